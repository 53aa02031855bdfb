package raftfsm

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestFollowerIsNotReadyWhileCatchingUp: a follower restarted far behind
// the leader is ready only once it applied what the leader had committed
// before it started. From a review: a follower's commit index stops at
// its last log entry, so between two of the leader's batches it had
// applied "everything committed", and readiness latched thousands of
// entries early.
func TestFollowerIsNotReadyWhileCatchingUp(t *testing.T) {
	// Raft timeouts of a second: the 6000 applies below all go to the
	// leader found first, and under -race on a loaded 2-core machine (CI
	// beside other jobs) it lost its leadership within the 200 ms defaults.
	c := newTestCluster(t, 3, func(cfg *Config) {
		slowRestoreTimeouts(cfg)
		cfg.SnapshotThreshold = 1 << 30
		cfg.TrailingLogs = 1 << 30
	})
	l := c.leader()
	c.converged()
	fi := -1
	for i, n := range c.nodes {
		if n != l {
			fi = i
			break
		}
	}
	c.stop(fi)
	var last raft.ApplyFuture
	for i := 0; i < 6000; i++ {
		last = l.raft.Apply(encodeRegister(now(), &WorkerInfo{ID: uint64(i%50 + 1), BlockSize: 16, DPRanks: []uint32{uint32(i % 7)}}), 5*time.Second)
	}
	if err := last.Error(); err != nil {
		t.Fatal(err)
	}
	target := last.Index()
	c.start(fi)
	f := c.nodes[fi]
	deadline := time.Now().Add(30 * time.Second)
	for !f.ready.Load() && time.Now().Before(deadline) {
		f.checkReady() // as the leader loop (every 20 ms) and WaitReady do, as often as it can
	}
	applied, _ := f.fsm.Applied()
	if !f.ready.Load() {
		t.Fatalf("not ready after 30s: applied %d of %d", applied, target)
	}
	if applied < target {
		t.Fatalf("ready at applied index %d; the leader had committed %d before the follower started", applied, target)
	}
}

// TestANodeRemovedAndAddedBackWhileRunningIsReadyOnlyOnceCaughtUp: a node
// removed while running reads not ready, and added back after the
// cluster moved on, is ready again only once it has applied what the
// leader had committed when it heard from it again. From a review:
// readiness latched once per process (and the leader commit index heard
// first with it), so the node read ready at its re-add, "Ready:true ...
// AppliedIndex:11 ... leader commit 65", its index lacking every entry
// since its removal.
func TestANodeRemovedAndAddedBackWhileRunningIsReadyOnlyOnceCaughtUp(t *testing.T) {
	c := newInmemCluster(t, 3)
	_, l := c.leaderExcept(-1)
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	_, inner := raft.NewInmemTransport("inmem-n4")
	c.trans = append(c.trans, inner)
	c.heal()
	tr := holdEntries(t, inner, 0)
	cfg4 := Config{ID: "n4", RaftAddr: "inmem-n4", HTTPAddr: "http-n4", DataDir: filepath.Join(t.TempDir(), "n4"), Transport: tr, Logger: quiet}
	n4, err := NewNode(cfg4)
	if err != nil {
		t.Fatal(err)
	}
	c.nodes = append(c.nodes, n4)
	if err := l.AddMember(ctx(t), "n4", cfg4.RaftAddr, cfg4.HTTPAddr); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n4 ready", func() bool { return n4.Status().Ready })
	if err := l.RemoveMember(ctx(t), "n4"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n4, removed, to be ready no more", func() bool { return n4.Status().Removed && !n4.ready.Load() })

	const k = 50
	for i := uint64(1); i <= k; i++ {
		if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: r1, Events: chainEvents(r1, i, 1, 1000+i)}}); err != nil {
			t.Fatal(err)
		}
	}
	// Added back, n4 gets heartbeats but no entries for now (a slow
	// catch-up): it hears the leader's commit index, far past its own.
	tr.hold(n4.raft.LastIndex() + 1)
	addNotCaughtUp(t, l, "n4", cfg4.RaftAddr, cfg4.HTTPAddr, time.Second)
	lc := l.raft.CommitIndex()
	waitFor(t, 10*time.Second, "n4 to hear the leader again", func() bool { return n4.watch.leaderCommit() > 0 })
	if st := n4.Status(); st.Ready {
		t.Fatalf("n4 added back reads ready at applied index %d, the leader's commit at %d (it has %d of %d index entries)",
			st.AppliedIndex, lc, n4.IndexStats().Entries, l.IndexStats().Entries)
	}
	// Let through, it catches up and is ready again.
	tr.hold(0)
	waitFor(t, 20*time.Second, "n4 caught up and ready", func() bool {
		st := n4.Status()
		return st.Ready && !st.Removed
	})
	if got := n4.IndexStats().Entries; got != k {
		t.Fatalf("n4 ready again with %d of the %d index entries", got, k)
	}
}
