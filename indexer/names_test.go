package indexer

import (
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// A node is named by its sequence hash alone (dumps, the digest, the
// journal, the rebuild), and content hashes come from publishers
// unchecked, so a store can aim a new node's name at a live node at
// another position: here a root block whose content hash is the sequence
// hash of the depth-1 node of [11 12]. Before names were checked, the
// rank's own dump failed to load ("node listed twice"), the journal kept
// one record for the two nodes (a free of one then dropped the other's),
// and the rebuild from it failed.
func TestStoreNamingALiveNodeIsRefused(t *testing.T) {
	taken := kvevent.SequenceHash(11, 12)
	ix := New(propCfg)
	j := newCopyJournal()
	ix.SetJournal(j)
	mustApply(t, ix,
		stored(rk1, dev, []kvevent.Block{{EngineHash: 1, LocalHash: 11}, {EngineHash: 2, LocalHash: 12}}),
		stored(rk1, dev, []kvevent.Block{{EngineHash: 3, LocalHash: taken}, {EngineHash: 4, LocalHash: 13}}),
	)
	if got := ix.Counters().NameCollisions; got != 1 {
		t.Errorf("Remapped = %d, want 1", got)
	}
	if ix.Holds(rk1, 3) || ix.Holds(rk1, 4) {
		t.Errorf("the colliding block or the rest of its event was stored")
	}
	checkInvariants(t, ix)
	d, err := ix.DumpRank(rk1)
	if err != nil {
		t.Fatal(err)
	}
	if err := New(propCfg).LoadRank(&d); err != nil {
		t.Errorf("a live rank's own dump does not load: %v", err)
	}
	mustApply(t, ix, removed(rk1, dev, 2))
	ix.FlushJournal()
	if int64(len(j.nodes)) != ix.Stats().Nodes {
		t.Errorf("journal holds %d node records, index has %d nodes", len(j.nodes), ix.Stats().Nodes)
	}
	re := j.load(t)
	if re.Digest() != ix.Digest() {
		t.Errorf("rebuilt digest %#x, live %#x", re.Digest(), ix.Digest())
	}
}

// A held store cut by a name collision when it is adopted reports only
// the blocks it stored as adopted (ApplyReport.Adopted): those after the
// collision are not held, and the node agent looked them up for nothing.
func TestAdoptedStoreCutByANameCollisionReportsOnlyWhatItStored(t *testing.T) {
	taken := kvevent.SequenceHash(kvevent.SequenceHash(11, 12), 13) // [11 12 13]'s third node
	ix := New(propCfg)
	mustApply(t, ix,
		stored(rk1, dev, []kvevent.Block{{EngineHash: 9, LocalHash: taken}}),
		storedUnder(rk1, dev, 1, []kvevent.Block{{EngineHash: 2, LocalHash: 12}, {EngineHash: 3, LocalHash: 13}, {EngineHash: 4, LocalHash: 14}}), // held
	)
	var rep ApplyReport
	ix.ApplyBatchReport([]kvevent.Event{*stored(rk1, dev, []kvevent.Block{{EngineHash: 1, LocalHash: 11}})}, 0, &rep)
	if got := ix.Counters().NameCollisions; got != 1 {
		t.Fatalf("NameCollisions = %d, want 1", got)
	}
	if !ix.Holds(rk1, 2) || ix.Holds(rk1, 3) || ix.Holds(rk1, 4) {
		t.Fatalf("holds 2, 3, 4: %v %v %v; want 2 alone", ix.Holds(rk1, 2), ix.Holds(rk1, 3), ix.Holds(rk1, 4))
	}
	if len(rep.Adopted) != 1 || rep.Adopted[0] != 2 {
		t.Fatalf("adopted %v, want [2]: 3 and 4 were cut", rep.Adopted)
	}
}

// The other way round: a deeper node whose sequence hash is a live root
// child's name. The store applies up to the block before it.
func TestDeeperStoreNamingALiveRootChildIsRefused(t *testing.T) {
	taken := kvevent.SequenceHash(11, 12)
	ix := New(propCfg)
	j := newCopyJournal()
	ix.SetJournal(j)
	mustApply(t, ix,
		stored(rk1, dev, []kvevent.Block{{EngineHash: 3, LocalHash: taken}}),
		stored(rk1, dev, []kvevent.Block{{EngineHash: 1, LocalHash: 11}, {EngineHash: 2, LocalHash: 12}, {EngineHash: 5, LocalHash: 14}}),
	)
	if got := ix.Counters().NameCollisions; got != 1 {
		t.Errorf("Remapped = %d, want 1", got)
	}
	if !ix.Holds(rk1, 1) || ix.Holds(rk1, 2) || ix.Holds(rk1, 5) {
		t.Errorf("holds 1/2/5: %v %v %v, want the blocks before the collision only",
			ix.Holds(rk1, 1), ix.Holds(rk1, 2), ix.Holds(rk1, 5))
	}
	if got := ix.Counters().StoredBlocks; got != 2 {
		t.Errorf("StoredBlocks = %d, want 2 (the refused blocks are not stored)", got)
	}
	checkInvariants(t, ix)
	ix.FlushJournal()
	re := j.load(t)
	live, got := find(ix, ViewDedup, []uint64{11, 12}), find(re, ViewDedup, []uint64{11, 12})
	if live[rk1] != got[rk1] || re.Digest() != ix.Digest() {
		t.Errorf("rebuilt index differs: match %v against %v, digest %#x against %#x", got[rk1], live[rk1], re.Digest(), ix.Digest())
	}
	// Once the holder of the name is gone, the name is free again.
	mustApply(t, ix, removed(rk1, dev, 3),
		storedUnder(rk1, dev, 1, []kvevent.Block{{EngineHash: 2, LocalHash: 12}}))
	if !ix.Holds(rk1, 2) {
		t.Errorf("a store of a freed name is still refused")
	}
	checkInvariants(t, ix)
}

// LoadRank refuses, changing nothing, a dump that would create a node
// whose name a live node of another rank has at another position.
func TestLoadRankRefusesANameTakenElsewhere(t *testing.T) {
	taken := kvevent.SequenceHash(11, 12)
	ix := New(propCfg)
	mustApply(t, ix, stored(rk2, dev, []kvevent.Block{{EngineHash: 1, LocalHash: 11}, {EngineHash: 2, LocalHash: 12}}))
	mustApply(t, ix, stored(rk1, dev, []kvevent.Block{{EngineHash: 7, LocalHash: 17}}))
	before := ix.Digest()
	d := RankDump{Rank: rk1,
		Nodes:   []DumpNode{{Seq: taken, Root: true, Local: taken}},
		Entries: []DumpEntry{{Seq: taken, EngineHash: 3, Mask: dev.Bit(), Order: 1}}}
	err := ix.LoadRank(&d)
	if !errors.Is(err, ErrBadDump) {
		t.Fatalf("LoadRank = %v, want ErrBadDump", err)
	}
	if ix.Digest() != before || !ix.Holds(rk1, 7) {
		t.Errorf("a refused dump changed the index")
	}
	checkInvariants(t, ix)
}

// Replicas refuse the same stores: the rule depends on the tree alone,
// never on a block map's seed.
func TestNameCollisionsIgnoreBlockSeeds(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		seed := uint64(1)
		old := newBlockSeed
		defer func() { newBlockSeed = old }()
		newBlockSeed = func() uint64 { seed = seed*6364136223846793005 + 1; return seed }
		a := New(propCfg)
		newBlockSeed = func() uint64 { seed = seed*2862933555777941757 + 3; return seed }
		b := New(propCfg)
		// Content hashes that are live sequence hashes, drawn as the run goes.
		var names []uint64
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(rt, "steps") {
			if s.ev.Kind == kvevent.KindStored && len(s.ev.Blocks) > 0 && len(names) > 0 && rapid.Bool().Draw(rt, "aim") {
				i := rapid.IntRange(0, len(s.ev.Blocks)-1).Draw(rt, "at")
				s.ev.Blocks = append([]kvevent.Block(nil), s.ev.Blocks...)
				s.ev.Blocks[i].LocalHash = rapid.SampledFrom(names).Draw(rt, "name")
			}
			_ = s.apply(a, 0)
			_ = s.apply(b, 0)
			names = names[:0]
			for _, r := range a.Ranks() {
				d, _ := a.DumpRank(r)
				for _, n := range d.Nodes {
					names = append(names, n.Seq)
				}
			}
		}
		checkInvariants(rt, a)
		checkInvariants(rt, b)
		if a.Counters() != b.Counters() {
			rt.Fatalf("counters differ: %+v, %+v", a.Counters(), b.Counters())
		}
		sameStateNoFlags(rt, a, b, allPropRanks())
	})
}
