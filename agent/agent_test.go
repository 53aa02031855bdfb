package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m, testwatch.NodeIgnores()...), testwatch.NodeIgnores()...)
}

var quiet = slog.New(slog.DiscardHandler)

// router is a single-node cluster with its embedded NATS and ingester.
type router struct {
	node *raftfsm.Node
	ns   *server.Server
}

func startRouter(t *testing.T) *router {
	t.Helper()
	return startRouterGrace(t, 0)
}

// startRouterGrace is startRouter whose leader removes the ranks of a
// worker that is not registered once it has stayed so for grace (0: the
// ingester's default).
func startRouterGrace(t *testing.T, grace time.Duration) *router {
	t.Helper()
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Name: "n1", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	addr, tr := raft.NewInmemTransport("")
	node, err := raftfsm.NewNode(raftfsm.Config{ID: "n1", RaftAddr: string(addr), HTTPAddr: "http-n1",
		DataDir: filepath.Join(t.TempDir(), "n1"), Transport: tr, Logger: quiet,
		Peers: []raftfsm.Member{{ID: "n1", RaftAddr: string(addr), HTTPAddr: "http-n1", Voter: true}}})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect("", nats.InProcessServer(ns), nats.NoReconnect())
	if err != nil {
		t.Fatal(err)
	}
	in, err := eventplane.NewIngester(eventplane.IngesterConfig{Conn: nc, Node: node, Logger: quiet, UnregisteredGrace: grace})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.Close()
		node.Close()
		nc.Close()
		ns.Shutdown()
		ns.WaitForShutdown()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := node.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	return &router{node: node, ns: ns}
}

// startAgent runs an agent for worker 7 rank 0 whose subscriber binds an
// ephemeral port no engine connects to: the tests feed its Sink directly.
// (startAgentWith with a Config.Endpoint connects it to that endpoint.)
func startAgent(t *testing.T, r *router) (*Agent, func()) {
	return startAgentWith(t, r, Config{})
}

func startAgentWith(t *testing.T, r *router, cfg Config) (*Agent, func()) {
	t.Helper()
	return startAgentThen(t, r, cfg, nil)
}

// startAgentThen is startAgentWith that calls before (when not nil) with
// the new agent before it runs, as kvagent opens its offload pools.
func startAgentThen(t *testing.T, r *router, cfg Config, before func(*Agent)) (*Agent, func()) {
	t.Helper()
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Endpoint == "" {
		cfg.Endpoint, cfg.Bind = "tcp://127.0.0.1:*", true
	}
	cfg.Worker, cfg.BlockSize, cfg.Conn = 7, 4, nc
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if before != nil {
		before(a)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("agent run: %v", err)
		}
		a.Close()
		nc.Close()
	}
	t.Cleanup(stop)
	return a, stop
}

var rank = kvevent.Rank{Worker: 7}

// workerRegistered says whether the router's worker table holds worker 7.
func workerRegistered(r *router) bool { _, ok := r.node.WorkerTable()[7]; return ok }

func storedChain(parent uint64, hs ...uint64) kvevent.Event {
	ev := kvevent.Event{Rank: rank, Kind: kvevent.KindStored}
	if parent != 0 {
		ev.HasParent, ev.Parent = true, parent
	}
	for _, h := range hs {
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: 1000 + h})
	}
	return ev
}

// matched returns how many of the local hashes 1001..1000+n rank 7's
// prefix covers in the router's index.
func matched(r *router, n int) uint32 {
	q := make([]uint64, n)
	for i := range q {
		q[i] = uint64(1001 + i)
	}
	var m indexer.Matches
	r.node.FindMatches(q, indexer.ViewDedup, &m)
	for _, rm := range m.Ranks {
		if rm.Rank == rank {
			return rm.Total()
		}
	}
	return 0
}

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAgentPublishesAndClears: engine batches reach the router's index
// through the agent; a reset or resync clears the rank there.
func TestAgentPublishesAndClears(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	if err := a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2), storedChain(2, 3)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the chain in the router's index", func() bool { return matched(r, 3) == 3 })
	a.Reset(rank)
	waitFor(t, "the reset to clear the rank", func() bool { return matched(r, 3) == 0 })
	if err := a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the new epoch's block", func() bool { return matched(r, 3) == 1 })
	a.Resync(rank, enginesub.ReasonOverrun)
	waitFor(t, "the resync to clear the rank", func() bool { return matched(r, 3) == 0 })
}

