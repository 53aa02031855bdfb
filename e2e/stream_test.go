package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// The ranks the tests publish for: two workers of two data-parallel ranks.
var testRanks = []kvevent.Rank{{Worker: 1, DP: 0}, {Worker: 1, DP: 1}, {Worker: 2, DP: 0}, {Worker: 2, DP: 1}}

// testSeed returns the seed of a test's event streams and logs it with
// the command that replays them.
func testSeed(t *testing.T) uint64 {
	t.Helper()
	s := seedOf()
	t.Logf("seed %d (go test ./e2e/ -run '^%s$' -seed %d replays the event streams)", s, t.Name(), s)
	return s
}

// seedOf returns the seed of a test's event streams, -seed's or a new
// one, unlogged: for a test whose replay command needs more than the seed
// (the chaos soak's environment), which logs its own.
func seedOf() uint64 {
	if s := *seedFlag; s != 0 {
		return s
	}
	return uint64(time.Now().UnixNano())
}

// rankGen generates one rank's event stream as an inference engine
// publishes it: Stored chains that start a new prefix or extend one,
// Removed events that drop a chain's tail, rarely a Cleared (which would
// hide a lost event from the model check), with consecutive event ids
// from 1.
//
// Every block gets an engine hash of its own across all ranks (the rank is
// in the high bits) and a content hash derived from it, and only tails are
// removed. So no two blocks share a tree node, every held block's parent is
// held, and the index's node count equals its entry count: the model needs
// no tree of its own.
type rankGen struct {
	rank   kvevent.Rank
	rng    *rand.Rand
	nextID uint64 // the next event id
	hashes uint64 // engine hashes handed out
	chains []genChain
}

type genChain struct {
	tier   kvevent.Tier
	hashes []uint64 // engine hashes, root first
}

func newRankGen(seed uint64, r kvevent.Rank) *rankGen {
	return &rankGen{rank: r, rng: rand.New(rand.NewPCG(seed, r.Worker<<32|uint64(r.DP))), nextID: 1}
}

func (g *rankGen) hash() uint64 {
	g.hashes++
	return g.rank.Worker<<48 | uint64(g.rank.DP)<<40 | g.hashes
}

func localHash(engineHash uint64) uint64 { return engineHash ^ 0x5bd1e9955bd1e995 }

// next returns the rank's next event.
func (g *rankGen) next() kvevent.Event {
	ev := kvevent.Event{Rank: g.rank, EventID: g.nextID}
	g.nextID++
	switch p := g.rng.IntN(100); {
	case p < 1 && len(g.chains) > 0:
		ev.Kind, ev.Tier = kvevent.KindCleared, kvevent.TierDevice
		g.chains = nil
	case p < 28 && len(g.chains) > 0:
		ci := g.rng.IntN(len(g.chains))
		ch := &g.chains[ci]
		k := 1 + g.rng.IntN(min(3, len(ch.hashes)))
		ev.Kind, ev.Tier = kvevent.KindRemoved, ch.tier
		for j := range k {
			ev.Removed = append(ev.Removed, ch.hashes[len(ch.hashes)-1-j]) // leaf first, as engines evict
		}
		ch.hashes = ch.hashes[:len(ch.hashes)-k]
		if len(ch.hashes) == 0 {
			g.chains = slices.Delete(g.chains, ci, ci+1)
		}
	default:
		var ch *genChain
		if len(g.chains) == 0 || len(g.chains) < 6 && g.rng.IntN(3) == 0 {
			tier := kvevent.TierDevice
			if g.rng.IntN(10) < 3 {
				tier = kvevent.TierHostPinned
			}
			g.chains = append(g.chains, genChain{tier: tier})
			ch = &g.chains[len(g.chains)-1]
		} else {
			ch = &g.chains[g.rng.IntN(len(g.chains))]
		}
		ev.Kind, ev.Tier = kvevent.KindStored, ch.tier
		if len(ch.hashes) > 0 {
			ev.HasParent, ev.Parent = true, ch.hashes[len(ch.hashes)-1]
		}
		for range 1 + g.rng.IntN(4) {
			h := g.hash()
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: localHash(h)})
			ch.hashes = append(ch.hashes, h)
		}
	}
	return ev
}

