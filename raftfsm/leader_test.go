package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
)

// gatedN3 starts a 3-node cluster, each node's Config set by tweak first
// (nil: nothing), whose n3 takes its FSM batches through g's gate (opened
// at cleanup, before the cluster closes, as Raft's shutdown waits for the
// FSM), and returns it with its leader l, n1 or n2.
func gatedN3(t *testing.T, tweak func(*Config)) (c *testCluster, l, n3 *Node, g *fsmGate) {
	t.Helper()
	g = newFSMGate()
	c = newTestCluster(t, 3, func(cfg *Config) {
		if tweak != nil {
			tweak(cfg)
		}
		if cfg.ID == "n3" {
			cfg.applyGate = g.gate
		}
	})
	t.Cleanup(g.open)
	l, n3 = c.leader(), c.nodes[2]
	if l == n3 {
		transferLeadership(t, l, "n1")
		l = c.leader()
	}
	return c, l, n3, g
}

// leadBehind moves the leadership from l to n once n's log holds every
// entry l's does, its FSM (gated) still behind them, and returns n,
// leading.
func (c *testCluster) leadBehind(l, n *Node) *Node {
	c.t.Helper()
	waitFor(c.t, 10*time.Second, n.cfg.ID+" to hold "+l.cfg.ID+"'s entries in its log", func() bool { return n.raft.LastIndex() >= l.raft.LastIndex() })
	return c.leadTo(n.cfg.ID)
}

// logWrites records, by term, the Barriers and commands Raft writes to a
// node's log (Config.beforeLogWrite = record): those a new leader writes
// in its term tell what a call of it has proposed while its FSM is gated.
type logWrites struct {
	mu      sync.Mutex
	written []raft.Log // Term and Type only
}

func (w *logWrites) record(logs []*raft.Log) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, l := range logs {
		if l.Type == raft.LogBarrier || l.Type == raft.LogCommand {
			w.written = append(w.written, raft.Log{Term: l.Term, Type: l.Type})
		}
	}
}

// inTerm returns the types of the entries written in term, in order.
func (w *logWrites) inTerm(term uint64) []raft.LogType {
	w.mu.Lock()
	defer w.mu.Unlock()
	var types []raft.LogType
	for _, l := range w.written {
		if l.Term == term {
			types = append(types, l.Type)
		}
	}
	return types
}

// pausedN3 starts a 3-node cluster whose leader l (n1 or n2) registered w;
// once all converged, it paused n3's FSM goroutine in its gate (g: the next
// batch n3 applies waits there; gatedN3).
func pausedN3(t *testing.T, w WorkerInfo) (c *testCluster, l, n3 *Node, g *fsmGate) {
	t.Helper()
	c, l, n3, g = gatedN3(t, nil)
	if err := l.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	c.converged()
	g.pause()
	return c, l, n3, g
}

// electBehindTheFSM sets up a new leader whose FSM lacks an entry its
// predecessor acknowledged: a 3-node cluster where n3's FSM goroutine,
// paused in its gate (the returned fsmGate; opened at cleanup, before the
// cluster closes: Raft's shutdown waits for the FSM), holds a worker
// registration that n1 and n2 applied, when n3 takes over. It returns n3,
// leading.
func electBehindTheFSM(t *testing.T) (*Node, *fsmGate) {
	t.Helper()
	c, l, n3, g := pausedN3(t, WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}})
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	return c.leadBehind(l, n3), g
}

// TestCheckLeaderWaitsForTheBarrier: a node elected while its FSM still
// lacks an entry its predecessor acknowledged refuses CheckLeader (the
// gate of handlers that judge a write by the replicated state) until its
// post-election Barrier has passed. It used to pass at once: a compatible
// API registration judged on the stale worker table then dropped the
// acknowledged dp rank and its index state.
func TestCheckLeaderWaitsForTheBarrier(t *testing.T) {
	n3, g := electBehindTheFSM(t)
	if err := n3.CheckLeader(); !errors.Is(err, ErrNoLeader) {
		t.Fatalf("CheckLeader = %v on a new leader whose worker table holds dp ranks %v of the acknowledged [0 1]; want ErrNoLeader",
			err, n3.WorkerTable()[1].DPRanks)
	}
	g.open()
	waitFor(t, 10*time.Second, "n3's Barrier", func() bool { return n3.CheckLeader() == nil })
	if got := n3.WorkerTable()[1].DPRanks; !slices.Equal(got, []uint32{0, 1}) {
		t.Fatalf("the leader's worker table holds dp ranks %v once CheckLeader passes, want [0 1]", got)
	}
}

// TestANewLeaderJudgesABlockSizeAfterItsBarrier: a node elected while its
// FSM still lacks a registration its predecessor acknowledged (worker 1,
// block size 16) judges a worker without a model (worker 2, block size 8)
// only once a Barrier has applied it, and refuses it with
// ErrBlockSizeConflict. n3's log writes tell when the registration's check
// is past (its own Barrier, or, without one, its entry, is written in n3's
// term beside the term's set-up Barrier) before its FSM may go on. It used
// to judge the stale table, without worker 1, and register worker 2.
func TestANewLeaderJudgesABlockSizeAfterItsBarrier(t *testing.T) {
	var w logWrites
	c, l, n3, g := gatedN3(t, func(cfg *Config) {
		if cfg.ID == "n3" {
			cfg.beforeLogWrite = w.record
		}
	})
	c.converged()
	g.pause()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	c.leadBehind(l, n3)
	if err := registerBehind(t, n3, g, &w, WorkerInfo{ID: 2, BlockSize: 8, DPRanks: []uint32{0}}); !errors.Is(err, ErrBlockSizeConflict) {
		t.Fatalf("worker 2 of block size 8 on a new leader behind worker 1 of 16: %v, want ErrBlockSizeConflict", err)
	}
}

// registerBehind registers wi on n, a new leader whose FSM waits in g's
// gate, and opens the gate once n's log holds, in its term, the set-up
// Barrier and the registration's Barrier or entry (w records n's log
// writes): the registration's check is past then, on the table of the
// gated FSM unless a Barrier came first. It returns the registration's
// answer.
func registerBehind(t *testing.T, n *Node, g *fsmGate, w *logWrites, wi WorkerInfo) error {
	t.Helper()
	term := n.raft.CurrentTerm()
	errc := make(chan error, 1)
	go func() { errc <- n.RegisterWorker(ctx(t), wi) }()
	waitFor(t, 10*time.Second, "the set-up Barrier and the registration's Barrier or entry in "+n.cfg.ID+"'s log", func() bool {
		return len(w.inTerm(term)) >= 2
	})
	g.open()
	err := <-errc
	t.Logf("log writes of term %d: %v", term, w.inTerm(term))
	return err
}

// TestANewLeaderJudgesAReRegistrationByTheWorkersEntryAfterItsBarrier:
// worker 2 (no model), registered at block size 16, moved to 32 alone, and
// worker 1 registered at 32, through n3's predecessor while n3's FSM was
// gated. Worker 2 registering at 16 again on n3 changes its block size
// against worker 1's, the smallest id's: ErrBlockSizeConflict. n3 read
// worker 2's entry before its Barrier, the stale one at 16, took the
// registration for one that changes nothing, let it through unjudged, and
// left worker 2 out of worker 1's block size.
func TestANewLeaderJudgesAReRegistrationByTheWorkersEntryAfterItsBarrier(t *testing.T) {
	var w logWrites
	c, l, n3, g := gatedN3(t, func(cfg *Config) {
		if cfg.ID == "n3" {
			cfg.beforeLogWrite = w.record
		}
	})
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	g.pause()
	for _, wi := range []WorkerInfo{{ID: 2, BlockSize: 32, DPRanks: []uint32{0}}, {ID: 1, BlockSize: 32, DPRanks: []uint32{0}}} {
		if err := l.RegisterWorker(ctx(t), wi); err != nil {
			t.Fatal(err)
		}
	}
	c.leadBehind(l, n3)
	if err := registerBehind(t, n3, g, &w, WorkerInfo{ID: 2, BlockSize: 16, DPRanks: []uint32{0}}); !errors.Is(err, ErrBlockSizeConflict) {
		t.Fatalf("worker 2 back to block size 16 on a new leader whose FSM held it at 16, behind its move to 32 and worker 1's 32: %v, want ErrBlockSizeConflict (worker table now %v)",
			err, n3.WorkerTable())
	}
}

