package indexer

import "github.com/kvrouter/kvrouter/kvevent"

// The digest is a sum (mod 2^64) of a strong mix of every residency and
// held orphan block: one term per (rank, node sequence hash, engine hash,
// tier mask) residency, and one per block of a held orphan event (rank,
// the engine hash before it in the event, or the event's parent for the
// first, its engine hash, its content hash, the event's tier). A sum is
// order-independent, so equal residencies and held orphans give an equal
// digest whatever order they arrived in, and it updates in O(1) as they
// change: subtract the old term, add the new one.
//
// Nothing else is in it, though the rest is replicated state too and
// decides what later events do: when each orphan arrived and the buffer's
// order (TTL expiry, which is dropped at the buffer's bounds), each
// entry's age (holder order and the rank's store counter: which entries a
// capacity trim drops), each rank's capacity, its needs-resync and
// over-capacity flags, ranks that hold nothing (SetCapacity makes one),
// and the counters. Two indexes with equal digests can therefore diverge
// at a later event; the digest shows a divergence there only once it
// reaches residencies or held orphans. The digest is compared between the
// nodes of a cluster, also between builds during a rolling upgrade, so its
// value for a given state must not change: TestDigestValue pins it.

// mix64 is the SplitMix64 finaliser: a bijection with full avalanche.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

func rankKey(r kvevent.Rank) uint64 { return mix64(r.Worker ^ mix64(uint64(r.DP)+0x9e3779b97f4a7c15)) }

func residencyTerm(rk, seq, eh uint64, m kvevent.Mask) uint64 {
	return mix64(rk ^ mix64(seq^mix64(eh^mix64(uint64(m)+1))))
}

func orphanTerm(rk, parent, eh, local uint64, t kvevent.Tier) uint64 {
	return mix64(rk ^ 0x6f727068616e ^ mix64(parent^mix64(eh^mix64(local^mix64(uint64(t)+17)))))
}
