package raftfsm

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// gather scrapes c and returns each sample's value by its name and
// labels, as "name{k=v,...}".
func gather(t *testing.T, c prometheus.Collector) map[string]*dto.Metric {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.Metric{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			key := f.GetName() + "{"
			for i, l := range m.GetLabel() {
				if i > 0 {
					key += ","
				}
				key += l.GetName() + "=" + l.GetValue()
			}
			out[key+"}"] = m
		}
	}
	return out
}

// TestCollectorAnswersTheOperatorsQuestions: the families metrics.md asks
// of a node carry what happened: the leader it saw take over, its time to
// ready, applies and snapshots timed, its disk, live bookings, and each
// worker's blocks, load and silence.
func TestCollectorAnswersTheOperatorsQuestions(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 7, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	r := kvevent.Rank{Worker: 7}
	ev := kvevent.Event{Rank: r, EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned}
	for i, h := range kvevent.LocalHashes(nil, tokens, 4, kvevent.Seed) {
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: uint64(100 + i), LocalHash: h})
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r, Events: []kvevent.Event{ev}}})
	if res, err := l.Route(ctx(t), RouteQuery{Tokens: append(tokens, 9, 10, 11, 12, 13), Book: true, RequestID: "req-1"}); err != nil || !res.Booked {
		t.Fatalf("book: %v %+v", err, res)
	}
	if err := l.await(ctx(t), l.raft.Snapshot()); err != nil {
		t.Fatal(err)
	}
	if err := l.WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the node to see its leader", func() bool { return l.leaderChanges.Load() > 0 })
	busyAt := indexer.DefaultParams()
	busyAt.BusyPrefillTokens = 1 // the booked request's prefill is over it
	if err := l.SetSettings(ctx(t), Settings{Params: busyAt}); err != nil {
		t.Fatal(err)
	}

	m := gather(t, NewCollector(l))
	want := func(key string, ok func(v float64) bool) {
		t.Helper()
		s, found := m[key]
		if !found {
			t.Fatalf("no sample %s", key)
		}
		v := s.GetGauge().GetValue() + s.GetCounter().GetValue() + float64(s.GetHistogram().GetSampleCount())
		if !ok(v) {
			t.Fatalf("%s = %v", key, v)
		}
	}
	positive := func(v float64) bool { return v > 0 }
	is := func(w float64) func(float64) bool { return func(v float64) bool { return v == w } }
	want("kvrouter_raft_leader_changes_total{}", is(1))
	want("kvrouter_startup_ready_seconds{}", positive)
	want("kvrouter_raft_apply_duration_seconds{}", positive)
	want("kvrouter_raft_snapshot_duration_seconds{}", is(1))
	want("kvrouter_store_disk_bytes{store=raft}", positive)
	want("kvrouter_store_disk_bytes{store=fsm}", positive)
	want("kvrouter_store_disk_bytes{store=snapshots}", positive)
	want("kvrouter_bookings_active{}", is(1))
	want("kvrouter_bookings_expired_total{}", is(0))
	want("kvrouter_index_worker_blocks{tier=host,worker=7}", is(2))
	want("kvrouter_index_worker_blocks{tier=device,worker=7}", is(0))
	want("kvrouter_worker_silent{worker=7}", is(0))
	want("kvrouter_worker_active_prefill_tokens{worker=7}", positive)
	want("kvrouter_worker_active_decode_blocks{worker=7}", positive)
	want("kvrouter_worker_busy{worker=7}", is(1))
	want("kvrouter_index_memory_bytes{}", positive)
	want("kvrouter_events_applied_total{op=store,outcome=applied,tier=host}", is(1))
	want("kvrouter_events_applied_total{op=store,outcome=duplicate,tier=host}", is(0))
	want("kvrouter_index_lookup_duration_seconds{}", is(1)) // the route's
	want("kvrouter_state_digest_checks_total{}", is(0))     // no check in this test's 30s
	want("kvrouter_state_digest_mismatch_total{}", is(0))
	want("kvrouter_configuration_mismatch_total{}", is(0)) // one node: its own list
	want("kvrouter_store_write_stall_seconds_total{store=raft}", is(0))
	want("kvrouter_store_write_stall_seconds_total{store=fsm}", is(0))
	want("kvrouter_raft_inbound_connections_closed_total{reason=over_limit}", is(0)) // the members' connections
	want("kvrouter_raft_inbound_connections_closed_total{reason=silent}", is(0))
	want("kvrouter_raft_inbound_connections_closed_total{reason=other_cluster}", is(0)) // one cluster
	if _, ok := m["kvrouter_restore_duration_seconds{}"]; ok {
		t.Fatal("a restore duration before any restore")
	}
}

