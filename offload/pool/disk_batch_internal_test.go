package pool

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/cockroachdb/pebble/v2"
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
