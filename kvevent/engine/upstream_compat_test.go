package engine

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// SGLang with EAGLE speculative decoding keys its radix tree by token
// bigrams, and its KV event recorder publishes each page's tokens as the
// pairs (t[j], t[j+1]) for j in the page: sgl-project/sglang
// python/sglang/srt/mem_cache/events.py @06f643f4, record_store ("Preserve
// historical event payload: bigram pages expose tuples"; block_size is the
// number of pairs). msgspec writes each tuple as a 2-element array, inside the
// array_like BlockStored [tag, block_hashes, parent_block_hash, token_ids,
// block_size, lora_id] of python/sglang/srt/disaggregation/kv_events.py
// @612d5790 (batch [ts, events, attn_dp_rank]). ai-dynamo/dynamo's decoder
// accepts these (KvTokenIds::Bigram in its vLLM/SGLang wire types).
//
// This pins that such a store is indexed, not dropped as a bad field: the
// first element of each pair is the page's token, so its blocks carry the
// content hash of those tokens, the one a request with the same prompt
// looks up.
func TestSGLangEagleBigramTokensAreIndexed(t *testing.T) {
	const bs = 4
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: bs})
	plain := tokens(100, 2*bs+1) // the page tokens and the one after them
	var pairs []any
	for j := 0; j < 2*bs; j++ {
		pairs = append(pairs, []any{plain[j], plain[j+1]})
	}
	payload := pack(t, []any{1.5, []any{
		[]any{"BlockStored", []any{i64(-7), i64(-8)}, nil, pairs, bs, nil},
	}, 0})
	got := decode(t, d, payload)
	want := []kvevent.Event{stored(rank, kvevent.TierDevice, nil,
		[]uint64{uint64(1<<64 - 7), uint64(1<<64 - 8)}, plain[:2*bs], bs, kvevent.Seed)}
	if s := d.Stats(); s.Emitted != 1 {
		t.Fatalf("EAGLE bigram store not emitted: skipped by reason %v", s.Skipped)
	}
	assertEvents(t, got, want)
}

// bigrams returns the n pairs (t, t+1) of the tokens from `from` on, as
// SGLang's EAGLE recorder writes a page's token_ids.
func bigrams(from, n int) []any {
	out := make([]any, n)
	for j := range out {
		out[j] = []any{from + j, from + j + 1}
	}
	return out
}

// TestSGLangEagleBigramTokensOfAnotherShapeAreABadField pins what the pair
// shape of token_ids accepts: only a list of 2-element arrays of tokens, each
// pair's second token the next pair's first, as SGLang builds them from one
// token sequence. Anything else skips the store as a bad field, and the
// stores around it decode.
func TestSGLangEagleBigramTokensOfAnotherShapeAreABadField(t *testing.T) {
	with := func(i int, v any) []any {
		p := bigrams(0, 16)
		p[i] = v
		return p
	}
	cases := []struct {
		name string
		toks any
	}{
		{"an integer, then pairs", append([]any{0}, bigrams(1, 15)...)},
		{"pairs, then an integer", append(bigrams(0, 15), 15)},
		{"integers, then a pair", append(anys(tokens(0, 15)), []any{15, 16})},
		{"a pair of three", with(3, []any{3, 4, 5})},
		{"a pair of one", with(15, []any{15})},
		{"an empty pair", with(0, []any{})},
		{"a pair whose second token is not the next first", with(4, []any{4, 9})},
		{"a pair whose first token is not the last second", with(5, []any{6, 6})},
		{"a negative token in a pair", with(2, []any{2, -1})},
		{"a token above 2^32 in a pair", with(15, []any{15, uint64(1 << 32)})},
		{"a string in a pair", with(0, []any{"0", 1})},
		{"a map for a pair", with(7, omap{"a", 7})},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			ev := []any{"BlockStored", []uint64{1}, nil, c.toks, 16}
			got := decode(t, d, in(t, goodStoreArray(), ev, goodStoreArray()))
			assertEvents(t, got, []kvevent.Event{goodStoreWant(), goodStoreWant()})
			s := d.Stats()
			if s.Events != 3 || s.Emitted != 2 || s.Skipped[ReasonBadField] != 1 {
				t.Fatalf("events %d emitted %d skipped %v, want 3, 2 and one %v", s.Events, s.Emitted, s.Skipped, ReasonBadField)
			}
		})
	}
	// The same page as pairs is one store, with the tokens' hash.
	d := newTestDecoder(t, Config{Rank: rank})
	got := decode(t, d, in(t, []any{"BlockStored", []uint64{1}, nil, bigrams(0, 16), 16}))
	assertEvents(t, got, []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1}, tokens(0, 16), 16, kvevent.Seed)})
}

