package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// twoIdleRanks starts a one-node cluster with one worker of two ranks,
// block size 4, under p (nil: the defaults), and returns its leader and a
// 64-token prompt.
func twoIdleRanks(t *testing.T, p *indexer.Params) (*Node, []uint32) {
	t.Helper()
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if p != nil {
		if err := l.SetSettings(ctx(t), Settings{Params: *p, View: indexer.ViewDedup}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	return l, tokens
}

// routeAtOnce sends n booked routes of tokens, request ids r0 to r<n-1>,
// all released together, and returns how many were booked and how many
// refused as overloaded; any other error fails the test.
func routeAtOnce(t *testing.T, l *Node, tokens []uint32, n int) (booked, refused int64) {
	t.Helper()
	var b, r atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, Book: true, RequestID: fmt.Sprintf("r%d", i)})
			switch {
			case errors.Is(err, indexer.ErrOverloaded):
				r.Add(1)
			case err != nil:
				t.Error(err)
			case res.Booked:
				b.Add(1)
			}
		}(i)
	}
	close(start)
	wg.Wait()
	return b.Load(), r.Load()
}

func activeRequests(l *Node, dp uint32) int64 {
	return l.fsm.Sequences().Load(kvevent.Rank{Worker: 1, DP: dp}).ActiveRequests
}

// TestSequentialBookedRoutesAlternate is the control of the concurrent
// test below: one after another, identical booked requests alternate
// between two idle ranks, each booking making its rank dearer.
func TestSequentialBookedRoutesAlternate(t *testing.T) {
	l, tokens := twoIdleRanks(t, nil)
	for i := 0; i < 32; i++ {
		if _, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, Book: true, RequestID: fmt.Sprintf("r%d", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if a, b := activeRequests(l, 0), activeRequests(l, 1); a != 16 || b != 16 {
		t.Fatalf("32 identical booked routes one after another split %d / %d, want 16 / 16", a, b)
	}
}

// TestConcurrentBookedRoutesSeeEachOthersLoad: a node books a routed
// request locally at once (semantics.md §6, architecture.md §5), so a
// booked route decides with the bookings this leader decided before it,
// committed or not. Deciding from the committed load alone, 32 identical
// routes sent at once to two idle ranks all went to one.
func TestConcurrentBookedRoutesSeeEachOthersLoad(t *testing.T) {
	l, tokens := twoIdleRanks(t, nil)
	const n = 32
	if booked, _ := routeAtOnce(t, l, tokens, n); booked != n {
		t.Fatalf("booked %d of %d", booked, n)
	}
	a, b := activeRequests(l, 0), activeRequests(l, 1)
	if a+b != n {
		t.Fatalf("the ranks hold %d + %d requests, want %d", a, b, n)
	}
	if d := a - b; d > 2 || d < -2 {
		t.Fatalf("%d identical booked routes sent at once to two idle ranks split %d / %d; one after another they split 16 / 16", n, a, b)
	}
	if left := l.fsm.pending.len(); left != 0 {
		t.Fatalf("%d bookings still pending after every route returned", left)
	}
}

// TestSequentialBookedRoutesRespectBusyThreshold is the control of the
// concurrent test below: with busy_prefill_tokens 64, two ranks and
// 64-token prompts, each rank takes two requests (128 tokens is over 64)
// and the rest are refused as overloaded.
func TestSequentialBookedRoutesRespectBusyThreshold(t *testing.T) {
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 64
	l, tokens := twoIdleRanks(t, &p)
	if booked := bookOneAfterAnother(t, l, tokens, 32); booked != 4 {
		t.Fatalf("booked %d one after another, want 4 (2 per rank)", booked)
	}
}

// bookOneAfterAnother sends n booked routes of tokens to l one after
// another (request ids r0, r1, ...) and returns how many were booked;
// those refused as overloaded are not, any other error fails the test.
func bookOneAfterAnother(t *testing.T, l *Node, tokens []uint32, n int) int {
	t.Helper()
	booked := 0
	for i := range n {
		res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, Book: true, RequestID: fmt.Sprintf("r%d", i)})
		switch {
		case errors.Is(err, indexer.ErrOverloaded):
		case err != nil:
			t.Fatal(err)
		case res.Booked:
			booked++
		}
	}
	return booked
}