// TestExpiredBookingsAreCounted: kvrouter_bookings_expired_total counts
// the bookings an expiry sweep removed (never freed); a booking freed
// before the sweep is not among them. From a review: it was read only at
// 0, and nothing failed with the sweep's count dropped.
func TestExpiredBookingsAreCounted(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 7, BlockSize: 4, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"req-1", "req-2", "req-freed"} {
		if res, err := l.Route(ctx(t), RouteQuery{ISL: 8, Book: true, RequestID: id}); err != nil || !res.Booked {
			t.Fatalf("book %s: %v %+v", id, err, res)
		}
	}
	if err := l.Free(ctx(t), "req-freed"); err != nil {
		t.Fatal(err)
	}
	sweepAhead(t, l, 10*time.Minute) // past the bookings' max age
	m := gather(t, NewCollector(l))
	for key, want := range map[string]float64{"kvrouter_bookings_expired_total{}": 2, "kvrouter_bookings_active{}": 0} {
		s, ok := m[key]
		if !ok {
			t.Fatalf("no sample %s", key)
		}
		if v := s.GetGauge().GetValue() + s.GetCounter().GetValue(); v != want {
			t.Fatalf("%s = %v after a sweep expired two bookings (a third freed before it), want %v", key, v, want)
		}
	}
}

// TestLeaderChangesCountEveryTakeOver: each leader a node sees take over
// counts, a term each, the same node winning again too.
func TestLeaderChangesCountEveryTakeOver(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	l := c.leader()
	other := c.nodes[0]
	if other == l {
		other = c.nodes[1]
	}
	transferLeadership(t, l, other.cfg.ID)
	waitFor(t, 10*time.Second, "the new leader", other.IsLeader)
	transferLeadership(t, other, l.cfg.ID)
	waitFor(t, 10*time.Second, "the first leader to lead again", l.IsLeader)
	for _, n := range c.nodes {
		waitFor(t, 10*time.Second, n.cfg.ID+" to count three take-overs", func() bool { return n.leaderChanges.Load() >= 3 })
	}
}

// TestCollectorSumsAWorkersRanks: a worker's index_worker_blocks,
// worker_active_prefill_tokens and worker_active_decode_blocks sum its dp
// ranks', not take the last rank's.
func TestCollectorSumsAWorkersRanks(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 9, BlockSize: 4, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	hashes := kvevent.LocalHashes(nil, tokens, 4, kvevent.Seed)
	var batches []RankBatch
	for dp, n := range []int{2, 1} { // rank 0 holds both blocks, rank 1 the first
		r := kvevent.Rank{Worker: 9, DP: uint32(dp)}
		ev := kvevent.Event{Rank: r, EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned}
		for i, h := range hashes[:n] {
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: uint64(100 + i), LocalHash: h})
		}
		batches = append(batches, RankBatch{Rank: r, Events: []kvevent.Event{ev}})
	}
	ingestRetrying(t, c, batches)
	for dp := range uint32(2) { // a booking on each rank
		only := func(r kvevent.Rank) bool { return r.DP == dp }
		q := RouteQuery{Tokens: append(tokens, 9, 10, 11, 12, 13), Book: true, RequestID: fmt.Sprint("req-", dp), Filter: only}
		if res, err := l.Route(ctx(t), q); err != nil || !res.Booked {
			t.Fatalf("book on dp rank %d: %v %+v", dp, err, res)
		}
	}
	var prefill, decode int64
	for _, w := range l.Workers() {
		for _, rs := range w.Ranks {
			if rs.Load.ActivePrefillTokens == 0 || rs.Load.ActiveDecodeBlocks == 0 {
				t.Fatalf("a rank has no load (%+v): the sums would not tell a rank's figure apart", rs)
			}
			prefill += rs.Load.ActivePrefillTokens
			decode += rs.Load.ActiveDecodeBlocks
		}
	}
	m := gather(t, NewCollector(l))
	for key, want := range map[string]float64{
		"kvrouter_index_worker_blocks{tier=host,worker=9}": 3,
		"kvrouter_worker_active_prefill_tokens{worker=9}":  float64(prefill),
		"kvrouter_worker_active_decode_blocks{worker=9}":   float64(decode),
	} {
		if s, ok := m[key]; !ok || s.GetGauge().GetValue() != want {
			t.Errorf("%s = %v (found %v), want %v", key, s.GetGauge().GetValue(), ok, want)
		}
	}
}

