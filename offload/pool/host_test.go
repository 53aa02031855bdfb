package pool_test

import (
	"bytes"
	"errors"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

func TestHostRegisterFromCopiesThroughTheBackend(t *testing.T) {
	be := hostBackend(t)
	s := newSink(t)
	p, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: 4, BlockSize: testBlock, Sink: s})
	check(t, err)
	defer p.Close()
	dev, err := be.AllocDevice(6 * testBlock) // stands in for G1
	check(t, err)
	defer be.FreeDevice(dev)
	stream, err := be.NewStream()
	check(t, err)
	defer be.DestroyStream(stream)
	ev, err := be.NewEvent()
	check(t, err)
	defer be.DestroyEvent(ev)

	// The device buffer is not host-visible: fill it through a host staging copy.
	stage, err := be.AllocHost(6 * testBlock)
	check(t, err)
	defer be.FreeHost(stage)
	bs := chain(0, 0, 6)
	src := make([]backend.Ptr, len(bs))
	for i, b := range bs {
		copy(stage.Bytes()[i*testBlock:], pattern(testBlock, b.Hash))
		src[i] = dev.At(i * testBlock)
	}
	check(t, be.CopyAsync(stream, dev.Ptr(), stage.Ptr(), 6*testBlock))
	check(t, be.SynchronizeStream(stream))

	check(t, p.Register(bs[0], pattern(testBlock, bs[0].Hash)))
	s.take()
	// bs[0] is held (revived, skipped); bs[1..3] fit; bs[4] does not: the
	// chain's blocks are each other's parents, so none can be evicted.
	n, err := p.RegisterFrom(stream, ev, bs, src)
	if n != 3 || !errors.Is(err, pool.ErrFull) {
		t.Fatalf("RegisterFrom: %d stored, %v; want 3 and ErrFull", n, err)
	}
	if got := storedBlocks(s.take()); !slices.Equal(got, bs[1:4]) {
		t.Fatalf("STORE events for %v, want %v", got, bs[1:4])
	}
	for _, b := range bs[:4] {
		sl, err := p.Acquire(b.Hash)
		check(t, err)
		if !bytes.Equal(sl.Bytes, pattern(testBlock, b.Hash)) {
			t.Fatalf("slot %d of %#x holds other bytes", sl.Index, b.Hash)
		}
		if sl.Ptr != p.Region().At(sl.Index*testBlock) {
			t.Fatalf("slot %d address %#x, want region + %d", sl.Index, sl.Ptr, sl.Index*testBlock)
		}
		check(t, p.Release(b.Hash))
	}
}

func TestHostReservationIsInvisibleUntilCommitted(t *testing.T) {
	s := newSink(t)
	p := newHostPool(t, 2, s)
	r, err := p.Reserve(pool.Block{Hash: 1})
	check(t, err)
	if got := p.Lookup([]uint64{1}, nil); got[0] {
		t.Fatal("a reserved block is visible before Commit")
	}
	if _, err := p.Acquire(1); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("acquire a pending block: %v, want ErrNotFound", err)
	}
	// Busy, not held: the first reservation may still be aborted.
	if _, err := p.Reserve(pool.Block{Hash: 1}); !errors.Is(err, pool.ErrExists) || !errors.Is(err, pool.ErrBusy) {
		t.Fatalf("reserve a pending block again: %v, want ErrExists and ErrBusy", err)
	}
	if st := p.Stats(); st.Pending != 1 || st.Used != 1 {
		t.Fatalf("stats %+v", st)
	}
	copy(r.Bytes, pattern(testBlock, 1))
	check(t, p.Commit(r))
	check(t, p.Commit(r)) // a second commit is a no-op
	if got := storedBlocks(s.take()); len(got) != 1 {
		t.Fatalf("STORE events for %v, want one block", got)
	}
	if _, err := p.Reserve(pool.Block{Hash: 1}); !errors.Is(err, pool.ErrExists) || errors.Is(err, pool.ErrBusy) {
		t.Fatalf("reserve a held block again: %v, want ErrExists, not ErrBusy", err)
	}

	r2, err := p.Reserve(pool.Block{Hash: 2, Parent: 1})
	check(t, err)
	p.Abort(r2)
	if st := p.Stats(); st.Pending != 0 || st.Used != 1 || st.Registered != 1 {
		t.Fatalf("stats after abort %+v", st)
	}
	if evs := s.take(); len(evs) != 0 {
		t.Fatalf("abort published %v", evs)
	}
	// The parent of the abandoned child is evictable again.
	register(t, p, pool.Block{Hash: 3}, pool.Block{Hash: 4})
	if got := removed(s.take()); !slices.Equal(got, []uint64{1}) {
		t.Fatalf("evicted %v, want [1]", got)
	}
}

func TestHostPendingBlocksCountAgainstCapacity(t *testing.T) {
	p := newHostPool(t, 2, newSink(t))
	r1, err := p.Reserve(pool.Block{Hash: 1})
	check(t, err)
	r2, err := p.Reserve(pool.Block{Hash: 2})
	check(t, err)
	if _, err := p.Reserve(pool.Block{Hash: 3}); !errors.Is(err, pool.ErrFull) {
		t.Fatalf("reserve past two pending: %v, want ErrFull", err)
	}
	if r1.Index == r2.Index {
		t.Fatal("two reservations share a slot")
	}
	p.Abort(r1, r2)
}

// TestHostCloseRemovesItsBlocks: Close frees the pool's memory, so it
// publishes a REMOVE of every block it held (a pending one was never
// advertised): a subscriber (the agent, the router behind it) must not go
// on offering blocks whose bytes are gone. From a review: Close published
// nothing, and the router routed to the G2 blocks of a stopped kvagent
// until its worker's lease ran out (or for good, with --lease 0).
func TestHostCloseRemovesItsBlocks(t *testing.T) {
	s := newSink(t)
	p, err := pool.NewHost(hostBackend(t), pool.Config{Rank: rank, Capacity: 8, BlockSize: testBlock, Sink: s})
	check(t, err)
	bs := chain(0, 0, 3)
	register(t, p, bs...)
	register(t, p, pool.Block{Hash: 100})
	pending, err := p.Reserve(pool.Block{Hash: 200})
	check(t, err)
	s.take()
	check(t, p.Close())
	got := removed(s.take())
	slices.Sort(got)
	want := []uint64{bs[0].Hash, bs[1].Hash, bs[2].Hash, 100}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("Close removed %v, want every held block %v", got, want)
	}
	if err := p.Commit(pending); !errors.Is(err, pool.ErrClosed) {
		t.Fatalf("commit after Close: %v, want ErrClosed", err)
	}
	check(t, p.Close())
	if evs := s.take(); len(evs) != 0 {
		t.Fatalf("a second Close published %v", evs)
	}
}
