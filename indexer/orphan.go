package indexer

import (
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// The orphan buffer.
//
// Events of one rank arrive in order, but a Stored event can still name a
// parent the index does not know: the parent's store was lost, filtered, or
// is a block the router dropped for capacity. The reference router drops
// such a store silently, which makes the rank's whole subtree invisible
// until it is re-stored. Here the store is held per rank, bounded in count,
// blocks and age, and applied as soon as a later store makes its parent
// known. A held store that is evicted by the bound or ages out is dropped,
// counted, and the rank is flagged as needing a resync, because the index
// now provably differs from the engine.
//
// A Removed event that names a block still held here cuts every held chain
// that has it in the event's tier at that block (the engine evicts leaves
// first, so its descendants are gone too); the cut is counted as dropped
// but needs no resync. A capacity trim cuts nothing here: the engine did
// not remove the block, and a held store of it is the engine's later word.
// An adopted store is older than every event applied since it was held,
// so it takes no name the rank has given since: where a block of it would
// rename a block or move an engine hash (store, takesAName), the chain is
// cut there too, counted as dropped, with no resync asked. The index keeps
// no time of a name, so it cuts too a held store that renames a block named
// before it was held (the newer word), but a resync would not mend that:
// the dump is the agent's mirror, which cut the same store (DESIGN.md).
//
// Times are the callers' (the leader's stamp on each Raft entry), and go
// back at a leader change to a clock behind, or at a clock step. The
// buffer is in arrival order and only its head is checked for age, which
// is right while no held store is later than the time the rank is given.
// So when the rank is given a time before a held store's, that store is
// taken as held at the time given: its time is pulled back, never pushed
// forward. A store stamped by a clock that ran ahead then neither waits
// that clock out nor holds the stores behind it past the TTL (it did, and
// no resync was asked for): every held store is dropped at most one TTL
// after the time went back, by the clock in use since, and none before it
// has waited one by that clock. (Sequences keeps the other rule, a clock
// that never goes back, because an early expiry there frees a booking;
// here it costs a resync, while a store held too long is a stale index
// that asks for none.) The times are derived from the applied stamps
// alone and journaled with the orphans (RankMeta), so every replica,
// rebuilt or not, agrees. A buffer loaded (a durable copy, a dump) is put
// in time order the same way (loadOrphans): an earlier build's may be out
// of it.

type orphan struct {
	at     int64 // arrival time, unix nanos
	tier   kvevent.Tier
	parent uint64
	blocks []kvevent.Block // owned copy
}

func (ix *Index) holdOrphan(rs *rankState, t kvevent.Tier, parent uint64, blocks []kvevent.Block, now int64) {
	ix.pullOrphanTimes(rs, now)
	if len(blocks) > ix.cfg.OrphanMaxBlocks {
		// Dropped before it is copied: a store this long would cost an
		// allocation of its size on every replica, only to be dropped.
		ix.counters.OrphansDropped++
		rs.needsResync = true
		ix.markDirty(rs)
		return
	}
	o := orphan{at: now, tier: t, parent: parent, blocks: append([]kvevent.Block(nil), blocks...)}
	ix.counters.OrphansHeld++
	ix.markDirty(rs)
	rs.orphans = append(rs.orphans, o)
	rs.orphanBlocks += len(o.blocks)
	ix.orphanDigest(rs, &o, +1)
	for len(rs.orphans) > ix.cfg.OrphanMaxEvents || rs.orphanBlocks > ix.cfg.OrphanMaxBlocks {
		ix.dropOrphan(rs, 0, true)
	}
}

func (ix *Index) orphanDigest(rs *rankState, o *orphan, sign int) {
	parent := o.parent
	for _, b := range o.blocks {
		// The content hash goes inside the mix: added outside it, two
		// held stores whose content hashes were swapped summed alike.
		term := orphanTerm(rs.key, parent, b.EngineHash, b.LocalHash, o.tier)
		if sign > 0 {
			ix.digest += term
		} else {
			ix.digest -= term
		}
		parent = b.EngineHash
	}
}

// dropOrphan discards held store i; lost says whether the index now misses
// blocks the engine holds (then the rank needs a resync).
func (ix *Index) dropOrphan(rs *rankState, i int, lost bool) {
	o := rs.orphans[i]
	ix.orphanDigest(rs, &o, -1)
	rs.orphanBlocks -= len(o.blocks)
	// slices.Delete clears the slot left at the tail: a copy of the last
	// store there kept its blocks' array alive, outside every bound.
	rs.orphans = slices.Delete(rs.orphans, i, i+1)
	if len(rs.orphans) == 0 {
		rs.orphans = nil
	}
	ix.counters.OrphansDropped++
	if lost {
		rs.needsResync = true
	}
	ix.markDirty(rs)
}

func (ix *Index) dropAllOrphans(rs *rankState, lost bool) {
	for len(rs.orphans) > 0 {
		ix.dropOrphan(rs, len(rs.orphans)-1, lost)
	}
}

// loadOrphans fills the rank's empty buffer with a loaded copy's held
// stores (a durable copy's, a dump's), in their order, each taken as held
// no later than any store held after it. A build before times were pulled
// back wrote buffers out of time order (a store stamped by a clock that
// ran ahead, then one by a clock behind), and only the head is checked
// for age: the stores behind a head stamped ahead were held past the TTL,
// no resync asked, pulled or not, since a pull keeps the order. A node of
// this build that held the same stores has each at the earliest time of
// those held after it (the pull at each hold), which is what the running
// minimum from the tail gives; it depends on the copy alone, so every
// node that loads it agrees.
func (ix *Index) loadOrphans(rs *rankState, os []DumpOrphan) {
	for _, o := range os {
		or := orphan{at: o.At, tier: o.Tier, parent: o.Parent, blocks: slices.Clone(o.Blocks)}
		rs.orphans = append(rs.orphans, or)
		rs.orphanBlocks += len(or.blocks)
		ix.orphanDigest(rs, &or, +1)
	}
	for i := len(rs.orphans) - 2; i >= 0; i-- {
		rs.orphans[i].at = min(rs.orphans[i].at, rs.orphans[i+1].at)
	}
}

// pullOrphanTimes takes every held store of the rank later than now as
// held at now (see the top of the file). The buffer is in time order (a
// loaded one is put in order, loadOrphans), so its ends tell whether any
// is.
func (ix *Index) pullOrphanTimes(rs *rankState, now int64) {
	n := len(rs.orphans)
	if n == 0 || rs.orphans[0].at <= now && rs.orphans[n-1].at <= now {
		return
	}
	for i := range rs.orphans {
		rs.orphans[i].at = min(rs.orphans[i].at, now)
	}
	ix.markDirty(rs)
}

// expireOrphans drops held stores older than the TTL. Held stores are in
// arrival order, and none is later than now once pulled, so only the head
// needs checking.
func (ix *Index) expireOrphans(rs *rankState, now int64) {
	ix.pullOrphanTimes(rs, now)
	ttl := int64(ix.cfg.OrphanTTL)
	for len(rs.orphans) > 0 && now-rs.orphans[0].at > ttl {
		ix.dropOrphan(rs, 0, true)
	}
}

// ExpireOrphans ages every rank's orphan buffer at time now. The cluster
// calls it from a replicated sweep so that every replica drops the same ones.
func (ix *Index) ExpireOrphans(now int64) {
	ix.wmu.Lock()
	defer ix.wmu.Unlock()
	ix.mu.Lock()
	defer ix.mu.Unlock()
	for _, rs := range ix.ranks {
		if rs != nil {
			ix.expireOrphans(rs, now)
		}
	}
}

// adoptOrphans applies every held store whose parent is now known, in
// arrival order, repeating until no more resolve (a chain of held stores
// resolves in one call).
func (ix *Index) adoptOrphans(rs *rankState, now int64) {
	for i := 0; i < len(rs.orphans); {
		o := rs.orphans[i]
		if _, ok := rs.blocks.get(o.parent); !ok {
			i++
			continue
		}
		ix.orphanDigest(rs, &o, -1)
		rs.orphanBlocks -= len(o.blocks)
		rs.orphans = slices.Delete(rs.orphans, i, i+1) // clears the tail slot (dropOrphan)
		if len(rs.orphans) == 0 {
			rs.orphans = nil
		}
		ix.markDirty(rs)
		// store counts the store applied and reports its blocks
		// (ApplyReport.Adopted): those it stores, not those it cuts
		// (a name taken since, a name collision). It re-enters
		// adoptOrphans for what this one resolves.
		ix.store(rs, o.tier, true, o.parent, o.blocks, now, false)
		i = 0
	}
}

// removeHeldOrphanBlock cuts every held chain that has the block eh in
// tier t at that block, and reports whether there was one. Every one: a
// held store of eh left uncut, adopted later, would store again the block
// the engine removed.
func (ix *Index) removeHeldOrphanBlock(rs *rankState, eh uint64, t kvevent.Tier) bool {
	cut := false
	for i := 0; i < len(rs.orphans); {
		o := &rs.orphans[i]
		j := -1
		for k := 0; o.tier == t && k < len(o.blocks); k++ {
			if o.blocks[k].EngineHash == eh {
				j = k
				break
			}
		}
		switch {
		case j < 0:
			i++
			continue
		case j == 0:
			ix.dropOrphan(rs, i, false) // the next one moves to i
		default:
			ix.orphanDigest(rs, o, -1)
			rs.orphanBlocks -= len(o.blocks) - j
			o.blocks = o.blocks[:j]
			if j < cap(o.blocks)/2 {
				// The bound counts blocks kept, not the array under them:
				// a store cut block by block (the engine evicts leaf
				// first) kept its whole array, and the buffer then held
				// its bound in new stores besides. Copied once it is
				// under half, the kept blocks' memory stays within twice
				// their count, and the copies cost no more than the
				// store did.
				o.blocks = slices.Clone(o.blocks)
			}
			ix.orphanDigest(rs, o, +1)
			ix.counters.OrphansDropped++
			ix.markDirty(rs)
			i++
		}
		cut = true
	}
	return cut
}
