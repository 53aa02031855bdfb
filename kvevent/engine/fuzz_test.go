package engine

import (
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// FuzzDecode feeds arbitrary bytes to the decoder. Whatever the bytes:
//
//   - it never panics, and never sizes a buffer from a length header alone
//     (a run that allocates wildly fails the fuzzer's memory limit);
//   - it returns nil or an ErrPayload, and after an error the batch is as it
//     was;
//   - every event it emits passes Event.Validate, has no EventID and the
//     configured worker, and a store's blocks are within the input's size;
//   - every wire event read is either emitted or counted as skipped;
//   - decoding is deterministic, and a second decode of the same bytes (with
//     what the first taught the decoder) still satisfies all of the above.
//
// The seed corpus, testdata/fuzz/FuzzDecode, holds wire.md's golden payloads,
// realistic batches and what earlier fuzzing found.
func FuzzDecode(f *testing.F) {
	f.Add(unhex(f, goldenCleared))
	f.Add(in(f, raw(unhex(f, goldenRemovedArray)), raw(unhex(f, goldenRemovedMap))))
	f.Add(in(f, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 8), 4, nil, "GPU", nil},
		[]any{"BlockStored", []uint64{1, 2}, nil, nil, 4, nil, "CPU"}))
	f.Add(pack(f, omap{"ts", float32(1), "events", []any{omap{"type", "BlockStored", "block_hashes", []any{[]byte{1, 2}},
		"token_ids", tokens(5, 4), "lora_name", "a", "group_idx", 1, "kv_cache_spec_kind", "full_attention"}}, "data_parallel_rank", 1}))

	f.Fuzz(func(t *testing.T, data []byte) {
		// Block size 4 lets the fuzzer make whole blocks cheaply; 16 is what
		// the realistic seeds use.
		for _, bs := range []int{4, 16} {
			first := checkDecode(t, data, bs)
			again := checkDecode(t, data, bs)
			if !eventsEqual(first, again) {
				t.Fatalf("two fresh decoders disagree:\n%s\n%s", fmtEvents(first), fmtEvents(again))
			}
		}
	})
}

// checkDecode decodes data twice with one decoder and checks the fuzz
// invariants. It returns the first decode's events.
func checkDecode(t *testing.T, data []byte, blockSize int) []kvevent.Event {
	const worker = 77
	d, err := NewDecoder(Config{Rank: kvevent.Rank{Worker: worker, DP: 1}, BlockSize: blockSize, MaxLearned: 64, MaxCopies: 64, LearnGroupKinds: len(data)%2 == 0})
	if err != nil {
		t.Fatal(err)
	}
	var first []kvevent.Event
	for pass := 0; pass < 2; pass++ {
		var b Batch
		b.Events = append(b.Events, kvevent.Event{Kind: kvevent.KindCleared, EventID: 5}) // must survive an error
		err := d.Decode(data, &b)
		if err != nil {
			if !errors.Is(err, ErrPayload) {
				t.Fatalf("error %v is not an ErrPayload", err)
			}
			if len(b.Events) != 1 || b.Events[0].EventID != 5 {
				t.Fatalf("a rejected payload changed the batch: %s", fmtEvents(b.Events))
			}
			continue
		}
		evs := b.Events[1:]
		blocks := 0
		for i := range evs {
			e := &evs[i]
			if err := e.Validate(); err != nil {
				t.Fatalf("event %d %s: %v", i, fmtEvent(*e), err)
			}
			if e.EventID != 0 || e.Rank.Worker != worker {
				t.Fatalf("event %d %s: id or worker set", i, fmtEvent(*e))
			}
			if e.Kind == kvevent.KindCleared && (e.Blocks != nil || e.Removed != nil) {
				t.Fatalf("event %d: a clear with data", i)
			}
			blocks += len(e.Blocks) + len(e.Removed)
		}
		if blocks > len(data) {
			t.Fatalf("%d blocks from %d bytes", blocks, len(data))
		}
		s := d.Stats()
		var skipped uint64
		for _, n := range s.Skipped {
			skipped += n
		}
		if s.Events != s.Emitted+skipped+s.Absorbed {
			t.Fatalf("%d events read, %d emitted + %d skipped + %d absorbed by copies", s.Events, s.Emitted, skipped, s.Absorbed)
		}
		if s.Learned > 64 {
			t.Fatalf("%d learned, bound 64", s.Learned)
		}
		if s.Copies > 64 {
			t.Fatalf("%d copies counted, bound 64", s.Copies)
		}
		if pass == 0 {
			first = append([]kvevent.Event(nil), evs...)
		}
	}
	return first
}
