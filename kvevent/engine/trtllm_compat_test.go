package engine

import (
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TensorRT-LLM's KV cache manager V2 publishes its own KV events over ZMQ
// (NVIDIA/TensorRT-LLM tensorrt_llm/_torch/pyexecutor/kv_cache_events.py
// @13599e98, "StreamingKVCacheEventManager"): a positional batch
// [ts, events, data_parallel_rank] of map-tagged events, BlockStored with
// lora_id, medium "GPU", lora_name written as nil and, when multimodal
// decoding is on, mm_keys: one list per block of MultimodalKey structs
// (msgspec tag "mm_key": {"type": "mm_key", "hash": hex, "start_offset": n}).
// Its C++ serializer (kv_cache_manager_v2 streamingEventSink.cpp, the
// same repository) writes every integer, tokens, block_size and the rank
// included, as int64 (0xd3).

// TestTRTLLMNativeBatchDecodes pins that the C++ serializer's byte layout
// (all integers 0xd3, a map of 8 per store, the rank as int64) decodes.
func TestTRTLLMNativeBatchDecodes(t *testing.T) {
	toks := tokens(100, 32)
	ti := make([]any, len(toks))
	for i, x := range toks {
		ti[i] = i64(x)
	}
	ev := omap{"type", "BlockStored", "block_hashes", []any{i64(-5), i64(6)}, "parent_block_hash", nil,
		"token_ids", ti, "block_size", i64(16), "lora_id", nil, "medium", "GPU", "lora_name", nil}
	rm := omap{"type", "BlockRemoved", "block_hashes", []any{i64(6)}, "medium", "GPU"}
	r := kvevent.Rank{Worker: rank.Worker, DP: 3} // the rank the batch names
	d := newTestDecoder(t, Config{Rank: r})
	got := decode(t, d, pack(t, []any{1.5, []any{ev, rm}, i64(3)}))
	want := []kvevent.Event{
		stored(r, kvevent.TierDevice, nil, []uint64{1<<64 - 5, 6}, toks, 16, kvevent.Seed),
		removed(r, kvevent.TierDevice, 6),
	}
	assertEvents(t, got, want)
}

// TestMultimodalKeysOfOtherPublishersCountAsExtraKeyBlocks: doc.go and
// Stats.ExtraKeyBlocks say the blocks whose engine hash covers more than
// their tokens (multimodal ids) are emitted with a content hash of the
// tokens alone and counted. TensorRT-LLM's mm_keys and Dynamo's TRT-LLM
// relay's block_mm_infos (ai-dynamo/dynamo components/src/dynamo/trtllm
// publisher.py ZmqKvEventPublisher.publish_stored, read by
// lib/kv-router zmq_wire.rs) carry that per-block multimodal identity
// under another key: such blocks are emitted, and must be counted too.
func TestMultimodalKeysOfOtherPublishersCountAsExtraKeyBlocks(t *testing.T) {
	img := strings.Repeat("ab", 32)
	for name, ev := range map[string]any{
		"TensorRT-LLM mm_keys": omap{"type", "BlockStored", "block_hashes", []uint64{1, 2}, "parent_block_hash", nil,
			"token_ids", tokens(0, 32), "block_size", 16, "lora_id", nil, "medium", "GPU", "lora_name", nil,
			"mm_keys", []any{[]any{}, []any{omap{"type", "mm_key", "hash", img, "start_offset", 0}}}},
		"Dynamo relay block_mm_infos": omap{"type", "BlockStored", "block_hashes", []uint64{1, 2}, "parent_block_hash", nil,
			"token_ids", tokens(0, 32), "block_size", 16,
			"block_mm_infos", []any{nil, omap{"mm_objects", []any{omap{"mm_hash", uint64(0xabababababababab), "offsets", []any{}}}}}},
	} {
		t.Run(name, func(t *testing.T) {
			d := newTestDecoder(t, Config{Rank: rank})
			evs := decode(t, d, in(t, ev))
			if len(evs) != 1 || len(evs[0].Blocks) != 2 {
				t.Fatalf("events %s, want one store of 2 blocks", fmtEvents(evs))
			}
			if s := d.Stats(); s.ExtraKeyBlocks != 1 {
				t.Fatalf("ExtraKeyBlocks = %d, want 1: block 2 carries an image's key and is emitted with the content hash of its placeholder tokens alone", s.ExtraKeyBlocks)
			}
		})
	}
}

// TestTRTLLMDigestTokenDropsItsBlockAndTheLaterOnes: TensorRT-LLM V2 writes
// a multimodal item's start as its digest in hex, a str among the ints of
// token_ids (EventTokenId = int | str; eventData.cpp decodeEventBlock), and
// its sink coalesces consecutive blocks of a chain into one BlockStored.
// The text blocks before the first block with a str token are plain text
// blocks a text request with the same prefix hits; only the blocks from
// the multimodal one on cannot be hashed from tokens: they are dropped
// (mm_token). The whole store was skipped as a bad field.
func TestTRTLLMDigestTokenDropsItsBlockAndTheLaterOnes(t *testing.T) {
	toks := anys(tokens(0, 48))
	toks[40] = strings.Repeat("cd", 32) // block 3's image start
	ev := omap{"type", "BlockStored", "block_hashes", []uint64{1, 2, 3}, "parent_block_hash", nil,
		"token_ids", toks, "block_size", 16, "lora_id", nil, "medium", "GPU", "lora_name", nil}
	d := newTestDecoder(t, Config{Rank: rank})
	got := decode(t, d, in(t, ev))
	want := []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1, 2}, tokens(0, 32), 16, kvevent.Seed)}
	if len(got) == 0 {
		t.Fatalf("the store of 2 text blocks and an image block emitted nothing: skipped %v", d.Stats().Skipped)
	}
	assertEvents(t, got, want)
	if s := d.Stats(); s.DroppedBlocks[ReasonMMToken] != 1 || s.Skipped != ([NumReasons]uint64{}) {
		t.Fatalf("dropped %v, skipped %v: want the image block dropped as %v, no event skipped", s.DroppedBlocks, s.Skipped, ReasonMMToken)
	}
	// A store whose first block holds the digest keeps none.
	toks[0] = strings.Repeat("ef", 32)
	if got := decode(t, d, in(t, ev)); len(got) != 0 {
		t.Fatalf("a store whose first block holds a digest emitted %s", fmtEvents(got))
	}
	if s := d.Stats(); s.Skipped[ReasonMMToken] != 1 || s.DroppedBlocks[ReasonMMToken] != 4 {
		t.Fatalf("skipped %v, dropped %v: want the store skipped as %v, its 3 blocks dropped", s.Skipped, s.DroppedBlocks, ReasonMMToken)
	}
}

