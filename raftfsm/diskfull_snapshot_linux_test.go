package raftfsm

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// TestARaftSnapshotFailedOnAFullDiskLeavesNoPartialSnapshot (from a review):
// Raft's periodic snapshot on a disk with room for its state.bin but not
// its meta.json: the snapshot fails, and should leave nothing behind in
// snapshots/ (a NAME.tmp holding a whole state.bin stays until the next
// start, and takes the room the next try needs).
func TestARaftSnapshotFailedOnAFullDiskLeavesNoPartialSnapshot(t *testing.T) {
	c, trs := newUnstartedCluster(t, 1, nil)
	d := c.dirs[0]
	testtmpfs.Mount(t, d, "64m")
	c.startOn(0, trs[0])
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 100, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	// The applied entries' group committed (as the next group commit
	// would), so that the snapshot's own writes are the ones that fail.
	snap, err := n.fsm.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	snap.Release()
	// Fill the disk.
	fp := testtmpfs.Fill(t, d)
	var errs []error
	for range 3 {
		errs = append(errs, n.raft.Snapshot().Error())
	}
	left, _ := filepath.Glob(filepath.Join(d, "snapshots", "*.tmp"))
	os.Remove(fp)
	t.Logf("3 snapshots on a full disk: %v", errs)
	if len(left) > 0 {
		t.Fatalf("3 Raft snapshots that failed on a full disk left %d partial snapshots, want none: %v", len(left), left)
	}
	// Space freed: the next snapshot succeeds (the node still runs).
	if err := n.raft.Snapshot().Error(); err != nil {
		t.Fatalf("snapshot after the space was freed: %v", err)
	}
}
