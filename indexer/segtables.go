package indexer

import (
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/hugepage"
)

// segTables hands out the full-sized segment tables (segSlots slots,
// 16 KiB) of one index's block maps from slabs, and takes back the tables
// of maps the index drops, for reuse.
//
// Why: a growing map splits each full segment by moving half its keys
// into a new table (blockMap.grow), so a growing index writes a new
// 16 KiB table for every 450 or so blocks it stores, and the first write
// of fresh memory costs a page fault per 4 KiB; on the virtual machines
// we run on, faults are dear. Tables from slabs advised for huge pages
// (internal/hugepage, as nodePool's) fault once per 2 MiB. The replicated
// ingest benchmark, whose three replicas grow their indexes from empty,
// spent 9 % of its CPU in the first writes of new tables (the profile's
// hi.insert in distribute, nearly all of it under the kernel's faults);
// with tables from advised slabs, eight alternating pairs on one idle
// machine: 464–562k block events/s (median 520k) against 416–514k
// (median 488k), page faults 190–200k against 236–258k, the FSM alone
// unchanged (1.9–2.24M against 1.64–2.2M).
//
// Why a free list: a slab lives while any table in it is in use, so the
// tables of a map the index drops (a rank cleared or removed, a table
// replaced by a larger one) are kept for the next split instead: the
// tables' memory stays at the index's high-water mark (bounded by its
// ranks' capacities), as the node pool's does. A table is cleared when it
// is given back, so that every table handed out is empty.
//
// A segTables belongs to one index and is used under its write lock; a
// nil *segTables makes each table with make and keeps none (a Loader's
// parallel parts, the tests).
type segTables struct {
	slab []segTable    // handed out from the front
	free [][]blockSlot // tables given back, cleared; taken first
	next int           // tables in the next slab; 0 before the first
	bulk int           // tables still to come of a reserve: larger slabs meanwhile
	huge *hugepage.Scratch
}

// segTable is one full-sized segment's slots.
type segTable = [segSlots]blockSlot

// Slabs double from segSlab tables (512 KiB) up to maxSegSlab (8 MiB): a
// small index stays small, and a slab of a large one holds three or four
// whole huge pages of the advice (a slab is aligned to the heap's 8 KiB
// pages, not to 2 MiB).
const segSlab, maxSegSlab = 32, 512

// maxBulkSegSlab bounds the slabs made for a reserve: 64 MiB.
const maxBulkSegSlab = 4096

// reserve tells t that about n more tables are to be taken at once (a
// rebuild sizing its maps, hundreds of megabytes of tables): until they
// are taken, its slabs are made to hold them, up to maxBulkSegSlab
// tables. A slab is aligned to the heap's 8 KiB pages, so about a huge
// page's worth of its two ends lies outside the whole huge pages advised
// and faults once per 4 KiB page: a quarter of an 8 MiB slab, a
// thirtieth of a 64 MiB one. A 5M-block restore into fresh memory (the
// cluster benchmark's: 3.1M names, 5M residencies): the faults of the
// maps' first writes fell from 17.5k to 2.2k.
func (t *segTables) reserve(n int) {
	if t != nil {
		t.bulk = max(n-len(t.free), 0)
	}
}

// get returns an empty full-sized table.
func (t *segTables) get() []blockSlot {
	if t == nil {
		return make([]blockSlot, segSlots)
	}
	if k := len(t.free); k > 0 {
		s := t.free[k-1]
		t.free[k-1] = nil
		t.free = t.free[:k-1]
		return s
	}
	if len(t.slab) == cap(t.slab) {
		size := max(t.next, segSlab)
		if t.bulk > size {
			size = min(t.bulk, maxBulkSegSlab)
		} else {
			t.next = min(2*size, maxSegSlab)
		}
		t.slab = hugepage.MakeCapIn[segTable](t.huge, size)
	}
	t.bulk = max(t.bulk-1, 0)
	t.slab = t.slab[:len(t.slab)+1]
	return t.slab[len(t.slab)-1][:]
}

// put takes back s, a table no segment uses any more. Tables of another
// size are left to the collector.
func (t *segTables) put(s []blockSlot) {
	if t == nil || len(s) != segSlots || cap(s) != segSlots {
		return
	}
	clear(s)
	t.free = append(t.free, s)
}

// release takes back the full-sized tables of m, which the index drops
// (nothing reaches m's segments afterwards).
func (t *segTables) release(m *blockMap) {
	if t == nil {
		return
	}
	for i := 0; i < len(m.dir); {
		s := m.dir[i]
		t.put(s.slots)
		s.slots = nil
		i += 1 << (m.depth - s.depth)
	}
	*m = blockMap{}
}

// bytes returns the memory of the tables no map uses: those kept for
// reuse and those of the open slab not yet handed out (up to 8 MiB, which
// the index holds as surely as the maps' own).
func (t *segTables) bytes() int64 {
	return int64(len(t.free)+cap(t.slab)-len(t.slab)) * int64(unsafe.Sizeof(segTable{}))
}
