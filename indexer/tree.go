package indexer

import "github.com/kvrouter/kvrouter/kvevent"

// node is one block position of one distinct prefix.
//
// Most nodes in a prefix tree have exactly one child, so the first child is
// held inline (its key is its own local hash) and a map is allocated only
// for the second: this keeps a chain of N blocks at N small allocations
// instead of N maps, and a node at 64 bytes.
type node struct {
	parent *node
	local  uint64 // content hash: the key under which parent holds this node
	seq    uint64 // sequence hash of the path from the root (node identity)

	c1   *node // inline child, nil when none
	more map[uint64]*node

	holders []holder
}

// nodeWithHolder allocates a node together with room for its first holder:
// most nodes are held by one rank, and one allocation instead of two keeps
// the holder on the node's cache line.
type nodeWithHolder struct {
	n node
	h [1]holder
}

func newNode(parent *node, local, seq uint64) *node {
	nh := &nodeWithHolder{n: node{parent: parent, local: local, seq: seq}}
	nh.n.holders = nh.h[:0:1]
	return &nh.n
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
