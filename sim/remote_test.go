package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/raftfsm"
)

func fakeCluster(t *testing.T) (*apitest.Fake, *client.Client) {
	t.Helper()
	return fakeClusterVia(t, func(h http.Handler) http.Handler { return h })
}

// fakeClusterVia is fakeCluster with its API served through wrap.
func fakeClusterVia(t *testing.T, wrap func(http.Handler) http.Handler) (*apitest.Fake, *client.Client) {
	t.Helper()
	f := apitest.New("n1", "")
	srv := api.NewServer(f, api.Options{Logger: slog.New(slog.DiscardHandler)})
	hs := httptest.NewServer(wrap(srv))
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
	})
	addr := strings.TrimPrefix(hs.URL, "http://")
	st := f.Status()
	st.HTTPAddr, st.LeaderHTTP = addr, addr
	f.SetStatus(st)
	cl, err := client.New([]string{addr}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return f, cl
}

// With Agents, Setup registers nothing and waits for the agents'
// registrations; Observe sends nothing.
func TestRemoteWithAgentsWaitsForTheirRegistrations(t *testing.T) {
	f, cl := fakeCluster(t)
	p := &Remote{Client: cl, Workers: 2, BlockSize: 16, Agents: true, PollInterval: 5 * time.Millisecond}

	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	err := p.Setup(ctx)
	if err == nil || !strings.Contains(err.Error(), "not registered: [2]") {
		t.Fatalf("setup with worker 2 missing: %v", err)
	}

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		done <- p.Setup(ctx)
	}()
	if err := f.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 2, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("setup once both are registered: %v", err)
	}
	p.Observe(&kvevent.Event{Rank: RankOf(0), Kind: kvevent.KindCleared}, 0)
	if err := p.flush(); err != nil {
		t.Fatal(err)
	}
	if c := f.Calls(); c["RegisterWorker"] != 2 || c["DeregisterWorker"] != 0 || c["IngestEvents"] != 0 {
		t.Fatalf("calls %v: Remote must leave registrations and events to the agents", c)
	}

	// A worker registered in another block size cannot be replayed.
	if err := f.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 2, BlockSize: 64}); err != nil {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel2()
	if err := p.Setup(ctx2); !errors.Is(err, ErrBadConfig) {
		t.Fatalf("setup with a 64-token worker: %v, want ErrBadConfig", err)
	}
}

// TestRemoteWithAgentsRoutesWithTheirSalt: in a live replay with agents
// (kvsim replay --live --zmq-base-port), each agent decodes the workers'
// token_ids with the salt its worker is registered with (kvagent --salt,
// engine.SaltedSeed). Remote routes with content hashes of that salt, so
// the blocks an agent indexed are found; and it refuses workers of
// different salts, naming them, as no route could match all of them. From
// a review: Remote took salted workers and routed with the plain seed's
// hashes, so every route missed every block and the replay reported a 0 %
// hit rate as the router's.
func TestRemoteWithAgentsRoutesWithTheirSalt(t *testing.T) {
	const bs, salt = 16, "tenant-a"
	// What the agent of a salted engine indexes for a request's blocks.
	q := &Request{InputLength: 3 * bs, HashIDs: []uint64{42}}
	exp := Expander{BlockSize: bs}
	local, seq := exp.Blocks(q)
	local = slices.Clone(local)
	payload := AppendBatch(nil, 1, []WireEvent{{Kind: kvevent.KindStored, Hashes: seq, Tokens: exp.Tokens(q), BlockSize: bs}}, 0)
	d, err := engine.NewDecoder(engine.Config{Rank: RankOf(0), BlockSize: bs, Seed: engine.SaltedSeed(salt)})
	if err != nil {
		t.Fatal(err)
	}
	var b engine.Batch
	if err := d.Decode(payload, &b); err != nil || len(b.Events) != 1 || len(b.Events[0].Blocks) != 3 {
		t.Fatalf("decode: %v, %d events", err, len(b.Events))
	}
	ev := b.Events[0]
	for i, blk := range ev.Blocks {
		if blk.LocalHash == local[i] {
			t.Fatalf("block %d: the salted agent indexes %#x, the plain seed's hash", i, blk.LocalHash)
		}
	}

	f, cl := fakeCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, id := range []uint64{1, 2} {
		if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: id, BlockSize: bs, Salt: salt}); err != nil {
			t.Fatal(err)
		}
	}
	p := &Remote{Client: cl, Workers: 2, BlockSize: bs, Agents: true, PollInterval: 5 * time.Millisecond}
	if err := p.Setup(ctx); err != nil {
		t.Fatalf("setup with agents of one salt: %v", err)
	}
	ev.Rank, ev.EventID = RankOf(0), 1
	if _, err := f.IngestEvents(ctx, []raftfsm.RankBatch{{Rank: ev.Rank, Events: []kvevent.Event{ev}}}); err != nil {
		t.Fatal(err)
	}
	w, cached, err := p.Route(&RouteQuery{ID: "r1", Local: local, ISL: q.InputLength, BlockSize: bs, Req: q}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if w != 0 || cached != 3*bs {
		t.Fatalf("route: worker %d, %d cached tokens predicted; want worker 0, %d (the blocks its agent indexed with the salt)", w, cached, 3*bs)
	}

	// Worker 2's agent with another salt: no route can match both.
	if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 2, BlockSize: bs, Salt: "tenant-b"}); err != nil {
		t.Fatal(err)
	}
	err = p.Setup(ctx)
	if !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), "[1], [2]") || strings.Contains(err.Error(), salt) {
		t.Fatalf("setup with agents of two salts: %v, want ErrBadConfig naming the workers of each salt, not the salts", err)
	}
}