// model is what the cluster must hold after the acknowledged events: per
// registered rank, its cursor and which blocks it holds, where.
type model struct {
	ranks map[kvevent.Rank]*rankModel
}

type rankModel struct {
	cursor uint64
	held   map[uint64]heldBlock // by engine hash
	// needsResync: an operator's restore (kvctl snapshot restore, online
	// or seeded) installed the state, which flags every rank it holds as
	// needing a resync until the rank is dumped (docs/events.md) or
	// cleared (a clear leaves nothing to resync); this model's publisher
	// sends no dumps, so only its clears take the flag off.
	needsResync bool
}

// restored is an operator's restore of the state the model holds: every
// rank flagged as needing a resync.
func (m *model) restored() {
	for _, rm := range m.ranks {
		rm.needsResync = true
	}
}

// flaggedRanks returns how many ranks the model holds flagged as needing
// a resync.
func (m *model) flaggedRanks() int {
	n := 0
	for _, rm := range m.ranks {
		if rm.needsResync {
			n++
		}
	}
	return n
}

type heldBlock struct {
	tier   kvevent.Tier
	parent uint64 // the parent's engine hash; 0 at the root
	local  uint64 // content hash
}

func newModel(ranks ...kvevent.Rank) *model {
	m := &model{ranks: map[kvevent.Rank]*rankModel{}}
	for _, r := range ranks {
		m.ranks[r] = &rankModel{held: map[uint64]heldBlock{}}
	}
	return m
}

// apply adds acknowledged batches. Like the cluster's cursor, it skips
// events at or below a rank's cursor, so an old batch acknowledged again
// changes nothing.
func (m *model) apply(batches []raftfsm.RankBatch) {
	for _, b := range batches {
		rm := m.ranks[b.Rank]
		for _, ev := range b.Events {
			if ev.EventID <= rm.cursor {
				continue
			}
			rm.cursor = ev.EventID
			switch ev.Kind {
			case kvevent.KindStored:
				var parent uint64
				if ev.HasParent {
					parent = ev.Parent
				}
				for _, bl := range ev.Blocks {
					rm.held[bl.EngineHash] = heldBlock{tier: ev.Tier, parent: parent, local: bl.LocalHash}
					parent = bl.EngineHash
				}
			case kvevent.KindRemoved:
				for _, h := range ev.Removed {
					delete(rm.held, h)
				}
			case kvevent.KindCleared:
				clear(rm.held)
				rm.needsResync = false
			}
		}
	}
}

// prefixes returns, for every held block that no held block descends
// from, the content hashes from the root down to it, and the tier the
// chain is in: the prompts whose whole prefix the rank holds.
func (rm *rankModel) prefixes() (out [][]uint64, tiers []kvevent.Tier) {
	parents := map[uint64]bool{}
	for _, b := range rm.held {
		parents[b.parent] = true
	}
	var leaves []uint64
	for h := range rm.held {
		if !parents[h] {
			leaves = append(leaves, h)
		}
	}
	slices.Sort(leaves)
	for _, h := range leaves {
		var chain []uint64
		for at := h; at != 0; at = rm.held[at].parent {
			chain = append(chain, rm.held[at].local)
		}
		slices.Reverse(chain)
		out = append(out, chain)
		tiers = append(tiers, rm.held[h].tier)
	}
	return out, tiers
}

// merge adds the ranks of o, which m does not have.
func (m *model) merge(o *model) {
	for r, rm := range o.ranks {
		m.ranks[r] = rm
	}
}

func (rm *rankModel) blocks() [kvevent.NumTiers]int64 {
	var out [kvevent.NumTiers]int64
	for _, b := range rm.held {
		out[b.tier]++
	}
	return out
}

func (m *model) blocks() [kvevent.NumTiers]int64 {
	var out [kvevent.NumTiers]int64
	for _, rm := range m.ranks {
		for t, n := range rm.blocks() {
			out[t] += n
		}
	}
	return out
}

func (m *model) entries() int64 {
	var n int64
	for _, rm := range m.ranks {
		n += int64(len(rm.held))
	}
	return n
}

