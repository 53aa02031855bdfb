package api

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"testing"

	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// cannedRoute is the fake backend with a route decision made once and
// answered again without work, so that what a route request allocates is
// the API's own (middleware, body decode, answer), not the backend's.
type cannedRoute struct {
	*apitest.Fake
	res raftfsm.RouteResult
}

func (c *cannedRoute) Route(context.Context, raftfsm.RouteQuery) (raftfsm.RouteResult, error) {
	return c.res, nil
}

// discardAnswer is a reusable http.ResponseWriter that drops the body
// (benchcluster's BenchmarkRouteServeHTTP writes to one like it).
type discardAnswer struct {
	h    http.Header
	code int
}

func (w *discardAnswer) Header() http.Header         { return w.h }
func (w *discardAnswer) WriteHeader(code int)        { w.code = code }
func (w *discardAnswer) Write(p []byte) (int, error) { return len(p), nil }

// routeHandlerAllocs is what one brief route request through ServeHTTP
// allocates with a backend that allocates nothing: 3 in the handler
// (the recorder of the middleware, http.MaxBytesReader, the answer's
// Content-Type header) and 2 in the test itself (the request's copy and
// its body's io.NopCloser, as in benchcluster's BenchmarkRouteServeHTTP,
// whose 6 per decision also count the node's Route).
const routeHandlerAllocs = 5

// TestRouteHandlerAllocations pins the hot-path rule of the developers'
// guide ("no per-event allocation you can avoid") on the API's route
// handler (Server.route under ServeHTTP's middleware): a brief route
// request allocates routeHandlerAllocs times, whatever its prompt's
// length. No test measured the handler: an allocation more per request
// passed every test.
func TestRouteHandlerAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's instrumentation allocates besides")
	}
	fake := apitest.New("n1", "")
	ctx := context.Background()
	if err := fake.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	res, err := fake.Route(ctx, raftfsm.RouteQuery{LocalHashes: []uint64{1, 2, 3, 4}, Brief: true})
	if err != nil {
		t.Fatal(err)
	}
	srv := NewServer(&cannedRoute{Fake: fake, res: res}, Options{Logger: slog.New(slog.DiscardHandler)})
	defer srv.Close()
	w := &discardAnswer{h: http.Header{}}
	body := &bytes.Reader{}
	req, err := http.NewRequest(http.MethodPost, "http://kvrouter/v1/route", io.NopCloser(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for _, b := range [][]byte{
		[]byte(`{"block_hashes":[1,2,3,4],"brief":true}`),
		[]byte(`{"block_hashes":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32],"brief":true}`),
		[]byte(`{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"brief":true}`),
	} {
		serve := func() {
			body.Reset(b)
			clear(w.h)
			w.code = 0
			r := *req // ServeHTTP may set fields of the request (the mux's pattern)
			r.Body = io.NopCloser(body)
			srv.ServeHTTP(w, &r)
			if w.code != 0 && w.code != http.StatusOK {
				t.Fatalf("%s: status %d", b, w.code)
			}
		}
		serve() // the pools' first scratch
		if n := testing.AllocsPerRun(100, serve); n > routeHandlerAllocs {
			t.Errorf("%s: %.1f allocations per route request, want at most %d", b, n, routeHandlerAllocs)
		}
	}
}
