package raftfsm

import (
	"context"
	"errors"
	"log/slog"
	"math"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// A registration replaces the worker's dp ranks, and the ranks it drops
// lose their index state. When the worker is registered (its lease live),
// that is most likely two agents given one worker id for different dp
// ranges, replacing each other's: the leader says so at Warn.
func TestRegistrationDroppingRanksOfALiveWorkerIsLogged(t *testing.T) {
	var logs testlog.Buffer
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

// TestRegisteringAnAbsurdCapacity: RegisterWorker refuses a capacity past
// MaxCapacity, and an FSM applying one that an older build committed (it
// took any non-negative capacity) keeps every block rather than panicking.
// From a review: kvagent --capacity-device 9223372036854775807 made every
// replica's apply panic (the index's slack overflowed), at every restart
// too, since the entry stays in the log.
func TestRegisteringAnAbsurdCapacity(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := c.leader().RegisterWorker(ctx, WorkerInfo{ID: 7, BlockSize: 16, Capacity: [4]int64{0, 0, MaxCapacity + 1, 0}})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "capacity") {
		t.Fatalf("RegisterWorker with capacity %d: %v, want ErrInvalid naming the capacity", int64(MaxCapacity+1), err)
	}

	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	f.ApplyBatch([]*raft.Log{
		w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 5, 10)}})),
		w.next(encodeRegister(2, &WorkerInfo{ID: 1, BlockSize: 16, Capacity: [4]int64{math.MaxInt64, math.MaxInt64, math.MaxInt64, math.MaxInt64}})),
		w.next(encodeEvents(3, []RankBatch{{Rank: r1, Events: chainEvents(r1, 6, 1, 20)}})),
	})
	if n := f.Index().Stats().Entries; n != 6 || f.Workers()[1].Capacity[0] != math.MaxInt64 {
		t.Fatalf("entries %d, worker %+v: want all 6 blocks kept and the registration applied", n, f.Workers()[1])
	}
}
