package raftfsm

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
)

// fullSeq is a prompt of indexer.MaxBookingBlocks blocks: a booking that
// takes no output block.
func fullSeq() []uint64 {
	seq := make([]uint64, indexer.MaxBookingBlocks)
	for i := range seq {
		seq[i] = uint64(1_000_000 + i)
	}
	return seq
}

// TestOutputBlockOfAFullBookingIsRefusedBeforeProposing: OutputBlock (the
// compatible API's output_block) of a request that holds
// indexer.MaxBookingBlocks blocks answers ErrInvalid (400) and proposes
// nothing, instead of growing the booking on every replica without end.
func TestOutputBlockOfAFullBookingIsRefusedBeforeProposing(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	if err := n.Reserve(ctx(t), Booking{ID: "full", Rank: r1, SeqHashes: fullSeq(), ISL: 4 * indexer.MaxBookingBlocks}); err != nil {
		t.Fatal(err)
	}
	last := n.raft.LastIndex()
	err := n.OutputBlock(ctx(t), "full", 7, NoDecay)
	if !errors.Is(err, ErrInvalid) {
		t.Fatalf("output block of a full booking: %v, want ErrInvalid", err)
	}
	t.Log(err)
	if got := n.raft.LastIndex(); got != last {
		t.Fatalf("the log grew from %d to %d: the refused output block was proposed", last, got)
	}
	if err := n.Reserve(ctx(t), Booking{ID: "small", Rank: r1, SeqHashes: []uint64{1}, ISL: 4}); err != nil {
		t.Fatal(err)
	}
	if err := n.OutputBlock(ctx(t), "small", 7, NoDecay); err != nil {
		t.Fatalf("output block of a small booking: %v", err)
	}
}

// TestAResentOutputBlockThatFilledTheBookingIsStillIdempotent:
// OutputBlock is idempotent by (id, h, weight), and the cap's pre-check
// refused (ErrInvalid, 400) a resend of the call whose block filled the
// booking to indexer.MaxBookingBlocks (its answer lost), though it
// changes nothing and its first send succeeded. A block the booking does
// not hold is still refused.
func TestAResentOutputBlockThatFilledTheBookingIsStillIdempotent(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	seq := fullSeq()[:indexer.MaxBookingBlocks-1]
	if err := n.Reserve(ctx(t), Booking{ID: "r", Rank: r1, SeqHashes: seq, ISL: 4 * len(seq)}); err != nil {
		t.Fatal(err)
	}
	if err := n.OutputBlock(ctx(t), "r", 7, NoDecay); err != nil {
		t.Fatalf("the output block that fills the booking: %v", err)
	}
	d := n.fsm.Digest()
	for _, h := range []uint64{7, seq[0]} { // the output block again, a prompt block
		if err := n.OutputBlock(ctx(t), "r", h, NoDecay); err != nil {
			t.Fatalf("block %d, which the full booking holds, again (idempotent by (id, h, weight)): %v", h, err)
		}
	}
	if got := n.fsm.Digest(); got != d {
		t.Fatalf("digest %016x after the resends, was %016x: a held block changed the booking", got, d)
	}
	if err := n.OutputBlock(ctx(t), "r", 8, NoDecay); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a new block of the full booking: %v, want ErrInvalid", err)
	}
}

// TestApplyingAnOutputBlockToAFullBookingChangesNothing: an output block
// entry for a booking that holds indexer.MaxBookingBlocks blocks (proposed
// by a leader that had not yet applied the one that filled it) is refused
// by every replica's apply alike: the booking, the digest and the state
// database stay as they were.
func TestApplyingAnOutputBlockToAFullBookingChangesNothing(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	f.ApplyBatch([]*raft.Log{w.next(encodeBook(10, []bookOp{{kind: bookAdd, b: Booking{ID: "full", Rank: r1, SeqHashes: fullSeq(), ISL: 16 * indexer.MaxBookingBlocks}}}))})
	d := f.Digest()
	f.ApplyBatch([]*raft.Log{w.next(encodeBook(11, []bookOp{{kind: bookOutput, b: Booking{ID: "full", SeqHashes: []uint64{7}}}}))})
	if n, ok := f.Sequences().Blocks("full"); !ok || n != indexer.MaxBookingBlocks {
		t.Fatalf("the full booking holds %d blocks (live %v), want %d", n, ok, indexer.MaxBookingBlocks)
	}
	if f.Digest() != d {
		t.Fatal("the refused output block changed the digest")
	}
	f.Close()
	f = openTestFSM(t, dir)
	defer f.Close()
	if n, _ := f.Sequences().Blocks("full"); n != indexer.MaxBookingBlocks || f.Digest() != d {
		t.Fatalf("reopened: %d blocks, digest changed %v", n, f.Digest() != d)
	}
}
