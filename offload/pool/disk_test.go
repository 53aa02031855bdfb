package pool_test

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/offload/pool"
)

func syncModes() []pool.SyncMode { return []pool.SyncMode{pool.SyncFlush, pool.SyncWAL} }

func openDisk(t testing.TB, dir string, capacity int, mode pool.SyncMode, s pool.Sink) *pool.DiskPool {
	t.Helper()
	p, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: capacity, BlockSize: testBlock, Sink: s},
		pool.DiskOptions{Sync: mode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() }) // after a failure; a second Close is a no-op
	return p
}

func TestDiskReopenRestoresContentsAndDumpsInParentOrder(t *testing.T) {
	for _, mode := range syncModes() {
		t.Run(mode.String(), func(t *testing.T) {
			dir := t.TempDir()
			p := openDisk(t, dir, 16, mode, newSink(t))
			trunk := chain(0, 0, 5)
			branch := chain(100, 3, 4)
			// Children before parents, across several Puts.
			put(t, p, branch[2:]...)
			put(t, p, trunk[3:]...)
			put(t, p, branch[:2]...)
			put(t, p, trunk[:3]...)
			wantDump := dumpBlocks(p)
			check(t, p.Close())

			s := newSink(t)
			p = openDisk(t, dir, 16, mode, s)
			defer p.Close()
			evs, _ := p.Dump()
			checkParentOrder(t, evs)
			got := storedBlocks(evs)
			if !sameBlocks(got, wantDump) || len(got) != 9 {
				t.Fatalf("reopened pool dumps %v, want %v", got, wantDump)
			}
			buf := make([]byte, testBlock)
			for _, b := range append(trunk, branch...) {
				check(t, p.Read(b.Hash, buf))
				if !bytes.Equal(buf, pattern(testBlock, b.Hash)) {
					t.Fatalf("block %#x differs after reopen", b.Hash)
				}
			}
			if evs := s.take(); len(evs) != 0 {
				t.Fatalf("reopening published %v", evs)
			}
		})
	}
}

func TestDiskReopenKeepsRegistrationOrderForEviction(t *testing.T) {
	dir := t.TempDir()
	p := openDisk(t, dir, 3, pool.SyncFlush, newSink(t))
	put(t, p, pool.Block{Hash: 3}, pool.Block{Hash: 1}, pool.Block{Hash: 2})
	check(t, p.Close())

	s := newSink(t)
	p = openDisk(t, dir, 3, pool.SyncFlush, s)
	defer p.Close()
	put(t, p, pool.Block{Hash: 4})
	if got := removed(s.take()); !slices.Equal(got, []uint64{3}) {
		t.Fatalf("evicted %v, want [3]: the oldest registration", got)
	}
}

func TestDiskEvictionIsGoneAfterReopen(t *testing.T) {
	for _, mode := range syncModes() {
		t.Run(mode.String(), func(t *testing.T) {
			dir := t.TempDir()
			p := openDisk(t, dir, 2, mode, newSink(t))
			put(t, p, pool.Block{Hash: 1}, pool.Block{Hash: 2})
			put(t, p, pool.Block{Hash: 3})
			check(t, p.Close())
			p = openDisk(t, dir, 2, mode, newSink(t))
			defer p.Close()
			if got := present(p, 1, 2, 3); !slices.Equal(got, []uint64{2, 3}) {
				t.Fatalf("present after reopen %v, want [2 3]", got)
			}
		})
	}
}

func TestDiskReopenWithSmallerCapacityEvictsLeavesFirst(t *testing.T) {
	dir := t.TempDir()
	p := openDisk(t, dir, 8, pool.SyncFlush, newSink(t))
	put(t, p, chain(0, 0, 4)...) // 1 <- 2 <- 3 <- 4
	put(t, p, pool.Block{Hash: 10})
	check(t, p.Close())

	s := newSink(t)
	p = openDisk(t, dir, 3, pool.SyncFlush, s)
	if got := present(p, 1, 2, 3, 4, 10); !slices.Equal(got, []uint64{1, 2, 10}) {
		t.Fatalf("present %v, want [1 2 10]: 4 then 3 evicted", got)
	}
	if st := p.Stats(); st.Used != 3 || st.Evictions != 2 {
		t.Fatalf("stats %+v", st)
	}
	if evs := s.take(); len(evs) != 0 {
		t.Fatalf("reopening published %v (the agent dumps instead)", evs)
	}
	check(t, p.Close())
	p = openDisk(t, dir, 8, pool.SyncFlush, newSink(t))
	defer p.Close()
	if got := p.Stats().Used; got != 3 {
		t.Fatalf("the evictions at open did not last: %d blocks", got)
	}
}

