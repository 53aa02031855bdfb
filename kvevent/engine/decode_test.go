package engine

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/wirepack"
	"github.com/kvrouter/kvrouter/kvevent"
)

var rank = kvevent.Rank{Worker: 42, DP: 0}

// A plain BlockStored of hashes 11, 12, 13 over tokens 0..47, in both
// encodings, used as the "good" event around the malformed ones.
func goodStoreArray() []any {
	return []any{"BlockStored", []uint64{11, 12, 13}, nil, tokens(0, 48), 16, nil, "GPU", nil}
}

func goodStoreWant() kvevent.Event {
	return stored(rank, kvevent.TierDevice, nil, []uint64{11, 12, 13}, tokens(0, 48), 16, kvevent.Seed)
}

func TestBatchShapes(t *testing.T) {
	ev := raw(pack(t, goodStoreArray()))
	cases := []struct {
		name    string
		payload any
		ts      float64
		dp      uint32
		hasDP   bool
	}{
		{"3-array float64 ts", []any{1.25, []any{ev}, 3}, 1.25, 3, true},
		{"3-array float32 ts", []any{float32(1.25), []any{ev}, 3}, 1.25, 3, true},
		{"3-array int ts", []any{1700000000, []any{ev}, u8(2)}, 1700000000, 2, true},
		{"3-array negative int ts", []any{-3, []any{ev}, 0}, -3, 0, true},
		{"3-array nil dp", []any{1.5, []any{ev}, nil}, 1.5, 0, false},
		{"3-array nil ts", []any{nil, []any{ev}, 1}, 0, 1, true},
		{"2-array", []any{1.5, []any{ev}}, 1.5, 0, false},
		{"array with later fields ignored", []any{1.5, []any{ev}, 4, "later", omap{"x", 1}}, 1.5, 4, true},
		{"map", omap{"ts", 2.5, "events", []any{ev}, "data_parallel_rank", 6}, 2.5, 6, true},
		{"map, other order", omap{"data_parallel_rank", u32(6), "events", []any{ev}, "ts", float32(2.5)}, 2.5, 6, true},
		{"map without dp", omap{"ts", 2.5, "events", []any{ev}}, 2.5, 0, false},
		{"map with nil dp", omap{"events", []any{ev}, "data_parallel_rank", nil}, 0, 0, false},
		{"map with unknown keys", omap{"seq", 9, "events", []any{ev}, 7, "non-string key", "ts", 1.0, "x", []any{1, 2}}, 1, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// The decoder follows the rank the batch names, if it names one
			// (another rank's batch is left out, see
			// TestABatchOfAnotherDPRankIsLeftOutWhole).
			r := kvevent.Rank{Worker: 42, DP: 9}
			if c.hasDP {
				r.DP = c.dp
			}
			d := newTestDecoder(t, Config{Rank: r})
			var b Batch
			if err := d.Decode(pack(t, c.payload), &b); err != nil {
				t.Fatal(err)
			}
			if b.TS != c.ts || b.DPRank != c.dp || b.HasDPRank != c.hasDP {
				t.Fatalf("ts %v dp %d has %v, want %v %d %v", b.TS, b.DPRank, b.HasDPRank, c.ts, c.dp, c.hasDP)
			}
			want := goodStoreWant()
			want.Rank = r
			assertEvents(t, b.Events, []kvevent.Event{want})
		})
	}
}

func TestEmptyBatchDecodesToNoEvents(t *testing.T) {
	d := newTestDecoder(t, Config{})
	if evs := decode(t, d, pack(t, []any{1.0, []any{}, 0})); len(evs) != 0 {
		t.Fatalf("got %d events from an empty batch", len(evs))
	}
	if s := d.Stats(); s.Batches != 1 || s.Events != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestEventEncodingsDecodeAlike(t *testing.T) {
	parent := uint64(0x77)
	toks := tokens(100, 32)
	want := stored(rank, kvevent.TierHostPinned, &parent, []uint64{21, 22}, toks, 16, kvevent.SeedFor("ad", ""))
	cases := map[string]any{
		"array, all fields": []any{"BlockStored", []uint64{21, 22}, parent, toks, 16, 5, "CPU", "ad",
			[]any{nil, []any{"mm", 3}}, 0, "full_attention", nil},
		"array, trailing omitted": []any{"BlockStored", []uint64{21, 22}, parent, toks, 16, nil, "CPU", "ad"},
		"array, later fields ignored": []any{"BlockStored", []uint64{21, 22}, parent, toks, 16, nil, "CPU", "ad",
			nil, nil, nil, 4096, "locality?", omap{"ownership", true}, 3.5, []byte{1}},
		"map, type first": omap{"type", "BlockStored", "block_hashes", []uint64{21, 22}, "parent_block_hash", parent,
			"token_ids", toks, "block_size", 16, "lora_id", nil, "medium", "CPU", "lora_name", "ad"},
		"map, type last, unknown keys": omap{"token_ids", toks, "locality", "rack-1", "medium", "cpu",
			"lora_name", "ad", "parent_block_hash", parent, "block_hashes", []uint64{21, 22}, "ownership", omap{"a", 1},
			"kv_cache_spec_sliding_window", nil, "block_size", u64(16), "type", "BlockStored"},
		"map, absent fields": omap{"type", "BlockStored", "block_hashes", []uint64{21, 22},
			"parent_block_hash", parent, "token_ids", toks, "medium", "CPU", "lora_name", "ad"},
	}
	for name, ev := range cases {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			assertEvents(t, decode(t, d, in(t, ev)), []kvevent.Event{want})
		})
	}

	t.Run("mixed in one batch", func(t *testing.T) {
		d := newTestDecoder(t, Config{Rank: rank})
		payload := in(t,
			cases["array, all fields"],
			omap{"type", "BlockRemoved", "block_hashes", []uint64{5}, "medium", nil},
			[]any{"AllBlocksCleared"},
			[]any{"BlockRemoved", []uint64{6, 7}},
			omap{"type", "AllBlocksCleared", "future", 1},
			cases["map, type last, unknown keys"],
		)
		assertEvents(t, decode(t, d, payload), []kvevent.Event{
			want,
			removed(rank, kvevent.TierDevice, 5),
			{Rank: rank, Kind: kvevent.KindCleared},
			removed(rank, kvevent.TierDevice, 6, 7),
			{Rank: rank, Kind: kvevent.KindCleared},
			want,
		})
	})
}

func TestHashEncodings(t *testing.T) {
	long := bytes.Repeat([]byte{0xee}, 300) // bin16 header
	copy(long[292:], []byte{1, 2, 3, 4, 5, 6, 7, 8})
	cases := []struct {
		name string
		enc  any
		want uint64
	}{
		{"positive fixint", 5, 5},
		{"uint8", u8(200), 200},
		{"uint16", u16(0xbeef), 0xbeef},
		{"uint32", u32(0xdeadbeef), 0xdeadbeef},
		{"uint64", u64(math.MaxUint64), math.MaxUint64},
		{"uint64 high bit", uint64(goldenHash), goldenHash},
		{"negative fixint", -1, math.MaxUint64},
		{"negative fixint -32", -32, uint64(1<<64 - 32)},
		{"int8", i8(-100), uint64(1<<64 - 100)},
		{"int8 positive", i8(100), 100},
		{"int16", i16(-300), uint64(1<<64 - 300)},
		{"int32", i32(-70000), uint64(1<<64 - 70000)},
		{"int64 min", i64(math.MinInt64), 1 << 63},
		{"int64 as signed golden", i64(-0x2547645584a7a840), goldenHash},
		{"bin empty", []byte{}, 0},
		{"bin 1 byte", []byte{0xab}, 0xab},
		{"bin 5 bytes, left-padded", []byte{1, 2, 3, 4, 5}, 0x0102030405},
		{"bin 8 bytes", []byte{0xda, 0xb8, 0x9b, 0xaa, 0x7b, 0x58, 0x57, 0xc0}, goldenHash},
		{"bin 32 bytes (sha256), last 8", append(bytes.Repeat([]byte{0x11}, 24), 0xda, 0xb8, 0x9b, 0xaa, 0x7b, 0x58, 0x57, 0xc0), goldenHash},
		{"bin16 300 bytes", long, 0x0102030405060708},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			payload := in(t,
				[]any{"BlockRemoved", []any{c.enc}, nil},
				[]any{"BlockStored", []any{99}, c.enc, tokens(0, 16), 16},
			)
			p := c.want
			want := []kvevent.Event{removed(rank, kvevent.TierDevice, c.want)}
			if c.want != 99 {
				want = append(want, stored(rank, kvevent.TierDevice, &p, []uint64{99}, tokens(0, 16), 16, kvevent.Seed))
			}
			assertEvents(t, decode(t, d, payload), want)
		})
	}
}

