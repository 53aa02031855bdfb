package store

import (
	"testing"

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
