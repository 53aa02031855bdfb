package indexer

import (
	"fmt"
	"math"
	"math/bits"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
)

// Batched lookups. A lookup of a sequence hash in a seqIndex costs, at
// millions of records, two dependent cache misses (the directory, then the
// record), and a loop that does one lookup after another mostly waits them
// out. So the many-lookups passes (each record's parent, each residency's
// node) do theirs in a batch: the queries are first scattered into
// partitions by the top bits of their seq, one partition per few thousand
// records, then answered partition by partition. A partition's records and
// its part of the directory are contiguous and fit in the processor's
// second-level cache, so every lookup but the first of a partition hits
// it, and the scatter itself is two sequential passes.

// batchMinRecs is the fewest records for which lookups are batched (below
// it the records fit in cache anyway), and batchPartRecs the records per
// partition aimed at. Variables so that tests can force the batched path
// and many partitions on small copies.
var batchMinRecs, batchPartRecs = 1 << 16, 4096

// maxBatchBits bounds the partitions: each one is a write stream of the
// scatter, and too many of them thrash the TLB.
const maxBatchBits = 10

// batchPair is one query: a seq and where its answer goes.
type batchPair struct {
	seq uint64
	at  uint32
}

// batcher holds a batch's reusable buffers.
type batcher struct {
	shift uint
	start []uint32 // start[p] is partition p's first pair; one more at the end
	cur   []uint32 // scatter cursors
	pairs []batchPair
}

// batched reports whether lookups in x are worth batching.
func (x *seqIndex) batched() bool { return len(x.recs) >= batchMinRecs }

// reset prepares b for n queries into x: count each query's seq with
// count, then call scatterStart, put each query, and read the partitions.
func (b *batcher) reset(x *seqIndex, n int) {
	parts := len(x.recs) / max(batchPartRecs, 1)
	logP := min(bits.Len(uint(parts)), maxBatchBits) // 0 for one partition
	b.shift = 64 - uint(logP)
	if logP == 0 {
		b.shift = 63 // seq>>63 is 0 or 1: two partitions, fine
	}
	np := 1<<(64-b.shift) + 1
	if cap(b.start) < np {
		b.start = make([]uint32, np)
		b.cur = make([]uint32, np)
	}
	b.start, b.cur = b.start[:np], b.cur[:np]
	clear(b.start)
	if cap(b.pairs) < n {
		b.pairs = hugepage.MakeIn[batchPair](x.sc, n)
	}
	b.pairs = b.pairs[:n]
}

func (b *batcher) count(seq uint64) { b.start[seq>>b.shift+1]++ }

// scatterStart turns the counts into partition starts: partition p's pairs
// will be pairs[start[p]:start[p+1]].
func (b *batcher) scatterStart() {
	var sum uint32
	for p := range b.start {
		sum += b.start[p]
		b.start[p] = sum
	}
	copy(b.cur, b.start)
}

func (b *batcher) put(seq uint64, at uint32) {
	c := &b.cur[seq>>b.shift]
	b.pairs[*c] = batchPair{seq, at}
	*c++
}

// resolveRanks finds the node of each entry of ranks, in order, into at
// (and the part byte of its record into own, unless own is nil): at and
// own hold every rank's entries one rank after another. It checks each
// entry as the serial path does, and returns per rank the first error of
// its entries in their order (nil for none).
func resolveRanks(x *seqIndex, b *batcher, ranks []*loadRank, at []*node, own []uint8) []error {
	errs := make([]error, len(ranks))
	total := 0
	for _, lr := range ranks {
		total += lr.entries.n
	}
	if !x.batched() || total > math.MaxUint32 {
		j := 0
		for i, lr := range ranks {
			for _, es := range lr.entries.all {
				for k := range es {
					e := &es[k]
					if err := checkMask(e, lr); err != nil && errs[i] == nil {
						errs[i] = err
					}
					if errs[i] != nil {
						j++
						continue
					}
					r := x.find(e.seq)
					if r < 0 || x.state[r] != linkDone {
						errs[i] = errMissing(e, lr)
						j++
						continue
					}
					at[j] = x.recs[r].n
					if own != nil {
						own[j] = x.recs[r].part
					}
					j++
				}
			}
		}
		return errs
	}
	b.reset(x, total)
	for _, lr := range ranks {
		for _, es := range lr.entries.all {
			for k := range es {
				b.count(es[k].seq)
			}
		}
	}
	b.scatterStart()
	j := uint32(0)
	for _, lr := range ranks {
		for _, es := range lr.entries.all {
			for k := range es {
				b.put(es[k].seq, j)
				j++
			}
		}
	}
	recs, state := x.recs, x.state
	for _, q := range b.pairs[:total] {
		r := x.find(q.seq)
		if r < 0 || state[r] != linkDone {
			at[q.at] = nil
			continue
		}
		at[q.at] = recs[r].n
		if own != nil {
			own[q.at] = recs[r].part
		}
	}
	j = 0
	for i, lr := range ranks {
		for _, es := range lr.entries.all {
			for k := range es {
				e := &es[k]
				if errs[i] == nil {
					if err := checkMask(e, lr); err != nil {
						errs[i] = err
					} else if at[j] == nil {
						errs[i] = errMissing(e, lr)
					}
				}
				j++
			}
		}
	}
	return errs
}

func checkMask(e *loadEntry, lr *loadRank) error {
	if e.mask == 0 || e.mask >= 1<<kvevent.NumTiers {
		return fmt.Errorf("%w: entry %#x of %s has mask %#x", ErrBadDump, e.eh, lr.meta.Rank, e.mask)
	}
	return nil
}

func errMissing(e *loadEntry, lr *loadRank) error {
	return fmt.Errorf("load %s: %w: node %#x missing or in a cycle", lr.meta.Rank, ErrBadDump, e.seq)
}
