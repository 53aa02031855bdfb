package pool

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/kvevent"
)

// The core is the bookkeeping both pools share: the blocks held, their
// reference counts, and which one to evict next. Storage (a slot of host
// memory, or two Pebble keys) is attached through the storage hooks.
//
// A block is in one of three states:
//
//	pending     reserved by a writer, bytes not yet written; not readable,
//	            not evictable, counts against the capacity
//	referenced  written, and acquired by at least one reader
//	inactive    written, no reference: found by hash, and evictable when no
//	            child of it is in the pool
//
// Eviction order. The evictable blocks are kept in a min-heap on their
// last-use stamp (a counter bumped by registration, Acquire and revival,
// by a re-registration or by DiskPool.Revive).
// A block enters the heap when it becomes evictable and leaves it when it
// stops being so. "Leaves before parents" then needs no tree walk: kids
// counts, per hash, the blocks in the pool (any state) whose Parent is that
// hash, and a block with kids is simply not evictable. When the last child
// goes, the parent enters the heap at its own, older stamp, so it is next in
// line if it is the least recently used, exactly as a plain LRU over the
// unreferenced leaves would pick it. kids is kept for hashes not in the pool
// too, so a parent registered after its child starts out with the count.
//
// Reserving a block adds it to its parent's kids before looking for room, so
// that storing a child never evicts its own parent.
//
// A written block found damaged (its bytes fail to read) is marked so: it is
// no longer found by hash (not stored for Lookup, Acquire, Dump...), and it
// is dropped, with a REMOVE as an eviction publishes, as soon as no reader
// holds it, at once or by the last release. It is dropped whether or not it
// has children: its bytes are gone either way.
type core struct {
	mu    sync.Mutex
	cfg   Config
	tier  kvevent.Tier
	store storage

	entries map[uint64]*entry
	kids    map[uint64]int32
	lru     evictHeap
	clock   uint64
	closed  bool

	pending, inactive, referenced int
	hits, misses                  uint64
	registered, revived           uint64
	evictions, publishErrors      uint64
	damaged                       uint64
	lastEventID                   uint64
}

// storage places and drops a block's bytes. Both hooks run with the core's
// lock held.
type storage interface {
	// place gives a newly reserved entry its storage (a slot).
	place(e *entry)
	// drop releases an entry's storage: evicted says it was stored,
	// otherwise a reservation is being abandoned. On an error an eviction
	// is abandoned and the entry stays; an abandoned reservation goes anyway.
	drop(e *entry, evicted bool) error
}

type entry struct {
	Block
	slot  int32 // HostPool's slot
	refs  int32 // readers holding it
	ready bool  // bytes written
	bad   bool  // bytes found damaged: dropped at the last release
	// readFails counts a DiskPool's reads of the block that failed in a
	// row with an I/O error (see unreadable); a successful read resets it.
	// Atomic, for ReadHeld reads without the core's lock; it fits in the
	// padding after bad, so an entry is no larger for it.
	readFails atomic.Uint32
	stamp     uint64 // last use
	hidx      int    // index in the eviction heap, -1 when not in it
}

// entriesHint caps the size hint of the entry map. Presized for the full
// capacity, an empty disk pool of 2^24 blocks held 577 MiB of heap, and one
// of --disk-blocks' maximum (2^31-1) could not start; the map grows as
// blocks come, and 2^16 entries (a few MiB) spare the first rehashes.
const entriesHint = 1 << 16

func newCore(cfg Config, tier kvevent.Tier, st storage) *core {
	return &core{
		cfg:     cfg,
		tier:    tier,
		store:   st,
		entries: make(map[uint64]*entry, min(cfg.Capacity, entriesHint)),
		kids:    make(map[uint64]int32),
	}
}

func (c *core) tick() uint64 { c.clock++; return c.clock }

func (c *core) evictable(e *entry) bool {
	return e.ready && !e.bad && e.refs == 0 && c.kids[e.Hash] == 0
}

