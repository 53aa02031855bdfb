package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/zeebo/xxh3"
)

// DefaultBlockSize is the block size used to hash token ids when no worker
// has registered one.
const DefaultBlockSize = 16

// routeScratch is the per-call working memory of Route, pooled so that a
// route decision allocates little beyond its result.
type routeScratch struct {
	local   []uint64
	seq     []uint64
	matches indexer.Matches
	loads   []indexer.RankLoad
	pot     indexer.PotentialScratch
	cands   []indexer.Candidate
	// dec is what Select fills: its candidates' scores (one per rank)
	// stay with the scratch, and the result gets a copy of what it needs.
	dec indexer.Decision
}

var routePool = sync.Pool{New: func() any { return new(routeScratch) }}

// pendingBooks is the bookings this node (as leader) decided and proposed
// and its FSM has not applied yet: semantics.md §6's "a node applies its
// own bookings optimistically and reconciles when the entry commits".
//
// A booked route holds mu from reading the committed load to recording
// its own booking here, so that booked routes decide one after another,
// each with the load of those decided before it, committed or pending:
// without it, the routes that arrived before the first booking committed
// all went to the same rank, and all were admitted past the busy
// thresholds. Nothing under mu waits on I/O. The FSM's apply of a booking
// takes mu too and settles the booking as it books it (FSM.applyBookAdd),
// so that a decision counts a booking once, pending or applied. A route
// also drops its booking when its apply returns (a proposal that failed
// or may never apply, as one a user restore aborted); one that still
// applies later (the route stopped waiting) goes uncounted until it does.
// Leadership lost clears them all: a new leader decides from what it
// applies. The pending bookings watch the tracker (indexer.NewPending),
// whose every change (an apply of a booking, a free, a sweep, a rank's
// removal, a restore) is made under mu as well: a pending booking's blocks
// count while no live booking of its rank holds them, however the live
// bookings change meanwhile.
type pendingBooks struct {
	mu sync.Mutex
	p  *indexer.Pending
}

func (pb *pendingBooks) len() int {
	pb.mu.Lock()
	defer pb.mu.Unlock()
	return pb.p.Len()
}

func (pb *pendingBooks) drop(id string, ticket uint64) {
	if ticket == 0 {
		return
	}
	pb.mu.Lock()
	pb.p.Drop(id, ticket)
	pb.mu.Unlock()
}

func (pb *pendingBooks) clear() {
	pb.mu.Lock()
	pb.p.Clear()
	pb.mu.Unlock()
}

// blockSizeOf returns the block size /v1 routes hash with, the worker it
// is from, and whether any worker has one (DefaultBlockSize when none
// does): the smallest id's of the workers without a model (withoutModel),
// the /v1 workers, which serve one model and must agree. A worker with a
// model is its namespace's (a compatible API's, hashing with its own block
// size): it sets the block size only when no worker without a model has
// one, by the smallest id's as before any worker had a model, so that a
// cluster of model workers alone routes /v1 as it did; otherwise another
// model's worker of another block size, were its id the smallest, took
// every /v1 route and held /v1 workers to its block size. "None" is ok,
// not an id: every id is a worker's, MaxUint64 too (a ^0 sentinel skipped
// that worker here while spliceWorker took it, so that replicas routed
// with different block sizes depending on how their batches fell).
func blockSizeOf(ws map[uint64]WorkerInfo) (bs int, from uint64, ok, plain bool) {
	bs = DefaultBlockSize
	for id, w := range ws {
		if w.BlockSize > 0 && (!ok || setsBlockSizeBefore(id, withoutModel(w), from, plain)) {
			bs, from, ok, plain = w.BlockSize, id, true, withoutModel(w)
		}
	}
	return bs, from, ok, plain
}

// setsBlockSizeBefore reports whether worker id (plain: without a model)
// comes before worker from (fromPlain) in blockSizeOf's order: the
// workers without a model first, then by id.
func setsBlockSizeBefore(id uint64, plain bool, from uint64, fromPlain bool) bool {
	if plain != fromPlain {
		return plain
	}
	return id < from
}

