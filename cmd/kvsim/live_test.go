package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/urfave/cli/v2"
)

// ingestSink is a node agent reduced to its event path: each decoded
// engine batch, numbered, straight into the fake cluster's ingestion.
type ingestSink struct {
	f    *apitest.Fake
	mu   sync.Mutex
	next map[kvevent.Rank]uint64
	errs []string
}

func (s *ingestSink) Events(r kvevent.Rank, _ uint64, evs []kvevent.Event) error {
	if len(evs) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	cp := make([]kvevent.Event, len(evs))
	for i, e := range evs {
		s.next[r]++
		e.EventID = s.next[r]
		e.Blocks, e.Removed = slices.Clone(e.Blocks), slices.Clone(e.Removed)
		cp[i] = e
	}
	acks, err := s.f.IngestEvents(context.Background(), []raftfsm.RankBatch{{Rank: r, Events: cp}})
	if err != nil || len(acks) != 1 || acks[0].Gap || acks[0].Applied != len(cp) {
		s.errs = append(s.errs, fmt.Sprintf("rank %v: acks %+v, %v", r, acks, err))
	}
	return nil
}

func (s *ingestSink) Reset(r kvevent.Rank) { s.note("reset " + r.String()) }
func (s *ingestSink) Resync(r kvevent.Rank, why enginesub.Reason) {
	s.note("resync " + r.String() + " " + string(why))
}
func (s *ingestSink) note(m string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = append(s.errs, m)
}

// fakeCluster serves a fake cluster's API and returns it and its address.
func fakeCluster(t *testing.T) (*apitest.Fake, string) {
	t.Helper()
	return fakeClusterWith(t, api.Options{})
}

// fakeClusterWith is fakeCluster with the server's options opts (a token).
func fakeClusterWith(t *testing.T, opts api.Options) (*apitest.Fake, string) {
	t.Helper()
	f := apitest.New("n1", "")
	opts.Logger = slog.New(slog.DiscardHandler)
	srv := api.NewServer(f, opts)
	hs := httptest.NewServer(srv)
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	addr := strings.TrimPrefix(hs.URL, "http://")
	st := f.Status()
	st.HTTPAddr, st.LeaderHTTP = addr, addr
	f.SetStatus(st)
	return f, addr
}

// A --live replay checks every name of --policies before it touches the
// cluster: an unknown one is a usage error, with no worker registered and
// no route booked (it was found only after the live replay had run).
func TestLiveReplayChecksPoliciesBeforeTouchingTheCluster(t *testing.T) {
	f, addr := fakeCluster(t)
	_, err := kvsim(t, "replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", "2", "--policies", "router,oracle")
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 {
		t.Fatalf("err %v, want exit 2", err)
	}
	if c := f.Calls(); c["RegisterWorker"] > 0 || c["Route"] > 0 {
		t.Fatalf("a bad --policies was refused only after the live replay ran: cluster calls %v", c)
	}
}

// A live replay whose bookings could not be freed exits 1 after printing
// its figures, saying how many may remain on the cluster and until when
// (it exited 0 with no error counted, the bookings left as load).
func TestLiveReplayExitsWhenBookingsCannotBeFreed(t *testing.T) {
	f, addr := fakeCluster(t)
	f.SetHook(func(m string) error {
		if m == "Free" {
			return errors.New("leader lost")
		}
		return nil
	})
	out, err := kvsim(t, "replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", "2", "--limit", "10", "--policies", "round_robin")
	var ec cli.ExitCoder
	if err == nil || errors.As(err, &ec) && ec.ExitCode() == 2 ||
		!regexp.MustCompile(`router_live: 10 bookings may remain on the cluster .*leader lost.* 5m0s after they were made`).MatchString(err.Error()) {
		t.Fatalf("err %v, want an error (exit 1) saying 10 bookings may remain, and until when", err)
	}
	if n := len(f.Bookings()); n != 10 {
		t.Fatalf("%d bookings on the cluster, want the 10 unfreed", n)
	}
	if !regexp.MustCompile(`(?m)^\s*router_live\s.*\s10\s*$`).MatchString(out) || !strings.Contains(out, "round_robin") {
		t.Fatalf("the figures were not printed, or router_live shows no errors:\n%s", out)
	}
}