// stored reports whether e is a written block that readers may find.
func stored(e *entry) bool { return e != nil && e.ready && !e.bad }

// settle puts e into the eviction heap or takes it out, as its state says.
func (c *core) settle(e *entry) {
	switch want, in := c.evictable(e), e.hidx >= 0; {
	case want && !in:
		heap.Push(&c.lru, e)
	case !want && in:
		heap.Remove(&c.lru, e.hidx)
	}
}

func (c *core) touch(e *entry) {
	e.stamp = c.tick()
	if e.hidx >= 0 {
		heap.Fix(&c.lru, e.hidx)
	}
}

func (c *core) addKid(parent uint64) {
	c.kids[parent]++
	if p := c.entries[parent]; p != nil {
		c.settle(p)
	}
}

func (c *core) dropKid(parent uint64) {
	if n := c.kids[parent] - 1; n > 0 {
		c.kids[parent] = n
	} else {
		delete(c.kids, parent)
	}
	if p := c.entries[parent]; p != nil {
		c.settle(p)
	}
}

// descends reports whether the block anc is an ancestor of (or is) the
// block h, following parents through the pool. It is only called when
// something in the pool names anc as its parent, so the common register
// pays nothing for it.
func (c *core) descends(h, anc uint64) bool {
	for n := 0; h != 0 && n <= len(c.entries); n++ {
		if h == anc {
			return true
		}
		e := c.entries[h]
		if e == nil {
			return false
		}
		h = e.Parent
	}
	return false
}

// loops fails with ErrInvalid when storing every block of bs would make
// one its own ancestor. A batch checks this before it reserves anything,
// under the same hold of the lock (see reserveAll), so that a bad batch
// changes nothing: reserve catches a loop only at the block that closes it,
// after the blocks before it were reserved. A block
// held or being written keeps its parent (the batch skips it), and of a
// hash named twice the first is the one reserved. A walk that leaves the
// batch's new blocks comes back to them only through a block in the pool
// naming one of them as its parent, so without one the pool is not walked;
// each block is walked once.
func (c *core) loops(bs []Block) error {
	if len(bs) < 2 {
		return nil // reserve refuses one block's loop before it changes anything
	}
	up := make(map[uint64]uint64, len(bs)) // the new blocks' parents
	back := false
	for _, b := range bs {
		if _, ok := up[b.Hash]; ok || c.entries[b.Hash] != nil {
			continue
		}
		up[b.Hash] = b.Parent
		back = back || c.kids[b.Hash] > 0
	}
	parent := func(h uint64) uint64 {
		if p, ok := up[h]; ok {
			return p
		}
		if e := c.entries[h]; back && e != nil {
			return e.Parent
		}
		return 0
	}
	const onPath, done = 1, 2
	seen := make(map[uint64]uint8, len(up))
	for h := range up {
		x := h
		for x != 0 && seen[x] == 0 {
			seen[x] = onPath
			x = parent(x)
		}
		if x != 0 && seen[x] == onPath {
			return fmt.Errorf("%w: block %#x would be its own ancestor", ErrInvalid, x)
		}
		for y := h; y != x; y = parent(y) {
			seen[y] = done
		}
	}
	return nil
}

// reserveAll reserves a batch's blocks (each passed Block.check) in order,
// skipping (and reviving) those held or being written: held counts them,
// skipped is the last one's error. It stops at the first block that does not fit, keeping those
// before it: stop says why. A batch that would make one of its blocks its
// own ancestor reserves nothing and fails with ErrInvalid as stop. The
// check and the reservations are one hold of the lock: checked alone, two
// batches that close a loop between them ([x, a(parent b)] and [y, b(parent
// a)]) would both pass, and the second would be caught only by reserve at
// a, after x was reserved, then written and published.
func (c *core) reserveAll(bs []Block) (es []*entry, idx []int, held int, skipped, stop error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.loops(bs); err != nil {
		return nil, nil, 0, nil, err
	}
	es = make([]*entry, 0, len(bs))
	idx = make([]int, 0, len(bs))
	for i, b := range bs {
		e, err := c.reserveLocked(b)
		if errors.Is(err, ErrExists) {
			held++
			skipped = err
			continue
		}
		if err != nil {
			return es, idx, held, skipped, err
		}
		es = append(es, e)
		idx = append(idx, i)
	}
	return es, idx, held, skipped, nil
}

