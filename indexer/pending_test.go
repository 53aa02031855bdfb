// pending_test.go checks that the pending bookings add to the committed
// load what the tracker will hold once they apply.

package indexer

import (
	"fmt"
	"runtime"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// candidatesFor returns the candidates ranks would be for a request of
// seq with s's committed load, as a route builds them: every rank, idle
// ones with the request's distinct blocks as potential decode blocks.
func candidatesFor(s *Sequences, ranks []kvevent.Rank, seq []uint64) []Candidate {
	loads, idle := s.PotentialDecodeBlocks(nil, seq, nil)
	cands := make([]Candidate, len(ranks))
	for i, r := range ranks {
		cands[i] = Candidate{Rank: r, PotentialDecodeBlocks: idle}
		for _, l := range loads {
			if l.Rank == r {
				cands[i].Load, cands[i].PotentialDecodeBlocks = l.Load, l.PotentialDecodeBlocks
			}
		}
	}
	return cands
}

// TestPendingLoadIsWhatTheBookingsAddOnceApplied: the committed load plus
// the pending bookings' equals the load once the bookings still pending
// apply, for the candidates of any request: requests, prefill tokens,
// decode blocks (a block shared with a live or another pending booking
// counts once) and potential decode blocks; also after some were dropped
// (never to apply) between the adds of others.
func TestPendingLoadIsWhatTheBookingsAddOnceApplied(t *testing.T) {
	ranks := []kvevent.Rank{wkA0, wkA1, wkB0}
	type pend struct {
		id          string
		r           kvevent.Rank
		seq         []uint64
		isl, cached int
		ticket      uint64
	}
	rapid.Check(t, func(t *rapid.T) {
		committed := NewSequences()
		p := NewPending()
		for i, n := 0, rapid.IntRange(0, 6).Draw(t, "committed"); i < n; i++ {
			id := fmt.Sprintf("c%d", i)
			r := rapid.SampledFrom(ranks).Draw(t, "rank")
			seq := genSeqHashes().Draw(t, "seq")
			isl, cached := rapid.IntRange(0, 64).Draw(t, "isl"), rapid.IntRange(0, 64).Draw(t, "cached")
			if _, err := committed.Add(id, r, seq, isl, cached, 0); err != nil {
				t.Fatal(err)
			}
		}
		var pending []pend
		for i, n := 0, rapid.IntRange(0, 8).Draw(t, "ops"); i < n; i++ {
			if len(pending) > 0 && rapid.IntRange(0, 2).Draw(t, "op") == 0 {
				// Its proposal failed: it never applies.
				j := rapid.IntRange(0, len(pending)-1).Draw(t, "drop")
				p.Drop(pending[j].id, pending[j].ticket)
				pending = slices.Delete(pending, j, j+1)
				continue
			}
			e := pend{id: fmt.Sprintf("p%d", i), r: rapid.SampledFrom(ranks).Draw(t, "rank"), seq: genSeqHashes().Draw(t, "seq"),
				isl: rapid.IntRange(0, 64).Draw(t, "isl"), cached: rapid.IntRange(0, 64).Draw(t, "cached")}
			if e.ticket = p.Add(committed, e.id, e.r, e.seq, e.isl, e.cached); e.ticket == 0 {
				t.Fatalf("Add(%s) recorded nothing", e.id)
			}
			pending = append(pending, e)
		}
		applied := NewSequences()
		for _, b := range committed.Bookings() {
			if _, err := applied.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens, 0); err != nil {
				t.Fatal(err)
			}
		}
		for _, e := range pending {
			if _, err := applied.Add(e.id, e.r, e.seq, e.isl, e.cached, 0); err != nil {
				t.Fatal(err)
			}
		}
		seq := genSeqHashes().Draw(t, "query")
		got := candidatesFor(committed, ranks, seq)
		p.AddTo(got, seq)
		if want := candidatesFor(applied, ranks, seq); !slices.Equal(got, want) {
			t.Fatalf("committed + pending:\n%+v\nafter the bookings still pending apply:\n%+v", got, want)
		}
	})
}

// TestPendingDropKeepsBlocksOtherBookingsShare: a booking dropped (its
// proposal failed, it never applies) takes away only the blocks no other
// pending booking of its rank holds: one with the same prompt still
// applies, and will hold them.
func TestPendingDropKeepsBlocksOtherBookingsShare(t *testing.T) {
	s := NewSequences()
	p := NewPending()
	seq := []uint64{1, 2, 3, 4}
	first := p.Add(s, "a", wkA0, seq, 16, 0)
	p.Add(s, "b", wkA0, seq, 16, 0)
	p.Drop("a", first)

	got := []Candidate{{Rank: wkA0}}
	p.AddTo(got, nil)
	applied := NewSequences()
	mustBook(t, applied, "b", wkA0, seq, 16, 0, 0)
	if want := applied.Load(wkA0); got[0].Load != want {
		t.Fatalf("pending load after a's drop: %+v; once b applies the rank holds %+v", got[0].Load, want)
	}
}

