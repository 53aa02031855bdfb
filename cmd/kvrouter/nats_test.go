package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/natstest"
	"github.com/kvrouter/kvrouter/internal/natswatch"
	"github.com/kvrouter/kvrouter/internal/netproxy"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestMistypedNATSRoutesIsAUsageErrorNotACrash: a --nats-routes entry the
// embedded server cannot parse is a usage error (exit 2) naming the flag,
// before the data directory is touched. From a review: the list went to
// nats-server unchecked, whose RoutesFromStr keeps a nil URL for an entry
// that does not parse (a list separated by spaces, an IPv6 address
// missing its ']'), and its route solicitation crashed the whole process
// with a nil pointer dereference, after the data directory was locked.
// The start runs in a child process: a crash would take the test binary
// down.
func TestMistypedNATSRoutesIsAUsageErrorNotACrash(t *testing.T) {
	const childEnv = "KVROUTER_TEST_NATS_ROUTES"
	if routes, ok := os.LookupEnv(childEnv); ok {
		checkRefusedStart(t, []string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0",
			"--nats-cluster-addr", freeAddr(t), "--nats-routes", routes}, "--nats-routes")
		return
	}
	for _, routes := range []string{
		"127.0.0.1:16229 127.0.0.1:16230", // a space instead of a comma
		"[::1:6222",                       // an IPv6 address missing its ]
		"127.0.0.1:6222,[::1:6223",
		"127.0.0.1",   // no port
		":6222",       // no host
		"127.0.0.1:0", // a port nobody listens on
		"http://127.0.0.1:6222",
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMistypedNATSRoutesIsAUsageErrorNotACrash$", "-test.count=1")
		cmd.Env = append(os.Environ(), childEnv+"="+routes)
		out, err := cmd.CombinedOutput()
		if i := strings.Index(string(out), "panic:"); i >= 0 {
			t.Errorf("--nats-routes %q crashed kvrouter:\n%s", routes, out[i:min(len(out), i+400)])
		} else if err != nil {
			t.Errorf("--nats-routes %q: %v\n%s", routes, err, out)
		}
	}
}

// TestARoutePasswordIsNeverShown: a --nats-routes entry with route
// credentials (nats-route://user:password@host:port, which nats-server
// sends in its route CONNECT) is refused without its password, whether it
// parses or not. From a review: an entry that did not parse (a list
// separated by spaces, an IPv6 host missing its ']', a password with an
// unescaped '#') was quoted whole, and one whose password held a '/'
// parsed with the password in its path, which url.URL.Redacted does not
// hide.
func TestARoutePasswordIsNeverShown(t *testing.T) {
	const secret = "s3cret"
	for _, routes := range []string{
		"nats-route://ruser:s3cret@10.0.0.2:6222 nats-route://ruser:s3cret@10.0.0.3:6222",
		"nats-route://ruser:s3cret@[fd00::2:6222",
		"nats-route://ruser:s3cret#1@10.0.0.2:6222",
		"nats-route://ruser:1234/s3cret@10.0.0.2:6222",
		"ruser:s3cret@10.0.0.2:0",
		"nats-route://ruser:s3cret@10.0.0.2:6222/x",
		"nats-route://ruser:s3cret,1@10.0.0.2:6222", // a ',' splits the list
	} {
		err := natsFlagCheck(t, "--nats-cluster-addr", "127.0.0.1:6222", "--nats-routes", routes)
		if err == nil {
			t.Errorf("--nats-routes %q accepted", routes)
			continue
		}
		if strings.Contains(err.Error(), secret) {
			t.Errorf("--nats-routes %q: the usage error shows the route password: %v", routes, err)
		}
	}
}

// natsFlagCheck runs natsRoutes and checkNATSFlags, as run does first, on
// kvrouter's flag set with args, without starting anything.
func natsFlagCheck(t *testing.T, args ...string) error {
	t.Helper()
	app := newApp()
	app.ExitErrHandler = func(*cli.Context, error) {}
	app.Action = func(c *cli.Context) error {
		if _, err := natsRoutes(c.String("nats-routes")); err != nil {
			return err
		}
		return checkNATSFlags(c)
	}
	return app.Run(append([]string{"kvrouter"}, args...))
}