func TestDiskOpenWithAnotherBlockSizeFails(t *testing.T) {
	dir := t.TempDir()
	p := openDisk(t, dir, 4, pool.SyncFlush, nil)
	put(t, p, pool.Block{Hash: 1})
	check(t, p.Close())
	_, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: 4, BlockSize: testBlock * 2}, pool.DiskOptions{})
	if !errors.Is(err, pool.ErrCorrupt) {
		t.Fatalf("open with another block size: %v, want ErrCorrupt", err)
	}
}

func TestDiskPutStopsAtTheFirstBlockThatDoesNotFit(t *testing.T) {
	s := newSink(t)
	p := openDisk(t, t.TempDir(), 3, pool.SyncFlush, s)
	defer p.Close()
	put(t, p, pool.Block{Hash: 1})
	check(t, p.Acquire(1))
	bs := chain(10, 0, 4) // a chain: each needs room, and a parent is never evicted for its child
	data := make([][]byte, len(bs))
	for i, b := range bs {
		data[i] = pattern(testBlock, b.Hash)
	}
	n, err := p.Put(bs, data)
	if n != 2 || !errors.Is(err, pool.ErrFull) {
		t.Fatalf("put: %d stored, %v; want 2 stored and ErrFull", n, err)
	}
	if got := present(p, 1, 11, 12, 13, 14); !slices.Equal(got, []uint64{1, 11, 12}) {
		t.Fatalf("present %v, want [1 11 12]", got)
	}
	if st := p.Stats(); st.Pending != 0 || st.Used != 3 {
		t.Fatalf("stats %+v", st)
	}
	// A batch with a bad member changes nothing.
	data[3] = data[3][:1]
	if n, err := p.Put(chain(20, 0, 4), data); n != 0 || !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("put with a short buffer: %d, %v", n, err)
	}
}

func TestDiskConcurrentPutsShareFlushesAndAllLand(t *testing.T) {
	for _, mode := range syncModes() {
		t.Run(mode.String(), func(t *testing.T) {
			dir := t.TempDir()
			p := openDisk(t, dir, 64, mode, newSink(t))
			var wg sync.WaitGroup
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					bs := chain(uint64(w)*1000, 0, 12)
					for i := 0; i < len(bs); i += 3 {
						data := [][]byte{pattern(testBlock, bs[i].Hash), pattern(testBlock, bs[i+1].Hash), pattern(testBlock, bs[i+2].Hash)}
						if n, err := p.Put(bs[i:i+3], data); n != 3 || err != nil {
							t.Errorf("put: %d, %v", n, err)
						}
					}
				}()
			}
			wg.Wait()
			check(t, p.Close())
			p = openDisk(t, dir, 64, mode, newSink(t))
			defer p.Close()
			if got := p.Stats().Used; got != 48 {
				t.Fatalf("%d blocks after reopen, want 48", got)
			}
			buf := make([]byte, testBlock)
			for w := range 4 {
				for _, b := range chain(uint64(w)*1000, 0, 12) {
					check(t, p.Read(b.Hash, buf))
					if !bytes.Equal(buf, pattern(testBlock, b.Hash)) {
						t.Fatalf("block %#x differs", b.Hash)
					}
				}
			}
		})
	}
}

func TestDiskReadHeldReadsUnderTheCallersReferenceWithoutAnotherHit(t *testing.T) {
	p := openDisk(t, t.TempDir(), 4, pool.SyncFlush, newSink(t))
	put(t, p, pool.Block{Hash: 1}, pool.Block{Hash: 2})
	buf := make([]byte, testBlock)
	if err := p.ReadHeld(1, buf); !errors.Is(err, pool.ErrNotHeld) {
		t.Fatalf("ReadHeld of a block not acquired: %v, want ErrNotHeld", err)
	}
	if err := p.ReadHeld(9, buf); !errors.Is(err, pool.ErrNotFound) {
		t.Fatalf("ReadHeld of a block not stored: %v, want ErrNotFound", err)
	}
	if err := p.ReadHeld(1, buf[:1]); !errors.Is(err, pool.ErrInvalid) {
		t.Fatalf("ReadHeld into a short buffer: %v, want ErrInvalid", err)
	}
	check(t, p.Acquire(1))
	check(t, p.ReadHeld(1, buf))
	if !bytes.Equal(buf, pattern(testBlock, 1)) {
		t.Fatal("ReadHeld read other bytes than the block's")
	}
	if st := p.Stats(); st.Hits != 1 || st.Referenced != 1 {
		t.Fatalf("after Acquire and ReadHeld: %d hits, %d referenced; want 1 (the Acquire) and 1", st.Hits, st.Referenced)
	}
	check(t, p.Release(1))
	if st := p.Stats(); st.Referenced != 0 {
		t.Fatalf("%d blocks referenced after the Release", st.Referenced)
	}
}

