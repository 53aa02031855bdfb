package pool_test

import (
	"bytes"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// forEachPool runs f against the host and the disk pool.
func forEachPool(t *testing.T, f func(t *testing.T, pc poolCase)) {
	for _, pc := range poolCases() {
		t.Run(pc.name, func(t *testing.T) { f(t, pc) })
	}
}

func TestFullPoolEvictsLeastRecentlyUsed(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 3, s)
		a, b, c, d := pool.Block{Hash: 1}, pool.Block{Hash: 2}, pool.Block{Hash: 3}, pool.Block{Hash: 4}
		register(t, p, a, b, c)
		// Use a: b is now the least recently used.
		check(t, pc.acquire(p, 1))
		check(t, p.Release(1))
		s.take()
		register(t, p, d)

		if got := removed(s.take()); !slices.Equal(got, []uint64{2}) {
			t.Fatalf("evicted %v, want [2] (least recently used)", got)
		}
		if got := present(p, 1, 2, 3, 4); !slices.Equal(got, []uint64{1, 3, 4}) {
			t.Fatalf("present %v, want [1 3 4]", got)
		}
		if st := p.Stats(); st.Evictions != 1 || st.Used != 3 {
			t.Fatalf("stats %+v, want 1 eviction, 3 used", st)
		}
	})
}

func TestEvictionTakesLeavesBeforeParents(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 4, s)
		// 1 <- 2 <- 3 registered oldest first, then an unrelated 10.
		register(t, p, chain(0, 0, 3)...)
		register(t, p, pool.Block{Hash: 10})
		s.take()
		// Three more: the chain's leaf goes first although its parents are
		// older, then its parent, then the root.
		register(t, p, pool.Block{Hash: 11}, pool.Block{Hash: 12}, pool.Block{Hash: 13})
		if got := removed(s.take()); !slices.Equal(got, []uint64{3, 2, 1}) {
			t.Fatalf("evicted %v, want [3 2 1]: leaves before parents", got)
		}
	})
}

func TestParentWithHeldChildIsNotEvicted(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 3, s)
		register(t, p, chain(0, 0, 2)...) // 1 <- 2
		register(t, p, pool.Block{Hash: 10})
		check(t, pc.acquire(p, 2)) // the child is pinned: neither 2 nor its parent 1 may go
		s.take()
		register(t, p, pool.Block{Hash: 11})
		if got := removed(s.take()); !slices.Equal(got, []uint64{10}) {
			t.Fatalf("evicted %v, want [10]: 1 is the parent of a held block", got)
		}
	})
}

func TestAcquiredBlockIsNotEvicted(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 2, s)
		register(t, p, pool.Block{Hash: 1}, pool.Block{Hash: 2})
		check(t, pc.acquire(p, 1))
		check(t, pc.acquire(p, 1)) // two references
		register(t, p, pool.Block{Hash: 3})
		check(t, p.Release(1))
		// Still one reference left: 3 is the only candidate for 4.
		register(t, p, pool.Block{Hash: 4})
		if got := present(p, 1, 2, 3, 4); !slices.Equal(got, []uint64{1, 4}) {
			t.Fatalf("present %v, want [1 4]", got)
		}
		check(t, p.Release(1))
		if err := p.Release(1); !errors.Is(err, pool.ErrNotHeld) {
			t.Fatalf("third release: %v, want ErrNotHeld", err)
		}
		register(t, p, pool.Block{Hash: 5})
		if got := present(p, 1, 4, 5); !slices.Equal(got, []uint64{4, 5}) {
			t.Fatalf("present %v after releasing 1, want [4 5]", got)
		}
	})
}

func TestReRegisteringInactiveBlockRevivesItWithoutCopy(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 2, s)
		register(t, p, pool.Block{Hash: 1}, pool.Block{Hash: 2})
		s.take()
		// Same hash, other bytes: no copy is made, and 1 is now the most
		// recently used.
		if err := p.Register(pool.Block{Hash: 1}, pattern(testBlock, 99)); !errors.Is(err, pool.ErrExists) {
			t.Fatalf("re-register: %v, want ErrExists", err)
		}
		if evs := s.take(); len(evs) != 0 {
			t.Fatalf("re-register published %v, want nothing", evs)
		}
		got := make([]byte, testBlock)
		check(t, p.Read(1, got))
		if !bytes.Equal(got, pattern(testBlock, 1)) {
			t.Fatal("re-registering overwrote the stored bytes")
		}
		register(t, p, pool.Block{Hash: 3})
		if got := removed(s.take()); !slices.Equal(got, []uint64{2}) {
			t.Fatalf("evicted %v, want [2]: the revived block is recent", got)
		}
		if st := p.Stats(); st.Revived != 1 || st.Inactive != 2 {
			t.Fatalf("stats %+v, want 1 revived, 2 inactive", st)
		}
	})
}

