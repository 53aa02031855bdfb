package api_test

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/raftfsm"
)

var fuzzRoutes = []struct{ method, path string }{
	{"POST", "/v1/route"},
	{"POST", "/v1/events"},
	{"POST", "/v1/ranks/1/0/dump"},
	{"POST", "/v1/workers"},
	{"PUT", "/v1/settings"},
	{"POST", "/v1/cluster/members"},
	{"POST", "/v1/cluster/leader/transfer"},
	{"POST", "/v1/snapshot/restore"},
}

// FuzzRequestBodies sends arbitrary bodies to every route that takes one:
// no body may make the server panic or answer 500, and nothing malformed
// may reach the backend.
func FuzzRequestBodies(f *testing.F) {
	seeds := []string{
		`{"token_ids":[1,2,3,4,5]}`, `{"block_hashes":[1,2],"isl":9,"book":true,"request_id":"x"}`,
		events(storedEv, removedEv), events(`{"event_id":1,"type":"cleared"}`),
		`{"batches":[{"worker_id":1,"dp_rank":0,"events":[{"event_id":1,"type":"stored","tier":"HOST","parent_hash":1,"blocks":[{"hash":2,"local_hash":3}]}]}]}`,
		`{"cursor":3,"events":[` + storedEv + `]}`, `{"worker_id":1,"block_size":16,"dp_ranks":[0,3]}`,
		`{"params":{"temperature":0.5},"view":"tiered"}`, `{"id":"n2","raft_addr":"a:1","http_addr":"b:2"}`,
		`{"to":"n1"}`, `null`, `[]`, `{}`, `{"a":`, "\x00", `{"token_ids":[1e3]}`, `{"isl":1e400,"token_ids":[1]}`,
		`{"isl":1}`, // a prompt shorter than a block: scored on load alone
	}
	for i, s := range seeds {
		f.Add(uint8(i), s)
	}
	fake := apitest.New("n1", "127.0.0.1:1")
	_ = fake.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0, 1}, BlockSize: 4})
	s := api.NewServer(fake, api.Options{Logger: slog.New(slog.DiscardHandler), MaxBodyBytes: 1 << 16})
	defer s.Close()
	f.Fuzz(func(t *testing.T, route uint8, body string) {
		r := fuzzRoutes[int(route)%len(fuzzRoutes)]
		rec := httptest.NewRecorder()
		before := fake.Malformed() // this input's own count: the fake outlives every input
		s.ServeHTTP(rec, httptest.NewRequest(r.method, r.path, strings.NewReader(body)))
		if rec.Code >= 500 && rec.Code != 503 {
			t.Fatalf("%s %s %q: %d %s", r.method, r.path, body, rec.Code, rec.Body)
		}
		if m := fake.Malformed(); m != before {
			t.Fatalf("%s %s %q: malformed input reached the backend", r.method, r.path, body)
		}
	})
}
