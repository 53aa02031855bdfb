package sim

import (
	"math"
	"math/rand/v2"
)

// SharedPrefixConfig describes a generated chat-like trace in which every
// request starts with the same blocks (one system prompt), the case where
// routing purely on the longest cached prefix sends everything to one
// worker (traces/README.md).
type SharedPrefixConfig struct {
	Requests     int     // default 2,000
	SharedBlocks int     // 512-token blocks every request starts with; default 1
	Sessions     int     // conversations; default 200
	RatePerS     float64 // mean arrivals per second (Poisson); default 20
	// Turn blocks: each request of a session appends a heavy-tailed
	// (Pareto, alpha 1.5) number of new blocks to the session's history,
	// at least 1, at most MaxTurnBlocks (default 16).
	MaxTurnBlocks int
	OutputTokens  int // mean output length; default 150
	Seed          uint64
}

// GenerateSharedPrefix returns a Mooncake-format trace of cfg: ids 0 ..
// SharedBlocks-1 open every request; then each request continues one of
// the sessions (drawn uniformly): the session's history so far plus its
// new turn, so requests of one session share ever longer prefixes.
// Deterministic for a given cfg.
func GenerateSharedPrefix(cfg SharedPrefixConfig) []Request {
	if cfg.Requests <= 0 {
		cfg.Requests = 2000
	}
	if cfg.SharedBlocks <= 0 {
		cfg.SharedBlocks = 1
	}
	if cfg.Sessions <= 0 {
		cfg.Sessions = 200
	}
	if cfg.RatePerS <= 0 {
		cfg.RatePerS = 20
	}
	if cfg.MaxTurnBlocks <= 0 {
		cfg.MaxTurnBlocks = 16
	}
	if cfg.OutputTokens <= 0 {
		cfg.OutputTokens = 150
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0xda942042e4dd58b5))
	next := uint64(cfg.SharedBlocks)
	history := make([][]uint64, cfg.Sessions)
	out := make([]Request, 0, cfg.Requests)
	var at float64
	for i := 0; i < cfg.Requests; i++ {
		at += rng.ExpFloat64() / cfg.RatePerS * 1000
		s := rng.IntN(cfg.Sessions)
		turn := min(cfg.MaxTurnBlocks, int(math.Ceil(math.Pow(1-rng.Float64(), -1/1.5))))
		h := history[s]
		if len(h) == 0 || len(h)+turn > 64 { // new, or outgrew its context: starts over
			h = h[:0]
			for b := 0; b < cfg.SharedBlocks; b++ {
				h = append(h, uint64(b))
			}
		}
		for b := 0; b < turn; b++ {
			h = append(h, next)
			next++
		}
		history[s] = h
		ids := append([]uint64(nil), h...)
		// The last block is partial: 1..512 tokens of it.
		in := (len(ids)-1)*TraceBlockTokens + 1 + rng.IntN(TraceBlockTokens)
		o := max(1, int(rng.ExpFloat64()*float64(cfg.OutputTokens)))
		out = append(out, Request{TimestampMs: int64(at), InputLength: in, OutputLength: o, HashIDs: ids})
	}
	return out
}
