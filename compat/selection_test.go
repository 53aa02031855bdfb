package compat

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

func selectionScript() []step {
	hs := promptHashes()
	seq := []Hash{11, 12, 13}
	p := "/selection"
	w1 := CatalogWorker{WorkerID: 1, ModelName: "llama", Endpoint: "http://10.0.0.1:8000", BlockSize: testBlockSize,
		DataParallelSize: 2, KVEventsEndpoints: Map[string]{"0": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558"}}
	w2 := CatalogWorker{WorkerID: 2, ModelName: "llama", Endpoint: "http://10.0.0.2:8000", BlockSize: testBlockSize}
	sel := func(id string, reserve bool) SelectRequest {
		return SelectRequest{SelectionID: id, ModelName: "llama", BlockHashes: hs, SequenceHashes: seq, ISLTokens: 16}
	}
	endpoint := "http://10.0.0.9:8000"
	return []step{
		{"ready_empty", "GET", p + "/ready", nil, 503},
		{"add_worker", "POST", p + "/workers", w1, 201},
		{"add_worker2", "POST", p + "/workers", w2, 201},
		{"add_worker_again", "POST", p + "/workers", w1, 201},
		{"add_worker_conflict", "POST", p + "/workers", CatalogWorker{WorkerID: 1, ModelName: "llama", BlockSize: 8}, 409},
		{"add_worker_bad_key", "POST", p + "/workers", CatalogWorker{WorkerID: 3, ModelName: "llama", BlockSize: 4,
			KVEventsEndpoints: Map[string]{"5": "tcp://h:1"}}, 400},
		{"patch_worker", "PATCH", p + "/workers/2", WorkerPatch{Endpoint: &endpoint}, 200},
		{"patch_unknown", "PATCH", p + "/workers/7", WorkerPatch{Endpoint: &endpoint}, 404},
		{"list_workers", "GET", p + "/workers", nil, 200},
		{"ready", "GET", p + "/ready", nil, 200},
		// Worker 1 dp 1 holds the prompt's first two blocks.
		{"events", "POST", "/events", EventsRequest{InstanceID: 1, ModelName: "llama", Events: []Event{stored(1, 1, "", 0, 2)}}, 200},
		{"overlap_scores", "POST", p + "/overlap_scores", OverlapScoresRequest{ModelName: "llama", BlockHashes: hs}, 200},
		{"select", "POST", p + "/select", sel("s1", false), 200},
		{"select_and_reserve", "POST", p + "/select_and_reserve", sel("s2", true), 200},
		{"select_no_workers", "POST", p + "/select", SelectRequest{ModelName: "mistral", ISLTokens: 4}, 503},
		{"loads_reserved", "GET", p + "/loads?model_name=llama", nil, 200},
		{"potential_loads", "POST", p + "/potential_loads", PotentialLoadsRequest{ModelName: "llama", BlockHashes: hs,
			SequenceHashes: seq, ISLTokens: 16}, 200},
		{"prefill_complete", "POST", p + "/reservations/s2/prefill_complete", nil, 200},
		{"output_block", "POST", p + "/reservations/s2/output_block", map[string]any{}, 200},
		{"loads_after_output", "GET", p + "/loads?model_name=llama", nil, 200},
		// Five blocks, held by s2 alone, at weight 0.5: 2.5, rounded up.
		{"output_block_decay", "POST", p + "/reservations/s2/output_block", OutputBlockRequest{DecayFraction: ptr(0.5)}, 200},
		{"output_block_decay_bad", "POST", p + "/reservations/s2/output_block", OutputBlockRequest{DecayFraction: ptr(1.5)}, 400},
		{"output_block_decay_negative", "POST", p + "/reservations/s2/output_block", OutputBlockRequest{DecayFraction: ptr(-0.1)}, 400},
		{"loads_after_decay", "GET", p + "/loads?model_name=llama", nil, 200},
		{"release", "DELETE", p + "/reservations/s2", nil, 200},
		{"release_again", "DELETE", p + "/reservations/s2", nil, 404},
		{"reserve", "POST", p + "/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama", WorkerID: 2,
			SequenceHashes: seq, ISLTokens: 12, CachedTokens: 4}, 201},
		{"reserve_unknown_rank", "POST", p + "/reservations", ReservationRequest{ReservationID: "r2", ModelName: "llama",
			WorkerID: 2, DPRank: 3, ISLTokens: 4}, 404},
		{"reserve_bad", "POST", p + "/reservations", ReservationRequest{ReservationID: "r3", ModelName: "llama",
			WorkerID: 2, ISLTokens: 4, CachedTokens: 8}, 400},
		{"loads_reserve", "GET", p + "/loads?model_name=llama", nil, 200},
		{"release_r1", "DELETE", p + "/reservations/r1", nil, 200},
		{"loads_zero", "GET", p + "/loads", nil, 200},
		{"delete_worker", "DELETE", p + "/workers/2", nil, 200},
		{"delete_unknown", "DELETE", p + "/workers/2", nil, 404},
	}
}

func ptr[T any](v T) *T { return &v }

// TestSelectionGolden runs the selection script against a fresh node in
// each encoding, checks every status and pins every answer that does not
// carry a generated id.
func TestSelectionGolden(t *testing.T) {
	script := selectionScript()
	answers := map[codec][]reply{}
	for _, c := range []codec{codecJSON, codecMsgpack} {
		n := startNode(t)
		for _, s := range script {
			r := n.do(t, c, s.method, s.path, s.body)
			if r.code != s.code {
				t.Fatalf("%s (%v): status %d, want %d: %s", s.name, c, r.code, s.code, r.body)
			}
			golden(t, "selection_"+s.name, c, r)
			answers[c] = append(answers[c], r)
		}
	}
	for i, s := range script {
		if s.code >= 400 {
			continue
		}
		j, m := answers[codecJSON][i].asJSON(t), answers[codecMsgpack][i].asJSON(t)
		if !reflect.DeepEqual(j, m) {
			t.Errorf("%s: JSON and MessagePack answers differ:\n%v\n%v", s.name, j, m)
		}
	}
}

// TestSelectionLifecycle follows one reservation through the load tracker:
// the cached worker is chosen, its load appears, prefill_complete drops
// the prefill tokens, an output block adds a decode block, and release
// returns the loads to zero.
func TestSelectionLifecycle(t *testing.T) {
	n := startNode(t)
	var loads []RankLoad
	for _, s := range selectionScript() {
		r := n.do(t, codecJSON, s.method, s.path, s.body)
		if r.code != s.code {
			t.Fatalf("%s: status %d, want %d: %s", s.name, r.code, s.code, r.body)
		}
		switch s.name {
		case "select", "select_and_reserve":
			var got SelectResponse
			if err := json.Unmarshal(r.body, &got); err != nil {
				t.Fatal(err)
			}
			// Worker 1 dp 1 has 2 of the 4 prompt blocks cached: 8 tokens.
			if got.WorkerID != 1 || got.DPRank != 1 || got.EffectivePrefillTokens != 8 || got.Overlap.GPU != 8 ||
				got.Reserved != (s.name == "select_and_reserve") || got.Endpoint != "http://10.0.0.1:8000" {
				t.Fatalf("%s: %+v", s.name, got)
			}
		case "loads_reserved", "loads_after_output", "loads_reserve", "loads_zero":
			loads = nil
			if err := json.Unmarshal(r.body, &loads); err != nil {
				t.Fatal(err)
			}
			want := map[string]RankLoad{
				"loads_reserved":     {WorkerID: 1, DPRank: 1, ActivePrefillTokens: 8, ActiveDecodeBlocks: 3, ActiveRequests: 1},
				"loads_after_output": {WorkerID: 1, DPRank: 1, ActivePrefillTokens: 0, ActiveDecodeBlocks: 4, ActiveRequests: 1},
				"loads_reserve":      {WorkerID: 2, DPRank: 0, ActivePrefillTokens: 8, ActiveDecodeBlocks: 3, ActiveRequests: 1},
			}[s.name]
			for _, l := range loads {
				if l.WorkerID == want.WorkerID && l.DPRank == want.DPRank && want.ActiveRequests > 0 {
					want.ModelName, want.RoutingGroup = "llama", DefaultTenant
					if l != want {
						t.Fatalf("%s: %+v, want %+v", s.name, l, want)
					}
				} else if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
					t.Fatalf("%s: unexpected load %+v", s.name, l)
				}
			}
		}
	}
	if len(loads) != 3 {
		t.Fatalf("loads of every rank: %+v", loads)
	}
}

