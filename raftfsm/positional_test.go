package raftfsm

import (
	"errors"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestPositionalBatchOfAnUnlistedRankAppliesNothing: from a review. After
// one dp rank of an agentless (Positional) worker was unregistered (the
// worker registered again without it), the leader's subscriber of that
// rank ran on until its next poll, and its batches applied: the rank got
// blocks and a cursor back that no sweep removed (its worker is
// registered), and a later registration of the rank resumed from that
// ghost's cursor with its blocks. Now such a batch applies nothing, sets
// no cursor and is acked Unregistered; the worker's listed ranks apply as
// before, and the rank registered again starts clean.
func TestPositionalBatchOfAnUnlistedRankAppliesNothing(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}, Positional: true}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	r0, r1 := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 1}
	pos := func(seq uint64) uint64 { return seq<<12 | 1 } // compat.Position(0, seq, 1)
	ingest := func(r kvevent.Rank, seq uint64) RankAck {
		t.Helper()
		acks, err := n.IngestEvents(ctx(t), []RankBatch{{Rank: r, Events: chainEvents(r, pos(seq), 1, 100*uint64(r.DP+1)+seq)}})
		if err != nil || len(acks) != 1 {
			t.Fatalf("ingest %v batch %d: %v %v", r, seq, acks, err)
		}
		return acks[0]
	}
	if a := ingest(r1, 3); a.Applied != 1 || a.Unregistered {
		t.Fatalf("a listed rank's batch: %+v", a)
	}
	w.DPRanks = []uint32{0} // unregister dp 1
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	if a := ingest(r1, 4); !a.Unregistered || a.Applied != 0 || a.Cursor != 0 {
		t.Fatalf("the unlisted rank's batch: ack %+v, want nothing applied, Unregistered", a)
	}
	if a := ingest(r0, 4); a.Applied != 1 || a.Unregistered {
		t.Fatalf("the listed rank's batch after: %+v", a)
	}
	if cur := n.Cursor(r1); cur != 0 {
		t.Fatalf("the unlisted rank has cursor %#x", cur)
	}
	if d, err := n.DumpRank(r1); err == nil && len(d.StoredEvents()) != 0 {
		t.Fatalf("the unlisted rank holds %d blocks", len(d.StoredEvents()))
	}
	if h := n.fsm.LastHeard(r1); h != 0 {
		t.Fatalf("the unlisted rank was heard at %d", h)
	}
	w.DPRanks = []uint32{0, 1}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	if cur := n.Cursor(r1); cur != 0 {
		t.Fatalf("the rank registered again resumes at %#x", cur)
	}
	if a := ingest(r1, 9); a.Applied != 1 || a.Cursor != pos(9) {
		t.Fatalf("the rank registered again: %+v", a)
	}
}

// TestPositionalDumpOfAnUnlistedRankAppliesNothing: from a review. A dump
// of a rank that its Positional worker does not list applied (an agent's
// Resync of every rank at its start, a gap, a fence), while the same rank's
// events were refused: it planted blocks and a cursor that no sweep takes
// away (the worker is registered). Now such a dump applies nothing, sets no
// cursor and fails with ErrUnregisteredRank; a dump of a listed rank
// applies as before.
func TestPositionalDumpOfAnUnlistedRankAppliesNothing(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}, Positional: true}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	r0, r1 := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 1}
	err := n.ReplaceRankFenced(ctx(t), r1, 7, 3, chainEvents(r1, 1, 2, 100))
	if !errors.Is(err, ErrUnregisteredRank) {
		t.Fatalf("a dump of the unlisted rank: %v, want ErrUnregisteredRank", err)
	}
	if cur := n.Cursor(r1); cur != 0 {
		t.Fatalf("the unlisted rank has cursor %d", cur)
	}
	if d, err := n.DumpRank(r1); err == nil && len(d.StoredEvents()) != 0 {
		t.Fatalf("the unlisted rank holds %d blocks", len(d.StoredEvents()))
	}
	if h := n.fsm.LastHeard(r1); h != 0 {
		t.Fatalf("the unlisted rank was heard at %d", h)
	}
	if err := n.ReplaceRankFenced(ctx(t), r0, 7, 3, chainEvents(r0, 1, 2, 200)); err != nil {
		t.Fatalf("a dump of the listed rank: %v", err)
	}
	if cur := n.Cursor(r0); cur != 7 {
		t.Fatalf("the listed rank's cursor after its dump: %d, want 7", cur)
	}
	// Listed, the rank takes the dump.
	w.DPRanks = []uint32{0, 1}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	if err := n.ReplaceRankFenced(ctx(t), r1, 7, 3, chainEvents(r1, 1, 2, 100)); err != nil {
		t.Fatalf("a dump of the rank once listed: %v", err)
	}
	if d, err := n.DumpRank(r1); err != nil || len(d.StoredEvents()) == 0 || n.Cursor(r1) != 7 {
		t.Fatalf("the rank once listed: cursor %d, dump %v", n.Cursor(r1), err)
	}
}

