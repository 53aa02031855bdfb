// Package engine decodes the KV event payloads of inference engines (vLLM,
// and SGLang in the same format; shared/design/wire.md) into router events
// (kvevent.Event). One payload is the msgpack frame of one batch; the ZMQ
// transport that carries it, sequence numbers and replay are not here.
//
// A Decoder serves one rank. It is configured with the rank's registered
// block size and turns each wire event into at most one router event:
//
//	BlockStored      → KindStored: Blocks{EngineHash, LocalHash}, Parent/HasParent, Tier from medium
//	BlockRemoved     → KindRemoved: Removed hashes, Tier from medium
//	AllBlocksCleared → KindCleared
//
// Accepted shapes: a batch as [ts, events, dp_rank], [ts, events] or a map
// {ts, events, data_parallel_rank} (later fields and unknown keys ignored; ts
// a float64, float32 or integer); each event as a tagged array (fields by
// position, trailing ones omitted, extra ones ignored) or a map with a "type"
// key (in any position; absent fields are nil, unknown keys ignored), mixed
// freely; hashes as integers of any width (signed reinterpreted as uint64) or
// bin (the last 8 bytes, big-endian, left-padded); token_ids as integers, or
// as SGLang's EAGLE token pairs [t, t'], one per token, each t' the next
// pair's t (a page's token is a pair's first element, block_size counts the
// pairs; readTokenPairs); in an array store, a map where lora_name goes is
// SGLang's request metadata (BlockStoredWithMetadata's {"cache_salt": ...}):
// no LoRA name, and the blocks count in Stats.ExtraKeyBlocks.
//
// Invariants:
//   - Every event Decode emits passes Event.Validate. Its EventID is zero (the
//     node agent assigns ids after filtering) and its Rank is Config.Rank. A
//     batch whose data_parallel_rank names another dp rank emits nothing:
//     its events are counted under ReasonOtherDPRank, and count no copy.
//   - A malformed event never reaches the output and never stops the batch:
//     it is skipped and counted under its Reason. Each wire event read is
//     either emitted or counted in Stats.Skipped exactly once.
//   - A payload that is not a readable batch returns ErrPayload and leaves the
//     Batch and the counters as they were (bar Stats.BadPayloads): a payload
//     is decoded whole or not at all. One whose data_parallel_rank, read
//     before its events, names another dp rank wraps ErrOtherDPRank too.
//     (Content hashes it taught the decoder
//     are kept, and so are group kinds with LearnGroupKinds: they are facts
//     about block contents and the engine's groups, not index state.)
//   - Nothing is sized from a length header alone: a header is checked
//     against the bytes that remain before it is used, so memory grows at
//     most in proportion to the payload (under 32 bytes a payload byte for
//     the most hashes or events a payload can carry), and any input,
//     however hostile, decodes or fails without panicking (FuzzDecode).
//   - The hot fields are read straight from the payload with no interface
//     boxing; once a reused Batch has grown, Decode allocates nothing. What
//     a Batch and the decoder keep between payloads is bounded
//     (maxKeptBytes a slice): one event of millions of blocks allocates its
//     storage, which is dropped after it rather than held for good.
//
// Rules, in the order they are checked (the Reason that counts a skip):
//
//  1. The event is an array or map with a string type tag (ReasonBadShape)
//     naming a known type (ReasonUnknownType), and every field its type reads
//     has the right msgpack type and range (ReasonBadField). Fields the
//     package never reads (lora_id's value, extra_keys,
//     kv_cache_spec_sliding_window, ownership, ...) are opaque and never cost
//     an event, and neither does a locality that is not a string (read as
//     absent). A block_size of 0 is out of range in a store with tokens;
//     in one without (vLLM's offloading connector's placeholder, rule 7) it
//     is read as no block_size.
//  2. Only the main attention group feeds the index (ReasonNotMainGroup): an
//     event with a kv_cache_spec_kind is kept when the kind is
//     full_attention, mla_attention or sink_full_attention (ASCII case
//     ignored); an event without one, when it has no group_idx or group 0.
//     That last rule misfiles removes of hybrid models whose full-attention
//     group is not group 0 (a BlockRemoved carries no kind): with
//     Config.LearnGroupKinds, a group's kind learned from its stores decides
//     instead. A clear has no fields: it is kept whatever group or kind
//     it carries (it clears the rank in every group and tier).
//  3. The medium names a tier per kvevent.ParseMedium, nil being the device
//     (ReasonUnknownMedium), unless the locality is REMOTE (ASCII case
//     ignored): such a store or remove is filed under TierExternal,
//     whatever its medium. LOCAL, no locality or any other value leaves
//     the medium's tier.
//  4. A store or remove has hashes (ReasonNoBlocks). A store repeats none
//     (ReasonRepeatedHash), and its first hash is not its parent
//     (ReasonParentIsFirst), nor any later one (ReasonRepeatedHash: the
//     chain would name its parent as its own descendant). A remove takes
//     one counted copy of each hash it names, as many as it names it, and
//     removes the hashes whose last copy went, each once (vLLM's
//     offloading connector repeats the hashes that evicted chunks share):
//     copies.go says why a block stored twice is removed only by its
//     second remove. A remove that removes nothing is Stats.Absorbed.
//  5. A store's content hashes are computed from its tokens with
//     kvevent.LocalHashes, seeded by Config.Seed(lora_name) (default
//     kvevent.SeedFor(lora_name, "")). Tokens under an adapter named only by
//     the deprecated lora_id cannot be hashed (ReasonUnnamedLoRA).
//  6. Block size (ReasonBlockSize): an event whose block_size differs from
//     the registered one loses all its blocks; one with more tokens than
//     blocks × block_size too (which tokens belong to which block is
//     unknown). One with fewer, and a block_size equal to the registered
//     one, keeps the blocks whose tokens are all there and loses the first
//     incomplete one and every block after it (they chain onto it); without
//     block_size, fewer tokens lose every block, since they may be the whole
//     of blocks smaller than the registered size, and pairing hash i with
//     the i-th registered-size span of them would learn a wrong content
//     hash. A str among the tokens (ReasonMMToken: TensorRT-LLM's digest of
//     a multimodal item, kv_cache_events.py EventTokenId = int | str) ends
//     the event at its block: the text blocks before it are kept, its block
//     and every later one, whose engine hashes cover the item, are lost.
//  7. A store without tokens (an offload tier's: the connector knows only
//     hashes) takes each block's content hash from the ones learned from
//     earlier stores with tokens; the first block never seen ends the event
//     (ReasonUnresolved). One that names no parent takes the parent the
//     store of its first block named, as vLLM's offloading connector sends
//     each block it offloads alone, with no parent (and block_size 0): an
//     engine hash covers the block's prefix, so at the root the block would
//     be another one under the same hash. Learned pairs are bounded
//     (Config.MaxLearned), never dropped on a remove, and forgotten by
//     Decoder.Reset at a new epoch; learned.go says why.
//
// Blocks lost under rules 6 and 7 are counted in Stats.DroppedBlocks; an
// event that loses them all is also counted as skipped. Before any rule, a
// batch whose data_parallel_rank is not Config.Rank.DP is left out whole
// (ReasonOtherDPRank).
//
// What this package cannot know: extra_keys (multimodal ids, a per-request
// cache salt) change the engine's block hash but are opaque here, so a
// block's content hash covers its tokens, its LoRA and the engine's
// registered salt (Config.Seed, SaltedSeed) only. Blocks of two requests
// with the same tokens and different images or per-request salts (vLLM's
// in extra_keys, TensorRT-LLM's in mm_keys, Dynamo's relay's in
// block_mm_infos, SGLang's in its request metadata or cache_salt key) share
// a content hash; Stats.ExtraKeyBlocks counts how many such blocks are
// emitted: from a block with such keys to the end of its store, since the
// engine's hashes chain (a salt on block 0 covers them all), and not for a
// key that is only the event's lora_name, which seeds the content hash
// (SGLang's cache_salt key of the map encoding is not counted, nor a later
// store continuing the chain).
package engine
