package compat

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim/enginepub"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"
)

// proposingTarget is an AgentlessTarget that, like Node.apply before the
// fix, proposes (records) every batch whatever its context says, and
// answers the context's error when it is done. stopWhile, when set, is
// called once a batch is proposed and before the answer: the subscriber
// is stopped while it waits.
type proposingTarget struct {
	proposed  []kvevent.Event
	stopWhile func()
}

func (f *proposingTarget) CheckLeader() error                         { return nil }
func (f *proposingTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *proposingTarget) Cursor(kvevent.Rank) uint64                 { return 0 }
func (f *proposingTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	f.proposed = append(f.proposed, bs[0].Events...)
	if f.stopWhile != nil {
		f.stopWhile()
		f.stopWhile = nil
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("raft apply: waiting for the entry to apply: %w", err)
	}
	return []raftfsm.RankAck{{Rank: bs[0].Rank, Applied: len(bs[0].Events), Cursor: bs[0].Events[len(bs[0].Events)-1].EventID}}, nil
}

// TestAgentlessSinkOfAStoppedSubscriberProposesNothing: from a review. A
// subscriber stopped while it waited for a batch's commit got
// context.Canceled; enginesub took that for a refused batch and called
// Resync, and the sink proposed a clear of the rank under the cancelled
// context, which the node committed: every graceful shutdown of the leader
// (Agentless.Close) and every restart of a subscriber (a PATCH of its
// endpoints, a term change) could empty a rank whose engine was
// publishing. Now the sink proposes nothing once its subscriber is
// stopping, neither the clear nor a later batch: the batch in flight may
// or may not have committed, and the next subscriber resumes from the
// cursor.
func TestAgentlessSinkOfAStoppedSubscriberProposesNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ft := &proposingTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Minute}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	s := &positionSink{a: a, rank: r, ctx: ctx}
	st := func() []kvevent.Event {
		return []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}
	}
	if err := s.Events(r, 4, st()); err != nil {
		t.Fatal(err)
	}
	ft.stopWhile = cancel // Agentless.Close while batch 5 commits
	if err := s.Events(r, 5, st()); err == nil {
		t.Fatal("batch 5: want the cancelled wait's error")
	}
	s.Resync(r, enginesub.ReasonSinkError) // as enginesub does
	if err := s.Events(r, 6, st()); err == nil {
		t.Fatal("batch 6 of a stopped subscriber: want an error")
	}
	var got []string
	for _, ev := range ft.proposed {
		e, seq, _ := SplitPosition(ev.EventID)
		got = append(got, fmt.Sprintf("%v@%d/%d", ev.Kind, e, seq))
	}
	if want := []string{"store@0/4", "store@0/5"}; !slices.Equal(got, want) {
		t.Fatalf("proposed %v, want %v: a stopped subscriber proposed more", got, want)
	}
}

// storeBatch is a vLLM-shaped engine batch storing one parentless block of
// hash h, every token tok.
func storeBatch(h uint64, tok uint32) []byte {
	b, err := msgpack.Marshal([]any{1.5, []any{map[string]any{"type": "BlockStored", "block_hashes": []uint64{h},
		"block_size": testBlockSize, "token_ids": slices.Repeat([]uint32{tok}, testBlockSize)}}})
	if err != nil {
		panic(err) // plain values: msgpack always encodes them
	}
	return b
}

// busyEngine publishes a one-block batch on pub every 2 ms (block hash
// 1000+n for batch n) until the returned function is called, which waits
// for the publishing to stop.
func busyEngine(t testing.TB, pub *enginepub.Publisher) (stop func()) {
	t.Helper()
	done, quit := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for i := uint64(0); ; i++ {
			_, _ = pub.Publish(storeBatch(1000+i, uint32(i)))
			select {
			case <-quit:
				return
			case <-tick.C:
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { close(quit); <-done }) }
	t.Cleanup(stop)
	return stop
}

// newEngine starts a simulated engine publishing on a free local port,
// with a replay socket when replay is set.
func newEngine(t testing.TB, replay bool) *enginepub.Publisher {
	t.Helper()
	cfg := enginepub.Config{Endpoint: "tcp://127.0.0.1:*", Linger: time.Millisecond}
	if replay {
		cfg.ReplayEndpoint = "tcp://127.0.0.1:*"
	}
	pub, err := enginepub.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func waitSubscribed(t testing.TB, pub *enginepub.Publisher, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx, n); err != nil {
		t.Fatalf("the engine's subscribers: %v", err)
	}
}

