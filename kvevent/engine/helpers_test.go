package engine

import (
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// assertEvents fails unless got equals want (nil and empty slices alike) and
// every event passes Validate.
func assertEvents(t tb, got, want []kvevent.Event) {
	t.Helper()
	for i := range got {
		if err := got[i].Validate(); err != nil {
			t.Errorf("event %d %s does not validate: %v", i, fmtEvent(got[i]), err)
		}
	}
	if !eventsEqual(got, want) {
		t.Fatalf("events:\n got %s\nwant %s", fmtEvents(got), fmtEvents(want))
	}
}

func eventsEqual(a, b []kvevent.Event) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.Rank != y.Rank || x.EventID != y.EventID || x.Tier != y.Tier || x.Kind != y.Kind ||
			x.HasParent != y.HasParent || x.Parent != y.Parent ||
			!slices.Equal(x.Blocks, y.Blocks) || !slices.Equal(x.Removed, y.Removed) {
			return false
		}
	}
	return true
}

func fmtEvent(e kvevent.Event) string {
	s := fmt.Sprintf("{%v %v %v", e.Rank, e.Kind, e.Tier)
	if e.EventID != 0 {
		s += fmt.Sprintf(" id=%d", e.EventID)
	}
	if e.HasParent {
		s += fmt.Sprintf(" parent=%#x", e.Parent)
	}
	for _, b := range e.Blocks {
		s += fmt.Sprintf(" %#x:%#x", b.EngineHash, b.LocalHash)
	}
	for _, h := range e.Removed {
		s += fmt.Sprintf(" -%#x", h)
	}
	return s + "}"
}

func fmtEvents(es []kvevent.Event) string {
	s := "["
	for i, e := range es {
		if i > 0 {
			s += " "
		}
		s += fmtEvent(e)
	}
	return s + "]"
}

// tokens returns n token ids from `from` on.
func tokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

// stored builds the expected Stored event of hashes over toks at block
// size bs and seed.
func stored(rank kvevent.Rank, tier kvevent.Tier, parent *uint64, hashes []uint64, toks []uint32, bs int, seed uint64) kvevent.Event {
	locals := kvevent.LocalHashes(nil, toks, bs, seed)
	ev := kvevent.Event{Rank: rank, Kind: kvevent.KindStored, Tier: tier}
	if parent != nil {
		ev.HasParent, ev.Parent = true, *parent
	}
	for i, h := range hashes[:len(locals)] {
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: locals[i]})
	}
	return ev
}

func removed(rank kvevent.Rank, tier kvevent.Tier, hashes ...uint64) kvevent.Event {
	return kvevent.Event{Rank: rank, Kind: kvevent.KindRemoved, Tier: tier, Removed: hashes}
}

// decode decodes payload with d into a fresh Batch and fails on an error.
func decode(t tb, d *Decoder, payload []byte) []kvevent.Event {
	t.Helper()
	var b Batch
	if err := d.Decode(payload, &b); err != nil {
		t.Fatalf("decode % x: %v", payload, err)
	}
	return b.Events
}

// in wraps events in a [ts, events, nil] batch.
func in(t tb, events ...any) []byte {
	t.Helper()
	return pack(t, []any{1.0, events, nil})
}

// tb is what the helpers need of a test: *testing.T, *testing.B and
// *rapid.T all have it.
type tb interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
}
