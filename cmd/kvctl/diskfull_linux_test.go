package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestSnapshotSaveOnAFullDisk: review rvS5. kvctl snapshot save to a
// volume with no room: exit 1 naming the disk's error, no .part left.
func TestSnapshotSaveOnAFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	c := newCluster(t)
	c.registerWorkers(t)
	dir := t.TempDir()
	if err := syscall.Mount("tmpfs", dir, "tmpfs", 0, "size=64k"); err != nil {
		t.Skipf("mount: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(dir, 0) })
	// Fill it, leaving nothing.
	f, _ := os.Create(filepath.Join(dir, "filler"))
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); err != nil {
			break
		}
	}
	f.Close()
	file := filepath.Join(dir, "a.snap")
	r := kvctl(t, "--endpoints", c.nodes[0].addr(), "snapshot", "save", file)
	t.Logf("code %d stdout %q stderr %q", r.code, r.stdout, r.stderr)
	r.wantCode(t, 1)
	if !strings.Contains(r.stderr, "no space left on device") {
		t.Fatalf("stderr = %q, want the disk's error", r.stderr)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Name() != "filler" {
			t.Fatalf("%s left behind", e.Name())
		}
	}
}
