package indexer

import (
	"cmp"
	"fmt"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// copyJournal keeps the durable copy a Journal makes possible, the way the
// cluster's Pebble tables do.
type copyJournal struct {
	nodes   map[uint64]DumpNode
	entries map[kvevent.Rank]map[uint64]DumpEntry
	meta    map[kvevent.Rank]RankMeta
}

func newCopyJournal() *copyJournal {
	return &copyJournal{nodes: map[uint64]DumpNode{}, entries: map[kvevent.Rank]map[uint64]DumpEntry{}, meta: map[kvevent.Rank]RankMeta{}}
}

func (j *copyJournal) NodeCreated(seq, parent uint64, root bool, local uint64) {
	j.nodes[seq] = DumpNode{Seq: seq, Parent: parent, Root: root, Local: local}
}
func (j *copyJournal) NodeFreed(seq uint64) { delete(j.nodes, seq) }
func (j *copyJournal) EntrySet(r kvevent.Rank, eh, seq uint64, m kvevent.Mask, order uint32) {
	if j.entries[r] == nil {
		j.entries[r] = map[uint64]DumpEntry{}
	}
	j.entries[r][eh] = DumpEntry{Seq: seq, EngineHash: eh, Mask: m, Order: order}
}
func (j *copyJournal) EntryDeleted(r kvevent.Rank, eh uint64) { delete(j.entries[r], eh) }
func (j *copyJournal) RankMeta(m RankMeta)                    { j.meta[m.Rank] = m }
func (j *copyJournal) RankRemoved(r kvevent.Rank) {
	delete(j.meta, r)
	delete(j.entries, r)
}

func (j *copyJournal) load(t interface{ Fatalf(string, ...any) }) *Index {
	var ranks []RankDump
	for r, m := range j.meta {
		d := RankDump{Rank: r, Capacity: m.Capacity, Order: m.Order, Orphans: m.Orphans}
		for _, e := range j.entries[r] {
			d.Entries = append(d.Entries, e)
		}
		ranks = append(ranks, d)
	}
	ix := New(propCfg)
	if err := ix.LoadState(j.nodes, ranks); err != nil {
		t.Fatalf("LoadState: %v", err)
	}
	for r, m := range j.meta {
		ix.SetRankFlags(r, m.NeedsResync, m.OverCapacity)
	}
	return ix
}

// TestJournalRebuildsTheSameIndex applies random events with a journal
// attached, flushing after every few, and checks that the durable copy the
// journal describes rebuilds an index equal to the live one.
func TestJournalRebuildsTheSameIndex(t *testing.T) {
	for range loadPropertyRounds() {
		checkJournalRebuildsTheSameIndex(t)
	}
}

// journaledSteps applies up to 60 random steps to a fresh index with a
// journal attached, flushing after every third, and returns the index,
// the journal and the clock of the last step. A malformed event changes
// nothing, so step errors are dropped.
func journaledSteps(t *rapid.T) (*Index, *copyJournal, int64) {
	ix := New(propCfg)
	j := newCopyJournal()
	ix.SetJournal(j)
	now := int64(0)
	for i, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
		now += int64(s.dt)
		_ = s.apply(ix, now)
		if i%3 == 0 {
			ix.FlushJournal()
		}
	}
	return ix, j, now
}

func checkJournalRebuildsTheSameIndex(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix, j, _ := journaledSteps(t)
		if rapid.Bool().Draw(t, "setCapacity") {
			ix.SetCapacity(kvevent.Rank{Worker: 1}, [4]int64{2, 1, 0, 0})
		}
		ix.FlushJournal()
		re := j.load(t)
		if re.Digest() != ix.Digest() {
			t.Fatalf("rebuilt digest %#x, live %#x", re.Digest(), ix.Digest())
		}
		a, b := re.Stats(), ix.Stats()
		if a.Nodes != b.Nodes || a.Entries != b.Entries || a.Blocks != b.Blocks || a.NeedResync != b.NeedResync || a.OrphanEvents != b.OrphanEvents {
			t.Fatalf("rebuilt stats %+v, live %+v", a, b)
		}
		if int64(len(j.nodes)) != b.Nodes {
			t.Fatalf("journal holds %d nodes, index %d", len(j.nodes), b.Nodes)
		}
		checkInvariants(t, re)
		// Ages too (capacity drops a tier's oldest entries first): the
		// rank's counter and every entry's order.
		for _, r := range ix.Ranks() {
			want, err1 := ix.DumpRank(r)
			got, err2 := re.DumpRank(r)
			if err1 != nil || err2 != nil {
				t.Fatalf("dump rank %v: %v, %v", r, err1, err2)
			}
			if got.Order != want.Order {
				t.Fatalf("rank %v: rebuilt order %d, live %d", r, got.Order, want.Order)
			}
			byHash := func(a, b DumpEntry) int { return cmp.Compare(a.EngineHash, b.EngineHash) }
			slices.SortFunc(got.Entries, byHash)
			slices.SortFunc(want.Entries, byHash)
			if !slices.Equal(got.Entries, want.Entries) {
				t.Fatalf("rank %v: rebuilt entries %v, live %v", r, got.Entries, want.Entries)
			}
		}
	})
}