// TestSessionBreaksTies: two idle workers with no cache tie on cost; a
// session's later requests stay on the rank it got first.
func TestSessionBreaksTies(t *testing.T) {
	n := fourIdleWorkers(t)
	pick := func(session string, first Hash) uint64 {
		r := n.do(t, codecJSON, "POST", "/selection/select", SelectRequest{ModelName: "m", BlockHashes: []Hash{first},
			ISLTokens: 4, SessionID: session})
		var got SelectResponse
		if err := json.Unmarshal(r.body, &got); err != nil || r.code != 200 {
			t.Fatalf("%d %s %v", r.code, r.body, err)
		}
		return got.WorkerID
	}
	// Without a session the rendezvous hash of the first block decides, so
	// different prompts spread; with one, they follow the session.
	first := pick("chat-1", 1)
	spread := map[uint64]bool{}
	for h := Hash(2); h < 40; h++ {
		spread[pick("", h)] = true
		if got := pick("chat-1", h); got != first {
			t.Fatalf("prompt %d of session chat-1 went to worker %d, its first to %d", h, got, first)
		}
	}
	if len(spread) < 2 {
		t.Fatalf("without a session every prompt went to %v: the test cannot tell sessions apart", spread)
	}
}

// TestBookingErrorsMapToStatus: a reservation on a rank that left before
// its commit is a 404, as the docs say, and a route with no worker to
// choose a 503 (from a review: both were answered 500), every rank busy a
// 429 (Dynamo's selection service's answer); a booking under
// an id freed before or live elsewhere is a 409.
func TestBookingErrorsMapToStatus(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{fmt.Errorf("reserve r: book r: %w: 1/0 is not a registered rank", indexer.ErrUnknownRank), http.StatusNotFound},
		{fmt.Errorf("route: %w", indexer.ErrNoWorkers), http.StatusServiceUnavailable},
		{fmt.Errorf("route: %w", indexer.ErrOverloaded), http.StatusTooManyRequests},
		{fmt.Errorf("reserve r: %w", raftfsm.ErrBookingFreed), http.StatusConflict},
		{fmt.Errorf("reserve r: %w", &raftfsm.BookedElsewhereError{ID: "r"}), http.StatusConflict},
	} {
		rec := httptest.NewRecorder()
		if err := answer(rec, codecJSON, http.StatusOK, nil, c.err); err != nil {
			t.Fatal(err)
		}
		if rec.Code != c.want {
			t.Errorf("%v: answered %d, want %d", c.err, rec.Code, c.want)
		}
	}
}

