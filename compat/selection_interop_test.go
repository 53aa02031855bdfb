package compat

// Requests to the selection API as NVIDIA Dynamo's standalone selection
// service's clients send them (ai-dynamo/dynamo
// lib/kv-router/src/services/selection/{server,types,input}.rs), sent as the
// exact bytes such a client sends.

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
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

// TestLoadsOfEveryModelSayWhoseRankEachIs: from a review. GET /loads
// without model_name lists every namespace's ranks, and an instance id
// registered for two models is two ranks with their own loads: each
// entry names its model_name and routing_group (Dynamo answers one entry
// per model and group), where two entries {worker_id 1, dp_rank 0} were
// told apart by nothing. tenant_id, Dynamo's name for the group filter,
// filters as routing_group does.
func TestLoadsOfEveryModelSayWhoseRankEachIs(t *testing.T) {
	n := startNode(t)
	for _, m := range []string{"a", "b"} {
		w := `{"worker_id":1,"model_name":"` + m + `","routing_group":"default","endpoint":"http://worker:8000","block_size":16}`
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", []byte(w)), 201, "POST /workers "+m)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", []byte(`{"reservation_id":"r1","model_name":"a",`+
		`"worker_id":1,"dp_rank":0,"sequence_hashes":[1,2],"isl_tokens":32}`)), 201, "reserve")
	r := n.do(t, codecJSON, "GET", "/selection/loads", nil)
	var got []RankLoad
	if err := json.Unmarshal(r.body, &got); err != nil {
		t.Fatal(err)
	}
	want := []RankLoad{
		{WorkerID: 1, ModelName: "a", RoutingGroup: "default", ActivePrefillTokens: 32, ActiveDecodeBlocks: 2, ActiveRequests: 1},
		{WorkerID: 1, ModelName: "b", RoutingGroup: "default"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("GET /loads answered %s; want model a's rank booked and model b's idle, each named", r.body)
	}
	for _, q := range []string{"tenant_id=default", "model_name=b&tenant_id=default"} {
		r := n.do(t, codecJSON, "GET", "/selection/loads?"+q, nil)
		var some []RankLoad
		if err := json.Unmarshal(r.body, &some); err != nil || len(some) == 0 {
			t.Fatalf("GET /loads?%s: %d %s", q, r.code, r.body)
		}
	}
	if r := n.do(t, codecJSON, "GET", "/selection/loads?tenant_id=other", nil); string(r.body) != "[]\n" && string(r.body) != "[]" {
		t.Errorf("GET /loads?tenant_id=other: %s, want no ranks", r.body)
	}
	mustCode(t, n.do(t, codecJSON, "GET", "/selection/loads?tenant_id=x&routing_group=y", nil), 400, "tenant_id and routing_group differ")
}

// TestSelectionPortServesHealth: from a review. Dynamo's selection service
// answers GET /health 200 {"status":"ok"}; --selection-addr answered 404
// naming /selection/health, a path the client never sent. It answers as
// the indexer API's /health does, and a path it does not route is named
// as the client sent it, in either encoding.
func TestSelectionPortServesHealth(t *testing.T) {
	n := dynamoNode(t)
	for _, port := range []*testNode{n.selectionPort(t), n} {
		path := "/health"
		if port == n {
			path = "/selection/health"
		}
		r := port.do(t, codecJSON, "GET", path, nil)
		if r.code != 200 || !strings.Contains(string(r.body), `"status":"ok"`) {
			t.Errorf("GET %s: %d %s, want 200 status ok", path, r.code, r.body)
		}
	}
	sel := n.selectionPort(t)
	for _, c := range []codec{codecJSON, codecMsgpack} {
		r := sel.do(t, c, "GET", "/nowhere", nil)
		if j := r.asJSON(t); r.code != 404 || !strings.Contains(fmt.Sprint(j), "no route GET /nowhere;") {
			t.Errorf("GET /nowhere on --selection-addr (%v): %d %v, want 404 naming /nowhere", c, r.code, j)
		}
		if c == codecJSON && !strings.Contains(string(r.body), `"reason":"not_found"`) {
			t.Errorf("GET /nowhere on --selection-addr: %s, want reason not_found", r.body)
		}
		r = sel.do(t, c, "DELETE", "/loads", nil)
		if j := r.asJSON(t); r.code != 405 || !strings.Contains(fmt.Sprint(j), "DELETE is not allowed on /loads ") {
			t.Errorf("DELETE /loads on --selection-addr (%v): %d %v, want 405 naming /loads", c, r.code, j)
		}
	}
}

