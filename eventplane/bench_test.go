package eventplane

import (
	"errors"
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestBenchEventsE2E (KVROUTER_BENCH=1) measures stored blocks per second
// from publishers through NATS to committed Raft entries on a 3-node
// cluster, against a ceiling measured in the same run: the same kind of
// events given to the leader's Node.IngestEvents directly, in large
// batches, by as many concurrent callers.
func TestBenchEventsE2E(t *testing.T) {
	benchenv.Skip(t, "bench-eventplane")
	const (
		pubs          = 4
		ranksPerPub   = 4
		eventsPerRank = 5000
		blocksPerEv   = 4
		batch         = 512 // events per direct call (the ceiling)
	)
	c := newTestCluster(t, 3)
	l := c.leader()
	mk := func(r kvevent.Rank, id uint64) kvevent.Event {
		ev := kvevent.Event{Rank: r, EventID: id, Kind: kvevent.KindStored, Tier: kvevent.TierDevice}
		for b := range uint64(blocksPerEv) {
			h := (r.Worker<<40 | uint64(r.DP)<<32 | id) * blocksPerEv
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h + b, LocalHash: (h+b)*0x9e3779b97f4a7c15 | 1})
		}
		return ev
	}
	total := float64(pubs * ranksPerPub * eventsPerRank * blocksPerEv)

	// Ceiling: direct calls on the leader, workers 100+.
	start := time.Now()
	var wg sync.WaitGroup
	for g := range pubs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range ranksPerPub {
				rank := kvevent.Rank{Worker: uint64(100 + g), DP: uint32(r)}
				for first := uint64(1); first <= eventsPerRank; first += batch {
					evs := make([]kvevent.Event, 0, batch)
					for id := first; id < first+batch && id <= eventsPerRank; id++ {
						evs = append(evs, mk(rank, id))
					}
					for {
						_, err := c.nodes[c.leader()].IngestEvents(ctxT(t), []raftfsm.RankBatch{{Rank: rank, Events: evs}})
						if err == nil {
							break
						}
						if !errors.Is(err, raftfsm.ErrNotLeader) && !errors.Is(err, raftfsm.ErrNoLeader) {
							t.Error(err)
							return
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	ceiling := total / time.Since(start).Seconds()

	// Publishers, each on its own connection to a follower's server.
	f := (l + 1) % 3
	ps := make([]*Publisher, pubs)
	for g := range ps {
		p, err := NewPublisher(PublisherConfig{Conn: connect(t, c.url(f)), Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		ps[g] = p
	}
	start = time.Now()
	for g, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := ctxT(t)
			for id := uint64(1); id <= eventsPerRank; id++ {
				for r := range ranksPerPub {
					rank := kvevent.Rank{Worker: uint64(1 + g), DP: uint32(r)}
					if _, err := p.PublishWait(ctx, rank, []kvevent.Event{mk(rank, id)}); err != nil {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	for _, p := range ps {
		waitFor(t, 60*time.Second, "publishers to drain", func() bool { return p.Pending() == 0 })
	}
	ours := total / time.Since(start).Seconds()
	var entries float64
	for _, in := range c.ings {
		entries += val(in.m.entries)
	}
	fmt.Printf("BENCH events.e2e block_events_per_s=%.3g ceiling_block_events_per_s=%.3g ratio=%.2f nodes=3 publishers=%d ranks=%d blocks_per_event=%d entries=%.0f\n",
		ours, ceiling, ours/ceiling, pubs, pubs*ranksPerPub, blocksPerEv, entries)
}
