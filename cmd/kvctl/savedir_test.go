package main

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// stoppedNodeDir runs a single-node cluster on a new data directory,
// registers worker 3 on it, stops it and returns the directory.
func stoppedNodeDir(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "node")
	_, tr := raft.NewInmemTransport("")
	node, err := raftfsm.NewNode(raftfsm.Config{
		ID: "n1", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "127.0.0.1:1", DataDir: dir,
		Peers:     []raftfsm.Member{{ID: "n1", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "127.0.0.1:1", Voter: true}},
		Transport: tr, Logger: slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := node.WaitReady(ctx); err != nil {
		t.Fatalf("the node did not get ready: %v", err)
	}
	if err := node.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 3, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	if err := node.Close(); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestSnapshotSaveOfADataDir: kvctl snapshot save FILE --data-dir DIR saves
// a stopped node's directory offline with raftfsm.SaveDataDir (no node is
// asked: no --endpoints answers here), says what it read, and writes a
// file that inspect verifies and the offline seed takes. Its flags are
// refused as usage errors (exit 2) where they do not make an offline save,
// and a directory a node holds is refused (exit 1), nothing saved.
func TestSnapshotSaveOfADataDir(t *testing.T) {
	dir := stoppedNodeDir(t)
	out := t.TempDir()
	file := filepath.Join(out, "survivor.snap")
	h := &harness{inspect: raftfsm.InspectSnapshot}
	dead := "--endpoints=" + deadAddr(t)

	r := h.run(t, dead, "snapshot", "save", file, "--data-dir", dir).wantCode(t, 0)
	for _, want := range []string{"saved " + file + " from " + dir, "sha256 ", "state applied at index ", "Raft log last index ", " (term "} {
		if !strings.Contains(r.stdout, want) {
			t.Fatalf("save --data-dir printed %q, want %q in it", r.stdout, want)
		}
	}
	if r := h.run(t, "snapshot", "inspect", file).wantCode(t, 0); !strings.Contains(r.stdout, "workers") {
		t.Fatalf("inspect of the offline save:\n%s", r.stdout)
	}
	if left, _ := filepath.Glob(filepath.Join(out, "*")); len(left) != 1 {
		t.Fatalf("the save left %v beside the file", left)
	}
	real := &env{stdout: &strings.Builder{}, stderr: &strings.Builder{}, inspect: raftfsm.InspectSnapshot, seed: raftfsm.SeedDataDir}
	if code := run(context.Background(), []string{"kvctl", "snapshot", "restore", file, "--data-dir", filepath.Join(out, "new"),
		"--node-id", "m1", "--peers", "m1=127.0.0.1:17946=127.0.0.1:17080"}, real); code != 0 {
		t.Fatalf("seed from the offline save: exit %d: %s", code, real.stderr)
	}

	r = h.run(t, "-o", "json", "snapshot", "save", file, "--data-dir", dir, "--applied-only").wantCode(t, 0)
	var got map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("-o json = %q: %v", r.stdout, err)
	}
	for _, k := range []string{"file", "data_dir", "applied_only", "applied_index", "applied_term", "log_last_index", "log_last_term",
		"log_entries_applied", "log_entries_left", "log_entries_detached", "index", "term", "bytes", "sha256", "checksum_ok"} {
		if _, ok := got[k]; !ok {
			t.Errorf("-o json has no %q: %s", k, r.stdout)
		}
	}
	if got["applied_only"] != true || got["log_entries_applied"] != 0.0 {
		t.Errorf("--applied-only -o json = %s, want applied_only true and no log entry applied", r.stdout)
	}

	// A FILE inside DIR (in its root, in raft/, or through a link to it):
	// the .part and the working copy would be written into DIR.
	if err := os.Symlink(filepath.Join(dir, "raft"), filepath.Join(out, "link")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"snapshot", "save", file, "--applied-only"}, "--applied-only is for the offline save"},
		{[]string{"snapshot", "save", file, "--data-dir", ""}, "--data-dir is empty"},
		{[]string{"snapshot", "save", out, "--data-dir", dir}, "FILE is a directory"},
		{[]string{"snapshot", "save", "--data-dir", dir}, "takes FILE"},
		{[]string{"snapshot", "save", filepath.Join(dir, "in.snap"), "--data-dir", dir}, "is inside --data-dir"},
		{[]string{"snapshot", "save", filepath.Join(dir, "raft", "in.snap"), "--data-dir", dir}, "is inside --data-dir"},
		{[]string{"snapshot", "save", filepath.Join(out, "link", "in.snap"), "--data-dir", dir}, "is inside --data-dir"},
	} {
		if r := h.run(t, append([]string{dead}, tc.args...)...).wantCode(t, 2); !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%q: %q, want %q", tc.args, r.stderr, tc.want)
		}
	}

	for _, p := range []string{filepath.Join(dir, "in.snap"), filepath.Join(dir, "raft", "in.snap")} {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("the refused save wrote %s", p)
		}
	}

	lock, err := raftfsm.LockDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	other := filepath.Join(out, "other.snap")
	if r := h.run(t, "snapshot", "save", other, "--data-dir", dir).wantCode(t, 1); !strings.Contains(r.stderr, "held by another kvrouter process") ||
		!strings.Contains(r.stderr, "nothing was saved") {
		t.Errorf("save of a directory in use: %q", r.stderr)
	}
	if _, err := os.Stat(other); err == nil {
		t.Errorf("the refused save wrote %s", other)
	}
}
