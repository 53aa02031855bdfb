package api_test

import (
	"bufio"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
)

// rawDo sends one raw HTTP/1.1 request line to addr and returns the response.
func rawDo(t *testing.T, addr, method, target string) *http.Response {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(method + " " + target + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(method, "http://x/", nil)
	resp, err := http.ReadResponse(bufio.NewReader(c), req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

// TestRedirectsOnlyWhereTheMuxDoes: the Server answers a path that is not
// clean with its own redirect (the escaping kept); every request target
// that a plain mux does not redirect it must not redirect either. From a
// review: "*" got a 307 to "/*" where the mux answers 400.
func TestRedirectsOnlyWhereTheMuxDoes(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	ref := newRefServer(t)
	for _, tc := range []struct{ m, target string }{
		{"GET", "*"},
		{"POST", "*"},
		{"DELETE", "*"},
		{"GET", "/healthz"},
		{"GET", "/healthz/"},
		{"GET", "//healthz"},
		{"GET", "/./healthz?x=1"},
		{"GET", "/healthz/."},
		{"GET", "/%2e/healthz"},
		{"GET", "/a%2F..%2Fhealthz"},
		{"GET", "http://x"},
		{"GET", "http://x/./healthz"},
		{"GET", "http:foo"},
		{"GET", "/\\evil.com"},
		{"GET", "//evil.com"},
		{"GET", "/.//%2Fevil.com"},
		{"GET", "/..//\\evil.com"},
	} {
		got := rawDo(t, n.addr(), tc.m, tc.target)
		want := rawDo(t, ref, tc.m, tc.target)
		gr, wr := got.StatusCode/100 == 3, want.StatusCode/100 == 3
		t.Logf("%s %s: server %d %q, mux %d %q", tc.m, tc.target, got.StatusCode, got.Header.Get("Location"), want.StatusCode, want.Header.Get("Location"))
		if gr && !wr {
			t.Errorf("%s %s: server redirects (%d Location %q) where the mux answered %d", tc.m, tc.target, got.StatusCode, got.Header.Get("Location"), want.StatusCode)
		}
		if loc := got.Header.Get("Location"); strings.HasPrefix(loc, "//") || strings.HasPrefix(loc, "/\\") {
			t.Errorf("%s %s: protocol-relative Location %q", tc.m, tc.target, loc)
		}
	}
}

// TestStarRequestTargetIsAJSONError: a "*" request-target (but OPTIONS,
// which net/http answers itself) is answered 400 invalid in a JSON error
// body, as every error is (docs/api.md, Errors). From a review: it went out
// as the mux writes it, a 400 with an empty body.
func TestStarRequestTargetIsAJSONError(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	for _, m := range []string{"GET", "POST", "DELETE"} {
		code, reason, msg := sendRawRequest(t, n, "*", m+" * HTTP/1.1\r\nHost: x\r\n\r\n", false)
		if code != http.StatusBadRequest || reason != api.ReasonInvalid || msg == "" {
			t.Errorf("%s *: %d %s %q, want a 400 invalid JSON error", m, code, reason, msg)
		}
	}
}

// TestRedirectLocationIsASCII: the mux hex-escapes non-ASCII bytes in a
// redirect's Location (http.Redirect's hexEscapeNonASCII); so must the
// Server's own redirect, which copied the raw query into the header as it
// came. From a review.
func TestRedirectLocationIsASCII(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	ref := newRefServer(t)
	target := "/./healthz?q=\xc3\xa9"
	got := rawDo(t, n.addr(), "GET", target)
	want := rawDo(t, ref, "GET", target)
	t.Logf("server %d %q, mux %d %q", got.StatusCode, got.Header.Get("Location"), want.StatusCode, want.Header.Get("Location"))
	loc := got.Header.Get("Location")
	for i := 0; i < len(loc); i++ {
		if loc[i] >= 0x80 {
			t.Fatalf("Location %q holds a non-ASCII byte (the mux sent %q)", loc, want.Header.Get("Location"))
		}
	}
}

func newRefServer(t *testing.T) string {
	m := http.NewServeMux()
	m.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: m}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return ln.Addr().String()
}

// FuzzRedirectSettlesInOneStep: a redirect the server answers leads to a
// path that it does not redirect again. From a review.
func FuzzRedirectSettlesInOneStep(f *testing.F) {
	for _, s := range []string{"/v1//workers", "/v1/requests/a%2F..%2Fb/../x/prefill_done", "/./v1/workers/", "//", "/v1/requests/%2E%2E/prefill_done", "/a/b/../../../c"} {
		f.Add(s)
	}
	fake := apitest.New("n1", "127.0.0.1:1")
	s := api.NewServer(fake, api.Options{Logger: slog.New(slog.DiscardHandler)})
	defer s.Close()
	f.Fuzz(func(t *testing.T, p string) {
		u, err := url.ParseRequestURI(p)
		if err != nil || u.Host != "" || u.Scheme != "" {
			return
		}
		req := httptest.NewRequest("GET", "/", nil)
		req.URL, req.RequestURI = u, u.RequestURI()
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, req)
		if rec.Code != http.StatusTemporaryRedirect {
			return
		}
		loc := rec.Header().Get("Location")
		lu, err := url.ParseRequestURI(loc)
		if err != nil {
			t.Fatalf("%q: Location %q: %v", p, loc, err)
		}
		req2 := httptest.NewRequest("GET", "/", nil)
		req2.URL, req2.RequestURI = lu, lu.RequestURI()
		rec2 := httptest.NewRecorder()
		s.ServeHTTP(rec2, req2)
		if rec2.Code == http.StatusTemporaryRedirect {
			t.Fatalf("%q -> %q -> %q: redirected twice", p, loc, rec2.Header().Get("Location"))
		}
	})
}

// TestRedirectedRequestsAreCounted pins docs/api.md's GET /metrics:
// kvrouter_http_requests_total counts every request the node answers, by
// route pattern, "requests matching no route" as unmatched. A path that is
// not clean (a doubled slash) matches no route and is answered (a 307 to
// the clean path), so it counts under unmatched with its code; it must not
// leave the family without a trace of it.
func TestRedirectedRequestsAreCounted(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	if resp := rawDo(t, n.addr(), "GET", "/v1//workers"); resp.StatusCode != http.StatusTemporaryRedirect {
		t.Fatalf("GET /v1//workers: %d, want 307", resp.StatusCode)
	}
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"code": "307"}); got != 1 {
		t.Fatalf("kvrouter_http_requests_total{code=307} = %v after one redirected request, want 1 (the request was answered and counted nowhere)", got)
	}
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"route": "unmatched", "code": "307"}); got != 1 {
		t.Fatalf("kvrouter_http_requests_total{route=unmatched,code=307} = %v, want 1 (docs/api.md: a path that is not clean counts as unmatched)", got)
	}
	if got := histogramCount(t, n.reg, "kvrouter_http_request_duration_seconds", map[string]string{"route": "unmatched"}); got != 1 {
		t.Fatalf("kvrouter_http_request_duration_seconds{route=unmatched} count = %d after one redirected request, want 1", got)
	}
}