// A live replay stopped by an error (a wire error, after which it frees
// what it booked) says how many bookings may remain after that error, and
// until when; before, the error alone was printed and the bookings left
// untold exactly when they were likely stranded.
func TestStoppedLiveReplaySaysBookingsMayRemain(t *testing.T) {
	stop := fmt.Errorf("request 7: %w: worker 2: socket gone", sim.ErrWire)
	err := withBookingsLeft(stop, sim.Result{Policy: "router_live", Unfreed: 3, FirstError: "leader lost"})
	if !errors.Is(err, sim.ErrWire) ||
		!regexp.MustCompile(`socket gone; router_live: 3 bookings may remain on the cluster .*leader lost.* 5m0s after they were made`).MatchString(err.Error()) {
		t.Fatalf("err %v, want the wire error, then that 3 bookings may remain and until when", err)
	}
	if err := withBookingsLeft(stop, sim.Result{Policy: "router_live"}); err != stop {
		t.Fatalf("nothing unfreed: err %v, want the wire error alone", err)
	}
}

// slowSource is a cluster whose Workers call is still running a moment
// after its context ended.
type slowSource struct {
	entered  chan struct{}
	returned atomic.Bool
}

func (s *slowSource) Status(context.Context) (*raftfsm.NodeStatus, error) {
	return &raftfsm.NodeStatus{LeaderID: "n1"}, nil
}

func (s *slowSource) Workers(ctx context.Context) ([]api.Worker, error) {
	select {
	case s.entered <- struct{}{}:
	default:
	}
	<-ctx.Done()
	for range 1000 {
		runtime.Gosched() // still inside the call after the cancel
	}
	s.returned.Store(true)
	return nil, ctx.Err()
}

// The live summary's stop returns only once its last call to the cluster
// is over, so that the client can be closed after it (the summary was
// cancelled and never waited for: the client could be closed under it).
func TestLiveSummaryStopWaitsForItsLastCall(t *testing.T) {
	src := &slowSource{entered: make(chan struct{})}
	_, stop := liveSummary(context.Background(), src, &countingPolicy{}, time.Millisecond)
	select {
	case <-src.entered:
	case <-time.After(10 * time.Second):
		stop()
		t.Fatal("the summary never asked for the workers")
	}
	stop()
	if !src.returned.Load() {
		t.Fatal("stop returned while the summary was still inside a call to the cluster")
	}
}

// freePorts returns a port p such that p to p+n-1 were free on the
// loopback interface a moment ago.
func freePorts(t *testing.T, n int) int {
	t.Helper()
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := l.Addr().(*net.TCPAddr).Port
		ls := []net.Listener{l}
		ok := true
		for i := 1; i < n && ok; i++ {
			li, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(base+i))
			if ok = err == nil; ok {
				ls = append(ls, li)
			}
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return 0
}

// kvsim replay --live --zmq-base-port: the simulated workers publish on
// their engine wires, agents (here: engine subscribers feeding a fake
// cluster) bring the events in and register the workers, and kvsim itself
// sends no event and registers nothing. kvsim binds the ports of its block
// only as it starts, after the subscribers dial them: another socket, or
// a subscriber's own connection (libzmq connects to itself on a free port
// it keeps dialing), may hold one by then, and a run that kvsim ends so
// is made again on another block.
func TestLiveReplayOverEngineWires(t *testing.T) {
	for run := 1; ; run++ {
		err := liveReplayOverEngineWires(t)
		if err == nil {
			return
		}
		if !strings.Contains(err.Error(), "address already in use") || run == 5 {
			t.Fatal(err)
		}
		t.Logf("run %d: %v; running it again on other ports", run, err)
	}
}

