package pool_test

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// crashNoReuseFS recycles a WAL file by removing it and creating the new
// one (see store's noReuseFS: the crashable MemFS deadlocks a CrashClone
// against ReuseForWrite's Rename).
type crashNoReuseFS struct{ vfs.FS }

func (f crashNoReuseFS) ReuseForWrite(oldname, newname string, category vfs.DiskWriteCategory) (vfs.File, error) {
	if err := f.FS.Remove(oldname); err != nil {
		return nil, err
	}
	return f.FS.Create(newname, category)
}

const crashBlock = 2048 // over the 1 KiB value separation threshold: bytes in blob files

func openCrashDisk(t *testing.T, fs vfs.FS, mode pool.SyncMode, capacity int, s pool.Sink) (*pool.DiskPool, error) {
	t.Helper()
	return pool.OpenDisk("pool", pool.Config{Rank: rank, Capacity: capacity, BlockSize: crashBlock, Sink: s},
		pool.DiskOptions{Sync: mode, FS: crashNoReuseFS{fs}, MemTableSize: 256 << 10, Identity: "crash-test"})
}

// A crash (power loss: the unsynced part of every file kept or lost at
// random) between any two operations must reopen to a pool whose every
// block reads back its own bytes, that holds every block advertised at the
// crash, and that restores nothing never stored. Under SyncWAL it fails
// when a Put's batch is committed without a sync of the log.
func TestDiskCrashReopensToReadableAdvertisedBlocks(t *testing.T) {
	ops := 500
	if os.Getenv("KVROUTER_LONG") != "" {
		ops = 20000 // make test-long
	}
	for _, mode := range syncModes() {
		t.Run(mode.String(), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(testseed.Seed(t), uint64(mode)))
			fs := vfs.NewCrashableMem()
			s := newSink(t)
			const capacity = 12
			p, err := openCrashDisk(t, fs, mode, capacity, s)
			check(t, err)
			defer func() { p.Close() }()
			ever := map[uint64]bool{}
			next := uint64(1)
			for op := range ops {
				switch r := rng.IntN(10); {
				case r < 6: // a Put of a short chain, maybe under an existing block
					parent := uint64(0)
					if held := heldNow(s.evs); len(held) > 0 && rng.IntN(2) == 0 {
						parent = held[rng.IntN(len(held))]
					}
					n := 1 + rng.IntN(4)
					var bs []pool.Block
					var data [][]byte
					for range n {
						h := next
						if rng.IntN(4) == 0 && next > 4 { // again, a hash maybe evicted
							h = 1 + rng.Uint64N(next-1)
						} else {
							next++
						}
						if h == parent || slices.ContainsFunc(bs, func(b pool.Block) bool { return b.Hash == h }) {
							continue
						}
						bs = append(bs, pool.Block{Hash: h, Parent: parent, Local: h})
						data = append(data, pattern(crashBlock, h))
						ever[h] = true
						parent = h
					}
					// ErrFull or ErrInvalid (a loop) are fine; a refusal
					// for a deep L0 (synced flushes outrunning compactions,
					// under -race) is tried again, or the run would cover
					// far fewer stored blocks than its ops say.
					_, err := p.Put(bs, data)
					for deadline := time.Now().Add(time.Minute); errors.Is(err, pool.ErrL0Deep) && time.Now().Before(deadline); {
						time.Sleep(time.Millisecond)
						_, err = p.Put(bs, data)
					}
					if errors.Is(err, pool.ErrL0Deep) {
						t.Fatalf("op %d: put still refused after a minute: %v", op, err)
					}
				case r < 8:
					held := heldNow(s.evs)
					if len(held) > 0 {
						h := held[rng.IntN(len(held))]
						buf := make([]byte, crashBlock)
						if err := p.Read(h, buf); err != nil {
							t.Fatalf("op %d: read %#x: %v", op, h, err)
						}
					}
				case r < 9: // a clean restart
					check(t, p.Close())
					s.take()
					if p, err = openCrashDisk(t, fs, mode, capacity, s); err != nil {
						t.Fatalf("op %d: reopen: %v", op, err)
					}
					evs, _ := p.Dump()
					s.evs = evs
				default:
					unsynced := []int{0, 10, 50, 90, 100}[rng.IntN(5)]
					img := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 2))})
					if err := checkCrashImage(t, img, mode, capacity, heldNow(s.evs), ever); err != nil {
						t.Fatalf("crash after op %d (unsynced kept %d%%): %v", op, unsynced, err)
					}
				}
			}
		})
	}
}