// committedAfter waits for a write that commits after every entry proposed
// so far (a registration of another instance) to be applied: any clear a
// stopped subscriber proposed is applied by then, or never.
func committedAfter(t *testing.T, n *testNode, inst uint64) {
	t.Helper()
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: inst, Endpoint: "tcp://127.0.0.1:9",
		ModelName: "other", BlockSize: testBlockSize, Agentless: new(bool)}), 201, "a later registration")
}

// TestAgentlessCloseWhileTheEngineStreamsKeepsTheRank: from a review.
// Agentless.Close (kvrouter's graceful shutdown, on the leader) while the
// engine published cleared the rank through Raft (see
// TestAgentlessSinkOfAStoppedSubscriberProposesNothing): the next leader
// resumed in a new epoch, the rank's blocks gone although nothing was
// lost. Now the rank keeps its epoch and its blocks.
func TestAgentlessCloseWhileTheEngineStreamsKeepsTheRank(t *testing.T) {
	n := startNode(t)
	pub := newEngine(t, true)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: pub.Endpoint(),
		ReplayEndpoint: pub.ReplayEndpoint(), ModelName: "llama", BlockSize: testBlockSize}), 201, "register")
	ag := NewAgentless(n.node, AgentlessConfig{Registerer: prometheus.NewRegistry(), Logger: quiet})
	waitSubscribed(t, pub, 1)
	rk := kvevent.Rank{Worker: WorkerID(1, "llama", DefaultTenant)}
	stop := busyEngine(t, pub)
	waitFor(t, 10*time.Second, "50 batches committed", func() bool { _, s, _ := SplitPosition(n.node.Cursor(rk)); return s > 50 })
	ag.Close() // mid-stream: a commit is in flight most of the time
	stop()
	committedAfter(t, n, 2)
	d, err := n.node.DumpRank(rk)
	if err != nil {
		t.Fatal(err)
	}
	if e, s, i := SplitPosition(n.node.Cursor(rk)); e != 0 || len(d.StoredEvents()) < 50 {
		t.Fatalf("after Agentless.Close the rank is at epoch %d batch %d index %d with %d blocks: it was cleared",
			e, s, i, len(d.StoredEvents()))
	}
}

// TestAgentlessReplayEndpointPatchWhileTheEngineStreamsKeepsTheRank: from
// a review. A PATCH that restarts the rank's subscriber (here: adding the
// engine's replay endpoint) while the engine published cleared the rank,
// as Close did: the old subscriber, stopped mid-commit, proposed a clear.
// Now the new subscriber resumes in the same epoch and the blocks stay.
func TestAgentlessReplayEndpointPatchWhileTheEngineStreamsKeepsTheRank(t *testing.T) {
	n := startNode(t)
	pub := newEngine(t, true)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: pub.Endpoint(),
		ModelName: "llama", BlockSize: testBlockSize}), 201, "register")
	ag := NewAgentless(n.node, AgentlessConfig{Poll: 20 * time.Millisecond, Registerer: prometheus.NewRegistry(), Logger: quiet})
	defer ag.Close()
	waitSubscribed(t, pub, 1)
	rk := kvevent.Rank{Worker: WorkerID(1, "llama", DefaultTenant)}
	stop := busyEngine(t, pub)
	defer stop()
	waitFor(t, 10*time.Second, "50 batches committed", func() bool { _, s, _ := SplitPosition(n.node.Cursor(rk)); return s > 50 })
	rep := pub.ReplayEndpoint()
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{ReplayEndpoint: &rep}), 200, "patch")
	waitFor(t, 10*time.Second, "the subscriber restarted with the replay endpoint", func() bool {
		ag.mu.Lock()
		defer ag.mu.Unlock()
		s := ag.subs[rk]
		return s != nil && s.replay == rep
	})
	// The restarted subscriber commits batches published after the restart:
	// the old one's clear, had it proposed one, is applied before them.
	after := pub.Seq()
	waitFor(t, 10*time.Second, "a batch of the restarted subscriber committed", func() bool {
		_, s, _ := SplitPosition(n.node.Cursor(rk))
		return s > after
	})
	d, err := n.node.DumpRank(rk)
	if err != nil {
		t.Fatal(err)
	}
	if e, s, _ := SplitPosition(n.node.Cursor(rk)); e != 0 || uint64(len(d.StoredEvents())) < after {
		t.Fatalf("after the PATCH the rank is at epoch %d batch %d with %d blocks, the engine published %d before it: it was cleared",
			e, s, len(d.StoredEvents()), after)
	}
}
