package compat

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestBenchCompatQuery: POST /query_by_hash (the standard KV-indexer API,
// JSON) against the native POST /v1/route (JSON) with the same content
// hashes, on one single-node cluster, the same index and the same HTTP
// client, in the same run. The index is filled through POST /register and
// POST /events: instances × dp rank 0 of block size 16, prompts of 8–64
// blocks, each a shared family prefix (4–32 blocks, popular families more
// often) plus a private suffix. Most queries share a cached prefix (85 %
// a stored prompt's prefix, 10 % a family prefix, each padded with blocks
// nobody holds; 5 % nothing cached).
//
// The two sides run as closed loops of the same client goroutines over
// keep-alive connections, alternating A B / B A in short rounds so that
// the machine's noise falls on both; each side reports the median round's
// throughput and the median round's p99 (the median of the rounds' own
// ratios is logged beside it). ratio = qps / native_qps (the
// target is ≥ 0.9: the compatible surface costs at most 10 % of the
// native route's throughput). Before measuring, a sample of queries is
// checked: each compat answer must agree with the native decision's
// candidates on every rank's matched prefix and so on which instances have
// the longest match. Any non-200 answer while measuring fails the test.
//
// Content hashes are drawn below 2^63, so that the request bodies carry
// the same numbers in both APIs (compat writes hashes signed, /v1 reads
// them unsigned); the bodies differ only by compat's "model_name".
//
//	KVROUTER_BENCH_COMPAT_INSTANCES  registered instances (default 16)
//	KVROUTER_BENCH_COMPAT_PROMPTS    prompts stored in the index (default 4000)
//	KVROUTER_BENCH_COMPAT_QUERIES    distinct query bodies (default 2048)
//	KVROUTER_BENCH_COMPAT_CLIENTS    client goroutines (default 4)
//	KVROUTER_BENCH_COMPAT_ROUNDS     rounds of one phase per side (default 12)
//	KVROUTER_BENCH_COMPAT_PHASE_MS   length of each phase in ms (default 750)
func TestBenchCompatQuery(t *testing.T) {
	benchenv.Skip(t, "bench-compat")
	seed := benchenv.Seed(t, 20261207)
	instances := benchenv.Int("KVROUTER_BENCH_COMPAT_INSTANCES", 16)
	prompts := benchenv.Int("KVROUTER_BENCH_COMPAT_PROMPTS", 4000)
	nQueries := benchenv.Int("KVROUTER_BENCH_COMPAT_QUERIES", 2048)
	clients := benchenv.Int("KVROUTER_BENCH_COMPAT_CLIENTS", 4)
	rounds := benchenv.Int("KVROUTER_BENCH_COMPAT_ROUNDS", 12)
	phase := time.Duration(benchenv.Int("KVROUTER_BENCH_COMPAT_PHASE_MS", 750)) * time.Millisecond
	const (
		model     = "llama"
		blockSize = 16
		families  = 64
	)

	n := startNode(t)
	tr := &http.Transport{MaxIdleConns: clients, MaxIdleConnsPerHost: clients, DisableCompression: true}
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	t.Cleanup(tr.CloseIdleConnections) // before the node's cleanup (LIFO)

	// The instances post their events (agentless false): an agentless
	// one's come from its engine, and a post is a 409.
	for i := 1; i <= instances; i++ {
		r := benchPost(t, hc, n.url+"/register", RegisterRequest{InstanceID: uint64(i), ModelName: model,
			BlockSize: blockSize, Endpoint: fmt.Sprintf("tcp://10.0.%d.%d:5557", i/256, i%256), Agentless: ptr(false)}, nil)
		if r != http.StatusCreated {
			t.Fatalf("register instance %d: status %d", i, r)
		}
	}

	// The index.
	start := time.Now()
	rng := rand.New(rand.NewPCG(seed, 1))
	fresh := func() uint64 { return rng.Uint64() >> 1 } // < 2^63: the same number on both APIs
	fams := make([][]uint64, families)
	for f := range fams {
		for range 4 + rng.IntN(29) {
			fams[f] = append(fams[f], fresh())
		}
	}
	family := func() int { u := rng.Float64(); return int(u * u * families) } // popular ones more often
	type storedPrompt struct {
		inst   int
		fam    int
		locals []uint64
	}
	type instState struct {
		nextID  uint64
		held    map[int]bool
		pending []Event
	}
	insts := make([]*instState, instances+1)
	for i := 1; i <= instances; i++ {
		insts[i] = &instState{nextID: 1, held: map[int]bool{}}
	}
	var storedPrompts []storedPrompt
	var blocks, posts int
	flush := func(i int) {
		st := insts[i]
		if len(st.pending) == 0 {
			return
		}
		var resp EventsResponse
		code := benchPost(t, hc, n.url+"/events", EventsRequest{InstanceID: uint64(i), ModelName: model, Events: st.pending}, &resp)
		if code != http.StatusOK || len(resp.Acks) != 1 || resp.Acks[0].Gap || resp.Acks[0].Applied != len(st.pending) {
			t.Fatalf("events of instance %d: status %d, acks %+v, want %d applied", i, code, resp.Acks, len(st.pending))
		}
		posts++
		st.pending = st.pending[:0]
	}
	for range prompts {
		i := 1 + rng.IntN(instances)
		f := family()
		fam := fams[f]
		total := max(8, min(64, len(fam)+4+rng.IntN(29)))
		locals := slices.Clone(fam[:min(len(fam), total)])
		for len(locals) < total {
			locals = append(locals, fresh())
		}
		seq := kvevent.SequenceHashes(nil, locals)
		st := insts[i]
		from := 0
		if st.held[f] && len(fam) < total {
			from = len(fam) // the family prefix is there: store the suffix only
		}
		st.held[f] = true
		ev := Event{EventID: st.nextID, Type: typeStored, Medium: "GPU"}
		if from > 0 {
			ev.ParentHash = hp(Hash(seq[from-1]))
		}
		for j := from; j < total; j++ {
			ev.Blocks = append(ev.Blocks, Block{BlockHash: Hash(seq[j]), TokensHash: Hash(locals[j])})
		}
		st.nextID++
		blocks += len(ev.Blocks)
		st.pending = append(st.pending, ev)
		if len(st.pending) >= 64 {
			flush(i)
		}
		storedPrompts = append(storedPrompts, storedPrompt{inst: i, fam: f, locals: locals})
	}
	for i := 1; i <= instances; i++ {
		flush(i)
	}
	t.Logf("index: %d prompts, %d stored blocks on %d instances (block size %d) through %d POST /events, built in %v",
		prompts, blocks, instances, blockSize, posts, time.Since(start).Round(time.Millisecond))

	// The queries, as two bodies of the same hashes.
	qrng := rand.New(rand.NewPCG(seed, 2))
	qfresh := func() uint64 { return qrng.Uint64() >> 1 }
	queries := make([][]uint64, nQueries)
	compatBodies := make([][]byte, nQueries)
	nativeBodies := make([][]byte, nQueries)
	var qBlocks int
	for k := range queries {
		total := 16 + qrng.IntN(49)
		var q []uint64
		switch u := qrng.Float64(); {
		case u < 0.85: // a stored prompt's prefix
			sp := storedPrompts[qrng.IntN(len(storedPrompts))]
			lo := min(len(fams[sp.fam]), len(sp.locals))
			cut := lo + qrng.IntN(len(sp.locals)-lo+1)
			q = slices.Clone(sp.locals[:cut])
		case u < 0.95: // a family prefix only
			q = slices.Clone(fams[family()])
		}
		for len(q) < total {
			q = append(q, qfresh())
		}
		queries[k] = q
		qBlocks += len(q)
		hs := make([]Hash, len(q))
		for j, h := range q {
			hs[j] = Hash(h)
		}
		var err error
		if compatBodies[k], err = json.Marshal(QueryByHashRequest{BlockHashes: hs, ModelName: model}); err != nil {
			t.Fatal(err)
		}
		if nativeBodies[k], err = json.Marshal(api.RouteRequest{BlockHashes: q}); err != nil {
			t.Fatal(err)
		}
	}
	compatURL, nativeURL := n.url+"/query_by_hash", n.url+"/v1/route"

	// Correctness: a sample of compat answers against the native decision.
	instOf := map[uint64]uint64{} // kvrouter worker id → instance
	for i := 1; i <= instances; i++ {
		instOf[WorkerID(uint64(i), model, DefaultTenant)] = uint64(i)
	}
	var checked, hits int
	var cBytes, nBytes int
	for k := 0; k < nQueries; k += max(1, nQueries/256) {
		var cr QueryResponse
		var nr api.RouteResponse
		if code := benchPostRaw(t, hc, compatURL, compatBodies[k], &cr, &cBytes); code != http.StatusOK {
			t.Fatalf("query %d: POST /query_by_hash: status %d", k, code)
		}
		if code := benchPostRaw(t, hc, nativeURL, nativeBodies[k], &nr, &nBytes); code != http.StatusOK {
			t.Fatalf("query %d: POST /v1/route: status %d", k, code)
		}
		if len(nr.Candidates) != instances {
			t.Fatalf("query %d: native answer has %d candidates, want %d", k, len(nr.Candidates), instances)
		}
		native := map[string]int{} // instance → matched tokens, matched ranks only
		best, nBest := 0, []string(nil)
		for _, c := range nr.Candidates {
			inst, ok := instOf[c.WorkerID]
			if !ok {
				t.Fatalf("query %d: native candidate worker %#x is no registered instance", k, c.WorkerID)
			}
			tok := int(c.Overlap.Total()) * blockSize
			if tok == 0 {
				continue
			}
			s := strconv.FormatUint(inst, 10)
			native[s] = tok
			switch {
			case tok > best:
				best, nBest = tok, []string{s}
			case tok == best:
				nBest = append(nBest, s)
			}
		}
		cbest, cBest := 0, []string(nil)
		for s, o := range cr.Instances {
			switch {
			case o.LongestMatched > cbest:
				cbest, cBest = o.LongestMatched, []string{s}
			case o.LongestMatched == cbest:
				cBest = append(cBest, s)
			}
		}
		slices.Sort(nBest)
		slices.Sort(cBest)
		if best != cbest || !slices.Equal(nBest, cBest) {
			t.Fatalf("query %d (%d blocks): longest match: compat instances %v with %d tokens, native %v with %d tokens",
				k, len(queries[k]), cBest, cbest, nBest, best)
		}
		for s, tok := range native {
			if got := cr.Scores[s]["0"]; got != tok {
				t.Fatalf("query %d: instance %s: compat score %d tokens, native overlap %d tokens", k, s, got, tok)
			}
		}
		if len(cr.Scores) != len(native) {
			t.Fatalf("query %d: compat scores %d instances, native matches %d", k, len(cr.Scores), len(native))
		}
		checked++
		if best > 0 {
			hits++
		}
	}
	if hits*10 < checked*8 {
		t.Fatalf("only %d of %d sampled queries match a cached prefix: the workload is wrong", hits, checked)
	}
	t.Logf("checked %d queries (%d with a cached prefix): compat and native agree; answers %d vs %d bytes on average",
		checked, hits, cBytes/checked, nBytes/checked)

	// The measurement: warm-up, then A B / B A rounds.
	d := benchDriver{hc: hc, clients: clients}
	for _, u := range []string{compatURL, nativeURL} {
		bodies := compatBodies
		if u == nativeURL {
			bodies = nativeBodies
		}
		if r := d.drive(u, bodies, phase/4); r.err != nil {
			t.Fatal(r.err)
		}
	}
	var compat, native []benchResult
	for k := range rounds {
		sides := []bool{true, false}
		if k%2 == 1 {
			sides = []bool{false, true}
		}
		for _, isCompat := range sides {
			if isCompat {
				compat = append(compat, d.drive(compatURL, compatBodies, phase))
			} else {
				native = append(native, d.drive(nativeURL, nativeBodies, phase))
			}
		}
	}
	for k := range rounds {
		for _, r := range []benchResult{compat[k], native[k]} {
			if r.err != nil {
				t.Fatal(r.err)
			}
			if r.non200 > 0 {
				t.Fatalf("%s: %d of %d answers were not 200 (first: %s)", r.url, r.non200, r.n+r.non200, r.firstBad)
			}
		}
		t.Logf("round %d: compat %s; native %s", k, compat[k], native[k])
	}
	cq, cp := benchMedians(compat)
	nq, np := benchMedians(native)
	paired := make([]float64, rounds)
	for k := range rounds {
		paired[k] = compat[k].qps() / native[k].qps()
	}
	slices.Sort(paired)
	t.Logf("median of the rounds' ratios %.3f (min %.3f, max %.3f)", paired[rounds/2], paired[0], paired[rounds-1])
	t.Logf("%d instances, %d stored blocks, %d queries of %.1f blocks on average, %d clients, %d rounds of %v per side",
		instances, blocks, nQueries, float64(qBlocks)/float64(nQueries), clients, rounds, phase)
	fmt.Printf("BENCH compat.query qps=%.0f p99_us=%.0f native_qps=%.0f native_p99_us=%.0f ratio=%.3f\n",
		cq, cp, nq, np, cq/nq)
}

// benchPost posts v as JSON and decodes a 2xx answer into out (when not nil).
func benchPost(t *testing.T, hc *http.Client, url string, v, out any) int {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	return benchPostRaw(t, hc, url, b, out, &n)
}

// benchPostRaw posts body and decodes a 2xx answer into out (when not
// nil); it adds the answer's length to *size.
func benchPostRaw(t *testing.T, hc *http.Client, url string, body []byte, out any, size *int) int {
	t.Helper()
	resp, err := hc.Post(url, contentJSON, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	*size += len(b)
	if resp.StatusCode/100 != 2 {
		t.Logf("POST %s: %s: %s", url, resp.Status, b)
		return resp.StatusCode
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			t.Fatalf("POST %s: answer %q: %v", url, b, err)
		}
	}
	return resp.StatusCode
}

// benchDriver sends requests as fast as its clients can (a closed loop),
// through one shared client and its keep-alive connections.
type benchDriver struct {
	hc      *http.Client
	clients int
}

type benchResult struct {
	url      string
	n        int // 200 answers
	non200   int
	firstBad string
	elapsed  time.Duration
	lat      []time.Duration // of the 200 answers, sorted
	err      error           // a transport error
}

func (r benchResult) qps() float64 { return float64(r.n) / r.elapsed.Seconds() }

func (r benchResult) pct(p float64) float64 {
	if len(r.lat) == 0 {
		return 0
	}
	return float64(r.lat[int(float64(len(r.lat)-1)*p)].Nanoseconds()) / 1e3
}

func (r benchResult) String() string {
	return fmt.Sprintf("%d in %v = %.0f/s, p50 %.0fµs p99 %.0fµs", r.n, r.elapsed.Round(time.Millisecond),
		r.qps(), r.pct(0.5), r.pct(0.99))
}

// drive posts bodies round-robin from d.clients goroutines for dur.
// Latency is from the send to the last byte of the answer.
func (d benchDriver) drive(url string, bodies [][]byte, dur time.Duration) benchResult {
	var (
		next, bad atomic.Int64
		wg        sync.WaitGroup
		mu        sync.Mutex
		all       []time.Duration
		firstBad  string
		firstErr  error
	)
	start := time.Now()
	end := start.Add(dur)
	for range d.clients {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 1<<14)
			defer func() {
				mu.Lock()
				all = append(all, lat...)
				mu.Unlock()
			}()
			for time.Now().Before(end) {
				i := next.Add(1) - 1
				t0 := time.Now()
				resp, err := d.hc.Post(url, contentJSON, bytes.NewReader(bodies[int(i)%len(bodies)]))
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("POST %s: %w", url, err)
					}
					mu.Unlock()
					return
				}
				var b []byte
				if resp.StatusCode != http.StatusOK {
					b, err = io.ReadAll(resp.Body)
				} else {
					_, err = io.Copy(io.Discard, resp.Body)
				}
				resp.Body.Close()
				el := time.Since(t0)
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("POST %s: reading the answer: %w", url, err)
					}
					mu.Unlock()
					return
				}
				if resp.StatusCode != http.StatusOK {
					if bad.Add(1) == 1 {
						mu.Lock()
						firstBad = fmt.Sprintf("%s: %s", resp.Status, b)
						mu.Unlock()
					}
					continue
				}
				lat = append(lat, el)
			}
		})
	}
	wg.Wait()
	slices.Sort(all)
	return benchResult{url: url, n: len(all), non200: int(bad.Load()), firstBad: firstBad,
		elapsed: time.Since(start), lat: all, err: firstErr}
}

