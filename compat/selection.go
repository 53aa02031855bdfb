package compat

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/httppath"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/zeebo/xxh3"
)

// SelectionBackend is what the selection and reservation API needs beyond
// Backend. *raftfsm.Node implements it.
type SelectionBackend interface {
	Backend
	// Route chooses a rank for a request (and books it with q.Book).
	Route(ctx context.Context, q raftfsm.RouteQuery) (raftfsm.RouteResult, error)
	// Reserve books a request on a chosen rank; idempotent by id: a retry
	// on the same rank is nil, an id live on another rank a
	// *raftfsm.BookedElsewhereError and a freed one raftfsm.ErrBookingFreed.
	Reserve(ctx context.Context, b raftfsm.Booking) error
	// PrefillDone and Free move a booking on; idempotent.
	PrefillDone(ctx context.Context, id string) error
	Free(ctx context.Context, id string) error
	// OutputBlock adds an output block of hash h to booking id's decode
	// load and, unless weight is raftfsm.NoDecay, sets how much the blocks
	// it alone holds count (parts per million, indexer.Sequences.SetDecay).
	OutputBlock(ctx context.Context, id string, h uint64, weight int64) error
	// Booking returns a live booking from this node's load tracker.
	Booking(id string) (indexer.Booking, bool)
	// Loads returns every rank with a live booking and its load.
	Loads() []indexer.RankLoad
	// PotentialLoads returns each booked rank's decode blocks with a
	// request of sequence hashes seq added; idle for any other rank.
	PotentialLoads(seq []uint64) (loads []indexer.RankLoad, idle int64)
	// Settings returns the cluster's scoring settings (the view and
	// weights Route scores with).
	Settings() raftfsm.Settings
}

var _ SelectionBackend = (*raftfsm.Node)(nil)

// CatalogWorker is a worker of the selection API's catalog: one engine
// with dp ranks [data_parallel_start_rank, +data_parallel_size), for a
// (model, routing group).
type CatalogWorker struct {
	WorkerID              uint64      `json:"worker_id"`
	ModelName             string      `json:"model_name"`
	RoutingGroup          string      `json:"routing_group"`
	Endpoint              string      `json:"endpoint"`
	BlockSize             int         `json:"block_size"`
	DataParallelStartRank uint32      `json:"data_parallel_start_rank"`
	DataParallelSize      uint32      `json:"data_parallel_size"`
	KVEventsEndpoints     Map[string] `json:"kv_events_endpoints,omitempty"`
	ReplayEndpoint        string      `json:"replay_endpoint,omitempty"`
}

// WorkerPatch is the body of PATCH /workers/{id}: the fields to change.
// ModelName and RoutingGroup pick the registration when the worker has
// several.
type WorkerPatch struct {
	ModelName             string            `json:"model_name,omitempty"`
	RoutingGroup          string            `json:"routing_group,omitempty"`
	Endpoint              *string           `json:"endpoint,omitempty"`
	BlockSize             *int              `json:"block_size,omitempty"`
	DataParallelStartRank *uint32           `json:"data_parallel_start_rank,omitempty"`
	DataParallelSize      *uint32           `json:"data_parallel_size,omitempty"`
	KVEventsEndpoints     map[string]string `json:"kv_events_endpoints,omitempty"`
	ReplayEndpoint        *string           `json:"replay_endpoint,omitempty"`
}

// SelectRequest is the body of POST /select and /select_and_reserve.
// BlockHashes are the prompt's content hashes (or give TokenIDs, hashed
// with the namespace's block size); SequenceHashes key the load booking.
// ISLTokens 0 means the prompt's length is len(TokenIDs), or else
// len(BlockHashes) times the block size.
type SelectRequest struct {
	SelectionID    string   `json:"selection_id,omitempty"`
	ModelName      string   `json:"model_name"`
	RoutingGroup   string   `json:"routing_group,omitempty"`
	BlockHashes    []Hash   `json:"block_hashes"`
	SequenceHashes []Hash   `json:"sequence_hashes"`
	ISLTokens      int      `json:"isl_tokens"`
	TokenIDs       []uint32 `json:"token_ids,omitempty"`
	// LoRAName and CacheSalt seed the hashes of TokenIDs, as /query's: an
	// instance registered with an additional_salt is matched only with
	// that cache_salt.
	LoRAName  string `json:"lora_name,omitempty"`
	CacheSalt string `json:"cache_salt,omitempty"`
	SessionID string `json:"session_id,omitempty"`
}

// SelectResponse is the chosen worker and rank with its cache overlap.
type SelectResponse struct {
	SelectionID            string          `json:"selection_id"`
	ModelName              string          `json:"model_name"`
	RoutingGroup           string          `json:"routing_group"`
	WorkerID               uint64          `json:"worker_id"`
	DPRank                 uint32          `json:"dp_rank"`
	Endpoint               string          `json:"endpoint"`
	BlockSize              int             `json:"block_size"`
	Overlap                InstanceOverlap `json:"overlap"`
	EffectivePrefillTokens int             `json:"effective_prefill_tokens"`
	Reserved               bool            `json:"reserved"`
}

// ReservationRequest is the body of POST /reservations: book a request on
// a rank the caller chose. The booking's id is SelectionID (Dynamo's
// name) or ReservationID; the prompt's cached tokens are CachedTokens or
// ISLTokens less EffectivePrefillTokens (Dynamo's). dp_rank defaults to 0.
type ReservationRequest struct {
	ReservationID          string `json:"reservation_id,omitempty"`
	SelectionID            string `json:"selection_id,omitempty"`
	ModelName              string `json:"model_name"`
	RoutingGroup           string `json:"routing_group,omitempty"`
	WorkerID               uint64 `json:"worker_id"`
	DPRank                 uint32 `json:"dp_rank"`
	SequenceHashes         []Hash `json:"sequence_hashes"`
	ISLTokens              int    `json:"isl_tokens"`
	CachedTokens           int    `json:"cached_tokens,omitempty"`
	EffectivePrefillTokens *int   `json:"effective_prefill_tokens,omitempty"`
}

// ReservationResponse is the 201 answer of POST /reservations: Dynamo's
// ReservationResponse (selection_id and the rank booked, with the
// worker's endpoint), and this API's status and reservation_id.
type ReservationResponse struct {
	Status        string `json:"status"`
	ReservationID string `json:"reservation_id"`
	SelectionID   string `json:"selection_id"`
	ModelName     string `json:"model_name"`
	RoutingGroup  string `json:"routing_group"`
	WorkerID      uint64 `json:"worker_id"`
	DPRank        uint32 `json:"dp_rank"`
	Endpoint      string `json:"endpoint"`
}

// OutputBlockRequest is the body of POST /reservations/{id}/output_block.
type OutputBlockRequest struct {
	DecayFraction *float64 `json:"decay_fraction,omitempty"`
}