// TestAgentRestartReplacesTheOldIncarnation: a restarted agent numbers
// its events from 1 again; its resync on start replaces what the router
// kept of the old one, so its new events are applied, not taken for
// duplicates of the old ids.
func TestAgentRestartReplacesTheOldIncarnation(t *testing.T) {
	r := startRouter(t)
	a, stop := startAgent(t, r)
	for i := uint64(1); i <= 5; i++ {
		if err := a.Events(rank, 0, []kvevent.Event{storedChain(i-1, i)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the old incarnation's chain", func() bool { return matched(r, 5) == 5 })
	stop()

	b, _ := startAgent(t, r)
	// The new incarnation's engine (restarted too) stores a shorter chain.
	if err := b.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the router to hold exactly the new incarnation's chain", func() bool {
		return matched(r, 5) == 2 && r.node.FSM().Cursor(rank) >= 1
	})
	acked, last := b.Publisher().Cursor(rank)
	waitFor(t, "the new events acknowledged", func() bool {
		acked, last = b.Publisher().Cursor(rank)
		return acked == last
	})
	if got := r.node.FSM().Cursor(rank); got != last {
		t.Fatalf("router cursor %d, agent's last id %d", got, last)
	}
}

// TestDumpCarriesHeldOrphans: an engine store whose parent the rank does
// not hold yet is held as an orphan, in the mirror and on the router; a
// dump in between replaces the router's state with the mirror's, so it
// must carry the orphan too, for the router to adopt it when the parent
// comes. From a review: dump leaving the held orphans out left every test
// green.
func TestDumpCarriesHeldOrphans(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(1, 2)})) // 1 not stored yet
	caughtUp(t, r, a)
	resyncAndWait(t, a)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
	caughtUp(t, r, a)
	if got := matched(r, 2); got != 2 {
		t.Fatalf("the router matches %d of 1 and the orphan 2 it adopts, want 2", got)
	}
}

// resyncAndWait has a's publisher dump rank (a resync, as the router's
// ask, a lapse or a buffer overrun starts one) and waits until the
// router has taken it.
func resyncAndWait(t *testing.T, a *Agent) {
	t.Helper()
	before := a.Publisher().Synced(rank)
	a.Publisher().Resync(rank)
	waitFor(t, "the dump", func() bool { s := a.Publisher().Synced(rank); return s != 0 && s != before })
}

// TestLeaseExpiresWithoutHeartbeats: an agent registers its worker with a
// lease and keeps it alive with heartbeats; removed by hand, it registers
// again; once the agent stops, the leader removes the worker.
func TestLeaseExpiresWithoutHeartbeats(t *testing.T) {
	r := startRouter(t)
	_, stop := startAgentWith(t, r, Config{Registrar: r.node, HeartbeatInterval: 50 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{BlockSize: 4, LeaseMs: 1000}})
	registered := func() bool { return workerRegistered(r) }
	waitFor(t, "the agent to register its worker", registered)
	regAt := r.node.FSM().RegisteredAt(7)
	// Heartbeats keep it: several leases pass and it stays. (From a review:
	// this watched 2 s of a 4 s lease, which a worker without heartbeats
	// outlives too. Without them the leader's 250 ms sweep removes it
	// within 1.25 s of its registration.) The leases are the leader's to
	// count, not a window of this test's clock: a sentinel worker with
	// the same lease and no heartbeats, registered after ours (so its
	// lease starts at the same sweep as ours or a later one), is removed
	// by the leader three times over. A lease of ours that the
	// heartbeats did not renew would have run out by the sentinel's
	// second removal at the latest; a removal the agent healed by
	// registering again shows as a new registration time.
	const sentinel = 99
	for round := range 3 {
		if err := r.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: sentinel, BlockSize: 4, LeaseMs: 1000}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, fmt.Sprintf("the leader to expire the sentinel's lease (round %d)", round+1), func() bool {
			if !registered() {
				t.Fatalf("the worker was removed while its agent sent heartbeats (round %d)", round+1)
			}
			_, ok := r.node.WorkerTable()[sentinel]
			return !ok
		})
	}
	if !registered() || r.node.FSM().RegisteredAt(7) != regAt {
		t.Fatalf("the worker was removed while its agent sent heartbeats (registered %v, at %d, first at %d)",
			registered(), r.node.FSM().RegisteredAt(7), regAt)
	}
	if err := r.node.DeregisterWorker(context.Background(), 7); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the agent to register again after the leader said it was unknown", registered)
	stop()
	waitFor(t, "the lease to expire", func() bool { return !registered() })
}

// heldRegistrar holds every registration until its context ends.
type heldRegistrar struct{ calls atomic.Int32 }

