package pool

import (
	"bytes"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// manifestFullFS refuses every write to a MANIFEST with ENOSPC: the open
// of a pool on a full disk, which writes a new MANIFEST.
type manifestFullFS struct{ vfs.FS }

func (f manifestFullFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	file, err := f.FS.Create(name, cat)
	if err != nil || !strings.HasPrefix(f.PathBase(name), "MANIFEST-") {
		return file, err
	}
	return manifestFull{File: file, name: name}, nil
}

type manifestFull struct {
	vfs.File
	name string
}

func (f manifestFull) Write(p []byte) (int, error) {
	return 0, &os.PathError{Op: "write", Path: f.name, Err: syscall.ENOSPC}
}

// exited is what the test's fatalExit panics with.
type exited int

// TestOpenOnAFullDiskExitsWithOneLine pins that a pool opened on a disk
// still full (docs/operations.md: "a restart on a disk still full may fail
// to open the pool") ends the process with status 1 after one error line
// that names the directory and the cause, instead of Pebble's Fatalf
// panicking with a stack trace ("panic: pebble fatal: MANIFEST flush
// failed: ... no space left on device", then a goroutine dump).
func TestOpenOnAFullDiskExitsWithOneLine(t *testing.T) {
	old := fatalExit
	fatalExit = func(code int) { panic(exited(code)) }
	t.Cleanup(func() { fatalExit = old })

	dir := t.TempDir()
	var log bytes.Buffer
	cfg := Config{Capacity: 8, BlockSize: 4096, Logger: slog.New(slog.NewTextHandler(&log, nil))}
	code := func() (code exited) {
		defer func() {
			r := recover()
			if c, ok := r.(exited); ok {
				code = c
				return
			}
			if r != nil {
				t.Fatalf("open on a full disk panicked: %v\nlog:\n%s", r, log.String())
			}
		}()
		p, err := OpenDisk(dir, cfg, DiskOptions{FS: manifestFullFS{vfs.Default}})
		if err == nil {
			p.Close()
		}
		t.Fatalf("open on a full disk returned (%v) instead of exiting", err)
		return -1
	}()
	if code != 1 {
		t.Fatalf("open on a full disk exited with %d, want 1", code)
	}
	lines := strings.Split(strings.TrimSpace(log.String()), "\n")
	var fatal []string
	for _, l := range lines {
		if strings.Contains(l, "level=ERROR") {
			fatal = append(fatal, l)
		}
	}
	if len(fatal) != 1 {
		t.Fatalf("%d error lines, want 1:\n%s", len(fatal), log.String())
	}
	for _, want := range []string{"dir=" + dir, `cause="disk full"`, "no space left on device", "exiting"} {
		if !strings.Contains(fatal[0], want) {
			t.Errorf("the error line %q does not say %q", fatal[0], want)
		}
	}
}
