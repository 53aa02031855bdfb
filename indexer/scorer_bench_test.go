// scorer_bench_test.go measures the route-time load path (potential decode
// blocks for every rank, then Select) and the booking path (Add + Free)
// against straightforward per-rank-map baselines in the same run, and prints
// one grep-able BENCH line per figure. ratio is baseline_ns_per_op /
// ns_per_op: above 1 means faster than the baseline.

package indexer

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// benchFleet is a synthetic fleet: every rank holds reqsPerRank live
// requests of blocks blocks; requests come from a few prompt families that
// share a prefix of random depth, so that ranks hold overlapping blocks.
type benchFleet struct {
	ranks    []kvevent.Rank
	seqs     *Sequences
	naive    *naiveLoads
	overlaps [][kvevent.NumTiers]uint32
	queries  [][]uint64
	bookings []Booking
}

const (
	benchFamilies   = 8
	benchReqPerRank = 8
)

func newBenchFleet(nRanks, blocks int) *benchFleet {
	rng := rand.New(rand.NewPCG(1, uint64(nRanks)))
	families := make([][]uint64, benchFamilies)
	for f := range families {
		families[f] = make([]uint64, blocks)
		for i := range families[f] {
			families[f][i] = rng.Uint64()
		}
	}
	request := func() []uint64 {
		f := families[rng.IntN(benchFamilies)]
		shared := rng.IntN(blocks + 1)
		seq := make([]uint64, blocks)
		copy(seq, f[:shared])
		for i := shared; i < blocks; i++ {
			seq[i] = rng.Uint64()
		}
		return seq
	}
	fl := &benchFleet{seqs: NewSequences(), naive: newNaiveLoads()}
	for r := range nRanks {
		rank := kvevent.Rank{Worker: uint64(r / 2), DP: uint32(r % 2)}
		fl.ranks = append(fl.ranks, rank)
		fl.overlaps = append(fl.overlaps, [kvevent.NumTiers]uint32{uint32(rng.IntN(blocks)), uint32(rng.IntN(8)), uint32(rng.IntN(4)), 0})
		for q := range benchReqPerRank {
			b := Booking{ID: fmt.Sprintf("r%d-%d", r, q), Rank: rank, SeqHashes: request(), ISL: blocks * 16, CachedTokens: rng.IntN(blocks * 16)}
			if _, err := fl.seqs.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens, benchFleetBooked); err != nil {
				panic(err)
			}
			fl.naive.add(b)
			fl.bookings = append(fl.bookings, b)
		}
	}
	for range 64 {
		fl.queries = append(fl.queries, request())
	}
	return fl
}

// naiveLoads is the baseline: one refcount map per rank, and a potential
// computed by looking every request block up in every rank's map.
type naiveLoads struct {
	held    map[kvevent.Rank]map[uint64]int32
	load    map[kvevent.Rank]*Load
	reqs    map[string]Booking
	ordered []kvevent.Rank
}

func newNaiveLoads() *naiveLoads {
	return &naiveLoads{held: map[kvevent.Rank]map[uint64]int32{}, load: map[kvevent.Rank]*Load{}, reqs: map[string]Booking{}}
}

func (n *naiveLoads) add(b Booking) {
	if _, ok := n.reqs[b.ID]; ok {
		return
	}
	n.reqs[b.ID] = b
	h, ok := n.held[b.Rank]
	if !ok {
		h = map[uint64]int32{}
		n.held[b.Rank] = h
		n.load[b.Rank] = &Load{}
		n.ordered = append(n.ordered, b.Rank)
	}
	l := n.load[b.Rank]
	for _, x := range b.SeqHashes {
		if h[x] == 0 {
			l.ActiveDecodeBlocks++
		}
		h[x]++
	}
	l.ActivePrefillTokens += int64(max(b.ISL-b.CachedTokens, 0))
	l.ActiveRequests++
}

func (n *naiveLoads) free(id string) {
	b, ok := n.reqs[id]
	if !ok {
		return
	}
	delete(n.reqs, id)
	h, l := n.held[b.Rank], n.load[b.Rank]
	for _, x := range b.SeqHashes {
		h[x]--
		if h[x] == 0 {
			delete(h, x)
			l.ActiveDecodeBlocks--
		}
	}
	l.ActivePrefillTokens -= int64(max(b.ISL-b.CachedTokens, 0))
	l.ActiveRequests--
}

// naiveSelect is the baseline route: per rank, per request block, one map
// lookup (O(blocks × ranks)), then the §5 cost and the minimum.
func (n *naiveLoads) naiveSelect(p Params, req Request, q []uint64, overlaps [][kvevent.NumTiers]uint32) kvevent.Rank {
	best, bestCost := kvevent.Rank{}, 0.0
	for i, r := range n.ordered {
		l, h := n.load[r], n.held[r]
		pot := l.ActiveDecodeBlocks
		for _, x := range q {
			if _, ok := h[x]; !ok {
				pot++
			}
		}
		ov := overlaps[i]
		credit := p.OverlapScoreCredit*float64(ov[0]) + p.HostCacheHitWeight*float64(ov[1]) + p.DiskCacheHitWeight*float64(ov[2]+ov[3])
		prefill := max((float64(l.ActivePrefillTokens)+float64(req.ISL))/float64(req.BlockSize)-credit, 0)
		cost := p.PrefillLoadScale*prefill + float64(pot) + p.DecodeActiveRequestWeight*float64(l.ActiveRequests)
		if i == 0 || cost < bestCost {
			best, bestCost = r, cost
		}
	}
	return best
}

