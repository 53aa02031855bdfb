package api

import (
	"cmp"
	"slices"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// The JSON bodies of the API. 64-bit values (worker ids, block hashes) are
// JSON numbers written exactly as integers: decoders that read every number
// as a float64 (JavaScript's JSON.parse) lose the low bits of a hash.
//
// The node's own types are used as they are where their JSON form already
// is the API's (raftfsm.NodeStatus, raftfsm.Member, raftfsm.SnapshotInfo);
// the others get a wire type here, so that the API names tiers and fields
// in snake_case whatever the Go types look like.

// ErrorResponse is the body of every error answer.
type ErrorResponse struct {
	Error  string `json:"error"`
	Reason string `json:"reason"`
	// Candidates are the scored candidates of a route request that failed
	// with reason overloaded: every one is busy, and says why. At most
	// MaxCandidates, as a route's answer.
	Candidates        []Candidate `json:"candidates,omitempty"`
	CandidatesLeftOut int         `json:"candidates_left_out,omitempty"`
}

// TierBlocks is a count per storage tier.
type TierBlocks struct {
	Device   int64 `json:"device"`
	Host     int64 `json:"host"`
	Disk     int64 `json:"disk"`
	External int64 `json:"external"`
}

// Get returns the count of tier t (0 for an invalid tier).
func (b TierBlocks) Get(t kvevent.Tier) int64 {
	switch t {
	case kvevent.TierDevice:
		return b.Device
	case kvevent.TierHostPinned:
		return b.Host
	case kvevent.TierDisk:
		return b.Disk
	case kvevent.TierExternal:
		return b.External
	}
	return 0
}

// Total is the sum over the tiers.
func (b TierBlocks) Total() int64 { return b.Device + b.Host + b.Disk + b.External }

// Array returns the counts indexed by kvevent.Tier.
func (b TierBlocks) Array() [kvevent.NumTiers]int64 {
	return [kvevent.NumTiers]int64{b.Device, b.Host, b.Disk, b.External}
}

func tierBlocks[T ~int64 | ~uint32](a [kvevent.NumTiers]T) TierBlocks {
	return TierBlocks{Device: int64(a[0]), Host: int64(a[1]), Disk: int64(a[2]), External: int64(a[3])}
}

// RouteRequest is the body of POST /v1/route. Give TokenIDs or BlockHashes,
// not both.
type RouteRequest struct {
	// TokenIDs is the prompt; the node hashes its full blocks with the
	// cluster's block size, LoRAName and CacheSalt.
	TokenIDs []uint32 `json:"token_ids,omitempty"`
	// BlockHashes are the content hashes of the prompt's full blocks,
	// computed by the caller (kvevent's block hashing).
	BlockHashes []uint64 `json:"block_hashes,omitempty"`
	// ISL is the prompt length in tokens; 0 means len(token_ids), or
	// len(block_hashes) × block size.
	ISL       int                `json:"isl,omitempty"`
	LoRAName  string             `json:"lora_name,omitempty"`
	CacheSalt string             `json:"cache_salt,omitempty"`
	Overrides *indexer.Overrides `json:"overrides,omitempty"`
	// Book books the request on the chosen rank under RequestID (required
	// then) before answering; free it with DELETE /v1/requests/{id}.
	Book      bool   `json:"book,omitempty"`
	RequestID string `json:"request_id,omitempty"`
	// Brief answers without the candidates' scores: the choice, its cost
	// and overlap, and a 503 overloaded without them either. A router's
	// hot path wants this; kvctl route does not.
	Brief bool `json:"brief,omitempty"`
	// Model names the request's model for the metrics only
	// (kvrouter_route_requests_total{model}); routing does not filter by
	// it: a cluster serves one model (the compatible API has namespaces).
	Model string `json:"model,omitempty"`
}

// RouteResponse is a route decision and its explanation.
type RouteResponse struct {
	WorkerID      uint64  `json:"worker_id"`
	DPRank        uint32  `json:"dp_rank"`
	Cost          float64 `json:"cost"`
	DecidedBy     string  `json:"decided_by"` // cost, overlap, active_blocks, rendezvous, input_order, sample
	BlockSize     int     `json:"block_size"`
	RequestBlocks int64   `json:"request_blocks"`
	Booked        bool    `json:"booked"`
	// Overlap is the chosen rank's matched blocks per tier.
	Overlap    TierBlocks     `json:"overlap"`
	Params     indexer.Params `json:"params"`               // the effective scoring parameters
	Candidates []Candidate    `json:"candidates,omitempty"` // the ranks' scores, at most MaxCandidates; absent when brief
	// CandidatesLeftOut counts the candidates past MaxCandidates that
	// Candidates leaves out (absent when none is).
	CandidatesLeftOut int `json:"candidates_left_out,omitempty"`
}

// Candidate is one rank's score in a route decision: every term of its cost.
type Candidate struct {
	WorkerID              uint64     `json:"worker_id"`
	DPRank                uint32     `json:"dp_rank"`
	Chosen                bool       `json:"chosen"`
	Overlap               TierBlocks `json:"overlap"` // matched blocks per tier
	Credit                float64    `json:"credit"`  // blocks of prefill the cache saves
	PrefillBlocks         float64    `json:"prefill_blocks"`
	PotentialDecodeBlocks int64      `json:"potential_decode_blocks"`
	ActiveRequests        int64      `json:"active_requests"`
	ActivePrefillTokens   int64      `json:"active_prefill_tokens"`
	ActiveDecodeBlocks    int64      `json:"active_decode_blocks"`
	Cost                  float64    `json:"cost"`
	Busy                  bool       `json:"busy"`
	BusyReason            string     `json:"busy_reason,omitempty"` // decode_blocks, prefill_tokens or both joined by +
	Probability           float64    `json:"probability"`           // of being sampled; 0 at temperature 0
}

// MaxCandidates bounds the candidates a route's answer lists: a cluster
// of 819,200 ranks answered one route with 219 MB. About 280 bytes each,
// so some 72 KB at most.
const MaxCandidates = 256

// candidates returns d's candidates, or, of more than MaxCandidates, the
// chosen one and the best others (not busy before busy, then by cost,
// then in rank order), in rank order, and how many it left out.
func candidates(d *indexer.Decision) ([]Candidate, int) {
	keep := make([]int, len(d.Candidates))
	for i := range keep {
		keep[i] = i
	}
	if len(keep) > MaxCandidates {
		slices.SortStableFunc(keep, func(a, b int) int {
			ca, cb := &d.Candidates[a], &d.Candidates[b]
			switch {
			case (a == d.Index) != (b == d.Index):
				if a == d.Index {
					return -1
				}
				return 1
			case ca.Busy != cb.Busy:
				if cb.Busy {
					return -1
				}
				return 1
			}
			return cmp.Compare(ca.Cost, cb.Cost)
		})
		keep = keep[:MaxCandidates]
		slices.Sort(keep)
	}
	out := make([]Candidate, len(keep))
	for j, i := range keep {
		c := &d.Candidates[i]
		out[j] = Candidate{
			WorkerID:              c.Rank.Worker,
			DPRank:                c.Rank.DP,
			Chosen:                i == d.Index,
			Overlap:               tierBlocks(c.Overlap),
			Credit:                c.Credit,
			PrefillBlocks:         c.PrefillBlocks,
			PotentialDecodeBlocks: c.PotentialDecodeBlocks,
			ActiveRequests:        c.ActiveRequests,
			ActivePrefillTokens:   c.ActivePrefillTokens,
			ActiveDecodeBlocks:    c.ActiveDecodeBlocks,
			Cost:                  c.Cost,
			Busy:                  c.Busy,
			BusyReason:            c.BusyReason.String(),
			Probability:           c.Probability,
		}
	}
	return out, len(d.Candidates) - len(keep)
}

func routeResponse(res *raftfsm.RouteResult, brief bool) RouteResponse {
	d := &res.Decision
	var overlap TierBlocks
	if c := d.Chosen(); c != nil {
		overlap = tierBlocks(c.Overlap)
	}
	out := RouteResponse{
		WorkerID:      d.Rank.Worker,
		DPRank:        d.Rank.DP,
		Cost:          d.Cost,
		DecidedBy:     d.DecidedBy.String(),
		BlockSize:     res.BlockSize,
		RequestBlocks: d.RequestBlocks,
		Booked:        res.Booked,
		Overlap:       overlap,
		Params:        d.Params,
	}
	if !brief {
		out.Candidates, out.CandidatesLeftOut = candidates(d)
	}
	return out
}

// Worker is a registered worker and what the index and the load tracker
// hold for each of its ranks (GET /v1/workers).
type Worker struct {
	WorkerID  uint64     `json:"worker_id"`
	DPRanks   []uint32   `json:"dp_ranks"`
	BlockSize int        `json:"block_size"`
	Capacity  TierBlocks `json:"capacity_blocks"`
	Endpoint  string     `json:"endpoint,omitempty"`
	Model     string     `json:"model,omitempty"`
	Salt      string     `json:"salt,omitempty"`
	LeaseMs   int64      `json:"lease_ms,omitempty"`
	Ranks     []RankInfo `json:"ranks"`
}

// RankInfo is one rank's index and load figures.
type RankInfo struct {
	DPRank      uint32     `json:"dp_rank"`
	Blocks      TierBlocks `json:"blocks"`
	LastEventID uint64     `json:"last_event_id"`
	NeedsResync bool       `json:"needs_resync"`
	Load        Load       `json:"load"`
	// LastHeardMs is when the rank's events last reached the log (unix
	// ms, the leader's clock); 0 when not since the answering node started.
	LastHeardMs int64 `json:"last_heard_ms"`
	// Silent: nothing heard of the rank for the node's --silent-after.
	Silent bool `json:"silent"`
	// Busy: the rank's load is over a busy threshold of the cluster's
	// scoring settings; routes pass it over while another rank is not.
	Busy bool `json:"busy"`
}

// Load is the load that live bookings put on a rank.
type Load struct {
	ActivePrefillTokens int64 `json:"active_prefill_tokens"`
	ActiveDecodeBlocks  int64 `json:"active_decode_blocks"`
	ActiveRequests      int64 `json:"active_requests"`
}

// WorkersResponse is the body of GET /v1/workers, sorted by worker id.
type WorkersResponse struct {
	Workers []Worker `json:"workers"`
}

func workers(ws []raftfsm.WorkerStatus) WorkersResponse {
	out := make([]Worker, 0, len(ws))
	for _, w := range ws {
		dp := w.Info.DPRanks
		if len(dp) == 0 {
			dp = []uint32{0}
		}
		wk := Worker{
			WorkerID:  w.Info.ID,
			DPRanks:   dp,
			BlockSize: w.Info.BlockSize,
			Capacity:  tierBlocks(w.Info.Capacity),
			Endpoint:  w.Info.Endpoint,
			Model:     w.Info.Model,
			Salt:      w.Info.Salt,
			LeaseMs:   w.Info.LeaseMs,
			Ranks:     make([]RankInfo, 0, len(w.Ranks)),
		}
		for _, r := range w.Ranks {
			wk.Ranks = append(wk.Ranks, RankInfo{
				DPRank:      r.DPRank,
				Blocks:      tierBlocks(r.Blocks),
				LastEventID: r.Cursor,
				NeedsResync: r.NeedsResync,
				LastHeardMs: r.LastHeard / 1e6,
				Silent:      r.Silent,
				Busy:        r.Busy,
				Load: Load{
					ActivePrefillTokens: r.Load.ActivePrefillTokens,
					ActiveDecodeBlocks:  r.Load.ActiveDecodeBlocks,
					ActiveRequests:      r.Load.ActiveRequests,
				},
			})
		}
		slices.SortFunc(wk.Ranks, func(a, b RankInfo) int { return cmp.Compare(a.DPRank, b.DPRank) })
		out = append(out, wk)
	}
	slices.SortFunc(out, func(a, b Worker) int { return cmp.Compare(a.WorkerID, b.WorkerID) })
	return WorkersResponse{Workers: out}
}

// RegisterWorkerRequest is the body of POST /v1/workers.
type RegisterWorkerRequest struct {
	WorkerID  *uint64    `json:"worker_id"`          // required
	DPRanks   []uint32   `json:"dp_ranks,omitempty"` // empty means [0]
	BlockSize int        `json:"block_size"`         // tokens per KV block, > 0
	Capacity  TierBlocks `json:"capacity_blocks"`    // per tier, 0 = unknown
	Endpoint  string     `json:"endpoint,omitempty"`
	Model     string     `json:"model,omitempty"`
	// Salt is the engine's additional salt: the worker's events are
	// hashed under it by its agent, and a route finds its blocks only
	// with cache_salt equal to it.
	Salt string `json:"salt,omitempty"`
	// LeaseMs, when > 0, removes the worker once the leader has heard no
	// heartbeat from it for this long (docs/events.md); at most
	// raftfsm.MaxLeaseMs (a year).
	LeaseMs int64 `json:"lease_ms,omitempty"`
}

// RegisterWorkerRequestFrom returns the body that registers w.
func RegisterWorkerRequestFrom(w raftfsm.WorkerInfo) RegisterWorkerRequest {
	id := w.ID
	return RegisterWorkerRequest{
		WorkerID:  &id,
		DPRanks:   w.DPRanks,
		BlockSize: w.BlockSize,
		Capacity:  tierBlocks(w.Capacity),
		Endpoint:  w.Endpoint,
		Model:     w.Model,
		Salt:      w.Salt,
		LeaseMs:   w.LeaseMs,
	}
}

// IndexStats is the body of GET /v1/index/stats.
type IndexStats struct {
	Nodes        int64         `json:"nodes"`   // tree nodes
	Ranks        int           `json:"ranks"`   // ranks with state
	Entries      int64         `json:"entries"` // (rank, block) residencies
	Blocks       TierBlocks    `json:"blocks"`  // residencies per tier
	OrphanEvents int           `json:"orphan_events"`
	OrphanBlocks int           `json:"orphan_blocks"`
	NeedResync   int           `json:"need_resync"`
	OverCapacity int           `json:"over_capacity"`
	Counters     IndexCounters `json:"counters"`
	// HeapBytes is the answering node's Go heap in live and not yet
	// collected objects: mostly its index (docs/operations.md, memory).
	HeapBytes uint64 `json:"heap_bytes"`
	// MemoryBytes estimates what the index itself holds
	// (kvrouter_index_memory_bytes).
	MemoryBytes int64 `json:"memory_bytes"`
}

// IndexCounters are the index's event counters since the node started.
type IndexCounters struct {
	StoredBlocks    uint64 `json:"stored_blocks"`
	RemovedBlocks   uint64 `json:"removed_blocks"`
	Cleared         uint64 `json:"cleared"`
	UnknownRemoves  uint64 `json:"unknown_removes"`
	Malformed       uint64 `json:"malformed"`
	OrphansHeld     uint64 `json:"orphans_held"`
	OrphansApplied  uint64 `json:"orphans_applied"`
	OrphansDropped  uint64 `json:"orphans_dropped"`
	Remapped        uint64 `json:"remapped"`
	CapacityEvicted uint64 `json:"capacity_evicted"`
	NameCollisions  uint64 `json:"name_collisions"` // stores cut at a block whose node would take a live node's name
}

func indexStats(s indexer.Stats) IndexStats {
	c := s.Counters
	return IndexStats{
		Nodes: s.Nodes, Ranks: s.Ranks, Entries: s.Entries, Blocks: tierBlocks(s.Blocks),
		OrphanEvents: s.OrphanEvents, OrphanBlocks: s.OrphanBlocks,
		NeedResync: s.NeedResync, OverCapacity: s.OverCapacity, MemoryBytes: s.MemoryBytes,
		Counters: IndexCounters{
			StoredBlocks: c.StoredBlocks, RemovedBlocks: c.RemovedBlocks, Cleared: c.Cleared,
			UnknownRemoves: c.UnknownRemoves, Malformed: c.Malformed,
			OrphansHeld: c.OrphansHeld, OrphansApplied: c.OrphansApplied, OrphansDropped: c.OrphansDropped,
			Remapped: c.Remapped, CapacityEvicted: c.CapacityEvicted, NameCollisions: c.NameCollisions,
		},
	}
}

// MembersResponse is the body of GET /v1/cluster/members.
type MembersResponse struct {
	Members []raftfsm.Member `json:"members"`
}

// AddMemberRequest is the body of POST /v1/cluster/members.
type AddMemberRequest struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"` // host:port
	HTTPAddr string `json:"http_addr"` // host:port
}

