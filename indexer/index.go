package indexer

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/internal/rankmap"
	"github.com/kvrouter/kvrouter/kvevent"
)

// Config bounds the index. The zero value takes the defaults.
type Config struct {
	// OrphanMaxEvents and OrphanMaxBlocks bound each rank's orphan buffer:
	// stores whose parent has not arrived yet. Defaults 64 and 4096.
	OrphanMaxEvents int
	OrphanMaxBlocks int
	// OrphanTTL is how long a held store waits for its parent. Default 2s.
	OrphanTTL time.Duration
	// CapacitySlack lets a rank exceed its per-tier capacity by this
	// fraction before its oldest entries are dropped. Default 0.1.
	CapacitySlack float64
	// ApplyChunk is how many blocks ApplyBatch applies under one hold of
	// the write lock before letting lookups in. Default 64.
	ApplyChunk int
}

func (c Config) withDefaults() Config {
	if c.OrphanMaxEvents <= 0 {
		c.OrphanMaxEvents = 64
	}
	if c.OrphanMaxBlocks <= 0 {
		c.OrphanMaxBlocks = 4096
	}
	if c.OrphanTTL <= 0 {
		c.OrphanTTL = 2 * time.Second
	}
	if c.CapacitySlack <= 0 {
		c.CapacitySlack = 0.1
	}
	if c.ApplyChunk <= 0 {
		c.ApplyChunk = 64
	}
	return c
}

// Counters are monotonic counts of what the index did with its input.
type Counters struct {
	StoredBlocks    uint64 // block stores applied (a tier bit set or already set)
	RemovedBlocks   uint64 // block removes that cleared a held tier
	Cleared         uint64 // Cleared events applied
	UnknownRemoves  uint64 // removes of a hash the rank does not hold in the remove's tier (no held store of it there either)
	Malformed       uint64 // events rejected whole by Validate
	OrphansHeld     uint64 // stores held for a missing parent
	OrphansApplied  uint64 // held stores applied (a block or more) once their parent arrived
	OrphansDropped  uint64 // held stores dropped or cut (bound, age, removed first, a name taken since)
	Remapped        uint64 // engine hashes that moved to another node
	CapacityEvicted uint64 // entries dropped because a rank exceeded capacity
	// NameCollisions counts stores cut short at a block whose new node's
	// name (its sequence hash) a node at another position already has: the
	// block and the rest of its event are not stored (DESIGN.md, names).
	NameCollisions uint64
}

// Index is the tiered radix index. It is safe for concurrent use: one
// writer at a time (Apply, ApplyBatch, the rank operations: a writer
// waits for another's whole call, though the batches and ReplaceRank let
// lookups in between their chunks) and any number of concurrent lookups.
// See DESIGN.md for why lookups never wait behind a whole batch or a
// rank's replace.
type Index struct {
	// wmu is held by every writer for its whole call, mu's releases
	// included: ApplyBatchReport and ReplaceRank let lookups in between
	// chunks, and a writer that ran meanwhile would see ReplaceRank's
	// deferTrim, or store into a rank half replaced (its result then
	// depended on where the chunks fell). Taken before mu.
	wmu sync.Mutex
	mu  sync.RWMutex
	cfg Config

	root  node
	pool  nodePool         // the tree's nodes; pool.huge is &huge
	names blockMap         // every node's sequence hash -> the node: names are unique (DESIGN.md)
	huge  hugepage.Scratch // the pool's and tables' slabs advised for huge pages
	// tables holds the full-sized segment tables of names and of every
	// rank's blocks; tables.huge is &huge.
	tables segTables
	ranks  []*rankState        // by slot; nil when the slot is free
	slots  rankmap.Map[uint32] // rank -> slot
	free   []uint32            // free slots, reused lowest first

	// keepNodes, set while a Loader applies residencies one by one,
	// makes unlink keep nodes in the tree (applySerial).
	keepNodes bool
	// deferTrim, set while ReplaceRank replays a dump, keeps store from
	// enforcing capacity: ReplaceRank trims once at the end. It stays
	// set across the replace's releases of mu: wmu keeps every other
	// writer out meanwhile.
	deferTrim bool
	// replacing is the rank a ReplaceRank is replacing (nil when none;
	// at most one: wmu), and replaced is closed when it is done. While
	// set, lookups leave the rank out and DumpRank waits for replaced:
	// between two of the replace's chunks the rank holds part of its
	// old state or part of its new one.
	replacing *rankState
	replaced  chan struct{}

	nodes    int64
	entries  int64                   // (rank, block) residencies
	perTier  [kvevent.NumTiers]int64 // residencies with the tier's bit set
	digest   uint64
	counters Counters

	scratchPool sync.Pool // *scratch for lookups

	journal Journal        // nil when no durable copy follows the index
	dirty   []kvevent.Rank // ranks whose metadata changed since FlushJournal

	evict evictScratch // evictOldest's working memory, kept between trims

	// report, set only while ApplyBatchReport holds mu (cleared before
	// every unlock), collects what adoptOrphans and setBitMapped did.
	report *ApplyReport

	// dumpUnlocked, for tests: DumpRank calls it once it has released
	// the lock, before it sorts what it copied.
	dumpUnlocked func()
	// applyUnlocked, for tests: ApplyBatchReport and ReplaceRank call it
	// between two chunks, while the lock is released (but wmu held: a
	// writer it calls on its own goroutine, or a DumpRank of the rank
	// being replaced, waits for ever).
	applyUnlocked func()
}

