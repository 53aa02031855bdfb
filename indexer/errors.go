package indexer

import (
	"errors"
	"fmt"
)

var (
	// ErrUnknownRank means the rank has no state in the index.
	ErrUnknownRank = errors.New("unknown rank")
	// ErrBadDump means a rank dump is inconsistent (an entry whose node is
	// missing, a node whose parent is missing, an empty mask); nothing of it
	// was loaded.
	ErrBadDump = errors.New("bad rank dump")
)

// ErrConflict means a store would move a residency the rank holds to
// another block (CheckStore): it names an engine hash the rank holds as
// another block, or a block the rank holds under another engine hash.
var ErrConflict = errors.New("store conflicts with what the rank holds")

// ErrRenames means a store names a block the rank holds under another
// engine hash, a hash the rank does not hold (CheckStore): applied, it
// would rename the block. It wraps ErrConflict. Unlike a hash the rank
// holds as another block, it is no sign of a wrong block: the engine's
// extra_keys (an image, a per-request cache salt) and a restart under
// another hash seed give one content another engine hash.
var ErrRenames = fmt.Errorf("%w: the block is held under another engine hash", ErrConflict)