// RankLoad is one rank's load in GET /loads and POST /potential_loads.
// ModelName and RoutingGroup say whose rank it is: one instance id may be
// registered for several models (or groups), each its own ranks with their
// own loads, which GET /loads without a model lists side by side.
type RankLoad struct {
	WorkerID              uint64 `json:"worker_id"`
	DPRank                uint32 `json:"dp_rank"`
	ModelName             string `json:"model_name"`
	RoutingGroup          string `json:"routing_group"`
	ActivePrefillTokens   int64  `json:"active_prefill_tokens"`
	ActiveDecodeBlocks    int64  `json:"active_decode_blocks"`
	ActiveRequests        int64  `json:"active_requests"`
	PotentialDecodeBlocks *int64 `json:"potential_decode_blocks,omitempty"`
	PotentialPrefillToks  *int64 `json:"potential_prefill_tokens,omitempty"`
}

// PotentialLoadsRequest is the body of POST /potential_loads.
type PotentialLoadsRequest struct {
	ModelName      string `json:"model_name"`
	RoutingGroup   string `json:"routing_group,omitempty"`
	BlockHashes    []Hash `json:"block_hashes,omitempty"`
	SequenceHashes []Hash `json:"sequence_hashes"`
	ISLTokens      int    `json:"isl_tokens"`
}

// OverlapScoresRequest is the body of POST /overlap_scores.
type OverlapScoresRequest struct {
	ModelName    string `json:"model_name"`
	RoutingGroup string `json:"routing_group,omitempty"`
	BlockHashes  []Hash `json:"block_hashes"`
	// CacheSalt must be absent or null, as on /query_by_hash, whose
	// answer this is: a salt cannot apply to hashes already computed.
	CacheSalt *string `json:"cache_salt,omitempty"`
}

// maxSessions bounds the session → last rank memory.
const maxSessions = 1 << 16

// Selection serves the selection and reservation API.
type Selection struct {
	b   SelectionBackend
	x   *Indexer // lookups and registration rules
	log *slog.Logger

	outMu sync.Mutex // serialises output blocks, whose hashes count the booking's blocks

	// The sessions answered, each at its index in sessList, which links
	// them in answer order (sessHead the latest, sessTail the least
	// recent): a session answered again moves to the head, and a new one
	// past sessCap takes the tail's entry. Nothing is allocated once the
	// list is full.
	sessMu   sync.Mutex
	sessions map[sessionKey]int32
	sessList []sessionEntry
	sessHead int32 // -1: none
	sessTail int32
	sessCap  int // maxSessions; tests set less
}

// sessionEntry is a session's last rank and its neighbours in sessList's
// answer order (-1 at either end).
type sessionEntry struct {
	key        sessionKey
	rank       kvevent.Rank
	prev, next int32
}

// sessionKey names a session in its namespace: a namespace partitions
// state, and two tenants (or models) that both name a session "s" have
// two sessions, each with its own rank. Keyed by the id alone, one's
// answer overwrote the other's rank.
type sessionKey struct {
	model, group, id string
}

// NewSelection returns the selection API of b. Its registrations and
// those of b's Indexer (POST /register) serialise on one lock.
func NewSelection(b SelectionBackend, log *slog.Logger) *Selection {
	if log == nil {
		log = slog.Default()
	}
	return &Selection{b: b, x: NewIndexer(b, log), log: log,
		sessions: map[sessionKey]int32{}, sessHead: -1, sessTail: -1, sessCap: maxSessions}
}

// Routes registers the API's routes on r under prefix. GET /workers
// collides with the indexer API's, so the two cannot share a prefix. The
// writes not safe twice are registered with HandleFuncOnce: a worker's
// removal and a reservation's release (a second answers 404 for what the
// first removed), and an output block (a second adds another block).
func (s *Selection) Routes(r Router, prefix string) {
	// The Indexer's check again when both APIs are served: it is cheap,
	// and either API served alone keeps its namespaces whole.
	r.CheckWorkers(s.x.checkV1Worker)
	r.HandleErrors(prefix, WriteError)
	// The indexer API's liveness answer, which Dynamo's selection service
	// serves too (a Dynamo client's probe of --selection-addr was a 404).
	r.HandleFunc("GET "+prefix+"/health", s.x.health)
	r.HandleFunc("POST "+prefix+"/workers", bodyHandler(http.StatusCreated, s.addWorker))
	r.HandleFunc("PATCH "+prefix+"/workers/{id}", s.patchWorker)
	r.HandleFuncOnce("DELETE "+prefix+"/workers/{id}", s.deleteWorker)
	r.HandleFunc("GET "+prefix+"/workers", s.listWorkers)
	r.HandleFunc("GET "+prefix+"/ready", s.ready)
	r.HandleFunc("POST "+prefix+"/select", bodyHandler(http.StatusOK, func(ctx context.Context, req *SelectRequest) (any, error) {
		return s.doSelect(ctx, req, false)
	}))
	r.HandleFunc("POST "+prefix+"/select_and_reserve", bodyHandler(http.StatusOK, func(ctx context.Context, req *SelectRequest) (any, error) {
		return s.doSelect(ctx, req, true)
	}))
	r.HandleFunc("POST "+prefix+"/reservations", bodyHandler(http.StatusCreated, s.reserve))
	r.HandleFunc("POST "+prefix+"/reservations/{id}/prefill_complete", s.prefillComplete)
	r.HandleFuncOnce("POST "+prefix+"/reservations/{id}/output_block", s.outputBlock)
	r.HandleFuncOnce("DELETE "+prefix+"/reservations/{id}", s.release)
	r.HandleFunc("GET "+prefix+"/loads", s.loads)
	r.HandleFunc("POST "+prefix+"/potential_loads", bodyHandler(http.StatusOK, s.potentialLoads))
	r.HandleFunc("POST "+prefix+"/overlap_scores", bodyHandler(http.StatusOK, s.overlapScores))
}

// catalogOf is the catalog form of a registration.
func catalogOf(id uint64, w *raftfsm.WorkerInfo) CatalogWorker {
	inst, tenant := w.Instance, w.Tenant
	if tenant == "" {
		inst, tenant = id, DefaultTenant
	}
	c := CatalogWorker{WorkerID: inst, ModelName: w.Model, RoutingGroup: tenant, Endpoint: w.Endpoint,
		BlockSize: w.BlockSize, DataParallelSize: 1}
	if len(w.DPRanks) > 0 {
		// The range that covers the ranks: /register may leave holes
		// (ranks 0 and 2), and kv_events_endpoints keys stay inside it.
		lo, hi := slices.Min(w.DPRanks), slices.Max(w.DPRanks)
		c.DataParallelStartRank = lo
		c.DataParallelSize = uint32(min(uint64(hi)-uint64(lo)+1, math.MaxUint32))
	}
	if len(w.EventEndpoints) > 0 {
		c.KVEventsEndpoints = Map[string]{}
		for dp, ep := range w.EventEndpoints {
			c.KVEventsEndpoints[strconv.FormatUint(uint64(dp), 10)] = ep
		}
	}
	c.ReplayEndpoint = w.ReplayEndpoints[c.DataParallelStartRank]
	return c
}

