package sim

import (
	"context"
	"fmt"
	"math"
	"strconv"
)

// TimedConfig sets up a discrete-event replay. A zero field takes its
// default; a negative one is refused (ErrBadConfig).
type TimedConfig struct {
	Workers int          // default 8
	Engine  EngineConfig // each worker's model; the zero value takes the defaults
	// Speed multiplies the arrival rate of an open-loop replay: request k
	// arrives at (timestamp_k − the first timestamp) / Speed (arrivalsNs).
	// Default 1.
	Speed float64
	// Concurrency > 0 makes the replay closed-loop: that many requests in
	// flight, the next one issued when one finishes or is rejected, in
	// trace order; timestamps are ignored.
	Concurrency int
	// Progress, when set, is called after each routed request.
	Progress func(done, total int)
}

func (c TimedConfig) check() error {
	if err := notNegative(setting{"workers", float64(c.Workers)}, setting{"speed", c.Speed},
		setting{"concurrency", float64(c.Concurrency)}); err != nil {
		return err
	}
	return c.Engine.check()
}

func (c TimedConfig) withDefaults() TimedConfig {
	if c.Workers <= 0 {
		c.Workers = 8
	}
	if c.Speed <= 0 {
		c.Speed = 1
	}
	c.Engine = c.Engine.withDefaults()
	return c
}

// blockSized is implemented by policies that hash and count in a block
// size of their own: a replay refuses one that is not the engine's.
type blockSized interface{ BlockTokens() int }

// RunTimed replays the prepared trace through cfg.Workers simulated
// engines routed by p, as a discrete-event simulation in simulated time,
// as fast as the CPU allows, and returns p's figures.
//
// Each step takes the earliest time t at which something happens, and at
// t: ends the passes that end then (publishing their events to p, then
// reporting first tokens and finished requests), routes every request
// that arrives then (in trace order, so a burst is routed as a burst: each
// decision sees the bookings of the ones before it, and no worker has
// started on any of them), and starts a pass on every idle worker with
// work. Ties go in worker order and trace order, so a replay is
// deterministic.
//
// A request a worker cannot take (queue full, or larger than the whole
// cache) and a routing error count as rejected; the policy never sees it
// start.
func RunTimed(pr *Prepared, cfg TimedConfig, p Policy) (Result, error) {
	return RunTimedContext(context.Background(), pr, cfg, p)
}

