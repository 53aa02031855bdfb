package eventplane

import (
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// TestADownPeersRouteDoesNotFloodTheLog: three embedded NATS servers wired
// as cmd/kvrouter wires them (--nats-routes naming every node's cluster
// address); one stops (a node killed). The others must not log an Error
// line per route reconnect attempt for as long as it is down (seen: 4 lines/s
// on a survivor, each attempt twice, unbounded), with no summary or bound.
func TestADownPeersRouteDoesNotFloodTheLog(t *testing.T) {
	var addrs []string
	for range 3 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, ln.Addr().String())
		ln.Close()
	}
	var logs testlog.Buffer
	srvs := make([]*server.Server, 3)
	for i := 2; i >= 0; i-- { // n1 last: its routes to n2 and n3 are its own dials (solicited), as a node started after its peers
		l := quiet
		if i == 0 {
			l = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
		}
		s, err := StartServer(ServerConfig{Name: fmt.Sprintf("n%d", i+1), Addr: "127.0.0.1:0", ClusterAddr: addrs[i], Routes: addrs, Logger: l})
		if err != nil {
			t.Fatal(err)
		}
		srvs[i] = s
		defer s.Shutdown()
	}
	waitFor(t, 10*time.Second, "nats routes", func() bool {
		for _, s := range srvs {
			if s.NumRoutes() < 2 {
				return false
			}
		}
		return true
	})
	srvs[2].Shutdown()
	srvs[2].WaitForShutdown()
	time.Sleep(time.Second)
	before := len(logs.Lines("Error trying to connect to route"))
	const window = 5 * time.Second
	time.Sleep(window)
	lines := logs.Lines("Error trying to connect to route")
	n := len(lines) - before
	if n > 3 {
		t.Fatalf("n3's NATS server down for %v: n1 logged %d route connect errors (%.1f/s, unbounded for as long as it is down), want at most 3; last: %s",
			window, n, float64(n)/window.Seconds(), strings.TrimSpace(lines[len(lines)-1]))
	}
}

// TestADumpOverMaxPayloadIsNotLoggedAtEveryRetry: a rank whose dump is
// larger than the NATS server's max_payload (docs/offload.md: "stays
// behind (its dump is retried with backoff, and logged)") is retried every
// MaxBackoff (500 ms) for ever, and each retry logs an Error line: 2 lines/s
// per such rank, ~170,000 a day, no summary (the count of retries is what
// a metric is for).
func TestADumpOverMaxPayloadIsNotLoggedAtEveryRetry(t *testing.T) {
	var logs testlog.Buffer
	nc := scriptedLeader(t, nil, func(m *nats.Msg) { m.Respond(appendDumpOK(nil, 1)) })
	big := make([]kvevent.Event, 1_000_000) // ~28 bytes each: over the embedded server's 8 MiB
	for i := range big {
		big[i] = kvevent.Event{Tier: kvevent.TierDevice, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: uint64(i + 1), LocalHash: uint64(i + 1)}}}
	}
	p, err := NewPublisher(PublisherConfig{Conn: nc, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Dump: func(kvevent.Rank) ([]kvevent.Event, uint64) { return big, 0 }})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.Resync(kvevent.Rank{Worker: 2})
	const what = "request larger than the NATS server takes"
	waitFor(t, 10*time.Second, "the first refusal", func() bool { return len(logs.Lines(what)) > 0 })
	time.Sleep(2 * time.Second) // the backoff at its ceiling
	before := len(logs.Lines(what))
	const window = 5 * time.Second
	time.Sleep(window)
	lines := logs.Lines(what)
	if !strings.Contains(lines[0], "rank") {
		t.Errorf("the refusal's line does not say which rank is stuck (nor what to do: --disk-blocks, or a larger max_payload): %s", strings.TrimSpace(lines[0]))
	}
	if n := len(lines) - before; n > 2 {
		t.Errorf("a dump over max_payload, for %v: %d Error lines (%.1f/s, for as long as the rank is that large), want at most 2; last: %s",
			window, n, float64(n)/window.Seconds(), strings.TrimSpace(lines[len(lines)-1]))
	}
}

