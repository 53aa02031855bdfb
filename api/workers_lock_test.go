package api_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// lockingBackend is a backend with a worker-table lock, as raftfsm.Node
// has, that counts the worker writes made without it held.
type lockingBackend struct {
	*apitest.Fake
	mu       sync.Mutex
	unlocked int
}

func (b *lockingBackend) WorkersMutex() *sync.Mutex { return &b.mu }

func (b *lockingBackend) held() bool {
	if b.mu.TryLock() {
		b.mu.Unlock()
		return false
	}
	return true
}

func (b *lockingBackend) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	if !b.held() {
		b.unlocked++
	}
	return b.Fake.RegisterWorker(ctx, w)
}

func (b *lockingBackend) DeregisterWorker(ctx context.Context, id uint64) error {
	if !b.held() {
		b.unlocked++
	}
	return b.Fake.DeregisterWorker(ctx, id)
}

// TestWorkerWritesTakeTheBackendsLock: /v1 registrations and removals
// write under the backend's worker-table lock, the one the compatible
// APIs' read-modify-writes take, so that neither undoes the other.
func TestWorkerWritesTakeTheBackendsLock(t *testing.T) {
	b := &lockingBackend{Fake: apitest.New("n1", "")}
	s := api.NewServer(b, api.Options{Logger: slog.New(slog.DiscardHandler)})
	defer s.Close()
	for _, req := range []*httptestRequest{
		{"POST", "/v1/workers", `{"worker_id": 7, "block_size": 16}`},
		{"DELETE", "/v1/workers/7", ""},
	} {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(req.method, req.path, strings.NewReader(req.body)))
		if rec.Code != 204 {
			t.Fatalf("%s %s: %d %s", req.method, req.path, rec.Code, rec.Body)
		}
	}
	if b.unlocked != 0 {
		t.Fatalf("%d worker writes made without the backend's worker-table lock", b.unlocked)
	}
}

type httptestRequest struct{ method, path, body string }

// TestWorkerChecksJudgeRegistrations: a check added with CheckWorkers
// runs under the backend's worker-table lock before a /v1 registration is
// written; one that returns an error wrapping ErrConflict refuses it with
// 409 conflict, which the Go client matches as api.ErrConflict, and
// nothing is written.
func TestWorkerChecksJudgeRegistrations(t *testing.T) {
	b := &lockingBackend{Fake: apitest.New("n1", "")}
	s := api.NewServer(b, api.Options{Logger: slog.New(slog.DiscardHandler)})
	defer s.Close()
	var checked, unlocked int
	s.CheckWorkers(func(w raftfsm.WorkerInfo) error {
		checked++
		if !b.held() {
			unlocked++
		}
		if w.Model == "taken" {
			return fmt.Errorf("%w: model taken", api.ErrConflict)
		}
		return nil
	})
	hs := httptest.NewServer(s)
	defer hs.Close()
	c, err := client.New([]string{hs.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if err := c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 7, BlockSize: 16, Model: "taken"}); !errors.Is(err, api.ErrConflict) {
		t.Errorf("a registration the check refuses: %v, want api.ErrConflict", err)
	}
	var ae *client.Error
	if errors.As(err, &ae) && (ae.StatusCode != 409 || ae.Reason != api.ReasonConflict) {
		t.Errorf("a registration the check refuses: %d %s, want 409 %s", ae.StatusCode, ae.Reason, api.ReasonConflict)
	}
	if ws := b.Workers(); len(ws) != 0 {
		t.Errorf("a refused registration was written: %+v", ws)
	}
	if err := c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 7, BlockSize: 16, Model: "free"}); err != nil {
		t.Errorf("a registration the check takes: %v", err)
	}
	if checked != 2 || unlocked != 0 {
		t.Errorf("the check ran %d times (want 2), %d of them without the worker-table lock", checked, unlocked)
	}
}
