package agent

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
)

// answerNeedingResync answers every heartbeat on subject, on r's NATS,
// with a body that knows every worker and a Kvrouter-Ranks-Needing-Resync
// header of ranks (the Kvrouter-Ranks-Without-State header empty), and
// returns the count of answers sent.
func answerNeedingResync(t *testing.T, r *router, subject, ranks string) *atomic.Int32 {
	t.Helper()
	nc, err := nats.Connect(r.ns.ClientURL())
	must(t, err)
	t.Cleanup(nc.Close)
	var answers atomic.Int32
	_, err = nc.Subscribe(subject, func(m *nats.Msg) {
		_ = m.RespondMsg(&nats.Msg{Data: eventplane.AppendHeartbeat(nil, nil), Header: nats.Header{
			"Kvrouter-Ranks-Without-State":  []string{""},
			"Kvrouter-Ranks-Needing-Resync": []string{ranks},
		}})
		answers.Add(1)
	})
	must(t, err)
	must(t, nc.Flush())
	return &answers
}

// TestRouterAskedResyncsAreHeldBackToOncePerInterval pins docs/events.md:
// a rank the heartbeats' answers name as needing a resync is dumped "at
// most once per RouterResyncEvery, 5 minutes", as an ack's resync is,
// not at every answer: a router that names it at every heartbeat (its
// flag cleared only by a dump it applies, which may take a while, or a
// router of a later build) would otherwise have the rank dumped every
// heartbeat interval.
func TestRouterAskedResyncsAreHeldBackToOncePerInterval(t *testing.T) {
	r := startRouter(t)
	must(t, r.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 7, BlockSize: 4, DPRanks: []uint32{0}}))
	answers := answerNeedingResync(t, r, "test.heartbeat", "7/0")
	var logs testlog.Buffer
	a, _ := startAgentWith(t, r, Config{HeartbeatInterval: 20 * time.Millisecond, HeartbeatSubject: "test.heartbeat",
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	// The start's dump, then the one the router asked for.
	waitFor(t, "the rank dumped for the router's ask", func() bool { return a.Publisher().Synced(rank) >= 2 })
	n := answers.Load()
	waitFor(t, "20 more answers naming the rank", func() bool { return answers.Load() >= n+20 })
	time.Sleep(100 * time.Millisecond) // a dump asked at the last answer is taken
	if got := a.Publisher().Synced(rank); got != 2 {
		t.Fatalf("%d dumps of the rank taken after %d answers naming it as needing a resync (%d after the first dump for them), want 2 (the start's and one for the answers): dumped again within RouterResyncEvery (5 minutes)",
			got, answers.Load(), answers.Load()-n)
	}
	if got := len(logs.Lines("level=INFO", "the router flags ranks as needing a resync")); got != 1 {
		t.Fatalf("%d Info lines of the router flagging ranks, want 1", got)
	}
}

// TestRouterAskedResyncsOfOtherRanksAreIgnored: a heartbeat's answer that
// names, beside one of the agent's own ranks (it follows 7/1 and 7/2),
// ranks it does not follow (7/0 below its first, 7/3 past its last, 8/1
// of another worker) as needing a resync has its own rank dumped, and no
// other: the publisher's dump of a rank the agent does not follow (its
// mirror holds nothing of it) would replace that rank's state on the
// router with nothing. Worker 8 is registered, so that a dump of its rank
// would be taken.
func TestRouterAskedResyncsOfOtherRanksAreIgnored(t *testing.T) {
	r := startRouter(t)
	must(t, r.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 7, BlockSize: 4, DPRanks: []uint32{1, 2}}))
	must(t, r.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 8, BlockSize: 4, DPRanks: []uint32{0, 1}}))
	answers := answerNeedingResync(t, r, "test.heartbeat", "7/0 8/1 7/1 7/3")
	var logs testlog.Buffer
	// Connected to ports no engine listens on: no engine events.
	a, _ := startAgentWith(t, r, Config{Endpoint: "tcp://127.0.0.1:9", DPStart: 1, DPRanks: 2,
		HeartbeatInterval: 20 * time.Millisecond, HeartbeatSubject: "test.heartbeat",
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	own := kvevent.Rank{Worker: 7, DP: 1}
	waitFor(t, "the agent's rank 7/1 dumped for the router's ask", func() bool { return a.Publisher().Synced(own) >= 2 })
	n := answers.Load()
	waitFor(t, "5 more answers", func() bool { return answers.Load() >= n+5 })
	time.Sleep(100 * time.Millisecond)
	for _, o := range []kvevent.Rank{{Worker: 7, DP: 0}, {Worker: 8, DP: 1}, {Worker: 7, DP: 3}} {
		if got := a.Publisher().Synced(o); got != 0 {
			t.Errorf("%d dumps of rank %v taken, a rank the agent does not follow (it follows 7/1 and 7/2): the router's state of it replaced by an empty dump", got, o)
		}
	}
	lines := logs.Lines("level=INFO", "the router flags ranks as needing a resync")
	if len(lines) != 1 || !strings.Contains(lines[0], "ranks=1 ") || !strings.Contains(lines[0], "first=7/1") {
		t.Fatalf("the router's flagging logged as %q, want one line of 1 rank, 7/1 (the others named are not the agent's)", lines)
	}
}

// heldBackResync starts a router that registers worker 7 (rank 7/0)
// and answers every heartbeat on its NATS with a body that knows the
// worker and the needing-resync header "7/0", and an agent that sends
// heartbeats every 20 ms, whose publisher holds a router's resync ask
// back for every. It returns once the router's ask has dumped the rank
// and 5 more answers named it (a dump held back), with the agent, the
// time of that dump, and after, which switches the answers to later's
// headers (the without-state header is always there, empty) and returns
// the count of answers sent since.
func heldBackResync(t *testing.T, every time.Duration, later nats.Header) (a *Agent, asked time.Time, after func() *atomic.Int32) {
	t.Helper()
	r := startRouter(t)
	must(t, r.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 7, BlockSize: 4, DPRanks: []uint32{0}}))
	nc, err := nats.Connect(r.ns.ClientURL())
	must(t, err)
	t.Cleanup(nc.Close)
	var switched atomic.Bool
	var answers, since atomic.Int32
	_, err = nc.Subscribe("test.heartbeat", func(m *nats.Msg) {
		h := nats.Header{"Kvrouter-Ranks-Without-State": []string{""}}
		if switched.Load() {
			for k, v := range later {
				h[k] = v
			}
			since.Add(1)
		} else {
			h["Kvrouter-Ranks-Needing-Resync"] = []string{"7/0"}
		}
		_ = m.RespondMsg(&nats.Msg{Data: eventplane.AppendHeartbeat(nil, nil), Header: h})
		answers.Add(1)
	})
	must(t, err)
	must(t, nc.Flush())
	a, _ = startAgentWith(t, r, Config{HeartbeatInterval: 20 * time.Millisecond, HeartbeatSubject: "test.heartbeat",
		Publisher: eventplane.PublisherConfig{RouterResyncEvery: every}})
	// The start's dump, then the one the router asked for.
	waitFor(t, "the rank dumped for the router's ask", func() bool { return a.Publisher().Synced(rank) >= 2 })
	asked = time.Now()
	// More answers naming it, within the interval: a dump held back.
	n := answers.Load()
	waitFor(t, "5 more answers naming the rank", func() bool { return answers.Load() >= n+5 })
	return a, asked, func() *atomic.Int32 { switched.Store(true); return &since }
}