// ApplyReport is what ApplyBatchReport tells of a batch beyond the events.
type ApplyReport struct {
	// Adopted has the engine hash of every block stored of every held
	// orphan store the batch applied, of any rank (a store held because
	// its parent was unknown, applied once an event made the parent
	// known): blocks the index now holds that the events do not name. A
	// block the adoption cut (a name taken since, a name collision) and
	// the rest of its store are not listed: not held. At most the
	// orphan buffer's blocks (Config.OrphanMaxBlocks) per event.
	Adopted []uint64
	// Renamed has every block a rank held under one engine hash that a
	// store named by another: the index holds it under the newest name
	// (Rename.New) in every tier it held (Rename.Tiers) and the store's,
	// and a remove of the old name no longer reaches it.
	Renamed []Rename
	// Cut has, for every remove that took a rank's last residency of a
	// block below which the rank holds blocks, and every store that took
	// it by reusing its engine hash for another block, those blocks,
	// parents first: no lookup reaches them from the root any more, and a dump
	// leaves them out (RankDump.StoredEvents), though the index keeps
	// them. A block of the rank below one it does not hold was cut off
	// before, and is not reported again: neither when a remove above it
	// goes nor when its own last residency goes (a chain cut off before
	// and removed parents first reports nothing).
	Cut []Cut
}

// Cut is a rank's block that a remove of a block above it left
// unreachable (ApplyReport.Cut), as it was then.
type Cut struct {
	Rank   kvevent.Rank
	Parent uint64 // its parent's engine hash (the removed block's, for the first below it)
	// ParentLocal is its parent's content hash: after a store that reused
	// the removed block's engine hash, Parent names another block.
	ParentLocal uint64
	EngineHash  uint64
	Local       uint64       // its content hash
	Tiers       kvevent.Mask // the tiers the rank held it in
}

// Rename is a rank's block renamed by a store (ApplyReport.Renamed).
type Rename struct {
	Rank     kvevent.Rank
	Old, New uint64       // engine hashes
	Tiers    kvevent.Mask // held under Old, before the store
}

// New returns an empty index.
func New(cfg Config) *Index {
	ix := &Index{cfg: cfg.withDefaults()}
	ix.pool.huge = &ix.huge
	ix.tables.huge = &ix.huge
	return ix
}

// Release withdraws the huge page advice from the tree's node slabs
// (nodePool) and the block maps' table slabs (segTables), for an owner
// done with the index (a state machine closed),
// so that the kernel does not refill them once the runtime returns their
// memory. The index stays usable: its contents are unchanged, and slabs
// taken later are advised again.
func (ix *Index) Release() {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.huge.Release()
}

// rankState is what the index knows of one rank.
type rankState struct {
	rank   kvevent.Rank
	slot   uint32
	key    uint64                  // rankKey(rank), cached for the digest
	blocks blockMap                // engine hash -> node
	count  [kvevent.NumTiers]int64 // residencies per tier
	order  uint32                  // store counter for oldest-first eviction
	cap    [kvevent.NumTiers]int64 // capacity per tier, 0 = unbounded

	orphans      []orphan
	orphanBlocks int
	needsResync  bool
	overCapacity bool
	dirty        bool // listed in Index.dirty
}

