package sim

import (
	"fmt"
	"math"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// EngineConfig describes one simulated worker (simulator.md, "One simulated
// worker"). The zero value of each field takes the default; a negative
// one is refused (ErrBadConfig), but for MaxWaiting.
type EngineConfig struct {
	NumGPUBlocks int // KV capacity in blocks; default 16,384
	// BlockSize is the engine's tokens per KV block; default 64. A router
	// must hash and count in the same block size.
	BlockSize           int
	MaxNumBatchedTokens int // token budget of one forward pass; default 8,192
	MaxNumSeqs          int // running requests at most; default 256
	// MaxWaiting is the waiting-queue length at which the worker rejects
	// new requests; default 4,096; negative means unbounded.
	MaxWaiting int
	Timing     Timing // default DefaultTiming()
	// Speed divides every pass time: 2 is a worker twice as fast as the
	// timing model says. Default 1.
	Speed float64
	// Offload gives the worker G2/G3 tiers (OffloadConfig); the zero value
	// is none. A worker with offload tiers must be opened with OpenEngine
	// and closed.
	Offload OffloadConfig
}

func (c EngineConfig) check() error {
	return notNegative(setting{"GPU blocks", float64(c.NumGPUBlocks)}, setting{"block size", float64(c.BlockSize)},
		setting{"max batched tokens", float64(c.MaxNumBatchedTokens)}, setting{"max seqs", float64(c.MaxNumSeqs)},
		setting{"engine speed", c.Speed})
}

func (c EngineConfig) withDefaults() EngineConfig {
	if c.NumGPUBlocks <= 0 {
		c.NumGPUBlocks = 16384
	}
	if c.BlockSize <= 0 {
		c.BlockSize = 64
	}
	if c.MaxNumBatchedTokens <= 0 {
		c.MaxNumBatchedTokens = 8192
	}
	if c.MaxNumSeqs <= 0 {
		c.MaxNumSeqs = 256
	}
	if c.MaxWaiting == 0 {
		c.MaxWaiting = 4096
	}
	c.Timing = c.Timing.withDefaults()
	if c.Speed <= 0 {
		c.Speed = 1
	}
	c.Offload = c.Offload.withDefaults()
	return c
}

// EngineRequest is one request on a simulated worker: what the trace says
// of it, and what the worker did with it.
type EngineRequest struct {
	ID           int // the caller's key (the request's index in the replay)
	Prompt       int // prompt tokens
	Output       int // tokens to generate; at least 1 is generated
	Local, Seq   []uint64
	Arrival      int64 // simulated nanoseconds
	CachedTokens int   // prompt tokens found cached in G1 when first admitted
	// HostTokens and DiskTokens are the prompt tokens loaded from G2 and
	// from G3 when first admitted (offload tiers only).
	HostTokens, DiskTokens int
	FirstTokenAt           int64 // when its first token came (end of its last prefill pass)
	FinishedAt             int64
	Queued                 bool // waited in the queue through at least one pass that did not admit it
	Preemptions            int

	target     int  // tokens to compute before the next token: prompt + generated at admission
	computed   int  // tokens whose KV is computed (or was found cached)
	generated  int  // output tokens produced
	pinned     int  // leading prompt blocks pinned in the cache
	private    int  // blocks reserved outside the tree (partial and generated)
	prefilling bool // computed < target
	admitted   bool // admitted at least once
}

// Engine is one simulated inference worker: a KV cache of NumGPUBlocks
// blocks and a vLLM-like scheduler, driven pass by pass by a replay.
//
// KV blocks: the full blocks of a prompt live in the prefix tree (Cache),
// keyed by sequence hash, published as Stored when allocated and as
// Removed when evicted, active while a request pins them and inactive
// (reusable, evictable leaf-first LRU) after. A prompt's partial last block
// and the blocks of generated tokens are private: reserved while the
// request runs, never matched by another request, never published.
//
// A pass (StartPass) spends a token budget of MaxNumBatchedTokens: first
// on the running requests in admission order (one token for a decoding
// request; for a prefilling one, as much of the rest of its prompt as the
// budget allows: chunked prefill), then on admitting waiting requests in
// FIFO order while fewer than MaxNumSeqs run. Admission first matches the
// prompt against the cache: the cached prefix (at most all but the last
// token, as vLLM recomputes at least one) costs nothing. When a running
// request cannot get the blocks it needs, the newest running request is
// preempted — its blocks unpinned, its progress dropped, put back at the
// head of the queue, recomputed later with whatever cache survives — until
// it can, and no waiting request is admitted in that pass.
//
// A pass takes prefill(N) + decode(u) milliseconds, divided by Speed: N the
// prompt tokens it computes (cached ones cost nothing), u the fraction of
// the KV capacity pinned or reserved once it has scheduled its batch
// (after its allocations, KVUse); a pass without prefill work has no
// prefill term, one without decoding requests no decode term (a mixed pass
// costs the sum of both: docs/sim.md says why).
//
// With offload tiers (EngineConfig.Offload, sim/offload.go) the blocks G1
// evicts go to G2/G3, and admission continues the cached prefix there: those
// blocks are copied back into G1 and the pass also takes their transfer
// time (their real KV size over the tier's bandwidth) instead of their
// prefill.
// At its end (FinishPass) every request that completed its prefill emits
// its first token, every decoding request one more, and requests that have
// all their output finish and release their blocks.
type Engine struct {
	cfg   EngineConfig
	cache *Cache
	off   *offloader // nil without offload tiers

	waiting []*EngineRequest // FIFO from whead; preempted requests go back to the head
	whead   int
	fresh   []*EngineRequest // submitted since the last StartPass
	running []*EngineRequest // in admission order
	batch   []work           // the pass in flight
	busy    bool
	events  []kvevent.Event // published during the pass in flight

	// Counters.
	Passes      int
	BusyNs      int64
	Preemptions int
	PrefillToks int64 // tokens computed by prefill passes
	LoadNs      int64 // pass time spent loading blocks from G2/G3 (after Speed)
}

type work struct {
	r *EngineRequest
	n int
}

// NewEngine returns an idle worker publishing as rank. It panics when cfg
// has a negative field, or when cfg.Offload is set and its tiers cannot be
// made: use OpenEngine then.
func NewEngine(rank kvevent.Rank, cfg EngineConfig) *Engine {
	e, err := OpenEngine(rank, cfg)
	if err != nil {
		panic(err)
	}
	return e
}

// OpenEngine returns an idle worker publishing as rank, with the offload
// tiers cfg.Offload asks for (Close releases them).
func OpenEngine(rank kvevent.Rank, cfg EngineConfig) (*Engine, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	e := &Engine{cfg: cfg}
	e.cache = NewCache(rank, cfg.NumGPUBlocks, e.record)
	if cfg.Offload.Enabled() {
		off, err := newOffloader(rank, cfg.NumGPUBlocks, cfg.Offload, e.record)
		if err != nil {
			return nil, err
		}
		e.off = off
		e.cache.Emit = off.event
	}
	return e, nil
}

// Close releases the worker's offload tiers (memory, the G3 directory);
// without them it does nothing.
func (e *Engine) Close() error {
	if e.off == nil {
		return nil
	}
	err := e.off.close()
	e.off = nil
	e.cache.Emit = e.record
	return err
}

// OffloadStats returns what the worker's offload tiers did; ok is false
// without them.
func (e *Engine) OffloadStats() (s OffloadStats, ok bool) {
	if e.off == nil {
		return s, false
	}
	return e.off.snapshot(), true
}

// Config returns the engine's configuration with defaults applied.
func (e *Engine) Config() EngineConfig { return e.cfg }

// Cache returns the engine's KV cache (for tests and reports).
func (e *Engine) Cache() *Cache { return e.cache }

func (e *Engine) record(ev *kvevent.Event) {
	c := *ev
	c.Blocks = slices.Clone(ev.Blocks)
	c.Removed = slices.Clone(ev.Removed)
	e.events = append(e.events, c)
}

// Busy reports whether a pass is in flight.
func (e *Engine) Busy() bool { return e.busy }

// Waiting and Running return the queue lengths.
func (e *Engine) Waiting() int { return len(e.waiting) - e.whead }
func (e *Engine) Running() int { return len(e.running) }

// HasWork reports whether a pass could do something.
func (e *Engine) HasWork() bool { return len(e.running) > 0 || e.Waiting() > 0 }

// KVUse is the fraction of the capacity pinned or reserved by requests.
func (e *Engine) KVUse() float64 {
	return float64(e.cache.Active()+e.cache.Reserved()) / float64(e.cfg.NumGPUBlocks)
}

// Fits reports whether a request of prompt and output tokens can ever run
// here: its whole context fits in the KV capacity.
func (e *Engine) Fits(prompt, output int) bool {
	room := e.cfg.NumGPUBlocks * e.cfg.BlockSize // tokens; no sum below can wrap
	if prompt > room || output > room {
		return false
	}
	return blocksFor(prompt+max(output, 1), e.cfg.BlockSize) <= e.cfg.NumGPUBlocks
}

// Submit queues r. It reports false, queueing nothing, when the waiting
// queue is full or r can never fit.
func (e *Engine) Submit(r *EngineRequest) bool {
	if e.cfg.MaxWaiting > 0 && e.Waiting() >= e.cfg.MaxWaiting {
		return false
	}
	if !e.Fits(r.Prompt, r.Output) {
		return false
	}
	r.Output = max(r.Output, 1)
	e.waiting = append(e.waiting, r)
	e.fresh = append(e.fresh, r)
	return true
}

func blocksFor(tokens, bs int) int { return (tokens + bs - 1) / bs }

// allocate gives r the blocks for n more tokens, or reports false and
// changes nothing.
func (e *Engine) allocate(r *EngineRequest, n int) bool {
	bs := e.cfg.BlockSize
	total := r.computed + n
	tree := min(total/bs, len(r.Seq))
	private := blocksFor(total, bs) - tree
	need := max(private-r.private, 0)
	if tree > r.pinned {
		need += e.cache.Unpinned(r.Seq, r.pinned, tree)
	}
	// Private blocks that became full prompt blocks move to the tree: give
	// them back first.
	if need > e.cache.Free()+max(r.private-private, 0) {
		return false
	}
	if private < r.private {
		e.cache.Unreserve(r.private - private)
		r.private = private
	}
	if tree > r.pinned {
		got := e.cache.Extend(r.Local, r.Seq, r.pinned, tree)
		if got != tree {
			panic(fmt.Sprintf("sim: engine pinned %d of %d blocks after checking room", got, tree))
		}
		r.pinned = tree
	}
	if private > r.private {
		if !e.cache.Reserve(private - r.private) {
			panic("sim: engine could not reserve after checking room")
		}
		r.private = private
	}
	return true
}

// release gives back every block r holds.
func (e *Engine) release(r *EngineRequest) {
	e.cache.Release(r.Seq, r.pinned)
	e.cache.Unreserve(r.private)
	r.pinned, r.private = 0, 0
}

// preempt drops the newest running request back to the head of the queue.
func (e *Engine) preempt() *EngineRequest {
	v := e.running[len(e.running)-1]
	e.running = e.running[:len(e.running)-1]
	e.release(v)
	v.computed, v.prefilling = 0, false
	v.Preemptions++
	e.Preemptions++
	if e.whead > 0 {
		e.whead--
		e.waiting[e.whead] = v
	} else {
		e.waiting = slices.Insert(e.waiting, 0, v)
	}
	return v
}

// MaxPassNs bounds one pass's duration: a quarter of the simulated clock's
// range (73 years), so that a replay's clock, arrivals and passes added,
// cannot wrap.
const MaxPassNs = math.MaxInt64 / 4

// StartPass schedules one pass at now and returns its duration in
// nanoseconds; ok is false when there is nothing to run (the worker stays
// idle). It must not be called while a pass is in flight.
//
// A pass time that is not a number, negative, or past MaxPassNs (a tiny
// Speed, a KV size or a bandwidth that makes a transfer infinite) fails
// with ErrBadConfig, and the worker is of no further use but to Close:
// clamping it, as StartPass did, turned the slowest worker into one whose
// passes took 1 ns.
func (e *Engine) StartPass(now int64) (dur int64, ok bool, err error) {
	if e.busy {
		panic("sim: StartPass during a pass")
	}
	e.batch = e.batch[:0]
	budget := e.cfg.MaxNumBatchedTokens
	prefill, decode := 0, 0
	loadMs := 0.0
	preempted := false
	for i := 0; i < len(e.running) && budget > 0; i++ {
		r := e.running[i]
		n := 1
		if r.prefilling {
			n = min(r.target-r.computed, budget)
		}
		for !e.allocate(r, n) {
			if v := e.preempt(); v == r {
				preempted = true
				break
			}
			preempted = true
		}
		if i >= len(e.running) || e.running[i] != r {
			break // r preempted itself: everything after it is gone too
		}
		e.batch = append(e.batch, work{r, n})
		budget -= n
		if r.prefilling {
			prefill += n
		} else {
			decode++
		}
	}
	for !preempted && budget > 0 && e.Waiting() > 0 && len(e.running) < e.cfg.MaxNumSeqs {
		r := e.waiting[e.whead]
		r.target = r.Prompt + r.generated
		// The cached prefix, in whole blocks, but never the last token:
		// one token at least is computed to produce the next.
		limit := (r.target - 1) / e.cfg.BlockSize
		hit := min(e.cache.Match(r.Seq), limit)
		// With offload tiers the prefix may go on in G2/G3: those blocks
		// are loaded into G1 (pinned in their pool until then) and cost
		// their transfer time instead of their prefill.
		host, disk := 0, 0
		if to := min(limit, len(r.Seq)); e.off != nil && hit < to {
			host, disk = e.off.planOnboard(r.Local, r.Seq, hit, to)
		}
		r.computed = (hit + host + disk) * e.cfg.BlockSize
		n := min(r.target-r.computed, budget)
		if !e.allocate(r, n) {
			if e.off != nil {
				e.off.endPlan(false)
			}
			r.computed = 0
			break
		}
		if e.off != nil {
			e.off.endPlan(true)
			loadMs += e.off.loadMs(host, disk, e.cfg.BlockSize, e.cfg.Timing)
		}
		if !r.admitted {
			r.admitted = true
			r.CachedTokens = hit * e.cfg.BlockSize
			r.HostTokens, r.DiskTokens = host*e.cfg.BlockSize, disk*e.cfg.BlockSize
		}
		r.prefilling = true
		e.waiting[e.whead] = nil
		e.whead++
		e.running = append(e.running, r)
		e.batch = append(e.batch, work{r, n})
		budget -= n
		prefill += n
	}
	if e.whead > 0 && e.whead*2 >= len(e.waiting) {
		n := copy(e.waiting, e.waiting[e.whead:])
		clear(e.waiting[n:])
		e.waiting, e.whead = e.waiting[:n], 0
	}
	// A request that this pass, its first chance, did not admit waits.
	for _, r := range e.fresh {
		if !r.admitted {
			r.Queued = true
		}
	}
	clear(e.fresh)
	e.fresh = e.fresh[:0]
	if e.off != nil {
		e.off.flushDisk()
	}
	if len(e.batch) == 0 {
		return 0, false, nil
	}
	ms := 0.0
	if prefill > 0 {
		ms += e.cfg.Timing.PrefillMs(prefill)
	}
	if decode > 0 {
		ms += e.cfg.Timing.DecodeStepMs(e.KVUse())
	}
	ms += loadMs
	ns := math.Round(ms * 1e6 / e.cfg.Speed)
	if !(ns >= 0 && ns <= MaxPassNs) { // NaN too
		return 0, false, fmt.Errorf("%w: a pass of %d prefill tokens, %d decoding requests and %g ms of loads takes %g ns at engine speed %g: want 0..%d ns",
			ErrBadConfig, prefill, decode, loadMs, ns, e.cfg.Speed, int64(MaxPassNs))
	}
	// At least 1 ns: a pass that took no time would end where it began,
	// and the replay's clock would not move.
	dur = max(int64(ns), 1)
	e.busy = true
	e.Passes++
	e.BusyNs += dur
	e.LoadNs += int64(math.Round(loadMs * 1e6 / e.cfg.Speed))
	e.PrefillToks += int64(prefill)
	return dur, true, nil
}

// PassOutcome is what a finished pass did: the events the worker published
// during it (in order; valid until the next StartPass), the requests whose
// first token came, and the requests that finished.
type PassOutcome struct {
	Events      []kvevent.Event
	FirstTokens []*EngineRequest
	Finished    []*EngineRequest
}

// FinishPass ends the pass in flight at now and fills out.
func (e *Engine) FinishPass(now int64, out *PassOutcome) {
	if !e.busy {
		panic("sim: FinishPass with no pass in flight")
	}
	e.busy = false
	out.Events = append(out.Events[:0], e.events...)
	e.events = e.events[:0]
	out.FirstTokens = out.FirstTokens[:0]
	out.Finished = out.Finished[:0]
	done := false
	for _, w := range e.batch {
		r := w.r
		r.computed += w.n
		if r.prefilling {
			if r.computed < r.target {
				continue
			}
			r.prefilling = false
			if r.generated == 0 {
				r.FirstTokenAt = now
				out.FirstTokens = append(out.FirstTokens, r)
			}
		}
		r.generated++
		if r.generated >= r.Output {
			r.FinishedAt = now
			e.release(r)
			out.Finished = append(out.Finished, r)
			done = true
		}
	}
	if done {
		e.running = slices.DeleteFunc(e.running, func(r *EngineRequest) bool { return r.generated >= r.Output })
	}
	e.batch = e.batch[:0]
}
