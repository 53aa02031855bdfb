package indexer

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// BenchmarkFindMatchesByTier measures one route's lookup: a prompt of 128
// blocks against 64 ranks that each hold a prefix of it (rank r the first
// 2r blocks, in the tier r mod 4), in the tiered view.
func BenchmarkFindMatchesByTier(b *testing.B) {
	const blocks, ranks = 128, 64
	hs := firstHashes(blocks)
	ix := New(Config{})
	for r := range ranks {
		n := min(blocks, 2*(r+1))
		bl := make([]kvevent.Block, n)
		for i := range bl {
			bl[i] = kvevent.Block{EngineHash: hs[i], LocalHash: 100 + hs[i]}
		}
		ev := stored(kvevent.Rank{Worker: uint64(r)}, kvevent.Tier(r%4), bl)
		if err := ix.Apply(ev, 0); err != nil {
			b.Fatal(err)
		}
	}
	q := locals(hs...)
	var m Matches
	b.ReportAllocs()
	for b.Loop() {
		ix.FindMatchesByTier(q, ViewTiered, false, &m)
	}
	if len(m.Ranks) != ranks {
		b.Fatalf("matched %d ranks, want %d", len(m.Ranks), ranks)
	}
}