// rankFor returns the rank's state, creating it when create is set. A rank
// created is marked for the journal at once: a store cut at its first
// block (names, DESIGN.md) creates it and changes nothing else, and a
// durable copy without it rebuilt a node that listed one rank fewer than
// the live ones.
func (ix *Index) rankFor(r kvevent.Rank, create bool) *rankState {
	if s, ok := ix.slots.Get(r); ok {
		return ix.ranks[s]
	}
	if !create {
		return nil
	}
	var s uint32
	if n := len(ix.free); n > 0 {
		// Lowest free slot first, so slot assignment depends only on the
		// order of rank arrivals and departures (deterministic).
		slices.Sort(ix.free)
		s, ix.free = ix.free[0], ix.free[1:]
	} else {
		s = uint32(len(ix.ranks))
		ix.ranks = append(ix.ranks, nil)
	}
	rs := &rankState{rank: r, slot: s, key: rankKey(r)}
	ix.ranks[s] = rs
	ix.slots.Set(r, s)
	ix.markDirty(rs)
	return rs
}

// Apply applies one event at time now (unix nanoseconds, used only to age
// the orphan buffer). A malformed event returns an error wrapping
// kvevent.ErrMalformed and changes nothing; everything else is applied.
func (ix *Index) Apply(ev *kvevent.Event, now int64) error {
	if !ix.TryApply(ev, now) {
		return fmt.Errorf("apply event %d of rank %s: %w", ev.EventID, ev.Rank, ev.Validate())
	}
	return nil
}

// TryApply is Apply without the error: it reports whether the event was
// applied, false for a malformed one, counted and skipped as Apply does.
// It allocates nothing for a malformed event (kvevent.Event.Valid), where
// Apply formats an error, for the callers that only count one (the FSM's
// apply, on every replica).
func (ix *Index) TryApply(ev *kvevent.Event, now int64) bool {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	if !ev.Valid() {
		ix.mu.Lock()
		ix.counters.Malformed++
		ix.mu.Unlock()
		return false
	}
	ix.mu.Lock()
	ix.applyLocked(ev, now)
	ix.mu.Unlock()
	return true
}

// ApplyBatch applies events in order and returns how many were rejected as
// malformed. The write lock is released every Config.ApplyChunk blocks so
// that lookups interleave with a long batch instead of waiting for all of it.
func (ix *Index) ApplyBatch(evs []kvevent.Event, now int64) (malformed int) {
	return ix.ApplyBatchReport(evs, now, nil)
}

// ApplyBatchReport is ApplyBatch that also appends to rep, when it is not
// nil, what the batch did that its events do not say (ApplyReport): the
// node agent lets the offload pools' blocks that wait for an adopted
// block go, looking up only those (agent's releaseLocked), and withdraws
// a pool's copy the engine renamed. What the index does is ApplyBatch's.
func (ix *Index) ApplyBatchReport(evs []kvevent.Event, now int64, rep *ApplyReport) (malformed int) {
	budget := 0
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	ix.report = rep
	for i := range evs {
		ev := &evs[i]
		if !ev.Valid() {
			malformed++
			ix.counters.Malformed++
			continue
		}
		ix.applyLocked(ev, now)
		budget += len(ev.Blocks) + len(ev.Removed) + 1
		if budget >= ix.cfg.ApplyChunk && i+1 < len(evs) {
			ix.report = nil // kept to mu's holds (no writer runs meanwhile: wmu)
			ix.yieldLocked()
			budget = 0
			ix.report = rep
		}
	}
	ix.report = nil
	ix.mu.Unlock()
	return malformed
}

func (ix *Index) applyLocked(ev *kvevent.Event, now int64) {
	switch ev.Kind {
	case kvevent.KindStored:
		rs := ix.rankFor(ev.Rank, true)
		ix.expireOrphans(rs, now)
		ix.store(rs, ev.Tier, ev.HasParent, ev.Parent, ev.Blocks, now, true)
	case kvevent.KindRemoved:
		rs := ix.rankFor(ev.Rank, false)
		if rs == nil {
			ix.counters.UnknownRemoves += uint64(len(ev.Removed))
			return
		}
		ix.expireOrphans(rs, now)
		for _, eh := range ev.Removed {
			ix.removeOne(rs, eh, ev.Tier, true)
		}
	case kvevent.KindCleared:
		ix.counters.Cleared++
		if rs := ix.rankFor(ev.Rank, false); rs != nil {
			ix.clearRank(rs)
		}
	}
}

