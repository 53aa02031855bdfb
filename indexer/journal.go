package indexer

import (
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// A Journal is told of every change to the index's logical state, so that
// a durable copy can follow it change by change (the cluster writes each
// change into the Pebble batch of the Raft entry being applied). Calls
// happen synchronously under the index's write lock, in the order the
// changes happen; an implementation must not call back into the index.
type Journal interface {
	// NodeCreated: a tree node now exists. root says its parent is the root
	// (then parent is meaningless).
	NodeCreated(seq, parent uint64, root bool, local uint64)
	// NodeFreed: the node was unlinked.
	NodeFreed(seq uint64)
	// EntrySet: the rank holds node seq under engine hash eh with this mask
	// (a new residency or a changed mask).
	EntrySet(r kvevent.Rank, eh, seq uint64, mask kvevent.Mask, order uint32)
	// EntryDeleted: the rank no longer holds the block it called eh.
	EntryDeleted(r kvevent.Rank, eh uint64)
	// RankMeta: the rank's metadata changed (reported once per Flush).
	RankMeta(m RankMeta)
	// RankRemoved: the rank is gone with all its state.
	RankRemoved(r kvevent.Rank)
}

// RankMeta is a rank's state outside its residencies.
type RankMeta struct {
	Rank         kvevent.Rank
	Capacity     [kvevent.NumTiers]int64
	Order        uint32
	NeedsResync  bool
	OverCapacity bool
	Orphans      []DumpOrphan
}

// SetJournal attaches j (nil detaches). Changes before the call are not
// reported.
func (ix *Index) SetJournal(j Journal) {
	ix.mu.Lock()
	ix.journal = j
	ix.mu.Unlock()
}

// FlushJournal reports the metadata of every rank changed since the last
// flush, in rank order. Call it once per durable batch.
func (ix *Index) FlushJournal() {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.journal == nil || len(ix.dirty) == 0 {
		ix.dirty = ix.dirty[:0]
		return
	}
	slices.SortFunc(ix.dirty, kvevent.Rank.Compare)
	ix.dirty = slices.Compact(ix.dirty)
	for _, r := range ix.dirty {
		if rs := ix.rankFor(r, false); rs != nil {
			rs.dirty = false
			ix.journal.RankMeta(rs.meta())
		}
	}
	ix.dirty = ix.dirty[:0]
}

func (rs *rankState) meta() RankMeta {
	m := RankMeta{Rank: rs.rank, Capacity: rs.cap, Order: rs.order, NeedsResync: rs.needsResync, OverCapacity: rs.overCapacity}
	for _, o := range rs.orphans {
		m.Orphans = append(m.Orphans, DumpOrphan{At: o.at, Tier: o.tier, Parent: o.parent, Blocks: slices.Clone(o.blocks)})
	}
	return m
}

func (ix *Index) markDirty(rs *rankState) {
	if ix.journal != nil && !rs.dirty {
		rs.dirty = true
		ix.dirty = append(ix.dirty, rs.rank)
	}
}

// LoadState rebuilds the index from a durable copy: every node (in any
// order, each naming its parent), every rank's residencies (RankDump with
// Nodes left empty) and metadata. It replaces everything the index held.
// The journal is not told. A reference to a missing node is ErrBadDump and
// leaves the index empty.
func (ix *Index) LoadState(nodes map[uint64]DumpNode, ranks []RankDump) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	j := ix.journal
	ix.journal = nil
	defer func() { ix.journal = j }()
	ix.resetLocked()
	built := make(map[uint64]*node, len(nodes))
	var build func(seq uint64, depth int) (*node, error)
	build = func(seq uint64, depth int) (*node, error) {
		if n, ok := built[seq]; ok {
			return n, nil
		}
		dn, ok := nodes[seq]
		if !ok || depth > 1<<20 {
			return nil, fmt.Errorf("%w: node %#x missing or in a cycle", ErrBadDump, seq)
		}
		parent := &ix.root
		if !dn.Root {
			p, err := build(dn.Parent, depth+1)
			if err != nil {
				return nil, err
			}
			parent = p
		}
		c := parent.child(dn.Local)
		if c == nil {
			c = newNode(parent, dn.Local, dn.Seq)
			parent.addChild(c)
			ix.nodes++
		}
		built[seq] = c
		return c, nil
	}
	for i := range ranks {
		d := &ranks[i]
		rs := ix.rankFor(d.Rank, true)
		rs.cap = d.Capacity
		for _, e := range d.Entries {
			if e.Mask == 0 || e.Mask >= 1<<kvevent.NumTiers {
				ix.resetLocked()
				return fmt.Errorf("%w: entry %#x of %s has mask %#x", ErrBadDump, e.EngineHash, d.Rank, e.Mask)
			}
			n, err := build(e.Seq, 0)
			if err != nil {
				ix.resetLocked()
				return fmt.Errorf("load %s: %w", d.Rank, err)
			}
			for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
				if e.Mask.Has(t) {
					ix.setBit(rs, n, e.EngineHash, t)
				}
			}
			n.holders[n.find(rs.slot)].order = e.Order
		}
		rs.order = d.Order
		for _, o := range d.Orphans {
			or := orphan{at: o.At, tier: o.Tier, parent: o.Parent, blocks: slices.Clone(o.Blocks)}
			rs.orphans = append(rs.orphans, or)
			rs.orphanBlocks += len(or.blocks)
			ix.orphanDigest(rs, &or, +1)
		}
	}
	// Nodes no entry reached are not kept: the invariant says a node exists
	// only while some rank holds it or a descendant.
	for _, n := range built {
		ix.unlink(n)
	}
	return nil
}

// SetRankState sets what LoadState cannot derive from entries: the resync
// and over-capacity flags.
func (ix *Index) SetRankFlags(r kvevent.Rank, needsResync, overCapacity bool) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if rs := ix.rankFor(r, false); rs != nil {
		rs.needsResync, rs.overCapacity = needsResync, overCapacity
	}
}

// resetLocked empties the index.
func (ix *Index) resetLocked() {
	ix.root = node{}
	ix.ranks = nil
	ix.slots = make(map[kvevent.Rank]uint32)
	ix.free = nil
	ix.nodes, ix.entries, ix.perTier, ix.digest = 0, 0, [kvevent.NumTiers]int64{}, 0
	ix.dirty = nil
}