// TestRemoteRefusesAClusterWithOtherWorkers: a live replay on a cluster
// that also has workers of its own would have some requests routed to
// them (it used to report "worker 11: <nil>" errors and leave their
// bookings on the cluster): Setup refuses it, naming them.
func TestRemoteRefusesAClusterWithOtherWorkers(t *testing.T) {
	f, cl := fakeCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 11, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	p := &Remote{Client: cl, Workers: 2, BlockSize: 16}
	if err := p.Setup(ctx); !errors.Is(err, ErrBadConfig) || !strings.Contains(err.Error(), "[11]") {
		t.Fatalf("setup beside worker 11: %v, want ErrBadConfig naming it", err)
	}
	if err := f.DeregisterWorker(ctx, 11); err != nil {
		t.Fatal(err)
	}
	if err := p.Setup(ctx); err != nil {
		t.Fatalf("setup of a cluster of the replay's workers only: %v", err)
	}
}

// TestRemoteSetupChecksADeregistrationOfUnknownOutcome: Setup drops the
// replay's workers before it registers them again; a deregistration that
// a node may have taken without answering (a follower whose forward to
// the leader broke: 503 no_leader saying it may have applied) is
// client.ErrOutcomeUnknown, as it is not safe to send twice. Setup looks
// in the worker table: a worker that is gone is done, one still there is
// deregistered once more. From a review: the client sent the
// deregistration on, and a second apply answered a false 404.
func TestRemoteSetupChecksADeregistrationOfUnknownOutcome(t *testing.T) {
	for _, applied := range []bool{true, false} {
		var broke atomic.Bool
		f, cl := fakeClusterVia(t, func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Method == http.MethodDelete && strings.HasPrefix(r.URL.Path, "/v1/workers/") && !broke.Swap(true) {
					if applied {
						h.ServeHTTP(httptest.NewRecorder(), r)
					}
					w.Header().Set(api.HeaderMaybeApplied, "true")
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusServiceUnavailable)
					fmt.Fprintf(w, `{"error":"forward to the leader: connection reset","reason":%q}`+"\n", api.ReasonNoLeader)
					return
				}
				h.ServeHTTP(w, r)
			})
		})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		for _, id := range []uint64{1, 2} {
			if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: id, BlockSize: 16}); err != nil {
				t.Fatal(err)
			}
		}
		p := &Remote{Client: cl, Workers: 2, BlockSize: 16, CapacityBlocks: 1000}
		if err := p.Setup(ctx); err != nil {
			t.Fatalf("applied %v: setup after a deregistration of unknown outcome: %v", applied, err)
		}
		// Two deregistrations reach the cluster: 1 and 2 (when the first
		// of 1 did not reach it, the second did).
		if c := f.Calls(); c["DeregisterWorker"] != 2 || c["RegisterWorker"] != 4 {
			t.Fatalf("applied %v: calls %v, want 2 deregistrations and 2 registrations after the first 2", applied, c)
		}
		for _, w := range f.Workers() {
			if w.Info.Capacity[0] != 1000 {
				t.Fatalf("applied %v: worker %d was not registered again: %+v", applied, w.Info.ID, w.Info)
			}
		}
	}
}