func TestFullPoolRefusesAndChangesNothing(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 3, s)
		register(t, p, chain(0, 0, 2)...) // 1 <- 2
		register(t, p, pool.Block{Hash: 10})
		check(t, pc.acquire(p, 2))
		check(t, pc.acquire(p, 10))
		s.take()
		before, dump := p.Stats(), dumpBlocks(p)

		if err := p.Register(pool.Block{Hash: 20}, pattern(testBlock, 20)); !errors.Is(err, pool.ErrFull) {
			t.Fatalf("register into a pool of pinned blocks and their parents: %v, want ErrFull", err)
		}
		if evs := s.take(); len(evs) != 0 {
			t.Fatalf("a refused register published %v", evs)
		}
		if after := p.Stats(); after != before {
			t.Fatalf("stats changed: %+v, was %+v", after, before)
		}
		if got := dumpBlocks(p); !slices.Equal(got, dump) {
			t.Fatalf("contents changed: %v, was %v", got, dump)
		}
		// A child of the pinned 2 does not evict its own ancestors either.
		if err := p.Register(pool.Block{Hash: 3, Parent: 2}, pattern(testBlock, 3)); !errors.Is(err, pool.ErrFull) {
			t.Fatalf("register child: %v, want ErrFull", err)
		}
		check(t, p.Release(10))
		register(t, p, pool.Block{Hash: 20})
		if got := removed(s.take()); !slices.Equal(got, []uint64{10}) {
			t.Fatalf("evicted %v, want [10]", got)
		}
	})
}

func TestEventsCarryTierAndParent(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 2, s)
		register(t, p, pool.Block{Hash: 5, Parent: 4, Local: 55})
		register(t, p, pool.Block{Hash: 6, Parent: 5, Local: 66})
		register(t, p, pool.Block{Hash: 7, Local: 77})
		evs := s.take()
		want := []kvevent.Event{
			{Rank: rank, Tier: pc.tier, Kind: kvevent.KindStored, HasParent: true, Parent: 4,
				Blocks: []kvevent.Block{{EngineHash: 5, LocalHash: 55}}},
			{Rank: rank, Tier: pc.tier, Kind: kvevent.KindStored, HasParent: true, Parent: 5,
				Blocks: []kvevent.Block{{EngineHash: 6, LocalHash: 66}}},
			{Rank: rank, Tier: pc.tier, Kind: kvevent.KindRemoved, Removed: []uint64{6}},
			{Rank: rank, Tier: pc.tier, Kind: kvevent.KindStored,
				Blocks: []kvevent.Block{{EngineHash: 7, LocalHash: 77}}},
		}
		if !eventsEqual(evs, want) {
			t.Fatalf("events\n%+v\nwant\n%+v", evs, want)
		}
	})
}

func TestPublishErrorKeepsTheChange(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		s.err = errors.New("buffer full")
		p := pc.open(t, 2, s)
		register(t, p, pool.Block{Hash: 1})
		if st := p.Stats(); st.Used != 1 || st.PublishErrors != 1 {
			t.Fatalf("stats %+v, want the block held and 1 publish error", st)
		}
	})
}

