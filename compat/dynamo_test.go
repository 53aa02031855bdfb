package compat

// The indexer API against NVIDIA Dynamo's standalone KV indexer
// (ai-dynamo/dynamo docs/components/router/standalone-indexer.md): each
// test sends the bytes a Dynamo client sends, or reads the answer as a
// Dynamo client reads it.

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
)

// regRaw registers dp rank dp of instance inst of model through a raw
// JSON body, as a Dynamo client writes it (extra keys appended verbatim).
func regRaw(t *testing.T, n *testNode, inst uint64, model string, dp uint32, extra string) reply {
	t.Helper()
	body := fmt.Sprintf(`{"instance_id": %d, "endpoint": "tcp://10.0.0.%d:%d", "model_name": %q, "block_size": %d, "dp_rank": %d, "agentless": false%s}`,
		inst, inst, 5557+dp, model, testBlockSize, dp, extra)
	return n.do(t, codecJSON, "POST", "/register", []byte(body))
}

// A /query_by_hash that names a cache_salt, any string, "" included, is
// refused in both encodings: the hashes were computed by the caller, and
// answered unsalted the scores were taken for salted ones. Absent or null
// it is none.
func TestQueryByHashRefusesACacheSalt(t *testing.T) {
	n := startNode(t)
	mustCode(t, regRaw(t, n, 1, "llama", 0, ""), 201, "register")
	for _, tc := range []struct {
		c    codec
		salt any // nil: none
		body string
		want int
	}{
		{codecJSON, nil, `{"block_hashes": [123456, 789012], "model_name": "llama", "cache_salt": "tenant-a"}`, 400},
		{codecJSON, nil, `{"block_hashes": [123456], "model_name": "llama", "cache_salt": ""}`, 400},
		{codecJSON, nil, `{"block_hashes": [123456], "model_name": "llama", "cache_salt": null}`, 200},
		{codecJSON, nil, `{"block_hashes": [123456], "model_name": "llama"}`, 200},
		{codecMsgpack, "tenant-a", "", 400},
		{codecMsgpack, "", "", 400},
		{codecMsgpack, nil, "", 200},
	} {
		var body any = []byte(tc.body)
		what := tc.body
		if tc.c == codecMsgpack {
			body = map[string]any{"block_hashes": []int64{123456}, "model_name": "llama", "cache_salt": tc.salt}
			what = fmt.Sprintf("msgpack with cache_salt %#v", tc.salt)
		}
		// The selection API's /overlap_scores is the same answer
		// (docs/compat.md), and refuses a salt as well: it dropped it as
		// an unknown key and answered the unsalted scores.
		for _, path := range []string{"/query_by_hash", "/selection/overlap_scores"} {
			if r := n.do(t, tc.c, "POST", path, body); r.code != tc.want {
				t.Errorf("%s %s: %d %s, want %d", path, what, r.code, r.body, tc.want)
			}
		}
	}
}

