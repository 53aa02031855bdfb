package sim

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Remote is the live policy: it routes through a running kvrouter
// cluster's HTTP API. Each request is booked on the chosen rank, marked
// prefill-done and freed through the API, so the cluster's load view
// follows the replay.
//
// The simulated workers' events reach the cluster's index one of two
// ways:
//   - Agents unset: Remote registers the workers itself and sends their
//     events through the cluster's event ingestion (POST /v1/events)
//     before each decision, so the cluster decides on exactly what the
//     workers hold.
//   - Agents set: the workers publish their events on their own engine
//     wires (WithWire over sim/enginepub: a ZMQ PUB per worker, as vLLM
//     does), a node agent (kvagent) per worker follows that stream,
//     publishes the events to the cluster over NATS and registers the
//     worker. Remote sends no events and registers nothing; Setup waits
//     until every worker is registered. The cluster then decides on what
//     the events brought it by the time of each decision, as it would
//     with real engines.
type Remote struct {
	Client    *client.Client
	Workers   int
	BlockSize int
	// CapacityBlocks is registered as each worker's device capacity.
	CapacityBlocks int64
	Timeout        time.Duration // per call, default 10s
	Agents         bool          // events and registrations come from node agents (see above)
	// PollInterval is how often Setup looks for the agents' registrations
	// (default 100ms).
	PollInterval time.Duration
	// Stop, when set, is the replay's context (kvsim's: Ctrl-C cancels it).
	// Once it is done, the call in flight is cancelled and the cleanup of
	// the requests in flight is bounded: no prefill-done (their frees
	// follow), one try per free, all of them within StopGrace of the stop,
	// and none after the first that fails, each counted in Unfreed (the
	// cluster drops such bookings after its booking max age). A user stops
	// a replay most often because the cluster stopped answering: a timeout
	// per call, per request in flight, one after another, held the stop
	// for minutes.
	Stop context.Context
	// StopGrace bounds the cleanup once Stop is done, or once the cluster
	// stopped answering (ErrNoAnswer) (default 3s).
	StopGrace time.Duration
	// Overrides, when set, go with every route request: the weights the
	// in-process router is built with (kvsim's router weight flags), so
	// that both score alike. Nil: the cluster's settings apply.
	Overrides *indexer.Overrides

	prefix  string
	pending []raftfsm.RankBatch // events not yet sent, per rank in first-seen order
	// salted hashes the routes' prompts with the agents' salt (Setup):
	// each agent's decoder hashes the workers' tokens with the salt its
	// worker is registered with, so the replay's own content hashes
	// (RouteQuery.Local) would match none of their blocks. Nil without
	// agents or salt.
	salted   *Expander
	Calls    int
	failures LifecycleFailures
	stopBy   time.Time // the cleanup's deadline, set when Stop is first seen done
	gaveUp   error     // the free that failed after the stop: no other is tried
	silent   int       // calls in a row that got no answer (heard)
	noAnswer error     // ErrNoAnswer, once silent reached maxSilentCalls: the replay ends as at a stop
}

// ErrNoAnswer means the live policy's cluster stopped answering:
// maxSilentCalls calls in a row timed out or reached no node. Route
// returns it (wrapped), and a replay stops on it as on a stop: the
// requests in flight are freed with the stop's bounds (Remote.Stop).
var ErrNoAnswer = errors.New("the cluster stopped answering")

// maxSilentCalls is how many calls in a row may time out or reach no
// node before Remote gives up on the cluster (ErrNoAnswer). A lost answer
// now and then (a forward cut by a leader change) is followed by answered
// calls; three in a row, a route and its free's two tries, is a cluster
// silent for three timeouts (30 s at the default). Going on would cost
// each remaining request a route timeout and two free timeouts, all for
// errors: hours for make run's 600 requests, with no one to press Ctrl-C.
const maxSilentCalls = 3

// errGaveUp is a free not tried: one failed after the replay was stopped.
var errGaveUp = errors.New("not tried: a free failed after the replay was stopped")

// LifecycleFailures counts the calls of a request's life after its route
// (prefill-done, free) that a policy could not make on its cluster.
type LifecycleFailures struct {
	Failed int // prefill-done and free calls that failed (a free after its retry), and frees not tried after a stop
	// Unfreed is how many bookings may remain on the cluster, counted as
	// load on their workers until the cluster's booking expiry frees them:
	// a free that failed twice, a route that failed after the leader
	// may have booked it and whose free failed too, or, once Stop is done,
	// a free that failed or was not tried.
	Unfreed int
	First   string // the first failure, for the report
}

