package indexer

import (
	"fmt"
	"slices"
	"testing"
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// checkTables verifies that no two segments of maps, nor a segment and
// the free list, share a table, and that every table kept for reuse is
// empty.
func checkTables(t *segTables, maps ...*blockMap) error {
	owner := map[*blockSlot]string{}
	claim := func(s []blockSlot, who string) error {
		p := unsafe.SliceData(s)
		if prev, ok := owner[p]; ok {
			return fmt.Errorf("tables: one table is %s and %s", prev, who)
		}
		owner[p] = who
		return nil
	}
	for k, s := range t.free {
		if err := claim(s, fmt.Sprintf("free table %d", k)); err != nil {
			return err
		}
		for i, sl := range s {
			if sl != (blockSlot{}) {
				return fmt.Errorf("tables: free table %d holds slot %d: %#x", k, i, sl.eh)
			}
		}
	}
	for j, m := range maps {
		for i := 0; i < len(m.dir); {
			s := m.dir[i]
			if err := claim(s.slots, fmt.Sprintf("map %d's segment at entry %d", j, i)); err != nil {
				return err
			}
			i += 1 << (m.depth - s.depth)
		}
	}
	return nil
}

// TestBlockMapsSharingTablesMatchMaps runs random puts, lookup-and-fill
// inserts, deletes and releases on three maps that share one segTables,
// each against a Go map: a table given back by one map's release or
// in-place growth and taken by another's split must carry nothing over,
// and no table may serve two segments at once.
func TestBlockMapsSharingTablesMatchMaps(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		defer setBlockSeed(rapid.Uint64().Draw(rt, "seed"))()
		node0 := &node{seq: 1}
		var tables segTables
		var maps [3]blockMap
		var refs [3]map[uint64]*node
		for i := range refs {
			refs[i] = map[uint64]*node{}
		}
		// Rounds of enough steps to grow each map past a full-sized
		// segment (896 keys) and split, each ended by a release of one
		// map: the next round's growth takes the tables it gave back.
		keys := uint64(rapid.SampledFrom([]int{1500, 4000}).Draw(rt, "keys"))
		check := func() {
			if err := checkTables(&tables, &maps[0], &maps[1], &maps[2]); err != nil {
				rt.Fatal(err)
			}
		}
		for round := 0; round < 4; round++ {
			for step := 0; step < 6000; step++ {
				i := rapid.IntRange(0, 2).Draw(rt, "map")
				m, ref := &maps[i], refs[i]
				k := (rapid.Uint64Range(0, keys).Draw(rt, "key") + uint64(i)<<40) * 0x9e3779b97f4a7c15
				switch rapid.IntRange(0, 3).Draw(rt, "op") {
				case 0, 1:
					m.put(k, node0, &tables)
					ref[k] = node0
				case 2:
					slot, old := m.lookup(k, &tables)
					if old != ref[k] {
						rt.Fatalf("map %d: lookup %#x: %v, want %v", i, k, old, ref[k])
					}
					if old == nil {
						m.setAt(slot, k, node0)
						ref[k] = node0
					}
				case 3:
					m.del(k)
					delete(ref, k)
				}
			}
			check()
			i := rapid.IntRange(0, 2).Draw(rt, "release")
			tables.release(&maps[i])
			refs[i] = map[uint64]*node{}
			check()
		}
		for i := range maps {
			if err := maps[i].check(); err != nil {
				rt.Fatalf("map %d: %v", i, err)
			}
			if maps[i].len() != len(refs[i]) {
				rt.Fatalf("map %d: len %d, want %d", i, maps[i].len(), len(refs[i]))
			}
			for k, n := range refs[i] {
				if got, _ := maps[i].get(k); got != n {
					rt.Fatalf("map %d: get %#x: %v, want %v", i, k, got, n)
				}
			}
		}
		if err := checkTables(&tables, &maps[0], &maps[1], &maps[2]); err != nil {
			rt.Fatal(err)
		}
	})
}