// withoutModel reports whether w is a /v1 worker without a model, in no
// compatible API's namespace: the workers whose block size /v1 routes
// hash with (blockSizeOf) and RegisterWorker holds to it (checkBlockSize).
func withoutModel(w WorkerInfo) bool { return w.Model == "" && w.Tenant == "" }

// Route scores every registered rank of the block size it hashes with
// (servesBlockSize) for the query from this node's local index and load
// view (slightly stale is fine for routing) and returns the decision. With q.Book the request is booked on the chosen rank through
// Raft before Route returns, so a follower answers ErrNotLeader for it,
// and a new leader ErrNoLeader (retry) until its Barrier passed;
// the leader decides booked routes one at a time, each with the load of
// the bookings it decided before, applied or still pending (pendingBooks).
func (n *Node) Route(ctx context.Context, q RouteQuery) (RouteResult, error) {
	for try := 1; ; try++ {
		res, err := n.route(ctx, q)
		if !errors.Is(err, errRankLeft) || try == routeTries {
			return res, err
		}
		// The chosen rank's worker left between the decision and the
		// booking's commit: decide again without it.
	}
}

// MaxISL is the longest input a route or booking may give, in tokens:
// beyond any model's context, and small enough that no number of bookings
// a rank could hold overflows its prefill load.
const MaxISL = 1 << 32

// routeTries bounds the decisions of one Route whose chosen rank keeps
// leaving before the booking commits.
const routeTries = 3

// errRankLeft is the error of a route whose booking found its rank gone.
// It wraps indexer.ErrNoWorkers: a caller that still meets it after
// routeTries decisions retries later, as with no workers at all.
// RendezvousKey is the key of a route's rendezvous tie-break
// (indexer.Request.FirstBlockHash): the hash of the prompt's first block
// (local[0]), so that requests sharing a prefix and tied on cost keep
// landing on one rank. A prompt shorter than one block has no block: it
// keys on the hash of its tokens, seeded as its blocks would be, or,
// given by its length alone, on its request id. Such prompts keyed 0
// once, all of them, and every unbooked one of them went to the same rank
// whenever the ranks tied (idle ones always do). 0 when there is neither.
func RendezvousKey(local []uint64, tokens []uint32, lora, salt, requestID string) uint64 {
	switch {
	case len(local) > 0:
		return local[0]
	case len(tokens) > 0:
		return kvevent.LocalHash(tokens, kvevent.SeedFor(lora, salt))
	case requestID != "":
		return xxh3.HashString(requestID)
	}
	return 0
}

var errRankLeft = fmt.Errorf("%w: the chosen rank left before its booking committed", indexer.ErrNoWorkers)