// store applies a Stored chain. When the parent is unknown the chain is
// held in the rank's orphan buffer (if hold is set) instead. Unset, the
// chain is a held store being adopted (adoptOrphans), which takes no name
// the rank has given otherwise (takesAName).
func (ix *Index) store(rs *rankState, t kvevent.Tier, hasParent bool, parentEH uint64, blocks []kvevent.Block, now int64, hold bool) bool {
	parent := &ix.root
	if hasParent {
		p, ok := rs.blocks.get(parentEH)
		if !ok {
			if hold {
				ix.holdOrphan(rs, t, parentEH, blocks, now)
			}
			return false
		}
		parent = p
	}
	stored := len(blocks)
	for i, b := range blocks {
		c := parent.child(b.LocalHash)
		if !hold && ix.takesAName(rs, c, b.EngineHash) {
			// An adopted store (hold unset: adoptOrphans) is older than
			// every event applied since it was held, and the name it would
			// take was given since, as far as the index can tell: by the
			// store that made its parent known or one before it. Taken,
			// the newest name lost to an older one (a remove of it then
			// missed, and the block stayed), or the block the engine
			// stored last under the hash was dropped for the older one.
			// So the held chain is cut there, as a remove cuts it
			// (orphan.go): that block and the rest of the event, which
			// hang below it, are not stored. The index keeps no time of
			// a name, so a held store that renames a block named before
			// it was held (the newer word) is cut too. No resync is
			// asked: the dump it brings is the agent's mirror, which
			// applied the same events and cut the same store, so it
			// settles nothing, and two requests of the same tokens under
			// other extra keys (kvevent/engine) take this cut on a
			// normal stream with offload, a whole dump through Raft each
			// time (DESIGN.md, Orphans).
			ix.counters.OrphansDropped++
			stored = i
			break
		}
		if c == nil {
			seq := b.LocalHash
			if parent != &ix.root {
				seq = kvevent.SequenceHash(parent.seq, b.LocalHash)
			}
			// A node is known by its name alone in dumps, the digest, the
			// journal and the rebuild, and content hashes come from
			// publishers unchecked: a name another position has (a root
			// block whose content hash is a deeper node's sequence hash,
			// or two 64-bit hashes equal by chance or by search) would
			// make the rank's dump unloadable and the durable copy lose a
			// node. The block and the rest of the event (which hangs
			// below it) are refused instead. One probe both checks the
			// name and finds where it goes.
			ref, other := ix.names.lookup(seq, &ix.tables)
			if other != nil {
				ix.counters.NameCollisions++
				stored = i
				break
			}
			c = ix.pool.get(parent, b.LocalHash, seq)
			ix.names.setAt(ref, seq, c)
			parent.addChild(c)
			ix.nodes++
			if ix.journal != nil {
				ix.journal.NodeCreated(seq, parent.seq, parent == &ix.root, b.LocalHash)
			}
		}
		ix.setBit(rs, c, b.EngineHash, t)
		if !hold && ix.report != nil {
			// Only the blocks stored: a cut one is not held.
			ix.report.Adopted = append(ix.report.Adopted, b.EngineHash)
		}
		parent = c
	}
	ix.counters.StoredBlocks += uint64(stored)
	if !hold && stored > 0 {
		ix.counters.OrphansApplied++
	}
	if len(rs.orphans) > 0 {
		ix.adoptOrphans(rs, now)
	}
	if !ix.deferTrim && ix.overCapacity(rs, t) {
		ix.evictOldest(rs, t, rs.count[t]-rs.cap[t])
	}
	return true
}

// takesAName reports whether storing eh at n (nil: a node not made yet)
// would take a name the rank has given otherwise: rename n, which it holds
// under another engine hash, or move eh, which names another node.
func (ix *Index) takesAName(rs *rankState, n *node, eh uint64) bool {
	if n != nil {
		if i := n.find(rs.slot); i >= 0 {
			return n.holders[i].eh != eh
		}
	}
	_, ok := rs.blocks.get(eh)
	return ok // and not n, which the rank does not hold
}

