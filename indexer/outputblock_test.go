package indexer

import (
	"fmt"
	"math/rand"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
)

// seqRange returns the hashes from, from+1, ..., from+n-1.
func seqRange(from uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = from + uint64(i)
	}
	return out
}

// TestOutputBlocksStopAtMaxBookingBlocks: a booking takes output blocks
// until it holds MaxBookingBlocks, then none, and the refused add changes
// nothing (load, blocks, digest); a prompt already over the bound is
// booked whole and takes none. Output blocks come one per call of the
// compatible API's output_block with no other bound than the booking's
// max age, and every replica keeps each one.
func TestOutputBlocksStopAtMaxBookingBlocks(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, seqRange(1, MaxBookingBlocks-1), 16, 0, 0)
	if !s.AddOutputBlock("r1", 1<<40) {
		t.Fatal("the booking's last block was refused")
	}
	load, d := s.Load(wkA0), s.Digest()
	if s.AddOutputBlock("r1", 1<<40+1) {
		t.Fatalf("an output block past %d blocks was added", MaxBookingBlocks)
	}
	if n, ok := s.Blocks("r1"); !ok || n != MaxBookingBlocks {
		t.Fatalf("Blocks = %d, %v; want %d", n, ok, MaxBookingBlocks)
	}
	if s.Load(wkA0) != load || s.Digest() != d {
		t.Fatal("the refused output block changed the state")
	}

	mustBook(t, s, "big", wkA0, seqRange(1<<41, MaxBookingBlocks+1), 16, 0, 0)
	if n, _ := s.Blocks("big"); n != MaxBookingBlocks+1 {
		t.Fatalf("a prompt over the bound was booked with %d blocks, want all %d", n, MaxBookingBlocks+1)
	}
	if s.AddOutputBlock("big", 7) {
		t.Fatal("a booking over the bound took an output block")
	}
	if _, ok := s.Blocks("nope"); ok {
		t.Fatal("Blocks of an unknown id")
	}
	// Holds answers the cap's idempotent resend (raftfsm's OutputBlock).
	for _, c := range []struct {
		id   string
		h    uint64
		want bool
	}{{"r1", 1 << 40, true}, {"r1", 1, true}, {"r1", 1<<40 + 1, false}, {"nope", 1, false}} {
		if got := s.Holds(c.id, c.h); got != c.want {
			t.Fatalf("Holds(%q, %d) = %v, want %v", c.id, c.h, got, c.want)
		}
	}
}

// TestOutputBlocksOfOneBookingCostConstantWork: every replica applies a
// reservation's output blocks (the compatible API's output_block, one per
// call) through AddOutputBlock, serially. Each add scanned, copied
// (slices.Clip forced a new array) and rehashed the booking's whole
// sequence: O(blocks held) each, O(n²) a booking (a review's d281275:
// adds at 50k blocks cost 13x those of a fresh booking). Each now reads
// no block of the booking's (the hash waits for Digest, which reads them
// once) and moves its array only as append grows it; the digest is the
// one a replica that restored the same state computes.
func TestOutputBlocksOfOneBookingCostConstantWork(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1}, 16, 0, 1)
	mustBook(t, s, "r2", wkA0, []uint64{1}, 16, 0, 1) // shares block 1: the r1 set is built once
	b := s.st.byID["r1"]
	const total = 20_000
	hashed, moves := s.st.hashed, 0
	for i := range total {
		arr := &b.seq[0]
		if !s.AddOutputBlock("r1", uint64(1000+i)) {
			t.Fatalf("add %d refused", i)
		}
		if &b.seq[0] != arr {
			moves++
		}
		if i%1000 == 0 && s.AddOutputBlock("r1", 1) {
			t.Fatal("block 1, held by r1 and r2, was added to r1 again")
		}
	}
	if got := s.st.hashed - hashed; got != 0 {
		t.Fatalf("%d output blocks read %d blocks to hash: each add rehashes the booking", total, got)
	}
	if moves > 100 {
		t.Fatalf("%d output blocks moved the booking's array %d times: each add copies it", total, moves)
	}
	d := s.Digest()
	if got := s.st.hashed - hashed; got != total+1 {
		t.Fatalf("Digest read %d blocks, want the booking's %d once", got, total+1)
	}
	restored := NewSequences()
	if err := restored.Restore(s.Snapshot()); err != nil {
		t.Fatal(err)
	}
	if restored.Digest() != d || s.Digest() != d {
		t.Fatal("the digest differs from a restored replica's")
	}
	if err := s.st.check(); err != nil {
		t.Fatal(err)
	}
}