// TestNATSFlagsThatWouldBeIgnoredAreRefused: a NATS flag that the node
// would ignore, or that would not do what it says given with the others,
// is a usage error (exit 2) naming it, before the data directory is
// touched. From a review: with --nats-tls-ca alone the embedded server
// served no TLS, and with --nats-password alone it let every client in;
// --nats-creds was dropped with the embedded server, and the embedded
// server's flags with --nats-url; a --nats-url that names a user (nats.go
// sends it, as a token, instead of the flags) dropped --nats-password.
func TestNATSFlagsThatWouldBeIgnoredAreRefused(t *testing.T) {
	const ext = "nats://127.0.0.1:4222"
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--nats-tls-ca", "ca.pem"}, "--nats-tls-ca"},
		{[]string{"--nats-tls-cert", "cert.pem"}, "--nats-tls-cert"},
		{[]string{"--nats-tls-key", "key.pem", "--nats-url", ext}, "--nats-tls-cert"},
		{[]string{"--nats-password", "s3cret"}, "--nats-password"},
		{[]string{"--nats-user", "alice"}, "--nats-user"},
		{[]string{"--nats-creds", "user.creds"}, "--nats-creds"},
		{[]string{"--nats-routes", "127.0.0.1:6222"}, "--nats-routes"},
		{[]string{"--nats-url", ext, "--nats-password", "s3cret"}, "--nats-password"},
		{[]string{"--nats-url", "nats://alice@127.0.0.1:4222", "--nats-password", "s3cret"}, "--nats-url"},
		{[]string{"--nats-url", "nats://alice:pw@127.0.0.1:4222", "--nats-user", "bob", "--nats-password", "s3cret"}, "--nats-url"},
		{[]string{"--nats-url", ext, "--nats-cluster-addr", "127.0.0.1:6222"}, "--nats-cluster-addr"},
		{[]string{"--nats-url", ext, "--nats-routes", "127.0.0.1:6222"}, "--nats-routes"},
		{[]string{"--nats-url", ext, "--nats-addr", "127.0.0.1:4223"}, "--nats-addr"},
	} {
		err := checkRefusedStart(t, append([]string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t)}, c.args...), c.flag)
		if err != nil && strings.Contains(err.Error(), ":pw@") {
			t.Errorf("kvrouter %q: %v shows the URL's password", c.args, err)
		}
	}
}

// TestAnEmptyEmbeddedNATSSettingIsTakenWithExternalNATS: an embedded
// server setting left empty (a deployment template that always renders
// KVROUTER_NATS_CLUSTER_ADDR and KVROUTER_NATS_ROUTES, empty for an
// external NATS; a script passing --nats-routes "$ROUTES" with ROUTES
// empty) configures nothing, and --nats-url takes it. From a review: it
// was refused as if it configured the embedded server, where the
// embedded server's own checks read those flags by value.
func TestAnEmptyEmbeddedNATSSettingIsTakenWithExternalNATS(t *testing.T) {
	const ext = "nats://127.0.0.1:4222"
	for _, c := range []struct {
		env  string
		args []string
	}{
		{"KVROUTER_NATS_CLUSTER_ADDR", nil},
		{"KVROUTER_NATS_ROUTES", nil},
		{"KVROUTER_NATS_ADDR", nil},
		{"", []string{"--nats-routes", ""}},
		{"", []string{"--nats-routes", " , "}},
		{"", []string{"--nats-cluster-addr", ""}},
		{"", []string{"--nats-addr", ""}},
	} {
		t.Run(c.env+strings.Join(c.args, "="), func(t *testing.T) {
			if c.env != "" {
				t.Setenv(c.env, "")
			}
			if err := natsFlagCheck(t, append([]string{"--nats-url", ext}, c.args...)...); err != nil {
				t.Errorf("--nats-url %s: %v", ext, err)
			}
		})
	}
	// The same empty values with the embedded server are taken as unset.
	t.Setenv("KVROUTER_NATS_CLUSTER_ADDR", "")
	if err := natsFlagCheck(t, "--nats-routes", ""); err != nil {
		t.Fatalf("embedded, empty cluster address and routes: %v", err)
	}
}

