package indexer

import (
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestMemoryEstimate: Stats.MemoryBytes is within a third of what the heap
// grew by while an index was built, for prompts shared by every rank and
// for prompts each rank holds alone.
func TestMemoryEstimate(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory skews the heap")
	}
	for _, tc := range []struct {
		name   string
		shared bool
	}{{"shared prompts", true}, {"own prompts", false}} {
		t.Run(tc.name, func(t *testing.T) {
			const ranks, prompts, blocks = 4, 400, 64
			before := liveHeap()
			ix := New(Config{})
			for r := range uint64(ranks) {
				rank := kvevent.Rank{Worker: r + 1}
				for p := range uint64(prompts) {
					base := p << 20
					if !tc.shared {
						base |= r << 40
					}
					hs := make([]uint64, blocks)
					for i := range hs {
						hs[i] = base + uint64(i) + 1
					}
					ev := kvevent.Event{Rank: rank, EventID: p + 1, Kind: kvevent.KindStored, Blocks: chain(hs...)}
					if err := ix.Apply(&ev, 0); err != nil {
						t.Fatal(err)
					}
				}
			}
			grew := float64(liveHeap() - before)
			est := float64(ix.Stats().MemoryBytes)
			runtime.KeepAlive(ix)
			t.Logf("%d entries on %d nodes: estimate %.0f bytes, heap grew %.0f (ratio %.2f)", ix.Stats().Entries, ix.Stats().Nodes, est, grew, est/grew)
			if est < grew*2/3 || est > grew*4/3 {
				t.Fatalf("estimate %.0f bytes, heap grew %.0f", est, grew)
			}
		})
	}
}

// liveHeap returns the heap's live bytes after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestMemoryEstimateAsATableSlabOpens: Stats.MemoryBytes stays within a
// third of what the heap grew by at the moment segTables opens its largest
// slab (maxSegSlab tables, 8 MiB, of which the first few are in use): the
// tables a slab holds beyond those handed out are memory the index holds,
// as the tables kept for reuse are, and before segTables the estimate
// counted every table the maps had (TestMemoryEstimate's bound). Prompts
// shared by eight ranks, so that the maps' tables are most of the index.
func TestMemoryEstimateAsATableSlabOpens(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory skews the heap")
	}
	seed := rand.Uint64()
	t.Logf("block seed %#x", seed)
	defer setBlockSeed(seed)()
	const ranks, blocks = 8, 64
	before := liveHeap()
	ix := New(Config{})
	opened := false
	for p := uint64(0); p < 4000 && !opened; p++ {
		hs := make([]uint64, blocks)
		for i := range hs {
			hs[i] = p<<20 + uint64(i) + 1
		}
		for r := range uint64(ranks) {
			ev := kvevent.Event{Rank: kvevent.Rank{Worker: r + 1}, EventID: p + 1, Kind: kvevent.KindStored, Blocks: chain(hs...)}
			if err := ix.Apply(&ev, 0); err != nil {
				t.Fatal(err)
			}
			if cap(ix.tables.slab) == maxSegSlab {
				opened = true
				break
			}
		}
	}
	if !opened {
		t.Fatalf("no slab of %d tables opened", maxSegSlab)
	}
	grew := float64(liveHeap() - before)
	st := ix.Stats()
	est := float64(st.MemoryBytes)
	runtime.KeepAlive(ix)
	t.Logf("%d entries on %d nodes, slab %d of %d tables handed out, %d kept: estimate %.0f bytes, heap grew %.0f (ratio %.2f)",
		st.Entries, st.Nodes, len(ix.tables.slab), cap(ix.tables.slab), len(ix.tables.free), est, grew, est/grew)
	if est < grew*2/3 || est > grew*4/3 {
		t.Fatalf("estimate %.0f bytes, heap grew %.0f", est, grew)
	}
}
