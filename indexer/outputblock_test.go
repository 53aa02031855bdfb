package indexer

import (
	"testing"
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
