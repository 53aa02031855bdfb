//go:build linux

// Package testtmpfs gives tests a small disk that fills: a tmpfs mounted
// on a directory, and a file that fills it. Mounting needs root; a test
// run without it (or where the mount is refused) is skipped, saying why.
package testtmpfs

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Mount mounts a tmpfs of size (mount(8)'s size=, "64m") on dir, made if
// missing, and unmounts it when the test ends. It skips the test when the
// process is not root or the mount is refused.
func Mount(t testing.TB, dir, size string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size="+size); err != nil {
		t.Skipf("mount a tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
}

// Fill writes dir/filler until the volume has no room left (ENOSPC) and
// returns its path: removing it gives the room back.
func Fill(t testing.TB, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "filler")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 4096)
	for {
		_, err := f.Write(buf)
		if errors.Is(err, syscall.ENOSPC) {
			return path
		}
		if err != nil {
			t.Fatalf("fill %s: %v", dir, err)
		}
	}
}