// TestOverlongIDIsRefusedBeforeItIsCommitted: a selection_id or
// reservation_id past /v1's id limit (256 bytes) is a 400 and writes
// nothing to the Raft log. From a review: an id past raftfsm's 4096-byte
// key limit was proposed and committed, then refused by every FSM as a
// bad command: a Raft entry for a malformed request, and a 500 instead of
// a 400.
func TestOverlongIDIsRefusedBeforeItIsCommitted(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 3, Endpoint: "tcp://10.0.0.1:5557",
		ModelName: "llama", BlockSize: 4, Agentless: ptr(false)}), 201, "register")
	before := n.node.Status().LastIndex
	for _, long := range []string{strings.Repeat("x", 5000), strings.Repeat("x", maxIDLen+1), "a\nb"} {
		r := n.do(t, codecJSON, "POST", "/selection/select_and_reserve", SelectRequest{SelectionID: long, ModelName: "llama",
			BlockHashes: []Hash{1}, ISLTokens: 8})
		r2 := n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: long, ModelName: "llama",
			WorkerID: 3, ISLTokens: 8})
		if r.code != 400 || r2.code != 400 {
			t.Errorf("a %d-byte id: select_and_reserve %d, reservations %d", len(long), r.code, r2.code)
		}
	}
	if after := n.node.Status().LastIndex; after != before {
		t.Errorf("refused ids reached the Raft log: last index %d -> %d", before, after)
	}
	r := n.do(t, codecJSON, "POST", "/selection/select", SelectRequest{ModelName: "llama", BlockHashes: []Hash{1},
		ISLTokens: 8, SessionID: strings.Repeat("s", maxIDLen+1)})
	mustCode(t, r, 400, "an overlong session_id")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: strings.Repeat("x", maxIDLen),
		ModelName: "llama", WorkerID: 3, ISLTokens: 8}), 201, "an id of the limit's length")
}

// errorOf is the "error" of an error answer.
func errorOf(t *testing.T, r reply) string {
	t.Helper()
	var e ErrorBody
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("an error answer that is not {\"error\": ...}: %v: %s", err, r.body)
	}
	return e.Error
}

// loadOf is rank (worker, dp)'s load in GET /selection/loads.
func loadOf(t *testing.T, n *testNode, model string, worker uint64, dp uint32) RankLoad {
	t.Helper()
	r := n.do(t, codecJSON, "GET", "/selection/loads?model_name="+model, nil)
	mustCode(t, r, 200, "loads")
	var loads []RankLoad
	if err := json.Unmarshal(r.body, &loads); err != nil {
		t.Fatal(err)
	}
	for _, l := range loads {
		if l.WorkerID == worker && l.DPRank == dp {
			return l
		}
	}
	return RankLoad{WorkerID: worker, DPRank: dp}
}

// TestReservationOfAFreedIDIsAConflict: reservation ids are single-use; a
// reservation under an id that was reserved and freed books nothing and is
// a 409 that says so. From a review: it was answered 201 ok, and the
// prefill_complete that followed was a 404.
func TestReservationOfAFreedIDIsAConflict(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	body := ReservationRequest{ReservationID: "r1", ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1, 2}, ISLTokens: 8}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", body), 201, "reserve")
	mustCode(t, n.do(t, codecJSON, "DELETE", "/selection/reservations/r1", nil), 200, "release")
	r := n.do(t, codecJSON, "POST", "/selection/reservations", body)
	mustCode(t, r, http.StatusConflict, "reserve a freed id")
	if e := errorOf(t, r); !strings.Contains(e, `reservation id "r1" was already used and freed`) {
		t.Errorf("reserve a freed id: %q, want it to say the id was already used and freed", e)
	}
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("a refused reservation left load: %+v", l)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations/r1/prefill_complete", nil), 404, "prefill_complete of the refused id")
}

// TestSelectionPortKeepsEscapedReservationIDs: a reservation id with a '/'
// (printable, so allowed), escaped as %2F in the path, reaches its
// reservation on the selection API's own port as on the main one. From a
// review: the selection port dropped the escaping, so the path had one
// more segment and prefill_complete, output_block and the release were
// 404s, and the reservation's load stayed until it expired.
func TestSelectionPortKeepsEscapedReservationIDs(t *testing.T) {
	n := startNode(t)
	sel := n.selectionPort(t)
	mustCode(t, sel.do(t, codecJSON, "POST", "/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	body := ReservationRequest{ReservationID: "a/b", ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1}, ISLTokens: 8}
	mustCode(t, sel.do(t, codecJSON, "POST", "/reservations", body), 201, "reserve a/b")
	mustCode(t, sel.do(t, codecJSON, "POST", "/reservations/a%2Fb/prefill_complete", nil), 200, "prefill_complete of a/b")
	mustCode(t, sel.do(t, codecJSON, "POST", "/reservations/a%2Fb/output_block", map[string]any{}), 200, "output_block of a/b")
	mustCode(t, sel.do(t, codecJSON, "DELETE", "/reservations/a%2Fb", nil), 200, "release a/b")
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("released reservation a/b still counts: %+v", l)
	}
	// An unescaped path is another one: /reservations/a/b names no route.
	mustCode(t, sel.do(t, codecJSON, "DELETE", "/reservations/a/b", nil), 404, "release of the unescaped a/b")
}

// TestSelectionPortServesUncleanPaths: a path that is not clean (a doubled
// slash, a "." or ".." segment) is served on the selection port as it is
// under SelectionPrefix on the main port. From a review: the prefix went on
// before the mux cleaned the path, so the mux redirected to the prefixed
// clean path (307 Location /selection/loads), which the selection port
// prefixes again (404 "no route GET /selection/selection/loads"); a 307
// keeps the method, so writes failed the same way.
func TestSelectionPortServesUncleanPaths(t *testing.T) {
	n := startNode(t)
	sel := n.selectionPort(t)
	mustCode(t, sel.do(t, codecJSON, "POST", "/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, p := range []string{"//loads", "/./loads", "/x/../loads", "/x/..//./loads"} {
		mustCode(t, n.do(t, codecJSON, "GET", SelectionPrefix+p+"?model_name=m", nil), 200, "main port GET "+SelectionPrefix+p)
		mustCode(t, sel.do(t, codecJSON, "GET", p+"?model_name=m", nil), 200, "selection port GET "+p)
		resp, err := noFollow.Get(sel.url + p + "?model_name=m")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if loc := resp.Header.Get("Location"); strings.HasPrefix(loc, SelectionPrefix) {
			t.Errorf("selection port GET %s: %d to %q, a path the selection port does not serve", p, resp.StatusCode, loc)
		}
	}
	// Writes too, and an escaped id in an unclean path keeps its escaping.
	body := ReservationRequest{ReservationID: "a/b", ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1}, ISLTokens: 8}
	mustCode(t, sel.do(t, codecJSON, "POST", "//reservations", body), 201, "reserve a/b at //reservations")
	mustCode(t, sel.do(t, codecJSON, "POST", "/x/../reservations/a%2Fb/prefill_complete", nil), 200, "prefill_complete of a/b under /x/..")
	mustCode(t, sel.do(t, codecJSON, "DELETE", "/./reservations//a%2Fb", nil), 200, "release of a/b under /./ and //")
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("released reservation a/b still counts: %+v", l)
	}
}

