package indexer

import (
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
)

// The indexer benchmark (make bench-indexer) prints BENCH lines; it is a
// test gated by KVROUTER_BENCH so that it can set up a large workload once
// and report several figures against a baseline built in the same run.
//
// Workload: R ranks; sequences made of one of 100 shared family prefixes
// (16–128 blocks) plus a private suffix (8–128 blocks); 70 % of steps store
// a whole sequence on a rank, 30 % remove the private suffix of one it
// stored, leaf first. Seeded.
//
// Ours and the baseline are measured alone on the heap and in alternating
// order (A B B A, see TestBenchIndexer); the apply figures are each side's
// best pass. Both apply pre-validated events (applyUnchecked; the naive
// index validates nothing), so the per-event Validate is in neither figure.
//
// Knobs (environment, all optional):
//
//	KVROUTER_BENCH_INDEXER_STEPS  workload steps per rank count (default 40000, ≈ 4.8M block events)
//	KVROUTER_BENCH_REPS           passes per side (default 2: A B B A)
//	KVROUTER_CPUPROFILE           file: a CPU profile of ours's first 64-rank apply pass

type benchSeq struct {
	blocks []kvevent.Block
	prefix int // blocks shared with the family
}

type benchWorkload struct {
	events  []kvevent.Event
	queries [][]uint64 // 128-block requests
	blocks  int        // block events in events
}

func blockOf(id uint64) kvevent.Block {
	return kvevent.Block{EngineHash: mix64(id ^ 0xabcdef), LocalHash: mix64(id)}
}

func genWorkload(seed uint64, ranks, steps int) *benchWorkload {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	next := uint64(1)
	families := make([][]kvevent.Block, 100)
	for f := range families {
		n := 16 + rng.IntN(113)
		for i := 0; i < n; i++ {
			families[f] = append(families[f], blockOf(next))
			next++
		}
	}
	newSeq := func() benchSeq {
		f := families[rng.IntN(len(families))]
		s := benchSeq{blocks: slices.Clone(f), prefix: len(f)}
		for n := 8 + rng.IntN(121); n > 0; n-- {
			s.blocks = append(s.blocks, blockOf(next))
			next++
		}
		return s
	}
	w := &benchWorkload{}
	held := make([][]benchSeq, ranks)
	for i := 0; i < steps; i++ {
		r := rng.IntN(ranks)
		rank := kvevent.Rank{Worker: uint64(r / 2), DP: uint32(r % 2)}
		if rng.Float64() < 0.7 || len(held[r]) == 0 {
			s := newSeq()
			held[r] = append(held[r], s)
			w.events = append(w.events, kvevent.Event{Rank: rank, Kind: kvevent.KindStored, Blocks: s.blocks})
			w.blocks += len(s.blocks)
			continue
		}
		j := rng.IntN(len(held[r]))
		s := held[r][j]
		held[r] = slices.Delete(held[r], j, j+1)
		rm := make([]uint64, 0, len(s.blocks)-s.prefix)
		for k := len(s.blocks) - 1; k >= s.prefix; k-- {
			rm = append(rm, s.blocks[k].EngineHash)
		}
		w.events = append(w.events, kvevent.Event{Rank: rank, Kind: kvevent.KindRemoved, Removed: rm})
		w.blocks += len(rm)
	}
	// Queries: 128-block prefixes of held sequences (padded with fresh
	// blocks past their end), so they share families with the index.
	for len(w.queries) < 4096 {
		r := rng.IntN(ranks)
		if len(held[r]) == 0 {
			continue
		}
		s := held[r][rng.IntN(len(held[r]))]
		q := make([]uint64, 0, 128)
		for _, b := range s.blocks {
			if len(q) == 128 {
				break
			}
			q = append(q, b.LocalHash)
		}
		for len(q) < 128 {
			q = append(q, mix64(next))
			next++
		}
		w.queries = append(w.queries, q)
	}
	return w
}

// naiveIndex is the baseline: a plain map of sets keyed by sequence hash,
// the way a first implementation would do it.
type naiveIndex struct {
	mu     sync.RWMutex
	blocks map[uint64]map[kvevent.Rank]kvevent.Mask // seq hash -> holders
	ranks  map[kvevent.Rank]map[uint64]uint64       // engine hash -> seq hash
}

