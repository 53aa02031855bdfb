package raftfsm

import (
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/kvevent"
)

var (
	// ErrNotLeader means the write must go to the leader; the error's text
	// names the leader, and NotLeaderError carries its addresses.
	ErrNotLeader = errors.New("not the leader")
	// ErrNoLeader means no leader is known right now; retry later.
	ErrNoLeader = errors.New("no leader")
	// ErrBadCommand means a command could not be decoded; it never reaches
	// the state.
	ErrBadCommand = errors.New("bad command")
	// ErrLaterBuild means a command (or a record of the state) was written
	// by a later build than this one: a command format version above the
	// highest this build reads, a command type, a settings view or a
	// worker extension it does not know. Unlike a garbled entry, which the
	// FSM skips, such an entry halts the FSM until the node runs a build
	// that reads it (FSM.Halted). Also ErrBadCommand.
	ErrLaterBuild = fmt.Errorf("%w: written by a later build", ErrBadCommand)
	// ErrBadSnapshot means a snapshot stream is truncated, corrupted or of
	// an unknown format; nothing of it was installed.
	ErrBadSnapshot = errors.New("bad snapshot")
	// ErrInvalid means a request is malformed (a bad worker registration,
	// empty route query, ...); nothing was proposed.
	ErrInvalid = errors.New("invalid request")
	// ErrUnreachable means a member the request needs does not answer
	// (down, cut off, or not yet up); nothing changed. Retry once it is up.
	ErrUnreachable = errors.New("member unreachable")
	// ErrNotProposed means a write was never handed to Raft: its context
	// was done, or its deadline passed, before it was proposed, or Raft
	// could not take it in time (an enqueue timeout). It did not and will
	// not apply. The error wraps the context's (context.Canceled or
	// context.DeadlineExceeded).
	ErrNotProposed = errors.New("not proposed")
	// ErrBlockSizeConflict means a worker registration without a model
	// named another block size than the one the cluster routes with (the
	// other workers', semantics.md §1); nothing was proposed.
	ErrBlockSizeConflict = errors.New("block size conflict")
	// ErrUnknownWorker means no worker has that id.
	ErrUnknownWorker = errors.New("unknown worker")
	// ErrReplaying means a Raft snapshot was refused while Raft replays the
	// log after a restart: the state is ahead of the entries Raft has
	// handed over, and Raft labels a snapshot with the last of those.
	// Raft tries again later.
	ErrReplaying = errors.New("state ahead of the replayed log")
	// ErrRestorePending means a Raft snapshot was refused, or cancelled
	// before it was put in place, because a leader's snapshot or a user
	// restore was put in place after the FSM's state it would hold
	// (snapshotStore). Raft tries again later.
	ErrRestorePending = errors.New("snapshot restore pending")
	// ErrStateReplaced means a snapshot save was cut off because a
	// restore (a user's, or a leader's snapshot) replaced the state while
	// the save read it: the stream written so far must be thrown away.
	// Save again; the next save reads the restored state.
	ErrStateReplaced = errors.New("the state was replaced by a restore while the save read it; save again")
	// ErrInsufficientStorage means the node's data directory lacks the
	// free space a restore needs (RestoreSnapshot); nothing was installed.
	// The error says how much is needed and how much is free.
	ErrInsufficientStorage = errors.New("insufficient storage")
	// ErrTooManyRanks means a worker registration would take the
	// cluster's registered dp ranks past Config.MaxRanks (kvrouter
	// --max-ranks); nothing was proposed. Also ErrInsufficientStorage:
	// the cluster has no room for the ranks.
	ErrTooManyRanks = fmt.Errorf("%w: too many registered dp ranks", ErrInsufficientStorage)
	// ErrForeignCluster means a Raft connection between two nodes was
	// refused because they are of different clusters (greeting.go): a
	// raft address one cluster lists is served by another cluster's node.
	// Neither acted on it.
	ErrForeignCluster = errors.New("another cluster's node")
	// ErrShutdown means the node is closing.
	ErrShutdown = errors.New("node shut down")
	// ErrSaveShutDown means a snapshot save was cut off because the node
	// closed while the save read its state: the stream written so far
	// must be thrown away. Save again from another node (the next
	// leader), or from this one once it restarts. Also ErrShutdown.
	ErrSaveShutDown = fmt.Errorf("%w while the save read the state; save again from another node, or from this one once it restarts", ErrShutdown)
	// ErrStaleDump means a rank dump named a cursor below the one the rank
	// is at, and was not applied (it would move the rank back in time);
	// StaleDumpError carries the rank's cursor.
	ErrStaleDump = errors.New("stale rank dump")
	// ErrUnregisteredRank means a rank dump was not applied because the
	// rank's worker is Positional and does not list it (its dp rank was
	// unregistered, or is not registered yet): as for the rank's events
	// (RankAck.Unregistered), nothing changed, and the rank keeps no state
	// for a later registration of it to find. Retry after a backoff: a
	// registration that lists the rank takes the dump.
	ErrUnregisteredRank = errors.New("rank not listed by its positional worker")
	// ErrDataDirInUse means another node holds the data directory's lock.
	ErrDataDirInUse = errors.New("data directory in use")
	// ErrStartRefused means NewNode refused to start on what its data
	// directory holds, as its Config asks (StartRefusal): a directory of
	// another node (ErrWrongNode), a node its configuration lists at
	// another address (ErrRaftAddrChanged), a cluster of its own started
	// to join, a seeded directory started with other peers. The error's
	// text says why and what to do, and the node did not start.
	ErrStartRefused = errors.New("start refused")
	// ErrWrongNode means the data directory holds another node's Raft
	// state than Config.ID's (it records the id of its node at its first
	// start): started as another id, it would be a second member under
	// that id. Start it with the id it names, or start on an empty
	// directory. Also ErrStartRefused.
	ErrWrongNode = errors.New("data directory belongs to another node")
	// ErrRaftAddrChanged means the cluster's configuration lists this node
	// at another Raft address than Config.RaftAddr: its peers would dial
	// it where it no longer listens, and it would stay a candidate for
	// good. To move a member, remove it and add it at the new address.
	// Also ErrStartRefused.
	ErrRaftAddrChanged = errors.New("node's raft address changed")
	// ErrRaftAddrInUse means an added member's raft address reaches a
	// member's Raft listener (the leader's own included) under another
	// spelling than the configuration's: localhost for 127.0.0.1, a name
	// that resolves to a member's address. The leader would replicate to
	// that member as to the new one: to itself, and it steps down for
	// good; to a follower, and the new member is made a voter by the
	// follower's answers, a second vote for one process. Nothing changed.
	// Also ErrInvalid.
	ErrRaftAddrInUse = fmt.Errorf("%w: raft address in use by another member", ErrInvalid)
	// ErrBookingFreed means a booking's request id was booked and then
	// freed (or expired) before, less than BookingMaxAge ago: request ids
	// are single-use while their tombstone stands, and nothing was booked.
	// Book the request under a new id.
	ErrBookingFreed = errors.New("request id already used: booked and then freed or expired")
	// ErrBookedElsewhere means a booking's request id is live on another
	// rank than the one asked for, where it stays; nothing was booked.
	// BookedElsewhereError carries that rank.
	ErrBookedElsewhere = errors.New("request id already booked on another rank")
)

