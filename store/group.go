package store

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"sync"
	"unsafe"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/internal/hugepage"
)

// StateBatch collects the writes of a group of applies. Commit writes them
// atomically and durably as one sorted sstable ingested into the database.
//
// Why not a Pebble batch: the FSM writes about 1.4 records per block
// event under random engine hashes. Through a batch, each record is
// encoded, inserted into the memtable's skiplist (a cache miss per level),
// or — for a batch of half a memtable or more — sorted by comparing
// varint-prefixed keys decoded from the batch, and then read back and
// written again by the flush. Here a record is appended to an arena once;
// Commit radix-sorts 24-byte handles on the first 16 key bytes held as
// integers (random hashes settle almost every order there), keeps the last
// write of each key, and streams the result into an sstable writer: every
// byte is copied once, and the memtable and the flush are skipped.
//
// Ordering: the records of one group share one sequence number in the
// database (an ingested table's), so a key must appear once in a table:
// the last write of a key in the group wins, as it would in a batch. A
// delete is written as a point tombstone, which also hides what earlier
// groups wrote under the key.
type StateBatch struct {
	s     *StateDB
	arena []byte    // per write: value length (4 bytes), key, value
	ops   []groupOp // one per write, in write order
	// reserve is the size the group will grow to (Reserve); 0 when unknown.
	reserve int
	key     []byte // scratch for building keys
	val     []byte // scratch for building values
	// huge records the buffers advised for huge pages: a group's buffers
	// grow to about GroupBytes each and live as long as the FSM, and a
	// first touch of fresh memory costs a fault per 4 KiB page without
	// the advice (a tenth of the faults of the replicated ingest
	// benchmark, whose three FSMs grow two groups each). Close withdraws
	// it. The sort's second buffer and the gathered writes are not the
	// group's: they are the database's commitScratch, one for all its
	// groups.
	huge hugepage.Scratch
}

// commitScratch is the memory a group's commit (or view) needs only while
// it sorts and gathers: the sort's second buffer of ops, then, once the
// ops are sorted, the writes gathered in key order. One serves every
// group of a database, the two uses in turn: the FSM keeps two groups
// (one filling while the other commits) and commits one at a time, and
// each group keeping both buffers held four of them, each about the size
// of a group's arena or ops. On the replicated ingest benchmark (three
// FSMs in one process, the default GroupBytes) the heap's memory from
// the system at the window's end (HeapSys) fell from 1.28–1.33 GB to
// 1.10–1.16 GB (six alternating pairs), its resident memory by 120–180 MB.
//
// Invariants: buf is used only under mu, and nothing taken from it is
// kept after mu is released. Once release has run (the database closed),
// take hands out plain memory that is neither kept nor advised, so that
// no advice outlives Close whatever raced it.
type commitScratch struct {
	mu     sync.Mutex
	buf    []uint64 // 8-byte words, so that it is aligned for groupOp
	huge   hugepage.Scratch
	closed bool // release has run
}

// opBytes is a groupOp's size.
const opBytes = int(unsafe.Sizeof(groupOp{}))

// take returns the scratch as at least n bytes, 8-byte aligned, grown
// (and advised for huge pages) when it is smaller, with an eighth more so
// that slightly larger groups do not reallocate every time. The caller
// holds mu.
func (c *commitScratch) take(n int) []byte {
	words := (n + 7) / 8
	if c.closed {
		return wordsAsBytes(make([]uint64, words))
	}
	if cap(c.buf) < words {
		c.buf = hugepage.Grow(&c.huge, c.buf[:0], words+words/8)
	}
	c.buf = c.buf[:cap(c.buf)]
	return wordsAsBytes(c.buf)
}

func wordsAsBytes(w []uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), len(w)*8)
}

// opsIn returns the start of b, which take returned, as n ops.
func opsIn(b []byte, n int) []groupOp {
	if n == 0 {
		return nil
	}
	if n*opBytes > len(b) {
		panic(fmt.Sprintf("store: %d ops in a scratch of %d bytes", n, len(b)))
	}
	return unsafe.Slice((*groupOp)(unsafe.Pointer(unsafe.SliceData(b))), n)
}

// release drops the scratch and withdraws its advice; later takes get
// plain memory.
func (c *commitScratch) release() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.huge.Release()
	c.buf = nil
	c.closed = true
}

