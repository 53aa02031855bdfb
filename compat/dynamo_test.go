package compat

// The indexer API against NVIDIA Dynamo's standalone KV indexer
// (ai-dynamo/dynamo docs/components/router/standalone-indexer.md): each
// test sends the bytes a Dynamo client sends, or reads the answer as a
// Dynamo client reads it.

import (
	"fmt"
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
		if r := n.do(t, tc.c, "POST", "/query_by_hash", body); r.code != tc.want {
			t.Errorf("/query_by_hash %s: %d %s, want %d", what, r.code, r.body, tc.want)
		}
	}
}