// The main attention group is the only one that feeds the index (wire.md).
func TestOnlyMainAttentionGroupIsEmitted(t *testing.T) {
	cases := []struct {
		name  string
		group any
		kind  any
		main  bool
	}{
		{"no group, no kind", nil, nil, true},
		{"group 0", 0, nil, true},
		{"group 1 without kind", 1, nil, false},
		{"group 0 sliding window", 0, "sliding_window", false},
		{"group 1 full attention", 1, "full_attention", true},
		{"group 2 mla", 2, "mla_attention", true},
		{"sink full attention", 3, "sink_full_attention", true},
		{"kind matched case-insensitively", 3, "Full_Attention", true},
		{"chunked local", 0, "chunked_local_attention", false},
		{"mamba, no group", nil, "mamba", false},
		{"unknown kind", 0, "full_attention_v2", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			st := []any{"BlockStored", []uint64{11, 12, 13}, nil, tokens(0, 48), 16, nil, nil, nil, nil, c.group, c.kind, 128}
			stMap := omap{"type", "BlockStored", "block_hashes", []uint64{11, 12, 13}, "token_ids", tokens(0, 48),
				"group_idx", c.group, "kv_cache_spec_kind", c.kind}
			rmMap := omap{"type", "BlockRemoved", "block_hashes", []uint64{11}, "group_idx", c.group, "kv_cache_spec_kind", c.kind}
			// Stored twice, so removed twice: the first remove leaves a copy.
			got := decode(t, d, in(t, st, stMap, rmMap, rmMap))
			var want []kvevent.Event
			if c.main {
				want = []kvevent.Event{goodStoreWant(), goodStoreWant(), removed(rank, kvevent.TierDevice, 11)}
			}
			assertEvents(t, got, want)
			if s := d.Stats(); !c.main && s.Skipped[ReasonNotMainGroup] != 4 {
				t.Fatalf("skipped not_main_group = %d, want 4", s.Skipped[ReasonNotMainGroup])
			}
		})
	}

	t.Run("array BlockRemoved group position", func(t *testing.T) {
		d := newTestDecoder(t, Config{Rank: rank})
		got := decode(t, d, in(t, []any{"BlockRemoved", []uint64{1}, "GPU", 1}, []any{"BlockRemoved", []uint64{2}, "GPU", 0, "kind?"}))
		assertEvents(t, got, []kvevent.Event{removed(rank, kvevent.TierDevice, 2)})
	})
}

// wire.md's rule files an event without a kind by group 0. For a hybrid
// model whose full-attention group is not group 0, that misfiles every
// BlockRemoved; LearnGroupKinds files it by the kind its group's stores named.
func TestLearnGroupKindsFilesHybridRemovesByTheirGroup(t *testing.T) {
	payload := in(t,
		[]any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, 0, "sliding_window", 512},
		[]any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, 1, "full_attention"},
		[]any{"BlockRemoved", []uint64{11}, nil, 0}, // the sliding window drops an old block
		[]any{"BlockRemoved", []uint64{11}, nil, 1}, // the full-attention group evicts it
	)
	st := stored(rank, kvevent.TierDevice, nil, []uint64{11}, tokens(0, 16), 16, kvevent.Seed)

	exact := newTestDecoder(t, Config{Rank: rank})
	assertEvents(t, decode(t, exact, payload), []kvevent.Event{st, removed(rank, kvevent.TierDevice, 11)})

	learn := newTestDecoder(t, Config{Rank: rank, LearnGroupKinds: true})
	got := decode(t, learn, payload)
	assertEvents(t, got, []kvevent.Event{st, removed(rank, kvevent.TierDevice, 11)})
	// Same events, but the remove that survived is the full-attention one.
	if s := learn.Stats(); s.Skipped[ReasonNotMainGroup] != 2 {
		t.Fatalf("learning decoder skipped %d, want the sliding store and its remove", s.Skipped[ReasonNotMainGroup])
	}
	// A remove of group 0 alone is now filed as sliding window.
	assertEvents(t, decode(t, learn, in(t, []any{"BlockRemoved", []uint64{11}, nil, 0})), nil)
	assertEvents(t, decode(t, exact, in(t, []any{"BlockRemoved", []uint64{11}, nil, 0})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, 11)})
}

func TestTierFromMedium(t *testing.T) {
	for medium, tier := range map[any]kvevent.Tier{
		nil: kvevent.TierDevice, "GPU": kvevent.TierDevice, "cuda?": 99,
		"CPU": kvevent.TierHostPinned, "cpu_tier1": kvevent.TierHostPinned,
		"CPU_TIER2": kvevent.TierDisk, "Disk": kvevent.TierDisk,
		"EXTERNAL": kvevent.TierExternal, "shared": kvevent.TierExternal,
	} {
		d := newTestDecoder(t, Config{Rank: rank})
		got := decode(t, d, in(t, []any{"BlockRemoved", []uint64{1}, medium}))
		if tier == 99 {
			assertEvents(t, got, nil)
			if n := d.Stats().Skipped[ReasonUnknownMedium]; n != 1 {
				t.Fatalf("medium %v: unknown_medium = %d", medium, n)
			}
			continue
		}
		assertEvents(t, got, []kvevent.Event{removed(rank, tier, 1)})
	}
}

// Every malformed event is skipped and counted, and the events around it
// still decode.
func TestMalformedEventsAreSkippedAndCounted(t *testing.T) {
	long := make([]uint64, 40)
	for i := range long {
		long[i] = uint64(1000 + i)
	}
	long[39] = 1005
	cases := []struct {
		name   string
		ev     any
		reason Reason
	}{
		{"event is a string", "BlockStored", ReasonBadShape},
		{"event is an empty array", []any{}, ReasonBadShape},
		{"array tag not a string", []any{7, []uint64{1}}, ReasonBadShape},
		{"map without type", omap{"block_hashes", []uint64{1}}, ReasonBadShape},
		{"map with nil type", omap{"type", nil, "block_hashes", []uint64{1}}, ReasonBadShape},
		{"map with int type", omap{"type", 3}, ReasonBadShape},
		{"unknown type", []any{"BlockTouched", []uint64{1}}, ReasonUnknownType},
		{"unknown type in map", omap{"type", "blockstored"}, ReasonUnknownType},
		{"store hashes not an array", []any{"BlockStored", "abc", nil, tokens(0, 16), 16}, ReasonBadField},
		{"store hash is a float", []any{"BlockStored", []any{1, 2.5, 3}, nil, tokens(0, 48), 16}, ReasonBadField},
		{"store hash is a string", []any{"BlockStored", []any{"1"}, nil, tokens(0, 16), 16}, ReasonBadField},
		{"parent is a string", []any{"BlockStored", []uint64{1}, "p", tokens(0, 16), 16}, ReasonBadField},
		{"token is negative", []any{"BlockStored", []uint64{1}, nil, append([]any{-1}, anys(tokens(0, 15))...), 16}, ReasonBadField},
		{"token above 2^32", []any{"BlockStored", []uint64{1}, nil, append(anys(tokens(0, 15)), uint64(1<<32)), 16}, ReasonBadField},
		{"token is a string: a multimodal digest, in the only block", []any{"BlockStored", []uint64{1}, nil, append(anys(tokens(0, 15)), "x"), 16}, ReasonMMToken},
		{"tokens not an array", []any{"BlockStored", []uint64{1}, nil, omap{"a", 1}, 16}, ReasonBadField},
		{"block size a string", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), "16"}, ReasonBadField},
		// 0 is vLLM's "unknown" size (its offloading connector's
		// placeholder store, TestVLLMOffloadPlaceholderStoreIsIndexed):
		// read as no size in a store without tokens, out of range in one
		// with tokens, whose size it contradicts.
		{"block size zero", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 0}, ReasonBadField},
		{"block size zero, no tokens", []any{"BlockStored", []uint64{1}, nil, []uint32{}, 0, nil, "CPU"}, ReasonUnresolved},
		{"block size negative", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), -16}, ReasonBadField},
		{"medium an int", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, 1}, ReasonBadField},
		{"lora name an int", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, nil, 3}, ReasonBadField},
		{"group negative", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, nil, nil, nil, -1}, ReasonBadField},
		{"group a string", []any{"BlockRemoved", []uint64{1}, nil, "0"}, ReasonBadField},
		{"kind an int", omap{"type", "BlockRemoved", "block_hashes", []uint64{1}, "kv_cache_spec_kind", 1}, ReasonBadField},
		{"remove medium a bin", []any{"BlockRemoved", []uint64{1}, []byte("GPU")}, ReasonBadField},
		{"unknown medium", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, "TPU"}, ReasonUnknownMedium},
		{"remove unknown medium", []any{"BlockRemoved", []uint64{1}, "hbm"}, ReasonUnknownMedium},
		{"store without hashes", []any{"BlockStored", []uint64{}, nil, []uint32{}, 16}, ReasonNoBlocks},
		{"store with nil hashes", []any{"BlockStored", nil, nil, tokens(0, 16), 16}, ReasonNoBlocks},
		{"map store without hashes", omap{"type", "BlockStored", "token_ids", tokens(0, 16)}, ReasonNoBlocks},
		{"remove without hashes", []any{"BlockRemoved", []uint64{}, "GPU"}, ReasonNoBlocks},
		{"remove, fields omitted", []any{"BlockRemoved"}, ReasonNoBlocks},
		{"store repeats a hash", []any{"BlockStored", []uint64{1, 2, 1}, nil, tokens(0, 48), 16}, ReasonRepeatedHash},
		{"store repeats a hash, long chain", []any{"BlockStored", long, nil, tokens(0, 40*16), 16}, ReasonRepeatedHash},
		{"int and bin spell the same hash", []any{"BlockStored", []any{u64(0xab), []byte{0xab}}, nil, tokens(0, 32), 16}, ReasonRepeatedHash},
		{"first hash is the parent", []any{"BlockStored", []uint64{7, 8}, 7, tokens(0, 32), 16}, ReasonParentIsFirst},
		{"a later hash is the parent", []any{"BlockStored", []uint64{7, 8, 9}, 8, tokens(0, 48), 16}, ReasonRepeatedHash},
		{"a later hash of an offload store is the parent", []any{"BlockStored", []uint64{7, 8}, 8, []uint32{}, 16, nil, "CPU"}, ReasonRepeatedHash},
		{"lora_id without lora_name", []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, 3, nil}, ReasonUnnamedLoRA},
		{"event block size differs", []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 64), 32}, ReasonBlockSize},
		{"more tokens than blocks", []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 48), 16}, ReasonBlockSize},
		{"fewer tokens than one block", []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 15), 16}, ReasonBlockSize},
		{"offload store of unseen blocks", []any{"BlockStored", []uint64{1, 2}, nil, []uint32{}, 16, nil, "CPU"}, ReasonUnresolved},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			got := decode(t, d, in(t, goodStoreArray(), c.ev, goodStoreArray()))
			assertEvents(t, got, []kvevent.Event{goodStoreWant(), goodStoreWant()})
			s := d.Stats()
			if s.Events != 3 || s.Emitted != 2 || s.Skipped[c.reason] != 1 {
				t.Fatalf("events %d emitted %d skipped %v, want 3, 2 and one %v", s.Events, s.Emitted, s.Skipped, c.reason)
			}
		})
	}
}