// TestSelectionPortKeepsReservationIDsWithDots: reservation ids that look
// hold path segments to clean ("x/../y", "./z", "a//b", escaped by the
// client) reach their reservations on both ports: only the escaped
// path is cleaned, where such an id is one segment. From a review, which
// found them working and asked that they stay so.
func TestSelectionPortKeepsReservationIDsWithDots(t *testing.T) {
	n := startNode(t)
	sel := n.selectionPort(t)
	mustCode(t, sel.do(t, codecJSON, "POST", "/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	ids := []string{"a b", "a%b", "a%2Fb", "a/b%", "a?b", "a#b", "é/x", "a+b", "a;b", "x/../y", "a//b", "..", "./z", "z/.", "/", "."}
	for _, port := range []struct {
		name string
		n    *testNode
		pre  string
	}{{"main", n, SelectionPrefix}, {"selection", sel, ""}} {
		for _, id := range ids {
			// A freed id cannot be booked again: each port books its own.
			id = port.name + ":" + id
			body := ReservationRequest{ReservationID: id, ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1}, ISLTokens: 8}
			if r := port.n.do(t, codecJSON, "POST", port.pre+"/reservations", body); r.code != 201 {
				t.Errorf("%s port: reserve %q: %d %s", port.name, id, r.code, r.body)
				continue
			}
			p := port.pre + "/reservations/" + url.PathEscape(id)
			if r := port.n.do(t, codecJSON, "POST", p+"/prefill_complete", nil); r.code != 200 {
				t.Errorf("%s port: prefill_complete of %q (%s): %d %s", port.name, id, p, r.code, r.body)
			}
			if r := port.n.do(t, codecJSON, "DELETE", p, nil); r.code != 200 {
				t.Errorf("%s port: release of %q (%s): %d %s", port.name, id, p, r.code, r.body)
			}
		}
	}
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("load left after every release: %+v", l)
	}
}

// TestReservationOfAnIDLiveElsewhereIsAConflict: a reservation under an id
// live on another rank is a 409 naming that rank, and the load stays where
// it is; a retry on the same rank is a 201 that books nothing more. From a
// review: the other rank's reservation was answered 201 ok, with the load
// still on the first rank.
func TestReservationOfAnIDLiveElsewhereIsAConflict(t *testing.T) {
	n := startNode(t)
	for id := uint64(1); id <= 2; id++ {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: id, ModelName: "m", BlockSize: 4}), 201, "add worker")
	}
	body := ReservationRequest{ReservationID: "r1", ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1, 2}, ISLTokens: 8}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", body), 201, "reserve on worker 1")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", body), 201, "the same reservation again")
	body.WorkerID = 2
	r := n.do(t, codecJSON, "POST", "/selection/reservations", body)
	mustCode(t, r, http.StatusConflict, "the id on worker 2")
	if e := errorOf(t, r); !strings.Contains(e, `reservation id "r1" is already reserved on worker 1 dp rank 0`) {
		t.Errorf("the id on worker 2: %q, want it to name worker 1 dp rank 0", e)
	}
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 1 || l.ActivePrefillTokens != 8 {
		t.Errorf("worker 1: %+v, want the one reservation of 8 tokens", l)
	}
	if l := loadOf(t, n, "m", 2, 0); l.ActiveRequests != 0 {
		t.Errorf("worker 2: %+v, want no load", l)
	}
}

// TestSelectOfTokenIDsCountsEveryToken: a prompt given as token_ids without
// isl_tokens is as long as its tokens, also its last partial block. From a
// review: its length was its full blocks' tokens, so a prompt shorter than
// a block was refused as empty (/v1/route routes it) and a 20-token prompt
// of 16-token blocks was costed, answered and booked as 16 tokens.
func TestSelectOfTokenIDsCountsEveryToken(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 16}), 201, "add worker")
	toks := make([]uint32, 20)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	for _, c := range []struct {
		path string
		toks []uint32
	}{
		{"/selection/select", toks[:3]},
		{"/selection/select", toks},
		{"/selection/select_and_reserve", toks[:3]},
		{"/selection/select_and_reserve", toks},
	} {
		r := n.do(t, codecJSON, "POST", c.path, SelectRequest{SelectionID: fmt.Sprintf("s%d", len(c.toks)), ModelName: "m", TokenIDs: c.toks})
		mustCode(t, r, 200, fmt.Sprintf("%s of a %d-token prompt", c.path, len(c.toks)))
		var got SelectResponse
		if err := json.Unmarshal(r.body, &got); err != nil {
			t.Fatal(err)
		}
		if got.EffectivePrefillTokens != len(c.toks) {
			t.Errorf("%s of a %d-token prompt: effective_prefill_tokens %d, want %d", c.path, len(c.toks), got.EffectivePrefillTokens, len(c.toks))
		}
	}
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 2 || l.ActivePrefillTokens != 3+20 {
		t.Errorf("after reserving a 3- and a 20-token prompt: %+v, want 2 requests of 23 prefill tokens", l)
	}
}