// DefaultModel is the model a selection API request without model_name
// names (POST /workers, /select, /select_and_reserve, /reservations,
// /potential_loads, /overlap_scores), as Dynamo's selection service
// defaults it; its routing group defaults to DefaultTenant alike. The
// indexer API still requires a model.
const DefaultModel = "default"

// defaultModel sets *model to DefaultModel when empty, and bounds it and
// the routing group (requireModel's checks).
func defaultModel(model *string, group string) error {
	if *model == "" {
		*model = DefaultModel
	}
	return requireModel(*model, group)
}

// infoOf checks a new catalog worker and returns its registration. Its
// model and routing group are checked here, not in checkedInfo: a PATCH
// keeps the stored ones, which an older build may have taken with a
// control character, and a PATCH changes only what its body names.
func infoOf(c *CatalogWorker) (raftfsm.WorkerInfo, error) {
	if err := defaultModel(&c.ModelName, c.RoutingGroup); err != nil {
		return raftfsm.WorkerInfo{}, err
	}
	if err := checkPrintable("model_name", c.ModelName); err != nil {
		return raftfsm.WorkerInfo{}, err
	}
	if err := checkPrintable("routing_group", c.RoutingGroup); err != nil {
		return raftfsm.WorkerInfo{}, err
	}
	return checkedInfo(c)
}

// checkedInfo checks a catalog worker but for its model and returns its
// registration: a PATCH's, whose model is the stored worker's, which a /v1
// worker registered without one does not have.
func checkedInfo(c *CatalogWorker) (raftfsm.WorkerInfo, error) {
	if err := checkName("endpoint", c.Endpoint); err != nil {
		return raftfsm.WorkerInfo{}, err
	}
	if c.BlockSize <= 0 || c.BlockSize > 1<<20 {
		return raftfsm.WorkerInfo{}, badRequest("block_size %d: want 1 to %d tokens", c.BlockSize, 1<<20)
	}
	size := c.DataParallelSize
	if size == 0 {
		size = 1
	}
	if size > maxDPRanks || uint64(c.DataParallelStartRank)+uint64(size) > 1<<32 {
		return raftfsm.WorkerInfo{}, badRequest("data_parallel_size %d from rank %d is too large", size, c.DataParallelStartRank)
	}
	tenant := orDefaultTenant(c.RoutingGroup)
	w := raftfsm.WorkerInfo{ID: WorkerID(c.WorkerID, c.ModelName, tenant), Instance: c.WorkerID, Model: c.ModelName,
		Tenant: tenant, Endpoint: c.Endpoint, BlockSize: c.BlockSize}
	for r := uint32(0); r < size; r++ {
		w.DPRanks = append(w.DPRanks, c.DataParallelStartRank+r)
	}
	// In uint64: start + size may be 2^32 (the last rank's range).
	start, end := uint64(c.DataParallelStartRank), uint64(c.DataParallelStartRank)+uint64(size)
	for k, ep := range c.KVEventsEndpoints {
		dp, ok := rankKey(k)
		if !ok || uint64(dp) < start || uint64(dp) >= end {
			return w, badRequest("kv_events_endpoints key %q: want a dp rank in [%d, %d)", k, start, end)
		}
		if err := checkEndpoint("kv_events_endpoints["+k+"]", ep); err != nil {
			return w, err
		}
		if w.EventEndpoints == nil {
			w.EventEndpoints = map[uint32]string{}
		}
		w.EventEndpoints[dp] = ep
	}
	if c.ReplayEndpoint != "" {
		if err := checkEndpoint("replay_endpoint", c.ReplayEndpoint); err != nil {
			return w, err
		}
		w.ReplayEndpoints = map[uint32]string{c.DataParallelStartRank: c.ReplayEndpoint}
	}
	return w, nil
}

// rankKey reads a kv_events_endpoints key: a dp rank in decimal, in its
// one spelling, so that two keys never name one rank ("01" and "1" did,
// and which endpoint the rank got depended on the map's order).
func rankKey(k string) (uint32, bool) {
	dp, err := strconv.ParseUint(k, 10, 32)
	if err != nil || strconv.FormatUint(dp, 10) != k {
		return 0, false
	}
	return uint32(dp), true
}

// sameRegistration reports whether a and b register the same thing.
func sameRegistration(a, b *raftfsm.WorkerInfo) bool {
	return a.ID == b.ID && a.Instance == b.Instance && a.Model == b.Model && a.Tenant == b.Tenant &&
		a.Endpoint == b.Endpoint && a.BlockSize == b.BlockSize && a.Salt == b.Salt &&
		slices.Equal(a.DPRanks, b.DPRanks) && maps.Equal(a.EventEndpoints, b.EventEndpoints) &&
		maps.Equal(a.ReplayEndpoints, b.ReplayEndpoints) && a.Capacity == b.Capacity
}

func (s *Selection) addWorker(ctx context.Context, req *CatalogWorker) (any, error) {
	if err := s.b.CheckLeader(); err != nil {
		return nil, err
	}
	nw, err := infoOf(req)
	if err != nil {
		return nil, err
	}
	s.x.regMu.Lock()
	defer s.x.regMu.Unlock()
	table := s.b.WorkerTable()
	if old, ok := table[nw.ID]; ok {
		if sameRegistration(&old, &nw) {
			return catalogOf(nw.ID, &nw), nil
		}
		return nil, &httpError{code: http.StatusConflict, err: fmt.Errorf(
			"worker %d is registered for %s/%s differently; PATCH it", req.WorkerID, nw.Model, nw.Tenant)}
	}
	// The namespace rules of /register: the catalog writes the same table.
	if err := joinsNamespace(table, &nw); err != nil {
		return nil, err
	}
	if err := s.b.RegisterWorker(ctx, nw); err != nil {
		return nil, fmt.Errorf("register worker %d: %w", req.WorkerID, err)
	}
	return catalogOf(nw.ID, &nw), nil
}

// find returns the registrations of worker id, narrowed by model and
// group when given; an error answer when there are none or, with one
// wanted, several.
func (s *Selection) find(id uint64, model, group string, one bool) ([]raftfsm.WorkerInfo, error) {
	if err := checkNames(model, group); err != nil {
		return nil, err
	}
	var out []raftfsm.WorkerInfo
	for wid, wi := range s.b.WorkerTable() {
		inst, tenant := wi.Instance, wi.Tenant
		if tenant == "" {
			inst, tenant = wid, DefaultTenant
		}
		if inst == id && (model == "" || wi.Model == model) && (group == "" || tenant == group) {
			out = append(out, wi)
		}
	}
	slices.SortFunc(out, func(a, b raftfsm.WorkerInfo) int { return cmp.Compare(a.ID, b.ID) })
	switch {
	case len(out) == 0:
		return nil, &httpError{code: http.StatusNotFound, err: fmt.Errorf("worker %d is not registered", id)}
	case one && len(out) > 1:
		return nil, badRequest("worker %d is registered for %d (model, routing group) pairs: name model_name and routing_group", id, len(out))
	}
	return out, nil
}

