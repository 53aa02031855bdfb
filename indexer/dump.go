package indexer

import (
	"cmp"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// RankDump is one rank's complete state, enough to rebuild it exactly on
// another index: the path of every block it holds (as tree nodes), its
// residencies, its held orphans and its capacity. Snapshots and resyncs are
// built from it.
type RankDump struct {
	Rank     kvevent.Rank
	Capacity [kvevent.NumTiers]int64
	Order    uint32 // the rank's store counter
	// Nodes lists every node on a path to an entry, parents before
	// children. A node is named by its sequence hash; Parent is 0 with
	// Root set for a child of the root.
	Nodes   []DumpNode
	Entries []DumpEntry
	Orphans []DumpOrphan
}

// DumpNode is one tree node on a rank's paths.
type DumpNode struct {
	Seq    uint64
	Parent uint64 // the parent's Seq; meaningless when Root
	Root   bool
	Local  uint64
}

// DumpEntry is one residency.
type DumpEntry struct {
	Seq        uint64 // the node
	EngineHash uint64
	Mask       kvevent.Mask
	Order      uint32
}

// DumpOrphan is one held store.
type DumpOrphan struct {
	At     int64
	Tier   kvevent.Tier
	Parent uint64
	Blocks []kvevent.Block
}

// DumpRank returns the rank's state, in a deterministic order: the rank
// as it was at one point of the apply order.
//
// It holds the read lock only to copy the rank out (O(n): no sort, and a
// map only for nodes on its paths that the rank does not hold), and
// orders the copy after releasing it. A writer waiting for the lock keeps
// every new reader out (sync.RWMutex), so a dump that sorted under the
// lock (1.2 s for a rank of 400k blocks) held every lookup of the node
// for as long.
//
// A rank that a ReplaceRank is replacing is dumped once the replace is
// done: between two of its chunks the rank holds part of its old state or
// of its new one, which was never the rank's state at any point of the
// apply order. The dump waits for the replace, as it did when the replace
// held the lock throughout; a dump of another rank does not.
func (ix *Index) DumpRank(r kvevent.Rank) (RankDump, error) {
	d, nodes, ok := ix.copyRank(r)
	if !ok {
		return RankDump{}, fmt.Errorf("dump %s: %w", r, ErrUnknownRank)
	}
	if ix.dumpUnlocked != nil {
		ix.dumpUnlocked()
	}
	// Parents before children: by depth, then by Seq. A node's depth is
	// its parent's plus one, found through the parent links of the copy
	// (every node on a path to an entry is in it).
	at := make(map[uint64]int, len(nodes))
	for i := range nodes {
		at[nodes[i].Seq] = i
		nodes[i].depth = -1
	}
	var up []int // nodes whose depth waits for their parent's
	for i := range nodes {
		j := i
		for nodes[j].depth < 0 {
			if nodes[j].Root {
				nodes[j].depth = 0
				break
			}
			up = append(up, j)
			j = at[nodes[j].Parent]
		}
		for _, k := range slices.Backward(up) {
			nodes[k].depth = nodes[j].depth + 1
			j = k
		}
		up = up[:0]
	}
	slices.SortFunc(nodes, func(a, b dumpNodeAt) int {
		if a.depth != b.depth {
			return cmp.Compare(a.depth, b.depth)
		}
		return cmp.Compare(a.Seq, b.Seq)
	})
	if len(nodes) > 0 {
		d.Nodes = make([]DumpNode, len(nodes))
		for i := range nodes {
			d.Nodes[i] = nodes[i].DumpNode
		}
	}
	slices.SortFunc(d.Entries, func(a, b DumpEntry) int { return cmp.Compare(a.EngineHash, b.EngineHash) })
	return d, nil
}

// dumpNodeAt is a node of a dump with its depth (0 for a child of the root).
type dumpNodeAt struct {
	DumpNode
	depth int
}

// copyRank copies the rank's state under the read lock, unordered: its
// entries and orphans into d, and every node on a path to an entry, once,
// into nodes. ok is false for an unknown rank. A rank being replaced is
// copied once the replace is done.
func (ix *Index) copyRank(r kvevent.Rank) (d RankDump, nodes []dumpNodeAt, ok bool) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs := ix.rankFor(r, false)
	for rs != nil && rs == ix.replacing {
		done := ix.replaced
		ix.mu.RUnlock()
		<-done
		ix.mu.RLock()
		rs = ix.rankFor(r, false) // a writer may have removed it since
	}
	if rs == nil {
		return RankDump{}, nil, false
	}
	d = RankDump{Rank: r, Capacity: rs.cap, Order: rs.order}
	if n := rs.blocks.len(); n > 0 {
		d.Entries, nodes = make([]DumpEntry, 0, n), make([]dumpNodeAt, 0, n)
	}
	var unheld map[*node]bool // ancestors listed that the rank does not hold
	for eh, n := range rs.blocks.all() {
		h := n.holders[n.find(rs.slot)]
		d.Entries = append(d.Entries, DumpEntry{Seq: n.seq, EngineHash: eh, Mask: h.mask(), Order: h.order})
		nodes = append(nodes, ix.dumpNode(n))
		// A node the rank holds is listed by its entry; one it does not
		// (its block removed, a descendant's kept) by the first entry
		// below it, which lists its ancestors up to one the rank holds or
		// one listed already.
		for p := n.parent; p != &ix.root && p.find(rs.slot) < 0 && !unheld[p]; p = p.parent {
			if unheld == nil {
				unheld = make(map[*node]bool)
			}
			unheld[p] = true
			nodes = append(nodes, ix.dumpNode(p))
		}
	}
	for _, o := range rs.orphans {
		d.Orphans = append(d.Orphans, DumpOrphan{At: o.at, Tier: o.tier, Parent: o.parent,
			Blocks: append([]kvevent.Block(nil), o.blocks...)})
	}
	return d, nodes, true
}

