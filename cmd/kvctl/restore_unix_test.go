//go:build unix

package main

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestRestoreOfAStreamIsAUsageError: a restore, online or a seed, reads
// its file twice (it verifies it, then uploads or seeds it), so a FIFO
// (what a process substitution such as <(zcat backup.snap.gz) gives) or
// a directory is refused at once, exit 2, saying to save the stream to a
// file; nothing is sent or written. From a review: kvctl verified the
// stream, then opened it again and waited for a second producer for
// ever. The FIFO has no producer: a kvctl that opened it would wait in
// open(2) until the harness's bound ends it (exit 1).
func TestRestoreOfAStreamIsAUsageError(t *testing.T) {
	c := newCluster(t)
	fifo := filepath.Join(t.TempDir(), "backup.snap")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	peers := "n1=10.0.0.1:7946=10.0.0.1:7080"
	for _, tc := range []struct {
		name, kind string
		args       []string
	}{
		{"online, FIFO", "FIFO", []string{"--endpoints", c.nodes[0].addr(), "snapshot", "restore", fifo}},
		{"seed, FIFO", "FIFO", []string{"snapshot", "restore", fifo, "--data-dir", t.TempDir(), "--node-id", "n1", "--peers", peers}},
		{"online, directory", "directory", []string{"--endpoints", c.nodes[0].addr(), "snapshot", "restore", t.TempDir()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &harness{bound: 20 * time.Second}
			r := h.run(t, tc.args...).wantCode(t, 2)
			if !strings.Contains(r.stderr, "must be a regular file, not a "+tc.kind) || !strings.Contains(r.stderr, "save the stream to a file") {
				t.Fatalf("stderr = %q", r.stderr)
			}
			if len(h.seeds) != 0 || c.leader().Calls()["RestoreSnapshot"] != 0 {
				t.Fatalf("a stream was restored: %d seeds, %d uploads", len(h.seeds), c.leader().Calls()["RestoreSnapshot"])
			}
		})
	}
}
