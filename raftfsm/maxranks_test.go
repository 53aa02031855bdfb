package raftfsm

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestARegistrationPastMaxRanksIsRefusedBeforeTheLog: nothing bounded the
// cluster's registered ranks (only each worker's, 4096), and 200 workers
// of 4096 ranks took a router from 46 MB to 1 GB and a route to 17.7 s.
// The leader refuses a registration that would pass Config.MaxRanks, with
// nothing proposed, and lets a re-registration of as many ranks or fewer
// through at the bound.
func TestARegistrationPastMaxRanksIsRefusedBeforeTheLog(t *testing.T) {
	// No expiry sweep or digest check: the test reads the log's growth.
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.MaxRanks, cfg.ExpiryInterval, cfg.CheckInterval = 6, time.Hour, time.Hour })
	n := c.leader()
	ranks := func(k int) []uint32 {
		out := make([]uint32, k)
		for i := range out {
			out[i] = uint32(i)
		}
		return out
	}
	for id, k := range []int{4, 2} { // 6 in all: at the bound
		if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: uint64(id), DPRanks: ranks(k), BlockSize: 16}); err != nil {
			t.Fatalf("worker %d, %d ranks: %v", id, k, err)
		}
	}
	last := n.raft.LastIndex()
	err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 9, DPRanks: ranks(1), BlockSize: 16})
	if !errors.Is(err, ErrTooManyRanks) || !errors.Is(err, ErrInsufficientStorage) {
		t.Fatalf("a 7th rank: %v, want ErrTooManyRanks", err)
	}
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: ranks(3), BlockSize: 16}); !errors.Is(err, ErrTooManyRanks) {
		t.Fatalf("worker 1 growing from 2 ranks to 3: %v, want ErrTooManyRanks", err)
	}
	if got := n.raft.LastIndex(); got != last {
		t.Fatalf("the log grew from %d to %d: a refused registration was proposed", last, got)
	}
	if _, ok := n.fsm.Workers()[9]; ok {
		t.Fatal("worker 9 was registered")
	}
	for _, k := range []int{4, 3} { // the same ranks again, then fewer
		if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 0, DPRanks: ranks(k), BlockSize: 16}); err != nil {
			t.Fatalf("worker 0 registering again with %d ranks at the bound: %v", k, err)
		}
	}
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 9, DPRanks: ranks(1), BlockSize: 16}); err != nil {
		t.Fatalf("a rank into the room worker 0 left: %v", err)
	}
	if got := n.fsm.RankCount(); got != 6 {
		t.Fatalf("registered ranks = %d, want 6", got)
	}
}

// TestARegistrationEndedByItsContextStillCountsItsRanks: a registration
// whose caller's context ends after its entry is proposed, before it
// applies, released its ranks then (a deferred release), while its entry
// still committed: a second registration took the same room, both
// applied, and the cluster held 8 ranks with MaxRanks 6. The ranks stay
// counted until Raft answers the entry.
func TestARegistrationEndedByItsContextStillCountsItsRanks(t *testing.T) {
	g := newFSMGate()
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.MaxRanks, cfg.ExpiryInterval, cfg.CheckInterval = 6, time.Hour, time.Hour
		cfg.applyGate = g.gate
	})
	t.Cleanup(g.open)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0, 1, 2, 3}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	g.pause() // the next batch waits: proposed, committed, not applied
	// Worker 2's context ends once its entry is in the log, not after a
	// fixed time: a timeout could end it first on a loaded machine, and
	// an entry never proposed never applies.
	short, cancel := context.WithCancel(context.Background())
	defer cancel()
	before := n.raft.LastIndex()
	done2 := make(chan error, 1)
	go func() { done2 <- n.RegisterWorker(short, WorkerInfo{ID: 2, DPRanks: []uint32{0, 1}, BlockSize: 16}) }()
	waitFor(t, 10*time.Second, "worker 2's entry to be proposed", func() bool {
		for i := before + 1; i <= n.raft.LastIndex(); i++ {
			var e raft.Log
			if err := n.logs.GetLog(i, &e); err != nil {
				t.Fatalf("log entry %d: %v", i, err)
			}
			if e.Type == raft.LogCommand && len(e.Data) > 1 && cmdType(e.Data[1]) == cmdRegister {
				return true
			}
		}
		return false
	})
	cancel()
	if err := <-done2; err == nil {
		t.Fatal("worker 2's registration applied through a paused FSM")
	}
	// Worker 3 is refused at once, or (the room released) proposed.
	last := n.raft.LastIndex()
	done := make(chan error, 1)
	go func() { done <- n.RegisterWorker(ctx(t), WorkerInfo{ID: 3, DPRanks: []uint32{0, 1}, BlockSize: 16}) }()
	var err3 error
	answered := false
	waitFor(t, 10*time.Second, "worker 3 refused or proposed", func() bool {
		select {
		case err3 = <-done:
			answered = true
		default:
		}
		return answered || n.raft.LastIndex() > last
	})
	g.open()
	if !answered {
		err3 = <-done
	}
	waitFor(t, 10*time.Second, "worker 2's entry to apply", func() bool { _, ok := n.fsm.Workers()[2]; return ok })
	if got := n.fsm.RankCount(); got > 6 {
		t.Fatalf("registered ranks = %d with MaxRanks 6: worker 2's ranks (its context ended, its entry still committed) were released and worker 3 took the same room (worker 3: %v)", got, err3)
	}
	if !errors.Is(err3, ErrTooManyRanks) {
		t.Fatalf("worker 3: %v, want ErrTooManyRanks", err3)
	}
}

// TestANewLeaderCountsTheRanksItsPredecessorRegistered: a leader elected
// while its FSM still lacks a registration its predecessor acknowledged
// judged that stale table (no post-election Barrier first, as
// checkBlockSize waits for): it let a registration through that, once
// both applied, took the cluster past MaxRanks.
func TestANewLeaderCountsTheRanksItsPredecessorRegistered(t *testing.T) {
	c, l, n3, g := gatedN3(t, func(cfg *Config) { cfg.MaxRanks = 6 })
	c.converged()
	g.pause()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16, Model: "m", DPRanks: []uint32{0, 1, 2, 3}}); err != nil {
		t.Fatal(err)
	}
	c.leadBehind(l, n3)
	// Its context ends while n3's FSM is paused: judged on the stale
	// table, worker 2's entry is proposed by then and commits.
	short, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	err := n3.RegisterWorker(short, WorkerInfo{ID: 2, BlockSize: 16, Model: "m", DPRanks: []uint32{0, 1, 2, 3}})
	g.open()
	if err := n3.WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if err := n3.raft.Barrier(10 * time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	if got := n3.fsm.RankCount(); got > 6 {
		t.Fatalf("registered ranks = %d with MaxRanks 6: the new leader judged worker 2 (4 ranks; %v) against a table without worker 1's 4", got, err)
	}
	if err := n3.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16, Model: "m", DPRanks: []uint32{0, 1, 2, 3}}); !errors.Is(err, ErrTooManyRanks) {
		t.Fatalf("worker 2 once n3 applied worker 1: %v, want ErrTooManyRanks", err)
	}
}