// TestMainPortRedirectKeepsAnEscapedID: an unclean path with an escaped
// reservation id ("/selection/./reservations/a%2Fb") on the main port is
// redirected to the clean path with the id's escaping kept, so that it
// releases a/b, as the same path does on the selection port. From a review:
// the mux's redirect went to ".../a%252Fb", the release of the reservation
// literally named "a%2Fb".
func TestMainPortRedirectKeepsAnEscapedID(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	for _, id := range []string{"a/b", "a%2Fb"} {
		body := ReservationRequest{ReservationID: id, ModelName: "m", WorkerID: 1, SequenceHashes: []Hash{1}, ISLTokens: 8}
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", body), 201, "reserve "+id)
	}
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	req, _ := http.NewRequest("DELETE", n.url+"/selection/./reservations/a%2Fb", nil)
	resp, err := noFollow.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if loc := resp.Header.Get("Location"); resp.StatusCode/100 != 3 || loc != "/selection/reservations/a%2Fb" {
		t.Fatalf("main port DELETE /selection/./reservations/a%%2Fb: %d Location %q, want a redirect to /selection/reservations/a%%2Fb", resp.StatusCode, loc)
	}
	// Follow it, as a client does.
	mustCode(t, n.do(t, codecJSON, "DELETE", "/selection/./reservations/a%2Fb", nil), 200, "main port release via unclean path")
	// a/b must be the one released (the selection port releases a/b for "/./reservations/a%2Fb").
	if r := n.do(t, codecJSON, "DELETE", "/selection/reservations/a%2Fb", nil); r.code == 200 {
		t.Errorf("main port: the unclean path released another reservation than a/b (a/b still live); the selection port releases a/b for the same path")
	}
}

// TestOutputBlockBodyIsOptional: an output_block without fields, its body
// empty or all whitespace, sent with a length or streamed (chunked), adds
// one block. From a review: whether the body was read went by
// Content-Length, so a chunked empty body was a 400 "bad request body:
// empty" (and a whitespace one with a length too), where the docs call the
// body optional.
func TestOutputBlockBodyIsOptional(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "m",
		WorkerID: 1, ISLTokens: 8}), 201, "reserve")
	post := func(body string, chunked bool) (int, string) {
		t.Helper()
		var rd io.Reader = strings.NewReader(body)
		if chunked {
			rd = io.MultiReader(rd) // no length known: sent chunked
		}
		req, err := http.NewRequest("POST", n.url+"/selection/reservations/r1/output_block", rd)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	blocks := loadOf(t, n, "m", 1, 0).ActiveDecodeBlocks
	for _, c := range []struct {
		body    string
		chunked bool
		want    int
	}{
		{"", false, 200},
		{"", true, 200},
		{" \n\t", false, 200},
		{" \n\t", true, 200},
		{`{"decay_fraction":1}`, true, 200},
		{`{"decay_fraction":2}`, true, 400},
		{`{`, true, 400},
	} {
		code, body := post(c.body, c.chunked)
		if code != c.want {
			t.Errorf("output_block %q (chunked %v): %d %s, want %d", c.body, c.chunked, code, body, c.want)
			continue
		}
		if code == 200 {
			blocks++
		}
	}
	if got := loadOf(t, n, "m", 1, 0).ActiveDecodeBlocks; got != blocks {
		t.Errorf("active_decode_blocks %d, want %d: one per accepted output_block", got, blocks)
	}
}

// TestSelectAndReserveOfAFreedIDIsAConflict: from a review. A
// select_and_reserve under a selection_id used and freed before answered
// 200 with reserved:false and booked nothing, where POST /reservations
// answers 409 for that id.
func TestSelectAndReserveOfAFreedIDIsAConflict(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "m", BlockSize: 4}), 201, "add worker")
	sel := SelectRequest{SelectionID: "s1", ModelName: "m", ISLTokens: 8}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/select_and_reserve", sel), 200, "select_and_reserve")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/select_and_reserve", sel), 200, "the same again (a retry)")
	mustCode(t, n.do(t, codecJSON, "DELETE", "/selection/reservations/s1", nil), 200, "release")
	r := n.do(t, codecJSON, "POST", "/selection/select_and_reserve", sel)
	mustCode(t, r, http.StatusConflict, "select_and_reserve of a freed id")
	if e := errorOf(t, r); !strings.Contains(e, `selection_id "s1" was already used and freed`) {
		t.Errorf("select_and_reserve of a freed id: %q, want it to say the id was already used and freed", e)
	}
	if l := loadOf(t, n, "m", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("a refused select_and_reserve left load: %+v", l)
	}
	// A select without a reservation books nothing and judges no id.
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/select", sel), 200, "select of a freed id")
}

// TestSelectAndReserveOfAnIDLiveInAnotherNamespace: from a review. A
// select_and_reserve under a selection_id live in another namespace was a
// 400 naming the internal id of the rank it is booked on; POST
// /reservations answers 409 naming the catalog worker.
func TestSelectAndReserveOfAnIDLiveInAnotherNamespace(t *testing.T) {
	n := startNode(t)
	for _, m := range []string{"llama", "mistral"} {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: m, BlockSize: 4}), 201, "add worker of "+m)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/select_and_reserve", SelectRequest{SelectionID: "s1", ModelName: "llama",
		ISLTokens: 8}), 200, "select_and_reserve in llama")
	r := n.do(t, codecJSON, "POST", "/selection/select_and_reserve", SelectRequest{SelectionID: "s1", ModelName: "mistral", ISLTokens: 8})
	mustCode(t, r, http.StatusConflict, "the id in mistral")
	if e, want := errorOf(t, r), `selection_id "s1" is already reserved on worker 1 dp rank 0 of model llama routing group default`; !strings.Contains(e, want) {
		t.Errorf("the id in mistral: %q, want it to say %q", e, want)
	}
	if l := loadOf(t, n, "mistral", 1, 0); l.ActiveRequests != 0 {
		t.Errorf("mistral's worker: %+v, want no load", l)
	}
}

