package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// countingRegistrar counts the registrations it passes on.
type countingRegistrar struct {
	next  Registrar
	calls atomic.Int32
}

func (c *countingRegistrar) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	c.calls.Add(1)
	return c.next.RegisterWorker(ctx, w)
}

// newAgentOf returns an agent of worker 7 rank 0 (its subscriber binds an
// ephemeral port no engine connects to) that registers through reg.
func newAgentOf(t *testing.T, r *router, blockSize int, reg Registrar) *Agent {
	t.Helper()
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	a, err := New(Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: blockSize, Conn: nc, Logger: quiet,
		Registrar: reg, HeartbeatInterval: 50 * time.Millisecond, Registration: raftfsm.WorkerInfo{LeaseMs: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a
}

// A registration the router refuses as invalid (a block size past its
// bound) is not retried: the router would refuse it again, for ever. Run
// stops and says why.
func TestRunStopsOnARegistrationTheRouterRefuses(t *testing.T) {
	r := startRouter(t)
	reg := &countingRegistrar{next: r.node}
	a := newAgentOf(t, r, raftfsm.MaxBlockSize+1, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := a.Run(ctx)
	if ctx.Err() != nil {
		t.Fatalf("Run went on until its context ended with a registration the router refuses: %d tries", reg.calls.Load())
	}
	if !errors.Is(err, ErrRegistrationRefused) || !errors.Is(err, raftfsm.ErrInvalid) || !strings.Contains(err.Error(), "block size") {
		t.Fatalf("Run: %v, want ErrRegistrationRefused wrapping the router's ErrInvalid about the block size", err)
	}
	if n := reg.calls.Load(); n != 1 {
		t.Errorf("%d registrations sent, want 1", n)
	}
}

// Through the HTTP API, a 4xx answer is the router refusing the
// registration (Run stops), except 408 and 429, which, like a 5xx, are
// retried.
func TestRegistrationAnswersThatStopTheAgent(t *testing.T) {
	for _, tc := range []struct {
		code int
		stop bool
	}{
		{http.StatusBadRequest, true},
		{http.StatusUnauthorized, true},
		{http.StatusNotFound, true},
		{http.StatusRequestTimeout, false},
		{http.StatusTooManyRequests, false},
		{http.StatusServiceUnavailable, false},
	} {
		t.Run(fmt.Sprint(tc.code), func(t *testing.T) {
			r := startRouter(t)
			var calls atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				calls.Add(1)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(tc.code)
				fmt.Fprintf(w, `{"error":"answer %d","reason":"test"}`, tc.code)
			}))
			defer srv.Close()
			cl, err := client.New([]string{strings.TrimPrefix(srv.URL, "http://")}, client.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer cl.Close()
			a := newAgentOf(t, r, 4, cl)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- a.Run(ctx) }()
			if !tc.stop {
				waitFor(t, "a second try", func() bool { return calls.Load() >= 2 })
				cancel()
				if err := <-done; err != nil {
					t.Fatalf("Run after a retried answer %d: %v", tc.code, err)
				}
				return
			}
			err = <-done
			if ctx.Err() != nil {
				t.Fatalf("answer %d: Run went on until its context ended (%d tries)", tc.code, calls.Load())
			}
			var ce *client.Error
			if !errors.Is(err, ErrRegistrationRefused) || !errors.As(err, &ce) || ce.StatusCode != tc.code {
				t.Fatalf("answer %d: Run returned %v, want ErrRegistrationRefused with the answer", tc.code, err)
			}
			if n := calls.Load(); n != 1 {
				t.Errorf("answer %d: %d tries, want 1", tc.code, n)
			}
		})
	}
}