func TestDiskReviveCountsHeldBlocksAsUsedNow(t *testing.T) {
	s := newSink(t)
	p := openDisk(t, t.TempDir(), 2, pool.SyncFlush, s)
	put(t, p, pool.Block{Hash: 1})
	put(t, p, pool.Block{Hash: 2})
	if got := p.Revive([]uint64{1, 9}, nil); !slices.Equal(got, []bool{true, false}) {
		t.Fatalf("Revive(1, 9) = %v, want [true false]", got)
	}
	if st := p.Stats(); st.Revived != 1 || st.Hits != 0 {
		t.Fatalf("stats %+v, want 1 revived and no hit", st)
	}
	s.take()
	put(t, p, pool.Block{Hash: 3})
	if got := removed(s.take()); !slices.Equal(got, []uint64{2}) {
		t.Fatalf("evicted %v, want [2]: 1 was revived after it", got)
	}
}

// TestDiskReadCountsAsAUseForEviction pins disk.go's "a successful read
// counts as a use and a hit, as Acquire does" against doc.go's LRU order:
// the oldest block, read, is kept, and the least recently used one goes in
// its place. It was unpinned: the stamp core.used gives a read block
// (e.stamp = c.tick()) was deletable with every pool test passing.
func TestDiskReadCountsAsAUseForEviction(t *testing.T) {
	s := newSink(t)
	p := openDisk(t, t.TempDir(), 3, pool.SyncFlush, s)
	put(t, p, pool.Block{Hash: 1})
	put(t, p, pool.Block{Hash: 2})
	put(t, p, pool.Block{Hash: 3})
	buf := make([]byte, testBlock)
	check(t, p.Read(1, buf))
	if st := p.Stats(); st.Hits != 1 || st.Referenced != 0 {
		t.Fatalf("after a Read: %d hits, %d referenced; want 1 and 0", st.Hits, st.Referenced)
	}
	s.take()
	put(t, p, pool.Block{Hash: 4})
	if got := removed(s.take()); !slices.Equal(got, []uint64{2}) {
		t.Fatalf("evicted %v, want [2]: 1, the oldest registration, was read after it", got)
	}
	if got := present(p, 1, 2, 3, 4); !slices.Equal(got, []uint64{1, 3, 4}) {
		t.Fatalf("present %v, want [1 3 4]", got)
	}
}

func put(t testing.TB, p *pool.DiskPool, bs ...pool.Block) {
	t.Helper()
	data := make([][]byte, len(bs))
	for i, b := range bs {
		data[i] = pattern(testBlock, b.Hash)
	}
	if n, err := p.Put(bs, data); err != nil || n != len(bs) {
		t.Fatalf("put %d blocks: %d stored, %v", len(bs), n, err)
	}
}

func sameBlocks(a, b []pool.Block) bool {
	cmp := func(x, y pool.Block) int {
		switch {
		case x.Hash < y.Hash:
			return -1
		case x.Hash > y.Hash:
			return 1
		}
		return 0
	}
	a, b = slices.Clone(a), slices.Clone(b)
	slices.SortFunc(a, cmp)
	slices.SortFunc(b, cmp)
	return slices.Equal(a, b)
}

// fullFS is the operating system's file system that, while full is set,
// refuses to create the files a flush writes (sstables, blob files) with
// ENOSPC, as a full disk does. With slow set too, each refusal takes 50 ms
// (a disk slow as well as full).
type fullFS struct {
	vfs.FS
	full, slow atomic.Bool
}

func (f *fullFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	if f.full.Load() && (strings.HasSuffix(name, ".sst") || strings.HasSuffix(name, ".blob")) {
		if f.slow.Load() {
			time.Sleep(50 * time.Millisecond)
		}
		return nil, fmt.Errorf("create %s: %w", name, syscall.ENOSPC)
	}
	return f.FS.Create(name, cat)
}

// returns runs f and returns its error, failing the test if f has not
// returned after a minute: a deadline for a hang, not a timing assert.
func returns(t *testing.T, what string, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-time.After(time.Minute):
		t.Fatalf("%s did not return", what)
		return nil
	}
}

