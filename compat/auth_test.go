package compat

import (
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/prometheus/client_golang/prometheus"
)

// TestATokenGuardsEveryRegisteredRoute pins docs/operations.md,
// "Security": a node started with a token answers 401 unauthorized to a
// request without it (or with a wrong one) on every route it serves, the
// API's, the drop-in indexer's at the root and the selection API's, for
// every method, and only GET and HEAD of /healthz, /readyz and /metrics
// pass without it. The routes are those the server registered (the route
// label of kvrouter_http_request_duration_seconds, present for each from
// the start), so that a route added later is covered without a line here;
// the list is checked to hold the routes the docs name, so that it cannot
// come back empty.
func TestATokenGuardsEveryRegisteredRoute(t *testing.T) {
	const token = "s3cret"
	reg := prometheus.NewRegistry()
	n := startNodeWith(t, api.Options{Token: token, Registerer: reg, Gatherer: reg})
	sel := n.selectionPort(t)
	patterns := registeredPatterns(t, reg)
	for _, want := range []string{
		"POST /v1/snapshot/restore", "GET /v1/snapshot", "POST /v1/cluster/leader/transfer",
		"POST /v1/cluster/members", "DELETE /v1/cluster/members/{id}", "POST /v1/route", "DELETE /v1/workers/{id}",
		"POST /events", "POST /query", "POST /query_by_hash", "GET /dump", "GET /workers", "GET /health",
		"POST /register", "POST /unregister",
		"GET /selection/ready", "POST /selection/select", "POST /selection/select_and_reserve",
		"PATCH /selection/workers/{id}", "DELETE /selection/reservations/{id}", "POST /selection/overlap_scores",
		"GET /healthz", "GET /readyz", "GET /metrics",
	} {
		if !slices.Contains(patterns, want) {
			t.Errorf("the server registered no %q; registered: %q", want, patterns)
		}
	}
	wildcard := regexp.MustCompile(`\{[^}]*\}`)
	paths := []string{"/no/such/route", "/"}
	for _, p := range patterns {
		_, path, ok := strings.Cut(p, " ")
		if !ok {
			path = p
		}
		paths = append(paths, wildcard.ReplaceAllString(path, "x1"))
	}
	open := func(method, path string) bool {
		return (method == http.MethodGet || method == http.MethodHead) && slices.Contains([]string{"/healthz", "/readyz", "/metrics"}, path)
	}
	methods := []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
	for _, path := range paths {
		for _, method := range methods {
			for _, auth := range []string{"", "Bearer wrong", "Basic " + token, token} {
				code, challenge := tryRoute(t, n.url, method, path, auth)
				if open(method, path) && auth == "" {
					if code != http.StatusOK {
						t.Errorf("%s %s without a token: %d, want 200 (probes and scrapers need none)", method, path, code)
					}
					continue
				}
				if open(method, path) {
					continue // a wrong token on a probe is not asked about
				}
				if code != http.StatusUnauthorized || !strings.HasPrefix(challenge, "Bearer") {
					t.Errorf("%s %s with Authorization %q: %d (WWW-Authenticate %q), want 401 with a Bearer challenge", method, path, auth, code, challenge)
				}
			}
			if rest, ok := strings.CutPrefix(path, SelectionPrefix+"/"); ok {
				if code, _ := tryRoute(t, sel.url, method, "/"+rest, ""); code != http.StatusUnauthorized {
					t.Errorf("%s /%s on the selection port without a token: %d, want 401", method, rest, code)
				}
			}
		}
	}
}

// registeredPatterns returns the route patterns the server registered:
// the route labels of its request durations, the unmatched and
// unauthorized requests' labels aside.
func registeredPatterns(t *testing.T, reg prometheus.Gatherer) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		if mf.GetName() != "kvrouter_http_request_duration_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "route" && strings.Contains(l.GetValue(), "/") {
					out = append(out, l.GetValue())
				}
			}
		}
	}
	return out
}

// tryRoute sends method path to url with Authorization auth ("": none)
// and an empty JSON body, and returns the status and the challenge.
func tryRoute(t *testing.T, url, method, path, auth string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url+path, strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentJSON)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("WWW-Authenticate")
}