// TestReleasedTablesServeTheNextGrowth: a rank removed gives its map's
// tables back to the index, and a rank that grows as large afterwards
// takes them instead of new memory; the tables kept count in the index's
// memory estimate.
func TestReleasedTablesServeTheNextGrowth(t *testing.T) {
	ix := New(Config{})
	a, b := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}
	growRank(t, ix, a, 1)
	held := fullTables(&ix.rankFor(a, false).blocks)
	t.Logf("rank a's map: %d full-sized tables", held)
	if held < 10 {
		t.Fatalf("rank a's map holds %d full-sized tables, want a grown map", held)
	}
	before := ix.Stats().MemoryBytes
	ix.RemoveRank(a)
	if got := len(ix.tables.free); got != held {
		t.Fatalf("%d tables kept after the removal, want rank a's %d", got, held)
	}
	if err := checkTables(&ix.tables, &ix.names); err != nil {
		t.Fatal(err)
	}
	// The tables kept count in the estimate, as the map's did.
	got := ix.Stats().MemoryBytes
	free := ix.tables.free
	ix.tables.free = nil
	without := ix.Stats().MemoryBytes
	ix.tables.free = free
	if want := int64(held) * int64(unsafe.Sizeof(segTable{})); got-without != want {
		t.Fatalf("memory estimate %d after the removal (%d before): the %d tables kept add %d, want %d", got, before, held, got-without, want)
	}
	slab := cap(ix.tables.slab)
	growRank(t, ix, b, 2)
	if got := len(ix.tables.free); got != 0 {
		t.Fatalf("%d tables still kept after rank b grew as large", got)
	}
	if cap(ix.tables.slab) != slab {
		t.Fatalf("rank b took a new slab of %d tables with %d kept", cap(ix.tables.slab), held)
	}
	if err := checkTables(&ix.tables, &ix.names, &ix.rankFor(b, false).blocks); err != nil {
		t.Fatal(err)
	}
}

// growRank stores a chain of 20,000 blocks for rank r (engine hashes drawn
// from salt): its map splits into 32 full-sized segments.
func growRank(t *testing.T, ix *Index, r kvevent.Rank, salt uint64) {
	t.Helper()
	parent := uint64(0)
	for i := uint64(0); i < 20000; i++ {
		eh := mix64(i ^ salt<<32)
		ev := kvevent.Event{Kind: kvevent.KindStored, Rank: r, Tier: kvevent.TierDevice,
			Blocks: []kvevent.Block{{EngineHash: eh, LocalHash: mix64(eh)}}, Parent: parent, HasParent: i > 0}
		if err := ix.Apply(&ev, 0); err != nil {
			t.Fatal(err)
		}
		parent = eh
	}
}

// fullTables counts m's segments with full-sized tables.
func fullTables(m *blockMap) int {
	n := 0
	for i := 0; i < len(m.dir); {
		s := m.dir[i]
		if len(s.slots) == segSlots {
			n++
		}
		i += 1 << (m.depth - s.depth)
	}
	return n
}

// TestTablesGoWithTheTree: an index that takes another's tree (Take)
// takes its table pool with it, recorded in its own huge page scratch
// (so that its later slabs are released with its tree), and leaves the
// other an empty pool; a tree replaced (Take, LoadState) drops its pool.
func TestTablesGoWithTheTree(t *testing.T) {
	a := New(Config{})
	growRank(t, a, kvevent.Rank{Worker: 1}, 1)
	a.RemoveRank(kvevent.Rank{Worker: 1})
	kept := len(a.tables.free)
	if kept == 0 {
		t.Fatal("a removed rank's tables were not kept")
	}
	b := New(Config{})
	b.Take(a)
	if len(b.tables.free) != kept || b.tables.huge != &b.huge {
		t.Fatalf("after Take: %d tables kept (want %d), recorded in the receiver's scratch %v", len(b.tables.free), kept, b.tables.huge == &b.huge)
	}
	if len(a.tables.free) != 0 || a.tables.slab != nil || a.tables.huge != &a.huge {
		t.Fatalf("the index taken from keeps %d tables, a slab of %d, its own scratch %v", len(a.tables.free), cap(a.tables.slab), a.tables.huge == &a.huge)
	}
	b.Take(New(Config{}))
	if len(b.tables.free) != 0 || b.tables.slab != nil || b.tables.huge != &b.huge {
		t.Fatalf("a replaced tree left %d tables kept, a slab of %d, its own scratch %v", len(b.tables.free), cap(b.tables.slab), b.tables.huge == &b.huge)
	}
	// A load replaces the tree in place: the old tables go with it.
	growRank(t, b, kvevent.Rank{Worker: 2}, 2)
	b.RemoveRank(kvevent.Rank{Worker: 2})
	if err := b.LoadState(nil, nil); err != nil {
		t.Fatal(err)
	}
	if len(b.tables.free) != 0 || b.tables.slab != nil || b.tables.huge != &b.huge {
		t.Fatalf("a loaded tree kept %d tables, a slab of %d, its own scratch %v", len(b.tables.free), cap(b.tables.slab), b.tables.huge == &b.huge)
	}
}

