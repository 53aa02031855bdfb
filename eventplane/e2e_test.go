package eventplane

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func connect(t testing.TB, urls string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(urls, nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// checkIndexMatches waits for the publisher to drain, then checks every
// running node: same digest at the same applied index, the model's entry
// count, every rank's cursor at the last published id, each rank's blocks
// per tier, no held orphan and no rank flagged for a resync (the model
// holds neither: an orphan is state the owner does not have, and a flag a
// loss no dump healed), and the content: every live chain of the model,
// looked up by its content hashes, matches in full on its owning rank
// alone and in the tier it was stored in (so a block held under the wrong
// hash, parent, rank or tier fails).
func checkIndexMatches(t *testing.T, c *testCluster, o *owner, p *Publisher) {
	t.Helper()
	checkIndex(t, c, o, p, false)
}

// checkIndexMatchesHoldingOrphans is checkIndexMatches after o.orphans:
// the router may still hold orphans the owner does not keep, and flag
// their rank for a resync, until a dump replaces it.
func checkIndexMatchesHoldingOrphans(t *testing.T, c *testCluster, o *owner, p *Publisher) {
	t.Helper()
	checkIndex(t, c, o, p, true)
}

func checkIndex(t *testing.T, c *testCluster, o *owner, p *Publisher, orphansHeld bool) {
	t.Helper()
	waitFor(t, 15*time.Second, "the publisher to drain", func() bool { return p.Pending() == 0 })
	c.converged()
	want := o.entries()
	o.mu.Lock()
	defer o.mu.Unlock()
	var wantTiers [kvevent.NumTiers]int64
	wantRank := map[kvevent.Rank][kvevent.NumTiers]int64{}
	for r, or := range o.ranks {
		var per [kvevent.NumTiers]int64
		for _, ev := range or.live {
			per[ev.Tier] += int64(len(ev.Blocks))
			wantTiers[ev.Tier] += int64(len(ev.Blocks))
		}
		wantRank[r] = per
	}
	var m indexer.Matches
	for i, n := range c.nodes {
		if n == nil {
			continue
		}
		st := n.IndexStats()
		if st.Entries != want {
			t.Errorf("node %d: index entries = %d, model %d", i, st.Entries, want)
		}
		if st.Blocks != wantTiers {
			t.Errorf("node %d: blocks per tier = %v, model %v", i, st.Blocks, wantTiers)
		}
		if !orphansHeld && (st.OrphanEvents != 0 || st.NeedResync != 0) {
			t.Errorf("node %d: %d orphan events held, %d ranks need a resync; the model has none", i, st.OrphanEvents, st.NeedResync)
		}
		for _, rs := range n.FSM().Index().RankStats() {
			if w := wantRank[rs.Rank]; rs.Blocks != w {
				t.Errorf("node %d: rank %v blocks per tier = %v, model %v", i, rs.Rank, rs.Blocks, w)
			}
			if !orphansHeld && (rs.OrphanEvents != 0 || rs.NeedsResync) {
				t.Errorf("node %d: rank %v holds %d orphan events, needs a resync %v", i, rs.Rank, rs.OrphanEvents, rs.NeedsResync)
			}
		}
		for r, or := range o.ranks {
			if got := n.FSM().Cursor(r); got != or.last {
				t.Errorf("node %d: rank %v cursor = %d, last published %d", i, r, got, or.last)
			}
			bad := 0
			for id, ev := range or.live {
				local := make([]uint64, len(ev.Blocks))
				for k, b := range ev.Blocks {
					local[k] = b.LocalHash
				}
				n.FindMatches(local, indexer.ViewTiered, &m)
				var wantBlocks [kvevent.NumTiers]uint32
				wantBlocks[ev.Tier] = uint32(len(ev.Blocks))
				if len(m.Ranks) != 1 || m.Ranks[0].Rank != r || m.Ranks[0].Blocks != wantBlocks {
					if bad++; bad <= 3 {
						t.Errorf("node %d: rank %v chain %d (%d blocks in tier %v) matches %+v, want only that rank with %v",
							i, r, id, len(ev.Blocks), ev.Tier, m.Ranks, wantBlocks)
					}
				}
			}
			if bad > 3 {
				t.Errorf("node %d: rank %v: %d chains in all do not match", i, r, bad)
			}
		}
	}
}

func TestLeaderCrashMidStreamLosesAndDoublesNothing(t *testing.T) {
	c := newTestCluster(t, 3)
	l := c.leader()
	f := (l + 1) % 3 // the publisher's server survives the crash
	o := newOwner(1)
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(f)), Dump: o.dump, RequestTimeout: 500 * time.Millisecond,
		MaxRequestEvents: 64, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o.pub = p
	ranks := []kvevent.Rank{{Worker: 1, DP: 0}, {Worker: 1, DP: 1}, {Worker: 2, DP: 0}, {Worker: 3, DP: 0}}

	const steps = 3000
	var wg sync.WaitGroup
	half, resume := make(chan struct{}), make(chan struct{})
	var halfOnce sync.Once
	reachedHalf := func() { halfOnce.Do(func() { close(half) }) }
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer reachedHalf() // also when step fails: the test must not wait for ever
		ctx := ctxT(t)
		for k := range steps {
			if k == steps/2 {
				reachedHalf()
				<-resume
			}
			o.step(ctx, t, ranks[k%len(ranks)])
			if k%10 == 0 {
				time.Sleep(time.Millisecond) // a stream, not one burst
			}
		}
	}()
	<-half
	// An election since l was picked (a loaded machine misses heartbeats
	// of 200 ms) may have moved the leadership: the crash is the
	// leader's, and the publisher's server f must survive it, so it comes
	// back to l, while the stream waits.
	if cur := c.leader(); cur != l {
		t.Logf("n%d leads since an election; moving the leadership back to n%d", cur+1, l+1)
		transferLeadership(t, c.nodes[cur], fmt.Sprintf("n%d", l+1))
		waitFor(t, 15*time.Second, fmt.Sprintf("n%d to lead again", l+1), func() bool { return c.nodes[l].IsLeader() })
	}
	// The leader's ingester is the first part of it to go (c.stop closes
	// it first): from here nobody answers requests until a new leader
	// does. The stream goes on, and the crash waits for an event
	// published after that, so that events are certainly unacknowledged
	// when the leader dies and go through the failover.
	c.ings[l].Close()
	publishedAtClose := val(p.m.published)
	close(resume)
	waitFor(t, 15*time.Second, "an event published after the leader stopped answering", func() bool {
		return val(p.m.published) > publishedAtClose
	})
	c.stop(l)
	publishedAtCrash, ackedAtCrash := val(p.m.published), val(p.m.acked)
	wg.Wait()
	if ackedAtCrash == 0 || ackedAtCrash >= steps {
		t.Fatalf("%v events acked when the leader crashed: not mid-stream", ackedAtCrash)
	}
	if publishedAtCrash <= ackedAtCrash {
		t.Fatalf("%v events published and %v acked when the leader crashed: none was in flight, the test did not exercise the failover",
			publishedAtCrash, ackedAtCrash)
	}
	if c.leader() == l {
		t.Fatal("the old leader still leads")
	}
	checkIndexMatches(t, c, o, p)
	t.Logf("published at crash=%v acked at crash=%v requests=%v retries=%v dumps=%v",
		publishedAtCrash, ackedAtCrash, val(p.m.requests), val(p.m.retries), val(p.m.dumps))
	// A dump would heal a lost event (and checkIndexMatches would see
	// nothing), so none may have happened: the router's cursor never falls
	// behind what it acknowledged, the publisher resends every
	// unacknowledged event from its buffer (no DropOldest), and the owner's
	// chains have no parents, so no orphans make the router ask for one.
	// Every gap must have healed by a replay.
	if d, g, r := val(p.m.dumps), val(p.m.resends.WithLabelValues("dump")), val(p.m.resends.WithLabelValues("router")); d != 0 || g != 0 || r != 0 {
		t.Errorf("%v dumps (%v gaps the buffer could not replay, %v router asks): an event was lost and a dump hid it", d, g, r)
	}
	if d := val(p.m.dropped); d != 0 {
		t.Errorf("%v events dropped from the publisher's buffer", d)
	}
}

