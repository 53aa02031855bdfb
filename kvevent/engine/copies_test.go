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
// never seen with tokens) is not counted: the router never held it, and a
// count of it would absorb the remove of the engine's one real copy.
func TestDroppedStoresAreNotCounted(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	decode(t, d, in(t, []any{"BlockStored", []any{9}, nil, []any{}, nil, nil, "CPU"}))
	if s := d.Stats(); s.Skipped[ReasonUnresolved] != 1 || s.Copies != 0 {
		t.Fatalf("unresolved offload store: skipped %d, %d copies counted; want 1 and 0", s.Skipped[ReasonUnresolved], s.Copies)
	}
}
