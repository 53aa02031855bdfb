package indexer

import (
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// seqJournal records every call a Journal gets, in order: the FSM's
// StateBatch keeps the last write of a key, so an order that differs only
// where two calls touch one key would change the durable copy.
type seqJournal struct{ calls []string }

func (j *seqJournal) NodeCreated(seq, parent uint64, root bool, local uint64) {
	j.calls = append(j.calls, fmt.Sprintf("node+ %d %d %v %d", seq, parent, root, local))
}
func (j *seqJournal) NodeFreed(seq uint64) { j.calls = append(j.calls, fmt.Sprintf("node- %d", seq)) }
func (j *seqJournal) EntrySet(r kvevent.Rank, eh, seq uint64, m kvevent.Mask, order uint32) {
	j.calls = append(j.calls, fmt.Sprintf("entry+ %v %d %d %d %d", r, eh, seq, m, order))
}
func (j *seqJournal) EntryDeleted(r kvevent.Rank, eh uint64) {
	j.calls = append(j.calls, fmt.Sprintf("entry- %v %d", r, eh))
}
func (j *seqJournal) RankMeta(m RankMeta) { j.calls = append(j.calls, fmt.Sprintf("meta %+v", m)) }
func (j *seqJournal) RankRemoved(r kvevent.Rank) {
	j.calls = append(j.calls, fmt.Sprintf("rank- %v", r))
}

// genDump draws what a ReplaceRank of r is given: a rank's StoredEvents
// from another random history (what an agent sends), or raw stores of the
// small universe (a log written by another writer), malformed ones
// included.
func genDump(t *rapid.T, r kvevent.Rank) []kvevent.Event {
	if rapid.Bool().Draw(t, "dump from a history") {
		src := New(propCfg)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 40).Draw(t, "src steps") {
			now += int64(s.dt)
			_ = s.apply(src, now)
		}
		d, err := src.DumpRank(r)
		if err != nil {
			return nil
		}
		return d.StoredEvents()
	}
	var evs []kvevent.Event
	for _, s := range rapid.SliceOfN(genStep(), 0, 30).Draw(t, "raw dump") {
		if s.removeWorker != 0 || s.setCapacity || s.expire {
			continue
		}
		ev := s.ev
		ev.Rank = r
		evs = append(evs, ev)
	}
	return evs
}

// TestReplaceRankInChunksJournalsInTheSameOrder: a replace in chunks
// (ApplyChunk 1..5) tells the journal the same calls, in the same order,
// as one that never releases the lock, and ends in the same state, over
// random histories and dumps. Block maps iterate in an order their random
// seed decides (blockmap.go): the two indexes' maps get one seed here.
func TestReplaceRankInChunksJournalsInTheSameOrder(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		defer setBlockSeed(rapid.Uint64().Draw(t, "block seed"))()
		chunked := propCfg
		chunked.ApplyChunk = rapid.IntRange(1, 5).Draw(t, "chunk")
		whole := propCfg
		whole.ApplyChunk = 1 << 30
		a, b := New(chunked), New(whole)
		ja, jb := &seqJournal{}, &seqJournal{}
		a.SetJournal(ja)
		b.SetJournal(jb)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
			now += int64(s.dt)
			_ = s.apply(a, now)
			_ = s.apply(b, now)
		}
		a.FlushJournal()
		b.FlushJournal()
		ja.calls, jb.calls = nil, nil
		r := genRank().Draw(t, "replaced")
		dump := genDump(t, r)
		ma, mb := a.ReplaceRank(r, slices.Clone(dump), now), b.ReplaceRank(r, slices.Clone(dump), now)
		a.FlushJournal()
		b.FlushJournal()
		if ma != mb {
			t.Fatalf("malformed %d in chunks, %d in one", ma, mb)
		}
		if !slices.Equal(ja.calls, jb.calls) {
			t.Fatalf("journal of a replace in chunks of %d:\n%v\nin one:\n%v", chunked.ApplyChunk, ja.calls, jb.calls)
		}
		checkInvariants(t, a)
		sameStateNoFlags(t, a, b, allPropRanks())
		if a.RankNeedsResync(r) != b.RankNeedsResync(r) {
			t.Fatalf("needs resync %v in chunks, %v in one", a.RankNeedsResync(r), b.RankNeedsResync(r))
		}
	})
}

