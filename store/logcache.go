package store

import (
	"sync"

	"github.com/hashicorp/raft"
)

// logCache keeps the entries most recently stored, up to a byte budget, so
// that Raft's reads of them are answered from memory. Raft reads every
// entry back soon after storing it: the leader once per follower to
// replicate it, a follower once to apply it. Each read from Pebble decodes
// and copies the entry; on the event-plane benchmark those copies were
// about a seventh of all allocation, and the collections they caused
// traced the whole index each time.
//
// Invariants: the cached entries are the contiguous indexes lo..hi, each
// at ring[index % len(ring)], and every one of them is in the store with
// the same contents (add runs after a commit; a DeleteRange that touches
// the window empties the cache). A cached entry's Data and Extensions are
// the very bytes its writer passed to StoreLogs, shared with every reader
// (get copies the struct, not the bytes): no one may modify them in place,
// and hashicorp/raft, which stores and reads them, does not (nor does the
// FSM it applies them to). Appending is safe: get caps both slices, so an
// append reallocates instead of writing into the writer's buffer, where
// Extensions may follow Data.
type logCache struct {
	mu     sync.RWMutex
	ring   []*raft.Log
	lo, hi uint64 // the window; empty when n == 0
	n      int
	bytes  int64 // of the cached entries (logBytes)
	max    int64
}

// DefaultLogCacheBytes is the log cache's budget unless LogStoreOptions
// says otherwise.
const DefaultLogCacheBytes = 64 << 20

// logCacheSlots bounds the entries cached, whatever their size.
const logCacheSlots = 4096

func newLogCache(max int64, slots int) *logCache {
	if max <= 0 || slots <= 0 {
		return nil
	}
	return &logCache{ring: make([]*raft.Log, slots), max: max}
}

// logBytes is what an entry counts against the budget.
func logBytes(l *raft.Log) int64 { return int64(len(l.Data)+len(l.Extensions)) + 64 }

// add caches entries just committed, in index order. An entry that does not
// follow the window starts a new one.
func (c *logCache) add(logs []*raft.Log) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, l := range logs {
		if c.n > 0 && l.Index != c.hi+1 {
			c.resetLocked()
		}
		if c.n == len(c.ring) {
			c.evictLocked()
		}
		c.ring[l.Index%uint64(len(c.ring))] = l
		if c.n == 0 {
			c.lo = l.Index
		}
		c.hi = l.Index
		c.n++
		c.bytes += logBytes(l)
		for c.bytes > c.max && c.n > 0 {
			c.evictLocked()
		}
	}
}

// get copies the cached entry at index into out, if there is one. out's
// Data and Extensions share their bytes with the cache (see logCache),
// capped at their length; otherwise out reads as decodeLog would give it.
func (c *logCache) get(index uint64, out *raft.Log) bool {
	if c == nil {
		return false
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.n == 0 || index < c.lo || index > c.hi {
		return false
	}
	*out = *c.ring[index%uint64(len(c.ring))]
	// The entry as a read from disk gives it (decodeLog): empty bytes as
	// nil, AppendedAt in UTC without the writer's monotonic reading.
	if len(out.Data) == 0 {
		out.Data = nil
	} else {
		out.Data = out.Data[:len(out.Data):len(out.Data)]
	}
	if len(out.Extensions) == 0 {
		out.Extensions = nil
	} else {
		out.Extensions = out.Extensions[:len(out.Extensions):len(out.Extensions)]
	}
	if !out.AppendedAt.IsZero() {
		out.AppendedAt = out.AppendedAt.Round(0).UTC()
	}
	return true
}

// deleted drops the cache if min..max touches its window.
func (c *logCache) deleted(min, max uint64) {
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n > 0 && min <= c.hi && max >= c.lo {
		c.resetLocked()
	}
}

func (c *logCache) evictLocked() {
	i := c.lo % uint64(len(c.ring))
	c.bytes -= logBytes(c.ring[i])
	c.ring[i] = nil
	c.lo++
	c.n--
}

func (c *logCache) resetLocked() {
	clear(c.ring)
	c.n, c.bytes = 0, 0
}
