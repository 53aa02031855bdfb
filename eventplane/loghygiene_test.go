package eventplane

import (
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/lograte"
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
	var logs testlog.Buffer
	srvs, _ := downPeers(t, 3, &logs, 0, 0)
	srvs[2].Shutdown()
	srvs[2].WaitForShutdown()
	waitFor(t, 10*time.Second, "the first failed route reconnect's line", func() bool {
		return len(logs.Lines("Error trying to connect to route")) > 0
	})
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
	// Every refusal is counted, the ones left out of the log too
	// (kvagent_events_dumps_too_large_total): the count is what an alert
	// reads. Polled, not read once: on a loaded machine (a -race build
	// beside other tests) a retry, which encodes the whole dump, took
	// longer than the window, and one refusal had been made and logged.
	waitFor(t, time.Minute, "every refusal counted, more than the lines logged", func() bool {
		return val(p.m.tooLarge) > float64(len(logs.Lines(what)))
	})
}

// TestFailedNATSAuthenticationsDoNotFloodTheLog: the embedded NATS server
// with --nats-user/--nats-password logs an Error line per client that
// fails to authenticate. Anyone who can reach the client port (no
// credentials needed) writes the log at the rate they connect: seen 1,900
// lines/s from one Python loop on the real binary, and no metric counts them.
func TestFailedNATSAuthenticationsDoNotFloodTheLog(t *testing.T) {
	var logs testlog.Buffer
	failures := prometheus.NewCounter(prometheus.CounterOpts{Name: "failures"})
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", User: "bob", Password: "s3cret", AuthFailures: failures,
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
	// Each refusal is counted as its line reaches the logger.
	waitFor(t, 10*time.Second, "every refusal to reach the logger", func() bool { return val(failures) >= conns })
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

// downPeers starts n embedded servers routed to each other as cmd/kvrouter
// wires them, the first (started last, its routes its own dials) logging
// to logs, its Error lines limited per every and a down route reported
// every reports-th attempt; it returns them and their route addresses,
// once every route is up.
func downPeers(t *testing.T, n int, logs *testlog.Buffer, every time.Duration, reports int) ([]*server.Server, []string) {
	t.Helper()
	var addrs []string
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, ln.Addr().String())
		ln.Close()
	}
	srvs := make([]*server.Server, n)
	for i := n - 1; i >= 0; i-- {
		l := quiet
		if i == 0 {
			l = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
		}
		s, err := StartServer(ServerConfig{Name: fmt.Sprintf("n%d", i+1), Addr: "127.0.0.1:0", ClusterAddr: addrs[i], Routes: addrs, Logger: l,
			logEvery: every, routeErrorReports: reports})
		if err != nil {
			t.Fatal(err)
		}
		srvs[i] = s
		t.Cleanup(s.Shutdown)
	}
	waitFor(t, 10*time.Second, "nats routes", func() bool {
		for _, s := range srvs {
			if s.NumRoutes() < n-1 {
				return false
			}
		}
		return true
	})
	return srvs, addrs
}

// TestASecondPeerDownIsLogged: n1 with routes to n2 and n3. n2 goes down
// (n1 logs its route's failed reconnect), then n3. natsLogKind folded
// numbers only, so both peers' "Error trying to connect to route
// (attempt N): dial tcp ADDR: ..." lines were one kind: n3's first failed
// reconnect was not logged at all if n2's was within the interval. The
// kind now keeps the peer's address.
func TestASecondPeerDownIsLogged(t *testing.T) {
	var logs testlog.Buffer
	srvs, addrs := downPeers(t, 3, &logs, time.Minute, 0)
	naming := func(addr string) int { return len(logs.Lines("Error trying to connect to route", addr)) }
	srvs[1].Shutdown()
	srvs[1].WaitForShutdown()
	waitFor(t, 5*time.Second, "n2's route error logged", func() bool { return naming(addrs[1]) > 0 })
	srvs[2].Shutdown()
	srvs[2].WaitForShutdown()
	waitFor(t, 5*time.Second, "a route error naming n3 ("+addrs[2]+"), after n2's", func() bool { return naming(addrs[2]) > 0 })
}

// TestADownPeerIsLoggedAboutOnceAMinute: docs/events.md says a down route
// peer is logged at its first failed reconnect and then about a line a
// minute (every routeErrorReports-th attempt, a second apart). With the
// limiter's interval a minute, attempt 60, 59 retries after attempt 1, fell
// inside it and was left out: the second line was attempt 120's, two
// minutes on. Here at a tenth of the scale (attempts reported every 6th,
// the interval 5 s) so that it runs in seconds: the interval must be under
// the reports' period for each report to be logged.
func TestADownPeerIsLoggedAboutOnceAMinute(t *testing.T) {
	var logs testlog.Buffer
	reports := routeErrorReports / 10
	every := natsLogEvery / 10
	srvs, _ := downPeers(t, 2, &logs, every, reports)
	srvs[1].Shutdown()
	srvs[1].WaitForShutdown()
	want := fmt.Sprintf("(attempt %d)", reports)
	waitFor(t, 20*time.Second, "the route error of "+want+", the second reported", func() bool {
		return len(logs.Lines("Error trying to connect to route", want)) > 0
	})
	if n := len(logs.Lines("Error trying to connect to route", "(attempt 1)")); n == 0 {
		t.Errorf("the first failed reconnect, attempt 1, was not logged:\n%s", logs.String())
	}
}

// TestALineLoggedAfterOthersSaysHowMany: the natsLogger's line logged
// after an interval in which others of its kind were held back says how
// many (left_out); the first of a kind says nothing.
func TestALineLoggedAfterOthersSaysHowMany(t *testing.T) {
	var logs testlog.Buffer
	now := time.Unix(1_700_000_000, 0)
	n := natsLogger{l: slog.New(slog.NewTextHandler(&logs, nil)), limit: lograte.New(time.Minute, func() time.Time { return now })}
	for i := range 4 {
		n.Errorf("Error trying to connect to route (attempt %d): dial tcp 127.0.0.1:4001: connect: connection refused", i+1)
	}
	now = now.Add(time.Minute)
	n.Errorf("Error trying to connect to route (attempt %d): dial tcp 127.0.0.1:4001: connect: connection refused", 61)
	lines := logs.Lines("Error trying to connect to route")
	if len(lines) != 2 {
		t.Fatalf("4 lines of a kind, then one a minute later: %d logged, want 2:\n%s", len(lines), logs.String())
	}
	if strings.Contains(lines[0], "left_out") {
		t.Errorf("the first line of its kind: %s\nwant no left_out", lines[0])
	}
	if !strings.Contains(lines[1], "left_out=3") {
		t.Errorf("the line a minute later: %s\nwant left_out=3", lines[1])
	}
}