func TestBadInputIsRejectedAndChangesNothing(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		p := pc.open(t, 4, s)
		register(t, p, chain(0, 0, 2)...)
		s.take()
		before := p.Stats()
		buf := make([]byte, testBlock)
		for _, tc := range []struct {
			name string
			err  error
			want error
		}{
			{"zero hash", p.Register(pool.Block{Hash: 0}, buf), pool.ErrInvalid},
			{"own parent", p.Register(pool.Block{Hash: 9, Parent: 9}, buf), pool.ErrInvalid},
			{"short block", p.Register(pool.Block{Hash: 9}, buf[:10]), pool.ErrInvalid},
			{"long block", p.Register(pool.Block{Hash: 9}, append(buf, 0)), pool.ErrInvalid},
			{"held hash, other parent", p.Register(pool.Block{Hash: 1, Parent: 2}, buf), pool.ErrExists},
			{"read unknown", p.Read(9, buf), pool.ErrNotFound},
			{"read zero", p.Read(0, buf), pool.ErrInvalid},
			{"read short", p.Read(1, buf[:1]), pool.ErrInvalid},
			{"acquire unknown", pc.acquire(p, 9), pool.ErrNotFound},
			{"release unknown", p.Release(9), pool.ErrNotFound},
			{"release unheld", p.Release(1), pool.ErrNotHeld},
		} {
			if !errors.Is(tc.err, tc.want) {
				t.Errorf("%s: %v, want %v", tc.name, tc.err, tc.want)
			}
		}
		after := p.Stats()
		after.Misses, after.Revived = before.Misses, before.Revived // counted, by design
		if after != before {
			t.Fatalf("stats changed: %+v, was %+v", after, before)
		}
		if evs := s.take(); len(evs) != 0 {
			t.Fatalf("bad input published %v", evs)
		}
	})
}

func TestBlockCannotBecomeItsOwnAncestor(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		p := pc.open(t, 4, newSink(t))
		register(t, p, pool.Block{Hash: 2, Parent: 1}, pool.Block{Hash: 3, Parent: 2})
		// 1 is not held, but 2 names it as parent: 1 with parent 3 closes a loop.
		if err := p.Register(pool.Block{Hash: 1, Parent: 3}, make([]byte, testBlock)); !errors.Is(err, pool.ErrInvalid) {
			t.Fatalf("register 1 under its own descendant: %v, want ErrInvalid", err)
		}
		register(t, p, pool.Block{Hash: 1})
	})
}

// A batch whose blocks would close a loop of parents, among themselves or
// through a held block, is a bad argument: it is refused before anything
// is reserved, so no block is stored, evicted or announced.
func TestBatchThatClosesALoopChangesNothing(t *testing.T) {
	batches := []struct {
		name string
		open func(t *testing.T, capacity int, s pool.Sink) (anyPool, func([]pool.Block) (int, error))
	}{
		{"disk Put", func(t *testing.T, c int, s pool.Sink) (anyPool, func([]pool.Block) (int, error)) {
			p := openDiskPool(t, t.TempDir(), c, s)
			return p, func(bs []pool.Block) (int, error) {
				data := make([][]byte, len(bs))
				for i, b := range bs {
					data[i] = pattern(testBlock, b.Hash)
				}
				return p.Put(bs, data)
			}
		}},
		{"host RegisterFrom", func(t *testing.T, c int, s pool.Sink) (anyPool, func([]pool.Block) (int, error)) {
			be := hostBackend(t)
			p, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: c, BlockSize: testBlock, Sink: s})
			check(t, err)
			t.Cleanup(func() { check(t, p.Close()) })
			stream, err := be.NewStream()
			check(t, err)
			t.Cleanup(func() { check(t, be.DestroyStream(stream)) })
			ev, err := be.NewEvent()
			check(t, err)
			t.Cleanup(func() { check(t, be.DestroyEvent(ev)) })
			src, err := be.AllocHost(4 * testBlock)
			check(t, err)
			t.Cleanup(func() { check(t, be.FreeHost(src)) })
			return p, func(bs []pool.Block) (int, error) {
				ptrs := make([]backend.Ptr, len(bs))
				for i := range bs {
					ptrs[i] = src.At(i * testBlock)
				}
				return p.RegisterFrom(stream, ev, bs, ptrs)
			}
		}},
	}
	loops := []struct {
		name  string
		held  []pool.Block // 9, evictable, fills the pool: a reservation would evict it
		batch []pool.Block
	}{
		{"within the batch", []pool.Block{{Hash: 9}},
			[]pool.Block{{Hash: 1, Parent: 2}, {Hash: 2, Parent: 1}}},
		{"through a held block", []pool.Block{{Hash: 9}, {Hash: 3, Parent: 2}},
			[]pool.Block{{Hash: 1, Parent: 3}, {Hash: 2, Parent: 1}}},
	}
	for _, bt := range batches {
		for _, lp := range loops {
			t.Run(bt.name+"/"+lp.name, func(t *testing.T) {
				s := newSink(t)
				p, batch := bt.open(t, len(lp.held), s)
				register(t, p, lp.held...)
				s.take()
				before := p.Stats()
				n, err := batch(lp.batch)
				if n != 0 || !errors.Is(err, pool.ErrInvalid) {
					t.Fatalf("batch %v: %d stored, %v; want 0 and ErrInvalid", lp.batch, n, err)
				}
				if after := p.Stats(); after != before {
					t.Fatalf("stats changed: %+v, was %+v", after, before)
				}
				if evs := s.take(); len(evs) != 0 {
					t.Fatalf("the refused batch published %v", evs)
				}
			})
		}
	}
}