// TransferLeaderRequest is the body of POST /v1/cluster/leader/transfer.
type TransferLeaderRequest struct {
	To string `json:"to,omitempty"` // a member id; empty: any up-to-date voter
}

// SettingsRequest is the body of PUT /v1/settings and the answer of GET
// /v1/settings. Params fields left out of a PUT take
// indexer.DefaultParams' values, not the current ones.
type SettingsRequest struct {
	Params *indexer.Params `json:"params,omitempty"`
	View   string          `json:"view,omitempty"` // dedup (default) or tiered
}

// ReadyResponse is the body of GET /readyz.
type ReadyResponse struct {
	Ready        bool   `json:"ready"`
	State        string `json:"state"`
	AppliedIndex uint64 `json:"applied_index"`
	// NATS is the node's NATS connection, "connected" or "disconnected"
	// (never made yet, or lost: the leader then ingests no event), shown
	// only: readiness does not depend on it. Empty when unknown.
	NATS   string `json:"nats,omitempty"`
	Error  string `json:"error,omitempty"`
	Reason string `json:"reason,omitempty"`
}

// Event types and tier names on the wire.
const (
	EventStored  = "stored"
	EventRemoved = "removed"
	EventCleared = "cleared"
)

// Event is one KV event of a rank.
type Event struct {
	EventID uint64 `json:"event_id"`
	Type    string `json:"type"`           // stored, removed or cleared
	Tier    string `json:"tier,omitempty"` // device, host, disk or external; required unless cleared
	// ParentHash is the engine hash of the first stored block's parent;
	// absent means the chain starts at the root. Stored only.
	ParentHash *uint64 `json:"parent_hash,omitempty"`
	Blocks     []Block `json:"blocks,omitempty"` // stored only
	// Hashes are the engine hashes of the removed blocks. Removed only.
	Hashes []uint64 `json:"hashes,omitempty"`
}

