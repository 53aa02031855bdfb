package pool

import (
	"errors"
	"fmt"
	"log/slog"
	"math"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvevent"
)

var (
	// ErrFull means the pool holds Capacity blocks and none of them can be
	// evicted: each is referenced, being written, or the parent of another
	// block in the pool. Nothing was changed.
	ErrFull = errors.New("pool full: no block can be evicted")
	// ErrExists means the block is already in the pool (it was revived:
	// counted as used now, no copy needed) or another caller is writing it.
	// It is not a failure; Reserve and Register return it so that the caller
	// skips the copy.
	ErrExists = errors.New("block already in the pool")
	// ErrBusy means another caller is writing the block: it is reserved,
	// not yet committed, and may still be aborted, leaving the pool without
	// it. Errors that wrap it wrap ErrExists too (the copy is skipped either
	// way); a caller that must know whether the block will be held checks
	// ErrBusy first.
	ErrBusy = errors.New("being written")
	// ErrNotFound means the hash is not in the pool, or its bytes are still
	// being written.
	ErrNotFound = errors.New("block not in the pool")
	// ErrNotHeld means Release was called for a block with no reference.
	ErrNotHeld = errors.New("block not acquired")
	// ErrInvalid means an argument can never be valid: a zero hash, a block
	// that is its own parent or ancestor, a buffer of the wrong length, a bad
	// Config.
	ErrInvalid = errors.New("invalid argument")
	// ErrClosed means the pool was closed.
	ErrClosed = errors.New("pool closed")
	// ErrCorrupt means a disk pool's stored data does not match its format: a
	// block of the wrong length, metadata that does not decode, or a
	// directory made with another block size or format version; or that a
	// block's bytes cannot be read (Pebble reports them corrupt, or the
	// disk failed their read three times in a row).
	ErrCorrupt = errors.New("disk pool data corrupt or incompatible")
	// ErrL0Deep means a disk pool refused a write because Pebble's L0 is
	// too deep: compactions fall behind the writes (a burst of synced
	// flushes, a slow or failing disk). It is temporary: writes resume
	// once compactions bring L0 back under the bound, and nothing was
	// changed. A caller may retry later or drop the block.
	ErrL0Deep = errors.New("L0 too deep")
)

// A Sink receives the pool's events. Its method is that of
// *eventplane.Publisher, so the agent passes its publisher.
//
// The pool calls Publish with its lock held, so that the order of the events
// is the order of the changes: Publish must not block for long and must not
// call back into the pool. An error is counted (Stats.PublishErrors) and
// logged; it does not undo the change (the agent heals with a dump).
// The pool never reuses the slices it passes.
type Sink interface {
	Publish(r kvevent.Rank, evs []kvevent.Event) (lastID uint64, err error)
}

// Block names one KV block.
type Block struct {
	// Hash is the block's sequence hash (the engine hash of its events). It
	// is never 0.
	Hash uint64
	// Parent is the sequence hash of the previous block of the sequence, or 0
	// for the first block.
	Parent uint64
	// Local is the block's content hash (kvevent.LocalHash), carried into
	// the STORE event so the router can place the block in its tree.
	Local uint64
}

func (b Block) check() error {
	if b.Hash == 0 {
		return fmt.Errorf("%w: zero block hash", ErrInvalid)
	}
	if b.Parent == b.Hash {
		return fmt.Errorf("%w: block %#x is its own parent", ErrInvalid, b.Hash)
	}
	return nil
}

// Config configures a pool of either tier.
type Config struct {
	// Rank is the rank whose blocks the pool holds; every event names it.
	Rank kvevent.Rank
	// Capacity is the most blocks the pool holds, > 0.
	Capacity int
	// BlockSize is the size of every block in bytes, > 0.
	BlockSize int
	// Sink receives STORE and REMOVE events; nil publishes nothing.
	Sink Sink
	// Registerer, when set, gets the pool's metrics, labelled with its tier
	// and rank. They are unregistered by Close.
	Registerer prometheus.Registerer
	// Logger; nil is slog.Default().
	Logger *slog.Logger
}

func (c *Config) check() error {
	if c.Capacity <= 0 || c.Capacity > math.MaxInt32 {
		return fmt.Errorf("%w: capacity %d blocks (want 1..%d)", ErrInvalid, c.Capacity, math.MaxInt32)
	}
	if c.BlockSize <= 0 || c.BlockSize > math.MaxInt/c.Capacity {
		return fmt.Errorf("%w: block size %d bytes for %d blocks", ErrInvalid, c.BlockSize, c.Capacity)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Stats is a snapshot of a pool's counters.
type Stats struct {
	Tier      kvevent.Tier
	Capacity  int // blocks
	BlockSize int // bytes
	// Used counts the blocks held, Pending those among them still being
	// written, Referenced those acquired and not yet released, and Inactive
	// the written, unreferenced ones: reusable by hash, and evictable once no
	// child of theirs is in the pool.
	Used, Pending, Referenced, Inactive int
	// Evictable counts the inactive blocks that may be evicted now.
	Evictable int

	Hits          uint64 // Acquire and successful Read of a stored block; not ReadHeld
	Misses        uint64 // Acquire (and Read) of a hash not stored
	Registered    uint64 // blocks stored
	Revived       uint64 // registrations (or DiskPool.Revive) of a block already stored
	Evictions     uint64
	PublishErrors uint64
	// Damaged counts the disk blocks whose bytes failed to read
	// (ErrCorrupt): each was dropped from the pool, with a REMOVE.
	Damaged uint64
}
