package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/netproxy"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// pair is a leader and a follower that knows it.
func pair(t *testing.T, opts api.Options) (leader, follower *node) {
	t.Helper()
	leader = newNode(t, "n1", opts)
	follower = newNode(t, "n2", opts)
	follower.fake.SetFollower("n1", leader.addr())
	return leader, follower
}

func TestFollowerForwardsWritesToTheLeader(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	withWorkers(t, leader)
	cases := []struct {
		method, path, body string
		backend            string // the backend method the write lands in
		code               int
	}{
		{"POST", "/v1/workers", `{"worker_id":7,"block_size":4}`, "RegisterWorker", 204},
		{"POST", "/v1/events", events(storedEv, removedEv), "IngestEvents", 200},
		{"POST", "/v1/ranks/1/1/dump", `{"cursor":9,"events":[` + storedEv + `]}`, "ReplaceRank", 200},
		{"POST", "/v1/route", `{"token_ids":[1,2,3,4],"book":true,"request_id":"r-9"}`, "Route", 200},
		{"POST", "/v1/requests/r-9/prefill_done", "", "PrefillDone", 204},
		{"DELETE", "/v1/requests/r-9", "", "Free", 204},
		{"PUT", "/v1/settings", `{"view":"tiered"}`, "SetSettings", 204},
		{"POST", "/v1/cluster/members", `{"id":"n3","raft_addr":"h3:7946","http_addr":"h3:7080"}`, "AddMember", 204},
		{"POST", "/v1/cluster/leader/transfer", `{"to":"n3"}`, "TransferLeadership", 204},
		{"DELETE", "/v1/cluster/members/n3", "", "RemoveMember", 204},
		{"DELETE", "/v1/workers/7", "", "DeregisterWorker", 204},
	}
	for _, tc := range cases {
		before := leader.fake.Calls()[tc.backend]
		a := send(t, follower.http.URL, tc.method, tc.path, tc.body)
		if a.code != tc.code {
			t.Fatalf("%s %s on the follower: %d %s, want %d from the leader", tc.method, tc.path, a.code, a.body, tc.code)
		}
		if got := a.header.Get(api.HeaderForwardedTo); got != leader.addr() {
			t.Fatalf("%s %s: %s = %q, want the leader %q", tc.method, tc.path, api.HeaderForwardedTo, got, leader.addr())
		}
		if got := leader.fake.Calls()[tc.backend]; got != before+1 {
			t.Fatalf("%s %s: the leader's %s ran %d times, want %d", tc.method, tc.path, tc.backend, got, before+1)
		}
	}
	// The events went through whole: the leader acknowledged both.
	ws := send(t, leader.http.URL, "GET", "/v1/workers", "").json(t)["workers"].([]any)
	rank0 := ws[0].(map[string]any)["ranks"].([]any)[0].(map[string]any)
	if rank0["last_event_id"] != 2.0 {
		t.Fatalf("the leader's rank 1/0 is at event %v, want 2", rank0["last_event_id"])
	}
	if got := counterValue(t, follower.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "sent"}); got != float64(len(cases)) {
		t.Fatalf("forwards counted %v, want %d", got, len(cases))
	}
	if m := leader.fake.Malformed() + follower.fake.Malformed(); m != 0 {
		t.Fatalf("%d malformed arguments reached a backend", m)
	}
}

func TestFollowerAnswersReadsItself(t *testing.T) {
	_, follower := pair(t, api.Options{})
	a := send(t, follower.http.URL, "GET", "/v1/cluster/status", "")
	if a.code != 200 || a.json(t)["id"] != "n2" || a.header.Get(api.HeaderForwardedTo) != "" {
		t.Fatalf("status on the follower: %d %s (forwarded to %q), want its own", a.code, a.body, a.header.Get(api.HeaderForwardedTo))
	}
}

func TestForwardedRequestIsNotForwardedAgain(t *testing.T) {
	// Each believes the other leads: a forward must stop after one hop.
	a, b := newNode(t, "n1", api.Options{}), newNode(t, "n2", api.Options{})
	a.fake.SetFollower("n2", b.addr())
	b.fake.SetFollower("n1", a.addr())
	ans := send(t, a.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
	if ans.code != 503 || ans.reason(t) != api.ReasonNoLeader {
		t.Fatalf("a forwarding loop: %d %s, want 503 no_leader", ans.code, ans.body)
	}
	if got := a.fake.Calls()["RegisterWorker"] + b.fake.Calls()["RegisterWorker"]; got != 2 {
		t.Fatalf("RegisterWorker ran %d times, want 2 (one hop)", got)
	}
	if got := counterValue(t, b.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "loop"}); got != 1 {
		t.Fatalf("loops counted %v, want 1", got)
	}
}

func TestForwardToUnreachableLeaderIs503(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	n := newNode(t, "n2", api.Options{})
	n.fake.SetFollower("n1", dead)
	a := send(t, n.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
	if a.code != 503 || a.reason(t) != api.ReasonNoLeader || !strings.Contains(a.json(t)["error"].(string), dead) {
		t.Fatalf("leader down: %d %s, want 503 no_leader naming %s", a.code, a.body, dead)
	}
	if got := counterValue(t, n.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "failed"}); got != 1 {
		t.Fatalf("failed forwards counted %v, want 1", got)
	}
	// The forward never reached a leader: the write did not apply.
	if a.header.Get(api.HeaderMaybeApplied) != "" {
		t.Fatalf("a forward that failed to dial says %s", api.HeaderMaybeApplied)
	}
}

