package compat

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// A /v1 worker registered without dp_ranks (empty = rank 0): a PATCH of
// kv_events_endpoints for rank 0 stores it.
func TestPatchEventEndpointOfAWorkerWithoutRanks(t *testing.T) {
	n := startNode(t)
	if err := n.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 5, BlockSize: 4, Model: "llama"}); err != nil {
		t.Fatal(err)
	}
	r := n.do(t, codecJSON, "PATCH", "/selection/workers/5", WorkerPatch{KVEventsEndpoints: map[string]string{"0": "tcp://10.0.0.5:5557"}})
	mustCode(t, r, 200, "patch")
	if w := n.node.WorkerTable()[5]; w.EventEndpoints[0] != "tcp://10.0.0.5:5557" {
		t.Errorf("PATCH kv_events_endpoints {0: ...} answered 200 but stored event endpoints %v", w.EventEndpoints)
	}
}

// A replay endpoint set by one PATCH stays through the next PATCH, which
// names something else.
func TestPatchKeepsTheReplayEndpoint(t *testing.T) {
	n := startNode(t)
	if err := n.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 5, BlockSize: 4, Model: "llama"}); err != nil {
		t.Fatal(err)
	}
	rep := "tcp://10.0.0.5:5560"
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/5", WorkerPatch{ReplayEndpoint: &rep}), 200, "patch replay")
	if w := n.node.WorkerTable()[5]; w.ReplayEndpoints[0] != rep {
		t.Fatalf("replay endpoints %v after patch", w.ReplayEndpoints)
	}
	ep := "http://10.0.0.5:8000"
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/5", WorkerPatch{Endpoint: &ep}), 200, "patch endpoint")
	if w := n.node.WorkerTable()[5]; w.ReplayEndpoints[0] != rep {
		t.Errorf("a PATCH of the endpoint alone dropped the replay endpoint: %v", w.ReplayEndpoints)
	}
}

// A /v1 worker with dp ranks 0 and 5000: a PATCH of its endpoint alone is
// accepted and keeps the ranks (the catalog's covering range, 5001 ranks,
// is past the limit a PATCH that names ranks may give).
func TestPatchOfAWorkerWithSparseRanks(t *testing.T) {
	n := startNode(t)
	if err := n.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 5, BlockSize: 4, Model: "llama", DPRanks: []uint32{0, 5000}}); err != nil {
		t.Fatal(err)
	}
	ep := "http://10.0.0.5:8000"
	r := n.do(t, codecJSON, "PATCH", "/selection/workers/5", WorkerPatch{Endpoint: &ep})
	if r.code != 200 {
		t.Errorf("PATCH of the endpoint alone: %d %s", r.code, r.body)
	}
	if w := n.node.WorkerTable()[5]; !slices.Equal(w.DPRanks, []uint32{0, 5000}) || w.Endpoint != ep {
		t.Errorf("after the PATCH: ranks %v endpoint %q", w.DPRanks, w.Endpoint)
	}
}

// The catalog's range of ranks 0 and 2³²-1 does not wrap to size 0.
func TestCatalogSizeDoesNotWrap(t *testing.T) {
	w := raftfsm.WorkerInfo{ID: 5, BlockSize: 4, Model: "llama", DPRanks: []uint32{0, math.MaxUint32}}
	c := catalogOf(5, &w)
	if c.DataParallelSize == 0 {
		t.Errorf("catalog of ranks [0, %d]: data_parallel_size %d", uint32(math.MaxUint32), c.DataParallelSize)
	}
}

// Ranks 0 and 2 registered, the catalog lists [0, 3): a PATCH of
// kv_events_endpoints naming rank 1, which the worker lacks, is a 400 (it
// was a 200 that dropped rank 1's endpoint).
func TestPatchOfAHoleRanksEndpointIsRefused(t *testing.T) {
	n := startNode(t)
	for _, dp := range []uint32{0, 2} {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: "tcp://10.0.0.1:555" + string(rune('7'+dp)),
			ModelName: "llama", BlockSize: 4, DPRank: u32(dp), Agentless: ptr(false)}), 201, "register")
	}
	r := n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{KVEventsEndpoints: map[string]string{
		"0": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558", "2": "tcp://10.0.0.1:5559"}})
	mustCode(t, r, 400, "patch of rank 1's endpoint")
	if w := n.node.WorkerTable()[WorkerID(1, "llama", "default")]; !slices.Equal(w.DPRanks, []uint32{0, 2}) || len(w.EventEndpoints) != 2 {
		t.Errorf("a refused PATCH changed the worker: ranks %v endpoints %v", w.DPRanks, w.EventEndpoints)
	}
}

// TestPatchOfBlockSizeKeepsOneBlockSizePerNamespace: a PATCH of
// block_size is a 409 while another worker of the namespace serves the
// old one, and accepted for the namespace's only worker. From a review:
// the PATCH was accepted, and the namespace then held two block sizes
// (its queries hash and score with the first worker's).
func TestPatchOfBlockSizeKeepsOneBlockSizePerNamespace(t *testing.T) {
	n := startNode(t)
	for _, id := range []uint64{1, 2} {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: id, Endpoint: "tcp://10.0.0.1:5557",
			ModelName: "llama", BlockSize: 4, Agentless: ptr(false)}), 201, "register")
	}
	r := n.do(t, codecJSON, "PATCH", "/selection/workers/2", WorkerPatch{BlockSize: ptr(16)})
	sizes := map[int]bool{}
	for _, w := range n.node.WorkerTable() {
		sizes[w.BlockSize] = true
	}
	if r.code != 409 || len(sizes) > 1 {
		t.Fatalf("PATCH answered %d; namespace llama/default now has block sizes %v", r.code, sizes)
	}
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/2", WorkerPatch{BlockSize: ptr(4)}), 200, "the same block size")
	mustCode(t, n.do(t, codecJSON, "DELETE", "/selection/workers/1", nil), 200, "delete worker 1")
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/2", WorkerPatch{BlockSize: ptr(16)}), 200,
		"the block size of the namespace's only worker")
}
