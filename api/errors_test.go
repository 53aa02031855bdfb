package api

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestClassifyAWriteNeverProposed: a write Raft never took is no_leader
// (nothing applied: the client moves on), whatever deadline it wraps, but
// one whose client went away is canceled, as any other. From a review:
// taking the Canceled exception out of classify left every test green.
func TestClassifyAWriteNeverProposed(t *testing.T) {
	for _, c := range []struct {
		err    error
		reason string
	}{
		{fmt.Errorf("raft apply: %w: %w", raftfsm.ErrNotProposed, context.DeadlineExceeded), ReasonNoLeader},
		{fmt.Errorf("raft apply: %w: %w", raftfsm.ErrNotProposed, context.Canceled), ReasonCanceled},
		{fmt.Errorf("raft apply: %w", context.DeadlineExceeded), ReasonTimeout},
	} {
		code, reason := classify(c.err)
		if code != http.StatusServiceUnavailable || reason != c.reason {
			t.Errorf("classify(%v) = %d %s, want 503 %s", c.err, code, reason, c.reason)
		}
	}
}

// TestClassifyARestoreBehindAnUncommittedConfiguration: a restore Raft
// refused before it read the stream, a membership change's entry not yet
// committed (raftfsm wraps ErrNoLeader), is 503 no_leader (nothing
// installed: the client moves on, and a retry takes it), not 500 internal.
func TestClassifyARestoreBehindAnUncommittedConfiguration(t *testing.T) {
	err := fmt.Errorf("restore: nothing was installed: %w: a membership change is committing, and raft takes a restore only once it has (cannot restore snapshot now); retry", raftfsm.ErrNoLeader)
	if code, reason := classify(err); code != http.StatusServiceUnavailable || reason != ReasonNoLeader {
		t.Fatalf("classify(%v) = %d %s, want 503 %s", err, code, reason, ReasonNoLeader)
	}
}

// TestClassifyAWriteAnsweredWithTheApplyHalt pins that a write a leader
// halted at an entry of a later build answers (raftfsm.ApplyHalt: its
// state machine applies nothing until it is upgraded) is not 400
// invalid. Raft answers the write's future only once its entry is
// committed: the upgraded nodes, a quorum, apply it, and the halted
// leader applies it once upgraded (docs/operations.md, "Upgrade"). The
// request was valid and is in effect; 400 invalid tells the client that
// it was refused for its content and never applied.
func TestClassifyAWriteAnsweredWithTheApplyHalt(t *testing.T) {
	halt := &raftfsm.ApplyHalt{Index: 11, Term: 2, Err: fmt.Errorf("%w: command type 12", raftfsm.ErrLaterBuild)}
	for _, err := range []error{halt, fmt.Errorf("register worker 7: %w", halt)} {
		if code, reason := classify(err); code == http.StatusBadRequest || reason == ReasonInvalid {
			t.Errorf("classify(%v) = %d %s, want no 400 invalid: the write is committed, and applied by the upgraded nodes", err, code, reason)
		}
	}
}