// TestRouteAnsweredByAFollowerCountsAsError: a route a follower answers
// itself, because its forward to the leader failed or was refused (a
// forward loop), counts outcome error there; one whose forward is sent is
// counted on the leader. From a review: the follower counted none of them
// ("forwarded, and counted there"), so a route answered 5xx was counted
// by no node.
func TestRouteAnsweredByAFollowerCountsAsError(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	total := func() float64 { return counterValue(t, n.reg, "kvrouter_route_requests_total", nil) }
	n.fake.SetHook(func(method string) error {
		if method == "Route" {
			// a leader is named, but it cannot be reached (it just died)
			return &raftfsm.NotLeaderError{LeaderID: "n2", LeaderHTTP: "127.0.0.1:1"}
		}
		return nil
	})
	before := total()
	a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"model":"llama","book":true,"request_id":"r1"}`)
	if a.code < 500 {
		t.Fatalf("route with an unreachable leader: %d %s, want a 5xx", a.code, a.body)
	}
	a = send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"model":"llama","book":true,"request_id":"r2"}`,
		api.HeaderForwarded, "n2")
	if a.code != 503 {
		t.Fatalf("forward loop: %d %s, want 503", a.code, a.body)
	}
	if got := total() - before; got != 2 {
		t.Errorf("kvrouter_route_requests_total rose by %v for 2 route requests this node answered 5xx (forward failed, forward loop), want 2", got)
	}
	if got := counterValue(t, n.reg, "kvrouter_route_requests_total", map[string]string{"model": "llama", "outcome": "error"}); got != 2 {
		t.Errorf("llama errors %v, want 2", got)
	}
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"route": "POST /v1/route"}); got != 2 {
		t.Errorf("http route requests %v, want 2", got)
	}
}

