package pool

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/internal/testseed"
)

// setBatchLimit lowers maxBatchBytes to k blocks of internalBlock bytes and
// records the size of each batch a Put commits.
func setBatchLimit(t *testing.T, k int, fail func(n int) error) *[]int {
	t.Helper()
	sizes := new([]int)
	limit := maxBatchBytes
	maxBatchBytes = k * putBatchBytes(internalBlock)
	testHookCommitBatch = func(b *pebble.Batch) error {
		*sizes = append(*sizes, b.Len())
		if fail != nil {
			return fail(len(*sizes))
		}
		return nil
	}
	t.Cleanup(func() { maxBatchBytes, testHookCommitBatch = limit, nil })
	return sizes
}

func internalBlocks(n int) ([]Block, [][]byte) {
	var bs []Block
	var data [][]byte
	for h := uint64(1); h <= uint64(n); h++ {
		bs = append(bs, Block{Hash: h, Local: h})
		data = append(data, bytes.Repeat([]byte{byte(h)}, internalBlock))
	}
	return bs, data
}

// A Put whose batch reaches Pebble's limit (4 GiB: Batch.grow panics with
// ErrBatchTooLarge, after reserveAll, leaving the reservations pending) is
// written in batches under maxBatchBytes, here three blocks' worth: every
// block is stored, reads back and is restored by a reopen.
func TestDiskPutOverTheBatchLimitIsWrittenInSeveralBatches(t *testing.T) {
	for _, mode := range []SyncMode{SyncFlush, SyncWAL} {
		t.Run(mode.String(), func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pool")
			cfg := Config{Capacity: 16, BlockSize: internalBlock}
			p, err := OpenDisk(dir, cfg, DiskOptions{Sync: mode})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { p.Close() }()
			sizes := setBatchLimit(t, 3, nil)
			bs, data := internalBlocks(10)
			if n, err := p.Put(bs, data); n != 10 || err != nil {
				t.Fatalf("Put of 10 blocks: %d, %v", n, err)
			}
			if len(*sizes) != 4 {
				t.Errorf("Put of 10 blocks, 3 to a batch: %d batches %v, want 4", len(*sizes), *sizes)
			}
			for _, n := range *sizes {
				if n > maxBatchBytes {
					t.Errorf("a batch of %d bytes, over the limit %d", n, maxBatchBytes)
				}
			}
			if st := p.Stats(); st.Used != 10 || st.Pending != 0 {
				t.Fatalf("stats %+v", st)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if p, err = OpenDisk(dir, cfg, DiskOptions{Sync: mode}); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, internalBlock)
			for i, b := range bs {
				if err := p.Read(b.Hash, buf); err != nil || !bytes.Equal(buf, data[i]) {
					t.Fatalf("reopened: read %#x: %v (bytes equal: %v)", b.Hash, err, bytes.Equal(buf, data[i]))
				}
			}
		})
	}
}