// TestSelectionCostsByHand: /select's choices and /potential_loads'
// figures, worked out by hand from semantics.md §5 with the defaults (the
// dedup view: a block in any tier counts as cached): block size 4, a
// prompt of 3 blocks, isl 12. Cost = prefill blocks + decode blocks.
func TestSelectionCostsByHand(t *testing.T) {
	n := startNode(t)
	for _, id := range []uint64{1, 2} {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: id, ModelName: "llama",
			Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	}
	post := func(inst uint64, evs ...Event) {
		mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: inst, ModelName: "llama", Events: evs}), 200, "events")
	}
	post(1, stored(1, 0, "GPU", 0, 2))
	post(2, stored(1, 0, "CPU", 0, 3))
	req := SelectRequest{ModelName: "llama", BlockHashes: promptHashes(), SequenceHashes: []Hash{11, 12, 13}, ISLTokens: 12}
	// W1: 3-2 + 3 = 4; W2: 3-3 + 3 = 3.
	s := selectOn(t, n, "/selection/select", req)
	if s.WorkerID != 2 || s.EffectivePrefillTokens != 0 || s.Overlap.GPU != 0 || s.Overlap.CPU != 12 || s.Overlap.LongestMatched != 12 {
		t.Errorf("case 1: %+v, want worker 2, effective 0, overlap gpu 0 cpu 12", s)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
		WorkerID: 2, SequenceHashes: []Hash{21, 22, 23, 24, 25}, ISLTokens: 20}), 201, "reserve")
	// W2: (20+12)/4 - 3 = 5, + 5+3 = 13; W1: 4.
	s = selectOn(t, n, "/selection/select", req)
	if s.WorkerID != 1 || s.EffectivePrefillTokens != 4 || s.Overlap.GPU != 8 {
		t.Errorf("case 2: %+v, want worker 1, effective 4", s)
	}
	// W1 loaded more: r2 on W1, 10 blocks, isl 40.
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r2", ModelName: "llama",
		WorkerID: 1, SequenceHashes: []Hash{31, 32, 33, 34, 35, 36, 37, 38, 39, 40}, ISLTokens: 40}), 201, "reserve")
	// W1: (40+12)/4 - 2 = 11, + 13 = 24; W2: 13.
	if s = selectOn(t, n, "/selection/select", req); s.WorkerID != 2 {
		t.Errorf("case 3: %+v, want worker 2", s)
	}
	// W1: potential decode 10+3 = 13, prefill 40+12-8 = 44; W2: 5+3 = 8, 20+12-12 = 20.
	r := n.do(t, codecJSON, "POST", "/selection/potential_loads", PotentialLoadsRequest{ModelName: "llama",
		BlockHashes: promptHashes(), SequenceHashes: []Hash{11, 12, 13}, ISLTokens: 12})
	mustCode(t, r, 200, "potential")
	var pl []RankLoad
	if err := json.Unmarshal(r.body, &pl); err != nil {
		t.Fatal(err)
	}
	if len(pl) != 2 || *pl[0].PotentialDecodeBlocks != 13 || *pl[0].PotentialPrefillToks != 44 ||
		*pl[1].PotentialDecodeBlocks != 8 || *pl[1].PotentialPrefillToks != 20 {
		t.Errorf("potential loads %s, want worker 1 13 blocks 44 tokens, worker 2 8 and 20", r.body)
	}
}

// TestSessionBreaksOnlyTies: a session keeps its rank on a tie, against
// the rank a request without a session gets, and never against a cheaper
// rank (docs/compat.md).
func TestSessionBreaksOnlyTies(t *testing.T) {
	n := startNode(t)
	for _, id := range []uint64{1, 2} {
		mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: id, ModelName: "llama",
			Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	}
	req := SelectRequest{ModelName: "llama", BlockHashes: promptHashes(), ISLTokens: 12}
	x := selectOn(t, n, "/selection/select", req).WorkerID
	y := 3 - x
	mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: y, ModelName: "llama",
		Events: []Event{stored(1, 0, "", 0, 1)}}), 200, "events")
	req.SessionID = "s"
	if got := selectOn(t, n, "/selection/select", req).WorkerID; got != y {
		t.Fatalf("cached worker %d not chosen: %d", y, got)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: y, ModelName: "llama",
		Events: []Event{{DPRank: 0, EventID: 2, Type: "removed", BlockHashes: []Hash{1000}}}}), 200, "remove")
	if got := selectOn(t, n, "/selection/select", req).WorkerID; got != y {
		t.Errorf("tie: session's worker %d not kept: %d", y, got)
	}
	req.SessionID = ""
	if got := selectOn(t, n, "/selection/select", req).WorkerID; got != x {
		t.Errorf("tie without session: %d, want %d", got, x)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: x, ModelName: "llama",
		Events: []Event{stored(1, 0, "", 0, 1)}}), 200, "events x")
	req.SessionID = "s"
	if got := selectOn(t, n, "/selection/select", req).WorkerID; got != x {
		t.Errorf("session overrode a cheaper worker: %d, want %d", got, x)
	}
}

// TestDecayFractionByHand: docs/compat.md's decay_fraction, by hand. r1
// holds 4 blocks and an output block at f = 0.5: 5 × 0.5 = 2.5, rounded
// up, 3 active decode blocks. A request of sequence hashes [1, 2, 9]
// shares blocks 1 and 2, which then count whole: 3 × 0.5 (3, 4, the
// output block) + 2 (1, 2) + 1 (9) = 4.5, 5 potential decode blocks.
func TestDecayFractionByHand(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
		WorkerID: 1, SequenceHashes: []Hash{1, 2, 3, 4}, ISLTokens: 16}), 201, "reserve")
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations/r1/output_block", OutputBlockRequest{DecayFraction: ptr(0.5)}), 200, "out")
	r := n.do(t, codecJSON, "GET", "/selection/loads?model_name=llama", nil)
	var ls []RankLoad
	if err := json.Unmarshal(r.body, &ls); err != nil {
		t.Fatal(err)
	}
	if len(ls) != 1 || ls[0].ActiveDecodeBlocks != 3 {
		t.Errorf("loads %s, want 3 active decode blocks", r.body)
	}
	r = n.do(t, codecJSON, "POST", "/selection/potential_loads", PotentialLoadsRequest{ModelName: "llama",
		SequenceHashes: []Hash{1, 2, 9}, ISLTokens: 12})
	var pl []RankLoad
	if err := json.Unmarshal(r.body, &pl); err != nil {
		t.Fatal(err)
	}
	if len(pl) != 1 || *pl[0].PotentialDecodeBlocks != 5 {
		t.Errorf("potential loads %s, want 5 potential decode blocks", r.body)
	}
}