// setBit records that rank rs holds node n under engine hash eh in tier t.
func (ix *Index) setBit(rs *rankState, n *node, eh uint64, t kvevent.Tier) {
	// Fast path: the rank already holds n under this engine hash (a
	// re-store, or the same block arriving in another tier). No map access.
	i := n.find(rs.slot)
	if i >= 0 && n.holders[i].eh == eh {
		ix.setTier(rs, n, &n.holders[i], t)
		return
	}
	slot, old := rs.blocks.lookup(eh, &ix.tables)
	if old == nil && i < 0 {
		// A new residency, the common case: one probe of the map finds
		// that eh is not in it and where it goes.
		rs.blocks.setAt(slot, eh, n)
		ix.addHolder(rs, n, eh, t)
		return
	}
	if old != nil && old != n {
		// The engine reused a hash for another block: the old residency is
		// gone (every tier), the new one starts fresh. The old node is
		// unlinked only after n holds the rank: n may be an ancestor of the
		// old node, and unlinking first could free n itself.
		ix.counters.Remapped++
		if ix.report != nil && old.hasChildren() && ix.reachable(rs, old) {
			// As a remove of old's last residency: what rs holds below it
			// no lookup reaches any more (eh names n now; the cuts' first
			// parent is eh, and its content hash tells the two apart).
			ix.reportCut(rs, old, eh)
		}
		ix.detachHolder(rs, old, old.find(rs.slot))
		ix.setBitMapped(rs, n, eh, t)
		ix.unlink(old)
		return
	}
	ix.setBitMapped(rs, n, eh, t)
}

// setBitMapped is setBit once eh maps to n or to nothing.
func (ix *Index) setBitMapped(rs *rankState, n *node, eh uint64, t kvevent.Tier) {
	i := n.find(rs.slot)
	if i < 0 {
		rs.blocks.put(eh, n, &ix.tables)
		ix.addHolder(rs, n, eh, t)
		return
	}
	h := &n.holders[i]
	if h.eh != eh {
		// The rank already holds this block under another engine hash: the
		// newest name wins, so that removes by either name stay resolvable
		// one-to-one.
		ix.counters.Remapped++
		if ix.report != nil {
			ix.report.Renamed = append(ix.report.Renamed, Rename{Rank: rs.rank, Old: h.eh, New: eh, Tiers: h.mask()})
		}
		ix.digest -= residencyTerm(rs.key, n.seq, h.eh, h.mask())
		rs.blocks.del(h.eh)
		if ix.journal != nil {
			ix.journal.EntryDeleted(rs.rank, h.eh)
			ix.journal.EntrySet(rs.rank, eh, n.seq, h.mask(), h.order)
		}
		h.eh = eh
		rs.blocks.put(eh, n, &ix.tables)
		ix.digest += residencyTerm(rs.key, n.seq, eh, h.mask())
	}
	ix.setTier(rs, n, h, t)
}

// addHolder makes rank rs a holder of node n, which it did not hold, as
// engine hash eh in tier t (the caller has mapped eh to n).
func (ix *Index) addHolder(rs *rankState, n *node, eh uint64, t kvevent.Tier) {
	rs.order++
	n.addHolder(holder{eh: eh, sm: mkSM(rs.slot, t.Bit()), order: rs.order})
	rs.count[t]++
	ix.perTier[t]++
	ix.entries++
	ix.digest += residencyTerm(rs.key, n.seq, eh, t.Bit())
	if ix.journal != nil {
		ix.journal.EntrySet(rs.rank, eh, n.seq, t.Bit(), rs.order)
		ix.markDirty(rs)
	}
}

// setTier sets tier t on the rank's holder h of node n. The entry keeps
// its age, its first store's: one counter per entry serves every tier it
// holds (see DESIGN.md, Capacity).
func (ix *Index) setTier(rs *rankState, n *node, h *holder, t kvevent.Tier) {
	m := h.mask()
	if m.Has(t) {
		return
	}
	ix.digest -= residencyTerm(rs.key, n.seq, h.eh, m)
	m |= t.Bit()
	h.sm = mkSM(rs.slot, m)
	ix.digest += residencyTerm(rs.key, n.seq, h.eh, m)
	rs.count[t]++
	ix.perTier[t]++
	if ix.journal != nil {
		ix.journal.EntrySet(rs.rank, h.eh, n.seq, m, h.order)
	}
}

