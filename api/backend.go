package api

import (
	"context"
	"io"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// A Backend is the node the API serves: *raftfsm.Node in production, an
// in-memory fake in tests (package apitest).
//
// Reads are answered from the node's local state, on any node, but for a
// consistent read, which CheckLeader gates as a write is. Writes go
// through Raft: on a follower they return an error wrapping
// raftfsm.ErrNotLeader (a *raftfsm.NotLeaderError that carries the
// leader's HTTP address), which the Server turns into a forward to the
// leader, or raftfsm.ErrNoLeader when no leader is known. Every write must
// be safe to retry: the Server forwards one that answered ErrNotLeader,
// and a write may still apply after that answer (a leader that lost its
// leadership with the entry in its log: the next leader may commit it), as
// after a timeout.
//
// The Server validates every argument before calling a method; a Backend
// may still refuse one with raftfsm.ErrInvalid. Methods are called
// concurrently.
type Backend interface {
	// Status is this node's view of itself and the cluster. It may wait for
	// an apply in progress and for Raft's main loop.
	Status() raftfsm.NodeStatus
	// Readiness is what /readyz reports: Status's Ready, State,
	// AppliedIndex, LeaderID, ApplyHalted and Removed, the rest zero. It
	// waits for no apply, nor for Raft's main loop while a leader is known.
	Readiness() raftfsm.NodeStatus
	// Members lists the servers of this node's latest Raft configuration,
	// each with its HTTP address from the replicated member table ("" when
	// the table has none).
	Members(ctx context.Context) ([]raftfsm.Member, error)
	// Workers lists every registered worker with its ranks' index and load
	// figures.
	Workers() []raftfsm.WorkerStatus
	// IndexStats summarises this node's index.
	IndexStats() indexer.Stats
	// Route chooses a rank for a request from this node's index and load
	// view. With q.Book set it is a write: it books the request under
	// q.RequestID through Raft before returning. On indexer.ErrOverloaded the
	// result still holds every candidate's score, for the operator. The
	// slices of q belong to the Server, which reuses them for a later
	// request once Route returns: Route must not keep them (a booking keeps
	// a copy).
	Route(ctx context.Context, q raftfsm.RouteQuery) (raftfsm.RouteResult, error)

	// IngestEvents applies each rank's batch in order and acknowledges each
	// once committed; the acks are in the order of batches.
	IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error)
	// ReplaceRank replaces a rank's whole index state with a dump of stored
	// events, and sets its cursor (after a gap the publisher could not fill).
	ReplaceRank(ctx context.Context, rank kvevent.Rank, cursor uint64, stored []kvevent.Event) error
	// RegisterWorker registers a worker or updates its registration.
	RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error
	// DeregisterWorker removes a worker, its ranks' index state and load;
	// raftfsm.ErrUnknownWorker when there is none of that id.
	DeregisterWorker(ctx context.Context, workerID uint64) error
	// PrefillDone marks a booked request's prefill as finished. Idempotent.
	PrefillDone(ctx context.Context, requestID string) error
	// Free ends a booked request. Idempotent.
	Free(ctx context.Context, requestID string) error
	// Settings returns the cluster's scoring settings, as this node's state
	// holds them.
	Settings() raftfsm.Settings
	// CheckLeader returns nil on a leader whose state holds every entry
	// committed before its term, and elsewhere the error a write would
	// return: ErrNotLeader (forwarded) on a follower, ErrNoLeader on a
	// leader whose post-election Barrier has not passed. A consistent read
	// (GET /v1/settings?consistent=true) calls it first.
	CheckLeader() error
	// SetSettings replaces the cluster's scoring settings.
	SetSettings(ctx context.Context, s raftfsm.Settings) error
	// AddMember adds a voter to the cluster: a non-voter until it has
	// caught up (raftfsm.Node.AddMember), waiting for that within ctx.
	AddMember(ctx context.Context, id, raftAddr, httpAddr string) error
	// RemoveMember removes a member from the cluster.
	RemoveMember(ctx context.Context, id string) error
	// TransferLeadership hands leadership to the voter toID (a non-voter
	// is raftfsm.ErrInvalid), or to any up-to-date voter when toID is "",
	// and returns once it moved.
	TransferLeadership(ctx context.Context, toID string) error
	// SaveSnapshot streams the leader's latest state to w: a header, the
	// records and a checksum trailer. On a follower it returns ErrNotLeader
	// before writing anything.
	SaveSnapshot(ctx context.Context, w io.Writer) (raftfsm.SnapshotInfo, error)
	// RestoreSnapshot verifies the stream and installs it through Raft on
	// every node; raftfsm.ErrBadSnapshot when the stream is truncated,
	// corrupted or of an unknown format, in which case nothing changed.
	// On a follower it should return ErrNotLeader before reading much of r:
	// the Server can forward only what it could keep (Options.MaxBodyBytes).
	RestoreSnapshot(ctx context.Context, r io.Reader) (raftfsm.SnapshotInfo, error)
}