// TestSGLangEagleBigramTokensCutShortAreABrokenPayload pins that token_ids
// pairs running past the payload's end refuse the payload (ErrPayload), as
// integers do, instead of reading beyond it.
func TestSGLangEagleBigramTokensCutShortAreABrokenPayload(t *testing.T) {
	for name, payload := range map[string]string{
		"the bytes end before a pair": `92 00 91 94 ab "BlockStored" 91 01 c0 94 92 01 02 92 02 03`,
		"the bytes end in a pair":     `92 00 91 94 ab "BlockStored" 91 01 c0 93 92 01 02 92`,
		"the bytes end in a token":    `92 00 91 94 ab "BlockStored" 91 01 c0 92 92 01 cd 01`,
	} {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			var b Batch
			if err := d.Decode(unhex(t, payload), &b); !errors.Is(err, ErrPayload) {
				t.Fatalf("error %v, want ErrPayload", err)
			}
		})
	}
}

// SGLang publishes a store of a request with a cache_salt as
// BlockStoredWithMetadata: msgspec array_like, every field written,
// [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
// medium, {"cache_salt": salt}] (python/sglang/srt/disaggregation/kv_events.py,
// read at amdpilot-org/sglang a029c210). The metadata map sits where vLLM
// writes lora_name. This pins that such a store is indexed, its blocks
// counted as carrying keys the content hash does not cover, instead of
// dropped as a bad lora_name; and that the tagged-map encoding with
// cache_salt and session_id keys decodes too.
func TestSGLangSaltedStoreIsIndexed(t *testing.T) {
	toks := tokens(0, 32)
	want := []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1, 2}, toks, 16, kvevent.Seed)}
	for name, ev := range map[string]any{
		"array with metadata": []any{"BlockStored", []uint64{1, 2}, nil, toks, 16, nil, "GPU", omap{"cache_salt", "tenant-a"}},
		"tagged map":          omap{"type", "BlockStored", "block_hashes", []uint64{1, 2}, "parent_block_hash", nil, "token_ids", toks, "block_size", 16, "lora_id", nil, "medium", "GPU", "cache_salt", "tenant-a", "session_id", "s-1"},
	} {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			got := decode(t, d, in(t, ev))
			if s := d.Stats(); s.Emitted != 1 {
				t.Fatalf("salted SGLang store not emitted: skipped by reason %v", s.Skipped)
			}
			assertEvents(t, got, want)
			if s := d.Stats(); name == "array with metadata" && s.ExtraKeyBlocks != 2 {
				t.Fatalf("ExtraKeyBlocks = %d, want the store's 2 salted blocks", s.ExtraKeyBlocks)
			}
		})
	}
	// A map under the lora_name key of the map encoding, which no engine
	// writes, is still a bad field.
	for name, ev := range map[string]any{
		"lora_name key a map": omap{"type", "BlockStored", "block_hashes", []uint64{1}, "token_ids", tokens(0, 16), "block_size", 16, "lora_name", omap{"a", 1}},
	} {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			decode(t, d, in(t, ev))
			if s := d.Stats(); s.Skipped[ReasonBadField] != 1 {
				t.Fatalf("skipped %v, want one bad field", s.Skipped)
			}
		})
	}
}