// TestSessionMemoryIsPerNamespace: a routing group partitions state
// (docs/compat.md, Namespaces), its sessions too. Group red's session "s"
// left group blue's session "s" its rank when the memory was keyed by the
// session id alone: blue's next tie went elsewhere.
func TestSessionMemoryIsPerNamespace(t *testing.T) {
	n := startNode(t)
	for _, g := range []string{"blue", "red"} {
		for _, id := range []uint64{1, 2} {
			mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: id, ModelName: "llama",
				RoutingGroup: g, Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
		}
	}
	blue := SelectRequest{ModelName: "llama", RoutingGroup: "blue", BlockHashes: promptHashes(), ISLTokens: 12}
	x := selectOn(t, n, "/selection/select", blue).WorkerID
	y := 3 - x
	post := func(evs ...Event) {
		mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: y, ModelName: "llama", RoutingGroup: "blue",
			Events: evs}), 200, "events")
	}
	post(stored(1, 0, "", 0, 1))
	blue.SessionID = "s"
	if got := selectOn(t, n, "/selection/select", blue).WorkerID; got != y {
		t.Fatalf("cached worker %d not chosen: %d", y, got)
	}
	post(Event{DPRank: 0, EventID: 2, Type: "removed", BlockHashes: []Hash{1000}})
	// Group red's session of the same name, given the rank of another prompt.
	selectOn(t, n, "/selection/select", SelectRequest{ModelName: "llama", RoutingGroup: "red", BlockHashes: []Hash{77}, ISLTokens: 4, SessionID: "s"})
	if got := selectOn(t, n, "/selection/select", blue).WorkerID; got != y {
		t.Errorf("group blue's session \"s\" lost its rank (worker %d) to group red's session \"s\": chose %d", y, got)
	}
}

// TestSessionMemoryKeepsTheLastAnswered: docs/compat.md, "each node
// remembers the last 65,536 sessions it answered". A session answered
// again is one of the last answered, and outlives the sessions answered
// before its latest answer; it was forgotten by its first answer.
func TestSessionMemoryKeepsTheLastAnswered(t *testing.T) {
	s := NewSelection(nil, quiet)
	key := func(id string) sessionKey { return sessionKey{model: "llama", group: DefaultTenant, id: id} }
	rk := func(w uint64) kvevent.Rank { return kvevent.Rank{Worker: w} }
	s.remember(key("chat"), rk(1))
	for i := range maxSessions - 1 {
		s.remember(key(fmt.Sprintf("s%d", i)), rk(2))
	}
	s.remember(key("chat"), rk(1)) // answered again: the most recent now
	s.remember(key("new"), rk(2))  // one more session: the oldest, s0, goes
	if got, ok := s.session(key("chat")); !ok || got != rk(1) {
		t.Errorf("session \"chat\", answered second to last, is %v (%v), want worker 1", got, ok)
	}
	if _, ok := s.session(key("s0")); ok {
		t.Errorf("session s0, the least recently answered of %d, is still remembered", maxSessions+1)
	}
}

// TestSessionMemoryIsBounded: with room for 3 sessions, a fourth forgets
// the least recently answered, and the memory never holds more than 3.
func TestSessionMemoryIsBounded(t *testing.T) {
	s := NewSelection(nil, quiet)
	s.sessCap = 3
	key := func(id string) sessionKey { return sessionKey{model: "m", group: DefaultTenant, id: id} }
	for i, id := range []string{"a", "b", "c", "a", "d", "e", "a", "f"} {
		s.remember(key(id), kvevent.Rank{Worker: uint64(i)})
		if len(s.sessions) > 3 {
			t.Fatalf("after %d answers %d sessions are remembered, at most 3 wanted", i+1, len(s.sessions))
		}
	}
	// Answer order a b c a d e a f: the last three distinct are f, a, e.
	for id, want := range map[string]bool{"a": true, "b": false, "c": false, "d": false, "e": true, "f": true} {
		if _, ok := s.session(key(id)); ok != want {
			t.Errorf("session %q remembered %v, want %v", id, ok, want)
		}
	}
	if rk, _ := s.session(key("a")); rk.Worker != 6 {
		t.Errorf("session a's rank is worker %d, want its last answer's, 6", rk.Worker)
	}
}

// TestPotentialLoadsDeriveWhatSelectDerives: /potential_loads reports the
// figures /select scores with. Given the prompt's block_hashes and neither
// sequence_hashes nor isl_tokens, /select derives both (the blocks'
// sequence hashes; isl = blocks × block size), so an idle rank's potential
// decode blocks are the prompt's 3 blocks and its potential prefill its 12
// tokens; /potential_loads answered 0 and 0.
func TestPotentialLoadsDeriveWhatSelectDerives(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	r := n.do(t, codecJSON, "POST", "/selection/potential_loads", PotentialLoadsRequest{ModelName: "llama",
		BlockHashes: promptHashes()})
	mustCode(t, r, 200, "potential")
	var pl []RankLoad
	if err := json.Unmarshal(r.body, &pl); err != nil || len(pl) != 1 {
		t.Fatalf("%s %v", r.body, err)
	}
	if *pl[0].PotentialDecodeBlocks != 3 || *pl[0].PotentialPrefillToks != 12 {
		t.Errorf("idle rank, prompt of 3 blocks of 4: potential_decode_blocks %d, potential_prefill_tokens %d; want 3 and 12 as /select scores",
			*pl[0].PotentialDecodeBlocks, *pl[0].PotentialPrefillToks)
	}
}

