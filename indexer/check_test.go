package indexer

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestCheckStoreFindsWhatWouldMoveAResidency: rank 1 holds the chain
// 1..4 on the device. A store that names one of its hashes as another
// block (another content hash or parent), or one of its blocks under
// another hash, conflicts at that block; a consistent store, one that
// extends the chain, and one whose parent is not held but whose content
// hash agrees, do not.
func TestCheckStoreFindsWhatWouldMoveAResidency(t *testing.T) {
	ix := New(Config{})
	mustApply(t, ix, stored(rk1, kvevent.TierDevice, chain(1, 2, 3, 4)))
	mustApply(t, ix, stored(rk2, kvevent.TierDevice, chain(9)))
	b := func(eh, local uint64) kvevent.Block { return kvevent.Block{EngineHash: eh, LocalHash: local} }
	for _, tc := range []struct {
		name      string
		rank      kvevent.Rank
		hasParent bool
		parent    uint64
		blocks    []kvevent.Block
		want      int
	}{
		{"the same block", rk1, true, 3, []kvevent.Block{b(4, 104)}, -1},
		{"the same chain", rk1, false, 0, chain(1, 2), -1},
		{"a new block under it", rk1, true, 4, chain(5, 6), -1},
		{"a parent not held, the same content", rk1, true, 77, []kvevent.Block{b(4, 104), b(5, 105)}, -1},
		{"another rank's hash", rk2, true, 9, chain(4), -1},
		{"an unknown rank", rk3, false, 0, chain(1), -1},
		{"another content hash", rk1, true, 3, []kvevent.Block{b(4, 0)}, 0},
		{"another parent", rk1, true, 2, chain(4), 0},
		{"the first of a sequence", rk1, false, 0, chain(4), 0},
		{"the block under another hash", rk1, true, 3, []kvevent.Block{b(99, 104)}, 0},
		{"a chain past the tree back to a held hash", rk1, true, 4, []kvevent.Block{b(5, 105), b(1, 101)}, 1},
		{"a wrong second block", rk1, false, 0, []kvevent.Block{b(1, 101), b(2, 999)}, 1},
		{"a parent not held, another content", rk1, true, 77, []kvevent.Block{b(4, 0)}, 0},
	} {
		i, err := ix.CheckStore(tc.rank, tc.hasParent, tc.parent, tc.blocks)
		if i != tc.want || (i >= 0) != errors.Is(err, ErrConflict) {
			t.Errorf("%s: CheckStore = %d, %v; want %d", tc.name, i, err, tc.want)
		}
	}
	if !ix.Holds(rk1, 4) || ix.Holds(rk1, 9) || ix.Holds(rk3, 1) {
		t.Error("Holds does not say what the ranks hold")
	}
}

// TestCheckStoreTellsARenameApart: a store of a block rank 1 holds under
// another engine hash, one it does not hold, is ErrRenames (the node
// agent accepts such an offload request: extra_keys give one content
// another engine hash); a hash it holds as another block is an
// ErrConflict but no ErrRenames.
func TestCheckStoreTellsARenameApart(t *testing.T) {
	ix := New(Config{})
	mustApply(t, ix, stored(rk1, kvevent.TierDevice, chain(1, 2)))
	b := kvevent.Block{EngineHash: 51, LocalHash: 101}
	if _, err := ix.CheckStore(rk1, false, 0, []kvevent.Block{b}); !errors.Is(err, ErrRenames) || !errors.Is(err, ErrConflict) {
		t.Errorf("a store of block 1 as engine hash 51: %v; want ErrRenames, an ErrConflict", err)
	}
	b = kvevent.Block{EngineHash: 2, LocalHash: 999}
	if _, err := ix.CheckStore(rk1, true, 1, []kvevent.Block{b}); !errors.Is(err, ErrConflict) || errors.Is(err, ErrRenames) {
		t.Errorf("a store of engine hash 2 as another block: %v; want an ErrConflict, no ErrRenames", err)
	}
}

// TestCheckStoreNeverMissesARemap: over random stores and removes of a
// small hash space, a store CheckStore passes never moves a residency
// (Counters.Remapped stays), and a store whose parent is held that it
// refuses does. A store that lets held orphans in is left out: those are
// checked when they come, not when their parent does.
func TestCheckStoreNeverMissesARemap(t *testing.T) {
	rng := rand.New(rand.NewPCG(testseed.Seed(t), 2))
	ix := New(Config{})
	for range 5000 {
		hasParent := rng.IntN(3) > 0
		parent := 1 + rng.Uint64N(12)
		blocks := make([]kvevent.Block, 1+rng.IntN(3))
		for i := range blocks {
			blocks[i] = kvevent.Block{EngineHash: 1 + rng.Uint64N(12), LocalHash: 100 + rng.Uint64N(4)}
		}
		ev := &kvevent.Event{Rank: rk1, Kind: kvevent.KindStored, Tier: kvevent.Tier(rng.IntN(int(kvevent.NumTiers))),
			HasParent: hasParent, Parent: parent, Blocks: blocks}
		if rng.IntN(4) == 0 {
			ev = removed(rk1, ev.Tier, blocks[0].EngineHash)
		}
		if ev.Validate() != nil {
			continue
		}
		i := -1
		held := !hasParent || ix.Holds(rk1, parent)
		if ev.Kind == kvevent.KindStored {
			i, _ = ix.CheckStore(rk1, hasParent, parent, blocks)
		}
		before, adopted := ix.counters.Remapped, ix.counters.OrphansApplied
		mustApply(t, ix, ev)
		moved := ix.counters.Remapped != before
		if ix.counters.OrphansApplied != adopted {
			continue
		}
		if i < 0 && moved {
			t.Fatalf("CheckStore passed %+v, which moved a residency", *ev)
		}
		if i >= 0 && held && !moved {
			t.Fatalf("CheckStore refused block %d of %+v, which moved nothing", i, *ev)
		}
	}
}
