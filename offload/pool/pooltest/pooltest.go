// Package pooltest damages a disk pool's files under it, as a failing
// disk would, for the tests of the pool and of what uses it. It is for
// tests only.
package pooltest

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Rot flips one byte in the first data block of each sstable in dir (a
// DiskPool's Dir) that is not in done yet, under the open pool, as bit rot
// would, and adds it to done. An sstable still being written (under 200
// bytes) or gone meanwhile is left for a later call.
func Rot(t testing.TB, dir string, done map[string]bool) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil || !strings.HasSuffix(e.Name(), ".sst") || fi.Size() < 200 || done[e.Name()] {
			continue // (gone, or being written: not yet whole)
		}
		f, err := os.OpenFile(filepath.Join(dir, e.Name()), os.O_RDWR, 0)
		if errors.Is(err, os.ErrNotExist) {
			continue // compacted away meanwhile
		}
		if err != nil {
			t.Fatal(err)
		}
		b := make([]byte, 1)
		if _, err := f.ReadAt(b, 60); err != nil {
			t.Fatal(err)
		}
		b[0] ^= 0xff
		if _, err := f.WriteAt(b, 60); err != nil {
			t.Fatal(err)
		}
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		done[e.Name()] = true
	}
}