// dumpNode returns tree node n as a dump lists it.
func (ix *Index) dumpNode(n *node) dumpNodeAt {
	dn := DumpNode{Seq: n.seq, Local: n.local, Root: n.parent == &ix.root}
	if !dn.Root {
		dn.Parent = n.parent.seq
	}
	return dumpNodeAt{DumpNode: dn}
}

// LoadRank replaces the rank's state with d, atomically: d is checked
// first, and a bad dump returns an error wrapping ErrBadDump and changes
// nothing. A dump is bad when it is inconsistent in itself, and when a
// node it would create is named (Seq) as a node of the index at another
// position: names are unique (DESIGN.md). The rank's resync flag clears.
func (ix *Index) LoadRank(d *RankDump) error {
	if err := d.validate(); err != nil {
		return fmt.Errorf("load %s: %w", d.Rank, err)
	}
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if err := ix.checkDumpNames(d); err != nil {
		return fmt.Errorf("load %s: %w", d.Rank, err)
	}
	rs := ix.rankFor(d.Rank, true)
	ix.clearRank(rs)
	rs.cap = d.Capacity
	nodes := make(map[uint64]*node, len(d.Nodes))
	for _, dn := range d.Nodes {
		parent := &ix.root
		if !dn.Root {
			parent = nodes[dn.Parent]
		}
		c := parent.child(dn.Local)
		if c == nil {
			c = ix.pool.get(parent, dn.Local, dn.Seq)
			ix.names.put(dn.Seq, c, &ix.tables) // free: checkDumpNames
			parent.addChild(c)
			ix.nodes++
			if ix.journal != nil {
				ix.journal.NodeCreated(dn.Seq, parent.seq, parent == &ix.root, dn.Local)
			}
		}
		nodes[dn.Seq] = c
	}
	for _, e := range d.Entries {
		n := nodes[e.Seq]
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if e.Mask.Has(t) {
				ix.setBit(rs, n, e.EngineHash, t)
			}
		}
		h := &n.holders[n.find(rs.slot)]
		h.order = e.Order
		if ix.journal != nil {
			// setBit journaled the entry with a fresh order; the state
			// database must hold the dump's, as the index now does.
			ix.journal.EntrySet(rs.rank, h.eh, n.seq, h.mask(), h.order)
		}
	}
	rs.order = d.Order
	ix.markDirty(rs)
	ix.loadOrphans(rs, d.Orphans)
	// Nodes of the dump that no entry ended up holding (possible only in a
	// hand-made dump) must not linger.
	for _, dn := range slices.Backward(d.Nodes) {
		ix.unlink(nodes[dn.Seq])
	}
	return nil
}

