package raftfsm

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// TestRestartWithOtherPeersIsWarnedOf: --peers bootstraps only an empty
// data directory, so a restart with another list is ignored; the start
// says so at Warn, with both lists and the way membership changes
// (kvctl members add/remove). The usual command line, the same --peers,
// logs nothing (a start without --peers compares nothing). From a review: an operator
// who changed --peers on a restart was told nothing, and believed the
// membership had changed.
func TestRestartWithOtherPeersIsWarnedOf(t *testing.T) {
	var logs testlog.Buffer
	var peers []Member // nil: the cluster's own
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		if peers != nil {
			cfg.Peers = peers
		}
	})
	c.leader()
	const warning = "--peers differ from the Raft configuration"
	restart := func(ps []Member) []string {
		t.Helper()
		c.stop(0)
		peers = ps
		before := len(logs.Lines(warning))
		c.start(0)
		c.leader()
		return logs.Lines(warning)[before:]
	}
	if got := logs.Lines(warning); len(got) != 0 {
		t.Fatalf("the bootstrap warned of its own --peers: %q", got)
	}
	if got := restart(c.peers()); len(got) != 0 {
		t.Fatalf("a restart with the same --peers warned: %q", got)
	}
	other := append(c.peers(), Member{ID: "n2", RaftAddr: "127.0.0.1:1", HTTPAddr: "http-n2"})
	got := restart(other)
	if len(got) != 1 {
		t.Fatalf("warnings of a restart with other --peers: %d, want 1: %q", len(got), logs.String())
	}
	for _, want := range []string{"ignored", "kvctl members add/remove", c.dirs[0],
		`peers="n1=` + c.addrs[0] + `,n2=127.0.0.1:1"`, `configuration="n1=` + c.addrs[0] + `"`} {
		if !strings.Contains(got[0], want) {
			t.Fatalf("the warning %q does not say %q", got[0], want)
		}
	}
}
