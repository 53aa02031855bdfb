package raftfsm

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
)

// TestACrashAfterAFullGroupKeepsItsBookings: a group that fills inside
// ApplyBatch commits in the background (commitAsync) with the applied
// index of its last entry; the tracker's bookings added or changed in it
// must be in that group (the FlushJournal before commitAsync), since a
// crash before the next commit loses the open group and Raft replays only
// the entries after the committed index. It pins the flush in ApplyBatch's
// full-group path, which otherwise only a rapid draw of
// TestReopenMidLogKeepsTheState caught.
func TestACrashAfterAFullGroupKeepsItsBookings(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	open := func() *FSM {
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, GroupBytes: 64, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	f := open()
	var w logWriter
	applyFixture(t, f, &w)
	f.ApplyBatch([]*raft.Log{
		w.next(encodeBook(20, []bookOp{{kind: bookAdd, b: Booking{ID: "a", Rank: r1, SeqHashes: []uint64{1, 2, 3}, ISL: 48}}})),
		w.next(encodeBook(20, []bookOp{{kind: bookOutput, b: Booking{ID: "a", SeqHashes: []uint64{100}}}})),
		w.next(encodeBook(20, []bookOp{{kind: bookOutput, b: Booking{ID: "q1", SeqHashes: []uint64{101}}}})),
		// KV events: the bookings' own writes wait for the flush, so
		// these are what fill the group.
		w.next(encodeEvents(20, []RankBatch{{Rank: r2, Events: chainEvents(r2, 4, 8, 1000)}})),
	})
	digest, index := f.Digest(), w.index
	// A crash once the full group is in: the open group is lost.
	f.dbMu.Lock()
	if err := f.waitCommit(); err != nil {
		t.Fatal(err)
	}
	dbApplied, _, err := f.db.Applied()
	if err != nil {
		t.Fatal(err)
	}
	if dbApplied != index {
		t.Fatalf("the state database is at %d after a full group, want %d (no background commit?)", dbApplied, index)
	}
	f.dropGroup()
	f.isClosed = true
	f.ix.Release()
	f.db.Close()
	f.dbMu.Unlock()
	f = open()
	defer f.Close()
	if got, _ := f.Applied(); got != index {
		t.Fatalf("reopened at %d, want %d", got, index)
	}
	if got := f.Digest(); got != digest {
		bk, ok := f.Sequences().Get("a")
		t.Fatalf("reopened after a crash at applied %d: digest %016x, want %016x (booking a: %+v, live %v)", index, got, digest, bk, ok)
	}
}

// TestBookingsAloneFillTheGroup: the group commits once it holds
// GroupBytes of state changes (FSM doc, DESIGN.md "Durability"), the
// tracker's bookings included: they are state changes the group will
// commit. Written only at the flush, they are counted in ApplyBatch's size
// check by their estimate (Sequences.UnjournaledBytes): uncounted, a load
// of bookings (no KV events) never filled a group, which stayed open,
// growing by every booking, until a snapshot or Close, and a crash
// replayed all of it.
func TestBookingsAloneFillTheGroup(t *testing.T) {
	const group = 4096
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, GroupBytes: group, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	if err := f.commitGroup(); err != nil {
		t.Fatal(err)
	}
	start := w.index
	seq := make([]uint64, 64)
	for i := range 64 {
		for j := range seq {
			seq[j] = uint64(i<<20 + j + 1)
		}
		f.ApplyBatch([]*raft.Log{w.next(encodeBook(20, []bookOp{{kind: bookAdd, b: Booking{ID: fmt.Sprint("r", i), Rank: r1, SeqHashes: seq, ISL: 16 * len(seq)}}}))})
	}
	f.dbMu.Lock()
	err = f.waitCommit()
	f.dbMu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	dbApplied, _, err := f.db.Applied()
	if err != nil {
		t.Fatal(err)
	}
	if dbApplied == start {
		t.Fatalf("64 bookings of 64 blocks (%d bytes as the flush writes them) applied in groups of %d bytes, and no group committed: the state database is still at %d, applied %d",
			groupLen(f), group, dbApplied, w.index)
	}
}
