package compat

import (
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/sim/enginepub"
)

// TestAgentlessLogsASkipReasonOncePerWorker: semantics.md §1 logs a
// reason for leaving engine events out once per worker. The agentless
// subscribers of one instance's dp ranks each logged it: an engine of
// eight ranks publishing a block size other than the registered one
// warned eight times.
func TestAgentlessLogsASkipReasonOncePerWorker(t *testing.T) {
	n := startNode(t)
	pubs := []*enginepub.Publisher{newEngine(t, false), newEngine(t, false), newEngine(t, false)}
	for i, p := range pubs {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: p.Endpoint(),
			ModelName: "llama", BlockSize: testBlockSize, DPRank: u32(uint32(i))}), 201, "register")
	}
	var logs testlog.Buffer
	ag := NewAgentless(n.node, AgentlessConfig{Poll: 20 * time.Millisecond, Registerer: prometheus.NewRegistry(),
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	defer ag.Close()
	for _, p := range pubs {
		waitSubscribed(t, p, 1)
	}
	wrongSize, err := msgpack.Marshal([]any{1.5, []any{map[string]any{"type": "BlockStored", "block_hashes": []uint64{77},
		"block_size": testBlockSize * 2, "token_ids": slices.Repeat([]uint32{7}, testBlockSize*2)}}})
	if err != nil {
		t.Fatal(err)
	}
	id := WorkerID(1, "llama", DefaultTenant)
	for i, p := range pubs {
		// The wrong block size, then a good batch: once the good one's
		// block is in, the subscriber has taken (and counted) the first.
		if _, err := p.Publish(wrongSize); err != nil {
			t.Fatal(err)
		}
		if _, err := p.Publish(storeBatch(uint64(100+i), uint32(i))); err != nil {
			t.Fatal(err)
		}
		r := kvevent.Rank{Worker: id, DP: uint32(i)}
		waitFor(t, 10*time.Second, "the good batch applied", func() bool {
			d, err := n.node.DumpRank(r)
			return err == nil && len(d.StoredEvents()) == 1
		})
	}
	if got := logs.Lines("engine events left out"); len(got) != 1 {
		t.Fatalf("%d log lines for one reason on one instance's %d ranks, want 1:\n%s", len(got), len(pubs), logs.String())
	}
}

// TestAgentlessForgetsTheSkipLogOfAWorkerThatLeft: the skip log kept per
// followed worker, which logs each reason once per worker, goes with the
// worker when it leaves the worker table, so that the instances an
// agentless node follows over its life leave no entry each; a worker that
// stays keeps its log. The polls are driven by hand here (reconcile).
func TestAgentlessForgetsTheSkipLogOfAWorkerThatLeft(t *testing.T) {
	n := startNode(t)
	pubs := []*enginepub.Publisher{newEngine(t, false), newEngine(t, false)}
	for i, p := range pubs {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: uint64(1 + i), Endpoint: p.Endpoint(),
			ModelName: "llama", BlockSize: testBlockSize}), 201, "register")
	}
	a := &Agentless{b: n.node, cfg: AgentlessConfig{Poll: time.Hour, CommitTimeout: 5 * time.Second, ReplayTimeout: time.Second},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}, retry: map[kvevent.Rank]agentlessRetry{},
		skipLogs: map[uint64]*enginesub.SkipLog{}, exported: map[kvevent.Rank]*enginesub.Subscriber{}}
	poll := func() { a.reconcile(n.node.WorkerTable(), termOf(n.node)) }
	t.Cleanup(func() { a.reconcile(nil, 0) })
	poll()
	left, stays := WorkerID(1, "llama", DefaultTenant), WorkerID(2, "llama", DefaultTenant)
	logs := func() (bool, bool) {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.skipLogs[left] != nil, a.skipLogs[stays] != nil
	}
	if l, s := logs(); !l || !s {
		t.Fatalf("skip logs of the followed workers: %v and %v, want both", l, s)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/unregister", UnregisterRequest{InstanceID: 1, ModelName: "llama"}), 200, "unregister")
	poll()
	if l, s := logs(); l || !s {
		t.Fatalf("after instance 1 left: its skip log kept %v, instance 2's %v; want it gone and instance 2's kept", l, s)
	}
}
