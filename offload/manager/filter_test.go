package manager

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/offload/pool"
)

func newFilter(t *testing.T, c FilterConfig) *Sightings[promotion] {
	t.Helper()
	f, err := NewSightings[promotion](c)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestFilterPassesABlockOnlyOnceSeenThreshold(t *testing.T) {
	f := newFilter(t, FilterConfig{Threshold: 3, HalfLife: 1000})
	b := pool.Block{Hash: 7, Parent: 6, Local: 70}
	for i, want := range []bool{false, false, true, true} {
		if got := f.Hot(f.See(7, &promotion{b, 2})); got != want {
			t.Fatalf("sighting %d: hot = %v, want %v", i+1, got, want)
		}
	}
	if got, ok := f.Meta(7); !ok || got.block != b || got.prio != 2 {
		t.Fatalf("Meta(7) = %+v, %v; want %+v, 2, true", got, ok, b)
	}
	f.See(8, nil)
	if _, ok := f.Meta(8); ok {
		t.Fatal("a hash only seen by Onboard has metadata")
	}
}

func TestFilterDefaultsToTwoSightingsAndAlwaysPassesEverything(t *testing.T) {
	f := newFilter(t, FilterConfig{})
	if f.Hot(f.See(1, nil)) || !f.Hot(f.See(1, nil)) {
		t.Fatal("default filter: want cold after one sighting, hot after two")
	}
	for _, c := range []FilterConfig{{Always: true}, {Threshold: 1}} {
		if f := newFilter(t, c); !f.Hot(f.See(1, nil)) {
			t.Fatalf("filter %+v: a block seen once is cold, want hot", c)
		}
	}
	if err := (&FilterConfig{Threshold: -1}).check(); err == nil {
		t.Fatal("negative threshold accepted")
	}
}

// A count is a uint32: a threshold past its range must be refused, not
// wrapped (1<<32 would become 0, every block hot on its first sighting).
func TestFilterRefusesThresholdPastTheCountRange(t *testing.T) {
	if _, err := NewSightings[promotion](FilterConfig{Threshold: math.MaxUint32}); err != nil {
		t.Fatalf("threshold MaxUint32: %v, want accepted", err)
	}
	for _, th := range []int{math.MaxUint32 + 1, 1<<32 + 2, math.MaxInt} {
		err := FilterConfig{Threshold: th}.Check()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "filter threshold") {
			t.Errorf("threshold %d: Check %v, want ErrInvalid naming the filter threshold", th, err)
		}
		if f, err := NewSightings[promotion](FilterConfig{Threshold: th}); err == nil {
			t.Errorf("threshold %d accepted; a block seen once is hot: %v", th, f.Hot(f.See(1, nil)))
		}
	}
}

func TestFilterCountsHalveEveryHalfLifeAndOnesAreForgotten(t *testing.T) {
	f := newFilter(t, FilterConfig{HalfLife: 10})
	for range 4 {
		f.See(1, nil) // count 4
	}
	f.See(2, nil) // count 1
	if f.Count(1) != 4 || f.Count(2) != 1 {
		t.Fatalf("counts before decay: %d, %d; want 4, 1", f.Count(1), f.Count(2))
	}
	for h := uint64(100); h < 105; h++ { // the 10th sighting halves
		f.See(h, nil)
	}
	if f.Count(1) != 2 {
		t.Fatalf("count after one half-life: %d, want 2", f.Count(1))
	}
	if f.Count(2) != 0 || f.Len() != 1 {
		t.Fatalf("after a half-life: count of a block seen once = %d, tracked = %d; want 0 and 1", f.Count(2), f.Len())
	}
	// A block seen once before the halving and once after is not hot: the
	// decay is what keeps one-off blocks off the disk.
	f.See(3, nil)
	for h := uint64(200); h < 209; h++ {
		f.See(h, nil)
	}
	if n := f.See(3, nil); f.Hot(n) {
		t.Fatalf("a block seen once per half-life became hot (count %d)", n)
	}
}

func TestFilterMemoryStaysBounded(t *testing.T) {
	seed := testseed.Seed(t)
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
		f.See(h, nil)
		if f.Len() > 2*halfLife {
			t.Fatalf("after %d sightings the filter tracks %d hashes, bound %d", i+1, f.Len(), 2*halfLife)
		}
	}
	hot := 0
	for h := uint64(1); h <= 8; h++ {
		if f.Hot(f.Count(h)) {
			hot++
		}
	}
	if hot < 7 {
		t.Fatalf("only %d of 8 frequently seen blocks are hot", hot)
	}
}
