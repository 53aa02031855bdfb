package raftfsm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// TestASeedOnAFullDiskSaysSo: an offline seed (kvctl snapshot restore
// --data-dir) into a data directory whose disk is full fails
// ErrInsufficientStorage, saying what to do, and leaves no state behind,
// so that a second seed, with room, is not refused. It panicked: Pebble
// takes a MANIFEST it cannot write as fatal ('panic: pebble fatal:
// MANIFEST flush failed: ... no space left on device' and a goroutine
// dump).
func TestASeedOnAFullDiskSaysSo(t *testing.T) {
	file := filepath.Join(t.TempDir(), "a.snap")
	if err := os.WriteFile(file, foreignSnapshot(t), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "data")
	testtmpfs.Mount(t, dir, "64m")
	filler := testtmpfs.Fill(t, dir)
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:17946", HTTPAddr: "127.0.0.1:17080"}}
	err := SeedDataDir(context.Background(), file, dir, "n1", peers)
	t.Logf("seed: %v", err)
	if !errors.Is(err, ErrInsufficientStorage) || !strings.Contains(err.Error(), "free space") {
		t.Fatalf("a seed on a full disk answered %v, want ErrInsufficientStorage saying to free space", err)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Name() != "filler" && e.Name() != lockFile {
			t.Errorf("the failed seed left %s", e.Name())
		}
	}
	os.Remove(filler)
	if err := SeedDataDir(context.Background(), file, dir, "n1", peers); err != nil {
		t.Fatalf("a seed once the disk had room: %v", err)
	}
}
