package sim

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/tinylib/msgp/msgp"
)

// The engine's KV event wire (shared/design/wire.md), as the simulated
// workers of a live replay publish it: each batch a msgpack array
// [ts, events, data_parallel_rank] with every event in vLLM's array
// encoding (tagged arrays, fields by position, trailing defaulted fields
// omitted), medium "GPU". The ZMQ transport is package sim/enginepub.

// WireEvent is one KV cache change as an engine publishes it.
type WireEvent struct {
	Kind kvevent.Kind // KindStored, KindRemoved or KindCleared
	// Hashes are the engine block hashes stored (a chain: each block's
	// parent is the one before, the first one's is Parent when HasParent)
	// or removed.
	Hashes    []uint64
	Parent    uint64
	HasParent bool
	// Tokens are a store's tokens: every token of its blocks, in order,
	// len(Hashes) × BlockSize of them.
	Tokens    []uint32
	BlockSize int
}

// AppendBatch appends to dst the msgpack payload of one batch of events,
// [ts, [event, ...], dpRank], and returns it:
//
//	["BlockStored", block_hashes, parent_block_hash|nil, token_ids, block_size, nil (lora_id), "GPU"]
//	["BlockRemoved", block_hashes, "GPU"]
//	["AllBlocksCleared"]
//
// vLLM's field order; lora_name, extra_keys and the later optional fields
// are left out, as the engine omits trailing defaulted fields.
func AppendBatch(dst []byte, ts float64, evs []WireEvent, dpRank uint32) []byte {
	dst = msgp.AppendArrayHeader(dst, 3)
	dst = msgp.AppendFloat64(dst, ts)
	dst = msgp.AppendArrayHeader(dst, uint32(len(evs)))
	for i := range evs {
		dst = AppendWireEvent(dst, &evs[i])
	}
	return msgp.AppendUint32(dst, dpRank)
}

// AppendWireEvent appends one event in the array encoding (see AppendBatch).
func AppendWireEvent(dst []byte, e *WireEvent) []byte {
	switch e.Kind {
	case kvevent.KindStored:
		dst = msgp.AppendArrayHeader(dst, 7)
		dst = msgp.AppendString(dst, "BlockStored")
		dst = appendHashes(dst, e.Hashes)
		if e.HasParent {
			dst = msgp.AppendUint64(dst, e.Parent)
		} else {
			dst = msgp.AppendNil(dst)
		}
		dst = msgp.AppendArrayHeader(dst, uint32(len(e.Tokens)))
		for _, t := range e.Tokens {
			dst = msgp.AppendUint32(dst, t)
		}
		dst = msgp.AppendInt(dst, e.BlockSize)
		dst = msgp.AppendNil(dst) // lora_id
		return msgp.AppendString(dst, "GPU")
	case kvevent.KindRemoved:
		dst = msgp.AppendArrayHeader(dst, 3)
		dst = msgp.AppendString(dst, "BlockRemoved")
		dst = appendHashes(dst, e.Hashes)
		return msgp.AppendString(dst, "GPU")
	default:
		dst = msgp.AppendArrayHeader(dst, 1)
		return msgp.AppendString(dst, "AllBlocksCleared")
	}
}

func appendHashes(dst []byte, hs []uint64) []byte {
	dst = msgp.AppendArrayHeader(dst, uint32(len(hs)))
	for _, h := range hs {
		dst = msgp.AppendUint64(dst, h)
	}
	return dst
}

// BatchPublisher sends one worker's batches (msgpack payloads, as
// AppendBatch writes them) on its engine wire: *enginepub.Publisher. The
// payload is only valid during the call.
type BatchPublisher interface {
	Publish(payload []byte) (seq uint64, err error)
}

// ErrWire means a worker's events could not be put on the wire.
var ErrWire = errors.New("engine wire")

// WireFleet puts the events of a replay's workers on their engine wires:
// it collects each worker's events (Observe), with the real tokens of the
// blocks stored, and publishes them as one batch per worker (Flush).
//
// A store's tokens come from the request the workers are storing blocks
// for, set by Query: in the v1 replay (Replay) every block is stored while
// the request just routed acquires its blocks, so WithWire sets it on each
// Route. A store of blocks that are not the current request's is an error
// (ErrWire), returned by the next Flush.
//
// An error stays: once a worker's events could not be put on its wire,
// whoever follows it has lost them for good (a publisher that fails
// consumes no sequence number, so a subscriber sees no gap to heal from),
// and every later decision would be made on a view that misses them. Every
// later Flush returns the error, and Replay stops on it.
type WireFleet struct {
	BlockSize int              // engine tokens per block
	Pubs      []BatchPublisher // one per worker, indexed like the replay's workers
	// Now gives batch timestamps (seconds since the epoch); nil is the
	// wall clock.
	Now func() float64

	// Counters.
	Batches, Events, Blocks uint64

	exp     Expander
	cur     *RouteQuery
	tokens  []uint32 // cur's tokens, once needed
	pending [][]WireEvent
	buf     []byte
	err     error
}

// Query sets the request whose blocks the workers store next.
func (f *WireFleet) Query(q *RouteQuery) {
	f.cur, f.tokens = q, nil
}