func pathID(r *http.Request) (uint64, error) {
	id, err := strconv.ParseUint(r.PathValue("id"), 10, 64)
	if err != nil {
		return 0, badRequest("worker id %q: not an unsigned integer", r.PathValue("id"))
	}
	return id, nil
}

func (s *Selection) patchWorker(w http.ResponseWriter, r *http.Request) error {
	c := codecOf(r)
	if err := s.b.CheckLeader(); err != nil {
		return err
	}
	id, err := pathID(r)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	var p WorkerPatch
	if err := decode(r, c, &p); err != nil {
		return answer(w, c, 0, nil, err)
	}
	s.x.regMu.Lock()
	defer s.x.regMu.Unlock()
	found, err := s.find(id, p.ModelName, p.RoutingGroup, true)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	old := found[0]
	cw := catalogOf(old.ID, &old)
	if p.DataParallelStartRank == nil && p.DataParallelSize == nil {
		// The worker keeps its ranks (patchedWorker), which the catalog's
		// one range need not fit (holes, a span past its limit): infoOf
		// checks the rest on one rank, patchedWorker the event endpoints.
		cw.DataParallelStartRank, cw.DataParallelSize, cw.KVEventsEndpoints = 0, 1, nil
	}
	if p.Endpoint != nil {
		cw.Endpoint = *p.Endpoint
	}
	if p.BlockSize != nil {
		cw.BlockSize = *p.BlockSize
	}
	if p.DataParallelStartRank != nil {
		cw.DataParallelStartRank = *p.DataParallelStartRank
	}
	if p.DataParallelSize != nil {
		cw.DataParallelSize = *p.DataParallelSize
	}
	// Only the endpoints the PATCH names are checked (infoOf, or
	// patchedWorker for event endpoints of unchanged ranks): the others
	// stay as they are (patchedWorker), whatever rules they were taken
	// under, and those of ranks the PATCH removes go with them rather
	// than be read against the new range.
	cw.KVEventsEndpoints, cw.ReplayEndpoint = nil, ""
	if p.KVEventsEndpoints != nil && (p.DataParallelStartRank != nil || p.DataParallelSize != nil) {
		cw.KVEventsEndpoints = p.KVEventsEndpoints
	}
	if p.ReplayEndpoint != nil {
		cw.ReplayEndpoint = *p.ReplayEndpoint
	}
	// The model is the stored one (the body's only finds the worker): not
	// checked again, as a /v1 worker may have none.
	patched, err := checkedInfo(&cw)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	nw, err := patchedWorker(&old, &patched, &p)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	if nw.BlockSize != old.BlockSize {
		// A namespace has one block size (its queries hash and score with
		// it): a worker takes a new one only where every other worker of
		// the namespace has it already.
		if err := keepsBlockSize(s.b.WorkerTable(), &nw); err != nil {
			return answer(w, c, 0, nil, err)
		}
	}
	if err := s.b.RegisterWorker(r.Context(), nw); err != nil {
		return answer(w, c, 0, nil, fmt.Errorf("update worker %d: %w", id, err))
	}
	return answer(w, c, http.StatusOK, catalogOf(nw.ID, &nw), nil)
}

// patchedWorker is old with what patch p sets, as infoOf read it into
// patched. Everything else stays as old has it: the worker's identity (a
// /v1 worker stays a /v1 worker), capacity, salt, lease, whether the
// leader follows its engine (agentless), and its ranks and their replay
// endpoints unless the patch names them (the catalog form shows the
// ranks as one range and only the first rank's replay endpoint).
func patchedWorker(old, patched *raftfsm.WorkerInfo, p *WorkerPatch) (raftfsm.WorkerInfo, error) {
	nw := *old
	nw.Endpoint, nw.BlockSize = patched.Endpoint, patched.BlockSize
	ranksNamed := p.DataParallelStartRank != nil || p.DataParallelSize != nil
	if ranksNamed {
		nw.DPRanks = patched.DPRanks // infoOf checked the endpoints' ranks against them
	}
	switch {
	case p.KVEventsEndpoints != nil && ranksNamed:
		nw.EventEndpoints = patched.EventEndpoints
	case p.KVEventsEndpoints != nil:
		nw.EventEndpoints = map[uint32]string{}
		for k, ep := range p.KVEventsEndpoints {
			dp, ok := rankKey(k)
			if !ok || !slices.Contains(nw.DPRanks, dp) {
				return nw, badRequest("kv_events_endpoints key %q: want one of the worker's dp ranks %v", k, nw.DPRanks)
			}
			if err := checkEndpoint("kv_events_endpoints["+k+"]", ep); err != nil {
				return nw, err
			}
			nw.EventEndpoints[dp] = ep
		}
	}
	replay := map[uint32]string{}
	for dp, ep := range old.ReplayEndpoints {
		if slices.Contains(nw.DPRanks, dp) {
			replay[dp] = ep
		}
	}
	if p.ReplayEndpoint != nil {
		start := uint32(0) // no ranks: rank 0
		if len(nw.DPRanks) > 0 {
			start = slices.Min(nw.DPRanks)
		}
		if *p.ReplayEndpoint == "" {
			delete(replay, start)
		} else {
			replay[start] = *p.ReplayEndpoint
		}
	}
	nw.ReplayEndpoints = nil
	if len(replay) > 0 {
		nw.ReplayEndpoints = replay
	}
	if nw.EventEndpoints != nil {
		kept := map[uint32]string{}
		for dp, ep := range nw.EventEndpoints {
			if slices.Contains(nw.DPRanks, dp) {
				kept[dp] = ep
			}
		}
		nw.EventEndpoints = kept
	}
	return nw, nil
}

func (s *Selection) deleteWorker(w http.ResponseWriter, r *http.Request) error {
	c := codecOf(r)
	if err := s.b.CheckLeader(); err != nil {
		return err
	}
	id, err := pathID(r)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	q := r.URL.Query()
	s.x.regMu.Lock()
	defer s.x.regMu.Unlock()
	found, err := s.find(id, q.Get("model_name"), q.Get("routing_group"), false)
	if err != nil {
		return answer(w, c, 0, nil, err)
	}
	for _, wi := range found {
		if err := s.b.DeregisterWorker(r.Context(), wi.ID); err != nil {
			return answer(w, c, 0, nil, fmt.Errorf("remove worker %d: %w", id, err))
		}
	}
	return answer(w, c, http.StatusOK, StatusBody{Status: "ok"}, nil)
}

