package eventplane

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// handoverNode is a HandoverTarget of three members, n1 to n3, whose
// leader is set by the test and moved by TransferLeadership.
type handoverNode struct {
	mu          sync.Mutex
	leader      string // "" none
	self        string
	transfers   []string
	transferErr error
	movesAnyway bool // a transfer that fails still moves the leadership
	membersErr  error
}

func (n *handoverNode) IsLeader() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.leader == n.self
}

func (n *handoverNode) Members(context.Context) ([]raftfsm.Member, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.membersErr != nil {
		return nil, n.membersErr
	}
	var out []raftfsm.Member
	// Listed out of id order, with a non-voter and a member without an
	// HTTP address: neither can be asked nor take the leadership.
	for _, id := range []string{"n3", "n1", "n2", "n4", "n5"} {
		out = append(out, raftfsm.Member{ID: id, HTTPAddr: "http-" + id, Voter: id != "n4", Leader: id == n.leader})
	}
	out[4].HTTPAddr = ""
	return out, nil
}

func (n *handoverNode) TransferLeadership(_ context.Context, to string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.transfers = append(n.transfers, to)
	if n.transferErr != nil {
		if n.movesAnyway {
			n.leader = to
		}
		return n.transferErr
	}
	n.leader = to
	return nil
}

// peers answers PeerConnected from a table of the members connected to
// NATS, and records whom it was asked about.
type peers struct {
	mu        sync.Mutex
	connected map[string]bool
	failing   map[string]bool
	asked     []string
}

func (p *peers) ask(_ context.Context, m raftfsm.Member) (bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.asked = append(p.asked, m.ID)
	if p.failing[m.ID] {
		return false, fmt.Errorf("%s does not answer", m.ID)
	}
	return p.connected[m.ID], nil
}