// checkStats compares an answer of GET /v1/index/stats with the model.
func (m *model) checkStats(st *api.IndexStats) error {
	want := m.blocks()
	switch {
	case st.Entries != m.entries():
		return fmt.Errorf("index holds %d entries, the acknowledged events %d", st.Entries, m.entries())
	case st.Blocks.Array() != want:
		return fmt.Errorf("index holds %v blocks per tier, the acknowledged events %v", st.Blocks.Array(), want)
	case st.Nodes != m.entries():
		return fmt.Errorf("index has %d tree nodes, want %d (one per held block)", st.Nodes, m.entries())
	case st.OrphanEvents != 0:
		return fmt.Errorf("index holds %d orphan events, want none", st.OrphanEvents)
	case st.NeedResync != m.flaggedRanks():
		return fmt.Errorf("index holds %d ranks needing a resync, want %d (every rank an operator's restore held, less those cleared since)", st.NeedResync, m.flaggedRanks())
	}
	return nil
}

// checkWorkers compares an answer of GET /v1/workers with the model: the
// same ranks registered, and each rank's cursor (last_event_id) equal to
// its last acknowledged event id, with the model's blocks per tier.
func (m *model) checkWorkers(ws []api.Worker) error {
	seen := 0
	for _, w := range ws {
		for _, ri := range w.Ranks {
			r := kvevent.Rank{Worker: w.WorkerID, DP: ri.DPRank}
			rm, ok := m.ranks[r]
			if !ok {
				return fmt.Errorf("rank %v is registered; the model has no such rank", r)
			}
			seen++
			if ri.LastEventID != rm.cursor {
				return fmt.Errorf("rank %v: cursor (last_event_id) %d, last acknowledged event id %d", r, ri.LastEventID, rm.cursor)
			}
			if got, want := ri.Blocks.Array(), rm.blocks(); got != want {
				return fmt.Errorf("rank %v: blocks per tier %v, the acknowledged events %v", r, got, want)
			}
			if ri.NeedsResync != rm.needsResync {
				return fmt.Errorf("rank %v: needs a resync %v, want %v (flagged by an operator's restore, and only by one, until a clear)", r, ri.NeedsResync, rm.needsResync)
			}
		}
	}
	if seen != len(m.ranks) {
		return fmt.Errorf("%d ranks registered, the model has %d", seen, len(m.ranks))
	}
	return nil
}

// checkRoutes asks node cl, for every prefix some rank holds whole in the
// model, for a route decision (nothing booked), and compares each
// candidate's overlap with the model: the holder matches the whole prefix,
// every other rank nothing (no two ranks share a block). This checks what
// the index holds, not only how much. The cluster scores in the default
// dedup view, which reports a match in any tier as device blocks
// (semantics.md §4).
func (m *model) checkRoutes(ctx context.Context, cl *client.Client) error {
	for r, rm := range m.ranks {
		prefixes, tiers := rm.prefixes()
		for k, prefix := range prefixes {
			res, err := cl.Route(ctx, api.RouteRequest{BlockHashes: prefix})
			if err != nil {
				return fmt.Errorf("route a prefix of rank %v: %w", r, err)
			}
			found := false
			for _, cand := range res.Candidates {
				var want [kvevent.NumTiers]int64
				if cand.WorkerID == r.Worker && cand.DPRank == r.DP {
					want[kvevent.TierDevice] = int64(len(prefix))
					found = true
				}
				if got := cand.Overlap.Array(); got != want {
					return fmt.Errorf("a prefix of %d blocks that rank %v holds in tier %v: rank %d/%d overlaps %v, want %v",
						len(prefix), r, tiers[k], cand.WorkerID, cand.DPRank, got, want)
				}
			}
			if !found {
				return fmt.Errorf("rank %v is not a route candidate", r)
			}
		}
	}
	return nil
}

// publisher streams requests of event batches for its ranks, one request
// at a time, and keeps the model of what the cluster acknowledged.
type publisher struct {
	gens    []*rankGen
	model   *model
	acked   [][]raftfsm.RankBatch // every acknowledged request, in order
	retries int                   // requests sent again after an error
	dups    int                   // events the cluster acknowledged as duplicates
	refused map[int]int           // publishAny's refusals (isRefusal) by node index
}

// totals sums the publishers' retried requests and the events the
// cluster acknowledged as duplicates, for a test's log.
func totals(pubs []*publisher) (retries, dups int) {
	for _, p := range pubs {
		retries += p.retries
		dups += p.dups
	}
	return retries, dups
}