// TestExternalNATSTakesTheUserAndPasswordFlags: with --nats-url, the node
// connects with --nats-user and --nats-password, which
// TestNATSFlagsThatWouldBeIgnoredAreRefused refuses with a URL that names
// a user.
func TestExternalNATSTakesTheUserAndPasswordFlags(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: "127.0.0.1:0", User: "alice", Password: "pw"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	own := s.NumSubscriptions() // the server's own
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := startNode(t, ctx, func() []string {
		return []string{"--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t),
			"--nats-url", s.ClientURL(), "--nats-user", "alice", "--nats-password", "pw", "--log-level", "error"}
	}, func() bool { return s.NumSubscriptions() > own })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("--nats-url %s --nats-user alice --nats-password pw: %v", s.ClientURL(), err)
	}
}

// TestAnExternalNATSConnectionClosedForGoodStopsTheNode: with --nats-url,
// the node's NATS connection is its event plane (the ingester, the
// heartbeats' answers). When the server refuses its credentials twice in
// a row (rotated, or a server started again with others), nats.go closes
// the connection for good, and the node stops with natswatch.ErrClosed
// (exit 1, for its supervisor to restart it), as kvagent does. From a
// review: kvrouter set no ClosedHandler and ran on, healthy to its
// supervisor, hearing no event and no heartbeat ever again, and logged
// nothing.
func TestAnExternalNATSConnectionClosedForGoodStopsTheNode(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: "127.0.0.1:0", User: "alice", Password: "pw"})
	if err != nil {
		t.Fatal(err)
	}
	addr := strings.TrimPrefix(s.ClientURL(), "nats://")
	own := s.NumSubscriptions() // the server's own
	// What a node that runs on is stopped after, from the fault: its
	// start, up to 20 s on a loaded machine (runUntilReady), is not
	// taken out of it. Generous: the bound ends a hang, and a node
	// that stops as it should returns in a few seconds.
	const runFor = 30 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A subscription, not a client: a client counts from its accept,
	// before its connect is through, and a shutdown then fails the start.
	done := startNode(t, ctx, func() []string {
		return []string{"--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t),
			"--nats-url", s.ClientURL(), "--nats-user", "alice", "--nats-password", "pw", "--log-level", "error"}
	}, func() bool { return s.NumSubscriptions() > own })
	s.Shutdown()
	s.WaitForShutdown()
	// The same server, its password changed: every reconnect is refused.
	s2, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: addr, User: "alice", Password: "rotated"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s2.Shutdown(); s2.WaitForShutdown() }()
	start := time.Now()
	defer time.AfterFunc(runFor, cancel).Stop()
	err = <-done
	if took := time.Since(start); !errors.Is(err, natswatch.ErrClosed) {
		t.Fatalf("kvrouter returned %v after %v with its NATS connection closed for good (it is stopped after %v); want %v, as kvagent stops",
			err, took.Round(time.Millisecond), runFor, natswatch.ErrClosed)
	}
}