// TestForwardedRouteIsTimedOnlyOnTheLeader: a route a follower forwards is
// decided, timed and counted on the leader; the follower observes none of
// kvrouter_route_duration_seconds' stages for it. From a review: the
// follower observed decode and backend, so that its backend histogram
// took the time to learn it does not lead for a decision's.
func TestForwardedRouteIsTimedOnlyOnTheLeader(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	withWorkers(t, leader)
	follower.fake.SetHook(func(method string) error {
		if method == "Route" {
			return &raftfsm.NotLeaderError{LeaderID: "n1", LeaderHTTP: leader.addr()}
		}
		return nil
	})
	a := send(t, follower.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"book":true,"request_id":"r-1"}`)
	if a.code != 200 {
		t.Fatalf("forwarded route: %d %s", a.code, a.body)
	}
	if got := counterValue(t, follower.reg, "kvrouter_route_requests_total", nil); got != 0 {
		t.Errorf("follower counted %v routes, want 0 (the leader counts the one it decided)", got)
	}
	for _, stage := range []string{"decode", "backend"} {
		if got := histogramCount(t, follower.reg, "kvrouter_route_duration_seconds", map[string]string{"stage": stage}); got != 0 {
			t.Errorf("follower timed stage %s %d times, want 0 (the leader decided the route)", stage, got)
		}
		if got := histogramCount(t, leader.reg, "kvrouter_route_duration_seconds", map[string]string{"stage": stage}); got != 1 {
			t.Errorf("leader timed stage %s %d times, want 1", stage, got)
		}
	}
}

// TestForwardToAWildcardLeaderAddressIsNotSent: a leader listed at a
// wildcard HTTP address (0.0.0.0:7080, from a member table written before
// kvrouter refused one) is not forwarded to: a dial of it reaches the
// forwarding node's own host, the follower itself when it listens on that
// port. The answer says what to fix. From a review: the follower
// forwarded to itself, and its loop guard answered 503 no_leader for ever
// without a word about the address.
func TestForwardToAWildcardLeaderAddressIsNotSent(t *testing.T) {
	for _, host := range []string{"0.0.0.0", "[::]"} {
		follower := newNode(t, "n2", api.Options{})
		_, port, _ := net.SplitHostPort(follower.addr())
		follower.fake.SetFollower("n1", host+":"+port)
		a := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
		if a.code != 503 || a.reason(t) != api.ReasonNoLeader || !strings.Contains(a.json(t)["error"].(string), "--http-advertise") {
			t.Fatalf("leader at %s:%s: %d %s, want 503 no_leader naming --http-advertise", host, port, a.code, a.body)
		}
		if got := follower.fake.Calls()["RegisterWorker"]; got != 1 {
			t.Fatalf("RegisterWorker ran %d times on the follower, want 1: the forward reached the follower itself", got)
		}
		if got := counterValue(t, follower.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "loop"}); got != 0 {
			t.Fatalf("loops counted %v: the forward reached the follower itself", got)
		}
	}
}

// TestForwardBrokenAfterItLeftSaysTheWriteMayHaveApplied: a forward that
// broke once the leader had the request (it hung up without answering)
// is 503 no_leader with HeaderMaybeApplied, which keeps a client from
// sending a write that is not safe twice on to another node.
func TestForwardBrokenAfterItLeftSaysTheWriteMayHaveApplied(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = conn.Read(make([]byte, 4096))
			conn.Close()
		}
	}()
	n := newNode(t, "n2", api.Options{})
	n.fake.SetFollower("n1", ln.Addr().String())
	a := send(t, n.http.URL, "POST", "/v1/cluster/leader/transfer", `{}`)
	if a.code != 503 || a.reason(t) != api.ReasonNoLeader || a.header.Get(api.HeaderMaybeApplied) != "true" {
		t.Fatalf("a forward the leader took and hung up on: %d %s, %s %q; want 503 no_leader saying it may have applied",
			a.code, a.body, api.HeaderMaybeApplied, a.header.Get(api.HeaderMaybeApplied))
	}
}

// TestAWriteNotSafeTwiceIsNotForwardedWhenItMayApply: a node that lost
// its leadership with a write not safe twice in its log (the next leader
// may commit it) answers 503 no_leader saying it may have applied, and
// does not forward it to the new leader; any other write is forwarded.
// From a review: a worker's deregistration was forwarded, and the new
// leader, having committed the first, answered 404 unknown_worker.
func TestAWriteNotSafeTwiceIsNotForwardedWhenItMayApply(t *testing.T) {
	n1, n2 := newNode(t, "n1", api.Options{}), newNode(t, "n2", api.Options{})
	withWorkers(t, n2)
	n1.fake.SetHook(func(string) error {
		return &raftfsm.NotLeaderError{LeaderID: "n2", LeaderHTTP: n2.addr(), MaybeApplied: true}
	})
	cases := []struct {
		method, path, body, backend string
		once                        bool
	}{
		{"DELETE", "/v1/workers/1", "", "DeregisterWorker", true},
		{"DELETE", "/v1/cluster/members/n3", "", "RemoveMember", true},
		{"POST", "/v1/cluster/leader/transfer", `{}`, "TransferLeadership", true},
		{"POST", "/v1/workers", `{"worker_id":7,"block_size":4}`, "RegisterWorker", false},
	}
	for _, tc := range cases {
		a := send(t, n1.http.URL, tc.method, tc.path, tc.body)
		forwarded := n2.fake.Calls()[tc.backend] != 0
		if !tc.once {
			if !forwarded || a.header.Get(api.HeaderMaybeApplied) != "" {
				t.Errorf("%s %s: %d %s, forwarded %v; want it forwarded to the new leader", tc.method, tc.path, a.code, a.body, forwarded)
			}
			continue
		}
		if forwarded || a.code != 503 || a.reason(t) != api.ReasonNoLeader || a.header.Get(api.HeaderMaybeApplied) != "true" {
			t.Errorf("%s %s: %d %s, %s %q, forwarded %v; want 503 no_leader saying it may have applied, not forwarded",
				tc.method, tc.path, a.code, a.body, api.HeaderMaybeApplied, a.header.Get(api.HeaderMaybeApplied), forwarded)
		}
	}
}

// TestHandleFuncOnceIsNotForwardedWhenItMayApply: a route another API
// registers with HandleFuncOnce is answered as the API's own writes not
// safe twice are when its write may have applied: 503 no_leader with
// HeaderMaybeApplied, not forwarded; a HandleFunc route is forwarded.
// From a review: the compatible APIs' removals (POST /unregister, DELETE
// /selection/workers/{id}, DELETE /selection/reservations/{id}),
// registered through HandleFunc, had no way to say so; they were
// forwarded, and the new leader answered 404 for a removal that applied.
func TestHandleFuncOnceIsNotForwardedWhenItMayApply(t *testing.T) {
	n1, n2 := newNode(t, "n1", api.Options{}), newNode(t, "n2", api.Options{})
	var mu sync.Mutex
	reached := map[string]int{} // on n2, the new leader
	for _, path := range []string{"/x/once/{id}", "/x/twice/{id}"} {
		n2h := func(w http.ResponseWriter, r *http.Request) error {
			mu.Lock()
			reached[r.Pattern]++
			mu.Unlock()
			w.WriteHeader(http.StatusNoContent)
			return nil
		}
		n1h := func(http.ResponseWriter, *http.Request) error {
			return &raftfsm.NotLeaderError{LeaderID: "n2", LeaderHTTP: n2.addr(), MaybeApplied: true}
		}
		if path == "/x/once/{id}" {
			n1.api.HandleFuncOnce("DELETE "+path, n1h)
			n2.api.HandleFuncOnce("DELETE "+path, n2h)
		} else {
			n1.api.HandleFunc("DELETE "+path, n1h)
			n2.api.HandleFunc("DELETE "+path, n2h)
		}
	}
	a := send(t, n1.http.URL, "DELETE", "/x/once/1", "")
	mu.Lock()
	forwarded := reached["DELETE /x/once/{id}"] != 0
	mu.Unlock()
	if forwarded || a.code != 503 || a.reason(t) != api.ReasonNoLeader || a.header.Get(api.HeaderMaybeApplied) != "true" {
		t.Errorf("HandleFuncOnce route: %d %s, %s %q, forwarded %v; want 503 no_leader saying it may have applied, not forwarded",
			a.code, a.body, api.HeaderMaybeApplied, a.header.Get(api.HeaderMaybeApplied), forwarded)
	}
	a = send(t, n1.http.URL, "DELETE", "/x/twice/1", "")
	mu.Lock()
	forwarded = reached["DELETE /x/twice/{id}"] != 0
	mu.Unlock()
	if !forwarded || a.code != http.StatusNoContent || a.header.Get(api.HeaderMaybeApplied) != "" {
		t.Errorf("HandleFunc route: %d %s, forwarded %v; want it forwarded to the new leader", a.code, a.body, forwarded)
	}
}

// TestForwardDropsIdempotencyKeys: a client's Idempotency-Key or
// X-Idempotency-Key does not reach the leader through a forward. From a
// review: with either header Go's transport takes a body-less request
// for safe to replay and sends it again on a new connection when a
// reused one broke, a second apply of a write such as a member removal;
// the forward decides about retries itself.
func TestForwardDropsIdempotencyKeys(t *testing.T) {
	leader := newNode(t, "n1", api.Options{})
	withWorkers(t, leader)
	seen := make(chan http.Header, 4)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		leader.api.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	follower := newNode(t, "n2", api.Options{})
	follower.fake.SetFollower("n1", strings.TrimPrefix(front.URL, "http://"))
	for _, tc := range []struct{ method, path, body string }{
		{"DELETE", "/v1/workers/1", ""},
		{"POST", "/v1/requests/r-1/prefill_done", ""},
		{"POST", "/v1/workers", `{"worker_id":7,"block_size":4}`},
	} {
		a := send(t, follower.http.URL, tc.method, tc.path, tc.body, "Idempotency-Key", "k1", "X-Idempotency-Key", "k2")
		if a.header.Get(api.HeaderForwardedTo) == "" {
			t.Fatalf("%s %s: not forwarded: %d %s", tc.method, tc.path, a.code, a.body)
		}
		h := <-seen
		if _, ok := h["Idempotency-Key"]; ok {
			t.Errorf("%s %s: the leader got Idempotency-Key %q", tc.method, tc.path, h.Get("Idempotency-Key"))
		}
		if _, ok := h["X-Idempotency-Key"]; ok {
			t.Errorf("%s %s: the leader got X-Idempotency-Key %q", tc.method, tc.path, h.Get("X-Idempotency-Key"))
		}
	}
}

// TestRestoreForwardBrokenMidUploadSaysNothingApplied: a forwarded
// restore whose leader hung up before the follower relayed the whole
// upload installed nothing (a leader installs only a whole stream): the
// answer is a plain 503 no_leader, without HeaderMaybeApplied, and the
// client may send the restore to another node. One whose leader hung up
// after the whole upload went out may be installed: HeaderMaybeApplied.
// From a review: both said the restore may apply, and the client gave up
// with ErrOutcomeUnknown on a restore no node could have installed.
func TestRestoreForwardBrokenMidUploadSaysNothingApplied(t *testing.T) {
	for _, whole := range []bool{false, true} {
		leader := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if whole {
				_, _ = io.Copy(io.Discard, r.Body)
			} else {
				_, _ = io.ReadFull(r.Body, make([]byte, 1024))
			}
			panic(http.ErrAbortHandler) // the leader dies without answering
		}))
		follower := newNode(t, "n2", api.Options{})
		follower.fake.SetFollower("n1", strings.TrimPrefix(leader.URL, "http://"))
		// A chunked upload of 64 KiB, or (not whole) one that goes on
		// until the answer came: the follower cannot have relayed all of
		// it.
		pr, pw := io.Pipe()
		go func() {
			chunk := make([]byte, 64<<10)
			for {
				if _, err := pw.Write(chunk); err != nil || whole {
					break
				}
			}
			pw.Close()
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		req, err := http.NewRequestWithContext(ctx, "POST", follower.http.URL+"/v1/snapshot/restore", pr)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("whole %v: %v", whole, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		pw.CloseWithError(errors.New("the test is done"))
		cancel()
		leader.Close()
		if resp.StatusCode != 503 || !strings.Contains(string(body), api.ReasonNoLeader) {
			t.Fatalf("whole %v: %d %s, want 503 no_leader", whole, resp.StatusCode, body)
		}
		if got := resp.Header.Get(api.HeaderMaybeApplied) == "true"; got != whole {
			t.Fatalf("a restore forward that broke with the upload relayed whole %v: %s %v, want %v (%s)",
				whole, api.HeaderMaybeApplied, got, whole, body)
		}
	}
}

func TestWriteWithNoLeaderKnownIs503(t *testing.T) {
	n := newNode(t, "n2", api.Options{})
	n.fake.SetFollower("", "")
	a := send(t, n.http.URL, "DELETE", "/v1/requests/r1", "")
	if a.code != 503 || a.reason(t) != api.ReasonNoLeader {
		t.Fatalf("no leader: %d %s, want 503 no_leader", a.code, a.body)
	}
}

func TestForwardGivesUpAtItsDeadline(t *testing.T) {
	release := make(chan struct{})
	leader, follower := pair(t, api.Options{ForwardTimeout: 50 * time.Millisecond})
	defer close(release) // before the servers close: their handlers must end
	leader.fake.SetHook(func(m string) error {
		if m == "RegisterWorker" {
			<-release
		}
		return nil
	})
	a := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
	if a.code != 503 || a.reason(t) != api.ReasonTimeout {
		t.Fatalf("a leader slower than the forward timeout: %d %s, want 503 timeout", a.code, a.body)
	}
	// The leader has the request: it may apply it.
	if a.header.Get(api.HeaderMaybeApplied) != "true" {
		t.Fatalf("a forward that timed out once the leader had it: %s %q, want true", api.HeaderMaybeApplied, a.header.Get(api.HeaderMaybeApplied))
	}
}

// TestSnapshotForwardsOutlastTheForwardTimeout: a snapshot's download and
// upload through a follower stream for as long as they take, bounded by
// their client only, not by the forward timeout (a forward timeout so
// short that any forward bound by it fails).
func TestSnapshotForwardsOutlastTheForwardTimeout(t *testing.T) {
	leader, follower := pair(t, api.Options{ForwardTimeout: time.Nanosecond})
	withWorkers(t, leader)
	if a := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`); a.code != 503 || a.reason(t) != api.ReasonNoLeader {
		t.Fatalf("setup: a write forwarded under a 1 ns forward timeout: %d %s, want 503 no_leader", a.code, a.body)
	}
	if a := send(t, follower.http.URL, "GET", "/v1/snapshot", ""); a.code != 200 {
		t.Errorf("a snapshot through a follower whose forward timeout is 1 ns: %d %s, want 200", a.code, a.body)
	}
	snap := send(t, leader.http.URL, "GET", "/v1/snapshot", "")
	if a := send(t, follower.http.URL, "POST", "/v1/snapshot/restore", string(snap.body)); a.code != 200 || leader.fake.Restores() != 1 {
		t.Errorf("a restore through a follower whose forward timeout is 1 ns: %d %s, leader restores %d; want 200, 1", a.code, a.body, leader.fake.Restores())
	}
}

