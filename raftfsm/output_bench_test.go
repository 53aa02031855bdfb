package raftfsm

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
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

// groupLen is the open group's size as it would commit: with the
// tracker's changed bookings in it (FSM.commitGroup writes them first).
func groupLen(f *FSM) int {
	f.seqs.FlushJournal()
	return f.batch.Len()
}

// BenchmarkOutputBlocksOfOneRequest measures the apply of one request's
// booking, output blocks and free (outputRequest); staged_B/op is what it
// wrote into the group batch, which every replica commits to its state
// database.
func BenchmarkOutputBlocksOfOneRequest(b *testing.B) {
	f := openTestFSM(b, filepath.Join(b.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(b, f, &w)
	seq := obSeq()
	logs := make([]*raft.Log, 0, obPerApply)
	var staged int
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		staged += outputRequest(b, f, &w, fmt.Sprint("req-", i), seq, logs)
	}
	b.ReportMetric(float64(staged)/float64(b.N), "staged_B/op")
}

// TestOutputBlocksStageBytesLinearInTheBooking: the group batch holds
// O(prompt + output) bytes of a request whose output blocks arrive one
// entry each, not a rewrite of the whole booking per block (which staged
// about obOutput × (obPrompt + obOutput/2) × 8 bytes: 1.3 MB here).
func TestOutputBlocksStageBytesLinearInTheBooking(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	seq := obSeq()
	staged := outputRequest(t, f, &w, "req", seq, nil)
	// Twice the booking's hashes: its record once (the add's may be
	// written apart from the output blocks'), with room for the keys and
	// the other fields.
	if limit := 2*8*(obPrompt+obOutput) + 1024; staged > limit {
		t.Fatalf("one request of %d prompt and %d output blocks staged %d bytes in the group batch, want at most %d (O(prompt+output))",
			obPrompt, obOutput, staged, limit)
	}
	t.Logf("staged %d bytes", staged)
}

// TestReopenAfterOutputBlocksRebuildsTheBookings: the tracker writes a
// booking changed by output blocks (and decay, prefill) into the group once,
// when the group commits, not at each change; a reopen after output blocks
// several to an ApplyBatch, across ApplyBatches and groups, and a free and
// an expiry in the same ApplyBatch as a booking's output blocks rebuilds
// the same bookings and digest, and a freed or expired booking stays gone.
func TestReopenAfterOutputBlocksRebuildsTheBookings(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	defer func() { f.Close() }() // the one open at the end
	var w logWriter
	applyFixture(t, f, &w)
	out := func(id string, h uint64) *raft.Log {
		return w.next(encodeBook(20, []bookOp{{kind: bookOutput, b: Booking{ID: id, SeqHashes: []uint64{h}}}}))
	}
	add := func(id string, now int64) *raft.Log {
		return w.next(encodeBook(now, []bookOp{{kind: bookAdd, b: Booking{ID: id, Rank: r1, SeqHashes: []uint64{1, 2, 3}, ISL: 48}}}))
	}
	book := func(now int64, kind bookKind, id string, discount uint32) *raft.Log {
		return w.next(encodeBook(now, []bookOp{{kind: kind, b: Booking{ID: id, Discount: discount}}}))
	}
	check := func(stage string) {
		t.Helper()
		d := f.Digest()
		want := map[string]indexer.Booking{}
		for _, id := range []string{"a", "b", "c", "d", "old"} {
			if bk, ok := f.Sequences().Get(id); ok {
				want[id] = bk
			}
		}
		f.Close()
		f = openTestFSM(t, dir)
		if got := f.Digest(); got != d {
			t.Fatalf("%s: reopened digest %016x, want %016x", stage, got, d)
		}
		for _, id := range []string{"a", "b", "c", "d", "old"} {
			got, ok := f.Sequences().Get(id)
			wb, wok := want[id]
			if ok != wok || ok && (len(got.SeqHashes) != len(wb.SeqHashes) || got.Discount != wb.Discount || got.PrefillDone != wb.PrefillDone) {
				t.Fatalf("%s: reopened booking %q = %+v (live %v), want %+v (live %v)", stage, id, got, ok, wb, wok)
			}
		}
	}
	f.ApplyBatch([]*raft.Log{add("old", 1), add("a", 30), add("b", 30), out("a", 100), out("a", 101), out("b", 200), out("a", 102)})
	check("several output blocks in one ApplyBatch")
	f.ApplyBatch([]*raft.Log{out("a", 103), book(30, bookPrefillDone, "a", 0)})
	f.ApplyBatch([]*raft.Log{out("a", 104), book(30, bookDecay, "b", indexer.DecayScale/2)})
	f.ApplyBatch([]*raft.Log{out("b", 201)})
	check("output blocks across ApplyBatches")
	f.ApplyBatch([]*raft.Log{add("c", 30), out("a", 105), out("c", 300), out("b", 202), book(30, bookFree, "b", 0), out("c", 301), book(30, bookFree, "c", 0)})
	if err := f.commitGroup(); err != nil { // a group boundary between a booking's output blocks
		t.Fatal(err)
	}
	f.ApplyBatch([]*raft.Log{out("a", 106), add("d", 30), out("old", 400), out("d", 500), w.next(encodeExpire(int64(indexer.DefaultBookingMaxAge)+10, 0))})
	if _, ok := f.Sequences().Get("old"); ok {
		t.Fatal("the sweep kept booking old")
	}
	check("a free and an expiry in the ApplyBatch of output blocks")
}

// obSeq is the prompt's sequence hashes of the output-block benchmark's
// request: obPrompt of them.
func obSeq() []uint64 {
	seq := make([]uint64, obPrompt)
	for i := range seq {
		seq[i] = uint64(1_000_000 + i)
	}
	return seq
}

// BenchmarkFlushOfBookings measures the tracker's journal flush of 1024
// bookings of obPrompt blocks each, added since the last flush (4.3 MB of
// records: a quarter of a group): what FSM.commitGroup writes into the
// group batch before it commits.
func BenchmarkFlushOfBookings(b *testing.B) {
	f := openTestFSM(b, filepath.Join(b.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(b, f, &w)
	seq := obSeq()
	logs := make([]*raft.Log, 0, obPerApply)
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		if err := f.commitGroup(); err != nil {
			b.Fatal(err)
		}
		for range 1024 / obPerApply {
			logs = logs[:0]
			for range obPerApply {
				n++
				logs = append(logs, w.next(encodeBook(10, []bookOp{{kind: bookAdd, b: Booking{ID: fmt.Sprint("req-", n), Rank: r1, SeqHashes: seq, ISL: 16 * len(seq)}}})))
			}
			f.ApplyBatch(logs)
		}
		b.StartTimer()
		f.seqs.FlushJournal()
	}
}
