package raftfsm

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
)

// bigFixture applies a chain of n blocks on r1 (each a tree node and a
// residency record: about 60 stream bytes a block).
func bigFixture(t *testing.T, f *FSM, n int) {
	t.Helper()
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16}))})
	for first := 1; first <= n; first += 1000 {
		f.ApplyBatch([]*raft.Log{w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: chainEvents(r1, uint64(first), 1000, uint64(first)*7)}}))})
	}
}

// openBigSnapshot returns an FSM holding bigFixture's n blocks and a Raft
// snapshot of it, both closed at the test's end.
func openBigSnapshot(t *testing.T, n int) (*FSM, raft.FSMSnapshot) {
	t.Helper()
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	t.Cleanup(func() { f.Close() })
	bigFixture(t, f, n)
	s, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Release) // before the FSM's close: cleanups run last first
	return f, s
}

// TestSnapshotOfManyBlocksRoundTrips: a stream of several write blocks
// (blockWriter) reads back whole and restores the same state.
func TestSnapshotOfManyBlocksRoundTrips(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	bigFixture(t, f, 40_000)
	snap := snapshotBytes(t, f)
	if len(snap) < 2*snapWriteBlock {
		t.Fatalf("stream of %d bytes: want several write blocks", len(snap))
	}
	info, err := InspectSnapshot(bytes.NewReader(snap))
	if err != nil || info.Records["residencies"] != 40_000 || info.Bytes != int64(len(snap)) {
		t.Fatalf("inspect: %+v %v", info, err)
	}
	restoredFSM(t, snap, f.Digest())
}

// failingWriter accepts limit bytes, then fails every write.
type failingWriter struct{ limit, n int }

var errSinkFull = errors.New("sink full")

func (w *failingWriter) Write(p []byte) (int, error) {
	if w.n+len(p) > w.limit {
		return 0, errSinkFull
	}
	w.n += len(p)
	return len(p), nil
}

// TestSnapshotWriteErrorIsReturned: a sink that fails part way makes the
// save fail with its error (and the writing goroutine ends: goleak).
func TestSnapshotWriteErrorIsReturned(t *testing.T) {
	_, s := openBigSnapshot(t, 40_000)
	for _, limit := range []int{0, snapWriteBlock / 2, snapWriteBlock + 1} {
		if _, err := writeSnapshot(&failingWriter{limit: limit}, s.(*fsmSnapshot).view); !errors.Is(err, errSinkFull) {
			t.Fatalf("limit %d: err %v, want the sink's", limit, err)
		}
	}
}
