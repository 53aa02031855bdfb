package indexer

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
)

// A Loader rebuilds an index from its durable copy (the records a Journal
// describes: tree nodes, residencies, rank metadata) in bulk, which is what
// a node does at start-up and after a snapshot restore. Feed it every
// record with AddNode, AddEntry and AddRank, then call Finish.
//
// Why it is fast. The obvious rebuild (look each entry's node up in a map
// of node records, build its path to the root on demand, then set the
// entry's tier bits through the index's write path) pays, per block, a
// handful of cache misses in maps that outgrew the caches, maps regrown
// from empty, and the write path's checks (holder searches, remap checks)
// that cannot fire on a consistent copy. At millions of blocks the misses
// are the cost, so the Loader is built to take few:
//
//   - A node record carries everything the rebuild needs of it (its
//     parent's record, its child count, its link state, the node built for
//     it), so a lookup lands on one record and the rest is on its line.
//   - The records are kept sorted by sequence hash (the state database
//     yields them in that order) and found through a directory of bucket
//     starts indexed by the top bits of the hash: sequence hashes are
//     uniform, so a bucket holds one or two records and a lookup costs a
//     directory read and a record read. No hash table is built. Skewed
//     hashes (tests use small integers) only fill some buckets more, and a
//     full bucket is binary-searched.
//   - Lookups by seq come in batches (each record's parent, each
//     residency's node) and are answered partition by partition of the
//     records, so that they hit the cache (batcher, load_batch.go).
//   - Every node is linked once, parents before children: each record's
//     children are threaded into a list through the records as their
//     parents are found (in the batched lookups), and the tree is built
//     top-down from the root along the lists, depth first, in parts side
//     by side under Spread (linkDown);
//     the records not reached do not reach the root (a missing parent, a
//     cycle). A copy in which two records name one position is linked by
//     walking up from each record instead, as it always was.
//   - Every map is sized from counts known before it is filled: each
//     rank's engine-hash map from its entry count, each node's child map
//     from its child count.
//   - Ranks take slots in rank order and their entries are applied in that
//     order, so a holder is always appended (never inserted), and a
//     residency costs one map store and one digest term. The general write
//     path (setBit) is kept for copies that break the index's invariants
//     (an engine hash twice in a rank, two holders of one rank on a node),
//     so that such a copy loads exactly as it did through the write path.
//
// Nodes come from slabs (nodePool), one pool per part of the tree's
// construction; the index adopts the first part's pool, and the freed
// nodes of every slab go to its free list as the write path frees them.
//
// Records are collected in chunks that are never moved (see chunks): a
// slice grown by append copies each record about four times and clears
// every new backing array, which at millions of records cost as much as
// the tree it was collected for.
//
// AddNode, then LinkNodes, may run concurrently with AddEntry and AddRank
// (they touch disjoint state), so that the node and residency scans run
// side by side and the tree is built while residencies are still read;
// calls of one method, and AddEntry with AddRank, must not overlap.
type Loader struct {
	nodes    chunks[loadNode]
	ranks    []*loadRank
	rankAt   map[kvevent.Rank]*loadRank
	lastRank *loadRank // the rank of the previous AddEntry: entries come grouped

	// Set by LinkNodes: the records by seq, and the tree built from them
	// under a root of the Loader's own, which Finish hands to the index.
	linked  bool
	linkErr error
	seqs    *seqIndex
	root    node
	built   int64      // nodes under root
	pools   []nodePool // the tree's nodes, a pool per part that built them

	parts int                               // Spread's parts, 0 when unset
	run   func(parts int, f func(part int)) // Spread's runner

	// scratch holds the build's large arrays and its pools' node slabs,
	// advised for huge pages (a first touch of fresh memory is most of a
	// rebuild's cost with 4 KiB pages); Finish and Discard withdraw the
	// advice (see nodePool).
	scratch hugepage.Scratch
	// The chunks of the node records and of every rank's residencies come
	// from slabs (see chunkSlab), released once LinkNodes and the
	// residencies' apply have dropped them; records holds the NodeRecords
	// handed out, whose slabs go the same way.
	nodeSlab  chunkSlab[loadNode]
	entrySlab chunkSlab[loadEntry]
	records   []*NodeRecords
}

