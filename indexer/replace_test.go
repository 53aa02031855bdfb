package indexer

import (
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestReplaceRankLeavesTheRankOutOfLookupsBetweenChunks pins ReplaceRank's
// doc comment and DESIGN.md (Concurrency): the replace releases the write
// lock every Config.ApplyChunk blocks, a lookup from another goroutine
// completes in the middle of it, and it reports neither the replaced
// rank's old state nor its new one part way (the rank is left out of
// Ranks and of Frequencies) while another rank's matches come in full. A
// dump of the replaced rank started meanwhile returns only once the
// replace is done, with the new state. The hook (applyUnlocked) runs where
// the lock is released; a lookup it waits for that could not take the
// read lock hangs, and the deadline fails the test.
func TestReplaceRankLeavesTheRankOutOfLookupsBetweenChunks(t *testing.T) {
	ix := New(Config{ApplyChunk: 8})
	const n = 32
	hs := firstHashes(n)
	// rk1 holds the chain in device memory, rk2 too; rk1's dump holds it
	// on the host, one block an event (as StoredEvents sends it).
	mustApply(t, ix, stored(rk1, dev, chain(hs...)), stored(rk2, dev, chain(hs...)))
	dump := make([]kvevent.Event, n)
	for i, h := range hs {
		if i == 0 {
			dump[i] = *stored(rk1, host, chain(h))
		} else {
			dump[i] = *storedUnder(rk1, host, h-1, chain(h))
		}
	}

	var lookups int
	dumped := make(chan RankDump, 1)
	hang := time.After(time.Minute) // fails only a real hang
	ix.applyUnlocked = func() {
		if lookups == 0 {
			go func() {
				d, err := ix.DumpRank(rk1)
				if err != nil {
					t.Errorf("dump during the replace: %v", err)
				}
				dumped <- d
			}()
		}
		done := make(chan Matches, 1)
		go func() {
			var m Matches
			ix.FindMatchesByTier(locals(hs...), ViewTiered, false, &m)
			done <- m
		}()
		select {
		case m := <-done:
			lookups++
			got := toMap(&m)
			if _, ok := got[rk1]; ok || got[rk2] != [kvevent.NumTiers]uint32{n, 0, 0, 0} || len(got) != 1 {
				t.Errorf("lookup %d during the replace of rk1: %v, want rk2 alone with its %d device blocks", lookups, got, n)
			}
			if want := slices.Repeat([]uint32{1}, n); !slices.Equal(m.Frequencies, want) {
				t.Errorf("lookup %d during the replace of rk1: frequencies %v, want rk2's alone %v", lookups, m.Frequencies, want)
			}
		case <-hang:
			t.Fatal("a lookup between two chunks of a replace waited for the replace")
		}
		select {
		case d := <-dumped:
			t.Errorf("a dump of rk1 returned during its replace (%d entries)", len(d.Entries))
			dumped <- d // for the check after the replace
		default:
		}
	}
	if bad := ix.ReplaceRank(rk1, dump, 0); bad != 0 {
		t.Fatalf("%d events malformed", bad)
	}
	ix.applyUnlocked = nil
	// The clear of 32 residencies and the replay of 32 one-block events
	// (2 of the budget each): 4 releases, then 8, less the last event's.
	if lookups < 10 {
		t.Fatalf("%d lookups between the chunks of a replace of %d blocks, ApplyChunk 8: want 10 or more", lookups, n)
	}
	if got := find(ix, ViewTiered, locals(hs...)); got[rk1] != [kvevent.NumTiers]uint32{0, n, 0, 0} || got[rk2] != [kvevent.NumTiers]uint32{n, 0, 0, 0} {
		t.Fatalf("after the replace: %v, want rk1 with its %d host blocks and rk2 with its device ones", got, n)
	}
	d := <-dumped
	if len(d.Entries) != n || d.Entries[0].Mask != kvevent.TierHostPinned.Bit() {
		t.Fatalf("a dump of rk1 started during its replace: %d entries (%+v), want its %d host entries", len(d.Entries), d.Entries, n)
	}
}

// TestReplaceRankInChunksEndsAsInOne: where a replace releases the lock
// changes nothing it leaves: the digest (replicas compare it), the dump,
// the stats and the durable copy the journal keeps are those of a replace that never releases it.
func TestReplaceRankInChunksEndsAsInOne(t *testing.T) {
	var states [2]struct {
		ix *Index
		j  *copyJournal
	}
	for i, chunk := range []int{1, 1 << 30} {
		ix := New(Config{ApplyChunk: chunk})
		j := newCopyJournal()
		ix.SetJournal(j)
		mustApply(t, ix, stored(rk1, dev, chain(1, 2, 3, 4)), stored(rk2, dev, chain(1, 2)), stored(rk1, host, chain(9)))
		ix.SetCapacity(rk1, [kvevent.NumTiers]int64{3})
		ix.FlushJournal()
		dump := []kvevent.Event{*stored(rk1, dev, chain(1, 2)), *storedUnder(rk1, dev, 2, chain(5, 6)), *storedUnder(rk1, host, 8, chain(7)), *stored(rk1, dev, chain(10))}
		if bad := ix.ReplaceRank(rk1, dump, 0); bad != 0 {
			t.Fatalf("ApplyChunk %d: %d events malformed", chunk, bad)
		}
		ix.FlushJournal()
		states[i].ix, states[i].j = ix, j
	}
	a, b := states[0], states[1]
	if a.ix.Digest() != b.ix.Digest() {
		t.Fatalf("digest after a replace in chunks of 1 block %#x, in one %#x", a.ix.Digest(), b.ix.Digest())
	}
	da, erra := a.ix.DumpRank(rk1)
	db, errb := b.ix.DumpRank(rk1)
	if erra != nil || errb != nil || !reflect.DeepEqual(da, db) {
		t.Fatalf("dump after a replace in chunks %+v (%v), in one %+v (%v)", da, erra, db, errb)
	}
	if sa, sb := a.ix.Stats(), b.ix.Stats(); !reflect.DeepEqual(sa, sb) {
		t.Fatalf("stats after a replace in chunks %+v, in one %+v", sa, sb)
	}
	if !reflect.DeepEqual(a.j, b.j) {
		t.Fatalf("durable copy after a replace in chunks %+v, in one %+v", a.j, b.j)
	}
}

// BenchmarkReplaceRankLockHold replaces a rank of 1,024,000 blocks (4000
// stored chains of 256 blocks, as a dump over NATS sends them) by the same
// and reports the longest hold of the write lock (max-hold-ms: from the
// call or a release to the next release or the end, lookups waiting
// that long at most) and the whole replace (replace-ms). A build that
// never releases the lock inside ReplaceRank reports the two equal.
//
//	go test -run '^$' -bench ReplaceRankLockHold -benchtime 3x ./indexer/
func BenchmarkReplaceRankLockHold(b *testing.B) {
	const chains, per = 4000, 256
	evs := make([]kvevent.Event, chains)
	for c := range evs {
		blocks := make([]kvevent.Block, per)
		for i := range blocks {
			h := uint64(c*per+i) + 1
			blocks[i] = kvevent.Block{EngineHash: h, LocalHash: h * 0x9e3779b97f4a7c15}
		}
		evs[c] = *stored(rk1, dev, blocks)
	}
	ix := New(Config{})
	if bad := ix.ApplyBatch(evs, 0); bad != 0 {
		b.Fatalf("%d events malformed", bad)
	}
	var last time.Time
	var maxHold time.Duration
	ix.applyUnlocked = func() {
		now := time.Now()
		maxHold = max(maxHold, now.Sub(last))
		last = now
	}
	var total time.Duration
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		last = start
		ix.ReplaceRank(rk1, evs, 0)
		end := time.Now()
		maxHold = max(maxHold, end.Sub(last))
		total += end.Sub(start)
	}
	b.ReportMetric(float64(maxHold.Microseconds())/1000, "max-hold-ms")
	b.ReportMetric(float64(total.Microseconds())/1000/float64(b.N), "replace-ms")
}