func TestSnapshotStreamsThroughAFollower(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	withWorkers(t, leader)
	resp, err := http.Get(follower.http.URL + "/v1/snapshot")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("snapshot via the follower: %d %s", resp.StatusCode, data)
	}
	info, err := apitest.InspectSnapshot(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("the forwarded stream does not verify: %v", err)
	}
	if got := resp.Trailer.Get(api.TrailerSnapshotIndex); got != strconv.FormatUint(info.Index, 10) {
		t.Fatalf("index trailer = %q, want %d", got, info.Index)
	}
	if got := resp.Trailer.Get(api.TrailerSnapshotSHA256); got != info.SHA256 {
		t.Fatalf("sha256 trailer = %q, want %q", got, info.SHA256)
	}
	if got := resp.Trailer.Get(api.TrailerSnapshotBytes); got != strconv.Itoa(len(data)) {
		t.Fatalf("bytes trailer = %q, want %d", got, len(data))
	}

	// And the upload goes the other way.
	a := send(t, follower.http.URL, "POST", "/v1/snapshot/restore", string(data))
	if a.code != 200 || leader.fake.Restores() != 1 {
		t.Fatalf("restore via the follower: %d %s, leader restores %d", a.code, a.body, leader.fake.Restores())
	}
	if got := a.json(t)["index"]; got != float64(info.Index) {
		t.Fatalf("restored index %v, want %d", got, info.Index)
	}
}