// TestABookedRouteOnANewLeaderWaitsForItsBarrier: a booking its
// predecessor acknowledged (req-1, ISL 200, busy_prefill_tokens 100) makes
// the only rank busy. n3, elected while its FSM still lacks that booking,
// refuses a booked route (ErrNoLeader, retry) until its post-election
// Barrier has passed, and then finds the rank busy (ErrOverloaded). It
// used to check IsLeader only, decide at once from a load view without
// req-1, and book req-2 on the busy rank too.
func TestABookedRouteOnANewLeaderWaitsForItsBarrier(t *testing.T) {
	c, l, n3, g := gatedN3(t, nil)
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 100
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	g.pause()
	q := RouteQuery{ISL: 200, Book: true, RequestID: "req-1"}
	if _, err := l.Route(ctx(t), q); err != nil {
		t.Fatal(err)
	}
	c.leadBehind(l, n3)
	from := n3.raft.LastIndex() + 1
	type answer struct {
		res RouteResult
		err error
	}
	done := make(chan answer, 1)
	q.RequestID = "req-2"
	go func() {
		res, err := n3.Route(ctx(t), q)
		done <- answer{res, err}
	}()
	// Refused at once, or decided: its booking then waits in n3's log
	// for the paused FSM.
	waitFor(t, 10*time.Second, "req-2's answer or decision", func() bool {
		return len(done) > 0 || bookAddsInLog(t, n3, from, "req-2") > 0
	})
	g.open()
	a := <-done
	if a.err == nil && a.res.Booked {
		t.Fatalf("a new leader, its FSM behind the acknowledged booking req-1 (ISL 200 over busy_prefill_tokens 100), booked req-2 on %v too (loads now %+v); want ErrNoLeader before its Barrier",
			a.res.Decision.Rank, n3.Loads())
	}
	if !errors.Is(a.err, ErrNoLeader) {
		t.Fatalf("req-2 on the new leader before its Barrier: %v, want ErrNoLeader", a.err)
	}
	waitFor(t, 10*time.Second, "n3's Barrier", func() bool { return n3.CheckLeader() == nil })
	if _, err := n3.Route(ctx(t), q); !errors.Is(err, indexer.ErrOverloaded) {
		t.Fatalf("req-2 on the new leader after its Barrier: %v, want ErrOverloaded (req-1's 200 prefill tokens on the one rank)", err)
	}
}

// TestALeaderReElectedDuringItsBarrierWaitsForTheNextOne: n1, leading in
// term a, waits for its post-election Barrier (committed, behind a batch
// its FSM has not applied) while n2 leads in term b and commits worker 2,
// and n1 leads again in term c. The Barrier of term a passing covers only
// what was committed before term a: n1 must not pass CheckLeader for term
// c while its FSM lacks worker 2. onLeadership reads the term before the
// Barrier for that; read after it, it said term c and passed at once.
func TestALeaderReElectedDuringItsBarrierWaitsForTheNextOne(t *testing.T) {
	gate := make(chan struct{})
	stopFeed, fed := make(chan struct{}), make(chan struct{})
	go func() { // a token per batch until stopFeed
		defer close(fed)
		for {
			select {
			case gate <- struct{}{}:
			case <-stopFeed:
				return
			}
		}
	}()
	c := newTestCluster(t, 3, func(cfg *Config) {
		// Nothing but the test's commands between theirs and the Barrier.
		cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
		if cfg.ID == "n1" {
			cfg.applyGate = gate
		}
	})
	var opened sync.Once
	open := func() { opened.Do(func() { close(gate) }) }
	t.Cleanup(open) // before the cluster closes: Raft's shutdown waits for the FSM
	n1 := c.nodes[0]
	l := c.leadTo("n2")
	waitFor(t, 10*time.Second, "n2's Barrier", func() bool { return l.CheckLeader() == nil })
	c.converged()
	close(stopFeed)
	<-fed // n1's FSM takes the next batch, worker 1's, only with a token
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	w1 := l.raft.LastIndex()
	waitFor(t, 10*time.Second, "n1 to know worker 1 committed", func() bool { return n1.raft.CommitIndex() >= w1 })
	c.leadTo("n1")
	termA := n1.raft.CurrentTerm()
	waitFor(t, 10*time.Second, "n1's Barrier of term a committed", func() bool {
		return lastIsBarrier(n1) && n1.raft.CommitIndex() >= n1.raft.LastIndex()
	})
	l = c.leadTo("n2")
	waitFor(t, 10*time.Second, "n2's Barrier", func() bool { return l.CheckLeader() == nil })
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 4, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	c.leadTo("n1")
	if n1.raft.CurrentTerm() <= termA+1 {
		t.Fatalf("n1 leads in term %d, want one after n2's (term a %d)", n1.raft.CurrentTerm(), termA)
	}
	// Worker 1's batch goes, the Barrier of term a passes, and worker 2's
	// batch waits in the gate.
	gate <- struct{}{}
	waitFor(t, 10*time.Second, "n1's set-up of term a to end", func() bool { return n1.ledTerm.Load() >= termA })
	if _, ok := n1.WorkerTable()[2]; ok {
		t.Fatal("n1's FSM holds worker 2 before the gate opens: the test needs it behind")
	}
	if err := n1.CheckLeader(); err == nil {
		t.Fatalf("n1 passed CheckLeader in term %d (set-up ended for term %d) with its FSM lacking worker 2, committed in between",
			n1.raft.CurrentTerm(), n1.ledTerm.Load())
	}
	open()
	waitFor(t, 10*time.Second, "n1's Barrier of its new term", func() bool { return n1.CheckLeader() == nil })
	if _, ok := n1.WorkerTable()[2]; !ok {
		t.Fatal("n1 passed CheckLeader without worker 2")
	}
}

// TestANewLeaderIsReadyOnlyOnceItsBarrierPassed: a node that becomes
// leader is not ready while its post-election Barrier has not passed,
// though its FSM holds everything its log says is committed: only the
// Barrier proves a new leader's state holds what earlier leaders
// committed (a leader's commit index is its own, with no leader's to
// check it against). Once the Barrier passed, it is ready.
func TestANewLeaderIsReadyOnlyOnceItsBarrierPassed(t *testing.T) {
	c, free := newHeldCluster(t, 1, nil)
	n := c.nodes[0]
	// Every other condition of readiness holds: only the Barrier is
	// missing.
	waitFor(t, 10*time.Second, "the FSM to hold everything committed", func() bool {
		addr, _ := n.raft.LeaderWithID()
		commit := n.raft.CommitIndex()
		applied, _ := n.fsm.Applied()
		return addr != "" && commit > 0 && n.raft.AppliedIndex() >= commit && n.fsmHasApplied(commit, applied)
	})
	n.checkReady()
	if n.ready.Load() || n.Status().Ready {
		t.Fatalf("%s, leading in term %d, is ready before its Barrier", n.cfg.ID, n.raft.CurrentTerm())
	}
	free()
	if err := n.WaitReady(ctx(t)); err != nil {
		t.Fatalf("%s not ready once its Barrier could pass: %v", n.cfg.ID, err)
	}
}

