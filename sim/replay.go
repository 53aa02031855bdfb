package sim

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Config sets up a replay. A zero field takes its default; a negative one
// is refused (ErrBadConfig).
type Config struct {
	Workers        int     // default 8
	BlockSize      int     // engine tokens per block, default 16
	CapacityTokens int     // KV capacity per worker, default 1,000,000
	Speed          float64 // arrival-speed multiplier, default 1
	Timing         Timing  // default DefaultTiming()
	// Progress, when set, is called after each request with the number done,
	// one whose route failed included (a live progress bar then moves on
	// while the cluster refuses routes).
	Progress func(done, total int)
}

func (c Config) withDefaults() Config {
	if c.Workers <= 0 {
		c.Workers = 8
	}
	if c.BlockSize <= 0 {
		c.BlockSize = 16
	}
	if c.CapacityTokens <= 0 {
		c.CapacityTokens = 1_000_000
	}
	if c.Speed <= 0 {
		c.Speed = 1
	}
	c.Timing = c.Timing.withDefaults()
	return c
}

// ErrBadConfig means the replay cannot run with this configuration.
var ErrBadConfig = errors.New("bad replay config")

// setting is a configuration field, for notNegative.
type setting struct {
	name string
	v    float64
}

// notNegative refuses a negative (or NaN) setting with ErrBadConfig: zero
// takes a setting's default, a negative one is a mistake, not a request
// for the default.
func notNegative(ss ...setting) error {
	for _, s := range ss {
		if s.v < 0 || math.IsNaN(s.v) {
			return fmt.Errorf("%w: %s = %v (want >= 0; 0 takes the default)", ErrBadConfig, s.name, s.v)
		}
	}
	return nil
}

func (c Config) check() error {
	return notNegative(setting{"workers", float64(c.Workers)}, setting{"block size", float64(c.BlockSize)},
		setting{"capacity tokens", float64(c.CapacityTokens)}, setting{"speed", c.Speed})
}

// Result is one policy's figures over a replay.
type Result struct {
	Policy   string
	Mode     string // "v1", "timed", "cache" or "ceiling"
	Requests int    // requests served (routed and accepted)
	Offered  int    // requests routed: served, rejected or failed to route
	// PromptTokens counts the prompt tokens of every offered request,
	// served or not: a request no worker took counts as a miss, so that
	// a policy that rejects cannot raise its hit rate (nor pass the
	// ceiling, which counts every request).
	PromptTokens int64
	CachedTokens int64 // prompt tokens the chosen worker really had cached
	// PredictedCachedTokens is what the policy believed the chosen worker
	// had cached (0 for policies that do not look).
	PredictedCachedTokens int64
	HitRate               float64 // CachedTokens / PromptTokens (rejected requests count as misses)
	Assigned              []int64 // prompt tokens per worker
	Imbalance             float64 // max / mean of Assigned
	TTFTMeanMs            float64
	TTFTP50Ms, TTFTP99Ms  float64
	Evicted               uint64
	// Errors counts the routing errors and, for a policy whose lifecycle
	// calls can fail (LifecycleReporter: the live policy), its failed
	// prefill-done and free calls.
	Errors     int
	FirstError string // the first routing error (with none, the first lifecycle failure), for the report
	// Unfreed is how many bookings the live policy may have left on its
	// cluster (LifecycleFailures.Unfreed).
	Unfreed int

	TTFTMs []float64 // every served request's TTFT, in trace order (timed and v1)

	// Timed replays only.
	TPOTMeanMs       float64 // mean over requests of (finish - first token) / (output - 1)
	E2EMeanMs        float64
	E2EP50Ms         float64
	E2EP99Ms         float64
	OutputTokensPerS float64 // generated tokens / makespan
	RequestsPerS     float64 // served requests / makespan
	MakespanS        float64 // first arrival to last finish, simulated seconds
	Rejected         int     // requests no worker took: a full queue, too large, or a routing error (v1: a routing error)
	Queued           int     // requests that waited through a pass that did not admit them
	Preemptions      int
	Speed            float64 // the arrival-speed multiplier it ran at
	Concurrency      int     // closed loop: requests in flight (0: open loop)
	HitOnly          bool    // the ceiling: only the hit rate means anything
	// Seed is the seed of the replay's randomised policies (RunSuite sets
	// it, a v1 replay's caller likewise): BenchLine prints it, so that a
	// figure can be reproduced from its line.
	Seed uint64

	// Timed replays with offload tiers (EngineConfig.Offload) only: the
	// prompt tokens loaded from G2 and from G3 at each request's first
	// admission (HitRate counts those found in G1), their share of the
	// prompt tokens, and what the tiers did. Offload is nil without tiers.
	HostTokens, DiskTokens int64
	OffloadHitRate         float64
	Offload                *OffloadStats
}