// TestSGLangMetadataMapIsReadOnlyWhereLoraNameGoes pins that the array
// encoding takes a map, SGLang's BlockStoredWithMetadata's metadata, only in
// the lora_name position of a BlockStored (TestSGLangSaltedStoreIsIndexed):
// a map in any other position of a BlockStored or a BlockRemoved is a bad
// field, the event skipped (a map as medium read as the device tier, the
// event indexed there, and a map as extra_keys or group_idx taken for
// salted or the main group, each indexed a store or applied a remove no
// engine wrote). Two positions are opaque (doc.go, rule 1): lora_id, read
// only for its presence, takes any value, so a map there is a LoRA without
// a name, a store skipped as such; extra_keys, read only as an array of
// entries, takes any other value as none, so a store with a map there is
// indexed, but not as salted (no ExtraKeyBlocks).
func TestSGLangMetadataMapIsReadOnlyWhereLoraNameGoes(t *testing.T) {
	meta := omap{"cache_salt", "tenant-a"}
	toks := tokens(0, 32)
	storedAt := func(pos int) []any {
		ev := []any{"BlockStored", []uint64{1, 2}, nil, toks, 16, nil, "GPU", nil, nil, 0, "full_attention"}
		ev[pos] = meta
		return ev
	}
	removedAt := func(pos int) []any {
		ev := []any{"BlockRemoved", []uint64{1, 2}, "GPU", 0}
		ev[pos] = meta
		return ev
	}
	cases := map[string]struct {
		ev   []any
		want Reason
	}{
		"stored block_hashes":       {storedAt(1), ReasonBadField},
		"stored parent_block_hash":  {storedAt(2), ReasonBadField},
		"stored token_ids":          {storedAt(3), ReasonBadField},
		"stored block_size":         {storedAt(4), ReasonBadField},
		"stored lora_id":            {storedAt(5), ReasonUnnamedLoRA},
		"stored medium":             {storedAt(6), ReasonBadField},
		"stored group_idx":          {storedAt(9), ReasonBadField},
		"stored kv_cache_spec_kind": {storedAt(10), ReasonBadField},
		"removed block_hashes":      {removedAt(1), ReasonBadField},
		"removed medium":            {removedAt(2), ReasonBadField},
		"removed group_idx":         {removedAt(3), ReasonBadField},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			got := decode(t, d, in(t, c.ev))
			if s := d.Stats(); s.Emitted != 0 || s.Skipped[c.want] != 1 || len(got) != 0 {
				t.Fatalf("a map as %s: emitted %d (%v), skipped by reason %v, want it skipped by reason %d only (the map is read only where lora_name goes)",
					name, s.Emitted, got, s.Skipped, c.want)
			}
		})
	}
	t.Run("stored extra_keys", func(t *testing.T) {
		d := newTestDecoder(t, Config{Rank: rank})
		decode(t, d, in(t, storedAt(8)))
		if s := d.Stats(); s.Emitted != 1 || s.ExtraKeyBlocks != 0 {
			t.Fatalf("a map as extra_keys: emitted %d, ExtraKeyBlocks %d, skipped by reason %v, want it emitted with no extra-key blocks (extra_keys opaque, the map read as salted only where lora_name goes)",
				s.Emitted, s.ExtraKeyBlocks, s.Skipped)
		}
	})
	// The same events with the map where lora_name goes, or without it,
	// are indexed: what is skipped above is the map's position.
	d := newTestDecoder(t, Config{Rank: rank})
	decode(t, d, in(t, storedAt(7), []any{"BlockRemoved", []uint64{1, 2}, "GPU", 0}))
	if s := d.Stats(); s.Emitted != 2 {
		t.Fatalf("the store with the map where lora_name goes and the remove: emitted %d, skipped by reason %v, want both", s.Emitted, s.Skipped)
	}
}