// fsmGate is a Config.applyGate that a test can pause: the FSM takes a
// batch per token; once paused it takes none until opened, and then the
// gate stays open.
type fsmGate struct {
	gate         chan struct{}
	pauseCh      chan chan struct{}
	release, fed chan struct{}
	once         sync.Once
}

func newFSMGate() *fsmGate {
	g := &fsmGate{gate: make(chan struct{}), pauseCh: make(chan chan struct{}), release: make(chan struct{}), fed: make(chan struct{})}
	go func() {
		defer close(g.fed)
		for {
			select {
			case g.gate <- struct{}{}:
			case ack := <-g.pauseCh:
				close(ack)
				<-g.release
				close(g.gate)
				return
			case <-g.release:
				close(g.gate)
				return
			}
		}
	}()
	return g
}

// pause stops the tokens: the batch the FSM takes next waits in the gate.
func (g *fsmGate) pause() {
	ack := make(chan struct{})
	g.pauseCh <- ack
	<-ack
}

// open lets everything through from now on; it may be called again.
func (g *fsmGate) open() { g.once.Do(func() { close(g.release); <-g.fed }) }

// TestCloseWhileABarrierWaitsForTheFSM: a node closed while its
// post-election Barrier is committed but queued behind a batch the FSM is
// still applying closes. Raft drops what is queued for the FSM when it
// shuts down, unanswered, and the leader loop used to wait on that
// Barrier for ever, so Close (which waits for the loop) never returned;
// it hung a whole test package on CI. Which of the two the FSM goroutine
// takes once the batch is done is Raft's random choice, so the test tries
// a few times.
func TestCloseWhileABarrierWaitsForTheFSM(t *testing.T) {
	for try := range 4 {
		t.Run(fmt.Sprintf("try%d", try), func(t *testing.T) {
			n3, g := electBehindTheFSM(t) // n3's FSM goroutine waits in the gate with an entry
			waitFor(t, 10*time.Second, "n3's Barrier to commit", func() bool {
				return n3.raft.CommitIndex() == n3.raft.LastIndex() && lastIsBarrier(n3)
			})
			closed := make(chan struct{})
			go func() { n3.Close(); close(closed) }()
			waitFor(t, 10*time.Second, "n3's Raft to begin its shutdown", n3.raftShutDown)
			g.open() // the FSM finishes the batch, then takes the Barrier or the shutdown
			waitFor(t, 10*time.Second, "n3's Close to return", func() bool {
				select {
				case <-closed:
					return true
				default:
					return false
				}
			})
		})
	}
}

// lastIsBarrier reports whether n's last log entry is a Barrier of its
// current term.
func lastIsBarrier(n *Node) bool {
	var e raft.Log
	return n.logs.GetLog(n.raft.LastIndex(), &e) == nil && e.Type == raft.LogBarrier && e.Term == n.raft.CurrentTerm()
}

// TestRetriedBookingAnswersTheBookedRank: a route that books, sent again
// with the same request id (its answer was lost, or a leader change made
// the API forward it again), answers the rank the first try booked, not
// the rank its own decision prefers now that the first booking loads the
// other; the load is counted once. A request id freed before books nothing.
func TestRetriedBookingAnswersTheBookedRank(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	q := RouteQuery{LocalHashes: []uint64{1, 2, 3, 4}, ISL: 64, Book: true, RequestID: "req-1"}
	first, err := l.Route(ctx(t), q)
	if err != nil || !first.Booked {
		t.Fatalf("first try: booked %v, err %v", first.Booked, err)
	}
	booked := first.Decision.Rank
	plain := q
	plain.Book, plain.RequestID = false, ""
	if now, err := l.Route(ctx(t), plain); err != nil || now.Decision.Rank == booked {
		t.Fatalf("a route without booking chose %v (err %v): the booking should make the other rank cheaper", now.Decision.Rank, err)
	}
	retry, err := l.Route(ctx(t), q)
	if err != nil {
		t.Fatal(err)
	}
	if !retry.Booked || retry.Decision.Rank != booked || retry.Decision.DecidedBy != indexer.DecidedByBooking {
		t.Fatalf("retry answered %v booked=%v decided by %v; the request is booked on %v",
			retry.Decision.Rank, retry.Booked, retry.Decision.DecidedBy, booked)
	}
	if b, ok := l.Booking("req-1"); !ok || b.Rank != booked {
		t.Fatalf("booking %+v %v, want on %v", b, ok, booked)
	}
	for _, r := range []struct {
		dp   uint32
		want int64
	}{{booked.DP, 1}, {1 - booked.DP, 0}} {
		rank := booked
		rank.DP = r.dp
		if got := l.fsm.Sequences().Load(rank).ActiveRequests; got != r.want {
			t.Fatalf("rank %v: %d active requests, want %d", rank, got, r.want)
		}
	}

	if err := l.Free(ctx(t), "req-1"); err != nil {
		t.Fatal(err)
	}
	again, err := l.Route(ctx(t), q)
	if err != nil || again.Booked {
		t.Fatalf("a freed request id booked again: booked %v, err %v", again.Booked, err)
	}
	if _, ok := l.Booking("req-1"); ok {
		t.Fatal("a freed request id holds a booking")
	}
}

// TestRetriedBookingWhenItsBookingMadeTheRankBusy: a retry of a booked
// route whose first try pushed the only rank over the busy threshold
// answers that rank, booked, rather than 503 overloaded (which would leave
// the load counted with no client to free it until it expires).
func TestRetriedBookingWhenItsBookingMadeTheRankBusy(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 100
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	q := RouteQuery{ISL: 200, Book: true, RequestID: "req-1"}
	first, err := l.Route(ctx(t), q)
	if err != nil || !first.Booked {
		t.Fatalf("first try: booked %v, err %v", first.Booked, err)
	}
	retry, err := l.Route(ctx(t), q)
	if err != nil || !retry.Booked || retry.Decision.Rank != first.Decision.Rank || retry.Decision.DecidedBy != indexer.DecidedByBooking {
		t.Fatalf("retry: %v booked=%v decided by %v, err %v; want %v, booked", retry.Decision.Rank, retry.Booked, retry.Decision.DecidedBy, err, first.Decision.Rank)
	}
	if got := l.fsm.Sequences().Load(first.Decision.Rank).ActiveRequests; got != 1 {
		t.Fatalf("%d active requests, want 1", got)
	}
	// Another request is refused: the rank is busy.
	other := q
	other.RequestID = "req-2"
	if _, err := l.Route(ctx(t), other); !errors.Is(err, indexer.ErrOverloaded) {
		t.Fatalf("a new request on the busy rank: %v, want ErrOverloaded", err)
	}
}

