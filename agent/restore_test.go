package agent

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestIdleRankConvergesAfterARestoreFromAnOlderSnapshot pins
// docs/events.md, "The agent (kvagent) and worker liveness": an agent
// whose router cluster was restored from an older snapshot resyncs its
// ranks, so that the router holds what the engine does again without
// waiting for the engine's next event. Here the snapshot still holds the
// worker (saved after its registration), with the rank's older state: the
// engine has since evicted the chain (blocks 1 and 2), and then stays
// idle. The heartbeats' answers know the worker and name no rank without
// state, so nothing tells the agent; the router must not go on routing to
// the evicted blocks until the engine's next event (an idle engine's,
// never: the case docs/events.md calls out for a removal).
func TestIdleRankConvergesAfterARestoreFromAnOlderSnapshot(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgentWith(t, r, Config{Registrar: r.node, HeartbeatInterval: 50 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{BlockSize: 4, LeaseMs: 10000}})
	waitFor(t, "the agent to register its worker", func() bool { return workerRegistered(r) })
	if err := a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the chain in the router's index", func() bool { return matched(r, 2) == 2 })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var snap bytes.Buffer
	if _, err := r.node.SaveSnapshot(ctx, &snap); err != nil {
		t.Fatal(err)
	}
	// The engine evicts the chain and stores another; then it is idle.
	if err := a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{1, 2}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the chain off the router", func() bool { return matched(r, 2) == 0 })
	if _, err := r.node.RestoreSnapshot(ctx, &snap); err != nil {
		t.Fatal(err)
	}
	if !workerRegistered(r) {
		t.Fatal("the snapshot does not hold the worker")
	}
	// Poll for the router to drop the blocks the engine evicted: a
	// deadline of a few seconds (many heartbeats, well within a lease).
	deadline := time.Now().Add(5 * time.Second)
	for matched(r, 2) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("5 s after a restore from an older snapshot the router still routes to %d blocks the idle engine evicted (the agent holds none)", matched(r, 2))
		}
		time.Sleep(10 * time.Millisecond)
	}
}
