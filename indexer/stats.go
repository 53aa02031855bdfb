package indexer

import (
	"slices"
	"unsafe"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Stats is a point-in-time summary of the index.
type Stats struct {
	Nodes        int64                   // tree nodes, the root excluded
	Ranks        int                     // ranks with state
	Entries      int64                   // (rank, block) residencies
	Blocks       [kvevent.NumTiers]int64 // residencies per tier
	OrphanEvents int                     // held stores waiting for a parent
	OrphanBlocks int
	NeedResync   int // ranks flagged as needing a resync
	OverCapacity int // ranks that exceeded a tier's capacity
	Counters     Counters
	// MemoryBytes estimates the memory the index holds: its nodes and
	// their names' map, the holders past each node's inline one, every
	// rank's engine-hash map
	// (exactly), the tables no map uses (segTables: kept for reuse, or
	// not yet handed out of the open slab) and orphan buffers. It leaves out the child maps of nodes
	// with more than one child (a prefix tree of chains has few) and the
	// runtime's own overhead; see TestMemoryEstimate for how close it
	// comes.
	MemoryBytes int64
}

// Sizes of what the index allocates, for Stats.MemoryBytes.
const (
	nodeBytes   = int64(unsafe.Sizeof(node{}))
	holderBytes = int64(unsafe.Sizeof(holder{}))
	blockBytes  = int64(unsafe.Sizeof(kvevent.Block{}))
	rankBytes   = int64(unsafe.Sizeof(rankState{}))
)

// Stats returns a summary. It is O(ranks and their block maps' segments).
// During a ReplaceRank it counts the replaced rank as far as the replace
// has got (a figure for metrics: a rank of 1M blocks replaced reads low
// for the second the replace takes).
func (ix *Index) Stats() Stats {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	s := Stats{Nodes: ix.nodes, Entries: ix.entries, Blocks: ix.perTier, Counters: ix.counters}
	// Holders past a node's inline one live in arrays that append grows
	// by a quarter or more: count a quarter spare.
	s.MemoryBytes = ix.nodes*nodeBytes + max(ix.entries-ix.nodes, 0)*holderBytes*5/4 + ix.names.bytes() + ix.tables.bytes()
	for _, rs := range ix.ranks {
		if rs == nil {
			continue
		}
		s.MemoryBytes += rankBytes + rs.blocks.bytes() + int64(rs.orphanBlocks)*blockBytes
		s.Ranks++
		s.OrphanEvents += len(rs.orphans)
		s.OrphanBlocks += rs.orphanBlocks
		if rs.needsResync {
			s.NeedResync++
		}
		if rs.overCapacity {
			s.OverCapacity++
		}
	}
	return s
}

// Counters returns the index's counters alone: O(1), unlike Stats, for a
// caller that compares them around an Apply (the node agent, to learn
// whether a store applied held orphans).
func (ix *Index) Counters() Counters {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.counters
}

// RankStats is what the index holds for one rank.
type RankStats struct {
	Rank         kvevent.Rank
	Blocks       [kvevent.NumTiers]int64
	Capacity     [kvevent.NumTiers]int64
	OrphanEvents int
	NeedsResync  bool
	OverCapacity bool
}

// RankStats returns per-rank figures, sorted by rank. During a
// ReplaceRank the replaced rank's figures are the replace's so far, as
// Stats's are: they are shown (workers listings), not routed on.
func (ix *Index) RankStats() []RankStats {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]RankStats, 0, ix.slots.Len())
	for _, rs := range ix.ranks {
		if rs == nil {
			continue
		}
		out = append(out, RankStats{Rank: rs.rank, Blocks: rs.count, Capacity: rs.cap,
			OrphanEvents: len(rs.orphans), NeedsResync: rs.needsResync, OverCapacity: rs.overCapacity})
	}
	slices.SortFunc(out, func(a, b RankStats) int { return a.Rank.Compare(b.Rank) })
	return out
}

// Digest returns the state digest: a sum over every residency (rank, node,
// engine hash, tier mask) and every held orphan block, equal whenever
// those are, whatever the history. O(1). It does not cover the rest of the
// state that decides later events: orphans' arrival times and order, entry
// ages, capacities, the needs-resync and over-capacity flags, empty ranks,
// counters (digest.go says why and what follows).
//
// During a ReplaceRank it is the digest of the state so far, which no
// replica compares: read it between two writes (the state machine reads
// it between two of its batches, AppliedDigest).
func (ix *Index) Digest() uint64 {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.digest
}

// NeedsResync returns the ranks whose index state provably differs from
// their engine (an orphan was dropped), sorted. The flag clears when the
// rank is cleared, replaced, or loaded.
func (ix *Index) NeedsResync() []kvevent.Rank {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var out []kvevent.Rank
	for _, rs := range ix.ranks {
		if rs != nil && rs.needsResync {
			out = append(out, rs.rank)
		}
	}
	slices.SortFunc(out, kvevent.Rank.Compare)
	return out
}

// RankNeedsResync reports whether rank r lost held events (NeedsResync
// lists every such rank): the apply path's per-batch question.
func (ix *Index) RankNeedsResync(r kvevent.Rank) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs := ix.rankFor(r, false)
	return rs != nil && rs.needsResync
}

// Ranks returns every rank with state, sorted.
func (ix *Index) Ranks() []kvevent.Rank {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	out := make([]kvevent.Rank, 0, ix.slots.Len())
	for r := range ix.slots.All() {
		out = append(out, r)
	}
	slices.SortFunc(out, kvevent.Rank.Compare)
	return out
}

// WorkerRanks appends worker's ranks with state to dst, sorted, and
// returns the extended slice (found without a scan of every rank).
func (ix *Index) WorkerRanks(dst []kvevent.Rank, worker uint64) []kvevent.Rank {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.slots.WorkerRanks(dst, worker)
}