// TestPositionalRegistrationDropsAnUnlistedRankDumpedBefore: from a review.
// A dump of a rank applies while its worker is not registered (kvagent
// resyncs every rank at its start, before a compat registration may have
// committed). The worker then registered Positional without that dp rank,
// and nothing removed the rank's blocks and cursor: the registration only
// dropped ranks the previous registration listed, and the leader's sweep
// (UnregisteredRanks) only takes ranks of unregistered workers. A later
// registration listing the rank resumed at the agent's cursor. Now the
// Positional registration drops every rank of the worker it does not list.
func TestPositionalRegistrationDropsAnUnlistedRankDumpedBefore(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	r1 := kvevent.Rank{Worker: 1, DP: 1}
	if err := n.ReplaceRankFenced(ctx(t), r1, 7, 3, chainEvents(r1, 1, 2, 100)); err != nil {
		t.Fatalf("a dump of a rank of an unregistered worker: %v", err)
	}
	if n.Cursor(r1) != 7 {
		t.Fatalf("the dump before the registration: cursor %d, want 7", n.Cursor(r1))
	}
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}, Positional: true}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	checkRankClean(t, n, r1, "after the Positional registration without it")
	w.DPRanks = []uint32{0, 1}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	checkRankClean(t, n, r1, "once listed")
}

// TestPositionalRegistrationDropsAnUnlistedRankOfANonPositionalWorker: from
// a review. A worker registered non-Positional takes events of a dp rank it
// does not list (an agent may publish before a registration lists the
// rank); when the worker then registered Positional, the rank kept its
// blocks and cursor. Now the switch drops them; the listed rank keeps its
// own.
func TestPositionalRegistrationDropsAnUnlistedRankOfANonPositionalWorker(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	r0, r1 := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 1}
	acks, err := n.IngestEvents(ctx(t), []RankBatch{
		{Rank: r0, Events: chainEvents(r0, 1, 2, 200)},
		{Rank: r1, Events: chainEvents(r1, 1, 2, 100)},
	})
	if err != nil || len(acks) != 2 || acks[0].Applied != 2 || acks[1].Applied != 2 {
		t.Fatalf("events of a non-Positional worker's ranks: %+v %v", acks, err)
	}
	w.Positional = true
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	checkRankClean(t, n, r1, "after the worker registered Positional")
	if cur := n.Cursor(r0); cur != 2 {
		t.Fatalf("the listed rank's cursor after the switch: %d, want 2", cur)
	}
	if d, err := n.DumpRank(r0); err != nil || len(d.StoredEvents()) != 2 {
		t.Fatalf("the listed rank after the switch: %v", err)
	}
}

// TestPositionalRegistrationDropsTheHeardTimeOfAnUnlistedRank: a rank of
// a non-Positional worker that its worker does not list, heard of only
// through a batch that began past a gap (no cursor, no blocks), loses its
// last-heard time when the worker registers Positional without it, as a
// rank with a cursor does (droppedRanks finds it through the last-heard
// times): a kept one would be an unlisted rank's, that no sweep takes.
func TestPositionalRegistrationDropsTheHeardTimeOfAnUnlistedRank(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	r1 := kvevent.Rank{Worker: 1, DP: 1}
	wi := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}}
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &wi)),
		w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: chainEvents(r1, 3, 1, 100)}})),
	})
	if a := res[1].([]RankAck)[0]; !a.Gap || f.HasCursor(r1) || f.LastHeard(r1) != 2 {
		t.Fatalf("a batch of an unlisted rank beginning past a gap: ack %+v, cursor %v, last heard %d; want a gap, no cursor, heard at 2",
			a, f.HasCursor(r1), f.LastHeard(r1))
	}
	wi.Positional = true
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(3, &wi))})
	if h := f.LastHeard(r1); h != 0 {
		t.Fatalf("rank %v keeps last-heard time %d after its worker registered Positional without it", r1, h)
	}
}

