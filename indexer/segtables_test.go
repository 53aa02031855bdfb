package indexer

import (
	"fmt"
	"testing"
	"unsafe"

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
	grow := func(r kvevent.Rank, salt uint64) {
		t.Helper()
		parent := uint64(0)
		for i := uint64(0); i < 20000; i++ {
			eh := mix64(i ^ salt<<32)
			ev := kvevent.Event{Kind: kvevent.KindStored, Rank: r, Tier: kvevent.TierDevice,
				Blocks: []kvevent.Block{{EngineHash: eh, LocalHash: mix64(eh)}}, Parent: parent}
			if i == 0 {
				ev.Parent, ev.HasParent = 0, false
			} else {
				ev.HasParent = true
			}
			if err := ix.Apply(&ev, 0); err != nil {
				t.Fatal(err)
			}
			parent = eh
		}
	}
	a, b := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 2}
	grow(a, 1)
	rs := ix.rankFor(a, false)
	held := 0
	for i := 0; i < len(rs.blocks.dir); {
		s := rs.blocks.dir[i]
		if len(s.slots) == segSlots {
			held++
		}
		i += 1 << (rs.blocks.depth - s.depth)
	}
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
	// The nodes stay in the pool; the tables count where the map did.
	if got := ix.Stats().MemoryBytes; got < int64(held)*segSlots*16 {
		t.Fatalf("memory estimate %d after the removal (%d before), under the %d tables kept", got, before, held)
	}
	slab := cap(ix.tables.slab)
	grow(b, 2)
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
