package raftfsm

import (
	"math"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// MaxBlockSize is the largest block size, in tokens, a registration may
// give: RegisterWorker refuses a larger one (ErrInvalid).
const MaxBlockSize = 1 << 20

// MaxCapacity bounds each tier of WorkerInfo.Capacity, in blocks: a
// trillion, far past any device, host or disk, and small enough that the
// index's capacity arithmetic (the slack added to it) never overflows.
// RegisterWorker and the API refuse more (ErrInvalid).
const MaxCapacity = 1 << 40

// MaxLeaseMs bounds WorkerInfo.LeaseMs: a year. A longer lease is refused
// (RegisterWorker, the API): a lease that long is no lease, and one
// past about 292 years does not fit a time.Duration.
const MaxLeaseMs = 365 * 24 * 60 * 60 * 1000

// WorkerInfo is a worker's registration: replicated, so that every node
// scores the same candidates.
type WorkerInfo struct {
	ID        uint64                  `json:"worker_id"`
	DPRanks   []uint32                `json:"dp_ranks"`           // its data-parallel ranks; empty means [0]
	BlockSize int                     `json:"block_size"`         // tokens per KV block
	Capacity  [kvevent.NumTiers]int64 `json:"capacity_blocks"`    // per tier, 0 = unknown
	Endpoint  string                  `json:"endpoint,omitempty"` // where requests go (opaque here)
	Model     string                  `json:"model,omitempty"`

	// The fields below come from the compatible APIs (package compat),
	// whose workers are instances registered per (model, tenant).

	// Tenant partitions a model's workers: a query of one tenant never
	// scores another's. "" for workers registered through /v1.
	Tenant string `json:"tenant,omitempty"`
	// Instance is the instance id the compatible API knows this worker
	// by; ID is derived from (Instance, Model, Tenant). 0 for /v1 workers.
	Instance uint64 `json:"instance_id,omitempty"`
	// EventEndpoints and ReplayEndpoints are the engine's ZMQ event and
	// replay endpoints per dp rank, when it registered them.
	EventEndpoints  map[uint32]string `json:"event_endpoints,omitempty"`
	ReplayEndpoints map[uint32]string `json:"replay_endpoints,omitempty"`
	// Salt is the engine's additional salt for block hashes.
	Salt string `json:"salt,omitempty"`
	// LeaseMs, when > 0, makes the registration a lease: the leader removes
	// the worker (through Raft) once it has heard no heartbeat from it for
	// this long (eventplane's heartbeat subject; kvagent sends them). 0: the
	// registration stays until deregistered. At most MaxLeaseMs.
	LeaseMs int64 `json:"lease_ms,omitempty"`
	// Positional: the ranks' event ids are positions in the engine's
	// stream (compat.Position: epoch, batch sequence, index), assigned by
	// the cluster's own subscriber (the agentless mode of the compatible
	// indexer API). They only go up, with holes: the cursor still drops an
	// id at or below it, but a hole is no gap. The cursor then says where
	// a new leader's subscriber resumes.
	Positional bool `json:"positional,omitempty"`
}

// RankBatch is one rank's consecutive events, as a publisher sent them.
// Events carry their own EventID; ids are strictly increasing by one.
type RankBatch struct {
	Rank kvevent.Rank
	// Incarnation is the publisher incarnation that sent the batch
	// (eventplane: each Publisher draws a random non-zero one), or 0 for
	// an unfenced batch (the HTTP and compatible APIs, agents of builds
	// before incarnations). docs/events.md says what the FSM does with it.
	// PositionalIncarnation marks a batch of positions instead.
	Incarnation uint64
	Events      []kvevent.Event
}

// PositionalIncarnation is the Incarnation of a batch whose event ids are
// positions in an engine's stream (the compatible API's agentless
// subscriber, compat): it applies only to a rank of a Positional worker
// that lists it, and is acknowledged Unregistered otherwise, the worker's
// registration checked as the batch applies. A subscriber runs on for up
// to a poll after its worker was unregistered and registered again with
// non-positional ids: its first batch (ids 1..k from the engine's first)
// applied to the new registration, and the poster's own events 1..k were
// then skipped as duplicates. No publisher uses it (eventplane refuses it
// on the wire), and no batch of it is fenced: the subscriber follows no
// dump.
const PositionalIncarnation uint64 = math.MaxUint64

// RankAck is what the cluster did with one RankBatch, once committed.
type RankAck struct {
	Rank    kvevent.Rank `json:"-"`
	Cursor  uint64       `json:"cursor"`  // the rank's last applied event id after this batch
	Applied int          `json:"applied"` // events applied
	Dups    int          `json:"dups"`    // events at or below the cursor, skipped
	// Gap is set when the batch's first unapplied event id was above
	// Cursor+1: nothing past the gap was applied; resend from Cursor+1, or
	// send a full dump of the rank.
	Gap bool `json:"gap"`
	// Resync is set when the rank lost events it held (an orphan store
	// dropped past its bound or age, semantics.md §3) and no dump has
	// replaced its state since: send a full dump of the rank. It is set
	// with Fenced too.
	Resync bool `json:"resync,omitempty"`
	// Unregistered is set when the rank's worker is Positional and does
	// not list the rank (its dp rank was unregistered while the leader's
	// subscriber of it still ran): nothing was applied, no cursor set and
	// Cursor is 0, so that the rank leaves no state behind for a later
	// registration of it to find. A dump of such a rank is refused the
	// same way (ErrUnregisteredRank).
	Unregistered bool `json:"unregistered,omitempty"`
	// Fenced is set when the batch's incarnation is not the one of the
	// dump that last replaced the rank (both non-zero): it applied
	// nothing, neither events nor duplicates, and Cursor is the rank's,
	// in that other incarnation's numbering. It is a dead incarnation's
	// late request, or the rank has another live publisher: a live one
	// dumps the rank, which makes it the rank's incarnation
	// (docs/events.md).
	Fenced bool `json:"fenced,omitempty"`
}

// Booking is a routed request's load booking (semantics.md §6).
type Booking struct {
	ID           string       `json:"request_id"`
	Rank         kvevent.Rank `json:"-"`
	SeqHashes    []uint64     `json:"-"`
	ISL          int          `json:"isl"`
	CachedTokens int          `json:"cached_tokens"`
	// Discount is carried only by a decay operation (see Node.OutputBlock).
	Discount uint32 `json:"-"`
}

// Settings are the cluster-wide scoring settings.
type Settings struct {
	Params indexer.Params `json:"params"`
	View   indexer.View   `json:"-"`
}

// Member is one node of the cluster as the replicated member table knows it.
type Member struct {
	ID       string `json:"id"`
	RaftAddr string `json:"raft_addr"`
	HTTPAddr string `json:"http_addr"`
	Voter    bool   `json:"voter"`
	Leader   bool   `json:"leader"`
}

// NodeStatus is one node's view of itself and the cluster.
type NodeStatus struct {
	ID string `json:"id"`
	// ClusterID names the node's cluster (hex; raftfsm/greeting.go): the
	// nodes of one cluster show the same, and refuse Raft connections
	// from nodes of another. Empty for a directory of a build before
	// cluster ids, which checks none.
	ClusterID string `json:"cluster_id,omitempty"`
	// ClusterIDProvisional: no connection has confirmed ClusterID yet
	// (derived at the directory's bootstrap; greeting.go), so it may not
	// be the cluster's: members of a cluster of no id wiped and started
	// again with --peers each show their own.
	ClusterIDProvisional bool   `json:"cluster_id_provisional,omitempty"`
	RaftAddr             string `json:"raft_addr"`
	HTTPAddr             string `json:"http_addr"`
	State                string `json:"state"` // Leader, Follower, Candidate, Shutdown
	Term                 uint64 `json:"term"`
	LastIndex            uint64 `json:"last_index"`
	CommitIndex          uint64 `json:"commit_index"`
	AppliedIndex         uint64 `json:"applied_index"` // the FSM's own
	LeaderID             string `json:"leader_id"`
	LeaderHTTP           string `json:"leader_http"`
	LastContactMs        int64  `json:"last_contact_ms"` // -1 when never
	SnapshotIndex        uint64 `json:"snapshot_index"`
	Digest               string `json:"digest"` // hex; equal on replicas at equal applied index
	Ready                bool   `json:"ready"`
	// Removed: the node has been a member of the cluster (a latest Raft
	// configuration of its named it; its data directory keeps that across
	// restarts), its latest configuration has members and not this node,
	// and no leader replicates to it (its Raft is shut down, or it knows
	// no leader and has heard from none for two election timeouts, counted
	// from its start if it has heard from none since): it
	// was removed from the cluster, and serves nothing more. A node
	// joining, or a removed one added back on an empty data directory,
	// whose log still holds configurations from before it was added, is
	// not removed: the leader that adds it replicates to it.
	Removed bool `json:"removed,omitempty"`
	// NATS is the node's connection to NATS, "connected" or
	// "disconnected", as /readyz shows it; empty where the node has none.
	// The API server fills it (raftfsm knows nothing of NATS). Only the
	// leader ingests the agents' events: a leader disconnected from NATS
	// ingests none until it reconnects.
	NATS string `json:"nats,omitempty"`
	// ApplyHalted, when set, says that the node's state machine halted at
	// an entry a later build wrote (FSM.Halted: its index, term and why):
	// it applies nothing more, and is not Ready, until it is restarted on
	// a build that reads the entry (docs/operations.md, "Upgrade").
	ApplyHalted string `json:"apply_halted,omitempty"`
}

// WorkerStatus is a worker's registration with what the index and the load
// tracker hold for each of its ranks.
type WorkerStatus struct {
	Info  WorkerInfo   `json:"info"`
	Ranks []RankStatus `json:"ranks"`
}

// RankStatus is one rank's index and load figures.
type RankStatus struct {
	DPRank      uint32                  `json:"dp_rank"`
	Blocks      [kvevent.NumTiers]int64 `json:"blocks"` // device, host, disk, external
	Cursor      uint64                  `json:"last_event_id"`
	NeedsResync bool                    `json:"needs_resync"`
	Load        indexer.Load            `json:"load"`
	// LastHeard is when the rank's events last reached the log (unix
	// nanos, the leader's clock); 0 when not since this node started.
	LastHeard int64 `json:"last_heard"`
	// Silent: nothing heard of the rank for Config.SilentAfter (counted
	// from this node's start when it has heard nothing yet). Its agent or
	// engine may be down while the worker's registration stays.
	Silent bool `json:"silent"`
	// Busy: the rank's load is over a busy threshold of the cluster's
	// scoring settings (busy_decode_fraction of its device capacity, or
	// busy_prefill_tokens); a route passes it over while another is not.
	Busy bool `json:"busy"`
}

// RouteQuery asks which rank should serve a request. Give either Tokens
// (hashed here with the cluster's block size, LoRA name and salt) or
// LocalHashes (content hashes of the prompt's full blocks, computed by the
// caller). ISL is the prompt length in tokens; when 0 it is len(Tokens), or
// len(LocalHashes) × block size.
type RouteQuery struct {
	Tokens      []uint32
	LocalHashes []uint64
	ISL         int
	LoRA        string
	Salt        string
	Overrides   *indexer.Overrides
	// Book, when set, books the request on the chosen rank through Raft
	// under RequestID before returning (semantics.md §6).
	Book      bool
	RequestID string

	// Filter, when set, keeps only the candidates it accepts (the ranks of
	// one namespace of the compatible APIs).
	Filter func(kvevent.Rank) bool
	// BlockSize, when > 0, replaces the cluster's block size (a
	// namespace's own).
	BlockSize int
	// SeqHashes, when set, are the request's sequence hashes as the caller
	// computed them: used for the load view and the booking instead of the
	// ones derived from the content hashes.
	SeqHashes []uint64
	// Prefer, when set, wins a tie on cost with the chosen rank (the rank
	// a session used last; indexer.Decision.Prefer).
	Prefer *kvevent.Rank
	// TieKey, when not 0, keys the rendezvous tie-break instead of the
	// route's own RendezvousKey: a caller that hashed the tokens itself
	// (the compatible selection API) gives the key of its tokens, which
	// the route no longer sees.
	TieKey uint64
	// Brief keeps only the chosen candidate in the result's Decision
	// (Candidates has one element, Index 0): what a caller that does not
	// explain the decision needs, without copying every candidate.
	Brief bool
}

// RouteResult is a decision and its explanation.
type RouteResult struct {
	Decision  indexer.Decision
	BlockSize int
	Booked    bool
	Stages    RouteStages
}

// RouteStages is how long each stage of a route decision took
// (kvrouter_route_duration_seconds{stage}); a stage not reached is 0.
type RouteStages struct {
	Hash  time.Duration // the prompt's block and sequence hashes
	Match time.Duration // the index lookup (FindMatchesByTier)
	Load  time.Duration // the load view and the candidates
	Score time.Duration // scoring and the choice
	Book  time.Duration // the booking, through Raft (0 without one)
}

// SnapshotInfo describes a snapshot stream.
type SnapshotInfo struct {
	FormatVersion uint32           `json:"format_version"`
	Index         uint64           `json:"index"`
	Term          uint64           `json:"term"`
	Records       map[string]int64 `json:"records"` // per record type
	Bytes         int64            `json:"bytes"`
	SHA256        string           `json:"sha256"`
}