func (n *Node) route(ctx context.Context, q RouteQuery) (RouteResult, error) {
	start := time.Now()
	// The block size and the candidates of one publish (workerView).
	view := n.fsm.published()
	bs := view.blockSize
	if q.BlockSize > 0 {
		bs = q.BlockSize
	}
	sc := routePool.Get().(*routeScratch)
	defer routePool.Put(sc)
	local := q.LocalHashes
	if len(q.Tokens) > 0 {
		if len(local) > 0 {
			return RouteResult{}, fmt.Errorf("%w: give token ids or block hashes, not both", ErrInvalid)
		}
		sc.local = kvevent.LocalHashes(sc.local[:0], q.Tokens, bs, kvevent.SeedFor(q.LoRA, q.Salt))
		local = sc.local
	}
	isl := q.ISL
	if isl == 0 {
		isl = len(q.Tokens)
		if isl == 0 {
			isl = len(local) * bs
		}
	}
	if isl <= 0 {
		return RouteResult{}, fmt.Errorf("%w: an empty prompt", ErrInvalid)
	}
	if need := max(len(q.Tokens), len(local)*bs); isl < need {
		// A booking would record an input length below the tokens of the
		// blocks it holds, and count less prefill than the prompt's.
		return RouteResult{}, fmt.Errorf("%w: input length (isl) %d is below the prompt's %d tokens (%d full blocks of %d)",
			ErrInvalid, isl, need, len(local), bs)
	}
	if isl > MaxISL {
		return RouteResult{}, fmt.Errorf("%w: input length %d is over %d tokens", ErrInvalid, isl, MaxISL)
	}
	if q.Book && q.RequestID == "" {
		return RouteResult{}, fmt.Errorf("%w: booking needs a request id", ErrInvalid)
	}
	if q.Book {
		// A booked route decides from the leader's load view: a new
		// leader's may still lack bookings its predecessor acknowledged
		// until its Barrier passed (CheckLeader), and would book onto
		// ranks they made busy.
		if err := n.CheckLeader(); err != nil {
			return RouteResult{}, err
		}
	}
	seq := q.SeqHashes
	if len(seq) == 0 {
		sc.seq = kvevent.SequenceHashes(sc.seq[:0], local)
		seq = sc.seq
	}
	var st RouteStages
	hashed := time.Now()
	st.Hash = hashed.Sub(start)
	settings := n.fsm.Settings()
	n.fsm.Index().FindMatchesByTier(local, settings.View, false, &sc.matches)
	matched := time.Now()
	st.Match = matched.Sub(hashed)
	n.lookupSeconds.Observe(st.Match.Seconds())
	// Candidates: every registered rank of a worker of the block size the
	// route hashes with (servesBlockSize), in rank order (deterministic).
	// The filter is the caller's code: it runs before the pending
	// bookings' lock, which the FSM's apply takes too.
	if bs == view.blockSize {
		sc.cands = append(sc.cands[:0], view.routeCands...)
	} else {
		// A namespace's own block size (q.BlockSize, the compatible
		// APIs): its queries filter the candidates anyway.
		sc.cands = sc.cands[:0]
		for _, c := range view.cands {
			if servesBlockSize(view.workers[c.Rank.Worker], bs) {
				sc.cands = append(sc.cands, c)
			}
		}
	}
	if q.Filter != nil {
		sc.cands = slices.DeleteFunc(sc.cands, func(c indexer.Candidate) bool { return !q.Filter(c.Rank) })
	}
	// A booked route decides under the pending bookings' lock, with their
	// load (pendingBooks); an unbooked one reads the committed load only,
	// as every node does, and takes no lock shared with other routes.
	pending := &n.fsm.pending
	if q.Book {
		pending.mu.Lock()
	}
	var idle int64
	sc.loads, idle = n.fsm.Sequences().PotentialDecodeBlocks(sc.loads[:0], seq, &sc.pot)
	for i := range sc.cands {
		sc.cands[i].PotentialDecodeBlocks = idle
	}
	pos := func(r kvevent.Rank) int {
		i, ok := slices.BinarySearchFunc(sc.cands, r, func(c indexer.Candidate, r kvevent.Rank) int { return c.Rank.Compare(r) })
		if !ok {
			return -1
		}
		return i
	}
	for _, m := range sc.matches.Ranks {
		if i := pos(m.Rank); i >= 0 {
			sc.cands[i].Overlap = m.Blocks
		}
	}
	for _, l := range sc.loads {
		if i := pos(l.Rank); i >= 0 {
			sc.cands[i].Load = l.Load
			sc.cands[i].PotentialDecodeBlocks = l.PotentialDecodeBlocks
		}
	}
	if q.Book {
		pending.p.AddTo(sc.cands, seq)
	}
	first := q.TieKey
	if first == 0 {
		first = RendezvousKey(local, q.Tokens, q.LoRA, q.Salt, q.RequestID)
	}
	loaded := time.Now()
	st.Load = loaded.Sub(matched)
	res := RouteResult{BlockSize: bs}
	params := settings.Params.With(q.Overrides)
	req := indexer.Request{ISL: isl, BlockSize: bs, FirstBlockHash: first}
	var err error
	if params.Temperature > 0 {
		// Only a sampled decision draws from the node's random source: a
		// decision at temperature 0 takes no lock shared by every route.
		n.rngMu.Lock()
		err = indexer.Select(params, req, sc.cands, n.rng, &sc.dec)
		n.rngMu.Unlock()
	} else {
		err = indexer.Select(params, req, sc.cands, nil, &sc.dec)
	}
	scored := time.Now()
	st.Score = scored.Sub(loaded)
	res.Stages = st
	if errors.Is(err, indexer.ErrOverloaded) && q.Book {
		// A retry of a route whose booking made its rank (or the last
		// free one) busy: the request is booked, so the answer is its
		// rank, not a refusal that leaves the load counted with nobody
		// to free it. The booking's apply below confirms it. A try still
		// pending counts as booked: its booking is on its way.
		r, ok := n.fsm.Sequences().RankOf(q.RequestID)
		if !ok {
			r, ok = pending.p.RankOf(q.RequestID)
		}
		if ok && sc.dec.Keep(r) {
			err = nil
		}
	}
	if err != nil {
		if q.Book {
			pending.mu.Unlock()
		}
		// On ErrOverloaded the scores are for the operator: all of them.
		res.Decision = sc.dec
		res.Decision.Candidates = nil
		if len(sc.dec.Candidates) > 0 {
			res.Decision.Candidates = slices.Clone(sc.dec.Candidates)
		}
		return res, err
	}
	if q.Prefer != nil {
		sc.dec.Prefer(*q.Prefer)
	}
	if q.Book {
		c := sc.dec.Chosen()
		// Cached blocks in any tier spare their prefill compute (the
		// scorer weighs what loading them costs); an isl given below the
		// blocks' tokens caps them.
		b := Booking{ID: q.RequestID, Rank: sc.dec.Rank, SeqHashes: seq, ISL: isl,
			CachedTokens: min(int(c.OverlapBlocks)*bs, isl)}
		// Pending until its apply settles it; a retry of an id pending or
		// known to the tracker adds nothing (ticket 0).
		ticket := pending.p.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens)
		pending.mu.Unlock()
		resp, err := n.apply(ctx, encodeBook(now(), []bookOp{{kind: bookAdd, b: b}}))
		pending.drop(b.ID, ticket)
		res.Stages.Book = time.Since(scored)
		if err != nil {
			return res, fmt.Errorf("book %s: %w", q.RequestID, err)
		}
		bo, _ := resp.(bookOutcome)
		switch {
		case bo.left:
			return res, fmt.Errorf("book %s on %v: %w", q.RequestID, bo.rank, errRankLeft)
		case bo.freed:
			// The id was booked and freed (or expired) before, and its
			// tombstone stands: ids are single-use, nothing is booked.
		case !bo.live:
			return res, fmt.Errorf("%w: book %s: nothing booked: %v", ErrInvalid, q.RequestID, bo.err)
		case sc.dec.Keep(bo.rank):
			// Booked by this route, or by an earlier try of it (a retry
			// after a lost answer or a leader change): answer the rank
			// the load is counted on.
			res.Booked = true
		default:
			// Invalid for /v1 (400), and a *BookedElsewhereError for a
			// caller that names the rank (the compatible APIs: a rank of
			// another namespace).
			return res, fmt.Errorf("%w: %w, which is not a candidate of this request", ErrInvalid,
				&BookedElsewhereError{ID: q.RequestID, Rank: bo.rank})
		}
	}
	// The decision outlives the pooled scratch: give it its own candidates
	// (only the chosen one when brief).
	res.Decision = sc.dec
	if q.Brief {
		res.Decision.Candidates = []indexer.CandidateScore{*sc.dec.Chosen()}
		res.Decision.Index = 0
	} else {
		res.Decision.Candidates = slices.Clone(sc.dec.Candidates)
	}
	return res, nil
}
