package api

import (
	"fmt"
	"math"
	"net"
	"strconv"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Limits on strings a client supplies. They keep ids printable and logs and
// Raft entries small; nothing else depends on them. Ids, names and ranks
// are bounded as the compatible API bounds them (internal/limits).
const (
	maxIDLen    = limits.MaxIDLen   // request ids, member ids
	maxNameLen  = limits.MaxNameLen // LoRA names, cache salts, models, endpoints
	maxAddrLen  = 512               // host:port
	maxBlockLen = 1 << 20
)

// checkID refuses an empty, overlong or non-printable id: ids travel in URL
// paths and log lines.
func checkID(what, id string) error {
	if p := limits.ID(id); p != "" {
		return invalidf("%s %s", what, p)
	}
	return nil
}

func checkName(what, s string) error {
	if p := limits.Name(s); p != "" {
		return invalidf("%s %s", what, p)
	}
	return nil
}

func checkAddr(what, addr string) error {
	if addr == "" {
		return invalidf("%s is empty (want host:port)", what)
	}
	if len(addr) > maxAddrLen {
		return invalidf("%s is %d bytes long (at most %d)", what, len(addr), maxAddrLen)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return invalidf("%s %q: %v (want host:port)", what, addr, err)
	}
	if host == "" {
		return invalidf("%s %q has no host (want host:port)", what, addr)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return invalidf("%s %q: port %q is not a number in 1-65535", what, addr, port)
	}
	return nil
}

func parseUint(what, s string, bits int) (uint64, error) {
	v, err := strconv.ParseUint(s, 10, bits)
	if err != nil {
		return 0, invalidf("%s %q is not an unsigned %d-bit decimal number", what, s, bits)
	}
	return v, nil
}

// CheckRoute returns the error a node answers req with (400 invalid) when
// the request itself is bad: a length or a weight out of range, an
// overlong name. It checks only what needs no cluster state. A client
// (kvctl) calls it to refuse bad input before sending it, with the node's
// own bounds, so the two cannot drift.
func CheckRoute(req *RouteRequest) error {
	_, err := routeQuery(req)
	return err
}

// routeQuery validates a route request and converts it.
func routeQuery(req *RouteRequest) (raftfsm.RouteQuery, error) {
	var q raftfsm.RouteQuery
	switch {
	case len(req.TokenIDs) > 0 && len(req.BlockHashes) > 0:
		return q, invalidf("give token_ids or block_hashes, not both")
	case len(req.TokenIDs) == 0 && len(req.BlockHashes) == 0 && req.ISL == 0:
		// A prompt shorter than one block has no block hash: isl alone is
		// then a valid query (it is scored on load only).
		return q, invalidf("give token_ids (the prompt), block_hashes (its blocks' content hashes), or isl")
	case req.ISL < 0 || req.ISL > raftfsm.MaxISL:
		return q, invalidf("isl = %d (want 0 to %d tokens)", req.ISL, raftfsm.MaxISL)
	case req.ISL > 0 && req.ISL < len(req.TokenIDs):
		// A booking would record fewer prompt tokens than it holds (the
		// node refuses one below its block_hashes' tokens too).
		return q, invalidf("isl = %d is below the %d token_ids (want 0, their count, or more)", req.ISL, len(req.TokenIDs))
	}
	if err := checkName("lora_name", req.LoRAName); err != nil {
		return q, err
	}
	if err := checkName("cache_salt", req.CacheSalt); err != nil {
		return q, err
	}
	// Printable, as a worker's model must be: it is a metrics label
	// (kvrouter_route_requests_total) and logged.
	if p := limits.PrintableName(req.Model); p != "" {
		return q, invalidf("model %s", p)
	}
	if req.Overrides != nil {
		// Validate the overrides alone: any valid base gives the same verdict,
		// because Validate checks each field on its own.
		if err := indexer.DefaultParams().With(req.Overrides).Validate(); err != nil {
			return q, invalidf("overrides: %v", err)
		}
	}
	if req.Book {
		if err := checkID("request_id", req.RequestID); err != nil {
			return q, fmt.Errorf("book: %w", err)
		}
	} else if req.RequestID != "" {
		if err := checkID("request_id", req.RequestID); err != nil {
			return q, err
		}
	}
	q = raftfsm.RouteQuery{
		Tokens:      req.TokenIDs,
		LocalHashes: req.BlockHashes,
		ISL:         req.ISL,
		LoRA:        req.LoRAName,
		Salt:        req.CacheSalt,
		Overrides:   req.Overrides,
		Book:        req.Book,
		RequestID:   req.RequestID,
		Brief:       req.Brief,
	}
	return q, nil
}

// workerInfo validates a registration and converts it.
func workerInfo(req *RegisterWorkerRequest) (raftfsm.WorkerInfo, error) {
	var w raftfsm.WorkerInfo
	if req.WorkerID == nil {
		return w, invalidf("worker_id is missing")
	}
	if req.BlockSize <= 0 {
		return w, invalidf("block_size = %d (want the tokens per KV block, > 0)", req.BlockSize)
	}
	// The check Node.RegisterWorker makes too: refused here, it answers 400.
	if msg := limits.DPRanks(req.DPRanks); msg != "" {
		return w, invalidf("%s", msg)
	}
	for t, c := range req.Capacity.Array() {
		if c < 0 || c > raftfsm.MaxCapacity {
			return w, invalidf("capacity_blocks.%s = %d (want 0, unknown, to %d blocks)", kvevent.Tier(t), c, int64(raftfsm.MaxCapacity))
		}
	}
	if err := checkName("endpoint", req.Endpoint); err != nil {
		return w, err
	}
	// Not only bounded: kvctl workers prints the model in a table, and a
	// line break or a tab in it would split the rank's row.
	if p := limits.PrintableName(req.Model); p != "" {
		return w, invalidf("model %s", p)
	}
	if err := checkName("salt", req.Salt); err != nil {
		return w, err
	}
	if req.LeaseMs < 0 || req.LeaseMs > raftfsm.MaxLeaseMs {
		return w, invalidf("lease_ms = %d (want 0, no lease, to %d, a year)", req.LeaseMs, int64(raftfsm.MaxLeaseMs))
	}
	return raftfsm.WorkerInfo{
		ID:        *req.WorkerID,
		DPRanks:   req.DPRanks,
		BlockSize: req.BlockSize,
		Capacity:  req.Capacity.Array(),
		Endpoint:  req.Endpoint,
		Model:     req.Model,
		Salt:      req.Salt,
		LeaseMs:   req.LeaseMs,
	}, nil
}

// toKV validates one wire event and converts it; the rank comes from its
// batch. It checks what Validate checks and what only the wire can get
// wrong: the type and tier names, and fields that do not belong to the type.
func (e *Event) toKV(rank kvevent.Rank) (kvevent.Event, error) {
	out := kvevent.Event{Rank: rank, EventID: e.EventID}
	switch e.Type {
	case EventStored:
		out.Kind = kvevent.KindStored
	case EventRemoved:
		out.Kind = kvevent.KindRemoved
	case EventCleared:
		out.Kind = kvevent.KindCleared
	case "":
		return out, invalidf("type is missing (want stored, removed or cleared)")
	default:
		return out, invalidf("unknown event type %q (want stored, removed or cleared)", e.Type)
	}
	switch {
	case out.Kind == kvevent.KindCleared:
		// A cleared event clears every tier: a tier given with it is
		// ignored, an unknown one too (docs/api.md), as EventFrom's
		// "device" on a cleared event means nothing either.
	case e.Tier == "":
		return out, invalidf("tier is missing (want device, host, disk or external)")
	default:
		t, err := kvevent.ParseTier(e.Tier)
		if err != nil {
			return out, invalidf("unknown tier %q (want device, host, disk or external)", e.Tier)
		}
		out.Tier = t
	}
	if out.Kind != kvevent.KindStored && (e.ParentHash != nil || len(e.Blocks) > 0) {
		return out, invalidf("a %s event carries no parent_hash or blocks", e.Type)
	}
	if out.Kind != kvevent.KindRemoved && len(e.Hashes) > 0 {
		return out, invalidf("a %s event carries no hashes (removed events do)", e.Type)
	}
	if len(e.Blocks) > maxBlockLen || len(e.Hashes) > maxBlockLen {
		return out, invalidf("more than %d blocks in one event", maxBlockLen)
	}
	if e.ParentHash != nil {
		out.HasParent, out.Parent = true, *e.ParentHash
	}
	if len(e.Blocks) > 0 {
		out.Blocks = make([]kvevent.Block, len(e.Blocks))
		for i, b := range e.Blocks {
			out.Blocks[i] = kvevent.Block{EngineHash: b.Hash, LocalHash: b.LocalHash}
		}
	}
	out.Removed = e.Hashes
	if err := out.Validate(); err != nil {
		return out, &httpError{code: 400, reason: ReasonInvalid, err: err}
	}
	return out, nil
}

// rankBatches validates an events request and converts it. Within a batch,
// event ids must rise by exactly one: a publisher numbers a rank's events
// consecutively, and a batch with a hole in it could not be acknowledged
// with one cursor.
func rankBatches(req *EventsRequest) ([]raftfsm.RankBatch, error) {
	if len(req.Batches) == 0 {
		return nil, invalidf("no batches")
	}
	out := make([]raftfsm.RankBatch, len(req.Batches))
	for i := range req.Batches {
		b := &req.Batches[i]
		if b.WorkerID == nil {
			return nil, invalidf("batch %d: worker_id is missing", i)
		}
		rank := kvevent.Rank{Worker: *b.WorkerID, DP: b.DPRank}
		if len(b.Events) == 0 {
			return nil, invalidf("batch %d (rank %v) has no events", i, rank)
		}
		rb := raftfsm.RankBatch{Rank: rank, Events: make([]kvevent.Event, len(b.Events))}
		for j := range b.Events {
			e := &b.Events[j]
			if j > 0 {
				// A wrap past the largest id is no rise.
				if prev := b.Events[j-1].EventID; prev == math.MaxUint64 || e.EventID != prev+1 {
					return nil, invalidf("batch %d (rank %v) event %d: event_id %d follows %d (ids must rise by one within a batch)",
						i, rank, j, e.EventID, prev)
				}
			}
			ev, err := e.toKV(rank)
			if err != nil {
				return nil, locate(err, "batch %d (rank %v) event %d (id %d)", i, rank, j, e.EventID)
			}
			rb.Events[j] = ev
		}
		out[i] = rb
	}
	return out, nil
}

// dumpEvents validates a rank dump: stored events only. A dump without
// events (absent, or null: encoding/json leaves both nil, and [] not) is
// refused: it would empty the rank.
func dumpEvents(rank kvevent.Rank, req *DumpRequest) ([]kvevent.Event, error) {
	if req.Events == nil {
		return nil, invalidf("events is missing (want the rank's stored events, [] for none)")
	}
	out := make([]kvevent.Event, len(req.Events))
	for j := range req.Events {
		e := &req.Events[j]
		if e.Type != EventStored {
			return nil, invalidf("event %d: a dump holds stored events only, not %q", j, e.Type)
		}
		ev, err := e.toKV(rank)
		if err != nil {
			return nil, locate(err, "event %d", j)
		}
		out[j] = ev
	}
	return out, nil
}

// locate prefixes an input error with where in the body it was found,
// keeping its code and reason.
func locate(err error, format string, args ...any) error {
	code, reason := classify(err)
	return &httpError{code: code, reason: reason, err: fmt.Errorf(format+": %w", append(args, err)...)}
}

// settings validates a settings request and converts it. held are the
// params the cluster holds now: a weight over indexer.MaxWeight passes
// only when it equals held's for that field (kept as an older build
// stored it).
func settings(req *SettingsRequest, held indexer.Params) (raftfsm.Settings, error) {
	s := raftfsm.Settings{Params: indexer.DefaultParams()}
	if req.Params != nil {
		s.Params = *req.Params
	}
	if err := s.Params.ValidateKeeping(held); err != nil {
		return s, invalidf("params: %v", err)
	}
	if req.View != "" { // omitted: the default, dedup
		v, ok := indexer.ParseView(req.View)
		if !ok {
			return s, invalidf("unknown view %q (want dedup or tiered)", req.View)
		}
		s.View = v
	}
	return s, nil
}
