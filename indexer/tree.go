package indexer

import (
	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
)

// node is one block position of one distinct prefix.
//
// Most nodes in a prefix tree have exactly one child, so the first child is
// held inline (its key is its own local hash) and a map is allocated only
// for the second: this keeps a chain of N blocks at N small allocations
// instead of N maps. Most nodes are held by one rank, so a node has room
// for its first holder (h0, where holders starts) on its own cache line.
// Nodes come from a nodePool.
type node struct {
	parent *node
	local  uint64 // content hash: the key under which parent holds this node
	seq    uint64 // sequence hash of the path from the root (node identity)

	c1   *node // inline child, nil when none; in a pool's free list, the next free node
	more map[uint64]*node

	holders []holder
	h0      [1]holder
}

// nodePool hands out nodes from slabs (growing, see nodeSlab) and takes back the
// nodes the tree frees, for reuse.
//
// Why slabs: the collector marks a small object through per-object work,
// however few pointers it holds, and an index of a million blocks is a
// million nodes: each collection of the route benchmark's index took
// about 150 ms of marking on two cores. A slab is one large object, which
// the collector scans in order, and a pointer into it costs one mark bit
// shared by the slab's nodes. A million-node tree built either way: a
// forced collection 170 ms with a node per object, 48 ms with slabs.
//
// A slab lives while any of its nodes is in use, so freed nodes are kept
// for reuse, never given back: the tree's node memory stays at its
// high-water mark (an index is bounded by its ranks' capacities), and a
// replaced tree (a load or a restore) drops its pool whole. A pool
// belongs to one tree and is used under its lock; a parallel build uses a
// pool per part.
type nodePool struct {
	slab []node // handed out from the front
	free *node  // freed nodes, linked through c1
	next int    // nodes in the next slab; 0 before the first
	most int    // the bound on slab sizes where above maxNodeSlab (a Loader's pools: loadSlab); 0: maxNodeSlab
	// spare holds partly used slabs handed on from other pools (a
	// parallel build's parts, Loader.adoptTree), taken before a new one.
	spare [][]node
	huge  *hugepage.Scratch // large slabs are advised and recorded here (the index's or the Loader's)
	_     [64]byte          // keeps the pools of a parallel build off each other's cache lines
}

// Slabs double from nodeSlab nodes (320 KiB) up to maxNodeSlab (10 MiB):
// a small tree stays small, and a large one takes fewer, larger slabs (a
// Loader's pools, which know how many nodes they build, up to 40 MiB:
// loadSlab). A pool holds at most one partly used slab, besides the spare
// ones a parallel build's other pools hand on to it.
//
// Large slabs (from 64Ki nodes on) are advised for huge pages
// (internal/hugepage): a first touch of fresh memory then costs a fault
// per 2 MiB instead of per 4 KiB, and on the virtual machines we run on
// faults are dear. A rebuild writes millions of nodes into fresh memory
// at once (a 5M-block restore: 1.37 s of CPU in get, 0.6 s advised); a
// growing tree takes a slab at a time. With the write groups' buffers
// (store.StateBatch) advised too, the replicated ingest benchmark's page
// faults fell from 470k to 288k and its rate rose from 310–365k to
// 342–435k block events/s (six alternating pairs). The FSM alone, growing
// a tree in memory a closed cluster had already faulted in, was slower
// (2.23–2.66M → 1.91–2.49M): the advice is for fresh memory.
// The slabs are recorded in the pool's Scratch: a Loader's, released when
// it ends (the huge pages already made stay), or the index's, released
// when its tree is replaced, so that a slab freed is not refilled by the
// kernel once the runtime returns it.
const nodeSlab, maxNodeSlab = 4096, 1 << 17