// tenant_id and routing_group name one field: a body that gives both with
// different values is refused by every endpoint of the indexer API, naming
// both (Dynamo takes routing_group, kvrouter took tenant_id: a client in
// transition sending both got another namespace from each); both the same
// is that tenant.
func TestTenantIDAndRoutingGroupThatDifferAreRefused(t *testing.T) {
	n := startNode(t)
	r := regRaw(t, n, 1, "llama", 0, `, "tenant_id": "default", "routing_group": "customer-a"`)
	if b := string(r.body); r.code != 400 || !strings.Contains(b, "tenant_id") || !strings.Contains(b, "routing_group") ||
		!strings.Contains(b, "customer-a") {
		t.Errorf("register with tenant_id default and routing_group customer-a: %d %s, want 400 naming both", r.code, r.body)
	}
	if len(n.node.WorkerTable()) != 0 {
		t.Fatalf("the refused registration registered %v", n.node.WorkerTable())
	}
	mustCode(t, regRaw(t, n, 1, "llama", 0, `, "tenant_id": "customer-a", "routing_group": "customer-a"`), 201, "register with both the same")
	if _, ok := n.node.WorkerTable()[WorkerID(1, "llama", "customer-a")]; !ok {
		t.Fatalf("tenant_id and routing_group customer-a registered %v, want tenant customer-a", n.node.WorkerTable())
	}
	both := map[string]any{"model_name": "llama", "tenant_id": "default", "routing_group": "customer-a"}
	with := func(kv ...any) map[string]any {
		m := maps.Clone(both)
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		path string
		body map[string]any
	}{
		{"/query", with("token_ids", prompt)},
		{"/query_by_hash", with("block_hashes", promptHashes())},
		{"/events", with("instance_id", 1, "events", []Event{stored(1, 0, "GPU", 0, 3)})},
		{"/unregister", with("instance_id", 1)},
	} {
		for _, c := range []codec{codecJSON, codecMsgpack} {
			if r := n.do(t, c, "POST", tc.path, tc.body); r.code != 400 {
				t.Errorf("%s with tenant_id default and routing_group customer-a (codec %d): %d %s, want 400", tc.path, c, r.code, r.body)
			}
		}
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/unregister",
		[]byte(`{"instance_id": 1, "model_name": "llama", "routing_group": "customer-a"}`)), 200, "unregister from routing_group customer-a")
}

// additionalsalt, Mooncake's name of additional_salt that Dynamo's
// indexer accepts, registers the salt (it was dropped as an unknown key:
// the instance registered unsalted, and the same registration written
// with additional_salt was a 409); both given must agree.
func TestRegisterTakesAdditionalSaltUnderMooncakesName(t *testing.T) {
	n := startNode(t)
	mustCode(t, regRaw(t, n, 1, "llama", 0, `, "additionalsalt": "w8a8"`), 201, "register with additionalsalt")
	if w := n.node.WorkerTable()[WorkerID(1, "llama", DefaultTenant)]; w.Salt != "w8a8" {
		t.Fatalf("registered with additionalsalt w8a8: salt %q", w.Salt)
	}
	mustCode(t, regRaw(t, n, 1, "llama", 0, `, "additional_salt": "w8a8"`), 201, "the same registration with additional_salt")
	mustCode(t, regRaw(t, n, 1, "llama", 0, `, "additional_salt": "w8a8", "additionalsalt": "w8a8"`), 201, "both, the same")
	mustCode(t, regRaw(t, n, 2, "llama", 0, `, "additional_salt": "w8a8", "additionalsalt": "fp16"`), 400, "both, differing")
}

// A registration that differs from the instance's names what differs.
func TestRegisterConflictNamesTheFieldThatDiffers(t *testing.T) {
	n := startNode(t)
	mustCode(t, regRaw(t, n, 1, "llama", 0, `, "additional_salt": "w8a8"`), 201, "register")
	for _, tc := range []struct{ extra, want string }{
		{`, "additional_salt": "fp16"`, "additional_salt"},
		{``, "additional_salt"},
		{`, "additional_salt": "w8a8", "block_size": 8`, "block_size 4, not 8"},
	} {
		r := regRaw(t, n, 1, "llama", 0, tc.extra)
		if r.code != 409 || !strings.Contains(string(r.body), tc.want) || strings.Contains(string(r.body), "w8a8") {
			t.Errorf("register again with%s: %d %s, want 409 naming %q (and not the salt registered)", tc.extra, r.code, r.body, tc.want)
		}
	}
}

