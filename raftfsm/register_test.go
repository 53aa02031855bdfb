package raftfsm

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"pgregory.net/rapid"

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

// TestMaxWorkerIDBlockSizeDoesNotDependOnBatching: worker id MaxUint64 is
// accepted like any other (refusing it now would fail logs that hold it),
// so its block size must route the same however a replica batched its
// registration, and after a restart. From a review: the ^0 "none"
// sentinel of blockSizeOf skipped it while the splice of a one-worker
// batch took it: replicas with equal digests routed with block sizes 32
// and 16.
func TestMaxWorkerIDBlockSizeDoesNotDependOnBatching(t *testing.T) {
	dirA := filepath.Join(t.TempDir(), "a")
	a, b := openTestFSM(t, dirA), openTestFSM(t, filepath.Join(t.TempDir(), "b"))
	defer b.Close()
	var w logWriter
	reg := w.next(encodeRegister(1, &WorkerInfo{ID: math.MaxUint64, DPRanks: []uint32{0}, BlockSize: 32}))
	other := w.next(encodeRegister(1, &WorkerInfo{ID: math.MaxUint64 - 1, DPRanks: []uint32{0}}))
	// a: one entry per batch (a splice each); b: both in one (a rebuild).
	a.ApplyBatch([]*raft.Log{reg})
	a.ApplyBatch([]*raft.Log{other})
	b.ApplyBatch([]*raft.Log{reg, other})
	if a.Digest() != b.Digest() {
		t.Fatalf("digests differ: %#x, %#x", a.Digest(), b.Digest())
	}
	bsA, bsB := a.published().blockSize, b.published().blockSize
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	a2 := openTestFSM(t, dirA)
	defer a2.Close()
	bsA2 := a2.published().blockSize
	if bsA != 32 || bsB != 32 || bsA2 != 32 {
		t.Fatalf("routing block size: entry by entry %d, one batch %d, restarted %d; want worker %d's 32 on each", bsA, bsB, bsA2, uint64(math.MaxUint64))
	}
}

// TestPublishedWorkersMatchARebuildForEdgeIDs: registrations and
// deregistrations of edge-case worker ids (0 and MaxUint64 among them)
// and dp ranks, applied one entry at a time (spliceWorker) and in random
// batches (a rebuild when a batch changed more than one worker): the
// published candidates and block size equal a rebuild from the table on
// both replicas, and after a reopen.
func TestPublishedWorkersMatchARebuildForEdgeIDs(t *testing.T) {
	ids := []uint64{0, 1, 2, math.MaxUint64 - 1, math.MaxUint64}
	dps := [][]uint32{{0}, {math.MaxUint32}, {0, math.MaxUint32}, {math.MaxUint32, 0, 5}, {}, {3, 1}}
	rapid.Check(t, func(rt *rapid.T) {
		open := func(dir string) *FSM {
			f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
			if err != nil {
				rt.Fatal(err)
			}
			return f
		}
		dirA := filepath.Join(t.TempDir(), "a")
		a, b := open(dirA), open(filepath.Join(t.TempDir(), "b"))
		defer b.Close()
		check := func(what string, f *FSM) {
			var rebuilt FSM
			rebuilt.setWorkers(maps.Clone(f.Workers()))
			got, want := f.published(), rebuilt.published()
			if !slices.Equal(got.cands, want.cands) {
				rt.Fatalf("%s: candidates %+v, rebuilt %+v", what, got.cands, want.cands)
			}
			if got.blockSize != want.blockSize || got.blockSizeFrom != want.blockSizeFrom || got.hasBlockSize != want.hasBlockSize {
				rt.Fatalf("%s: block size %d of worker %d (%v), rebuilt %d of worker %d (%v)", what,
					got.blockSize, got.blockSizeFrom, got.hasBlockSize, want.blockSize, want.blockSizeFrom, want.hasBlockSize)
			}
		}
		var w logWriter
		var logs []*raft.Log
		for i, n := 0, rapid.IntRange(1, 30).Draw(rt, "n"); i < n; i++ {
			id := rapid.SampledFrom(ids).Draw(rt, "id")
			var data []byte
			if rapid.IntRange(0, 3).Draw(rt, "op") == 0 {
				data = encodeDeregister(1, id)
			} else {
				data = encodeRegister(1, &WorkerInfo{ID: id, DPRanks: slices.Clone(rapid.SampledFrom(dps).Draw(rt, "dps")),
					BlockSize: rapid.SampledFrom([]int{0, 16, 32}).Draw(rt, "bs"),
					Capacity:  [4]int64{rapid.Int64Range(0, 3).Draw(rt, "cap")}})
			}
			l := w.next(data)
			logs = append(logs, l)
			a.ApplyBatch([]*raft.Log{l})
			check("one by one", a)
		}
		for len(logs) > 0 {
			k := rapid.IntRange(1, len(logs)).Draw(rt, "batch")
			b.ApplyBatch(logs[:k])
			check("batched", b)
			logs = logs[k:]
		}
		if va, vb := a.published(), b.published(); va.blockSize != vb.blockSize || !slices.Equal(va.cands, vb.cands) {
			rt.Fatalf("replicas differ: block size %d, %d; candidates %+v, %+v", va.blockSize, vb.blockSize, va.cands, vb.cands)
		}
		want := a.published().blockSize
		if err := a.Close(); err != nil {
			rt.Fatal(err)
		}
		a = open(dirA)
		defer a.Close()
		check("reopened", a)
		if got := a.published().blockSize; got != want {
			rt.Fatalf("block size %d before the reopen, %d after", want, got)
		}
	})
}