// reserve makes room for b and adds it as pending. If b is already held it
// is revived (touched) and reserve fails with ErrExists; if it is being
// written, with ErrExists and ErrBusy.
func (c *core) reserve(b Block) (*entry, error) {
	if err := b.check(); err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reserveLocked(b)
}

// reserveLocked is reserve, called with c.mu held.
func (c *core) reserveLocked(b Block) (*entry, error) {
	if c.closed {
		return nil, ErrClosed
	}
	if e := c.entries[b.Hash]; e != nil {
		if !e.ready {
			return nil, fmt.Errorf("register %#x: %w (%w)", b.Hash, ErrExists, ErrBusy)
		}
		if e.bad { // readers still hold the damaged copy; stored again once they let go
			return nil, fmt.Errorf("register %#x: %w (%w): a damaged copy is being dropped", b.Hash, ErrExists, ErrBusy)
		}
		c.touch(e)
		c.revived++
		return nil, fmt.Errorf("register %#x: %w", b.Hash, ErrExists)
	}
	if b.Parent != 0 && c.kids[b.Hash] > 0 && c.descends(b.Parent, b.Hash) {
		return nil, fmt.Errorf("%w: block %#x would be its own ancestor", ErrInvalid, b.Hash)
	}
	if b.Parent != 0 {
		c.addKid(b.Parent)
	}
	if len(c.entries) >= c.cfg.Capacity {
		if err := c.evictOne(true); err != nil {
			if b.Parent != 0 {
				c.dropKid(b.Parent)
			}
			return nil, fmt.Errorf("register %#x: %w", b.Hash, err)
		}
	}
	e := &entry{Block: b, hidx: -1, stamp: c.tick()}
	c.store.place(e)
	c.entries[b.Hash] = e
	c.pending++
	return e, nil
}

// evictOne evicts the least recently used evictable block.
func (c *core) evictOne(publish bool) error {
	if len(c.lru) == 0 {
		return fmt.Errorf("%w (%d blocks: %d being written, %d referenced, %d inactive parents)",
			ErrFull, len(c.entries), c.pending, c.referenced, c.inactive)
	}
	e := c.lru[0]
	if err := c.store.drop(e, true); err != nil {
		return fmt.Errorf("evict %#x: %w", e.Hash, err)
	}
	c.unlink(e)
	c.inactive--
	c.evictions++
	if publish {
		c.publish([]kvevent.Event{{Rank: c.cfg.Rank, Tier: c.tier, Kind: kvevent.KindRemoved, Removed: []uint64{e.Hash}}})
	}
	return nil
}

func (c *core) unlink(e *entry) {
	if e.hidx >= 0 {
		heap.Remove(&c.lru, e.hidx)
	}
	delete(c.entries, e.Hash)
	if e.Parent != 0 {
		c.dropKid(e.Parent)
	}
}

// commit marks reserved entries as written and publishes their STORE
// events, consecutive blocks of one chain in one event. Entries that are not
// pending reservations of this pool any more are skipped.
func (c *core) commit(es []*entry) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	var evs []kvevent.Event
	for _, e := range es {
		if e == nil || e.ready || c.entries[e.Hash] != e {
			continue
		}
		e.ready = true
		c.pending--
		c.inactive++
		c.registered++
		c.settle(e)
		evs = c.appendStored(evs, e.Block, 0)
	}
	if len(evs) > 0 {
		c.publish(evs)
	}
	return nil
}

