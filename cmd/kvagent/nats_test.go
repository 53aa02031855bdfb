package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/natstest"
	"github.com/kvrouter/kvrouter/internal/natswatch"
	"github.com/kvrouter/kvrouter/internal/netproxy"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// logBuffer is an io.Writer for the agent's log (the app's ErrWriter),
// safe for concurrent use.
type logBuffer struct {
	mu      sync.Mutex
	b       bytes.Buffer
	onWrite func(line string) // when set, called with each line as it is written
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.onWrite != nil {
		l.onWrite(string(p))
	}
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// has reports whether a line of the log holds all of want.
func (l *logBuffer) has(want ...string) bool {
	for _, line := range strings.Split(l.String(), "\n") {
		ok := line != ""
		for _, w := range want {
			ok = ok && strings.Contains(line, w)
		}
		if ok {
			return true
		}
	}
	return false
}

// waitFor polls cond until it holds, or fails the test after 15 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// freePort is a TCP port nothing listens on (one the system gave and
// took back): for an address the test dials, never for one it binds
// after, which another socket may have taken by then (cutNATS).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// cutNATS starts a NATS server with cfg (on a port of its own) and, in
// front of it, a proxy that is cut: the agent is given the proxy's
// address (returned with it), and the test takes the server down and
// back with the proxy's Cut and Heal. Neither port is ever given up
// while the test runs, where a server stopped and started again on a
// port the test had released could find it taken by another socket.
func cutNATS(t *testing.T, cfg eventplane.ServerConfig) (*netproxy.Proxy, string) {
	t.Helper()
	cfg.Addr = "127.0.0.1:0"
	ns, err := eventplane.StartServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	proxy, err := netproxy.New(strings.TrimPrefix(ns.ClientURL(), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	proxy.Cut()
	t.Cleanup(func() { proxy.Close() })
	return proxy, proxy.Addr()
}

// agentRun is a kvagent started by a test, its log in logs.
type agentRun struct {
	logs   *logBuffer
	cancel context.CancelFunc
	done   chan error
	err    error // what it returned, once stopped
}

// startKvagent runs kvagent with args (after a quiet --metrics-addr) until
// stop.
func startKvagent(t *testing.T, args ...string) *agentRun {
	t.Helper()
	return startKvagentLogging(t, nil, args...)
}

// startKvagentLogging is startKvagent calling onLine (when not nil) with
// each line the agent logs, as it logs it.
func startKvagentLogging(t *testing.T, onLine func(string), args ...string) *agentRun {
	t.Helper()
	r := &agentRun{logs: &logBuffer{onWrite: onLine}, done: make(chan error, 1)}
	a := app()
	a.ExitErrHandler = func(*cli.Context, error) {}
	a.ErrWriter = r.logs
	var ctx context.Context
	ctx, r.cancel = context.WithCancel(context.Background())
	go func() { r.done <- a.RunContext(ctx, append([]string{"kvagent", "--metrics-addr", ""}, args...)) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

// waitEnded waits for the agent to end on its own and returns what it
// returned (and leaves it for stop).
func (r *agentRun) waitEnded(t *testing.T) error {
	t.Helper()
	var ended error
	waitFor(t, "the agent to stop", func() bool {
		select {
		case ended = <-r.done:
			r.done <- ended
			return true
		default:
			return false
		}
	})
	return ended
}

// stop stops the agent (once) and returns what it returned.
func (r *agentRun) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	select {
	case err, ok := <-r.done:
		if ok {
			close(r.done)
			r.err = err
		}
	case <-time.After(30 * time.Second):
		t.Fatal("kvagent still runs 30 s after it was stopped")
	}
	return r.err
}

// TestNATSURLIsChecked: a --nats-url that is not a list of NATS URLs is a
// usage error (exit 2). From a review: "http//bad url" started an agent
// that retried it for ever, without a word. (eventplane.CheckNATSURLs's
// own test has the cases.)
func TestNATSURLIsChecked(t *testing.T) {
	for _, u := range []string{"http//bad url", "", "nats://h:4222/path"} {
		args := []string{"--block-size", "4", "--nats-url", u}
		wantUsage(t, args, checkOnly(args...), "--nats-url")
	}
	for _, u := range []string{"nats://127.0.0.1:4222", "nats://a:4221, tls://b:4222", "nats://user:pass@h:4222"} {
		if err := checkOnly("--block-size", "4", "--nats-url", u); err != nil {
			t.Errorf("--nats-url %q: %v", u, err)
		}
	}
}

// TestNATSURLPasswordIsNotShown: a --nats-url's password appears in no
// usage error. From a review: the error echoed the URL as given; and a
// second look: a typo in the port (url.Error quotes the URL as given) or
// an unescaped '#' in the password showed it still.
func TestNATSURLPasswordIsNotShown(t *testing.T) {
	for _, u := range []string{"nats://alice:s3cret@127.0.0.1:0", "nats://alice:s3cret@nats.example:42x2", "nats://alice:pa#s3cret@nats.example:4222"} {
		args := []string{"--block-size", "4", "--nats-url", u}
		err := checkOnly(args...)
		wantUsage(t, args, err, "--nats-url")
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("--nats-url %q: the usage error shows the password: %v", u, err)
		}
	}
}

// TestRefusedCredentialsStopTheAgent: a NATS connection that nats.go
// closes for good (the server refused the credentials twice in a row)
// stops the agent with an error, after a warning that names the
// credentials. From a review: the agent logged the close and ran on,
// publishing nothing, while its supervisor saw it healthy.
func TestRefusedCredentialsStopTheAgent(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Name: "n1", Addr: "127.0.0.1:0", User: "u", Password: "right"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	r := startKvagent(t, "--worker-id", "1", "--block-size", "4", "--nats-url", ns.ClientURL(),
		"--nats-user", "u", "--nats-password", "wrong", "--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)))
	ended := r.waitEnded(t)
	if ended == nil || !strings.Contains(ended.Error(), "closed for good") {
		t.Errorf("kvagent ended with %v, want the NATS connection closed for good", ended)
	}
	if !r.logs.has("level=WARN", "refused the agent's credentials") {
		t.Errorf("no warning naming the credentials:\n%s", r.logs)
	}
}

// TestNATSConnectionIsLogged: the agent logs, through its logger, that
// NATS cannot be reached, the connection made, lost and made again. From
// a review: it logged nothing while it could not reach NATS.
func TestNATSConnectionIsLogged(t *testing.T) {
	proxy, addr := cutNATS(t, eventplane.ServerConfig{Name: "n1"})
	r := startKvagent(t, "--worker-id", "1", "--block-size", "4", "--nats-url", "nats://"+addr,
		"--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)))
	waitFor(t, "a warning that NATS cannot be reached", func() bool { return r.logs.has("level=WARN", "cannot reach NATS") })
	proxy.Heal()
	waitFor(t, "the connection to NATS logged", func() bool { return r.logs.has("level=INFO", "connected to NATS", addr) })
	proxy.Cut()
	waitFor(t, "the lost connection logged", func() bool { return r.logs.has("level=WARN", "lost the NATS connection") })
	proxy.Heal()
	waitFor(t, "the reconnection logged", func() bool { return r.logs.has("level=INFO", "reconnected to NATS", addr) })
	if err := r.stop(t); err != nil {
		t.Fatalf("kvagent: %v", err)
	}
	if r.logs.has("NATS connection is closed") {
		t.Errorf("the connection closed at shutdown is logged as a failure:\n%s", r.logs)
	}
}

// TestACredsFileGoneBadStopsTheAgent: a --nats-creds file that held
// credentials when the agent started (CheckFiles took it) and holds none
// when it connects stops the agent with an error naming the credentials,
// as credentials the server refuses do: nats.go retries such a file for
// ever, and the agent, which took the failure for NATS out of reach, ran
// on publishing nothing. From a review (a junk creds file).
func TestACredsFileGoneBadStopsTheAgent(t *testing.T) {
	creds := natstest.WriteCreds(t, t.TempDir())
	proxy, addr := cutNATS(t, eventplane.ServerConfig{Name: "n1", User: "u", Password: "p"})
	r := startKvagent(t, "--worker-id", "1", "--block-size", "4", "--nats-url", "nats://"+addr,
		"--nats-creds", creds, "--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)))
	waitFor(t, "a warning that NATS cannot be reached", func() bool { return r.logs.has("level=WARN", "cannot reach NATS") })
	if err := os.WriteFile(creds, []byte("not a creds file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	proxy.Heal()
	ended := r.waitEnded(t)
	if ended == nil || !strings.Contains(ended.Error(), "--nats-creds") {
		t.Errorf("kvagent ended with %v, want an error naming --nats-creds; log:\n%s", ended, r.logs)
	}
}

// TestConnectionGaugesFollowTheAgent: kvagent_nats_connected is 1 while
// the agent's NATS connection is up and 0 while it is not, and
// kvagent_registered is 1 once a registration through --router went
// through and 0 after one failed, so that /metrics shows an agent that
// cannot reach NATS or register its worker (it runs on, retrying). From a
// review: nothing on /metrics told such an agent from a healthy one.
func TestConnectionGaugesFollowTheAgent(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(ns.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	connected := natsConnectedGauge(nc)
	if v := gaugeValue(t, connected, "kvagent_nats_connected"); v != 1 {
		t.Errorf("kvagent_nats_connected %v while connected, want 1", v)
	}
	ns.Shutdown()
	ns.WaitForShutdown()
	waitFor(t, "kvagent_nats_connected 0", func() bool { return gaugeValue(t, connected, "kvagent_nats_connected") == 0 })

	fr := &failingRegistrar{err: errors.New("no router")}
	reg := newRegisteredGauge(fr)
	if v := gaugeValue(t, reg.g, "kvagent_registered"); v != 0 {
		t.Errorf("kvagent_registered %v before any registration, want 0", v)
	}
	if err := reg.RegisterWorker(context.Background(), raftfsm.WorkerInfo{}); err == nil {
		t.Fatal("the failed registration's error was lost")
	}
	if v := gaugeValue(t, reg.g, "kvagent_registered"); v != 0 {
		t.Errorf("kvagent_registered %v after a failed registration, want 0", v)
	}
	fr.err = nil
	if err := reg.RegisterWorker(context.Background(), raftfsm.WorkerInfo{}); err != nil {
		t.Fatal(err)
	}
	if v := gaugeValue(t, reg.g, "kvagent_registered"); v != 1 {
		t.Errorf("kvagent_registered %v after a registration, want 1", v)
	}
}

// failingRegistrar answers each registration with err.
type failingRegistrar struct{ err error }

func (f *failingRegistrar) RegisterWorker(context.Context, raftfsm.WorkerInfo) error { return f.err }

// gaugeValue gathers c, a collector of one gauge named name, and returns
// its value.
func gaugeValue(t *testing.T, c prometheus.Collector, name string) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil || len(fams) != 1 || fams[0].GetName() != name {
		t.Fatalf("gathered %v, %v; want %s", fams, err, name)
	}
	return fams[0].GetMetric()[0].GetGauge().GetValue()
}

// TestNATSClosesAfterTheLastFlush: at shutdown the agent flushes its last
// events and closes its publisher while its NATS connection is still
// open (shutDown sees it open), so that the flush's acks can come back,
// and closes NATS after. From a review: with the NATS close deferred
// after shutdown (run before it) every test stayed green.
func TestNATSClosesAfterTheLastFlush(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Name: "n1", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	addr := strings.TrimPrefix(ns.ClientURL(), "nats://")
	closedAtShutdown := make(chan bool, 1)
	shutDown = func(nc *nats.Conn) { closedAtShutdown <- nc.IsClosed() }
	t.Cleanup(func() { shutDown = nil }) // after the run's cleanup
	r := startKvagent(t, "--worker-id", "1", "--block-size", "4", "--nats-url", "nats://"+addr,
		"--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)))
	waitFor(t, "the connection to NATS logged", func() bool { return r.logs.has("level=INFO", "connected to NATS", addr) })
	if err := r.stop(t); err != nil {
		t.Fatalf("kvagent: %v", err)
	}
	select {
	case closed := <-closedAtShutdown:
		if closed {
			t.Error("NATS was closed before the shutdown's flush of the last events and the publisher's close, want it open until after them")
		}
	default:
		t.Fatal("the agent stopped without its shutdown (flush, publisher close) running")
	}
}

// TestSlowConsumersAreCountedOnMetrics: /metrics has
// kvagent_nats_slow_consumer_total (natswatch.ErrorHandler counts the
// episodes of a subscription of the agent's NATS connection falling
// behind: heartbeat or event answers dropped), from the start, at 0, as
// kvrouter has kvrouter_nats_slow_consumer_total. From a review: the
// agent's connection had no ErrorHandler, and nats.go's default wrote
// such drops to stderr outside the log, counted nowhere.
func TestSlowConsumersAreCountedOnMetrics(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	// Port 0: the agent logs the port it listens on, where a port the
	// test released could be taken by another socket before the agent
	// binds it.
	r := startKvagent(t, "--worker-id", "1", "--block-size", "4", "--nats-url", ns.ClientURL(),
		"--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)), "--metrics-addr", "127.0.0.1:0")
	waitFor(t, "the connection to NATS logged", func() bool { return r.logs.has("level=INFO", "connected to NATS") })
	m := regexp.MustCompile(`"metrics listening" addr=(http://\S+/metrics)`).FindStringSubmatch(r.logs.String())
	if m == nil {
		t.Fatalf("no \"metrics listening\" line with its address in the log:\n%s", r.logs)
	}
	resp, err := http.Get(m[1])
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if want := "\nkvagent_nats_slow_consumer_total 0\n"; !strings.Contains(string(b), want) {
		t.Errorf("/metrics has no %q:\n%s", strings.TrimSpace(want), b)
	}
}

// TestTheAgentsConnectionCountsASlowConsumer: a subscription of the
// connection connectNATS makes that falls behind is counted in the
// agent's slow-consumer counter (natswatch's error handler is among the
// connection's options), not left to nats.go's default handler.
func TestTheAgentsConnectionCountsASlowConsumer(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Addr: "127.0.0.1:0", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	a := app()
	set := flag.NewFlagSet("kvagent", flag.ContinueOnError)
	for _, f := range a.Flags {
		if err := f.Apply(set); err != nil {
			t.Fatal(err)
		}
	}
	if err := set.Parse([]string{"--nats-url", ns.ClientURL()}); err != nil {
		t.Fatal(err)
	}
	slow := prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})
	_, lost := context.WithCancelCause(context.Background())
	defer lost(nil)
	nl := natswatch.New(slog.New(slog.DiscardHandler), lost, natswatch.Texts{Who: "the agent"})
	nc, err := connectNATS(cli.NewContext(a, set, nil), nl, slow)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { nl.Closing(); nc.Close() }()
	release := make(chan struct{})
	defer close(release)
	sub, err := nc.Subscribe("kv.events", func(*nats.Msg) { <-release })
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(1, -1); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var m dto.Metric
		if err := slow.Write(&m); err != nil {
			t.Fatal(err)
		}
		if m.GetCounter().GetValue() > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a subscription that fell behind was not counted in 10 s")
		}
		if err := nc.Publish("kv.events", []byte("x")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
