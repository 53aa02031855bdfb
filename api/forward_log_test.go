package api_test

import (
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
)

// TestForwardFailureToAnUnreachableLeaderIsRateLimited: a follower whose
// leader's HTTP address refuses connections (the leader's Raft is fine: a
// wrong --http-advertise, a firewall on the HTTP port, the leader's HTTP
// listener gone) logs "api forward to the leader failed" at Warn once per
// minute, not once per forwarded request for as long as that leader keeps
// the leadership (the Raft and NATS lines of the same kind are rate-limited
// too, internal/lograte). From a soak: 140 such lines in 0.22 s on one
// follower right after a leader's kill -9. Every failure is still counted.
func TestForwardFailureToAnUnreachableLeaderIsRateLimited(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close() // connection refused from now on
	var logs logSink
	follower := newNode(t, "n2", api.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	follower.fake.SetFollower("n1", dead)
	const n = 200
	for i := 0; i < n; i++ {
		resp, err := http.Post(follower.http.URL+"/v1/requests/r1/prefill_done", "application/json", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if got := strings.Count(logs.String(), "api forward to the leader failed"); got != 1 {
		t.Fatalf("%d forwards to an unreachable leader logged %d warning lines, want 1 (a minute's worth):\n%s", n, got, logs.String())
	}
	if got := counterValue(t, follower.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "failed"}); got != n {
		t.Fatalf("%d forwards to an unreachable leader counted %v failed, want every one", n, got)
	}
}
