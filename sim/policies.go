package sim

import (
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// The policies compared in one replay (simulator.md, "Trace replay"). Each
// sees only what a router would: the workers' events, and the lifecycle of
// the requests it routed.

// PolicyNames lists the routing policies NewPolicy builds, in report order.
// "ceiling" is not a policy: it is the hit rate of one infinite shared
// cache (Ceiling, CacheCeiling).
var PolicyNames = []string{"router", "round_robin", "random", "least_loaded", "longest_prefix", "greedy_balanced"}

// PolicyConfig is what NewPolicy needs to build a policy.
type PolicyConfig struct {
	Workers   int
	BlockSize int // the engine's block size: the router hashes and counts in it
	// CapacityBlocks per worker, for the router's busy thresholds; 0 = unknown.
	CapacityBlocks int64
	Seed           uint64
	// RouterParams are the router's scoring weights; the zero value means
	// indexer.DefaultParams(). least_loaded takes them with every overlap
	// credit set to 0.
	RouterParams *indexer.Params
	// Balance is greedy_balanced's tolerance over the mean assigned load;
	// 0 means 0.05.
	Balance float64
}

// NewPolicy builds the named policy (one of PolicyNames).
func NewPolicy(name string, cfg PolicyConfig) (Policy, error) {
	params := indexer.DefaultParams()
	if cfg.RouterParams != nil {
		params = *cfg.RouterParams
	}
	switch name {
	case "router":
		r := NewRouter(cfg.Workers, cfg.BlockSize, params, cfg.Seed)
		r.CapacityBlocks = cfg.CapacityBlocks
		return r, nil
	case "round_robin":
		return &RoundRobin{Workers: cfg.Workers}, nil
	case "random":
		return NewRandom(cfg.Workers, cfg.Seed), nil
	case "least_loaded":
		return NewLeastLoaded(cfg.Workers, cfg.BlockSize, params, cfg.Seed), nil
	case "longest_prefix":
		return NewLongestPrefix(cfg.Workers), nil
	case "greedy_balanced":
		return NewGreedyBalanced(cfg.Workers, cfg.Balance), nil
	}
	return nil, fmt.Errorf("%w: unknown policy %q (want one of %s)", ErrBadConfig, name, strings.Join(PolicyNames, ", "))
}

// NewLeastLoaded is the router's cost with no credit for cached blocks:
// the same index, load tracker and scorer, so it differs from the router
// only by what the cache is worth. (Ties on cost still go to the longer
// overlap, as the scorer's tie chain says.)
func NewLeastLoaded(n, blockSize int, params indexer.Params, seed uint64) *Router {
	params.OverlapScoreCredit, params.HostCacheHitWeight, params.DiskCacheHitWeight = 0, 0, 0
	r := NewRouter(n, blockSize, params, seed)
	r.Label = "least_loaded"
	return r
}

// Random sends each request to a uniformly drawn worker, from a seeded
// source.
type Random struct {
	Workers int
	rng     *rand.Rand
}

// NewRandom returns the random policy over n workers.
func NewRandom(n int, seed uint64) *Random {
	return &Random{Workers: n, rng: rand.New(rand.NewPCG(seed, seed^0x5851f42d4c957f2d))}
}

func (p *Random) Name() string { return "random" }
func (p *Random) Route(*RouteQuery, int64) (int, int, error) {
	return p.rng.IntN(p.Workers), 0, nil
}
func (p *Random) Observe(*kvevent.Event, int64)        {}
func (p *Random) Started(*RouteQuery, int, int, int64) {}
func (p *Random) PrefillDone(string, int64)            {}
func (p *Random) Finished(string, int64)               {}

// prefixView is an index fed by the workers' events that answers, per
// worker, the length of the cached prefix of a request, and counts each
// worker's live requests and assigned prompt tokens from the lifecycle.
type prefixView struct {
	workers  int
	ix       *indexer.Index
	matches  indexer.Matches
	overlap  []int   // per worker, for the last query
	active   []int   // live requests per worker
	assigned []int64 // prompt tokens routed to each worker
	live     map[string]int
}

func newPrefixView(n int) prefixView {
	return prefixView{workers: n, ix: indexer.New(indexer.Config{}), overlap: make([]int, n),
		active: make([]int, n), assigned: make([]int64, n), live: make(map[string]int)}
}

// match fills v.overlap with each worker's cached prefix of q, in blocks.
func (v *prefixView) match(q *RouteQuery) {
	v.ix.FindMatchesByTier(q.Local, indexer.ViewDedup, false, &v.matches)
	clear(v.overlap)
	for _, m := range v.matches.Ranks {
		if i := int(m.Rank.Worker) - 1; i >= 0 && i < v.workers {
			v.overlap[i] = int(m.Total())
		}
	}
}

func (v *prefixView) observe(ev *kvevent.Event, now int64) { _ = v.ix.Apply(ev, now) }

func (v *prefixView) started(q *RouteQuery, w int) {
	v.active[w]++
	v.assigned[w] += int64(q.ISL)
	v.live[q.ID] = w
}

func (v *prefixView) finished(id string) {
	if w, ok := v.live[id]; ok {
		v.active[w]--
		delete(v.live, id)
	}
}

// LongestPrefix sends each request to the worker with the longest cached
// prefix of it, ties to the fewer live requests, then the lower index. It
// ignores load otherwise, which is what makes it collapse onto one worker
// when every request starts with the same block.
type LongestPrefix struct{ v prefixView }

// NewLongestPrefix returns the pure longest-prefix policy over n workers.
func NewLongestPrefix(n int) *LongestPrefix { return &LongestPrefix{v: newPrefixView(n)} }

func (p *LongestPrefix) Name() string { return "longest_prefix" }
func (p *LongestPrefix) Route(q *RouteQuery, _ int64) (int, int, error) {
	p.v.match(q)
	best := 0
	for w := 1; w < p.v.workers; w++ {
		o, b := p.v.overlap[w], p.v.overlap[best]
		if o > b || (o == b && p.v.active[w] < p.v.active[best]) {
			best = w
		}
	}
	return best, p.v.overlap[best] * q.BlockSize, nil
}
func (p *LongestPrefix) Observe(ev *kvevent.Event, now int64) { p.v.observe(ev, now) }
func (p *LongestPrefix) Started(q *RouteQuery, w, _ int, _ int64) {
	p.v.started(q, w)
}
func (p *LongestPrefix) PrefillDone(string, int64)   {}
func (p *LongestPrefix) Finished(id string, _ int64) { p.v.finished(id) }

// GreedyBalanced is the greedy baseline of simulator.md's cache-only
// figures: the longest cached prefix among the workers that stay within
// Tolerance of the mean assigned prompt tokens once they take the request
// (assigned[w] + isl <= (1+Tolerance) * (mean + isl/n)); ties to the less
// assigned worker, then the lower index. When no worker qualifies (a
// request larger than the slack) it takes the least assigned one.
type GreedyBalanced struct {
	Tolerance float64
	v         prefixView
}

// NewGreedyBalanced returns the greedy policy over n workers; tolerance 0
// means 0.05.
func NewGreedyBalanced(n int, tolerance float64) *GreedyBalanced {
	if tolerance <= 0 {
		tolerance = 0.05
	}
	return &GreedyBalanced{Tolerance: tolerance, v: newPrefixView(n)}
}

func (p *GreedyBalanced) Name() string { return "greedy_balanced" }
func (p *GreedyBalanced) Route(q *RouteQuery, _ int64) (int, int, error) {
	p.v.match(q)
	var sum int64
	for _, a := range p.v.assigned {
		sum += a
	}
	isl := float64(q.ISL)
	bound := (1 + p.Tolerance) * (float64(sum) + isl) / float64(p.v.workers)
	best, least := -1, 0
	for w := 0; w < p.v.workers; w++ {
		a := p.v.assigned[w]
		if a < p.v.assigned[least] {
			least = w
		}
		if float64(a)+isl > bound {
			continue
		}
		if best < 0 {
			best = w
			continue
		}
		o, b := p.v.overlap[w], p.v.overlap[best]
		if o > b || (o == b && a < p.v.assigned[best]) {
			best = w
		}
	}
	if best < 0 {
		best = least
	}
	return best, p.v.overlap[best] * q.BlockSize, nil
}
func (p *GreedyBalanced) Observe(ev *kvevent.Event, now int64) { p.v.observe(ev, now) }
func (p *GreedyBalanced) Started(q *RouteQuery, w, _ int, _ int64) {
	p.v.started(q, w)
}
func (p *GreedyBalanced) PrefillDone(string, int64)   {}
func (p *GreedyBalanced) Finished(id string, _ int64) { p.v.finished(id) }
