package indexer

import (
	"math/bits"

	"github.com/kvrouter/kvrouter/kvevent"
)

// View is how a lookup reads residency.
type View uint8

const (
	// ViewDedup counts a block held in any tier as a device hit, so the
	// router keeps seeing a block that the GPU evicted while G2/G3 hold it.
	ViewDedup View = iota
	// ViewTiered walks each rank's contiguous prefix tier by tier: device
	// first, then host, disk, external, each extension counted in its tier.
	ViewTiered
)

func (v View) String() string {
	if v == ViewTiered {
		return "tiered"
	}
	return "dedup"
}

// ParseView is String's inverse: the view named "dedup" or "tiered", and
// false for any other name (an empty one included: a caller for whom an
// omitted view means the default says so itself).
func ParseView(name string) (View, bool) {
	switch name {
	case "dedup":
		return ViewDedup, true
	case "tiered":
		return ViewTiered, true
	}
	return ViewDedup, false
}

// RankMatch is one rank's matched prefix, in blocks per tier.
type RankMatch struct {
	Rank   kvevent.Rank
	Blocks [kvevent.NumTiers]uint32
}

// Total is the rank's whole matched prefix in blocks.
func (m RankMatch) Total() uint32 {
	return m.Blocks[0] + m.Blocks[1] + m.Blocks[2] + m.Blocks[3]
}

// Matches is the result of FindMatchesByTier. Reuse one across calls to
// avoid allocating.
type Matches struct {
	// Ranks holds every rank that matched at least the first block, in no
	// particular order.
	Ranks []RankMatch
	// Frequencies[d] is the number of ranks holding the request's block d
	// (any tier), for each depth the walk reached.
	Frequencies []uint32
}

// Reset empties m, keeping its memory.
func (m *Matches) Reset() {
	m.Ranks = m.Ranks[:0]
	m.Frequencies = m.Frequencies[:0]
}

// scratch is per-lookup state indexed by rank slot. mark[slot] packs the
// lookup's epoch (upper 32 bits) with the depth+1 the rank is still
// matching at (lower 32), so that stale values from earlier lookups are
// never mistaken for live ones and nothing needs clearing between lookups.
type scratch struct {
	epoch   uint64
	mark    []uint64
	phase   []uint8
	counts  [][kvevent.NumTiers]uint32
	touched []uint32
}

func (ix *Index) getScratch(slots int) *scratch {
	sc, _ := ix.scratchPool.Get().(*scratch)
	if sc == nil {
		sc = &scratch{}
	}
	if len(sc.mark) < slots {
		n := slots + slots/4 + 8
		sc.mark = make([]uint64, n)
		sc.phase = make([]uint8, n)
		sc.counts = make([][kvevent.NumTiers]uint32, n)
		sc.epoch = 0
	}
	sc.epoch++
	if sc.epoch == 1<<32 {
		clear(sc.mark)
		sc.epoch = 1
	}
	sc.touched = sc.touched[:0]
	return sc
}

// FindMatchesByTier walks the request's content hashes from the root and
// reports, per rank, the length of the prefix it holds (semantics.md §4).
//
// Every rank starts at depth 0 with the holders of the first block; at each
// later depth only ranks that were still matching and hold the next node
// carry on. A rank that drops out never re-enters, so the work is
// O(depth × holders on the path). With earlyExit, the walk stops as soon as
// one rank is left: that rank's count is then a lower bound, which is all
// a router needs to prefer it.
//
// In the tiered view each rank carries a phase: it starts in the lowest
// tier it holds the first block in, and at every later block it stays in
// its phase if the block is held there, else moves to the lowest higher
// tier that holds it, else stops. Only a contiguous prefix counts.
//
// A rank that a ReplaceRank is replacing is left out, of Ranks and of
// Frequencies: between two chunks of the replace it holds part of its old
// state or of its new one, and a route must not prefer it (or pass it
// over) for a prefix it held only part way. It is left out once, at the
// first block (the walk never marks it), so the cost is one comparison
// per rank there, and, at each depth of the walk while a replace runs,
// one search for it among the node's holders for Frequencies. A node
// that only the rank being replaced holds still counts, as 0, where an
// index without the rank has no node: Frequencies may then end in a 0
// (nothing in the router reads them; the tests trim it).
//
// Lookups hold the read lock for the walk only; out is overwritten.
func (ix *Index) FindMatchesByTier(hashes []uint64, view View, earlyExit bool, out *Matches) {
	out.Reset()
	if len(hashes) == 0 {
		return
	}
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	n := ix.root.child(hashes[0])
	if n == nil {
		return
	}
	sc := ix.getScratch(len(ix.ranks))
	defer ix.scratchPool.Put(sc)
	ep := sc.epoch << 32
	tiered := view == ViewTiered
	skip := ^uint32(0) // no slot has it: ranks hold fewer
	if ix.replacing != nil {
		skip = ix.replacing.slot
	}

	active := 0
	for _, h := range n.holders {
		s := h.slot()
		if s == skip {
			continue
		}
		active++
		sc.mark[s] = ep | 1
		sc.touched = append(sc.touched, s)
		if tiered {
			p := uint8(bits.TrailingZeros8(uint8(h.mask())))
			sc.phase[s] = p
			sc.counts[s] = [kvevent.NumTiers]uint32{}
			sc.counts[s][p] = 1
		}
	}
	out.Frequencies = append(out.Frequencies, holdersBut(n, skip))

	for d := 1; d < len(hashes); d++ {
		if active == 0 || (earlyExit && active == 1) {
			break
		}
		if n = n.child(hashes[d]); n == nil {
			break
		}
		prev := ep | uint64(d)
		next := prev + 1
		cnt := 0
		if !tiered {
			for _, h := range n.holders {
				if s := h.slot(); sc.mark[s] == prev {
					sc.mark[s] = next
					cnt++
				}
			}
		} else {
			for _, h := range n.holders {
				s := h.slot()
				if sc.mark[s] != prev {
					continue
				}
				m := uint8(h.mask())
				p := sc.phase[s]
				if m&(1<<p) == 0 {
					higher := m &^ (1<<(p+1) - 1)
					if higher == 0 {
						continue // no tier at or after its phase holds it: stop
					}
					p = uint8(bits.TrailingZeros8(higher))
					sc.phase[s] = p
				}
				sc.counts[s][p]++
				sc.mark[s] = next
				cnt++
			}
		}
		out.Frequencies = append(out.Frequencies, holdersBut(n, skip))
		active = cnt
	}

	for _, s := range sc.touched {
		rm := RankMatch{Rank: ix.ranks[s].rank}
		if tiered {
			rm.Blocks = sc.counts[s]
		} else {
			rm.Blocks[kvevent.TierDevice] = uint32(sc.mark[s] & 0xffffffff)
		}
		out.Ranks = append(out.Ranks, rm)
	}
}

// holdersBut is how many ranks hold n, the rank in slot skip left out
// (^uint32(0): none).
func holdersBut(n *node, skip uint32) uint32 {
	if skip != ^uint32(0) && n.find(skip) >= 0 {
		return uint32(len(n.holders) - 1)
	}
	return uint32(len(n.holders))
}