// removeOne clears tier t of the block rs knows as eh. engine says the
// engine removed it (an event), not a capacity trim.
func (ix *Index) removeOne(rs *rankState, eh uint64, t kvevent.Tier, engine bool) {
	n, ok := rs.blocks.get(eh)
	if !ok {
		if !ix.removeHeldOrphanBlock(rs, eh, t) {
			ix.counters.UnknownRemoves++
		}
		return
	}
	i := n.find(rs.slot)
	h := &n.holders[i]
	m := h.mask()
	if !m.Has(t) {
		// Not held in this tier; a held store may still have the block in
		// t (a store of it there waiting for its parent), and the engine
		// has just said it is gone from t: cut it, as for a block the rank
		// does not hold at all, or adoption would bring it back. Without
		// one, the remove is of a residency the index does not have:
		// counted unknown, as a remove of a hash the rank does not hold
		// is (it was counted nowhere, and the store the index missed
		// went unseen).
		if len(rs.orphans) == 0 || !ix.removeHeldOrphanBlock(rs, eh, t) {
			ix.counters.UnknownRemoves++
		}
		return
	}
	ix.counters.RemovedBlocks++
	if engine && len(rs.orphans) > 0 {
		// A held store of the block in t (a later store of it, under a
		// parent not known yet) is older than this remove too: cut it,
		// or adoption would bring back the residency dropped here. A
		// capacity trim is the router's guess, not the engine's word: a
		// held store of the block is the engine's later store of it, and
		// is left to be adopted (cut, it was dropped with no resync asked,
		// semantics.md §3).
		ix.removeHeldOrphanBlock(rs, eh, t)
	}
	if m == t.Bit() {
		if ix.report != nil && n.hasChildren() && ix.reachable(rs, n) {
			ix.reportCut(rs, n, eh)
		}
		ix.dropHolder(rs, n, i)
		return
	}
	ix.digest -= residencyTerm(rs.key, n.seq, eh, m)
	m &^= t.Bit()
	h.sm = mkSM(rs.slot, m)
	ix.digest += residencyTerm(rs.key, n.seq, eh, m)
	rs.count[t]--
	ix.perTier[t]--
	if ix.journal != nil {
		ix.journal.EntrySet(rs.rank, eh, n.seq, m, h.order)
	}
}

// reportCut adds to the report the blocks rs holds below n, which it
// holds under engine hash eh and is about to stop holding, parents first.
// The walk goes down only through blocks rs holds: it looks at n's
// children, and then at rs's own blocks below them.
func (ix *Index) reportCut(rs *rankState, n *node, eh uint64) {
	n.forEachChild(func(c *node) {
		i := c.find(rs.slot)
		if i < 0 {
			return // what rs holds below c was cut off before
		}
		h := &c.holders[i]
		ix.report.Cut = append(ix.report.Cut, Cut{Rank: rs.rank, Parent: eh, ParentLocal: n.local, EngineHash: h.eh, Local: c.local, Tiers: h.mask()})
		ix.reportCut(rs, c, h.eh)
	})
}

// reachable reports whether n's parent is the root or a block rs holds:
// whether, as far as a remove of n is concerned, rs's blocks below n are
// reachable until n goes. A block whose parent rs stopped holding was cut
// off then, and its subtree reported as cut; reporting it again for each
// block of it that goes (the node agent removes a cut chain parents
// first) would report a chain of n blocks n(n-1)/2 times. Only the parent
// is looked at, not the whole path: a held block below a cut is reported
// again when it goes, at most once per remove, not per ancestor.
func (ix *Index) reachable(rs *rankState, n *node) bool {
	return n.parent == &ix.root || n.parent.find(rs.slot) >= 0
}

// dropHolder removes rank rs from node n (holder i) in every tier, and
// unlinks n and any ancestors that no rank holds and that have no children.
func (ix *Index) dropHolder(rs *rankState, n *node, i int) {
	ix.detachHolder(rs, n, i)
	ix.unlink(n)
}

// detachHolder removes rank rs from node n (holder i) in every tier,
// leaving n linked even when nobody holds it any more.
func (ix *Index) detachHolder(rs *rankState, n *node, i int) {
	h := n.holders[i]
	m := h.mask()
	ix.digest -= residencyTerm(rs.key, n.seq, h.eh, m)
	for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
		if m.Has(t) {
			rs.count[t]--
			ix.perTier[t]--
		}
	}
	ix.entries--
	rs.blocks.del(h.eh)
	n.removeHolder(i)
	if ix.journal != nil {
		ix.journal.EntryDeleted(rs.rank, h.eh)
	}
}