// TestConcurrentBookedRoutesRespectBusyThreshold: a busy rank is never
// chosen (semantics.md §5), also when the bookings that made it busy are
// not committed yet. Deciding from the committed load alone, all 32
// routes sent at once were booked: 1024 prefill tokens on each rank.
func TestConcurrentBookedRoutesRespectBusyThreshold(t *testing.T) {
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 64
	l, tokens := twoIdleRanks(t, &p)
	const n = 32
	booked, refused := routeAtOnce(t, l, tokens, n)
	if booked > 4 {
		t.Fatalf("%d of %d booked routes sent at once were booked (%d refused) with busy_prefill_tokens 64 and two ranks; "+
			"at most 4 can be (2 per rank)", booked, n, refused)
	}
	if booked+refused != n {
		t.Fatalf("%d booked and %d refused of %d", booked, refused, n)
	}
}

// TestConcurrentBookedRoutesAndRetriesCountOnce: routes that book, sent
// at once with each request id twice (a retry racing its first try), and
// frees of half of them, leave each id booked once, the load equal to the
// live bookings', and nothing pending. Run with -race, it also checks that
// the pending bookings are shared safely between the routes and the FSM.
func TestConcurrentBookedRoutesAndRetriesCountOnce(t *testing.T) {
	l, tokens := twoIdleRanks(t, nil)
	const ids = 16
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < 2*ids; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			id := fmt.Sprintf("r%d", i%ids)
			freer := i%2 == 0 && i < ids // frees its id once routed
			res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, Book: true, RequestID: id})
			if err != nil {
				t.Error(err)
				return
			}
			if b, ok := l.Booking(id); i%2 == 1 && (!res.Booked || !ok || b.Rank != res.Decision.Rank) {
				t.Errorf("%s answered booked=%v on %v; the tracker has %+v (%v)", id, res.Booked, res.Decision.Rank, b, ok)
			}
			if freer {
				if err := l.Free(ctx(t), id); err != nil {
					t.Error(err)
				}
			}
		}(i)
	}
	close(start)
	wg.Wait()
	live, _ := l.fsm.Sequences().Count()
	if got := activeRequests(l, 0) + activeRequests(l, 1); got != int64(live) {
		t.Fatalf("the ranks hold %d requests, the tracker %d live bookings", got, live)
	}
	if live != ids/2 {
		t.Fatalf("%d live bookings of %d ids, %d of them freed", live, ids, ids/2)
	}
	if left := l.fsm.pending.len(); left != 0 {
		t.Fatalf("%d bookings still pending after every route returned", left)
	}
}

// TestPendingBookingCountsBeforeItApplies: while a booking's entry waits
// for the FSM, the leader counts it: a new request on the rank it made
// busy is refused as overloaded, and a retry of the pending request id
// answers its rank, booked once, rather than overloaded.
func TestPendingBookingCountsBeforeItApplies(t *testing.T) {
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 100
	g, l := gatedBookingLeader(t, p, WorkerInfo{ID: 1, BlockSize: 4})
	g.pause()
	from := l.raft.LastIndex() + 1
	q := RouteQuery{ISL: 200, Book: true, RequestID: "req-1"}
	type answer struct {
		res RouteResult
		err error
	}
	answers := make(chan answer, 2)
	route := func() {
		res, err := l.Route(ctx(t), q)
		answers <- answer{res, err}
	}
	go route()
	waitFor(t, 10*time.Second, "req-1 pending", func() bool { return l.fsm.pending.len() == 1 })
	other := q
	other.RequestID = "req-2"
	if _, err := l.Route(ctx(t), other); !errors.Is(err, indexer.ErrOverloaded) {
		t.Fatalf("a new request on the rank a pending booking made busy: %v, want ErrOverloaded", err)
	}
	go route() // the retry, decided while req-1 is still pending
	waitFor(t, 10*time.Second, "the retry's entry or answer", func() bool {
		return len(answers) > 0 || bookAddsInLog(t, l, from, "req-1") == 2
	})
	g.open()
	for range 2 {
		a := <-answers
		if a.err != nil || !a.res.Booked || a.res.Decision.Rank != (kvevent.Rank{Worker: 1}) {
			t.Fatalf("req-1: %v booked=%v, err %v; want booked on 1/0", a.res.Decision.Rank, a.res.Booked, a.err)
		}
	}
	if got := activeRequests(l, 0); got != 1 {
		t.Fatalf("%d active requests, want 1", got)
	}
	if left := l.fsm.pending.len(); left != 0 {
		t.Fatalf("%d bookings still pending after every route returned", left)
	}
}

