package store

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/hashicorp/raft"
)

// TestDeleteRangeWhoseBoundsCannotBeReadMovesThemPastTheRange: a
// DeleteRange whose tombstone is committed but whose read of the new
// bounds fails (an sstable the disk cannot read) reports the failure and
// still leaves the bounds past the range: the next FirstIndex or LastIndex
// reads them. From a review: the bounds stayed as they were, and
// after a tail truncation and a re-append LastIndex named entries that
// were gone, until the next reload.
func TestDeleteRangeWhoseBoundsCannotBeReadMovesThemPastTheRange(t *testing.T) {
	for _, c := range []struct {
		what                string
		min, max            uint64
		wantFirst, wantLast uint64
	}{
		{"a tail truncated", 15, 20, 1, 14},
		{"a head compacted", 1, 9, 10, 20},
		{"the whole log", 1, 30, 0, 0},
		{"a range past the log", 25, 30, 1, 20},
	} {
		t.Run(c.what, func(t *testing.T) {
			var failReads atomic.Bool
			s := openTestLogStore(t, unreadableTablesFS(&failReads), "raft")
			if err := s.StoreLogs(testLogs(1, 20, 1)); err != nil {
				t.Fatal(err)
			}
			if err := s.db.Flush(); err != nil { // the entries now live in an sstable
				t.Fatal(err)
			}
			failReads.Store(true)
			err := s.DeleteRange(c.min, c.max)
			failReads.Store(false)
			if err == nil {
				t.Fatalf("DeleteRange(%d, %d) with the sstable unreadable: nil, want the read's failure", c.min, c.max)
			}
			mustBounds(t, s, c.wantFirst, c.wantLast)
			var l raft.Log
			if c.wantLast != 0 {
				if err := s.GetLog(c.wantLast, &l); err != nil {
					t.Fatalf("GetLog(%d), the last index: %v", c.wantLast, err)
				}
			}
			// The next writes go on from the bounds: a new leader's entries
			// after a truncation, or more after the rest.
			next := c.wantLast + 1
			if err := s.StoreLogs(testLogs(next, next+1, 2)); err != nil {
				t.Fatal(err)
			}
			want := c.wantFirst
			if want == 0 {
				want = next
			}
			mustBounds(t, s, want, next+1)
		})
	}
}

// TestDeleteRangeWhoseBoundsCannotBeReadAroundAHole: a log with a hole,
// as Raft leaves one (entries 1..5 below a snapshot at 9 that a follower
// installed and was killed before clearing its log, then 10..12 from the
// leader: DESIGN.md, Durability argument 5), keeps exact bounds after a
// DeleteRange whose read of the new bounds fails. While the disk still
// fails, FirstIndex and LastIndex report it rather than a guess. From a
// review: the bounds were worked out from the range as if the log had no
// hole, and a compaction of 1..7 left FirstIndex at 8, an entry the store
// does not hold.
func TestDeleteRangeWhoseBoundsCannotBeReadAroundAHole(t *testing.T) {
	for _, c := range []struct {
		what                string
		min, max            uint64
		wantFirst, wantLast uint64
	}{
		{"a head compacted into the hole", 1, 7, 10, 12},
		{"the entries below the hole compacted", 1, 5, 10, 12},
		{"a tail truncated down to the hole", 10, 12, 1, 5},
		{"a tail truncated above the hole", 11, 12, 1, 10},
		{"the hole itself", 6, 9, 1, 12},
	} {
		t.Run(c.what, func(t *testing.T) {
			var failReads atomic.Bool
			s := openTestLogStore(t, unreadableTablesFS(&failReads), "raft")
			if err := s.StoreLogs(testLogs(1, 5, 1)); err != nil {
				t.Fatal(err)
			}
			if err := s.StoreLogs(testLogs(10, 12, 2)); err != nil {
				t.Fatal(err)
			}
			if err := s.db.Flush(); err != nil { // the entries now live in an sstable
				t.Fatal(err)
			}
			failReads.Store(true)
			if err := s.DeleteRange(c.min, c.max); err == nil {
				t.Fatalf("DeleteRange(%d, %d) with the sstable unreadable: nil, want the read's failure", c.min, c.max)
			}
			if first, err := s.FirstIndex(); err == nil && first != c.wantFirst {
				t.Fatalf("FirstIndex with the sstable still unreadable = %d, want %d or an error", first, c.wantFirst)
			}
			if last, err := s.LastIndex(); err == nil && last != c.wantLast {
				t.Fatalf("LastIndex with the sstable still unreadable = %d, want %d or an error", last, c.wantLast)
			}
			failReads.Store(false)
			// An append before the bounds are read again: a new leader's
			// entries after a truncation, or more after the rest.
			next := c.wantLast + 1
			if err := s.StoreLogs(testLogs(next, next+1, 3)); err != nil {
				t.Fatal(err)
			}
			mustBounds(t, s, c.wantFirst, next+1)
			firstTerm := uint64(1) // of the entries below the hole
			if c.wantFirst >= 10 {
				firstTerm = 2
			}
			mustHave(t, s, testLog(c.wantFirst, firstTerm))
		})
	}
}

// TestDeleteRangeWritesOneTombstone: DeleteRange is one range tombstone
// whatever the range's length (replication.md): what it writes to the WAL
// does not grow with the entries it deletes (19,000 point deletes write
// about 200 KB). From a review: nothing checked it.
func TestDeleteRangeWritesOneTombstone(t *testing.T) {
	fs := &walFS{FS: vfs.NewMem()}
	s := openTestLogStore(t, fs, "raft")
	for lo := uint64(1); lo <= 20000; lo += 1000 {
		if err := s.StoreLogs(testLogs(lo, lo+999, 1)); err != nil {
			t.Fatal(err)
		}
	}
	before := fs.written.Load()
	if err := s.DeleteRange(1, 19000); err != nil {
		t.Fatal(err)
	}
	if n := fs.written.Load() - before; n > 512 {
		t.Errorf("DeleteRange of 19,000 entries wrote %d bytes to the WAL: not one range tombstone", n)
	}
	mustBounds(t, s, 19001, 20000)
}

// unreadableTablesFS is an in-memory filesystem whose sstables cannot be
// read while fail is set.
func unreadableTablesFS(fail *atomic.Bool) vfs.FS {
	return errorfs.Wrap(vfs.NewMem(), errorfs.InjectorFunc(func(op errorfs.Op) error {
		if fail.Load() && op.Kind == errorfs.OpFileReadAt && strings.HasSuffix(op.Path, ".sst") {
			return errorfs.ErrInjected
		}
		return nil
	}))
}
