package raftfsm

import (
	"errors"
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