// get returns a node with the given position and no children or holders.
func (p *nodePool) get(parent *node, local, seq uint64) *node {
	n := p.free
	if n != nil {
		p.free = n.c1
	} else {
		if len(p.slab) == cap(p.slab) && len(p.spare) > 0 {
			k := len(p.spare) - 1
			p.slab, p.spare[k] = p.spare[k], nil
			p.spare = p.spare[:k]
		}
		if len(p.slab) == cap(p.slab) {
			size := max(p.next, nodeSlab)
			p.slab = hugepage.MakeCapIn[node](p.huge, size)
			p.next = min(2*size, max(p.most, maxNodeSlab))
		}
		p.slab = p.slab[:len(p.slab)+1]
		n = &p.slab[len(p.slab)-1]
	}
	*n = node{parent: parent, local: local, seq: seq}
	n.holders = n.h0[:0:1]
	return n
}

// put takes back n, which the tree no longer reaches (no parent, children
// or holders).
func (p *nodePool) put(n *node) {
	*n = node{c1: p.free} // drops the grown holders and child map
	p.free = n
}

// holder is one rank's residency on a node. sm packs the rank's slot
// (upper 28 bits) and the tier mask (lower 4 bits) so that a holder stays
// at 16 bytes; order is the rank's store counter when the entry was made,
// used to evict the oldest entries first.
type holder struct {
	eh    uint64 // the engine hash the rank knows this block by
	sm    uint32
	order uint32
}

const maskBits = 4

func mkSM(slot uint32, m kvevent.Mask) uint32 { return slot<<maskBits | uint32(m) }
func (h holder) slot() uint32                 { return h.sm >> maskBits }
func (h holder) mask() kvevent.Mask           { return kvevent.Mask(h.sm & (1<<maskBits - 1)) }

func (n *node) child(h uint64) *node {
	if c := n.c1; c != nil && c.local == h {
		return c
	}
	if n.more != nil {
		return n.more[h]
	}
	return nil
}

func (n *node) addChild(c *node) {
	if n.c1 == nil {
		n.c1 = c
		return
	}
	if n.more == nil {
		n.more = make(map[uint64]*node, 2)
	}
	n.more[c.local] = c
}

func (n *node) removeChild(h uint64) {
	if n.c1 != nil && n.c1.local == h {
		n.c1 = nil
		// Promote one mapped child into the inline slot. Which one is
		// irrelevant to the logical state; it only keeps lookups fast.
		for k, c := range n.more {
			n.c1 = c
			delete(n.more, k)
			break
		}
	} else if n.more != nil {
		delete(n.more, h)
	}
	if n.more != nil && len(n.more) == 0 {
		n.more = nil
	}
}

func (n *node) hasChildren() bool { return n.c1 != nil || len(n.more) > 0 }

// forEachChild calls f for every child, in no particular order.
func (n *node) forEachChild(f func(*node)) {
	if n.c1 != nil {
		f(n.c1)
	}
	for _, c := range n.more {
		f(c)
	}
}

// Holders are kept sorted by slot: a shared node near the root is held by
// every rank, and a binary search there beats a scan of hundreds of holders
// on every store and remove. Short lists are scanned.

// find returns the index of slot's holder on n, or -1.
func (n *node) find(slot uint32) int {
	hs := n.holders
	if len(hs) <= 16 {
		for i := range hs {
			if hs[i].sm>>maskBits == slot {
				return i
			}
		}
		return -1
	}
	lo, hi := 0, len(hs)
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if hs[m].sm>>maskBits < slot {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(hs) && hs[lo].sm>>maskBits == slot {
		return lo
	}
	return -1
}

// addHolder inserts h at its place in slot order.
func (n *node) addHolder(h holder) {
	slot := h.sm >> maskBits
	i := len(n.holders)
	for i > 0 && n.holders[i-1].sm>>maskBits > slot {
		i--
	}
	n.holders = append(n.holders, holder{})
	copy(n.holders[i+1:], n.holders[i:])
	n.holders[i] = h
}

// removeHolder drops holder i, keeping the slot order.
func (n *node) removeHolder(i int) {
	last := len(n.holders) - 1
	copy(n.holders[i:], n.holders[i+1:])
	n.holders[last] = holder{}
	n.holders = n.holders[:last]
	if len(n.holders) == 0 {
		n.holders = n.holders[:0] // keeps the inline room when it is the one
	} else if cap(n.holders) > 8 && len(n.holders) < cap(n.holders)/4 {
		n.holders = append([]holder(nil), n.holders...)
	}
}
