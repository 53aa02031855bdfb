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
}