// vLLM's offloading connector publishes a CPU (or STORAGE) tier store, unless
// the opt-in kv_connector_extra_config["self_describing_kv_events"] is set,
// as a placeholder with no tokens, no parent and block_size=0:
// vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py
// @030ea52e, OffloadingEventsTracker._placeholder_stored:
//
//	BlockStored(block_hashes=[maybe_convert_block_hash(get_offload_block_hash(key))],
//	            parent_block_hash=None, token_ids=[], lora_id=None, block_size=0,
//	            medium="CPU", lora_name=None, group_idx=get_offload_group_idx(key), ...)
//
// vllm/distributed/kv_events.py @0181ea31 encodes the batch and events as
// msgspec maps (omit_defaults: parent, lora_id and lora_name written as nil,
// extra_keys, kind, window, locality and ownership omitted), the tag first
// under "type". The store names a block the device store taught the decoder
// (the same engine hash), so it resolves through the learned hashes to the
// host tier (rule 7): block_size=0 is vLLM's "unknown", not a size. The
// placeholder names no parent even for a block deep in a chain: it goes
// under the parent the device store named, so that the router holds it at
// the device block's node, where a route finds it, rather than at the root
// under the device block's hash. A placeholder of a block never learned is
// dropped as unresolved, not placed at the root. From a review: every
// placeholder was skipped as bad_field, so the host and disk tiers of vLLM's
// offloading were never indexed.
func TestVLLMOffloadPlaceholderStoreIsIndexed(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
	const h1, h2, h3 = uint64(0xdab89baa7b5857c0), uint64(0x8ab89baa7b5857c1), uint64(0x7ab89baa7b5857c2)
	gpu := omap{"type", "BlockStored", "block_hashes", []any{u64(h1), u64(h2), u64(h3)}, "parent_block_hash", nil,
		"token_ids", anys(tokens(0, 48)), "block_size", 16, "lora_id", nil, "medium", "GPU",
		"lora_name", nil, "group_idx", 0, "kv_cache_spec_kind", "full_attention"}
	batch := func(ev any) []byte {
		return pack(t, omap{"ts", 1.7e9, "events", []any{ev}, "data_parallel_rank", 0})
	}
	want := stored(rank, kvevent.TierDevice, nil, []uint64{h1, h2, h3}, tokens(0, 48), 16, kvevent.Seed)
	assertEvents(t, decode(t, d, batch(gpu)), []kvevent.Event{want})

	placeholder := map[string]func(h uint64) any{
		"map (kv_events.py since array_like was dropped)": func(h uint64) any {
			return omap{"type", "BlockStored", "block_hashes", []any{u64(h)}, "parent_block_hash", nil,
				"token_ids", []any{}, "block_size", 0, "lora_id", nil, "medium", "CPU", "lora_name", nil, "group_idx", 0}
		},
		"array (array_like kv_events.py)": func(h uint64) any {
			return []any{"BlockStored", []any{u64(h)}, nil, []any{}, 0, nil, "CPU", nil}
		},
	}
	for name, ev := range placeholder {
		t.Run(name, func(t *testing.T) {
			for i, h := range []uint64{h1, h2, h3} {
				before := d.Stats()
				got := decode(t, d, batch(ev(h)))
				cpu := want
				cpu.Tier, cpu.Blocks = kvevent.TierHostPinned, want.Blocks[i:i+1]
				if i > 0 {
					cpu.HasParent, cpu.Parent = true, want.Blocks[i-1].EngineHash
				}
				if len(got) != 1 {
					t.Fatalf("placeholder store of block %d (block_size=0, no tokens) not indexed: skipped by reason %v",
						i, skippedNames(skippedSince(before, d.Stats())))
				}
				assertEvents(t, got, []kvevent.Event{cpu})
			}

			before := d.Stats()
			assertEvents(t, decode(t, d, batch(ev(0x1234))), nil)
			if s := skippedSince(before, d.Stats()); s[ReasonUnresolved] != 1 {
				t.Fatalf("placeholder store of a block never learned: skipped by reason %v, want one unresolved", skippedNames(s))
			}
		})
	}
}

