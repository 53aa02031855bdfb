package sim

import (
	"context"
	"fmt"

	"github.com/kvrouter/kvrouter/indexer"
)

// CacheModeRouterParams are the router's weights for cache-only replays,
// where nothing finishes and the router books each request's whole prompt
// as load (Router.BookWholePrompt): its prefill term is then the prompt
// tokens assigned so far, in blocks, plus the request. A cached block is
// worth 50 of them, and the load term weighs 30 per block against the
// potential-decode-blocks term's 1. Tuned on mooncake_synthetic_trace.jsonl
// (docs/sim.md gives the sweep).
func CacheModeRouterParams() indexer.Params {
	p := indexer.DefaultParams()
	p.OverlapScoreCredit = 50
	p.PrefillLoadScale = 30
	return p
}

// Mode names.
const (
	ModeTimed = "timed"
	ModeCache = "cache"
)

// SuiteConfig is one replay of several policies over one prepared trace.
type SuiteConfig struct {
	Mode     string   // ModeTimed or ModeCache
	Policies []string // PolicyNames and "ceiling", in report order
	Timed    TimedConfig
	Cache    CacheConfig
	Seed     uint64
	// RouterParams override the router's (and least_loaded's) weights; nil
	// means indexer.DefaultParams() when timed, CacheModeRouterParams()
	// when cache-only.
	RouterParams *indexer.Params
	// Progress, when set, is told each policy as it starts.
	Progress func(policy string)
}

// RunSuite replays pr once per policy, each from a fresh fleet, and
// returns their results in cfg.Policies order.
func RunSuite(pr *Prepared, cfg SuiteConfig) ([]Result, error) {
	return RunSuiteContext(context.Background(), pr, cfg)
}

// RunSuiteContext is RunSuite, stopped when ctx is done (between policies
// and within each replay): it returns the results so far and ctx's error,
// wrapped.
func RunSuiteContext(ctx context.Context, pr *Prepared, cfg SuiteConfig) ([]Result, error) {
	var out []Result
	for _, name := range cfg.Policies {
		if err := ctx.Err(); err != nil {
			return out, fmt.Errorf("sim: suite stopped before %s: %w", name, err)
		}
		if cfg.Progress != nil {
			cfg.Progress(name)
		}
		if name == "ceiling" {
			out = append(out, Ceiling(pr, cfg.Mode))
			continue
		}
		p, err := NewSuitePolicy(name, cfg)
		if err != nil {
			return out, err
		}
		var r Result
		switch cfg.Mode {
		case ModeTimed:
			r, err = RunTimedContext(ctx, pr, cfg.Timed, p)
		case ModeCache:
			r, err = RunCacheOnlyContext(ctx, pr, cfg.Cache, p)
		default:
			return out, fmt.Errorf("%w: mode %q (want %s or %s)", ErrBadConfig, cfg.Mode, ModeTimed, ModeCache)
		}
		if err != nil {
			return out, fmt.Errorf("%s: %w", name, err)
		}
		r.Seed = cfg.Seed
		out = append(out, r)
	}
	return out, nil
}

// NewSuitePolicy builds the named policy for cfg's mode and fleet.
func NewSuitePolicy(name string, cfg SuiteConfig) (Policy, error) {
	pc := PolicyConfig{Seed: cfg.Seed, RouterParams: cfg.RouterParams}
	switch cfg.Mode {
	case ModeTimed:
		t := cfg.Timed.withDefaults()
		pc.Workers, pc.BlockSize, pc.CapacityBlocks = t.Workers, t.Engine.BlockSize, int64(t.Engine.NumGPUBlocks)
	case ModeCache:
		c := cfg.Cache.withDefaults()
		pc.Workers, pc.BlockSize = c.Workers, c.BlockSize
		if pc.RouterParams == nil {
			rp := CacheModeRouterParams()
			pc.RouterParams = &rp
		}
	}
	p, err := NewPolicy(name, pc)
	if err != nil {
		return nil, err
	}
	if r, ok := p.(*Router); ok && cfg.Mode == ModeCache {
		r.BookWholePrompt = true
	}
	// With offload tiers the workers report G2/G3 residency: the router
	// (and least_loaded, whose tier weights are 0) reads the index tier by
	// tier, so a host or disk block earns host_cache_hit_weight or
	// disk_cache_hit_weight, as a cluster set to the tiered view does.
	if r, ok := p.(*Router); ok && cfg.Mode == ModeTimed && cfg.Timed.Engine.Offload.Enabled() {
		r.View = indexer.ViewTiered
	}
	return p, nil
}

// Unloaded replays pr through cfg's fleet with round-robin, one request at
// a time (closed loop, concurrency 1): every request meets an idle worker
// with round-robin's cache, so its TTFT is its unloaded TTFT.
func Unloaded(pr *Prepared, cfg TimedConfig) (Result, error) {
	cfg.Concurrency = 1
	if err := cfg.check(); err != nil {
		return Result{}, err
	}
	cfg = cfg.withDefaults()
	return RunTimed(pr, cfg, &RoundRobin{Workers: cfg.Workers})
}

// LoadedSpeed finds the first arrival speed of ladder at which
// round-robin's mean TTFT is at least factor times its unloaded mean TTFT
// (Unloaded), and returns it with round-robin's result there. ok is false
// when no speed of the ladder loads the fleet that much.
func LoadedSpeed(pr *Prepared, cfg TimedConfig, unloadedMs, factor float64, ladder []float64) (speed float64, rr Result, ok bool, err error) {
	for _, s := range ladder {
		c := cfg
		c.Speed, c.Concurrency = s, 0
		if err := c.check(); err != nil {
			return s, rr, false, err
		}
		c = c.withDefaults()
		rr, err = RunTimed(pr, c, &RoundRobin{Workers: c.Workers})
		if err != nil {
			return s, rr, false, err
		}
		if rr.TTFTMeanMs >= factor*unloadedMs {
			return s, rr, true, nil
		}
	}
	return 0, rr, false, nil
}