func TestSnapshotFailingMidStreamSetsTheErrorTrailer(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	n.fake.FailSnapshotAfter(128)
	resp, err := http.Get(n.http.URL + "/v1/snapshot")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || len(data) != 128 {
		t.Fatalf("status %d with %d bytes, want 200 and the 128 bytes sent before the failure", resp.StatusCode, len(data))
	}
	if msg := resp.Trailer.Get(api.TrailerError); !strings.Contains(msg, "disk read failed") {
		t.Fatalf("error trailer = %q, want the failure", msg)
	}
	if got := resp.Trailer.Get(api.TrailerSnapshotIndex); got != "" {
		t.Fatalf("a failed stream announces index %q", got)
	}
}

// panicsMidSnapshot is a backend whose snapshot stream panics after its
// first 64 KiB (a bug, a storage library's panic on a corrupt block):
// more than the server buffers, so that its status is on the wire.
type panicsMidSnapshot struct{ *apitest.Fake }

func (p panicsMidSnapshot) SaveSnapshot(ctx context.Context, w io.Writer) (raftfsm.SnapshotInfo, error) {
	_, _ = w.Write(bytes.Repeat([]byte{'x'}, 64<<10))
	panic("corrupt block")
}

// TestASnapshotStreamThatPanicsHalfWayIsCutOff: a handler that panics
// after its status went out (a snapshot stream half-way) is logged, counted
// and its answer aborted: the client reads a broken stream, not a whole
// one. From a review: the middleware's recover wrote nothing more once the
// status was out, and the chunked stream ended cleanly without trailers,
// which the client took for a whole snapshot of 64 KiB.
func TestASnapshotStreamThatPanicsHalfWayIsCutOff(t *testing.T) {
	var logs logSink
	reg := prometheus.NewRegistry()
	s := api.NewServer(panicsMidSnapshot{apitest.New("n1", "")},
		api.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil)), Registerer: reg, Gatherer: reg})
	hs := httptest.NewServer(s)
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	resp, err := http.Get(hs.URL + "/v1/snapshot")
	if err != nil {
		t.Fatalf("%v; want a 200 whose stream breaks off", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || err == nil {
		t.Fatalf("status %d, %d bytes read, err %v (trailers %v); want 200 and a stream that breaks off", resp.StatusCode, len(data), err, resp.Trailer)
	}
	if l := logs.String(); !strings.Contains(l, "api handler panicked") || !strings.Contains(l, "corrupt block") {
		t.Fatalf("the panic was not logged:\n%s", l)
	}
	if got := counterValue(t, reg, "kvrouter_http_requests_total", map[string]string{"route": "GET /v1/snapshot"}); got != 1 {
		t.Fatalf("the aborted download counted %v times, want once", got)
	}
}

// TestForwardBrokenMidAnswerIsCountedFailed: a forwarded snapshot
// download whose leader connection breaks after the answer started (the
// proxy aborts the response with http.ErrAbortHandler) is counted in
// kvrouter_http_forwards_total as failed. From a review: the panic skipped
// the count, and such a forward was neither sent nor failed.
func TestForwardBrokenMidAnswerIsCountedFailed(t *testing.T) {
	leader := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.WriteHeader(200)
		_, _ = w.Write([]byte(strings.Repeat("x", 1000)))
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler) // the leader dies mid-stream
	}))
	t.Cleanup(leader.Close)
	var logs logSink
	follower := newNode(t, "n2", api.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	follower.fake.SetFollower("n1", strings.TrimPrefix(leader.URL, "http://"))
	resp, err := http.Get(follower.http.URL + "/v1/snapshot")
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	if err == nil {
		t.Fatalf("a download whose leader broke off half-way read whole")
	}
	want := map[string]float64{"sent": 0, "failed": 1}
	for outcome, n := range want {
		if got := counterValue(t, follower.reg, "kvrouter_http_forwards_total", map[string]string{"outcome": outcome}); got != n {
			t.Fatalf("a forward that broke mid-answer counted %v %s, want %v (sent 0, failed 1)", got, outcome, n)
		}
	}
	if l := logs.String(); !strings.Contains(l, "api forward to the leader failed") {
		t.Fatalf("a forward that broke mid-answer logged no warning:\n%s", l)
	}
}