// TestJournalRecordsARankCreatedByACutStore: a store cut at its first
// block (its node's name is taken, DESIGN.md) creates the rank and
// nothing else. The rank was not marked for the journal, so a node
// rebuilt from its durable copy lacked a rank the live ones listed
// (Ranks, RankStats, Stats.Ranks, DumpRank). A rank is marked when it is
// created.
func TestJournalRecordsARankCreatedByACutStore(t *testing.T) {
	ix := New(propCfg)
	j := newCopyJournal()
	ix.SetJournal(j)
	taken := kvevent.SequenceHash(11, 12) // the name of rk1's second node
	mustApply(t, ix,
		stored(rk1, dev, []kvevent.Block{{EngineHash: 1, LocalHash: 11}, {EngineHash: 2, LocalHash: 12}}),
		stored(rk2, dev, []kvevent.Block{{EngineHash: 3, LocalHash: taken}}))
	if c := ix.Counters().NameCollisions; c != 1 {
		t.Fatalf("%d stores cut, want rk2's", c)
	}
	ix.FlushJournal()
	re := j.load(t)
	if got, want := re.Ranks(), ix.Ranks(); !slices.Equal(got, want) || len(want) != 2 {
		t.Fatalf("rebuilt ranks %v, live %v; want both ranks in each", got, want)
	}
	if got, want := re.Stats().Ranks, ix.Stats().Ranks; got != want {
		t.Fatalf("rebuilt Stats.Ranks %d, live %d", got, want)
	}
	sameStateNoFlags(t, re, ix, []kvevent.Rank{rk1, rk2})
}

// TestJournalReattachedReportsEveryChangedRank: a flush with no journal
// attached forgets the ranks changed before the journal was detached, and
// so must their marks: left set, a journal attached again was never told
// those ranks' metadata, whatever changed in them later.
func TestJournalReattachedReportsEveryChangedRank(t *testing.T) {
	ix := New(Config{})
	ix.SetJournal(newCopyJournal())
	ix.SetCapacity(rk1, [kvevent.NumTiers]int64{8})
	ix.SetJournal(nil)
	ix.FlushJournal()
	j := newCopyJournal()
	ix.SetJournal(j)
	ix.SetCapacity(rk1, [kvevent.NumTiers]int64{16})
	ix.FlushJournal()
	if m, ok := j.meta[rk1]; !ok || m.Capacity[0] != 16 {
		t.Fatalf("journal attached again: rank meta %+v (reported %v), want capacity 16", m, ok)
	}
}

// rankMetaString is a rank's whole state outside its residencies, as
// DumpRank and RankStats show it.
func rankMetaString(ix *Index, r kvevent.Rank) string {
	d, err := ix.DumpRank(r)
	if err != nil {
		return "unknown"
	}
	var st RankStats
	for _, s := range ix.RankStats() {
		if s.Rank == r {
			st = s
		}
	}
	return fmt.Sprintf("cap %v order %d orphans %v stats %+v", d.Capacity, d.Order, d.Orphans, st)
}

// TestJournalRebuildKeepsRankMeta: the durable copy the journal
// describes rebuilds every rank's metadata (capacity, flags, held stores
// and their times), and the rebuilt index then goes on exactly as the
// live one under more steps.
func TestJournalRebuildKeepsRankMeta(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix, j, now := journaledSteps(t)
		ix.FlushJournal()
		re := j.load(t)
		for _, r := range allPropRanks() {
			if a, b := rankMetaString(re, r), rankMetaString(ix, r); a != b {
				t.Fatalf("rank %v: rebuilt %s\nlive %s", r, a, b)
			}
		}
		for _, s := range rapid.SliceOfN(genStep(), 1, 30).Draw(t, "more") {
			now += int64(s.dt)
			_ = s.apply(ix, now)
			_ = s.apply(re, now)
			if re.Digest() != ix.Digest() {
				t.Fatalf("after %+v: rebuilt digest %#x, live %#x", s, re.Digest(), ix.Digest())
			}
		}
		for _, r := range allPropRanks() {
			if a, b := rankMetaString(re, r), rankMetaString(ix, r); a != b {
				t.Fatalf("rank %v after more steps: rebuilt %s\nlive %s", r, a, b)
			}
		}
	})
}

// TestJournalRecordsATrimAfterATierAdded: a store that only adds a tier to
// blocks the rank holds changes no rank metadata, so it does not mark the
// rank; the capacity trim it sets off does (the over-capacity flag), and
// must mark it itself, or the durable copy keeps the flag unset.
func TestJournalRecordsATrimAfterATierAdded(t *testing.T) {
	ix := New(Config{CapacitySlack: 1e-9})
	j := newCopyJournal()
	ix.SetJournal(j)
	ix.SetCapacity(rk1, [kvevent.NumTiers]int64{0, 2, 0, 0})
	mustApply(t, ix, stored(rk1, dev, chain(1, 2, 3)))
	ix.FlushJournal()
	mustApply(t, ix, stored(rk1, host, chain(1, 2, 3))) // 3 in host: the trim drops leaf 3 there
	ix.FlushJournal()
	if !ix.RankStats()[0].OverCapacity {
		t.Fatal("setup: the rank should be over its host capacity")
	}
	if got, want := rankMetaString(j.load(t), rk1), rankMetaString(ix, rk1); got != want {
		t.Fatalf("rebuilt %s\nlive %s", got, want)
	}
}
