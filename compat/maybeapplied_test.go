package compat

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// lostLeadership applies the first removal (or output block), then answers
// as a leader that lost its leadership with the entry in its log (what
// raftfsm.Node answers for raft.ErrLeadershipLost): the entry committed,
// and the "new leader" is the same HTTP server.
type lostLeadership struct {
	*raftfsm.Node
	leaderHTTP string
	n          atomic.Int32
}

func (l *lostLeadership) lost(err error) error {
	if err == nil && l.n.Add(1) == 1 {
		return &raftfsm.NotLeaderError{LeaderID: "n1", LeaderHTTP: l.leaderHTTP, MaybeApplied: true}
	}
	return err
}

func (l *lostLeadership) DeregisterWorker(ctx context.Context, id uint64) error {
	return l.lost(l.Node.DeregisterWorker(ctx, id))
}

func (l *lostLeadership) Free(ctx context.Context, id string) error {
	return l.lost(l.Node.Free(ctx, id))
}

func (l *lostLeadership) OutputBlock(ctx context.Context, id string, h uint64, weight int64) error {
	return l.lost(l.Node.OutputBlock(ctx, id, h, weight))
}

// TestAWriteNotSafeTwiceThatMayHaveAppliedIsNotForwarded: a compatible
// API's write that is not safe twice, whose node lost its leadership with
// it in its log, is answered 503 no_leader with X-Kvrouter-Maybe-Applied,
// as /v1's are, and not forwarded to the new leader. From a review: the
// fix that kept DELETE /v1/workers/{id} from being forwarded did not
// cover the compatible APIs' removals, POST /unregister, DELETE
// /selection/workers/{id} and DELETE /selection/reservations/{id}: the
// node forwarded them, and the new leader, which had committed the
// removal, answered 404 ("not registered", "not live") for a removal that
// went through. An output block forwarded so was added twice.
func TestAWriteNotSafeTwiceThatMayHaveAppliedIsNotForwarded(t *testing.T) {
	for _, tc := range []struct {
		name, method, path string
		body               any
	}{
		{"unregister", "POST", "/unregister", UnregisterRequest{InstanceID: 1, ModelName: "llama"}},
		{"selection delete", "DELETE", "/selection/workers/1?model_name=llama", nil},
		{"release", "DELETE", "/selection/reservations/r1", nil},
		{"output block", "POST", "/selection/reservations/r1/output_block", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var handler http.Handler
			hs := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { handler.ServeHTTP(w, r) }))
			httpAddr := hs.Listener.Addr().String()
			raftAddr, tr := raft.NewInmemTransport("")
			node, err := raftfsm.NewNode(raftfsm.Config{ID: "n1", RaftAddr: string(raftAddr), HTTPAddr: httpAddr, DataDir: t.TempDir(),
				Peers: []raftfsm.Member{{ID: "n1", RaftAddr: string(raftAddr), HTTPAddr: httpAddr, Voter: true}}, Transport: tr, Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			ll := &lostLeadership{Node: node, leaderHTTP: httpAddr}
			srv := api.NewServer(node, api.Options{Logger: quiet})
			NewIndexer(ll, quiet).Routes(srv, "")
			NewSelection(ll, quiet).Routes(srv, SelectionPrefix)
			handler = srv
			hs.Start()
			t.Cleanup(func() { hs.Close(); srv.Close(); node.Close() })
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := node.WaitReady(ctx); err != nil {
				t.Fatal(err)
			}
			n := &testNode{node: node, url: hs.URL}
			mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: "tcp://10.0.0.1:5557",
				ModelName: "llama", BlockSize: 4, Agentless: ptr(false)}), 201, "register")
			reservation := tc.name == "release" || tc.name == "output block"
			if reservation {
				mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
					WorkerID: 1, ISLTokens: 8}), 201, "reserve")
			}
			r := n.do(t, codecJSON, tc.method, tc.path, tc.body)
			switch tc.name {
			case "release":
				if _, live := node.Booking("r1"); live {
					t.Fatal("the reservation is still live")
				}
			case "output block":
				b, _ := node.Booking("r1")
				if len(b.SeqHashes) != 1 {
					t.Fatalf("the reservation holds %d output blocks after one call, want 1", len(b.SeqHashes))
				}
			default:
				if len(node.WorkerTable()) != 0 {
					t.Fatalf("the worker is still registered: %v", node.WorkerTable())
				}
			}
			if r.code != http.StatusServiceUnavailable || r.hdr.Get(api.HeaderMaybeApplied) != "true" {
				t.Fatalf("%s %s: %d %s, %s %q; want 503 no_leader saying it may have applied (the node forwarded it to the new leader?)",
					tc.method, tc.path, r.code, r.body, api.HeaderMaybeApplied, r.hdr.Get(api.HeaderMaybeApplied))
			}
		})
	}
}
