package pool_test

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/internal/testtmpfs"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// From a review: a disk pool of blocks under value separation's 1 KiB
// (--block-bytes 512: the bytes stay inline in the sstables) on a disk that
// fills. DESIGN.md ("Damage Pebble reports is an error") holds that on a
// full disk "flushes, which write the blocks' bytes where a compaction
// writes only keys, fail first, so Puts fail rather than pile onto L0",
// and docs/offload.md that writes to G3 then fail and "the agent keeps
// serving, and stops when asked". With inline bytes a flush (one Put's
// few KiB) still fits where a compaction of L0 (all of it, merged) does
// not: every compaction fails for want of room, the Puts' flushes go on
// succeeding, L0 reaches Pebble's L0StopWritesThreshold (12 files) and
// Pebble stalls every write: the Put waits in DB.AsyncFlush
// (maybeInduceWriteStall) for ever, and Close behind it.
func TestDiskPutOfSmallBlocksOnAFillingDiskReturns(t *testing.T) {
	const bs = 512
	dir := t.TempDir()
	testtmpfs.Mount(t, dir, "4m")
	// Room to give back if a Put hangs, so that the test can end.
	filler := filepath.Join(dir, "filler")
	check(t, os.WriteFile(filler, make([]byte, 1<<20), 0o600))
	db := filepath.Join(dir, "pool")
	var log testlog.Buffer
	p, err := pool.OpenDisk(db, pool.Config{Rank: rank, Capacity: 1 << 20, BlockSize: bs, Sink: newSink(t),
		Logger: slog.New(slog.NewTextHandler(&log, nil))}, pool.DiskOptions{})
	check(t, err)
	t.Cleanup(func() { os.Remove(filler); p.Close() })

	h := uint64(1)
	fails := 0
	for i := 0; i < 3000 && fails < 200; i++ {
		blocks := make([]pool.Block, 16)
		data := make([][]byte, 16)
		for j := range blocks {
			blocks[j] = pool.Block{Hash: h, Local: h}
			data[j] = pattern(bs, h)
			h++
		}
		done := make(chan error, 1)
		go func() { _, err := p.Put(blocks, data); done <- err }()
		select {
		case err := <-done:
			if err != nil {
				fails++
			}
		case <-time.After(30 * time.Second):
			closed := make(chan error, 1)
			go func() { closed <- p.Close() }()
			closeHangs := "returned"
			select {
			case <-closed:
			case <-time.After(10 * time.Second):
				closeHangs = "did not return in 10 s either"
			}
			os.Remove(filler) // let the compactions through, and the Put and Close return
			<-done
			t.Fatalf("Put #%d (after %d blocks stored, %d Puts failed) did not return in 30 s on the full disk: "+
				"Pebble stalls writes (L0 file count limit: every compaction fails for want of room); Close %s.\nlog:\n%s",
				i, p.Stats().Used, fails, closeHangs, log.String())
		}
	}
	if fails == 0 {
		t.Fatalf("the disk never filled: %d blocks stored", p.Stats().Used)
	}
	if err := p.Close(); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Logf("close: %v", err)
	}
}