// TestInFlightReservationCountsForBookedRoutes: a booking the leader
// makes through Reserve (the compatible API's reservations) is one of its
// own bookings as much as a booked route's: while its entry waits for the
// FSM, a booked route on the rank it made busy is refused, as after a
// booked route's.
func TestInFlightReservationCountsForBookedRoutes(t *testing.T) {
	for _, first := range []string{"route", "reserve"} {
		t.Run(first, func(t *testing.T) {
			p := indexer.DefaultParams()
			p.BusyPrefillTokens = 100
			g, l := gatedBookingLeader(t, p, WorkerInfo{ID: 1, BlockSize: 4})
			g.pause()
			from := l.raft.LastIndex() + 1
			done := make(chan error, 1)
			go func() {
				if first == "route" {
					_, err := l.Route(ctx(t), RouteQuery{ISL: 200, Book: true, RequestID: "req-1"})
					done <- err
					return
				}
				done <- l.Reserve(ctx(t), Booking{ID: "req-1", Rank: kvevent.Rank{Worker: 1}, ISL: 200})
			}()
			waitFor(t, 10*time.Second, "req-1's entry in the log", func() bool { return bookAddsInLog(t, l, from, "req-1") == 1 })
			answer := make(chan error, 1)
			go func() {
				_, err := l.Route(ctx(t), RouteQuery{ISL: 200, Book: true, RequestID: "req-2"})
				answer <- err
			}()
			waitFor(t, 10*time.Second, "req-2's decision", func() bool {
				return len(answer) > 0 || bookAddsInLog(t, l, from, "req-2") == 1
			})
			g.open()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			if err := <-answer; !errors.Is(err, indexer.ErrOverloaded) {
				t.Fatalf("req-2 decided while req-1 (by %s, 200 prefill tokens) was in flight: %v, want ErrOverloaded "+
					"(busy_prefill_tokens 100); the rank now holds %+v", first, err, l.fsm.Sequences().Load(kvevent.Rank{Worker: 1}))
			}
			if left := l.fsm.pending.len(); left != 0 {
				t.Fatalf("%d bookings still pending after every call returned", left)
			}
		})
	}
}

// TestADeposedLeadersPendingBookingsDoNotCountOnItsNextTerm: a leader
// that loses its leadership drops its pending bookings (leaderLoop's
// pending.clear): one whose route still waits may never apply, and on the
// node's next term it decides from what its FSM applied. The pending
// booking here is one no route will drop, as a route's that still waits
// on its entry; with the clear taken out it stayed, made the rank busy on
// the next term and refused a booked route there as overloaded.
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts): its
// routes go to the node it made lead, and a leader that missed Raft's
// default 200 ms lease under load lost its term before them ("no leader").
func TestADeposedLeadersPendingBookingsDoNotCountOnItsNextTerm(t *testing.T) {
	c := newTestCluster(t, 3, steadyTimeouts)
	l := c.leader()
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 100
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	l.fsm.pending.mu.Lock()
	l.fsm.pending.p.Add("waiting", kvevent.Rank{Worker: 1}, nil, 200, 0)
	l.fsm.pending.mu.Unlock()
	q := RouteQuery{ISL: 200, Book: true, RequestID: "req-1"}
	if _, err := l.Route(ctx(t), q); !errors.Is(err, indexer.ErrOverloaded) {
		t.Fatalf("a booked route with 200 prefill tokens pending on the one rank: %v, want ErrOverloaded", err)
	}
	var other string
	for _, n := range c.nodes {
		if n != l {
			other = n.cfg.ID
			break
		}
	}
	c.leadTo(other)
	waitFor(t, 10*time.Second, "the deposed leader to drop its pending booking", func() bool { return l.fsm.pending.len() == 0 })
	if c.leadTo(l.cfg.ID) != l {
		t.Fatal("the leadership did not come back")
	}
	waitFor(t, 10*time.Second, "the node's Barrier", func() bool { return l.CheckLeader() == nil })
	res, err := l.Route(ctx(t), q)
	if err != nil || !res.Booked {
		t.Fatalf("a booked route on the node's next term: booked %v, %v; want booked, the last term's pending booking gone", res.Booked, err)
	}
}

