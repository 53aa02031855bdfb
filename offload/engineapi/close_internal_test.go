package engineapi

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// TestCloseWaitsForAHandlerItCutOff: a lookup handler (which reads the
// pools without holding a region) still running when Close gives up on its
// connection keeps Close from returning until it returns, so the caller
// never closes the pools under it; requests after Close began are refused.
func TestCloseWaitsForAHandlerItCutOff(t *testing.T) {
	raw, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	rank := kvevent.Rank{Worker: 5}
	hp, err := pool.NewHost(raw, pool.Config{Rank: rank, Capacity: 4, BlockSize: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer hp.Close()
	dir, err := os.MkdirTemp("", "eapi")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)

	entered, release, waiting := make(chan struct{}), make(chan struct{}), make(chan struct{})
	grace := shutdownGrace
	shutdownGrace = time.Millisecond // hs.Shutdown gives up on the busy connection at once
	testHookHandler = func(path string) {
		if path == PathLookup {
			close(entered)
			<-release
		}
	}
	testHookCloseWait = func() { close(waiting) }
	defer func() { shutdownGrace, testHookHandler, testHookCloseWait = grace, nil, nil }()

	srv, err := Listen(Config{Socket: filepath.Join(dir, "kvagent.sock"), Backend: raw,
		Ranks: []RankPools{{Rank: rank, Host: hp}}})
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient(srv.Socket())
	defer c.Close()
	looked := make(chan error, 1)
	go func() {
		_, err := c.Lookup(context.Background(), LookupRequest{Hashes: []Hash{1, 2}})
		looked <- err
	}()
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- srv.Close() }()
	select {
	case err := <-closed:
		close(release)
		t.Fatalf("Close returned (%v) while a lookup handler was still running", err)
	case <-waiting:
	}
	// Its connection was cut: the client has its answer, the handler runs on.
	if err := <-looked; err == nil {
		t.Fatal("the lookup cut off by Close got an answer")
	}
	// Close has not returned, and a request reaching the handlers now is refused.
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a lookup handler was still running", err)
	default:
	}
	// (testHookHandler would panic: entered is closed.)
	rec := httptest.NewRecorder()
	srv.hs.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, PathLookup, strings.NewReader(`{"dp_rank":0,"hashes":[1]}`)))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), `"closed"`) {
		t.Fatalf("a request after Close began: %d %s, want 503 closed", rec.Code, rec.Body)
	}
	if _, err := srv.handleLookup(context.Background(), []byte(`{"dp_rank":0,"hashes":[1]}`)); !errors.Is(err, ErrClosed) {
		t.Fatalf("a lookup after Close began: %v, want ErrClosed", err)
	}
	close(release)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}