// TestRemoteSetupBoundsEachCallByTimeout: Setup's deregistrations,
// listings and registrations (Agents unset) are each bounded by Timeout
// ("per call"), as every other call of Remote is. From a review: they went
// out on the caller's context alone, so against a node that accepts
// connections and never answers a Setup whose context had no deadline
// never returned, and the listing that checks a deregistration that timed
// out ran on its spent context and failed at once.
func TestRemoteSetupBoundsEachCallByTimeout(t *testing.T) {
	// Each call that answers must answer within it on a loaded -race run
	// (a call of 200 ms timed out there): a second, as the calls that
	// hang wait it out.
	const timeout = time.Second
	// The caller's context, with no deadline Setup could reach first:
	// a Setup bounded by its Timeouts ends before it (ctx.Err() nil),
	// one that waits for the caller's context ends with it. No duration
	// of Setup is asserted: a loaded run may take long over its calls.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	hung := apitest.HungServer(t)
	cl, err := client.New([]string{strings.TrimPrefix(hung.URL, "http://")}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	p := &Remote{Client: cl, Workers: 1, BlockSize: 16, CapacityBlocks: 100, Timeout: timeout}
	start := time.Now()
	if err := p.Setup(ctx); err == nil || ctx.Err() != nil {
		t.Fatalf("Setup against a hung node: %v after %v, want an error of its Timeouts (%v), not the caller's context's",
			err, time.Since(start).Round(10*time.Millisecond), timeout)
	}

	// The first deregistration hangs (not applied): it times out, of
	// unknown outcome; the listing, a Timeout of its own, finds the
	// worker still there, and it is deregistered again.
	var hungOnce atomic.Bool
	f, cl := fakeClusterVia(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodDelete && !hungOnce.Swap(true) {
				<-r.Context().Done()
				return
			}
			h.ServeHTTP(w, r)
		})
	})
	if err := f.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	p = &Remote{Client: cl, Workers: 1, BlockSize: 16, CapacityBlocks: 100, Timeout: timeout}
	start = time.Now()
	if err := p.Setup(ctx); err != nil || ctx.Err() != nil {
		t.Fatalf("Setup after a deregistration that timed out: %v after %v, want done within its Timeouts (%v)",
			err, time.Since(start).Round(10*time.Millisecond), timeout)
	}
	if c := f.Calls(); c["DeregisterWorker"] != 1 || c["RegisterWorker"] != 2 {
		t.Fatalf("calls %v, want the worker deregistered once (the hung try never applied) and registered again", c)
	}

	// The registration hangs (the deregistration before it answers): it
	// fails within its Timeout, naming the worker, instead of waiting
	// for the caller's context.
	_, cl = fakeClusterVia(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && r.URL.Path == "/v1/workers" {
				// The server sees the client go (and ends r's context)
				// only once the body is read.
				io.Copy(io.Discard, r.Body)
				<-r.Context().Done()
				return
			}
			h.ServeHTTP(w, r)
		})
	})
	p = &Remote{Client: cl, Workers: 1, BlockSize: 16, CapacityBlocks: 100, Timeout: timeout}
	start = time.Now()
	if err := p.Setup(ctx); err == nil || !strings.Contains(err.Error(), "register worker 1") || ctx.Err() != nil {
		t.Fatalf("Setup whose registration hangs: %v after %v, want the registration's error of its Timeout (%v), not the caller's context's",
			err, time.Since(start).Round(10*time.Millisecond), timeout)
	}
}