func anys[T any](xs []T) []any { return wirepack.Anys(xs) }

// A value of the wrong type in a field the event type does not read, or in a
// field this package never reads, does not cost the event.
func TestBadValuesInUnreadFieldsAreIgnored(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	got := decode(t, d, in(t,
		omap{"type", "BlockRemoved", "block_hashes", []uint64{1}, "token_ids", "junk", "block_size", "junk", "parent_block_hash", 2.5},
		[]any{"BlockStored", []uint64{11, 12, 13}, nil, tokens(0, 48), 16, "lora id is opaque", "GPU", "", "extra keys are opaque", nil, nil, "window is opaque"},
		omap{"type", "AllBlocksCleared", "medium", 5, "block_hashes", "x"},
	))
	assertEvents(t, got, []kvevent.Event{removed(rank, kvevent.TierDevice, 1), goodStoreWant(), {Rank: rank, Kind: kvevent.KindCleared}})
}

// TestClearIgnoresGroupAndKind: a clear has no fields (wire.md), so a
// group or kind it carries in the map encoding, good or bad, does not cost
// it, as it cannot in the array encoding. From a review: the map form's
// clear of group 1 was skipped as not the main group, which left the
// rank's whole index stale.
func TestClearIgnoresGroupAndKind(t *testing.T) {
	clear := kvevent.Event{Rank: rank, Kind: kvevent.KindCleared}
	for name, ev := range map[string]any{
		"array, a group":     []any{"AllBlocksCleared", 1},
		"map, group 1":       omap{"type", "AllBlocksCleared", "group_idx", 1},
		"map, a bad group":   omap{"type", "AllBlocksCleared", "group_idx", "x"},
		"map, sliding kind":  omap{"type", "AllBlocksCleared", "kv_cache_spec_kind", "sliding_window"},
		"map, a kind an int": omap{"type", "AllBlocksCleared", "kv_cache_spec_kind", 3},
	} {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank, LearnGroupKinds: true})
			assertEvents(t, decode(t, d, in(t, ev)), []kvevent.Event{clear})
		})
	}
}

// TestLargeBlockSizeIsABlockSizeMismatch: a block size beyond any engine's
// (2^25) is a mismatch with the registered one, counted as such with its
// blocks, not a bad field (from a review: it hid a worker registered with
// the wrong block size from the metric that shows it).
func TestLargeBlockSizeIsABlockSizeMismatch(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 32), 1 << 25}))
	if s := d.Stats(); s.Skipped[ReasonBlockSize] != 1 || s.DroppedBlocks[ReasonBlockSize] != 2 {
		t.Fatalf("block_size 2^25: skipped %v, dropped blocks %v; want one block_size event of 2 blocks", s.Skipped, s.DroppedBlocks)
	}
}

func TestBlockSizeRulesKeepOnlyWholeBlocks(t *testing.T) {
	cases := []struct {
		name    string
		ev      any
		keep    int
		dropped uint64
	}{
		{"block size absent, tokens fit", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 48)}, 3, 0},
		{"block size matches", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 48), 16}, 3, 0},
		{"tokens for two of three blocks", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 32), 16}, 2, 1},
		{"a partial third block", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 40), 16}, 2, 1},
		{"block size differs", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 96), 32}, 0, 3},
		{"too many tokens", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 49), 16}, 0, 3},
		// Without block_size, only tokens = blocks × the registered size
		// show that the engine's blocks are that size. From a review: an
		// engine with blocks of 8 (three blocks, 24 tokens) on a rank
		// registered with 16 had its first block kept, engine hash 1 paired
		// with the content of its blocks 1 and 2.
		{"block size absent, a smaller engine block size", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 24)}, 0, 3},
		{"block size absent, tokens for two of three blocks", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 32)}, 0, 3},
		{"block size absent, a partial third block", []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 40)}, 0, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			got := decode(t, d, in(t, c.ev))
			var want []kvevent.Event
			if c.keep > 0 {
				want = []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1, 2, 3}, tokens(0, c.keep*16), 16, kvevent.Seed)}
			}
			assertEvents(t, got, want)
			if s := d.Stats(); s.DroppedBlocks[ReasonBlockSize] != c.dropped {
				t.Fatalf("dropped %d, want %d", s.DroppedBlocks[ReasonBlockSize], c.dropped)
			}
		})
	}
}

// The content hashes are kvevent's, pinned there against an independent
// XXH3; pinned here too so that a decoder that hashed the wrong span of
// tokens, or with the wrong seed, fails.
func TestContentHashesMatchPinnedVectors(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	got := decode(t, d, in(t,
		[]any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 48), 16},
		[]any{"BlockStored", []uint64{9}, nil, tokens(1, 16), 16, 7, nil, "my-adapter"},
	))
	want := []kvevent.Event{
		{Rank: rank, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 0xd47a8f41c833328a}, {EngineHash: 2, LocalHash: 0xd43939178abd00db}, {EngineHash: 3, LocalHash: 0x4cc8f942aaf401a2}}},
		{Rank: rank, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 9, LocalHash: 0xe7c4d1518de44e34}}},
	}
	assertEvents(t, got, want)
}

func TestSeedFunctionIsUsedForLoRANames(t *testing.T) {
	var asked []string
	d := newTestDecoder(t, Config{Rank: rank, Seed: func(name string) uint64 { asked = append(asked, name); return 5 + uint64(len(name)) }})
	got := decode(t, d, in(t,
		[]any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, nil, "abc"},
		[]any{"BlockStored", []uint64{2}, nil, tokens(0, 16), 16, nil, nil, "abc"},
		[]any{"BlockStored", []uint64{3}, nil, tokens(0, 16), 16, nil, nil, nil},
	))
	assertEvents(t, got, []kvevent.Event{
		stored(rank, kvevent.TierDevice, nil, []uint64{1}, tokens(0, 16), 16, 8),
		stored(rank, kvevent.TierDevice, nil, []uint64{2}, tokens(0, 16), 16, 8),
		stored(rank, kvevent.TierDevice, nil, []uint64{3}, tokens(0, 16), 16, 5),
	})
	if len(asked) != 2 || asked[0] != "" || asked[1] != "abc" {
		t.Fatalf("seed asked for %q, want the base seed once and abc once", asked)
	}
}