func newNaive() *naiveIndex {
	return &naiveIndex{blocks: map[uint64]map[kvevent.Rank]kvevent.Mask{}, ranks: map[kvevent.Rank]map[uint64]uint64{}}
}

func (n *naiveIndex) apply(ev *kvevent.Event) {
	n.mu.Lock()
	defer n.mu.Unlock()
	rm := n.ranks[ev.Rank]
	if rm == nil {
		rm = map[uint64]uint64{}
		n.ranks[ev.Rank] = rm
	}
	switch ev.Kind {
	case kvevent.KindStored:
		var seq uint64
		for i, b := range ev.Blocks {
			if i == 0 {
				seq = b.LocalHash
			} else {
				seq = kvevent.SequenceHash(seq, b.LocalHash)
			}
			set := n.blocks[seq]
			if set == nil {
				set = map[kvevent.Rank]kvevent.Mask{}
				n.blocks[seq] = set
			}
			set[ev.Rank] |= ev.Tier.Bit()
			rm[b.EngineHash] = seq
		}
	case kvevent.KindRemoved:
		for _, eh := range ev.Removed {
			seq, ok := rm[eh]
			if !ok {
				continue
			}
			delete(rm, eh)
			set := n.blocks[seq]
			delete(set, ev.Rank)
			if len(set) == 0 {
				delete(n.blocks, seq)
			}
		}
	}
}

func (n *naiveIndex) find(hashes []uint64, out map[kvevent.Rank]uint32) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	clear(out)
	var seq uint64
	for d, h := range hashes {
		if d == 0 {
			seq = h
		} else {
			seq = kvevent.SequenceHash(seq, h)
		}
		set := n.blocks[seq]
		if len(set) == 0 {
			return
		}
		alive := 0
		for r := range set {
			if d == 0 || out[r] == uint32(d) {
				out[r] = uint32(d + 1)
				alive++
			}
		}
		if alive == 0 {
			return
		}
	}
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

func pct(sorted []time.Duration, p float64) float64 {
	i := int(float64(len(sorted)-1) * p)
	return float64(sorted[i].Nanoseconds()) / 1e3
}

