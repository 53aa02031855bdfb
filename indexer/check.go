package indexer

import (
	"fmt"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Holds reports whether rank r holds a block under engine hash eh, in any
// tier (a held orphan does not count).
func (ix *Index) Holds(r kvevent.Rank, eh uint64) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs := ix.rankFor(r, false)
	if rs == nil {
		return false
	}
	_, ok := rs.blocks.get(eh)
	return ok
}

// HeldAs returns the content hash of the block rank r holds under engine
// hash eh, in any tier, and whether it holds one (a held orphan does not
// count): a store that reuses eh for another block changes it.
func (ix *Index) HeldAs(r kvevent.Rank, eh uint64) (local uint64, ok bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	if _, n := ix.heldLocked(r, eh); n != nil {
		return n.local, true
	}
	return 0, false
}

// HeldUnder returns the tiers rank r holds a block in under engine hash
// eh (0 when it holds none), and whether r holds the block's parent too
// (true for a block of the root): whether a lookup, and a dump
// (RankDump.StoredEvents), can reach the block from the block above it.
func (ix *Index) HeldUnder(r kvevent.Rank, eh uint64) (tiers kvevent.Mask, parentHeld bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs, n := ix.heldLocked(r, eh)
	if n == nil {
		return 0, false
	}
	return n.holders[n.find(rs.slot)].mask(), ix.reachable(rs, n)
}

// heldLocked returns rank r's state and the block it holds under engine
// hash eh (a held orphan does not count), or a nil block. ix.mu is held.
func (ix *Index) heldLocked(r kvevent.Rank, eh uint64) (*rankState, *node) {
	rs := ix.rankFor(r, false)
	if rs == nil {
		return nil, nil
	}
	n, ok := rs.blocks.get(eh)
	if !ok {
		return rs, nil
	}
	return rs, n
}

// CheckStore reports whether applying a Stored chain of rank r (its parent
// named by hasParent and parent, then blocks, each the parent of the next)
// would move a residency r holds: store takes a block whose engine hash r
// holds as another block (another content hash, or under another parent)
// for the engine reusing the hash, and drops the old residency in every
// tier; and a block r holds under another engine hash is renamed. Both are
// right for the engine's own events, which say what it holds; from any
// other source (an offload pool publishing what an engine's request named)
// they would undo what the engine reported. It returns the index of the
// first such block and an error wrapping ErrConflict that says what r
// holds (and ErrRenames for a block held under another hash), or -1 and
// nil. Nothing changes.
//
// A chain whose parent r does not hold would be held for it (an orphan):
// where it lands is not known yet, so its first block is checked by its
// content hash alone, and the blocks after it as a chain under it.
func (ix *Index) CheckStore(r kvevent.Rank, hasParent bool, parent uint64, blocks []kvevent.Block) (int, error) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs := ix.rankFor(r, false)
	if rs == nil {
		return -1, nil
	}
	// at is the node the next block would be stored under (nil once the
	// chain runs past the tree: its nodes would be new); known is false
	// while the chain hangs from a parent r does not hold.
	at, known := &ix.root, true
	if hasParent {
		at, known = rs.blocks.get(parent)
	}
	for i, b := range blocks {
		old, held := rs.blocks.get(b.EngineHash)
		var c *node
		if known && at != nil {
			c = at.child(b.LocalHash)
		}
		switch {
		case held && !known && old.local != b.LocalHash,
			held && known && old != c:
			return i, fmt.Errorf("%w: rank %s holds engine hash %#x as %s, not content hash %#x under %s",
				ErrConflict, r, b.EngineHash, ix.describe(rs, old), b.LocalHash, parentName(i, hasParent, parent, blocks))
		case !held && c != nil:
			if j := c.find(rs.slot); j >= 0 {
				return i, fmt.Errorf("%w: rank %s holds content hash %#x under %s as engine hash %#x, not %#x",
					ErrRenames, r, b.LocalHash, parentName(i, hasParent, parent, blocks), c.holders[j].eh, b.EngineHash)
			}
		}
		switch {
		case known:
			at = c
		case held:
			at, known = old, true
		}
	}
	return -1, nil
}

// describe names node n as rank rs knows it: its content hash and parent.
func (ix *Index) describe(rs *rankState, n *node) string {
	switch p := n.parent; {
	case p == &ix.root:
		return fmt.Sprintf("content hash %#x, the first block of its sequence", n.local)
	case p.find(rs.slot) >= 0:
		return fmt.Sprintf("content hash %#x under engine hash %#x", n.local, p.holders[p.find(rs.slot)].eh)
	default:
		return fmt.Sprintf("content hash %#x under a parent it no longer holds", n.local)
	}
}

// parentName names the parent of block i of a stored chain.
func parentName(i int, hasParent bool, parent uint64, blocks []kvevent.Block) string {
	switch {
	case i > 0:
		return fmt.Sprintf("engine hash %#x", blocks[i-1].EngineHash)
	case hasParent:
		return fmt.Sprintf("engine hash %#x", parent)
	}
	return "no parent (the first block of a sequence)"
}