func newPublisher(seed uint64, ranks ...kvevent.Rank) *publisher {
	p := &publisher{model: newModel(ranks...)}
	for _, r := range ranks {
		p.gens = append(p.gens, newRankGen(seed, r))
	}
	return p
}

// request returns the next request: one batch of 1 to 3 new events per rank.
func (p *publisher) request() []raftfsm.RankBatch {
	var req []raftfsm.RankBatch
	for _, g := range p.gens {
		b := raftfsm.RankBatch{Rank: g.rank}
		for range 1 + g.rng.IntN(3) {
			b.Events = append(b.Events, g.next())
		}
		req = append(req, b)
	}
	return req
}

// publishNext publishes the next request until it is acknowledged, checks
// the acknowledgement, adds the request to the model and returns the acks.
func (p *publisher) publishNext(ctx context.Context, cl *client.Client) ([]raftfsm.RankAck, error) {
	req := p.request()
	acks, tries, err := publish(ctx, cl, req)
	if err != nil {
		return nil, err
	}
	if err := checkAcks(req, acks); err != nil {
		return nil, err
	}
	p.model.apply(req)
	p.acked = append(p.acked, req)
	p.retries += tries - 1
	for _, a := range acks {
		p.dups += a.Dups
	}
	return acks, nil
}

// publishN publishes n requests.
func (p *publisher) publishN(ctx context.Context, cl *client.Client, n int) error {
	for range n {
		if _, err := p.publishNext(ctx, cl); err != nil {
			return err
		}
	}
	return nil
}

// checkAcks checks that every batch of a request was applied or found
// applied already, with no gap, and that the rank's cursor is the batch's
// last event id.
func checkAcks(req []raftfsm.RankBatch, acks []raftfsm.RankAck) error {
	if len(acks) != len(req) {
		return fmt.Errorf("%d acks for %d batches", len(acks), len(req))
	}
	for i, a := range acks {
		b := req[i]
		last := b.Events[len(b.Events)-1].EventID
		if a.Rank != b.Rank || a.Gap || a.Cursor != last || a.Applied+a.Dups != len(b.Events) {
			return fmt.Errorf("batch %d of rank %v (event ids %d..%d) acknowledged as %+v (rank %v)",
				i, b.Rank, b.Events[0].EventID, last, a, a.Rank)
		}
	}
	return nil
}

// publish sends one request until the cluster acknowledges it, as a
// publisher does across a failover: after an error it sends the same
// batches again, with the same event ids, and whatever part of them had
// applied before the error comes back as duplicates. It returns the acks
// and how many times it sent the request.
func publish(ctx context.Context, cl *client.Client, req []raftfsm.RankBatch) ([]raftfsm.RankAck, int, error) {
	var acks []raftfsm.RankAck
	tries, err := retry(ctx, func(ctx context.Context) error {
		var err error
		acks, err = cl.IngestEvents(ctx, req)
		return err
	})
	return acks, tries, err
}

// retry calls f until it succeeds, and returns how many calls it took. Every
// kvrouter command is safe to retry; only a refusal of the request itself
// (invalid) is final. Each call gets a few seconds: a call to a node that
// died under it must not hold the whole test.
func retry(ctx context.Context, f func(ctx context.Context) error) (int, error) {
	for tries := 1; ; tries++ {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := f(cctx)
		cancel()
		if err == nil {
			return tries, nil
		}
		if errors.Is(err, raftfsm.ErrInvalid) {
			return tries, err
		}
		select {
		case <-ctx.Done():
			return tries, fmt.Errorf("no success after %d tries: %w (last error: %v)", tries, ctx.Err(), err)
		case <-time.After(25 * time.Millisecond): // a retry's pace, not a wait for a condition
		}
	}
}

// registeredPublishers returns two publishers of seed over testRanks
// (two ranks each), and the extra ones given, and the model of them all,
// their workers registered through cl.
func registeredPublishers(t *testing.T, cl *client.Client, seed uint64, extra ...*publisher) ([]*publisher, *model) {
	t.Helper()
	pubs := []*publisher{
		newPublisher(seed, testRanks[0], testRanks[1]),
		newPublisher(seed, testRanks[2], testRanks[3]),
	}
	all := newModel()
	for _, p := range append(slices.Clone(pubs), extra...) {
		all.merge(p.model)
	}
	registerWorkers(t, cl, all)
	return pubs, all
}