func TestBufferOverflowHealsWithADump(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	o := newOwner(2)
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o.dump, BufferEvents: 8, DropOldest: true, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o.pub = p
	ranks := []kvevent.Rank{{Worker: 7, DP: 0}, {Worker: 7, DP: 1}}
	ctx := ctxT(t)
	// A burst far larger than the buffer: the oldest unacknowledged events
	// are dropped, the router reports a gap, and the rank is replaced by a
	// dump of the owner's state.
	for k := range 2000 {
		o.step(ctx, t, ranks[k%2])
	}
	checkIndexMatches(t, c, o, p)
	if val(p.m.dropped) == 0 || val(p.m.dumps) == 0 {
		t.Fatalf("dropped=%v dumps=%v: the test did not exercise the dump path",
			val(p.m.dropped), val(p.m.dumps))
	}
}

// TestRouterAskedResyncHealsWithADump: a rank whose held orphans overflow
// the router's bound loses events; the ack says so (Resync) and the
// publisher answers with a dump of the rank, which replaces its state
// and clears the flag (semantics.md §3: "request a resync of that rank").
func TestRouterAskedResyncHealsWithADump(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	o := newOwner(3)
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o.dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o.pub = p
	r := kvevent.Rank{Worker: 9, DP: 0}
	ctx := ctxT(t)
	for range 20 {
		o.step(ctx, t, r)
	}
	o.orphans(ctx, t, r, 100) // the router holds 64 (indexer.Config's default)
	checkIndexMatchesHoldingOrphans(t, c, o, p)
	// The publisher counts a dump once its reply is in, after the index
	// changed: wait for both.
	waitFor(t, 15*time.Second, "the dump the router asked for", func() bool {
		st := c.nodes[0].IndexStats()
		return st.NeedResync == 0 && st.OrphanEvents == 0 && val(p.m.dumps) > 0
	})
	if got := val(p.m.resends.WithLabelValues("router")); got == 0 {
		t.Fatal("kvagent_events_resyncs_total{reason=router} did not count the router's ask")
	}
	checkIndexMatches(t, c, o, p)

	// Again, within RouterResyncEvery: the router asks, and the publisher
	// does not dump the rank again yet (the owner's copy dropped the same
	// stores; a dump on every ack would resend the rank without end).
	dumps := val(p.m.dumps)
	o.orphans(ctx, t, r, 100)
	checkIndexMatchesHoldingOrphans(t, c, o, p)
	if st := c.nodes[0].IndexStats(); st.NeedResync != 1 {
		t.Fatalf("%d ranks need a resync, want the one that dropped orphans again", st.NeedResync)
	}
	p.mu.Lock()
	pending := p.ranks[r].needDump
	p.mu.Unlock()
	if got := val(p.m.dumps); got != dumps || pending {
		t.Fatalf("%v dumps after the second ask (want %v), another pending %v: dumped again within RouterResyncEvery", got, dumps, pending)
	}
}

// TestHeldBackResyncAskIsAnsweredLater: an ask the publisher held back
// within RouterResyncEvery is answered once the interval ends, though the
// rank sends nothing more. From the eighth session's note: the held-back
// ask waited for another flagged ack, and a quiet rank stayed flagged.
func TestHeldBackResyncAskIsAnsweredLater(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	o := newOwner(4)
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o.dump, Logger: quiet, RouterResyncEvery: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o.pub = p
	r := kvevent.Rank{Worker: 9}
	ctx := ctxT(t)
	o.step(ctx, t, r)
	o.orphans(ctx, t, r, 100)
	waitFor(t, 15*time.Second, "the first dump", func() bool {
		return c.nodes[0].IndexStats().NeedResync == 0 && val(p.m.dumps) > 0
	})
	dumps := val(p.m.dumps)
	o.orphans(ctx, t, r, 100) // asked again at once: held back
	checkIndexMatchesHoldingOrphans(t, c, o, p)
	// The rank is quiet from here on.
	waitFor(t, 15*time.Second, "the held-back ask's dump", func() bool {
		return c.nodes[0].IndexStats().NeedResync == 0 && val(p.m.dumps) > dumps
	})
	// The dump replaced the rank whole: the owner's state, no orphan left.
	checkIndexMatches(t, c, o, p)
}