// Two concurrent Puts that close a loop between them: in either order the
// second is refused whole. Checked for loops apart from its reservations,
// each passed the check, and the second was caught only by reserve at the
// block that closes the loop, failing with ErrInvalid after storing the
// block before it, an outcome no serial order of the two Puts gives.
func TestConcurrentBatchesThatCloseALoopChangeNothing(t *testing.T) {
	p, err := pool.OpenDisk("/db", pool.Config{Rank: rank, Capacity: 16, BlockSize: testBlock},
		pool.DiskOptions{FS: vfs.NewMem(), Sync: pool.SyncWAL}) // no flush per Put: more trials
	check(t, err)
	t.Cleanup(func() { p.Close() })
	data := [][]byte{pattern(testBlock, 1), pattern(testBlock, 2)}
	closeLoopsConcurrently(t, p, 5000, "Put", func(i int, bs []pool.Block) (int, error) { return p.Put(bs, data) })
}

// TestConcurrentRegisterFromsThatCloseALoopChangeNothing is
// TestConcurrentBatchesThatCloseALoopChangeNothing for HostPool.RegisterFrom:
// its loop check and reservations are one hold of the lock (reserveAll)
// too, so in either order the second batch is refused whole, with nothing
// copied, stored or published.
func TestConcurrentRegisterFromsThatCloseALoopChangeNothing(t *testing.T) {
	be := hostBackend(t)
	p, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: 16, BlockSize: testBlock})
	check(t, err)
	t.Cleanup(func() { check(t, p.Close()) })
	src, err := be.AllocHost(2 * testBlock)
	check(t, err)
	t.Cleanup(func() { check(t, be.FreeHost(src)) })
	ptrs := []backend.Ptr{src.At(0), src.At(testBlock)}
	var (
		streams [2]backend.Stream
		events  [2]backend.Event
	)
	for i := range 2 {
		streams[i], err = be.NewStream()
		check(t, err)
		t.Cleanup(func() { check(t, be.DestroyStream(streams[i])) })
		events[i], err = be.NewEvent()
		check(t, err)
		t.Cleanup(func() { check(t, be.DestroyEvent(events[i])) })
	}
	closeLoopsConcurrently(t, p, 2000, "RegisterFrom", func(i int, bs []pool.Block) (int, error) {
		return p.RegisterFrom(streams[i], events[i], bs, ptrs)
	})
}

// closeLoopsConcurrently runs trials of two batches, each one block
// of its own and one whose parent the other batch stores, through put at
// once (i is the batch's goroutine: 0 or 1): together they would close a
// loop of parents, so the second to reserve is refused, and a batch
// refused (ErrInvalid) must have stored nothing of its own.
func closeLoopsConcurrently(t *testing.T, p anyPool, trials uint64, what string, put func(i int, bs []pool.Block) (int, error)) {
	t.Helper()
	for trial := range trials {
		x, a, b := 0x100+4*trial, 0x101+4*trial, 0x102+4*trial // new hashes each trial
		batches := [2][]pool.Block{
			{{Hash: x}, {Hash: a, Parent: b}},
			{{Hash: x + 3}, {Hash: b, Parent: a}},
		}
		var (
			wg     sync.WaitGroup
			start  = make(chan struct{})
			stored [2]int
			errs   [2]error
		)
		for i := range 2 {
			wg.Go(func() {
				<-start
				stored[i], errs[i] = put(i, batches[i])
			})
		}
		close(start)
		wg.Wait()
		for i := range 2 {
			if !errors.Is(errs[i], pool.ErrInvalid) {
				continue
			}
			if held := present(p, batches[i][0].Hash); stored[i] != 0 || len(held) != 0 {
				t.Fatalf("trial %d: %s %x failed with %v after storing %d block(s) (held now: %x); "+
					"a batch refused as a loop must change nothing", trial, what, batches[i], errs[i], stored[i], held)
			}
		}
	}
}

