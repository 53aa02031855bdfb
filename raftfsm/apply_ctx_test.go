package raftfsm

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestApplyUnderADoneContextProposesNothing: from a review. Node.apply
// refused only a context whose deadline had passed; under one cancelled
// without a deadline it proposed the command anyway and answered
// context.Canceled once the wait gave up, so the command committed behind
// its caller's back. The agentless mode's subscriber, stopped mid-stream
// (Agentless.Close, a restart of its subscriber), took that answer for a
// refused batch and proposed a clear of the rank under the same cancelled
// context, which committed: the rank's blocks were gone. Now a context
// already done proposes nothing, and the error says which (the API answers
// a cancelled request as it did: canceled).
func TestApplyUnderADoneContextProposesNothing(t *testing.T) {
	// No expiry sweep or digest check of the leader's own: either
	// appends an entry, and the test reads the log's growth as a proposal.
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	r := kvevent.Rank{Worker: 1}
	batch := func() []RankBatch {
		return []RankBatch{{Rank: r, Events: []kvevent.Event{{EventID: 1, Kind: kvevent.KindCleared}}}}
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		want error
	}{{"cancelled", cancelled, context.Canceled}, {"past its deadline", expired, context.DeadlineExceeded}} {
		last := n.raft.LastIndex()
		if _, err := n.IngestEvents(tc.ctx, batch()); !errors.Is(err, tc.want) || !errors.Is(err, ErrNotProposed) {
			t.Fatalf("a context %s: err %v, want %v and ErrNotProposed", tc.name, err, tc.want)
		}
		if got := n.raft.LastIndex(); got != last {
			t.Fatalf("a context %s: the log grew from %d to %d: the command was proposed", tc.name, last, got)
		}
	}
	// The same batch under a live context is the rank's first: had either
	// been proposed, it would be a duplicate.
	acks, err := n.IngestEvents(ctx(t), batch())
	if err != nil {
		t.Fatal(err)
	}
	if len(acks) != 1 || acks[0].Applied != 1 || acks[0].Dups != 0 {
		t.Fatalf("acks %+v, want the event applied: a batch under a done context was committed", acks)
	}
}
