package api_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

const testToken = "s3cret-token"

func TestTokenGuardsEveryRouteButTheProbes(t *testing.T) {
	n := newNode(t, "n1", api.Options{Token: testToken})
	withWorkers(t, n)
	guarded := []struct{ method, path, body, backend string }{
		{"POST", "/v1/route", `{"token_ids":[1,2,3,4]}`, "Route"},
		{"GET", "/v1/workers", "", ""},
		{"POST", "/v1/workers", `{"worker_id":7,"block_size":4}`, "RegisterWorker"},
		{"POST", "/v1/events", events(storedEv), "IngestEvents"},
		{"PUT", "/v1/settings", `{"view":"tiered"}`, "SetSettings"},
		{"GET", "/v1/cluster/status", "", ""},
		{"POST", "/v1/cluster/members", `{"id":"n3","raft_addr":"h3:7946","http_addr":"h3:7080"}`, "AddMember"},
		{"DELETE", "/v1/cluster/members/n3", "", "RemoveMember"},
		{"GET", "/v1/snapshot", "", ""},
		{"GET", "/no/such/route", "", ""}, // 401, not 404: a client without the token learns nothing
	}
	for _, tc := range guarded {
		for _, hdr := range [][]string{nil, {"Authorization", "Bearer wrong"}, {"Authorization", "Basic " + testToken}, {"Authorization", testToken}} {
			before := n.fake.Calls()[tc.backend]
			a := send(t, n.http.URL, tc.method, tc.path, tc.body, hdr...)
			if a.code != 401 || a.json(t)["reason"] != api.ReasonUnauthorized {
				t.Fatalf("%s %s with %q: %d %s, want 401 %s", tc.method, tc.path, hdr, a.code, a.body, api.ReasonUnauthorized)
			}
			if !strings.HasPrefix(a.header.Get("WWW-Authenticate"), "Bearer") {
				t.Fatalf("%s %s: WWW-Authenticate %q, want a Bearer challenge", tc.method, tc.path, a.header.Get("WWW-Authenticate"))
			}
			if tc.backend != "" && n.fake.Calls()[tc.backend] != before {
				t.Fatalf("%s %s with %q reached the backend's %s", tc.method, tc.path, hdr, tc.backend)
			}
		}
	}
	// Each refusal says what was wrong with the request.
	for hdr, want := range map[string]string{"": "carries none", "Bearer wrong": "not this cluster's", "Basic " + testToken: "not a Bearer token"} {
		var h []string
		if hdr != "" {
			h = []string{"Authorization", hdr}
		}
		if a := send(t, n.http.URL, "GET", "/v1/workers", "", h...); !strings.Contains(fmt.Sprint(a.json(t)["error"]), want) {
			t.Fatalf("Authorization %q: %s, want the error to say %q", hdr, a.body, want)
		}
	}
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"route": "unauthorized", "code": "401"}); got != float64(4*len(guarded)+3) {
		t.Fatalf("unauthorized requests counted %v, want %d", got, 4*len(guarded))
	}
	// With the token (the scheme's case does not matter, RFC 6750), the
	// same requests are served.
	for i, tc := range guarded[:len(guarded)-1] {
		scheme := "Bearer "
		if i%2 == 1 {
			scheme = "bearer "
		}
		before := n.fake.Calls()[tc.backend]
		a := send(t, n.http.URL, tc.method, tc.path, tc.body, "Authorization", scheme+testToken)
		if a.code >= 300 {
			t.Fatalf("%s %s with the token: %d %s", tc.method, tc.path, a.code, a.body)
		}
		if tc.backend != "" && n.fake.Calls()[tc.backend] != before+1 {
			t.Fatalf("%s %s with the token did not reach the backend's %s", tc.method, tc.path, tc.backend)
		}
	}
	// Probes and scrapers need no token.
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		if a := send(t, n.http.URL, "GET", path, ""); a.code != 200 {
			t.Fatalf("GET %s without a token: %d %s, want 200", path, a.code, a.body)
		}
	}
	// But only to read them.
	if a := send(t, n.http.URL, "POST", "/healthz", "{}"); a.code != 401 {
		t.Fatalf("POST /healthz without a token: %d %s, want 401", a.code, a.body)
	}
}

func TestNoTokenAsksForNone(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	if a := send(t, n.http.URL, "GET", "/v1/cluster/status", "", "Authorization", "Bearer anything"); a.code != 200 {
		t.Fatalf("a node without a token answered %d %s", a.code, a.body)
	}
}

// A follower forwards a write to a leader that serves TLS (ForwardScheme
// https, a transport that trusts it), and the client's token goes with it:
// the leader checks it again.
func TestForwardOverTLSCarriesTheToken(t *testing.T) {
	quiet := api.Options{Token: testToken, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	leaderFake := apitest.New("n1", "")
	leaderAPI := api.NewServer(leaderFake, api.Options{Token: testToken, Logger: quiet.Logger, Registerer: prometheus.NewRegistry()})
	leader := httptest.NewTLSServer(leaderAPI)
	t.Cleanup(func() { leader.Close(); leaderAPI.Close() })
	leaderAddr := strings.TrimPrefix(leader.URL, "https://")
	st := leaderFake.Status()
	st.HTTPAddr, st.LeaderHTTP = leaderAddr, leaderAddr
	leaderFake.SetStatus(st)
	leaderFake.SetMembers([]raftfsm.Member{{ID: "n1", RaftAddr: "n1:7946", HTTPAddr: leaderAddr, Voter: true, Leader: true}})

	quiet.ForwardScheme, quiet.ForwardTransport = "https", leader.Client().Transport
	follower := newNode(t, "n2", quiet)
	follower.fake.SetFollower("n1", leaderAddr) // host:port: reached by ForwardScheme

	body := `{"worker_id":7,"block_size":4}`
	if a := send(t, follower.http.URL, "POST", "/v1/workers", body, "Authorization", "Bearer "+testToken); a.code != 204 {
		t.Fatalf("forwarded registration: %d %s, want 204 from the leader", a.code, a.body)
	} else if got := a.header.Get(api.HeaderForwardedTo); got != leaderAddr {
		t.Fatalf("%s = %q, want the leader %s", api.HeaderForwardedTo, got, leaderAddr)
	}
	if got := leaderFake.Calls()["RegisterWorker"]; got != 1 {
		t.Fatalf("the leader registered %d times, want 1", got)
	}
	// Without the token the follower refuses it itself: nothing goes on.
	if a := send(t, follower.http.URL, "POST", "/v1/workers", body); a.code != 401 {
		t.Fatalf("registration without the token: %d %s, want 401", a.code, a.body)
	}
	if got := leaderFake.Calls()["RegisterWorker"]; got != 1 {
		t.Fatalf("the leader registered %d times after a refused request, want 1", got)
	}
}