// logSink is a log destination that tests read while servers write it.
type logSink struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logSink) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func TestRestoreRefusesACorruptSnapshot(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	var buf bytes.Buffer
	if _, err := n.fake.SaveSnapshot(context.Background(), &buf); err != nil {
		t.Fatal(err)
	}
	data := buf.Bytes()
	for name, bad := range map[string][]byte{
		"truncated": data[:len(data)/2],
		"flipped":   append(append([]byte{}, data[:40]...), append([]byte{data[40] ^ 1}, data[41:]...)...),
		"empty":     nil,
	} {
		a := send(t, n.http.URL, "POST", "/v1/snapshot/restore", string(bad))
		if a.code != 400 || a.reason(t) != api.ReasonBadSnapshot {
			t.Fatalf("%s snapshot: %d %s, want 400 bad_snapshot", name, a.code, a.body)
		}
	}
	if n.fake.Restores() != 0 {
		t.Fatal("a bad snapshot was installed")
	}
}

// TestSnapshotHeadTakesNoSnapshot: a HEAD of /v1/snapshot is answered
// with the headers alone, at the leader and at a follower, and takes no
// snapshot. From a review: it ran a whole SaveSnapshot, forwarded to the
// leader from a follower, and threw the stream away.
func TestSnapshotHeadTakesNoSnapshot(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	for name, n := range map[string]*node{"leader": leader, "follower": follower} {
		a := send(t, n.http.URL, "HEAD", "/v1/snapshot", "")
		if a.code != http.StatusOK || a.header.Get("Content-Type") != "application/octet-stream" || len(a.body) != 0 {
			t.Errorf("HEAD /v1/snapshot at the %s: %d %q %q, want 200 application/octet-stream and no body",
				name, a.code, a.header.Get("Content-Type"), a.body)
		}
	}
	for name, n := range map[string]*node{"leader": leader, "follower": follower} {
		if got := n.fake.Calls()["SaveSnapshot"]; got != 0 {
			t.Errorf("HEAD /v1/snapshot: the %s took %d snapshots, want none", name, got)
		}
	}
}

// TestMalformedChunkedUploadIsBadSnapshot: a snapshot upload whose chunked
// framing is malformed is the client's fault, which sent again fails
// again: 400 bad_snapshot, at the leader and through a follower. From a
// review: the leader answered 500 internal (the body's read error passed
// for the backend's failure), and a follower 503 no_leader, which sends
// the client on to another node.
func TestMalformedChunkedUploadIsBadSnapshot(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	req := "POST /v1/snapshot/restore HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
		"5\r\nKVRSN\r\nzz\r\n" // "zz" is no chunk size
	for name, n := range map[string]*node{"leader": leader, "follower": follower} {
		code, reason, msg := sendRawRequest(t, n, "/v1/snapshot/restore", req, false)
		if code != http.StatusBadRequest || reason != api.ReasonBadSnapshot || !strings.Contains(msg, "framing") {
			t.Errorf("an upload with a malformed chunk size at the %s: %d %s %q, want 400 bad_snapshot naming the framing", name, code, reason, msg)
		}
	}
	if leader.fake.Restores() != 0 {
		t.Fatal("a malformed upload was installed")
	}
}

// greedyFollower reads a whole upload before it finds out that it is not
// the leader.
type greedyFollower struct{ *apitest.Fake }

func (g greedyFollower) RestoreSnapshot(ctx context.Context, r io.Reader) (raftfsm.SnapshotInfo, error) {
	_, _ = io.Copy(io.Discard, r)
	return raftfsm.SnapshotInfo{}, &raftfsm.NotLeaderError{LeaderID: "n1", LeaderHTTP: "127.0.0.1:1"}
}

func TestUploadTooLargeToKeepIsNotForwarded(t *testing.T) {
	fake := apitest.New("n2", "")
	reg := prometheus.NewRegistry()
	s := api.NewServer(greedyFollower{fake}, api.Options{MaxBodyBytes: 1024, Registerer: reg, Gatherer: reg,
		Logger: slog.New(slog.DiscardHandler)})
	defer s.Close()
	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest("POST", "/v1/snapshot/restore", strings.NewReader(strings.Repeat("x", 4096))))
	if rec.Code != 503 || !strings.Contains(rec.Body.String(), "too large to forward") {
		t.Fatalf("an upload the follower could not keep: %d %s, want 503 naming the leader", rec.Code, rec.Body)
	}
	if got := counterValue(t, reg, "kvrouter_http_forwards_total", map[string]string{"outcome": "no_body"}); got != 1 {
		t.Fatalf("unforwardable uploads counted %v, want 1", got)
	}
}

func TestNotLeaderErrorsUnwrap(t *testing.T) {
	// The forwarding keys on these; pin them.
	if !errors.Is(&raftfsm.NotLeaderError{LeaderID: "n1", LeaderHTTP: "h:1"}, raftfsm.ErrNotLeader) ||
		!errors.Is(&raftfsm.NotLeaderError{}, raftfsm.ErrNoLeader) {
		t.Fatal("NotLeaderError does not unwrap as the API expects")
	}
}

// TestOversizedUploadThroughAFollowerIs413: a snapshot upload over the
// follower's MaxSnapshotBytes, forwarded to the leader, is answered 413
// too_large, as at the leader. It was 503 no_leader (the limit stopped
// the forward's transport), which sends a client on to the next node with
// a body no node can take.
func TestOversizedUploadThroughAFollowerIs413(t *testing.T) {
	leader, follower := pair(t, api.Options{MaxSnapshotBytes: 1024})
	for name, n := range map[string]*node{"leader": leader, "follower": follower} {
		a := send(t, n.http.URL, "POST", "/v1/snapshot/restore", strings.Repeat("x", 4096))
		if a.code != http.StatusRequestEntityTooLarge || !strings.Contains(string(a.body), api.ReasonTooLarge) {
			t.Fatalf("an upload of 4096 bytes over a limit of 1024 at the %s: %d %s, want 413 too_large", name, a.code, a.body)
		}
	}
}