func TestReadReturnsTheBytesWritten(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		p := pc.open(t, 8, newSink(t))
		bs := chain(100, 0, 8)
		register(t, p, bs...)
		got := make([]byte, testBlock)
		for _, b := range bs {
			check(t, p.Read(b.Hash, got))
			if !bytes.Equal(got, pattern(testBlock, b.Hash)) {
				t.Fatalf("block %#x read back differs", b.Hash)
			}
		}
		if st := p.Stats(); st.Hits != 8 || st.Referenced != 0 {
			t.Fatalf("stats %+v, want 8 hits and nothing left referenced", st)
		}
	})
}

func TestDumpPutsParentsBeforeChildren(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		p := pc.open(t, 16, newSink(t))
		// Registered children first: the dump must still order by parent.
		trunk := chain(0, 0, 4)                        // 1..4
		branch := chain(10, 2, 3)                      // 11..13 under 2
		orphan := []pool.Block{{Hash: 21, Parent: 20}} // parent not in the pool
		for _, bs := range [][]pool.Block{branch, orphan, trunk} {
			for i := len(bs) - 1; i >= 0; i-- {
				register(t, p, bs[i])
			}
		}
		evs, _ := p.Dump()
		checkParentOrder(t, evs)
		got := storedBlocks(evs)
		if len(got) != 8 {
			t.Fatalf("dump holds %d blocks, want 8: %v", len(got), got)
		}
		for _, b := range got {
			if b.Parent != parentOf(b.Hash, trunk, branch, orphan) {
				t.Fatalf("dumped %#x with parent %#x", b.Hash, b.Parent)
			}
		}
		if len(evs) != 3 {
			t.Errorf("dump is %d events, want 3 (trunk, branch, orphan): %+v", len(evs), evs)
		}
	})
}

func parentOf(h uint64, sets ...[]pool.Block) uint64 {
	for _, bs := range sets {
		for _, b := range bs {
			if b.Hash == h {
				return b.Parent
			}
		}
	}
	return ^uint64(0)
}

// checkParentOrder fails unless every dumped block whose parent is in the
// dump comes after it, and every event is valid.
func checkParentOrder(t testing.TB, evs []kvevent.Event) {
	t.Helper()
	all := map[uint64]bool{}
	for _, b := range storedBlocks(evs) {
		all[b.Hash] = true
	}
	seen := map[uint64]bool{}
	for i := range evs {
		if err := evs[i].Validate(); err != nil || evs[i].Kind != kvevent.KindStored {
			t.Fatalf("dump event %+v: kind %v, %v", evs[i], evs[i].Kind, err)
		}
	}
	for _, b := range storedBlocks(evs) {
		if b.Parent != 0 && all[b.Parent] && !seen[b.Parent] {
			t.Fatalf("dump has %#x before its parent %#x", b.Hash, b.Parent)
		}
		seen[b.Hash] = true
	}
}