// TestPositionalRankListedLaterTakesTheEnginesFirstBatch: from a review.
// The cursor an agent's dump left (its own numbering) on a rank that the
// Positional registration did not list made the engine's first positions,
// once a registration listed the rank, duplicates: they were acked and
// lost. Now the rank starts clean and the first batch applies.
func TestPositionalRankListedLaterTakesTheEnginesFirstBatch(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	r1 := kvevent.Rank{Worker: 1, DP: 1}
	if err := n.ReplaceRankFenced(ctx(t), r1, 5000, 3, chainEvents(r1, 1, 2, 100)); err != nil {
		t.Fatal(err)
	}
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}, Positional: true}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	w.DPRanks = []uint32{0, 1}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	pos := uint64(1)<<12 | 1 // compat.Position(0, 1, 1): the engine's first batch
	acks, err := n.IngestEvents(ctx(t), []RankBatch{{Rank: r1, Events: chainEvents(r1, pos, 1, 900)}})
	if err != nil || len(acks) != 1 {
		t.Fatalf("%+v %v", acks, err)
	}
	if a := acks[0]; a.Applied != 1 || a.Dups != 0 || a.Cursor != pos {
		t.Fatalf("the engine's first batch of the rank listed later: %+v, want it applied at %#x", a, pos)
	}
}

// checkRankClean fails unless r holds no cursor, incarnation, blocks or
// last-heard time, and no sweep lists it.
func checkRankClean(t *testing.T, n *Node, r kvevent.Rank, what string) {
	t.Helper()
	if cur := n.Cursor(r); cur != 0 {
		t.Fatalf("%s: rank %v keeps cursor %d", what, r, cur)
	}
	if inc := n.fsm.Incarnation(r); inc != 0 {
		t.Fatalf("%s: rank %v keeps incarnation %d", what, r, inc)
	}
	if d, err := n.DumpRank(r); err == nil && len(d.StoredEvents()) != 0 {
		t.Fatalf("%s: rank %v keeps %d blocks", what, r, len(d.StoredEvents()))
	}
	if h := n.fsm.LastHeard(r); h != 0 {
		t.Fatalf("%s: rank %v keeps last-heard time %d", what, r, h)
	}
	if slices.Contains(n.UnregisteredRanks(), r) {
		t.Fatalf("%s: rank %v is in the sweep's list", what, r)
	}
}

// TestBatchOfPositionsAppliesOnlyToAPositionalWorker: from a review. A
// batch marked PositionalIncarnation (the compatible API's agentless
// subscriber) applies only to a listed rank of a worker that is Positional
// as it applies: its worker unregistered, or registered again with
// non-positional ids before the subscriber stopped, it applies nothing and
// is acked Unregistered, and the poster's own first ids apply. It is never
// fenced, and the worker's unmarked batches apply as before.
func TestBatchOfPositionsAppliesOnlyToAPositionalWorker(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	r := kvevent.Rank{Worker: 1}
	ingest := func(inc, first uint64) RankAck {
		t.Helper()
		acks, err := n.IngestEvents(ctx(t), []RankBatch{{Rank: r, Incarnation: inc, Events: chainEvents(r, first, 1, first)}})
		if err != nil || len(acks) != 1 {
			t.Fatalf("ingest incarnation %#x at %d: %v %v", inc, first, acks, err)
		}
		return acks[0]
	}
	if a := ingest(PositionalIncarnation, 1); !a.Unregistered || a.Applied != 0 {
		t.Fatalf("positions of a worker not registered: %+v, want Unregistered", a)
	}
	w := WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}, Positional: true}
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	if a := ingest(PositionalIncarnation, 1<<12|1); a.Applied != 1 || a.Unregistered || a.Fenced {
		t.Fatalf("positions of a Positional worker: %+v", a)
	}
	if err := n.DeregisterWorker(ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	w.Positional = false
	if err := n.RegisterWorker(ctx(t), w); err != nil {
		t.Fatal(err)
	}
	if a := ingest(PositionalIncarnation, 1); !a.Unregistered || a.Applied != 0 {
		t.Fatalf("positions of a worker registered again with non-positional ids: %+v, want Unregistered", a)
	}
	if a := ingest(0, 1); a.Applied != 1 || a.Cursor != 1 {
		t.Fatalf("the poster's first event: %+v, want it applied", a)
	}
}
