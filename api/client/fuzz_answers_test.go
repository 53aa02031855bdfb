package client_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// FuzzAnswers: whatever a node answers (any status from 200 to 599, any
// body), no client call panics or outlives its context; an answer of 400
// or more is, for every call, an *Error that carries its status (Ready's
// not_ready excepted: a node that is not ready); and each read of a 2xx
// answer returns a value in the node's shape (the field every node's
// answer to it holds, ErrNotAnAnswer's rule) or an error, never another
// service's JSON read as an empty list or a node that is not ready.
func FuzzAnswers(f *testing.F) {
	f.Add(uint16(0), []byte(`{"workers":[]}`))
	f.Add(uint16(303), []byte(`{"error":"x","reason":"not_ready","applied_index":3}`))
	f.Add(uint16(303), []byte(`{"error":"x","reason":"no_leader"}`))
	f.Add(uint16(229), []byte(`{"error":"x","reason":"overloaded","candidates":[{"worker_id":1}]}`))
	f.Add(uint16(0), []byte(`{"acks":[{"worker_id":1,"dp_rank":0,"cursor":3}]}`))
	f.Add(uint16(0), []byte(`{"ready":true,"applied_index":7}`))
	f.Add(uint16(0), []byte(`{"workers":[{"worker_id":1,"endpoints":[{`))
	f.Add(uint16(0), []byte(`{"foo":1}`)) // another service's answer
	f.Add(uint16(0), []byte(`{"id":"n1","state":"Leader","members":null,"entries":0,"params":{},"decided_by":"cost","block_size":16}`))
	f.Add(uint16(200), []byte(`{"foo":1}`))
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
		// Each call's error, and for a read whether what it returned is in
		// the node's shape.
		type result struct {
			err    error
			shaped bool
		}
		has := func(key string) bool { return holds(body, key) }
		results := map[string]func() result{
			"Workers": func() result { _, err := c.Workers(ctx); return result{err, has("workers")} },
			"Members": func() result { _, err := c.Members(ctx); return result{err, has("members")} },
			"IndexStats": func() result {
				_, err := c.IndexStats(ctx)
				return result{err, has("entries")}
			},
			"Settings": func() result { _, err := c.Settings(ctx); return result{err, has("params")} },
			"Ready": func() result {
				rd, err := c.Ready(ctx)
				return result{err, has("ready") || err == nil && !rd.Ready && rd.Reason == api.ReasonNotReady}
			},
			"Status": func() result {
				s, err := c.Status(ctx)
				return result{err, err == nil && (s.ID != "" || s.State != "")}
			},
			"StatusAll": func() result {
				r := c.StatusAll(ctx)[0]
				return result{r.Err, r.Err == nil && (r.Status.ID != "" || r.Status.State != "")}
			},
			"Route": func() result {
				r, err := c.Route(ctx, api.RouteRequest{TokenIDs: []uint32{1}})
				return result{err, err == nil && (r.DecidedBy != "" || r.BlockSize != 0)}
			},
			"IngestEvents": func() result {
				acks, err := c.IngestEvents(ctx, []raftfsm.RankBatch{{Rank: kvevent.Rank{Worker: 1}}})
				return result{err, len(acks) == 1}
			},
			"RestoreSnapshot": func() result {
				info, err := c.RestoreSnapshot(ctx, bytes.NewReader(nil))
				return result{err, err == nil && (info.FormatVersion != 0 || info.SHA256 != "")}
			},
			// Writes whose answer is not read as a value: only their
			// errors are checked.
			"RegisterWorker": func() result {
				return result{c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0}}), true}
			},
			"Free": func() result { return result{c.Free(ctx, "r"), true} },
			"SaveSnapshot": func() result {
				var w bytes.Buffer
				_, err := c.SaveSnapshot(ctx, &w)
				return result{err, true}
			},
		}
		for _, name := range slices.Sorted(maps.Keys(results)) {
			r := results[name]()
			if ctx.Err() != nil {
				t.Fatalf("%s outlived its context: %v", name, r.err)
			}
			var ae *client.Error
			switch {
			case status >= 400 && name == "Ready" && r.err == nil && r.shaped:
				// not_ready: a node that is not ready, read from its answer.
			case status >= 400 && (!errors.As(r.err, &ae) || ae.StatusCode != status):
				t.Fatalf("answer %d %q: %s returned %v, want an *Error of that status", status, body, name, r.err)
			case status < 300 && r.err == nil && !r.shaped:
				t.Fatalf("answer %d %q: %s returned no error and a value of another shape than a node's", status, body, name)
			}
		}
	})
}

// holds reports whether body's first JSON value, as the client decodes an
// answer, is an object with the field key.
func holds(body []byte, key string) bool {
	var fields map[string]json.RawMessage
	if json.NewDecoder(bytes.NewReader(body)).Decode(&fields) != nil {
		return false
	}
	_, ok := fields[key]
	return ok
}
