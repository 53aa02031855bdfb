package indexer

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestLoadRankJournalsTheDumpsOrders: LoadRank's residencies reach the
// journal with the dump's orders, as the index holds them (it journaled
// the fresh orders its adds took, then set the dump's in memory only: a
// node rebuilt from its database would then evict other entries first).
func TestLoadRankJournalsTheDumpsOrders(t *testing.T) {
	src := New(Config{})
	r := kvevent.Rank{Worker: 1}
	for i := uint64(1); i <= 3; i++ {
		ev := kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
			HasParent: i > 1, Parent: i - 1, Blocks: []kvevent.Block{{EngineHash: i, LocalHash: 100 + i}}}
		if err := src.Apply(&ev, 0); err != nil {
			t.Fatal(err)
		}
	}
	d, _ := src.DumpRank(r)

	ix := New(Config{})
	j := newCopyJournal()
	ix.SetJournal(j)
	// Some history first, so the rank's counter is not where the dump's is.
	for i := uint64(50); i < 60; i++ {
		ev := kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, Blocks: []kvevent.Block{{EngineHash: i, LocalHash: i}}}
		_ = ix.Apply(&ev, 0)
	}
	if err := ix.LoadRank(&d); err != nil {
		t.Fatal(err)
	}
	ix.FlushJournal()
	live, _ := ix.DumpRank(r)
	for _, e := range live.Entries {
		if je := j.entries[r][e.EngineHash]; je.Order != e.Order {
			t.Errorf("eh %d: index order %d, journal order %d", e.EngineHash, e.Order, je.Order)
		}
	}
}
