package diskfree_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/internal/diskfree"
	"golang.org/x/sys/unix"
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

// TestRoomOfTellsFileSystemsApartThroughALink: a directory on another file
// system (/dev/shm's tmpfs, where it is one) has another Device, and a
// symbolic link to it (a dp<rank> linked to another disk) has the target's
// Device, not the link's parent's. A Room of a constant Device, or of
// lstat's (the link's own), passed the other tests.
func TestRoomOfTellsFileSystemsApartThroughALink(t *testing.T) {
	var a, b unix.Stat_t
	if unix.Stat(os.TempDir(), &a) != nil || unix.Stat("/dev/shm", &b) != nil || a.Dev == b.Dev {
		t.Skip("no /dev/shm on a file system other than the temp dir's")
	}
	other, err := os.MkdirTemp("/dev/shm", "diskfree-test-")
	if err != nil {
		t.Skipf("/dev/shm is not writable here: %v", err)
	}
	t.Cleanup(func() { os.RemoveAll(other) })
	dir := t.TempDir()
	here, err := diskfree.RoomOf(dir)
	if err != nil {
		t.Fatal(err)
	}
	there, err := diskfree.RoomOf(other)
	if err != nil {
		t.Fatal(err)
	}
	if here.Device == there.Device {
		t.Fatalf("RoomOf(%s) and RoomOf(%s), on two file systems: one Device %d", dir, other, here.Device)
	}
	link := filepath.Join(dir, "dp0")
	if err := os.Symlink(other, link); err != nil {
		t.Fatal(err)
	}
	got, err := diskfree.RoomOf(link)
	if err != nil || got.Device != there.Device {
		t.Fatalf("RoomOf(a link to %s) = %+v, %v; want its target's device %d (the link's parent is on %d)", other, got, err, there.Device, here.Device)
	}
}
