package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestANodeHaltedAtAnEntryOfALaterBuildSaysSo: a node whose state machine
// met an entry of a later build says so: its status names the halt
// (ApplyHalted) and is not ready, kvrouter_apply_halted is 1, a write
// after it fails with the halt rather than hangs or succeeds, and a Raft
// snapshot is refused, so that the log keeps the entry for the node's
// upgrade.
func TestANodeHaltedAtAnEntryOfALaterBuildSaysSo(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if m := gather(t, NewCollector(l)); m["kvrouter_apply_halted{}"].GetGauge().GetValue() != 0 || !l.Status().Ready {
		t.Fatalf("kvrouter_apply_halted %v, ready %v before any entry of a later build; want 0 and ready",
			m["kvrouter_apply_halted{}"], l.Status().Ready)
	}
	later := encodeRegister(now(), &WorkerInfo{ID: 7, DPRanks: []uint32{0}, BlockSize: 16})
	later[0] = commandVersion + 1
	f := l.raft.Apply(later, 5*time.Second)
	if err := l.await(ctx(t), f); err != nil {
		t.Fatal(err)
	}
	if err, ok := f.Response().(error); !ok || !errors.Is(err, ErrLaterBuild) {
		t.Fatalf("the entry's response: %v, want the halt (ErrLaterBuild)", f.Response())
	}
	st := l.Status()
	if st.Ready || !strings.Contains(st.ApplyHalted, "apply halted at entry") || !strings.Contains(st.ApplyHalted, "upgrade this node") {
		t.Fatalf("status: ready %v, apply_halted %q; want not ready, naming the halt", st.Ready, st.ApplyHalted)
	}
	if g := gather(t, NewCollector(l))["kvrouter_apply_halted{}"]; g.GetGauge().GetValue() != 1 {
		t.Fatalf("kvrouter_apply_halted %v while halted, want 1", g)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 8, BlockSize: 16, DPRanks: []uint32{0}}); !errors.Is(err, ErrLaterBuild) {
		t.Fatalf("a registration after the halt: %v, want the halt (ErrLaterBuild)", err)
	}
	if len(l.fsm.Workers()) != 0 {
		t.Fatalf("workers %v after the halt, want none", l.fsm.Workers())
	}
	if err := l.await(ctx(t), l.raft.Snapshot()); err == nil || !strings.Contains(err.Error(), "apply halted") {
		t.Fatalf("a Raft snapshot while halted: %v, want it refused, naming the halt", err)
	}
}

// TestASnapshotSaveOnAHaltedLeaderIsRefused pins that a user's snapshot
// save (Node.SaveSnapshot: kvctl snapshot save) is refused on a leader
// whose state machine is halted at an entry of a later build, as
// FSM.Snapshot refuses a Raft snapshot. SaveSnapshot says "A Barrier
// first makes sure everything committed is applied"; docs/operations.md
// ("Upgrade") that a halted node applies nothing after the entry. Raft
// answers the Barrier whatever the FSM did, so the save streamed, with
// success, the state of the index before the halt as the cluster's:
// here a follower halts (set as ApplyBatch sets it, as an older build's
// does at the upgraded leader's first new entry), the leader
// acknowledges seven registrations, the leadership moves to the halted
// node (an election may pick it: its log is complete), and its save
// lacks all seven. Restored, that backup drops acknowledged writes.
func TestASnapshotSaveOnAHaltedLeaderIsRefused(t *testing.T) {
	h, at, acked := haltedLeader(t)
	var buf bytes.Buffer
	info, err := h.SaveSnapshot(ctx(t), &buf)
	if err == nil {
		t.Fatalf("a snapshot save on a leader halted at entry %d succeeded: the state at index %d (%d worker(s)), "+
			"while registrations up to index %d were acknowledged (8 workers); want it refused, naming the halt",
			at+1, info.Index, len(h.fsm.Workers()), acked)
	}
	if !errors.Is(err, ErrLaterBuild) {
		t.Fatalf("a snapshot save on a halted leader: %v, want the halt (ErrLaterBuild)", err)
	}
}

// haltedLeader starts a 3-node cluster, halts a follower's state machine
// at the next entry (as ApplyBatch does at an entry of a later build: the
// old leader, a follower after the transfer, at the upgraded leader's
// first new entry), has the leader acknowledge seven registrations after
// one before, and moves the leadership to the halted node (its log is
// complete: an election may pick it too). It returns that node, the
// index it applied before the halt, and the index of the last write
// acknowledged.
func haltedLeader(t *testing.T) (h *Node, at, acked uint64) {
	t.Helper()
	c := newTestCluster(t, 3, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	for _, n := range c.nodes {
		if n != l {
			h = n
		}
	}
	at, term := h.fsm.Applied()
	h.fsm.halt.Store(&ApplyHalt{Index: at + 1, Term: term, Err: fmt.Errorf("%w: command type 99", ErrLaterBuild)})
	for id := uint64(2); id <= 8; id++ {
		if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	acked, _ = l.fsm.Applied()
	return c.leadTo(h.cfg.ID), at, acked
}

// TestCheckLeaderRefusesOnAHaltedLeader pins CheckLeader's rule
// (node.go): it "returns nil on a leader whose state holds every entry
// committed before its term"; until then a read-modify-write judged on
// the state (the compatible APIs' worker table, a booked route's load
// view) "would undo" the entries its predecessor acknowledged. A leader
// whose state machine is halted at an entry of a later build lacks that
// entry and every one after it, which its predecessor acknowledged, for
// as long as it runs; but its post-election Barrier passes (Raft answers
// it whatever the FSM did), and CheckLeader answered nil, so it judged
// writes and booked routes on a state seven acknowledged registrations
// short. Want it refused, naming the halt.
func TestCheckLeaderRefusesOnAHaltedLeader(t *testing.T) {
	h, at, acked := haltedLeader(t)
	var err error
	waitFor(t, 10*time.Second, "the halted leader's set-up to finish, or CheckLeader to name the halt", func() bool {
		err = h.CheckLeader()
		return err == nil || errors.Is(err, ErrLaterBuild)
	})
	if err == nil {
		t.Fatalf("CheckLeader on a leader halted at entry %d (its state at %d, %d worker(s)) = nil, "+
			"while writes up to index %d were acknowledged (8 workers); want the halt", at+1, at, len(h.fsm.Workers()), acked)
	}
}