// TestAnExternalNATSCredsFileGoneBadStopsTheNode: a --nats-creds file
// that held credentials at the start (checkNATSFiles took it) and holds
// none when the connection is made again stops the node with an error
// naming --nats-creds (exit 1), as kvagent stops. From a review: nats.go
// retries such a file for ever, reporting nothing (natswatch's
// ClosedHandler never fires), and the node ran on, looking healthy, with
// an ingester and a heartbeat answerer that heard nothing.
func TestAnExternalNATSCredsFileGoneBadStopsTheNode(t *testing.T) {
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	addr := strings.TrimPrefix(s.ClientURL(), "nats://")
	creds := natstest.WriteCreds(t, t.TempDir())
	own := s.NumSubscriptions() // the server's own
	// What a node that runs on is stopped after, from the fault: its
	// start, up to 20 s on a loaded machine (runUntilReady), is not
	// taken out of it. Generous: the bound ends a hang, and a node
	// that stops as it should returns in a few seconds.
	const runFor = 30 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := startNode(t, ctx, func() []string {
		return []string{"--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t),
			"--nats-url", s.ClientURL(), "--nats-creds", creds, "--log-level", "error"}
	}, func() bool { return s.NumSubscriptions() > own })
	if err := os.WriteFile(creds, []byte("not a creds file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s.Shutdown()
	s.WaitForShutdown()
	// The same server: the node's reconnects read the file again.
	s2, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: addr})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s2.Shutdown(); s2.WaitForShutdown() }()
	start := time.Now()
	defer time.AfterFunc(runFor, cancel).Stop()
	err = <-done
	if took := time.Since(start); err == nil || !strings.Contains(err.Error(), "--nats-creds") {
		t.Fatalf("kvrouter returned %v after %v with a --nats-creds file gone bad (it is stopped after %v); want an error naming --nats-creds, as kvagent stops",
			err, took.Round(time.Millisecond), runFor)
	}
}