func (s *Selection) listWorkers(w http.ResponseWriter, r *http.Request) error {
	return answer(w, codecOf(r), http.StatusOK, s.catalog(), nil)
}

// catalog lists every worker in its catalog form, by worker id, model and
// routing group.
func (s *Selection) catalog() []CatalogWorker {
	table := s.b.WorkerTable()
	out := make([]CatalogWorker, 0, len(table))
	for id := range table {
		wi := table[id]
		out = append(out, catalogOf(id, &wi))
	}
	slices.SortFunc(out, func(a, b CatalogWorker) int {
		return cmp.Or(cmp.Compare(a.WorkerID, b.WorkerID), cmp.Compare(a.ModelName, b.ModelName),
			cmp.Compare(a.RoutingGroup, b.RoutingGroup))
	})
	return out
}

// ReadyResponse is the answer of GET /ready: Dynamo's ReadyResponse
// (ready, schedulable_workers: the workers with a block size, which
// /select can score, and workers: the catalog, as GET /workers lists it)
// and the node's Raft state.
type ReadyResponse struct {
	Ready              bool            `json:"ready"`
	SchedulableWorkers int             `json:"schedulable_workers"`
	Workers            []CatalogWorker `json:"workers"`
	State              string          `json:"state"`
}

func (s *Selection) ready(w http.ResponseWriter, r *http.Request) error {
	st := s.b.Status()
	workers := s.catalog()
	n := 0
	for i := range workers {
		if workers[i].BlockSize > 0 {
			n++
		}
	}
	body := ReadyResponse{Ready: st.Ready && n > 0, SchedulableWorkers: n, Workers: workers, State: st.State}
	if !st.Ready || n == 0 {
		return answer(w, codecOf(r), http.StatusServiceUnavailable, body, nil)
	}
	return answer(w, codecOf(r), http.StatusOK, body, nil)
}

func newSelectionID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func hashes(hs []Hash) []uint64 {
	if len(hs) == 0 {
		return nil
	}
	out := make([]uint64, len(hs))
	for i, h := range hs {
		out[i] = uint64(h)
	}
	return out
}

// sameBlockCount refuses a prompt of blocks blocks (its block_hashes, or
// the full blocks of its token_ids when fromTokens) given with seqs
// sequence hashes, when both are given and their counts differ: the
// sequence hashes key the booking's blocks, and a booking keyed on fewer
// (or more) of them than the prompt has blocks books a decode load that is
// not the prompt's. Dynamo's selection service refuses them alike.
func sameBlockCount(blocks, seqs int, fromTokens bool) error {
	if blocks == 0 || seqs == 0 || blocks == seqs {
		return nil
	}
	if fromTokens {
		return badRequest("token_ids make %d full blocks: sequence_hashes length %d must match", blocks, seqs)
	}
	return badRequest("block_hashes length %d must match sequence_hashes length %d", blocks, seqs)
}

// doSelect chooses a rank for req, and books it when reserve.
func (s *Selection) doSelect(ctx context.Context, req *SelectRequest, reserve bool) (any, error) {
	if reserve {
		if err := s.b.CheckLeader(); err != nil {
			return nil, err
		}
	}
	if err := defaultModel(&req.ModelName, req.RoutingGroup); err != nil {
		return nil, err
	}
	if req.SelectionID != "" {
		if err := checkID("selection_id", req.SelectionID); err != nil {
			return nil, err
		}
	}
	if len(req.SessionID) > maxIDLen {
		return nil, badRequest("session_id is %d bytes long (at most %d)", len(req.SessionID), maxIDLen)
	}
	if len(req.BlockHashes) > 0 && len(req.TokenIDs) > 0 {
		return nil, badRequest("give block_hashes or token_ids, not both")
	}
	if err := checkName("lora_name", req.LoRAName); err != nil {
		return nil, err
	}
	if err := checkName("cache_salt", req.CacheSalt); err != nil {
		return nil, err
	}
	if req.ISLTokens < 0 {
		return nil, badRequest("isl_tokens %d is negative", req.ISLTokens)
	}
	group := orDefaultTenant(req.RoutingGroup)
	ns := s.x.ns.get(s.b, req.ModelName, group)
	if len(ns.workers) == 0 {
		return nil, &httpError{code: http.StatusServiceUnavailable,
			err: fmt.Errorf("no worker is registered for model %s routing group %s", req.ModelName, group)}
	}
	// A prompt shorter than a block breaks ties on its tokens' hash, or on
	// the selection id its caller gave (RendezvousKey), never on one drawn
	// here: one prompt keeps to one rank.
	givenID := req.SelectionID
	if req.SelectionID == "" {
		req.SelectionID = newSelectionID()
	}
	local := hashes(req.BlockHashes)
	// The prompt's length: isl_tokens, else its tokens (a last partial
	// block too), else (0 here) its blocks' tokens, as /v1/route counts it.
	isl := req.ISLTokens
	if len(req.TokenIDs) > 0 {
		local = kvevent.LocalHashes(nil, req.TokenIDs, ns.blockSize, kvevent.SeedFor(req.LoRAName, req.CacheSalt))
		if isl == 0 {
			isl = len(req.TokenIDs)
		}
	}
	if err := sameBlockCount(len(local), len(req.SequenceHashes), len(req.TokenIDs) > 0); err != nil {
		return nil, err
	}
	q := raftfsm.RouteQuery{LocalHashes: local, ISL: isl, BlockSize: ns.blockSize,
		SeqHashes: hashes(req.SequenceHashes), Book: reserve, RequestID: req.SelectionID, Brief: true,
		Filter: func(rk kvevent.Rank) bool { _, ok := ns.has(rk); return ok },
		TieKey: raftfsm.RendezvousKey(local, req.TokenIDs, req.LoRAName, req.CacheSalt, givenID)}
	session := sessionKey{model: req.ModelName, group: group, id: req.SessionID}
	if req.SessionID != "" {
		if rk, ok := s.session(session); ok {
			q.Prefer = &rk
		}
	}
	res, err := s.b.Route(ctx, q)
	if err == nil && reserve && !res.Booked {
		// Route books nothing, and says so only in Booked, for an id
		// whose booking was freed (its tombstone stands): /v1/route
		// answers that, this API refuses it as POST /reservations does.
		err = raftfsm.ErrBookingFreed
	}
	if err != nil {
		if errors.Is(err, indexer.ErrOverloaded) || errors.Is(err, indexer.ErrNoWorkers) {
			err = &httpError{code: routeRefusalStatus(err), err: err}
		} else if c := s.bookingConflict("selection_id", req.SelectionID, err); c != nil {
			err = c
		}
		return nil, err
	}
	chosen := res.Decision.Chosen()
	wi := ns.workers[res.Decision.Rank.Worker]
	if chosen == nil || wi == nil {
		return nil, fmt.Errorf("route chose %v outside the namespace", res.Decision.Rank)
	}
	if req.SessionID != "" {
		s.remember(session, res.Decision.Rank)
	}
	out := SelectResponse{SelectionID: req.SelectionID, ModelName: req.ModelName, RoutingGroup: group,
		WorkerID: wi.Instance, DPRank: res.Decision.Rank.DP, Endpoint: wi.Endpoint, BlockSize: res.BlockSize,
		Reserved: res.Booked}
	out.Overlap = s.overlapOf(ns, local, wi)
	if isl == 0 {
		isl = len(local) * res.BlockSize
	}
	out.EffectivePrefillTokens = max(isl-int(chosen.OverlapBlocks)*res.BlockSize, 0)
	return out, nil
}