// TestStaleBookingHashesNeverShowInTheDigest: a booking's hash is left
// stale by output blocks and settled by Digest, PrefillDone, SetDecay, a
// free or an expiry. Two replicas apply the same random operations, one
// reading its digest after every one (its bookings always settled), the
// other only now and then (stale ones pile up); a third restores the
// second's snapshot. All digests and loads agree, and the invariant check
// holds, at every point: a settle dropped from PrefillDone, Expire or a
// free passed every other test.
func TestStaleBookingHashesNeverShowInTheDigest(t *testing.T) {
	for seed := int64(1); seed <= 30; seed++ {
		rng := rand.New(rand.NewSource(seed))
		a, b := NewSequences(), NewSequences()
		ranks := []kvevent.Rank{{Worker: 1}, {Worker: 1, DP: 1}, {Worker: 2}}
		var now int64
		for step := range 400 {
			id := fmt.Sprintf("r%d", rng.Intn(12))
			var op string
			switch k := rng.Intn(10); {
			case k < 2:
				seq := []uint64{uint64(rng.Intn(6)), uint64(rng.Intn(6))}
				r := ranks[rng.Intn(len(ranks))]
				op = fmt.Sprintf("add %s %v %v", id, r, seq)
				a.Add(id, r, seq, 64, 0, now)
				b.Add(id, r, seq, 64, 0, now)
			case k < 6:
				h := uint64(rng.Intn(20))
				op = fmt.Sprintf("out %s %d", id, h)
				if a.AddOutputBlock(id, h) != b.AddOutputBlock(id, h) {
					t.Fatalf("seed %d step %d: %s answered differently", seed, step, op)
				}
			case k < 7:
				op = "prefill " + id
				a.PrefillDone(id)
				b.PrefillDone(id)
			case k < 8:
				w := uint32(rng.Intn(3)) * 300000
				op = fmt.Sprintf("decay %s %d", id, w)
				a.SetDecay(id, w)
				b.SetDecay(id, w)
			case k < 9:
				op = "free " + id
				a.Free(id)
				b.Free(id)
			default:
				now += int64(time.Second)
				op = "expire"
				a.Expire(now, 5*time.Second)
				b.Expire(now, 5*time.Second)
			}
			da := a.Digest()
			if err := a.st.check(); err != nil {
				t.Fatalf("seed %d step %d (%s): %v", seed, step, op, err)
			}
			if rng.Intn(5) == 0 {
				db := b.Digest()
				r := NewSequences()
				if err := r.Restore(b.Snapshot()); err != nil {
					t.Fatal(err)
				}
				if da != db || r.Digest() != db {
					t.Fatalf("seed %d step %d (%s): digests %x (settled), %x (stale), %x (restored)", seed, step, op, da, db, r.Digest())
				}
				if la, lb := a.Loads(nil), b.Loads(nil); !slices.Equal(la, lb) {
					t.Fatalf("seed %d step %d (%s): loads %v (settled), %v (stale)", seed, step, op, la, lb)
				}
			}
			if err := b.st.check(); err != nil {
				t.Fatalf("seed %d step %d (%s): stale replica: %v", seed, step, op, err)
			}
		}
	}
}

// TestDigestRacesNoReader: Digest settles stale bookings under the write
// lock while readers (Get, Blocks, Loads, Snapshot) run; -race finds no
// race.
func TestDigestRacesNoReader(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", kvevent.Rank{Worker: 1}, []uint64{1}, 16, 0, 0)
	mustBook(t, s, "r2", kvevent.Rank{Worker: 1}, []uint64{1}, 16, 0, 0)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				s.Get("r1")
				s.Blocks("r1")
				s.Loads(nil)
				s.Snapshot()
				s.Digest()
			}
		}()
	}
	for i := range 3000 {
		s.AddOutputBlock("r1", uint64(100+i))
		s.AddOutputBlock("r2", uint64(100+i))
	}
	close(stop)
	wg.Wait()
}