// Block is one stored block: the engine's hash and the content hash.
type Block struct {
	Hash      uint64 `json:"hash"`
	LocalHash uint64 `json:"local_hash"`
}

// EventFrom returns the wire form of e (its rank is carried by the batch).
func EventFrom(e *kvevent.Event) Event {
	out := Event{EventID: e.EventID, Tier: e.Tier.String()}
	switch e.Kind {
	case kvevent.KindStored:
		out.Type = EventStored
		if e.HasParent {
			p := e.Parent
			out.ParentHash = &p
		}
		out.Blocks = make([]Block, len(e.Blocks))
		for i, b := range e.Blocks {
			out.Blocks[i] = Block{Hash: b.EngineHash, LocalHash: b.LocalHash}
		}
	case kvevent.KindRemoved:
		out.Type = EventRemoved
		out.Hashes = slices.Clone(e.Removed)
	case kvevent.KindCleared:
		out.Type = EventCleared
	default:
		out.Type = e.Kind.String()
	}
	return out
}

// EventBatch is one rank's consecutive events.
type EventBatch struct {
	// WorkerID is required: a batch without it would apply to worker 0's
	// rank, whatever the sender meant.
	WorkerID *uint64 `json:"worker_id"`
	DPRank   uint32  `json:"dp_rank"` // absent: rank 0, as a registration's dp_ranks
	Events   []Event `json:"events"`
}