// loadNode is one node record and what Finish works out about it.
type loadNode struct {
	seq, parent, local uint64
	n                  *node // the node built for the record, once linked
	kids               uint32
	// The records whose parent this one is, as a list threaded through
	// them (linkAll): the first one's index, and the next one's after
	// this record in its parent's list; noRec ends a list.
	head, next uint32
	root       bool
	part       uint8 // top byte of the node's seq: who adds its holders (applySpread)
}

// noRec ends a list of child records (loadNode.head, next).
const noRec = math.MaxUint32

const parRoot, parMissing = -1, -2

// Link states of a node record during Finish.
const (
	linkNone    uint8 = iota // not reached yet
	linkPending              // on the current walk's path
	linkDone                 // linked under the root (n is set)
	linkBroken               // does not reach the root: parent missing, or a cycle
)

// loadRank is what the Loader collected of one rank.
type loadRank struct {
	meta    RankMeta
	entries chunks[loadEntry]
	// unique is set while every entry's engine hash was above the previous
	// one: then no engine hash repeats, and the fast path may skip the
	// check (the state database yields a rank's entries in hash order).
	unique bool
	lastEH uint64 // the engine hash of the last entry added
}

// loadEntry is one residency, 24 bytes.
type loadEntry struct {
	seq, eh uint64
	order   uint32
	mask    kvevent.Mask
}

// NewLoader returns an empty Loader. nodes and ranks are capacity hints
// (0 when unknown).
func NewLoader(nodes, ranks int) *Loader {
	l := &Loader{
		ranks:  make([]*loadRank, 0, ranks),
		rankAt: make(map[kvevent.Rank]*loadRank, ranks),
	}
	l.nodes.from = &l.nodeSlab
	l.nodes.reserve(nodes, &l.scratch)
	return l
}

// AddNode records a tree node. Records are cheapest in ascending seq order.
func (l *Loader) AddNode(seq, parent uint64, root bool, local uint64) {
	*l.nodes.next() = loadNode{seq: seq, parent: parent, local: local, root: root, head: noRec}
}

// NodeRecords collects node records apart from a Loader, so that a second
// scan of the node records can run beside the one that feeds the Loader;
// Loader.AddNodes hands them over. Its zero value is ready to use (its
// chunks made one by one); Loader.NodeRecords returns one whose chunks
// come from slabs the Loader releases.
type NodeRecords struct {
	c    chunks[loadNode]
	slab chunkSlab[loadNode]
}

// NodeRecords returns an empty NodeRecords for l.AddNodes, its chunks
// from slabs of its own advised for huge pages, which l releases with its
// node records' (LinkNodes, Finish, Discard). It may be filled on another
// goroutine than l's; that must end before AddNodes, LinkNodes, Finish or
// Discard.
func (l *Loader) NodeRecords() *NodeRecords {
	r := &NodeRecords{}
	r.c.from = &r.slab
	l.records = append(l.records, r)
	return r
}

// releaseNodeSlabs releases the slabs of the node records' chunks (the
// Loader's and those of the NodeRecords it handed out).
func (l *Loader) releaseNodeSlabs() {
	l.nodeSlab.release()
	for _, r := range l.records {
		r.slab.release()
	}
	l.records = nil
}

// releaseScratch withdraws the huge page advice from everything the Loader
// advised, at its end.
func (l *Loader) releaseScratch() {
	l.releaseNodeSlabs()
	l.entrySlab.release()
	l.scratch.Release()
}

// Add records a tree node, as Loader.AddNode does.
func (r *NodeRecords) Add(seq, parent uint64, root bool, local uint64) {
	*r.c.next() = loadNode{seq: seq, parent: parent, local: local, root: root, head: noRec}
}

