package e2e

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestAnotherClustersLeaderCannotTakeOverANodeAtAReusedRaftAddress: with
// the binaries, cluster A loses a follower to kill -9, and cluster B
// starts with a node at that follower's raft address (a port reused, as a
// CI run saw: another package's test cluster's leader replicated its
// 3,806 entries into an e2e node). A's leader keeps dialing the address
// and is refused at every connection (it logs so): B forms and converges
// with its own state and id on all three nodes, and A keeps taking
// writes. Before cluster ids, A's leader replicated its log into B's
// node.
func TestAnotherClustersLeaderCannotTakeOverANodeAtAReusedRaftAddress(t *testing.T) {
	a := startCluster(t, 3)
	la := a.leader()
	gone := (la + 1) % 3
	a.kill9(gone)
	b := newCluster(t, 3)
	b.nodes[0].raftAddr = a.nodes[gone].raftAddr
	b.bootstrap()
	register := func(c *cluster, id uint64) {
		w := raftfsm.WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16, Model: "m"}
		c.waitFor(leaderTimeout, fmt.Sprintf("worker %d registered", id), func() (bool, string) {
			err := c.nodes[c.leader()].cl.RegisterWorker(ctxT(t, callTimeout), w)
			if err != nil && !isRefusal(err) && !errors.Is(err, client.ErrOutcomeUnknown) && !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("register worker %d: %v", id, err)
			}
			return err == nil, fmt.Sprint(err)
		})
	}
	register(a, 1)
	register(b, 2)
	a.waitFor(convergeTimeout, "A's leader to be refused at the reused address", func() (bool, string) {
		if strings.Contains(a.runLog(a.leader()), "is a node of cluster") {
			return true, ""
		}
		// Before cluster ids, A's leader walked back to the entry both
		// logs hold (the bootstrap's, term 1) and replicated its own from
		// there into B's node.
		// Its entries reached B's node: B's node logs that the
		// configuration of the leader that sent them differs from its own
		// at the same index (another cluster's first entry).
		if strings.Contains(b.runLog(0), "differs from the leader's at the same log index") {
			t.Fatalf("A's leader replicated its log into B's %s", b.nodes[0].id)
		}
		return false, "no refusal logged yet"
	})
	a.converged()
	b.converged()
	ids := map[string]bool{}
	for i, st := range b.statusAll() {
		if st == nil || st.ClusterID == "" {
			t.Fatalf("B's %s: status %+v, want a cluster id", b.nodes[i].id, st)
		}
		ids[st.ClusterID] = true
		ws, err := b.nodes[i].cl.Workers(ctxT(t, callTimeout))
		if err != nil || len(ws) != 1 || !slices.ContainsFunc(ws, func(w api.Worker) bool { return w.WorkerID == 2 }) {
			t.Fatalf("B's %s holds workers %+v (%v), want B's worker 2 alone", b.nodes[i].id, ws, err)
		}
	}
	sa := a.statusAll()[la]
	if len(ids) != 1 || sa == nil || ids[sa.ClusterID] {
		t.Fatalf("B's nodes are of clusters %v, A's leader of %+v: want one, not A's", ids, sa)
	}
}
