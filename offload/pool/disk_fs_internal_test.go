package pool

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// syncFailsFS fails every Sync, SyncData and SyncTo of its files with EIO.
type syncFailsFS struct{ vfs.FS }

func (f syncFailsFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	file, err := f.FS.Create(name, cat)
	if err != nil {
		return nil, err
	}
	return syncFails{File: file, name: name}, nil
}

type syncFails struct {
	vfs.File
	name string
}

func (f syncFails) err(op string) error { return &os.PathError{Op: op, Path: f.name, Err: syscall.EIO} }

func (f syncFails) Sync() error                { return f.err("sync") }
func (f syncFails) SyncData() error            { return f.err("fdatasync") }
func (f syncFails) SyncTo(int64) (bool, error) { return false, f.err("sync_file_range") }

// TestABlobFileWhoseSyncFailedIsRemoved pins failedBlobsFS on syncs: a
// blob file one of whose Sync, SyncData or SyncTo failed (its writes all
// succeeded) is removed once closed, as one of whose writes failed is
// (TestDiskFullDiskLeavesNoEmptyFilesBehind): Pebble's flush fails on the
// sync as on a write and never refers to the file. A blob file whose syncs
// succeeded, and a file that is not a blob file, stay.
func TestABlobFileWhoseSyncFailedIsRemoved(t *testing.T) {
	mem := vfs.NewMem()
	fs := failedBlobsFS{syncFailsFS{mem}}
	syncs := []struct {
		name string
		sync func(vfs.File) error
	}{
		{"Sync", func(f vfs.File) error { return f.Sync() }},
		{"SyncData", func(f vfs.File) error { return f.SyncData() }},
		{"SyncTo", func(f vfs.File) error { _, err := f.SyncTo(4); return err }},
	}
	for i, s := range syncs {
		for _, name := range []string{fmt.Sprintf("%06d.blob", i+1), fmt.Sprintf("%06d.sst", i+1)} {
			f, err := fs.Create(name, vfs.WriteCategoryUnspecified)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.Write([]byte("blob")); err != nil {
				t.Fatalf("%s: write: %v", name, err)
			}
			if err := s.sync(f); !errors.Is(err, syscall.EIO) {
				t.Fatalf("%s: %s: %v, want the injected EIO", name, s.name, err)
			}
			if err := f.Close(); err != nil {
				t.Fatalf("%s: close: %v", name, err)
			}
			_, err = mem.Stat(name)
			switch blob := name[len(name)-5:] == ".blob"; {
			case blob && !errors.Is(err, os.ErrNotExist):
				t.Errorf("blob file %s, whose %s failed, is still there after its close (stat: %v): want it removed", name, s.name, err)
			case !blob && err != nil:
				t.Errorf("%s, not a blob file, is gone after a failed %s: %v; want it left to Pebble", name, s.name, err)
			}
		}
	}
	ok := failedBlobsFS{mem}
	f, err := ok.Create("000009.blob", vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("blob")); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := mem.Stat("000009.blob"); err != nil {
		t.Errorf("a blob file whose writes and syncs succeeded is gone after its close: %v", err)
	}
}

// TestFatalCauseNamesEachCause pins fatalCause's names of the errors
// among a Fatalf's arguments, wrapped as Pebble wraps them: ENOSPC and
// EDQUOT (a quota reached) are a full disk, EIO an I/O error, and other
// errors, or none, no cause.
func TestFatalCauseNamesEachCause(t *testing.T) {
	wrap := func(e syscall.Errno) error {
		return fmt.Errorf("MANIFEST flush failed: %w", &os.PathError{Op: "write", Path: "MANIFEST-000001", Err: e})
	}
	for _, c := range []struct {
		args []any
		want string
	}{
		{[]any{wrap(syscall.ENOSPC)}, "disk full"},
		{[]any{wrap(syscall.EDQUOT)}, "disk full"},
		{[]any{wrap(syscall.EIO)}, "I/O error"},
		{[]any{"not an error", 3, wrap(syscall.EIO)}, "I/O error"},
		{[]any{wrap(syscall.EACCES)}, ""},
		{[]any{errors.New("pebble: invariant violated")}, ""},
		{[]any{"MANIFEST-000001"}, ""},
		{nil, ""},
	} {
		if got := fatalCause(c.args); got != c.want {
			t.Errorf("fatalCause(%v) = %q, want %q", c.args, got, c.want)
		}
	}
}