// AddNodes adds r's records after those added so far, without copying
// them, and empties r. It is an AddNode as to what may overlap it.
func (l *Loader) AddNodes(r *NodeRecords) { l.nodes.join(&r.c) }

// AddEntry records that rank r holds node seq under engine hash eh.
// Entries are cheapest grouped by rank and in ascending eh order.
func (l *Loader) AddEntry(r kvevent.Rank, eh, seq uint64, mask kvevent.Mask, order uint32) {
	lr := l.lastRank
	if lr == nil || lr.meta.Rank != r {
		lr = l.rank(r)
		l.lastRank = lr
	}
	if lr.entries.n > 0 && eh <= lr.lastEH {
		lr.unique = false
	}
	lr.lastEH = eh
	*lr.entries.next() = loadEntry{seq: seq, eh: eh, order: order, mask: mask}
}

// AddRank records a rank's metadata (its flags included: Finish sets them).
func (l *Loader) AddRank(m RankMeta) {
	lr := l.rank(m.Rank)
	lr.meta = m
}

func (l *Loader) rank(r kvevent.Rank) *loadRank {
	lr := l.rankAt[r]
	if lr == nil {
		lr = &loadRank{meta: RankMeta{Rank: r}, entries: chunks[loadEntry]{from: &l.entrySlab}, unique: true}
		l.rankAt[r] = lr
		l.ranks = append(l.ranks, lr)
	}
	return lr
}

// Finish replaces everything ix held with the collected state (the
// journal is not told) and releases the Loader's records. An entry whose
// node is missing or does not reach the root, or whose mask is empty or
// out of range, is ErrBadDump and leaves ix empty. Nodes no entry needs are
// not kept: a node exists only while some rank holds it or a descendant.
func (l *Loader) Finish(ix *Index) error {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	j := ix.journal
	ix.journal = nil
	defer func() { ix.journal = j }()
	ix.resetLocked()
	err := l.build(ix)
	if err != nil {
		ix.resetLocked()
	}
	l.releaseScratch()
	*l = Loader{}
	return err
}

// Discard drops what the Loader collected without building anything, for
// a Loader abandoned part way (a stream refused): like Finish, it
// withdraws the huge page advice from the Loader's scratch arrays before
// they are dropped. A LinkNodes running on another goroutine must have
// returned.
func (l *Loader) Discard() {
	l.releaseScratch()
	*l = Loader{}
}

// FinishDetached is Finish into a new index with like's configuration,
// which nothing else sees: a caller that must not change any state before
// it knows the records are consistent (a snapshot restore) builds here,
// and on success moves the result into the live index with Index.Take.
func (l *Loader) FinishDetached(like *Index) (*Index, error) {
	ix := New(like.cfg)
	if err := l.Finish(ix); err != nil {
		return nil, err
	}
	return ix, nil
}

// Take replaces the index's contents (tree, ranks, counts, digest) with
// o's and leaves o empty. o must be an index nothing else uses
// (FinishDetached's). The index keeps its configuration and journal
// (nothing is journaled), and its counters, to which o's are added (what
// the load counted, as Finish counts into the index it loads).
func (ix *Index) Take(o *Index) {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	o.mu.Lock()
	defer o.mu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.resetLocked()
	ix.root.c1, ix.root.more = o.root.c1, o.root.more
	ix.root.forEachChild(func(c *node) { c.parent = &ix.root })
	ix.pool, o.pool = o.pool, nodePool{huge: &o.huge}
	ix.names, o.names = o.names, blockMap{}
	ix.tables, o.tables = o.tables, segTables{huge: &o.huge}
	ix.pool.huge = &ix.huge
	ix.tables.huge = &ix.huge
	o.huge.MoveTo(&ix.huge) // the slabs' records go with them
	ix.ranks, ix.slots, ix.free = o.ranks, o.slots, o.free
	ix.nodes, ix.entries, ix.perTier, ix.digest = o.nodes, o.entries, o.perTier, o.digest
	c, oc := &ix.counters, &o.counters
	c.StoredBlocks += oc.StoredBlocks
	c.RemovedBlocks += oc.RemovedBlocks
	c.Cleared += oc.Cleared
	c.UnknownRemoves += oc.UnknownRemoves
	c.Malformed += oc.Malformed
	c.OrphansHeld += oc.OrphansHeld
	c.OrphansApplied += oc.OrphansApplied
	c.OrphansDropped += oc.OrphansDropped
	c.Remapped += oc.Remapped
	c.CapacityEvicted += oc.CapacityEvicted
	c.NameCollisions += oc.NameCollisions
	o.resetLocked()
	o.counters = Counters{}
}

