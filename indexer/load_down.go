package indexer

import "github.com/kvrouter/kvrouter/internal/hugepage"

// linkDown is linkAll's fast way, for copies in which no two records name
// one (parent, local) position (consistent copies never do): it builds the
// nodes top-down from the root, depth first, over each record's children
// laid out together (a counting sort by parent record). The walk up from
// each record in seq order takes several dependent cache misses per record
// (its parent's record, the parent's node), where this one reads the
// children arrays mostly in order and writes each record once. Depth first
// keeps a path's nodes together in memory, as the walk did. The records
// reached are linkDone and the rest linkBroken (their chain misses a parent
// or is a cycle): what the walk finds. It reports false, leaving the nodes
// it built for the collector and the states to be reset, on meeting two
// records for one position: which record names that node depends on the
// walk's order, and the walk decides it.
func (l *Loader) linkDown(x *seqIndex, rootKids int) (built int64, ok bool) {
	recs, par, state := x.recs, x.par, x.state
	n := len(recs)
	type kid struct {
		local, seq  uint64
		n           *node // built for it
		k           int32
		first, kids uint32 // where its own children are in ch, and how many
	}
	// cur[p]: where the next child of record p goes; the root's children
	// come first, in ch[0:rootKids].
	cur := hugepage.MakeIn[uint32](x.sc, n)
	off := uint32(rootKids)
	for k := range recs {
		cur[k] = off
		off += recs[k].kids
	}
	ch := hugepage.MakeIn[kid](x.sc, int(off))
	var rootAt uint32
	off = uint32(rootKids)
	for k := range recs {
		r := &recs[k]
		r.part = uint8(r.seq >> 56) // its node's seq: no other record names it
		e := kid{local: r.local, seq: r.seq, k: int32(k), first: off, kids: r.kids}
		off += r.kids
		switch p := par[k]; {
		case p == parRoot:
			ch[rootAt] = e
			rootAt++
		case p >= 0:
			ch[cur[p]] = e
			cur[p]++
		}
	}
	cur = nil
	// A frame is a record's children being built: ch[lo:hi], the first
	// of them at ch[at]. Two of them naming one position (a copy that
	// breaks the index's invariants) shows in the parent's child map not
	// growing, or a local equal to the first child's (the inline one).
	type frame struct {
		at, lo, hi uint32
		parent     *node
	}
	// next builds the node of f's next child; nil when it names a
	// position taken.
	next := func(f *frame, pool *nodePool) *kid {
		e := &ch[f.lo]
		f.lo++
		parent := f.parent
		nd := pool.get(parent, e.local, e.seq)
		if e.kids > 1 {
			nd.more = make(map[uint64]*node, e.kids-1)
		}
		if f.lo-1 == f.at { // the first child
			if parent.c1 != nil { // only the root's may be set: never
				return nil
			}
			parent.c1 = nd
		} else {
			if e.local == ch[f.at].local {
				return nil
			}
			if parent.more == nil {
				parent.more = make(map[uint64]*node, 2)
			}
			parent.more[e.local] = nd
			if len(parent.more) != int(f.lo-1-f.at) {
				return nil
			}
		}
		e.n = nd
		state[e.k] = linkDone
		return e
	}
	frames := []frame{{0, 0, uint32(rootKids), &l.root}}
	parts := 1
	if l.parts > 1 && l.run != nil {
		// Build the top levels breadth first until there are enough
		// subtrees to share among the parts (Spread), which then build
		// them depth first side by side: no two write one node.
		parts = l.parts
		for len(frames) > 0 && len(frames) < 64*parts {
			var deeper []frame
			for i := range frames {
				f := &frames[i]
				for f.lo < f.hi {
					e := next(f, l.pool(0))
					if e == nil {
						return 0, false
					}
					built++
					if e.kids > 0 {
						deeper = append(deeper, frame{e.first, e.first, e.first + e.kids, e.n})
					}
				}
			}
			frames = deeper
		}
	}
	type tally struct {
		built int64
		bad   bool
		_     [64]byte
	}
	tallies := make([]tally, parts)
	l.pool(parts - 1) // every part's pool, before the parts run
	dfs := func(p int) {
		pool := &l.pools[p]
		var stack []frame
		for i := p; i < len(frames); i += parts {
			stack = append(stack, frames[i])
		}
		t := &tallies[p]
		for len(stack) > 0 {
			f := &stack[len(stack)-1]
			if f.lo == f.hi {
				stack = stack[:len(stack)-1]
				continue
			}
			e := next(f, pool)
			if e == nil {
				t.bad = true
				return
			}
			t.built++
			if e.kids > 0 {
				stack = append(stack, frame{e.first, e.first, e.first + e.kids, e.n})
			}
		}
	}
	if parts > 1 {
		l.run(parts, dfs)
	} else {
		dfs(0)
	}
	for _, t := range tallies {
		if t.bad {
			return 0, false
		}
		built += t.built
	}
	for i := range ch {
		recs[ch[i].k].n = ch[i].n
	}
	for k := range state {
		if state[k] != linkDone {
			state[k] = linkBroken
		}
	}
	return built, true
}