// groupOp is one write: its key's first 16 bytes as big-endian integers
// (zero padded, so integer order is byte order) and where the write sits
// in the arena. 24 bytes, so that the sort moves little.
type groupOp struct {
	k0, k1 uint64
	off    uint32 // arena[off:off+4] is the value's length, then the key, then the value
	klen   uint16
	del    bool
}

// GroupBytes is the default size at which the FSM commits the group it
// keeps across applies. Larger groups mean fewer, larger tables (fewer L0
// sublevels to compact) for more memory and a longer pause at commit.
const GroupBytes = 16 << 20

// NewBatch starts an empty group.
func (s *StateDB) NewBatch() *StateBatch {
	// The key and value scratch buffers hold the largest record of the
	// fixed layouts (a residency key, 21 bytes), so appends never grow them.
	return &StateBatch{s: s, key: make([]byte, 0, 64), val: make([]byte, 0, 64)}
}

func (b *StateBatch) add(key, value []byte, del bool) {
	if len(key) > math.MaxUint16 {
		// Callers bound their ids far below this (raftfsm's maxKeyID); a
		// longer key would wrap klen and write the group out of order.
		panic(fmt.Sprintf("store: a state key of %d bytes (at most %d)", len(key), math.MaxUint16))
	}
	var pad [16]byte
	copy(pad[:], key)
	// Grow the buffers by doubling: append grows a slice this large by a
	// quarter at a time, and each step copies it into fresh pages that
	// fault in (about a tenth of the CPU in a profile of the 4-second
	// ingest benchmark). The buffers are kept from group to group.
	if n := 4 + len(key) + len(value); len(b.arena)+n > cap(b.arena) {
		grow := max(n, cap(b.arena))
		if cap(b.arena) >= reserveFrom {
			grow = max(grow, b.reserve-len(b.arena))
		}
		b.arena = hugepage.Grow(&b.huge, b.arena, grow)
	}
	if len(b.ops) == cap(b.ops) {
		grow := max(1, cap(b.ops))
		if cap(b.ops)*24 >= reserveFrom {
			// Records average well over 24 bytes with their length: an op
			// per 24 reserved bytes is room enough.
			grow = max(grow, b.reserve/24-len(b.ops))
		}
		b.ops = hugepage.Grow(&b.huge, b.ops, grow)
	}
	off := len(b.arena)
	b.arena = binary.LittleEndian.AppendUint32(b.arena, uint32(len(value)))
	b.arena = append(b.arena, key...)
	b.arena = append(b.arena, value...)
	b.ops = append(b.ops, groupOp{
		k0: binary.BigEndian.Uint64(pad[:8]), k1: binary.BigEndian.Uint64(pad[8:]),
		off: uint32(off), klen: uint16(len(key)), del: del,
	})
}

func (b *StateBatch) set(key, value []byte) { b.add(key, value, false) }
func (b *StateBatch) del(key []byte)        { b.add(key, nil, true) }

// Reserve says how large the group will grow (about bytes of keys and
// values): once it outgrows its first MiB, its buffers grow straight to
// that size instead of doubling there (each doubling copies the group into
// fresh pages). A group that stays small allocates nothing more.
func (b *StateBatch) Reserve(bytes int) { b.reserve = bytes }

// reserveFrom is the size from which a group's buffers grow straight to
// the reserved size.
const reserveFrom = 1 << 20

// Len is the group's size in bytes (keys and values).
func (b *StateBatch) Len() int { return len(b.arena) }

// Close releases the group's memory.
func (b *StateBatch) Close() error {
	b.huge.Release()
	b.arena, b.ops = nil, nil
	return nil
}

func (b *StateBatch) keyOf(o *groupOp) []byte {
	return b.arena[o.off+4 : o.off+4+uint32(o.klen)]
}

// sameKey reports whether two writes are of the same key.
func (b *StateBatch) sameKey(x, y *groupOp) bool {
	return x.k0 == y.k0 && x.k1 == y.k1 && x.klen == y.klen &&
		(x.klen <= 16 || bytes.Equal(b.keyOf(x), b.keyOf(y)))
}