// LinkNodes builds the tree of the node records added so far, under a
// root of the Loader's own: nothing of it is visible in an index before
// Finish. Call it after the last AddNode (a later AddNode is lost); it may
// run while AddEntry and AddRank calls go on, so that the tree is built
// while the residencies are read. Finish calls it when no one did.
func (l *Loader) LinkNodes() {
	if l.linked {
		return
	}
	l.linked = true
	if l.nodes.n > math.MaxInt32 {
		l.linkErr = fmt.Errorf("%w: %d nodes", ErrBadDump, l.nodes.n)
		l.nodes = chunks[loadNode]{}
		l.releaseNodeSlabs()
		return
	}
	l.seqs = newSeqIndex(l.nodes.flatten(&l.scratch), &l.scratch)
	l.nodes = chunks[loadNode]{}
	l.releaseNodeSlabs() // the collector may have the chunks now
	l.built = l.linkAll(l.seqs)
}

// pool returns part p's node pool.
func (l *Loader) pool(p int) *nodePool {
	for len(l.pools) <= p {
		slab := 0
		if l.seqs != nil {
			slab = loadSlab(len(l.seqs.recs), l.parts)
		}
		l.pools = append(l.pools, nodePool{huge: &l.scratch, next: slab, most: slab})
	}
	return &l.pools[p]
}

// loadSlab is the slab size, in nodes, of a Loader's pools building n
// nodes in parts: a quarter of a part's share, from nodeSlab up to
// maxLoadSlab. A rebuild writes its nodes into fresh memory at once, and
// only the whole huge pages inside a slab are advised (internal/hugepage):
// the 4 KiB pages at a slab's two ends, about a huge page's worth, cost a
// fault each, a fifth of a 10 MiB slab and a twentieth of a 40 MiB one.
// A 5M-block restore into fresh memory (the cluster benchmark's, 3.1M
// nodes on two parts): the faults of the nodes' first writes fell from
// 15.0k to 4.1k, the restore's from 88–92k to 78k.
func loadSlab(n, parts int) int {
	return min(max(n/(4*max(parts, 1)), nodeSlab), maxLoadSlab)
}

const maxLoadSlab = 1 << 19 // 40 MiB of nodes

// adoptTree moves the tree LinkNodes built into ix, whose root is empty:
// the root's children are re-parented (the root is a value in each).
func (l *Loader) adoptTree(ix *Index) {
	ix.root.c1, ix.root.more = l.root.c1, l.root.more
	ix.root.forEachChild(func(c *node) { c.parent = &ix.root })
	ix.nodes = l.built
	if len(l.pools) > 0 {
		ix.pool = l.pools[0]
		ix.pool.huge = &ix.huge // the Loader's scratch is released at its end
		// A growing tree takes a slab at a time: the usual sizes.
		ix.pool.next, ix.pool.most = min(ix.pool.next, maxNodeSlab), 0
		// The other parts' pools go with the Loader: their partly used
		// slabs' tails (up to a slab each) would be lost to the tree.
		for _, q := range l.pools[1:] {
			if len(q.slab) < cap(q.slab) {
				ix.pool.spare = append(ix.pool.spare, q.slab)
			}
		}
	}
	l.root, l.pools = node{}, nil
}

