// pending_test.go checks that the pending bookings add to the committed
// load what the tracker will hold once they apply.

package indexer

import (
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

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
// counts once) and potential decode blocks. It holds whatever happens
// between the adds: pending bookings dropped (never to apply) or applied,
// and the live bookings changed under the pending ones (booked, freed,
// grown by an output block, expired, their rank removed, the whole state
// restored), so that a block a pending booking brings counts exactly while
// no live booking of its rank holds it.
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
		p := NewPending(committed)
		var pending []pend
		book := func(s *Sequences, id string, now int64) {
			r := rapid.SampledFrom(ranks).Draw(t, "rank")
			seq := genSeqHashes().Draw(t, "seq")
			isl, cached := rapid.IntRange(0, 64).Draw(t, "isl"), rapid.IntRange(0, 64).Draw(t, "cached")
			if _, err := s.Add(id, r, seq, isl, cached, now); err != nil {
				t.Fatal(err)
			}
		}
		liveID := func() (string, bool) {
			bs := committed.Bookings()
			if len(bs) == 0 {
				return "", false
			}
			return rapid.SampledFrom(bs).Draw(t, "live").ID, true
		}
		for i, n := 0, rapid.IntRange(0, 16).Draw(t, "ops"); i < n; i++ {
			now := int64(i)
			switch op := rapid.IntRange(0, 9).Draw(t, "op"); {
			case op <= 2:
				e := pend{id: fmt.Sprintf("p%d", i), r: rapid.SampledFrom(ranks).Draw(t, "rank"), seq: genSeqHashes().Draw(t, "seq"),
					isl: rapid.IntRange(0, 64).Draw(t, "isl"), cached: rapid.IntRange(0, 64).Draw(t, "cached")}
				if e.ticket = p.Add(e.id, e.r, e.seq, e.isl, e.cached); e.ticket == 0 {
					t.Fatalf("Add(%s) recorded nothing", e.id)
				}
				pending = append(pending, e)
			case op == 3 && len(pending) > 0: // its proposal failed: it never applies
				j := rapid.IntRange(0, len(pending)-1).Draw(t, "drop")
				p.Drop(pending[j].id, pending[j].ticket)
				pending = slices.Delete(pending, j, j+1)
			case op == 4 && len(pending) > 0: // it applies, as FSM.applyBookAdd does
				j := rapid.IntRange(0, len(pending)-1).Draw(t, "apply")
				e := pending[j]
				p.Settle(e.id)
				if _, err := committed.Add(e.id, e.r, e.seq, e.isl, e.cached, now); err != nil {
					t.Fatal(err)
				}
				pending = slices.Delete(pending, j, j+1)
			case op == 5:
				book(committed, fmt.Sprintf("c%d", i), now)
			case op == 6:
				if id, ok := liveID(); ok {
					committed.Free(id)
				}
			case op == 7:
				if id, ok := liveID(); ok {
					committed.AddOutputBlock(id, rapid.Uint64Range(1, 12).Draw(t, "output"))
				}
			case op == 8:
				if rapid.Bool().Draw(t, "expire") {
					committed.Expire(now, time.Duration(rapid.Int64Range(1, 4).Draw(t, "age")))
				} else {
					committed.RemoveRank(rapid.SampledFrom(ranks).Draw(t, "remove"))
				}
			case op == 9: // a snapshot installed under the pending bookings
				other := NewSequences()
				for j, m := 0, rapid.IntRange(0, 4).Draw(t, "restored"); j < m; j++ {
					book(other, fmt.Sprintf("r%d.%d", i, j), now)
				}
				if err := committed.Restore(other.Snapshot()); err != nil {
					t.Fatal(err)
				}
			}
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
	p := NewPending(s)
	seq := []uint64{1, 2, 3, 4}
	first := p.Add("a", wkA0, seq, 16, 0)
	p.Add("b", wkA0, seq, 16, 0)
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
	p := NewPending(s)
	for _, id := range []string{"live", "freed"} {
		if p.Add(id, wkA1, []uint64{2}, 8, 0) != 0 {
			t.Fatalf("a pending booking of %s, which the tracker knows", id)
		}
	}
	first := p.Add("r", wkA1, []uint64{2, 3}, 8, 0)
	if first == 0 || p.Add("r", wkA1, []uint64{2, 3}, 8, 0) != 0 {
		t.Fatal("a retry of a pending id was recorded again")
	}
	p.Drop("r", first+1)
	if r, ok := p.RankOf("r"); !ok || r != wkA1 {
		t.Fatalf("a Drop with another ticket removed r (%v %v)", r, ok)
	}
	p.Settle("r")
	again := p.Add("r", wkA1, []uint64{2, 3}, 8, 0)
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
	p := NewPending(s)
	seq := []uint64{1, 2, 3, 4}
	p.Add("a", wkA0, seq, 16, 0)
	p.Add("b", wkA1, seq[:2], 16, 0)
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
			p := NewPending(s)
			before := liveHeap()
			const n, blocks = 1000, 1024 // 1,000 booked routes of 16k-token prompts (block size 16)
			seq := make([]uint64, blocks)
			for i := range n {
				for j := range seq {
					seq[j] = uint64(i)<<20 | uint64(j)
				}
				p.Add(fmt.Sprintf("r%d", i), wkA0, seq, 1, 0)
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

// TestPendingKeepsAtMostSixteenSmallSpares pins DESIGN.md's "it keeps at
// most 16 spare bookings" and the cap on a spare's room (pendingSpare,
// pendingSpareBlocks) by looking at the spares themselves, so that it runs
// under the race detector too, where
// TestPendingReleasesABurstsMemoryOnceEmpty, which bounds the heap, is
// skipped. Both bounds were unpinned: remove's len(p.spare) < pendingSpare
// or its cap(b.blocks) <= pendingSpareBlocks was deletable with every
// indexer test passing. A burst of 40 bookings, every fourth with more
// hashes than a spare may have room for, is settled, dropped or cleared.
func TestPendingKeepsAtMostSixteenSmallSpares(t *testing.T) {
	for _, how := range []string{"settled", "dropped", "cleared"} {
		t.Run(how, func(t *testing.T) {
			p := NewPending(NewSequences())
			const n = 40
			tickets := make([]uint64, n)
			for i := range n {
				blocks := 8
				if i%4 == 0 {
					blocks = pendingSpareBlocks + 1
				}
				seq := make([]uint64, blocks)
				for j := range seq {
					seq[j] = uint64(i)<<20 | uint64(j)
				}
				if tickets[i] = p.Add(fmt.Sprintf("r%d", i), wkA0, seq, 1, 0); tickets[i] == 0 {
					t.Fatalf("booking r%d not added", i)
				}
			}
			switch how {
			case "settled":
				for i := range n {
					p.Settle(fmt.Sprintf("r%d", i))
				}
			case "dropped":
				for i := range n {
					p.Drop(fmt.Sprintf("r%d", i), tickets[i])
				}
			case "cleared":
				p.Clear()
			}
			if p.Len() != 0 {
				t.Fatalf("%d still pending", p.Len())
			}
			if len(p.spare) > pendingSpare {
				t.Errorf("%d spare bookings kept, want at most %d", len(p.spare), pendingSpare)
			}
			for i, b := range p.spare {
				if cap(b.blocks) > pendingSpareBlocks {
					t.Errorf("spare %d has room for %d hashes, want at most %d", i, cap(b.blocks), pendingSpareBlocks)
				}
			}
		})
	}
}

// TestPendingBlocksFollowTheLiveBookings: a block a pending booking
// brings counts while, and only while, no live booking of its rank holds
// it: two pending bookings of one prompt, the first applied, leave the
// second adding none of its blocks (counted twice before, which made a
// rank look busy at half its capacity); a pending booking whose blocks a
// live booking held when it was added brings them once that one is freed
// (counted nowhere before).
func TestPendingBlocksFollowTheLiveBookings(t *testing.T) {
	seq := []uint64{1, 2, 3, 4}
	unrelated := []uint64{9}
	check := func(t *testing.T, s *Sequences, p *Pending, pending ...string) {
		t.Helper()
		got := candidatesFor(s, []kvevent.Rank{wkA0, wkA1}, unrelated)
		p.AddTo(got, unrelated)
		applied := NewSequences()
		for _, b := range s.Bookings() {
			mustBook(t, applied, b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens, 0)
		}
		for _, id := range pending {
			mustBook(t, applied, id, wkA0, seq, 64, 0, 0)
		}
		if want := candidatesFor(applied, []kvevent.Rank{wkA0, wkA1}, unrelated); !slices.Equal(got, want) {
			t.Fatalf("committed + pending:\n  %+v\nonce %v apply:\n  %+v", got, pending, want)
		}
	}
	t.Run("a sharer applies", func(t *testing.T) {
		s := NewSequences()
		p := NewPending(s)
		p.Add("a", wkA0, seq, 64, 0)
		p.Add("b", wkA0, seq, 64, 0)
		p.Settle("a")
		mustBook(t, s, "a", wkA0, seq, 64, 0, 0)
		check(t, s, p, "b")

		cands := candidatesFor(s, []kvevent.Rank{wkA0}, seq)
		p.AddTo(cands, seq)
		cands[0].CapacityBlocks = 6
		params := DefaultParams()
		params.BusyDecodeFraction = 1
		var d Decision
		if err := Select(params, Request{ISL: 64, BlockSize: 16}, cands, nil, &d); err != nil {
			t.Fatalf("a rank holding 4 distinct blocks of 6 refused: %v (decode blocks seen: %d)", err, cands[0].Load.ActiveDecodeBlocks)
		}
	})
	t.Run("the sharer is freed", func(t *testing.T) {
		s := NewSequences()
		mustBook(t, s, "a", wkA0, seq, 64, 0, 0)
		p := NewPending(s)
		p.Add("b", wkA0, seq, 64, 0)
		s.Free("a")
		check(t, s, p, "b")
	})
}