// TestPendingCountsAnIDOnce: a retry of an id already pending, or already
// known to the tracker (live or freed), adds nothing; Drop removes only
// the booking its ticket names, Settle whichever is pending.
func TestPendingCountsAnIDOnce(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "live", wkA0, []uint64{1}, 8, 0, 0)
	mustBook(t, s, "freed", wkA0, []uint64{1}, 8, 0, 0)
	s.Free("freed")
	p := NewPending()
	for _, id := range []string{"live", "freed"} {
		if p.Add(s, id, wkA1, []uint64{2}, 8, 0) != 0 {
			t.Fatalf("a pending booking of %s, which the tracker knows", id)
		}
	}
	first := p.Add(s, "r", wkA1, []uint64{2, 3}, 8, 0)
	if first == 0 || p.Add(s, "r", wkA1, []uint64{2, 3}, 8, 0) != 0 {
		t.Fatal("a retry of a pending id was recorded again")
	}
	p.Drop("r", first+1)
	if r, ok := p.RankOf("r"); !ok || r != wkA1 {
		t.Fatalf("a Drop with another ticket removed r (%v %v)", r, ok)
	}
	p.Settle("r")
	again := p.Add(s, "r", wkA1, []uint64{2, 3}, 8, 0)
	p.Drop("r", first)
	if p.Len() != 1 {
		t.Fatal("the first Add's Drop removed a later Add's booking")
	}
	p.Drop("r", again)
	cands := []Candidate{{Rank: wkA1, PotentialDecodeBlocks: 2}}
	p.AddTo(cands, []uint64{2, 3})
	if p.Len() != 0 || cands[0] != (Candidate{Rank: wkA1, PotentialDecodeBlocks: 2}) || len(p.holders) != 0 || len(p.ranks) != 0 {
		t.Fatalf("after every booking went: %d pending, %d holders, %d ranks, candidate %+v", p.Len(), len(p.holders), len(p.ranks), cands[0])
	}
}

// TestPendingAddToDoesNotAllocate: a booked route adds the pending load
// to its candidates on the hot path.
func TestPendingAddToDoesNotAllocate(t *testing.T) {
	s := NewSequences()
	p := NewPending()
	seq := []uint64{1, 2, 3, 4}
	p.Add(s, "a", wkA0, seq, 16, 0)
	p.Add(s, "b", wkA1, seq[:2], 16, 0)
	cands := []Candidate{{Rank: wkA0}, {Rank: wkA1}, {Rank: wkB0}}
	p.AddTo(cands, seq) // grows the scratch
	if n := testing.AllocsPerRun(100, func() { p.AddTo(cands, seq) }); n != 0 {
		t.Fatalf("AddTo allocates %.0f times a call", n)
	}
}

// TestPendingReleasesABurstsMemoryOnceEmpty: a leader's pending list is
// empty most of the time; once a burst's bookings are all gone (applied,
// dropped or cleared), it keeps no more than a small part of the memory
// the burst took.
func TestPendingReleasesABurstsMemoryOnceEmpty(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory skews the heap")
	}
	for _, how := range []string{"settled", "cleared"} {
		t.Run(how, func(t *testing.T) {
			s := NewSequences()
			p := NewPending()
			before := liveHeap()
			const n, blocks = 1000, 1024 // 1,000 booked routes of 16k-token prompts (block size 16)
			seq := make([]uint64, blocks)
			for i := range n {
				for j := range seq {
					seq[j] = uint64(i)<<20 | uint64(j)
				}
				p.Add(s, fmt.Sprintf("r%d", i), wkA0, seq, 1, 0)
			}
			peak := liveHeap()
			if how == "cleared" {
				p.Clear()
			} else {
				for i := range n {
					p.Settle(fmt.Sprintf("r%d", i))
				}
			}
			after := liveHeap()
			runtime.KeepAlive(p)
			if p.Len() != 0 {
				t.Fatalf("%d still pending", p.Len())
			}
			t.Logf("heap: before %d KiB, at the burst's peak %d KiB, with nothing pending %d KiB", before>>10, peak>>10, after>>10)
			if kept := int64(after) - int64(before); kept > int64(peak-before)/4 {
				t.Fatalf("with nothing pending the Pending keeps %d KiB of the %d KiB the burst took", kept>>10, (peak-before)>>10)
			}
		})
	}
}