// TestANATSNotUpYetIsWaitedFor: with --nats-url, a NATS server not up
// yet (started beside the nodes) is waited for, as kvagent waits for it
// and as a lost connection is: the node starts (ready), logs that it
// cannot reach NATS, and subscribes once the server is up;
// kvrouter_nats_connected reads 0 until then, and 1 after, and /readyz's
// body shows nats disconnected, then connected. From a review:
// nats.Connect without RetryOnFailedConnect failed the start (exit 1),
// after the data directory was locked and the ports taken.
func TestANATSNotUpYetIsWaitedFor(t *testing.T) {
	// NATS "not up yet" is a proxy in front of it, cut: it holds its
	// port from the start, where a port released for a server to take
	// later could be taken by another socket first.
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: "ext", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	own := s.NumSubscriptions() // the server's own
	proxy, err := netproxy.New(strings.TrimPrefix(s.ClientURL(), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	proxy.Cut()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var httpAddr string
	done := startNode(t, ctx, func() []string {
		httpAddr = freeAddr(t)
		return []string{"--data-dir", t.TempDir(), "--http-addr", httpAddr, "--raft-addr", freeAddr(t),
			"--nats-url", "nats://" + proxy.Addr(), "--log-level", "error"}
	}, func() bool { return answersReady(httpAddr) })
	t.Cleanup(func() {
		cancel()
		<-done
	})
	if b := readyzOf(t, httpAddr); !strings.Contains(b, `"nats":"disconnected"`) {
		t.Errorf("/readyz of a node whose NATS is not up: %s, want it to show nats disconnected", b)
	}
	if m := metricsOf(t, httpAddr); !strings.Contains(m, "\nkvrouter_nats_connected 0\n") {
		t.Errorf("/metrics of a node whose NATS is not up has no kvrouter_nats_connected 0:\n%s", m)
	}
	proxy.Heal()
	pollRunning(t, done, "the node's subscriptions once NATS is up", func() bool { return s.NumSubscriptions() > own })
	pollRunning(t, done, "kvrouter_nats_connected 1 once NATS is up", func() bool {
		return strings.Contains(metricsOf(t, httpAddr), "\nkvrouter_nats_connected 1\n")
	})
	if b := readyzOf(t, httpAddr); !strings.Contains(b, `"nats":"connected"`) {
		t.Errorf("/readyz of a node connected to NATS: %s, want it to show nats connected", b)
	}
	cancel()
	err = <-done
	done <- nil // for the cleanup
	if err != nil {
		t.Fatalf("kvrouter stopped: %v", err)
	}
}

// metricsOf is the body of the node's /metrics at httpAddr.
func metricsOf(t *testing.T, httpAddr string) string {
	t.Helper()
	r, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// readyzOf is the body of the node's /readyz at httpAddr.
func readyzOf(t *testing.T, httpAddr string) string {
	t.Helper()
	r, err := http.Get("http://" + httpAddr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestSlowConsumersAreCountedOnMetrics: /metrics has
// kvrouter_nats_slow_consumer_total (natswatch.ErrorHandler counts
// nats.go's reports of a subscription of the node's NATS connection falling
// behind, events or heartbeats dropped), from the start, at 0. From a
// review: neither connection had an ErrorHandler, and nats.go's default
// wrote such drops to stderr outside the log, counted nowhere. So has
// kvrouter_nats_authentication_failures_total (the embedded server's
// refusals of credentials, logged at most once a minute).
func TestSlowConsumersAreCountedOnMetrics(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var httpAddr string
	done := startNode(t, ctx, func() []string {
		httpAddr = freeAddr(t)
		return []string{"--data-dir", t.TempDir(), "--http-addr", httpAddr, "--raft-addr", freeAddr(t),
			"--nats-addr", "127.0.0.1:0", "--log-level", "error"}
	}, func() bool { return answersReady(httpAddr) })
	t.Cleanup(func() {
		cancel()
		<-done
	})
	r, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"\nkvrouter_nats_slow_consumer_total 0\n", "\nkvrouter_nats_connected 1\n",
		"\nkvrouter_nats_authentication_failures_total 0\n"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("/metrics has no %q:\n%s", strings.TrimSpace(want), b)
		}
	}
}

// TestARestartedMemberWithAnUnclusteredNATSSaysSo: a member of a cluster
// whose embedded NATS is not clustered (no --nats-cluster-addr) says so
// in its log at start, as docs/operations.md promises, also when it is
// restarted as the docs allow, without --peers or --join (its directory
// holds the cluster). From a review: the warning looked at the flags only.
func TestARestartedMemberWithAnUnclusteredNATSSaysSo(t *testing.T) {
	r1, r2, h1, h2 := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	dir := t.TempDir()
	n, err := raftfsm.NewNode(raftfsm.Config{ID: "n1", RaftAddr: r1, HTTPAddr: h1, DataDir: dir, Logger: slog.New(slog.DiscardHandler),
		Peers: []raftfsm.Member{{ID: "n1", RaftAddr: r1, HTTPAddr: h1, Voter: true}, {ID: "n2", RaftAddr: r2, HTTPAddr: h2, Voter: true}}})
	if err != nil {
		t.Fatal(err)
	}
	n.Close()
	logged := stderrOf(t, func() {
		err = runKvrouterFor(t, time.Second, "--node-id", "n1", "--data-dir", dir, "--raft-addr", r1, "--http-addr", h1, "--nats-addr", "127.0.0.1:0")
	})
	if err != nil {
		t.Fatalf("n1 restarted: %v", err)
	}
	if want := "the embedded NATS server is not clustered"; !strings.Contains(logged, want) {
		t.Errorf("member n1 of a 2-node cluster restarted without --peers, its NATS not clustered: no %q in its log:\n%s", want, logged)
	}
}

// TestANATSClusterPortInUseNamesThatAddress: a node whose
// --nats-cluster-addr is taken stops before Raft naming that address, not
// --nats-addr. From a review: it said "nats server on <--nats-addr>:
// Error listening on router port: <port>", the client address, which was
// free, and the one in use as a bare port.
func TestANATSClusterPortInUseNamesThatAddress(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	natsAddr := freeAddr(t)
	err = runKvrouter(t, "--data-dir", t.TempDir(), "--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t),
		"--nats-addr", natsAddr, "--nats-cluster-addr", taken.Addr().String(), "--log-level", "error")
	if err == nil || !strings.Contains(err.Error(), "cluster address "+taken.Addr().String()) || strings.Contains(err.Error(), natsAddr) {
		t.Errorf("--nats-cluster-addr %s in use (--nats-addr %s free): %v, want an error naming the cluster address %s, not %s",
			taken.Addr(), natsAddr, err, taken.Addr(), natsAddr)
	}
}

// TestANodeIDWithASpaceIsAUsageErrorWithTheEmbeddedNATS: the embedded
// NATS server takes --node-id as its server name, and nats-server refuses
// a name with a space; limits.ID takes it. With the embedded server such
// an id is a usage error (exit 2) naming --node-id, before the data
// directory is touched; an external NATS (--nats-url) never sees it, and
// takes it. From a review: "a b" was refused by nats-server once the data
// directory and its LOCK were made (exit 1, "server name cannot contain
// spaces", no flag named).
func TestANodeIDWithASpaceIsAUsageErrorWithTheEmbeddedNATS(t *testing.T) {
	checkRefusedStart(t, []string{"--node-id", "a b", "--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0"}, "--node-id")
	if err := natsFlagCheck(t, "--node-id", "a b", "--nats-url", "nats://127.0.0.1:4222"); err != nil {
		t.Errorf("--node-id \"a b\" with --nats-url: %v, want it taken", err)
	}
}

// TestANATSAddressWithAServicePortIsAUsageError: --nats-addr and
// --nats-cluster-addr take a numeric port only, as the embedded server
// parses them (eventplane.CheckServerAddr); a service name
// (127.0.0.1:http), which net.Listen takes for --http-addr, is a usage
// error naming the flag before the data directory is touched. From a
// review: the check took it (net.LookupPort) and the server refused it
// once the data directory was made (exit 1); from a later one, a negative
// port likewise.
func TestANATSAddressWithAServicePortIsAUsageError(t *testing.T) {
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--nats-addr", "127.0.0.1:http"}, "--nats-addr"},
		{[]string{"--nats-addr", "127.0.0.1:0", "--nats-cluster-addr", "127.0.0.1:http"}, "--nats-cluster-addr"},
		{[]string{"--nats-addr", "127.0.0.1:-5"}, "--nats-addr"},
	} {
		checkRefusedStart(t, append([]string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t)}, c.args...), c.flag)
	}
}