// vLLM's generate_block_hash_extra_keys (vllm/v1/core/kv_cache_utils.py,
// read at b4e69e0a) builds each block's extra_keys as lora_extra_keys +
// mm_extra_keys + cache_salt_keys + prompt_embeds_keys, where the LoRA key
// ([lora_name]) is on every block of a LoRA request and the cache salt is
// on the first block only ("start_token_idx == 0"): the engine's block
// hash chains it to every later block.

// TestLoRAOnlyExtraKeysAreNotExtraKeyBlocks: a LoRA store's blocks carry
// extra_keys [lora_name] each, but their content hashes are seeded by
// lora_name (Config.Seed): a route under the same adapter finds them, and
// no other request shares them. They are not the blocks ExtraKeyBlocks
// stands for (doc.go: blocks whose content hash covers the tokens only,
// shared by requests with other images or salts).
func TestLoRAOnlyExtraKeysAreNotExtraKeyBlocks(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	keys := []any{[]any{"sql-adapter"}, []any{"sql-adapter"}}
	evs := decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2}, nil, tokens(0, 32), 16, nil, "GPU", "sql-adapter", keys}))
	want := []kvevent.Event{stored(rank, kvevent.TierDevice, nil, []uint64{1, 2}, tokens(0, 32), 16, kvevent.SeedFor("sql-adapter", ""))}
	assertEvents(t, evs, want)
	if s := d.Stats(); s.ExtraKeyBlocks != 0 {
		t.Fatalf("ExtraKeyBlocks = %d, want 0: the blocks' only extra key is their LoRA name, which their content hashes are seeded by", s.ExtraKeyBlocks)
	}
}

// TestSaltOnTheFirstBlockCountsEveryBlockItChains: a salted request's store
// carries the salt in extra_keys[0] only, yet every block's engine hash
// covers it while every block's content hash (and sequence hash) is the
// unsalted request's: all of them are blocks another tenant's request
// shares a content hash with.
func TestSaltOnTheFirstBlockCountsEveryBlockItChains(t *testing.T) {
	d := newTestDecoder(t, Config{Rank: rank})
	keys := []any{[]any{"tenant-a"}, nil, nil}
	decode(t, d, in(t, []any{"BlockStored", []uint64{1, 2, 3}, nil, tokens(0, 48), 16, nil, "GPU", nil, keys}))
	if s := d.Stats(); s.ExtraKeyBlocks != 3 {
		t.Fatalf("ExtraKeyBlocks = %d, want 3: the salt of block 1 is in the engine hash of blocks 2 and 3 too, and none of their content hashes covers it", s.ExtraKeyBlocks)
	}
}
