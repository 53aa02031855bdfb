package indexer

import "errors"

var (
	// ErrUnknownRank means the rank has no state in the index.
	ErrUnknownRank = errors.New("unknown rank")
	// ErrBadDump means a rank dump is inconsistent (an entry whose node is
	// missing, a node whose parent is missing, an empty mask); nothing of it
	// was loaded.
	ErrBadDump = errors.New("bad rank dump")
)
