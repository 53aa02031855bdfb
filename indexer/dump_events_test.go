package indexer

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestStoredEventsRebuildMatches: replaying a rank's StoredEvents into an
// empty index gives the same matches, in both views, for every prefix the
// rank holds; unreachable blocks (parent removed) are left out.
func TestStoredEventsRebuildMatches(t *testing.T) {
	src := New(Config{})
	mustApply(t, src,
		stored(rk1, kvevent.TierDevice, chain(1, 2, 3, 4)),
		storedUnder(rk1, kvevent.TierHostPinned, 2, chain(5, 6)),
		stored(rk1, kvevent.TierHostPinned, chain(1, 2)),
		stored(rk1, kvevent.TierDisk, chain(7, 8)),
		removed(rk1, kvevent.TierDisk, 7), // 8 is now unreachable
		stored(rk2, kvevent.TierDevice, chain(1, 9)),
	)
	d, err := src.DumpRank(rk1)
	if err != nil {
		t.Fatal(err)
	}
	evs := d.StoredEvents()
	dst := New(Config{})
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if len(evs[i].Blocks) != 1 || evs[i].Rank != rk1 || evs[i].EventID != uint64(i+1) {
			t.Fatalf("event %d = %+v, want one block of %v with id %d", i, evs[i], rk1, i+1)
		}
		if err := dst.Apply(&evs[i], 0); err != nil {
			t.Fatalf("apply %d: %v", i, err)
		}
	}
	// 1,2 in device+host, 3,4 device, 5,6 host: 8 events; 8 (its parent
	// removed) is left out.
	if len(evs) != 8 {
		t.Fatalf("%d events, want 8: %+v", len(evs), evs)
	}
	for _, q := range [][]uint64{locals(1, 2, 3, 4), locals(1, 2, 5, 6), locals(7, 8), locals(1, 9)} {
		for _, v := range []View{ViewDedup, ViewTiered} {
			var want, got Matches
			src.FindMatchesByTier(q, v, false, &want)
			dst.FindMatchesByTier(q, v, false, &got)
			var w RankMatch
			for _, m := range want.Ranks {
				if m.Rank == rk1 {
					w = m
				}
			}
			var g RankMatch
			for _, m := range got.Ranks {
				g = m
			}
			if w.Blocks != g.Blocks {
				t.Errorf("query %v view %v: rebuilt %v, source %v", q, v, g.Blocks, w.Blocks)
			}
		}
	}
}