// checkDumpNames returns an error wrapping ErrBadDump if loading d (a
// valid dump) could create a node under a name a live node has: a dump
// node at a position the tree lacks, or whose node there has another name,
// must have a name no node has. It looks before the rank is cleared, so it
// may refuse a name that only the rank's own nodes hold; a consistent dump
// names each position as the tree does and never meets that.
func (ix *Index) checkDumpNames(d *RankDump) error {
	at := make(map[uint64]*node, len(d.Nodes)) // a dump node's live node at its position, nil when none
	for _, dn := range d.Nodes {
		var c *node
		if parent := &ix.root; dn.Root || at[dn.Parent] != nil {
			if !dn.Root {
				parent = at[dn.Parent]
			}
			c = parent.child(dn.Local)
		}
		if c == nil || c.seq != dn.Seq {
			if other, ok := ix.names.get(dn.Seq); ok {
				return fmt.Errorf("%w: node %#x (content hash %#x) is named as the node of content hash %#x at another position",
					ErrBadDump, dn.Seq, dn.Local, other.local)
			}
		}
		at[dn.Seq] = c
	}
	return nil
}

// validate checks the dump's internal consistency without touching the index.
func (d *RankDump) validate() error {
	known := make(map[uint64]bool, len(d.Nodes))
	// A position (parent, local) holds one node: LoadRank would take a
	// second node at one for the first, and an entry of one of them
	// would be lost.
	type position struct {
		parent, local uint64
		root          bool
	}
	at := make(map[position]uint64, len(d.Nodes))
	for _, dn := range d.Nodes {
		if !dn.Root && !known[dn.Parent] {
			return fmt.Errorf("%w: node %#x before its parent %#x", ErrBadDump, dn.Seq, dn.Parent)
		}
		if known[dn.Seq] {
			return fmt.Errorf("%w: node %#x listed twice", ErrBadDump, dn.Seq)
		}
		pos := position{local: dn.Local, root: dn.Root}
		if !dn.Root {
			pos.parent = dn.Parent
		}
		if other, ok := at[pos]; ok {
			return fmt.Errorf("%w: nodes %#x and %#x at one position (content hash %#x)", ErrBadDump, other, dn.Seq, dn.Local)
		}
		at[pos] = dn.Seq
		known[dn.Seq] = true
	}
	ehs := make(map[uint64]bool, len(d.Entries))
	onNode := make(map[uint64]bool, len(d.Entries))
	for _, e := range d.Entries {
		if !known[e.Seq] {
			return fmt.Errorf("%w: entry %#x on unknown node %#x", ErrBadDump, e.EngineHash, e.Seq)
		}
		if e.Mask == 0 || e.Mask >= 1<<kvevent.NumTiers {
			return fmt.Errorf("%w: entry %#x has mask %#x", ErrBadDump, e.EngineHash, e.Mask)
		}
		if ehs[e.EngineHash] {
			return fmt.Errorf("%w: engine hash %#x listed twice", ErrBadDump, e.EngineHash)
		}
		if onNode[e.Seq] {
			return fmt.Errorf("%w: two entries on node %#x", ErrBadDump, e.Seq)
		}
		ehs[e.EngineHash], onNode[e.Seq] = true, true
	}
	for _, o := range d.Orphans {
		if !o.Tier.Valid() || len(o.Blocks) == 0 {
			return fmt.Errorf("%w: bad orphan", ErrBadDump)
		}
	}
	return nil
}