// overlapOf is one worker's tiered overlap, in tokens.
func (s *Selection) overlapOf(ns *namespace, local []uint64, wi *raftfsm.WorkerInfo) InstanceOverlap {
	one := namespace{blockSize: ns.blockSize, workers: map[uint64]*raftfsm.WorkerInfo{wi.ID: wi}}
	sc := s.x.pool.Get().(*queryScratch)
	defer s.x.pool.Put(sc)
	sc.local = append(sc.local[:0], local...)
	res := s.x.lookup(&one, sc)
	o, ok := res.Instances[strconv.FormatUint(wi.Instance, 10)]
	if !ok {
		o.DP = Map[int]{}
	}
	return o
}

func (s *Selection) session(id sessionKey) (kvevent.Rank, bool) {
	s.sessMu.Lock()
	defer s.sessMu.Unlock()
	i, ok := s.sessions[id]
	if !ok {
		return kvevent.Rank{}, false
	}
	return s.sessList[i].rank, true
}

// remember records a session's rank as the latest answered, forgetting
// the least recently answered session when sessCap are known: the memory
// keeps the last sessions answered, as docs/compat.md says (it used to
// forget the session first answered longest ago, however recent its last
// answer).
func (s *Selection) remember(id sessionKey, rk kvevent.Rank) {
	s.sessMu.Lock()
	defer s.sessMu.Unlock()
	i, ok := s.sessions[id]
	switch {
	case ok:
		s.unlinkSession(i)
	case len(s.sessList) < s.sessCap:
		i = int32(len(s.sessList))
		s.sessList = append(s.sessList, sessionEntry{})
		s.sessions[id] = i
	default:
		i = s.sessTail
		s.unlinkSession(i)
		delete(s.sessions, s.sessList[i].key)
		s.sessions[id] = i
	}
	e := &s.sessList[i]
	e.key, e.rank, e.prev, e.next = id, rk, -1, s.sessHead
	if s.sessHead >= 0 {
		s.sessList[s.sessHead].prev = i
	}
	s.sessHead = i
	if s.sessTail < 0 {
		s.sessTail = i
	}
}

// unlinkSession takes entry i out of the answer order.
func (s *Selection) unlinkSession(i int32) {
	e := &s.sessList[i]
	if e.prev >= 0 {
		s.sessList[e.prev].next = e.next
	} else {
		s.sessHead = e.next
	}
	if e.next >= 0 {
		s.sessList[e.next].prev = e.prev
	} else {
		s.sessTail = e.prev
	}
}

// reservationID is the booking id of req: its selection_id (Dynamo's
// name) or its reservation_id, which must agree when both are given.
func reservationID(req *ReservationRequest) (string, error) {
	id := req.ReservationID
	switch {
	case req.SelectionID == "":
	case id == "":
		id = req.SelectionID
	case id != req.SelectionID:
		return "", badRequest("selection_id %q and reservation_id %q differ: give one", req.SelectionID, id)
	}
	if err := checkID("selection_id or reservation_id", id); err != nil {
		return "", err
	}
	return id, nil
}

// cachedTokens is the prompt's cached tokens of req: cached_tokens, or
// isl_tokens less effective_prefill_tokens (Dynamo's form), which must
// agree when both are given.
func cachedTokens(req *ReservationRequest) (int, error) {
	e := req.EffectivePrefillTokens
	if e == nil {
		return req.CachedTokens, nil
	}
	if *e < 0 || *e > req.ISLTokens {
		return 0, badRequest("effective_prefill_tokens %d: want 0 to isl_tokens (%d)", *e, req.ISLTokens)
	}
	cached := req.ISLTokens - *e
	if req.CachedTokens != 0 && req.CachedTokens != cached {
		return 0, badRequest("cached_tokens %d and effective_prefill_tokens %d of isl_tokens %d disagree: give one",
			req.CachedTokens, *e, req.ISLTokens)
	}
	return cached, nil
}

func (s *Selection) reserve(ctx context.Context, req *ReservationRequest) (any, error) {
	if err := s.b.CheckLeader(); err != nil {
		return nil, err
	}
	if req.SelectionID != "" && req.WorkerID == 0 && req.ISLTokens == 0 && len(req.SequenceHashes) == 0 {
		// Dynamo's replay form books what an earlier /select chose; a
		// /select here books nothing and keeps no record of its choice
		// (none replicated, which any node could replay), so there is
		// nothing to book it from.
		return nil, badRequest("selection_id %q alone (the replay form) is not supported: "+
			"send worker_id, dp_rank, sequence_hashes and isl_tokens, or use /select_and_reserve", req.SelectionID)
	}
	id, err := reservationID(req)
	if err != nil {
		return nil, err
	}
	cached, err := cachedTokens(req)
	if err != nil {
		return nil, err
	}
	if err := defaultModel(&req.ModelName, req.RoutingGroup); err != nil {
		return nil, err
	}
	group := orDefaultTenant(req.RoutingGroup)
	ns := s.x.ns.get(s.b, req.ModelName, group)
	rk := kvevent.Rank{Worker: WorkerID(req.WorkerID, req.ModelName, group), DP: req.DPRank}
	wi, ok := ns.has(rk)
	if !ok {
		// A /v1 worker (no tenant) is its own instance in the default
		// group (namespaceOf). Only such a worker, whose id is its
		// instance: a registered instance's internal id (WorkerID) names
		// no instance, and booked on it.
		rk.Worker = req.WorkerID
		if wi, ok = ns.has(rk); !ok || wi.Instance != req.WorkerID {
			return nil, &httpError{code: http.StatusNotFound, err: fmt.Errorf(
				"worker %d dp rank %d is not registered for model %s routing group %s", req.WorkerID, req.DPRank, req.ModelName, group)}
		}
	}
	b := raftfsm.Booking{ID: id, Rank: rk, SeqHashes: hashes(req.SequenceHashes), ISL: req.ISLTokens,
		CachedTokens: cached}
	err = s.b.Reserve(ctx, b)
	if err == nil {
		return ReservationResponse{Status: "ok", ReservationID: id, SelectionID: id, ModelName: req.ModelName,
			RoutingGroup: group, WorkerID: req.WorkerID, DPRank: req.DPRank, Endpoint: wi.Endpoint}, nil
	}
	if c := s.bookingConflict("reservation id", id, err); c != nil {
		return nil, c
	}
	return nil, fmt.Errorf("reserve %s: %w", id, err)
}