func (l *Loader) build(ix *Index) error {
	// A held orphan is checked as a dump's is (RankDump.validate): one of
	// an unknown tier would load and then fail the apply that adopts it.
	for _, lr := range l.ranks {
		for _, o := range lr.meta.Orphans {
			if !o.Tier.Valid() || len(o.Blocks) == 0 {
				return fmt.Errorf("%w: rank %v holds an orphan of tier %d with %d blocks", ErrBadDump, lr.meta.Rank, o.Tier, len(o.Blocks))
			}
		}
	}
	l.LinkNodes()
	if l.linkErr != nil {
		return l.linkErr
	}
	nodes := l.seqs
	l.adoptTree(ix)
	// Every node's name, for the write path's check (Index.names). The
	// records are one per seq and each builds at most one node, so the
	// names of the tree are unique; two records of one position share
	// their node, named by the first.
	//
	// The names' and the ranks' maps are sized here at once, with tables
	// from the index's pool (segTables) whose slabs the Loader's scratch
	// advises for huge pages, as it does the tree's node slabs: millions
	// of blocks take hundreds of megabytes of tables, and their first
	// writes would otherwise fault once per 4 KiB page. Slabs the index
	// takes later are its own.
	ix.tables.huge = &l.scratch
	defer func() { ix.tables.huge, ix.tables.bulk = &ix.huge, 0 }()
	tables := mapTables(int(ix.nodes))
	for _, lr := range l.ranks {
		tables += mapTables(lr.entries.n)
	}
	ix.tables.reserve(tables)
	ix.names = newBlockMap(int(ix.nodes), &ix.tables)
	fillNames(&ix.names, nodes, &ix.tables, l.parts, l.run)

	// Ranks take slots in rank order: deterministic, and the order in
	// which their entries are applied below, so that every holder lands
	// at the end of its node's slot-ordered list.
	slices.SortFunc(l.ranks, func(a, b *loadRank) int { return a.meta.Rank.Compare(b.meta.Rank) })
	rss := make([]*rankState, len(l.ranks))
	unique := true
	for i, lr := range l.ranks {
		rs := ix.rankFor(lr.meta.Rank, true)
		rs.blocks = newBlockMap(lr.entries.n, &ix.tables)
		rs.cap = lr.meta.Capacity
		rss[i] = rs
		unique = unique && lr.unique
	}
	done := false
	if l.parts > 1 && unique {
		var err error
		if done, err = l.applySpread(ix, nodes, rss); err != nil {
			return err
		}
	}
	if !done {
		if err := l.applySerial(ix, nodes, rss); err != nil {
			return err
		}
	}
	// Every rank's residencies are applied and dropped (the serial path
	// drops each rank's as it goes, but the ranks share the slabs).
	l.entrySlab.release()
	for i, lr := range l.ranks {
		rs := rss[i]
		rs.order = lr.meta.Order
		rs.needsResync, rs.overCapacity = lr.meta.NeedsResync, lr.meta.OverCapacity
		ix.loadOrphans(rs, lr.meta.Orphans)
	}

	// Unlink the nodes no rank holds and that lead to no held node. On a
	// consistent copy there are none.
	for k := range nodes.recs {
		if rec := &nodes.recs[k]; nodes.state[k] == linkDone && len(rec.n.holders) == 0 && !rec.n.hasChildren() {
			ix.unlink(rec.n)
		}
	}
	return nil
}