// TestATableGrownInPlaceIsKept: a full-sized segment of aimed keys, which
// may not split, grows in place, and its old table goes back to the pool.
func TestATableGrownInPlaceIsKept(t *testing.T) {
	t.Cleanup(setBlockSeed(0)) // the keys are aimed at seed 0
	var tables segTables
	m := newBlockMap(0, nil)
	nd := &node{seq: 1}
	for _, k := range clusteredKeys(0x5555555555555400>>10>>1, 53, 2048) {
		m.put(k, nd, &tables)
	}
	large := 0
	for i := 0; i < len(m.dir); {
		s := m.dir[i]
		if len(s.slots) > segSlots {
			large++
		}
		i += 1 << (m.depth - s.depth)
	}
	if large == 0 {
		t.Fatal("no segment grew past a full-sized table")
	}
	if len(tables.free) == 0 {
		t.Fatalf("%d segments grew in place past a full-sized table, and no table was given back", large)
	}
	if err := checkTables(&tables, &m); err != nil {
		t.Fatal(err)
	}
	if err := m.check(); err != nil {
		t.Fatal(err)
	}
}

// TestLoadedMapsTakeTablesFromTheSlabs: a load sizes the names' and the
// ranks' maps at once, and their full-sized tables come from the index's
// slabs (advised for huge pages while the Loader runs), not from make:
// at a restart of 5M blocks that is about 260 MB of tables written for
// the first time. The Loader's advice is withdrawn at its end, as for the
// tree's node slabs; the index's later slabs are its own. A parallel
// load that falls back to the serial path (two holders of one rank on a
// node) hands its maps' tables to the serial path's.
func TestLoadedMapsTakeTablesFromTheSlabs(t *testing.T) {
	for _, tc := range []struct {
		parts    int
		conflict bool
	}{{1, false}, {2, false}, {2, true}} {
		parts := tc.parts
		t.Run(fmt.Sprintf("parts=%d,conflict=%v", parts, tc.conflict), func(t *testing.T) {
			before := hugepage.Held() // other tests' indexes may hold some
			l := NewLoader(0, 0)
			l.Spread(parts, spreadGo)
			ranks := []kvevent.Rank{{Worker: 1}, {Worker: 2}}
			const chain = 4000 // names: 8 full-sized tables; each rank's blocks: 8
			for s := uint64(1); s <= chain; s++ {
				l.AddNode(s, s-1, s == 1, s+1000)
				for i, r := range ranks {
					l.AddEntry(r, s<<8|uint64(i), s, 1, uint32(s))
				}
			}
			if tc.conflict {
				l.AddEntry(ranks[0], (chain+1)<<8, chain, 2, chain+1) // a second holder of rank 1 on the last node
			}
			for _, r := range ranks {
				l.AddRank(RankMeta{Rank: r, Capacity: [kvevent.NumTiers]int64{chain + 1}})
			}
			ix := New(Config{})
			if err := l.Finish(ix); err != nil {
				t.Fatal(err)
			}
			slab := ix.tables.slab[:cap(ix.tables.slab)]
			lo, hi := uintptr(unsafe.Pointer(unsafe.SliceData(slab))), uintptr(unsafe.Pointer(unsafe.SliceData(slab)))+uintptr(len(slab))*unsafe.Sizeof(segTable{})
			maps := []*blockMap{&ix.names}
			for _, r := range ranks {
				maps = append(maps, &ix.rankFor(r, false).blocks)
			}
			total := 0
			for j, m := range maps {
				for i := 0; i < len(m.dir); {
					s := m.dir[i]
					if p := uintptr(unsafe.Pointer(unsafe.SliceData(s.slots))); len(s.slots) == segSlots && (p < lo || p >= hi) {
						t.Fatalf("map %d's segment at entry %d has a table of its own, not one of the slab's", j, i)
					}
					i += 1 << (m.depth - s.depth)
				}
				total += fullTables(m)
			}
			if total == 0 || len(ix.tables.slab) == 0 {
				t.Fatalf("the maps have %d full-sized tables, %d from the slab: the test needs full-sized ones", total, len(ix.tables.slab))
			}
			if ix.tables.huge != &ix.huge {
				t.Fatal("after the load the index's pool records its slabs in the Loader's scratch")
			}
			if h := hugepage.Held(); h != before {
				t.Fatalf("%d bytes advised after the Loader ended, %d before it", h, before)
			}
			if err := checkTables(&ix.tables, maps...); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestNamesFilledInPartitionsNameEveryNode: a load of many nodes fills the
// names' map partition by partition (fillNames), and the map then names
// every node of the tree by its seq and nothing else, as the one insert
// after another that a damaged copy's load (or a small one) takes does.
func TestNamesFilledInPartitionsNameEveryNode(t *testing.T) {
	defer func(m int) { batchMinRecs = m }(batchMinRecs)
	batchMinRecs = 0
	for _, tc := range []struct {
		name  string
		dup   bool // two records of one position: the upward walk
		parts int
	}{{"top down", false, 1}, {"top down, spread", false, 2}, {"upward walk", true, 1}} {
		t.Run(tc.name, func(t *testing.T) {
			l := NewLoader(0, 0)
			l.Spread(tc.parts, spreadGo)
			r := kvevent.Rank{Worker: 1}
			// 64 chains of 100 blocks: 6,400 nodes, a map of 16 segments.
			seq := uint64(0)
			for c := uint64(0); c < 64; c++ {
				parent := uint64(0)
				for d := uint64(0); d < 100; d++ {
					seq++
					s := mix64(seq)
					l.AddNode(s, parent, d == 0, c<<32|d)
					l.AddEntry(r, s, s, 1, uint32(seq))
					parent = s
				}
			}
			if tc.dup {
				l.AddNode(^uint64(0), 0, true, 0) // a second root child at chain 0's position
			}
			l.AddRank(RankMeta{Rank: r})
			ix := New(Config{})
			if err := l.Finish(ix); err != nil {
				t.Fatal(err)
			}
			if ix.names.depth == 0 {
				t.Fatal("the names' map has one segment: the partitioned fill is not taken")
			}
			n := 0
			var walk func(nd *node)
			walk = func(nd *node) {
				n++
				if got, ok := ix.names.get(nd.seq); !ok || got != nd {
					t.Fatalf("node %#x: the names' map gives %p %v, want %p", nd.seq, got, ok, nd)
				}
				nd.forEachChild(walk)
			}
			ix.root.forEachChild(walk)
			if n != 6400 || ix.names.len() != n {
				t.Fatalf("%d nodes in the tree, %d names; want 6400 of each", n, ix.names.len())
			}
			if err := ix.names.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestReserveMakesSlabsForTheTablesToCome: after reserve(n), the slabs
// made hold the n tables to come, up to maxBulkSegSlab each, counting the
// free tables that are taken first; once they are taken, slabs are the
// usual sizes again. A rebuild reserves what newBlockMap takes for its
// maps, which mapTables says.
func TestReserveMakesSlabsForTheTablesToCome(t *testing.T) {
	var ts segTables
	take := func(n int) (slabs []int) {
		for i := 0; i < n; i++ {
			full := len(ts.free) == 0 && len(ts.slab) == cap(ts.slab)
			ts.get()
			if full {
				slabs = append(slabs, cap(ts.slab))
			}
		}
		return slabs
	}
	ts.reserve(maxBulkSegSlab + 900)
	if got, want := take(maxBulkSegSlab+900), []int{maxBulkSegSlab, 900}; !slices.Equal(got, want) {
		t.Fatalf("slabs for a reserve of %d tables: %v, want %v", maxBulkSegSlab+900, got, want)
	}
	if ts.bulk != 0 {
		t.Fatalf("%d tables still reserved once all were taken", ts.bulk)
	}
	if got, want := take(1), []int{segSlab}; !slices.Equal(got, want) {
		t.Fatalf("the slab after the reserve: %v, want %v", got, want)
	}
	for i := 0; i < 10; i++ {
		ts.put(make([]blockSlot, segSlots))
	}
	ts.reserve(segSlab + 100)
	if ts.bulk != segSlab+90 {
		t.Fatalf("a reserve of %d with 10 free tables: %d to come, want %d", segSlab+100, ts.bulk, segSlab+90)
	}
	if got, want := take(segSlab+100), []int{segSlab + 90 - (segSlab - 1)}; !slices.Equal(got, want) {
		// The open slab's last 31 tables come before a new one.
		t.Fatalf("slabs for a reserve after 10 frees: %v, want %v", got, want)
	}

	for _, hint := range []int{0, 1, segSlots * 7 / 8, segSlots*7/8 + 1, 10_000, 123_456} {
		var fresh segTables
		fresh.reserve(maxBulkSegSlab) // one slab holds whatever it takes
		newBlockMap(hint, &fresh)
		if got, want := len(fresh.slab), mapTables(hint); got != want {
			t.Fatalf("newBlockMap(%d) took %d full-sized tables; mapTables says %d", hint, got, want)
		}
	}
}