// TestSelectionModelAndGroupDefault: from a review. Dynamo's selection
// service defaults model_name and routing_group to "default" when a
// request leaves them out; the selection API answered 400 "model_name is
// required". Every selection route that names a namespace defaults both
// now; the indexer API still requires a model.
func TestSelectionModelAndGroupDefault(t *testing.T) {
	n := startNode(t)
	r := n.do(t, codecJSON, "POST", "/selection/workers", []byte(`{"worker_id":2,"endpoint":"http://w2:8000","block_size":16}`))
	mustCode(t, r, 201, "POST /workers without model_name")
	var w CatalogWorker
	if err := json.Unmarshal(r.body, &w); err != nil || w.ModelName != DefaultModel || w.RoutingGroup != DefaultTenant {
		t.Fatalf("POST /workers without model_name or routing_group stored %s, want model and group %q", r.body, "default")
	}
	for _, c := range []struct{ path, body string }{
		{"/selection/select", `{"block_hashes":[11,12],"sequence_hashes":[21,22],"isl_tokens":32}`},
		{"/selection/select_and_reserve", `{"selection_id":"s1","block_hashes":[11,12],"sequence_hashes":[21,22],"isl_tokens":32}`},
		{"/selection/reservations", `{"reservation_id":"r1","worker_id":2,"dp_rank":0,"sequence_hashes":[21],"isl_tokens":16}`},
		{"/selection/potential_loads", `{"block_hashes":[11,12],"isl_tokens":32}`},
		{"/selection/overlap_scores", `{"block_hashes":[11,12]}`},
	} {
		r := n.do(t, codecJSON, "POST", c.path, []byte(c.body))
		if r.code != 200 && r.code != 201 {
			t.Errorf("POST %s without model_name: %d %s, want it answered in model %q", c.path, r.code, r.body, "default")
		}
	}
	r = n.do(t, codecJSON, "GET", "/selection/loads?model_name=default", nil)
	var loads []RankLoad
	if err := json.Unmarshal(r.body, &loads); err != nil || len(loads) != 1 || loads[0].ActiveRequests != 2 {
		t.Errorf("GET /loads?model_name=default: %s, want worker 2's rank with s1 and r1 booked", r.body)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/query", []byte(`{"token_ids":[1,2,3,4]}`)), 400, "indexer /query without model_name")
}

// TestDynamoExplicitReservationIsBooked: from a review. Dynamo's POST
// /reservations names its booking selection_id (it has no
// reservation_id), sends effective_prefill_tokens where this API read
// cached_tokens (a client's value was dropped), and answers 201 {selection_id,
// model_name, routing_group, worker_id, dp_rank, endpoint}. The explicit
// form is booked under selection_id, with isl - effective cached tokens,
// and freed under it; reservation_id stays an alias, and the two (or
// cached_tokens and effective_prefill_tokens) disagreeing are 400.
func TestDynamoExplicitReservationIsBooked(t *testing.T) {
	n := dynamoNode(t)
	r := n.do(t, codecJSON, "POST", "/selection/reservations", []byte(`{"selection_id":"request-123",`+
		`"model_name":"model","routing_group":"default","worker_id":1,"dp_rank":1,`+
		`"sequence_hashes":[21,22,23,24,25,26,27,28],"isl_tokens":512,"effective_prefill_tokens":384,"track_prefill_tokens":true}`))
	mustCode(t, r, 201, "POST /reservations, Dynamo's explicit form")
	var got ReservationResponse
	want := ReservationResponse{Status: "ok", ReservationID: "request-123", SelectionID: "request-123", ModelName: "model",
		RoutingGroup: "default", WorkerID: 1, DPRank: 1, Endpoint: "http://worker:8000"}
	if err := json.Unmarshal(r.body, &got); err != nil || got != want {
		t.Fatalf("POST /reservations answered %s, want %+v (Dynamo's ReservationResponse and ours)", r.body, want)
	}
	r = n.do(t, codecJSON, "GET", "/selection/loads?model_name=model", nil)
	var loads []RankLoad
	if err := json.Unmarshal(r.body, &loads); err != nil || len(loads) != 2 || loads[1].ActivePrefillTokens != 384 {
		t.Fatalf("GET /loads: %s, want rank 1 with 384 prefill tokens (512 less the 128 cached)", r.body)
	}
	mustCode(t, n.do(t, codecJSON, "DELETE", "/selection/reservations/request-123", nil), 200, "DELETE request-123")
	// dp_rank left out is rank 0.
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", []byte(`{"selection_id":"r2","model_name":"model",`+
		`"worker_id":1,"sequence_hashes":[21],"isl_tokens":16}`)), 201, "POST /reservations without dp_rank")
	if b, ok := n.node.Booking("r2"); !ok || b.Rank.DP != 0 {
		t.Errorf("reservation without dp_rank: booking %+v %v, want rank 0", b, ok)
	}
	for _, bad := range []string{
		`{"selection_id":"a","reservation_id":"b","model_name":"model","worker_id":1,"isl_tokens":16}`,
		`{"selection_id":"c","model_name":"model","worker_id":1,"isl_tokens":16,"effective_prefill_tokens":17}`,
		`{"selection_id":"d","model_name":"model","worker_id":1,"isl_tokens":16,"effective_prefill_tokens":-1}`,
		`{"selection_id":"e","model_name":"model","worker_id":1,"isl_tokens":16,"effective_prefill_tokens":8,"cached_tokens":4}`,
		`{"model_name":"model","worker_id":1,"isl_tokens":16}`,
	} {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", []byte(bad)), 400, bad)
	}
}