// A Put written in several batches fails as a whole when one of them
// does: it stores nothing, leaves nothing pending, and the blocks of the
// batches written before do not come back at the next open.
func TestDiskPutWhoseLaterBatchFailsStoresNothing(t *testing.T) {
	errDisk := errors.New("the disk says no")
	dir := filepath.Join(t.TempDir(), "pool")
	cfg := Config{Capacity: 16, BlockSize: internalBlock}
	p, err := OpenDisk(dir, cfg, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { p.Close() }()
	setBatchLimit(t, 3, func(n int) error {
		if n == 2 {
			return errDisk
		}
		return nil
	})
	bs, data := internalBlocks(10)
	if n, err := p.Put(bs, data); n != 0 || !errors.Is(err, errDisk) {
		t.Fatalf("Put whose second batch fails: %d, %v", n, err)
	}
	if st := p.Stats(); st.Used != 0 || st.Pending != 0 {
		t.Fatalf("stats %+v, want nothing held or pending", st)
	}
	if got := p.Lookup([]uint64{1, 2, 3}, nil); fmt.Sprint(got) != "[false false false]" {
		t.Fatalf("blocks of the batch written before the failure held: %v", got)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	testHookCommitBatch = nil
	if p, err = OpenDisk(dir, cfg, DiskOptions{}); err != nil {
		t.Fatal(err)
	}
	if st := p.Stats(); st.Used != 0 {
		t.Fatalf("reopened: %d blocks restored, want none", st.Used)
	}
}

// A block too large for a batch of its own is refused before anything is
// reserved.
func TestDiskPutOfABlockOverTheBatchLimitIsRefused(t *testing.T) {
	p := openInternal(t, filepath.Join(t.TempDir(), "pool"), nil)
	defer p.Close()
	limit := maxBatchBytes
	maxBatchBytes = internalBlock
	t.Cleanup(func() { maxBatchBytes = limit })
	bs, data := internalBlocks(1)
	if n, err := p.Put(bs, data); n != 0 || !errors.Is(err, ErrInvalid) {
		t.Fatalf("Put of a block over the batch limit: %d, %v, want ErrInvalid", n, err)
	}
	if st := p.Stats(); st.Used != 0 || st.Pending != 0 {
		t.Fatalf("stats %+v, want nothing held or pending", st)
	}
}

// noReuseCrashFS recycles a WAL file by removing it and creating the new
// one (see disk_crash_test.go's crashNoReuseFS: the crashable MemFS
// deadlocks a CrashClone against ReuseForWrite's Rename).
type noReuseCrashFS struct{ vfs.FS }

func (f noReuseCrashFS) ReuseForWrite(oldname, newname string, category vfs.DiskWriteCategory) (vfs.File, error) {
	if err := f.FS.Remove(oldname); err != nil {
		return nil, err
	}
	return f.FS.Create(newname, category)
}

// A crash that cuts a Put off between its batches (its call never
// returned) reopens to the blocks of the batches written before: durable
// under either SyncMode, each whole, with its own bytes, and every block
// the reopened pool advertises reads back; nothing of the batches not yet
// written comes back. A crash image is taken as each batch is about to be
// committed.
func TestDiskPutCutOffByACrashBetweenItsBatchesRestoresWholeBlocks(t *testing.T) {
	const block = 2048 // over the 1 KiB value separation threshold: bytes in blob files
	for _, mode := range []SyncMode{SyncFlush, SyncWAL} {
		t.Run(mode.String(), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(testseed.Seed(t), uint64(mode)))
			mem := vfs.NewCrashableMem()
			open := func(fs vfs.FS) (*DiskPool, error) {
				return OpenDisk("pool", Config{Capacity: 16, BlockSize: block},
					DiskOptions{Sync: mode, FS: noReuseCrashFS{fs}, MemTableSize: 256 << 10})
			}
			p, err := open(mem)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { p.Close() }()
			var bs []Block
			var data [][]byte
			var parent uint64
			for h := uint64(1); h <= 10; h++ {
				b := make([]byte, block)
				for i := range b {
					b[i] = byte(rng.Uint32())
				}
				bs, data = append(bs, Block{Hash: h, Parent: parent, Local: h}), append(data, b)
				parent = h
			}
			var images []*vfs.MemFS
			var unsynced []int
			limit := maxBatchBytes
			maxBatchBytes = 3 * putBatchBytes(block)
			testHookCommitBatch = func(*pebble.Batch) error {
				u := []int{0, 50, 100}[rng.IntN(3)]
				unsynced = append(unsynced, u)
				images = append(images, mem.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: u, RNG: rand.New(rand.NewPCG(rng.Uint64(), 2))}))
				return nil
			}
			t.Cleanup(func() { maxBatchBytes, testHookCommitBatch = limit, nil })
			if n, err := p.Put(bs, data); n != 10 || err != nil {
				t.Fatalf("Put of 10 blocks: %d, %v", n, err)
			}
			testHookCommitBatch = nil
			if len(images) != 4 {
				t.Fatalf("%d batches, want 4 (3 blocks to a batch)", len(images))
			}
			buf := make([]byte, block)
			for k, img := range images {
				q, err := open(img)
				if err != nil {
					t.Fatalf("crash before batch %d (unsynced kept %d%%): reopen: %v", k+1, unsynced[k], err)
				}
				evs, _ := q.Dump()
				var got []uint64
				for _, ev := range evs {
					for _, b := range ev.Blocks {
						got = append(got, b.EngineHash)
					}
				}
				slices.Sort(got)
				var want []uint64
				for h := uint64(1); h <= uint64(3*k); h++ {
					want = append(want, h)
				}
				if !slices.Equal(got, want) {
					q.Close()
					t.Fatalf("crash before batch %d (unsynced kept %d%%): restored %v, want the blocks of the batches before, %v",
						k+1, unsynced[k], got, want)
				}
				for _, h := range got {
					if err := q.Read(h, buf); err != nil || !bytes.Equal(buf, data[h-1]) {
						q.Close()
						t.Fatalf("crash before batch %d: restored %#x: read %v (its own bytes: %v)", k+1, h, err, bytes.Equal(buf, data[h-1]))
					}
				}
				if err := q.Close(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}