func TestFullBufferRefusesWithoutTakingIDs(t *testing.T) {
	nc := connectNowhere(t)
	p, err := NewPublisher(PublisherConfig{Conn: nc, BufferEvents: 2, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 1}
	ev := []kvevent.Event{{Kind: kvevent.KindCleared}}
	for want := uint64(1); want <= 2; want++ {
		if id, err := p.Publish(r, ev); err != nil || id != want {
			t.Fatalf("publish = %d, %v; want id %d", id, err, want)
		}
	}
	if _, err := p.Publish(r, ev); err != ErrFull {
		t.Fatalf("publish into a full buffer: %v, want ErrFull", err)
	}
	if _, last := p.Cursor(r); last != 2 {
		t.Fatalf("last id = %d after a refused publish, want 2", last)
	}
}

// TestBatchLargerThanTheBufferFailsAtOnce: a batch of more events than a
// rank's buffer holds can never fit: Publish and PublishWait both refuse it
// at once with ErrTooLarge (an ErrFull), taking no ids. From a review:
// PublishWait waited on a room channel that was nil, until its context
// ended.
func TestBatchLargerThanTheBufferFailsAtOnce(t *testing.T) {
	p, err := NewPublisher(PublisherConfig{Conn: connectNowhere(t), BufferEvents: 2, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 1}
	evs := make([]kvevent.Event, 3)
	for i := range evs {
		evs[i].Kind = kvevent.KindCleared
	}
	if _, err := p.Publish(r, evs); !errors.Is(err, ErrTooLarge) || !errors.Is(err, ErrFull) {
		t.Fatalf("publish of 3 events into a 2-event buffer: %v, want ErrTooLarge (an ErrFull)", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := p.PublishWait(ctx, r, evs)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, ErrTooLarge) || errors.Is(err, context.Canceled) {
			t.Fatalf("PublishWait of 3 events into a 2-event buffer: %v, want ErrTooLarge", err)
		}
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatalf("PublishWait of 3 events into a 2-event buffer still waits for room after 10s; with its context cancelled: %v", <-done)
	}
	if _, last := p.Cursor(r); last != 0 {
		t.Fatalf("last id = %d after refused publishes, want 0", last)
	}
}

// connectNowhere is a connection to a lone server nobody answers on.
func connectNowhere(t *testing.T) *nats.Conn {
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	nc, err := nats.Connect(s.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func val(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// TestResyncDuringADumpSendsAnother: a resync asked for while a dump is
// being built or sent (an agent's engine resets as its first dump goes
// out) gets a dump of its own. The first dump's state is the owner's from
// before the reset; had its success answered the later ask too, the
// router would keep that stale state (it did: the agent's reset test
// lost the offloaded blocks about once in fifty runs on a loaded machine).
func TestResyncDuringADumpSendsAnother(t *testing.T) {
	c := newTestCluster(t, 1)
	l := c.leader()
	warm, r := kvevent.Rank{Worker: 4}, kvevent.Rank{Worker: 5}
	block := func(r kvevent.Rank, h uint64) kvevent.Event {
		return kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
			Blocks: []kvevent.Block{{EngineHash: h, LocalHash: 1000 + h}}}
	}
	var mu sync.Mutex
	calls := 0
	var p *Publisher
	dump := func(kvevent.Rank) ([]kvevent.Event, uint64) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		if calls == 1 {
			// The stale state is built; then the owner resets (the
			// resync comes from its own goroutine in the agent).
			p.Resync(r)
			return []kvevent.Event{block(r, 1), block(r, 2), block(r, 3)}, 0
		}
		return []kvevent.Event{block(r, 9)}, 0
	}
	var err error
	p, err = NewPublisher(PublisherConfig{Conn: connect(t, c.url(l)), Dump: dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// The router answers before the scenario starts: a first dump that
	// failed for want of a responder would be built again, fresh, and
	// hide the fault.
	if _, err := p.PublishWait(ctxT(t), warm, []kvevent.Event{block(warm, 100)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 15*time.Second, "the warm-up event's ack", func() bool { return p.Pending() == 0 })
	p.Resync(r)
	n := c.nodes[l]
	// Two dumps committed (the stale one, then the one the reset asked
	// for), and the router holds the second: the warm-up block and block 9.
	waitFor(t, 15*time.Second, "the second dump's state on the router", func() bool {
		return val(p.m.dumps) == 2 && n.IndexStats().Entries == 2 && p.Pending() == 0
	})
	mu.Lock()
	defer mu.Unlock()
	if calls < 2 {
		t.Fatalf("the owner built %d dumps, want 2", calls)
	}
}

// TestStaleDumpRenumbersOnce: a new incarnation's first dump is behind the
// router's cursor (an earlier incarnation used those ids); the publisher
// renumbers past it and the next dump goes through, also when the owner
// reports through in the ids Publish returned before the renumbering.
// From a review: each dump then renumbered again, with no backoff, for
// ever, and Close waited on the spinning loop.
func TestStaleDumpRenumbersOnce(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	r := kvevent.Rank{Worker: 9}
	o1 := newOwner(11)
	p1, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o1.dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	o1.pub = p1
	for range 50 {
		o1.step(ctxT(t), t, r)
	}
	waitFor(t, 10*time.Second, "the first incarnation's events", func() bool { return p1.Pending() == 0 })
	p1.Close()

	o2 := newOwner(12) // holds nothing: its dump's through is 0
	p2, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o2.dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p2.Close()
	o2.pub = p2
	p2.Resync(r)
	waitFor(t, 10*time.Second, "the second incarnation's dump", func() bool {
		p2.mu.Lock()
		defer p2.mu.Unlock()
		return !p2.ranks[r].needDump
	})
	if n := val(p2.m.requests); n > 5 {
		t.Fatalf("%v requests for one stale dump", n)
	}
	for range 5 {
		o2.step(ctxT(t), t, r)
	}
	checkIndexMatches(t, c, o2, p2)
}

// TestFailingDumpHoldsOnlyItsRank: a rank whose dump keeps failing (here
// the publisher has no Dump callback; in the field, a dump larger than the
// server takes) is retried on its own backoff while the other ranks'
// events go on. From a review: the loop retried that dump only, and every
// other rank of the agent stalled for good.
func TestFailingDumpHoldsOnlyItsRank(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	stuck, fine := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Resync(stuck)
	if _, err := p.Publish(fine, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the other rank's event", func() bool {
		acked, _ := p.Cursor(fine)
		return acked == 1
	})
}

// cursorTarget is a leader that keeps per-rank cursors as the state
// machine does: ids at or below the cursor are duplicates, the next one
// applies, one past it is a gap; a dump below the cursor is stale.
// applied holds the events applied since the last dump.
type cursorTarget struct {
	mu      sync.Mutex
	cursor  map[kvevent.Rank]uint64
	dumps   int
	applied []kvevent.Event
}

func newCursorTarget() *cursorTarget { return &cursorTarget{cursor: map[kvevent.Rank]uint64{}} }

func (t *cursorTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	acks := make([]raftfsm.RankAck, len(bs))
	for i, b := range bs {
		cur := t.cursor[b.Rank]
		a := raftfsm.RankAck{Rank: b.Rank}
		for _, ev := range b.Events {
			if ev.EventID <= cur {
				a.Dups++
				continue
			}
			if ev.EventID != cur+1 {
				a.Gap = true
				break
			}
			cur = ev.EventID
			a.Applied++
			t.applied = append(t.applied, ev)
		}
		t.cursor[b.Rank] = cur
		a.Cursor = cur
		acks[i] = a
	}
	return acks, nil
}

func (t *cursorTarget) ReplaceRankFenced(_ context.Context, r kvevent.Rank, cursor, _ uint64, _ []kvevent.Event) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if cur := t.cursor[r]; cursor < cur {
		return &raftfsm.StaleDumpError{Cursor: cur}
	}
	t.cursor[r] = cursor
	t.dumps++
	t.applied = nil
	return nil
}

func (t *cursorTarget) IsLeader() bool                                 { return true }
func (t *cursorTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo     { return nil }
func (t *cursorTarget) DeregisterWorker(context.Context, uint64) error { return nil }

// ingesting reports whether in holds the event subscriptions.
func ingesting(in *Ingester) bool {
	var m dto.Metric
	_ = in.m.subs.Write(&m)
	return m.GetGauge().GetValue() == 1
}

// holdAfterDumpTarget is a cursorTarget whose events requests after the
// first dump it commits wait for release.
type holdAfterDumpTarget struct {
	*cursorTarget
	release chan struct{}
}

func (t *holdAfterDumpTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	t.mu.Lock()
	dumped := t.dumps > 0
	t.mu.Unlock()
	if dumped {
		select {
		case <-t.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return t.cursorTarget.IngestEvents(ctx, bs)
}

// pollHook is a context whose Done calls poll first: Flush calls it once
// per look at the cursors, after it took its goals and that look.
type pollHook struct {
	context.Context
	poll func()
}

func (c pollHook) Done() <-chan struct{} {
	c.poll()
	return c.Context.Done()
}

// TestFlushFollowsARenumbering: a new incarnation's events, published
// before a Flush, are renumbered past the router's cursor (an earlier
// incarnation used their ids) and go through after the dump that follows;
// Flush waits for them in their new numbering and returns once the router
// holds them. The owner's dump reflects the first 5 of the 10 events (the
// others were published after it was built), so the 5 others are still to
// go when the dump commits, at a cursor past 10: Flush must wait for
// their new ids, not take that cursor for past the old ones'. Their
// request is held until Flush has looked at the cursors after the dump.
func TestFlushFollowsARenumbering(t *testing.T) {
	tg := &holdAfterDumpTarget{cursorTarget: newCursorTarget(), release: make(chan struct{})}
	var released sync.Once
	release := func() { released.Do(func() { close(tg.release) }) }
	defer release()
	r := kvevent.Rank{Worker: 9}
	tg.cursor[r] = 50 // an earlier incarnation's
	dumpGo := make(chan struct{})
	dump := func(kvevent.Rank) ([]kvevent.Event, uint64) {
		select {
		case <-dumpGo:
		case <-t.Context().Done():
		}
		return nil, 5
	}
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump})
	// ids 1..10: duplicates, to the router
	if _, err := p.Publish(r, slices.Repeat([]kvevent.Event{{Kind: kvevent.KindCleared}}, 10)); err != nil {
		t.Fatal(err)
	}
	polls, dumped := 0, false
	ctx := pollHook{ctxT(t), func() {
		polls++
		switch {
		case polls == 1:
			close(dumpGo) // Flush took its goals in the old numbering
		case dumped:
			release() // Flush looked at the cursors after the dump, and waits on
		case val(p.m.dumps) > 0:
			dumped = true // the look before this call may predate the dump
		}
	}}
	if err := p.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v", err)
	}
	acked, last := p.Cursor(r)
	tg.mu.Lock()
	defer tg.mu.Unlock()
	if tg.dumps != 1 || acked != tg.cursor[r] || acked < 50 || last != acked || p.Pending() != 0 {
		t.Fatalf("after Flush: %d dumps, cursor %d acknowledged of the router's %d, last id %d, %d pending; want the events renumbered past 50 and acknowledged",
			tg.dumps, acked, tg.cursor[r], last, p.Pending())
	}
}

// TestRenumberingLeavesARequestCapOfRoom: a dump refused as stale
// renumbers a request cap past the router's cursor (docs/events.md: "The
// new numbering starts a request cap further up (65536 ids past the
// larger of the cursor and the last id `Publish` returned: the larger of
// the publisher's `MaxRequestEvents` and the leader's default cap"), so
// that a dead incarnation's last request, committed after the next dump,
// applies as duplicates. The owner holds nothing (through 0) and the
// router's cursor is 50: the next dump commits at 50 + the cap, the
// leader's default cap with the publisher's default (8192) below it, the
// publisher's own when above.
func TestRenumberingLeavesARequestCapOfRoom(t *testing.T) {
	for _, tc := range []struct {
		maxRequestEvents int
		want             uint64
	}{
		{0, 50 + defaultMaxRequestEvents}, // the publisher's default, 8192
		{100000, 50 + 100000},
	} {
		t.Run(fmt.Sprint(tc.maxRequestEvents), func(t *testing.T) {
			tg := newCursorTarget()
			r := kvevent.Rank{Worker: 9}
			tg.cursor[r] = 50 // an earlier incarnation's
			dump := func(kvevent.Rank) ([]kvevent.Event, uint64) { return nil, 0 }
			_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump, MaxRequestEvents: tc.maxRequestEvents})
			p.Resync(r)
			waitFor(t, 10*time.Second, "the dump after the renumbering", func() bool {
				tg.mu.Lock()
				defer tg.mu.Unlock()
				return tg.dumps == 1
			})
			waitCursorIsTheRouters(t, tg, p, r)
			tg.mu.Lock()
			defer tg.mu.Unlock()
			if got := tg.cursor[r]; got != tc.want {
				t.Fatalf("the dump after the renumbering committed at %d, %d past the router's cursor 50; want %d, %d past it",
					got, got-50, tc.want, tc.want-50)
			}
		})
	}
}

// TestRenumberingPastPublishedIDsDoesNotReapplyEvents: the owner
// publishes while a stale dump is out, past the router's cursor; the
// publisher renumbers, and the next dump reports its through in the ids
// Publish returned before the renumbering. That through must be taken as
// an old id: no event is sent after the dump that holds them all. From
// the event-plane review: the renumbering moved the ids past the router's
// cursor only (50), so the old through 80 read as a new id, and the 50
// events above it were applied again on top of the dump.
func TestRenumberingPastPublishedIDsDoesNotReapplyEvents(t *testing.T) {
	tg := newCursorTarget()
	r := kvevent.Rank{Worker: 9}
	tg.cursor[r] = 50 // an earlier incarnation's
	o := newOwner(3)
	ctx := ctxT(t)
	calls := 0 // the publisher's loop alone calls dump
	dump := func(r kvevent.Rank) ([]kvevent.Event, uint64) {
		calls++
		stored, through := o.dump(r)
		if calls == 1 {
			// Published after the dump was built, before its stale reply:
			// ids 1..80, past the router's cursor.
			for range 80 {
				o.step(ctx, t, r)
			}
		}
		return stored, through
	}
	// The first dump must meet the ingester (startPlaneWith waits for its
	// subscriptions): one retried for want of a responder would be built
	// again, after the events below.
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump})
	o.pub = p
	p.Resync(r)
	waitFor(t, 10*time.Second, "the dump and the events", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.dumps == 1 && p.Pending() == 0
	})
	waitCursorIsTheRouters(t, tg, p, r)
	tg.mu.Lock()
	defer tg.mu.Unlock()
	if n := len(tg.applied); n != 0 {
		_, last := p.Cursor(r)
		t.Fatalf("router cursor %d, publisher last %d, owner last %d: %d events applied after the dump that already held every one of them, the first with id %d",
			tg.cursor[r], last, o.ranks[r].last, n, tg.applied[0].EventID)
	}
	if calls != 2 {
		t.Fatalf("the owner built %d dumps, want 2 (the stale one and the one after the renumbering)", calls)
	}
}

