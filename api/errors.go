package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Reasons: the "reason" of an error body, what a client branches on. The
// status code goes with the reason as listed.
const (
	ReasonBadJSON             = "bad_json"             // 400: not JSON, a wrong type, an unknown field or a key twice, trailing data
	ReasonInvalid             = "invalid"              // 400: well-formed, but a value is wrong
	ReasonBadSnapshot         = "bad_snapshot"         // 400: a truncated, corrupted or unknown snapshot; nothing installed
	ReasonUnauthorized        = "unauthorized"         // 401: the cluster asks for a token, and the request's is missing or wrong
	ReasonNotFound            = "not_found"            // 404: no such route
	ReasonUnknownWorker       = "unknown_worker"       // 404
	ReasonUnknownRank         = "unknown_rank"         // 404
	ReasonStaleDump           = "stale_dump"           // 409: the rank's cursor is past the dump's
	ReasonUnregisteredRank    = "unregistered_rank"    // 409: a dump of a rank its positional worker does not list; nothing applied
	ReasonConflict            = "conflict"             // 409: a registration breaks a rule of another API the node serves (ErrConflict), or names another block size than the cluster's
	ReasonMethodNotAllowed    = "method_not_allowed"   // 405
	ReasonRequestTimeout      = "request_timeout"      // 408: the JSON body did not arrive within the body timeout; nothing applied, send it again
	ReasonTooLarge            = "too_large"            // 413: the body is over the server's limit
	ReasonInternal            = "internal"             // 500: a bug or a storage failure; see the node's log
	ReasonInsufficientStorage = "insufficient_storage" // 507: the leader's data directory lacks the free space a restore needs; nothing installed
	ReasonNoLeader            = "no_leader"            // 503: no leader known or reachable, or it could not take the write in time; nothing applied (unless HeaderMaybeApplied); retry
	ReasonUnreachable         = "unreachable"          // 503: a member the request needs does not answer (a transfer's target); nothing changed
	ReasonOverloaded          = "overloaded"           // 503: every candidate rank is busy
	ReasonNoWorkers           = "no_workers"           // 503: no worker can take the request
	ReasonNotReady            = "not_ready"            // 503: /readyz before the node caught up
	ReasonShuttingDown        = "shutting_down"        // 503
	ReasonStateReplaced       = "state_replaced"       // 503: a snapshot stream cut off by a restore that replaced the state; save again
	ReasonTimeout             = "timeout"              // 503: the node gave up waiting (the write may still apply; retrying is safe)
	ReasonCanceled            = "canceled"             // 503: the client went away
)

// ErrConflict is what a worker check (Server.CheckWorkers) wraps to refuse
// a registration that breaks its API's rules: 409 conflict.
var ErrConflict = errors.New("conflict")

// httpError is an error with the status code and reason it is answered
// with. Handlers return it for input they refuse.
type httpError struct {
	code   int
	reason string
	err    error
}

func (e *httpError) Error() string { return e.err.Error() }
func (e *httpError) Unwrap() error { return e.err }

func invalidf(format string, args ...any) error {
	return &httpError{code: http.StatusBadRequest, reason: ReasonInvalid, err: fmt.Errorf(format, args...)}
}

// classify returns the status code and reason that err is answered with.
func classify(err error) (int, string) {
	var he *httpError
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &he):
		return he.code, he.reason
	case errors.As(err, &mbe):
		return http.StatusRequestEntityTooLarge, ReasonTooLarge
	case errors.As(err, new(*raftfsm.ApplyHalt)):
		// A node halted at an entry of a later build (docs/operations.md,
		// "Upgrade"): a write it answers so is committed, not refused for
		// its content (the halt wraps ErrBadCommand, 400 below); it
		// serves nothing that needs its state until it is upgraded.
		return http.StatusServiceUnavailable, ReasonNoLeader
	case errors.Is(err, raftfsm.ErrNotProposed) && !errors.Is(err, context.Canceled):
		// Raft never took the write (its enqueue timed out, or the
		// deadline passed before it was proposed): it did not and will
		// not apply. Not timeout, which says it may still apply and
		// stops a client's write not safe twice: no_leader sends the
		// client on to another node. (A client that went away is
		// canceled, below.)
		return http.StatusServiceUnavailable, ReasonNoLeader
	case errors.Is(err, indexer.ErrOverloaded):
		return http.StatusServiceUnavailable, ReasonOverloaded
	case errors.Is(err, indexer.ErrNoWorkers):
		return http.StatusServiceUnavailable, ReasonNoWorkers
	case errors.Is(err, raftfsm.ErrNotLeader), errors.Is(err, raftfsm.ErrNoLeader):
		return http.StatusServiceUnavailable, ReasonNoLeader
	case errors.Is(err, raftfsm.ErrShutdown):
		return http.StatusServiceUnavailable, ReasonShuttingDown
	case errors.Is(err, raftfsm.ErrStateReplaced):
		return http.StatusServiceUnavailable, ReasonStateReplaced
	case errors.Is(err, raftfsm.ErrUnreachable):
		return http.StatusServiceUnavailable, ReasonUnreachable
	case errors.Is(err, raftfsm.ErrUnknownWorker):
		return http.StatusNotFound, ReasonUnknownWorker
	case errors.Is(err, indexer.ErrUnknownRank):
		return http.StatusNotFound, ReasonUnknownRank
	case errors.Is(err, raftfsm.ErrStaleDump):
		return http.StatusConflict, ReasonStaleDump
	case errors.Is(err, raftfsm.ErrUnregisteredRank):
		return http.StatusConflict, ReasonUnregisteredRank
	case errors.Is(err, ErrConflict), errors.Is(err, raftfsm.ErrBlockSizeConflict):
		return http.StatusConflict, ReasonConflict
	case errors.Is(err, raftfsm.ErrBadSnapshot):
		return http.StatusBadRequest, ReasonBadSnapshot
	case errors.Is(err, raftfsm.ErrInsufficientStorage):
		return http.StatusInsufficientStorage, ReasonInsufficientStorage
	case errors.Is(err, raftfsm.ErrInvalid), errors.Is(err, raftfsm.ErrBadCommand),
		errors.Is(err, indexer.ErrInvalidParams), errors.Is(err, indexer.ErrInvalidRequest),
		errors.Is(err, indexer.ErrInvalidBooking), errors.Is(err, indexer.ErrBadDump),
		errors.Is(err, kvevent.ErrMalformed), errors.Is(err, kvevent.ErrUnknownTier):
		return http.StatusBadRequest, ReasonInvalid
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusServiceUnavailable, ReasonTimeout
	case errors.Is(err, context.Canceled):
		return http.StatusServiceUnavailable, ReasonCanceled
	}
	return http.StatusInternalServerError, ReasonInternal
}
