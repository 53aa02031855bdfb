package compat

// Requests to the selection API as NVIDIA Dynamo's standalone selection
// service's clients send them (ai-dynamo/dynamo
// lib/kv-router/src/services/selection/{server,types,input}.rs), sent as the
// exact bytes such a client sends.

import (
	"strings"
	"testing"
)

// dynamoWorker is a catalog worker of two dp ranks as a Dynamo client
// registers it.
const dynamoWorker = `{"worker_id":1,"model_name":"model","routing_group":"default",` +
	`"endpoint":"http://worker:8000","block_size":16,"data_parallel_start_rank":0,"data_parallel_size":2,` +
	`"kv_events_endpoints":{"0":"tcp://worker:5557","1":"tcp://worker:5558"},"replay_endpoint":"tcp://worker:5560"}`

// dynamoNode starts a node with dynamoWorker registered.
func dynamoNode(t *testing.T) *testNode {
	t.Helper()
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", []byte(dynamoWorker)), 201, "POST /workers")
	return n
}

// TestMismatchedBlockAndSequenceHashesAreRefused: from a review.
// block_hashes and sequence_hashes of different lengths were taken, and a
// booking keyed on fewer sequence hashes than the prompt has blocks booked
// a decode load that was not the prompt's. Both given, they must be as
// long (Dynamo's selection service refuses them alike): 400 naming both
// lengths, and nothing booked. Either alone is still taken.
func TestMismatchedBlockAndSequenceHashesAreRefused(t *testing.T) {
	n := dynamoNode(t)
	for _, path := range []string{"/selection/select", "/selection/select_and_reserve", "/selection/potential_loads"} {
		r := n.do(t, codecJSON, "POST", path, []byte(`{"selection_id":"m1","model_name":"model",`+
			`"block_hashes":[11,12,13,14],"sequence_hashes":[21],"isl_tokens":64}`))
		if r.code != 400 || !strings.Contains(string(r.body), "block_hashes length 4 must match sequence_hashes length 1") {
			t.Errorf("POST %s with 4 block_hashes and 1 sequence_hash: %d %s, want 400 naming both lengths", path, r.code, r.body)
		}
	}
	r := n.do(t, codecJSON, "POST", "/selection/select", []byte(`{"model_name":"model",`+
		`"token_ids":[`+strings.Repeat("1,", 47)+`1],"sequence_hashes":[21,22]}`))
	if r.code != 400 || !strings.Contains(string(r.body), "token_ids make 3 full blocks: sequence_hashes length 2") {
		t.Errorf("POST /select with 48 token_ids (3 blocks of 16) and 2 sequence_hashes: %d %s, want 400", r.code, r.body)
	}
	if _, ok := n.node.Booking("m1"); ok {
		t.Errorf("a refused /select_and_reserve booked m1")
	}
	for _, body := range []string{
		`{"model_name":"model","block_hashes":[11,12,13,14],"sequence_hashes":[21,22,23,24],"isl_tokens":64}`,
		`{"model_name":"model","block_hashes":[11,12,13,14],"isl_tokens":64}`,
		`{"model_name":"model","sequence_hashes":[21],"isl_tokens":16}`,
	} {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/select", []byte(body)), 200, body)
	}
}
