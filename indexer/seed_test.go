package indexer

import (
	"reflect"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// Block maps draw their hash seeds at random (blockMap.hash), so their
// iteration order differs between replicas and across restarts. These
// tests check that nothing an index decides depends on it.

// sameState fails unless a and b hold the same replicated state: digest,
// counts and every rank's dump (sorted, with entry ages).
func sameState(t interface{ Fatalf(string, ...any) }, a, b *Index, ranks []kvevent.Rank) {
	if a.Digest() != b.Digest() {
		t.Fatalf("digests %#x and %#x", a.Digest(), b.Digest())
	}
	if sa, sb := a.Stats(), b.Stats(); !reflect.DeepEqual(sa, sb) {
		t.Fatalf("stats differ:\n%+v\n%+v", sa, sb)
	}
	for _, r := range ranks {
		da, ea := a.DumpRank(r)
		db, eb := b.DumpRank(r)
		if (ea == nil) != (eb == nil) || !reflect.DeepEqual(da, db) {
			t.Fatalf("rank %v: dumps differ:\n%+v (%v)\n%+v (%v)", r, da, ea, db, eb)
		}
	}
}

// TestStateIgnoresBlockSeeds applies one random history, with capacity
// trims, worker removals and malformed events, to two indexes whose block
// maps have different seeds.
func TestStateIgnoresBlockSeeds(t *testing.T) {
	var ranks []kvevent.Rank
	for _, w := range propWorkers {
		ranks = append(ranks, kvevent.Rank{Worker: w, DP: 0}, kvevent.Rank{Worker: w, DP: 1})
	}
	rapid.Check(t, func(rt *rapid.T) {
		seeds := [2]uint64{rapid.Uint64().Draw(rt, "seedA"), rapid.Uint64().Draw(rt, "seedB")}
		ixs := [2]*Index{New(propCfg), New(propCfg)}
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 80).Draw(rt, "steps") {
			now += int64(s.dt)
			for i, ix := range ixs {
				restore := setBlockSeed(seeds[i])
				_ = s.apply(ix, now) // malformed events are part of the history
				restore()
			}
		}
		sameState(rt, ixs[0], ixs[1], ranks)
	})
}

// TestTrimWithRepeatedOrdersIgnoresBlockSeeds: a loaded dump may give two
// entries one age (a hand-made one, or a store counter that wrapped past
// a live entry). X and Y, of one age, both extend Q, older: Y as its
// child, X three steps below. Which of the two handed its age to Q first
// used to decide Q's steps (1 or 3) and so whether a trim took Q or P2,
// and that order is the block map's, different on every replica.
func TestTrimWithRepeatedOrdersIgnoresBlockSeeds(t *testing.T) {
	src := New(Config{})
	// Engine hashes: Q 1, P1 2, P2 3, X 4; Y 5 under Q.
	mustApply(t, src, stored(rk1, dev, chain(1, 2, 3, 4)), storedUnder(rk1, dev, 1, chain(5)))
	d, err := src.DumpRank(rk1)
	if err != nil {
		t.Fatal(err)
	}
	for i := range d.Entries {
		if e := &d.Entries[i]; e.EngineHash == 5 {
			e.Order = d.Entries[3].Order // X's (entries are sorted by engine hash)
		}
	}
	var first *Index
	for seed := uint64(1); seed <= 32; seed++ {
		restore := setBlockSeed(seed * 0x9e3779b97f4a7c15)
		ix := New(Config{})
		dd := d
		if err := ix.LoadRank(&dd); err != nil {
			t.Fatal(err)
		}
		ix.SetCapacity(rk1, [kvevent.NumTiers]int64{2, 0, 0, 0})
		restore()
		checkInvariants(t, ix)
		if first == nil {
			first = ix
			// X and Y go (one age, no steps), then Q (one step from Y)
			// before P2 (one from X) by engine hash.
			got, _ := ix.DumpRank(rk1)
			var held []uint64
			for _, e := range got.Entries {
				held = append(held, e.EngineHash)
			}
			if !reflect.DeepEqual(held, []uint64{2, 3}) {
				t.Fatalf("after the trim the rank holds %v, want P1 and P2 (2, 3)", held)
			}
			continue
		}
		sameState(t, first, ix, []kvevent.Rank{rk1})
	}
}