// Prepared is a trace expanded once into blocks, shared by every policy's
// replay.
type Prepared struct {
	BlockSize int // engine tokens per block
	Reqs      []Request
	Local     [][]uint64
	Seq       [][]uint64
}

// Prepare expands every request of the trace into engine blocks. A
// request with fewer hash ids than its prompt needs (ceil(InputLength /
// 512)) fails with ErrBadTrace, naming it: ReadTrace refuses such a row,
// but a []Request built by hand is not read, and the Expander would index
// past its ids.
func Prepare(reqs []Request, blockSize int) (*Prepared, error) {
	p := &Prepared{BlockSize: blockSize, Reqs: reqs, Local: make([][]uint64, len(reqs)), Seq: make([][]uint64, len(reqs))}
	e := Expander{BlockSize: blockSize}
	for i := range reqs {
		if q := &reqs[i]; q.InputLength > 0 && len(q.HashIDs) < (q.InputLength+TraceBlockTokens-1)/TraceBlockTokens {
			return nil, fmt.Errorf("%w: request %d: %d hash ids for %d tokens (want ceil(%d/%d) = %d)", ErrBadTrace, i,
				len(q.HashIDs), q.InputLength, q.InputLength, TraceBlockTokens, (q.InputLength+TraceBlockTokens-1)/TraceBlockTokens)
		}
		l, s := e.Blocks(&reqs[i])
		p.Local[i], p.Seq[i] = slices.Clone(l), slices.Clone(s)
	}
	return p, nil
}

// completion is a pending request milestone in simulated time.
type completion struct {
	at    int64
	order int  // tie-break: the request's index, so equal times replay in a fixed order
	done  bool // false: prefill done; true: finished
}

type completions []completion

func (h completions) Len() int { return len(h) }
func (h completions) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	if h[i].order != h[j].order {
		return h[i].order < h[j].order
	}
	return !h[i].done && h[j].done
}
func (h completions) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *completions) Push(x any)   { *h = append(*h, x.(completion)) }
func (h *completions) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// Replay runs the prepared trace against cfg.Workers simulated workers,
// routed by p, in simulated time, and returns p's figures. The workers
// publish their events to p as they happen.
//
// v1 model: a request is served at once on its worker (no queue); its
// time to first token is the prefill time of its uncached tokens, and it
// finishes after output_length decode steps at the worker's KV use when it
// started (the share of its capacity that in-flight requests pin). Its
// blocks stay pinned until it finishes. A routing error counts as an
// error and as a rejection; a failed lifecycle call of a
// LifecycleReporter (the live policy) as an error. A routing error that is
// ErrWire (WithWire: a worker's events could not be put on its engine
// wire, so the cluster's view of it is lost for good) stops the replay:
// the requests in flight finish (their bookings freed), and Replay returns
// the error with the counts so far, its lifecycle failures included. So
// does ErrNoAnswer (the live policy's cluster stopped answering), the
// error then saying how many requests were not routed. The request whose
// route returned either error is not counted as offered.
func Replay(pr *Prepared, cfg Config, p Policy) (Result, error) {
	return ReplayContext(context.Background(), pr, cfg, p)
}

