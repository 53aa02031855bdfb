package compat

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// TestRegisterRefusesEndpointsLibzmqRefuses: from a review. POST /register
// answered 201 to event endpoints libzmq's connect refuses (a tcp host
// starting with '_' or '-', an ipc path past 107 bytes), whose subscriber
// could never start. Now they are a 400 naming libzmq's rule.
func TestRegisterRefusesEndpointsLibzmqRefuses(t *testing.T) {
	n := startNode(t)
	for i, ep := range []string{"ipc:///var/run/kvrouter/" + strings.Repeat("d", 100) + "/events.sock",
		"tcp://_engine:5557", "tcp://-engine:5557", "tcp://en!gine:5557"} {
		r := n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: uint64(10 + i), Endpoint: ep, ModelName: "llama", BlockSize: 4})
		if r.code != 400 || !strings.Contains(string(r.body), "libzmq refuses") {
			t.Errorf("register %s: %d %s, want 400 naming libzmq's rule", ep, r.code, r.body)
		}
	}
}

// TestAgentlessRestartsAStoppedSubscriberWithBackoff: from a review. A
// subscriber whose Run returned by itself (here: libzmq refuses the
// endpoint an older build registered) stayed in Agentless's map: Ranks()
// listed its rank as followed, and reconcile never started it again (it
// restarted a subscriber only when its registration or the term changed),
// so a rank whose subscriber failed once, for whatever reason, was never
// followed again. Now a stopped subscriber is not listed, starts again
// after a backoff that doubles at each failure, and at once when its
// registration changes.
func TestAgentlessRestartsAStoppedSubscriberWithBackoff(t *testing.T) {
	const poll = 20 * time.Millisecond
	a := &Agentless{b: &cursorTarget{}, cfg: AgentlessConfig{Poll: poll, CommitTimeout: time.Second, Registerer: prometheus.NewRegistry()},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}, retry: map[kvevent.Rank]agentlessRetry{}}
	defer a.reconcile(nil, 0)
	r := kvevent.Rank{Worker: 1}
	table := func(ep string) map[uint64]raftfsm.WorkerInfo {
		return map[uint64]raftfsm.WorkerInfo{1: {ID: 1, Positional: true, BlockSize: 4, EventEndpoints: map[uint32]string{0: ep}}}
	}
	bad := table("tcp://_engine:5557") // registered by an older build
	sub := func() *agentlessSub {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.subs[r]
	}
	waitStopped := func(s *agentlessSub) {
		t.Helper()
		waitFor(t, 10*time.Second, "the subscriber's Run to return", s.stopped)
	}

	a.reconcile(bad, 5)
	first := sub()
	if first == nil {
		t.Fatal("no subscriber started")
	}
	waitStopped(first)
	if slices.Contains(a.Ranks(), r) {
		t.Fatal("Ranks() lists the rank of a stopped subscriber as followed")
	}
	waitFor(t, 10*time.Second, "the subscriber started again", func() bool {
		a.reconcile(bad, 5)
		s := sub()
		return s != nil && s != first
	})
	second := sub()
	waitStopped(second)
	a.reconcile(bad, 5)
	a.mu.Lock()
	rt, waiting := a.retry[r]
	a.mu.Unlock()
	if sub() != nil || !waiting || rt.backoff != 2*poll {
		t.Fatalf("after a second failure: subscriber %p, retry %+v (%v): want none running and a backoff of %v",
			sub(), rt, waiting, 2*poll)
	}

	// Registered anew (a PATCH of the endpoint): started at once.
	a.reconcile(table("tcp://127.0.0.1:9"), 5)
	if s := sub(); s == nil || s.endpoint != "tcp://127.0.0.1:9" {
		t.Fatalf("after a new registration: subscriber %+v, want one on the new endpoint at once", s)
	}
	if _, waiting := a.retry[r]; waiting {
		t.Fatal("the new registration waits for the old one's backoff")
	}
}

