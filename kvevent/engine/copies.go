package engine

import "github.com/kvrouter/kvrouter/kvevent"

// Copies of a block.
//
// vLLM's prefix cache does not de-duplicate: two requests that fill a block
// with the same tokens at the same time each cache their own copy under one
// block hash, and the engine announces each with a BlockStored and each
// eviction with a BlockRemoved of that hash. Its offloading connector, with
// self-describing events in chunk mode, announces the blocks two chunks
// share once per chunk, and fans each chunk's eviction out to them ("consumers
// are expected to deduplicate (reference-count) repeated store/remove
// announcements of the same hash"). The index holds a block or not, per
// rank and tier: taken as it comes, the first of two removes would take the
// block off the router while the engine still holds the other copy, and the
// rank would lose the hits of that prefix, and of every block below it,
// until the engine stores it again.
//
// So the decoder counts, per tier, the stores of each engine hash that no
// remove has taken back, and a remove of a hash counted twice or more only
// takes one off the count: the router's event is left out until the last
// copy goes. A store is emitted every time (the index takes a block it holds
// as a no-op). What makes the count wrong is what makes the rank's state
// wrong anyway, a lost batch or a restarted engine, and the subscriber then
// clears the rank and calls ForgetCopies or Reset; a payload the decoder
// rejects drops them itself (the events past its bad bytes, removes perhaps,
// were never read), unless the payload is another dp rank's
// (ErrOtherDPRank: its events count no copy), and a remove it skips for a bad field or an unknown
// medium drops the counts of the hashes it names. A count can only run
// short of the engine's copies (a decoder started on a stream whose earlier
// stores it never saw, as an agentless rank's after a leader change): a
// remove then passes early, as it did before counts, taking a block the
// router could still have routed to, never leaving one the engine no longer
// holds.
//
// The counts are bounded (Config.MaxCopies): past the bound a store of a
// hash not counted yet is not counted, and its removes pass, as before.

// DefaultMaxCopies is the default bound of Config.MaxCopies: 76 MB at most
// (a Go map of an engine hash to a count per tier: 36 bytes a count when
// the map has just grown, measured with 2M), above the device and host
// blocks of one engine rank.
const DefaultMaxCopies = 1 << 21

// copyCounts counts, per tier, the stores of each engine hash not yet
// removed. A hash counted once is in the map with 1: a second store must
// find it to count as a second copy.
type copyCounts struct {
	byTier [kvevent.NumTiers]map[uint64]uint32
	peak   [kvevent.NumTiers]int // the most hashes each map held since made
	n, max int
}

// maxClearedCounts bounds the maps forget empties and keeps: a map that
// held more is dropped, since a Go map never shrinks and clear costs its
// capacity. Below it, one kept saves an engine that resets its prefix
// cache often (AllBlocksCleared at every weight update) a new map a batch.
const maxClearedCounts = 1 << 12

func newCopyCounts(max int) copyCounts {
	return copyCounts{max: max}
}

// stored counts one more copy of each of hs in tier t.
func (c *copyCounts) stored(t kvevent.Tier, hs []uint64) {
	if c.max <= 0 {
		return
	}
	m := c.byTier[t]
	if m == nil {
		m = make(map[uint64]uint32)
		c.byTier[t] = m
	}
	for _, h := range hs {
		if k, ok := m[h]; ok {
			if k < ^uint32(0) {
				m[h] = k + 1
			}
			continue
		}
		if c.n >= c.max {
			continue
		}
		m[h] = 1
		c.n++
	}
	c.peak[t] = max(c.peak[t], len(m))
}

// removed takes one copy of each of hs (a hash as many times as hs names
// it) off tier t's counts, in place, and returns the hashes whose last copy
// went (or that were never counted), in their order: those the router must
// remove. kept is how many were left out because another copy stays.
func (c *copyCounts) removed(t kvevent.Tier, hs []uint64) (gone []uint64, kept int) {
	m := c.byTier[t]
	if len(m) == 0 {
		return hs, 0
	}
	n := 0
	for _, h := range hs {
		switch k := m[h]; {
		case k > 1:
			m[h] = k - 1
			continue
		case k == 1:
			delete(m, h)
			c.n--
		}
		hs[n] = h
		n++
	}
	return hs[:n], len(hs) - n
}

// drop forgets the counts of hs in every tier: a remove of them the decoder
// could not apply (a bad field, an unknown medium) took a copy the counts
// cannot tell, and a count left above the engine's copies would absorb the
// remove of its last. Dropped, the next remove of each passes.
func (c *copyCounts) drop(hs []uint64) {
	for _, m := range c.byTier {
		if len(m) == 0 {
			continue
		}
		for _, h := range hs {
			if _, ok := m[h]; ok {
				delete(m, h)
				c.n--
			}
		}
	}
}

// forget drops every count.
func (c *copyCounts) forget() {
	for t, m := range c.byTier {
		if c.peak[t] > maxClearedCounts {
			c.byTier[t], c.peak[t] = nil, 0
		} else {
			clear(m)
		}
	}
	c.n = 0
}

// held returns how many (tier, engine hash) counts are held.
func (c *copyCounts) held() int { return c.n }