// fillNames puts every linked node of x into m, a map sized for them, under
// its name (its seq).
//
// The records are in seq order, and a name's slot in m is at random: one
// insert after another would wait out a cache miss into a table of
// hundreds of megabytes each (and one into the node, for its seq). So,
// when the tree was built top down (every record's node is named by the
// record's own seq) and the records are many, the inserts are first
// scattered by the top bits of their hash (which pick the segment) into
// partitions of a few segments each, as the batched lookups are
// (load_batch.go), and then made partition by partition, within tables
// that stay in cache. The map holds the same entries either way.
//
// With parts (Spread), each of the three passes runs in parts side by
// side: the count and the scatter over a range of the records each
// (every part scatters into its own run of each partition, after the
// runs of the parts before it, so the pairs are in record order within
// a partition as one pass leaves them), the inserts over a range of the
// partitions each. A partition's segments are its own (the map was
// sized at once: every segment is at the directory's depth, at least
// the partition bits), so no two parts write one segment; an insert that
// would grow its segment (which splits it and may double the directory)
// is left to a serial pass after the parts (fillSegments). At 5M blocks
// the names took 0.45–0.53 s on one core, after the tree and before the
// residencies: on the restore's critical path.
func fillNames(m *blockMap, x *seqIndex, t *segTables, parts int, run func(parts int, f func(part int))) {
	recs, state := x.recs, x.state
	if !x.ownNodes || !x.batched() || m.depth == 0 {
		for k := range recs {
			if state[k] == linkDone {
				n := recs[k].n
				m.put(n.seq, n, t)
			}
		}
		return
	}
	if parts < 2 || run == nil {
		parts, run = 1, func(_ int, f func(int)) { f(0) }
	}
	logP := min(m.depth, maxBatchBits) // a partition is 1<<(depth-logP) segments
	shift := 64 - logP
	np := 1 << logP
	span := func(p, n int) (lo, hi int) { return p * n / parts, (p + 1) * n / parts }
	// cur[p][q]: where part p's next pair of partition q goes; first its
	// count.
	cur := make([][]uint32, parts)
	run(parts, func(p int) {
		c := make([]uint32, np)
		lo, hi := span(p, len(recs))
		for k := lo; k < hi; k++ {
			if state[k] == linkDone {
				c[m.hash(recs[k].seq)>>shift]++
			}
		}
		cur[p] = c
	})
	start := make([]uint32, np+1) // partition q's pairs: start[q] up to start[q+1]
	var sum uint32
	for q := range np {
		start[q] = sum
		for p := range parts {
			n := cur[p][q]
			cur[p][q] = sum
			sum += n
		}
	}
	start[np] = sum
	pairs := hugepage.MakeIn[blockSlot](x.sc, int(sum))
	run(parts, func(p int) {
		c := cur[p]
		lo, hi := span(p, len(recs))
		for k := lo; k < hi; k++ {
			if state[k] == linkDone {
				r := &recs[k]
				at := &c[m.hash(r.seq)>>shift]
				pairs[*at] = blockSlot{eh: r.seq, n: r.n}
				*at++
			}
		}
	})
	added := make([]int, parts)
	over := make([][]blockSlot, parts)
	run(parts, func(p int) {
		lo, hi := span(p, np)
		added[p], over[p] = m.fillSegments(pairs[start[lo]:start[hi]])
	})
	for p := range parts {
		m.n += added[p]
	}
	for _, o := range over {
		for _, sl := range o {
			m.put(sl.eh, sl.n, t)
		}
	}
}

// applySerial adds every residency, rank by rank in slot order.
//
// Nodes are not unlinked meanwhile (Index.keepNodes): each entry's node
// is resolved before its rank is applied, and the write path's remap (an
// engine hash given twice) would unlink a node that a later entry, of
// this rank or a later one, still holds, and free it for reuse under
// that entry. build's last pass unlinks what is left empty.
func (l *Loader) applySerial(ix *Index, nodes *seqIndex, rss []*rankState) error {
	ix.keepNodes = true
	defer func() { ix.keepNodes = false }()
	var at []*node // the node of each entry of the rank at hand
	var b batcher
	for ri, lr := range l.ranks {
		rs := rss[ri]
		// First every entry's node (one batch of lookups, see batcher),
		// then the residencies.
		at = slices.Grow(at[:0], lr.entries.n)[:lr.entries.n]
		if err := resolveRanks(nodes, &b, l.ranks[ri:ri+1], at, nil)[0]; err != nil {
			return err
		}
		j := 0
		for _, es := range lr.entries.all {
			for i := range es {
				e, n := &es[i], at[j]
				j++
				if lr.unique && (len(n.holders) == 0 || n.holders[len(n.holders)-1].slot() < rs.slot) {
					ix.addLoaded(rs, n, e)
					continue
				}
				// A copy the write path would have reconciled (an engine
				// hash given twice, or a second holder of this rank on n):
				// load it the way the write path does, so the outcome is
				// the same.
				for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
					if e.mask.Has(t) {
						ix.setBit(rs, n, e.eh, t)
					}
				}
				n.holders[n.find(rs.slot)].order = e.order
			}
		}
		lr.entries = chunks[loadEntry]{} // the collector may have them while the rest loads
	}
	return nil
}