// TestAgentlessRemedyForUsedUpEpochsWorksWithinOnePoll: docs/compat.md's
// remedy for a rank that used its last epoch, unregistering the instance
// and registering it again, works when both requests fall between two
// polls of the leader (a script's back to back). From a review: reconcile
// found the same registration and kept the subscriber, whose sink stayed
// at the last epoch with its clear failing, and the rank applied nothing.
// The polls are driven by hand here (reconcile).
func TestAgentlessRemedyForUsedUpEpochsWorksWithinOnePoll(t *testing.T) {
	pypub.Require(t)
	n := startNode(t)
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*"})
	reg := RegisterRequest{InstanceID: 9, Endpoint: pub.Pub, ReplayEndpoint: pub.Replay, ModelName: "llama", BlockSize: testBlockSize}
	mustCode(t, n.do(t, codecJSON, "POST", "/register", reg), 201, "register")
	rk := kvevent.Rank{Worker: WorkerID(9, "llama", DefaultTenant)}
	// The rank has used its last epoch.
	if _, err := n.node.IngestEvents(context.Background(), []raftfsm.RankBatch{{Rank: rk, Events: []kvevent.Event{{Rank: rk,
		EventID: Position(maxEpoch, 5, 1), Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}}}); err != nil {
		t.Fatal(err)
	}
	a := &Agentless{b: n.node, cfg: AgentlessConfig{Poll: time.Hour, CommitTimeout: 5 * time.Second, ReplayTimeout: time.Second},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}, retry: map[kvevent.Rank]agentlessRetry{},
		skipLogs: map[uint64]*enginesub.SkipLog{}}
	poll := func() { a.reconcile(n.node.WorkerTable(), termOf(n.node)) }
	t.Cleanup(func() { a.reconcile(nil, 0) })
	poll()
	pub.WaitSub()
	// The engine restarts: the rank must be cleared, and cannot be.
	pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: 0, Form: "array", Live: true, Events: []pypub.EvSpec{{Type: "BlockStored",
		BlockSize: testBlockSize, Medium: "GPU", Hashes: []uint64{101}, Tokens: prompt[:4]}}})
	refused := func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		s := a.subs[rk]
		return s != nil && s.sub.Stats().SinkErrors > 0
	}
	waitFor(t, 10*time.Second, "the sink to refuse the engine's first batch after its restart", refused)

	mustCode(t, n.do(t, codecJSON, "POST", "/unregister", UnregisterRequest{InstanceID: 9, ModelName: "llama"}), 200, "unregister")
	mustCode(t, n.do(t, codecJSON, "POST", "/register", reg), 201, "register again")
	poll()
	pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: 1, Form: "array", Live: true, Events: []pypub.EvSpec{{Type: "BlockStored",
		BlockSize: testBlockSize, Medium: "GPU", Hashes: []uint64{201, 202, 203}, Tokens: prompt}}})
	matched := func() int {
		r := n.do(t, codecJSON, "POST", "/query", QueryRequest{TokenIDs: prompt, ModelName: "llama"})
		var q QueryResponse
		if err := json.Unmarshal(r.body, &q); err != nil || r.code != 200 {
			t.Fatalf("query: %d %s %v", r.code, r.body, err)
		}
		return q.Instances["9"].LongestMatched
	}
	waitFor(t, 10*time.Second, "the engine's blocks after the instance registered again to match the prompt",
		func() bool { return matched() == len(prompt) })
	if e, _, _ := SplitPosition(n.node.Cursor(rk)); e != 1 {
		t.Fatalf("the rank registered anew is at epoch %d, want 1 (cleared once)", e)
	}
}

// TestAgentlessForgetsTheSeriesOfARankThatLeft: a rank that leaves the
// worker table stops being exported (kvagent_subscriber_*,
// kvagent_engine_seq_gaps_total), whether its subscriber runs or stopped
// by itself and waits in retry. From a review: only a running subscriber's
// series were forgotten; a waiting one's retry entry was dropped with its
// series left exported for good, under the worker label of a worker gone.
func TestAgentlessForgetsTheSeriesOfARankThatLeft(t *testing.T) {
	const poll = 20 * time.Millisecond
	reg := prometheus.NewRegistry()
	a := &Agentless{b: &cursorTarget{}, cfg: AgentlessConfig{Poll: poll, CommitTimeout: time.Second, Registerer: reg},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}, retry: map[kvevent.Rank]agentlessRetry{}}
	defer a.reconcile(nil, 0)
	exported := func() map[string]bool { // the worker labels exported
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, mf := range mfs {
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "worker" {
						out[l.GetValue()] = true
					}
				}
			}
		}
		return out
	}
	waiting := kvevent.Rank{Worker: 7}
	waiter := raftfsm.WorkerInfo{ID: 7, Positional: true, BlockSize: 4,
		EventEndpoints: map[uint32]string{0: "tcp://_engine:5557"}} // libzmq refuses it: Run returns
	runner := raftfsm.WorkerInfo{ID: 8, Positional: true, BlockSize: 4,
		EventEndpoints: map[uint32]string{0: "tcp://127.0.0.1:9"}} // connects in the background: Run goes on
	both := map[uint64]raftfsm.WorkerInfo{7: waiter, 8: runner}
	a.reconcile(both, 5)
	a.mu.Lock()
	s := a.subs[waiting]
	a.mu.Unlock()
	if s == nil {
		t.Fatal("no subscriber started for worker 7")
	}
	waitFor(t, 10*time.Second, "worker 7's subscriber's Run to return", s.stopped)
	a.reconcile(both, 5) // worker 7's rank moves to retry
	if _, ok := a.retry[waiting]; !ok {
		t.Fatal("worker 7's rank does not wait in retry")
	}
	if got := exported(); !got["7"] || !got["8"] {
		t.Fatalf("workers exported %v, want 7 and 8", got)
	}

	a.reconcile(map[uint64]raftfsm.WorkerInfo{8: runner}, 5) // worker 7 left, waiting
	if got := exported(); got["7"] || !got["8"] {
		t.Fatalf("after worker 7 left: workers exported %v, want 8 only", got)
	}
	a.reconcile(map[uint64]raftfsm.WorkerInfo{}, 5) // worker 8 left, running
	if got := exported(); len(got) != 0 {
		t.Fatalf("after worker 8 left: workers exported %v, want none", got)
	}
}