// StartRefusal is the error of a start NewNode refused (ErrStartRefused,
// and Kind when set): its text is its message alone, which says what to
// do, without a sentinel's words in front.
type StartRefusal struct {
	Kind error // ErrWrongNode, ErrRaftAddrChanged, ..., or nil
	Msg  string
}

func (e *StartRefusal) Error() string { return e.Msg }

// Is makes errors.Is(err, ErrStartRefused) true, and errors.Is(err,
// e.Kind).
func (e *StartRefusal) Is(target error) bool {
	return target == ErrStartRefused || e.Kind != nil && target == e.Kind
}

// refuseStart returns a StartRefusal of kind with the message format
// makes of args.
func refuseStart(kind error, format string, args ...any) error {
	return &StartRefusal{Kind: kind, Msg: fmt.Sprintf(format, args...)}
}

// BookedElsewhereError is returned by Reserve when the request id is live
// on another rank than the booking's.
type BookedElsewhereError struct {
	ID   string       // the request id
	Rank kvevent.Rank // the rank the id is booked on
}

func (e *BookedElsewhereError) Error() string {
	return fmt.Sprintf("%v: %q is booked on %v", ErrBookedElsewhere, e.ID, e.Rank)
}

// Unwrap makes errors.Is(err, ErrBookedElsewhere) true.
func (e *BookedElsewhereError) Unwrap() error { return ErrBookedElsewhere }

// StaleDumpError is returned by ReplaceRank when the dump's cursor is
// below the rank's: a publisher that numbers its events anew (an agent
// restart) resends its dump numbered past Cursor.
type StaleDumpError struct {
	Cursor uint64 // the rank's cursor, which the dump did not reach
}

func (e *StaleDumpError) Error() string {
	return fmt.Sprintf("%v: the rank is at event %d", ErrStaleDump, e.Cursor)
}

// Unwrap makes errors.Is(err, ErrStaleDump) true.
func (e *StaleDumpError) Unwrap() error { return ErrStaleDump }

// NotLeaderError is returned by writes on a follower.
type NotLeaderError struct {
	LeaderID   string
	LeaderHTTP string // empty when unknown
	// MaybeApplied: the node lost its leadership while the write was in
	// its log, and the next leader may commit it. A write that is not
	// safe to send twice must not be sent again as if it had not been.
	MaybeApplied bool
	// Closed: the node closed, rather than lost its leadership, with the
	// write in its log (MaybeApplied); the error is ErrShutdown, not
	// ErrNoLeader or ErrNotLeader, and names no leader.
	Closed bool
}

func (e *NotLeaderError) Error() string {
	switch {
	case e.Closed:
		return ErrShutdown.Error()
	case e.LeaderID == "":
		return ErrNoLeader.Error()
	}
	return "not the leader; the leader is " + e.LeaderID + " at " + e.LeaderHTTP
}

// Unwrap makes errors.Is(err, ErrNotLeader) (or ErrNoLeader, or
// ErrShutdown when Closed) true.
func (e *NotLeaderError) Unwrap() error {
	switch {
	case e.Closed:
		return ErrShutdown
	case e.LeaderID == "":
		return ErrNoLeader
	}
	return ErrNotLeader
}