// setUpRemote returns a Remote of two workers on the cluster of cl, set up.
func setUpRemote(t *testing.T, cl *client.Client) *Remote {
	t.Helper()
	p := &Remote{Client: cl, Workers: 2, BlockSize: 16, CapacityBlocks: 1000}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	return p
}

// A live replay whose free (and prefill-done) calls fail counts them as
// errors and its bookings left on the cluster as unfreed, after trying each
// free twice (the failures were dropped: no error, and the bookings stayed
// counted as load on the cluster until they expired).
func TestRemoteCountsFailedLifecycleCalls(t *testing.T) {
	f, cl := fakeCluster(t)
	p := setUpRemote(t, cl)
	f.SetHook(func(m string) error {
		if m == "Free" || m == "PrefillDone" {
			return errors.New("leader lost")
		}
		return nil
	})
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 20, Sessions: 4, Seed: 1}), 16)
	res, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, p)
	if err != nil {
		t.Fatal(err)
	}
	left := len(f.Bookings())
	if left != res.Requests || res.Unfreed != left || res.Errors != 2*res.Requests || res.Rejected != 0 ||
		!strings.Contains(res.FirstError, "leader lost") {
		t.Fatalf("%d bookings left on the cluster; result: %d served, %d unfreed, %d errors (want %d), %d rejected, first %q",
			left, res.Requests, res.Unfreed, res.Errors, 2*res.Requests, res.Rejected, res.FirstError)
	}
	if c := f.Calls(); c["Free"] != 2*res.Requests {
		t.Fatalf("%d free calls for %d requests: want each tried twice", c["Free"], res.Requests)
	}

	// Once the cluster takes the frees again, a replay has no failure left
	// over from the last (Setup starts the count again).
	f.SetHook(nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Setup(ctx); err != nil {
		t.Fatal(err)
	}
	if res, err = Replay(pr, Config{Workers: 2, BlockSize: 16}, p); err != nil || res.Errors != 0 || res.Unfreed != 0 {
		t.Fatalf("replay on a healthy cluster: %v, %d errors (%s), %d unfreed", err, res.Errors, res.FirstError, res.Unfreed)
	}
}

// A route whose answer is lost after the leader booked it (here a 503 in
// place of the node's answer) counts as a routing error, and its booking
// is freed: it stayed on the cluster, counted as load, until it expired.
func TestRemoteFreesTheBookingOfAFailedRoute(t *testing.T) {
	var routes atomic.Int64
	f, cl := fakeClusterVia(t, func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/route" {
				h.ServeHTTP(w, r)
				return
			}
			if routes.Add(1)%3 != 0 {
				h.ServeHTTP(w, r)
				return
			}
			h.ServeHTTP(httptest.NewRecorder(), r) // booked, then the answer is lost
			http.Error(w, "gateway gave up", http.StatusServiceUnavailable)
		})
	})
	p := setUpRemote(t, cl)
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 20, Sessions: 4, Seed: 1}), 16)
	res, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, p)
	if err != nil {
		t.Fatal(err)
	}
	if b := f.Bookings(); len(b) != 0 || res.Rejected != 6 || res.Errors != 6 || res.Unfreed != 0 {
		t.Fatalf("bookings left %v; %d rejected, %d errors (want 6 each), %d unfreed", b, res.Rejected, res.Errors, res.Unfreed)
	}
	// A route that reached no node, or that no worker could take, booked
	// nothing: no free. Any other refusal may follow a try that booked (a
	// second try after a broken forward is refused as already booked on a
	// worker that is no longer a candidate, 400 invalid): it is freed.
	for err, want := range map[error]bool{
		errors.New("connection reset"):                                       true,
		&client.Error{StatusCode: 503, Reason: api.ReasonTimeout}:            true,
		&client.Error{StatusCode: 503, Reason: api.ReasonNoLeader}:           true,
		&client.Error{StatusCode: 500, Reason: api.ReasonInternal}:           true,
		&client.Error{StatusCode: 503, Reason: api.ReasonOverloaded}:         false,
		&client.Error{StatusCode: 503, Reason: api.ReasonNoWorkers}:          false,
		fmt.Errorf("route: %w: refused", client.ErrUnreachable):              false,
		&client.Error{StatusCode: 400, Reason: api.ReasonInvalid}:            true,
		fmt.Errorf("route: %w", &client.Error{StatusCode: 401, Reason: "x"}): true,
	} {
		if got := mayHaveBooked(err); got != want {
			t.Errorf("mayHaveBooked(%v) = %v, want %v", err, got, want)
		}
	}
}

