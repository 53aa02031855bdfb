package apitest

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// HungServer is a node that accepts connections and never answers (a
// wedged or stopped process): each request waits until its client gives
// up or the test ends.
func HungServer(t testing.TB) *httptest.Server {
	t.Helper()
	release := make(chan struct{})
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(s.Close)
	t.Cleanup(func() { close(release) }) // before Close, which waits for the handlers
	return s
}