// bookingConflict is the 409 of a booking refused for its id (what names
// it: "reservation id", "selection_id"): one booked and freed before, or
// one live on another rank, named in the catalog's terms (describeRank),
// not by its internal worker id. nil for any other error.
func (s *Selection) bookingConflict(what, id string, err error) error {
	var elsewhere *raftfsm.BookedElsewhereError
	switch {
	case errors.Is(err, raftfsm.ErrBookingFreed):
		return &httpError{code: http.StatusConflict, err: fmt.Errorf(
			"%s %q was already used and freed (or expired): reservation ids are single-use, reserve under a new one",
			what, id)}
	case errors.As(err, &elsewhere):
		return &httpError{code: http.StatusConflict, err: fmt.Errorf(
			"%s %q is already reserved on %s; release it first or reserve under a new id",
			what, id, s.describeRank(elsewhere.Rank))}
	}
	return nil
}

// describeRank names rank rk in the selection API's terms: the worker id
// of its catalog worker, its dp rank, model and routing group.
func (s *Selection) describeRank(rk kvevent.Rank) string {
	wi, ok := s.b.WorkerTable()[rk.Worker]
	if !ok {
		return fmt.Sprintf("internal worker %#x dp rank %d (no longer registered)", rk.Worker, rk.DP)
	}
	inst, group := wi.Instance, wi.Tenant
	if group == "" {
		inst, group = rk.Worker, DefaultTenant
	}
	return fmt.Sprintf("worker %d dp rank %d of model %s routing group %s", inst, rk.DP, wi.Model, group)
}

// onLeader runs a reservation write: a follower forwards it to the leader,
// where an unknown id is a 404, checked against the leader's own tracker,
// which holds every acknowledged booking.
func (s *Selection) onLeader(w http.ResponseWriter, r *http.Request, c codec, write func(ctx context.Context, id string, b indexer.Booking) error) error {
	if err := s.b.CheckLeader(); err != nil {
		return err
	}
	id := r.PathValue("id")
	b, ok := s.b.Booking(id)
	if !ok {
		return answer(w, c, 0, nil, &httpError{code: http.StatusNotFound, err: fmt.Errorf("reservation %q is not live", id)})
	}
	if err := write(r.Context(), id, b); err != nil {
		return answer(w, c, 0, nil, fmt.Errorf("reservation %s: %w", id, err))
	}
	return answer(w, c, http.StatusOK, StatusBody{Status: "ok"}, nil)
}

func (s *Selection) prefillComplete(w http.ResponseWriter, r *http.Request) error {
	return s.onLeader(w, r, codecOf(r), func(ctx context.Context, id string, _ indexer.Booking) error {
		return s.b.PrefillDone(ctx, id)
	})
}

func (s *Selection) release(w http.ResponseWriter, r *http.Request) error {
	return s.onLeader(w, r, codecOf(r), func(ctx context.Context, id string, _ indexer.Booking) error {
		return s.b.Free(ctx, id)
	})
}

func (s *Selection) outputBlock(w http.ResponseWriter, r *http.Request) error {
	c := codecOf(r)
	var req OutputBlockRequest
	if err := decodeOptional(r, c, &req); err != nil {
		return answer(w, c, 0, nil, err)
	}
	weight := int64(raftfsm.NoDecay)
	if f := req.DecayFraction; f != nil {
		if !(*f >= 0 && *f <= 1) { // NaN fails both
			return answer(w, c, 0, nil, badRequest("decay_fraction %v: want a number in [0, 1]", *f))
		}
		weight = int64(math.Round(*f * indexer.DecayScale))
	}
	s.outMu.Lock()
	defer s.outMu.Unlock()
	return s.onLeader(w, r, c, func(ctx context.Context, id string, b indexer.Booking) error {
		// The block's hash: the reservation's id and how many blocks it
		// holds, so that each call adds one new block.
		var buf [8]byte
		binary.LittleEndian.PutUint64(buf[:], uint64(len(b.SeqHashes)))
		h := xxh3.New()
		h.WriteString(id)
		h.Write(buf[:])
		return s.b.OutputBlock(ctx, id, h.Sum64(), weight)
	})
}

// rankOwner is the catalog worker a rank is of: its instance id, model
// and routing group.
type rankOwner struct {
	inst         uint64
	model, group string
}

// load is rank rk's entry of GET /loads and POST /potential_loads, with
// load l.
func (o rankOwner) load(rk kvevent.Rank, l indexer.Load) RankLoad {
	return RankLoad{WorkerID: o.inst, DPRank: rk.DP, ModelName: o.model, RoutingGroup: o.group,
		ActivePrefillTokens: l.ActivePrefillTokens, ActiveDecodeBlocks: l.ActiveDecodeBlocks, ActiveRequests: l.ActiveRequests}
}

// ranksOf lists the ranks of model's workers in group (either "": any),
// ordered by instance id, model, routing group and dp rank, with the
// catalog worker of each worker.
func (s *Selection) ranksOf(model, group string) ([]kvevent.Rank, map[uint64]rankOwner) {
	table := s.b.WorkerTable()
	var ranks []kvevent.Rank
	inst := map[uint64]rankOwner{}
	for id, wi := range table {
		i, tenant := wi.Instance, wi.Tenant
		if tenant == "" {
			i, tenant = id, DefaultTenant
		}
		if model != "" && wi.Model != model || group != "" && tenant != group {
			continue
		}
		inst[id] = rankOwner{inst: i, model: wi.Model, group: tenant}
		dps := wi.DPRanks
		if len(dps) == 0 {
			dps = []uint32{0}
		}
		for _, dp := range dps {
			ranks = append(ranks, kvevent.Rank{Worker: id, DP: dp})
		}
	}
	slices.SortFunc(ranks, func(a, b kvevent.Rank) int {
		oa, ob := inst[a.Worker], inst[b.Worker]
		return cmp.Or(cmp.Compare(oa.inst, ob.inst), cmp.Compare(oa.model, ob.model), cmp.Compare(oa.group, ob.group),
			cmp.Compare(a.Worker, b.Worker), cmp.Compare(a.DP, b.DP))
	})
	return ranks, inst
}

