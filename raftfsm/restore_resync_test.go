package raftfsm

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
)

// flagged returns how many of ix's ranks are flagged as needing a resync,
// and how many ranks it holds.
func flagged(ix *indexer.Index) (n, of int) {
	for _, rs := range ix.RankStats() {
		if rs.NeedsResync {
			n++
		}
		of++
	}
	return n, of
}

// TestAnOperatorsRestoreFlagsEveryRankForAResync pins docs/events.md's
// promise that an agent resyncs its ranks once the cluster "was restored
// from an older snapshot": an operator's restore, online (the stream
// replaceMembers writes for Raft) or offline (SeedDataDir), flags every
// rank it holds as needing a resync, in the state itself, so that every
// replica names the ranks alike (acks, heartbeat answers) until their
// agents' dumps clear them. Raft's own restore of a stream (a leader's
// snapshot sent to a follower that lags: current state) flags nothing.
func TestAnOperatorsRestoreFlagsEveryRankForAResync(t *testing.T) {
	f, path := fixtureSnapshotFile(t)
	if n, of := flagged(f.Index()); n != 0 || of == 0 {
		t.Fatalf("the fixture has %d of %d ranks flagged, want some ranks, none flagged", n, of)
	}
	snap := snapshotBytes(t, f)
	// Raft's own restore (InstallSnapshot, a start) flags nothing.
	if n, of := flagged(restoredFSM(t, snap, f.Digest()).Index()); n != 0 {
		t.Fatalf("a Raft restore of a node's snapshot flagged %d of %d ranks as needing a resync, want none", n, of)
	}
	// The online restore's stream.
	var out bytes.Buffer
	if _, err := replaceMembers(&out, bytes.NewReader(snap), []Member{{ID: "n1", RaftAddr: "127.0.0.1:1"}}); err != nil {
		t.Fatal(err)
	}
	if n, of := flagged(restoredFSM(t, out.Bytes(), f.Digest()).Index()); n != of {
		t.Fatalf("the online restore's stream flags %d of %d ranks as needing a resync, want every one", n, of)
	}
	// The offline restore.
	dir := filepath.Join(t.TempDir(), "node")
	if err := SeedDataDir(context.Background(), path, dir, "n1", []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, filepath.Join(dir, "fsm"))
	defer g.Close()
	if n, of := flagged(g.Index()); n != of || of == 0 {
		t.Fatalf("a seeded data directory flags %d of %d ranks as needing a resync, want every one", n, of)
	}
}

// TestAnOnlineRestoreFlagsTheRanksOnEveryNode: the flag of an online
// restore is in the state Raft installs, so every node of the cluster
// holds it, and a node's HTTP heartbeat answers name the rank whichever
// node leads.
func TestAnOnlineRestoreFlagsTheRanksOnEveryNode(t *testing.T) {
	c := newTestCluster(t, 3, slowRestoreTimeouts)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 10, 7)}})
	c.converged()
	var snap bytes.Buffer
	if _, err := c.leader().SaveSnapshot(ctx(t), &snap); err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		if n.RankNeedsResync(r1) {
			t.Fatalf("%s flags r1 before the restore", n.cfg.ID)
		}
	}
	restoreRetrying(t, c, snap.Bytes())
	for _, n := range c.nodes {
		waitFor(t, 10*time.Second, n.cfg.ID+" to flag r1 as needing a resync after the restore", func() bool { return n.RankNeedsResync(r1) })
	}
}