// trimZeros drops trailing zero frequencies: between two chunks of a
// replace, a node only the replaced rank holds counts 0 (FindMatchesByTier),
// where an index without the rank has no such node.
func trimZeros(f []uint32) []uint32 {
	for len(f) > 0 && f[len(f)-1] == 0 {
		f = f[:len(f)-1]
	}
	return f
}

// TestLookupsBetweenChunksLeaveTheRankOut: between any two chunks of
// a replace (ApplyChunk 1..5), every lookup, in both views and with and
// without the early exit, answers what an index without the replaced rank
// answers (the rank's old and new state share nothing with it), a dump
// of another rank is that rank's, and a dump of the replaced rank started
// there returns the state the replace ends with. Beside the checked
// readers, a goroutine reads (lookups, Stats, RankStats, Digest,
// NeedsResync, dumps) all along the replace, for -race.
func TestLookupsBetweenChunksLeaveTheRankOut(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		cfg := propCfg
		cfg.ApplyChunk = rapid.IntRange(1, 5).Draw(t, "chunk")
		ix, ref := New(cfg), New(cfg)
		now := int64(0)
		for _, s := range rapid.SliceOfN(genStep(), 1, 80).Draw(t, "steps") {
			now += int64(s.dt)
			_ = s.apply(ix, now)
			_ = s.apply(ref, now)
		}
		r := genRank().Draw(t, "replaced")
		ref.RemoveRank(r)
		dump := genDump(t, r)
		queries := rapid.SliceOfN(rapid.SliceOfN(rapid.SampledFrom(propLocals), 1, 6), 1, 6).Draw(t, "queries")
		others := slices.DeleteFunc(allPropRanks(), func(o kvevent.Rank) bool { return o == r })

		type want struct {
			m map[kvevent.Rank][kvevent.NumTiers]uint32
			f []uint32
		}
		wants := map[string]want{}
		key := func(q []uint64, v View, e bool) string { return fmt.Sprint(q, v, e) }
		var m Matches
		for _, q := range queries {
			for _, v := range []View{ViewDedup, ViewTiered} {
				for _, e := range []bool{false, true} {
					ref.FindMatchesByTier(q, v, e, &m)
					wants[key(q, v, e)] = want{toMap(&m), slices.Clone(trimZeros(m.Frequencies))}
				}
			}
		}
		otherDumps := map[kvevent.Rank]RankDump{}
		for _, o := range others {
			if d, err := ref.DumpRank(o); err == nil {
				otherDumps[o] = d
			}
		}

		var failure atomic.Pointer[string]
		fail := func(format string, args ...any) {
			s := fmt.Sprintf(format, args...)
			failure.CompareAndSwap(nil, &s)
		}
		stop := make(chan struct{})
		var bg sync.WaitGroup
		bg.Add(1)
		go func() { // unchecked readers, for the race detector
			defer bg.Done()
			var m Matches
			for {
				select {
				case <-stop:
					return
				default:
				}
				for _, q := range queries {
					ix.FindMatchesByTier(q, ViewTiered, false, &m)
				}
				_, _, _, _ = ix.Stats(), ix.RankStats(), ix.Digest(), ix.NeedsResync()
				for _, o := range others {
					_, _ = ix.DumpRank(o)
				}
			}
		}()
		dumped := make(chan RankDump, 1)
		dumpErr := make(chan error, 1)
		started := false
		releases := 0
		ix.applyUnlocked = func() {
			releases++
			if !started {
				started = true
				go func() {
					d, err := ix.DumpRank(r)
					dumped <- d
					dumpErr <- err
				}()
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				var m Matches
				for _, q := range queries {
					for _, v := range []View{ViewDedup, ViewTiered} {
						for _, e := range []bool{false, true} {
							ix.FindMatchesByTier(q, v, e, &m)
							w := wants[key(q, v, e)]
							if err := ranksOnce(&m); err != nil {
								fail("release %d, query %v view %v early %v: %v", releases, q, v, e, err)
							}
							if !equalMatches(toMap(&m), w.m) {
								fail("release %d, query %v view %v early %v: %v, want (without %v) %v", releases, q, v, e, toMap(&m), r, w.m)
							}
							if !slicesEqual(trimZeros(m.Frequencies), w.f) {
								fail("release %d, query %v view %v early %v: frequencies %v, want (without %v) %v", releases, q, v, e, m.Frequencies, r, w.f)
							}
						}
					}
				}
				for _, o := range others {
					d, err := ix.DumpRank(o)
					wd, ok := otherDumps[o]
					if (err == nil) != ok || ok && !reflect.DeepEqual(d, wd) {
						fail("release %d: dump of %v during the replace of %v: %+v (%v), want %+v", releases, o, r, d, err, wd)
					}
				}
			}()
			<-done
		}
		ix.ReplaceRank(r, dump, now)
		ix.applyUnlocked = nil
		close(stop)
		bg.Wait()
		if p := failure.Load(); p != nil {
			t.Fatal(*p)
		}
		checkInvariants(t, ix)
		if started {
			got, err := <-dumped, <-dumpErr
			final, ferr := ix.DumpRank(r)
			if (err == nil) != (ferr == nil) || !reflect.DeepEqual(got, final) {
				t.Fatalf("a dump of %v started during its replace: %+v (%v), the state it ends with %+v (%v)", r, got, err, final, ferr)
			}
		}
		t.Logf("%d releases", releases)
	})
}

