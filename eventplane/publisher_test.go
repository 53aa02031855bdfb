package eventplane

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// rateWindow is how long the backoff tests watch a publisher's requests.
// It measures a rate, so it is a fixed window, not a wait for a condition:
// with MinBackoff 5ms doubling to MaxBackoff 500ms, a backed-off rank
// sends about 8 requests in it; one that spins sends hundreds.
const rateWindow = time.Second

// TestPublisherBacksOffAnUnregisteredRank: the state machine refuses a
// batch for a rank its Positional worker does not list (RankAck.Unregistered:
// nothing applied, cursor 0). The publisher must back off that rank (one
// Raft entry per try), count and keep its events, and send them once the
// worker lists the rank. It used to take the refusal for a plain ack and
// resend at once, for ever: ~470 requests and Raft entries a second.
func TestPublisherBacksOffAnUnregisteredRank(t *testing.T) {
	c := newTestCluster(t, 1)
	node := c.nodes[c.leader()]
	ctx := ctxT(t)
	if err := node.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 5, BlockSize: 16, DPRanks: []uint32{0}, Positional: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "ingesting", func() bool { return ingesting(c.ings[0]) })
	p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(0)), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 5, DP: 1}
	if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the first refusal", func() bool { return val(p.m.unregistered) > 0 })
	start, reqs := node.Raft().LastIndex(), val(p.m.requests)
	time.Sleep(rateWindow)
	reqs = val(p.m.requests) - reqs
	entries := node.Raft().LastIndex() - start
	t.Logf("in %v: %v requests, %d Raft entries, %v refusals, pending %d", rateWindow, reqs, entries, val(p.m.unregistered), p.Pending())
	if reqs > 20 || entries > 20 {
		t.Fatalf("a rank the router refuses was sent %v times in %v (%d Raft entries): no backoff", reqs, rateWindow, entries)
	}
	if p.Pending() != 1 {
		t.Fatalf("pending %d, want the refused event kept", p.Pending())
	}
	// The worker lists the rank: the kept event goes through.
	if err := node.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 5, BlockSize: 16, DPRanks: []uint32{0, 1}, Positional: true}); err != nil {
		t.Fatal(err)
	}
	fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := p.Flush(fctx); err != nil {
		t.Fatalf("flush after the rank was registered: %v", err)
	}
}

// ackNothingTarget is a router of an earlier build for one rank: it answers
// the rank's batches with an ack that moves nothing (cursor 0, nothing
// applied, no flag), as it answered an unregistered rank. The other ranks
// it keeps as cursorTarget does.
type ackNothingTarget struct {
	*cursorTarget
	rank kvevent.Rank
}

func (t ackNothingTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	acks, err := t.cursorTarget.IngestEvents(ctx, bs)
	for i := range acks {
		if acks[i].Rank == t.rank {
			acks[i] = raftfsm.RankAck{Rank: t.rank}
		}
	}
	return acks, err
}

// TestPublisherBacksOffAnAckThatMovesNothing: an ack that trims nothing,
// reports no gap and asks for no dump is no progress, whatever the reason
// (a router of an earlier build refusing an unregistered rank): the
// publisher backs off and counts a retry rather than resend at once.
func TestPublisherBacksOffAnAckThatMovesNothing(t *testing.T) {
	r := kvevent.Rank{Worker: 9, DP: 3}
	_, p := startPlaneWith(t, ackNothingTarget{newCursorTarget(), r}, IngesterConfig{}, PublisherConfig{})
	if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the first retry", func() bool { return val(p.m.retries) > 0 })
	reqs := val(p.m.requests)
	time.Sleep(rateWindow)
	reqs = val(p.m.requests) - reqs
	t.Logf("in %v: %v requests, %v retries", rateWindow, reqs, val(p.m.retries))
	if reqs > 20 {
		t.Fatalf("an ack that moved nothing was answered by %v resends in %v: no backoff", reqs, rateWindow)
	}
	// The other ranks are not held back.
	other := kvevent.Rank{Worker: 9}
	if _, err := p.Publish(other, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the other rank's ack", func() bool { a, _ := p.Cursor(other); return a == 1 })
}

// closeConcurrently calls close from n goroutines at once and fails t if
// any Close fails, or returns before the close is done (done reports it): a
// second Close waits for the first.
func closeConcurrently(t *testing.T, n int, closeFn func() error, done func() bool) {
	t.Helper()
	start := make(chan struct{})
	errs := make(chan error, n)
	for range n {
		go func() {
			<-start
			err := closeFn()
			if err == nil && !done() {
				err = errors.New("Close returned before the close was done")
			}
			errs <- err
		}()
	}
	close(start)
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

// TestConcurrentClose: Publisher.Close and Ingester.Close may be called
// from several goroutines at once (a signal handler and a deferred close,
// say). They checked their stop channel and then closed it, unlocked: two
// Closes could both close it, and panic.
func TestConcurrentClose(t *testing.T) {
	nc := connectNowhere(t)
	for range 50 {
		p, err := NewPublisher(PublisherConfig{Conn: nc, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		closeConcurrently(t, 8, p.Close, func() bool {
			select {
			case <-p.done:
				return true
			default:
				return false
			}
		})
		in, err := NewIngester(IngesterConfig{Conn: nc, Node: newCursorTarget(), Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		closeConcurrently(t, 8, in.Close, func() bool { return in.ctx.Err() != nil })
	}
}
