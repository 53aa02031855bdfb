package store

import (
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
)

// TestLogCacheWindow: the cache holds a contiguous window of the entries
// stored last, within its slots and bytes; an entry that does not follow
// the window starts a new one; a deletion away from the window keeps it.
func TestLogCacheWindow(t *testing.T) {
	entry := func(i uint64, size int) *raft.Log { return &raft.Log{Index: i, Term: 1, Data: make([]byte, size)} }
	holds := func(c *logCache, want ...uint64) {
		t.Helper()
		in := map[uint64]bool{}
		for _, i := range want {
			in[i] = true
		}
		for i := uint64(0); i <= 20; i++ {
			var l raft.Log
			if got := c.get(i, &l); got != in[i] || got && l.Index != i {
				t.Fatalf("get(%d) = %v (entry %d), want %v; window %d..%d of %d", i, got, l.Index, in[i], c.lo, c.hi, c.n)
			}
		}
	}
	c := newLogCache(1000, 4)
	c.add([]*raft.Log{entry(1, 10), entry(2, 10), entry(3, 10)})
	holds(c, 1, 2, 3)
	c.add([]*raft.Log{entry(4, 10), entry(5, 10)})
	holds(c, 2, 3, 4, 5) // four slots
	c.add([]*raft.Log{entry(9, 10)})
	holds(c, 9) // a gap: a new window
	c.add([]*raft.Log{entry(10, 500), entry(11, 300)})
	holds(c, 10, 11) // 10+500+300 and 64 each > 1000 bytes: 9 evicted
	c.add([]*raft.Log{entry(12, 2000)})
	holds(c) // larger than the budget: nothing stays
	c.add([]*raft.Log{entry(13, 10), entry(14, 10)})
	c.deleted(1, 12)
	holds(c, 13, 14)
	c.deleted(14, 20)
	holds(c)
	if newLogCache(0, 4) != nil || newLogCache(-1, 4) != nil {
		t.Fatal("a cache without a budget")
	}
	var none *logCache
	none.add([]*raft.Log{entry(1, 1)})
	if none.get(1, &raft.Log{}) {
		t.Fatal("the nil cache holds an entry")
	}
}

// TestCachedReadEqualsADiskRead: an entry answered from the log cache
// reads as one decoded from disk (DESIGN.md "Entry encoding"): AppendedAt
// in UTC without a monotonic reading, empty Data as nil. From a review: a
// cache hit gave the leader's time.Now() as it was, Local and monotonic,
// and Data as []byte{}, so an entry read differently while cached.
func TestCachedReadEqualsADiskRead(t *testing.T) {
	s := openTestLogStore(t, vfs.NewMem(), "raft")
	now := time.Now() // what raft's dispatchLogs stores: time.Now(), Local, monotonic
	if err := s.StoreLogs([]*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand, Data: []byte{}, AppendedAt: now}}); err != nil {
		t.Fatal(err)
	}
	var l raft.Log
	if err := s.GetLog(1, &l); err != nil {
		t.Fatal(err)
	}
	if l.AppendedAt.Location() != time.UTC {
		t.Errorf("AppendedAt location = %v, want UTC (%v)", l.AppendedAt.Location(), l.AppendedAt)
	}
	if l.AppendedAt != l.AppendedAt.Round(0) {
		t.Errorf("AppendedAt carries a monotonic reading: %v", l.AppendedAt)
	}
	if l.Data != nil {
		t.Errorf("empty Data = %#v, want nil", l.Data)
	}
}

// TestReadersDuringDeleteRange: readers during head compactions, tail
// truncations and appends never see an entry with another index, an
// error other than ErrLogNotFound, or a first index past the last.
func TestReadersDuringDeleteRange(t *testing.T) {
	s := openTestLogStore(t, vfs.NewMem(), "raft")
	if err := s.StoreLogs(testLogs(1, 200, 1)); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for r := 0; r < 4; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				first, _ := s.FirstIndex()
				last, _ := s.LastIndex()
				if first > last && last != 0 {
					t.Errorf("bounds [%d,%d]", first, last)
					return
				}
				for i := first; i <= last && i < first+50; i++ {
					var l raft.Log
					err := s.GetLog(i, &l)
					if err == nil && l.Index != i {
						t.Errorf("GetLog(%d) gave index %d", i, l.Index)
						return
					}
					if err != nil && err != raft.ErrLogNotFound {
						t.Errorf("GetLog(%d): %v", i, err)
						return
					}
				}
			}
		}()
	}
	term := uint64(1)
	next := uint64(201)
	for k := 0; k < 200; k++ {
		first, _ := s.FirstIndex()
		last, _ := s.LastIndex()
		switch k % 4 {
		case 0:
			if last > first+10 {
				if err := s.DeleteRange(first, first+5); err != nil {
					t.Fatal(err)
				}
			}
		case 1:
			if last > first+10 {
				term++
				if err := s.DeleteRange(last-3, last); err != nil {
					t.Fatal(err)
				}
				next = last - 3
			}
		default:
			if err := s.StoreLogs(testLogs(next, next+7, term)); err != nil {
				t.Fatal(err)
			}
			next += 8
		}
	}
	close(stop)
	wg.Wait()
}
