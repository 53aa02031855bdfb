package indexer

import (
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