// TestARetriedBookingOnANewLeaderAnswersTheFirstTrysRank: a booked route
// retried on a new leader whose FSM still lacks the first try's booking,
// and an earlier one's, is refused (ErrNoLeader, retry) while its
// post-election Barrier has not passed, proposing nothing; once it passed,
// the retry answers the rank the first try booked, with the load counted
// once. From a review: TestRetriedBookingAnswersTheBookedRank retries on
// the node that booked, whose FSM holds the booking; nothing pinned the
// retry a leader change makes the API forward to a node that has not
// applied it yet. Such a retry used to decide on the stale load and
// propose a booking on its own choice, which the FSM's apply then
// answered with the first try's rank.
func TestARetriedBookingOnANewLeaderAnswersTheFirstTrysRank(t *testing.T) {
	c, l, n3, g := pausedN3(t, WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}})
	// req-0 loads one rank, so req-1 goes to the other; n3, which has
	// applied neither, sees both idle and would choose req-0's again.
	q0 := RouteQuery{LocalHashes: []uint64{1, 2, 3, 4}, ISL: 64, Book: true, RequestID: "req-0"}
	zero, err := l.Route(ctx(t), q0)
	if err != nil || !zero.Booked {
		t.Fatalf("req-0: booked %v, err %v", zero.Booked, err)
	}
	q := q0
	q.RequestID = "req-1"
	first, err := l.Route(ctx(t), q)
	if err != nil || !first.Booked {
		t.Fatalf("req-1's first try: booked %v, err %v", first.Booked, err)
	}
	if first.Decision.Rank == zero.Decision.Rank {
		t.Fatalf("req-1 went to req-0's rank %v: the test needs them apart", first.Decision.Rank)
	}
	c.leadBehind(l, n3)
	waitFor(t, 10*time.Second, "n3's Barrier in its log", func() bool { return lastIsBarrier(n3) })
	if n3.CheckLeader() == nil {
		t.Fatal("n3 passed its Barrier with its FSM gated")
	}
	if _, ok := n3.fsm.Sequences().RankOf("req-1"); ok {
		t.Fatal("n3's FSM holds req-1's booking before its gate opens")
	}
	from := n3.raft.LastIndex() + 1
	if _, err := n3.Route(ctx(t), q); !errors.Is(err, ErrNoLeader) {
		t.Fatalf("the retry on the new leader before its Barrier: %v, want ErrNoLeader", err)
	}
	if got := bookAddsInLog(t, n3, from, "req-1"); got != 0 {
		t.Fatalf("the retry refused before the Barrier proposed %d bookings", got)
	}
	g.open()
	waitFor(t, 10*time.Second, "n3's Barrier", func() bool { return n3.CheckLeader() == nil })
	res, err := n3.Route(ctx(t), q)
	if err != nil || !res.Booked || res.Decision.Rank != first.Decision.Rank {
		t.Fatalf("the retry on the new leader: %v booked=%v, err %v; the first try booked %v",
			res.Decision.Rank, res.Booked, err, first.Decision.Rank)
	}
	for _, r := range []kvevent.Rank{zero.Decision.Rank, first.Decision.Rank} {
		if got := n3.fsm.Sequences().Load(r).ActiveRequests; got != 1 {
			t.Fatalf("%d active requests on %v, want 1", got, r)
		}
	}
}

// TestTransferToTheLeaderItselfIsInvalid: naming the leader as the target
// is the caller's mistake (a 400), not a failure of the node.
func TestTransferToTheLeaderItselfIsInvalid(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.TransferLeadership(ctx(t), l.cfg.ID); !errors.Is(err, ErrInvalid) {
		t.Fatalf("transfer to the leader itself: %v, want ErrInvalid", err)
	}
	// Nor can a lone voter hand over to anyone (Raft's "cannot find peer"
	// was a 500).
	if err := l.TransferLeadership(ctx(t), ""); !errors.Is(err, ErrInvalid) {
		t.Fatalf("transfer from a lone voter: %v, want ErrInvalid", err)
	}
}

// TestTransferToANonvoterIsInvalid: a transfer to a member that is not a
// voter (one added that has not caught up yet: members list shows VOTER
// no) is the caller's mistake (a 400), refused before anything is sent,
// so the leader keeps leading in its term. A non-voter cannot lead: the
// quorum does not count it. From a review: it was accepted, the leader
// stepped down for a needless election, and the caller was told the
// non-voter leads.
//
// Its voters run with Raft timeouts of a second (steadyTimeouts): a
// leader that misses its 200 ms lease under load loses its term whatever
// the transfer does.
func TestTransferToANonvoterIsInvalid(t *testing.T) {
	c := newInmemClusterTuned(t, 3, steadyTimeouts)
	_, l := c.leaderExcept(-1)
	n4, _ := c.newcomer("n4")
	if err := l.raft.AddNonvoter("n4", raft.ServerAddress("inmem-n4"), 0, 0).Error(); err != nil {
		t.Fatal(err)
	}
	// Caught up, so that only its suffrage stands in the way.
	waitFor(t, 10*time.Second, "n4 caught up", func() bool { return n4.raft.LastIndex() == l.raft.LastIndex() })
	term := l.raft.CurrentTerm()
	err := l.TransferLeadership(ctx(t), "n4")
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "n4") || !strings.Contains(err.Error(), "not a voter") {
		t.Fatalf("transfer to the non-voter n4: %v, want ErrInvalid saying n4 is not a voter", err)
	}
	if !l.IsLeader() || l.raft.CurrentTerm() != term {
		t.Fatalf("after the refused transfer %s leads: %v, in term %d (was %d)", l.cfg.ID, l.IsLeader(), l.raft.CurrentTerm(), term)
	}
}

// TestTransferToADownMemberIsUnreachable: a transfer to a member that does
// not answer fails with ErrUnreachable (a 503 the operator can act on),
// the leadership in place, whether it went down a moment ago or the
// leader already counts it down. (Raft's TimeoutNow RPC failing to dial,
// when the member goes down between the check and the RPC, is
// ErrUnreachable too: TestTransferWhoseTimeoutNowAnswerIsLostIsOutcomeUnknown.)
// From a review:
// Raft's unwrapped "failed to make TimeoutNow RPC" was a 500 internal.
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts): with
// one follower down, a leader that missed its 200 ms lease under load
// stepped down, and the transfer answered "no leader".
func TestTransferToADownMemberIsUnreachable(t *testing.T) {
	c := newTestCluster(t, 3, steadyTimeouts)
	l := c.leader()
	c.converged()
	down := slices.IndexFunc(c.nodes, func(n *Node) bool { return n != l })
	c.stop(down)
	for _, when := range []string{"just down", "noticed down"} {
		if when == "noticed down" {
			noticedDown(t, l, c.id(down))
		}
		err := l.TransferLeadership(ctx(t), c.id(down))
		if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), c.id(down)) {
			t.Fatalf("transfer to %s, %s: %v, want ErrUnreachable naming it", c.id(down), when, err)
		}
		if !l.IsLeader() {
			t.Fatalf("%s no longer leads after the failed transfer (%s)", l.cfg.ID, when)
		}
	}
}

// TestTransferToABlackHoledMemberIsUnreachable: a transfer to a voter
// whose Raft address takes connections and never answers (black-holed: a
// host cut off by a firewall that drops its traffic, not one that is down)
// fails with ErrUnreachable naming it, said at once from the leader's
// contacts, the leadership in place; not Raft's TimeoutNow RPC left to
// wait out the transport's timeout or the transfer's election timeout,
// a context.DeadlineExceeded (outcome unknown) though nothing was sent
// that it took. The transfer's own context runs far longer than both.
// From a review: with the leader's down-target check gone,
// TestTransferToADownMemberIsUnreachable still passed, a stopped target's
// refused dial being ErrUnreachable as well.
func TestTransferToABlackHoledMemberIsUnreachable(t *testing.T) {
	c := newTestCluster(t, 3, steadyTimeouts)
	l := c.leader()
	c.converged()
	to := slices.IndexFunc(c.nodes, func(n *Node) bool { return n != l })
	c.stop(to)
	swallowAt(t, c.addrs[to])
	noticedDown(t, l, c.id(to))
	cx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	err := l.TransferLeadership(cx, c.id(to))
	if !errors.Is(err, ErrUnreachable) || errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), c.id(to)) {
		t.Fatalf("transfer to the black-holed %s: %v, want ErrUnreachable naming it (not a timeout)", c.id(to), err)
	}
	if !l.IsLeader() {
		t.Fatalf("%s no longer leads after the refused transfer", l.cfg.ID)
	}
}