func TestConcurrentWorkersKeepTheInvariants(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		s := newSink(t)
		const capacity, workers, per = 16, 4, 40
		p := pc.open(t, capacity, s)
		var wg sync.WaitGroup
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				buf := make([]byte, testBlock)
				bs := chain(uint64(w)*1000, 0, per)
				for i, b := range bs {
					err := p.Register(b, pattern(testBlock, b.Hash))
					if err != nil && !errors.Is(err, pool.ErrFull) {
						t.Errorf("register: %v", err)
						return
					}
					if i > 0 && pc.acquire(p, bs[i-1].Hash) == nil {
						if err := p.Read(bs[i-1].Hash, buf); err != nil {
							t.Errorf("read a held block: %v", err)
						} else if !bytes.Equal(buf, pattern(testBlock, bs[i-1].Hash)) {
							t.Errorf("block %#x read back differs", bs[i-1].Hash)
						}
						if err := p.Release(bs[i-1].Hash); err != nil {
							t.Errorf("release: %v", err)
						}
					}
				}
			}()
		}
		wg.Wait()
		st := p.Stats()
		if st.Used > capacity || st.Referenced != 0 || st.Pending != 0 || st.Inactive != st.Used {
			t.Fatalf("stats after the workers: %+v", st)
		}
		// The events replayed give exactly the pool's contents.
		held := map[uint64]bool{}
		for _, ev := range s.take() {
			for _, b := range ev.Blocks {
				held[b.EngineHash] = true
			}
			for _, h := range ev.Removed {
				if !held[h] {
					t.Fatalf("REMOVE of %#x, which was not stored", h)
				}
				delete(held, h)
			}
		}
		evs, _ := p.Dump()
		checkParentOrder(t, evs)
		dumped := map[uint64]bool{}
		for _, b := range storedBlocks(evs) {
			dumped[b.Hash] = true
		}
		if len(dumped) != st.Used || len(held) != st.Used {
			t.Fatalf("dump %d blocks, events say %d, stats %d", len(dumped), len(held), st.Used)
		}
		for h := range held {
			if !dumped[h] {
				t.Fatalf("%#x stored per the events but not in the dump", h)
			}
		}
	})
}

func TestMetricsFollowTheStats(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	be := hostBackend(t)
	cfg := pool.Config{Rank: rank, Capacity: 2, BlockSize: testBlock, Registerer: reg}
	p, err := pool.NewHost(be, cfg)
	check(t, err)
	d, err := pool.OpenDisk(t.TempDir(), cfg, pool.DiskOptions{})
	check(t, err)
	check(t, p.Register(pool.Block{Hash: 1}, pattern(testBlock, 1)))
	check(t, p.Register(pool.Block{Hash: 2}, pattern(testBlock, 2)))
	check(t, p.Register(pool.Block{Hash: 3}, pattern(testBlock, 3)))
	_, _ = p.Acquire(9)
	got := gather(t, reg)
	for name, want := range map[string]float64{
		`kvagent_pool_evictions_total{dp_rank="1",tier="host",worker="7"}`: 1,
		`kvagent_pool_evictions_total{dp_rank="1",tier="disk",worker="7"}`: 0,
		`kvagent_pool_misses_total{dp_rank="1",tier="host",worker="7"}`:    1,
		`kvagent_pool_blocks{dp_rank="1",tier="host",worker="7"}`:          2,
		`kvagent_pool_blocks{dp_rank="1",tier="disk",worker="7"}`:          0,
		`kvagent_pool_capacity_blocks{dp_rank="1",tier="disk",worker="7"}`: 2,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", name, v, ok, want)
		}
	}
	check(t, p.Close())
	check(t, d.Close())
	// Closed pools leave the registry, so the same pools can be made again.
	if got := gather(t, reg); len(got) != 0 {
		t.Fatalf("after close: %v", got)
	}
	p, err = pool.NewHost(be, cfg)
	check(t, err)
	check(t, p.Close())
}

