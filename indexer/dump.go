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

// DumpRank returns the rank's state, in a deterministic order.
func (ix *Index) DumpRank(r kvevent.Rank) (RankDump, error) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	rs := ix.rankFor(r, false)
	if rs == nil {
		return RankDump{}, fmt.Errorf("dump %s: %w", r, ErrUnknownRank)
	}
	d := RankDump{Rank: r, Capacity: rs.cap, Order: rs.order}
	seen := make(map[*node]bool, rs.blocks.len())
	var path []*node
	for eh, n := range rs.blocks.all() {
		h := n.holders[n.find(rs.slot)]
		d.Entries = append(d.Entries, DumpEntry{Seq: n.seq, EngineHash: eh, Mask: h.mask(), Order: h.order})
		path = path[:0]
		for p := n; p != &ix.root && !seen[p]; p = p.parent {
			seen[p] = true
			path = append(path, p)
		}
		for _, p := range path {
			dn := DumpNode{Seq: p.seq, Local: p.local, Root: p.parent == &ix.root}
			if !dn.Root {
				dn.Parent = p.parent.seq
			}
			d.Nodes = append(d.Nodes, dn)
		}
	}
	// Parents before children: sort nodes by depth, then by Seq. Depth is
	// recovered from the parent links within the dump.
	depth := make(map[uint64]int, len(d.Nodes))
	var depthOf func(seq uint64) int
	bySeq := make(map[uint64]DumpNode, len(d.Nodes))
	for _, dn := range d.Nodes {
		bySeq[dn.Seq] = dn
	}
	depthOf = func(seq uint64) int {
		if v, ok := depth[seq]; ok {
			return v
		}
		dn := bySeq[seq]
		v := 0
		if !dn.Root {
			v = depthOf(dn.Parent) + 1
		}
		depth[seq] = v
		return v
	}
	slices.SortFunc(d.Nodes, func(a, b DumpNode) int {
		da, db := depthOf(a.Seq), depthOf(b.Seq)
		if da != db {
			return da - db
		}
		return cmp.Compare(a.Seq, b.Seq)
	})
	slices.SortFunc(d.Entries, func(a, b DumpEntry) int { return cmp.Compare(a.EngineHash, b.EngineHash) })
	for _, o := range rs.orphans {
		d.Orphans = append(d.Orphans, DumpOrphan{At: o.at, Tier: o.tier, Parent: o.parent,
			Blocks: append([]kvevent.Block(nil), o.blocks...)})
	}
	return d, nil
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
			ix.names.put(dn.Seq, c) // free: checkDumpNames
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
	for _, o := range d.Orphans {
		or := orphan{at: o.At, tier: o.Tier, parent: o.Parent, blocks: append([]kvevent.Block(nil), o.Blocks...)}
		rs.orphans = append(rs.orphans, or)
		rs.orphanBlocks += len(or.blocks)
		ix.orphanDigest(rs, &or, +1)
	}
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
// build, atomically with respect to lookups: this is how a full dump sent
// by a node agent resynchronises a rank. Malformed events are skipped and
// counted; the number skipped is returned.
func (ix *Index) ReplaceRank(r kvevent.Rank, evs []kvevent.Event, now int64) (malformed int) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	rs := ix.rankFor(r, true)
	ix.clearRank(rs)
	for i := range evs {
		ev := &evs[i]
		if ev.Rank != r || ev.Kind != kvevent.KindStored || ev.Validate() != nil {
			malformed++
			ix.counters.Malformed++
			continue
		}
		ix.store(rs, ev.Tier, ev.HasParent, ev.Parent, ev.Blocks, now, true)
	}
	return malformed
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
