package client_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// FuzzAnswers: whatever a node answers (any status from 200 to 599, any
// body), no client call panics or outlives its context, and an answer of
// 400 or more is an *Error that carries its status.
func FuzzAnswers(f *testing.F) {
	f.Add(uint16(0), []byte(`{"workers":[]}`))
	f.Add(uint16(303), []byte(`{"error":"x","reason":"not_ready","applied_index":3}`))
	f.Add(uint16(303), []byte(`{"error":"x","reason":"no_leader"}`))
	f.Add(uint16(229), []byte(`{"error":"x","reason":"overloaded","candidates":[{"worker_id":1}]}`))
	f.Add(uint16(0), []byte(`{"acks":[{"worker_id":1,"dp_rank":0,"cursor":3}]}`))
	f.Add(uint16(0), []byte(`{"ready":true,"applied_index":7}`))
	f.Add(uint16(0), []byte(`{"workers":[{"worker_id":1,"endpoints":[{`))
	type answer struct {
		status int
		body   []byte
	}
	var ans atomic.Pointer[answer]
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		a := ans.Load()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
	}))
	defer srv.Close()
	c, err := client.New([]string{srv.URL}, client.Options{})
	if err != nil {
		f.Fatal(err)
	}
	defer c.Close()
	f.Fuzz(func(t *testing.T, st uint16, body []byte) {
		status := 200 + int(st)%400
		ans.Store(&answer{status: status, body: body})
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := c.Workers(ctx)
		if ctx.Err() != nil {
			t.Fatalf("Workers outlived its context: %v", err)
		}
		var ae *client.Error
		if status >= 400 && (!errors.As(err, &ae) || ae.StatusCode != status) {
			t.Fatalf("answer %d: Workers returned %v, want an *Error of that status", status, err)
		}
		_, _ = c.Route(ctx, api.RouteRequest{TokenIDs: []uint32{1}})
		_, _ = c.IndexStats(ctx)
		_, _ = c.Status(ctx)
		_ = c.StatusAll(ctx)
		_, _ = c.Ready(ctx)
		_, _ = c.Members(ctx)
		_, _ = c.IngestEvents(ctx, []raftfsm.RankBatch{{Rank: kvevent.Rank{Worker: 1}}})
		_, _ = c.RestoreSnapshot(ctx, bytes.NewReader(nil))
		var w bytes.Buffer
		_, _ = c.SaveSnapshot(ctx, &w)
		if ctx.Err() != nil {
			t.Fatal("the calls outlived their context")
		}
	})
}