// TestUnregisteredWorkersRanksLeaveEveryNode: events and dumps apply for
// any worker, registered or not; the ranks of a worker that is not
// registered — one deregistered while its agent goes on publishing (its
// first batch meets a gap and it dumps the rank anew), one that never
// registered — are removed from every node once the grace has passed,
// as is a registered worker's rank that its registration does not list
// (its worker stays), and a registered worker's listed rank stays. From
// the event-plane review: such ranks stayed in the index, the cursors and
// the heard times for good (the unlisted one from a later review).
func TestUnregisteredWorkersRanksLeaveEveryNode(t *testing.T) {
	c := newTestClusterWith(t, 3, IngesterConfig{UnregisteredGrace: time.Second, LeaseSweep: 50 * time.Millisecond})
	l := c.leader()
	n := c.nodes[l]
	ctx := ctxT(t)
	for _, id := range []uint64{1, 2} {
		if err := n.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: id, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	o := newOwner(21)
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(l)), Dump: o.dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	o.pub = p
	kept, gone, never := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}, kvevent.Rank{Worker: 3}
	unlisted := kvevent.Rank{Worker: 1, DP: 3} // worker 1 lists dp 0 only
	for k := range 40 {
		o.step(ctx, t, []kvevent.Rank{kept, gone, never, unlisted}[k%4])
	}
	waitFor(t, 10*time.Second, "the events", func() bool { return p.Pending() == 0 })

	if err := n.DeregisterWorker(ctx, gone.Worker); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		o.step(ctx, t, gone)
	}
	waitFor(t, 10*time.Second, "the removed worker's dump to bring its rank back", func() bool {
		return p.Pending() == 0 && n.FSM().Cursor(gone) == o.ranks[gone].last
	})

	waitFor(t, 15*time.Second, "the unregistered workers' ranks to leave every node", func() bool {
		for _, nd := range c.nodes {
			for _, r := range []kvevent.Rank{gone, never, unlisted} {
				if _, err := nd.DumpRank(r); nd.FSM().Cursor(r) != 0 || !errors.Is(err, indexer.ErrUnknownRank) {
					return false
				}
			}
			if len(nd.UnregisteredRanks()) != 0 {
				return false
			}
		}
		return true
	})
	c.converged()
	for i, nd := range c.nodes {
		if got, want := nd.FSM().Cursor(kept), o.ranks[kept].last; got != want {
			t.Errorf("node %d: the registered worker's cursor = %d, want %d", i, got, want)
		}
		if _, err := nd.DumpRank(kept); err != nil {
			t.Errorf("node %d: the registered worker's rank: %v", i, err)
		}
		if _, ok := nd.WorkerTable()[kept.Worker]; !ok {
			t.Errorf("node %d: the registered worker was removed", i)
		}
	}
	// Summed over the nodes: the leader that removed them may not be the
	// first one, when a loaded machine delayed heartbeats past a timeout.
	var removed float64
	for _, in := range c.ings {
		removed += val(in.m.unregRemoved)
	}
	if removed < 3 {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v over the nodes, want at least 3 (workers 2 and 3, rank %v)", removed, unlisted)
	}
}

