package raftfsm

import (
	"errors"
	"testing"

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