// TestCollectorDoesNotWaitForTheApplyLock: a scrape answers while an
// ApplyBatch holds the state machine's apply lock. From a review: Collect
// read Node.Status, whose AppliedDigest waits for that lock (held for a
// whole batch: a large rank dump takes seconds) and, holding it, computed
// the whole state's digest, which no family exports.
func TestCollectorDoesNotWaitForTheApplyLock(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	col := NewCollector(l)
	want, _ := l.fsm.Applied()
	l.fsm.stateMu.Lock() // an ApplyBatch in progress
	done := make(chan float64)
	go func() {
		ch := make(chan prometheus.Metric, 4096)
		col.Collect(ch)
		close(ch)
		applied := -1.0
		for m := range ch {
			if m.Desc() == col.applied {
				var d dto.Metric
				if err := m.Write(&d); err == nil {
					applied = d.GetGauge().GetValue()
				}
			}
		}
		done <- applied
	}()
	select {
	case applied := <-done:
		l.fsm.stateMu.Unlock()
		if applied != float64(want) {
			t.Fatalf("kvrouter_raft_applied_index = %v, want %d", applied, want)
		}
	case <-time.After(2 * time.Second):
		l.fsm.stateMu.Unlock()
		<-done
		t.Fatal("a scrape waited 2s for the state machine's apply lock")
	}
}

// TestASkippedGarbledEntryIsCountedAsMalformed: a garbled Raft entry
// (truncated: no build writes it) is skipped, not halted at, and counted
// in kvrouter_events_rejected_total{reason="malformed"}, beside the
// index's malformed events, as docs/operations.md ("Upgrade") says. From
// a review: the FSM's count could be dropped from the family and every
// test passed.
func TestASkippedGarbledEntryIsCountedAsMalformed(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	rejected := func() float64 {
		t.Helper()
		s, ok := gather(t, NewCollector(l))["kvrouter_events_rejected_total{reason=malformed}"]
		if !ok {
			t.Fatal("no sample kvrouter_events_rejected_total{reason=malformed}")
		}
		return s.GetCounter().GetValue()
	}
	before := rejected()
	f := l.raft.Apply([]byte{commandVersion, uint8(cmdRegister)}, 5*time.Second) // no time, no worker
	if err := l.await(ctx(t), f); err != nil {
		t.Fatal(err)
	}
	if err, ok := f.Response().(error); !ok || !errors.Is(err, ErrBadCommand) || errors.Is(err, ErrLaterBuild) {
		t.Fatalf("the garbled entry's response: %v, want ErrBadCommand (skipped, not a halt)", f.Response())
	}
	if got := rejected(); got != before+1 {
		t.Fatalf("kvrouter_events_rejected_total{reason=malformed} %v after a garbled entry, want %v", got, before+1)
	}
	if l.fsm.Halted() != nil {
		t.Fatalf("halted at a garbled entry: %v", l.fsm.Halted())
	}
}

// TestWorkerBusyOnlyWhenAllItsRanksAre pins semantics.md §5, "a worker is
// busy only when all its ranks are", on kvrouter_worker_busy: a worker of
// two dp ranks, one over busy_prefill_tokens and one idle, still takes
// routes (through its idle rank), so the gauge an operator alerts on must
// read 0 for it; it reads 1 only once both ranks are over the threshold.
func TestWorkerBusyOnlyWhenAllItsRanksAre(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 9, BlockSize: 4, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	busyAt := indexer.DefaultParams()
	busyAt.BusyPrefillTokens = 1
	if err := l.SetSettings(ctx(t), Settings{Params: busyAt}); err != nil {
		t.Fatal(err)
	}
	book := func(dp uint32) {
		t.Helper()
		only := func(r kvevent.Rank) bool { return r.DP == dp }
		q := RouteQuery{ISL: 8, Book: true, RequestID: fmt.Sprint("req-", dp), Filter: only}
		if res, err := l.Route(ctx(t), q); err != nil || !res.Booked {
			t.Fatalf("book on dp rank %d: %v %+v", dp, err, res)
		}
	}
	busyGauge := func() float64 {
		t.Helper()
		s, ok := gather(t, NewCollector(l))["kvrouter_worker_busy{worker=9}"]
		if !ok {
			t.Fatal("no sample kvrouter_worker_busy{worker=9}")
		}
		return s.GetGauge().GetValue()
	}
	book(0) // rank 0 is over the threshold, rank 1 idle
	if res, err := l.Route(ctx(t), RouteQuery{ISL: 8}); err != nil || res.Decision.Rank.DP != 1 {
		t.Fatalf("route with one rank busy: %v %+v (want dp rank 1)", err, res.Decision.Rank)
	}
	if v := busyGauge(); v != 0 {
		t.Fatalf("kvrouter_worker_busy{worker=9} = %v with one of its two ranks busy and the worker taking routes, want 0", v)
	}
	book(1)
	if v := busyGauge(); v != 1 {
		t.Fatalf("kvrouter_worker_busy{worker=9} = %v with both ranks busy, want 1", v)
	}
}