// TestDynamoReplayReservationIsRefused: Dynamo's replay form of POST
// /reservations ({selection_id, model_name, routing_group} alone) books
// what an earlier /select chose. /select here books nothing and records no
// choice, so the form is a 400 that says to send the explicit form, as
// docs/compat.md says, and nothing is booked.
func TestDynamoReplayReservationIsRefused(t *testing.T) {
	n := dynamoNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/select", []byte(`{"selection_id":"select-123","model_name":"model",`+
		`"routing_group":"default","block_hashes":[11,12,13,14,15,16,17,18],"sequence_hashes":[21,22,23,24,25,26,27,28],"isl_tokens":512}`)),
		200, "POST /select")
	r := n.do(t, codecJSON, "POST", "/selection/reservations", []byte(`{"selection_id":"select-123","model_name":"model","routing_group":"default"}`))
	if r.code != 400 || !strings.Contains(string(r.body), "replay form) is not supported") {
		t.Fatalf("POST /reservations, the replay form: %d %s, want 400 saying it is not supported", r.code, r.body)
	}
	if _, ok := n.node.Booking("select-123"); ok {
		t.Errorf("the refused replay booked select-123")
	}
}

// TestDynamoReadyAnswerDecodes: from a review. Dynamo's GET /ready answers
// {ready, schedulable_workers, workers: [worker record]}; ours answered
// "workers" as a count, which a Dynamo client cannot decode. workers is
// the catalog now, as GET /workers lists it, with schedulable_workers the
// count, and the node's state kept.
func TestDynamoReadyAnswerDecodes(t *testing.T) {
	n := startNode(t)
	r := n.do(t, codecJSON, "GET", "/selection/ready", nil)
	if r.code != 503 || !strings.Contains(string(r.body), `"schedulable_workers":0,"workers":[]`) {
		t.Errorf("GET /ready without workers: %d %s, want 503 with no schedulable workers and an empty list", r.code, r.body)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", []byte(dynamoWorker)), 201, "POST /workers")
	r = n.do(t, codecJSON, "GET", "/selection/ready", nil)
	var got struct {
		Ready              bool            `json:"ready"`
		SchedulableWorkers *int            `json:"schedulable_workers"`
		Workers            []CatalogWorker `json:"workers"`
		State              string          `json:"state"`
	}
	if err := json.Unmarshal(r.body, &got); err != nil || r.code != 200 || !got.Ready || got.SchedulableWorkers == nil ||
		*got.SchedulableWorkers != 1 || len(got.Workers) != 1 || got.Workers[0].Endpoint != "http://worker:8000" || got.State == "" {
		t.Fatalf("GET /ready answered %d %s, not Dynamo's ReadyResponse {ready, schedulable_workers, workers: [...]} with our state: %v", r.code, r.body, err)
	}
}

// TestSelectionDiffersFromDynamoAsDocumented: from a review, whose tests
// wanted Dynamo's upsert and grouped GET /loads. docs/compat.md lists the
// differences instead; these are they: a POST /workers of a worker
// registered differently is 409 (PATCH moves it), GET /loads is flat with
// the rank's names, and DELETE /workers/{id} answers {"status":"ok"}.
func TestSelectionDiffersFromDynamoAsDocumented(t *testing.T) {
	n := dynamoNode(t)
	moved := `{"worker_id":1,"model_name":"model","routing_group":"default","endpoint":"http://worker2:8000","block_size":16}`
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", []byte(moved)), 409, "POST /workers again, moved")
	mustCode(t, n.do(t, codecJSON, "PATCH", "/selection/workers/1", []byte(`{"endpoint":"http://worker2:8000"}`)), 200, "PATCH")
	r := n.do(t, codecJSON, "GET", "/selection/loads", nil)
	var loads []RankLoad
	if err := json.Unmarshal(r.body, &loads); err != nil || len(loads) != 2 || loads[0].ModelName != "model" || loads[1].DPRank != 1 {
		t.Errorf("GET /loads: %s, want two flat entries of model's ranks 0 and 1", r.body)
	}
	r = n.do(t, codecJSON, "DELETE", "/selection/workers/1", nil)
	if r.code != 200 || strings.TrimSpace(string(r.body)) != `{"status":"ok"}` {
		t.Errorf("DELETE /workers/1: %d %s, want 200 {\"status\":\"ok\"}", r.code, r.body)
	}
}

// TestEveryRankBusyIs429: from a review. With every candidate rank over a
// busy threshold, /select and /select_and_reserve answered 503, where
// Dynamo's selection service answers 429 (services/selection error.rs:
// its scheduler's overloaded rejection), and a Dynamo client that retries
// only a 429 failed the request. Both answer 429 now, with the error in
// the request's encoding, and nothing is booked; no worker to choose stays
// a 503, as Dynamo's unavailable rejection is.
func TestEveryRankBusyIs429(t *testing.T) {
	n := dynamoNode(t)
	s := n.node.Settings()
	s.Params.BusyPrefillTokens = 64
	if err := n.node.SetSettings(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	for dp := range 2 {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", []byte(fmt.Sprintf(`{"selection_id":"busy-%d",`+
			`"model_name":"model","worker_id":1,"dp_rank":%d,"isl_tokens":512,"effective_prefill_tokens":512}`, dp, dp))),
			201, "booking 512 prefill tokens")
	}
	req := SelectRequest{SelectionID: "late", ModelName: "model", BlockHashes: []Hash{11, 12}, ISLTokens: 32}
	for _, path := range []string{"/selection/select", "/selection/select_and_reserve"} {
		for _, c := range []codec{codecJSON, codecMsgpack} {
			r := n.do(t, c, "POST", path, req)
			j, _ := r.asJSON(t).(map[string]any)
			if msg, _ := j["error"].(string); r.code != 429 || !strings.Contains(msg, "all 2 ranks busy") {
				t.Errorf("POST %s (%v) with every rank busy: %d %s, want 429 {\"error\": \"... all 2 ranks busy ...\"}", path, c, r.code, r.body)
			}
		}
	}
	r := n.do(t, codecJSON, "GET", "/selection/loads", nil)
	if strings.Contains(string(r.body), `"active_requests":2`) {
		t.Errorf("GET /loads after the refused selections: %s, want one booking a rank", r.body)
	}
	r = n.do(t, codecJSON, "POST", "/selection/select", []byte(`{"model_name":"other","block_hashes":[11]}`))
	mustCode(t, r, 503, "POST /select of a model without workers")
}
