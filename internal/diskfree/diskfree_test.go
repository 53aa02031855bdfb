package diskfree_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/internal/diskfree"
)

func TestAvailableOfATempDirIsSomeBytesAndOfNoDirAnError(t *testing.T) {
	if n, err := diskfree.Available(t.TempDir()); err != nil || n == 0 {
		t.Fatalf("Available(a temp dir) = %d, %v; want some bytes", n, err)
	}
	if _, err := diskfree.Available(t.TempDir() + "/missing"); err == nil {
		t.Fatal("Available(a missing dir) answered no error")
	}
}

// Two directories of one file system have one Device; a missing one is an
// error, not a Room of device 0.
func TestRoomOfTwoDirsOfOneFileSystemIsOneDevice(t *testing.T) {
	dir := t.TempDir()
	a, err := diskfree.RoomOf(dir)
	if err != nil || a.Available == 0 {
		t.Fatalf("RoomOf(a temp dir) = %+v, %v; want some bytes", a, err)
	}
	sub := filepath.Join(dir, "dp0")
	if err := os.Mkdir(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	if b, err := diskfree.RoomOf(sub); err != nil || b.Device != a.Device {
		t.Fatalf("RoomOf(a subdirectory) = %+v, %v; want device %d, its parent's", b, err, a.Device)
	}
	if _, err := diskfree.RoomOf(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("RoomOf(a missing dir) answered no error")
	}
}
