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