// addLoaded adds the residency e of rank rs on node n, which rs does not
// hold yet and whose holders all have lower slots: the write path's
// setBitMapped without its checks, and with all tier bits at once.
func (ix *Index) addLoaded(rs *rankState, n *node, e *loadEntry) {
	n.holders = append(n.holders, holder{eh: e.eh, sm: mkSM(rs.slot, e.mask), order: e.order})
	rs.blocks.put(e.eh, n, &ix.tables)
	for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
		if e.mask.Has(t) {
			rs.count[t]++
			ix.perTier[t]++
		}
	}
	ix.entries++
	ix.digest += residencyTerm(rs.key, n.seq, e.eh, e.mask)
}

// seqIndex finds node records by sequence hash: the records sorted by
// seq, and dir[b] the first record whose seq's top bits are >= b (dir has
// one bucket per one or two records, and a last entry len(recs)).
type seqIndex struct {
	recs  []loadNode
	dir   []uint32
	shift uint
	// Set by linkAll, per record: its parent's record (parRoot,
	// parMissing or an index) and its link state (linkNone ...). Kept
	// apart from the records so that the walks, which read them at
	// random, touch small arrays.
	par   []int32
	state []uint8
	// ownNodes is set by linkAll when the tree was built top down
	// (linkDown): every record linked built a node of its own, named by
	// the record's seq. The upward walk, for damaged copies, may link two
	// records of one position to one node.
	ownNodes bool
	sc       *hugepage.Scratch // the Loader's, for the arrays of its lookups
}

// newSeqIndex sorts the records by seq with one record per seq (the last
// one given, as a map keyed by seq would keep) and builds the directory.
// Records already in strictly ascending order, as the state database
// yields them, are checked in one pass and not moved.
func newSeqIndex(recs []loadNode, sc *hugepage.Scratch) *seqIndex {
	sorted := true
	for i := 1; i < len(recs); i++ {
		if recs[i-1].seq >= recs[i].seq {
			sorted = false
			break
		}
	}
	if !sorted {
		// A stable sort keeps duplicates in the order given; keep the last.
		slices.SortStableFunc(recs, func(a, b loadNode) int { return cmp.Compare(a.seq, b.seq) })
		out := recs[:0]
		for i := range recs {
			if i+1 < len(recs) && recs[i+1].seq == recs[i].seq {
				continue
			}
			out = append(out, recs[i])
		}
		recs = out
	}
	// 2^logB buckets, the power of two at or above half the records.
	logB := bits.Len(uint(len(recs)/2 + 1))
	x := &seqIndex{recs: recs, dir: hugepage.MakeIn[uint32](sc, 1<<logB+1), shift: uint(64 - logB), sc: sc}
	b := 0
	for i := range recs {
		for top := int(recs[i].seq >> x.shift); b <= top; b++ {
			x.dir[b] = uint32(i)
		}
	}
	for ; b < len(x.dir); b++ {
		x.dir[b] = uint32(len(recs))
	}
	return x
}

// find returns the index of seq's record, or -1.
func (x *seqIndex) find(seq uint64) int {
	b := seq >> x.shift
	lo, hi := int(x.dir[b]), int(x.dir[b+1])
	if hi-lo <= 8 {
		for i := lo; i < hi; i++ {
			if x.recs[i].seq == seq {
				return i
			}
		}
		return -1
	}
	k, ok := slices.BinarySearchFunc(x.recs[lo:hi], seq, func(r loadNode, s uint64) int { return cmp.Compare(r.seq, s) })
	if !ok {
		return -1
	}
	return lo + k
}