// EventsRequest is the body of POST /v1/events.
type EventsRequest struct {
	Batches []EventBatch `json:"batches"`
}

// EventsRequestFrom returns the wire form of batches.
func EventsRequestFrom(batches []raftfsm.RankBatch) EventsRequest {
	out := EventsRequest{Batches: make([]EventBatch, len(batches))}
	for i := range batches {
		b := &batches[i]
		worker := b.Rank.Worker
		eb := EventBatch{WorkerID: &worker, DPRank: b.Rank.DP, Events: make([]Event, len(b.Events))}
		for j := range b.Events {
			eb.Events[j] = EventFrom(&b.Events[j])
		}
		out.Batches[i] = eb
	}
	return out
}

// Ack is what the cluster did with one batch, once committed.
type Ack struct {
	WorkerID uint64 `json:"worker_id"`
	DPRank   uint32 `json:"dp_rank"`
	Cursor   uint64 `json:"cursor"`  // the rank's last applied event id
	Applied  int    `json:"applied"` // events applied
	Dups     int    `json:"dups"`    // events at or below the cursor, skipped
	// Gap: the batch started above cursor+1 and nothing past the gap was
	// applied; resend from cursor+1, or dump the rank.
	Gap bool `json:"gap"`
	// Resync: the rank lost events the cluster held for it (orphans past
	// their bounds); send a dump of the rank.
	Resync bool `json:"resync,omitempty"`
}

// RankAck returns a in the node's form.
func (a Ack) RankAck() raftfsm.RankAck {
	return raftfsm.RankAck{Rank: kvevent.Rank{Worker: a.WorkerID, DP: a.DPRank},
		Cursor: a.Cursor, Applied: a.Applied, Dups: a.Dups, Gap: a.Gap, Resync: a.Resync}
}

// EventsResponse is the body answering POST /v1/events: one ack per batch,
// in the order of the batches.
type EventsResponse struct {
	Acks []Ack `json:"acks"`
}

// DumpRequest is the body of POST /v1/ranks/{worker}/{dp}/dump: the rank's
// whole state as stored events, and the cursor it is at.
type DumpRequest struct {
	Cursor uint64 `json:"cursor"`
	// Events is required, [] for an empty rank: a body without it (or
	// with null) would empty the rank, whatever the sender meant.
	Events []Event `json:"events"`
}

// DumpResponse answers a dump.
type DumpResponse struct {
	WorkerID uint64 `json:"worker_id"`
	DPRank   uint32 `json:"dp_rank"`
	Cursor   uint64 `json:"cursor"`
	Events   int    `json:"events"`
}
