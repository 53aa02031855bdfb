package compat

import (
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/rawhttp"
)

// TestBodyReadErrorsAreAnsweredAsOnV1: the compatible APIs are served by
// api.Server, with its body timeout, and answer a body that could not be
// read as /v1 does (api.BodyReadError): stalled past the timeout 408, cut
// off by its connection 503, neither naming the connection's addresses,
// and a malformed chunk size 400. From a review: each was 400 with both
// addresses in the message.
func TestBodyReadErrorsAreAnsweredAsOnV1(t *testing.T) {
	n := startNodeWith(t, api.Options{BodyTimeout: 100 * time.Millisecond})
	u, err := url.Parse(n.url)
	if err != nil {
		t.Fatal(err)
	}
	const head = "POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
	for _, c := range []struct {
		what, req string
		cut       bool
		code      int
	}{
		{"a body stalled past the body timeout", head + "Content-Length: 100\r\n\r\n{\"model\":", false, http.StatusRequestTimeout},
		{"a body cut off by its connection", head + "Content-Length: 100\r\n\r\n{\"model\":", true, http.StatusServiceUnavailable},
		{"a malformed chunk size", head + "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\nzz\r\n", false, http.StatusBadRequest},
	} {
		code, msg := rawPost(t, u.Host, c.req, c.cut)
		if code != c.code || strings.Contains(msg, "127.0.0.1") {
			t.Errorf("/query with %s: %d %q, want %d naming no address", c.what, code, msg, c.code)
		}
	}
}

// TestBodyOverTheLimitIs413: a body over the server's MaxBodyBytes is 413,
// as on /v1, not 400 (bad input a client would not send again as it is,
// though the same request may suit a node with a larger limit). From a
// review.
func TestBodyOverTheLimitIs413(t *testing.T) {
	n := startNodeWith(t, api.Options{MaxBodyBytes: 64})
	body := []byte(`{"model":"` + strings.Repeat("m", 100) + `","block_hashes":[1]}`)
	for _, c := range []codec{codecJSON, codecMsgpack} {
		if r := n.do(t, c, "POST", "/query", body); r.code != http.StatusRequestEntityTooLarge {
			t.Errorf("a %d-byte body over a 64-byte limit (%v): %d %s, want 413", len(body), c, r.code, r.body)
		}
	}
}

// rawPost writes req, an HTTP request as bytes, to addr, and then stalls,
// or closes its side of the connection when cut; it returns the answer's
// status and error message.
func rawPost(t *testing.T, addr, req string, cut bool) (int, string) {
	t.Helper()
	code, b := rawhttp.Send(t, addr, req, cut)
	var body ErrorBody
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatalf("%d, not an error body: %v", code, err)
	}
	return code, body.Error
}
