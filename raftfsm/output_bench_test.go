package raftfsm

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
)

// The shape of BenchmarkOutputBlocksOfOneRequest's request: a prompt of
// obPrompt blocks, then obOutput output blocks, each its own entry (as
// Node.OutputBlock proposes them), handed to the FSM obPerApply at a time
// (Raft's batches under load: its MaxAppendEntries, 64).
const (
	obPrompt   = 512
	obOutput   = 256
	obPerApply = 64
)

// outputRequest applies one request's lifecycle through the FSM as the
// route and lifecycle API send it: the booking (one bookAdd entry), its
// output blocks and its free. It returns the bytes the request staged in
// the group batch, read at a group boundary: the booking is still live
// when the group commits (the worst case for what the group holds of it);
// the free goes into the next group.
func outputRequest(tb testing.TB, f *FSM, w *logWriter, id string, seq []uint64, logs []*raft.Log) (staged int) {
	tb.Helper()
	n0 := f.batch.Len()
	f.ApplyBatch([]*raft.Log{w.next(encodeBook(10, []bookOp{{kind: bookAdd, b: Booking{ID: id, Rank: r1, SeqHashes: seq, ISL: 16 * len(seq)}}}))})
	for i := 0; i < obOutput; i += obPerApply {
		logs = logs[:0]
		for j := i; j < min(i+obPerApply, obOutput); j++ {
			h := uint64(1<<40) + uint64(j)
			logs = append(logs, w.next(encodeBook(11, []bookOp{{kind: bookOutput, b: Booking{ID: id, SeqHashes: []uint64{h}}}})))
		}
		f.ApplyBatch(logs)
	}
	staged = groupLen(f) - n0
	if err := f.commitGroup(); err != nil {
		tb.Fatal(err)
	}
	n0 = f.batch.Len()
	f.ApplyBatch([]*raft.Log{w.next(encodeBook(12, []bookOp{{kind: bookFree, b: Booking{ID: id}}}))})
	return staged + f.batch.Len() - n0
}

// groupLen is the open group's size as it would commit.
func groupLen(f *FSM) int { return f.batch.Len() }

// BenchmarkOutputBlocksOfOneRequest measures the apply of one request's
// booking, output blocks and free (outputRequest); staged_B/op is what it
// wrote into the group batch, which every replica commits to its state
// database.
func BenchmarkOutputBlocksOfOneRequest(b *testing.B) {
	f := openTestFSM(b, filepath.Join(b.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(b, f, &w)
	seq := make([]uint64, obPrompt)
	for i := range seq {
		seq[i] = uint64(1_000_000 + i)
	}
	logs := make([]*raft.Log, 0, obPerApply)
	var staged int
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		staged += outputRequest(b, f, &w, fmt.Sprint("req-", i), seq, logs)
	}
	b.ReportMetric(float64(staged)/float64(b.N), "staged_B/op")
}
