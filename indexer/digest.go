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
// reaches residencies or held orphans. Held stores' boundaries are not in
// it either: a block's term names the block before it, not its event, so
// one held store [2 3] under 50 and two, [2] under 50 and [3] under 2,
// sum alike, though the buffer's event bound counts them apart and a
// remove of 2 cuts the one whole and leaves [3] of the other.
//
// And it can confuse crafted states: each term xors a field into the mix
// of the next before mixing, so two states whose fields differ by the
// same xor give one term. A residency term mixes eh ^ mix64(mask+1):
// engine hash eh on the device and eh ^ mix64(1+1) ^ mix64(2+1) on the
// host (masks 1 and 2) are one term; the orphan term's fields chain the
// same way. Engine hashes come from outside, so replicas that diverged
// between two such crafted states read as equal; a divergence of the
// router's own making is not aimed at the mix, and is caught but for
// 2^-64. Both gaps stay because the value must not change (below): a
// digest of another form would need a new check command.
//
// The digest is compared between the nodes of a cluster, also between
// builds during a rolling upgrade, so its value for a given state must
// not change: TestDigestValue pins it.

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