// ReplayContext is Replay, stopped when ctx is done: as after ErrWire, the
// requests in flight finish (a live policy frees their bookings), and it
// returns ctx's error (wrapped) with the counts so far.
func ReplayContext(ctx context.Context, pr *Prepared, cfg Config, p Policy) (Result, error) {
	if err := cfg.check(); err != nil {
		return Result{}, err
	}
	cfg = cfg.withDefaults()
	if cfg.CapacityTokens < cfg.BlockSize {
		return Result{}, fmt.Errorf("%w: capacity %d tokens is below one block of %d", ErrBadConfig, cfg.CapacityTokens, cfg.BlockSize)
	}
	if pr.BlockSize != 0 && pr.BlockSize != cfg.BlockSize {
		return Result{}, fmt.Errorf("%w: trace prepared in %d-token blocks, block size %d", ErrBadConfig, pr.BlockSize, cfg.BlockSize)
	}
	if b, ok := p.(blockSized); ok && b.BlockTokens() != cfg.BlockSize {
		return Result{}, fmt.Errorf("%w: policy %s counts in %d-token blocks, engine block size %d", ErrBadConfig, p.Name(), b.BlockTokens(), cfg.BlockSize)
	}
	arrivals, err := arrivalsNs(pr.Reqs, cfg.Speed)
	if err != nil {
		return Result{}, err
	}
	capBlocks := cfg.CapacityTokens / cfg.BlockSize
	res := Result{Policy: p.Name(), Mode: "v1", Speed: cfg.Speed, Assigned: make([]int64, cfg.Workers)}
	var now int64
	eventIDs := make([]uint64, cfg.Workers)
	workers := make([]*Cache, cfg.Workers)
	for i := range workers {
		i := i
		workers[i] = NewCache(RankOf(i), capBlocks, func(ev *kvevent.Event) {
			eventIDs[i]++
			ev.EventID = eventIDs[i]
			p.Observe(ev, now)
		})
	}
	type inflight struct {
		worker int
		pinned int
	}
	live := make([]inflight, len(pr.Reqs))
	ids := make([]string, len(pr.Reqs))
	var pending completions
	ttft := make([]float64, 0, len(pr.Reqs))

	settle := func(until int64) {
		for len(pending) > 0 && pending[0].at <= until {
			c := heap.Pop(&pending).(completion)
			now = c.at
			if !c.done {
				p.PrefillDone(ids[c.order], now)
				continue
			}
			f := live[c.order]
			workers[f.worker].Release(pr.Seq[c.order], f.pinned)
			p.Finished(ids[c.order], now)
		}
	}

	// finish merges the policy's lifecycle failures (the frees and
	// prefill-dones that failed, the bookings that may remain) and sums up
	// the figures, on every return: a replay stopped by a wire error freed
	// what it had booked while stopping, and those failures must be told.
	finish := func() {
		if lr, ok := p.(LifecycleReporter); ok {
			lf := lr.LifecycleFailures()
			if res.Errors == 0 && lf.Failed > 0 {
				res.FirstError = lf.First
			}
			res.Errors += lf.Failed
			res.Unfreed = lf.Unfreed
		}
		for _, c := range workers {
			res.Evicted += c.Evicted
		}
		if res.PromptTokens > 0 {
			res.HitRate = float64(res.CachedTokens) / float64(res.PromptTokens)
		}
		res.Imbalance = imbalance(res.Assigned)
		res.TTFTMs = ttft
		res.TTFTMeanMs, res.TTFTP50Ms, res.TTFTP99Ms = summarize(ttft)
	}

	progress := func(done int) {
		if cfg.Progress != nil {
			cfg.Progress(done, len(pr.Reqs))
		}
	}
	done := ctx.Done()
	for k := range pr.Reqs {
		select {
		case <-done:
			settle(math.MaxInt64)
			finish()
			return res, fmt.Errorf("sim: replay stopped after %d of %d requests: %w", k, len(pr.Reqs), ctx.Err())
		default:
		}
		q := &pr.Reqs[k]
		at := arrivals[k]
		settle(at)
		now = max(now, at)
		ids[k] = strconv.Itoa(k)
		rq := RouteQuery{ID: ids[k], Local: pr.Local[k], Seq: pr.Seq[k], ISL: q.InputLength, BlockSize: cfg.BlockSize, Req: q}
		res.Offered++
		res.PromptTokens += int64(q.InputLength)
		w, predicted, err := p.Route(&rq, now)
		if errors.Is(err, ErrWire) || errors.Is(err, ErrNoAnswer) {
			res.Offered--
			res.PromptTokens -= int64(q.InputLength)
			settle(math.MaxInt64)
			finish()
			if errors.Is(err, ErrNoAnswer) {
				return res, fmt.Errorf("sim: replay stopped at request %d, %d of %d requests not routed: %w", k, len(pr.Reqs)-k, len(pr.Reqs), err)
			}
			return res, fmt.Errorf("request %d: %w", k, err)
		}
		if err != nil || w < 0 || w >= cfg.Workers {
			if res.Errors == 0 {
				res.FirstError = fmt.Sprintf("request %d: worker %d: %v", k, w, err)
			}
			res.Errors++
			res.Rejected++
			progress(k + 1)
			continue
		}
		c := workers[w]
		hitBlocks := c.Match(rq.Seq)
		cached := hitBlocks * cfg.BlockSize
		// KV use: the blocks in-flight requests pin. Inactive cached
		// blocks are free memory (as in the timed engine's KVUse).
		u := float64(c.Active()) / float64(c.Capacity())
		pinned := c.Acquire(rq.Local, rq.Seq)
		p.Started(&rq, w, predicted, now)
		live[k] = inflight{worker: w, pinned: pinned}

		prefill := cfg.Timing.PrefillMs(q.InputLength - cached)
		decode := float64(q.OutputLength) * cfg.Timing.DecodeStepMs(u)
		heap.Push(&pending, completion{at: now + int64(prefill*1e6), order: k})
		heap.Push(&pending, completion{at: now + int64((prefill+decode)*1e6), order: k, done: true})

		res.Requests++
		res.CachedTokens += int64(cached)
		res.PredictedCachedTokens += int64(predicted)
		res.Assigned[w] += int64(q.InputLength)
		ttft = append(ttft, prefill)
		progress(k + 1)
	}
	settle(math.MaxInt64)
	finish()
	return res, nil
}

// Served is the share of the offered requests that were served (1 with
// none offered).
func (r *Result) Served() float64 {
	if r.Offered == 0 {
		return 1
	}
	return float64(r.Requests) / float64(r.Offered)
}

func imbalance(xs []int64) float64 {
	var sum, mx int64
	for _, x := range xs {
		sum += x
		mx = max(mx, x)
	}
	if sum == 0 {
		return 0
	}
	return float64(mx) / (float64(sum) / float64(len(xs)))
}

func summarize(xs []float64) (mean, p50, p99 float64) {
	if len(xs) == 0 {
		return 0, 0, 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	return sum / float64(len(s)), percentile(s, 0.5), percentile(s, 0.99)
}

// percentile is the nearest-rank q-quantile of sorted (non-empty): the
// smallest value that at least q of the values are at or below,
// sorted[ceil(q·n) − 1].
func percentile(sorted []float64, q float64) float64 {
	i := int(math.Ceil(q*float64(len(sorted))-1e-9)) - 1 // 1e-9: q·n a hair over an integer
	return sorted[min(max(i, 0), len(sorted)-1)]
}
