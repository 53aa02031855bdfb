package indexer

import (
	"slices"

	"github.com/kvrouter/kvrouter/internal/rankmap"
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
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	ix.journal = j
	ix.mu.Unlock()
}

// FlushJournal reports the metadata of every rank changed since the last
// flush, in rank order. Call it once per durable batch.
func (ix *Index) FlushJournal() {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.journal == nil || len(ix.dirty) == 0 {
		// The ranks' marks go with the list: left set, a journal attached
		// later was never told of those ranks (markDirty skips a marked
		// rank).
		for _, r := range ix.dirty {
			if rs := ix.rankFor(r, false); rs != nil {
				rs.dirty = false
			}
		}
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
// leaves the index empty. It is a Loader fed from the arguments; a caller
// that reads the copy record by record should feed a Loader directly.
func (ix *Index) LoadState(nodes map[uint64]DumpNode, ranks []RankDump) error {
	l := NewLoader(len(nodes), len(ranks))
	for seq, n := range nodes {
		l.AddNode(seq, n.Parent, n.Root, n.Local)
	}
	for i := range ranks {
		d := &ranks[i]
		for _, e := range d.Entries {
			l.AddEntry(d.Rank, e.EngineHash, e.Seq, e.Mask, e.Order)
		}
		lr := l.rank(d.Rank)
		lr.meta.Capacity, lr.meta.Order = d.Capacity, d.Order
		lr.meta.Orphans = append(lr.meta.Orphans, d.Orphans...)
	}
	return l.Finish(ix)
}

// SetRankState sets what LoadState cannot derive from entries: the resync
// and over-capacity flags.
func (ix *Index) SetRankFlags(r kvevent.Rank, needsResync, overCapacity bool) {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if rs := ix.rankFor(r, false); rs != nil {
		rs.needsResync, rs.overCapacity = needsResync, overCapacity
	}
}

// resetLocked empties the index.
func (ix *Index) resetLocked() {
	ix.root = node{}
	ix.huge.Release() // the slabs go with the pool
	ix.pool = nodePool{huge: &ix.huge}
	ix.tables = segTables{huge: &ix.huge}
	ix.names = blockMap{}
	ix.ranks = nil
	ix.slots = rankmap.Map[uint32]{}
	ix.free = nil
	ix.nodes, ix.entries, ix.perTier, ix.digest = 0, 0, [kvevent.NumTiers]int64{}, 0
	ix.dirty = nil
}