func TestOffloadStoreResolvesThroughLearnedHashes(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	gpu := stored(rank, kvevent.TierDevice, nil, []uint64{11, 12, 13}, tokens(0, 48), 16, kvevent.Seed)
	assertEvents(t, decode(t, d, in(t, goodStoreArray())), []kvevent.Event{gpu})

	cpu := gpu
	cpu.Tier = kvevent.TierHostPinned
	assertEvents(t, decode(t, d, in(t, []any{"BlockStored", []uint64{11, 12, 13}, nil, []uint32{}, 16, nil, "CPU"})),
		[]kvevent.Event{cpu})

	// The device evicts the blocks; the disk tier stores them afterwards.
	disk := gpu
	disk.Tier, disk.Blocks = kvevent.TierDisk, gpu.Blocks[1:]
	disk.HasParent, disk.Parent = true, 11
	assertEvents(t, decode(t, d, in(t,
		[]any{"BlockRemoved", []uint64{11, 12, 13}, "GPU"},
		omap{"type", "BlockStored", "block_hashes", []uint64{12, 13}, "parent_block_hash", 11, "medium", "DISK", "token_ids", nil},
	)), []kvevent.Event{removed(rank, kvevent.TierDevice, 11, 12, 13), disk})

	// A chain that runs into an unseen block stops there.
	part := gpu
	part.Tier, part.Blocks = kvevent.TierExternal, gpu.Blocks[:2]
	assertEvents(t, decode(t, d, in(t, []any{"BlockStored", []uint64{11, 12, 99, 13}, nil, nil, 16, nil, "REMOTE"})),
		[]kvevent.Event{part})
	if s := d.Stats(); s.DroppedBlocks[ReasonUnresolved] != 2 || s.Skipped[ReasonUnresolved] != 0 {
		t.Fatalf("unresolved: dropped %d skipped %d, want 2 and 0", s.DroppedBlocks[ReasonUnresolved], s.Skipped[ReasonUnresolved])
	}

	// A new epoch forgets.
	d.Reset()
	assertEvents(t, decode(t, d, in(t, []any{"BlockStored", []uint64{11}, nil, nil, 16, nil, "CPU"})), nil)
	if s := d.Stats(); s.Skipped[ReasonUnresolved] != 1 || s.Learned != 0 {
		t.Fatalf("after reset: skipped %d learned %d", s.Skipped[ReasonUnresolved], s.Learned)
	}
}

func TestLearnedHashesStayBounded(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, MaxLearned: 8})
	for i := 0; i < 100; i++ {
		h := uint64(1000 + i)
		decode(t, d, in(t, []any{"BlockStored", []uint64{h}, nil, tokens(i, 16), 16}))
		if n := d.Stats().Learned; n > 8 {
			t.Fatalf("after %d stores %d learned, bound 8", i+1, n)
		}
	}
	// The most recent blocks are still resolvable, the oldest are not.
	got := decode(t, d, in(t, []any{"BlockStored", []uint64{1099}, nil, nil, 16, nil, "CPU"}, []any{"BlockStored", []uint64{1000}, nil, nil, 16, nil, "CPU"}))
	want := stored(rank, kvevent.TierHostPinned, nil, []uint64{1099}, tokens(99, 16), 16, kvevent.Seed)
	assertEvents(t, got, []kvevent.Event{want})

	off := newTestDecoder(t, Config{Rank: rank, MaxLearned: -1})
	decode(t, off, in(t, goodStoreArray()))
	if n := off.Stats().Learned; n != 0 {
		t.Fatalf("learning off, yet %d learned", n)
	}
}

// TestLongEventKeepsNoLargeHashSet: the hashes of an event longer than 32
// are checked for repeats through a set the decoder reuses, and a Go map
// never shrinks: clear costs its capacity, not its length. From a review:
// one remove of 2M hashes (a large eviction) left a set that large, its
// memory kept and cleared again at every later event of more than 32
// hashes, each 50-100x slower for good. A set for more than maxSeenKept
// hashes is not kept; repeats are found past that length as within it: a
// store that repeats a hash is skipped, a remove removes it once.
func TestLongEventKeepsNoLargeHashSet(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	long := make([]uint64, 4*maxSeenKept)
	for i := range long {
		long[i] = uint64(1 + i)
	}
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", long})), []kvevent.Event{removed(rank, kvevent.TierDevice, long...)})
	if n := len(d.seen); n > maxSeenKept {
		t.Fatalf("after an event of %d hashes the decoder keeps a set of %d, bound %d", len(long), n, maxSeenKept)
	}
	check := func(hs []uint64, what string) {
		t.Helper()
		before := d.Stats().Skipped[ReasonRepeatedHash]
		assertEvents(t, decode(t, d, in(t, []any{"BlockStored", hs, nil, []uint32{}, 16, nil, "CPU"})), nil)
		if got := d.Stats().Skipped[ReasonRepeatedHash]; got != before+1 {
			t.Fatalf("a store of %d hashes, %s: %d skipped as repeated, want %d", len(hs), what, got, before+1)
		}
		assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", hs})),
			[]kvevent.Event{removed(rank, kvevent.TierDevice, hs[:len(hs)-1]...)})
		if n := len(d.seen); n > maxSeenKept {
			t.Fatalf("after an event of %d hashes the decoder keeps a set of %d, bound %d", len(hs), n, maxSeenKept)
		}
	}
	for _, n := range []int{33, maxSeenKept, len(long)} {
		hs := slices.Clone(long[:n])
		hs[n-1] = hs[n/2]
		check(hs, "one repeated")
	}
	// A repeat of one of the hashes the set checks, past them.
	hs := slices.Clone(long)
	hs[len(hs)-1] = hs[0]
	check(hs, "the last repeating the first")
}

// TestOneLargeEventKeepsNoLargeStorage: the slices a Batch and the decoder
// reuse from payload to payload grow to the largest event they held. From a
// review: one remove of 2M blocks (an eviction step) left ~51 MB held per
// rank for the rest of the run, by the Batch, the wire event and the
// content-hash scratch. Once emptied, none keeps more than maxKeptBytes.
func TestOneLargeEventKeepsNoLargeStorage(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	const n = 3 * maxKeptBytes / 16 // blocks: 1.5 times the bound of the smallest slice
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = uint64(1 + i)
	}
	var b Batch
	for _, p := range [][]byte{
		in(t, []any{"BlockStored", hashes, nil, tokens(0, n*16), 16}),
		in(t, []any{"BlockRemoved", hashes}),
	} {
		b.Reset()
		if err := d.Decode(p, &b); err != nil {
			t.Fatal(err)
		}
		if got := b.BlockEvents(); got != n {
			t.Fatalf("decoded %d block events, want %d", got, n)
		}
	}
	b.Reset()
	if err := d.Decode(in(t, goodStoreArray()), &b); err != nil {
		t.Fatal(err)
	}
	b.Reset()
	for _, s := range []struct {
		name  string
		bytes int
	}{
		{"Batch.Events", cap(b.Events) * int(unsafe.Sizeof(kvevent.Event{}))},
		{"Batch.blocks", cap(b.blocks) * 16},
		{"Batch.removed", cap(b.removed) * 8},
		{"wire event hashes", cap(d.ev.hashes) * 8},
		{"wire event tokens", cap(d.ev.tokens) * 4},
		{"content hashes", cap(d.locals) * 8},
		{"spans", cap(d.spans) * int(unsafe.Sizeof(span{}))},
	} {
		if s.bytes > maxKeptBytes {
			t.Errorf("%s keeps %d bytes after an event of %d blocks, bound %d", s.name, s.bytes, n, maxKeptBytes)
		}
	}
}

