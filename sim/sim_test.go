package sim

import (
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

func TestReadTraceRejectsBadRows(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}` + "\n\n"
	if reqs, err := ReadTrace(strings.NewReader(good)); err != nil || len(reqs) != 1 || reqs[0].HashIDs[1] != 2 {
		t.Fatalf("good trace: %v %v", reqs, err)
	}
	for _, bad := range []string{
		`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 0, "output_length": 3, "hash_ids": []}`,
		`{"timestamp": -5, "input_length": 10, "output_length": 3, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": "x"}`,
		`not json`,
		// Past the bounds: they would wrap the simulated clock (an epoch
		// in microseconds) or a block count.
		`{"timestamp": 4398046511105, "input_length": 10, "output_length": 3, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 9223372036854775800, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 2147483649, "output_length": 3, "hash_ids": [1]}`,
	} {
		if _, err := ReadTrace(strings.NewReader(good + bad)); !errors.Is(err, ErrBadTrace) || !strings.Contains(err.Error(), "line 3") {
			t.Errorf("%s: err %v, want ErrBadTrace at line 3", bad, err)
		}
	}
	// Timestamps going backwards: the replays issue requests in trace
	// order, so the timed clock ran backwards (a later row's request
	// waited behind an earlier row's).
	later := `{"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1]}` + "\n"
	earlier := `{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [2]}` + "\n"
	if _, err := ReadTrace(strings.NewReader(later + earlier)); !errors.Is(err, ErrBadTrace) || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("a timestamp going backwards: err %v, want ErrBadTrace at line 2", err)
	}
	if _, err := ReadTrace(strings.NewReader(earlier + later + later)); err != nil {
		t.Errorf("equal and rising timestamps: %v", err)
	}
}

// TestATraceLineOverTheLimitNamesItsLineAndTheLimit: a line longer than
// MaxTraceLineBytes (a file without newlines, say) is a bad trace whose
// error names the line and the limit, instead of bufio's bare "token too
// long".
func TestATraceLineOverTheLimitNamesItsLineAndTheLimit(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}` + "\n"
	long := io.LimitReader(zeros{}, MaxTraceLineBytes+1)
	_, err := ReadTrace(io.MultiReader(strings.NewReader(good+good), long))
	if !errors.Is(err, ErrBadTrace) || !strings.Contains(fmt.Sprint(err), "line 3: longer than 64 MiB, the most a trace line may take") {
		t.Fatalf("a line of %d bytes: %v, want ErrBadTrace naming line 3 and the 64 MiB limit", MaxTraceLineBytes+1, err)
	}
}

// zeros reads as an endless run of '0's.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = '0'
	}
	return len(p), nil
}

// TestReadTraceIsStrict: a row is exactly the README's four fields with
// ceil(input_length/512) hash ids (an unknown key was ignored and a
// missing field read as 0, so {"ts": 9000, ...} arrived at 0); a line of
// whitespace is blank; a trace without rows and a row asking for more
// than MaxTraceTokens are refused before anything is built for them.
func TestReadTraceIsStrict(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}` + "\n \t\n"
	if reqs, err := ReadTrace(strings.NewReader(good)); err != nil || len(reqs) != 1 {
		t.Fatalf("a row and a whitespace line: %v %v", reqs, err)
	}
	for _, bad := range []string{
		`{"ts": 9000, "timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`,
		`{"ts": 9000, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "output_length": 3, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 3}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": null}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3]}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]} {}`,
		`{"timestamp": 0, "input_length": 16777217, "output_length": 3, "hash_ids": [1]}`,
		`{"timestamp": 0, "input_length": 10, "output_length": 16777217, "hash_ids": [1]}`,
		// Keys as encoding/json alone takes them: given twice (the last
		// winning: 100 tokens, one id), in another case, folded by Unicode
		// (U+017F LONG S is 's'). From a review.
		`{"timestamp": 0, "input_length": 600, "input_length": 100, "output_length": 3, "hash_ids": [1]}`,
		`{"TIMESTAMP": 0, "Input_Length": 600, "output_length": 3, "hash_ids": [1, 2]}`,
		`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_id` + "\u017f" + `": [1, 2]}`,
	} {
		_, err := ReadTrace(strings.NewReader(good + bad + "\n"))
		if !errors.Is(err, ErrBadTrace) || !strings.Contains(err.Error(), "line 3") {
			t.Errorf("%s: err %v, want ErrBadTrace at line 3", bad, err)
		}
	}
	// A key refused for its spelling or for being given twice is named.
	for bad, key := range map[string]string{
		`{"timestamp": 0, "input_length": 600, "input_length": 100, "output_length": 3, "hash_ids": [1]}`: `"input_length" given twice`,
		`{"TIMESTAMP": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`:                   `"TIMESTAMP"`,
	} {
		if _, err := ReadTrace(strings.NewReader(bad)); !errors.Is(err, ErrBadTrace) || !strings.Contains(err.Error(), key) {
			t.Errorf("%s: err %v, want ErrBadTrace naming %s", bad, err, key)
		}
	}
	for _, empty := range []string{"", "\n", "  \n\t\n"} {
		if reqs, err := ReadTrace(strings.NewReader(empty)); !errors.Is(err, ErrBadTrace) {
			t.Errorf("%q: %d rows, err %v, want ErrBadTrace", empty, len(reqs), err)
		}
	}
	// Every shared trace still loads, all its rows.
	for name, rows := range map[string]int{"mooncake_synthetic_trace.jsonl": 3993, "mooncake_arxiv_trace_first1000.jsonl": 1000} {
		reqs, err := LoadTrace("../traces/" + name)
		if err != nil || len(reqs) != rows {
			t.Errorf("%s: %d rows, err %v; want %d", name, len(reqs), err, rows)
		}
	}
}

