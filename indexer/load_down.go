package indexer

// linkDown is linkAll's fast way, for copies in which no two records name
// one (parent, local) position (consistent copies never do): it builds the
// nodes top-down from the root, depth first, over each record's list of
// children (loadNode.head and next, threaded by linkAll as it finds the
// parents, in record order). The walk up from each record in seq order
// takes several dependent cache misses per record (its parent's record,
// the parent's node), where this one reads each record once, when its
// node is built, and writes the node into the record it has just read.
// Depth first keeps a path's nodes together in memory, as the walk did.
// The records reached are linkDone and the rest linkBroken (their chain
// misses a parent or is a cycle): what the walk finds. It reports false,
// leaving the nodes it built for the collector and the states to be
// reset, on meeting two records for one position: which record names
// that node depends on the walk's order, and the walk decides it.
//
// An earlier version laid every record's children out together first (a
// counting sort by parent record, 40 bytes a record) and built from that
// array: the sort's scattered writes took 0.43–0.68 s of a 5M-block
// restore, on the restore's critical path, and the array 125 MB (3.1M
// node records).
func (l *Loader) linkDown(x *seqIndex) (built int64, ok bool) {
	recs, par, state := x.recs, x.par, x.state
	// The root's children, in record order.
	rootHead := uint32(noRec)
	for k := len(recs) - 1; k >= 0; k-- {
		if par[k] == parRoot {
			recs[k].next, rootHead = rootHead, uint32(k)
		}
	}
	// A frame is a node's children being built: the record of the next
	// one (noRec when none is left), how many were built, and the first
	// one's local. Two of them naming one position (a copy that breaks
	// the index's invariants) shows in the parent's child map not
	// growing, or a local equal to the first child's (the inline one).
	type frame struct {
		next   uint32
		done   uint32
		first  uint64
		parent *node
	}
	// step builds the node of f's next child and returns its record; nil
	// when it names a position taken.
	step := func(f *frame, pool *nodePool) *loadNode {
		k := f.next
		r := &recs[k]
		f.next = r.next
		parent := f.parent
		nd := pool.get(parent, r.local, r.seq)
		if r.kids > 1 {
			nd.more = make(map[uint64]*node, r.kids-1)
		}
		if f.done == 0 { // the first child
			if parent.c1 != nil { // only the root's may be set: never
				return nil
			}
			parent.c1 = nd
			f.first = r.local
		} else {
			if r.local == f.first {
				return nil
			}
			if parent.more == nil {
				parent.more = make(map[uint64]*node, 2)
			}
			parent.more[r.local] = nd
			if len(parent.more) != int(f.done) {
				return nil
			}
		}
		f.done++
		r.n, r.part = nd, uint8(r.seq>>56) // its node's seq: no other record names it
		state[k] = linkDone
		return r
	}
	// fail leaves no record with a node of this attempt: the walk links
	// from scratch.
	fail := func() (int64, bool) {
		for k := range recs {
			recs[k].n = nil
		}
		return 0, false
	}
	frames := []frame{{next: rootHead, parent: &l.root}}
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
				for f.next != noRec {
					r := step(f, l.pool(0))
					if r == nil {
						return fail()
					}
					built++
					if r.head != noRec {
						deeper = append(deeper, frame{next: r.head, parent: r.n})
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
			if f.next == noRec {
				stack = stack[:len(stack)-1]
				continue
			}
			r := step(f, pool)
			if r == nil {
				t.bad = true
				return
			}
			t.built++
			if r.head != noRec {
				stack = append(stack, frame{next: r.head, parent: r.n})
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
			return fail()
		}
		built += t.built
	}
	for k := range state {
		if state[k] != linkDone {
			state[k] = linkBroken
		}
	}
	return built, true
}