// TestFailedNATSAuthenticationsDoNotFloodTheLog: the embedded NATS server
// with --nats-user/--nats-password logs an Error line per client that
// fails to authenticate. Anyone who can reach the client port (no
// credentials needed) writes the log at the rate they connect: seen 1,900
// lines/s from one Python loop on the real binary, and no metric counts them.
func TestFailedNATSAuthenticationsDoNotFloodTheLog(t *testing.T) {
	var logs testlog.Buffer
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", User: "bob", Password: "s3cret",
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	before := len(logs.Lines("authentication error"))
	const conns = 300
	for range conns {
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		c.Read(make([]byte, 4096)) // INFO
		c.Write([]byte("CONNECT {\"verbose\":false,\"user\":\"eve\",\"pass\":\"guess\"}\r\nPING\r\n"))
		c.Read(make([]byte, 4096)) // -ERR
		c.Close()
	}
	time.Sleep(200 * time.Millisecond)
	lines := logs.Lines("authentication error")
	if n := len(lines) - before; n > 10 {
		t.Fatalf("%d connections with a wrong password: %d Error lines, want a bounded summary (at most 10) and a metric; last: %s",
			conns, n, strings.TrimSpace(lines[len(lines)-1]))
	}
}

// TestFailedNATSAuthenticationsAreCounted: the failures that
// TestFailedNATSAuthenticationsDoNotFloodTheLog leaves out of the log are
// each counted in ServerConfig.AuthFailures
// (kvrouter_nats_authentication_failures_total); a client that
// authenticates is not.
func TestFailedNATSAuthenticationsAreCounted(t *testing.T) {
	failures := prometheus.NewCounter(prometheus.CounterOpts{Name: "failures"})
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", User: "bob", Password: "s3cret", AuthFailures: failures, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	const conns = 5
	for i := range conns {
		if nc, err := nats.Connect(s.ClientURL(), nats.UserInfo(fmt.Sprintf("eve%d", i), "guess"), nats.NoReconnect()); err == nil {
			nc.Close()
			t.Fatal("a client with a wrong password connected")
		}
	}
	nc, err := nats.Connect(s.ClientURL(), nats.UserInfo("bob", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	if got := val(failures); got != conns {
		t.Fatalf("%d connections with a wrong password and one with the right one: %v counted, want %d", conns, got, conns)
	}
}

// TestGarbageClientsDoNotHideTheFirstAuthFailure: an unauthenticated
// client that sends garbage after "C" makes the embedded server log a
// "Client parser ERROR ... proto='...'" line whose snippet is the
// client's bytes. Each garbage was its own kind of the natsLogger's
// limiter: 300 of them filled its 256 kinds, and every new kind after
// that shared the overflow kind, so the first-ever Error line of any
// other kind (here: a wrong password) was not logged at all. A parser
// error is now one kind.
func TestGarbageClientsDoNotHideTheFirstAuthFailure(t *testing.T) {
	var logs testlog.Buffer
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", User: "bob", Password: "s3cret",
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	send := func(b string) {
		c, err := net.Dial("tcp", s.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(2 * time.Second))
		c.Read(make([]byte, 4096)) // INFO
		c.Write([]byte(b))
		c.Read(make([]byte, 4096)) // -ERR
	}
	const garbage = 300
	for i := range garbage {
		send(fmt.Sprintf("Cjunk%s\r\n", strings.Repeat(string(rune('a'+i%26)), 1+i/26)))
	}
	send("CONNECT {\"verbose\":false,\"user\":\"eve\",\"pass\":\"guess\"}\r\nPING\r\n")
	waitFor(t, 5*time.Second, "the wrong password's line, after "+fmt.Sprint(garbage)+" garbage clients' parser errors", func() bool {
		return len(logs.Lines("authentication error")) > 0
	})
	if n := len(logs.Lines("parser ERROR")); n != 1 {
		t.Errorf("%d garbage clients: %d parser-error lines, want 1 (one kind, whatever the bytes)", garbage, n)
	}
}