// GET /workers filters by ?model_name= and ?routing_group= (or
// ?tenant_id=), both narrowing, as Dynamo's indexer does; none matching
// is [] (the filters were ignored: every instance was listed).
func TestWorkersFilterByModelAndGroup(t *testing.T) {
	n := startNode(t)
	mustCode(t, regRaw(t, n, 1, "llama", 0, ""), 201, "register llama")
	mustCode(t, regRaw(t, n, 2, "mistral", 0, ""), 201, "register mistral")
	mustCode(t, regRaw(t, n, 3, "llama", 0, `, "routing_group": "blue"`), 201, "register llama blue")
	for _, tc := range []struct {
		query string
		want  []uint64
	}{
		{"", []uint64{1, 2, 3}},
		{"?model_name=llama", []uint64{1, 3}},
		{"?routing_group=blue", []uint64{3}},
		{"?tenant_id=default", []uint64{1, 2}},
		{"?model_name=llama&routing_group=default", []uint64{1}},
		{"?model_name=mistral&routing_group=blue", []uint64{}},
		{"?model_name=gpt", []uint64{}},
	} {
		r := n.do(t, codecJSON, "GET", "/workers"+tc.query, nil)
		mustCode(t, r, 200, "workers"+tc.query)
		var ws []Instance
		if err := json.Unmarshal(r.body, &ws); err != nil {
			t.Fatal(err)
		}
		got := []uint64{}
		for _, w := range ws {
			got = append(got, w.InstanceID)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("GET /workers%s lists instances %v, want %v: %s", tc.query, got, tc.want, r.body)
		}
	}
	mustCode(t, n.do(t, codecJSON, "GET", "/workers?tenant_id=default&routing_group=blue", nil), 400, "workers of two tenants")
}

// GET /dump is kvrouter's own shape, as compat.md says: flat events with
// their instance_id and signed hashes, not Dynamo's RouterEvent
// ({worker_id, event: {event_id, data: {stored: ...}}}), which a Dynamo
// replica reads to recover; it posts back to kvrouter's /events.
func TestDumpIsKvroutersOwnShape(t *testing.T) {
	n := startNode(t)
	mustCode(t, regRaw(t, n, 1, "llama", 0, ""), 201, "register")
	postEvents(t, n, stored(1, 0, "GPU", 0, 3))
	r := n.do(t, codecJSON, "GET", "/dump", nil)
	mustCode(t, r, 200, "dump")
	var dump map[string]struct {
		Events []map[string]json.RawMessage `json:"events"`
	}
	if err := json.Unmarshal(r.body, &dump); err != nil {
		t.Fatal(err)
	}
	evs := dump["llama:default"].Events
	if len(evs) != 3 {
		t.Fatalf("dump of 3 stored blocks: %s", r.body)
	}
	for _, ev := range evs {
		for _, k := range []string{"instance_id", "dp_rank", "event_id", "type", "medium", "blocks"} {
			if ev[k] == nil {
				t.Errorf("dump event %v lacks %q", ev, k)
			}
		}
		if ev["worker_id"] != nil || ev["event"] != nil {
			t.Errorf("dump event %v has a Dynamo RouterEvent's keys; compat.md says it is kvrouter's shape", ev)
		}
	}
}

// Bodies written to Mooncake's indexer RFC are refused, not misread, as
// compat.md says: its /register names the model "modelname" and takes a
// string instance_id, its /query names the model "model". Only its
// additionalsalt is read (TestRegisterTakesAdditionalSaltUnderMooncakesName).
func TestMooncakeRFCBodiesAreRefused(t *testing.T) {
	n := startNode(t)
	for _, tc := range []struct{ path, body string }{
		{"/register", `{"endpoint": "tcp://1.1.1.1:5557", "type": "vLLM", "modelname": "deepseek", "tenant_id": "default",
			"instance_id": "vllm-prefill-node1", "block_size": 128, "dp_rank": 0, "additionalsalt": "w8a8"}`},
		{"/register", `{"endpoint": "tcp://1.1.1.1:5557", "modelname": "deepseek", "instance_id": 1, "block_size": 128}`},
		{"/query", `{"model": "deepseek", "token_ids": [101, 15, 100, 55, 89], "tenant_id": "default"}`},
	} {
		if r := n.do(t, codecJSON, "POST", tc.path, []byte(tc.body)); r.code != 400 {
			t.Errorf("Mooncake RFC %s %s: %d %s, want 400", tc.path, tc.body, r.code, r.body)
		}
	}
	if len(n.node.WorkerTable()) != 0 {
		t.Errorf("the refused registrations registered %v", n.node.WorkerTable())
	}
}