func newTestHandover(t *testing.T, node *handoverNode, up *atomic.Bool, p *peers, reg prometheus.Registerer) *Handover {
	t.Helper()
	h, err := newHandover(HandoverConfig{Node: node, Connected: up.Load, PeerConnected: p.ask,
		After: 10 * time.Second, Registerer: reg, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	close(h.done) // no loop: the test drives due, try and tried
	return h
}

// TestHandoverIsDueOnlyAfterTheConnectionStaysDownWhileLeading: a try is
// due once this node has led with its connection down for After without
// a break; a connection back, or the leadership gone, starts the wait
// afresh; after a try the next waits After again.
func TestHandoverIsDueOnlyAfterTheConnectionStaysDownWhileLeading(t *testing.T) {
	node := &handoverNode{self: "n1", leader: "n1"}
	var up atomic.Bool
	h := newTestHandover(t, node, &up, &peers{}, nil)
	t0 := time.Unix(1000, 0)
	at := func(d time.Duration, wantDue bool, wantDown time.Duration, what string) {
		t.Helper()
		down, due := h.due(t0.Add(d))
		if due != wantDue || (due && down != wantDown) {
			t.Fatalf("%s: at +%v due=%v down=%v, want due=%v down=%v", what, d, due, down, wantDue, wantDown)
		}
	}
	at(0, false, 0, "first seen down")
	at(9*time.Second, false, 0, "down for less than After")
	at(10*time.Second, true, 10*time.Second, "down for After")
	h.tried(t0.Add(11 * time.Second))
	at(20*time.Second, false, 0, "less than After after a try")
	at(21*time.Second, true, 21*time.Second, "After after a try")

	up.Store(true)
	at(22*time.Second, false, 0, "connection back")
	up.Store(false)
	at(23*time.Second, false, 0, "down again: the wait starts afresh")
	at(32*time.Second, false, 0, "down again for less than After")
	at(33*time.Second, true, 10*time.Second, "down again for After")

	node.leader = "n2"
	at(34*time.Second, false, 0, "not leading")
	node.leader = "n1"
	at(35*time.Second, false, 0, "leading again: the wait starts afresh")
	at(44*time.Second, false, 0, "leading again for less than After")
	at(45*time.Second, true, 10*time.Second, "leading again for After")
}

// TestHandoverPicksAConnectedVoter: the leadership goes to the first
// voter in id order that answers connected, never to a non-voter, a
// member without an HTTP address, or itself; with none, this node keeps
// it. Each try is counted by outcome.
func TestHandoverPicksAConnectedVoter(t *testing.T) {
	reg := prometheus.NewRegistry()
	node := &handoverNode{self: "n1", leader: "n1"}
	var up atomic.Bool
	p := &peers{connected: map[string]bool{"n1": true, "n4": true, "n5": true}, failing: map[string]bool{}}
	h := newTestHandover(t, node, &up, p, reg)

	if got := h.try(time.Minute); got != handoverNoCandidate {
		t.Fatalf("no connected voter: %q, want %q", got, handoverNoCandidate)
	}
	if node.transfers != nil || fmt.Sprint(p.asked) != "[n2 n3]" {
		t.Fatalf("no connected voter: transfers %v, asked %v; want none, and [n2 n3]", node.transfers, p.asked)
	}

	p.asked = nil
	p.failing["n2"] = true
	p.connected["n2"], p.connected["n3"] = true, true
	if got := h.try(time.Minute); got != handoverTransferred {
		t.Fatalf("n3 connected: %q, want %q", got, handoverTransferred)
	}
	if fmt.Sprint(node.transfers) != "[n3]" || fmt.Sprint(p.asked) != "[n2 n3]" {
		t.Fatalf("n3 connected, n2 failing: transfers %v, asked %v; want [n3], [n2 n3]", node.transfers, p.asked)
	}

	node.leader, node.transferErr = "n1", errors.New("leadership transfer: the target did not take over")
	p.failing["n2"] = false
	if got := h.try(time.Minute); got != handoverFailed {
		t.Fatalf("transfer refused: %q, want %q", got, handoverFailed)
	}
	if fmt.Sprint(node.transfers) != "[n3 n2]" || !node.IsLeader() {
		t.Fatalf("transfer refused: transfers %v, leader %s; want [n3 n2], n1", node.transfers, node.leader)
	}

	// A transfer whose answer is an error but which took all the same
	// (its context ended as the target won) is a handover.
	node.movesAnyway = true
	if got := h.try(time.Minute); got != handoverTransferred || node.leader != "n2" {
		t.Fatalf("transfer answered an error but taken: %q, leader %s; want %q, n2", got, node.leader, handoverTransferred)
	}

	node.leader = "n1"
	node.membersErr = errors.New("raft is shut down")
	if got := h.try(time.Minute); got != handoverFailed {
		t.Fatalf("members not listed: %q, want %q", got, handoverFailed)
	}
	for outcome, want := range map[string]float64{handoverNoCandidate: 1, handoverTransferred: 2, handoverFailed: 2} {
		if got := val(h.tries.WithLabelValues(outcome)); got != want {
			t.Errorf("kvrouter_nats_handovers_total{outcome=%q} = %v, want %v", outcome, got, want)
		}
	}
	families, err := reg.Gather()
	if err != nil || len(families) != 1 || families[0].GetName() != "kvrouter_nats_handovers_total" || len(families[0].GetMetric()) != 3 {
		t.Errorf("registered: %v, %v; want kvrouter_nats_handovers_total with 3 series", families, err)
	}
}

// TestHandoverPassesOverAHungVoter: a voter that never answers the
// question (its /readyz: a stopped process that accepted the connection)
// costs the try its Timeout, and the next voter connected to NATS takes
// the leadership. kvrouter's question goes through the forwarding
// transport, which has no header timeout: Timeout is the only bound.
func TestHandoverPassesOverAHungVoter(t *testing.T) {
	node := &handoverNode{self: "n1", leader: "n1"}
	hung := func(ctx context.Context, m raftfsm.Member) (bool, error) {
		if m.ID == "n2" {
			<-ctx.Done()
			return false, ctx.Err()
		}
		return m.ID == "n3", nil
	}
	h, err := newHandover(HandoverConfig{Node: node, Connected: func() bool { return false }, PeerConnected: hung,
		After: 10 * time.Second, Timeout: 100 * time.Millisecond, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	close(h.done) // no loop: the test drives try
	got := make(chan string, 1)
	go func() { got <- h.try(time.Minute) }()
	select {
	case g := <-got:
		if g != handoverTransferred || fmt.Sprint(node.transfers) != "[n3]" {
			t.Fatalf("n2 hung, n3 connected: %q, transfers %v; want %q to n3", g, node.transfers, handoverTransferred)
		}
	case <-time.After(5 * time.Second):
		h.cancel() // ends the hung question, and the try with it
		<-got
		t.Fatalf("n2 hung: the handover's try still waited on it after 5 s (Timeout 100ms)")
	}
}

// TestHandoverDoesNotTransferOnceTheConnectionIsBack: the connection may
// come back while the others are asked; this node then keeps leading.
func TestHandoverDoesNotTransferOnceTheConnectionIsBack(t *testing.T) {
	node := &handoverNode{self: "n1", leader: "n1"}
	var up atomic.Bool
	p := &peers{connected: map[string]bool{"n2": true}}
	h, err := newHandover(HandoverConfig{Node: node, Connected: up.Load, Logger: quiet,
		PeerConnected: func(ctx context.Context, m raftfsm.Member) (bool, error) {
			up.Store(true)
			return p.ask(ctx, m)
		}})
	if err != nil {
		t.Fatal(err)
	}
	close(h.done)
	if got := h.try(time.Minute); got != "" || node.transfers != nil {
		t.Fatalf("connection back during the try: outcome %q, transfers %v; want none", got, node.transfers)
	}
}

// TestHandoverNeedsItsParts: NewHandover refuses a config without a node,
// a connection's state or a way to ask the others.
func TestHandoverNeedsItsParts(t *testing.T) {
	ask := func(context.Context, raftfsm.Member) (bool, error) { return true, nil }
	for _, cfg := range []HandoverConfig{
		{Connected: func() bool { return true }, PeerConnected: ask},
		{Node: &handoverNode{}, PeerConnected: ask},
		{Node: &handoverNode{}, Connected: func() bool { return true }},
	} {
		if h, err := NewHandover(cfg); err == nil {
			h.Close()
			t.Errorf("NewHandover(%+v) took it", cfg)
		}
	}
}

// TestLeaderWithoutNATSHandsOverAndEventsFlow: 3 nodes, each with its
// embedded NATS server and its handover, as cmd/kvrouter wires them. The
// leader's NATS server stops: within After the leadership moves to a node
// still connected, whose ingester takes the events an agent connected to
// it publishes. The node without NATS never takes the leadership back.
func TestLeaderWithoutNATSHandsOverAndEventsFlow(t *testing.T) {
	c := newTestCluster(t, 3)
	c.converged()
	for i := range c.nodes {
		h, err := NewHandover(HandoverConfig{Node: c.nodes[i], Connected: c.conns[i].IsConnected, Logger: quiet,
			After: 200 * time.Millisecond, PollInterval: 10 * time.Millisecond,
			PeerConnected: func(_ context.Context, m raftfsm.Member) (bool, error) {
				for j, n := range c.nodes {
					if n != nil && n.Status().ID == m.ID {
						return n.Status().Ready && c.conns[j].IsConnected(), nil
					}
				}
				return false, fmt.Errorf("no node %s", m.ID)
			}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
	}
	old := c.leader()
	c.nats[old].Shutdown()
	c.nats[old].WaitForShutdown()
	// An agent connected to a server still up publishes while the
	// leader cannot hear it.
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url((old+1)%3)), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 7}
	ev := []kvevent.Event{{Kind: kvevent.KindCleared}}
	for range 20 {
		if _, err := p.Publish(r, ev); err != nil {
			t.Fatal(err)
		}
	}
	var now int
	waitFor(t, 15*time.Second, "another node to lead and ingest the events", func() bool {
		now = c.leader()
		return now != old && c.nodes[now].Cursor(r) == 20
	})
	if err := p.Flush(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	if l := c.leader(); l == old || c.conns[old].IsConnected() {
		t.Fatalf("leader %d (was %d, its connection up: %v)", l, old, c.conns[old].IsConnected())
	}
}

// TestAHandoverClosedMidTryCountsNoOutcome: Close ends a try in
// progress (its context is canceled). The try's questions then fail for
// the cancellation, not for the peers: no evidence that no voter is
// connected, and the try counts and logs nothing. From a review: it
// counted outcome="no_candidate" and logged that no other voter was
// ready and connected, at every shutdown during a try.
func TestAHandoverClosedMidTryCountsNoOutcome(t *testing.T) {
	node := &handoverNode{self: "n1", leader: "n1"}
	var up atomic.Bool // down
	asking := make(chan struct{}, 8)
	h, err := NewHandover(HandoverConfig{Node: node, Connected: up.Load, Logger: quiet,
		After: 10 * time.Millisecond, PollInterval: 5 * time.Millisecond, Timeout: time.Minute,
		Registerer: prometheus.NewRegistry(),
		PeerConnected: func(ctx context.Context, m raftfsm.Member) (bool, error) {
			select {
			case asking <- struct{}{}:
			default:
			}
			<-ctx.Done() // a peer slow to answer (n2 would say connected)
			return false, ctx.Err()
		}})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-asking:
	case <-time.After(5 * time.Second):
		h.Close()
		t.Fatal("no try began")
	}
	h.Close()
	if got := val(h.tries.WithLabelValues(handoverNoCandidate)); got != 0 {
		t.Errorf("a try ended by Close counted kvrouter_nats_handovers_total{outcome=\"no_candidate\"} = %v, want 0 (the peers were never heard)", got)
	}
}

// TestHandoverWaitsAfterBetweenTries: having tried (here no other voter
// answers connected, so it keeps the leadership), the loop tries again
// only After later, however many polls come meanwhile (docs/events.md:
// "Either way it tries again `--nats-handover-after` later, for as long
// as the connection stays down and it leads"): each try asks every voter
// and counts in kvrouter_nats_handovers_total. The first try is due at
// once (the connection found down an After ago); After is an hour, so no
// second one is due while the test runs.
func TestHandoverWaitsAfterBetweenTries(t *testing.T) {
	node := &handoverNode{self: "n1", leader: "n1"}
	var polls atomic.Int64 // due asks Connected at every poll while leading
	p := &peers{}
	h, err := newHandover(HandoverConfig{Node: node, PeerConnected: p.ask, Logger: quiet,
		Connected: func() bool { polls.Add(1); return false },
		After:     time.Hour, PollInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	h.downSince, h.nextTry = start.Add(-time.Hour), start // set before the loop starts
	go h.run()
	defer h.Close()
	tries := h.tries.WithLabelValues(handoverNoCandidate)
	waitFor(t, 10*time.Second, "the first try", func() bool { return val(tries) >= 1 })
	seen := polls.Load()
	waitFor(t, 10*time.Second, "50 polls after the first try", func() bool { return polls.Load() >= seen+50 })
	h.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	if got := val(tries); got != 1 || fmt.Sprint(p.asked) != "[n2 n3]" {
		t.Fatalf("over %d polls within After of the first try: %v tries counted, %d questions to the voters; want 1 try, asking [n2 n3] once",
			polls.Load()-seen, got, len(p.asked))
	}
	if !h.nextTry.After(start.Add(time.Hour)) { // the loop has ended: Close waited for it
		t.Fatalf("next try due at start+%v, want at least After (1h) after the first try", h.nextTry.Sub(start))
	}
}
