package compat

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// closedWithTheWriteInTheLog applies the first removal (or output block),
// then answers what raftfsm.Node.shutdownMaybeApplied returns for a
// leader closing with the entry in its log: a *NotLeaderError with
// MaybeApplied and Closed (ErrShutdown).
type closedWithTheWriteInTheLog struct {
	*raftfsm.Node
	n atomic.Int32
}

func (l *closedWithTheWriteInTheLog) closed(err error) error {
	if err == nil && l.n.Add(1) == 1 {
		return fmt.Errorf("raft apply: %w", fmt.Errorf("%w before raft answered, and the write may still apply",
			&raftfsm.NotLeaderError{MaybeApplied: true, Closed: true}))
	}
	return err
}

func (l *closedWithTheWriteInTheLog) DeregisterWorker(ctx context.Context, id uint64) error {
	return l.closed(l.Node.DeregisterWorker(ctx, id))
}

func (l *closedWithTheWriteInTheLog) Free(ctx context.Context, id string) error {
	return l.closed(l.Node.Free(ctx, id))
}

func (l *closedWithTheWriteInTheLog) OutputBlock(ctx context.Context, id string, h uint64, weight int64) error {
	return l.closed(l.Node.OutputBlock(ctx, id, h, weight))
}

// TestCloseWithAWriteNotSafeTwiceInTheLogSaysMaybeApplied: the
// compatible APIs' writes not safe twice, answered by a node that closed
// with the write in its log, must carry X-Kvrouter-Maybe-Applied (as /v1's
// do since 5ad17fe, and as docs/compat.md promises).
func TestCloseWithAWriteNotSafeTwiceInTheLogSaysMaybeApplied(t *testing.T) {
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
			n := startNodeAs(t, api.Options{}, func(n *raftfsm.Node) SelectionBackend { return &closedWithTheWriteInTheLog{Node: n} })
			mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: "tcp://10.0.0.1:5557",
				ModelName: "llama", BlockSize: 4, Agentless: ptr(false)}), 201, "register")
			if tc.name == "release" || tc.name == "output block" {
				mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
					WorkerID: 1, ISLTokens: 8}), 201, "reserve")
			}
			r := n.do(t, codecJSON, tc.method, tc.path, tc.body)
			if r.code != http.StatusServiceUnavailable || r.hdr.Get(api.HeaderMaybeApplied) != "true" ||
				!strings.Contains(string(r.body), api.ReasonShuttingDown) {
				t.Fatalf("%s %s: %d %s, %s %q; want 503 shutting_down with %s: true (the write is in the log and may apply)",
					tc.method, tc.path, r.code, r.body, api.HeaderMaybeApplied, r.hdr.Get(api.HeaderMaybeApplied), api.HeaderMaybeApplied)
			}
		})
	}
}
