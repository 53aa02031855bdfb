package raftfsm

import (
	"log/slog"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/store"
)

// TestRestartWithAMovedPeerIsWarnedOf: --peers that list the same ids as
// the stored configuration but another Raft address for one of them are
// other --peers too (warnIgnoredPeers compares the addresses with
// SameRaftAddr). TestRestartWithOtherPeersIsWarnedOf adds a peer only: a
// warnIgnoredPeers that compared ids alone passed it.
func TestRestartWithAMovedPeerIsWarnedOf(t *testing.T) {
	var logs testlog.Buffer
	var peers []Member
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
		if peers != nil {
			cfg.Peers = peers
		}
	})
	c.leader()
	c.stop(0)
	moved := c.peers()
	moved[0].RaftAddr = "127.0.0.1:1"
	peers = moved
	c.start(0)
	c.leader()
	if got := logs.Lines("--peers differ from the Raft configuration"); len(got) != 1 {
		t.Fatalf("warnings of a restart with --peers that move n1 to 127.0.0.1:1: %d, want 1: %q", len(got), logs.String())
	}
}

// TestStartRestoringOverAnotherTermsEntryDoesNotWarn: the Warn of
// 5ea6691 is for a state whose entry the log does not hold (unplaced);
// a state whose index the log holds with another term is of another
// history, and its restore is logged at info as before. No test checked
// that: stateOfSnapshotsHistory answering unplaced for that case passed.
func TestStartRestoringOverAnotherTermsEntryDoesNotWarn(t *testing.T) {
	s := startOtherHistory(t)
	if err := seedRaftSnapshotAt(s.c.dirs[0], s.otherDir, s.c.peers(), s.applied-2, s.term); err != nil {
		t.Fatal(err)
	}
	s.editLog(t, func(ls *store.LogStore) {
		if err := ls.DeleteRange(s.applied, s.last); err != nil {
			t.Fatal(err)
		}
		if err := ls.StoreLog(&raft.Log{Index: s.applied, Term: s.term + 1, Type: raft.LogNoop}); err != nil {
			t.Fatal(err)
		}
		if err := ls.SetUint64([]byte("CurrentTerm"), s.term+1); err != nil {
			t.Fatal(err)
		}
	})
	var logs testlog.Buffer
	gate := make(chan struct{})
	defer close(gate)
	s.c.tune = func(cfg *Config) {
		cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
		cfg.applyGate = gate
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	s.c.start(0)
	if got := s.c.nodes[0].fsm.Digest(); got != s.other {
		t.Fatalf("the start kept its own state (%v), want the snapshot's", got == s.own)
	}
	if got := logs.Lines("restoring the newest Raft snapshot over a state applied past it"); len(got) != 0 {
		t.Fatalf("a restore over a state whose entry the log holds with another term warned as unplaced: %q", got)
	}
}