// unlink frees n and then each ancestor while it is held by no rank and has
// no children. This is what keeps memory bounded under store/remove churn.
func (ix *Index) unlink(n *node) {
	if ix.keepNodes {
		return
	}
	for n != &ix.root && n.parent != nil && len(n.holders) == 0 && !n.hasChildren() {
		p := n.parent
		p.removeChild(n.local)
		ix.names.del(n.seq)
		ix.nodes--
		if ix.journal != nil {
			ix.journal.NodeFreed(n.seq)
		}
		ix.pool.put(n) // parent nil: a second unlink of n stops at once
		n = p
	}
}

// clearRank drops every residency and held orphan of rs. The rank keeps
// its slot and capacity.
func (ix *Index) clearRank(rs *rankState) {
	// The order of removal does not matter: the result of dropping all of
	// a rank's holders is the same whatever order they go in.
	// Holders drop while the old map is walked; their deletes miss the
	// new, empty one.
	old := rs.blocks
	rs.blocks = blockMap{}
	for _, n := range old.all() {
		if i := n.find(rs.slot); i >= 0 {
			ix.dropHolder(rs, n, i)
		}
	}
	ix.tables.release(&old)
	ix.clearRankRest(rs)
}

// clearRankRest is what clearRank does once the rank's residencies are
// gone: its held orphans and flags.
func (ix *Index) clearRankRest(rs *rankState) {
	ix.dropAllOrphans(rs, false)
	rs.needsResync = false
	rs.overCapacity = false
	ix.markDirty(rs)
}

// yieldLocked releases the write lock and takes it again, so that the
// lookups waiting for it go first. The caller holds wmu: no writer runs
// meanwhile.
func (ix *Index) yieldLocked() {
	ix.mu.Unlock()
	if ix.applyUnlocked != nil {
		ix.applyUnlocked()
	}
	ix.mu.Lock()
}

// RemoveRank drops a rank's state entirely (every tier, its orphans, its
// capacity). Removing an unknown rank is a no-op and returns false.
func (ix *Index) RemoveRank(r kvevent.Rank) bool {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.removeRankLocked(r)
}

func (ix *Index) removeRankLocked(r kvevent.Rank) bool {
	rs := ix.rankFor(r, false)
	if rs == nil {
		return false
	}
	ix.clearRank(rs)
	ix.ranks[rs.slot] = nil
	ix.slots.Delete(r)
	ix.free = append(ix.free, rs.slot)
	if ix.journal != nil {
		ix.journal.RankRemoved(r)
	}
	return true
}

// RemoveWorker drops every rank of the worker and returns how many there were.
func (ix *Index) RemoveWorker(worker uint64) int {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	// Sorted, so that slots are freed in the same order on every replica;
	// found without a scan of every rank (rankmap says why).
	rs := ix.slots.WorkerRanks(nil, worker)
	for _, r := range rs {
		ix.removeRankLocked(r)
	}
	return len(rs)
}

// SetCapacity bounds how many blocks the rank may hold per tier (0 =
// unbounded). It creates the rank if needed and enforces the bound at once,
// as a store does: a tier over its capacity and the slack drops its oldest
// entries down to the capacity. (A registration repeats the capacity it
// had: trimming every rank within its slack then dropped entries the
// engine still held, and sorted the rank's entries each time.)
func (ix *Index) SetCapacity(r kvevent.Rank, capacity [kvevent.NumTiers]int64) {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	rs := ix.rankFor(r, true)
	rs.cap = capacity
	ix.markDirty(rs)
	ix.enforceCapacity(rs)
}

// enforceCapacity trims every tier of the rank that is over its capacity
// and the slack down to the capacity.
func (ix *Index) enforceCapacity(rs *rankState) {
	for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
		if ix.overCapacity(rs, t) {
			ix.evictOldest(rs, t, rs.count[t]-rs.cap[t])
		}
	}
}

// overCapacity reports whether the rank's tier t holds more than its
// capacity and the slack allow. A capacity or slack too large for the sum
// to fit an int64 (2^61 blocks and up: no rank holds that many) bounds
// nothing: the limit must not wrap negative.
func (ix *Index) overCapacity(rs *rankState, t kvevent.Tier) bool {
	const unbounded = 1 << 61
	c := rs.cap[t]
	if c <= 0 || c >= unbounded {
		return false
	}
	slack := float64(c) * ix.cfg.CapacitySlack
	if slack >= unbounded {
		return false
	}
	return rs.count[t] > c+int64(slack) // < 2^62
}