// LifecycleReporter is a policy whose PrefillDone and Finished calls can
// fail (Remote: they are calls to a cluster). Replay counts its failures
// as errors, and its unfreed bookings in Result.Unfreed.
type LifecycleReporter interface {
	LifecycleFailures() LifecycleFailures
}

// LifecycleFailures returns the failures since Setup.
func (p *Remote) LifecycleFailures() LifecycleFailures { return p.failures }

func (p *Remote) fail(unfreed bool, format string, args ...any) {
	if p.failures.Failed == 0 {
		p.failures.First = fmt.Sprintf(format, args...)
	}
	p.failures.Failed++
	if unfreed {
		p.failures.Unfreed++
	}
}

// Setup (re)registers the simulated workers, dropping whatever the cluster
// held of them from an earlier run, so their event ids start again at 1.
func (p *Remote) Setup(ctx context.Context) error {
	if p.Timeout <= 0 {
		p.Timeout = 10 * time.Second
	}
	p.prefix = "kvsim-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-"
	p.failures = LifecycleFailures{}
	p.stopBy, p.gaveUp = time.Time{}, nil
	p.silent, p.noAnswer = 0, nil
	p.pending = p.pending[:0] // an earlier run's, numbered before the workers were registered again
	p.salted = nil
	if p.Agents {
		salt, err := p.awaitWorkers(ctx)
		if err != nil {
			return err
		}
		if salt != "" {
			p.salted = &Expander{BlockSize: p.BlockSize, Seed: kvevent.SeedFor("", salt)}
		}
		return p.onlyOurs(ctx)
	}
	for i := 0; i < p.Workers; i++ {
		id := RankOf(i).Worker
		if err := p.deregister(ctx, id); err != nil {
			return fmt.Errorf("deregister worker %d: %w", id, err)
		}
		w := raftfsm.WorkerInfo{ID: id, BlockSize: p.BlockSize, Capacity: [kvevent.NumTiers]int64{p.CapacityBlocks}}
		cctx, cancel := context.WithTimeout(ctx, p.Timeout)
		err := p.Client.RegisterWorker(cctx, w)
		cancel()
		if err != nil {
			return fmt.Errorf("register worker %d: %w", id, err)
		}
	}
	return p.onlyOurs(ctx)
}

// deregister drops worker id from the cluster, if the cluster has it. A
// deregistration is not safe to send twice, so the client answers
// client.ErrOutcomeUnknown when a node may have taken it without
// answering; deregister then looks in the worker table: a worker that is
// gone is done, one still there is deregistered once more (a 404 then
// means the first one applied meanwhile). Each call is bounded by a
// Timeout of its own: the listing after a deregistration that timed out
// must not inherit its spent deadline.
func (p *Remote) deregister(ctx context.Context, id uint64) error {
	cctx, cancel := context.WithTimeout(ctx, p.Timeout)
	err := p.Client.DeregisterWorker(cctx, id)
	cancel()
	if errors.Is(err, client.ErrOutcomeUnknown) {
		cctx, cancel = context.WithTimeout(ctx, p.Timeout)
		ws, lerr := p.Client.Workers(cctx)
		cancel()
		if lerr != nil {
			return fmt.Errorf("%w; and listing the workers to see whether it applied: %w", err, lerr)
		}
		if !slices.ContainsFunc(ws, func(w api.Worker) bool { return w.WorkerID == id }) {
			return nil
		}
		cctx, cancel = context.WithTimeout(ctx, p.Timeout)
		err = p.Client.DeregisterWorker(cctx, id)
		cancel()
	}
	if err != nil && !isNotFound(err) {
		return err
	}
	return nil
}

// onlyOurs refuses a cluster with workers other than the replay's: it
// would route some requests to them, which the replay cannot serve.
func (p *Remote) onlyOurs(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	ws, err := p.Client.Workers(cctx)
	if err != nil {
		return fmt.Errorf("list workers: %w", err)
	}
	var others []uint64
	for _, w := range ws {
		if !p.ours(w.WorkerID) {
			others = append(others, w.WorkerID)
		}
	}
	if len(others) > 0 {
		return fmt.Errorf("%w: the cluster has workers %v besides the replay's 1..%d; a live replay needs a cluster of its workers only (deregister the others, or use another cluster)",
			ErrBadConfig, others, p.Workers)
	}
	return nil
}