// TestNameCachesStayBounded: the decoder caches the seed of each LoRA name
// and the tier of each medium spelling, so that lookups do not allocate.
// Both are bounded: names past the bound are still decoded right, uncached.
func TestNameCachesStayBounded(t *testing.T) {
	asked := 0
	d := newTestDecoder(t, Config{Rank: rank, Seed: func(name string) uint64 { asked++; return uint64(len(name)) }})
	for i := range 2 * maxSeeds {
		name := fmt.Sprintf("adapter-%d", i)
		got := decode(t, d, in(t, []any{"BlockStored", []uint64{1}, nil, tokens(0, 16), 16, nil, nil, name}))
		assertEvents(t, got, []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1}, tokens(0, 16), 16, uint64(len(name)))})
	}
	if n := len(d.seeds); n > maxSeeds {
		t.Fatalf("%d LoRA seeds cached, bound %d", n, maxSeeds)
	}

	// Every letter case of "cpu_pinned" names the host tier: 512 spellings.
	d = newTestDecoder(t, Config{Rank: rank})
	for i := range 512 {
		b := []byte("cpu_pinned")
		for j, k := 0, 0; j < len(b); j++ {
			if b[j] == '_' {
				continue
			}
			if i>>k&1 == 1 {
				b[j] -= 'a' - 'A'
			}
			k++
		}
		got := decode(t, d, in(t, []any{"BlockRemoved", []uint64{1}, string(b)}))
		assertEvents(t, got, []kvevent.Event{removed(rank, kvevent.TierHostPinned, 1)})
	}
	if n := len(d.mediums); n > 64 {
		t.Fatalf("%d medium spellings cached, bound 64", n)
	}
}

// TestExtraKeyBlocksCountsKeptBlocksOnly: ExtraKeyBlocks counts emitted
// blocks, so a store that loses blocks to the block-size rule counts at most
// the blocks it kept.
func TestExtraKeyBlocksCountsKeptBlocksOnly(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	keys := []any{[]any{"img-1"}, []any{"img-2"}, []any{"img-3"}}
	decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 40), 16, nil, nil, nil, keys}))
	if s := d.Stats(); s.ExtraKeyBlocks != 2 || s.DroppedBlocks[ReasonBlockSize] != 1 {
		t.Fatalf("extra-key blocks %d, dropped %d; want 2 kept with extra keys, 1 dropped", s.ExtraKeyBlocks, s.DroppedBlocks[ReasonBlockSize])
	}
}

// TestExtraKeyBlocksCountsTheKeptBlocksKeys: ExtraKeyBlocks counts the kept
// blocks that carry extra keys, not as many of the entries as were kept: a
// store of 3 blocks whose third alone carries extra keys, and loses that
// block to the block-size rule, emits none.
func TestExtraKeyBlocksCountsTheKeptBlocksKeys(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	keys := []any{nil, nil, []any{"img-3"}}
	evs := decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 40), 16, nil, nil, nil, keys}))
	if len(evs) != 1 || len(evs[0].Blocks) != 2 {
		t.Fatalf("events %s, want one store of blocks 1 and 2", fmtEvents(evs))
	}
	if s := d.Stats(); s.ExtraKeyBlocks != 0 {
		t.Fatalf("ExtraKeyBlocks = %d, want 0: neither kept block carries extra keys (the dropped third does)", s.ExtraKeyBlocks)
	}
}

// TestLearnedGroupKindChangesOnceTheTableIsFull: the group → kind table of
// LearnGroupKinds takes no new group past maxLearnedGroups, but a group it
// holds still follows what its stores say: a full table must not freeze it.
func TestLearnedGroupKindChangesOnceTheTableIsFull(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, LearnGroupKinds: true})
	for g := range maxLearnedGroups {
		decode(t, d, in(t, []any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, g, "full_attention"}))
	}
	if n := len(d.groupMain); n != maxLearnedGroups {
		t.Fatalf("%d groups learned, want %d", n, maxLearnedGroups)
	}
	decode(t, d, in(t, []any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, 5, "sliding_window", 512}))
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []uint64{11}, nil, 5})), nil)
	if s := d.Stats(); s.Skipped[ReasonNotMainGroup] != 2 {
		t.Fatalf("skipped as not the main group: %d, want group 5's sliding store and remove", s.Skipped[ReasonNotMainGroup])
	}
}

// TestLearnedGroupKindsStayBounded: the group → kind table of
// LearnGroupKinds holds at most maxLearnedGroups groups (what a decoder keeps
// between payloads is bounded, doc.go): an engine naming ever more groups
// does not grow it, and a group past the bound is filed by wire.md's rule, a
// group other than 0 not the main one, whatever its stores said.
func TestLearnedGroupKindsStayBounded(t *testing.T) {
	// Copies not counted: the stores of every group name one block.
	d := newTestDecoder(t, Config{Rank: rank, LearnGroupKinds: true, MaxCopies: -1})
	for g := range 4 * maxLearnedGroups {
		decode(t, d, in(t, []any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, g, "full_attention"}))
	}
	if n := len(d.groupMain); n != maxLearnedGroups {
		t.Fatalf("%d groups learned after stores of %d groups, want the bound %d", n, 4*maxLearnedGroups, maxLearnedGroups)
	}
	past := 4*maxLearnedGroups - 1
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []uint64{11}, nil, past})), nil)
	assertEvents(t, decode(t, d, in(t, []any{"BlockRemoved", []uint64{11}, nil, maxLearnedGroups - 1})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, 11)})
}

// TestResetForgetsLearnedGroupKinds: a new epoch (Decoder.Reset) forgets the
// group kinds learned before it, as doc.go says: the restarted engine may
// lay its groups out anew, so its events are filed by wire.md's rule until
// its stores name their kinds again.
func TestResetForgetsLearnedGroupKinds(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, LearnGroupKinds: true})
	decode(t, d, in(t,
		[]any{"BlockStored", []uint64{11}, nil, tokens(0, 16), 16, nil, nil, nil, nil, 0, "sliding_window", 512},
		[]any{"BlockStored", []uint64{12}, nil, tokens(0, 16), 16, nil, nil, nil, nil, 1, "full_attention"},
	))
	remove0 := in(t, []any{"BlockRemoved", []uint64{11}, nil, 0})
	remove1 := in(t, []any{"BlockRemoved", []uint64{12}, nil, 1})
	assertEvents(t, decode(t, d, remove0), nil)
	assertEvents(t, decode(t, d, remove1), []kvevent.Event{removed(rank, kvevent.TierDevice, 12)})
	d.Reset()
	if n := len(d.groupMain); n != 0 {
		t.Fatalf("%d group kinds kept across Reset, want none", n)
	}
	assertEvents(t, decode(t, d, remove0), []kvevent.Event{removed(rank, kvevent.TierDevice, 11)})
	assertEvents(t, decode(t, d, remove1), nil)
}

func TestLearnedHashesKeepWhatIsUsed(t *testing.T) {
	l := newLearned(4) // two generations of two
	l.put(1, learned{local: 10})
	l.put(2, learned{local: 20})
	l.put(3, learned{local: 30}) // rotates: {1,2} become old
	v, ok := l.get(1)
	if !ok {
		t.Fatal("1 lost after one rotation")
	}
	l.keep(1, v) // a hit in old moves 1 back into cur
	// Moved, not copied: held twice, a pair would count twice in Learned
	// and take the room of another.
	if n := l.len(); n != 3 {
		t.Fatalf("after keeping a pair of old, %d entries held, want 3", n)
	}
	l.put(4, learned{local: 40}) // rotates: {3,1} old, {2} dropped
	if _, ok := l.get(2); ok {
		t.Fatal("2 survived two rotations unused")
	}
	for _, k := range []uint64{1, 3, 4} {
		if v, ok := l.get(k); !ok || v.local != k*10 {
			t.Fatalf("get(%d) = %+v, %v", k, v, ok)
		}
	}
	if l.len() > 4 {
		t.Fatalf("%d entries, bound 4", l.len())
	}
}

// TestOffloadStoreFromOldGenerationResolvesItsWholeChain: four learned
// pairs under a bound of four are all held, and an offload-tier store of the
// first two blocks resolves both. From a review: promoting the first block
// out of the old generation rotated the generations and cleared the old one,
// which still held the second block of the chain being resolved, so it was
// dropped as unresolved.
func TestOffloadStoreFromOldGenerationResolvesItsWholeChain(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, MaxLearned: 4})
	gpu := stored(rank, kvevent.TierDevice, nil, []uint64{1, 2}, tokens(0, 32), 16, kvevent.Seed)
	decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 32), 16}))
	decode(t, d, in(t, []any{"BlockStored", []uint64{3, 4}, nil, tokens(100, 32), 16})) // {1, 2} now old
	if n := d.Stats().Learned; n != 4 {
		t.Fatalf("learned %d pairs, want all 4 (the bound)", n)
	}
	cpu := gpu
	cpu.Tier = kvevent.TierHostPinned
	assertEvents(t, decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2}, nil, []uint32{}, 16, nil, "CPU"})),
		[]kvevent.Event{cpu})
	// Both are kept, now the newest.
	assertEvents(t, decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2}, nil, []uint32{}, 16, nil, "CPU"})),
		[]kvevent.Event{cpu})
}

