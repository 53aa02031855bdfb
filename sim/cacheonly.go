package sim

import (
	"context"
	"fmt"
	"math"
	"strconv"

	"github.com/kvrouter/kvrouter/kvevent"
)

// CacheConfig sets up a cache-only replay (simulator.md, "Cache-only
// figures"): no time, no queues, only which worker holds what. A zero
// field takes its default; a negative one is refused (ErrBadConfig).
type CacheConfig struct {
	Workers        int // default 8
	CapacityBlocks int // per worker, default 2,048
	BlockSize      int // tokens per block, default 512 (one trace id per block)
}

func (c CacheConfig) check() error {
	return notNegative(setting{"workers", float64(c.Workers)}, setting{"capacity blocks", float64(c.CapacityBlocks)},
		setting{"block size", float64(c.BlockSize)})
}

func (c CacheConfig) withDefaults() CacheConfig {
	if c.Workers <= 0 {
		c.Workers = 8
	}
	if c.CapacityBlocks <= 0 {
		c.CapacityBlocks = 2048
	}
	if c.BlockSize <= 0 {
		c.BlockSize = TraceBlockTokens
	}
	return c
}

// RunCacheOnly replays the prepared trace without time: for each request in
// trace order it asks p for a worker, counts the longest prefix that
// worker has cached as the request's cached tokens, then inserts the
// request's blocks there (leaf-first LRU, cfg.CapacityBlocks per worker),
// delivering the worker's Stored and Removed events to p at once.
//
// Nothing finishes in a time-free replay: p is told each request Started
// (with what it predicted cached) and never PrefillDone or Finished, so a
// policy that tracks load sees everything assigned so far — the
// cumulative assigned prompt tokens the imbalance figure measures. The
// "now" given to p is the request's trace timestamp, less the first
// request's (arrivalsNs at speed 1).
func RunCacheOnly(pr *Prepared, cfg CacheConfig, p Policy) (Result, error) {
	return RunCacheOnlyContext(context.Background(), pr, cfg, p)
}

// RunCacheOnlyContext is RunCacheOnly, stopped when ctx is done: it
// returns ctx's error, wrapped with how many requests were routed.
func RunCacheOnlyContext(ctx context.Context, pr *Prepared, cfg CacheConfig, p Policy) (Result, error) {
	if err := cfg.check(); err != nil {
		return Result{}, err
	}
	cfg = cfg.withDefaults()
	if pr.BlockSize != 0 && pr.BlockSize != cfg.BlockSize {
		return Result{}, fmt.Errorf("%w: trace prepared in %d-token blocks, cache block size %d", ErrBadConfig, pr.BlockSize, cfg.BlockSize)
	}
	if b, ok := p.(blockSized); ok && b.BlockTokens() != cfg.BlockSize {
		return Result{}, fmt.Errorf("%w: policy %s counts in %d-token blocks, cache block size %d", ErrBadConfig, p.Name(), b.BlockTokens(), cfg.BlockSize)
	}
	// The policies see the replays' clock: from the first request, at
	// speed 1.
	arrivals, err := arrivalsNs(pr.Reqs, 1)
	if err != nil {
		return Result{}, err
	}
	res := Result{Policy: p.Name(), Mode: "cache", Assigned: make([]int64, cfg.Workers)}
	var now int64
	eventIDs := make([]uint64, cfg.Workers)
	caches := make([]*Cache, cfg.Workers)
	for i := range caches {
		i := i
		caches[i] = NewCache(RankOf(i), cfg.CapacityBlocks, func(ev *kvevent.Event) {
			eventIDs[i]++
			ev.EventID = eventIDs[i]
			p.Observe(ev, now)
		})
	}
	done := ctx.Done()
	for k := range pr.Reqs {
		select {
		case <-done:
			return res, fmt.Errorf("sim: cache-only replay stopped after %d of %d requests: %w", k, len(pr.Reqs), ctx.Err())
		default:
		}
		q := &pr.Reqs[k]
		now = arrivals[k]
		rq := RouteQuery{ID: strconv.Itoa(k), Local: pr.Local[k], Seq: pr.Seq[k], ISL: q.InputLength, BlockSize: cfg.BlockSize, Req: q}
		res.Offered++
		res.PromptTokens += int64(q.InputLength)
		w, predicted, err := p.Route(&rq, now)
		if err != nil || w < 0 || w >= cfg.Workers {
			if res.Errors == 0 {
				res.FirstError = fmt.Sprintf("request %d: worker %d: %v", k, w, err)
			}
			res.Errors++
			res.Rejected++
			continue
		}
		c := caches[w]
		cached := c.Match(rq.Seq) * cfg.BlockSize
		n := c.Acquire(rq.Local, rq.Seq)
		c.Release(rq.Seq, n)
		p.Started(&rq, w, predicted, now)
		res.Requests++
		res.CachedTokens += int64(cached)
		res.PredictedCachedTokens += int64(predicted)
		res.Assigned[w] += int64(q.InputLength)
	}
	for _, c := range caches {
		res.Evicted += c.Evicted
	}
	if res.PromptTokens > 0 {
		res.HitRate = float64(res.CachedTokens) / float64(res.PromptTokens)
	}
	res.Imbalance = imbalance(res.Assigned)
	return res, nil
}

// Ceiling is the hit-rate ceiling of one infinite cache shared by every
// worker: each request, in trace order, counts the longest prefix of its
// full blocks seen before, then adds its blocks. No routing can do better
// on the same blocks. Only HitRate (and the token counts) mean anything.
func Ceiling(pr *Prepared, mode string) Result {
	res := Result{Policy: "ceiling", Mode: mode, HitOnly: true, Imbalance: math.NaN()}
	seen := make(map[uint64]struct{})
	for k := range pr.Reqs {
		seq := pr.Seq[k]
		m := 0
		for m < len(seq) {
			if _, ok := seen[seq[m]]; !ok {
				break
			}
			m++
		}
		for _, h := range seq[m:] {
			seen[h] = struct{}{}
		}
		res.Requests++
		res.Offered++
		res.PromptTokens += int64(pr.Reqs[k].InputLength)
		res.CachedTokens += int64(m * pr.BlockSize)
	}
	if res.PromptTokens > 0 {
		res.HitRate = float64(res.CachedTokens) / float64(res.PromptTokens)
	}
	return res
}
