package kvevent

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testseed"
)

func TestParseMediumTable(t *testing.T) {
	cases := map[string]Tier{
		"": TierDevice, "GPU": TierDevice, "gpu": TierDevice, "Device": TierDevice,
		"CPU": TierHostPinned, "cpu_pinned": TierHostPinned, "CPU_TIER1": TierHostPinned,
		"CPU_TIER2": TierDisk, "disk": TierDisk, "NVMe": TierDisk, "storage": TierDisk,
		"EXTERNAL": TierExternal, "network": TierExternal, "Remote": TierExternal, "shared": TierExternal,
	}
	for in, want := range cases {
		got, err := ParseMedium(in)
		if err != nil || got != want {
			t.Errorf("ParseMedium(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, bad := range []string{"TPU", "CPU_TIER3", " GPU", "hbm"} {
		if _, err := ParseMedium(bad); !errors.Is(err, ErrUnknownMedium) {
			t.Errorf("ParseMedium(%q) error = %v, want ErrUnknownMedium", bad, err)
		}
	}
}

func TestTierLabelsRoundTrip(t *testing.T) {
	for tr := Tier(0); tr < NumTiers; tr++ {
		got, err := ParseTier(tr.String())
		if err != nil || got != tr {
			t.Fatalf("ParseTier(%q) = %v, %v", tr.String(), got, err)
		}
	}
	if _, err := ParseTier("gpu"); !errors.Is(err, ErrUnknownTier) {
		t.Fatalf("ParseTier(gpu) error = %v, want ErrUnknownTier", err)
	}
}

func TestValidateRejectsMalformedEvents(t *testing.T) {
	chain := func(hs ...uint64) []Block {
		out := make([]Block, len(hs))
		for i, h := range hs {
			out[i] = Block{EngineHash: h, LocalHash: h * 7}
		}
		return out
	}
	long := make([]Block, 40)
	for i := range long {
		long[i] = Block{EngineHash: uint64(i + 1)}
	}
	long[39].EngineHash = 17
	chain40 := func() []Block { // 1..40, none repeated
		out := make([]Block, 40)
		for i := range out {
			out[i] = Block{EngineHash: uint64(i + 1)}
		}
		return out
	}
	cases := []struct {
		name string
		ev   Event
		ok   bool
	}{
		{"store ok", Event{Kind: KindStored, Blocks: chain(1, 2, 3)}, true},
		{"store with parent ok", Event{Kind: KindStored, HasParent: true, Parent: 9, Blocks: chain(1, 2)}, true},
		{"store empty", Event{Kind: KindStored}, false},
		{"first block is parent", Event{Kind: KindStored, HasParent: true, Parent: 1, Blocks: chain(1, 2)}, false},
		{"later block is parent", Event{Kind: KindStored, HasParent: true, Parent: 2, Blocks: chain(1, 2, 3)}, false},
		{"last block of a long chain is parent", Event{Kind: KindStored, HasParent: true, Parent: 40, Blocks: chain40()}, false},
		{"parent 0 is not a block of a chain without parent", Event{Kind: KindStored, Blocks: chain(0, 1)}, true},
		{"repeat in short chain", Event{Kind: KindStored, Blocks: chain(1, 2, 1)}, false},
		{"repeat in long chain", Event{Kind: KindStored, Blocks: long}, false},
		{"remove ok", Event{Kind: KindRemoved, Removed: []uint64{1}}, true},
		{"remove empty", Event{Kind: KindRemoved}, false},
		{"clear ok", Event{Kind: KindCleared}, true},
		{"bad tier", Event{Kind: KindCleared, Tier: 9}, false},
		{"bad kind", Event{Kind: 0}, false},
	}
	for _, c := range cases {
		err := c.ev.Validate()
		if c.ok && err != nil {
			t.Errorf("%s: unexpected error %v", c.name, err)
		}
		if !c.ok && !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: error %v, want ErrMalformed", c.name, err)
		}
		// Valid is Validate's answer without its error, allocating
		// nothing either way (the index's apply counts and skips a
		// malformed event on every replica).
		if got := c.ev.Valid(); got != c.ok {
			t.Errorf("%s: Valid() = %v, Validate() = %v", c.name, got, err)
		}
		if a := testing.AllocsPerRun(20, func() { _ = c.ev.Valid() }); a != 0 {
			t.Errorf("%s: %v allocations per Valid, want 0", c.name, a)
		}
	}
}

// TestValidateFindsRepeatsInLongChainsWithoutAllocating: a hash repeated
// in a chain, or the parent named as a block, is refused at every length,
// and checking a chain under a parent allocates nothing at any length
// (every replica validates every event it applies; a chain over 32 blocks
// made a map, and later one over 1024 blocks, a long prompt's prefill,
// still did). Past 32 blocks the check uses a pooled table, which -race's
// sync.Pool drops: those lengths' allocations are checked without it
// (make test's second pass).
func TestValidateFindsRepeatsInLongChainsWithoutAllocating(t *testing.T) {
	for _, n := range []int{2, 32, 33, 256, 1024, 1025, 2000, 8192} {
		ev := Event{Rank: Rank{Worker: 1}, EventID: 1, Kind: KindStored, Tier: TierDevice, HasParent: true, Parent: 1}
		for i := range n {
			ev.Blocks = append(ev.Blocks, Block{EngineHash: uint64(1000 + i), LocalHash: uint64(5000 + i)})
		}
		if err := ev.Validate(); err != nil {
			t.Fatalf("%d distinct blocks: %v", n, err)
		}
		if n <= 32 || !raceEnabled {
			if a := testing.AllocsPerRun(20, func() { _ = ev.Validate() }); a != 0 {
				t.Errorf("%d blocks: %v allocations per Validate, want 0", n, a)
			}
		}
		ev.Parent = ev.Blocks[n-1].EngineHash
		if err := ev.Validate(); err == nil {
			t.Errorf("%d blocks, the last the parent: no error", n)
		}
		ev.Parent = 1
		ev.Blocks[n-1].EngineHash = ev.Blocks[0].EngineHash
		if err := ev.Validate(); err == nil {
			t.Errorf("%d blocks with an engine hash twice: no error", n)
		}
	}
}

// TestParseMediumEngineSpellings pins every medium of semantics.md §2 as
// engines send it (upper case), each of which ParseMedium's allocation-free
// switch answers before its case-folding fallback: TestParseMediumTable
// gives most of them in mixed case, which only the fallback reads.
func TestParseMediumEngineSpellings(t *testing.T) {
	for in, want := range map[string]Tier{
		"GPU": TierDevice, "DEVICE": TierDevice,
		"CPU": TierHostPinned, "CPU_PINNED": TierHostPinned, "CPU_TIER1": TierHostPinned,
		"CPU_TIER2": TierDisk, "DISK": TierDisk, "NVME": TierDisk, "STORAGE": TierDisk,
		"EXTERNAL": TierExternal, "NETWORK": TierExternal, "REMOTE": TierExternal, "SHARED": TierExternal,
	} {
		if got, err := ParseMedium(in); err != nil || got != want {
			t.Errorf("ParseMedium(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
}

// TestFirstRepeatMatchesAMap: firstRepeat names the first value, in order,
// that repeats an earlier one, or none, as a map of the values seen says,
// for chains of every length around its two ways (pairwise to 32, a table
// past it), with the value 0 (the table's free mark) among them and values
// that differ only in high or only in low bits (testseed logs the seed).
func TestFirstRepeatMatchesAMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(testseed.Seed(t), 0))
	draw := []func() uint64{
		rng.Uint64,
		func() uint64 { return rng.Uint64N(64) },         // small: repeats, 0 among them
		func() uint64 { return rng.Uint64N(4096) << 52 }, // high bits only
		func() uint64 { return rng.Uint64N(1 << 20) },    // low bits only
	}
	for round := range 2000 {
		n := 1 + rng.IntN(3000)
		if round%4 == 0 {
			n = 30 + rng.IntN(6)
		}
		d := draw[round%len(draw)]
		vs := make([]uint64, n)
		for i := range vs {
			vs[i] = d()
		}
		var want uint64
		wantDup := false
		seen := make(map[uint64]bool, n)
		for _, v := range vs {
			if seen[v] {
				want, wantDup = v, true
				break
			}
			seen[v] = true
		}
		got, dup := firstRepeat(n, func(i int) uint64 { return vs[i] })
		if dup != wantDup || got != want {
			t.Fatalf("round %d, %d values: firstRepeat = %d, %v; want %d, %v", round, n, got, dup, want, wantDup)
		}
	}
}

// BenchmarkValidateChain: Validate of a stored chain under a parent, every
// replica's check of every event it applies (a long prompt's prefill stores
// thousands of blocks in one event; past 32 blocks the repeated-hash check
// goes through a pooled table), against its baseline in the same run: the
// repeated-hash check through a map of the chain (what chains over 32
// blocks once went through, and those over 1024 until 2026-12-06), whose
// time over Validate's it reports as map_over_table.
func BenchmarkValidateChain(b *testing.B) {
	for _, n := range []int{16, 256, 2000, 8192} {
		ev := Event{Rank: Rank{Worker: 1}, EventID: 1, Kind: KindStored, Tier: TierDevice, HasParent: true, Parent: 1}
		for i := range n {
			ev.Blocks = append(ev.Blocks, Block{EngineHash: uint64(i)*0x9e3779b97f4a7c15 + 2, LocalHash: uint64(i)})
		}
		mapRepeat := func() bool {
			seen := make(map[uint64]struct{}, n)
			for i := range ev.Blocks {
				h := ev.Blocks[i].EngineHash
				if _, ok := seen[h]; ok {
					return true
				}
				seen[h] = struct{}{}
			}
			return false
		}
		var mapNs float64
		b.Run(fmt.Sprintf("blocks=%d/baseline=map", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if mapRepeat() {
					b.Fatal("a repeat in a chain of distinct hashes")
				}
			}
			mapNs = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
		})
		b.Run(fmt.Sprintf("blocks=%d", n), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := ev.Validate(); err != nil {
					b.Fatal(err)
				}
			}
			if ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N); ns > 0 && mapNs > 0 {
				b.ReportMetric(mapNs/ns, "map_over_table")
			}
		})
	}
}