// refusingTarget is a cursorTarget that answers invalid (raftfsm.ErrInvalid)
// any request holding event refuse of rank (of any rank when zero).
type refusingTarget struct {
	*cursorTarget
	rank   kvevent.Rank
	refuse uint64
}

func (t *refusingTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	for _, b := range bs {
		for _, ev := range b.Events {
			if ev.EventID == t.refuse && (t.rank == kvevent.Rank{} || t.rank == b.Rank) {
				return nil, fmt.Errorf("%w: event %d", raftfsm.ErrInvalid, ev.EventID)
			}
		}
	}
	return t.cursorTarget.IngestEvents(ctx, bs)
}

// TestRequestsShrinkToWhatTheRouterTakes: a router whose request cap is
// below the publisher's refuses its requests as invalid; the publisher
// sends smaller ones until they go through, and every event is applied.
// From the event-plane review: it resent the same request for ever, and
// every rank in it was stuck.
func TestRequestsShrinkToWhatTheRouterTakes(t *testing.T) {
	tg := newCursorTarget()
	_, p := startPlaneWith(t, tg, IngesterConfig{MaxRequestEvents: 5}, PublisherConfig{MinBackoff: time.Millisecond})
	publishTwoRanksAndWait(t, tg, p)
}

// publishTwoRanksAndWait publishes 100 one-block stores on each of two
// ranks through p and waits until tg applied them all and p holds
// nothing unacknowledged.
func publishTwoRanksAndWait(t *testing.T, tg *cursorTarget, p *Publisher) {
	t.Helper()
	ranks := []kvevent.Rank{{Worker: 1}, {Worker: 2}}
	for _, r := range ranks {
		evs := make([]kvevent.Event, 100)
		for i := range evs {
			evs[i] = kvevent.Event{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: uint64(i + 1), LocalHash: uint64(i + 1)}}}
		}
		if _, err := p.Publish(r, evs); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "every event to be applied", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.cursor[ranks[0]] == 100 && tg.cursor[ranks[1]] == 100 && p.Pending() == 0
	})
}

