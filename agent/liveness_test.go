package agent

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
)

// TestFailingHeartbeatsAreLogged: heartbeats that have failed for longer
// than the worker's lease are logged at Warn, once per lease while they
// go on failing, and their recovery at Info. From a review: heartbeat
// errors were dropped, and an agent cut off from the routers logged
// nothing while its worker's lease ran out.
func TestFailingHeartbeatsAreLogged(t *testing.T) {
	ns, err := eventplane.StartServer(eventplane.ServerConfig{Name: "n1", Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var logs testlog.Buffer
	// Nobody answers the heartbeats: each fails at once (no responders).
	a, err := New(Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: 4, Conn: nc,
		Logger: slog.New(slog.NewTextHandler(&logs, nil)), HeartbeatInterval: 10 * time.Millisecond,
		Registration: raftfsm.WorkerInfo{LeaseMs: 100}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	waitFor(t, "two warnings of failing heartbeats", func() bool {
		return len(logs.Lines("level=WARN", "heartbeats have failed", "lease=100ms")) >= 2
	})
	// Answered again.
	sub, err := nc.Subscribe(eventplane.DefaultHeartbeatSubject, func(m *nats.Msg) { m.Respond(nil) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	waitFor(t, "the heartbeats' recovery", func() bool { return len(logs.Lines("level=INFO", "heartbeats answered again")) == 1 })
	// Warned once the heartbeats had failed for the lease, then at most
	// once per lease (by the agent's clock, which each warning's for=
	// gives): the heartbeats failed once each 10 ms.
	prev := time.Duration(0)
	for i, line := range logs.Lines("level=WARN", "heartbeats have failed") {
		_, v, _ := strings.Cut(line, " for=")
		v, _, _ = strings.Cut(v, " ")
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("warning %d does not say for how long the heartbeats failed: %s", i, line)
		}
		if d < prev+99*time.Millisecond {
			t.Errorf("warning %d: heartbeats failed for %v, %v after the warning before: want a warning per lease (100ms) at most", i, d, d-prev)
		}
		prev = d
	}
}