// RunTimedContext is RunTimed, stopped when ctx is done (at the end of the
// step in progress): it returns ctx's error, wrapped with how many
// requests were routed, once the workers are closed, so that their
// offload tiers (the G3 directories) are gone by then. The figures of a
// stopped replay are not summed up.
func RunTimedContext(ctx context.Context, pr *Prepared, cfg TimedConfig, p Policy) (res Result, err error) {
	if err := cfg.check(); err != nil {
		return Result{}, err
	}
	cfg = cfg.withDefaults()
	bs := cfg.Engine.BlockSize
	if pr.BlockSize != 0 && pr.BlockSize != bs {
		return Result{}, fmt.Errorf("%w: trace prepared in %d-token blocks, engine block size %d", ErrBadConfig, pr.BlockSize, bs)
	}
	if b, ok := p.(blockSized); ok && b.BlockTokens() != bs {
		return Result{}, fmt.Errorf("%w: policy %s counts in %d-token blocks, engine block size %d", ErrBadConfig, p.Name(), b.BlockTokens(), bs)
	}
	var arrivals []int64 // open loop; checked before any worker is opened
	if cfg.Concurrency == 0 {
		if arrivals, err = arrivalsNs(pr.Reqs, cfg.Speed); err != nil {
			return Result{}, err
		}
	}
	n := len(pr.Reqs)
	res = Result{Policy: p.Name(), Mode: "timed", Speed: cfg.Speed, Concurrency: cfg.Concurrency, Assigned: make([]int64, cfg.Workers)}
	engines := make([]*Engine, 0, cfg.Workers)
	eventIDs := make([]uint64, cfg.Workers)
	passEnd := make([]int64, cfg.Workers)
	defer func() {
		for _, e := range engines {
			if cerr := e.Close(); err == nil && cerr != nil {
				err = cerr
			}
		}
	}()
	for i := 0; i < cfg.Workers; i++ {
		e, err := OpenEngine(RankOf(i), cfg.Engine)
		if err != nil {
			return res, err
		}
		engines = append(engines, e)
	}
	reqs := make([]EngineRequest, n)
	ids := make([]string, n)
	served := make([]bool, n)

	// Arrivals come in non-decreasing time: trace order when open, finish
	// (or rejection) order when closed.
	type arrival struct {
		at int64
		k  int
	}
	var queue []arrival
	qhead, issued := 0, 0
	if cfg.Concurrency > 0 {
		for ; issued < min(cfg.Concurrency, n); issued++ {
			queue = append(queue, arrival{0, issued})
		}
	} else {
		for k := range pr.Reqs {
			queue = append(queue, arrival{arrivals[k], k})
		}
		issued = n
	}
	next := func(at int64) { // closed loop: one more request in flight
		if cfg.Concurrency > 0 && issued < n {
			queue = append(queue, arrival{at, issued})
			issued++
		}
	}

	var out PassOutcome
	routed := 0
	done := ctx.Done()
	for {
		// A non-blocking receive: cheap enough for every step.
		select {
		case <-done:
			return res, fmt.Errorf("sim: timed replay stopped after %d of %d requests: %w", routed, n, ctx.Err())
		default:
		}
		t := int64(math.MaxInt64)
		if qhead < len(queue) {
			t = queue[qhead].at
		}
		for w, e := range engines {
			if e.Busy() && passEnd[w] < t {
				t = passEnd[w]
			}
		}
		if t == math.MaxInt64 {
			break
		}
		for w, e := range engines {
			if !e.Busy() || passEnd[w] != t {
				continue
			}
			e.FinishPass(t, &out)
			for i := range out.Events {
				eventIDs[w]++
				out.Events[i].EventID = eventIDs[w]
				p.Observe(&out.Events[i], t)
			}
			for _, r := range out.FirstTokens {
				p.PrefillDone(ids[r.ID], t)
			}
			for _, r := range out.Finished {
				p.Finished(ids[r.ID], t)
				next(t)
			}
		}
		for ; qhead < len(queue) && queue[qhead].at == t; qhead++ {
			k := queue[qhead].k
			q := &pr.Reqs[k]
			ids[k] = strconv.Itoa(k)
			rq := RouteQuery{ID: ids[k], Local: pr.Local[k], Seq: pr.Seq[k], ISL: q.InputLength, BlockSize: bs, Req: q}
			w, predicted, err := p.Route(&rq, t)
			routed++
			if cfg.Progress != nil {
				cfg.Progress(routed, n)
			}
			if err != nil || w < 0 || w >= cfg.Workers {
				if res.Errors == 0 {
					res.FirstError = fmt.Sprintf("request %d: worker %d: %v", k, w, err)
				}
				res.Errors++
				res.Rejected++
				next(t)
				continue
			}
			reqs[k] = EngineRequest{ID: k, Prompt: q.InputLength, Output: q.OutputLength,
				Local: pr.Local[k], Seq: pr.Seq[k], Arrival: t}
			if !engines[w].Submit(&reqs[k]) {
				res.Rejected++
				next(t)
				continue
			}
			served[k] = true
			p.Started(&rq, w, predicted, t)
			res.Assigned[w] += int64(q.InputLength)
			res.PredictedCachedTokens += int64(predicted)
		}
		for w, e := range engines {
			if e.Busy() || !e.HasWork() {
				continue
			}
			d, ok, err := e.StartPass(t)
			if err != nil {
				return res, fmt.Errorf("worker %d at %d ns: %w", w, t, err)
			}
			if ok && t > math.MaxInt64-d {
				return res, fmt.Errorf("%w: worker %d: a pass of %d ns at %d ns would take the simulated clock past its range", ErrBadConfig, w, d, t)
			}
			if ok {
				passEnd[w] = t + d
			}
		}
	}

	var first, last int64 = math.MaxInt64, 0
	var tpotSum float64
	var tpotN int
	var outTokens int64
	e2e := make([]float64, 0, n)
	res.Offered = routed
	for k := range reqs {
		// Every routed request's prompt counts: a rejected one as a miss.
		if k < issued {
			res.PromptTokens += int64(pr.Reqs[k].InputLength)
		}
		if !served[k] {
			continue
		}
		r := &reqs[k]
		if r.FinishedAt == 0 {
			return res, fmt.Errorf("sim: request %d never finished (worker stuck)", k)
		}
		res.Requests++
		res.CachedTokens += int64(r.CachedTokens)
		res.HostTokens += int64(r.HostTokens)
		res.DiskTokens += int64(r.DiskTokens)
		res.TTFTMs = append(res.TTFTMs, float64(r.FirstTokenAt-r.Arrival)/1e6)
		e2e = append(e2e, float64(r.FinishedAt-r.Arrival)/1e6)
		if r.Output > 1 {
			tpotSum += float64(r.FinishedAt-r.FirstTokenAt) / 1e6 / float64(r.Output-1)
			tpotN++
		}
		outTokens += int64(r.Output)
		if r.Queued {
			res.Queued++
		}
		first, last = min(first, r.Arrival), max(last, r.FinishedAt)
	}
	for _, e := range engines {
		res.Evicted += e.cache.Evicted
		res.Preemptions += e.Preemptions
		if s, ok := e.OffloadStats(); ok {
			if res.Offload == nil {
				res.Offload = &OffloadStats{}
			}
			res.Offload.add(&s)
		}
	}
	if res.PromptTokens > 0 {
		res.HitRate = float64(res.CachedTokens) / float64(res.PromptTokens)
		res.OffloadHitRate = float64(res.HostTokens+res.DiskTokens) / float64(res.PromptTokens)
	}
	if res.Offload != nil && res.Offload.Mismatches > 0 {
		return res, fmt.Errorf("sim: %d of %d blocks onboarded from G2/G3 had other bytes than they were offloaded with", res.Offload.Mismatches, res.Offload.Checked)
	}
	if tpotN > 0 {
		res.TPOTMeanMs = tpotSum / float64(tpotN)
	}
	if last > first {
		res.MakespanS = float64(last-first) / 1e9
		res.OutputTokensPerS = float64(outTokens) / res.MakespanS
		res.RequestsPerS = float64(res.Requests) / res.MakespanS
	}
	res.Imbalance = imbalance(res.Assigned)
	res.TTFTMeanMs, res.TTFTP50Ms, res.TTFTP99Ms = summarize(res.TTFTMs)
	res.E2EMeanMs, res.E2EP50Ms, res.E2EP99Ms = summarize(e2e)
	return res, nil
}
