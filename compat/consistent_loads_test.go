package compat

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// checkedLeader is a node whose CheckLeader answers check(): the node
// itself leads its single-node cluster (IsLeader), as a leader just
// elected does before its post-election Barrier, or as a follower would
// answer, naming another node as the leader.
type checkedLeader struct {
	*raftfsm.Node
	check func() error
}

func (c *checkedLeader) CheckLeader() error { return c.check() }

// startCheckedNode is startNode with the compatible APIs on a node whose
// CheckLeader answers check().
func startCheckedNode(t *testing.T, check func() error) *testNode {
	t.Helper()
	return startNodeAs(t, api.Options{}, func(n *raftfsm.Node) SelectionBackend { return &checkedLeader{Node: n, check: check} })
}

// TestConsistentLoadsAreTheLeaders: docs/compat.md tells a client that
// got a maybe-applied 503 on an output_block or a release to check GET
// /selection/loads?consistent=true before sending it again. A leader that
// has not applied its predecessors' entries (CheckLeader fails while it
// leads) must not answer it from its state, which may lack the write
// (the client would send it a second time): 503 no_leader, as for a
// write. A follower forwards it to the leader. A plain GET /loads is
// answered from the node's own state, as ever.
func TestConsistentLoadsAreTheLeaders(t *testing.T) {
	t.Run("a leader before its Barrier", func(t *testing.T) {
		n := startCheckedNode(t, func() error {
			return fmt.Errorf("%w: this node was just elected and has not yet applied every entry of the terms before its own; retry",
				raftfsm.ErrNoLeader)
		})
		if !n.node.IsLeader() {
			t.Fatal("the node does not lead")
		}
		r := n.do(t, codecJSON, "GET", "/selection/loads?consistent=true", nil)
		if r.code != http.StatusServiceUnavailable || !strings.Contains(string(r.body), "no_leader") {
			t.Errorf("consistent loads on a leader before its Barrier: %d %s, want 503 no_leader", r.code, r.body)
		}
		mustCode(t, n.do(t, codecJSON, "GET", "/selection/loads", nil), http.StatusOK, "plain loads")
		mustCode(t, n.do(t, codecJSON, "GET", "/selection/loads?consistent=false", nil), http.StatusOK, "loads, consistent=false")
		mustCode(t, n.do(t, codecJSON, "GET", "/selection/loads?consistent=maybe", nil), http.StatusBadRequest, "loads, consistent=maybe")
	})
	t.Run("through a follower", func(t *testing.T) {
		l := startNode(t)
		mustCode(t, l.do(t, codecJSON, "POST", "/selection/workers",
			CatalogWorker{WorkerID: 1, ModelName: "llama", Endpoint: "http://w1", BlockSize: 4}), 201, "add")
		mustCode(t, l.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
			WorkerID: 1, SequenceHashes: []Hash{1, 2, 3}, ISLTokens: 12}), 201, "reserve")
		mustCode(t, l.do(t, codecJSON, "POST", "/selection/reservations/r1/output_block", nil), 200, "out")
		leaderHTTP := strings.TrimPrefix(l.url, "http://")
		// The follower holds none of it: a follower behind the leader.
		f := startCheckedNode(t, func() error { return &raftfsm.NotLeaderError{LeaderID: "leader", LeaderHTTP: leaderHTTP} })
		r := f.do(t, codecJSON, "GET", "/selection/loads?model_name=llama&consistent=true", nil)
		var ls []RankLoad
		if err := json.Unmarshal(r.body, &ls); err != nil {
			t.Fatalf("%d %s: %v", r.code, r.body, err)
		}
		if r.code != http.StatusOK || len(ls) != 1 || ls[0].ActiveDecodeBlocks != 4 {
			t.Errorf("consistent loads through a follower: %d %s, want the leader's (worker 1, 4 active decode blocks)", r.code, r.body)
		}
		if got := r.hdr.Get(api.HeaderForwardedTo); got == "" {
			t.Errorf("consistent loads through a follower: no %s, want it forwarded to the leader", api.HeaderForwardedTo)
		}
		r = f.do(t, codecJSON, "GET", "/selection/loads?model_name=llama", nil)
		ls = nil
		if err := json.Unmarshal(r.body, &ls); err != nil {
			t.Fatalf("%d %s: %v", r.code, r.body, err)
		}
		if r.code != http.StatusOK || len(ls) != 0 {
			t.Errorf("plain loads on the follower: %d %s, want its own state (no rank)", r.code, r.body)
		}
	})
}
