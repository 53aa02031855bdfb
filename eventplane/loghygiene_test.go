package eventplane

import (
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/nats-io/nats-server/v2/server"
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
