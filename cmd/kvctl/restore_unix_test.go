//go:build unix

package main

import (
	"encoding/json"
	"os"
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

// TestSnapshotInspectOfAFIFOReportsTheBytesItRead: inspect of a stream (a
// FIFO: what <(zcat backup.snap.gz) gives) reports the size of the stream
// it read and verified. From a review: it reported the size of a stat of
// the path after the read, 0 for a FIFO.
func TestSnapshotInspectOfAFIFOReportsTheBytesItRead(t *testing.T) {
	c := newCluster(t)
	c.registerWorkers(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "a.snap")
	kvctl(t, "--endpoints", c.nodes[0].addr(), "snapshot", "save", file).wantCode(t, 0)
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() {
		f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
		if err != nil {
			wrote <- err
			return
		}
		_, err = f.Write(data)
		f.Close()
		wrote <- err
	}()
	r := kvctl(t, "snapshot", "inspect", fifo, "-o", "json").wantCode(t, 0)
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Bytes int64 `json:"bytes"`
	}
	if err := json.Unmarshal([]byte(r.stdout), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Bytes != int64(len(data)) {
		t.Fatalf("inspect of a FIFO reports bytes %d, the stream held %d", rep.Bytes, len(data))
	}
}