// skippedSince returns the events skipped, by reason, between two Stats.
func skippedSince(before, after Stats) [NumReasons]uint64 {
	var s [NumReasons]uint64
	for r := range s {
		s[r] = after.Skipped[r] - before.Skipped[r]
	}
	return s
}

func skippedNames(s [NumReasons]uint64) map[string]uint64 {
	m := map[string]uint64{}
	for r, n := range s {
		if n != 0 {
			m[Reason(r).String()] = n
		}
	}
	return m
}

// vLLM's offloading connector in self-describing mode
// (kv_connector_extra_config["self_describing_kv_events"]) publishes each
// offloaded chunk's constituent block hashes, and an eviction "fans out to the
// same hashes": vllm-project/vllm
// vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py @030ea52e,
// OffloadingEventsTracker._take_removed_event, which extends one list per
// group_idx with every evicted key's block hashes and yields ONE
// BlockRemoved(block_hashes=hashes, medium="CPU", group_idx=g). Its module
// docstring: "Chunks overlapping a non-chunk-aligned shared prefix re-announce
// the shared hashes once per chunk; consumers are expected to deduplicate
// (reference-count) repeated store/remove announcements of the same hash."
//
// Two requests that share the first 3 blocks of a 4-block chunk offload two
// chunks [h1 h2 h3 h4] and [h1 h2 h3 h5] (keys h4 and h5). The CPU manager
// evicts both in one OffloadingEvent, so the remove is
// [h1 h2 h3 h4 h1 h2 h3 h5]: every one of those blocks left the host tier,
// and the remove takes each once. From a review: the decoder skipped the
// whole remove as repeated_hash, so the router kept routing to five
// host-tier blocks the engine no longer held.
func TestVLLMOffloadEvictionFanOutRemovesEveryHash(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
	const h1, h2, h3, h4, h5 = uint64(0x1111111111111111), uint64(0x2222222222222222),
		uint64(0x3333333333333333), uint64(0x4444444444444444), uint64(0x5555555555555555)
	chunkA := anys(tokens(0, 64))
	chunkB := append(anys(tokens(0, 48)), anys(tokens(1000, 16))...)
	store := func(hs []any, toks []any) omap { // events.py _take_stored_event, msgspec map (kv_events.py @0181ea31)
		return omap{"type", "BlockStored", "block_hashes", hs, "parent_block_hash", nil, "token_ids", toks,
			"block_size", 16, "lora_id", nil, "medium", "CPU", "lora_name", nil, "group_idx", 0,
			"kv_cache_spec_kind", "full_attention"}
	}
	batch := func(evs ...any) []byte {
		return pack(t, omap{"ts", 1.7e9, "events", evs, "data_parallel_rank", 0})
	}
	got := decode(t, d, batch(
		store([]any{u64(h1), u64(h2), u64(h3), u64(h4)}, chunkA),
		store([]any{u64(h1), u64(h2), u64(h3), u64(h5)}, chunkB)))
	if len(got) != 2 {
		t.Fatalf("the two chunk stores: %d events, want 2 (skipped %v)", len(got), skippedNames(d.Stats().Skipped))
	}

	before := d.Stats()
	got = decode(t, d, batch(omap{"type", "BlockRemoved",
		"block_hashes", []any{u64(h1), u64(h2), u64(h3), u64(h4), u64(h1), u64(h2), u64(h3), u64(h5)},
		"medium", "CPU", "group_idx", 0}))
	if len(got) != 1 {
		t.Fatalf("vLLM's fanned-out eviction of two chunks sharing a prefix: %d events %s, skipped %v; want one host-tier remove of h1..h5",
			len(got), fmtEvents(got), skippedNames(skippedSince(before, d.Stats())))
	}
	// Each hash in the order its last copy went: h1..h3 were stored twice.
	assertEvents(t, got, []kvevent.Event{removed(rank, kvevent.TierHostPinned, h4, h1, h2, h3, h5)})

	// The int and bin spellings of one hash are one hash.
	assertEvents(t, decode(t, d, batch([]any{"BlockRemoved", []any{u64(0xab), []byte{0xab}, u64(0xac)}, "CPU"})),
		[]kvevent.Event{removed(rank, kvevent.TierHostPinned, 0xab, 0xac)})
}

