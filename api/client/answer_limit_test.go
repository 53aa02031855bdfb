package client_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
)

// endless answers 200 with the start of a JSON answer and then whitespace
// for as long as the client reads: a broken or hostile node.
func endless(t *testing.T) *httptest.Server {
	chunk := []byte(strings.Repeat(" ", 64<<10))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		prefix := `{"workers":[`
		if r.URL.Path == "/readyz" {
			prefix = `{"ready":true,"error":"`
		}
		if _, err := w.Write([]byte(prefix)); err != nil {
			return
		}
		for r.Context().Err() == nil {
			if _, err := w.Write(chunk); err != nil {
				return // the client let go
			}
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// Every JSON answer of the client is read up to the limit and no more: an
// endless one fails with ErrAnswerTooLarge, naming the call, instead of
// being read (and, for a value, held) without end. The limit is lowered
// to 1 MiB here, so that the race detector gets through it quickly.
func TestEndlessAnswerIsCutAtTheLimit(t *testing.T) {
	client.SetMaxAnswerBytes(t, 1<<20)
	c, err := client.New([]string{endless(t).URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	check := func(call string, err error) {
		t.Helper()
		if ctx.Err() != nil {
			t.Fatalf("%s read until its context ended: %v", call, err)
		}
		if !errors.Is(err, client.ErrAnswerTooLarge) || !strings.Contains(err.Error(), call) {
			t.Fatalf("%s of an endless answer: %v, want ErrAnswerTooLarge naming the call", call, err)
		}
	}
	_, err = c.Workers(ctx)
	check("GET /v1/workers", err)
	_, err = c.Ready(ctx)
	check("GET /readyz", err)
}

// An answer within the limit decodes, whatever follows its value (here
// more whitespace than the limit: the client stops at the value's end).
func TestAnswerWithinTheLimitDecodes(t *testing.T) {
	const limit = 1 << 20
	client.SetMaxAnswerBytes(t, limit)
	var ws api.WorkersResponse
	for i := range 7000 {
		ws.Workers = append(ws.Workers, api.Worker{WorkerID: uint64(i + 1), DPRanks: []uint32{0}, Model: "m"})
	}
	body, err := json.Marshal(ws)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) < limit/2 || len(body) > limit {
		t.Fatalf("a body of %d bytes: the test wants one close under the limit of %d", len(body), limit)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body)
		_, _ = w.Write([]byte(strings.Repeat("\n", limit))) // trailing whitespace past the limit
	}))
	defer srv.Close()
	c, err := client.New([]string{srv.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got, err := c.Workers(context.Background())
	if err != nil || len(got) != len(ws.Workers) {
		t.Fatalf("Workers: %d workers, %v; want %d", len(got), err, len(ws.Workers))
	}
}
