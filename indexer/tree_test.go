package indexer

import (
	"testing"

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
	if ix.pool.nfree != 4 || ix.Stats().Nodes != 0 {
		t.Fatalf("after the removal: %d free nodes, %d in the tree; want 4 and 0", ix.pool.nfree, ix.Stats().Nodes)
	}
	mustApply(t, ix,
		stored(rk2, kvevent.TierDevice, chain(11, 12, 13)),
		stored(rk3, kvevent.TierHostPinned, chain(11, 12)))
	if ix.pool.nfree != 1 || len(ix.pool.slab) != slab {
		t.Fatalf("after new stores: %d free nodes and %d nodes carved, want 1 and %d", ix.pool.nfree, len(ix.pool.slab), slab)
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