// appendStored adds b to evs: to the last event when b continues its chain
// (and the chain is shorter than limit, when limit > 0), else as a new one.
func (c *core) appendStored(evs []kvevent.Event, b Block, limit int) []kvevent.Event {
	kb := kvevent.Block{EngineHash: b.Hash, LocalHash: b.Local}
	if n := len(evs); n > 0 && b.Parent != 0 {
		last := &evs[n-1]
		if last.Blocks[len(last.Blocks)-1].EngineHash == b.Parent && (limit <= 0 || len(last.Blocks) < limit) {
			last.Blocks = append(last.Blocks, kb)
			return evs
		}
	}
	return append(evs, kvevent.Event{
		Rank:      c.cfg.Rank,
		Tier:      c.tier,
		Kind:      kvevent.KindStored,
		HasParent: b.Parent != 0,
		Parent:    b.Parent,
		Blocks:    []kvevent.Block{kb},
	})
}

// abort abandons reservations that were not committed.
func (c *core) abort(es []*entry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range es {
		if e == nil || e.ready || c.entries[e.Hash] != e {
			continue
		}
		if err := c.store.drop(e, false); err != nil {
			c.cfg.Logger.Warn("offload pool: dropping an abandoned block", "tier", c.tier, "hash", e.Hash, "err", err)
		}
		c.unlink(e)
		c.pending--
	}
}

// acquire takes a reference on a written block, which keeps it from being
// evicted until release, and counts it as a hit and a use.
func (c *core) acquire(h uint64) (*entry, error) { return c.ref(h, true) }

// ref takes a reference on a written block; with use, it counts as a hit
// and a use (else see used).
func (c *core) ref(h uint64, use bool) (*entry, error) {
	if h == 0 {
		return nil, fmt.Errorf("%w: zero block hash", ErrInvalid)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	e := c.entries[h]
	if !stored(e) {
		c.misses++
		return nil, fmt.Errorf("acquire %#x: %w", h, ErrNotFound)
	}
	if e.refs == 0 {
		c.inactive--
		c.referenced++
	}
	e.refs++
	if use {
		c.hits++
		e.stamp = c.tick()
	}
	c.settle(e)
	return e, nil
}

// used counts a read of e under a reference from ref(h, false) as a hit
// and a use, once the read has succeeded.
func (c *core) used(e *entry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.entries[e.Hash] != e || e.bad {
		return
	}
	c.hits++
	e.stamp = c.tick() // referenced, so not in the heap: no Fix
}

// damage marks e, a written block whose bytes failed to read, as damaged:
// from now on it is not found by hash, and it is dropped (keys deleted,
// REMOVE published) once no reader holds it. The caller holds a reference
// on e, so e is still the pool's entry for its hash, unless the pool has
// been closed.
func (c *core) damage(e *entry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || c.entries[e.Hash] != e || !e.ready || e.bad {
		return
	}
	e.bad = true
	c.damaged++
	c.cfg.Logger.Warn("offload pool: a block's bytes are damaged; dropping it", "tier", c.tier,
		"rank", c.cfg.Rank, "hash", e.Hash, "readers", e.refs)
	if e.hidx >= 0 { // not evictable any more: dropped by its last release
		heap.Remove(&c.lru, e.hidx)
	}
	if e.refs == 0 {
		c.dropDamaged(e)
	}
}

// dropDamaged drops a damaged block no reader holds: its storage, its
// entry, and its advertisement (a REMOVE, published as evictOne does). A
// failure to delete its storage is logged and the entry goes anyway: a
// damaged block must not be found again, and what is left on disk is read
// (and found damaged) again only if a reopen restores it.
func (c *core) dropDamaged(e *entry) {
	if err := c.store.drop(e, true); err != nil {
		c.cfg.Logger.Warn("offload pool: deleting a damaged block failed; it is dropped from the pool all the same",
			"tier", c.tier, "rank", c.cfg.Rank, "hash", e.Hash, "err", err)
	}
	c.unlink(e)
	c.inactive--
	c.publish([]kvevent.Event{{Rank: c.cfg.Rank, Tier: c.tier, Kind: kvevent.KindRemoved, Removed: []uint64{e.Hash}}})
}

// held checks that h is a written block with a reference on it, for a
// read on behalf of the reader that acquired it: not a new use, not a hit.
// A held block found damaged fails with ErrCorrupt.
func (c *core) held(h uint64) (*entry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	e := c.entries[h]
	if e == nil || !e.ready {
		return nil, fmt.Errorf("read %#x: %w", h, ErrNotFound)
	}
	if e.refs == 0 {
		return nil, fmt.Errorf("read %#x: %w: acquire it first", h, ErrNotHeld)
	}
	if e.bad {
		return nil, fmt.Errorf("read %#x: %w: its bytes were found damaged; dropped once released", h, ErrCorrupt)
	}
	return e, nil
}

func (c *core) release(h uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	e := c.entries[h]
	if e == nil || !e.ready {
		return fmt.Errorf("release %#x: %w", h, ErrNotFound)
	}
	if e.refs == 0 {
		return fmt.Errorf("release %#x: %w", h, ErrNotHeld)
	}
	if e.refs--; e.refs == 0 {
		c.referenced--
		c.inactive++
		if e.bad {
			c.dropDamaged(e)
		} else {
			c.settle(e)
		}
	}
	return nil
}

// lookup reports, per hash, whether it is stored (written) in the pool.
func (c *core) lookup(hs []uint64, dst []bool) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range hs {
		dst = append(dst, stored(c.entries[h]))
	}
	return dst
}