func (h *heldRegistrar) RegisterWorker(ctx context.Context, _ raftfsm.WorkerInfo) error {
	h.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

// TestHeartbeatsGoOnWhileRegistrationHangs: a registration against an HTTP
// API that does not answer holds no heartbeat back. From a review: the
// registration ran between heartbeats, so a 5 s try kept a live worker
// silent past a short lease.
func TestHeartbeatsGoOnWhileRegistrationHangs(t *testing.T) {
	r := startRouter(t)
	lc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer lc.Close()
	// Counted beside the leader's own answer (a plain subscription gets
	// every heartbeat; the leader's queue group answers).
	var beats atomic.Int32
	sub, err := lc.Subscribe(eventplane.DefaultHeartbeatSubject, func(*nats.Msg) { beats.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := lc.Flush(); err != nil {
		t.Fatal(err)
	}
	reg := &heldRegistrar{}
	startAgentWith(t, r, Config{Registrar: reg, HeartbeatInterval: 50 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{BlockSize: 4, LeaseMs: 1000}})
	// Well within the first try's 5 s.
	deadline := time.Now().Add(4 * time.Second)
	for beats.Load() < 5 {
		if time.Now().After(deadline) {
			t.Fatalf("%d heartbeats while the first registration hung (%d tries)", beats.Load(), reg.calls.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReRegistrationResyncsTheRanks: a worker removed on the router (its
// lease ran out while the agent was cut off; here an operator's removal)
// is registered again by its agent, which resyncs its ranks: the router
// holds the engine's blocks again although the engine sends nothing more.
// From a review: it waited for the engine's next event to show the gap.
func TestReRegistrationResyncsTheRanks(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgentWith(t, r, Config{Registrar: r.node, HeartbeatInterval: 50 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{BlockSize: 4, LeaseMs: 10000}})
	registered := func() bool { return workerRegistered(r) }
	waitFor(t, "the agent to register its worker", registered)
	if err := a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2), storedChain(2, 3)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the chain in the router's index", func() bool { return matched(r, 3) == 3 })
	if err := r.node.DeregisterWorker(context.Background(), 7); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the chain back in the router's index after the worker registered again", func() bool {
		return registered() && matched(r, 3) == 3
	})
}

// gatedRegistrar fails every registration, as an unreachable router HTTP
// API does, until open is set; then it registers through node.
type gatedRegistrar struct {
	node *raftfsm.Node
	open atomic.Bool
}

func (g *gatedRegistrar) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	if !g.open.Load() {
		return errors.New("dial tcp 10.0.0.1:7080: connect: connection refused")
	}
	return g.node.RegisterWorker(ctx, w)
}

// TestFirstRegistrationAfterTheGraceResyncsTheRanks: the agent's first
// registration goes through only after the leader's unregistered grace
// removed the ranks its start dump and events had put on the router (the
// router's HTTP API was unreachable for a while, NATS was not). The
// heartbeats said the worker was unknown meanwhile, so the registration
// resyncs every rank: the router holds an idle engine's blocks again. From
// a review: the first registration was taken for one that needs no resync
// (Run had dumped every rank already), and the worker was a route
// candidate with an empty index until the engine's next event showed a
// gap.
func TestFirstRegistrationAfterTheGraceResyncsTheRanks(t *testing.T) {
	r := startRouterGrace(t, 300*time.Millisecond)
	reg := &gatedRegistrar{node: r.node}
	a, _ := startAgentWith(t, r, Config{Registrar: reg, HeartbeatInterval: 20 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{BlockSize: 4, LeaseMs: 10000}})
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	waitFor(t, "the chain on the router (the worker not registered yet)", func() bool { return matched(r, 3) == 3 })
	waitFor(t, "the grace to remove the ranks", func() bool { return matched(r, 3) == 0 && r.node.FSM().Cursor(rank) == 0 })
	// The router's HTTP API is reachable again; the engine stays idle.
	reg.open.Store(true)
	waitFor(t, "the worker registered", func() bool { return workerRegistered(r) })
	waitFor(t, "the chain back on the router after the first registration", func() bool { return matched(r, 3) == 3 })
}

// TestWorkerRegisteredElsewhereIsResyncedAfterEachRemoval: an agent without
// a Registrar (kvagent without --router: something else registers its
// worker) hears from the leader's heartbeat answers that its worker was
// removed (a lease ran out, an operator removed it), which took its ranks'
// state off the router. Once the worker is registered again, whoever
// registers it, the agent resyncs every rank: an idle engine's blocks are
// back on the router. Each removal is logged, not only a process's first.
// From a review: the agent warned once per process and never resynced.
func TestWorkerRegisteredElsewhereIsResyncedAfterEachRemoval(t *testing.T) {
	r := startRouter(t)
	info := raftfsm.WorkerInfo{ID: 7, BlockSize: 4, DPRanks: []uint32{0}, LeaseMs: 60000}
	must(t, r.node.RegisterWorker(context.Background(), info))
	var logs testlog.Buffer
	a, _ := startAgentWith(t, r, Config{HeartbeatInterval: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	waitFor(t, "the chain on the router", func() bool { return matched(r, 3) == 3 })
	for i := 1; i <= 2; i++ {
		// No dump in flight (the start's, or the last resync's): one
		// applied after the removal puts the ranks back, as an agent that
		// publishes without a registration may (the leader's sweep removes
		// them), and the chain reads as resynced without the agent having
		// heard the worker known again.
		waitFor(t, fmt.Sprintf("the rank's dump taken before removal %d", i), func() bool {
			return a.Publisher().Synced(rank) != 0 && a.Publisher().Pending() == 0
		})
		must(t, r.node.DeregisterWorker(context.Background(), 7))
		if n := matched(r, 3); n != 0 {
			t.Fatalf("removal %d: the router matches %d blocks of a removed worker", i, n)
		}
		waitFor(t, fmt.Sprintf("the agent to hear of removal %d", i), func() bool {
			return len(logs.Lines("level=WARN", "the router does not know this worker")) == i
		})
		// An orchestrator registers the worker again; the engine is idle.
		must(t, r.node.RegisterWorker(context.Background(), info))
		waitFor(t, fmt.Sprintf("the chain back on the router after removal %d", i), func() bool { return matched(r, 3) == 3 })
	}
}