// TestReservationOfAnInstancesInternalIDIs404: from a review. A
// reservation's worker_id falls back to a /v1 worker's own id (a worker
// registered without a tenant is its own instance in the default group),
// but took any worker id of the namespace: the internal id of instance 5
// (WorkerID(5, llama, default)), which names no instance, booked on
// instance 5 (201) where docs/compat.md says 404. Only a /v1 worker's id
// is a fallback now; a /v1 worker is still reserved on by its id.
func TestReservationOfAnInstancesInternalIDIs404(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 5, Endpoint: "tcp://10.0.0.1:5557",
		ModelName: "llama", BlockSize: 4, Agentless: ptr(false)}), 201, "register")
	internal := WorkerID(5, "llama", DefaultTenant)
	r := n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r1", ModelName: "llama",
		WorkerID: internal, SequenceHashes: []Hash{1}, ISLTokens: 4})
	if r.code != http.StatusNotFound {
		t.Errorf("a reservation for worker_id %d (instance 5's internal id): %d %s, want 404", internal, r.code, r.body)
	}
	if l := loadOf(t, n, "llama", 5, 0); l.ActiveRequests != 0 {
		t.Errorf("the refused reservation booked on instance 5: %+v", l)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r2", ModelName: "llama",
		WorkerID: 5, SequenceHashes: []Hash{1}, ISLTokens: 4}), 201, "a reservation for instance 5")
	if err := n.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 9, BlockSize: 4, Model: "llama"}); err != nil {
		t.Fatal(err)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/reservations", ReservationRequest{ReservationID: "r3", ModelName: "llama",
		WorkerID: 9, SequenceHashes: []Hash{1}, ISLTokens: 4}), 201, "a reservation for /v1 worker 9")
}

// TestPotentialLoadsCountWhatSelectCountsInTheTieredView: from a review.
// /potential_loads' potential_prefill_tokens are the figures /select
// scores with (docs/compat.md), but it looked the prompt up in the dedup
// view whatever the cluster's: under the tiered view, a prompt whose
// first block a rank holds on the host and its second on the device only
// matched 2 blocks there and 1 in /select (its effective_prefill_tokens).
// Both count in the cluster's view now.
func TestPotentialLoadsCountWhatSelectCountsInTheTieredView(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: 1, ModelName: "llama",
		Endpoint: "http://h:1", BlockSize: 4}), 201, "add")
	mustCode(t, n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: 1, ModelName: "llama",
		Events: []Event{stored(1, 0, "CPU", 0, 1), stored(2, 0, "GPU", 1, 2)}}), 200, "events")
	figures := func() (selected, potential int) {
		t.Helper()
		s := selectOn(t, n, "/selection/select", SelectRequest{ModelName: "llama", BlockHashes: promptHashes(), ISLTokens: 12})
		r := n.do(t, codecJSON, "POST", "/selection/potential_loads", PotentialLoadsRequest{ModelName: "llama",
			BlockHashes: promptHashes(), ISLTokens: 12})
		mustCode(t, r, 200, "potential loads")
		var pl []RankLoad
		if err := json.Unmarshal(r.body, &pl); err != nil {
			t.Fatal(err)
		}
		if len(pl) != 1 || pl[0].PotentialPrefillToks == nil {
			t.Fatalf("potential loads %s, want one rank", r.body)
		}
		return s.EffectivePrefillTokens, int(*pl[0].PotentialPrefillToks)
	}
	// The dedup view (the default): both blocks, 12 - 8.
	if s, p := figures(); s != 4 || p != 4 {
		t.Errorf("dedup view: /select's effective prefill %d, /potential_loads' %d, want 4 and 4", s, p)
	}
	if err := n.node.SetSettings(context.Background(), raftfsm.Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered}); err != nil {
		t.Fatal(err)
	}
	// The tiered view: the host block, then no host block after it: 12 - 4.
	if s, p := figures(); s != 8 || p != 8 {
		t.Errorf("tiered view: /select's effective prefill %d, /potential_loads' %d, want 8 and 8", s, p)
	}
}

// TestShortPromptSelectKeepsToOneRank: a prompt shorter than one block
// keys its rendezvous tie-break on its tokens' hash
// (raftfsm.RendezvousKey), through /selection/select too, which hashes
// token_ids itself: one such prompt on idle (tied) workers keeps to one
// worker, and different ones spread over them. From a review: the route
// saw only the empty block hashes and a selection id drawn at random per
// call, and the same short prompt went to another worker nearly every
// time.
func TestShortPromptSelectKeepsToOneRank(t *testing.T) {
	n := fourIdleWorkers(t)
	selectWorker := func(tokens []uint32) uint64 {
		t.Helper()
		r := n.do(t, codecJSON, "POST", "/selection/select", SelectRequest{ModelName: "m", TokenIDs: tokens})
		var sr SelectResponse
		if err := json.Unmarshal(r.body, &sr); err != nil || r.code != http.StatusOK {
			t.Fatalf("%d %s %v", r.code, r.body, err)
		}
		return sr.WorkerID
	}
	one := map[uint64]int{}
	for range 20 {
		one[selectWorker([]uint32{7, 8, 9})]++
	}
	if len(one) != 1 {
		t.Errorf("one 3-token prompt (block size 4), selected 20 times on idle workers, went to workers %v; want one worker", one)
	}
	many := map[uint64]int{}
	for p := range uint32(20) {
		many[selectWorker([]uint32{1000*p + 1, 1000*p + 2})]++
	}
	if len(many) < 2 {
		t.Errorf("20 short prompts on idle workers went to workers %v; want them spread", many)
	}
}

// fourIdleWorkers starts a node with workers 1 to 4 of model m, block
// size 4, registered through the selection API.
func fourIdleWorkers(t *testing.T) *testNode {
	t.Helper()
	n := startNode(t)
	for id := uint64(1); id <= 4; id++ {
		r := n.do(t, codecJSON, "POST", "/selection/workers", CatalogWorker{WorkerID: id, ModelName: "m", BlockSize: 4})
		if r.code != http.StatusCreated {
			t.Fatalf("%d %s", r.code, r.body)
		}
	}
	return n
}
