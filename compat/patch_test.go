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

// TestPatchShrinkDropsTheRemovedRanksEndpoints: a PATCH of
// data_parallel_size 2 → 1, naming no kv_events_endpoints, keeps rank 0
// with its endpoint and removes rank 1 with its own. From a review: the
// PATCH was a 400, refused for the endpoint of rank 1, the very rank it
// removes (the old endpoints were read against the new range).
func TestPatchShrinkDropsTheRemovedRanksEndpoints(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama", BlockSize: 4,
		DataParallelSize: 2, KVEventsEndpoints: Map[string]{"0": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558"}}), 201, "add")
	r := n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{DataParallelSize: u32(1)})
	mustCode(t, r, 200, "PATCH data_parallel_size 2 -> 1")
	w := n.node.WorkerTable()[WorkerID(1, "llama", DefaultTenant)]
	if !slices.Equal(w.DPRanks, []uint32{0}) || len(w.EventEndpoints) != 1 || w.EventEndpoints[0] != "tcp://10.0.0.1:5557" {
		t.Errorf("after the PATCH: ranks %v endpoints %v", w.DPRanks, w.EventEndpoints)
	}
}

// TestLastRankKeepsItsEndpoint: rank 2^32-1, the last, may have its own
// event endpoint. From a review: infoOf allowed start + size == 2^32,
// then compared with that sum in uint32, which wrapped to 0, and refused
// the endpoint.
func TestLastRankKeepsItsEndpoint(t *testing.T) {
	c := CatalogWorker{WorkerID: 1, ModelName: "llama", BlockSize: 4, DataParallelStartRank: math.MaxUint32, DataParallelSize: 1,
		KVEventsEndpoints: Map[string]{"4294967295": "tcp://10.0.0.1:5557"}}
	w, err := infoOf(&c)
	if err != nil {
		t.Fatalf("rank 2^32-1 with its own endpoint: %v", err)
	}
	if w.EventEndpoints[math.MaxUint32] != "tcp://10.0.0.1:5557" {
		t.Errorf("event endpoints %v", w.EventEndpoints)
	}
}

// TestEndpointKeysHaveOneSpelling: a kv_events_endpoints key is a dp rank
// in decimal without leading zeros or a sign; "01" is a 400, in POST and
// PATCH. From a review: "01" and "1" both named rank 1, and which of the
// two endpoints the rank got depended on the map's iteration order.
func TestEndpointKeysHaveOneSpelling(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama", BlockSize: 4,
		DataParallelSize: 2, KVEventsEndpoints: Map[string]{"01": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558"}}), 400, "keys 01 and 1")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama", BlockSize: 4,
		DataParallelSize: 2, KVEventsEndpoints: Map[string]{"1": "tcp://10.0.0.1:5558"}}), 201, "key 1")
	for _, k := range []string{"01", "+1", " 1"} {
		r := n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{KVEventsEndpoints: map[string]string{k: "tcp://10.0.0.1:5559"}})
		mustCode(t, r, 400, "PATCH of key "+k)
	}
}

// TestPatchLeavesStoredEndpointsUnchecked: a PATCH checks the endpoints
// it names, not those it keeps. From a review: the stored replay endpoint
// of a worker an older build registered (tcp://*:5558, refused since) was
// checked again, and a PATCH of the worker's HTTP endpoint alone was a 400.
func TestPatchLeavesStoredEndpointsUnchecked(t *testing.T) {
	n := startNode(t)
	id := WorkerID(7, "llama", DefaultTenant)
	w := raftfsm.WorkerInfo{ID: id, Instance: 7, Model: "llama", Tenant: DefaultTenant, BlockSize: 4,
		DPRanks: []uint32{0}, EventEndpoints: map[uint32]string{0: "tcp://*:5557"},
		ReplayEndpoints: map[uint32]string{0: "tcp://*:5558"}, Positional: true}
	if err := n.node.RegisterWorker(context.Background(), w); err != nil {
		t.Fatal(err)
	}
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/7", WorkerPatch{Endpoint: ptr("http://10.0.0.1:8000")}), 200, "PATCH of the endpoint alone")
	got := n.node.WorkerTable()[id]
	if got.Endpoint != "http://10.0.0.1:8000" || got.EventEndpoints[0] != "tcp://*:5557" || got.ReplayEndpoints[0] != "tcp://*:5558" {
		t.Fatalf("after the PATCH: %+v", got)
	}
	// What a PATCH names is checked.
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/7", WorkerPatch{ReplayEndpoint: ptr("tcp://*:5559")}), 400, "PATCH naming a wildcard replay endpoint")
}

// TestPatchLeavesTheStoredModelUnchecked: a PATCH keeps the stored model
// and routing group, and does not check them again. From a review: once
// registrations refused a control character in a model, a worker an older
// build registered with a tab in its model could not be PATCHed at all, a
// 400 naming a field the PATCH did not carry.
func TestPatchLeavesTheStoredModelUnchecked(t *testing.T) {
	n := startNode(t)
	model := "llama\tv2"
	id := WorkerID(7, model, DefaultTenant)
	w := raftfsm.WorkerInfo{ID: id, Instance: 7, Model: model, Tenant: DefaultTenant, BlockSize: 4,
		DPRanks: []uint32{0}, Positional: true}
	if err := n.node.RegisterWorker(context.Background(), w); err != nil {
		t.Fatal(err)
	}
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/7", WorkerPatch{Endpoint: ptr("http://10.0.0.1:8000")}), 200,
		"PATCH of the endpoint alone of a worker an older build registered with a tab in its model")
	if got := n.node.WorkerTable()[id]; got.Endpoint != "http://10.0.0.1:8000" || got.Model != model {
		t.Fatalf("after the PATCH: %+v", got)
	}
}

// TestPatchOfTheRangeDropsARanksState: a PATCH that drops a rank drops its
// blocks and cursor, and one that adds it back starts it clean
// (Backend.RegisterWorker's contract).
func TestPatchOfTheRangeDropsARanksState(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4, DataParallelSize: 2}), 201, "add")
	postEvents(t, n, stored(1, 1, "", 0, 3))
	one, two := uint32(1), uint32(2)
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{DataParallelSize: &one}), 200, "shrink")
	if q := queryPrompt(t, n, ""); len(q.Scores) != 0 {
		t.Errorf("after the rank left: scores %v", q.Scores)
	}
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/1", WorkerPatch{DataParallelSize: &two}), 200, "grow")
	if q := queryPrompt(t, n, ""); len(q.Scores) != 0 {
		t.Errorf("after the rank came back: scores %v", q.Scores)
	}
	if ack := postEvents(t, n, stored(1, 1, "", 0, 1)); ack.Acks[0].Applied != 1 {
		t.Errorf("first event of the rank back: %+v, want applied", ack.Acks)
	}
}
