package raftfsm

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// lockedBuffer is a bytes.Buffer safe for a logger's concurrent writes.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A registration replaces the worker's dp ranks, and the ranks it drops
// lose their index state. When the worker is registered (its lease live),
// that is most likely two agents given one worker id for different dp
// ranges, replacing each other's: the leader says so at Warn.
func TestRegistrationDroppingRanksOfALiveWorkerIsLogged(t *testing.T) {
	var logs lockedBuffer
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	n := c.leader()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, ranks := range [][]uint32{{0, 1, 2}, {0, 1, 2, 3}, nil} {
		if err := n.RegisterWorker(ctx, WorkerInfo{ID: 7, DPRanks: ranks, BlockSize: 16, LeaseMs: 10000}); err != nil {
			t.Fatal(err)
		}
	}
	var warns []string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, "level=WARN") && strings.Contains(l, "dp ranks") {
			warns = append(warns, l)
		}
	}
	// The first registration and the one that adds a rank drop nothing;
	// the last (no ranks: rank 0) drops 1, 2 and 3.
	if len(warns) != 1 || !strings.Contains(warns[0], "worker=7") || !strings.Contains(warns[0], "dropped=\"[1 2 3]\"") ||
		!strings.Contains(warns[0], "index state") {
		t.Fatalf("warnings about dropped dp ranks: %q, want one naming worker 7, ranks [1 2 3] and their index state", warns)
	}
}
