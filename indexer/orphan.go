package indexer

import "github.com/kvrouter/kvrouter/kvevent"

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
// A Removed event that names a block still held here cuts the held chain at
// that block (the engine evicts leaves first, so its descendants are gone
// too); the cut is counted as dropped but needs no resync.

type orphan struct {
	at     int64 // arrival time, unix nanos
	tier   kvevent.Tier
	parent uint64
	blocks []kvevent.Block // owned copy
}

func (ix *Index) holdOrphan(rs *rankState, t kvevent.Tier, parent uint64, blocks []kvevent.Block, now int64) {
	o := orphan{at: now, tier: t, parent: parent, blocks: append([]kvevent.Block(nil), blocks...)}
	if len(o.blocks) > ix.cfg.OrphanMaxBlocks {
		ix.counters.OrphansDropped++
		rs.needsResync = true
		ix.markDirty(rs)
		return
	}
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
	rs.orphans = append(rs.orphans[:i], rs.orphans[i+1:]...)
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

// expireOrphans drops held stores older than the TTL. Held stores are in
// arrival order, so only the head needs checking.
func (ix *Index) expireOrphans(rs *rankState, now int64) {
	ttl := int64(ix.cfg.OrphanTTL)
	for len(rs.orphans) > 0 && now-rs.orphans[0].at > ttl {
		ix.dropOrphan(rs, 0, true)
	}
}

// ExpireOrphans ages every rank's orphan buffer at time now. The cluster
// calls it from a replicated sweep so that every replica drops the same ones.
func (ix *Index) ExpireOrphans(now int64) {
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
		rs.orphans = append(rs.orphans[:i], rs.orphans[i+1:]...)
		if len(rs.orphans) == 0 {
			rs.orphans = nil
		}
		ix.counters.OrphansApplied++
		ix.markDirty(rs)
		if ix.report != nil {
			for _, b := range o.blocks {
				ix.report.Adopted = append(ix.report.Adopted, b.EngineHash)
			}
		}
		// store re-enters adoptOrphans for what this one resolves.
		ix.store(rs, o.tier, true, o.parent, o.blocks, now, false)
		i = 0
	}
}

// removeHeldOrphanBlock cuts a held chain at the block eh in tier t.
func (ix *Index) removeHeldOrphanBlock(rs *rankState, eh uint64, t kvevent.Tier) bool {
	for i := range rs.orphans {
		o := &rs.orphans[i]
		if o.tier != t {
			continue
		}
		for j, b := range o.blocks {
			if b.EngineHash != eh {
				continue
			}
			if j == 0 {
				ix.dropOrphan(rs, i, false)
				return true
			}
			ix.orphanDigest(rs, o, -1)
			rs.orphanBlocks -= len(o.blocks) - j
			o.blocks = o.blocks[:j]
			ix.orphanDigest(rs, o, +1)
			ix.counters.OrphansDropped++
			ix.markDirty(rs)
			return true
		}
	}
	return false
}