// TestFitsCannotWrap: a request far larger than a worker's cache never
// fits, however large (prompt + output wrapped negative and fit).
func TestFitsCannotWrap(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 4, BlockSize: 16})
	if e.Fits(20, math.MaxInt64-10) || e.Fits(math.MaxInt64-10, 1) {
		t.Fatal("a request past the cache fits")
	}
	if !e.Fits(20, 40) {
		t.Fatal("a request of 60 tokens does not fit 64")
	}
}

func FuzzReadTrace(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`))
	f.Add([]byte(`{"timestamp": 1, "input_length": 1, "output_length": 0, "hash_ids": [18446744073709551615]}` + "\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		reqs, err := ReadTrace(strings.NewReader(string(b)))
		if err != nil {
			return
		}
		e := Expander{BlockSize: 16}
		for i := range reqs {
			if reqs[i].InputLength > 1<<16 {
				continue // keep each run cheap
			}
			local, seq := e.Blocks(&reqs[i])
			if len(local) != reqs[i].InputLength/16 || len(seq) != len(local) {
				t.Fatalf("%d tokens gave %d blocks", reqs[i].InputLength, len(local))
			}
		}
	})
}

// FuzzReadTraceRowsKeepTheirBounds: every row ReadTrace accepts keeps the
// bounds it documents (1..MaxTraceTokens tokens in, 0..MaxTraceTokens
// out, 0..MaxTraceTimestampMs ms, ceil(in/512) ids, timestamps not going
// backwards). FuzzReadTrace checks only that accepted rows expand; with the
// `q.OutputLength < 0` check deleted from parseRow every existing test
// passed, and a v1 replay then finished a request before its prefill
// (a review's gap, 2bf7727).
func FuzzReadTraceRowsKeepTheirBounds(f *testing.F) {
	f.Add(`{"timestamp": 0, "input_length": 600, "output_length": -3, "hash_ids": [1, 2]}`)
	f.Add(`{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}` + "\n" +
		`{"timestamp": 7, "input_length": 1, "output_length": 0, "hash_ids": [9]}`)
	f.Add(`{"timestamp": -1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}`)
	f.Add(`{"timestamp": 0, "input_length": -600, "output_length": 3, "hash_ids": []}`)
	f.Fuzz(func(t *testing.T, s string) {
		reqs, err := ReadTrace(strings.NewReader(s))
		if err != nil {
			return
		}
		for i, q := range reqs {
			if q.InputLength < 1 || q.InputLength > MaxTraceTokens || q.OutputLength < 0 || q.OutputLength > MaxTraceTokens ||
				q.TimestampMs < 0 || q.TimestampMs > MaxTraceTimestampMs ||
				len(q.HashIDs) != (q.InputLength+TraceBlockTokens-1)/TraceBlockTokens ||
				(i > 0 && q.TimestampMs < reqs[i-1].TimestampMs) {
				t.Fatalf("row %d accepted out of bounds: %+v", i, q)
			}
		}
	})
}

func TestExpanderSharesBlocksWhereIDsAgree(t *testing.T) {
	e := Expander{BlockSize: 16}
	a := Request{InputLength: 1024 + 100, HashIDs: []uint64{7, 8, 9}}
	b := Request{InputLength: 1024, HashIDs: []uint64{7, 8}}
	c := Request{InputLength: 1024, HashIDs: []uint64{7, 5}}
	la, _ := e.Blocks(&a)
	la = append([]uint64(nil), la...)
	lb, _ := e.Blocks(&b)
	lb = append([]uint64(nil), lb...)
	lc, _ := e.Blocks(&c)
	if len(la) != (1024+100)/16 || len(lb) != 64 {
		t.Fatalf("block counts %d %d", len(la), len(lb))
	}
	for i := 0; i < 64; i++ {
		if la[i] != lb[i] {
			t.Fatalf("block %d differs where the ids agree", i)
		}
	}
	if lc[31] != lb[31] || lc[32] == lb[32] {
		t.Fatal("blocks must agree inside id 7 and differ inside ids 8 vs 5")
	}
}

// TestPrepareRefusesTooFewHashIDs: a request built by hand (ReadTrace
// refuses such a row) with fewer hash ids than its prompt needs made the
// Expander index past its ids: Prepare panicked (index out of range [2]
// with length 2). It fails with ErrBadTrace naming the request; more ids
// than needed are ignored, as before.
func TestPrepareRefusesTooFewHashIDs(t *testing.T) {
	reqs := []Request{
		{InputLength: 1024, OutputLength: 1, HashIDs: []uint64{1, 2}},
		{InputLength: 1100, OutputLength: 1, HashIDs: []uint64{1, 2}},
	}
	pr, err := Prepare(reqs, 16)
	if !errors.Is(err, ErrBadTrace) || !strings.Contains(err.Error(), "request 1") || pr != nil {
		t.Fatalf("Prepare: %v, err %v; want no trace and ErrBadTrace naming request 1", pr, err)
	}
	reqs[1].HashIDs = []uint64{1, 2, 3, 4}
	if pr, err = Prepare(reqs, 16); err != nil || len(pr.Local[1]) != 1100/16 {
		t.Fatalf("with ids to spare: err %v, want %d blocks of request 1", err, 1100/16)
	}
}

// recorder collects a cache's events.
type recorder struct{ evs []kvevent.Event }

func (r *recorder) emit(ev *kvevent.Event) {
	c := *ev
	c.Blocks = append([]kvevent.Block(nil), ev.Blocks...)
	c.Removed = append([]uint64(nil), ev.Removed...)
	r.evs = append(r.evs, c)
}

func seqOf(ids ...uint64) (local, seq []uint64) {
	local = ids
	return local, kvevent.SequenceHashes(nil, local)
}

func TestCacheEvictsLeastRecentLeafFirst(t *testing.T) {
	var rec recorder
	c := NewCache(RankOf(0), 4, rec.emit)
	la, sa := seqOf(1, 2, 3)
	n := c.Acquire(la, sa)
	c.Release(sa, n)
	lb, sb := seqOf(9)
	n = c.Acquire(lb, sb)
	c.Release(sb, n)
	// Full (4 blocks). A new block evicts the LRU leaf: block 3 of the
	// older chain, not its parents, and not 9 (newer).
	lc, sc := seqOf(5)
	n = c.Acquire(lc, sc)
	if c.Match(sa) != 2 || c.Match(sb) != 1 {
		t.Fatalf("after eviction: chain a matches %d (want 2), b %d (want 1)", c.Match(sa), c.Match(sb))
	}
	last := rec.evs[len(rec.evs)-2]
	if last.Kind != kvevent.KindRemoved || len(last.Removed) != 1 || last.Removed[0] != sa[2] {
		t.Fatalf("expected a remove of the leaf of chain a, got %+v", last)
	}
	c.Release(sc, n)
}

func TestCacheNeverEvictsPinnedBlocks(t *testing.T) {
	c := NewCache(RankOf(0), 2, nil)
	la, sa := seqOf(1, 2)
	n := c.Acquire(la, sa) // pinned
	lb, sb := seqOf(3)
	if got := c.Acquire(lb, sb); got != 0 || c.Uncacheable != 1 {
		t.Fatalf("pinned cache took a block: pinned %d, uncacheable %d", got, c.Uncacheable)
	}
	c.Release(sa, n)
	if got := c.Acquire(lb, sb); got != 1 {
		t.Fatalf("after release the block must fit, pinned %d", got)
	}
}

// TestCacheReleaseCountsAsUse: a request's blocks count as used when it
// ends (Release), not when it started, so a long request's prefix is not
// the first to go: it outlives a shorter request that started after it
// and ended before it.
func TestCacheReleaseCountsAsUse(t *testing.T) {
	c := NewCache(RankOf(0), 2, nil)
	la, sa := seqOf(1)
	na := c.Acquire(la, sa) // the long request
	lb, sb := seqOf(9)
	c.Release(sb, c.Acquire(lb, sb)) // a short one, started and ended meanwhile
	c.Release(sa, na)
	lc, sc := seqOf(5)
	c.Release(sc, c.Acquire(lc, sc)) // full: evicts the least recently used
	if c.Match(sa) != 1 || c.Match(sb) != 0 {
		t.Fatalf("the long request's block matches %d (want 1, used last), the short one's %d (want 0, evicted)", c.Match(sa), c.Match(sb))
	}
}

// TestCacheEventsRebuildItsContents feeds a cache's events to a real index
// and checks that the index sees exactly what the cache holds.
func TestCacheEventsRebuildItsContents(t *testing.T) {
	ix := indexer.New(indexer.Config{})
	c := NewCache(RankOf(0), 50, func(ev *kvevent.Event) {
		if err := ix.Apply(ev, 0); err != nil {
			t.Fatal(err)
		}
	})
	e := Expander{BlockSize: 16}
	for i := uint64(0); i < 40; i++ {
		q := Request{InputLength: 512 * 2, HashIDs: []uint64{i % 3, 100 + i}}
		local, seq := e.Blocks(&q)
		n := c.Acquire(local, seq)
		c.Release(seq, n)
	}
	if got, want := ix.Stats().Entries, int64(c.Len()); got != want {
		t.Fatalf("index holds %d blocks, cache %d", got, want)
	}
	if ix.Stats().Counters.UnknownRemoves != 0 || ix.Stats().OrphanEvents != 0 {
		t.Fatalf("cache events did not apply cleanly: %+v", ix.Stats())
	}
}

func TestReplayRouterBeatsRoundRobinOnTrace(t *testing.T) {
	reqs, err := LoadTrace("../traces/mooncake_arxiv_trace_first1000.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	reqs = reqs[:400]
	cfg := Config{Workers: 4, BlockSize: 64, CapacityTokens: 200_000}
	pr := prepare(t, reqs, cfg.BlockSize)
	rr, err := Replay(pr, cfg, &RoundRobin{Workers: 4})
	if err != nil {
		t.Fatal(err)
	}
	router, err := Replay(pr, cfg, NewRouter(4, cfg.BlockSize, indexer.DefaultParams(), 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("round-robin %.3f (imbalance %.2f), router %.3f (imbalance %.2f)", rr.HitRate, rr.Imbalance, router.HitRate, router.Imbalance)
	if router.HitRate <= rr.HitRate {
		t.Fatalf("router hit rate %.3f is not above round-robin's %.3f", router.HitRate, rr.HitRate)
	}
	if rr.Errors+router.Errors != 0 || rr.Requests != 400 {
		t.Fatalf("errors %d/%d, requests %d", rr.Errors, router.Errors, rr.Requests)
	}
	// Deterministic: the same replay gives the same figures.
	again, _ := Replay(pr, cfg, NewRouter(4, cfg.BlockSize, indexer.DefaultParams(), 1))
	if again.CachedTokens != router.CachedTokens || again.TTFTMeanMs != router.TTFTMeanMs {
		t.Fatal("replay is not deterministic")
	}
}

// TestPercentilesAreNearestRank: p50 and p99 are the nearest-rank
// percentiles, s[ceil(q·n) − 1] (they rounded the index down, so the p99
// of two requests was the faster one, and of ten the ninth).
func TestPercentilesAreNearestRank(t *testing.T) {
	seq := func(n int) []float64 {
		xs := make([]float64, n)
		for i := range xs {
			xs[i] = float64(n - i) // unsorted: summarize sorts
		}
		return xs
	}
	for _, c := range []struct {
		n              int
		mean, p50, p99 float64
	}{
		{1, 1, 1, 1},
		{2, 1.5, 1, 2},
		{10, 5.5, 5, 10},
		{100, 50.5, 50, 99},
		{1000, 500.5, 500, 990},
	} {
		mean, p50, p99 := summarize(seq(c.n))
		if mean != c.mean || p50 != c.p50 || p99 != c.p99 {
			t.Errorf("1..%d: mean %g, p50 %g, p99 %g; want %g, %g, %g", c.n, mean, p50, p99, c.mean, c.p50, c.p99)
		}
	}
	if m, p50, p99 := summarize(nil); m != 0 || p50 != 0 || p99 != 0 {
		t.Errorf("no values: %g %g %g", m, p50, p99)
	}
}

// finishClock routes everything to worker 0 and records when each
// request finishes.
type finishClock struct {
	RoundRobin
	at map[string]int64
}

func (p *finishClock) Finished(id string, now int64) { p.at[id] = now }

// TestBenchLineTellsAClosedLoopFromOpenLoop: a closed-loop timed replay
// (TimedConfig.Concurrency) ignores the arrival speed, yet its BENCH line
// said speed=1 and nothing of the concurrency: it read exactly as an
// open-loop replay at 1x with the same figures. It says concurrency=N
// instead of speed=, with offload tiers too.
func TestBenchLineTellsAClosedLoopFromOpenLoop(t *testing.T) {
	open := Result{Policy: "router", Mode: ModeTimed, Speed: 1, Offered: 10, Requests: 10, HitRate: 0.3, Seed: 1}
	closed := open
	closed.Concurrency = 64
	offOpen, offClosed := open, closed
	offOpen.Offload, offClosed.Offload = &OffloadStats{}, &OffloadStats{}
	for _, c := range []struct {
		r          Result
		want, deny string
	}{
		{open, " speed=1 seed=1", "concurrency="},
		{closed, " concurrency=64 seed=1", "speed="},
		{offOpen, " speed=1 seed=1", "concurrency="},
		{offClosed, " concurrency=64 seed=1", "speed="},
	} {
		if l := BenchLine("synthetic", c.r); !strings.HasSuffix(l, c.want) || strings.Contains(l, c.deny) {
			t.Errorf("concurrency %d, offload %t: %s\nwant it to end with %q, without %q", c.r.Concurrency, c.r.Offload != nil, l, c.want, c.deny)
		}
	}
}

// TestBenchLineNamesItsModel: a v1 replay and a timed replay of one
// trace at one speed and seed are different models with different
// figures, but BenchLine gave both "BENCH sim.<trace>.<policy> …
// speed=1 seed=1": a v1 line passed for the timed figure of the same name
// (docs/benchmarks.md keeps sim.synthetic.* lines of timed replays), as a
// closed-loop line passed for an open-loop one before
// TestBenchLineTellsAClosedLoopFromOpenLoop. Every line, the ceiling's
// too, says model=v1, timed or cache.
func TestBenchLineNamesItsModel(t *testing.T) {
	reqs := loadTrace(t, "mooncake_synthetic_trace.jsonl")[:100]
	v1, err := Replay(prepare(t, reqs, 16), Config{Workers: 2}, &RoundRobin{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	tm, err := RunTimed(prepare(t, reqs, 64), TimedConfig{Workers: 2}, &RoundRobin{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	v1.Seed, tm.Seed = 1, 1
	// The line's identity: its name and the fields that say how it ran.
	id := func(line string) string {
		f := strings.Fields(line)
		out := []string{f[1]}
		for _, kv := range f[2:] {
			if k, _, _ := strings.Cut(kv, "="); k == "speed" || k == "concurrency" || k == "seed" || k == "model" {
				out = append(out, kv)
			}
		}
		return strings.Join(out, " ")
	}
	a, b := BenchLine("synthetic", v1), BenchLine("synthetic", tm)
	if id(a) == id(b) {
		t.Fatalf("a v1 and a timed replay print the same BENCH name and load, with different figures:\n  v1:    %s\n  timed: %s", a, b)
	}
	cache, err := RunCacheOnly(prepare(t, reqs, 512), CacheConfig{Workers: 2}, &RoundRobin{Workers: 2})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		r     Result
		model string
	}{
		{v1, "v1"}, {tm, "timed"}, {cache, "cache"},
		{Ceiling(prepare(t, reqs, 16), "v1"), "v1"}, {Ceiling(prepare(t, reqs, 64), ModeTimed), "timed"}, {Ceiling(prepare(t, reqs, 512), ModeCache), "cache"},
	} {
		if l := BenchLine("synthetic", c.r); !slices.Contains(strings.Fields(l), "model="+c.model) {
			t.Errorf("%s, mode %s: %s\nwant model=%s in it", c.r.Policy, c.r.Mode, l, c.model)
		}
	}
}

// TestTraceLabelNamesOnlyTheSharedTraces: TraceLabel names
// mooncake_synthetic_trace.jsonl "synthetic" and
// mooncake_arxiv_trace_first1000.jsonl "arxiv", else the file's base name.
// Any file whose name contained "synthetic" or "arxiv" got those labels
// too, so a generated trace's BENCH lines (sim.synthetic.router …) passed
// for the Mooncake trace's.
func TestTraceLabelNamesOnlyTheSharedTraces(t *testing.T) {
	for path, want := range map[string]string{
		"traces/mooncake_synthetic_trace.jsonl":      "synthetic",
		"/x/mooncake_arxiv_trace_first1000.jsonl":    "arxiv",
		"/tmp/chat_synthetic_sessions.jsonl":         "chat_synthetic_sessions",
		"/tmp/arxiv_full.jsonl":                      "arxiv_full",
		"/tmp/mooncake_synthetic_trace_sample.jsonl": "mooncake_synthetic_trace_sample",
	} {
		if got := TraceLabel(path); got != want {
			t.Errorf("TraceLabel(%q) = %q, want %q", path, got, want)
		}
	}
}

// TestV1DecodeLoadAndRejections: a v1 request decodes at the KV use of
// the blocks in-flight requests pin, not counting a finished request's
// cached blocks (it decoded as if they were in use); a routing error counts
// as rejected (v1 counted only errors, so its BENCH line said rejected=0);
// the served requests' TTFTs are kept for the plot.
func TestV1DecodeLoadAndRejections(t *testing.T) {
	reqs := []Request{
		{TimestampMs: 0, InputLength: 1024, OutputLength: 1, HashIDs: []uint64{1, 2}},
		{TimestampMs: 10_000, InputLength: 512, OutputLength: 100, HashIDs: []uint64{3}},
	}
	cfg := Config{Workers: 1, BlockSize: 16, CapacityTokens: 1600}
	p := &finishClock{RoundRobin: RoundRobin{Workers: 1}, at: map[string]int64{}}
	r, err := Replay(prepare(t, reqs, 16), cfg, p)
	if err != nil {
		t.Fatal(err)
	}
	tm := DefaultTiming()
	want := tm.PrefillMs(512) + 100*tm.DecodeStepMs(0) // the first request's 64 blocks are cached, not in use
	if got := float64(p.at["1"]-10_000*1e6) / 1e6; math.Abs(got-want) > 0.01 {
		t.Fatalf("second request took %.2f ms, want %.2f (decode at KV use 0; at 64 %% it would take %.2f)",
			got, want, tm.PrefillMs(512)+100*tm.DecodeStepMs(0.64))
	}
	if len(r.TTFTMs) != 2 {
		t.Fatalf("%d TTFTs kept, want 2", len(r.TTFTMs))
	}

	var picky []Request
	for i := 0; i < 4; i++ {
		picky = append(picky, Request{TimestampMs: int64(i), InputLength: 512, OutputLength: 1, HashIDs: []uint64{uint64(i)}})
	}
	r, err = Replay(prepare(t, picky, 16), Config{Workers: 2, BlockSize: 16}, &pickyPolicy{})
	if err != nil {
		t.Fatal(err)
	}
	if r.Errors != 2 || r.Rejected != 2 || r.Requests != 2 || !strings.Contains(BenchLine("t", r), " rejected=2 served=0.5000 ") {
		t.Fatalf("v1 with 2 routing errors: %d errors, %d rejected, %d served; %s", r.Errors, r.Rejected, r.Requests, BenchLine("t", r))
	}
}

// downPolicy fails every route, as a live policy's cluster that answers
// each with an error.
type downPolicy struct{ RoundRobin }

func (p *downPolicy) Route(*RouteQuery, int64) (int, int, error) { return 0, 0, errors.New("down") }

// TestV1ProgressCountsFailedRoutes: Config.Progress is called after every
// request, one whose route failed included. From a review: the failed
// ones were skipped, so kvsim's live progress bar and summary froze while
// the cluster refused routes.
func TestV1ProgressCountsFailedRoutes(t *testing.T) {
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 10, Seed: 1}), 16)
	last, calls := 0, 0
	r, err := Replay(pr, Config{Workers: 2, Progress: func(done, _ int) { last, calls = done, calls+1 }}, &downPolicy{RoundRobin{Workers: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if calls != 10 || last != 10 || r.Errors != 10 {
		t.Fatalf("Progress called %d times, last done=%d, for 10 requests whose routes all failed (%d errors); want 10 and 10", calls, last, r.Errors)
	}
}

// TestV1RefusesARouterOfAnotherBlockSize: the v1 replay refuses a policy
// that counts in another block size than its engines', as the timed and
// cache-only replays do (ErrBadConfig). From a review: it took a 64-token
// router on 16-token workers, whose predictions then meant nothing.
func TestV1RefusesARouterOfAnotherBlockSize(t *testing.T) {
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 50, Seed: 1}), 16)
	r, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, NewRouter(2, 64, indexer.DefaultParams(), 1))
	if !errors.Is(err, ErrBadConfig) {
		t.Fatalf("a 64-token router on 16-token workers: err %v (predicted %d cached tokens, workers held %d), want ErrBadConfig",
			err, r.PredictedCachedTokens, r.CachedTokens)
	}
}