// waitCursorIsTheRouters waits until p's acknowledged cursor of r is
// tg's.
func waitCursorIsTheRouters(t *testing.T, tg *cursorTarget, p *Publisher, r kvevent.Rank) {
	t.Helper()
	waitFor(t, 10*time.Second, "the publisher's cursor to be the router's", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		acked, _ := p.Cursor(r)
		return acked == tg.cursor[r]
	})
}

// capTarget is a cursorTarget that answers invalid (raftfsm.ErrInvalid)
// any request of more than limit events, as a router with a smaller
// request cap than the publisher's does, and records the size of every
// request it is sent, refused or not.
type capTarget struct {
	*cursorTarget
	limit int
	sizes []int // guarded by cursorTarget.mu
	taken []bool
}

func (t *capTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	n := 0
	for _, b := range bs {
		n += len(b.Events)
	}
	t.mu.Lock()
	t.sizes, t.taken = append(t.sizes, n), append(t.taken, n <= t.limit)
	t.mu.Unlock()
	if n > t.limit {
		return nil, fmt.Errorf("%w: %d events in a request, more than %d", raftfsm.ErrInvalid, n, t.limit)
	}
	return t.cursorTarget.IngestEvents(ctx, bs)
}

// TestRequestsStayBelowARefusedSize: once a request of n events is
// refused as it is, no later request holds n or more for a minute
// (docs/events.md: "the publisher halves its request size until one goes
// through, and stays below the refused size for a minute"), however many
// go through meanwhile: doubled back at once, each success would be
// followed by a refused request, and half of the requests to a router
// with a smaller cap refused for good. The test ends well within the
// minute.
func TestRequestsStayBelowARefusedSize(t *testing.T) {
	tg := &capTarget{cursorTarget: newCursorTarget(), limit: 5}
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{MinBackoff: time.Millisecond})
	publishTwoRanksAndWait(t, tg.cursorTarget, p)
	tg.mu.Lock()
	defer tg.mu.Unlock()
	refused := 0 // the smallest refused size so far; 0 none
	for i, n := range tg.sizes {
		if refused > 0 && n >= refused {
			t.Fatalf("request %d of %d events, after one of %d was refused (sizes %v)", i+1, n, refused, tg.sizes)
		}
		if !tg.taken[i] {
			refused = n
		}
	}
	if refused == 0 {
		t.Fatalf("no request refused (sizes %v): the test's cap did not bind", tg.sizes)
	}
}

// TestAnEventRefusedAloneIsReplacedByADump: an event the router refuses
// even in a request of its own is given up, and the owner's dump, which
// holds what it did, replaces the rank; the rank's later events go on.
func TestAnEventRefusedAloneIsReplacedByADump(t *testing.T) {
	tg := &refusingTarget{cursorTarget: newCursorTarget(), refuse: 5}
	o := newOwner(5)
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: o.dump, MinBackoff: time.Millisecond})
	o.pub = p
	r := kvevent.Rank{Worker: 3}
	ctx := ctxT(t)
	for range 20 {
		o.step(ctx, t, r)
	}
	waitFor(t, 20*time.Second, "the dump and the events after it", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.dumps == 1 && p.Pending() == 0
	})
	for range 5 {
		o.step(ctx, t, r)
	}
	waitFor(t, 10*time.Second, "the rank's later events", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		_, last := p.Cursor(r)
		return p.Pending() == 0 && tg.cursor[r] == last && last > 20
	})
}

// TestOneBadEventAmongManyRanksIsIsolated: the router refuses every
// request that holds one rank's bad event, among eight ranks' events; the
// requests shrink until the bad event goes alone, and is given up for a
// dump of its rank, while every other event is applied.
func TestOneBadEventAmongManyRanksIsIsolated(t *testing.T) {
	bad := kvevent.Rank{Worker: 3}
	tg := &refusingTarget{cursorTarget: newCursorTarget(), rank: bad, refuse: 10}
	const perRank = 50
	dump := func(r kvevent.Rank) ([]kvevent.Event, uint64) { return nil, perRank }
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump, MinBackoff: time.Millisecond})
	var ranks []kvevent.Rank
	for w := range uint64(8) {
		r := kvevent.Rank{Worker: w + 1}
		ranks = append(ranks, r)
		evs := make([]kvevent.Event, perRank)
		for i := range evs {
			evs[i] = kvevent.Event{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: uint64(i + 1), LocalHash: uint64(i + 1)}}}
		}
		if _, err := p.Publish(r, evs); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "every rank at its last event", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		for _, r := range ranks {
			if tg.cursor[r] != perRank {
				return false
			}
		}
		return p.Pending() == 0
	})
	tg.mu.Lock()
	if tg.dumps != 1 {
		t.Fatalf("%d dumps, want 1 (of rank %v)", tg.dumps, bad)
	}
	tg.mu.Unlock()

	// The refusals were the event's, not the requests' size: the ranks'
	// next events go in full requests again, not one at a time.
	before := val(p.m.requests)
	for _, r := range ranks {
		evs := make([]kvevent.Event, perRank)
		for i := range evs {
			evs[i] = kvevent.Event{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: uint64(perRank + i + 1), LocalHash: uint64(perRank + i + 1)}}}
		}
		if _, err := p.Publish(r, evs); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "the next events", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		for _, r := range ranks {
			if tg.cursor[r] != 2*perRank {
				return false
			}
		}
		return p.Pending() == 0
	})
	if n := val(p.m.requests) - before; n > 50 {
		t.Fatalf("%v requests for %d events of %d ranks: the requests stayed small after the bad event was given up", n, len(ranks)*perRank, len(ranks))
	}
}