// TestAnAnswerThatNoLongerFlagsTheRankVoidsTheHeldBackResync pins
// docs/events.md: a held-back resync ask is void once the router no
// longer flags the rank. After an operator's restore the heartbeats'
// answers name an idle rank until the dump asked for them is applied:
// answers that come meanwhile hold another dump back to the interval's
// end, and an answer that names the flagged ranks without this one voids
// it, as an ack without the flag does. Without that the rank was dumped
// once more, RouterResyncEvery (5 minutes) after the restore, for
// nothing.
func TestAnAnswerThatNoLongerFlagsTheRankVoidsTheHeldBackResync(t *testing.T) {
	const every = 500 * time.Millisecond
	a, asked, after := heldBackResync(t, every, nats.Header{"Kvrouter-Ranks-Needing-Resync": []string{""}})
	cleared := after()
	// Past the interval's end, with answers that no longer flag it.
	waitFor(t, "the interval's end, twice over, and 5 answers without the flag", func() bool {
		return time.Since(asked) > 2*every && cleared.Load() >= 5
	})
	if got := a.Publisher().Synced(rank); got != 2 {
		t.Fatalf("%d dumps of the rank taken, want 2 (the start's and one for the answers): the ask held back within RouterResyncEvery (%v) dumped the rank after answers that no longer flag it", got, every)
	}
}

// TestAnAnswerThatDoesNotNameTheFlaggedRanksKeepsTheHeldBackResync: an
// answer that does not say which ranks the router flags (without the
// Kvrouter-Ranks-Needing-Resync header: a router of an earlier build, or
// with a rank of it that cannot be read: a format of a later one) voids
// no held-back resync ask: the rank is dumped at the interval's end, as
// an ack's held-back ask is, not left unsynced on an answer that says
// nothing of it.
func TestAnAnswerThatDoesNotNameTheFlaggedRanksKeepsTheHeldBackResync(t *testing.T) {
	for _, c := range []struct {
		name  string
		later nats.Header // the answers' headers after the switch
	}{
		{"without the header", nil},
		{"with an unreadable rank", nats.Header{"Kvrouter-Ranks-Needing-Resync": []string{"7/x"}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			const every = 500 * time.Millisecond
			a, asked, after := heldBackResync(t, every, c.later)
			unnamed := after()
			waitFor(t, "5 answers that do not name the flagged ranks", func() bool { return unnamed.Load() >= 5 })
			deadline := asked.Add(10 * every)
			for a.Publisher().Synced(rank) < 3 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if got := a.Publisher().Synced(rank); got != 3 {
				t.Fatalf("%d dumps of the rank taken %v after the ask held back, want 3 (the start's, one for the answers, and the held-back one at RouterResyncEvery, %v): %d answers %s voided it",
					got, time.Since(asked), every, unnamed.Load(), c.name)
			}
		})
	}
}