// A route that reached no node (client.ErrUnreachable: every endpoint
// refused the connection) booked nothing: it is not counted as a booking
// that may remain on the cluster, where kvsim then exited 1 telling the
// user to wait for bookings that were never made. (The replay gives up at
// the third: ErrNoAnswer.)
func TestRemoteUnreachableRouteIsNotAnUnfreedBooking(t *testing.T) {
	f := apitest.New("n1", "")
	srv := api.NewServer(f, api.Options{Logger: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	hs := httptest.NewServer(srv)
	addr := strings.TrimPrefix(hs.URL, "http://")
	st := f.Status()
	st.HTTPAddr, st.LeaderHTTP = addr, addr
	f.SetStatus(st)
	cl, err := client.New([]string{addr}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	p := setUpRemote(t, cl)
	hs.Close() // the cluster is gone: every call is refused
	cl.Close() // and none goes out on a kept-alive connection (EOF: outcome unknown)
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 5, Sessions: 2, Seed: 1}), 16)
	res, err := Replay(pr, Config{Workers: 2, BlockSize: 16}, p)
	if !errors.Is(err, ErrNoAnswer) {
		t.Fatalf("err %v, want ErrNoAnswer after %d unreachable routes", err, maxSilentCalls)
	}
	if res.Errors == 0 || !strings.Contains(res.FirstError, client.ErrUnreachable.Error()) {
		t.Fatalf("%d errors, first %q: want the routes refused as unreachable", res.Errors, res.FirstError)
	}
	if res.Unfreed != 0 {
		t.Fatalf("no route reached the cluster (%d errors), yet %d bookings are reported as possibly left on it", res.Errors, res.Unfreed)
	}
}

// Stopping a live replay (Stop done: kvsim's Ctrl-C) on a cluster that
// stopped answering, the reason a user stops it: the route in flight is
// cancelled, no prefill-done is sent, and the frees of the requests in
// flight give up after the first that fails (within StopGrace), each
// counted as a booking that may remain. The route in flight ran to its
// timeout and every request in flight then made a prefill-done and two
// frees, a timeout each, one after another: minutes.
func TestRemoteStopBoundsTheCleanupOnAStuckCluster(t *testing.T) {
	f, cl := fakeCluster(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A timeout per call far longer than the test's deadline: only the stop
	// may end the calls in flight. The cleanup's deadline is a second:
	// the first free must reach the cluster within it on a loaded -race
	// run (with 100 ms a free sent late counted none), and it waits it
	// out, as the cluster does not answer.
	p := &Remote{Client: cl, Workers: 2, BlockSize: 16, CapacityBlocks: 1000, Timeout: 10 * time.Minute,
		Stop: ctx, StopGrace: time.Second}
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer scancel()
	if err := p.Setup(sctx); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // before the server closes: it waits for its handlers
	var routes atomic.Int64
	var hung atomic.Bool
	var atStop map[string]int
	f.SetHook(func(m string) error {
		if m == "Route" && routes.Add(1) == 10 {
			// The cluster hangs from the 10th route on; the user stops.
			atStop = f.Calls()
			hung.Store(true)
			cancel()
		}
		if hung.Load() {
			<-release
		}
		return nil
	})
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: 40, Sessions: 4, Seed: 1}), 16)
	type outcome struct {
		res Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := ReplayContext(ctx, pr, Config{Workers: 2, BlockSize: 16}, p)
		done <- outcome{res, err}
	}()
	var o outcome
	select {
	case o = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the replay still runs a minute after its stop on a stuck cluster")
	}
	if !errors.Is(o.err, context.Canceled) {
		t.Fatalf("err %v, want context.Canceled", o.err)
	}
	calls := f.Calls()
	if d := calls["Free"] - atStop["Free"]; d != 1 {
		t.Errorf("%d frees tried after the stop, want 1 (none after the first failed)", d)
	}
	if d := calls["PrefillDone"] - atStop["PrefillDone"]; d != 0 {
		t.Errorf("%d prefill-dones after the stop, want none (the frees follow)", d)
	}
	if o.res.Unfreed < 1 || o.res.Errors < o.res.Unfreed {
		t.Errorf("%d unfreed, %d errors (first %q): want the bookings left counted", o.res.Unfreed, o.res.Errors, o.res.FirstError)
	}
}