// linkAll builds and links, under l.root, the node of every record that
// reaches the root, parents before children: such a record ends linkDone
// with its node in n, the others linkBroken. It returns the number of
// nodes built.
//
// linkDown does it when no two records name one position; else, for each
// record not yet decided, it walks up the parent records to the root, to a
// linked record or to one that cannot be linked, then links the path
// top-down; every record is on one walk only, so this is linear in the
// records.
func (l *Loader) linkAll(x *seqIndex) (built int64) {
	recs := x.recs
	x.par = hugepage.MakeIn[int32](x.sc, len(recs))
	x.state = hugepage.MakeIn[uint8](x.sc, len(recs))
	par, state := x.par, x.state
	// One pass finds every record's parent record and counts children, so
	// that a node with several gets its child map at its final size at
	// once (the root's and the shared prefixes' maps are the large ones).
	// The lookups are batched (see batcher) when the records are many.
	var rootKids int
	if x.batched() {
		var b batcher
		b.reset(x, len(recs))
		for k := range recs {
			if r := &recs[k]; r.root {
				par[k] = parRoot
				rootKids++
			} else {
				b.count(r.parent)
			}
		}
		b.scatterStart()
		for k := range recs {
			if r := &recs[k]; !r.root {
				b.put(r.parent, uint32(k))
			}
		}
		// Each record is put at the head of its parent's list of
		// children, in reverse: a partition's pairs are in record order,
		// so that every list ends in record order.
		pairs := b.pairs[:b.start[len(b.start)-1]]
		for i := len(pairs) - 1; i >= 0; i-- {
			q := pairs[i]
			p := x.find(q.seq)
			if p < 0 {
				par[q.at] = parMissing
				continue
			}
			par[q.at] = int32(p)
			rp := &recs[p]
			rp.kids++
			recs[q.at].next, rp.head = rp.head, q.at
		}
	} else {
		for k := len(recs) - 1; k >= 0; k-- { // in reverse, as above
			r := &recs[k]
			switch {
			case r.root:
				par[k] = parRoot
				rootKids++
			default:
				p := x.find(r.parent)
				if p < 0 {
					par[k] = parMissing
					continue
				}
				par[k] = int32(p)
				rp := &recs[p]
				rp.kids++
				r.next, rp.head = rp.head, uint32(k)
			}
		}
	}
	if rootKids > 1 {
		l.root.more = make(map[uint64]*node, rootKids-1)
	}
	if built, ok := l.linkDown(x); ok {
		x.ownNodes = true
		return built
	}
	// Two records name one (parent, local) position: link as the walk
	// below always did, so that such a copy loads as it did.
	l.root, l.pools = node{}, nil
	clear(state)
	if rootKids > 1 {
		l.root.more = make(map[uint64]*node, rootKids-1)
	}
	var path []int32
	for k := range recs {
		if state[k] != linkNone {
			continue
		}
		path = path[:0]
		parent := &l.root // what the path's last record hangs below
		ok := true
		for c := int32(k); ; {
			state[c] = linkPending
			path = append(path, c)
			p := par[c]
			if p == parRoot {
				break
			}
			if p == parMissing || state[p] == linkBroken || state[p] == linkPending {
				ok = false // no parent, or one that cannot be linked, or a cycle
				break
			}
			if state[p] == linkDone {
				parent = recs[p].n
				break
			}
			c = p
		}
		if !ok {
			for _, c := range path {
				state[c] = linkBroken
			}
			continue
		}
		for i := len(path) - 1; i >= 0; i-- {
			r := &recs[path[i]]
			n := parent.child(r.local)
			if n == nil {
				n = l.pool(0).get(parent, r.local, r.seq)
				if r.kids > 1 {
					n.more = make(map[uint64]*node, r.kids-1)
				}
				parent.addChild(n)
				built++
			}
			// else: another record already named this (parent, local)
			// position; both records denote that node, as they would
			// have through the write path.
			r.n, r.part = n, uint8(n.seq>>56)
			state[path[i]] = linkDone
			parent = n
		}
	}
	return built
}