// TestCloseDoesNotWaitOutARequest: a request waiting for a reply that
// does not come (a router stuck in a commit) does not hold Close back for
// its timeout, which grows to MaxRequestTimeout. From a review.
func TestCloseDoesNotWaitOutARequest(t *testing.T) {
	nc := connectNowhere(t)
	got := make(chan struct{}, 1)
	sub, err := nc.Subscribe(DefaultSubject, func(*nats.Msg) { // takes requests, answers none
		select {
		case got <- struct{}{}:
		default:
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	p, err := NewPublisher(PublisherConfig{Conn: nc, RequestTimeout: time.Hour, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish(kvevent.Rank{Worker: 1}, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-got:
	case <-time.After(30 * time.Second):
		t.Fatal("no request reached the subject")
	}
	closed := make(chan struct{})
	go func() { p.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close waits for a request's reply (timeout 1h)")
	}
	// Nothing failed and nothing is resent: a shutdown is not a retry on
	// the dashboards.
	if r := val(p.m.retries); r != 0 {
		t.Fatalf("kvagent_events_request_retries_total = %v after Close cancelled the only request", r)
	}
}

// heldCursorTarget is a cursorTarget whose first IngestEvents call waits,
// as a slow commit does, until release is closed; returned is closed once
// that call has applied.
type heldCursorTarget struct {
	*cursorTarget
	once     sync.Once
	entered  chan struct{}
	release  chan struct{}
	returned chan struct{}
}

func newHeldCursorTarget() *heldCursorTarget {
	return &heldCursorTarget{cursorTarget: newCursorTarget(),
		entered: make(chan struct{}), release: make(chan struct{}), returned: make(chan struct{})}
}

func (t *heldCursorTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	first := false
	t.once.Do(func() { first = true })
	if !first {
		return t.cursorTarget.IngestEvents(ctx, bs)
	}
	close(t.entered)
	<-t.release
	defer close(t.returned)
	return t.cursorTarget.IngestEvents(ctx, bs)
}

// tagged returns n valid stored events whose block hashes carry tag in
// their upper 32 bits.
func tagged(tag uint64, n int) []kvevent.Event {
	evs := make([]kvevent.Event, n)
	for i := range evs {
		h := tag<<32 | uint64(i+1)
		evs[i] = kvevent.Event{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: h, LocalHash: h | 1}}}
	}
	return evs
}

// appliedByTag counts the router's applied events by tagged's tag.
func appliedByTag(tg *cursorTarget) map[uint64]int {
	n := map[uint64]int{}
	for _, ev := range tg.applied {
		n[ev.Blocks[0].EngineHash>>32]++
	}
	return n
}

// TestOldIncarnationRequestDoesNotApplyOverNewIncarnation: a dead agent
// incarnation's last request is still at the leader (here a slow commit)
// when its successor's start dump, refused as stale, renumbers and dumps
// again. The request must not apply on top of the new incarnation's state,
// nor make its events duplicates. From the event-plane review: the dump
// set the cursor to the router's (50), the old request then applied ids
// 51..60, and the new incarnation's 51..60 were acknowledged as
// duplicates without being applied.
func TestOldIncarnationRequestDoesNotApplyOverNewIncarnation(t *testing.T) {
	tg := newHeldCursorTarget()
	r := kvevent.Rank{Worker: 9}
	tg.cursor[r] = 50 // an earlier incarnation's
	_, old := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{})
	if _, err := old.Publish(r, tagged(1, 60)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-tg.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the old request never reached the commit")
	}
	old.Close()
	var np *Publisher
	dump := func(r kvevent.Rank) ([]kvevent.Event, uint64) { _, last := np.Cursor(r); return nil, last }
	np, err := NewPublisher(PublisherConfig{Conn: old.cfg.Conn, Dump: dump, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { np.Close() })
	np.Resync(r)
	waitFor(t, 10*time.Second, "the new incarnation's dump", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.dumps == 1
	})
	close(tg.release)
	select {
	case <-tg.returned:
	case <-time.After(10 * time.Second):
		t.Fatal("the old request never applied")
	}
	if _, err := np.Publish(r, tagged(2, 10)); err != nil {
		t.Fatal(err)
	}
	if err := np.Flush(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	tg.mu.Lock()
	defer tg.mu.Unlock()
	if n := appliedByTag(tg.cursorTarget); n[1] != 0 || n[2] != 10 {
		t.Fatalf("after the new incarnation's dump the router applied %d events of the dead incarnation and %d of the new one's 10 (cursor %d)",
			n[1], n[2], tg.cursor[r])
	}
}

// TestNoRenumberingPastAHugeCursor: a router cursor no publisher ever set
// (past 2^63) leaves no numbering above it: the publisher keeps its ids,
// retries the dump, and never wraps them around.
func TestNoRenumberingPastAHugeCursor(t *testing.T) {
	tg := newCursorTarget()
	r := kvevent.Rank{Worker: 9}
	tg.cursor[r] = math.MaxUint64 - 10
	var p *Publisher
	var mu sync.Mutex
	calls := 0
	dump := func(r kvevent.Rank) ([]kvevent.Event, uint64) {
		mu.Lock()
		calls++
		mu.Unlock()
		_, last := p.Cursor(r)
		return nil, last
	}
	_, p = startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump})
	if _, err := p.Publish(r, tagged(1, 3)); err != nil {
		t.Fatal(err)
	}
	p.Resync(r)
	waitFor(t, 10*time.Second, "the dump to be retried", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return calls >= 3
	})
	if acked, last := p.Cursor(r); last != 3 || acked != 0 {
		t.Fatalf("after dumps refused below cursor %d: acked %d, last id %d; want the ids kept (last 3)", uint64(math.MaxUint64-10), acked, last)
	}
}

// TestOwnerThroughBetweenTwoRenumberings: two dumps in a row are refused
// as stale (the router's cursor moved past the first renumbering, here
// by a second writer), and the owner reports the third dump's through as
// an id Publish returned between the two renumberings: only the second
// renumbering moved that id, and the events published while the third
// dump is out, above it, must reach the router. From the event-plane
// review: the id was moved by both renumberings, the dump's through
// landed past those events, and they were dropped as covered by it,
// never sent.
func TestOwnerThroughBetweenTwoRenumberings(t *testing.T) {
	tg := newCursorTarget()
	r := kvevent.Rank{Worker: 9}
	tg.cursor[r] = 50 // an earlier incarnation's
	var p *Publisher
	var ownerLast uint64 // the last id Publish returned, as an owner keeps it
	calls := 0           // the publisher's loop alone calls dump
	dump := func(r kvevent.Rank) ([]kvevent.Event, uint64) {
		calls++
		through := ownerLast
		switch calls {
		case 2:
			// Published after the first renumbering; then another writer
			// moves the router's cursor past this dump.
			last, err := p.Publish(r, tagged(1, 3))
			if err != nil {
				t.Error(err)
			}
			ownerLast, through = last, last
			tg.mu.Lock()
			tg.cursor[r] = 1 << 40
			tg.mu.Unlock()
		case 3:
			// Published while the third dump is out: above its through.
			if _, err := p.Publish(r, tagged(2, 5)); err != nil {
				t.Error(err)
			}
		}
		return nil, through
	}
	_, p = startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Dump: dump})
	p.Resync(r)
	waitFor(t, 10*time.Second, "the dump after two renumberings", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.dumps == 1
	})
	if err := p.Flush(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	tg.mu.Lock()
	defer tg.mu.Unlock()
	acked, last := p.Cursor(r)
	if n := appliedByTag(tg); n[2] != 5 || calls != 3 {
		t.Fatalf("%d dumps built; after the last, the router applied %d of the 5 events published while it was out (router cursor %d, publisher's acked %d, last %d)",
			calls, n[2], tg.cursor[r], acked, last)
	}
}

