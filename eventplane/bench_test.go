package eventplane

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
)

// TestBenchEventsE2E (KVROUTER_BENCH=1) measures stored blocks per second
// from publishers (the agent's eventplane.Publisher) through NATS to
// committed Raft entries on a 3-node cluster, every one acknowledged, and
// checks afterwards that every node holds every block. The ceiling, as for
// cluster.ingest, is the same events applied to a bare in-memory
// indexer.Index by one writer in the same run (median of three), timed
// after the cluster and the publishers are closed and the garbage
// collected. Also
// reported: direct_block_events_per_s, the same kind of events given to the
// leader's Node.IngestEvents directly, in large batches, by as many
// concurrent callers (Raft without NATS). Each side runs in two halves, in
// the order publishers, direct, direct, publishers, so that both apply
// into an index of the same size on average.
func TestBenchEventsE2E(t *testing.T) {
	benchenv.Skip(t, "bench-eventplane")
	const (
		pubs        = 4
		ranksPerPub = 4
		blocksPerEv = 4
		batch       = 512 // events per direct call
	)
	eventsPerRank := uint64(benchenv.Int("KVROUTER_BENCH_EVENTS_PER_RANK", 20000))
	// The workers are not registered: a long run must not see their ranks
	// removed (IngesterConfig.UnregisteredGrace).
	c := newTestClusterWith(t, 3, IngesterConfig{UnregisteredGrace: time.Hour})
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

	// Direct calls on the leader (workers 100+), events from..to of each
	// rank.
	var wg sync.WaitGroup
	directPhase := func(from, to uint64) time.Duration {
		benchenv.Settle()
		start := time.Now()
		for g := range pubs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for r := range ranksPerPub {
					rank := kvevent.Rank{Worker: uint64(100 + g), DP: uint32(r)}
					for first := from; first <= to; first += batch {
						evs := make([]kvevent.Event, 0, batch)
						for id := first; id < first+batch && id <= to; id++ {
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
		return time.Since(start)
	}

	// Publishers (workers 1+), each on its own connection to a
	// follower's server, events from..to of each rank; the phase ends
	// when every publisher has had every batch acknowledged.
	f := (l + 1) % 3
	ps := make([]*Publisher, pubs)
	conns := make([]*nats.Conn, pubs)
	for g := range ps {
		conns[g] = connect(t, c.url(f))
		p, err := NewPublisher(PublisherConfig{Conn: conns[g], Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		ps[g] = p
	}
	publishPhase := func(from, to uint64) time.Duration {
		benchenv.Settle()
		start := time.Now()
		for g, p := range ps {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx := ctxT(t)
				for id := from; id <= to; id++ {
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
		return time.Since(start)
	}

	// Each side's events in two halves, in the order publishers, direct,
	// direct, publishers (benchenv.ABBA's reason): the index grows through
	// all four, and run one after the other the second side would always
	// apply into the larger index and the fuller heap.
	half := eventsPerRank / 2
	pubTime := publishPhase(1, half)
	directTime := directPhase(1, half)
	directTime += directPhase(half+1, eventsPerRank)
	pubTime += publishPhase(half+1, eventsPerRank)
	if t.Failed() {
		t.FailNow()
	}
	direct := total / directTime.Seconds()
	ours := total / pubTime.Seconds()
	var entries float64
	for _, in := range c.ings {
		entries += val(in.m.entries)
	}
	// Nothing lost, nothing doubled: every node holds both phases' blocks.
	for i, n := range c.nodes {
		waitFor(t, 60*time.Second, fmt.Sprintf("node %d to hold every block", i), func() bool {
			return n.IndexStats().Entries == int64(2*total)
		})
	}

	// Then everything stops, publishers (whose connections would retry the
	// closed servers) and cluster, and the garbage is collected, so that
	// neither the nodes' background work (heartbeats, compactions) nor
	// their heap is in the ceiling's timing, as for cluster.ingest.
	for g, p := range ps {
		p.Close()
		conns[g].Close()
	}
	c.close()
	benchenv.Settle()

	// Ceiling: the publishers' events into a bare index, one writer.
	var evs []kvevent.Event // made before the clock starts
	for g := range pubs {
		for r := range ranksPerPub {
			rank := kvevent.Rank{Worker: uint64(1 + g), DP: uint32(r)}
			for id := uint64(1); id <= eventsPerRank; id++ {
				evs = append(evs, mk(rank, id))
			}
		}
	}
	var ceilings []float64
	for rep := 0; rep < 3; rep++ {
		ix := indexer.New(indexer.Config{})
		cstart := time.Now()
		for i := range evs {
			_ = ix.Apply(&evs[i], 1)
		}
		ceilings = append(ceilings, total/time.Since(cstart).Seconds())
		if got := ix.Stats().Entries; got != int64(total) {
			t.Fatalf("bare index holds %d entries, want %.0f", got, total)
		}
	}
	slices.Sort(ceilings)
	ceiling := ceilings[1]
	fmt.Printf("BENCH events.e2e block_events_per_s=%.3g ceiling_block_events_per_s=%.3g ratio=%.3f direct_block_events_per_s=%.3g direct_ratio=%.2f nodes=3 publishers=%d ranks=%d blocks_per_event=%d block_events=%.0f entries=%.0f\n",
		ours, ceiling, ours/ceiling, direct, ours/direct, pubs, pubs*ranksPerPub, blocksPerEv, total, entries)
}
