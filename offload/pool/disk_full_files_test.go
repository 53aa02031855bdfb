package pool_test

import (
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/offload/pool"
)

// writeFullFS is the operating system's file system that, while full is
// set, lets a flush create its files (sstables, blob files) but refuses
// every write to them with ENOSPC: what a full ext4 or tmpfs does (the
// create takes an inode, the data finds no room). creates counts the blob
// files created while full.
type writeFullFS struct {
	vfs.FS
	full    atomic.Bool
	creates atomic.Int64
}

func (f *writeFullFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	file, err := f.FS.Create(name, cat)
	if err != nil || !f.full.Load() || !(strings.HasSuffix(name, ".sst") || strings.HasSuffix(name, ".blob")) {
		return file, err
	}
	if strings.HasSuffix(name, ".blob") {
		f.creates.Add(1)
	}
	return &fullWrites{File: file, name: name}, nil
}

// fullWrites refuses every write with ENOSPC.
type fullWrites struct {
	vfs.File
	name string
}

func (f *fullWrites) Write(p []byte) (int, error) {
	return 0, &os.PathError{Op: "write", Path: f.name, Err: syscall.ENOSPC}
}

func (f *fullWrites) WriteAt(p []byte, off int64) (int, error) {
	return 0, &os.PathError{Op: "write", Path: f.name, Err: syscall.ENOSPC}
}

// TestDiskFullDiskLeavesNoEmptyFilesBehind pins that a disk pool on a full
// disk does not fill its directory with the files of Pebble's failed flush
// retries. docs/offload.md: on a full disk "writes to G3 fail and store
// nothing ... until Pebble's retries of the flush succeed; the agent keeps
// serving". Pebble retries a failed flush at once, over and over; each
// retry creates a blob file, and a failed one was left behind, empty, for
// as long as the process ran (only the next open deleted them): with
// kvagent on a 6 MiB tmpfs, 2,806 empty .blob files in 16 s, about 100 a
// second, on a real disk full for an hour hundreds of thousands of inodes,
// and still there after the disk had room and flushes succeeded again.
func TestDiskFullDiskLeavesNoEmptyFilesBehind(t *testing.T) {
	const bs = 4096 // over the value separation's 1 KiB: the bytes go to blob files
	dir := t.TempDir()
	fs := &writeFullFS{FS: vfs.Default}
	p, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: 64, BlockSize: bs}, pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { p.Close() })
	t.Cleanup(func() { fs.full.Store(false) })
	check(t, p.Register(pool.Block{Hash: 1, Local: 1}, pattern(bs, 1)))

	fs.full.Store(true)
	if err := returns(t, "Put on a full disk", func() error {
		return p.Register(pool.Block{Hash: 7, Local: 7}, pattern(bs, 7))
	}); err == nil {
		t.Fatal("a Put on a full disk succeeded")
	}
	// Let Pebble retry the flush a while.
	deadline := time.Now().Add(time.Minute)
	for fs.creates.Load() < 200 {
		if time.Now().After(deadline) {
			t.Fatalf("Pebble created %d blob files in a minute of retries, want 200", fs.creates.Load())
		}
		time.Sleep(time.Millisecond)
	}
	fs.full.Store(false)
	deadline = time.Now().Add(time.Minute)
	for h := uint64(8); p.Register(pool.Block{Hash: h, Local: h}, pattern(bs, h)) != nil; {
		if time.Now().After(deadline) {
			t.Fatal("Puts still fail a minute after the disk has room again")
		}
		time.Sleep(time.Millisecond)
	}
	for h := uint64(9); h < 12; h++ { // more successful flushes, for any cleanup they do
		check(t, p.Register(pool.Block{Hash: h, Local: h}, pattern(bs, h)))
	}
	var empty, blobs int
	deadline = time.Now().Add(3 * time.Second)
	for {
		ents, err := os.ReadDir(dir)
		check(t, err)
		empty, blobs = 0, 0
		for _, e := range ents {
			if !strings.HasSuffix(e.Name(), ".blob") {
				continue
			}
			blobs++
			if info, err := e.Info(); err == nil && info.Size() == 0 {
				empty++
			}
		}
		if empty <= 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if empty > 2 {
		t.Fatalf("after %d flush retries on a full disk and flushes that succeeded since: %s holds %d blob files, %d of them empty; want none left behind",
			fs.creates.Load(), dir, blobs, empty)
	}
}
