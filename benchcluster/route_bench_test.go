package benchcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Micro-benchmarks of the server side of a route decision, without the
// network: what one decision costs in CPU and allocations (run with
// -benchmem). The index is TestBenchClusterRoute's, built once per process
// (KVROUTER_BENCH_ROUTE_BLOCKS, default 300000 here), built again for every
// run of the benchmark function: give a fixed count.
//
//	go test -run '^$' -bench BenchmarkRoute -benchtime 20000x -benchmem ./benchcluster/

func benchRouteEnv(b *testing.B) *routeEnv {
	b.Helper()
	b.StopTimer()
	defer b.StartTimer()
	return newRouteEnv(b, 20261205, int64(benchenv.Int("KVROUTER_BENCH_ROUTE_BLOCKS", 300_000)), false)
}

// discardWriter is a reusable http.ResponseWriter that drops the body.
type discardWriter struct {
	h    http.Header
	code int
	n    int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) WriteHeader(code int)        { w.code = code }
func (w *discardWriter) Write(p []byte) (int, error) { w.n += len(p); return len(p), nil }

// BenchmarkRouteServeHTTP: one brief route decision through the API
// server's handler (middleware, body decode, decision, answer), from an
// in-memory request to an in-memory answer.
func BenchmarkRouteServeHTTP(b *testing.B) {
	env := benchRouteEnv(b)
	srv := api.NewServer(env.node, api.Options{Logger: quiet})
	defer srv.Close()
	w := &discardWriter{h: http.Header{}}
	body := &bytes.Reader{}
	req, err := http.NewRequest(http.MethodPost, "http://kvrouter/v1/route", io.NopCloser(body))
	if err != nil {
		b.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		body.Reset(env.bodies[i%len(env.bodies)])
		clear(w.h)
		w.code = 0
		r := *req // ServeHTTP may set fields of the request (the mux's pattern)
		r.Body = io.NopCloser(body)
		srv.ServeHTTP(w, &r)
		if w.code != 0 && w.code != http.StatusOK {
			b.Fatalf("status %d", w.code)
		}
	}
}

// BenchmarkRouteDecision: the node's decision alone (raftfsm.Node.Route),
// brief, from parsed block hashes; p50 and p99 of the decisions' times
// are reported beside the mean.
func BenchmarkRouteDecision(b *testing.B) { benchRouteDecision(b, false) }

// BenchmarkRouteDecisionDuringIngest: the same while another goroutine
// ingests block events through Raft without pause (16 events of 8 blocks
// per rank and call), so that the FSM's apply holds the index's and the
// load tracker's write locks against the decisions' read locks. Run it
// with -blockprofile to see where the decisions wait. ingest_blocks/s is
// the ingest calls completed while the timer ran, over that time; an
// ingest call that fails fails the benchmark (the decisions would
// otherwise have been measured without the ingest).
func BenchmarkRouteDecisionDuringIngest(b *testing.B) { benchRouteDecision(b, true) }

func benchRouteDecision(b *testing.B, ingest bool) {
	env := benchRouteEnv(b)
	qs := make([]raftfsm.RouteQuery, 0, len(env.bodies))
	for _, body := range env.bodies {
		var req api.RouteRequest
		if err := json.Unmarshal(body, &req); err != nil {
			b.Fatal(err)
		}
		qs = append(qs, raftfsm.RouteQuery{LocalHashes: req.BlockHashes, Brief: true})
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var bg *backgroundIngest
	if ingest {
		calls := make([][]raftfsm.RankBatch, 64)
		for i := range calls {
			calls[i] = env.gen.call(16)
		}
		i := 0
		bg = startIngest(func(ctx context.Context) error {
			// Replays of the same calls are duplicates after the first
			// round: new events each time keep the apply path busy.
			if i >= len(calls) {
				calls[i%len(calls)] = env.gen.call(16)
			}
			_, err := env.node.IngestEvents(ctx, calls[i%len(calls)])
			i++
			return err
		})
		defer bg.stop()
	}
	lat := make([]time.Duration, 0, b.N)
	b.ReportAllocs()
	b.ResetTimer()
	var from int64
	if bg != nil {
		from = bg.calls()
	}
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if _, err := env.node.Route(ctx, qs[i%len(qs)]); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	b.StopTimer()
	if bg != nil {
		// The calls made while the timer ran, over the time it ran.
		n := bg.calls() - from
		if err := bg.stop(); err != nil {
			b.Fatalf("the ingest beside the decisions stopped: %v", err)
		}
		b.ReportMetric(float64(n*64*16*blocksPerEvent)/b.Elapsed().Seconds(), "ingest_blocks/s")
	}
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50_us")
	b.ReportMetric(float64(lat[(len(lat)-1)*99/100].Microseconds()), "p99_us")
}

// backgroundIngest calls an ingest function without pause on a goroutine
// of its own until stopped or until a call fails.
type backgroundIngest struct {
	cancel context.CancelFunc
	done   chan struct{}
	n      atomic.Int64
	err    error // the failed call's; read after done closes
}

func startIngest(call func(ctx context.Context) error) *backgroundIngest {
	ctx, cancel := context.WithCancel(context.Background())
	bg := &backgroundIngest{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(bg.done)
		for ctx.Err() == nil {
			if err := call(ctx); err != nil {
				if ctx.Err() == nil { // not the stop's cancellation
					bg.err = err
				}
				return
			}
			bg.n.Add(1)
		}
	}()
	return bg
}

// calls returns the calls completed so far.
func (bg *backgroundIngest) calls() int64 { return bg.n.Load() }

// stop stops the calls and waits for the goroutine. It returns the error
// of a call that failed before the stop: the ingest had stopped early, and
// a figure measured "during ingest" was not. A second stop does the same.
func (bg *backgroundIngest) stop() error {
	bg.cancel()
	<-bg.done
	return bg.err
}

// TestBackgroundIngestReportsAFailedCall: the ingest beside the route
// decisions reports a call that failed (the benchmark then fails instead
// of measuring decisions with no ingest and still quoting a rate), counts
// only completed calls, and a stop's own cancellation is no failure.
func TestBackgroundIngestReportsAFailedCall(t *testing.T) {
	refused := errors.New("refused")
	n := 0
	bg := startIngest(func(ctx context.Context) error {
		if n++; n == 3 {
			return refused
		}
		return nil
	})
	<-bg.done // it stops by itself at the failed call
	if err := bg.stop(); !errors.Is(err, refused) || bg.calls() != 2 {
		t.Fatalf("stop = %v after %d calls, want %v after 2", err, bg.calls(), refused)
	}

	started := make(chan struct{})
	bg = startIngest(func(ctx context.Context) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	})
	<-started
	if err := bg.stop(); err != nil || bg.calls() != 0 {
		t.Fatalf("stop during a call = %v after %d calls, want nil after 0: the stop's cancellation is not a failure", err, bg.calls())
	}
}
