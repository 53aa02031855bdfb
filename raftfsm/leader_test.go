package raftfsm

import (
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
)

// TestCheckLeaderWaitsForTheBarrier: a node elected while its FSM still
// lacks an entry its predecessor acknowledged refuses CheckLeader (the
// gate of handlers that judge a write by the replicated state) until its
// post-election Barrier has passed. It used to pass at once: a compatible
// API registration judged on the stale worker table then dropped the
// acknowledged dp rank and its index state.
func TestCheckLeaderWaitsForTheBarrier(t *testing.T) {
	// n3's FSM takes a batch per token; once paused it takes none until
	// released (then the gate stays open).
	gate := make(chan struct{})
	pause, release, fed := make(chan chan struct{}), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(fed)
		for {
			select {
			case gate <- struct{}{}:
			case ack := <-pause:
				close(ack)
				<-release
				close(gate)
				return
			case <-release:
				close(gate)
				return
			}
		}
	}()
	c := newTestCluster(t, 3, func(cfg *Config) {
		if cfg.ID == "n3" {
			cfg.applyGate = gate
		}
	})
	var once sync.Once
	open := func() { once.Do(func() { close(release); <-fed }) }
	t.Cleanup(open) // before the cluster closes: Raft's shutdown waits for the FSM

	l := c.leader()
	n3 := c.nodes[2]
	if l == n3 {
		if err := l.TransferLeadership(ctx(t), "n1"); err != nil {
			t.Fatal(err)
		}
		l = c.leader()
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	ack := make(chan struct{})
	pause <- ack
	<-ack
	// Acknowledged by n1 and n2; n3 holds it in its log, unapplied.
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n3 to hold the entry in its log", func() bool { return n3.raft.LastIndex() >= l.raft.LastIndex() })
	if err := l.TransferLeadership(ctx(t), "n3"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n3 to lead", n3.IsLeader)
	if err := n3.CheckLeader(); !errors.Is(err, ErrNoLeader) {
		t.Fatalf("CheckLeader = %v on a new leader whose worker table holds dp ranks %v of the acknowledged [0 1]; want ErrNoLeader",
			err, n3.WorkerTable()[1].DPRanks)
	}
	open()
	waitFor(t, 10*time.Second, "n3's Barrier", func() bool { return n3.CheckLeader() == nil })
	if got := n3.WorkerTable()[1].DPRanks; !slices.Equal(got, []uint32{0, 1}) {
		t.Fatalf("the leader's worker table holds dp ranks %v once CheckLeader passes, want [0 1]", got)
	}
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

// TestTransferToTheLeaderItselfIsInvalid: naming the leader as the target
// is the caller's mistake (a 400), not a failure of the node.
func TestTransferToTheLeaderItselfIsInvalid(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.TransferLeadership(ctx(t), l.cfg.ID); !errors.Is(err, ErrInvalid) {
		t.Fatalf("transfer to the leader itself: %v, want ErrInvalid", err)
	}
}

// TestReadyNeedsALeaderAndMembership: a node that caught up stays ready
// only while it knows a leader and is a member: cut off from a quorum it
// is not ready (it used to stay ready, serving routes from an index that
// no longer moved), and ready again once a leader is back; removed from
// the cluster it is not ready.
func TestReadyNeedsALeaderAndMembership(t *testing.T) {
	c := newTestCluster(t, 3, nil)
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