func TestEventsCarryTheFollowedRankAndNoID(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: kvevent.Rank{Worker: 8, DP: 1}})
	var b Batch
	if err := d.Decode(pack(t, []any{1.0, []any{goodStoreArray(), []any{"AllBlocksCleared"}}, 1}), &b); err != nil {
		t.Fatal(err)
	}
	if err := d.Decode(pack(t, []any{1.0, []any{[]any{"BlockRemoved", []uint64{3}}}}), &b); err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 3 {
		t.Fatalf("events %s, want 3", fmtEvents(b.Events))
	}
	for i, e := range b.Events {
		if e.EventID != 0 {
			t.Errorf("event %d has id %d: ids are the agent's", i, e.EventID)
		}
		if want := (kvevent.Rank{Worker: 8, DP: 1}); e.Rank != want {
			t.Fatalf("event %d rank %v, want %v", i, e.Rank, want)
		}
	}
}

// TestABatchOfAnotherDPRankIsLeftOutWhole: an engine that publishes every
// dp rank's batches on one endpoint (Dynamo's TensorRT-LLM relay with
// attention DP, each batch [ts, events, attention_dp_rank]) reaches the
// decoder of each rank followed there. Filed under the followed rank,
// rank 3's blocks would be routed to rank 0, and its clear would clear
// rank 0. Left out, its stores count no copy: rank 0's remove of a block
// both ranks stored still takes rank 0's only copy.
func TestABatchOfAnotherDPRankIsLeftOutWhole(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	var b Batch
	if err := d.Decode(pack(t, []any{1.0, []any{goodStoreArray(), []any{"AllBlocksCleared"}}, 3}), &b); err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 0 || !b.HasDPRank || b.DPRank != 3 {
		t.Fatalf("rank 3's batch, decoded for rank 0: events %s, dp %d/%v; want none, dp 3", fmtEvents(b.Events), b.DPRank, b.HasDPRank)
	}
	s := d.Stats()
	if s.Batches != 1 || s.Events != 2 || s.Emitted != 0 || s.Skipped[ReasonOtherDPRank] != 2 || s.DroppedBlocks[ReasonOtherDPRank] != 3 {
		t.Fatalf("stats %+v, want 1 batch, 2 events skipped as %v, 3 blocks dropped", s, ReasonOtherDPRank)
	}

	own := func(ev any) []kvevent.Event { return decode(t, d, pack(t, []any{1.0, []any{ev}, 0})) }
	assertEvents(t, own(goodStoreArray()), []kvevent.Event{goodStoreWant()})
	for _, other := range []any{
		[]any{2.0, []any{goodStoreArray()}, 3},
		omap{"data_parallel_rank", 3, "events", []any{goodStoreArray()}, "ts", 2.0},
	} {
		if evs := decode(t, d, pack(t, other)); len(evs) != 0 {
			t.Fatalf("rank 3's store emitted %s for rank 0", fmtEvents(evs))
		}
	}
	want := []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{11}}}
	assertEvents(t, own([]any{"BlockRemoved", []uint64{11}}), want)
	if s := d.Stats(); s.Skipped[ReasonOtherDPRank] != 4 || s.CopyRemoves != 0 {
		t.Fatalf("stats %+v, want 4 events of rank 3 skipped, no remove held back for rank 3's copies", s)
	}
}

// TestARejectedBatchOfAnotherDPRankKeepsTheCopies: once the decoder has
// seen another dp rank's batch, it reads each payload's dp rank first; a
// payload of another rank that does not decode returns ErrPayload and
// ErrOtherDPRank, and keeps the copies counted for the followed rank (the
// other rank's events count none). A rejected payload of the followed
// rank forgets them, as before.
func TestARejectedBatchOfAnotherDPRankKeepsTheCopies(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	decode(t, d, pack(t, []any{1.0, []any{goodStoreArray()}, 3})) // rank 3's: read dp ranks first from now on
	decode(t, d, pack(t, []any{1.0, []any{goodStoreArray()}, 0})) // the followed rank's store: copies counted
	held := d.Stats().Copies
	if held == 0 {
		t.Fatal("no copy counted for the followed rank's store")
	}
	var b Batch
	err := d.Decode(pack(t, []any{"now", []any{goodStoreArray()}, 3}), &b)
	if !errors.Is(err, ErrPayload) || !errors.Is(err, ErrOtherDPRank) {
		t.Fatalf("rank 3's rejected payload: error %v, want ErrPayload and ErrOtherDPRank", err)
	}
	if s := d.Stats(); s.Copies != held || s.BadPayloads != 1 || len(b.Events) != 0 {
		t.Fatalf("after rank 3's rejected payload: %d copies (want %d), %d bad payloads, %d events", s.Copies, held, s.BadPayloads, len(b.Events))
	}
	err = d.Decode(pack(t, []any{"now", []any{goodStoreArray()}, 0}), &b)
	if !errors.Is(err, ErrPayload) || errors.Is(err, ErrOtherDPRank) {
		t.Fatalf("the followed rank's rejected payload: error %v, want ErrPayload alone", err)
	}
	if s := d.Stats(); s.Copies != 0 {
		t.Fatalf("%d copies after the followed rank's rejected payload, want 0", s.Copies)
	}
}

func TestBatchSlicesDoNotAlias(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	var b Batch
	two := in(t, goodStoreArray(), []any{"BlockStored", []uint64{21, 22}, nil, tokens(0, 32), 16}, []any{"BlockRemoved", []uint64{1}}, []any{"BlockRemoved", []uint64{2}})
	if err := d.Decode(two, &b); err != nil {
		t.Fatal(err)
	}
	before := b.Events[1].Blocks[0]
	b.Events[0].Blocks = append(b.Events[0].Blocks, kvevent.Block{EngineHash: 666})
	b.Events[2].Removed = append(b.Events[2].Removed, 666)
	if b.Events[1].Blocks[0] != before || b.Events[3].Removed[0] != 2 {
		t.Fatal("appending to one event's slice overwrote the next event")
	}
}

func TestBrokenPayloadsReturnErrPayloadAndLeaveTheBatch(t *testing.T) {
	good := raw(pack(t, goodStoreArray()))
	cases := []struct {
		name    string
		payload []byte
	}{
		{"empty", nil},
		{"reserved byte", []byte{0xc1}},
		{"an int", []byte{0x05}},
		{"a string", pack(t, "batch")},
		{"one-element array", pack(t, []any{1.0})},
		{"empty array", pack(t, []any{})},
		{"ts a string", pack(t, []any{"now", []any{good}})},
		{"events a map", pack(t, []any{1.0, omap{"a", 1}})},
		{"events nil", pack(t, []any{1.0, nil})},
		{"dp negative", pack(t, []any{1.0, []any{good}, -1})},
		{"dp above 2^32", pack(t, []any{1.0, []any{good}, uint64(1 << 32)})},
		{"dp a string", pack(t, []any{1.0, []any{good}, "0"})},
		{"map without events", pack(t, omap{"ts", 1.0})},
		{"map with events twice", pack(t, omap{"events", []any{}, "events", []any{}})},
		{"trailing bytes", append(pack(t, []any{1.0, []any{good}}), 0x00)},
		{"truncated in a token", pack(t, []any{1.0, []any{good}})[:30]},
		{"truncated in a hash", unhex(t, `92 cb 3f f8 00 00 00 00 00 00 91 93 ac "BlockRemoved" 91 cf da b8 9b`)},
		{"events count beyond the bytes", unhex(t, `92 00 dd ff ff ff ff 90`)},
		{"fewer events than the count", unhex(t, `92 00 93 90 90`)},
		{"token count beyond the bytes", unhex(t, `92 00 91 94 ab "BlockStored" 91 01 c0 dd 7f ff ff ff 01`)},
		{"string length beyond the bytes", unhex(t, `92 00 91 92 db 7f ff ff ff 41`)},
		{"reserved byte inside an ignored field", pack(t, []any{1.0, []any{[]any{"BlockRemoved", []uint64{1}, nil, nil, raw{0xc1}}}})},
		{"map count beyond the bytes", unhex(t, `df ff ff ff ff a2 74 73 00`)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			var b Batch
			if err := d.Decode(in(t, goodStoreArray()), &b); err != nil {
				t.Fatal(err)
			}
			before := d.Stats()
			err := d.Decode(c.payload, &b)
			if !errors.Is(err, ErrPayload) {
				t.Fatalf("error %v, want ErrPayload", err)
			}
			assertEvents(t, b.Events, []kvevent.Event{goodStoreWant()})
			if b.TS != 1.0 || b.HasDPRank {
				t.Fatalf("batch header changed: ts %v dp %v", b.TS, b.HasDPRank)
			}
			after := d.Stats()
			after.BadPayloads--
			if after.Copies != 0 {
				t.Fatalf("%d copies counted after a rejected payload, want 0: the events it lost may have removed some", after.Copies)
			}
			after.Copies = before.Copies
			if after != before {
				t.Fatalf("stats changed by a rejected payload:\nbefore %+v\nafter  %+v", before, after)
			}
		})
	}
}