// The same two chunks evicted one at a time: the connector's remove of
// chunk A names [h1 h2 h3 h4], and h1..h3 stay in the host tier in chunk B
// (the docstring's "reference-count"). Taken as they came, the first
// remove took h1..h3 off the router, and with them the way to h5: the
// rank lost its host-tier hits of chunk B's whole prefix while the engine
// held it. Only h4 goes; chunk B's eviction then takes the rest.
func TestVLLMOffloadEvictionOfOneChunkKeepsTheBlocksItShares(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
	const h1, h2, h3, h4, h5 = uint64(0x1111111111111111), uint64(0x2222222222222222),
		uint64(0x3333333333333333), uint64(0x4444444444444444), uint64(0x5555555555555555)
	store := func(hs []any, toks []any) omap { // events.py _take_stored_event
		return omap{"type", "BlockStored", "block_hashes", hs, "parent_block_hash", nil, "token_ids", toks,
			"block_size", 16, "lora_id", nil, "medium", "CPU", "lora_name", nil, "group_idx", 0,
			"kv_cache_spec_kind", "full_attention"}
	}
	remove := func(hs ...any) omap { // events.py _take_removed_event
		return omap{"type", "BlockRemoved", "block_hashes", hs, "medium", "CPU", "group_idx", 0}
	}
	batch := func(evs ...any) []byte {
		return pack(t, omap{"ts", 1.7e9, "events", evs, "data_parallel_rank", 0})
	}
	decode(t, d, batch(
		store([]any{u64(h1), u64(h2), u64(h3), u64(h4)}, anys(tokens(0, 64))),
		store([]any{u64(h1), u64(h2), u64(h3), u64(h5)}, append(anys(tokens(0, 48)), anys(tokens(1000, 16))...))))

	assertEvents(t, decode(t, d, batch(remove(u64(h1), u64(h2), u64(h3), u64(h4)))),
		[]kvevent.Event{removed(rank, kvevent.TierHostPinned, h4)})
	if s := d.Stats(); s.CopyRemoves != 3 || s.Copies != 4 {
		t.Fatalf("after chunk A's eviction: %d hashes kept by another copy, %d counted; want 3 and 4 (h1..h3, h5)", s.CopyRemoves, s.Copies)
	}
	assertEvents(t, decode(t, d, batch(remove(u64(h1), u64(h2), u64(h3), u64(h5)))),
		[]kvevent.Event{removed(rank, kvevent.TierHostPinned, h1, h2, h3, h5)})
	if s := d.Stats(); s.Copies != 0 {
		t.Fatalf("after both evictions %d copies counted, want 0", s.Copies)
	}
}

