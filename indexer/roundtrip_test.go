package indexer

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// Round trips of the paths that replace state (LoadRank, ReplaceRank,
// LoadState and Take, the journal) and of ApplyBatch's chunks, under
// random histories: each must leave what the plain path leaves, and the
// package invariants (checkInvariants: the name set among them).

// allPropRanks is every rank genRank draws.
func allPropRanks() []kvevent.Rank {
	var ranks []kvevent.Rank
	for _, w := range propWorkers {
		ranks = append(ranks, kvevent.Rank{Worker: w, DP: 0}, kvevent.Rank{Worker: w, DP: 1})
	}
	return ranks
}

// sameStateNoFlags fails unless a and b have one digest, the same counts
// and equal dumps of every rank (flags aside).
func sameStateNoFlags(t interface{ Fatalf(string, ...any) }, a, b *Index, ranks []kvevent.Rank) {
	if a.Digest() != b.Digest() {
		t.Fatalf("digests %#x and %#x", a.Digest(), b.Digest())
	}
	sa, sb := a.Stats(), b.Stats()
	if sa.Nodes != sb.Nodes || sa.Entries != sb.Entries || sa.Blocks != sb.Blocks {
		t.Fatalf("stats differ:\n%+v\n%+v", sa, sb)
	}
	for _, r := range ranks {
		da, ea := a.DumpRank(r)
		db, eb := b.DumpRank(r)
		if (ea == nil) != (eb == nil) || fmt.Sprint(da) != fmt.Sprint(db) {
			t.Fatalf("rank %v: dumps differ:\n%+v (%v)\n%+v (%v)", r, da, ea, db, eb)
		}
	}
}

// Loading a rank's own dump back in place changes nothing.
func TestLoadRankOfOwnDumpChangesNothing(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		a, b := New(propCfg), New(propCfg)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(rt, "steps") {
			now += int64(s.dt)
			_ = s.apply(a, now)
			_ = s.apply(b, now)
		}
		for _, r := range a.Ranks() {
			d, err := a.DumpRank(r)
			if err != nil {
				rt.Fatal(err)
			}
			if err := a.LoadRank(&d); err != nil {
				rt.Fatalf("load %v: %v", r, err)
			}
		}
		checkInvariants(rt, a)
		sameStateNoFlags(rt, a, b, allPropRanks())
	})
}

// The journal describes the index after LoadRank, ReplaceRank, RemoveRank
// and ExpireOrphans too (the resync paths), not only after events.
func TestJournalFollowsResyncs(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		ix, other := New(propCfg), New(propCfg)
		j := newCopyJournal()
		ix.SetJournal(j)
		now := int64(0)
		for i, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(rt, "steps") {
			now += int64(s.dt)
			_ = s.apply(other, now)
			switch rapid.IntRange(0, 9).Draw(rt, "op") {
			case 0:
				if d, err := other.DumpRank(genRank().Draw(rt, "lr")); err == nil {
					if err := ix.LoadRank(&d); err != nil {
						rt.Fatal(err)
					}
				}
			case 1:
				r := genRank().Draw(rt, "rr")
				if d, err := other.DumpRank(r); err == nil {
					ix.ReplaceRank(r, d.StoredEvents(), now)
				}
			case 2:
				ix.RemoveRank(genRank().Draw(rt, "rm"))
			case 3:
				ix.ExpireOrphans(now)
			default:
				_ = s.apply(ix, now)
			}
			if i%3 == 0 {
				ix.FlushJournal()
			}
		}
		ix.FlushJournal()
		checkInvariants(rt, ix)
		re := j.load(rt)
		checkInvariants(rt, re)
		sameStateNoFlags(rt, re, ix, allPropRanks())
	})
}

// ApplyBatch, whatever its chunk, equals Apply one event at a time.
func TestApplyBatchEqualsApplyOneByOne(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		cfg := propCfg
		cfg.ApplyChunk = rapid.IntRange(1, 5).Draw(rt, "chunk")
		a, b := New(cfg), New(cfg)
		var batch []kvevent.Event
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(rt, "steps") {
			if s.removeWorker != 0 || s.setCapacity {
				continue
			}
			_ = s.apply(a, 0)
			batch = append(batch, s.ev)
		}
		b.ApplyBatch(batch, 0)
		checkInvariants(rt, b)
		sameStateNoFlags(rt, a, b, allPropRanks())
	})
}

// A snapshot round trip (dumps, LoadState into a detached index, Take
// into a live one with other state), then the same history on both.
func TestTakeRoundTripThenContinue(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		src, live := New(propCfg), New(propCfg)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 50).Draw(rt, "steps") {
			now += int64(s.dt)
			_ = s.apply(src, now)
		}
		for _, s := range rapid.SliceOfN(genStep(), 0, 30).Draw(rt, "other") {
			_ = s.apply(live, now)
		}
		nodes := map[uint64]DumpNode{}
		var ranks []RankDump
		for _, r := range src.Ranks() {
			d, _ := src.DumpRank(r)
			for _, n := range d.Nodes {
				nodes[n.Seq] = n
			}
			d.Nodes = nil
			ranks = append(ranks, d)
		}
		det := New(propCfg)
		if err := det.LoadState(nodes, ranks); err != nil {
			rt.Fatal(err)
		}
		for _, r := range src.Ranks() {
			det.SetRankFlags(r, src.RankNeedsResync(r), false)
		}
		live.Take(det)
		checkInvariants(rt, live)
		sameStateNoFlags(rt, live, src, allPropRanks())
		for _, s := range rapid.SliceOfN(genStep(), 0, 40).Draw(rt, "after") {
			now += int64(s.dt)
			_ = s.apply(src, now)
			_ = s.apply(live, now)
		}
		checkInvariants(rt, live)
		sameStateNoFlags(rt, live, src, allPropRanks())
	})
}

// The model test with enough ranks that shared nodes get more than 16
// holders (node.find's binary search, addHolder's insertion), which the
// six-rank universe never reaches.
func TestIndexMatchesModelManyRanks(t *testing.T) {
	old := propWorkers
	defer func() { propWorkers = old }()
	propWorkers = nil
	for w := uint64(1); w <= 24; w++ {
		propWorkers = append(propWorkers, w)
	}
	checkIndexMatchesModel(t)
}