// registerWorkers registers the workers of the model's ranks (block size
// 16, capacity unknown), retrying like a publisher.
func registerWorkers(t *testing.T, cl *client.Client, m *model) {
	t.Helper()
	dp := map[uint64][]uint32{}
	for r := range m.ranks {
		dp[r.Worker] = append(dp[r.Worker], r.DP)
	}
	for id, ranks := range dp {
		slices.Sort(ranks)
		w := raftfsm.WorkerInfo{ID: id, DPRanks: ranks, BlockSize: 16, Model: "e2e-model", Endpoint: fmt.Sprintf("worker-%d:8000", id)}
		if _, err := retry(ctxT(t, 30*time.Second), func(ctx context.Context) error { return cl.RegisterWorker(ctx, w) }); err != nil {
			t.Fatalf("register worker %d: %v", id, err)
		}
	}
}

// checkNode compares what node i holds with the model: the index's
// figures (GET /v1/index/stats), every rank's cursor and blocks
// (GET /v1/workers), and the overlap of every held prefix (POST /v1/route).
func (c *cluster) checkNode(i int, m *model) {
	c.t.Helper()
	n := c.nodes[i]
	ctx := ctxT(c.t, 10*time.Second)
	st, err := n.cl.IndexStats(ctx)
	if err != nil {
		c.t.Fatalf("%s: index stats: %v", n.id, err)
	}
	if err := m.checkStats(st); err != nil {
		c.t.Fatalf("%s: %v", n.id, err)
	}
	ws, err := n.cl.Workers(ctx)
	if err != nil {
		c.t.Fatalf("%s: workers: %v", n.id, err)
	}
	if err := m.checkWorkers(ws); err != nil {
		c.t.Fatalf("%s: %v", n.id, err)
	}
	if err := m.checkRoutes(ctx, n.cl); err != nil {
		c.t.Fatalf("%s: %v", n.id, err)
	}
}

// checkAll checks every serving node against the model.
func (c *cluster) checkAll(m *model) {
	c.t.Helper()
	for i, n := range c.nodes {
		if n.serving() {
			c.checkNode(i, m)
		}
	}
}

// appliedOnce checks that every serving node's state machine applied each
// event the model acknowledged once: its count of events applied
// (kvrouter_events_applied_total{outcome="applied"}) is the number of
// acknowledged events (ackedEvents). The count is since the node started,
// so only a node that has run since the cluster started, and never
// restored a snapshot, can be checked.
func (c *cluster) appliedOnce(m *model) {
	c.t.Helper()
	var idx []int
	for i, n := range c.nodes {
		if n.serving() {
			idx = append(idx, i)
		}
	}
	c.appliedOnceAt(m, idx)
}

// appliedOnceAt is appliedOnce for the nodes at idx alone: the caller
// picks the ones whose count can hold (running since the cluster started,
// no snapshot restored).
func (c *cluster) appliedOnceAt(m *model, idx []int) {
	c.t.Helper()
	events := ackedEvents(m)
	for _, i := range idx {
		n := c.nodes[i]
		got := scrape(c.t, "http://"+n.httpAddr+"/metrics").sum("kvrouter_events_applied_total", "outcome", "applied")
		if got != float64(events) {
			c.t.Fatalf("%s applied %v events; %d were acknowledged, each to be applied once", n.id, got, events)
		}
	}
}

// ackedEvents is how many events m acknowledged: they run from id 1 to
// each rank's cursor.
func ackedEvents(m *model) int64 {
	var n int64
	for _, rm := range m.ranks {
		n += int64(rm.cursor)
	}
	return n
}

// indexState is an index stats answer without the counters, which count
// since the node started: what a restart or a restore must keep.
func indexState(st *api.IndexStats) api.IndexStats {
	s := *st
	s.Counters = api.IndexCounters{}
	s.HeapBytes = 0   // the process's, not the state's
	s.MemoryBytes = 0 // depends on how the index was built (a load sizes its maps once)
	return s
}