// revive reports, per hash, whether it is stored (written) in the pool,
// and revives each one that is, as reserve does for a block already held:
// touched in the LRU order, counted in revived.
func (c *core) revive(hs []uint64, dst []bool) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, h := range hs {
		e := c.entries[h]
		ok := stored(e)
		if ok {
			c.touch(e)
			c.revived++
		}
		dst = append(dst, ok)
	}
	return dst
}

// prefix counts the leading hashes that are stored.
func (c *core) prefix(hs []uint64) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, h := range hs {
		if !stored(c.entries[h]) {
			return i
		}
	}
	return len(hs)
}

// dumpChain bounds the blocks of one dumped event, so that one event stays
// well under a request's byte limit on the event plane.
const dumpChain = 256

// dump returns every written block as STORE events, each block after its
// parent when the parent is in the pool, and the id the Sink returned for
// the last event this pool published (0 if none). Chains become one event
// each (split every dumpChain blocks); siblings, and blocks whose parent is
// not in the pool, start new events. Among siblings, older ones come first.
func (c *core) dump() ([]kvevent.Event, uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.dumpLocked(), c.lastEventID
}

// dumpTo calls f with dump's events under the lock: no event of the pool's
// is published while f runs.
func (c *core) dumpTo(f func([]kvevent.Event) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return f(c.dumpLocked())
}

// dumpLocked is dump's events. The caller holds c.mu.
func (c *core) dumpLocked() []kvevent.Event {
	children := make(map[uint64][]*entry)
	var roots []*entry
	for _, e := range c.entries {
		if !stored(e) {
			continue
		}
		if p := c.entries[e.Parent]; e.Parent != 0 && stored(p) {
			children[e.Parent] = append(children[e.Parent], e)
		} else {
			roots = append(roots, e)
		}
	}
	byAge := func(a, b *entry) int { return cmp.Or(cmp.Compare(a.stamp, b.stamp), cmp.Compare(a.Hash, b.Hash)) }
	slices.SortFunc(roots, byAge)
	var evs []kvevent.Event
	stack := make([]*entry, 0, 64)
	for i := len(roots) - 1; i >= 0; i-- {
		stack = append(stack, roots[i])
	}
	// Depth-first, preorder: a block's first child directly follows it, so
	// a chain stays one event.
	for len(stack) > 0 {
		e := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		evs = c.appendStored(evs, e.Block, dumpChain)
		kids := children[e.Hash]
		slices.SortFunc(kids, byAge)
		for i := len(kids) - 1; i >= 0; i-- {
			stack = append(stack, kids[i])
		}
	}
	return evs
}