// A live replay on a cluster that stops answering, with no one to stop
// it, gives up after maxSilentCalls calls in a row got no answer: the
// requests in flight are freed as after a stop (one try each, sharing
// StopGrace, none after the first that fails), and ReplayContext returns
// ErrNoAnswer saying how many requests were not routed. From a review:
// every remaining request waited out a route timeout and two free
// timeouts, hours for make run's 600 requests, each counted as an error.
func TestRemoteGivesUpOnAClusterThatStopsAnswering(t *testing.T) {
	f, cl := fakeCluster(t)
	// A second a call: the calls answered (the first two routes and their
	// frees) must be answered within it on a loaded -race run, where 50 ms
	// once timed the second route out ("1 requests served"); the silent
	// ones cost it each, maxSilentCalls of them.
	p := &Remote{Client: cl, Workers: 2, BlockSize: 16, CapacityBlocks: 1000, Timeout: time.Second,
		StopGrace: time.Second}
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer scancel()
	if err := p.Setup(sctx); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	t.Cleanup(func() { close(release) }) // before the server closes: it waits for its handlers
	var routes, silent atomic.Int64
	var hung atomic.Bool
	f.SetHook(func(m string) error {
		if m == "Route" && routes.Add(1) == 3 {
			hung.Store(true) // from the 3rd route on, nothing is answered
		}
		if hung.Load() {
			silent.Add(1)
			<-release
		}
		return nil
	})
	const n = 30
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: n, Sessions: 4, Seed: 1}), 16)
	res, err := ReplayContext(context.Background(), pr, Config{Workers: 2, BlockSize: 16}, p)
	if !errors.Is(err, ErrNoAnswer) || !strings.Contains(err.Error(), fmt.Sprintf("%d of %d requests not routed", n-2, n)) {
		t.Fatalf("err %v, want ErrNoAnswer saying %d of %d requests were not routed", err, n-2, n)
	}
	// The route, its two frees, then one free of the requests in flight.
	if c := silent.Load(); c > maxSilentCalls+2 {
		t.Fatalf("%d calls to the silent cluster, want at most %d: the replay went on after %d unanswered in a row", c, maxSilentCalls+2, maxSilentCalls)
	}
	if res.Requests != 2 || res.Unfreed < 1 {
		t.Fatalf("%d requests served, %d unfreed: want the 2 routed before, their bookings counted as left", res.Requests, res.Unfreed)
	}
}

// A route the cluster refuses with an answer (here 503 no_leader) is not
// silence: the replay goes on routing every request, each counted as an
// error, however many are refused in a row.
func TestRemoteKeepsGoingWhileTheClusterAnswersWithRefusals(t *testing.T) {
	f, cl := fakeCluster(t)
	p := setUpRemote(t, cl)
	f.SetHook(func(m string) error {
		if m == "Route" {
			return raftfsm.ErrNoLeader
		}
		return nil
	})
	const n = 10
	pr := prepare(t, GenerateSharedPrefix(SharedPrefixConfig{Requests: n, Sessions: 4, Seed: 1}), 16)
	res, err := ReplayContext(context.Background(), pr, Config{Workers: 2, BlockSize: 16}, p)
	if err != nil {
		t.Fatalf("err %v: refusals are answers, not a cluster that stopped answering", err)
	}
	if res.Offered != n || res.Rejected != n || f.Calls()["Route"] != n {
		t.Fatalf("%d offered, %d rejected, %d routes sent; want all %d", res.Offered, res.Rejected, f.Calls()["Route"], n)
	}
}