// benchMedians returns the median round's throughput and the median of the
// rounds' p99 latencies in µs.
func benchMedians(rs []benchResult) (qps, p99 float64) {
	q := make([]float64, len(rs))
	p := make([]float64, len(rs))
	for i, r := range rs {
		q[i], p[i] = r.qps(), r.pct(0.99)
	}
	slices.Sort(q)
	slices.Sort(p)
	return q[len(q)/2], p[len(p)/2]
}

// TestBenchMediansTakesEachFiguresMedian: compat.query's qps and p99_us are
// the median of the rounds' throughputs and, apart, the median of their
// p99 latencies (here from another round than the median throughput's),
// neither a round's as it came nor the best or worst.
func TestBenchMediansTakesEachFiguresMedian(t *testing.T) {
	round := func(n int, p99 time.Duration) benchResult {
		return benchResult{n: n, elapsed: time.Second, lat: []time.Duration{p99}}
	}
	rs := []benchResult{
		round(300, 20*time.Microsecond),
		round(100, 30*time.Microsecond),
		round(200, 10*time.Microsecond),
	}
	if qps, p99 := benchMedians(rs); qps != 200 || p99 != 20 {
		t.Errorf("benchMedians of rounds at 300, 100, 200/s with p99 20, 30, 10µs = %v/s, %vµs; want 200/s, 20µs", qps, p99)
	}
}
