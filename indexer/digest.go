package indexer

import "github.com/kvrouter/kvrouter/kvevent"

// The digest is a sum (mod 2^64) of a strong mix of every logical fact:
// one term per (rank, node, engine hash, mask) residency and one per held
// orphan block. A sum is order-independent, so equal logical state gives an
// equal digest whatever order the facts arrived in, and it updates in O(1)
// as facts change: subtract the old term, add the new one.

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