// On a full disk, Put never returned: Pebble retries a failed flush at
// once, for ever, and DB.Flush waits for one that succeeds; DiskPool.Close
// waited behind the Put, and with them the manager's workers and kvagent's
// shutdown. Now the Put fails and stores nothing, later Puts fail too until
// Pebble's retries succeed, Close returns, and the failed block does not
// come back at the next open although its batch reached the disk with the
// retry.
func TestDiskPutOnAFullDiskFailsAndStoresNothing(t *testing.T) {
	dir := t.TempDir()
	fs := &fullFS{FS: vfs.Default}
	s := newSink(t)
	p, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: 8, BlockSize: testBlock, Sink: s}, pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { p.Close() })
	// First, after a failure: a Put stuck on the full disk would hold up Close.
	t.Cleanup(func() { fs.full.Store(false) })
	check(t, p.Register(pool.Block{Hash: 1, Local: 1}, pattern(testBlock, 1)))
	s.take()

	fs.full.Store(true)
	err = returns(t, "Put on a full disk", func() error {
		return p.Register(pool.Block{Hash: 7, Local: 7}, pattern(testBlock, 7))
	})
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Put on a full disk: %v, want an error wrapping ENOSPC", err)
	}
	if got := p.Lookup([]uint64{1, 7}, nil); !slices.Equal(got, []bool{true, false}) || p.Stats().Used != 1 {
		t.Fatalf("after the failed Put: Lookup(1, 7) = %v, %d used; want [true false], 1", got, p.Stats().Used)
	}
	if evs := s.take(); len(evs) != 0 {
		t.Fatalf("the failed Put published %v", evs)
	}
	if err := returns(t, "a second Put on a full disk", func() error {
		return p.Register(pool.Block{Hash: 8, Local: 8}, pattern(testBlock, 8))
	}); err == nil {
		t.Fatal("a Put while the disk is full succeeded")
	}

	fs.full.Store(false)
	deadline := time.Now().Add(time.Minute)
	for p.Register(pool.Block{Hash: 8, Local: 8}, pattern(testBlock, 8)) != nil {
		if time.Now().After(deadline) {
			t.Fatal("Puts still fail a minute after the disk has room again")
		}
		time.Sleep(time.Millisecond)
	}
	check(t, returns(t, "Close", p.Close))

	reopened := openDisk(t, dir, 8, pool.SyncFlush, nil)
	if got := reopened.Lookup([]uint64{1, 7, 8}, nil); !slices.Equal(got, []bool{true, false, true}) {
		t.Fatalf("after a reopen, Lookup(1, 7, 8) = %v, want [true false true]", got)
	}
}

// Close on a disk still full returns, and says its flush failed: what
// changed since the last flush is lost, as after a crash. An eviction made
// since comes back at the next open (a valid block, as the design allows);
// the failed Put's block does not.
func TestDiskCloseOnAFullDiskReturnsAnError(t *testing.T) {
	dir := t.TempDir()
	fs := &fullFS{FS: vfs.Default}
	p, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: 2, BlockSize: testBlock}, pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { p.Close() })
	// First, after a failure: a call stuck on the full disk would hold up Close.
	t.Cleanup(func() { fs.full.Store(false) })
	for h := uint64(1); h <= 3; h++ { // 3 evicts 1, durably with its flush
		check(t, p.Register(pool.Block{Hash: h, Local: h}, pattern(testBlock, h)))
	}
	fs.full.Store(true)
	// 9 evicts 2, in the memtable only, and fails.
	if err := returns(t, "Put on a full disk", func() error {
		return p.Register(pool.Block{Hash: 9, Local: 9}, pattern(testBlock, 9))
	}); err == nil {
		t.Fatal("a Put on a full disk succeeded")
	}
	if err := returns(t, "Close on a full disk", p.Close); err == nil {
		t.Fatal("Close on a full disk did not report its failed flush")
	}
	fs.full.Store(false)
	reopened := openDisk(t, dir, 8, pool.SyncFlush, nil)
	if got := reopened.Lookup([]uint64{1, 2, 3, 9}, nil); !slices.Equal(got, []bool{false, true, true, false}) {
		t.Fatalf("after a reopen, Lookup(1, 2, 3, 9) = %v, want [false true true false]", got)
	}
}