// liveReplayOverEngineWires is one run of TestLiveReplayOverEngineWires on
// a block of ports freePorts picks, with a fake cluster of its own. It
// returns kvsim's error, and fails the test on anything else.
func liveReplayOverEngineWires(t *testing.T) error {
	t.Helper()
	const workers = 3
	f, addr := fakeCluster(t)

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	base := freePorts(t, 2*workers)
	sink := &ingestSink{f: f, next: map[kvevent.Rank]uint64{}}
	for i := range workers {
		r := kvevent.Rank{Worker: uint64(i + 1)}
		sub, err := enginesub.New(enginesub.Config{Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", base+i),
			ReplayEndpoint: fmt.Sprintf("tcp://127.0.0.1:%d", base+workers+i),
			Rank:           r, Decoder: engine.Config{BlockSize: 16}, Sink: sink})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sub.Run(ctx); err != nil {
				t.Errorf("subscriber %d: %v", i, err)
			}
		}()
		// The agents register their workers while kvsim waits for them.
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-sub.Ready():
			case <-ctx.Done():
				return
			}
			if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: r.Worker, BlockSize: 16, DPRanks: []uint32{0}, Capacity: [4]int64{62500}}); err != nil {
				t.Errorf("register %d: %v", r.Worker, err)
			}
		}()
	}

	out, err := kvsim(t, "replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", strconv.Itoa(workers),
		"--zmq-base-port", strconv.Itoa(base), "--zmq-replay-base-port", strconv.Itoa(base+workers), "--agent-wait", "30s")
	if err != nil {
		return fmt.Errorf("kvsim: %w\n%s", err, out)
	}
	m := regexp.MustCompile(`(?m)^\s*router_live\s+([0-9.]+) %.*\s(\d+)\s*$`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no router_live row:\n%s", out)
	}
	if hit, _ := strconv.ParseFloat(m[1], 64); hit <= 0 || m[2] != "0" {
		t.Fatalf("router_live: hit rate %s %%, %s errors; want a hit rate and no errors:\n%s", m[1], m[2], out)
	}
	calls := f.Calls()
	if calls["RegisterWorker"] != workers || calls["DeregisterWorker"] != 0 {
		t.Fatalf("registrations %d, deregistrations %d: kvsim must leave them to the agents", calls["RegisterWorker"], calls["DeregisterWorker"])
	}
	// Every batch reached the agents (Close let the last ones go out).
	deadline := time.Now().Add(10 * time.Second)
	for {
		sink.mu.Lock()
		errs := slices.Clone(sink.errs)
		sink.mu.Unlock()
		if len(errs) > 0 {
			t.Fatalf("agents: %v", errs)
		}
		held := 0
		for _, w := range f.Workers() {
			if b := w.Ranks[0].Blocks[kvevent.TierDevice]; b > 0 {
				held++
			}
		}
		if held == workers {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d workers hold blocks on the cluster", held, workers)
		}
		time.Sleep(5 * time.Millisecond) // polling, bounded by the deadline
	}
	t.Logf("\n%s", out)
	return nil
}

// recordingCluster serves a fake cluster's API, as fakeCluster, and
// records the JSON body of every route request it answers.
func recordingCluster(t *testing.T) (addr string, routes func() []map[string]any) {
	t.Helper()
	f := apitest.New("n1", "")
	srv := api.NewServer(f, api.Options{Logger: slog.New(slog.DiscardHandler)})
	var mu sync.Mutex
	var got []map[string]any
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/route") {
			b, err := io.ReadAll(r.Body)
			if err != nil {
				t.Errorf("read a route request: %v", err)
			}
			var m map[string]any
			if err := json.Unmarshal(b, &m); err != nil {
				t.Errorf("route request %q: %v", b, err)
			}
			mu.Lock()
			got = append(got, m)
			mu.Unlock()
			r.Body = io.NopCloser(bytes.NewReader(b))
		}
		srv.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	addr = strings.TrimPrefix(hs.URL, "http://")
	st := f.Status()
	st.HTTPAddr, st.LeaderHTTP = addr, addr
	f.SetStatus(st)
	return addr, func() []map[string]any {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

// A live replay sends the router weights given on the command line with
// every route, as overrides, so that router_live and the in-process router
// it is compared with score with the same weights; a weight not given is
// not sent (the cluster's setting applies). Before, none was sent: the
// cluster scored with its own weights, the in-process router with the
// command line's.
func TestLiveReplaySendsTheRouterWeightFlagsAsOverrides(t *testing.T) {
	for _, tc := range []struct {
		flags []string
		want  map[string]any
	}{
		{nil, nil},
		{[]string{"--overlap-credit", "8", "--prefill-load-scale", "3", "--decode-request-weight", "2"},
			map[string]any{"overlap_score_credit": 8.0, "prefill_load_scale": 3.0, "decode_active_request_weight": 2.0}},
		{[]string{"--decode-request-weight", "0.5"}, map[string]any{"decode_active_request_weight": 0.5}},
	} {
		addr, routes := recordingCluster(t)
		args := []string{"replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", "2", "--limit", "20", "--policies", "router"}
		out, err := kvsim(t, append(args, tc.flags...)...)
		if err != nil {
			t.Fatalf("%v: %v", tc.flags, err)
		}
		rs := routes()
		if len(rs) != 20 {
			t.Fatalf("%v: %d route requests, want 20:\n%s", tc.flags, len(rs), out)
		}
		for i, r := range rs {
			ov, _ := r["overrides"].(map[string]any)
			if fmt.Sprint(ov) != fmt.Sprint(tc.want) {
				t.Fatalf("%v: route %d carries overrides %v, want %v", tc.flags, i, ov, tc.want)
			}
		}
	}
}

// A live replay on a cluster that stops answering ends by itself: kvsim
// prints that the cluster stopped answering and how many requests were
// not routed, and exits 1. From a review: it waited out a route timeout
// and two free timeouts per remaining request (hours for make run's 600
// at the default 10 s), each counted as an error, until someone pressed
// Ctrl-C. Here the cluster cuts every connection from the 3rd route on, so
// that no call waits for a timeout.
func TestLiveReplayGivesUpOnAClusterThatStopsAnswering(t *testing.T) {
	f := apitest.New("n1", "")
	srv := api.NewServer(f, api.Options{Logger: slog.New(slog.DiscardHandler)})
	var routes, cut atomic.Int64
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/route" && routes.Add(1) >= 3 || routes.Load() >= 3 {
			cut.Add(1)
			panic(http.ErrAbortHandler) // the connection is cut: no answer
		}
		srv.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	addr := strings.TrimPrefix(hs.URL, "http://")
	st := f.Status()
	st.HTTPAddr, st.LeaderHTTP = addr, addr
	f.SetStatus(st)

	var out, errb bytes.Buffer
	code := run([]string{"kvsim", "replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", "2", "--limit", "20",
		"--policies", "round_robin"}, &out, &errb)
	if code != exitError || !regexp.MustCompile(`the cluster stopped answering.*18 of 20 requests not routed|18 of 20 requests not routed.*the cluster stopped answering`).MatchString(errb.String()) {
		t.Fatalf("exit %d, stderr:\n%s\nwant exit 1 saying the cluster stopped answering, 18 of 20 requests not routed", code, errb.String())
	}
	if c := cut.Load(); c > 10 {
		t.Fatalf("%d calls to the silent cluster: the replay went on after it stopped answering", c)
	}
}