// swallowAt listens on addr, a stopped node's Raft address, until the
// test ends, and takes every connection and all it is sent without ever
// answering: a dial there connects and an RPC times out, where one to a
// stopped node's address is refused at once. (blackHole's dial hangs
// instead, and fails as a dial: Raft's TimeoutNow said so, ErrUnreachable
// with no check of the leader's.)
func swallowAt(t *testing.T, addr string) {
	t.Helper()
	var ln net.Listener
	waitFor(t, 5*time.Second, "the port of "+addr+" to be free", func() bool {
		var err error
		ln, err = net.Listen("tcp", addr)
		return err == nil
	})
	var (
		mu     sync.Mutex
		conns  []net.Conn
		closed bool
		wg     sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			cn, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed {
				cn.Close()
			} else {
				conns = append(conns, cn)
				wg.Add(1)
				go func() {
					defer wg.Done()
					_, _ = io.Copy(io.Discard, cn)
				}()
			}
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		closed = true
		for _, cn := range conns {
			cn.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// lostTimeoutNow is a transport whose TimeoutNow RPCs reach their target
// and whose answers are lost (a network blip, the target's connection
// broken right after it took the RPC), or, once undialable is set, whose
// TimeoutNow RPCs fail to dial (the target went down after the leader's
// check that it answers).
//
// A lost answer's RPC is held (late) until the test sends it, once the
// transfer answered: the leader reads the error before the target, taking
// over, can depose it. Sent before the error was returned, the RPC raced
// it: on a loaded machine the target's election deposed the leader first,
// and Raft answered the transfer as one done ("lost leadership during
// transfer (expected)": nil).
type lostTimeoutNow struct {
	*raft.NetworkTransport
	undialable *atomic.Bool
	late       *lateRPCs
}

// lateRPCs holds the TimeoutNow RPCs whose answers lostTimeoutNow lost,
// not yet sent.
type lateRPCs struct {
	mu   sync.Mutex
	send []func() error
}

// sendAll sends the RPCs held, and answers the first error.
func (l *lateRPCs) sendAll() error {
	l.mu.Lock()
	send := l.send
	l.send = nil
	l.mu.Unlock()
	for _, f := range send {
		if err := f(); err != nil {
			return err
		}
	}
	return nil
}

func (t lostTimeoutNow) TimeoutNow(id raft.ServerID, target raft.ServerAddress, args *raft.TimeoutNowRequest, _ *raft.TimeoutNowResponse) error {
	if t.undialable.Load() {
		return fmt.Errorf("dial tcp %s: connect: connection refused", target)
	}
	t.late.mu.Lock()
	t.late.send = append(t.late.send, func() error {
		return t.NetworkTransport.TimeoutNow(id, target, args, &raft.TimeoutNowResponse{})
	})
	t.late.mu.Unlock()
	return errors.New("read tcp 127.0.0.1:1->127.0.0.1:2: i/o timeout")
}

// TestTransferWhoseTimeoutNowAnswerIsLostIsOutcomeUnknown: a leader's
// TimeoutNow RPC that reached the target, whose answer was lost, made the
// target a candidate that takes over. The transfer's error says its
// outcome is unknown (context.DeadlineExceeded: the API's 503 timeout, a
// transfer the client does not send again), not ErrUnreachable. From a
// review: any failure of the RPC was ErrUnreachable, "nothing changed",
// while leadership moved. One that failed to dial sent nothing: still
// ErrUnreachable, the leadership in place.
func TestTransferWhoseTimeoutNowAnswerIsLostIsOutcomeUnknown(t *testing.T) {
	var undialable atomic.Bool
	var late lateRPCs
	c := newTestCluster(t, 3, func(cfg *Config) {
		cfg.Transport = lostTimeoutNow{cfg.Transport.(*raft.NetworkTransport), &undialable, &late}
	})
	l := c.leader()
	waitFor(t, 10*time.Second, "the leader's set-up", l.ledThisTerm)
	c.converged()
	to := slices.IndexFunc(c.nodes, func(n *Node) bool { return n != l })
	undialable.Store(true)
	err := l.TransferLeadership(ctx(t), c.id(to))
	if !errors.Is(err, ErrUnreachable) || !l.IsLeader() {
		t.Fatalf("a transfer whose TimeoutNow to %s failed to dial: %v, %s leads %v; want ErrUnreachable, the leadership in place", c.id(to), err, l.cfg.ID, l.IsLeader())
	}
	undialable.Store(false)
	err = l.TransferLeadership(ctx(t), c.id(to))
	if errors.Is(err, ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a transfer whose TimeoutNow reached %s, its answer lost: %v; want context.DeadlineExceeded (outcome unknown), not ErrUnreachable", c.id(to), err)
	}
	// The RPC reaches the target now, as its lost answer says it may have.
	if err := late.sendAll(); err != nil {
		t.Fatalf("the TimeoutNow whose answer was lost, to %s: %v", c.id(to), err)
	}
	waitFor(t, 10*time.Second, c.id(to)+" to lead", c.nodes[to].IsLeader)
}

// TestTransferToAnyVoterGoesToOneThatAnswers: 3 voters, the follower
// listed first in the configuration down, the other up and as up to date:
// a transfer to any voter goes to the one that answers. From a review:
// Raft chose the target (LeadershipTransfer with none), the first voter
// with the highest next index in configuration order, which on an idle
// cluster is the down one, and the transfer failed ErrUnreachable naming
// a node the caller never chose.
func TestTransferToAnyVoterGoesToOneThatAnswers(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
	l := c.leader()
	waitFor(t, 10*time.Second, "the leader's set-up", l.ledThisTerm)
	c.converged()
	var first string
	for _, s := range l.raft.GetConfiguration().Configuration().Servers {
		if string(s.ID) != l.cfg.ID && s.Suffrage == raft.Voter {
			first = string(s.ID)
			break
		}
	}
	down := slices.IndexFunc(c.nodes, func(n *Node) bool { return n != nil && n.cfg.ID == first })
	c.stop(down)
	noticedDown(t, l, first)
	// Raft's own pick failed every try (the down node is the first
	// follower), so trying again on a loaded machine still catches it.
	t.Logf("%s is down", first)
	transferLeadership(t, l, "")
	waitFor(t, 10*time.Second, "the voter that answers to lead", func() bool {
		for _, n := range c.nodes {
			if n != nil && n != l && n.IsLeader() {
				return true
			}
		}
		return false
	})
}

// TestReadyNeedsALeaderAndMembership: a node that caught up stays ready
// only while it knows a leader and is a member: cut off from a quorum it
// is not ready (it used to stay ready, serving routes from an index that
// no longer moved), and ready again once a leader is back; removed from
// the cluster it is not ready.
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts): the
// removal goes to the leader it found, and a leader that missed Raft's
// default 200 ms lease under load lost its term before it ("no leader").
func TestReadyNeedsALeaderAndMembership(t *testing.T) {
	c := newTestCluster(t, 3, steadyTimeouts)
	l := c.leader()
	c.converged()
	for _, n := range c.nodes {
		if err := n.WaitReady(ctx(t)); err != nil {
			t.Fatal(err)
		}
	}
	// Remove a follower: it is no longer ready.
	var gone *Node
	for _, n := range c.nodes {
		if n != l {
			gone = n
			break
		}
	}
	if err := l.RemoveMember(ctx(t), gone.cfg.ID); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the removed member to be not ready", func() bool { return !gone.Status().Ready })
	// Only a node left out of its own latest configuration, once a
	// member, and hearing from no leader, reports itself removed. (The
	// removed follower does only if the entry that removes it
	// reached it before the leader stopped replicating to it: not always;
	// TestLeaderRemovingItselfSucceeds checks a node that holds the entry.)
	for _, n := range c.nodes {
		if n != gone && n.Status().Removed {
			t.Fatalf("%s reports itself removed", n.cfg.ID)
		}
	}

	// Stop the other follower: the leader loses its quorum and steps down.
	other := -1
	for i, n := range c.nodes {
		if n != l && n != gone {
			other = i
		}
	}
	c.stop(other)
	waitFor(t, 10*time.Second, "the node without a quorum to be not ready", func() bool { return !l.Status().Ready })
	if st := l.Status(); st.LeaderID != "" {
		t.Fatalf("not ready with leader %q known", st.LeaderID)
	}
	c.start(other)
	waitFor(t, 10*time.Second, "a leader again, and the node ready", func() bool { return l.Status().Ready })
}

// TestLeaderRemovingItselfSucceeds: a leader that removes itself, its FSM
// slow to apply the removal, gets nil once it has, and its Raft is then
// shut down. Raft's own ShutdownOnRemove shut Raft down from inside,
// before the FSM goroutine had answered (the call got "raft is already
// shutdown"), and left Close no shutdown to wait for: it closed the
// storage under an FSM that could still be applying.
func TestLeaderRemovingItselfSucceeds(t *testing.T) {
	g := newFSMGate()
	c := newTestCluster(t, 3, func(cfg *Config) {
		if cfg.ID == "n1" {
			cfg.applyGate = g.gate
		}
	})
	t.Cleanup(g.open)
	n1 := c.nodes[0]
	if l := c.leader(); l != n1 {
		transferLeadership(t, l, "n1")
		waitFor(t, 10*time.Second, "n1 to lead", n1.IsLeader)
	}
	waitFor(t, 10*time.Second, "n1's Barrier", func() bool { return n1.CheckLeader() == nil })
	g.pause()
	removed := make(chan error, 1)
	go func() { removed <- n1.RemoveMember(ctx(t), "n1") }()
	waitFor(t, 10*time.Second, "the removal to commit", func() bool {
		at, err := n1.configIndex() // the latest; committed once the commit index reaches it
		return err == nil && at > 0 && at <= n1.raft.CommitIndex() && !n1.inConfiguration("n1")
	})
	if st := n1.raft.State(); st == raft.Shutdown {
		t.Fatal("Raft shut down before the FSM applied the removal")
	}
	g.open()
	if err := testwatch.Within(t, 10*time.Second, removed, "RemoveMember(self)"); err != nil {
		t.Fatalf("RemoveMember(self) = %v", err)
	}
	if !n1.raftShutDown() {
		t.Fatalf("n1's Raft is %v after removing itself, want it shut down", n1.raft.State())
	}
	// It knows it was removed (its readyz says so).
	if st := n1.Status(); !st.Removed || st.Ready {
		t.Fatalf("n1's status after removing itself: %+v, want removed and not ready", st)
	}
	if err := n1.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestCloseWithAWriteInTheLogAnswersMaybeApplied: a write whose entry
// Raft holds when the node closes may still apply (here it is committed,
// and applies when the node starts again): its caller gets a
// *NotLeaderError with MaybeApplied, which the API answers with
// X-Kvrouter-Maybe-Applied for a write not safe twice, not a plain
// ErrShutdown, which the API answered 503 shutting_down and a client took
// for "not applied, send it to another node". From a review: a worker's
// deregistration sent on so answered 404 unknown_worker.
func TestCloseWithAWriteInTheLogAnswersMaybeApplied(t *testing.T) {
	g := newFSMGate()
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.applyGate = g.gate })
	t.Cleanup(g.open)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 7, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the leader's Barrier", func() bool { return n.CheckLeader() == nil })
	before := n.raft.LastIndex()
	g.pause()
	deregistered := make(chan error, 1)
	go func() { deregistered <- n.DeregisterWorker(ctx(t), 7) }()
	waitFor(t, 10*time.Second, "the deregistration to commit", func() bool {
		return n.raft.LastIndex() > before && n.raft.CommitIndex() == n.raft.LastIndex()
	})
	closed := make(chan error, 1)
	go func() { closed <- n.Close() }()
	err := testwatch.Within(t, 10*time.Second, deregistered, "DeregisterWorker")
	var nle *NotLeaderError
	if !errors.As(err, &nle) || !nle.MaybeApplied || !errors.Is(err, ErrShutdown) {
		t.Errorf("a deregistration committed when its node closed: %v; want a *NotLeaderError with MaybeApplied, and ErrShutdown", err)
	}
	if errors.Is(err, ErrNoLeader) || errors.Is(err, ErrNotLeader) {
		// The API checks these before ErrShutdown: a closing node's
		// writes were answered 503 no_leader, not shutting_down.
		t.Errorf("a deregistration committed when its node closed: %v; matches ErrNoLeader or ErrNotLeader, want ErrShutdown alone", err)
	}
	g.open()
	if err := testwatch.Within(t, 10*time.Second, closed, "Close"); err != nil {
		t.Fatal(err)
	}
	c.nodes[0] = nil
	c.start(0)
	n = c.leader()
	waitFor(t, 10*time.Second, "the deregistration to apply after the restart", func() bool {
		_, ok := n.WorkerTable()[7]
		return !ok
	})
}

// TestConcurrentClosesWaitForTheFirst: Close called from two goroutines
// at once closes the node once, and neither returns before its storage
// is closed.
func TestConcurrentClosesWaitForTheFirst(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			err := n.Close()
			if err == nil && !n.fsm.closed() {
				err = errors.New("Close returned before the state database closed")
			}
			errs <- err
		}()
	}
	for range 2 {
		if err := testwatch.Within(t, 10*time.Second, errs, "Close"); err != nil {
			t.Fatal(err)
		}
	}
}

