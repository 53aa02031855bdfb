package benchcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestBenchClusterRoute: route decisions (POST /v1/route, 128 block
// hashes per request) served by a node's api.Server over loopback HTTP,
// against an index of 64 registered workers holding about a million
// blocks. A few client goroutines offer a fixed rate (5000/s) and then
// send as fast as they can (closed loop); the baseline is an http.Handler
// that reads the request and answers a constant body of the same size as
// a route answer, driven the same way in the same run (the transport
// ceiling). The node is a single-node cluster (a route is a local read on
// any node); client and server share the machine's cores.
//
//	KVROUTER_BENCH_ROUTE_BLOCKS    blocks in the index (default 1000000)
//	KVROUTER_BENCH_ROUTE_RATE      offered rate per second (default 5000)
//	KVROUTER_BENCH_ROUTE_SECONDS   length of each of the four phases, in 3 interleaved rounds (default 6)
//	KVROUTER_BENCH_ROUTE_CLIENTS   client goroutines (default 8)
//	KVROUTER_BENCH_ROUTE_EXPLAIN   1: full answers with every candidate's score (default 0: brief answers, as a router asks)
func TestBenchClusterRoute(t *testing.T) {
	benchenv.Skip(t, "bench-cluster")
	seed := benchenv.Seed(t, 20261205)
	const workers, requestBlocks = 64, 128
	targetBlocks := int64(benchenv.Int("KVROUTER_BENCH_ROUTE_BLOCKS", 1_000_000))
	rate := float64(benchenv.Int("KVROUTER_BENCH_ROUTE_RATE", 5000))
	phase := time.Duration(benchenv.Int("KVROUTER_BENCH_ROUTE_SECONDS", 6)) * time.Second
	clients := benchenv.Int("KVROUTER_BENCH_ROUTE_CLIENTS", 8)
	explain := benchenv.Int("KVROUTER_BENCH_ROUTE_EXPLAIN", 0) == 1

	raftAddr, httpAddr := freeAddr(t), freeAddr(t)
	node, err := raftfsm.NewNode(raftfsm.Config{ID: "r1", RaftAddr: raftAddr, HTTPAddr: httpAddr, DataDir: t.TempDir(),
		Peers:  []raftfsm.Member{{ID: "r1", RaftAddr: raftAddr, HTTPAddr: httpAddr}},
		Logger: quiet, ExpiryInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := node.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	var ranks []kvevent.Rank
	for w := uint64(1); w <= workers; w++ {
		if err := node.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: w, BlockSize: 16,
			Capacity: [kvevent.NumTiers]int64{1 << 16}, Endpoint: fmt.Sprintf("10.0.0.%d:8000", w)}); err != nil {
			t.Fatal(err)
		}
		ranks = append(ranks, kvevent.Rank{Worker: w})
	}

	// The index: every rank publishes 16 events of 8 blocks per call.
	start := time.Now()
	g := newGen(seed, 1, ranks)
	for node.IndexStats().Entries < targetBlocks {
		if _, err := node.IngestEvents(ctx, g.call(16)); err != nil {
			t.Fatal(err)
		}
	}
	st := node.IndexStats()
	t.Logf("index: %d blocks, %d tree nodes, %d workers, built in %v", st.Entries, st.Nodes, workers, time.Since(start).Round(time.Millisecond))

	// Requests: 128-block prefixes of stored sequences (a family prefix
	// shared by many ranks, then one rank's suffix), padded with blocks
	// nobody holds.
	rng := rand.New(rand.NewPCG(seed, 2))
	var bodies [][]byte
	for len(bodies) < 4096 {
		s := g.samples[rng.IntN(len(g.samples))]
		q := slices.Clone(s[:min(len(s), requestBlocks)])
		for len(q) < requestBlocks {
			q = append(q, mix(rng.Uint64()))
		}
		b, err := json.Marshal(api.RouteRequest{BlockHashes: q, Brief: !explain})
		if err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, b)
	}

	srv := api.NewServer(node, api.Options{Logger: quiet})
	defer srv.Close()
	routeURL := serve(t, srv) + "/v1/route"

	// One real answer: checked, and the baseline's constant body.
	var sample api.RouteResponse
	constBody := postOnce(t, routeURL, bodies[0], &sample)
	if want := map[bool]int{true: workers, false: 0}[explain]; len(sample.Candidates) != want {
		t.Fatalf("route answer has %d candidates, want %d", len(sample.Candidates), want)
	}
	ceilURL := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(constBody)
	})) + "/v1/route"

	drive(routeURL, bodies, 0, clients, time.Second) // warm up connections and pools
	drive(ceilURL, bodies, 0, clients, time.Second)
	// The four phases interleaved in rounds, so that the machine's noise
	// falls on the route and its baseline alike.
	var paced, ceilPaced, closed, ceilClosed driveResult
	const rounds = 3
	for k := 0; k < rounds; k++ {
		paced.add(drive(routeURL, bodies, rate, clients, phase/rounds))
		ceilPaced.add(drive(ceilURL, bodies, rate, clients, phase/rounds))
		closed.add(drive(routeURL, bodies, 0, clients, phase/rounds))
		ceilClosed.add(drive(ceilURL, bodies, 0, clients, phase/rounds))
	}
	for _, r := range []*driveResult{&paced, &ceilPaced, &closed, &ceilClosed} {
		if r.err != nil {
			t.Fatal(r.err)
		}
		r.finish()
	}
	t.Logf("route: paced %s; closed loop %s", paced, closed)
	t.Logf("ceiling: paced %s; closed loop %s", ceilPaced, ceilClosed)
	t.Logf("request %d bytes, answer %d bytes", len(bodies[0]), len(constBody))
	fmt.Printf("BENCH cluster.route offered_qps=%.0f qps=%.0f p50_us=%.0f p99_us=%.0f ceiling_qps=%.0f ceiling_p99_us=%.0f max_qps=%.0f ratio=%.3f workers=%d blocks=%d request_blocks=%d clients=%d answer_bytes=%d seed=%d\n",
		rate, paced.qps, paced.pct(0.50), paced.pct(0.99), ceilClosed.qps, ceilPaced.pct(0.99), closed.qps, closed.qps/ceilClosed.qps,
		workers, st.Entries, requestBlocks, clients, len(constBody), seed)
}

