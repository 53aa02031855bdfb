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
			if s.removeWorker != 0 || s.setCapacity || s.expire {
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

// TestReplaceRankFromDumpAnswersAsTheSource: a rank replaced (on another
// index) by the StoredEvents of its dump answers every lookup as the
// source does, in both views.
func TestReplaceRankFromDumpAnswersAsTheSource(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix := New(Config{})
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
			now += int64(s.dt)
			if s.setCapacity {
				continue // capacity trims by age, which a replay renews
			}
			_ = s.apply(ix, now)
		}
		dst := New(Config{})
		for _, r := range ix.Ranks() {
			d, err := ix.DumpRank(r)
			if err != nil {
				t.Fatal(err)
			}
			if bad := dst.ReplaceRank(r, d.StoredEvents(), now); bad != 0 {
				t.Fatalf("rank %v: %d malformed", r, bad)
			}
		}
		checkInvariants(t, dst)
		var a, b Matches
		for q := 0; q < 16; q++ {
			hashes := rapid.SliceOfN(rapid.SampledFrom(propLocals), 1, 6).Draw(t, "query")
			for _, view := range []View{ViewDedup, ViewTiered} {
				ix.FindMatchesByTier(hashes, view, false, &a)
				dst.FindMatchesByTier(hashes, view, false, &b)
				for _, m := range []*Matches{&a, &b} {
					if err := ranksOnce(m); err != nil {
						t.Fatalf("query %v view %v: %v", hashes, view, err)
					}
				}
				if !equalMatches(toMap(&a), toMap(&b)) {
					t.Fatalf("query %v view %v: replaced %v, source %v", hashes, view, toMap(&b), toMap(&a))
				}
			}
		}
	})
}

// TestReplaceRankInPlaceKeepsMatches: a rank replaced in place by
// the StoredEvents of its own dump answers every lookup as before, and
// the other ranks are untouched.
func TestReplaceRankInPlaceKeepsMatches(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix := New(Config{})
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
			now += int64(s.dt)
			if !s.setCapacity {
				_ = s.apply(ix, now)
			}
		}
		ranks := ix.Ranks()
		if len(ranks) == 0 {
			return
		}
		r := rapid.SampledFrom(ranks).Draw(t, "rank")
		var queries [][]uint64
		var before []map[kvevent.Rank][kvevent.NumTiers]uint32
		for q := 0; q < 16; q++ {
			h := rapid.SliceOfN(rapid.SampledFrom(propLocals), 1, 6).Draw(t, "query")
			queries = append(queries, h)
			for _, v := range []View{ViewDedup, ViewTiered} {
				before = append(before, find(ix, v, h))
			}
		}
		others := map[kvevent.Rank]string{}
		for _, o := range ranks {
			if o != r {
				d, _ := ix.DumpRank(o)
				others[o] = fmt.Sprint(d)
			}
		}
		d, _ := ix.DumpRank(r)
		ix.ReplaceRank(r, d.StoredEvents(), now)
		checkInvariants(t, ix)
		i := 0
		for _, h := range queries {
			for _, v := range []View{ViewDedup, ViewTiered} {
				if got := find(ix, v, h); !equalMatches(got, before[i]) {
					t.Fatalf("query %v view %v: after %v %v, before %v", h, v, r, got, before[i])
				}
				i++
			}
		}
		for o, want := range others {
			d, _ := ix.DumpRank(o)
			if fmt.Sprint(d) != want {
				t.Fatalf("rank %v changed by replacing %v", o, r)
			}
		}
	})
}

// TestLoadedDumpsGoOnAsTheSource: an index built from every rank's
// dump (LoadRank) goes on exactly as the source under the same later
// steps: dumps carry all the state later events depend on.
func TestLoadedDumpsGoOnAsTheSource(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix := New(propCfg)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
			now += int64(s.dt)
			_ = s.apply(ix, now)
		}
		fresh := New(propCfg)
		ranks := ix.Ranks()
		for _, k := range rapid.Permutation(ranks).Draw(t, "load order") {
			d, err := ix.DumpRank(k)
			if err != nil {
				t.Fatal(err)
			}
			if err := fresh.LoadRank(&d); err != nil {
				t.Fatalf("load %v: %v", k, err)
			}
		}
		for i, s := range rapid.SliceOfN(genStep(), 1, 40).Draw(t, "more") {
			now += int64(s.dt)
			_ = s.apply(ix, now)
			_ = s.apply(fresh, now)
			if fresh.Digest() != ix.Digest() {
				t.Fatalf("step %d %+v: loaded digest %#x, source %#x", i, s, fresh.Digest(), ix.Digest())
			}
		}
		for _, r := range allPropRanks() {
			a, _ := fresh.DumpRank(r)
			b, _ := ix.DumpRank(r)
			if fmt.Sprint(a) != fmt.Sprint(b) {
				t.Fatalf("rank %v: loaded %+v\nsource %+v", r, a, b)
			}
		}
	})
}