// sortOps orders the writes by key, and the writes of one key in write
// order. Radix sorts, stable throughout, so that writes that agree on the
// bytes sorted keep their write order: first one pass on the kind byte,
// then, within each kind, a least-significant-digit pass per byte of k0
// and k1 on which the kind's writes do not all agree (the high bytes of
// worker ids and the zero padding of short keys are skipped: residencies
// take about 5 passes, tree nodes 8). Writes that agree on their first 16
// bytes (a residency's engine hash runs past them) are then ordered by
// their whole key, stably. tmp is the second buffer, of len(b.ops).
func (b *StateBatch) sortOps(tmp []groupOp) {
	ops := b.ops
	var count [257]int
	for i := range ops {
		count[ops[i].k0>>56+1]++
	}
	for d := 1; d < len(count); d++ {
		count[d] += count[d-1]
	}
	starts := count // bucket d is tmp[starts[d]:starts[d+1]]
	for i := range ops {
		d := ops[i].k0 >> 56
		tmp[count[d]] = ops[i]
		count[d]++
	}
	for d := 0; d < 256; d++ {
		lo, hi := starts[d], starts[d+1]
		if hi-lo == 0 {
			continue
		}
		if res := radixLSD(tmp[lo:hi], ops[lo:hi]); &res[0] != &ops[lo] {
			copy(ops[lo:hi], res)
		}
	}
	for i := 0; i < len(ops); {
		j := i + 1
		for j < len(ops) && ops[j].k0 == ops[i].k0 && ops[j].k1 == ops[i].k1 {
			j++
		}
		if j-i > 1 {
			slices.SortStableFunc(ops[i:j], func(x, y groupOp) int {
				return bytes.Compare(b.keyOf(&x), b.keyOf(&y))
			})
		}
		i = j
	}
}

// radixLSD stably sorts a by (k0, k1), using scratch (of a's length) as
// the second buffer, and returns whichever of the two holds the result.
// Byte positions on which every element agrees are skipped.
func radixLSD(a, scratch []groupOp) []groupOp {
	and0, and1, or0, or1 := ^uint64(0), ^uint64(0), uint64(0), uint64(0)
	for i := range a {
		and0 &= a[i].k0
		or0 |= a[i].k0
		and1 &= a[i].k1
		or1 |= a[i].k1
	}
	src, dst := a, scratch
	var count [256]int
	for pass := 0; pass < 16; pass++ {
		hi := pass >= 8
		shift := uint(pass%8) * 8
		varies := and1 ^ or1
		if hi {
			varies = and0 ^ or0
		}
		if (varies>>shift)&0xff == 0 {
			continue
		}
		clear(count[:])
		if hi {
			for i := range src {
				count[byte(src[i].k0>>shift)]++
			}
		} else {
			for i := range src {
				count[byte(src[i].k1>>shift)]++
			}
		}
		sum := 0
		for d := range count {
			count[d], sum = sum, sum+count[d]
		}
		if hi {
			for i := range src {
				d := byte(src[i].k0 >> shift)
				dst[count[d]] = src[i]
				count[d]++
			}
		} else {
			for i := range src {
				d := byte(src[i].k1 >> shift)
				dst[count[d]] = src[i]
				count[d]++
			}
		}
		src, dst = dst, src
	}
	return src
}

// Commit writes the group as one table and ingests it: atomically (a
// table is ingested whole or not at all) and durably (the ingest syncs
// the table and the manifest). The group is empty afterwards.
func (b *StateBatch) Commit() error {
	if len(b.ops) == 0 {
		b.s.mu.RLock()
		closed := b.s.db == nil
		b.s.mu.RUnlock()
		if closed {
			return fmt.Errorf("commit state group: %w", ErrClosed)
		}
		return nil
	}
	s := b.s
	path := s.fs.PathJoin(s.dir, fmt.Sprintf("group-%06d.sst", s.groups.Add(1)))
	w, err := s.createTable(path)
	if err != nil {
		return fmt.Errorf("commit state group: %w", err)
	}
	// Sort, then gather the surviving writes into key order, in a loop
	// tight enough that the processor overlaps the cache misses of the
	// arena's random reads; the table writer then reads sequentially.
	// (Reading the arena from the writer's loop took a miss at a time:
	// half of Commit.) Both use the database's scratch in turn, held
	// until the writer has taken every write (it copies what it keeps).
	sc := &s.scratch
	sc.mu.Lock()
	buf := sc.take(max(len(b.ops)*opBytes, b.gatherBytes()))
	b.sortOps(opsIn(buf, len(b.ops)))
	out := b.gather(buf[:0])
	for len(out) > 0 {
		var key, value []byte
		var del bool
		key, value, del, out = nextGathered(out)
		if del {
			err = w.Delete(key)
		} else {
			err = w.Set(key, value)
		}
		if err != nil {
			break
		}
	}
	sc.mu.Unlock()
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = s.ingest([]string{path})
	}
	// An ingested table is linked into the database; the name written here
	// goes either way.
	_ = s.fs.Remove(path)
	if err != nil {
		return fmt.Errorf("commit state group: %w", err)
	}
	b.arena, b.ops = b.arena[:0], b.ops[:0]
	return nil
}