// A length header is never trusted to size anything: a payload of a few
// bytes that claims four billion elements fails without allocating for them.
func TestLengthHeadersCannotForceAllocation(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	payloads := [][]byte{
		unhex(t, `92 00 dd ff ff ff ff`),
		unhex(t, `92 00 91 94 ab "BlockStored" dd ff ff ff ff 01 02`),
		unhex(t, `92 00 91 94 ab "BlockStored" 91 01 c0 dd ff ff ff ff 01`),
		unhex(t, `92 00 91 83 a4 "type" ab "BlockStored" df ff ff ff ff`),
		unhex(t, `92 00 91 93 ac "BlockRemoved" 91 c6 ff ff ff ff 00`),
	}
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	for _, p := range payloads {
		var b Batch
		if err := d.Decode(p, &b); !errors.Is(err, ErrPayload) {
			t.Fatalf("% x: error %v, want ErrPayload", p, err)
		}
	}
	runtime.ReadMemStats(&ms1)
	if grown := ms1.TotalAlloc - ms0.TotalAlloc; grown > 1<<20 {
		t.Fatalf("rejecting %d tiny payloads allocated %d bytes", len(payloads), grown)
	}
}

// An event's hashes cost memory in proportion to the payload, at a rate a
// frame of the size the subscriber accepts (256 MiB) can afford: a
// BlockRemoved of n one-byte hashes (a payload of about n bytes, the most
// hashes a payload can carry) must not make Decode allocate more than 32
// bytes per payload byte (8 for the decoded hashes, 8 for the Batch's
// copy, their growth, the repeat check's set, and the sorted copy that
// drops a remove's repeats). It pins the slices
// sized once from the checked header, and a repeat check that does not
// size a set from a count it may abandon at the 129th hash.
func TestManyOneByteHashesAllocateInProportion(t *testing.T) {
	n := 1 << 20
	p := []byte{0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x93, 0xac}
	p = append(p, "BlockRemoved"...)
	p = append(p, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	for i := 0; i < n; i++ {
		p = append(p, byte(1+i%100)) // repeats from the 101st: removed once
	}
	p = append(p, 0xc0, 0xc0)
	d := newTestDecoder(t, Config{Rank: rank})
	var b Batch
	grown, err := decodeAllocating(d, p, &b)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if len(b.Events) != 1 || len(b.Events[0].Removed) != 100 {
		t.Fatalf("%d events (skipped %v), want one remove of the 100 hashes", len(b.Events), d.Stats().Skipped)
	}
	if grown > 32*uint64(len(p)) {
		t.Fatalf("a payload of %d bytes (%d one-byte hashes) allocated %d bytes, %.0f per payload byte (at most 32)",
			len(p), n, grown, float64(grown)/float64(len(p)))
	}
}

func TestNewDecoderRejectsBadBlockSize(t *testing.T) {
	for _, bs := range []int{0, -16, maxBlockSize + 1} {
		if _, err := NewDecoder(Config{BlockSize: bs}); !errors.Is(err, ErrConfig) {
			t.Fatalf("block size %d: error %v, want ErrConfig", bs, err)
		}
	}
}

func TestReasonLabels(t *testing.T) {
	seen := map[string]bool{}
	for r := Reason(0); r < NumReasons; r++ {
		s := r.String()
		if s == "" || seen[s] {
			t.Fatalf("reason %d label %q empty or repeated", r, s)
		}
		seen[s] = true
	}
}

// Once its buffers have grown, decoding a batch allocates nothing.
func TestDecodeDoesNotAllocateInSteadyState(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	payloads := benchPayloads(t, 8)
	for _, lora := range []string{"adapter-a", "adapter-b", "adapter-a"} { // names alternate
		payloads = append(payloads, in(t, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 32), 16, 1, "CPU", lora}))
	}
	// Removes that repeat hashes (vLLM's fanned-out offload evictions) drop
	// the repeats in place, short ones pairwise and longer ones through the
	// decoder's set; a placeholder offload store resolves its parent.
	fanOut := make([]uint64, 80)
	for i := range fanOut {
		fanOut[i] = uint64(1 + i%50)
	}
	payloads = append(payloads,
		in(t, []any{"BlockRemoved", []uint64{1, 2, 1, 3}, "CPU"}, []any{"BlockRemoved", fanOut, "CPU"}),
		in(t, []any{"BlockStored", []uint64{2}, nil, []uint32{}, 0, nil, "CPU"}))
	// A REMOTE storage tier's store and remove, the locality in either case
	// and encoding, and an unknown medium only REMOTE makes readable.
	payloads = append(payloads,
		in(t, []any{"BlockStored", []uint64{7}, nil, tokens(0, 16), 16, nil, "STORAGE", nil, nil, 0, nil, nil, "REMOTE"},
			omap{"type", "BlockStored", "block_hashes", []uint64{8}, "token_ids", tokens(16, 16), "block_size", 16,
				"medium", "OBJ", "locality", "remote", "ownership", "fs"}),
		in(t, []any{"BlockRemoved", []uint64{7}, "STORAGE", 0, "Remote"},
			omap{"type", "BlockRemoved", "block_hashes", []uint64{8}, "medium", "OBJ", "locality", "REMOTE"}))
	// TensorRT-LLM's multimodal digest among the tokens and its mm_keys,
	// a LoRA store's extra keys, and another dp rank's batch (read before
	// its events once one was seen).
	digest := anys(tokens(0, 48))
	digest[40] = strings.Repeat("cd", 32)
	payloads = append(payloads,
		in(t, omap{"type", "BlockStored", "block_hashes", []uint64{31, 32, 33}, "token_ids", digest, "block_size", 16,
			"mm_keys", []any{[]any{}, []any{omap{"type", "mm_key", "hash", "ab", "start_offset", 0}}, nil}}),
		in(t, []any{"BlockStored", []uint64{34, 35}, nil, tokens(0, 32), 16, nil, "GPU", "sql", []any{[]any{"sql"}, []any{"sql", "salt"}}}),
		pack(t, []any{1.0, []any{goodStoreArray(), []any{"AllBlocksCleared"}}, 3}))
	var b Batch
	for _, p := range payloads { // warm up: grow buffers, learn hashes, fill caches
		if err := d.Decode(p, &b); err != nil {
			t.Fatal(err)
		}
		b.Reset()
	}
	i := 0
	allocs := testing.AllocsPerRun(200, func() {
		b.Reset()
		if err := d.Decode(payloads[i%len(payloads)], &b); err != nil {
			t.Fatal(err)
		}
		i++
	})
	if allocs != 0 {
		t.Fatalf("Decode allocated %.1f times per batch, want 0", allocs)
	}
}

// An engine that salts every block hash (its registered salt) is decoded
// with SaltedSeed: its blocks' content hashes are what a route with that
// cache_salt (and LoRA) looks up, and not what one without it does. From a
// review: every decoder hashed without the salt, so a route with
// cache_salt never matched anything.
func TestSaltedSeedHashesAsASaltedRouteLooksUp(t *testing.T) {
	const bs = 4
	toks := tokens(100, 2*bs)
	for _, lora := range []string{"", "adapter-a"} {
		d, err := NewDecoder(Config{BlockSize: bs, Seed: SaltedSeed("tenant-a")})
		if err != nil {
			t.Fatal(err)
		}
		ev := omap{"type", "BlockStored", "block_hashes", []uint64{11, 12}, "token_ids", toks, "block_size", bs, "medium", "GPU"}
		if lora != "" {
			ev = append(ev, "lora_name", lora)
		}
		evs := decode(t, d, pack(t, []any{1.0, []any{ev}, nil}))
		if len(evs) != 1 || len(evs[0].Blocks) != 2 {
			t.Fatalf("decoded %s", fmtEvents(evs))
		}
		salted := kvevent.LocalHashes(nil, toks, bs, kvevent.SeedFor(lora, "tenant-a"))
		plain := kvevent.LocalHashes(nil, toks, bs, kvevent.SeedFor(lora, ""))
		for i, b := range evs[0].Blocks {
			if b.LocalHash != salted[i] || b.LocalHash == plain[i] {
				t.Fatalf("lora %q block %d: content hash %#x, want the salted %#x (unsalted %#x)", lora, i, b.LocalHash, salted[i], plain[i])
			}
		}
	}
	if SaltedSeed("") != nil {
		t.Fatal("SaltedSeed(\"\") is not nil: the decoder's plain seeds")
	}
}

