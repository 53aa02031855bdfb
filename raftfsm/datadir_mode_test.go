//go:build unix

package raftfsm

import (
	"context"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// openToOthers lists what under root another local user can reach and
// read: an entry whose mode grants others anything, and every directory
// on its way down from root lets them through (o+x). Pebble and Raft
// create their files 0666&^umask, so the files themselves are readable
// under the usual umask 022: the data directory's own mode is what must
// keep them from others.
func openToOthers(t *testing.T, root string) []string {
	t.Helper()
	passable := map[string]bool{} // directories others may pass through
	var open []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		perm := fi.Mode().Perm()
		reachable := p == root || passable[filepath.Dir(p)]
		if reachable && d.IsDir() && perm&0o001 != 0 {
			passable[p] = true
		}
		if reachable && perm&0o007 != 0 {
			rel, _ := filepath.Rel(root, p)
			open = append(open, rel+" "+perm.String())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return open
}

// withUmask022 runs the test under the usual umask, whatever the
// machine's is, so that a file created 0666 comes out world-readable.
func withUmask022(t *testing.T) {
	old := syscall.Umask(0o022)
	t.Cleanup(func() { syscall.Umask(old) })
}

// TestASeededDataDirIsNotWorldReadable: kvctl snapshot save writes the
// cluster's whole state readable by its owner only (docs/kvctl.md; its
// test says why: "the cluster's whole state"). Seeding a node's data
// directory from that file must not hand the same state back to every
// local user: nothing the seed writes may be readable by others under the
// usual umask 022.
func TestASeededDataDirIsNotWorldReadable(t *testing.T) {
	withUmask022(t)
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, good := fixtureSnapshotFile(t)
	dir := filepath.Join(t.TempDir(), "node")
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatal(err)
	}
	if open := openToOthers(t, dir); len(open) > 0 {
		t.Fatalf("the seeded data directory holds the cluster's state open to every user: %v", open)
	}
}

// TestARunningNodesDataDirIsOwnerOnly: a node started on a new directory
// creates it owner-only, and its lock file too, so that nothing the node
// writes (Pebble's and Raft's files) is readable by other local users.
func TestARunningNodesDataDirIsOwnerOnly(t *testing.T) {
	withUmask022(t)
	c := newTestCluster(t, 1, nil)
	c.leader()
	if fi, err := os.Stat(c.dirs[0]); err != nil {
		t.Fatal(err)
	} else if got := fi.Mode().Perm(); got != 0o700 {
		t.Fatalf("a new data directory's mode = %v, want %v", got, fs.FileMode(0o700))
	}
	if fi, err := os.Stat(filepath.Join(c.dirs[0], lockFile)); err != nil {
		t.Fatal(err)
	} else if got := fi.Mode().Perm(); got != 0o600 {
		t.Fatalf("the lock file's mode = %v, want %v", got, fs.FileMode(0o600))
	}
	if open := openToOthers(t, c.dirs[0]); len(open) > 0 {
		t.Fatalf("a running node's data directory is open to every user: %v", open)
	}
}

// TestAnOpenDataDirIsWarnedOfNotChanged: a data directory an older build
// made 0755, or one an operator shares on purpose, is named in a warning
// at start with what to do, and left as it is: a chmod behind the
// operator's back is not the node's to make.
func TestAnOpenDataDirIsWarnedOfNotChanged(t *testing.T) {
	withUmask022(t)
	var logs testlog.Buffer
	c := newTestCluster(t, 1, func(cfg *Config) {
		if err := os.MkdirAll(cfg.DataDir, 0o755); err != nil {
			t.Fatal(err)
		}
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	c.leader()
	lines := logs.Lines("data directory is open")
	if len(lines) != 1 {
		t.Fatalf("warnings of the open data directory: %d, want 1: %q", len(lines), logs.String())
	}
	for _, want := range []string{c.dirs[0], "-rwxr-xr-x", "chmod 700"} {
		if !strings.Contains(lines[0], want) {
			t.Fatalf("the warning %q does not say %q", lines[0], want)
		}
	}
	if fi, err := os.Stat(c.dirs[0]); err != nil {
		t.Fatal(err)
	} else if got := fi.Mode().Perm(); got != 0o755 {
		t.Fatalf("the data directory's mode after start = %v, want it left at %v", got, fs.FileMode(0o755))
	}
}
