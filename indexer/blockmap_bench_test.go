package indexer

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkBlockMapInsert: n random engine hashes inserted into an empty
// map (growing), per op; blockMap against a Go map.
func BenchmarkBlockMapInsert(b *testing.B) {
	const n = 250_000
	rng := rand.New(rand.NewPCG(1, 2))
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	nd := &node{}
	b.Run("blockmap", func(b *testing.B) {
		for b.Loop() {
			var m blockMap
			for _, k := range keys {
				if s, old := m.lookup(k, nil); old == nil {
					m.setAt(s, k, nd)
				}
			}
		}
	})
	b.Run("gomap", func(b *testing.B) {
		for b.Loop() {
			m := map[uint64]*node{}
			for _, k := range keys {
				if _, ok := m[k]; !ok {
					m[k] = nd
				}
			}
		}
	})
}
