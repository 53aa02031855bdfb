package raftfsm

import (
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