// TestRankBusyCountsDecodeBlocksAgainstDeviceCapacity: a rank's busy in
// Workers (GET /v1/workers, kvctl workers) holds its active decode blocks
// to busy_decode_fraction of its worker's device capacity, as the scorer
// does (semantics.md §5), not another tier's. Two workers of one rank each
// carry 8 decode blocks at a fraction of 0.5: worker 1 (device 10, host
// 100) is over 5 and busy, worker 2 (device 100, host 10) under 50 and
// not. From a review: reading the host capacity passed every test.
func TestRankBusyCountsDecodeBlocksAgainstDeviceCapacity(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	capacity := map[uint64][kvevent.NumTiers]int64{
		1: {kvevent.TierDevice: 10, kvevent.TierHostPinned: 100},
		2: {kvevent.TierDevice: 100, kvevent.TierHostPinned: 10},
	}
	for id, cp := range capacity {
		if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 4, DPRanks: []uint32{0}, Capacity: cp}); err != nil {
			t.Fatal(err)
		}
	}
	p := indexer.DefaultParams()
	p.BusyDecodeFraction = 0.5
	if err := l.SetSettings(ctx(t), Settings{Params: p}); err != nil {
		t.Fatal(err)
	}
	for id := range capacity {
		only := func(r kvevent.Rank) bool { return r.Worker == id }
		hashes := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
		q := RouteQuery{LocalHashes: hashes, ISL: 32, Book: true, RequestID: fmt.Sprint("req-", id), Filter: only}
		if res, err := l.Route(ctx(t), q); err != nil || !res.Booked || res.Decision.Rank.Worker != id {
			t.Fatalf("book on worker %d: %v %+v", id, err, res)
		}
	}
	want := map[uint64]bool{1: true, 2: false}
	ws := l.Workers()
	if len(ws) != 2 {
		t.Fatalf("%d workers, want 2", len(ws))
	}
	for _, w := range ws {
		r := w.Ranks[0]
		if r.Load.ActiveDecodeBlocks != 8 {
			t.Fatalf("worker %d: %d active decode blocks, want 8", w.Info.ID, r.Load.ActiveDecodeBlocks)
		}
		if r.Busy != want[w.Info.ID] {
			t.Errorf("worker %d (capacity %v): rank busy %v with 8 decode blocks at fraction 0.5, want %v (of its device capacity)",
				w.Info.ID, w.Info.Capacity, r.Busy, want[w.Info.ID])
		}
	}
}

// TestUnknownRemovesAreCounted: kvrouter_events_unknown_removes_total
// counts, through the state machine, each hash of a remove that the rank
// did not hold in the remove's tier (semantics.md §3: counted and
// ignored), and not a remove of a block the rank held. From a review: no
// test read the family through the FSM.
func TestUnknownRemovesAreCounted(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 7, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	r := kvevent.Rank{Worker: 7}
	tokens := []uint32{1, 2, 3, 4}
	st := kvevent.Event{Rank: r, EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
		Blocks: []kvevent.Block{{EngineHash: 100, LocalHash: kvevent.LocalHashes(nil, tokens, 4, kvevent.Seed)[0]}}}
	known := kvevent.Event{Rank: r, EventID: 2, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{100}}
	unknown := kvevent.Event{Rank: r, EventID: 3, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{5, 6}}
	acks := ingestRetrying(t, c, []RankBatch{{Rank: r, Events: []kvevent.Event{st, known, unknown}}})
	if acks[0].Applied != 3 {
		t.Fatalf("ack %+v, want 3 applied", acks[0])
	}
	key := "kvrouter_events_unknown_removes_total{}"
	s, ok := gather(t, NewCollector(l))[key]
	if !ok {
		t.Fatalf("no sample %s", key)
	}
	if got := s.GetCounter().GetValue(); got != 2 {
		t.Fatalf("%s = %v after a remove of a held block and one of 2 hashes never stored, want 2", key, got)
	}
}