// recomputedDigest is the digest of ix's state from scratch, from its dumps.
func recomputedDigest(t interface{ Fatalf(string, ...any) }, ix *Index) uint64 {
	var sum uint64
	for _, r := range ix.Ranks() {
		d, err := ix.DumpRank(r)
		if err != nil {
			t.Fatalf("dump %v: %v", r, err)
		}
		rk := rankKey(r)
		for _, e := range d.Entries {
			sum += residencyTerm(rk, e.Seq, e.EngineHash, e.Mask)
		}
		for _, o := range d.Orphans {
			parent := o.Parent
			for _, b := range o.Blocks {
				sum += orphanTerm(rk, parent, b.EngineHash, b.LocalHash, o.Tier)
				parent = b.EngineHash
			}
		}
	}
	return sum
}

// TestRankOpsKeepTheDigestAndJournal: the rank operations the model
// test leaves out (ExpireOrphans, ReplaceRank, RemoveRank, LoadRank)
// keep the incremental digest equal to one computed from scratch, the
// invariants, and the journal's copy equal to the live index.
func TestRankOpsKeepTheDigestAndJournal(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix := New(propCfg)
		j := newCopyJournal()
		ix.SetJournal(j)
		now := int64(0)
		for i := 0; i < 40; i++ {
			s := genStep().Draw(t, "step")
			now += int64(s.dt)
			switch rapid.IntRange(0, 9).Draw(t, "op") {
			case 0:
				ix.ExpireOrphans(now)
			case 1:
				src := genRank().Draw(t, "src")
				var evs []kvevent.Event
				if d, err := ix.DumpRank(src); err == nil {
					evs = d.StoredEvents()
					for k := range evs {
						evs[k].Rank = s.ev.Rank
					}
				}
				ix.ReplaceRank(s.ev.Rank, evs, now)
			case 2:
				ix.RemoveRank(s.ev.Rank)
			case 3:
				if d, err := ix.DumpRank(s.ev.Rank); err == nil {
					if err := ix.LoadRank(&d); err != nil {
						t.Fatalf("load own dump: %v", err)
					}
				}
			default:
				_ = s.apply(ix, now)
			}
			if got, want := ix.Digest(), recomputedDigest(t, ix); got != want {
				t.Fatalf("step %d: digest %#x, recomputed %#x", i, got, want)
			}
			if rapid.Bool().Draw(t, "flush") {
				ix.FlushJournal()
			}
		}
		checkInvariants(t, ix)
		ix.FlushJournal()
		re := j.load(t)
		if re.Digest() != ix.Digest() {
			t.Fatalf("rebuilt digest %#x, live %#x", re.Digest(), ix.Digest())
		}
		for _, r := range allPropRanks() {
			if a, b := rankMetaString(re, r), rankMetaString(ix, r); a != b {
				t.Fatalf("rank %v: rebuilt %s\nlive %s", r, a, b)
			}
		}
	})
}

// TestParseViewIsStringsInverse: every view's name parses back to it, and a
// name no view has (the empty one included) is refused, so that the API,
// the client and kvctl, which all parse through it, agree on the names.
func TestParseViewIsStringsInverse(t *testing.T) {
	for _, v := range []View{ViewDedup, ViewTiered} {
		got, ok := ParseView(v.String())
		if !ok || got != v {
			t.Errorf("ParseView(%q) = %v, %v; want %v, true", v.String(), got, ok, v)
		}
	}
	for _, name := range []string{"", "Dedup", "tiered ", "device", "dedup,tiered"} {
		if got, ok := ParseView(name); ok {
			t.Errorf("ParseView(%q) = %v, true; want it refused", name, got)
		}
	}
}