// New sets Registration.DPRanks from the ranks the agent follows: a caller
// that filled them does not register a rank twice (which POST /v1/workers
// refuses), and the caller's slice is not written.
func TestNewSetsTheRegisteredDPRanks(t *testing.T) {
	r := startRouter(t)
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	mine := make([]uint32, 1, 4)
	mine[0] = 9
	a, err := New(Config{Worker: 7, DPStart: 3, DPRanks: 2, Endpoint: "tcp://127.0.0.1:40000", Bind: true, BlockSize: 4,
		Conn: nc, Logger: quiet, Registrar: r.node, Registration: raftfsm.WorkerInfo{BlockSize: 4, DPRanks: mine}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if got := a.cfg.Registration.DPRanks; !slices.Equal(got, []uint32{3, 4}) {
		t.Errorf("the agent registers dp ranks %v, want [3 4]", got)
	}
	if full := mine[:cap(mine)]; !slices.Equal(full, []uint32{9, 0, 0, 0}) {
		t.Errorf("the caller's DPRanks array was written: %v", full)
	}
}

// Registration.BlockSize is the block size the router scores with; it
// defaults to Config.BlockSize, the one the agent hashes with, and New
// refuses the two when they differ.
func TestNewReconcilesTheRegisteredBlockSize(t *testing.T) {
	r := startRouter(t)
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	cfg := Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: 16, Conn: nc, Logger: quiet}
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	if got := a.cfg.Registration.BlockSize; got != 16 {
		t.Errorf("registered block size %d, want Config.BlockSize 16", got)
	}
	cfg.Registration.BlockSize = 32
	if a, err := New(cfg); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "32") {
		if err == nil {
			a.Close()
		}
		t.Errorf("New with Config.BlockSize 16 and Registration.BlockSize 32: %v, want ErrConfig naming both", err)
	}
}

// TestFailedNewTakesBackItsMetrics: a New that fails returns an error, not
// a panic, and leaves none of its metrics on the caller's Registerer, so
// that a New with the config fixed, on the same Registerer, goes through.
// From a review: a config the subscribers refused (after the agent's and
// the publisher's metrics were registered) left them registered, and a
// Registerer that held one of the publisher's made New panic.
func TestFailedNewTakesBackItsMetrics(t *testing.T) {
	r := startRouter(t)
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// A registerer that holds another's metric under a name of the
	// publisher's: the agent's own metrics are registered before it.
	held := prometheus.NewRegistry()
	held.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "kvagent_events_published_total", Help: "another's"}))
	cfg := Config{Worker: 7, BlockSize: 4, Conn: nc, Logger: quiet, Registerer: held, Endpoint: "tcp://127.0.0.1:*", Bind: true}
	if a, err := New(cfg); err == nil {
		a.Close()
		t.Fatal("New took a registerer holding a metric of the publisher's name")
	}
	fams, err := held.Gather()
	must(t, err)
	if len(fams) != 1 {
		var names []string
		for _, f := range fams {
			names = append(names, f.GetName())
		}
		t.Fatalf("a failed New left metrics registered: %v", names)
	}
	// The subscribers refuse an endpoint without a scheme, once the
	// agent's and the publisher's metrics are registered.
	reg := prometheus.NewRegistry()
	cfg.Registerer, cfg.Endpoint = reg, "localhost:5557"
	if a, err := New(cfg); err == nil {
		a.Close()
		t.Fatal("New took an endpoint without a scheme")
	}
	cfg.Endpoint = "tcp://127.0.0.1:*"
	a, err := New(cfg)
	if err != nil {
		t.Fatalf("New with the config fixed, on the registerer of the failed one: %v", err)
	}
	a.Close()
}