// evictScratch is evictOldest's working memory. A trim of a rank of
// capacity c handles about c entries; reused, its slices cost neither an
// allocation nor, for the pointers, the collector's scan per trim.
type evictScratch struct {
	all   []evictEntry
	keys  []uint64
	order []evictAged
}

type evictEntry struct {
	n        *node
	h        *holder // stays put until the evictions
	eh       uint64
	own, age uint32 // distances from the rank's counter: the entry's own, and its youngest descendant's
	tie      uint32 // steps from that descendant
}

type evictAged struct {
	key uint64 // the oldest subtree first, then the deepest of a chain (the fewest steps)
	eh  uint64
}

// evictOldest clears tier t of the rank's k oldest entries that hold it.
// Capacity is enforced with slack, so this runs once per slack's worth of
// stores and its O(n log n) cost is amortised.
//
// An entry is as old as the youngest entry the rank holds in t at or below
// it: a prefix is in use while any of its extensions is, and a lookup
// counts only an unbroken prefix from the root, so dropping a chain's first
// block makes the rest of it unreachable while it still takes capacity.
// Among entries of one age (the blocks of one chain, stored together, up to
// its last) the deepest go first: a chain is trimmed from its leaf, as an
// engine evicts.
func (ix *Index) evictOldest(rs *rankState, t kvevent.Tier, k int64) {
	rs.overCapacity = true
	ix.markDirty(rs)
	sc := &ix.evict
	all := sc.all[:0]
	for eh, n := range rs.blocks.all() {
		h := &n.holders[n.find(rs.slot)]
		if h.mask().Has(t) {
			// Ages are distances from the rank's counter, so the uint32
			// counter may wrap without reordering live entries.
			own := rs.order - h.order
			all = append(all, evictEntry{n: n, h: h, eh: eh, own: own, age: own})
		}
	}
	// Youngest first, each entry hands its age up the chain of ancestors
	// the rank holds in t until one is as young already, so an entry's
	// age is set by its youngest descendant, once, and tie counts the
	// steps from that descendant: the deepest of one age has the least.
	// Two entries have one own age only when orders repeat (a loaded
	// dump's, or a counter wrapped past a live entry); an ancestor then
	// keeps the fewest steps to either, so the result does not depend on
	// which goes first: keys of one age are in all()'s order, and that
	// order differs between replicas (blockMap's seed).
	// While this runs, each holder's order field holds its entry's index
	// in all (no map of the entries); it gets its own order back before
	// anything else reads it. Sort keys are packed in a uint64: sorting
	// them is several times faster than sorting the entries.
	keys := sc.keys[:0]
	for i := range all {
		keys = append(keys, uint64(all[i].own)<<32|uint64(i))
		all[i].h.order = uint32(i)
	}
	slices.Sort(keys)
	for _, key := range keys {
		e := &all[uint32(key)]
		for p := e.n.parent; p != nil; p = p.parent {
			j := p.find(rs.slot)
			if j < 0 || !p.holders[j].mask().Has(t) {
				break // a chain the rank holds in t ends here
			}
			a := &all[p.holders[j].order]
			if a.age < e.age || a.age == e.age && a.tie <= e.tie+1 {
				break
			}
			a.age, a.tie = e.age, e.tie+1
			e = a
		}
	}
	order := sc.order[:0]
	for i := range all {
		e := &all[i]
		order = append(order, evictAged{key: uint64(^e.age)<<32 | uint64(e.tie), eh: e.eh})
		e.h.order = rs.order - e.own
	}
	clear(all) // the nodes may be freed below
	sc.all, sc.keys, sc.order = all[:0], keys[:0], order[:0]
	slices.SortFunc(order, func(a, b evictAged) int {
		if a.key != b.key {
			return cmp.Compare(a.key, b.key)
		}
		return cmp.Compare(a.eh, b.eh)
	})
	k = max(0, min(k, int64(len(order))))
	for _, a := range order[:k] {
		ix.removeOne(rs, a.eh, t, false)
		ix.counters.CapacityEvicted++
	}
}
