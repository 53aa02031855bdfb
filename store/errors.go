package store

import "errors"

var (
	// ErrKeyNotFound is returned by Get for a stable-store key that was never
	// set. Its text is exactly "not found" because hashicorp/raft matches on
	// err.Error() == "not found"; it is always returned unwrapped.
	ErrKeyNotFound = errors.New("not found")
	// ErrClosed means the store was closed; every method returns it (wrapped)
	// after Close.
	ErrClosed = errors.New("store closed")
	// ErrCorrupt means bytes read back from disk do not decode: a log entry
	// with a bad length, a truncated field or trailing bytes, an entry whose
	// index differs from its key, or a uint64 value that is not 8 bytes.
	ErrCorrupt = errors.New("corrupt record")
	// ErrUnsupportedVersion means a record or the database was written by a
	// newer (or unknown) encoding version than this code reads.
	ErrUnsupportedVersion = errors.New("unsupported encoding version")
	// ErrInvalidArgument means a caller passed something the store refuses
	// rather than guessing: a nil log entry, one at index 0 (Raft's log
	// starts at 1), or DeleteRange with min > max.
	ErrInvalidArgument = errors.New("invalid argument")
)