// serve serves h on a loopback port until the test ends; it returns the base URL.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = hs.Serve(ln) }()
	t.Cleanup(func() { _ = hs.Close() })
	return "http://" + ln.Addr().String()
}

func postOnce(t *testing.T, url string, body []byte, v any) []byte {
	t.Helper()
	resp, err := http.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %s: %s", url, resp.Status, b)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
	return b
}

type driveResult struct {
	n       int
	elapsed time.Duration
	qps     float64
	lat     []time.Duration // sorted
	err     error
}

// add merges another phase's result into r; finish computes the totals.
func (r *driveResult) add(o driveResult) {
	r.n += o.n
	r.elapsed += o.elapsed
	r.lat = append(r.lat, o.lat...)
	if r.err == nil {
		r.err = o.err
	}
}

func (r *driveResult) finish() {
	slices.Sort(r.lat)
	r.qps = float64(r.n) / r.elapsed.Seconds()
}

func (r driveResult) pct(p float64) float64 {
	if len(r.lat) == 0 {
		return 0
	}
	return float64(r.lat[int(float64(len(r.lat)-1)*p)].Nanoseconds()) / 1e3
}

func (r driveResult) String() string {
	return fmt.Sprintf("%d requests in %v = %.0f/s, p50 %.0fµs p99 %.0fµs max %.0fµs",
		r.n, r.elapsed.Round(time.Millisecond), r.qps, r.pct(0.5), r.pct(0.99), r.pct(1))
}

// drive sends bodies round-robin from clients goroutines for d: at rate
// requests per second in all (each request due at start + i/rate, sent
// when due or as soon as a client is free, so that a server slower than
// the rate is driven at its capacity with clients requests in flight), or
// as fast as they can when rate is 0. Latency is from the send to the last
// byte of the answer (not from the due time).
func drive(url string, bodies [][]byte, rate float64, clients int, d time.Duration) driveResult {
	tr := &http.Transport{MaxIdleConnsPerHost: clients, DisableCompression: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	var (
		next    atomic.Int64
		wg      sync.WaitGroup
		mu      sync.Mutex
		all     []time.Duration
		errOnce sync.Once
		firstE  error
	)
	start := time.Now()
	end := start.Add(d)
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, 1<<14)
			defer func() {
				mu.Lock()
				all = append(all, lat...)
				mu.Unlock()
			}()
			for {
				i := next.Add(1) - 1
				if time.Now().After(end) {
					return
				}
				if rate > 0 {
					due := start.Add(time.Duration(float64(i) / rate * float64(time.Second)))
					if due.After(end) {
						return
					}
					if w := time.Until(due); w > 0 {
						time.Sleep(w)
					}
				}
				t0 := time.Now()
				resp, err := hc.Post(url, "application/json", bytes.NewReader(bodies[int(i)%len(bodies)]))
				if err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if err == nil && resp.StatusCode != http.StatusOK {
						err = errors.New(resp.Status)
					}
				}
				if err != nil {
					errOnce.Do(func() { firstE = fmt.Errorf("POST %s: %w", url, err) })
					return
				}
				lat = append(lat, time.Since(t0))
			}
		}()
	}
	wg.Wait()
	r := driveResult{n: len(all), elapsed: time.Since(start), lat: all, err: firstE}
	r.finish()
	return r
}