// loads answers GET /loads from this node's state, or with
// ?consistent=true from the leader's: a client checks there whether a
// write not safe to repeat (an output_block, a release) applied after a
// maybe-applied 503, and a follower behind the leader, or a leader just
// elected that has not applied its predecessors' entries (its Barrier),
// would answer without it and have the client send it a second time. A
// follower forwards the read as it does a write (CheckLeader wraps
// raftfsm.ErrNotLeader), and a leader without every entry answers 503
// no_leader, as it answers a write.
func (s *Selection) loads(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if v := q.Get("consistent"); v != "" {
		consistent, err := strconv.ParseBool(v)
		if err != nil {
			return answer(w, codecOf(r), 0, nil, badRequest("consistent %q: want true or false", v))
		}
		if consistent {
			if err := s.b.CheckLeader(); err != nil {
				return err
			}
		}
	}
	// A model's ranks are those of one group (default "default"); a group
	// alone gives its ranks over every model; neither, every rank.
	// tenant_id is Dynamo's name for the group (its indexer's); given
	// both, they must agree.
	model, group := q.Get("model_name"), q.Get("routing_group")
	if t := q.Get("tenant_id"); t != "" {
		if group != "" && group != t {
			return answer(w, codecOf(r), 0, nil, badRequest("routing_group %q and tenant_id %q differ: give one", group, t))
		}
		group = t
	}
	if model != "" {
		group = orDefaultTenant(group)
	}
	ranks, inst := s.ranksOf(model, group)
	byRank := map[kvevent.Rank]indexer.Load{}
	for _, l := range s.b.Loads() {
		byRank[l.Rank] = l.Load
	}
	out := make([]RankLoad, 0, len(ranks))
	for _, rk := range ranks {
		out = append(out, inst[rk.Worker].load(rk, byRank[rk]))
	}
	return answer(w, codecOf(r), http.StatusOK, out, nil)
}

func (s *Selection) potentialLoads(_ context.Context, req *PotentialLoadsRequest) (any, error) {
	if err := defaultModel(&req.ModelName, req.RoutingGroup); err != nil {
		return nil, err
	}
	if req.ISLTokens < 0 {
		return nil, badRequest("isl_tokens %d is negative", req.ISLTokens)
	}
	group := orDefaultTenant(req.RoutingGroup)
	ranks, inst := s.ranksOf(req.ModelName, group)
	ns := s.x.ns.get(s.b, req.ModelName, group)
	// Without sequence_hashes or isl_tokens the prompt's blocks give them,
	// as /select (Route) derives them, so that these are the figures it
	// scores with: the blocks' sequence hashes, and their tokens.
	if err := sameBlockCount(len(req.BlockHashes), len(req.SequenceHashes), false); err != nil {
		return nil, err
	}
	local := hashes(req.BlockHashes)
	seq := hashes(req.SequenceHashes)
	if len(seq) == 0 {
		seq = kvevent.SequenceHashes(nil, local)
	}
	isl := int64(req.ISLTokens)
	if isl == 0 {
		isl = int64(len(local)) * int64(ns.blockSize)
	}
	loads, idle := s.b.PotentialLoads(seq)
	byRank := map[kvevent.Rank]indexer.RankLoad{}
	for _, l := range loads {
		byRank[l.Rank] = l
	}
	// Cached tokens per rank, from the index, for the prefill figure:
	// looked up in the cluster's view, as /select's route looks them up
	// (its effective_prefill_tokens), not always in the dedup view, which
	// under the tiered view counted a prefix /select does not.
	cached := map[kvevent.Rank]int64{}
	if len(local) > 0 {
		var m indexer.Matches
		s.b.FindMatches(local, s.b.Settings().View, &m)
		for _, rm := range m.Ranks {
			cached[rm.Rank] = int64(rm.Total()) * int64(ns.blockSize)
		}
	}
	out := make([]RankLoad, 0, len(ranks))
	for _, rk := range ranks {
		l, ok := byRank[rk]
		pot := idle
		if ok {
			pot = l.PotentialDecodeBlocks
		}
		pre := l.Load.ActivePrefillTokens + max(isl-cached[rk], 0)
		e := inst[rk.Worker].load(rk, l.Load)
		e.PotentialDecodeBlocks, e.PotentialPrefillToks = &pot, &pre
		out = append(out, e)
	}
	return out, nil
}

func (s *Selection) overlapScores(_ context.Context, req *OverlapScoresRequest) (any, error) {
	if err := defaultModel(&req.ModelName, req.RoutingGroup); err != nil {
		return nil, err
	}
	if req.CacheSalt != nil {
		return nil, &httpError{code: http.StatusBadRequest, err: errHashSalt}
	}
	return s.x.lookupHashes(s.x.ns.get(s.b, req.ModelName, orDefaultTenant(req.RoutingGroup)), req.BlockHashes), nil
}

// routeRefusalStatus is the status of a route that found no rank to
// choose: 429 when every candidate is busy, as Dynamo's selection service
// answers it (its scheduler's overloaded rejection, services/selection
// error.rs), so that a Dynamo client that retries on 429 backs off and
// retries; 503 when there was no candidate at all (its unavailable
// rejection). /v1/route keeps its 503 "overloaded" (docs/api.md).
func routeRefusalStatus(err error) int {
	if errors.Is(err, indexer.ErrOverloaded) {
		return http.StatusTooManyRequests
	}
	return http.StatusServiceUnavailable
}

// SelectionPrefix is where a node serves the selection API beside the
// indexer API. SelectionHandler serves it at the root of its own listener.
const SelectionPrefix = "/selection"

// SelectionHandler serves the selection API at the root of a listener of
// its own by handing each request to h (the node's server, where Routes
// mounted it under SelectionPrefix) with the prefix added, so that a
// forward to the leader reaches the same route there.
//
// The escaped path gets the prefix too: a reservation id with a '/' comes
// as %2F, and the router (and a forward) match on the escaped path, where
// the decoded one has a segment more and names no route.
//
// The path is cleaned before the prefix goes on (a doubled slash, "." and
// ".." segments), as the mux would clean it: the mux answers a path that
// is not clean with a redirect to the clean one, which would carry the
// prefix, a path this listener does not serve (it would prefix it again).
// Served at once instead, such a path gets what the main port gives under
// the prefix after its redirect. The escaped path is cleaned, as the mux
// does, so an escaped id ("x%2F..%2Fy") is one segment and stays whole.
func SelectionHandler(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		decoded, raw := r.URL.Path, r.URL.RawPath
		// The mux leaves CONNECT's path as it comes; so does this.
		if r.Method != http.MethodConnect {
			if p, esc, ok := httppath.Cleaned(r.URL); ok {
				decoded, raw = p, esc
			}
		}
		// The Server's 404 and 405 name the path the client sent, not
		// the /selection one this listener does not serve.
		r2 := r.Clone(api.WithSentPath(r.Context(), decoded))
		r2.URL.Path = SelectionPrefix + decoded
		if raw != "" {
			// The prefix needs no escaping, so this stays a valid
			// encoding of Path.
			r2.URL.RawPath = SelectionPrefix + raw
		}
		h.ServeHTTP(w, r2)
	})
}
