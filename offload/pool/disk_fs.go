package pool

import (
	"strings"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// failedBlobsFS is the file system the disk pool gives Pebble: fs, except
// that a blob file one of whose writes or syncs failed is removed once
// Pebble closes it.
//
// Pebble (v2.1) leaves such a file behind. A flush writes a memtable's
// block bytes to a new blob file; when a write to it fails (a full disk:
// ENOSPC), the flush fails, deletes its sstable, and is retried at once,
// over and over, each retry with a new blob file; the blob file of a failed
// one is closed (Abort) but not deleted, and stays, empty or half written,
// until the next open deletes the files no version holds: on a full disk a
// hundred files a second, hundreds of thousands of inodes in an hour, still
// there once flushes succeed again.
//
// Removing it is safe: Pebble never refers to such a file. A blob file's
// writes go through objstorage's buffered writable, whose first failed
// write or sync (bufio's error is sticky, the syncing file returns its
// SyncTo's) fails the blob writer's Close, and a flush or compaction
// records a blob file, in its result and so in a version, only after that
// Close succeeded (writeNewBlobFiles.FinishOutput); a blob-file rewrite
// whose output fails deletes that output itself, where a file already gone
// is no error to Pebble's deletion. Only blob files are watched: a failed
// sstable is deleted by Pebble, a failed WAL or MANIFEST write ends the
// process (Fatalf), and other files are not Pebble's objects.
type failedBlobsFS struct {
	vfs.FS
}

func (f failedBlobsFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	file, err := f.FS.Create(name, cat)
	if err != nil || !strings.HasSuffix(name, ".blob") {
		return file, err
	}
	return &blobFile{File: file, fs: f.FS, name: name}, nil
}

// A blobFile is a blob file being written: once a write or sync of it
// failed, closing it removes it.
type blobFile struct {
	vfs.File
	fs     vfs.FS
	name   string
	failed atomic.Bool
}

func (b *blobFile) fail(err error) {
	if err != nil {
		b.failed.Store(true)
	}
}

func (b *blobFile) Write(p []byte) (int, error) {
	n, err := b.File.Write(p)
	b.fail(err)
	return n, err
}

func (b *blobFile) WriteAt(p []byte, off int64) (int, error) {
	n, err := b.File.WriteAt(p, off)
	b.fail(err)
	return n, err
}

func (b *blobFile) Sync() error {
	err := b.File.Sync()
	b.fail(err)
	return err
}

func (b *blobFile) SyncData() error {
	err := b.File.SyncData()
	b.fail(err)
	return err
}

func (b *blobFile) SyncTo(length int64) (bool, error) {
	full, err := b.File.SyncTo(length)
	b.fail(err)
	return full, err
}

func (b *blobFile) Close() error {
	err := b.File.Close()
	if b.failed.Load() {
		// Pebble holds no reference to it (see failedBlobsFS); a removal
		// that fails leaves it to the next open's cleanup, as before.
		_ = b.fs.Remove(b.name)
	}
	return err
}