func checkCrashImage(t *testing.T, img *vfs.MemFS, mode pool.SyncMode, capacity int, held []uint64, ever map[uint64]bool) error {
	q, err := openCrashDisk(t, img, mode, capacity, nil)
	if err != nil {
		return fmt.Errorf("reopen: %w", err)
	}
	defer q.Close()
	evs, _ := q.Dump()
	got := heldNow(evs)
	for _, h := range held {
		if !slices.Contains(got, h) {
			return fmt.Errorf("block %#x, advertised at the crash, not restored (restored %v, advertised %v)", h, got, held)
		}
	}
	buf := make([]byte, crashBlock)
	for _, h := range got {
		if !ever[h] {
			return fmt.Errorf("restored %#x, never stored", h)
		}
		if err := q.Read(h, buf); err != nil {
			return fmt.Errorf("restored %#x does not read back: %w", h, err)
		}
		if !bytes.Equal(buf, pattern(crashBlock, h)) {
			return fmt.Errorf("restored %#x reads back other bytes", h)
		}
	}
	return nil
}

// heldNow is what a subscriber of evs takes the pool to hold, events
// applied in order (a hash stored again after its REMOVE is held).
func heldNow(evs []kvevent.Event) []uint64 {
	held := map[uint64]bool{}
	for _, ev := range evs {
		switch ev.Kind {
		case kvevent.KindStored:
			for _, b := range ev.Blocks {
				held[b.EngineHash] = true
			}
		case kvevent.KindRemoved:
			for _, h := range ev.Removed {
				delete(held, h)
			}
		}
	}
	return slices.Sorted(maps.Keys(held))
}

// Concurrent Puts share flushes (group commit): a Put returns without a
// flush of its own when one that started after its commit succeeded. A
// crash image taken at any moment must hold every block whose Put had
// returned nil before the image was taken: it fails when a flush counts
// as durable the batches committed while it ran (flushed read after the
// flush instead of before it).
func TestDiskCrashDuringConcurrentPutsKeepsEveryAcknowledgedBlock(t *testing.T) {
	fs := vfs.NewCrashableMem()
	const writers = 4
	per := 80
	if os.Getenv("KVROUTER_LONG") != "" {
		per = 1000 // make test-long
	}
	// Slow flushes (2 ms to create a file) widen the window in which
	// Puts commit while another Put's flush runs.
	slow := errorfs.Wrap(fs, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind == errorfs.OpCreate && (strings.HasSuffix(op.Path, ".blob") || strings.HasSuffix(op.Path, ".sst")) {
			time.Sleep(2 * time.Millisecond)
		}
		return nil
	}))
	p, err := openCrashDisk(t, slow, pool.SyncFlush, writers*per+1, nil)
	check(t, err)
	defer p.Close()
	var mu sync.Mutex
	acked := map[uint64]bool{}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range per {
				h := uint64(w*per + i + 1)
				// A refusal for a deep L0 (four writers' synced flushes
				// outrun compactions on a slow machine, under -race) is
				// no acknowledgement: the Put is tried again until
				// compactions catch up.
				deadline := time.Now().Add(time.Minute)
				err := p.Register(pool.Block{Hash: h, Local: h}, pattern(crashBlock, h))
				for errors.Is(err, pool.ErrL0Deep) && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
					err = p.Register(pool.Block{Hash: h, Local: h}, pattern(crashBlock, h))
				}
				if err != nil {
					t.Errorf("register %#x: %v", h, err)
					return
				}
				mu.Lock()
				acked[h] = true
				mu.Unlock()
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for n := 0; ; n++ {
		select {
		case <-done:
			return
		default:
		}
		mu.Lock()
		want := slices.Sorted(maps.Keys(acked))
		mu.Unlock()
		img := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: 0})
		q, err := openCrashDisk(t, img, pool.SyncFlush, writers*per+1, nil)
		if err != nil {
			t.Fatalf("image %d: reopen: %v", n, err)
		}
		got := q.Lookup(want, nil)
		q.Close()
		for i, ok := range got {
			if !ok {
				wg.Wait()
				t.Fatalf("image %d: block %#x, its Put returned nil before the crash, is not on disk", n, want[i])
			}
		}
	}
}