// Observe takes one event of a worker (RankOf(i) for worker i). The event
// is copied.
func (f *WireFleet) Observe(ev *kvevent.Event) {
	if f.err != nil {
		return
	}
	w := int(ev.Rank.Worker) - 1
	if w < 0 || w >= len(f.Pubs) {
		f.err = fmt.Errorf("%w: event of rank %v, %d workers", ErrWire, ev.Rank, len(f.Pubs))
		return
	}
	if f.pending == nil {
		f.pending = make([][]WireEvent, len(f.Pubs))
	}
	we := WireEvent{Kind: ev.Kind, Parent: ev.Parent, HasParent: ev.HasParent, BlockSize: f.BlockSize}
	switch ev.Kind {
	case kvevent.KindStored:
		we.Hashes = make([]uint64, len(ev.Blocks))
		for i, b := range ev.Blocks {
			we.Hashes[i] = b.EngineHash
		}
		toks, err := f.storedTokens(ev)
		if err != nil {
			f.err = err
			return
		}
		we.Tokens = toks
		f.Blocks += uint64(len(ev.Blocks))
	case kvevent.KindRemoved:
		we.Hashes = slices.Clone(ev.Removed)
	}
	f.pending[w] = append(f.pending[w], we)
	f.Events++
}

// storedTokens returns a copy of the tokens of a store's blocks, found in
// the current request.
func (f *WireFleet) storedTokens(ev *kvevent.Event) ([]uint32, error) {
	q := f.cur
	if q == nil || q.Req == nil {
		return nil, fmt.Errorf("%w: blocks stored with no current request (or one without its trace row)", ErrWire)
	}
	first := slices.Index(q.Seq, ev.Blocks[0].EngineHash)
	if first < 0 || first+len(ev.Blocks) > len(q.Seq) {
		return nil, fmt.Errorf("%w: stored block %#x is not one of request %s's", ErrWire, ev.Blocks[0].EngineHash, q.ID)
	}
	for i, b := range ev.Blocks {
		if q.Seq[first+i] != b.EngineHash || q.Local[first+i] != b.LocalHash {
			return nil, fmt.Errorf("%w: stored block %d of request %s does not match it", ErrWire, first+i, q.ID)
		}
	}
	if f.tokens == nil {
		f.exp.BlockSize = f.BlockSize
		f.tokens = f.exp.Tokens(q.Req)
	}
	from, to := first*f.BlockSize, (first+len(ev.Blocks))*f.BlockSize
	if to > len(f.tokens) {
		return nil, fmt.Errorf("%w: request %s has %d tokens, block %d ends at %d", ErrWire, q.ID, len(f.tokens), first+len(ev.Blocks)-1, to)
	}
	return slices.Clone(f.tokens[from:to]), nil
}

// Flush publishes each worker's pending events as one batch, workers in
// order, and returns the first error met (a publisher's, or an event that
// could not be encoded), now or by an earlier Flush or Observe: it stays
// (see WireFleet). A worker's events stay pending until its publisher took
// them.
func (f *WireFleet) Flush() error {
	if f.err != nil {
		return f.err
	}
	ts := 0.0
	for w, evs := range f.pending {
		if len(evs) == 0 {
			continue
		}
		if ts == 0 {
			ts = f.now()
		}
		f.buf = AppendBatch(f.buf[:0], ts, evs, 0)
		if _, err := f.Pubs[w].Publish(f.buf); err != nil {
			f.err = fmt.Errorf("%w: worker %d: %w", ErrWire, w+1, err)
			return f.err
		}
		clear(evs)
		f.pending[w] = evs[:0]
		f.Batches++
	}
	return nil
}

// ClearAll publishes an AllBlocksCleared batch on every worker's wire
// (after whatever is pending): the workers start empty, and whoever
// follows their wires drops what it held of them — an earlier run's
// blocks, which a subscriber that outlived that run still has.
func (f *WireFleet) ClearAll() error {
	if err := f.Flush(); err != nil {
		return err
	}
	for w, pub := range f.Pubs {
		f.buf = AppendBatch(f.buf[:0], f.now(), []WireEvent{{Kind: kvevent.KindCleared}}, 0)
		if _, err := pub.Publish(f.buf); err != nil {
			f.err = fmt.Errorf("%w: worker %d: %w", ErrWire, w+1, err)
			return f.err
		}
		f.Batches++
		f.Events++
	}
	return nil
}

func (f *WireFleet) now() float64 {
	if f.Now != nil {
		return f.Now()
	}
	return float64(time.Now().UnixNano()) / 1e9
}

// WithWire returns p with its workers' events also put on the fleet's
// engine wires: every event goes to the fleet, then to p; the fleet
// publishes what it holds before each route and after each request
// started (when its blocks were stored). p is unchanged otherwise. A wire
// error (ErrWire) is returned by the next Route, which stops Replay. Call
// the fleet's Flush once the replay is over, and check its error.
func WithWire(p Policy, f *WireFleet) Policy { return &wirePolicy{Policy: p, f: f} }

type wirePolicy struct {
	Policy
	f *WireFleet
}

// LifecycleFailures are the wrapped policy's, when it reports any
// (LifecycleReporter).
func (p *wirePolicy) LifecycleFailures() LifecycleFailures {
	if lr, ok := p.Policy.(LifecycleReporter); ok {
		return lr.LifecycleFailures()
	}
	return LifecycleFailures{}
}

func (p *wirePolicy) Route(q *RouteQuery, now int64) (int, int, error) {
	if err := p.f.Flush(); err != nil {
		return 0, 0, err
	}
	p.f.Query(q)
	return p.Policy.Route(q, now)
}

func (p *wirePolicy) Observe(ev *kvevent.Event, now int64) {
	p.f.Observe(ev)
	p.Policy.Observe(ev, now)
}

func (p *wirePolicy) Started(q *RouteQuery, worker, cached int, now int64) {
	p.Policy.Started(q, worker, cached, now)
	// An error stays in the fleet, for the next Route's Flush.
	_ = p.f.Flush()
}
