package raftfsm

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
)

// TestRaftLogLevels: Raft's errors are logged as errors, its warnings as
// warnings, but a connection's reader that finds this node's own transport
// shut down is the routine end of a shutdown: info, not error. From a
// run-through of docs/operations.md: stopping a follower logged it as
// ERROR.
func TestRaftLogLevels(t *testing.T) {
	var out bytes.Buffer
	h := hclogAdapter(slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})))
	h.Error("failed to decode incoming command", "error", "transport shutdown")
	h.Error("failed to appendEntries to", "peer", "n2")
	h.Warn("heartbeat timeout reached")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{"level=INFO", "level=ERROR", "level=WARN"}
	if len(lines) != len(want) {
		t.Fatalf("logged:\n%s", out.String())
	}
	for i, l := range lines {
		if !strings.Contains(l, want[i]) {
			t.Errorf("line %d: %s, want %s", i, l, want[i])
		}
	}
}