// A live replay whose first endpoint accepts connections and never
// answers (a wedged or stopped node) passes it over after a try's share of
// the call's timeout and replays through the next one. kvsim bounded no
// try: each call waited its whole 10 s on the first endpoint, the healthy
// one was never tried, and after three calls the replay ended with "the
// cluster stopped answering".
func TestLiveReplayPassesOverAHungFirstEndpoint(t *testing.T) {
	hung := apitest.HungServer(t)
	f, addr := fakeCluster(t)
	eps := strings.TrimPrefix(hung.URL, "http://") + "," + addr
	_, errb, err := kvsimStderr(t, "replay", "--live", "--endpoints", eps, "--trace", genTrace(t), "--workers", "2", "--limit", "5", "--policies", "round_robin")
	if err != nil {
		t.Fatalf("%v; the healthy second endpoint was not used (its calls: %v); stderr:\n%s", err, f.Calls(), errb)
	}
	if n := f.Calls()["Route"]; n != 5 {
		t.Fatalf("%d routes reached the healthy endpoint, want the 5 replayed", n)
	}
}

// TestLiveReplayTokenFlagOutranksKVCTLToken pins docs/sim.md's "as
// kvctl's" for --token and --token-file: a kvctl user's KVCTL_TOKEN in the
// environment does not stand against a --token-file (or a KVCTL_TOKEN_FILE
// against a --token) given on the command line, which outranks both token
// variables (docs/operations.md, "Security"; clihelp.TokenArgs). The
// replay reaches a cluster that asks for the file's token.
func TestLiveReplayTokenFlagOutranksKVCTLToken(t *testing.T) {
	const token = "live-s3cret"
	_, addr := fakeClusterWith(t, api.Options{Token: token})
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	trace := genTrace(t)
	for _, tc := range []struct {
		env, val string
		flags    []string
	}{
		{"KVCTL_TOKEN", "stale", []string{"--token-file", file}},
		{"KVCTL_TOKEN_FILE", filepath.Join(t.TempDir(), "missing"), []string{"--token", token}},
	} {
		t.Setenv(tc.env, tc.val)
		args := append([]string{"replay", "--live", "--endpoints", addr, "--trace", trace, "--workers", "2", "--limit", "5", "--policies", "round_robin"}, tc.flags...)
		if _, err := kvsim(t, args...); err != nil {
			t.Errorf("%s=%s kvsim %s: %v, want the command line's token used", tc.env, tc.val, strings.Join(tc.flags, " "), err)
		}
		os.Unsetenv(tc.env)
	}
}
