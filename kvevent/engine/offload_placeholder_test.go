package engine

import (
	"encoding/binary"
	"math/rand"
	"slices"
	"testing"
)

// TestRemoveDropsRepeatsAroundEveryThreshold: a remove's repeats are dropped, first copy kept in
// order, at every length around the 32 / maxSeenKept thresholds, with
// hashes spelled as ints and as 8- and 32-byte bins.
func TestRemoveDropsRepeatsAroundEveryThreshold(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	d := newTestDecoder(t, Config{Rank: rank})
	lengths := []int{2, 3, 31, 32, 33, 34, 64, maxSeenKept - 1, maxSeenKept, maxSeenKept + 1, maxSeenKept + 2, 2*maxSeenKept + 7}
	for _, n := range lengths {
		for trial := 0; trial < 6; trial++ {
			distinct := 1 + rng.Intn(n)
			pool := make([]uint64, distinct)
			for i := range pool {
				pool[i] = rng.Uint64() | 1<<63
			}
			hs := make([]uint64, n)
			for i := range hs {
				hs[i] = pool[rng.Intn(distinct)]
			}
			if trial == 0 { // repeat only straddling the end
				for i := range hs {
					hs[i] = uint64(i + 1000)
				}
				hs[n-1] = hs[0]
			}
			wire := make([]any, n)
			for i, h := range hs {
				switch rng.Intn(3) {
				case 0:
					wire[i] = u64(h)
				case 1:
					b := make([]byte, 8)
					binary.BigEndian.PutUint64(b, h)
					wire[i] = b
				default:
					b := make([]byte, 32)
					rng.Read(b[:24])
					binary.BigEndian.PutUint64(b[24:], h)
					wire[i] = b
				}
			}
			var want []uint64
			for _, h := range hs {
				if !slices.Contains(want, h) {
					want = append(want, h)
				}
			}
			got := decode(t, d, in(t, []any{"BlockRemoved", wire, "CPU"}))
			if len(got) != 1 || !slices.Equal(got[0].Removed, want) {
				t.Fatalf("n=%d trial %d: got %d events, want one remove of %d unique hashes in order", n, trial, len(got), len(want))
			}
		}
	}
}

// TestPlaceholderAfterRotationKeepsItsParent: a block offloaded to CPU and then to STORAGE sends two
// placeholders of one hash. When the first finds the block's entry in the
// old generation of the learned table, keep moves it to the new one; the
// parent must move with it, or the second placeholder lands at the root.
func TestPlaceholderAfterRotationKeepsItsParent(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16, MaxLearned: 4}) // two entries a generation
	const h1, h2, h3, h4 = uint64(0xa1), uint64(0xa2), uint64(0xa3), uint64(0xa4)
	gpu := func(a, b uint64, from int) any {
		return []any{"BlockStored", []any{u64(a), u64(b)}, nil, anys(tokens(from, 32)), 16, nil, "GPU"}
	}
	decode(t, d, in(t, gpu(h1, h2, 0)))
	decode(t, d, in(t, gpu(h3, h4, 100))) // h1, h2 rotate into the old generation
	for _, medium := range []string{"CPU", "DISK"} {
		got := decode(t, d, in(t, []any{"BlockStored", []any{u64(h2)}, nil, []any{}, 0, nil, medium}))
		if len(got) != 1 || !got[0].HasParent || got[0].Parent != h1 {
			t.Fatalf("placeholder of h2 on %s: got %+v, want one store under h1 (its device parent)", medium, got)
		}
	}
}
