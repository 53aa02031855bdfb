// load_errors.go names the errors that the load tracker (sequences.go) and
// the scorer (scorer.go) return, so that callers branch with errors.Is and
// never on message text. Every error returned by those files wraps one of
// these with context (the request id, the rank, the parameter at fault).

package indexer

import "errors"

var (
	// ErrInvalidBooking means an Add or a Restore carried a booking that
	// breaks a rule: an empty request id, a negative input length or cached
	// token count, or an id given twice in one snapshot. Nothing is applied.
	ErrInvalidBooking = errors.New("invalid booking")
	// ErrInvalidRequest means a route request cannot be scored: a block size
	// that is not positive or a negative input length.
	ErrInvalidRequest = errors.New("invalid route request")
	// ErrInvalidParams means a scoring parameter is negative, NaN or
	// infinite, or a positive temperature came without a random source.
	ErrInvalidParams = errors.New("invalid scoring parameters")
	// ErrInvalidCandidate means a candidate carries a negative load or
	// capacity; the whole selection is refused rather than guessed.
	ErrInvalidCandidate = errors.New("invalid candidate")
	// ErrNoWorkers means there was no candidate rank to route to.
	ErrNoWorkers = errors.New("no workers")
	// ErrOverloaded means every candidate rank is over a busy threshold; the
	// error wraps the thresholds that tripped (an HTTP 503 with that reason).
	ErrOverloaded = errors.New("all workers busy")
)
