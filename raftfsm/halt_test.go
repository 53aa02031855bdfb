package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/store"
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
	// The write is committed (the upgraded nodes apply it), so its error
	// says it may have applied (NotLeaderError.MaybeApplied: the API
	// sends a write not safe twice nowhere else) beside the halt.
	err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 8, BlockSize: 16, DPRanks: []uint32{0}})
	var nle *NotLeaderError
	if !errors.Is(err, ErrLaterBuild) || !errors.As(err, &nle) || !nle.MaybeApplied {
		t.Fatalf("a registration after the halt: %v, want the halt (ErrLaterBuild) and MaybeApplied", err)
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
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.keepHaltedLeadership = true })
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

// TestARestoreClearsTheHalt pins records.go's rule that "a restored state
// is past any entry the FSM halted at, or replays it": a follower halted
// at an entry of a later build that installs the leader's snapshot takes
// the leader's state and applies again (it halts again only if the entry
// comes to it once more). Before the rule was pinned, dropping the clear
// left every test green, and such a follower would stay halted, not
// ready and refusing snapshots, for good.
func TestARestoreClearsTheHalt(t *testing.T) {
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	defer src.Close()
	var w logWriter
	src.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}))})
	dst := openTestFSM(t, filepath.Join(t.TempDir(), "dst"))
	defer dst.Close()
	dst.halt.Store(&ApplyHalt{Index: 1, Term: 1, Err: fmt.Errorf("%w: command type 99", ErrLaterBuild)})
	if err := dst.Restore(raftSnapshotStream(snapshotBytes(t, src), 1, 1)); err != nil {
		t.Fatal(err)
	}
	if h := dst.Halted(); h != nil {
		t.Fatalf("halted at %v after restoring a snapshot past it, want applying", h)
	}
	if dst.Digest() != src.Digest() || len(dst.Workers()) != 1 {
		t.Fatalf("restored digest %#x, %d worker(s); want the source's %#x, 1", dst.Digest(), len(dst.Workers()), src.Digest())
	}
}

// TestAStateWithAWorkerRecordOfALaterBuildIsNotOpened: a worker record of
// an extension this build does not know (a later build's registration
// fields) stops the start with ErrLaterBuild naming the record, as a
// settings record of a later view does, rather than a bare decode error.
func TestAStateWithAWorkerRecordOfALaterBuildIsNotOpened(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}))})
	var e enc
	e.uv(3)  // id
	e.uv(1)  // one dp rank
	e.uv(0)  // rank 0
	e.uv(16) // block size
	for range (WorkerInfo{}).Capacity {
		e.sv(0)
	}
	e.str("") // endpoint
	e.str("") // model
	e.u8(2)   // an extension this build does not know
	e.str("a later field")
	f.batch.Put(store.KindWorker, u64key(3), e.b) // as a later build's apply would have
	f.Close()
	g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
	if err == nil {
		g.Close()
		t.Fatal("opened a state holding a worker record of extension 2")
	}
	if !errors.Is(err, ErrLaterBuild) || strings.Count(err.Error(), "worker record") != 1 {
		t.Fatalf("open: %v, want ErrLaterBuild naming the worker record once", err)
	}
}

// TestAHaltedLeaderHandsTheLeadershipOn: a leader whose state machine
// halts at an entry of a later build (an older build's node that an
// election picked: its log is complete) hands the leadership on to a node
// that applies, rather than lead on answering every write with the halt
// until an operator moves it.
func TestAHaltedLeaderHandsTheLeadershipOn(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	l := c.leader()
	at, term := l.fsm.Applied()
	l.fsm.halt.Store(&ApplyHalt{Index: at + 1, Term: term, Err: fmt.Errorf("%w: command type 99", ErrLaterBuild)})
	waitFor(t, 30*time.Second, "another node to lead", func() bool {
		n := c.leaderNow()
		return n != nil && n != l
	})
	next := c.leader() // past its set-up: a halted node's CheckLeader refuses
	if next == l {
		t.Fatalf("%s, halted, leads again", l.cfg.ID)
	}
	if err := next.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatalf("a write on %s, leading after the halted %s: %v", next.cfg.ID, l.cfg.ID, err)
	}
}
