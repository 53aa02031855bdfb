package e2e

import (
	"context"
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestLossOfQuorumThenRecovery is fault scenario 17 with the quorum's
// nodes killed: both followers are killed with SIGKILL under the stream
// and started again (lossOfQuorum).
func TestLossOfQuorumThenRecovery(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	lossOfQuorum(t, c, seed, func(lone int) (restore func(), ranThroughout []int) {
		followers := c.others(lone)
		for _, f := range followers {
			c.kill9(f)
		}
		t.Logf("killed both followers, %s and %s; %s stays, alone",
			c.nodes[followers[0]].id, c.nodes[followers[1]].id, c.nodes[lone].id)
		// Both come back at once, the three elect a leader.
		return func() {
			for _, f := range followers {
				c.start(f)
			}
			c.waitAllReady()
		}, []int{lone}
	})
}

// TestPartitionWithNoMajorityThenHeal is fault scenario 17 with every
// node running: every Raft link is cut under the stream, so that each
// node is alone and none has a quorum, then healed (lossOfQuorum).
func TestPartitionWithNoMajorityThenHeal(t *testing.T) {
	seed := testSeed(t)
	c, h := startPartitionedCluster(t, 3)
	lossOfQuorum(t, c, seed, func(int) (restore func(), ranThroughout []int) {
		for i := range c.nodes {
			h.isolate(i)
		}
		return h.heal, []int{0, 1, 2}
	})
}

// lossOfQuorum is fault scenario 17, loss of quorum, then recovery: two
// publishers stream event batches through every node (retrying what was
// not acknowledged, on the next node) and a probe writes to the leader
// only, when lose takes the quorum away from it. The leader, without a
// quorum, steps down, reports itself not ready, and refuses every write
// (503 no_leader), and nothing is acknowledged, through it or anywhere,
// until lose's restore brings the quorum back. Then a leader is elected,
// the stream goes on through every node, the probe's through the old
// leader, and every node holds exactly what was acknowledged, at one
// applied index with one digest; the nodes at ranThroughout (running
// since the start, no snapshot restored) applied each acknowledged event
// once.
func lossOfQuorum(t *testing.T, c *cluster, seed uint64, lose func(lone int) (restore func(), ranThroughout []int)) {
	t.Helper()
	probe := newPublisher(seed, probeRank)
	pubs, all := registeredPublishers(t, c.cl, seed, probe)

	s := newStream(t, ctxT(t, 2*convergeTimeout))
	s.publish(c, pubs)
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the quorum is lost")

	// lone is the leader when the quorum goes: lose leaves it alone. The
	// probe writes only to it, one request at a time until it is
	// acknowledged. Its answers to the writes sent while the quorum is
	// gone are counted (probeTally).
	lone := c.leader()
	pt := s.probe(c, c.nodes[lone].cl, probe)

	restore, ranThroughout := lose(lone)

	// The lone node steps down (its lease runs out without a quorum) and
	// is not ready: it knows no leader.
	c.waitFor(leaderTimeout, "the lone node to step down and report itself not ready", func() (bool, string) {
		st := c.status(lone)
		if st == nil {
			return false, "no answer"
		}
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		r, err := c.nodes[lone].cl.Ready(ctx)
		if err != nil {
			return false, fmt.Sprintf("%s; readyz: %v", describe([]*raftfsm.NodeStatus{st}), err)
		}
		return st.State != "Leader" && st.LeaderID == "" && !r.Ready,
			fmt.Sprintf("%s; ready %v", describe([]*raftfsm.NodeStatus{st}), r.Ready)
	})
	// From here on nothing can commit. A request the old leader committed
	// before the quorum went may still be answered, its apply or its
	// answer slow under load: the count is taken once the lone node has
	// applied all it committed, and the check is that nothing after that
	// is acknowledged.
	c.waitFor(leaderTimeout, "the lone node to apply all it committed", func() (bool, string) {
		st := c.status(lone)
		if st == nil {
			return false, "no answer"
		}
		return st.AppliedIndex >= st.CommitIndex, describe([]*raftfsm.NodeStatus{st}) +
			fmt.Sprintf(" applied %d of %d committed", st.AppliedIndex, st.CommitIndex)
	})
	pt.during.Store(true)
	atLost := s.acked.Load()
	probeAtLost := pt.ok.Load()
	commitAtLost := c.status(lone).CommitIndex
	s.until(c, "the lone node to refuse 10 probe writes", func() (bool, string) {
		return pt.refused.Load() >= 10, fmt.Sprintf("%d refused, %d other errors", pt.refused.Load(), pt.other.Load())
	})
	// The publishers were sent to every node meanwhile, the lone one
	// included: none of them got anything acknowledged.
	st := c.status(lone)
	if st == nil {
		t.Fatalf("the lone node does not answer: %s", describe(c.statusAll()))
	}
	switch {
	case s.acked.Load() != atLost:
		t.Fatalf("%d requests acknowledged without a quorum", s.acked.Load()-atLost)
	case pt.acked.Load() != 0:
		t.Fatalf("the lone node acknowledged %d probe writes without a quorum", pt.acked.Load())
	case st.CommitIndex != commitAtLost:
		t.Fatalf("the lone node's commit index went from %d to %d without a quorum", commitAtLost, st.CommitIndex)
	}
	t.Logf("without a quorum: %s; the probe: %d writes refused, %d failed otherwise",
		describe([]*raftfsm.NodeStatus{st}), pt.refused.Load(), pt.other.Load())

	restore()
	pt.during.Store(false)
	lead := c.leader()
	s.ackedAtLeast(c, atLost+20, "20 requests acknowledged after the quorum is back")
	s.until(c, "a probe write acknowledged through the lone node", func() (bool, string) {
		return pt.ok.Load() > probeAtLost, "none yet"
	})
	s.wait(t)

	retries, dups := totals(pubs)
	t.Logf("quorum lost after %d acknowledged requests, back with leader %s; %d in all; %d requests retried, %d events acknowledged as duplicates; the probe: %d acknowledged",
		atLost, c.nodes[lead].id, s.acked.Load(), retries, dups, pt.ok.Load())
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	c.appliedOnceAt(all, ranThroughout)
}
