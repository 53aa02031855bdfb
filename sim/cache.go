package sim

import (
	"container/heap"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Cache is one simulated worker's KV cache: a prefix tree of blocks keyed
// by sequence hash, with a capacity in blocks and leaf-first LRU eviction.
// Blocks used by an in-flight request are pinned (refs > 0). Every block
// it stores and every block it evicts is reported through Emit as a router
// event, as an engine would publish it; the engine hash of a block is its
// sequence hash.
//
// Leaf-first: a block is evictable only when it has no cached children, so
// a shared parent outlives its children. Recency comes from a tick counter:
// pinning blocks stamps them, and releasing a request stamps its whole
// path, so an unpinned parent is never older than its children and the
// LRU order over leaves is the order to evict.
//
// Besides the tree, Reserve holds blocks that count against the capacity
// but are never matched or published (an engine's partial and generated
// blocks).
type Cache struct {
	capacity int
	blocks   map[uint64]*cblock
	leaves   leafHeap
	tick     uint64
	active   int // blocks with refs > 0
	reserved int // blocks held outside the tree (Reserve)

	// Emit receives each event; its slices are only valid during the call.
	Emit func(ev *kvevent.Event)
	rank kvevent.Rank

	// Counters.
	Evicted     uint64
	Uncacheable uint64 // blocks not cached because every block was pinned

	stored  []kvevent.Block
	removed []uint64
}

type cblock struct {
	parent    uint64
	hasParent bool
	children  int32
	refs      int32
	last      uint64
}

// NewCache returns an empty cache of capacity blocks for the given rank.
func NewCache(rank kvevent.Rank, capacity int, emit func(*kvevent.Event)) *Cache {
	return &Cache{capacity: capacity, blocks: make(map[uint64]*cblock), Emit: emit, rank: rank}
}

// Len returns the number of cached blocks.
func (c *Cache) Len() int { return len(c.blocks) }

// Capacity returns the capacity in blocks.
func (c *Cache) Capacity() int { return c.capacity }

// Match returns how many leading blocks of seq are cached.
func (c *Cache) Match(seq []uint64) int {
	for i, h := range seq {
		if _, ok := c.blocks[h]; !ok {
			return i
		}
	}
	return len(seq)
}

// Active returns the number of pinned blocks (used by an in-flight
// request); the others are inactive, kept for reuse and evictable.
func (c *Cache) Active() int { return c.active }

// Reserved returns the blocks held outside the prefix tree (Reserve).
func (c *Cache) Reserved() int { return c.reserved }

// Free returns how many more blocks can be pinned or reserved: the
// capacity less the pinned and reserved blocks (inactive blocks count as
// free, as they can be evicted).
func (c *Cache) Free() int { return c.capacity - c.active - c.reserved }

// Acquire pins the request's blocks, caching those that are missing
// (evicting others as needed), and returns how many leading blocks it
// pinned: Release must be given the same prefix. Blocks that cannot be
// cached because everything else is pinned are counted and not pinned.
func (c *Cache) Acquire(local, seq []uint64) int {
	return c.Extend(local, seq, 0, len(seq))
}

// Extend pins blocks from..to-1 of a request whose first from blocks the
// caller already pinned (Acquire is Extend from 0), caching the missing
// ones as Acquire does, and returns how many leading blocks of seq the
// request now has pinned (to, unless blocks were uncacheable).
func (c *Cache) Extend(local, seq []uint64, from, to int) int {
	c.tick++
	c.stored = c.stored[:0]
	c.removed = c.removed[:0]
	firstNew := -1
	n := from
	for i := from; i < to; i++ {
		h := seq[i]
		b, ok := c.blocks[h]
		if !ok {
			if len(c.blocks)+c.reserved >= c.capacity && !c.evictOne() {
				c.Uncacheable += uint64(to - i)
				break
			}
			b = &cblock{}
			if i > 0 {
				b.parent, b.hasParent = seq[i-1], true
				c.blocks[seq[i-1]].children++
			}
			c.blocks[h] = b
			if firstNew < 0 {
				firstNew = i
			}
			c.stored = append(c.stored, kvevent.Block{EngineHash: h, LocalHash: local[i]})
		} else if firstNew >= 0 {
			// A cached block after a new one cannot happen in a prefix tree
			// keyed by sequence hash: its parent was just created.
			c.flushStored(seq, firstNew)
			firstNew = -1
		}
		if b.refs == 0 {
			c.active++
		}
		b.refs++
		b.last = c.tick
		n++
	}
	c.flushRemoved()
	if firstNew >= 0 {
		c.flushStored(seq, firstNew)
	}
	return n
}

// Unpinned returns how many of blocks from..to-1 of seq are not pinned
// (absent or inactive): what pinning them takes from Free.
func (c *Cache) Unpinned(seq []uint64, from, to int) int {
	n := 0
	for _, h := range seq[from:to] {
		if b, ok := c.blocks[h]; !ok || b.refs == 0 {
			n++
		}
	}
	return n
}

// Reserve holds n blocks outside the prefix tree (a request's partial and
// generated blocks, which no other request can match), evicting inactive
// blocks to make room. It reports false, holding nothing more, when the
// pinned and reserved blocks leave no room.
func (c *Cache) Reserve(n int) bool {
	if n > c.Free() {
		return false
	}
	c.removed = c.removed[:0]
	for len(c.blocks)+c.reserved+n > c.capacity && c.evictOne() {
	}
	c.reserved += n
	c.flushRemoved()
	return true
}

// Unreserve gives back n reserved blocks.
func (c *Cache) Unreserve(n int) { c.reserved -= n }

func (c *Cache) flushStored(seq []uint64, first int) {
	if len(c.stored) == 0 || c.Emit == nil {
		c.stored = c.stored[:0]
		return
	}
	ev := kvevent.Event{Rank: c.rank, Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Blocks: c.stored}
	if first > 0 {
		ev.HasParent, ev.Parent = true, seq[first-1]
	}
	c.Emit(&ev)
	c.stored = c.stored[:0]
}

func (c *Cache) flushRemoved() {
	if len(c.removed) == 0 || c.Emit == nil {
		c.removed = c.removed[:0]
		return
	}
	c.Emit(&kvevent.Event{Rank: c.rank, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: c.removed})
	c.removed = c.removed[:0]
}

// Release unpins the first n blocks of seq (as returned by Acquire).
// The blocks count as used now: recency is the time of last use, so a
// long request's prefix is not the first to go when it ends.
func (c *Cache) Release(seq []uint64, n int) {
	c.tick++
	for i := n - 1; i >= 0; i-- {
		b := c.blocks[seq[i]]
		b.refs--
		b.last = c.tick
		if b.refs == 0 {
			c.active--
			if b.children == 0 {
				heap.Push(&c.leaves, leaf{last: b.last, key: seq[i]})
			}
		}
	}
}

// evictOne evicts the least recently used unpinned leaf.
func (c *Cache) evictOne() bool {
	for c.leaves.Len() > 0 {
		l := heap.Pop(&c.leaves).(leaf)
		b, ok := c.blocks[l.key]
		if !ok || b.last != l.last || b.refs > 0 || b.children > 0 {
			continue // stale entry
		}
		delete(c.blocks, l.key)
		c.Evicted++
		c.removed = append(c.removed, l.key)
		if b.hasParent {
			p := c.blocks[b.parent]
			p.children--
			if p.children == 0 && p.refs == 0 {
				heap.Push(&c.leaves, leaf{last: p.last, key: b.parent})
			}
		}
		return true
	}
	return false
}

type leaf struct {
	last uint64
	key  uint64
}

type leafHeap []leaf

func (h leafHeap) Len() int { return len(h) }
func (h leafHeap) Less(i, j int) bool {
	if h[i].last != h[j].last {
		return h[i].last < h[j].last
	}
	return h[i].key < h[j].key
}
func (h leafHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)   { *h = append(*h, x.(leaf)) }
func (h *leafHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
