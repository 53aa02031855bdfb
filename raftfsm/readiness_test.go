package raftfsm

import (
	"testing"
	"time"
)

// TestReadinessAnswersDuringAnApply: a readiness probe is answered while
// an ApplyBatch holds the state (a large rank's dump applies for seconds),
// with what Status would say of readiness. Status waits for the apply to
// end (it pairs the digest with the applied index between two applies), and
// /readyz read it: a probe's timeout (Kubernetes': 1 s) passed and the node
// was taken for down.
func TestReadinessAnswersDuringAnApply(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	if err := n.WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	want := n.Status()
	n.fsm.stateMu.Lock() // an ApplyBatch in progress
	answered := make(chan NodeStatus, 1)
	go func() { answered <- n.Readiness() }()
	var got NodeStatus
	select {
	case got = <-answered:
	case <-time.After(time.Minute):
		n.fsm.stateMu.Unlock()
		<-answered
		t.Fatal("timed out after a minute waiting for Readiness while an apply holds the state")
	}
	n.fsm.stateMu.Unlock()
	if !got.Ready || got.State != want.State || got.LeaderID != want.LeaderID || got.AppliedIndex != want.AppliedIndex || got.Removed || got.ApplyHalted != "" {
		t.Fatalf("Readiness during an apply = %+v; want Ready, State %q, LeaderID %q, AppliedIndex %d as Status says",
			got, want.State, want.LeaderID, want.AppliedIndex)
	}
}