// ReplaceRank replaces the rank's state with what the given Stored events
// build, atomically with respect to lookups and dumps: this is how a full
// dump sent by a node agent resynchronises a rank. Malformed events are
// skipped and counted; the number skipped is returned.
//
// The write lock is released every Config.ApplyChunk blocks, as
// ApplyBatch does, so that lookups do not wait for the whole replace: a
// rank of 1M blocks held every lookup of the node for 2.4 s, on every
// replica, at each resync. Meanwhile the rank is marked as being replaced
// and its half-done state is shown to no reader that routes or dumps:
// FindMatchesByTier leaves the rank out (as if it held nothing) and
// DumpRank waits for the replace to end. The readers of counts (Stats,
// RankStats, Digest, Holds and the other point reads) see the state as
// far as the replace has got, but for the rank's need of a resync
// (NeedsResync), cleared from the start: the dump is the resync. The
// state machine reads the digest it compares only between two of its
// batches. No other writer runs until the replace ends (wmu).
//
// The rank's capacity is enforced once, after the last event, as
// SetCapacity does. A dump comes level by level (StoredEvents: every first
// block, then every second, ...), and a trim during the replay, on the
// levels stored so far, dropped blocks whose children came later: held as
// orphans, they expired and asked for a resync, which sent the same dump.
func (ix *Index) ReplaceRank(r kvevent.Rank, evs []kvevent.Event, now int64) (malformed int) {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	rs := ix.rankFor(r, true)
	ix.replacing, ix.replaced = rs, make(chan struct{})
	// The dump is the resync: a reader between two chunks (a heartbeat's
	// answer lists the ranks that need one, eventplane) must not read
	// the flag the clear drops only once every old residency is gone, or
	// the agent is asked for the dump it is sending. The replay may set
	// it again (an orphan dropped), as it would in one piece.
	rs.needsResync = false
	budget := ix.clearRankChunked(rs)
	ix.deferTrim = true
	for i := range evs {
		ev := &evs[i]
		if ev.Rank != r || ev.Kind != kvevent.KindStored || !ev.Valid() {
			malformed++
			ix.counters.Malformed++
			continue
		}
		ix.store(rs, ev.Tier, ev.HasParent, ev.Parent, ev.Blocks, now, true)
		if budget += len(ev.Blocks) + 1; budget >= ix.cfg.ApplyChunk && i+1 < len(evs) {
			ix.yieldLocked()
			budget = 0
		}
	}
	ix.deferTrim = false
	ix.enforceCapacity(rs)
	close(ix.replaced)
	ix.replacing, ix.replaced = nil, nil
	ix.mu.Unlock()
	return malformed
}

// clearRankChunked is clearRank releasing the write lock every
// Config.ApplyChunk holders dropped (yieldLocked), for ReplaceRank, which
// has marked the rank as being replaced. It returns the budget spent since
// the last release. The old block map is walked while the lock is free:
// nothing else holds it (rs.blocks is a new one), and no writer runs
// meanwhile (wmu). The holders go in the order clearRank drops them, so
// the journal is told the same, and the digest comes out the same.
func (ix *Index) clearRankChunked(rs *rankState) (budget int) {
	old := rs.blocks
	rs.blocks = blockMap{}
	for _, n := range old.all() {
		if i := n.find(rs.slot); i >= 0 {
			ix.dropHolder(rs, n, i)
		}
		if budget++; budget >= ix.cfg.ApplyChunk {
			ix.yieldLocked()
			budget = 0
		}
	}
	ix.tables.release(&old)
	ix.clearRankRest(rs)
	return budget
}

// StoredEvents returns the rank's reachable state as single-block stored
// events, parents before children, one per tier the block is held in: what
// a peer replays to rebuild the rank's matches. A block whose parent the
// rank does not hold is left out (no lookup can reach it from the root),
// as are orphans. Event ids count from 1.
func (d *RankDump) StoredEvents() []kvevent.Event {
	bySeq := make(map[uint64]int, len(d.Entries))
	for i, e := range d.Entries {
		bySeq[e.Seq] = i
	}
	kept := make(map[uint64]bool, len(d.Entries)) // node seq → emitted
	blocks := make([]kvevent.Block, 0, len(d.Entries))
	out := make([]kvevent.Event, 0, len(d.Entries))
	for _, n := range d.Nodes { // parents before children
		i, held := bySeq[n.Seq]
		if !held {
			continue
		}
		var parent uint64
		if !n.Root {
			if !kept[n.Parent] {
				continue
			}
			parent = d.Entries[bySeq[n.Parent]].EngineHash
		}
		kept[n.Seq] = true
		e := d.Entries[i]
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if !e.Mask.Has(t) {
				continue
			}
			blocks = append(blocks, kvevent.Block{EngineHash: e.EngineHash, LocalHash: n.Local})
			out = append(out, kvevent.Event{Rank: d.Rank, EventID: uint64(len(out) + 1), Kind: kvevent.KindStored, Tier: t,
				HasParent: !n.Root, Parent: parent, Blocks: blocks[len(blocks)-1 : len(blocks) : len(blocks)]})
		}
	}
	return out
}