// vLLM's GPU prefix cache does not de-duplicate (vllm/v1/core/block_pool.py
// @002f3491, BlockPool: "We currently don't de-duplicate the blocks in the
// cache"): two requests that fill a block with the same tokens at once
// cache two blocks under one hash, each announced by cache_full_blocks'
// BlockStored, and _maybe_evict_cached_block announces each eviction with
// a BlockRemoved of the hash. The first eviction leaves a copy: the router
// must keep routing to it. Its remove emits nothing (Stats.Absorbed); the
// second takes the block.
func TestVLLMDeviceCopiesOfABlockStayUntilTheLastIsEvicted(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
	const parent, h = uint64(0x0a0a0a0a0a0a0a0a), uint64(0x0b0b0b0b0b0b0b0b)
	batch := func(evs ...any) []byte { return pack(t, []any{1.7e9, evs, 0}) }
	// array_like BlockStored: [tag, block_hashes, parent, token_ids, block_size, lora_id, medium]
	decode(t, d, batch([]any{"BlockStored", []any{u64(parent)}, nil, anys(tokens(0, 16)), 16, nil, nil}))
	for range 2 {
		decode(t, d, batch([]any{"BlockStored", []any{u64(h)}, u64(parent), anys(tokens(16, 16)), 16, nil, nil}))
	}
	assertEvents(t, decode(t, d, batch([]any{"BlockRemoved", []any{u64(h)}, nil})), nil)
	if s := d.Stats(); s.Absorbed != 1 || s.CopyRemoves != 1 {
		t.Fatalf("first eviction of two copies: absorbed %d, kept %d hashes; want 1 and 1", s.Absorbed, s.CopyRemoves)
	}
	assertEvents(t, decode(t, d, batch([]any{"BlockRemoved", []any{u64(h)}, nil})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, h)})
	// Copies are per tier: the host tier's store of the block is its own.
	decode(t, d, batch([]any{"BlockStored", []any{u64(parent)}, nil, []any{}, 0, nil, "CPU"}))
	assertEvents(t, decode(t, d, batch([]any{"BlockRemoved", []any{u64(parent)}, nil})),
		[]kvevent.Event{removed(rank, kvevent.TierDevice, parent)})
	assertEvents(t, decode(t, d, batch([]any{"BlockRemoved", []any{u64(parent)}, "CPU"})),
		[]kvevent.Event{removed(rank, kvevent.TierHostPinned, parent)})
}