// TestNATSFilesAreCheckedBeforeTheStart: the --nats-tls-* files (and,
// with --nats-url, --nats-creds) are read before the data directory's
// lock, as the --tls-* files are (TestSecurityFlagsAreChecked): a file
// missing or wrong is a usage error (exit 2) naming its flag. From a
// review: they were read only once the directory was locked and the HTTP
// port taken (exit 1, the message naming no flag). From a later review: a
// creds file holding no credentials was only read, and nats.go retried it
// for ever.
func TestNATSFilesAreCheckedBeforeTheStart(t *testing.T) {
	dir := t.TempDir()
	cert, key := apitest.WriteSelfSigned(t, dir)
	junk, missing := filepath.Join(dir, "junk.pem"), filepath.Join(dir, "missing")
	if err := os.WriteFile(junk, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const ext = "nats://127.0.0.1:4222"
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--nats-tls-cert", missing, "--nats-tls-key", key}, "--nats-tls-cert"},
		{[]string{"--nats-tls-cert", cert, "--nats-tls-key", missing}, "--nats-tls-cert"},
		{[]string{"--nats-tls-cert", junk, "--nats-tls-key", junk}, "--nats-tls-cert"},
		{[]string{"--nats-tls-cert", cert, "--nats-tls-key", key, "--nats-tls-ca", missing}, "--nats-tls-ca"},
		{[]string{"--nats-tls-cert", cert, "--nats-tls-key", key, "--nats-tls-ca", junk}, "--nats-tls-ca"},
		{[]string{"--nats-url", ext, "--nats-tls-cert", missing, "--nats-tls-key", key}, "--nats-tls-cert"},
		{[]string{"--nats-url", ext, "--nats-tls-ca", missing}, "--nats-tls-ca"},
		{[]string{"--nats-url", ext, "--nats-creds", missing}, "--nats-creds"},
		{[]string{"--nats-url", ext, "--nats-creds", junk}, "--nats-creds"},
	} {
		args := []string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t)}
		if c.args[0] != "--nats-url" {
			args = append(args, "--nats-addr", "127.0.0.1:0") // the embedded server
		}
		checkRefusedStart(t, append(args, c.args...), c.flag)
	}
}

