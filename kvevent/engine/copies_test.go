package engine

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// What ends the counts: a clear in the stream, Reset (a new epoch) and
// ForgetCopies (the subscriber cleared the rank after lost batches). A
// count kept past them would hold a block on the router after the engine's
// one remove of it (the block was stored once since), the unsafe
// direction.
func TestCopiesAreForgottenWithTheRanksState(t *testing.T) {
	const h = 0x77
	for _, c := range []struct {
		name   string
		forget func(d *Decoder)
	}{
		{"AllBlocksCleared", func(d *Decoder) { decode(t, d, in(t, []any{"AllBlocksCleared"})) }},
		{"Reset", (*Decoder).Reset},
		{"ForgetCopies", (*Decoder).ForgetCopies},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			store := in(t, []any{"BlockStored", []any{h}, nil, tokens(0, d.blockSize)})
			decode(t, d, store)
			decode(t, d, store)
			c.forget(d)
			if n := d.Stats().Copies; n != 0 {
				t.Fatalf("%d copies counted after %s, want 0", n, c.name)
			}
			decode(t, d, store)
			assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{h}})),
				[]kvevent.Event{removed(rank, kvevent.TierDevice, h)})
		})
	}
}

// Config.MaxCopies bounds the counts: a hash first stored once the bound is
// reached is not counted, and its removes pass (as every remove did before
// counts); the hashes counted before keep counting. A negative bound
// counts nothing.
func TestCopyCountsStayBounded(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, MaxCopies: 2})
	store := func(h uint64, first int) []byte {
		return in(t, []any{"BlockStored", []any{h}, nil, tokens(first, d.blockSize)})
	}
	for _, h := range []uint64{1, 2, 3, 1, 3} {
		decode(t, d, store(h, int(h)*100))
	}
	if n := d.Stats().Copies; n != 2 {
		t.Fatalf("%d copies counted, want the bound 2", n)
	}
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{3}})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, 3)})
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{1}})), nil)
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{1}})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, 1)})

	off := newTestDecoder(t, Config{Rank: rank, MaxCopies: -1})
	decode(t, off, store(5, 0))
	decode(t, off, store(5, 0))
	assertEvents(t, decode(t, off, in(t, []any{"BlockRemoved", []any{5}})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, 5)})
	if n := off.Stats().Copies; n != 0 {
		t.Fatalf("MaxCopies -1: %d copies counted, want 0", n)
	}
}

// A store the decoder drops (here: unresolved, an offload store of a block
// never seen with tokens) is not counted: the router never held it. (The
// engine did store it, so a count would not exceed its copies; not counting
// keeps the counts to what the router was told.)
func TestDroppedStoresAreNotCounted(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	decode(t, d, in(t, []any{"BlockStored", []any{9}, nil, []any{}, nil, nil, "CPU"}))
	if s := d.Stats(); s.Skipped[ReasonUnresolved] != 1 || s.Copies != 0 {
		t.Fatalf("unresolved offload store: skipped %d, %d copies counted; want 1 and 0", s.Skipped[ReasonUnresolved], s.Copies)
	}
}

// Decode allocates nothing once a reused Batch has grown (doc.go), and an
// AllBlocksCleared is an ordinary event of vLLM's stream (reset_prefix_cache,
// every weight update of an RL loop). But a clear drops the copy counts' maps
// (copies.forget) instead of emptying them, so the next store builds a new
// map: a stream that stores and clears allocates on every batch.
func TestDecodeOfStoresAndClearsDoesNotAllocateInSteadyState(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	p := in(t, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 32), 16, nil, "GPU"}, []any{"AllBlocksCleared"})
	var b Batch
	for range 3 { // warm up
		if err := d.Decode(p, &b); err != nil {
			t.Fatal(err)
		}
		b.Reset()
	}
	allocs := testing.AllocsPerRun(200, func() {
		b.Reset()
		if err := d.Decode(p, &b); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("Decode of [store, AllBlocksCleared] allocated %.1f times per batch, want 0", allocs)
	}
}

// A remove the decoder skips (here a bad field: a medium that is not a
// string) is one the engine made: the engine's copies went from two to one,
// the count stays at two. Before counts, the router kept the block only
// until the engine's next remove of it; now that remove is absorbed by the
// count the skipped one left, and the block stays on the router after the
// engine evicted its last copy, until a clear.
func TestASkippedRemoveDoesNotKeepTheBlockPastTheLastCopy(t *testing.T) {
	const h = 0x78
	d := newTestDecoder(t, Config{Rank: rank})
	store := in(t, []any{"BlockStored", []any{h}, nil, tokens(0, d.blockSize)})
	decode(t, d, store)
	decode(t, d, store)
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{h}, 5})), nil) // skipped: bad medium
	if s := d.Stats(); s.Skipped[ReasonBadField] != 1 {
		t.Fatalf("skipped %v, want the remove with the bad medium skipped", s.Skipped)
	}
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []any{h}})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, h)})
}