// TestPendingBookingsClearedOnAQuickLoseAndRegain is
// TestADeposedLeadersPendingBookingsDoNotCountOnItsNextTerm with the
// step-down and the re-election coming while leaderLoop is busy (here in
// its post-election set-up, before the Barrier). Raft's LeaderCh holds one
// value and a newer one replaces it unread: the false of the step-down
// gives way to the true of the re-election, and leaderLoop never sees the
// false. The pending bookings go when a node starts leading a term other
// than the last it led; they used to go on a false alone, and the last
// term's pending booking made the rank busy in the next.
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts), as
// its model's does: its writes and its route go to the nodes it made
// lead, and a leader that missed Raft's default 200 ms lease under load
// lost its term before them ("no leader"). The test's step-down and
// re-election are transfers, which the timeouts do not slow.
func TestPendingBookingsClearedOnAQuickLoseAndRegain(t *testing.T) {
	var block atomic.Bool
	release := make(chan struct{})
	var once sync.Once
	c := newTestCluster(t, 3, func(cfg *Config) {
		steadyTimeouts(cfg)
		if cfg.ID == "n1" {
			cfg.beforeBarrier = func() {
				if block.Load() {
					<-release
				}
			}
		}
	})
	t.Cleanup(func() { once.Do(func() { close(release) }) }) // before the cluster closes: Close waits for leaderLoop
	l := c.leadTo("n2")
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 100
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	block.Store(true)
	n1 := c.leadTo("n1") // its leaderLoop now waits in the set-up
	n1.fsm.pending.mu.Lock()
	n1.fsm.pending.p.Add("waiting", kvevent.Rank{Worker: 1}, nil, 200, 0)
	n1.fsm.pending.mu.Unlock()
	c.leadTo("n2")
	block.Store(false)
	if c.leadTo("n1") != n1 {
		t.Fatal("the leadership did not come back")
	}
	once.Do(func() { close(release) })
	waitFor(t, 10*time.Second, "n1's Barrier", func() bool { return n1.CheckLeader() == nil })
	res, err := n1.Route(ctx(t), RouteQuery{ISL: 200, Book: true, RequestID: "req-1"})
	if err != nil || !res.Booked {
		t.Fatalf("a booked route on n1's next term: booked %v, %v (pending bookings %d); want booked, the last term's pending booking gone",
			res.Booked, err, n1.fsm.pending.len())
	}
}

// bookAddsInLog counts the booking adds of request id in l's log from
// index from.
func bookAddsInLog(t *testing.T, l *Node, from uint64, id string) int {
	t.Helper()
	n := 0
	for i := from; i <= l.raft.LastIndex(); i++ {
		var e raft.Log
		if l.logs.GetLog(i, &e) != nil || e.Type != raft.LogCommand {
			continue
		}
		c, err := decodeCommand(e.Data)
		if err != nil || c.typ != cmdBook {
			continue
		}
		for op := range c.books.all() {
			if op.kind == bookAdd && op.b.ID == id {
				n++
			}
		}
	}
	return n
}

// heldCtx is a request context that runs out while its route is between
// its decision and its proposal: its first Err waits for release, then
// it is cancelled, so the route's booking is never proposed.
type heldCtx struct {
	entered, release chan struct{}
	once             sync.Once
}

