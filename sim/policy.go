package sim

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// RouteQuery is what a policy sees of a request.
type RouteQuery struct {
	ID    string
	Local []uint64 // content hashes of the full blocks
	Seq   []uint64 // sequence hashes of the full blocks
	ISL   int      // prompt tokens
	// BlockSize is the engine's tokens per block (the replay sets it).
	BlockSize int
	// Req is the request's trace row (the replays set it): what its
	// tokens are made from (Expander.Tokens).
	Req *Request
}

// A Policy routes requests to workers 0..n-1 from what it has observed.
type Policy interface {
	// Name is the policy's report label.
	Name() string
	// Route picks the worker for q at simulated time now (unix nanos) and
	// returns the cached tokens it predicts there (0 if it does not know).
	Route(q *RouteQuery, now int64) (worker int, predictedCached int, err error)
	// Observe receives every event a worker publishes, in order.
	Observe(ev *kvevent.Event, now int64)
	// Started, PrefillDone and Finished follow a routed request's life.
	Started(q *RouteQuery, worker int, predictedCached int, now int64)
	PrefillDone(id string, now int64)
	Finished(id string, now int64)
}

// RankOf is the rank simulated worker i publishes as.
func RankOf(i int) kvevent.Rank { return kvevent.Rank{Worker: uint64(i + 1)} }

// RoundRobin sends request k to worker k mod n.
type RoundRobin struct {
	Workers int
	next    int
}

func (p *RoundRobin) Name() string { return "round_robin" }
func (p *RoundRobin) Route(*RouteQuery, int64) (int, int, error) {
	w := p.next % p.Workers
	p.next++
	return w, 0, nil
}
func (p *RoundRobin) Observe(*kvevent.Event, int64)        {}
func (p *RoundRobin) Started(*RouteQuery, int, int, int64) {}
func (p *RoundRobin) PrefillDone(string, int64)            {}
func (p *RoundRobin) Finished(string, int64)               {}

// Router is the KV-aware policy: the real index, load tracker and scorer
// of package indexer, fed by the workers' events.
type Router struct {
	Workers   int
	BlockSize int
	Params    indexer.Params
	View      indexer.View
	// CapacityBlocks per worker, for busy thresholds; 0 = unknown.
	CapacityBlocks int64
	Label          string // report name; "router" when empty
	// BookWholePrompt books every request's whole prompt as prefill load
	// (cached tokens 0) instead of the uncached part the router predicted:
	// a load term in assigned prompt tokens, for replays where nothing
	// finishes (cache-only mode), whose imbalance is measured in them.
	BookWholePrompt bool

	ix      *indexer.Index
	seqs    *indexer.Sequences
	rng     *rand.Rand
	matches indexer.Matches
	cands   []indexer.Candidate
	loads   []indexer.RankLoad
	scratch indexer.PotentialScratch
	dec     indexer.Decision
}

// NewRouter returns the KV-aware policy for n workers.
func NewRouter(n, blockSize int, params indexer.Params, seed uint64) *Router {
	return &Router{Workers: n, BlockSize: blockSize, Params: params,
		ix: indexer.New(indexer.Config{}), seqs: indexer.NewSequences(),
		rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (p *Router) Name() string {
	if p.Label != "" {
		return p.Label
	}
	return "router"
}

// Index exposes the policy's index (for reports and tests).
func (p *Router) Index() *indexer.Index { return p.ix }

func (p *Router) Route(q *RouteQuery, now int64) (int, int, error) {
	p.ix.FindMatchesByTier(q.Local, p.View, false, &p.matches)
	p.loads, _ = p.seqs.PotentialDecodeBlocks(p.loads[:0], q.Seq, &p.scratch)
	p.cands = p.cands[:0]
	distinct := int64(len(q.Seq))
	for i := 0; i < p.Workers; i++ {
		p.cands = append(p.cands, indexer.Candidate{Rank: RankOf(i), PotentialDecodeBlocks: distinct, CapacityBlocks: p.CapacityBlocks})
	}
	for _, m := range p.matches.Ranks {
		if i := int(m.Rank.Worker) - 1; i >= 0 && i < p.Workers {
			p.cands[i].Overlap = m.Blocks
		}
	}
	for _, l := range p.loads {
		if i := int(l.Rank.Worker) - 1; i >= 0 && i < p.Workers {
			p.cands[i].Load = l.Load
			p.cands[i].PotentialDecodeBlocks = l.PotentialDecodeBlocks
		}
	}
	// The router's key (raftfsm.RendezvousKey): a trace has no token ids,
	// so a prompt shorter than a block keys on its id.
	req := indexer.Request{ISL: q.ISL, BlockSize: p.BlockSize, FirstBlockHash: raftfsm.RendezvousKey(q.Local, nil, "", "", q.ID)}
	if err := indexer.Select(p.Params, req, p.cands, p.rng, &p.dec); err != nil {
		return 0, 0, fmt.Errorf("route %s: %w", q.ID, err)
	}
	c := p.dec.Chosen()
	return p.dec.Index, int(c.OverlapBlocks) * p.BlockSize, nil
}

// BlockTokens is the block size the router hashes and counts in; a replay
// refuses a router whose block size is not the engine's.
func (p *Router) BlockTokens() int { return p.BlockSize }

func (p *Router) Observe(ev *kvevent.Event, now int64) { _ = p.ix.Apply(ev, now) }

func (p *Router) Started(q *RouteQuery, worker, cached int, now int64) {
	if p.BookWholePrompt {
		cached = 0
	}
	_, _ = p.seqs.Add(q.ID, RankOf(worker), q.Seq, q.ISL, cached, now)
}
func (p *Router) PrefillDone(id string, _ int64) { p.seqs.PrefillDone(id) }
func (p *Router) Finished(id string, _ int64)    { p.seqs.Free(id) }