func TestBenchIndexer(t *testing.T) {
	benchenv.Skip(t, "bench-indexer")
	const seed = 20261130
	t.Logf("seed %d", seed)
	steps := benchenv.Int("KVROUTER_BENCH_INDEXER_STEPS", 40000)
	reps := benchenv.Int("KVROUTER_BENCH_REPS", 2)
	for _, ranks := range []int{16, 64, 256} {
		w := genWorkload(seed, ranks, steps)
		churn := genWorkload(seed+1, ranks, steps/2)

		// Ours and the baseline each build their index from the same
		// events, then answer the lookups, alone on the heap: each pass
		// first drops what the other side built and collects, so that
		// neither is timed with the other's 1–2M entries live (scanned by
		// every collection) or its garbage pending. The passes alternate
		// A B B A (benchenv.ABBA); the apply rates are each side's best
		// pass, the lookup latencies both passes' together.
		var (
			ix            *Index
			nv            *naiveIndex
			st            Stats
			bytesPerEntry float64
			lat, blat     [2][]time.Duration // [none, concurrent]
			oursRuns      int
		)
		oursPass := func() float64 {
			nv = nil
			base := heapInUse() // collects, after the baseline was dropped
			ix = New(Config{})
			var prof *os.File
			if p := os.Getenv("KVROUTER_CPUPROFILE"); p != "" && ranks == 64 && oursRuns == 0 {
				prof, _ = os.Create(p)
				_ = pprof.StartCPUProfile(prof)
			}
			start := time.Now()
			for i := range w.events {
				ix.applyUnchecked(&w.events[i])
			}
			rate := float64(w.blocks) / time.Since(start).Seconds()
			if prof != nil {
				pprof.StopCPUProfile()
				prof.Close()
			}
			if oursRuns == 0 {
				st = ix.Stats()
				bytesPerEntry = float64(heapInUse()-base) / float64(st.Entries)
			}
			oursRuns++
			var m Matches
			for mode := range lat {
				benchenv.Settle()
				lat[mode] = append(lat[mode], measureLookups(w.queries, mode == 1,
					churner(churn.events, func(evs []kvevent.Event) { ix.ApplyBatch(evs, 0) }),
					func(q []uint64) { ix.FindMatchesByTier(q, ViewTiered, false, &m) })...)
			}
			return rate
		}
		basePass := func() float64 {
			ix = nil
			benchenv.Settle()
			nv = newNaive()
			start := time.Now()
			for i := range w.events {
				nv.apply(&w.events[i])
			}
			rate := float64(w.blocks) / time.Since(start).Seconds()
			out := map[kvevent.Rank]uint32{}
			for mode := range blat {
				benchenv.Settle()
				blat[mode] = append(blat[mode], measureLookups(w.queries, mode == 1,
					churner(churn.events, func(evs []kvevent.Event) {
						for i := range evs {
							nv.apply(&evs[i])
						}
					}),
					func(q []uint64) { nv.find(q, out) })...)
			}
			return rate
		}
		oursRates, baseRates := benchenv.ABBA(reps, oursPass, basePass)
		ix, nv = nil, nil
		ours, baseRate := benchenv.Best(oursRates), benchenv.Best(baseRates)
		t.Logf("ranks %d: apply passes, ours %.3g, baseline %.3g (block events/s)", ranks, oursRates, baseRates)
		fmt.Printf("BENCH indexer.apply ranks=%d block_events=%d block_events_per_s=%.3g baseline_block_events_per_s=%.3g ratio=%.2f reps=%d\n",
			ranks, w.blocks, ours, baseRate, ours/baseRate, reps)
		fmt.Printf("BENCH indexer.memory ranks=%d entries=%d nodes=%d bytes_per_entry=%.1f\n", ranks, st.Entries, st.Nodes, bytesPerEntry)
		for mode, name := range []string{"none", "concurrent"} {
			slices.Sort(lat[mode])
			slices.Sort(blat[mode])
			l, b := lat[mode], blat[mode]
			fmt.Printf("BENCH indexer.lookup ranks=%d blocks=128 writes=%s p50_us=%.1f p99_us=%.1f baseline_p50_us=%.1f baseline_p99_us=%.1f ratio_p99=%.2f reps=%d\n",
				ranks, name, pct(l, .5), pct(l, .99), pct(b, .5), pct(b, .99), pct(b, .99)/pct(l, .99), reps)
		}
	}
}

// churner returns the writer of a concurrent lookup phase: each call
// applies the next 500 churn events (wrapping around) through apply. Each
// phase starts from the first event, so both sides see the same writes.
func churner(events []kvevent.Event, apply func([]kvevent.Event)) func() {
	next := 0
	return func() {
		end := min(next+500, len(events))
		apply(events[next:end])
		next = end % len(events)
	}
}

// measureLookups times each query once, with write running in a loop on
// another goroutine when writes is set, and returns sorted latencies.
func measureLookups(queries [][]uint64, writes bool, write func(), lookup func([]uint64)) []time.Duration {
	var stop atomic.Bool
	var wg sync.WaitGroup
	if writes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				write()
			}
		}()
	}
	lat := make([]time.Duration, 0, len(queries))
	for _, q := range queries {
		s := time.Now()
		lookup(q)
		lat = append(lat, time.Since(s))
	}
	stop.Store(true)
	wg.Wait()
	slices.Sort(lat)
	return lat
}

// applyUnchecked is Apply for pre-validated benchmark events.
func (ix *Index) applyUnchecked(ev *kvevent.Event) {
	ix.mu.Lock()
	ix.applyLocked(ev, 0)
	ix.mu.Unlock()
}

// BenchmarkApply builds an index from TestBenchIndexer's workload at 64
// ranks (about 480k block events; 70 % of steps store a sequence, 30 %
// remove a suffix), in a new index per iteration: the apply path alone,
// for a before/after on one machine, where make bench-indexer takes
// minutes.
func BenchmarkApply(b *testing.B) {
	const seed = 20261130
	w := genWorkload(seed, 64, 4000)
	b.Logf("seed %d, %d block events", seed, w.blocks)
	b.ResetTimer()
	for range b.N {
		ix := New(Config{})
		for i := range w.events {
			ix.applyUnchecked(&w.events[i])
		}
	}
	b.ReportMetric(float64(w.blocks)*float64(b.N)/b.Elapsed().Seconds(), "block_events/s")
}