// TestConcurrentWritersDoNotInterleave: a ReplaceRank and an
// ApplyBatch (ApplyChunk 1..3) started together end as one of the two
// run whole, one after the other, over random histories: wmu keeps a
// writer out of another's chunks.
func TestConcurrentWritersDoNotInterleave(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		defer setBlockSeed(rapid.Uint64().Draw(t, "block seed"))()
		cfg := propCfg
		cfg.ApplyChunk = rapid.IntRange(1, 3).Draw(t, "chunk")
		var history, batch []kvevent.Event
		for _, s := range rapid.SliceOfN(genStep(), 1, 40).Draw(t, "history") {
			if s.removeWorker == 0 && !s.setCapacity && !s.expire {
				history = append(history, s.ev)
			}
		}
		for _, s := range rapid.SliceOfN(genStep(), 1, 30).Draw(t, "batch") {
			if s.removeWorker == 0 && !s.setCapacity && !s.expire {
				batch = append(batch, s.ev)
			}
		}
		r := genRank().Draw(t, "replaced")
		dump := genDump(t, r)
		build := func() *Index {
			ix := New(cfg)
			ix.ApplyBatch(slices.Clone(history), 0)
			return ix
		}
		replaceFirst, batchFirst, both := build(), build(), build()
		replaceFirst.ReplaceRank(r, slices.Clone(dump), 0)
		replaceFirst.ApplyBatch(slices.Clone(batch), 0)
		batchFirst.ApplyBatch(slices.Clone(batch), 0)
		batchFirst.ReplaceRank(r, slices.Clone(dump), 0)

		// The batch starts at the replace's first release of the lock,
		// and each release yields the processor a few times (no wait on
		// a condition): a batch that could run between two chunks does.
		var wg sync.WaitGroup
		started := false
		both.applyUnlocked = func() {
			if !started {
				started = true
				wg.Add(1)
				go func() { defer wg.Done(); both.ApplyBatch(slices.Clone(batch), 0) }()
			}
			for range 4 {
				runtime.Gosched()
			}
		}
		both.ReplaceRank(r, slices.Clone(dump), 0)
		if !started {
			both.applyUnlocked = nil
			both.ApplyBatch(slices.Clone(batch), 0)
		}
		wg.Wait()
		checkInvariants(t, both)
		if d := both.Digest(); d != replaceFirst.Digest() && d != batchFirst.Digest() {
			t.Fatalf("a replace of %v and a batch run together: digest %#x, want %#x (replace first) or %#x (batch first)", r, d, replaceFirst.Digest(), batchFirst.Digest())
		}
	})
}
