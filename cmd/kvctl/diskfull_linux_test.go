package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// TestSnapshotSaveOnAFullDisk (from a review): kvctl snapshot save to a
// volume with no room: exit 1 naming the disk's error, no .part left.
func TestSnapshotSaveOnAFullDisk(t *testing.T) {
	c := newCluster(t)
	c.registerWorkers(t)
	dir := t.TempDir()
	testtmpfs.Mount(t, dir, "64k")
	testtmpfs.Fill(t, dir) // leaving nothing
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