// closeBound is how long a test lets Close take when Raft's shutdown
// waits on a hung peer: raftShutdownGrace, then the transport's
// connections close under it.
const closeBound = raftShutdownGrace + 4*time.Second

// closeWithin closes n and fails t when that takes over closeBound; it
// still waits for the Close, after unblock (nil: nothing) ends what it
// waits on.
func closeWithin(t *testing.T, n *Node, unblock func()) {
	t.Helper()
	start := time.Now()
	done := make(chan struct{})
	go func() { n.Close(); close(done) }()
	select {
	case <-done:
		t.Logf("closed in %v", time.Since(start))
	case <-time.After(closeBound):
		t.Errorf("Close still waits %v after it began: Raft's shutdown waits on a hung peer", time.Since(start))
		if unblock != nil {
			unblock()
		}
		<-done
		t.Logf("closed after %v", time.Since(start))
	}
}

// TestLeaderCloseEndsASnapshotToAHungFollower: a leader's Close while it
// sends its snapshot to a hung follower (a stopped process, a
// black-holed host: its kernel takes the connection, nothing answers)
// returns within closeBound. It waited for the send's deadline, which
// the transport scales by the snapshot's size (its timeout for every
// 256 KiB): minutes for a state of tens of MB, the whole time kvrouter's
// SIGTERM shutdown hung. From a review.
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts): with
// one follower down, a leader that missed its 200 ms lease under load
// stepped down after its snapshot, and no leader sent it.
func TestLeaderCloseEndsASnapshotToAHungFollower(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) {
		steadyTimeouts(cfg)
		cfg.TrailingLogs, cfg.SnapshotThreshold = 4, 8
	})
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	down := c.followerOf(l)
	c.stop(down)
	// About 2 MB of state (16 events of 1000 blocks): a send deadline of
	// 16 s at the test transport's 2 s.
	for k := range 16 {
		ev := kvevent.Event{Rank: r1, EventID: uint64(k + 1), Kind: kvevent.KindStored}
		for b := range 1000 {
			h := uint64(k*1000+b) + 1
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: h * 7})
		}
		ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: []kvevent.Event{ev}}})
	}
	ld := c.leader()
	if err := ld.raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	// The stopped follower's address now takes connections, answers
	// their greetings as the cluster's node, reads the first 256 KiB (the
	// snapshot's start; the appends before it are small) and then nothing
	// more: a process that hung.
	var hole net.Listener
	var err error
	waitFor(t, 5*time.Second, "the follower's address to be free", func() bool {
		hole, err = net.Listen("tcp", c.addrs[down])
		return err == nil
	})
	var mu sync.Mutex
	var conns []net.Conn
	cut := func() {
		hole.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, cn := range conns {
			cn.Close()
		}
	}
	defer cut()
	var read atomic.Int64
	go func() {
		for {
			cn, err := hole.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, cn)
			mu.Unlock()
			go func() {
				if answerGreeting(cn) != nil {
					return
				}
				buf := make([]byte, 32<<10)
				for read.Load() < 256<<10 {
					k, err := cn.Read(buf)
					read.Add(int64(k))
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	// Raft backs off from a follower it failed to reach, doubling its wait
	// from 10 ms up to 10.24 s (raft v1.8.0's failureWait and
	// maxFailureScale): on a loaded machine the follower stays stopped long
	// enough for the leader's next try to come 10 s after the address
	// listens. The wait covers that; on an idle machine the send comes
	// within a second or two.
	waitFor(t, 30*time.Second, "the leader to send the hung follower its snapshot", func() bool { return read.Load() >= 256<<10 })
	closeWithin(t, ld, cut)
}

// TestFollowerCloseEndsASnapshotFromAHungLeader: a follower's Close while
// it takes a snapshot from a leader that hung part-way (a stopped
// process, a host gone without a FIN) returns within closeBound. It never
// returned: Raft's main goroutine reads the snapshot from the
// connection, with no deadline on the receiving side, and Close waited
// for Raft's goroutines before it closed the transport's connections
// (kvrouter's SIGTERM shutdown hung until a second signal). From a
// review.
func TestFollowerCloseEndsASnapshotFromAHungLeader(t *testing.T) {
	tr, err := NewTransport("127.0.0.1:0", nil, 2*time.Second, quiet)
	if err != nil {
		t.Fatal(err)
	}
	self := Member{ID: "n1", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "http-n1"}
	leader := Member{ID: "n2", RaftAddr: silentPeer(t), HTTPAddr: "http-n2"}
	n, err := NewNode(Config{ID: self.ID, RaftAddr: self.RaftAddr, HTTPAddr: self.HTTPAddr, DataDir: t.TempDir(),
		Peers: []Member{self, leader}, Transport: tr, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	conn := hangInstallSnapshot(t, self, leader, self, leader)
	closeWithin(t, n, func() { conn.Close() }) // the leader's connection goes: the read fails
}

// TestCloseEndsADialToABlackHoledPeer: a node whose peer's host is gone
// without a trace (SYNs dropped: a dead VM, a partition) closes within
// closeBound. Raft's shutdown waits for its vote goroutine, dialing the
// peer, and the transport's Close did not cut the dial: Close waited
// for the dial's timeout (10 s in production) after the grace. From a
// review.
func TestCloseEndsADialToABlackHoledPeer(t *testing.T) {
	hole := blackHole(t)
	tr, err := NewTransport("127.0.0.1:0", nil, 8*time.Second, quiet) // a dial outlasts closeBound
	if err != nil {
		t.Fatal(err)
	}
	self := Member{ID: "n1", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "http-n1"}
	peer := Member{ID: "n2", RaftAddr: hole, HTTPAddr: "http-n2"}
	n, err := NewNode(Config{ID: self.ID, RaftAddr: self.RaftAddr, HTTPAddr: self.HTTPAddr, DataDir: t.TempDir(),
		Peers: []Member{self, peer}, Transport: tr, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	waitDialing(t) // the node campaigns: its vote request dials the black hole
	closeWithin(t, n, nil)
}

// TestRaftErrorsAreTheNodes: the errors of Raft's futures reach callers as
// the node's sentinels, whatever call waited on them (the API answers
// those with a retryable 503; Raft's own errors were a 500 outside apply).
func TestRaftErrorsAreTheNodes(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	for _, tc := range []struct {
		raft error
		want error
	}{
		{raft.ErrNotLeader, ErrNotLeader},
		{raft.ErrLeadershipLost, ErrNotLeader},
		{raft.ErrLeadershipTransferInProgress, ErrNotLeader},
		{raft.ErrRaftShutdown, ErrShutdown},
		{raft.ErrEnqueueTimeout, context.DeadlineExceeded},
	} {
		got := n.raftError(fmt.Errorf("wrapped: %w", tc.raft))
		if tc.want == ErrNotLeader && errors.Is(got, ErrNoLeader) {
			continue // Raft still names this node: no other leader known yet
		}
		if !errors.Is(got, tc.want) {
			t.Errorf("raftError(%v) = %v, want %v", tc.raft, got, tc.want)
		}
	}
	other := errors.New("disk on fire")
	if got := n.raftError(other); got != other {
		t.Errorf("raftError(%v) = %v, want it as it is", other, got)
	}
}

// TestASecondNodeOnTheDataDirIsRefused: a node started on a data directory
// another node holds fails with ErrDataDirInUse before it touches
// anything there. It used to tidy the running node's restore directories
// first (an interrupted restore's leftovers, as it took them) and only
// then meet Pebble's own lock.
func TestASecondNodeOnTheDataDirIsRefused(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	c.leader()
	inRestore := filepath.Join(c.dirs[0], "fsm.restore")
	if err := os.MkdirAll(inRestore, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := NewNode(Config{ID: "n1", RaftAddr: "127.0.0.1:1", DataDir: c.dirs[0], Logger: quiet})
	if !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("a second node on the data directory: %v, want ErrDataDirInUse", err)
	}
	if _, err := os.Stat(inRestore); err != nil {
		t.Fatalf("the running node's fsm.restore: %v", err)
	}
	// Nor can an offline restore seed it (kvctl snapshot restore --data-dir).
	if err := SeedDataDir(context.Background(), filepath.Join(t.TempDir(), "none.snap"), c.dirs[0], "n1", c.peers()); !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("seeding a data directory a node holds: %v, want ErrDataDirInUse", err)
	}
	// Closed, the node lets the directory go.
	os.Remove(inRestore)
	c.stop(0)
	c.start(0)
	c.leader()
}

// TestANodeTakesOverTheDataDirLockItIsGiven: a lock taken ahead with
// LockDataDir (kvrouter takes it before it listens) is the node's once
// given in Config.DataDirLock: the directory stays held throughout, the
// lock's own Close then leaves it held, and the node's Close releases it.
// A lock of another directory, or one already taken, is refused.
func TestANodeTakesOverTheDataDirLockItIsGiven(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "n1") // not there yet: LockDataDir makes it
	lock, err := LockDataDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if _, err := LockDataDir(dir); !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("a second lock of a locked directory: %v, want ErrDataDirInUse", err)
	}
	if _, err := NewNode(Config{ID: "n1", RaftAddr: "127.0.0.1:1", DataDir: t.TempDir(), DataDirLock: lock, Logger: quiet}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a node given another directory's lock: %v, want ErrInvalid", err)
	}
	tr, err := NewTransport("127.0.0.1:0", nil, 2*time.Second, quiet)
	if err != nil {
		t.Fatal(err)
	}
	addr := string(tr.LocalAddr())
	n, err := NewNode(Config{ID: "n1", RaftAddr: addr, DataDir: dir, DataDirLock: lock, Peers: []Member{{ID: "n1", RaftAddr: addr, HTTPAddr: "h:1"}},
		Transport: tr, Logger: quiet})
	if err != nil {
		t.Fatalf("a node given its directory's lock: %v", err)
	}
	defer n.Close()
	if _, err := NewNode(Config{ID: "n1", RaftAddr: "127.0.0.1:1", DataDir: dir, DataDirLock: lock, Logger: quiet}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a second node given the lock a node took: %v, want ErrInvalid", err)
	}
	if err := lock.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := LockDataDir(dir); !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("the running node's directory after the given lock's Close: %v, want ErrDataDirInUse", err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	again, err := LockDataDir(dir)
	if err != nil {
		t.Fatalf("the directory after the node's Close: %v", err)
	}
	again.Close()
}

// TestBookingOnARankThatLeftBooksNothing: a worker that leaves between a
// route's decision and its booking's commit gets no booking (from a
// review: it came back as phantom load when the worker registered again
// within the expiry); the route decides again among the ranks left, and
// gives up as no workers when the chosen rank keeps leaving. Reserve on a
// rank nobody has is ErrUnknownRank.
func TestBookingOnARankThatLeftBooksNothing(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	register := func(id uint64) {
		t.Helper()
		if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
			t.Fatal(err)
		}
	}
	register(1)
	// The filter runs after the decision took its candidates: the first
	// decision can only choose worker 1, which then leaves for worker 2.
	var turns int
	q := RouteQuery{LocalHashes: []uint64{1, 2}, ISL: 32, Book: true, RequestID: "req-1",
		Filter: func(kvevent.Rank) bool {
			if turns++; turns == 1 {
				register(2)
				if err := l.DeregisterWorker(ctx(t), 1); err != nil {
					t.Fatal(err)
				}
			}
			return true
		}}
	res, err := l.Route(ctx(t), q)
	if want := (kvevent.Rank{Worker: 2}); err != nil || !res.Booked || res.Decision.Rank != want {
		t.Fatalf("route: %v booked %v, err %v; want booked on %v", res.Decision.Rank, res.Booked, err, want)
	}
	register(1)
	if load := l.fsm.Sequences().Load(kvevent.Rank{Worker: 1}); load != (indexer.Load{}) {
		t.Fatalf("worker 1 registered again with load %+v from a booking made after it left", load)
	}

	next := uint64(3)
	q.RequestID, q.Filter = "req-2", func(kvevent.Rank) bool {
		// Every decision's only rank leaves before its booking commits.
		register(next)
		for id := range l.fsm.Workers() {
			if id != next {
				if err := l.DeregisterWorker(ctx(t), id); err != nil {
					t.Fatal(err)
				}
			}
		}
		next++
		return true
	}
	// Leave one worker for the first decision.
	if err := l.DeregisterWorker(ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Route(ctx(t), q); !errors.Is(err, indexer.ErrNoWorkers) {
		t.Fatalf("a route whose rank always left: %v, want ErrNoWorkers", err)
	}
	if b, ok := l.Booking("req-2"); ok {
		t.Fatalf("req-2 booked %+v on a rank that left", b)
	}

	err = l.Reserve(ctx(t), Booking{ID: "req-3", Rank: kvevent.Rank{Worker: 99}, ISL: 16})
	if !errors.Is(err, indexer.ErrUnknownRank) {
		t.Fatalf("reserve on a rank nobody has: %v, want ErrUnknownRank", err)
	}
}

// TestReserveReportsWhatItBooked: Reserve of an id already live on the same
// rank is a retry that succeeds; of an id live on another rank it is a
// BookedElsewhereError naming that rank, and of an id booked and freed it
// is ErrBookingFreed; neither books anything. From a review: both said
// nothing, and their callers answered that the reservation was made.
func TestReserveReportsWhatItBooked(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	for id := uint64(1); id <= 2; id++ {
		if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
			t.Fatal(err)
		}
	}
	one, two := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}
	b := Booking{ID: "req-1", Rank: one, SeqHashes: []uint64{1}, ISL: 16}
	for i := range 2 {
		if err := l.Reserve(ctx(t), b); err != nil {
			t.Fatalf("reserve %d on %v: %v", i+1, one, err)
		}
	}
	b.Rank = two
	err := l.Reserve(ctx(t), b)
	var be *BookedElsewhereError
	if !errors.Is(err, ErrBookedElsewhere) || !errors.As(err, &be) || be.Rank != one {
		t.Fatalf("reserve on %v of an id live on %v: %v, want a BookedElsewhereError naming %v", two, one, err, one)
	}
	if got, ok := l.Booking("req-1"); !ok || got.Rank != one {
		t.Fatalf("req-1 is booked on %v (live %v), want %v", got.Rank, ok, one)
	}
	if err := l.Free(ctx(t), "req-1"); err != nil {
		t.Fatal(err)
	}
	for _, r := range []kvevent.Rank{one, two} {
		b.Rank = r
		if err := l.Reserve(ctx(t), b); !errors.Is(err, ErrBookingFreed) {
			t.Fatalf("reserve on %v of a freed id: %v, want ErrBookingFreed", r, err)
		}
	}
	if got, ok := l.Booking("req-1"); ok {
		t.Fatalf("a freed id was booked again: %+v", got)
	}
}

// TestTransferWithoutATargetPicksTheCaughtUpVoter: of two followers that
// both answer, a transfer without a target goes to the one whose log the
// leader saw match furthest, not to the one held behind (whose log writes
// are held: it answers heartbeats, and is first in configuration order, so
// a tie or the least match would pick it, and the transfer would wait on
// its log).
func TestTransferWithoutATargetPicksTheCaughtUpVoter(t *testing.T) {
	var holdID atomic.Value // string: the node whose log writes are held
	holdID.Store("")
	release := make(chan struct{})
	c := newTestCluster(t, 3, func(cfg *Config) {
		id := cfg.ID
		cfg.beforeLogWrite = func([]*raft.Log) {
			if holdID.Load() == id {
				<-release
			}
		}
	})
	t.Cleanup(sync.OnceFunc(func() { close(release) })) // before the cluster's Close, which waits for Raft
	l := c.leader()
	c.converged()
	var followers []string
	for _, s := range l.raft.GetConfiguration().Configuration().Servers {
		if string(s.ID) != l.cfg.ID {
			followers = append(followers, string(s.ID))
		}
	}
	behind, ahead := followers[0], followers[1]
	holdID.Store(behind)
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	last := l.raft.LastIndex()
	held := time.Now()
	waitFor(t, 10*time.Second, ahead+" to match the write and "+behind+" to answer while held", func() bool {
		return l.watch.contact(raft.ServerID(ahead)).matched >= last && l.watch.contact(raft.ServerID(behind)).at.After(held)
	})
	if m := l.watch.contact(raft.ServerID(behind)).matched; m >= last {
		t.Fatalf("%s, held, matched through %d, the write is at %d: the set-up no longer holds it behind", behind, m, last)
	}
	if err := l.TransferLeadership(ctx(t), ""); err != nil {
		t.Fatalf("transfer without a target (%s at %d held behind %s): %v", behind, l.watch.contact(raft.ServerID(behind)).matched, ahead, err)
	}
	waitFor(t, 10*time.Second, "a new leader", func() bool { return !l.IsLeader() && c.leader() != l })
	if got := c.leader().cfg.ID; got != ahead {
		t.Fatalf("a transfer without a target went to %s, want %s, the voter whose log matched furthest", got, ahead)
	}
}
