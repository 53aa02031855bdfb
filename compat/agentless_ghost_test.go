package compat

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim/enginepub"
	"github.com/prometheus/client_golang/prometheus"
)

// TestAgentlessUnregisteredDPRankLeavesNoGhost: from a review. POST
// /unregister of one dp rank of an agentless instance whose engine kept
// publishing: the registration without the rank dropped its state and
// cursor, but the leader's subscriber of the rank ran on until its next
// poll (200 ms by default) and the worker was still Positional, so its
// batches applied to the rank no longer registered, re-creating state and
// a cursor that nothing swept (the worker is registered), and a later
// /register of the rank started at that ghost's cursor with its blocks.
// Now those batches apply nothing, and the rank registered again starts
// clean.
func TestAgentlessUnregisteredDPRankLeavesNoGhost(t *testing.T) {
	n := startNode(t)
	pubs := [2]*enginepub.Publisher{newEngine(t, false), newEngine(t, false)}
	for i, p := range pubs {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: p.Endpoint(),
			ModelName: "llama", BlockSize: testBlockSize, DPRank: u32(uint32(i))}), 201, "register")
	}
	// The polls are driven by hand (reconcile): a poll of its own clock
	// could stop the subscriber of rank 1 before it took a batch after the
	// unregistration (a commit slower than the poll, under load), and the
	// test would show nothing.
	a := &Agentless{b: n.node, cfg: AgentlessConfig{Poll: time.Hour, CommitTimeout: 5 * time.Second, Registerer: prometheus.NewRegistry()},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}}
	poll := func() { a.reconcile(n.node.WorkerTable(), termOf(n.node)) }
	t.Cleanup(func() { a.reconcile(nil, 0) })
	poll()
	for _, p := range pubs {
		waitSubscribed(t, p, 1)
	}
	id := WorkerID(1, "llama", DefaultTenant)
	r1 := kvevent.Rank{Worker: id, DP: 1}
	stop := busyEngine(t, pubs[1])
	defer stop()
	waitFor(t, 10*time.Second, "rank 1 followed", func() bool { return n.node.Cursor(r1) != 0 })
	a.mu.Lock()
	sub := a.subs[r1]
	a.mu.Unlock()

	mustCode(t, n.do(t, codecJSON, "POST", "/unregister", UnregisterRequest{InstanceID: 1, ModelName: "llama", DPRank: u32(1)}), 200, "unregister dp 1")
	batches := sub.sub.Stats().Batches
	// The subscriber of rank 1 runs on until the next poll. It counts a
	// batch before giving it to the sink, so by its second batch after
	// the unregistration the sink has had a whole one of them; then the
	// poll stops it (reconcile waits for its Run to return).
	waitFor(t, 10*time.Second, "the subscriber of rank 1 to give the sink a batch after the unregistration", func() bool {
		return sub.sub.Stats().Batches >= batches+2
	})
	poll()
	select {
	case <-sub.done:
	default:
		t.Fatal("the poll after the unregistration left the subscriber of rank 1 running")
	}
	stop()
	if slices.Contains(n.node.WorkerTable()[id].DPRanks, 1) {
		t.Fatal("rank 1 still registered")
	}
	d, err := n.node.DumpRank(r1)
	blocks := 0
	if err == nil {
		blocks = len(d.StoredEvents())
	}
	if cur := n.node.Cursor(r1); cur != 0 || blocks != 0 || n.node.FSM().LastHeard(r1) != 0 {
		e, s, i := SplitPosition(cur)
		t.Fatalf("rank 1 was unregistered but holds state: cursor epoch %d batch %d index %d, %d blocks, last heard %d",
			e, s, i, blocks, n.node.FSM().LastHeard(r1))
	}

	// Registered again (to another engine, not publishing yet), it starts
	// clean.
	other := newEngine(t, false)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: other.Endpoint(),
		ModelName: "llama", BlockSize: testBlockSize, DPRank: u32(1)}), 201, "register dp 1 again")
	if c := n.node.Cursor(r1); c != 0 {
		t.Fatalf("the rank registered again starts at cursor %#x", c)
	}
}

// unregisteredTarget acks every batch Unregistered, as raftfsm does for a
// Positional worker's rank it does not list, and counts them.
type unregisteredTarget struct{ proposed int }

func (f *unregisteredTarget) CheckLeader() error                         { return nil }
func (f *unregisteredTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *unregisteredTarget) Cursor(kvevent.Rank) uint64                 { return 0 }
func (f *unregisteredTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	f.proposed++
	return []raftfsm.RankAck{{Rank: bs[0].Rank, Unregistered: true}}, nil
}

// TestAgentlessSinkDropsTheBatchesOfAnUnregisteredRank: a batch acked
// Unregistered is no refused batch (no error, so no resync for it): the
// sink drops it, one proposal per batch, until reconcile stops the
// subscriber. A clear due then stays due, its epoch not taken: it did not
// commit (the sink took it as committed, and would have applied the
// batches of a rank registered again in an epoch no clear started).
func TestAgentlessSinkDropsTheBatchesOfAnUnregisteredRank(t *testing.T) {
	ft := &unregisteredTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1, DP: 1}
	s := &positionSink{a: a, rank: r}
	s.Resync(r, enginesub.ReasonGap) // a clear due; it meets the unregistration
	for seq := uint64(4); seq < 8; seq++ {
		st := []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: seq, LocalHash: seq}}}}
		if err := s.Events(r, seq, st); err != nil {
			t.Fatalf("batch %d: %v", seq, err)
		}
	}
	if ft.proposed != 5 || s.clearDue == "" || s.epoch != 0 {
		t.Fatalf("%d proposals, clear due %q, epoch %d: want the clear tried with each batch, still due, in epoch 0",
			ft.proposed, s.clearDue, s.epoch)
	}
}
