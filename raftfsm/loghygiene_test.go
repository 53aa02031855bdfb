package raftfsm

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// TestAFollowerDownDoesNotFloodTheLeadersLog: one follower killed (its
// raft port refuses connections) must not have the leader log an Error
// line per heartbeat retry for as long as it is down: that is ~8 lines/s
// (~140 MB/day) per down peer, forever, hiding the lines that matter. A
// bounded summary (first failure, then one every so often, with the peer
// and what to do) is what an operator needs.
func TestAFollowerDownDoesNotFloodTheLeadersLog(t *testing.T) {
	var logs testlog.Buffer
	c := newTestCluster(t, 3, func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	l := c.leader()
	c.converged()
	down := c.followerOf(l)
	c.stop(down)
	waitFor(t, 10*time.Second, "the leader's first 'failed to heartbeat' line", func() bool {
		return len(logs.Lines("failed to heartbeat")) > 0
	})
	before := len(logs.Lines("failed to heartbeat"))
	const window = 5 * time.Second
	time.Sleep(window)
	lines := logs.Lines("failed to heartbeat")
	n := len(lines) - before
	if n > 5 {
		t.Fatalf("%s down for %v: the leader logged %d 'failed to heartbeat' lines (%.1f/s, unbounded for as long as it is down), want at most 5; last: %s",
			c.id(down), window, n, float64(n)/window.Seconds(), strings.TrimSpace(lines[len(lines)-1]))
	}
}
