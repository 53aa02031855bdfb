package raftfsm

import (
	"bytes"
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

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
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

// TestRegisteringADPRankTwiceIsRefused: RegisterWorker refuses a dp rank
// listed twice with ErrInvalid, as the /v1 handler does (one check,
// limits.DPRanks). From a review: only the handler refused it, and a
// worker registered through the Node with dp ranks [0, 0] had rank 0 as
// two route candidates.
func TestRegisteringADPRankTwiceIsRefused(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0, 0}})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "dp rank 0 is listed twice") {
		t.Fatalf("RegisterWorker with dp ranks [0 0]: %v, want ErrInvalid saying dp rank 0 is listed twice", err)
	}
	if _, ok := c.leader().fsm.Workers()[1]; ok {
		t.Fatal("the refused registration was applied")
	}
}

// TestARegistrationEntryWithARepeatedDPRankRegistersEachRankOnce: an entry
// already in a log (an embedding caller's, or one written before
// RegisterWorker checked) that lists a dp rank twice is applied with its
// ranks sorted and each once, rather than refused: the rank is one route
// candidate, whose load the busy threshold sees. From a review: rank 0
// registered twice was two candidates, and route.go's binary search gave
// the rank's load to the first only: the second looked idle and took
// every booked route (8 of 8, past busy_prefill_tokens 64).
func TestARegistrationEntryWithARepeatedDPRankRegistersEachRankOnce(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	p := indexer.DefaultParams()
	p.BusyPrefillTokens = 64
	if err := l.SetSettings(ctx(t), Settings{Params: p, View: indexer.ViewDedup}); err != nil {
		t.Fatal(err)
	}
	// Past RegisterWorker's check, as a log written without it holds it.
	if _, err := l.apply(ctx(t), encodeRegister(now(), &WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{3, 0, 3}})); err != nil {
		t.Fatal(err)
	}
	if got := l.fsm.Workers()[1].DPRanks; !slices.Equal(got, []uint32{0, 3}) {
		t.Fatalf("dp ranks applied %v, want [0 3]", got)
	}
	var ranks []kvevent.Rank
	for _, cand := range l.fsm.published().cands {
		ranks = append(ranks, cand.Rank)
	}
	if want := []kvevent.Rank{{Worker: 1, DP: 0}, {Worker: 1, DP: 3}}; !slices.Equal(ranks, want) {
		t.Fatalf("route candidates %v, want %v", ranks, want)
	}
	tokens := make([]uint32, 64)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	// Two ranks of 64-token prompts, busy over 64 prefill tokens: two each.
	if booked := bookOneAfterAnother(t, l, tokens, 8); booked != 4 {
		t.Fatalf("booked %d routes, want 4 (2 per rank)", booked)
	}
}

// TestASnapshotWorkerWithARepeatedDPRankLoadsEachRankOnce: a snapshot's
// (or the state database's) worker record that lists a dp rank twice, as
// a state built from such an entry by an earlier build holds, loads with
// its ranks sorted and each once, as the entry now applies: one route
// candidate per rank, and the state's other records still accepted.
func TestASnapshotWorkerWithARepeatedDPRankLoadsEachRankOnce(t *testing.T) {
	stream := streamOfRecs([]rec{workerRec(1, WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{1, 0, 1}})})
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	if err := f.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatal(err)
	}
	if got := f.Workers()[1].DPRanks; !slices.Equal(got, []uint32{0, 1}) {
		t.Fatalf("dp ranks loaded %v, want [0 1]", got)
	}
	if n := len(f.published().cands); n != 2 {
		t.Fatalf("%d route candidates, want 2", n)
	}
}

// TestRegisteringAnotherBlockSizeIsRefused: a worker without a model whose
// block size differs from the one the cluster routes with (the smallest
// id's of the other workers) is refused with ErrBlockSizeConflict before
// it is proposed (semantics.md §1: one block size per model, the same for
// every worker): routes would leave it out, or, with the smallest id, every
// other worker. The worker that sets the block size may change it when it
// is alone, a worker with a model is its namespace's to judge (compat),
// and one registered before the rule held registers again unchanged.
func TestRegisteringAnotherBlockSizeIsRefused(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	register := func(w WorkerInfo) error {
		t.Helper()
		return l.RegisterWorker(ctx(t), w)
	}
	if err := register(WorkerInfo{ID: 5, BlockSize: 8}); err != nil {
		t.Fatal(err)
	}
	if err := register(WorkerInfo{ID: 5, BlockSize: 4}); err != nil {
		t.Fatalf("the only worker changing its block size: %v", err)
	}
	for _, w := range []WorkerInfo{{ID: 6, BlockSize: 8}, {ID: 1, BlockSize: 8}} {
		err := register(w)
		if !errors.Is(err, ErrBlockSizeConflict) || !strings.Contains(err.Error(), "routes with block size 4 (worker 5's)") {
			t.Fatalf("worker %d of block size 8 beside worker 5 of 4: %v, want ErrBlockSizeConflict naming block size 4 and worker 5", w.ID, err)
		}
		if _, ok := l.fsm.Workers()[w.ID]; ok {
			t.Fatalf("worker %d's refused registration was applied", w.ID)
		}
	}
	if err := register(WorkerInfo{ID: 6, BlockSize: 4}); err != nil {
		t.Fatalf("a worker of the cluster's block size: %v", err)
	}
	if err := register(WorkerInfo{ID: 5, BlockSize: 8}); !errors.Is(err, ErrBlockSizeConflict) {
		t.Fatalf("worker 5 changing its block size beside worker 6: %v, want ErrBlockSizeConflict", err)
	}
	if err := register(WorkerInfo{ID: 7, BlockSize: 8, Model: "m"}); err != nil {
		t.Fatalf("a worker with a model: %v", err)
	}
	// Past RegisterWorker's check, as a log written before it held it.
	if _, err := l.apply(ctx(t), encodeRegister(now(), &WorkerInfo{ID: 8, BlockSize: 8})); err != nil {
		t.Fatal(err)
	}
	if err := register(WorkerInfo{ID: 8, BlockSize: 8, Endpoint: "w8"}); err != nil {
		t.Fatalf("a worker registered before the rule, registering again with its block size: %v", err)
	}
}