// TestRenumberingsTranslateOwnersIDs: an id the owner reports moves as the
// ids it was published among did, through any number of renumberings,
// and the renumberings kept stay bounded by maxMoves, merging the oldest:
// an id from before them all still moves by every shift.
func TestRenumberingsTranslateOwnersIDs(t *testing.T) {
	b := &rankBuf{next: 1}
	publish := func() uint64 { b.next++; return b.next - 1 }
	type issued struct{ id, want uint64 }
	var ids []issued
	for i := range 3 * maxMoves {
		ids = append(ids, issued{publish(), 0})
		b.renumber(uint64(1000 + i))
	}
	// The expected translation: each id moves by the shifts of the
	// renumberings after it was published.
	for j := range ids {
		want := ids[j].id
		for i := j; i < 3*maxMoves; i++ {
			want += uint64(1000 + i)
		}
		ids[j].want = want
	}
	if len(b.moves) > maxMoves {
		t.Fatalf("%d renumberings kept, want at most %d", len(b.moves), maxMoves)
	}
	if got := translate(b.moves, ids[0].id); got != ids[0].want {
		t.Errorf("id %d from before every renumbering translated to %d, want %d", ids[0].id, got, ids[0].want)
	}
	for _, is := range ids[len(ids)-maxMoves+1:] {
		if got := translate(b.moves, is.id); got != is.want {
			t.Errorf("id %d translated to %d, want %d", is.id, got, is.want)
		}
	}
	if last := b.next - 1; translate(b.moves, last) != last {
		t.Errorf("the current numbering's id %d moved to %d", last, translate(b.moves, last))
	}
}

// TestDeadIncarnationRequestAfterAcceptedDumpAppliesNothing: a new agent
// incarnation (B) dumps a rank the router takes (here it had no state),
// and then the dead incarnation's (A) last request, which was still on its
// way (lingering, in a slow commit, pending in NATS), reaches the leader
// and commits, with ids B numbers the same. It applies nothing (its batch
// is fenced), and B's events with those ids apply, on every node. Before
// the fence, renumbering covered a refused dump only: A's events applied
// on top of B's state, and B's were acknowledged as duplicates and never
// applied (docs/events.md).
func TestDeadIncarnationRequestAfterAcceptedDumpAppliesNothing(t *testing.T) {
	c := newTestCluster(t, 3)
	l := c.leader()
	r := kvevent.Rank{Worker: 9}
	ob := newOwner(21)
	pb, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(l)), Dump: ob.dump, Incarnation: 0xb, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	ob.pub = pb
	pb.Resync(r) // an agent's start: its dump before any event
	waitFor(t, 10*time.Second, "B's dump", func() bool {
		pb.mu.Lock()
		defer pb.mu.Unlock()
		return !pb.ranks[r].needDump
	})

	// A's last request, as A's publisher encoded it: ids 1..10.
	late := tagged(1, 10)
	for i := range late {
		late[i].Rank, late[i].EventID = r, uint64(i+1)
	}
	nc := connect(t, c.url(l))
	msg, err := nc.Request(DefaultSubject, appendEvents(nil, []raftfsm.RankBatch{{Rank: r, Incarnation: 0xa, Events: late}}), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	acks, _, err := decodeReply(msg.Data)
	if err != nil {
		t.Fatal(err)
	}
	if len(acks) != 1 || acks[0].Applied != 0 || acks[0].Dups != 0 || !acks[0].Fenced || !acks[0].Resync || acks[0].Cursor != 0 {
		t.Errorf("the dead incarnation's request: acks %+v, want one that applied nothing, Fenced and Resync at cursor 0", acks)
	}

	for range 10 {
		ob.step(ctxT(t), t, r) // B's ids 1..10
	}
	checkIndexMatches(t, c, ob, pb) // B's state, every node, nothing of A's
}

// TestFencedPublisherDumpsOnceAndGoesOn: a live publisher whose rank
// another incarnation dumped since its own dump (a second agent given the
// same worker) has its next request fenced; it dumps the rank at once, once
// (not held back like the router's resync asks, and not again and again),
// which makes the rank its own, and its events, those of the fenced
// request included, then apply.
func TestFencedPublisherDumpsOnceAndGoesOn(t *testing.T) {
	c := newTestCluster(t, 1)
	c.leader()
	r := kvevent.Rank{Worker: 9}
	ctx := ctxT(t)
	o1 := newOwner(31)
	p1, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o1.dump, Incarnation: 1, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p1.Close()
	o1.pub = p1
	p1.Resync(r)
	for range 10 {
		o1.step(ctx, t, r)
	}
	waitFor(t, 10*time.Second, "the first publisher's events", func() bool { return p1.Pending() == 0 })

	// Another incarnation dumps the rank (after renumbering past the
	// cursor, since its own owner holds nothing), and goes away.
	o2 := newOwner(32)
	p2, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Dump: o2.dump, Incarnation: 2, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	p2.Resync(r)
	waitFor(t, 10*time.Second, "the other incarnation's dump", func() bool { return val(p2.m.dumps) == 1 })
	p2.Close()
	if got := c.nodes[0].FSM().Incarnation(r); got != 2 {
		t.Fatalf("the rank's incarnation is %d after the other one's dump, want 2", got)
	}

	for range 5 {
		o1.step(ctx, t, r) // fenced, then sent again after the dump
	}
	waitFor(t, 10*time.Second, "the fenced publisher's dump and events", func() bool { return p1.Pending() == 0 })
	for range 5 {
		o1.step(ctx, t, r)
	}
	checkIndexMatches(t, c, o1, p1)
	if got := c.nodes[0].FSM().Incarnation(r); got != 1 {
		t.Fatalf("the rank's incarnation is %d, want the first publisher's 1 again", got)
	}
	if fenced, dumps := val(p1.m.resends.WithLabelValues("fenced")), val(p1.m.dumps); fenced != 1 || dumps != 2 {
		t.Fatalf("%v fenced resyncs and %v dumps, want 1 and 2 (the start's and the one the fence asked for)", fenced, dumps)
	}
}
