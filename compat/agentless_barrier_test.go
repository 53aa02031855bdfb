package compat

import (
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// polledLeader is a checkedLeader that counts the reads of its Raft: the
// agentless loop reads the term (termOf) at the start of every poll,
// whatever it then asks to learn whether the node leads.
type polledLeader struct {
	*checkedLeader
	polls atomic.Int64
}

func (p *polledLeader) Raft() *raft.Raft {
	p.polls.Add(1)
	return p.checkedLeader.Raft()
}

// TestAgentlessWaitsForTheLeadersBarrier: from a review. A node that
// leads (its Raft state is Leader) but has not yet applied its
// post-election Barrier may hold stale cursors, the ones its predecessor
// moved since; a subscriber started then would resume from them. No
// subscriber starts until CheckLeader says the node leads with every
// earlier entry applied; then the rank's starts at the next poll. Every
// other agentless test's target answers CheckLeader with nil, so a loop
// that asked Raft's state only went unnoticed.
func TestAgentlessWaitsForTheLeadersBarrier(t *testing.T) {
	n := startNode(t)
	pub := newEngine(t, true)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: pub.Endpoint(),
		ReplayEndpoint: pub.ReplayEndpoint(), ModelName: "llama", BlockSize: testBlockSize}), 201, "register")
	rk := kvevent.Rank{Worker: WorkerID(1, "llama", DefaultTenant)}

	var barrierApplied atomic.Bool
	target := &polledLeader{checkedLeader: &checkedLeader{Node: n.node, check: func() error {
		if barrierApplied.Load() {
			return nil
		}
		return fmt.Errorf("%w: this node was just elected and has not yet applied every entry of the terms before its own; retry",
			raftfsm.ErrNoLeader)
	}}}
	ag := NewAgentless(target, AgentlessConfig{Poll: 20 * time.Millisecond, Registerer: prometheus.NewRegistry(), Logger: quiet})
	t.Cleanup(func() { ag.Close() })

	// A poll reconciles before the next one reads the term: by the third
	// read, two polls before the Barrier have reconciled.
	waitFor(t, 10*time.Second, "three polls", func() bool { return target.polls.Load() >= 3 })
	if !n.node.IsLeader() {
		t.Fatal("the node does not lead: the test shows nothing")
	}
	if got := ag.Ranks(); len(got) != 0 {
		t.Fatalf("ranks followed before the leader's Barrier applied: %v, want none", got)
	}

	barrierApplied.Store(true)
	waitFor(t, 10*time.Second, "the rank followed once the Barrier applied", func() bool { return slices.Contains(ag.Ranks(), rk) })
	waitSubscribed(t, pub, 1)
}