// Floods of the smallest events the decoder emits cost memory in
// proportion to the payload, at the rate TestManyOneByteHashesAllocateInProportion
// holds hashes to (32 bytes per payload byte): the Batch's events and the
// decoder's spans are sized once from the events' count, bounded by the
// bytes left, instead of grown by append (a quarter at a time past 256
// elements, five times their final size in all).
func TestFloodsOfSmallEventsAllocateInProportion(t *testing.T) {
	n := 1 << 16
	cleared := []byte{0x91, 0xb0}
	cleared = append(cleared, "AllBlocksCleared"...)
	removed := []byte{0x92, 0xac}
	removed = append(removed, "BlockRemoved"...)
	removed = append(removed, 0x91, 0x01)
	if len(removed) != 16 {
		t.Fatalf("the smallest emitted event is %d bytes, want 16", len(removed))
	}
	for _, c := range []struct {
		name string
		ev   []byte
	}{{"AllBlocksCleared", cleared}, {"one-hash BlockRemoved", removed}} {
		p := []byte{0x92, 0x00, 0xdd, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
		for range n {
			p = append(p, c.ev...)
		}
		d := newTestDecoder(t, Config{Rank: rank})
		var b Batch
		grown, err := decodeAllocating(d, p, &b)
		if err != nil {
			t.Fatalf("%s: decode: %v", c.name, err)
		}
		if len(b.Events) != n {
			t.Fatalf("%s: %d events, want %d", c.name, len(b.Events), n)
		}
		t.Logf("%s: %d events of %d bytes allocated %.1f bytes per payload byte", c.name, n, len(c.ev), float64(grown)/float64(len(p)))
		if grown > 32*uint64(len(p)) {
			t.Errorf("%s: a payload of %d bytes (%d events) allocated %d bytes, %.0f per payload byte (at most 32)",
				c.name, len(p), n, grown, float64(grown)/float64(len(p)))
		}
	}
}

// Events of a hundred one-byte hashes each, many to a payload, cost
// memory in proportion to the payload at the rate doc.go states ("under 32
// bytes a payload byte for the most hashes or events a payload can
// carry"), as one event of all the hashes and floods of the smallest
// events do (TestManyOneByteHashesAllocateInProportion,
// TestFloodsOfSmallEventsAllocateInProportion): the Batch's blocks and
// removed hashes, appended event by event, must not cost several times
// their final size on the way. The stores are of hashes learned first
// (an offload tier's store carries no tokens), so each one emits.
func TestManyMidSizedEventsAllocateInProportion(t *testing.T) {
	// Copies not counted: the payloads store one event's blocks many times,
	// and the removes would take copies off their counts, emitting nothing.
	d := newTestDecoder(t, Config{Rank: rank, MaxCopies: -1})
	const per = 100 // one-byte hashes 1..100, distinct within an event
	hs := make([]any, per)
	for i := range hs {
		hs[i] = i + 1
	}
	toks := make([]any, d.blockSize*per)
	for i := range toks {
		toks[i] = i % 1000
	}
	if evs := decode(t, d, in(t, []any{"BlockStored", hs, nil, toks})); len(evs) != 1 {
		t.Fatalf("learning the hashes emitted %d events, want 1", len(evs))
	}
	for _, typ := range []string{"BlockStored", "BlockRemoved"} {
		ev := []byte{0x92, 0xa0 | byte(len(typ))}
		ev = append(ev, typ...)
		ev = append(ev, 0xdc, 0, per)
		for i := 1; i <= per; i++ {
			ev = append(ev, byte(i))
		}
		n := (1 << 22) / len(ev)
		p := []byte{0x92, 0x00, 0xdd, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
		for range n {
			p = append(p, ev...)
		}
		var b Batch
		grown, err := decodeAllocating(d, p, &b)
		if err != nil {
			t.Fatalf("%s: decode: %v", typ, err)
		}
		if len(b.Events) != n {
			t.Fatalf("%s: %d events, want %d", typ, len(b.Events), n)
		}
		if grown > 32*uint64(len(p)) {
			t.Errorf("%s: a payload of %d bytes (%d events of %d one-byte hashes) allocated %d bytes, %.1f per payload byte (at most 32)",
				typ, len(p), n, per, grown, float64(grown)/float64(len(p)))
		}
	}
}

// minEmittedEventBytes, which readEvents sizes the events by, is no larger
// than the smallest event that emits: ["BlockStored", [h]] of a one-byte
// hash learned earlier (a store of an offload tier), 15 bytes. A bound
// larger than an emitting event undersizes the events, which append then
// grows, copying them all.
func TestNoEmittedEventIsSmallerThanTheSizingBound(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, MaxCopies: -1}) // the store of [1] is repeated
	decode(t, d, in(t, []any{"BlockStored", []any{1}, nil, tokens(0, d.blockSize)}))
	for _, ev := range [][]byte{
		append(append([]byte{0x92, 0xab}, "BlockStored"...), 0x91, 0x01),
		append(append([]byte{0x92, 0xac}, "BlockRemoved"...), 0x91, 0x01),
		append([]byte{0x91, 0xb0}, "AllBlocksCleared"...),
	} {
		p := append([]byte{0x92, 0x00, 0x91}, ev...)
		if evs := decode(t, d, p); len(evs) != 1 {
			t.Fatalf("% x emitted %d events, want 1", ev, len(evs))
		}
		if len(ev) < minEmittedEventBytes {
			t.Errorf("a %d-byte event (% x) emitted, but minEmittedEventBytes is %d", len(ev), ev, minEmittedEventBytes)
		}
	}
}

// A flood of one-byte events that emit nothing (a number where an event
// should be: bad_shape) costs memory in proportion to the payload: the
// events are sized by what the bytes left can emit (minEmittedEventBytes
// an event), not by the array's count, which such a payload makes a
// million for a million bytes.
func TestAFloodOfSkippedOneByteEventsAllocatesInProportion(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	n := 1 << 20
	p := []byte{0x92, 0x00, 0xdd, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
	for range n {
		p = append(p, 0x01)
	}
	var b Batch
	grown, err := decodeAllocating(d, p, &b)
	if err != nil {
		t.Fatalf("decode: %v", err)
	}
	if len(b.Events) != 0 || d.Stats().Skipped[ReasonBadShape] != uint64(n) {
		t.Fatalf("%d events emitted, %d skipped as bad_shape; want 0 and %d", len(b.Events), d.Stats().Skipped[ReasonBadShape], n)
	}
	if grown > 32*uint64(len(p)) {
		t.Errorf("a payload of %d bytes (%d one-byte events, none emitted) allocated %d bytes, %.1f per payload byte (at most 32)",
			len(p), n, grown, float64(grown)/float64(len(p)))
	}
}

// decodeAllocating decodes p into b with d and returns the bytes the
// decode allocated (runtime.MemStats.TotalAlloc, after a GC).
func decodeAllocating(d *Decoder, p []byte, b *Batch) (uint64, error) {
	runtime.GC()
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	err := d.Decode(p, b)
	runtime.ReadMemStats(&ms1)
	return ms1.TotalAlloc - ms0.TotalAlloc, err
}

// TestPeekedRankFollowsDecodeOnRepeatedKeys: once another dp rank's batch
// was seen, each payload's data_parallel_rank is peeked at before its
// events (peekDP), and the peek must read the rank decodeBatch reads: of
// a map with the key twice, the last one (a nil last one: no rank, so the
// followed rank's). Otherwise rank 0's batch is left out, or rank 3's
// emitted under rank 0 with nothing to undo it.
func TestPeekedRankFollowsDecodeOnRepeatedKeys(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	if evs := decode(t, d, pack(t, []any{1.0, []any{}, 3})); len(evs) != 0 {
		t.Fatal(fmtEvents(evs))
	}
	for _, c := range []struct {
		name  string
		batch omap
		emits int
	}{
		{"3 then 0", omap{"data_parallel_rank", 3, "events", []any{goodStoreArray()}, "data_parallel_rank", 0}, 1},
		{"0 then 3", omap{"data_parallel_rank", 0, "events", []any{goodStoreArray()}, "data_parallel_rank", 3}, 0},
		{"3 then nil", omap{"data_parallel_rank", 3, "events", []any{goodStoreArray()}, "data_parallel_rank", nil}, 1},
	} {
		if evs := decode(t, d, pack(t, c.batch)); len(evs) != c.emits {
			t.Fatalf("%s: emitted %s, want %d events (the last data_parallel_rank counts)", c.name, fmtEvents(evs), c.emits)
		}
	}
}
