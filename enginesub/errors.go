package enginesub

import "errors"

var (
	// ErrConfig means a Subscriber or Group was configured with an
	// impossible value; the error wraps what.
	ErrConfig = errors.New("enginesub: invalid config")
	// ErrRunning means Run was called on a Subscriber that already ran: a
	// Subscriber's sequence state belongs to one run.
	ErrRunning = errors.New("enginesub: Run called twice")
	// ErrOpenFiles means the process's open files limit (RLIMIT_NOFILE) is
	// below what its subscribers may need; the error says both figures.
	ErrOpenFiles = errors.New("enginesub: open files limit too low")
	// errReplayTimeout means the engine did not finish a replay in time.
	errReplayTimeout = errors.New("replay timed out")
)