// TestReplaceRankIsNoLongerAskedForBetweenChunks: a rank that needs a
// resync stops needing one when its dump's replace starts: a reader
// between two chunks of it (a heartbeat's answer lists the ranks that
// need one) sees the flag cleared from the first release, also while the
// old residencies are still being dropped, and the agent is not asked for
// the dump it is sending.
func TestReplaceRankIsNoLongerAskedForBetweenChunks(t *testing.T) {
	ix := New(Config{ApplyChunk: 4})
	const n = 32
	hs := firstHashes(n)
	mustApply(t, ix, stored(rk1, dev, chain(hs...)))
	ix.SetRankFlags(rk1, true, false)
	if !ix.RankNeedsResync(rk1) {
		t.Fatal("rk1 does not need a resync after SetRankFlags")
	}
	releases := 0
	ix.applyUnlocked = func() {
		releases++
		if ix.RankNeedsResync(rk1) || slices.Contains(ix.NeedsResync(), rk1) {
			t.Errorf("release %d of rk1's replace: rk1 still reads as needing a resync", releases)
		}
	}
	if bad := ix.ReplaceRank(rk1, []kvevent.Event{*stored(rk1, host, chain(hs...))}, 0); bad != 0 {
		t.Fatalf("%d events malformed", bad)
	}
	ix.applyUnlocked = nil
	if releases < n/4 {
		t.Fatalf("%d releases while %d old residencies were dropped, ApplyChunk 4: the clear was not chunked", releases, n)
	}
	if ix.RankNeedsResync(rk1) {
		t.Fatal("rk1 needs a resync after its replace")
	}
}

// firstHashes returns the content hashes 1 to n, a chain's.
func firstHashes(n int) []uint64 {
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = uint64(i + 1)
	}
	return hs
}
