package manager

import (
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/offload/pool"
)

func newFilter(t *testing.T, c FilterConfig) *sightings {
	t.Helper()
	if err := c.check(); err != nil {
		t.Fatal(err)
	}
	return newSightings(c)
}

func TestFilterPassesABlockOnlyOnceSeenThreshold(t *testing.T) {
	f := newFilter(t, FilterConfig{Threshold: 3, HalfLife: 1000})
	b := pool.Block{Hash: 7, Parent: 6, Local: 70}
	for i, want := range []bool{false, false, true, true} {
		if got := f.hot(f.see(7, &b, 2)); got != want {
			t.Fatalf("sighting %d: hot = %v, want %v", i+1, got, want)
		}
	}
	if got, prio, ok := f.block(7); !ok || got != b || prio != 2 {
		t.Fatalf("block(7) = %+v, %d, %v; want %+v, 2, true", got, prio, ok, b)
	}
	f.see(8, nil, 0)
	if _, _, ok := f.block(8); ok {
		t.Fatal("a hash only seen by Onboard has metadata")
	}
}

func TestFilterDefaultsToTwoSightingsAndAlwaysPassesEverything(t *testing.T) {
	f := newFilter(t, FilterConfig{})
	if f.hot(f.see(1, nil, 0)) || !f.hot(f.see(1, nil, 0)) {
		t.Fatal("default filter: want cold after one sighting, hot after two")
	}
	for _, c := range []FilterConfig{{Always: true}, {Threshold: 1}} {
		if f := newFilter(t, c); !f.hot(f.see(1, nil, 0)) {
			t.Fatalf("filter %+v: a block seen once is cold, want hot", c)
		}
	}
	if err := (&FilterConfig{Threshold: -1}).check(); err == nil {
		t.Fatal("negative threshold accepted")
	}
}

func TestFilterCountsHalveEveryHalfLifeAndOnesAreForgotten(t *testing.T) {
	f := newFilter(t, FilterConfig{HalfLife: 10})
	for range 4 {
		f.see(1, nil, 0) // count 4
	}
	f.see(2, nil, 0) // count 1
	if f.count(1) != 4 || f.count(2) != 1 {
		t.Fatalf("counts before decay: %d, %d; want 4, 1", f.count(1), f.count(2))
	}
	for h := uint64(100); h < 105; h++ { // the 10th sighting halves
		f.see(h, nil, 0)
	}
	if f.count(1) != 2 {
		t.Fatalf("count after one half-life: %d, want 2", f.count(1))
	}
	if f.count(2) != 0 || f.len() != 1 {
		t.Fatalf("after a half-life: count of a block seen once = %d, tracked = %d; want 0 and 1", f.count(2), f.len())
	}
	// A block seen once before the halving and once after is not hot: the
	// decay is what keeps one-off blocks off the disk.
	f.see(3, nil, 0)
	for h := uint64(200); h < 209; h++ {
		f.see(h, nil, 0)
	}
	if n := f.see(3, nil, 0); f.hot(n) {
		t.Fatalf("a block seen once per half-life became hot (count %d)", n)
	}
}

func TestFilterMemoryStaysBounded(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	const halfLife = 64
	f := newFilter(t, FilterConfig{HalfLife: halfLife})
	for i := range 20000 {
		var h uint64
		if rng.IntN(2) == 0 {
			h = uint64(rng.IntN(8)) + 1 // a few hot blocks
		} else {
			h = uint64(i) + 1000 // a stream of one-offs
		}
		f.see(h, nil, 0)
		if f.len() > 2*halfLife {
			t.Fatalf("after %d sightings the filter tracks %d hashes, bound %d", i+1, f.len(), 2*halfLife)
		}
	}
	hot := 0
	for h := uint64(1); h <= 8; h++ {
		if f.hot(f.count(h)) {
			hot++
		}
	}
	if hot < 7 {
		t.Fatalf("only %d of 8 frequently seen blocks are hot", hot)
	}
}