// TestForwardOfAClientThatLeftSaysCanceled: a client that goes away during
// a forward is answered (and counted) canceled, not no_leader: the leader
// was not at fault. From a review.
func TestForwardOfAClientThatLeftSaysCanceled(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	leader, follower := pair(t, api.Options{})
	defer close(release)
	leader.fake.SetHook(func(m string) error {
		if m == "RegisterWorker" {
			entered <- struct{}{}
			<-release
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	req := httptest.NewRequest("POST", "/v1/workers", strings.NewReader(`{"worker_id":7,"block_size":4}`)).WithContext(ctx)
	rec := httptest.NewRecorder()
	done := make(chan struct{})
	go func() {
		defer close(done)
		follower.api.ServeHTTP(rec, req)
	}()
	<-entered
	cancel()
	<-done
	var body map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("%v in %q", err, rec.Body)
	}
	if body["reason"] != api.ReasonCanceled {
		t.Fatalf("a client that left during the forward: %d %v, want reason canceled", rec.Code, body)
	}
}

// TestForwardWhoseHeadersNeverLeftSaysNothing: a forward over a
// kept-alive connection to a leader that went away (the headers stay in
// the buffer, the transport's retry fails to dial) reached no leader: no
// HeaderMaybeApplied. From a review of the header.
func TestForwardWhoseHeadersNeverLeftSaysNothing(t *testing.T) {
	leader := newNode(t, "n1", api.Options{})
	dead := netproxy.NewDeadAfterFirst("")
	tr := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(tr.CloseIdleConnections)
	tr.DialContext = dead.DialContext
	follower := newNode(t, "n2", api.Options{ForwardTransport: tr})
	follower.fake.SetFollower("n1", leader.addr())
	if a := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`); a.code != 204 {
		t.Fatalf("warm-up forward: %d %s", a.code, a.body)
	}
	dead.Kill() // the leader goes away
	a := send(t, follower.http.URL, "DELETE", "/v1/cluster/members/n3", "")
	if a.header.Get(api.HeaderMaybeApplied) != "" {
		t.Fatalf("a forward the leader never got a byte of says %s", api.HeaderMaybeApplied)
	}
}

// blackHoleTransport is a forwarding transport whose dials never connect
// (a leader address that drops SYNs: a host gone from the network, a
// stale address after a membership change, a firewall): each dial waits
// for its context.
func blackHoleTransport(t *testing.T) *http.Transport {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

// TestForwardThatNeverConnectedIsNoLeader: a forward whose dial of the
// leader never completed before its deadline sent nothing: the write
// cannot apply, and another node may serve it. It is 503 no_leader
// without HeaderMaybeApplied. From a review: it was 503 timeout ("the
// write may still apply"; Go's dial timeout is a DeadlineExceeded), which
// the client took for an outcome it cannot know: ErrOutcomeUnknown for a
// write not safe twice, and no other endpoint tried for any write.
func TestForwardThatNeverConnectedIsNoLeader(t *testing.T) {
	leader := newNode(t, "n1", api.Options{})
	follower := newNode(t, "n2", api.Options{ForwardTimeout: 100 * time.Millisecond, ForwardTransport: blackHoleTransport(t)})
	follower.fake.SetFollower("n1", leader.addr())
	for _, w := range []struct{ method, path, body string }{
		{"DELETE", "/v1/cluster/members/n3", ""},
		{"POST", "/v1/workers", `{"worker_id":7,"block_size":4}`},
	} {
		a := send(t, follower.http.URL, w.method, w.path, w.body)
		if a.header.Get(api.HeaderMaybeApplied) != "" {
			t.Fatalf("%s %s: a forward that never connected says %s", w.method, w.path, api.HeaderMaybeApplied)
		}
		if a.code != 503 || a.reason(t) != api.ReasonNoLeader {
			t.Errorf("%s %s: a forward that never reached the leader: %d %s; want 503 no_leader (nothing sent, retry elsewhere), not a timeout that says the write may still apply",
				w.method, w.path, a.code, a.body)
		}
	}
	if got := leader.fake.Calls()["RemoveMember"] + leader.fake.Calls()["RegisterWorker"]; got != 0 {
		t.Fatalf("the leader ran %d writes, want none: the forwards never connected", got)
	}
}

// TestForwardToAZonedIPv6LeaderAddress: a follower forwards to a leader
// listed at an IPv6 address with a zone ([::1%lo]:7080, [fe80::1%eth0]:7080),
// which raftfsm.CheckHTTPAddr and the members API take. From a review:
// leaderURL parsed "http://"+addr as a URL, where a zone's % must be
// written %25, and every forward was 503 no_leader "the leader's address
// is unusable".
func TestForwardToAZonedIPv6LeaderAddress(t *testing.T) {
	ln, zone := apitest.LoopbackZone(t)
	leader := newNode(t, "n1", api.Options{})
	hs := httptest.NewUnstartedServer(leader.api)
	hs.Listener.Close()
	hs.Listener = ln
	hs.Start()
	defer hs.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	addr := "[::1%" + zone + "]:" + port
	if err := raftfsm.CheckHTTPAddr(addr); err != nil {
		t.Fatalf("CheckHTTPAddr(%q): %v", addr, err)
	}
	follower := newNode(t, "n2", api.Options{})
	follower.fake.SetFollower("n1", addr)
	a := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
	if a.code != 204 {
		t.Fatalf("forward to a leader at %s: %d %s; want 204 from the leader", addr, a.code, a.body)
	}
	if got := leader.fake.Calls()["RegisterWorker"]; got != 1 {
		t.Fatalf("RegisterWorker ran %d times on the leader, want 1", got)
	}
}

// TestMembersAPITakesNoHTTPAddrFollowersRefuseToForwardTo: an http_addr
// the members API takes is one a follower forwards to once that member
// leads. From a review: a host with a '/', '@', ' ', '?' or '#' passed
// the API's host:port check, went into the member table, and once its
// member led every write sent to a follower was 503 no_leader ("the
// leader's address is unusable") for ever. The same host in a raft_addr
// is refused alike.
func TestMembersAPITakesNoHTTPAddrFollowersRefuseToForwardTo(t *testing.T) {
	for i, addr := range []string{"n4.example/x:7080", "user@n4.example:7080", "n4 example:7080", "n4.example?x:7080", "n4.example#x:7080"} {
		leader := newNode(t, "n1", api.Options{})
		id := fmt.Sprintf("n%d", 4+i)
		body := fmt.Sprintf(`{"id":%q,"raft_addr":"10.0.0.4:7946","http_addr":%q}`, id, addr)
		a := send(t, leader.http.URL, "POST", "/v1/cluster/members", body)
		accepted := a.code == 204 && leader.fake.Calls()["AddMember"] == 1

		// The member it added now leads: a follower forwards a write to it.
		follower := newNode(t, "n2", api.Options{})
		follower.fake.SetFollower(id, addr)
		w := send(t, follower.http.URL, "POST", "/v1/workers", `{"worker_id":7,"block_size":4}`)
		if accepted && w.code == 503 {
			t.Errorf("http_addr %q: the members API answered %d (added to the member table), but a follower refuses to forward to it: %d %s",
				addr, a.code, w.code, w.body)
		}
		if a.code != 400 || a.reason(t) != api.ReasonInvalid || !strings.Contains(string(a.body), "http_addr") {
			t.Errorf("http_addr %q: %d %s, want 400 invalid naming http_addr", addr, a.code, a.body)
		}

		before := leader.fake.Calls()["AddMember"]
		raftAddr := strings.Replace(addr, "7080", "7946", 1)
		raft := fmt.Sprintf(`{"id":"r%s","raft_addr":%q,"http_addr":"10.0.0.4:7080"}`, id, raftAddr)
		if a := send(t, leader.http.URL, "POST", "/v1/cluster/members", raft); a.code != 400 || a.reason(t) != api.ReasonInvalid ||
			!strings.Contains(string(a.body), "raft_addr") || leader.fake.Calls()["AddMember"] != before {
			t.Errorf("raft_addr %q: %d %s (reached AddMember: %v), want 400 invalid naming raft_addr",
				raftAddr, a.code, a.body, leader.fake.Calls()["AddMember"] != before)
		}
	}
}

// TestConsistentSettingsReadIsTheCaughtUpLeaders: GET /v1/settings
// ?consistent=true, the read of kvctl settings set's read-modify-write,
// answers the leader's settings through a follower (forwarded, as a
// write is) and, on a leader just elected whose post-election Barrier
// has not passed (CheckLeader: ErrNoLeader), 503 no_leader rather than a
// state that may lack a change its predecessor acknowledged, which the
// put would undo. A plain GET still answers from the node's own state.
func TestConsistentSettingsReadIsTheCaughtUpLeaders(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	p := indexer.DefaultParams()
	p.Temperature = 0.5
	if err := leader.fake.SetSettings(context.Background(), raftfsm.Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	temperature := func(a answer) any {
		params, _ := a.json(t)["params"].(map[string]any)
		return params["temperature"]
	}
	if a := send(t, follower.http.URL, "GET", "/v1/settings", ""); a.code != 200 || temperature(a) != 0.0 {
		t.Fatalf("plain GET /v1/settings on the follower: %d %s, want 200 with its own temperature 0", a.code, a.body)
	}
	a := send(t, follower.http.URL, "GET", "/v1/settings?consistent=true", "")
	if a.code != 200 || temperature(a) != 0.5 || a.header.Get(api.HeaderForwardedTo) != leader.addr() {
		t.Fatalf("GET /v1/settings?consistent=true on the (stale) follower: %d %s (forwarded to %q), "+
			"want 200 with the leader's temperature 0.5, forwarded to %s", a.code, a.body, a.header.Get(api.HeaderForwardedTo), leader.addr())
	}
	leader.fake.SetHook(func(method string) error {
		if method == "CheckLeader" {
			return fmt.Errorf("%w: this node was just elected and has not yet applied every entry of the terms before its own; retry", raftfsm.ErrNoLeader)
		}
		return nil
	})
	for _, n := range []*node{leader, follower} {
		a := send(t, n.http.URL, "GET", "/v1/settings?consistent=true", "")
		if a.code != 503 || a.reason(t) != api.ReasonNoLeader {
			t.Fatalf("GET /v1/settings?consistent=true on %s, the leader not caught up: %d %s, want 503 no_leader", n.fake.Status().ID, a.code, a.body)
		}
	}
	if a := send(t, leader.http.URL, "GET", "/v1/settings?consistent=false", ""); a.code != 200 || temperature(a) != 0.5 {
		t.Fatalf("GET /v1/settings?consistent=false on the leader: %d %s, want 200", a.code, a.body)
	}
	// The value is read as strconv.ParseBool reads one (docs/api.md lists
	// its spellings); a refusal says what is taken.
	for v, want := range map[string]int{"1": 503, "t": 503, "TRUE": 503, "True": 503, "0": 200, "F": 200} {
		// True: the leader not caught up answers 503 no_leader, as above.
		if a := send(t, leader.http.URL, "GET", "/v1/settings?consistent="+v, ""); a.code != want {
			t.Errorf("GET /v1/settings?consistent=%s: %d %s, want %d", v, a.code, a.body, want)
		}
	}
	for _, v := range []string{"maybe", ""} {
		a := send(t, leader.http.URL, "GET", "/v1/settings?consistent="+v, "")
		if a.code != 400 || a.reason(t) != api.ReasonInvalid || !strings.Contains(string(a.body), "not a boolean (true, false, 1, 0, ...)") {
			t.Errorf("GET /v1/settings?consistent=%s: %d %s, want 400 invalid saying what is taken", v, a.code, a.body)
		}
	}
}