// vLLM's KV events carry, since vllm-project/vllm#48281, an optional locality
// on BlockStored and BlockRemoved: "LOCAL or REMOTE relative to the
// publisher; None means unspecified" (vllm/distributed/kv_events.py; its
// fields, after kv_cache_spec_sliding_window in a store and group_idx in a
// remove: locality, then ownership, "secondary offloading tier identifier,
// if generated by one", #52067). The FS and OBJ secondary tiers of the
// offloading connector publish it as configured (locality: LOCAL or REMOTE
// in their secondary_tiers entry; vllm/v1/kv_offload/tiering/fs/manager.py
// @0255eeaa, FileSystemTierManager: medium STORAGE,
// OffloadingEvent(keys, medium, removed=False, locality=self.locality)), and
// OffloadingEventsTracker forwards it to the BlockStored and BlockRemoved it
// builds (offloading/events.py @030ea52e). vLLM never infers it: absent is
// unspecified.
//
// A REMOTE tier is storage the worker does not hold (a shared PVC, an object
// store): its blocks go under External (G4, remote or shared storage), not
// under the worker's Disk, whatever the medium (STORAGE today; FS or OBJ
// from vLLM 0.26, which no medium table names). LOCAL, absent, and any other
// value keep the medium's tier. Both of kv_events.py's encodings: the msgspec
// map (omit_defaults: a None locality or ownership is left out), and the
// array_like one, where a locality makes the defaults before it be written
// as nil.
func TestVLLMRemoteStorageTierIsExternal(t *testing.T) {
	const h1, h2 = uint64(0x1a1a1a1a1a1a1a1a), uint64(0x2b2b2b2b2b2b2b2b)
	toks := tokens(0, 32)
	encodings := map[string]struct {
		store  func(medium, locality any) any
		remove func(medium, locality any) any
	}{
		"map": {
			store: func(medium, locality any) any {
				ev := omap{"type", "BlockStored", "block_hashes", []any{u64(h1), u64(h2)}, "parent_block_hash", nil,
					"token_ids", anys(toks), "block_size", 16, "lora_id", nil, "medium", medium, "lora_name", nil,
					"group_idx", 0, "kv_cache_spec_kind", "full_attention"}
				if locality != nil {
					ev = append(ev, "locality", locality, "ownership", "fs")
				}
				return ev
			},
			remove: func(medium, locality any) any {
				ev := omap{"type", "BlockRemoved", "block_hashes", []any{u64(h1), u64(h2)}, "medium", medium, "group_idx", 0}
				if locality != nil {
					ev = append(ev, "locality", locality)
				}
				return ev
			},
		},
		"array_like": {
			// [tag, block_hashes, parent_block_hash, token_ids, block_size,
			// lora_id, medium, lora_name, extra_keys, group_idx,
			// kv_cache_spec_kind, kv_cache_spec_sliding_window, locality,
			// ownership]
			store: func(medium, locality any) any {
				ev := []any{"BlockStored", []any{u64(h1), u64(h2)}, nil, anys(toks), 16, nil, medium, nil, nil, 0, "full_attention"}
				if locality != nil {
					ev = append(ev, nil, locality, "fs")
				}
				return ev
			},
			// [tag, block_hashes, medium, group_idx, locality, ownership]
			remove: func(medium, locality any) any {
				ev := []any{"BlockRemoved", []any{u64(h1), u64(h2)}, medium, 0}
				if locality != nil {
					ev = append(ev, locality, "fs")
				}
				return ev
			},
		},
	}
	cases := []struct {
		medium, locality any
		want             kvevent.Tier
	}{
		{"STORAGE", "REMOTE", kvevent.TierExternal},
		{"STORAGE", "remote", kvevent.TierExternal}, // ASCII case ignored, as for mediums
		{"OBJ", "REMOTE", kvevent.TierExternal},     // vLLM 0.26's OBJ tier: a medium no table names
		{"CPU", "REMOTE", kvevent.TierExternal},     // a shared CPU pool (#48281: "may be REMOTE")
		{"STORAGE", "LOCAL", kvevent.TierDisk},
		{"STORAGE", nil, kvevent.TierDisk},
		{"STORAGE", "RACK", kvevent.TierDisk}, // a value vLLM does not send: the medium decides
		{"STORAGE", 7, kvevent.TierDisk},      // not a string: read as absent
		{"CPU", "LOCAL", kvevent.TierHostPinned},
	}
	batch := func(ev any) []byte { return pack(t, omap{"ts", 1.7e9, "events", []any{ev}, "data_parallel_rank", 0}) }
	for name, enc := range encodings {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/%v/%v", name, c.medium, c.locality), func(t *testing.T) {
				d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
				got := decode(t, d, batch(enc.store(c.medium, c.locality)))
				if len(got) != 1 {
					t.Fatalf("store not indexed: skipped by reason %v", skippedNames(d.Stats().Skipped))
				}
				assertEvents(t, got, []kvevent.Event{stored(rank, c.want, nil, []uint64{h1, h2}, toks, 16, kvevent.Seed)})
				assertEvents(t, decode(t, d, batch(enc.remove(c.medium, c.locality))),
					[]kvevent.Event{removed(rank, c.want, h1, h2)})
			})
		}
	}

	// The copies of a block are counted per tier: the REMOTE tier's copy
	// and the local disk's are two, and the remote one's eviction leaves
	// the disk's.
	t.Run("a local and a remote copy", func(t *testing.T) {
		d := newTestDecoder(t, Config{Rank: rank, BlockSize: 16})
		enc := encodings["map"]
		decode(t, d, batch(enc.store("STORAGE", "REMOTE")))
		decode(t, d, batch(enc.store("STORAGE", "LOCAL")))
		assertEvents(t, decode(t, d, batch(enc.remove("STORAGE", "REMOTE"))),
			[]kvevent.Event{removed(rank, kvevent.TierExternal, h1, h2)})
		assertEvents(t, decode(t, d, batch(enc.remove("STORAGE", nil))),
			[]kvevent.Event{removed(rank, kvevent.TierDisk, h1, h2)})
	})
}
