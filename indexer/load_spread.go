package indexer

import (
	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
)

// Spread lets LinkNodes split the tree's construction, and Finish the
// residencies' work, into parts that run side by side: run must call
// f(0) … f(parts-1) concurrently and return once every call has returned.
// The indexer starts no goroutines of its own (DESIGN.md), so the caller
// supplies them. Without Spread, or with fewer than two parts, they work
// alone. The index built is the same either way.
func (l *Loader) Spread(parts int, run func(parts int, f func(part int))) {
	l.parts, l.run = min(parts, 256), run
}

// applySpread adds every residency in two phases of l.parts parts each,
// and reports false, having undone what it added, when the copy breaks
// the index's invariants (two holders of one rank on a node), which only
// the serial path (setBit) loads as the write path would.
//
//   - Resolve: each part finds the nodes of the entries of every parts-th
//     rank. Reads only.
//   - Apply: each part adds the holders of the nodes of its own (by the top
//     byte of the node's seq, a uniform hash), going through the ranks in
//     slot order as the serial path does, so every node's holders end in
//     the same order; and it fills the engine-hash maps of its own ranks.
//     Counts and digest terms are summed per part and merged after (the
//     digest is a sum, so its order does not matter).
//
// No node or map is written by two parts, so the parts need no locks.
func (l *Loader) applySpread(ix *Index, x *seqIndex, rss []*rankState) (bool, error) {
	parts, ranks := l.parts, l.ranks
	ats := make([][]*node, len(ranks))   // per rank, per entry: its node
	owner := make([][]uint8, len(ranks)) // per rank, per entry: its node's part byte
	errs := make([]error, len(ranks))
	l.run(parts, func(p int) {
		// This part's ranks, resolved in one batch of lookups.
		var mine []*loadRank
		total := 0
		for i := p; i < len(ranks); i += parts {
			mine = append(mine, ranks[i])
			total += ranks[i].entries.n
		}
		at, own := hugepage.MakeIn[*node](x.sc, total), hugepage.MakeIn[uint8](x.sc, total)
		var b batcher
		es := resolveRanks(x, &b, mine, at, own)
		off := 0
		for k, i := 0, p; i < len(ranks); k, i = k+1, i+parts {
			n := ranks[i].entries.n
			ats[i], owner[i], errs[i] = at[off:off+n:off+n], own[off:off+n:off+n], es[k]
			off += n
		}
	})
	for _, err := range errs {
		if err != nil {
			return false, err // the first in rank order, as the serial path reports
		}
	}

	type tally struct {
		entries  int64
		perTier  [kvevent.NumTiers]int64
		digest   uint64
		counts   [][kvevent.NumTiers]int64 // per rank
		conflict bool
		_        [64]byte // keeps two parts' tallies off one cache line
	}
	tallies := make([]tally, parts)
	l.run(parts, func(p int) {
		t := &tallies[p]
		t.counts = make([][kvevent.NumTiers]int64, len(ranks))
		for i, lr := range ranks {
			rs, at, own := rss[i], ats[i], owner[i]
			cnt := &t.counts[i]
			j := 0
			for _, es := range lr.entries.all {
				for k := range es {
					e, n := &es[k], at[j]
					mine := int(own[j])%parts == p
					j++
					if !mine {
						continue
					}
					if len(n.holders) > 0 && n.holders[len(n.holders)-1].slot() >= rs.slot {
						t.conflict = true
						return
					}
					n.holders = append(n.holders, holder{eh: e.eh, sm: mkSM(rs.slot, e.mask), order: e.order})
					for tr := kvevent.Tier(0); tr < kvevent.NumTiers; tr++ {
						if e.mask.Has(tr) {
							cnt[tr]++
							t.perTier[tr]++
						}
					}
					t.entries++
					t.digest += residencyTerm(rs.key, n.seq, e.eh, e.mask)
				}
			}
			if i%parts == p {
				j = 0
				for _, es := range lr.entries.all {
					for k := range es {
						rs.blocks.put(es[k].eh, at[j], nil) // parts run at once: no shared tables
						j++
					}
				}
			}
		}
	})
	for p := range tallies {
		if tallies[p].conflict {
			undoHolders(x, rss, ranks, &ix.tables)
			return false, nil
		}
	}
	for p := range tallies {
		t := &tallies[p]
		ix.entries += t.entries
		ix.digest += t.digest
		for tr := range ix.perTier {
			ix.perTier[tr] += t.perTier[tr]
		}
		for i, rs := range rss {
			for tr := range rs.count {
				rs.count[tr] += t.counts[i][tr]
			}
		}
	}
	for _, lr := range ranks {
		lr.entries = chunks[loadEntry]{}
	}
	return true, nil
}

// undoHolders takes back what an abandoned applySpread added: the holders
// of every node (the tree had none before it) and the ranks' maps, whose
// tables go back to t for the fresh maps.
func undoHolders(x *seqIndex, rss []*rankState, ranks []*loadRank, t *segTables) {
	for k := range x.recs {
		if r := &x.recs[k]; x.state[k] == linkDone {
			clear(r.n.holders)
			r.n.holders = r.n.holders[:0]
		}
	}
	for i, rs := range rss {
		t.release(&rs.blocks)
		rs.blocks = newBlockMap(ranks[i].entries.n, t)
	}
}
