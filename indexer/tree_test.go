package indexer

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestFreedNodesAreReused: the nodes a removal frees go back to the
// tree's pool and the next stores take them, before any new slab; the
// index then equals one that only ever saw those stores, with a second
// holder on a reused node too.
func TestFreedNodesAreReused(t *testing.T) {
	cfg := Config{}
	ix := New(cfg)
	mustApply(t, ix, stored(rk1, kvevent.TierDevice, chain(1, 2, 3, 4)))
	slab := len(ix.pool.slab)
	mustApply(t, ix, removed(rk1, kvevent.TierDevice, 1, 2, 3, 4))
	if freeNodes(&ix.pool) != 4 || ix.Stats().Nodes != 0 {
		t.Fatalf("after the removal: %d free nodes, %d in the tree; want 4 and 0", freeNodes(&ix.pool), ix.Stats().Nodes)
	}
	mustApply(t, ix,
		stored(rk2, kvevent.TierDevice, chain(11, 12, 13)),
		stored(rk3, kvevent.TierHostPinned, chain(11, 12)))
	if freeNodes(&ix.pool) != 1 || len(ix.pool.slab) != slab {
		t.Fatalf("after new stores: %d free nodes and %d nodes carved, want 1 and %d", freeNodes(&ix.pool), len(ix.pool.slab), slab)
	}
	fresh := New(cfg)
	mustApply(t, fresh,
		stored(rk1, kvevent.TierDevice, chain(1)),
		removed(rk1, kvevent.TierDevice, 1),
		stored(rk2, kvevent.TierDevice, chain(11, 12, 13)),
		stored(rk3, kvevent.TierHostPinned, chain(11, 12)))
	got, want := ix.Stats(), fresh.Stats()
	got.Counters, want.Counters = Counters{}, Counters{} // what each saw differs
	if ix.Digest() != fresh.Digest() || got != want {
		t.Fatalf("index with reused nodes: %+v digest %#x; fresh: %+v digest %#x", got, ix.Digest(), want, fresh.Digest())
	}
	checkInvariants(t, ix)
}

// freeNodes counts the pool's free list.
func freeNodes(p *nodePool) (n int) {
	for f := p.free; f != nil; f = f.c1 {
		n++
	}
	return n
}

// TestLoadKeepsNodesItStillApplies: a copy in which a rank gives one
// engine hash on two nodes (loaded the write path's way: the second
// remaps it) and a later rank holds the first node. The remap must not
// free that node while the later rank's entry is still to come (it was
// freed, handed out again for the next new node, and a removal then
// indexed its emptied holders at -1). The load equals the same residencies
// stored through the write path.
func TestLoadKeepsNodesItStillApplies(t *testing.T) {
	rA, rB, rC := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}, kvevent.Rank{Worker: 3}
	ix := New(Config{})
	nodes := map[uint64]DumpNode{
		101: {Seq: 101, Root: true, Local: 101},
		102: {Seq: 102, Root: true, Local: 102},
	}
	ranks := []RankDump{
		{Rank: rA, Entries: []DumpEntry{{EngineHash: 5, Seq: 101, Mask: 1, Order: 1}, {EngineHash: 5, Seq: 102, Mask: 1, Order: 2}}},
		{Rank: rB, Entries: []DumpEntry{{EngineHash: 7, Seq: 101, Mask: 1, Order: 1}}},
	}
	if err := ix.LoadState(nodes, ranks); err != nil {
		t.Fatal(err)
	}
	checkInvariants(t, ix)
	ref := New(Config{})
	mustApply(t, ref,
		stored(rA, kvevent.TierDevice, []kvevent.Block{{EngineHash: 5, LocalHash: 101}}),
		stored(rA, kvevent.TierDevice, []kvevent.Block{{EngineHash: 5, LocalHash: 102}}),
		stored(rB, kvevent.TierDevice, []kvevent.Block{{EngineHash: 7, LocalHash: 101}}))
	if ix.Digest() != ref.Digest() || ix.Stats().Nodes != ref.Stats().Nodes || ix.Stats().Entries != ref.Stats().Entries {
		t.Fatalf("loaded %+v digest %#x; through the write path %+v digest %#x", ix.Stats(), ix.Digest(), ref.Stats(), ref.Digest())
	}
	for _, x := range []*Index{ix, ref} {
		mustApply(t, x,
			stored(rC, kvevent.TierDevice, []kvevent.Block{{EngineHash: 9, LocalHash: 199}}),
			removed(rB, kvevent.TierDevice, 7))
		checkInvariants(t, x)
	}
	if ix.Digest() != ref.Digest() {
		t.Fatalf("after a store and a removal: %+v digest %#x; write path %+v digest %#x", ix.Stats(), ix.Digest(), ref.Stats(), ref.Digest())
	}
}

// TestTreeSlabAdviceGoesWithTheTree: a tree grown past a few MiB of
// nodes has its large slabs advised for huge pages, recorded in its
// index; a tree moved into another index (Take) takes the records along,
// and a tree replaced drops them, withdrawing the advice.
func TestTreeSlabAdviceGoesWithTheTree(t *testing.T) {
	const n, per = 200_000, 1000 // two slabs of 64Ki nodes and more
	grow := func(ix *Index) {
		for s := uint64(1); s <= n; s += per {
			bs := make([]kvevent.Block, per)
			for i := range bs {
				bs[i] = kvevent.Block{EngineHash: s + uint64(i), LocalHash: 1<<40 + s + uint64(i)}
			}
			ev := stored(rk1, kvevent.TierDevice, bs)
			if s > 1 {
				ev = storedUnder(rk1, kvevent.TierDevice, s-1, bs)
			}
			mustApply(t, ix, ev)
		}
	}
	base := hugepage.Held()
	a := New(Config{})
	grow(a)
	if hugepage.Held() == base {
		t.Fatalf("a tree of %d nodes advised no slab", a.Stats().Nodes)
	}
	held := hugepage.Held()
	b := New(Config{})
	b.Take(a)
	if hugepage.Held() != held || b.Stats().Nodes != n {
		t.Fatalf("after Take: %d bytes advised (was %d), %d nodes", hugepage.Held(), held, b.Stats().Nodes)
	}
	grow(a) // a's new tree records slabs of its own
	mine := hugepage.Held() - held
	if mine == 0 {
		t.Fatal("a's second tree advised no slab")
	}
	b.Take(New(Config{}))
	if b.Stats().Nodes != 0 || hugepage.Held() != base+mine {
		t.Fatalf("after b's tree was replaced: %d nodes, %d bytes advised, want %d (a's)", b.Stats().Nodes, hugepage.Held()-base, mine)
	}
	a.Take(New(Config{}))
	if hugepage.Held() != base {
		t.Fatalf("%d bytes still advised with both trees replaced (%d before)", hugepage.Held(), base)
	}
}