// Close documents "Later calls fail with ErrClosed". After a Close on a
// full disk (any Close while the last flush had failed), Put and Register
// failed with "refused until a flush succeeds" instead: the flush refusal
// was checked before the pool's closed state, and nothing clears it once
// the database is closed. Callers that tell shutdown from failure by
// ErrClosed counted a failure.
func TestDiskPutAfterCloseOnAFullDiskFailsWithErrClosed(t *testing.T) {
	fs := &fullFS{FS: vfs.Default}
	p, err := pool.OpenDisk(t.TempDir(), pool.Config{Rank: rank, Capacity: 8, BlockSize: testBlock},
		pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { p.Close() })
	// First, after a failure: a call stuck on the full disk would hold up Close.
	t.Cleanup(func() { fs.full.Store(false) })
	check(t, p.Register(pool.Block{Hash: 1, Local: 1}, pattern(testBlock, 1)))
	fs.full.Store(true)
	if err := returns(t, "Put on a full disk", func() error {
		return p.Register(pool.Block{Hash: 2, Local: 2}, pattern(testBlock, 2))
	}); err == nil {
		t.Fatal("a Put on a full disk succeeded")
	}
	if err := returns(t, "Close on a full disk", p.Close); err == nil {
		t.Fatal("Close on a full disk did not report its failed flush")
	}
	fs.full.Store(false)
	if err := p.Register(pool.Block{Hash: 3, Local: 3}, pattern(testBlock, 3)); !errors.Is(err, pool.ErrClosed) {
		t.Fatalf("Register after Close = %v, want ErrClosed", err)
	}
	if _, err := p.Put([]pool.Block{{Hash: 4, Local: 4}}, [][]byte{pattern(testBlock, 4)}); !errors.Is(err, pool.ErrClosed) {
		t.Fatalf("Put after Close = %v, want ErrClosed", err)
	}
	if err := p.Read(1, make([]byte, testBlock)); !errors.Is(err, pool.ErrClosed) {
		t.Fatalf("Read after Close = %v, want ErrClosed", err)
	}
}

// A Put batch of half a memtable or more is a Pebble "large batch", queued
// for flushing as a memtable of its own (in production, 16 blocks of 2 MiB
// against the 64 MiB memtable). On a full disk it stays queued, and once
// the queue held MemTableStopWritesThreshold (4) memtables' worth, the
// Put's flush (or its commit) waited in Pebble's write stall until a flush
// succeeded, which the flush watch cannot end: the Put never returned
// while the disk stayed full, nor Close behind it. Now no memtable queue
// stalls a write (each Put waits for its own flush), and the Puts fail.
func TestDiskLargePutsOnAFullDiskFailAndCloseReturns(t *testing.T) {
	const bs = 64 << 10 // MemTableSize 1 MiB: a 16-block batch is a large batch
	for _, tc := range []struct {
		name      string
		puts, per uint64
		slow      bool
	}{
		{"one Put of 5 memtables", 1, 80, false},
		{"two concurrent Puts of 2.5 memtables, slow disk", 2, 40, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := &fullFS{FS: vfs.Default}
			p, err := pool.OpenDisk(t.TempDir(), pool.Config{Rank: rank, Capacity: 1024, BlockSize: bs},
				pool.DiskOptions{FS: fs, MemTableSize: 1 << 20})
			check(t, err)
			t.Cleanup(func() { p.Close() })
			// First, after a failure: a call stuck on the full disk would hold up Close.
			t.Cleanup(func() { fs.full.Store(false) })
			check(t, p.Register(pool.Block{Hash: 1, Local: 1}, pattern(bs, 1)))

			fs.full.Store(true)
			fs.slow.Store(tc.slow)
			errs := make([]error, tc.puts)
			check(t, returns(t, "Puts on a full disk", func() error {
				var wg sync.WaitGroup
				for i := range tc.puts {
					wg.Go(func() {
						var blocks []pool.Block
						var data [][]byte
						for h := 100 + 1000*i; h < 100+1000*i+tc.per; h++ {
							blocks = append(blocks, pool.Block{Hash: h, Local: h})
							data = append(data, pattern(bs, h))
						}
						_, errs[i] = p.Put(blocks, data)
					})
				}
				wg.Wait()
				return nil
			}))
			for i, err := range errs {
				if !errors.Is(err, syscall.ENOSPC) {
					t.Fatalf("Put %d on a full disk: %v, want an error wrapping ENOSPC", i, err)
				}
			}
			if err := returns(t, "Close on a full disk", p.Close); err == nil {
				t.Fatal("Close on a full disk did not report its failed flush")
			}
		})
	}
}