// gatherBytes is the most that gather appends.
func (b *StateBatch) gatherBytes() int { return len(b.arena) + 3*len(b.ops) }

// gather appends the group's writes to out in key order, the last write
// of each key only (the ops are sorted, see sortOps): per write its key
// length (u16 LE), 1 for a delete or 0, its value length (u32 LE), the
// key and the value. nextGathered reads them back.
func (b *StateBatch) gather(out []byte) []byte {
	// The ops are in key order, their arena bytes in write order: each
	// read below is a cache miss. Touching the write gatherAhead ops on
	// first lets the processor wait for several misses at once.
	var touched byte
	for i := range b.ops {
		if j := i + gatherAhead; j < len(b.ops) {
			touched += b.arena[b.ops[j].off]
		}
		o := &b.ops[i]
		if i+1 < len(b.ops) && b.sameKey(o, &b.ops[i+1]) {
			continue // a later write of the same key wins
		}
		n := binary.LittleEndian.Uint32(b.arena[o.off:])
		out = binary.LittleEndian.AppendUint16(out, o.klen)
		if o.del {
			out = append(out, 1)
		} else {
			out = append(out, 0)
		}
		out = append(out, b.arena[o.off:o.off+4+uint32(o.klen)+n]...)
	}
	runtime.KeepAlive(touched) // the touches are not optimised away
	return out
}

// gatherAhead is how far ahead gather touches the arena.
const gatherAhead = 8

// nextGathered reads the first write of a non-empty gather output and
// returns it and the rest.
func nextGathered(g []byte) (key, value []byte, del bool, rest []byte) {
	klen := int(binary.LittleEndian.Uint16(g))
	del = g[2] == 1
	n := int(binary.LittleEndian.Uint32(g[3:]))
	return g[7 : 7+klen], g[7+klen : 7+klen+n], del, g[7+klen+n:]
}

// View opens a read view of the database as committing the group now
// would leave it, without committing it: a snapshot of the database,
// and a copy of the group's writes, in key order, laid over it. The
// group goes on taking writes; they are not in the view. A view costs a
// copy of the group (at most GroupBytes and a little more) where a
// commit would write, sync and ingest a table, and add an L0 sublevel
// that can start a compaction of the whole base level beside the reader
// (a snapshot save did start one). Its sort uses the database's commit
// scratch, so it may wait for another group's commit to write its table.
func (b *StateBatch) View() *StateSnapshot {
	sc := &b.s.scratch
	sc.mu.Lock()
	b.sortOps(opsIn(sc.take(len(b.ops)*opBytes), len(b.ops)))
	sc.mu.Unlock()
	over := b.gather(make([]byte, 0, b.gatherBytes()))
	return b.s.newView(over)
}

// removeStaleGroups removes group and bulk-load tables that a crash left
// behind between their writing and their ingest, or between the ingest and
// their removal (an ingested table lives on under Pebble's own name; these
// names are never Pebble's, and no load runs while the database opens).
func removeStaleGroups(fs vfs.FS, dir string) {
	names, err := fs.List(dir)
	if err != nil {
		return
	}
	for _, n := range names {
		if (strings.HasPrefix(n, "group-") || strings.HasPrefix(n, "load-")) && strings.HasSuffix(n, ".sst") {
			_ = fs.Remove(fs.PathJoin(dir, n))
		}
	}
}