func (c *core) publish(evs []kvevent.Event) {
	if c.cfg.Sink == nil {
		return
	}
	id, err := c.cfg.Sink.Publish(c.cfg.Rank, evs)
	if err != nil {
		c.publishErrors++
		c.cfg.Logger.Warn("offload pool: publishing events failed", "tier", c.tier, "rank", c.cfg.Rank,
			"events", len(evs), "err", err)
		return
	}
	c.lastEventID = id
}

func (c *core) stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return Stats{
		Tier:          c.tier,
		Capacity:      c.cfg.Capacity,
		BlockSize:     c.cfg.BlockSize,
		Used:          len(c.entries),
		Pending:       c.pending,
		Referenced:    c.referenced,
		Inactive:      c.inactive,
		Evictable:     len(c.lru),
		Hits:          c.hits,
		Misses:        c.misses,
		Registered:    c.registered,
		Revived:       c.revived,
		Evictions:     c.evictions,
		PublishErrors: c.publishErrors,
		Damaged:       c.damaged,
	}
}

// close marks the core closed and reports whether it was open.
func (c *core) close() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	was := !c.closed
	c.closed = true
	return was
}

// retire closes the core, as close does, and drops every written block
// with a REMOVE, as an eviction does (split every dumpChain blocks): for a
// pool whose storage is lost (a DiskPool shut down for damage, a HostPool
// closed), whose blocks must not stay advertised. The caller has excluded writers, so no
// block is pending. It reports whether the core was open.
func (c *core) retire() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return false
	}
	c.closed = true
	var gone []uint64
	for h, e := range c.entries {
		if e.ready { // a damaged one too: its REMOVE waited for its last reader
			gone = append(gone, h)
		}
	}
	slices.Sort(gone)
	clear(c.entries)
	clear(c.kids)
	c.lru = nil
	c.pending, c.inactive, c.referenced = 0, 0, 0
	var evs []kvevent.Event
	for hs := range slices.Chunk(gone, dumpChain) {
		evs = append(evs, kvevent.Event{Rank: c.cfg.Rank, Tier: c.tier, Kind: kvevent.KindRemoved, Removed: hs})
	}
	if len(evs) > 0 {
		c.publish(evs)
	}
	return true
}

// restore loads written blocks found in storage (a reopened disk pool), then
// evicts, without events, down to the capacity. The clock continues after
// the largest stamp. The caller has deleted the entries that fail
// Block.check; restore still skips any it is given.
func (c *core) restore(bs []restored) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range bs {
		if _, dup := c.entries[r.Hash]; dup || r.check() != nil {
			continue
		}
		e := &entry{Block: r.Block, ready: true, stamp: r.stamp, hidx: -1}
		c.entries[r.Hash] = e
		if r.Parent != 0 {
			c.kids[r.Parent]++
		}
		c.inactive++
		c.clock = max(c.clock, r.stamp)
	}
	for _, e := range c.entries {
		c.settle(e)
	}
	for len(c.entries) > c.cfg.Capacity {
		if err := c.evictOne(false); err != nil {
			c.cfg.Logger.Warn("offload pool: holds more blocks than its capacity", "tier", c.tier,
				"blocks", len(c.entries), "capacity", c.cfg.Capacity, "err", err)
			return
		}
	}
}

type restored struct {
	Block
	stamp uint64
}

// evictHeap orders evictable entries by last use, oldest first.
type evictHeap []*entry

func (h evictHeap) Len() int { return len(h) }
func (h evictHeap) Less(i, j int) bool {
	return h[i].stamp < h[j].stamp || h[i].stamp == h[j].stamp && h[i].Hash < h[j].Hash
}
func (h evictHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].hidx, h[j].hidx = i, j
}
func (h *evictHeap) Push(x any) {
	e := x.(*entry)
	e.hidx = len(*h)
	*h = append(*h, e)
}
func (h *evictHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	e.hidx = -1
	return e
}
