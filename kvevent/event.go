package kvevent

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"sync"
)

// Rank identifies one data-parallel rank of one worker: the unit of
// indexing, scoring and load.
type Rank struct {
	Worker uint64
	DP     uint32
}

func (r Rank) String() string { return fmt.Sprintf("%d/%d", r.Worker, r.DP) }

// Less orders ranks by worker, then dp rank.
func (r Rank) Less(o Rank) bool {
	if r.Worker != o.Worker {
		return r.Worker < o.Worker
	}
	return r.DP < o.DP
}

// Compare orders ranks by worker, then dp rank: -1, 0 or +1.
func (r Rank) Compare(o Rank) int {
	switch {
	case r == o:
		return 0
	case r.Less(o):
		return -1
	}
	return 1
}

// Kind is what an event does.
type Kind uint8

// Event kinds.
const (
	KindStored  Kind = iota + 1 // blocks were stored in a tier
	KindRemoved                 // blocks were removed from a tier
	KindCleared                 // the rank dropped everything, every tier
)

func (k Kind) String() string {
	switch k {
	case KindStored:
		return "store"
	case KindRemoved:
		return "remove"
	case KindCleared:
		return "clear"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Block is one stored block: the engine's opaque id and the content hash the
// router computed from its tokens.
type Block struct {
	EngineHash uint64 // the engine's id; resolves parents and removes, per rank
	LocalHash  uint64 // XXH3 of the block's tokens; places it in the tree
}

// Event is one router event. It is a flat struct rather than an interface
// so that decoding and applying an event allocates nothing beyond its
// slices, which callers may reuse.
//
// For KindStored, Blocks form a chain: each block's parent is the previous
// one, and the first block's parent is Parent when HasParent, else the root.
// For KindRemoved, Removed lists engine hashes. KindCleared carries no data
// and applies to every tier, whichever Tier it carries (which must still
// be a valid one: Validate refuses any event with a tier out of range).
type Event struct {
	Rank      Rank
	EventID   uint64
	Tier      Tier
	Kind      Kind
	HasParent bool
	Parent    uint64
	Blocks    []Block
	Removed   []uint64
}

// Validate checks the structural rules every consumer relies on: a valid
// tier and kind; a store has blocks, none of them its parent and no engine
// hash twice; a remove has hashes. It never looks at index state, and
// costs O(n) for n blocks without allocating (a chain of up to 1024) on an
// event that passes. An event that fails is skipped whole. Valid is the
// same check without the error: it does not allocate on a malformed event
// either.
func (e *Event) Validate() error {
	switch f, at, h := e.check(); f {
	case flawNone:
		return nil
	case flawTier:
		return fmt.Errorf("%w: tier %d", ErrMalformed, e.Tier)
	case flawNoBlocks:
		return fmt.Errorf("%w: store with no blocks", ErrMalformed)
	case flawOwnParent:
		return fmt.Errorf("%w: first block %#x is its own parent", ErrMalformed, h)
	case flawRepeatsParent:
		return fmt.Errorf("%w: block %d of the chain repeats its parent %#x", ErrMalformed, at, h)
	case flawRepeatedHash:
		return fmt.Errorf("%w: hash %#x repeated within the event", ErrMalformed, h)
	case flawNoHashes:
		return fmt.Errorf("%w: remove with no hashes", ErrMalformed)
	default: // flawKind
		return fmt.Errorf("%w: kind %d", ErrMalformed, e.Kind)
	}
}

// Valid reports whether Validate passes the event, without building its
// error: for callers that only count a malformed event and skip it (the
// index's apply, on every replica, for every event a publisher sends).
func (e *Event) Valid() bool {
	f, _, _ := e.check()
	return f == flawNone
}

// flaw is what check found wrong with an event: one implementation of the
// rules for Validate and Valid, so that the two cannot disagree.
type flaw uint8

const (
	flawNone          flaw = iota
	flawTier               // the tier is out of range
	flawKind               // the kind is unknown
	flawNoBlocks           // a store with no blocks
	flawOwnParent          // the first block is the parent
	flawRepeatsParent      // a later block is the parent
	flawRepeatedHash       // an engine hash twice in the chain
	flawNoHashes           // a remove with no hashes
)

// check applies Validate's rules and returns the first flaw found, with
// the block's index and the hash it names where the flaw has them.
func (e *Event) check() (f flaw, at int, h uint64) {
	if !e.Tier.Valid() {
		return flawTier, 0, 0
	}
	switch e.Kind {
	case KindStored:
		if len(e.Blocks) == 0 {
			return flawNoBlocks, 0, 0
		}
		if e.HasParent {
			// No block may be the parent: the first would be its own, and
			// a later one would name the parent as its own descendant
			// (applied, the parent moved below the chain and the rank's
			// prefixes through it stopped matching).
			for i := range e.Blocks {
				if e.Blocks[i].EngineHash != e.Parent {
					continue
				}
				if i == 0 {
					return flawOwnParent, 0, e.Parent
				}
				return flawRepeatsParent, i, e.Parent
			}
		}
		if h, dup := firstRepeat(len(e.Blocks), func(i int) uint64 { return e.Blocks[i].EngineHash }); dup {
			return flawRepeatedHash, 0, h
		}
	case KindRemoved:
		if len(e.Removed) == 0 {
			return flawNoHashes, 0, 0
		}
	case KindCleared:
	default:
		return flawKind, 0, 0
	}
	return flawNone, 0, 0
}

// repeatTables holds firstRepeat's hash tables for chains over 32 blocks
// (a long prompt's prefill stores thousands in one event).
var repeatTables sync.Pool // of *[]uint64

// repeatSeed is mixed into the tables' slots, so that no engine's hashes
// can be chosen to fall into one run of slots.
var repeatSeed = rand.Uint64() | 1

// firstRepeat reports the first of n values, in order, that repeats an
// earlier one: short chains checked pairwise, longer ones through a pooled
// open-addressing table. Neither allocates in steady state (every replica
// validates every event it applies).
func firstRepeat(n int, at func(int) uint64) (uint64, bool) {
	if n <= 32 {
		for i := 1; i < n; i++ {
			hi := at(i)
			for j := 0; j < i; j++ {
				if at(j) == hi {
					return hi, true
				}
			}
		}
		return 0, false
	}
	return tableRepeat(n, at)
}

// tableRepeat is firstRepeat through a table of at least 2n slots, linear
// probing from a seeded multiplicative hash of the value; 0 marks a free
// slot, so the value 0 is tracked beside the table.
func tableRepeat(n int, at func(int) uint64) (uint64, bool) {
	shift := 64 - bits.Len(uint(2*n-1))
	size := 1 << (64 - shift)
	tp, _ := repeatTables.Get().(*[]uint64)
	if tp == nil {
		tp = new([]uint64)
	}
	if cap(*tp) < size {
		*tp = make([]uint64, size)
	}
	t := (*tp)[:size]
	clear(t)
	defer repeatTables.Put(tp)
	mask := uint64(size - 1)
	zero := false
	for i := range n {
		h := at(i)
		if h == 0 {
			if zero {
				return 0, true
			}
			zero = true
			continue
		}
		for j := ((h ^ repeatSeed) * 0x9e3779b97f4a7c15) >> shift; ; j = (j + 1) & mask {
			if t[j] == 0 {
				t[j] = h
				break
			}
			if t[j] == h {
				return h, true
			}
		}
	}
	return 0, false
}