// sideBySideBench runs ours and the baseline as sub-benchmarks of b and prints
// the BENCH line from their final (longest) runs. (testing.Benchmark cannot
// be used inside a benchmark: it waits on the lock the outer one holds.)
func sideBySideBench(b *testing.B, name string, ranks, blocks int, ours, base func(b *testing.B)) {
	var oursNs, baseNs float64
	timed := func(f func(*testing.B), ns *float64) func(*testing.B) {
		return func(b *testing.B) {
			b.ReportAllocs()
			f(b)
			*ns = float64(b.Elapsed().Nanoseconds()) / float64(max(b.N, 1))
		}
	}
	prefix := fmt.Sprintf("ranks=%d/", ranks)
	b.Run(prefix+"ours", timed(ours, &oursNs))
	b.Run(prefix+"baseline", timed(base, &baseNs))
	fmt.Printf("BENCH indexer.%s ranks=%d blocks=%d ns_per_op=%.0f baseline_ns_per_op=%.0f ratio=%.2f\n",
		name, ranks, blocks, oursNs, baseNs, baseNs/max(oursNs, 1))
}

// BenchmarkSelect runs the whole route-time load path: potential decode
// blocks for every rank from Sequences, candidates, Select at temperature 0.
func BenchmarkSelect(b *testing.B) {
	const blocks = 128
	for _, nRanks := range []int{16, 64, 256} {
		fl := newBenchFleet(nRanks, blocks)
		p := DefaultParams()
		req := Request{ISL: blocks * 16, BlockSize: 16, FirstBlockHash: 1}
		var (
			sc    PotentialScratch
			loads []RankLoad
			cands = make([]Candidate, 0, nRanks)
			d     Decision
		)
		route := func(q []uint64) kvevent.Rank {
			loads, _ = fl.seqs.PotentialDecodeBlocks(loads[:0], q, &sc)
			cands = cands[:0]
			for i, rl := range loads { // every rank is active: loads[i] is ranks[i]
				cands = append(cands, Candidate{Rank: rl.Rank, Overlap: fl.overlaps[i], Load: rl.Load, PotentialDecodeBlocks: rl.PotentialDecodeBlocks})
			}
			if err := Select(p, req, cands, nil, &d); err != nil {
				b.Fatal(err)
			}
			return d.Rank
		}
		// The two must agree before their speeds mean anything. (Ties can
		// differ: the baseline takes the first, Select the tie chain.)
		for _, q := range fl.queries {
			if got, want := route(q), fl.naive.naiveSelect(p, req, q, fl.overlaps); got != want && d.DecidedBy == DecidedByCost {
				b.Fatalf("ranks=%d: Select chose %v, baseline %v", nRanks, got, want)
			}
		}
		sideBySideBench(b, "select", nRanks, blocks, func(b *testing.B) {
			i := 0
			for b.Loop() {
				route(fl.queries[i%len(fl.queries)])
				i++
			}
		}, func(b *testing.B) {
			i := 0
			for b.Loop() {
				fl.naive.naiveSelect(p, req, fl.queries[i%len(fl.queries)], fl.overlaps)
				i++
			}
		})
	}
}

// BenchmarkBookingAddFree measures one Add and one Free of a 128-block
// request against a fleet with live load, against the per-rank-map baseline.
// benchFleetBooked is when the bench fleet's bookings were made: later
// than any request a benchmark books and sweeps, so sweeps leave them.
const benchFleetBooked = 1 << 62

func BenchmarkBookingAddFree(b *testing.B) {
	const blocks = 128
	nRanks := 64
	fl := newBenchFleet(nRanks, blocks)
	sideBySideBench(b, "booking_add_free", nRanks, blocks, func(b *testing.B) {
		// Each freed id stays as a tombstone until a sweep: sweeping every
		// 1,024 requests keeps the state the same size whatever b.N is, so
		// ns/op compares across runs. The sweep's cutoff stays below the
		// fleet's own bookings (benchFleetBooked), which stay live.
		i := 0
		for b.Loop() {
			bk := fl.bookings[i%len(fl.bookings)]
			id := fmt.Sprint("x", i)
			if _, err := fl.seqs.Add(id, bk.Rank, bk.SeqHashes, bk.ISL, bk.CachedTokens, int64(i+1)); err != nil {
				b.Fatal(err)
			}
			fl.seqs.Free(id)
			i++
			if i%1024 == 0 {
				fl.seqs.Expire(int64(i+1), 1)
			}
		}
		if _, freed := fl.seqs.Count(); freed > 1025 {
			b.Fatalf("%d tombstones after the sweeps, want at most 1,025", freed)
		}
	}, func(b *testing.B) {
		i := 0
		for b.Loop() {
			bk := fl.bookings[i%len(fl.bookings)]
			bk.ID = fmt.Sprint("x", i)
			fl.naive.add(bk)
			fl.naive.free(bk.ID)
			i++
		}
	})
}