// TestMetricsReportEachStatUnderItsName drives a host pool to different
// counts of each stat (hits 3, misses 2, registered 4, revived 1, pending 1,
// referenced 1, inactive 3, a publish error) and a disk pool to a damaged
// block, and reads each kvagent_pool_* family: a family that reported
// another stat (hits as misses) or none passed TestMetricsFollowTheStats.
func TestMetricsReportEachStatUnderItsName(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	s := newSink(t)
	p, err := pool.NewHost(hostBackend(t), pool.Config{Rank: rank, Capacity: 8, BlockSize: testBlock, Sink: s, Registerer: reg})
	check(t, err)
	defer p.Close()
	for _, b := range chain(0, 0, 3) {
		check(t, p.Register(b, pattern(testBlock, b.Hash)))
	}
	s.mu.Lock()
	s.err = errors.New("sink down")
	s.mu.Unlock()
	b4 := pool.Block{Hash: 4, Parent: 3, Local: 4}
	check(t, p.Register(b4, pattern(testBlock, 4))) // published nothing: a publish error
	s.mu.Lock()
	s.err = nil
	s.mu.Unlock()
	if err := p.Register(b4, pattern(testBlock, 4)); !errors.Is(err, pool.ErrExists) { // held: revived
		t.Fatalf("register of a block held: %v, want ErrExists", err)
	}
	_, err = p.Acquire(1) // hit; referenced until the end
	check(t, err)
	buf := make([]byte, testBlock)
	check(t, p.Read(2, buf)) // hit
	check(t, p.Read(4, buf)) // hit
	if _, err := p.Acquire(90); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("acquire of a block not held: %v", err)
	}
	if err := p.Read(91, buf); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("read of a block not held: %v", err)
	}
	if _, err := p.Reserve(pool.Block{Hash: 5, Parent: 4, Local: 5}); err != nil { // pending
		t.Fatal(err)
	}

	dir := t.TempDir()
	storeAndDamage(t, dir, 42)
	d, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: 8, BlockSize: damageBS, Registerer: reg}, pool.DiskOptions{})
	check(t, err)
	defer d.Close()
	if err := d.Read(42, make([]byte, damageBS)); !errors.Is(err, pool.ErrCorrupt) {
		t.Fatalf("read of a damaged block: %v, want ErrCorrupt", err)
	}

	want := map[string]float64{
		"hits_total": 3, "misses_total": 2, "registered_total": 4, "revived_total": 1,
		"pending_blocks": 1, "referenced_blocks": 1, "inactive_blocks": 3, "blocks": 5,
		"publish_errors_total": 1, "evictions_total": 0, "damaged_total": 0,
		"capacity_blocks": 8, "block_bytes": testBlock,
	}
	got := gather(t, reg)
	for name, v := range want {
		key := `kvagent_pool_` + name + `{dp_rank="1",tier="host",worker="7"}`
		if g, ok := got[key]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", key, g, ok, v)
		}
	}
	if key := `kvagent_pool_damaged_total{dp_rank="1",tier="disk",worker="7"}`; got[key] != 1 {
		t.Errorf("%s = %v after one damaged block's read, want 1", key, got[key])
	}
}

func TestClosedPoolRefuses(t *testing.T) {
	forEachPool(t, func(t *testing.T, pc poolCase) {
		p := pc.open(t, 2, newSink(t))
		register(t, p, pool.Block{Hash: 1})
		check(t, p.Close())
		if err := p.Register(pool.Block{Hash: 2}, make([]byte, testBlock)); !errors.Is(err, pool.ErrClosed) {
			t.Fatalf("register after close: %v", err)
		}
		if err := p.Read(1, make([]byte, testBlock)); !errors.Is(err, pool.ErrClosed) {
			t.Fatalf("read after close: %v", err)
		}
		check(t, p.Close()) // a second close is fine
	})
}

func TestConfigIsChecked(t *testing.T) {
	be := hostBackend(t)
	for _, cfg := range []pool.Config{{Capacity: 0, BlockSize: 1}, {Capacity: 1, BlockSize: 0}, {Capacity: -1, BlockSize: 8}} {
		if _, err := pool.NewHost(be, cfg); !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("NewHost(%+v): %v, want ErrInvalid", cfg, err)
		}
		if _, err := pool.OpenDisk(t.TempDir(), cfg, pool.DiskOptions{}); !errors.Is(err, pool.ErrInvalid) {
			t.Errorf("OpenDisk(%+v): %v, want ErrInvalid", cfg, err)
		}
	}
}

// dumpBlocks is the pool's contents as dumped.
func dumpBlocks(p anyPool) []pool.Block {
	evs, _ := p.Dump()
	return storedBlocks(evs)
}

// gather returns every sample of reg as name{label="v",...} -> value.
func gather(t testing.TB, reg prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	check(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+strconv.Quote(l.GetValue()))
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			out[mf.GetName()+"{"+strings.Join(ls, ",")+"}"] = v
		}
	}
	return out
}

func eventsEqual(a, b []kvevent.Event) bool {
	return slices.EqualFunc(a, b, func(x, y kvevent.Event) bool {
		return x.Rank == y.Rank && x.Tier == y.Tier && x.Kind == y.Kind && x.HasParent == y.HasParent &&
			x.Parent == y.Parent && slices.Equal(x.Blocks, y.Blocks) && slices.Equal(x.Removed, y.Removed)
	})
}

func check(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