func newHeldCtx() *heldCtx {
	return &heldCtx{entered: make(chan struct{}), release: make(chan struct{})}
}
func (h *heldCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (h *heldCtx) Done() <-chan struct{}       { return h.release }
func (h *heldCtx) Value(any) any               { return nil }
func (h *heldCtx) Err() error {
	h.once.Do(func() { close(h.entered) })
	<-h.release
	return context.Canceled
}

// TestDroppedPendingBookingKeepsBlocksOthersShare: a booked route whose
// proposal fails after its decision drops its pending booking, but not
// the decode blocks another pending booking of the same prompt on its
// rank shares, which still applies: the next decisions count them, and
// refuse a route past the busy threshold as they do without the failed
// route.
func TestDroppedPendingBookingKeepsBlocksOthersShare(t *testing.T) {
	for _, failed := range []bool{false, true} {
		t.Run(map[bool]string{false: "alone", true: "after-a-failed-route"}[failed], func(t *testing.T) {
			p := indexer.DefaultParams()
			p.BusyDecodeFraction = 0.5 // busy over 20 of 40 blocks
			var capacity [kvevent.NumTiers]int64
			capacity[kvevent.TierDevice] = 40
			g, l := gatedBookingLeader(t, p, WorkerInfo{ID: 1, BlockSize: 4, Capacity: capacity})
			prompt := func(base uint32) []uint32 { // 16 blocks
				tk := make([]uint32, 64)
				for i := range tk {
					tk[i] = base + uint32(i)
				}
				return tk
			}
			P, Q := prompt(1), prompt(1000)
			g.pause()
			errs := make(chan error, 4)
			route := func(cx context.Context, id string, tk []uint32) {
				_, err := l.Route(cx, RouteQuery{Tokens: tk, Book: true, RequestID: id})
				errs <- err
			}
			if failed {
				// a: decided (16 blocks pending), then its context runs
				// out before it proposes.
				h := newHeldCtx()
				go route(h, "a", P)
				<-h.entered
				// b: the same prompt, decided while a is pending.
				go route(ctx(t), "b", P)
				waitFor(t, 10*time.Second, "b pending", func() bool { return l.fsm.pending.len() == 2 })
				close(h.release)
				if err := <-errs; err == nil {
					t.Fatal("a was booked")
				}
				waitFor(t, 10*time.Second, "a dropped", func() bool { return l.fsm.pending.len() == 1 })
			} else {
				go route(ctx(t), "b", P)
				waitFor(t, 10*time.Second, "b pending", func() bool { return l.fsm.pending.len() == 1 })
			}
			// c: another prompt; b's 16 blocks are under 20: admitted.
			go route(ctx(t), "c", Q)
			waitFor(t, 10*time.Second, "c pending", func() bool { return l.fsm.pending.len() == 2 })
			// d: b and c will hold 32 blocks, over 20: the rank is busy.
			dErr := make(chan error, 1)
			go func() {
				_, err := l.Route(ctx(t), RouteQuery{Tokens: P, Book: true, RequestID: "d"})
				dErr <- err
			}()
			waitFor(t, 10*time.Second, "d's decision", func() bool { return len(dErr) > 0 || l.fsm.pending.len() == 3 })
			g.open()
			for range 2 {
				if err := <-errs; err != nil {
					t.Error(err)
				}
			}
			if err := <-dErr; !errors.Is(err, indexer.ErrOverloaded) {
				t.Errorf("d: %v, want ErrOverloaded: b and c, pending when d decided, hold 32 decode blocks of 40, "+
					"over busy_decode_fraction 0.5; the rank now holds %+v", err, l.fsm.Sequences().Load(kvevent.Rank{Worker: 1}))
			}
		})
	}
}

// gatedBookingLeader starts a single-node cluster whose FSM applies wait on a
// gate (open until the caller pauses it), with scoring parameters p and
// worker w registered, and returns the gate and the leader.
func gatedBookingLeader(t *testing.T, p indexer.Params, w WorkerInfo) (*fsmGate, *Node) {
	t.Helper()
	g := newFSMGate()
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.applyGate = g.gate })
	t.Cleanup(g.open)
	l := c.leader()
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	return g, l
}