// TestABindThatFailsRegistersNothing: when a subscriber cannot open its
// socket (a bind to an address in use), Run fails before the worker is
// registered or a heartbeat sent: the router must not take the worker for
// followed. From a review: the registration went out beside the failing
// bind.
func TestABindThatFailsRegistersNothing(t *testing.T) {
	r := startRouter(t)
	inUse, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer inUse.Close()
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var beats atomic.Int32
	sub, err := nc.Subscribe(eventplane.DefaultHeartbeatSubject, func(*nats.Msg) { beats.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	reg := &countingRegistrar{next: r.node}
	a, err := New(Config{Worker: 7, Endpoint: "tcp://" + inUse.Addr().String(), Bind: true, BlockSize: 4, Conn: nc, Logger: quiet,
		Registrar: reg, HeartbeatInterval: 10 * time.Millisecond, Registration: raftfsm.WorkerInfo{LeaseMs: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := a.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "bind") {
		t.Fatalf("Run with a bind to an address in use: %v", err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if n, b := reg.calls.Load(), beats.Load(); n != 0 || b != 0 {
		t.Errorf("%d registrations and %d heartbeats sent by an agent whose bind failed", n, b)
	}
}

// TestARegistrationConflictStopsTheAgentSayingWhatToFix: a 409 conflict
// (the registration breaks a rule of the compatible APIs' namespace of its
// model: another block size than the namespace's other workers serve)
// stops the agent, as before, with an error log that names the worker, its
// model and block size, the conflicting worker (the router's message) and
// the ways to fix it. From a review: a worker of a namespace that held
// mixed block sizes before the upgrade registers fine at its start, but is
// refused once its lease ran out and the sweep removed it, and the agent
// stopped for good with "fix the registration", which names no cause.
func TestARegistrationConflictStopsTheAgentSayingWhatToFix(t *testing.T) {
	r := startRouter(t)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		fmt.Fprint(w, `{"error":"conflict: worker 7: llama/default serves block_size 16 (instance 3): a namespace has one block size","reason":"conflict"}`)
	}))
	defer srv.Close()
	cl, err := client.New([]string{strings.TrimPrefix(srv.URL, "http://")}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	nc, err := nats.Connect(r.ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var logs testlog.Buffer
	a, err := New(Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: 8, Conn: nc, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Registrar: cl, HeartbeatInterval: 50 * time.Millisecond, Registration: raftfsm.WorkerInfo{Model: "llama", LeaseMs: 1000}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := a.Run(ctx); ctx.Err() != nil || !errors.Is(err, ErrRegistrationRefused) || !errors.Is(err, api.ErrConflict) {
		t.Fatalf("Run: %v, want ErrRegistrationRefused wrapping api.ErrConflict", err)
	}
	want := []string{"level=ERROR", "worker=7", "model=llama", "block_size=8", "instance 3", "--block-size", "--model", "DELETE /v1/workers/"}
	if got := logs.Lines(want...); len(got) != 1 {
		t.Fatalf("no error log holding all of %q:\n%s", want, logs.String())
	}
}

// registrarFunc is a Registrar of a function.
type registrarFunc func(ctx context.Context, w raftfsm.WorkerInfo) error

func (f registrarFunc) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	return f(ctx, w)
}

// TestAHungRegistrationIsGivenUpAfterFiveSeconds pins the bound of each
// registration try (registrations: 5 s): a router that takes the request
// and never answers does not hold the registration for ever; the try is
// given up and the next goes out. The first try here hangs until its
// context ends, the second goes through.
func TestAHungRegistrationIsGivenUpAfterFiveSeconds(t *testing.T) {
	r := startRouter(t)
	var tries atomic.Int32
	ended := make(chan time.Duration, 1)
	reg := registrarFunc(func(ctx context.Context, w raftfsm.WorkerInfo) error {
		if tries.Add(1) > 1 {
			return r.node.RegisterWorker(ctx, w)
		}
		start := time.Now()
		<-ctx.Done()
		ended <- time.Since(start)
		return ctx.Err()
	})
	a := newAgentOf(t, r, 4, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); <-done }()
	select {
	case d := <-ended:
		if d < 4*time.Second || d > 10*time.Second {
			t.Fatalf("the hung registration was given up after %v, want about 5 s", d)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a registration the router never answers still hangs 20 s on, want it given up after 5 s")
	}
	deadline := time.Now().Add(10 * time.Second)
	for tries.Load() < 2 || !workerRegistered(r) {
		if time.Now().After(deadline) {
			t.Fatalf("no registration went through 10 s after the hung one was given up (%d tries)", tries.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRegistrationRetriesBackOffToFiveSecondsAtMost pins the cap of the
// registrations' backoff (5 s): the waits double from 100 ms, and a router
// out of reach for minutes is still asked every 5 s or so, not after
// 12.8 s, 25.6 s and on. Ten tries, the last two 5 s apart at most, take
// about 16 s; without the cap the gap before the tenth is 12.8 s to
// 25.6 s. Each gap is asked to be under 10 s.
func TestRegistrationRetriesBackOffToFiveSecondsAtMost(t *testing.T) {
	r := startRouter(t)
	var mu sync.Mutex
	var tries []time.Time
	reg := registrarFunc(func(context.Context, raftfsm.WorkerInfo) error {
		mu.Lock()
		tries = append(tries, time.Now())
		mu.Unlock()
		return errors.New("the router is out of reach")
	})
	a := newAgentOf(t, r, 4, reg)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); <-done }()
	for {
		mu.Lock()
		n, last := len(tries), time.Time{}
		if n > 0 {
			last = tries[n-1]
		}
		mu.Unlock()
		if n >= 10 {
			break
		}
		if n > 0 && time.Since(last) > 10*time.Second {
			t.Fatalf("no registration try 10 s after try %d, want one every 5 s at most (the backoff's cap)", n)
		}
		if ctx.Err() != nil {
			t.Fatalf("%d registration tries in 60 s, want 10", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