// natsContext is the cli.Context of kvrouter's flags parsed from args,
// as startNATS takes it.
func natsContext(t *testing.T, args ...string) *cli.Context {
	t.Helper()
	app := newApp()
	set := flag.NewFlagSet("kvrouter", flag.ContinueOnError)
	for _, f := range app.Flags {
		if err := f.Apply(set); err != nil {
			t.Fatal(err)
		}
	}
	if err := set.Parse(args); err != nil {
		t.Fatal(err)
	}
	return cli.NewContext(app, set, nil)
}

// TestTheNodesConnectionsCountASlowConsumer: a subscription of the
// connection startNATS makes, to the embedded server and to an external
// NATS, that falls behind is counted in the node's slow-consumer counter
// (natswatch's error handler is among the connection's options), not
// left to nats.go's default handler.
func TestTheNodesConnectionsCountASlowConsumer(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Addr: "127.0.0.1:0", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	for name, args := range map[string][]string{
		"embedded": {"--nats-addr", "127.0.0.1:0"},
		"external": {"--nats-url", ns.ClientURL()},
	} {
		t.Run(name, func(t *testing.T) {
			slow := prometheus.NewCounter(prometheus.CounterOpts{Name: "slow_total"})
			_, lost := context.WithCancelCause(context.Background())
			defer lost(nil)
			nc, closeNATS, err := startNATS(natsContext(t, args...), "n1", slog.New(slog.DiscardHandler), lost, slow, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer closeNATS()
			release := make(chan struct{})
			defer close(release)
			sub, err := nc.Subscribe("kv.events", func(*nats.Msg) { <-release })
			if err != nil {
				t.Fatal(err)
			}
			if err := sub.SetPendingLimits(1, -1); err != nil {
				t.Fatal(err)
			}
			counted := func() float64 {
				var m dto.Metric
				if err := slow.Write(&m); err != nil {
					t.Fatal(err)
				}
				return m.GetCounter().GetValue()
			}
			deadline := time.Now().Add(10 * time.Second)
			for counted() == 0 {
				if time.Now().After(deadline) {
					t.Fatal("a subscription that fell behind was not counted in 10 s")
				}
				if err := nc.Publish("kv.events", []byte("x")); err != nil {
					t.Fatal(err)
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// TestALeaderAloneWithoutNATSKeepsItsLeadership: with
// --nats-handover-after, a leader whose NATS connection stays down that
// long looks for a voter connected to NATS to take over; alone in its
// cluster it finds none, keeps leading, and counts the try
// (kvrouter_nats_handovers_total{outcome="no_candidate"}).
func TestALeaderAloneWithoutNATSKeepsItsLeadership(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var httpAddr string
	done := startNode(t, ctx, func() []string {
		httpAddr = freeAddr(t)
		return []string{"--data-dir", t.TempDir(), "--http-addr", httpAddr, "--raft-addr", freeAddr(t),
			"--nats-url", "nats://" + freeAddr(t), "--nats-handover-after", "50ms", "--log-level", "error"}
	}, func() bool { return answersReady(httpAddr) })
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("kvrouter stopped: %v", err)
		}
	}()
	pollRunning(t, done, "a handover try that finds no other voter", func() bool {
		r, err := http.Get("http://" + httpAddr + "/metrics")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		b, err := io.ReadAll(r.Body)
		return err == nil && strings.Contains(string(b), `kvrouter_nats_handovers_total{outcome="no_candidate"}`)
	})
	if b := readyzOf(t, httpAddr); !strings.Contains(b, `"state":"Leader"`) {
		t.Errorf("/readyz after the try: %s, want the node still leading", b)
	}
}

// TestPeerReadyWithNATSAsksTheMembersReadyz: the handover takes a member
// as connected only when its /readyz answers ready with nats connected;
// not ready, disconnected, a build that does not say, or no answer is no.
func TestPeerReadyWithNATSAsksTheMembersReadyz(t *testing.T) {
	var answer atomic.Pointer[string]
	status := atomic.Int32{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(status.Load()))
		io.WriteString(w, *answer.Load())
	}))
	defer srv.Close()
	ask := peerReadyWithNATS(http.DefaultTransport, "http")
	m := raftfsm.Member{ID: "n2", HTTPAddr: strings.TrimPrefix(srv.URL, "http://"), Voter: true}
	for _, tc := range []struct {
		code int
		body string
		want bool
	}{
		{200, `{"ready":true,"state":"Follower","applied_index":7,"nats":"connected"}`, true},
		{200, `{"ready":true,"state":"Follower","applied_index":7,"nats":"disconnected"}`, false},
		{200, `{"ready":true,"state":"Follower","applied_index":7}`, false},
		{503, `{"ready":false,"state":"Candidate","applied_index":7,"nats":"connected","error":"no leader","reason":"not_ready"}`, false},
	} {
		status.Store(int32(tc.code))
		answer.Store(&tc.body)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		got, err := ask(ctx, m)
		cancel()
		if err != nil || got != tc.want {
			t.Errorf("/readyz %d %s: %v, %v; want %v", tc.code, tc.body, got, err, tc.want)
		}
	}
	srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if got, err := ask(ctx, m); got || err == nil {
		t.Errorf("a member that does not answer: %v, %v; want false and an error", got, err)
	}
}

// TestANATSTokenInTheURLIsNeverShown: a --nats-url whose user information
// has no password carries a NATS token (docs/events.md: "nats://alice@host
// sends alice as a token"; nats.go sends the user name as auth_token), the
// URL's only secret. Like a password, it must not show in the log or in
// what RedactURLs gives for messages. From a review: it showed in both
// (nats.go's ConnectedUrlRedacted hides a password only).
func TestANATSTokenInTheURLIsNeverShown(t *testing.T) {
	const token = "s3cretNatsToken"
	if shown := eventplane.RedactURLs("nats://" + token + "@h:4222"); strings.Contains(shown, token) {
		t.Errorf("RedactURLs shows the NATS token: %q", shown)
	}
	var err error
	logged := stderrOf(t, func() {
		err = runKvrouterFor(t, 2*time.Second, "--data-dir", t.TempDir(), "--raft-addr", freeAddr(t), "--http-addr", "127.0.0.1:0",
			"--nats-url", "nats://"+token+"@"+freeAddr(t))
	})
	if err != nil || !strings.Contains(logged, "cannot reach NATS") {
		t.Fatalf("kvrouter with an external NATS it cannot reach: %v; log:\n%s", err, logged)
	}
	if strings.Contains(logged, token) {
		t.Fatalf("kvrouter's log shows the NATS token given in --nats-url:\n%s", logged)
	}
}

// TestTheEmbeddedNATSRefusesAUserWithoutAPassword: the embedded server
// given --nats-user and no --nats-password lets in any client that names
// the user (nats-server compares the client's password with an empty
// one), so a user name, no secret, would pass for a credential: kvrouter
// refuses the combination at start (exit 2), naming both flags.
func TestTheEmbeddedNATSRefusesAUserWithoutAPassword(t *testing.T) {
	err := checkRefusedStart(t, []string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t), "--nats-user", "alice"}, "--nats-user")
	if err == nil || !strings.Contains(err.Error(), "--nats-password") {
		t.Fatalf("kvrouter --nats-user alone: %v, want it refused naming --nats-password too", err)
	}
}