// ours reports whether worker id is one of the replay's.
func (p *Remote) ours(id uint64) bool { return id >= 1 && id <= uint64(p.Workers) }

// awaitWorkers waits until the agents registered every worker, with the
// replay's block size and one salt, and returns that salt.
func (p *Remote) awaitWorkers(ctx context.Context) (string, error) {
	every := p.PollInterval
	if every <= 0 {
		every = 100 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var missing []uint64 // as of the last answer
	var lastErr error
	for {
		m, salt, err := p.unregistered(ctx)
		switch {
		case errors.Is(err, ErrBadConfig):
			return "", err
		case err != nil:
			lastErr = err
		case len(m) == 0:
			return salt, nil
		default:
			missing = m
		}
		select {
		case <-ctx.Done():
			if missing == nil {
				return "", fmt.Errorf("waiting for the agents to register the workers: %w (last: %v)", ctx.Err(), lastErr)
			}
			return "", fmt.Errorf("waiting for the agents to register the workers: %w; not registered: %v", ctx.Err(), missing)
		case <-t.C:
		}
	}
}

// AwaitEmpty waits until the cluster holds no block of any worker, in any
// tier: with Agents, after the workers announced an empty cache
// (WireFleet.ClearAll), so that no decision sees an earlier run's blocks.
func (p *Remote) AwaitEmpty(ctx context.Context) error {
	if p.Timeout <= 0 {
		p.Timeout = 10 * time.Second
	}
	every := p.PollInterval
	if every <= 0 {
		every = 100 * time.Millisecond
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var held map[uint64]int64
	var lastErr error
	for {
		h, err := p.heldBlocks(ctx)
		if err == nil && len(h) == 0 {
			return nil
		}
		if err != nil {
			lastErr = err
		} else {
			held = h
		}
		select {
		case <-ctx.Done():
			if held == nil {
				return fmt.Errorf("waiting for the cluster to drop the workers' blocks: %w (last: %v)", ctx.Err(), lastErr)
			}
			return fmt.Errorf("waiting for the cluster to drop the workers' blocks: %w; still held (worker: blocks): %v", ctx.Err(), held)
		case <-t.C:
		}
	}
}

// heldBlocks returns the blocks the cluster holds of each replay worker
// that holds any.
func (p *Remote) heldBlocks(ctx context.Context) (map[uint64]int64, error) {
	cctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	ws, err := p.Client.Workers(cctx)
	if err != nil {
		return nil, err
	}
	held := map[uint64]int64{}
	for _, w := range ws {
		if w.WorkerID < 1 || w.WorkerID > uint64(p.Workers) {
			continue
		}
		for _, r := range w.Ranks {
			if n := r.Blocks.Device + r.Blocks.Host + r.Blocks.Disk + r.Blocks.External; n > 0 {
				held[w.WorkerID] += n
			}
		}
	}
	return held, nil
}

// unregistered returns the ids of the workers the cluster does not know,
// and the salt of those it knows. Workers registered with different salts
// are ErrBadConfig: a route carries the content hashes of one salt, so the
// blocks of the others would never match.
func (p *Remote) unregistered(ctx context.Context) ([]uint64, string, error) {
	cctx, cancel := context.WithTimeout(ctx, p.Timeout)
	defer cancel()
	ws, err := p.Client.Workers(cctx)
	if err != nil {
		return nil, "", err
	}
	byID := make(map[uint64]api.Worker, len(ws))
	for _, w := range ws {
		byID[w.WorkerID] = w
	}
	var missing []uint64
	var salts []string              // in order of first worker
	bySalt := map[string][]uint64{} // the registered workers of each salt
	for i := 0; i < p.Workers; i++ {
		id := RankOf(i).Worker
		w, ok := byID[id]
		if !ok {
			missing = append(missing, id)
			continue
		}
		if w.BlockSize != p.BlockSize {
			return nil, "", fmt.Errorf("%w: worker %d is registered with block size %d, the replay's is %d", ErrBadConfig, id, w.BlockSize, p.BlockSize)
		}
		if _, ok := bySalt[w.Salt]; !ok {
			salts = append(salts, w.Salt)
		}
		bySalt[w.Salt] = append(bySalt[w.Salt], id)
	}
	if len(salts) > 1 {
		// The salts are not named: a cache salt keeps tenants apart.
		groups := make([]string, len(salts))
		for i, s := range salts {
			groups[i] = fmt.Sprint(bySalt[s])
		}
		return nil, "", fmt.Errorf("%w: the workers' agents salt their block hashes differently (workers of one salt: %s); a live replay routes with the hashes of one salt, so give every agent the same --salt, or none",
			ErrBadConfig, strings.Join(groups, ", "))
	}
	var salt string
	if len(salts) == 1 {
		salt = salts[0]
	}
	return missing, salt, nil
}

func isNotFound(err error) bool {
	var ce *client.Error
	return errors.As(err, &ce) && ce.StatusCode == 404
}

func (p *Remote) Name() string { return "router_live" }

// ctx is the context of one call: Timeout, cut short by Stop; once Stop is
// done, the cleanup's deadline (the cleanup's calls must not end with it).
func (p *Remote) ctx() (context.Context, context.CancelFunc) {
	if p.stopping() {
		return context.WithDeadline(context.Background(), p.stopBy)
	}
	parent := context.Background()
	if p.Stop != nil {
		parent = p.Stop
	}
	return context.WithTimeout(parent, p.Timeout)
}

// stopping reports whether Stop is done or the cluster stopped answering
// (ErrNoAnswer), starting the cleanup's deadline the first time it is
// seen.
func (p *Remote) stopping() bool {
	if p.noAnswer == nil && (p.Stop == nil || p.Stop.Err() == nil) {
		return false
	}
	if p.stopBy.IsZero() {
		grace := p.StopGrace
		if grace <= 0 {
			grace = 3 * time.Second
		}
		p.stopBy = time.Now().Add(grace)
	}
	return true
}

// heard counts a call's outcome toward giving up on the cluster
// (maxSilentCalls): an answer, a refusal included, starts the count
// again; a call that timed out or reached no node adds one. Once stopped
// nothing counts: the cleanup has its own bounds.
func (p *Remote) heard(err error) {
	if p.noAnswer != nil || (p.Stop != nil && p.Stop.Err() != nil) {
		return
	}
	if !unanswered(err) {
		p.silent = 0
		return
	}
	p.silent++
	if p.silent >= maxSilentCalls {
		p.noAnswer = fmt.Errorf("%w: %d calls in a row got no answer, the last: %v", ErrNoAnswer, p.silent, err)
	}
}

// unanswered reports whether a call that failed with err got no answer:
// it timed out or reached no node, or its answer was lost. An error
// answer of the API (*client.Error, even wrapped in ErrOutcomeUnknown) is
// an answer.
func unanswered(err error) bool {
	var ce *client.Error
	if err == nil || errors.As(err, &ce) {
		return false
	}
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, client.ErrUnreachable) || errors.Is(err, client.ErrOutcomeUnknown)
}

// flush sends the buffered events, so the index has them before the next
// decision, as an engine's events would have arrived by then.
func (p *Remote) flush() error {
	if len(p.pending) == 0 {
		return nil
	}
	ctx, cancel := p.ctx()
	defer cancel()
	acks, err := p.Client.IngestEvents(ctx, p.pending)
	p.Calls++
	p.heard(err)
	if err != nil {
		return fmt.Errorf("ingest events: %w", err)
	}
	for _, a := range acks {
		if a.Gap {
			return fmt.Errorf("ingest events: gap at rank %v (cursor %d)", a.Rank, a.Cursor)
		}
	}
	p.pending = p.pending[:0]
	return nil
}

// Route books the request on the worker the cluster chooses. Once the
// cluster stopped answering (heard) it sends nothing and returns
// ErrNoAnswer, as it does for the call that found so.
func (p *Remote) Route(q *RouteQuery, _ int64) (int, int, error) {
	if p.noAnswer != nil {
		return 0, 0, p.noAnswer
	}
	if err := p.flush(); err != nil {
		if p.noAnswer != nil {
			return 0, 0, p.noAnswer
		}
		return 0, 0, err
	}
	local := q.Local
	if p.salted != nil {
		if q.Req == nil {
			return 0, 0, fmt.Errorf("%w: request %s has no trace row to hash with the agents' salt", ErrBadConfig, q.ID)
		}
		local, _ = p.salted.Blocks(q.Req)
	}
	ctx, cancel := p.ctx()
	defer cancel()
	res, err := p.Client.Route(ctx, api.RouteRequest{BlockHashes: local, ISL: q.ISL, Book: true, RequestID: p.prefix + q.ID,
		Brief: true, Overrides: p.Overrides})
	p.Calls++
	p.heard(err)
	if err != nil {
		// The leader may have booked it before the answer was lost (a
		// timeout, a connection cut): give the booking back, as a free of
		// an id is idempotent.
		if mayHaveBooked(err) {
			if ferr := p.free(q.ID); ferr != nil {
				p.fail(true, "request %s: free after its route failed (%v): %v", q.ID, err, ferr)
			}
		}
		if p.noAnswer != nil {
			return 0, 0, p.noAnswer
		}
		return 0, 0, err
	}
	if !p.ours(res.WorkerID) {
		// Registered after Setup: give its booking back, so that its
		// load does not stay counted on the cluster.
		p.Finished(q.ID, 0)
		return -1, 0, fmt.Errorf("the cluster chose worker %d, which is not one of the replay's 1..%d", res.WorkerID, p.Workers)
	}
	o := res.Overlap
	return int(res.WorkerID) - 1, int(o.Device+o.Host+o.Disk+o.External) * res.BlockSize, nil
}

func (p *Remote) Observe(ev *kvevent.Event, _ int64) {
	if p.Agents {
		return // the agents bring the events
	}
	c := *ev
	c.Blocks = slices.Clone(ev.Blocks)
	c.Removed = slices.Clone(ev.Removed)
	for i := range p.pending {
		if p.pending[i].Rank == ev.Rank {
			p.pending[i].Events = append(p.pending[i].Events, c)
			return
		}
	}
	p.pending = append(p.pending, raftfsm.RankBatch{Rank: ev.Rank, Events: []kvevent.Event{c}})
}

func (p *Remote) Started(*RouteQuery, int, int, int64) {}

// PrefillDone marks the request's prefill done on the cluster; a failure
// is counted (LifecycleFailures): the booking stays counted as prefill
// load until it is freed.
func (p *Remote) PrefillDone(id string, _ int64) {
	if p.stopping() {
		return // the request's free follows at once: it drops the booking whole
	}
	ctx, cancel := p.ctx()
	defer cancel()
	err := p.Client.PrefillDone(ctx, p.prefix+id)
	p.Calls++
	p.heard(err)
	if err != nil {
		p.fail(false, "request %s: prefill done: %v", id, err)
	}
}

// Finished frees the request's booking on the cluster; a free that fails
// twice is counted (LifecycleFailures), as a booking that may remain.
func (p *Remote) Finished(id string, _ int64) {
	if err := p.free(id); err != nil {
		p.fail(true, "request %s: free: %v", id, err)
	}
}

// free frees the booking of request id, trying twice: a free is
// idempotent by request id. Once Stop is done (or the cluster stopped
// answering) it tries once, and not at all after a free failed then: the
// cluster is most likely not answering, and each try would wait out the
// cleanup's deadline.
func (p *Remote) free(id string) error {
	tries := 2
	if p.stopping() {
		if p.gaveUp != nil {
			return fmt.Errorf("%w (%v)", errGaveUp, p.gaveUp)
		}
		tries = 1
	}
	var err error
	for range tries {
		ctx, cancel := p.ctx()
		err = p.Client.Free(ctx, p.prefix+id)
		cancel()
		p.Calls++
		p.heard(err)
		if err == nil {
			return nil
		}
	}
	if p.stopping() {
		p.gaveUp = err
	}
	return err
}

// mayHaveBooked reports whether a route that failed with err may still
// have been booked: any failure but one that reached no node
// (client.ErrUnreachable) or an answer that no worker could take it
// (overloaded, no_workers). Other refusals may follow a try that booked:
// the client sends a route on to the next endpoint after a forward broke,
// and the leader refuses the second try as already booked on a worker that
// is no longer a candidate (400 invalid) while the first booking stands. A
// free of an id never booked is answered 204, so freeing is cheap.
func mayHaveBooked(err error) bool {
	if errors.Is(err, client.ErrUnreachable) {
		return false
	}
	var ce *client.Error
	if !errors.As(err, &ce) {
		return true
	}
	return ce.Reason != api.ReasonOverloaded && ce.Reason != api.ReasonNoWorkers
}
