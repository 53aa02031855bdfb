package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/tinylib/msgp/msgp"
)

// This file reads the msgpack of one batch into wireEvents: the engine's
// fields, unconverted. It reads straight from the payload bytes: strings are
// sub-slices of the payload, numbers are decoded by a switch on the lead
// byte, and nothing is boxed into an interface. The conversion to router
// events (block size, content hashes, tiers, filtering) is in decoder.go.
//
// Two kinds of failure are kept apart throughout:
//
//   - a value of the wrong msgpack type (a string where a hash belongs) is a
//     *field* error: the value is skipped with msgp.Skip, the field is marked
//     bad in wireEvent.bad, and reading goes on with the next field, so the
//     event can be skipped and counted while the batch still decodes;
//   - bytes that are not msgpack at all (truncated, the reserved prefix 0xc1,
//     a length running past the end) are a *structural* error, returned as a
//     Go error, because nothing after them can be located.
//
// Every length header is checked against the bytes left before anything is
// sized from it: each msgpack value takes at least one byte, so an array of n
// values needs n bytes and a map 2n. A lying header therefore fails at once
// instead of allocating, and every buffer grows at most in proportion to the
// payload.

// errLength means a length header promises more values than bytes remain.
var errLength = errors.New("length header exceeds the remaining bytes")

const mnil = 0xc0

func isArray(c byte) bool { return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd }
func isMap(c byte) bool   { return c&0xf0 == 0x80 || c == 0xde || c == 0xdf }
func isStr(c byte) bool   { return c&0xe0 == 0xa0 || c == 0xd9 || c == 0xda || c == 0xdb }
func isBin(c byte) bool   { return c == 0xc4 || c == 0xc5 || c == 0xc6 }

// arrayHeader reads an array header whose lead byte is known to be an array.
func arrayHeader(b []byte) (int, []byte, error) {
	n, rest, err := msgp.ReadArrayHeaderBytes(b)
	if err != nil {
		return 0, b, err
	}
	if uint64(n) > uint64(len(rest)) {
		return 0, b, errLength
	}
	return int(n), rest, nil
}

// mapHeader reads a map header whose lead byte is known to be a map.
func mapHeader(b []byte) (int, []byte, error) {
	n, rest, err := msgp.ReadMapHeaderBytes(b)
	if err != nil {
		return 0, b, err
	}
	if 2*uint64(n) > uint64(len(rest)) {
		return 0, b, errLength
	}
	return int(n), rest, nil
}

// skipN skips n values.
func skipN(b []byte, n int) ([]byte, error) {
	var err error
	for ; n > 0; n-- {
		if b, err = msgp.Skip(b); err != nil {
			return b, err
		}
	}
	return b, nil
}

// readInt reads an integer of any msgpack width. It returns its 64 bits
// (a negative value two's-complement, as uint64) and whether it was a
// negative signed value. ok is false, and b returned unchanged, when the
// next value is not an integer.
func readInt(b []byte) (v uint64, neg bool, rest []byte, ok bool, err error) {
	if len(b) == 0 {
		return 0, false, b, false, msgp.ErrShortBytes
	}
	c := b[0]
	if c <= 0x7f {
		return uint64(c), false, b[1:], true, nil
	}
	if c >= 0xe0 {
		return uint64(int64(int8(c))), true, b[1:], true, nil
	}
	var size int
	switch c {
	case 0xcc, 0xd0:
		size = 1
	case 0xcd, 0xd1:
		size = 2
	case 0xce, 0xd2:
		size = 4
	case 0xcf, 0xd3:
		size = 8
	default:
		return 0, false, b, false, nil
	}
	if len(b) < 1+size {
		return 0, false, b, false, msgp.ErrShortBytes
	}
	p := b[1 : 1+size]
	switch c {
	case 0xcc:
		v = uint64(p[0])
	case 0xcd:
		v = uint64(binary.BigEndian.Uint16(p))
	case 0xce:
		v = uint64(binary.BigEndian.Uint32(p))
	case 0xcf:
		v = binary.BigEndian.Uint64(p)
	case 0xd0:
		v = uint64(int64(int8(p[0])))
	case 0xd1:
		v = uint64(int64(int16(binary.BigEndian.Uint16(p))))
	case 0xd2:
		v = uint64(int64(int32(binary.BigEndian.Uint32(p))))
	case 0xd3:
		v = binary.BigEndian.Uint64(p)
	}
	neg = c >= 0xd0 && int64(v) < 0
	return v, neg, b[1+size:], true, nil
}

// readUint reads a non-negative integer no larger than max. ok is false,
// and b returned unchanged, for any other value.
func readUint(b []byte, max uint64) (uint64, []byte, bool, error) {
	v, neg, rest, ok, err := readInt(b)
	if err != nil || !ok || neg || v > max {
		return 0, b, false, err
	}
	return v, rest, true, nil
}

// readHash reads a block hash: an integer of any width (a signed value is
// reinterpreted as uint64) or bin bytes, of which the last 8 are read
// big-endian, shorter ones left-padded with zeros. That is the value the
// engine's integer mode gives for the same block.
func readHash(b []byte) (uint64, []byte, bool, error) {
	if len(b) == 0 {
		return 0, b, false, msgp.ErrShortBytes
	}
	c := b[0]
	if c <= 0x7f { // fast path: small ints are common in tests, rare in production
		return uint64(c), b[1:], true, nil
	}
	if c == 0xcf || c == 0xd3 { // the common case: a full 64-bit hash
		if len(b) < 9 {
			return 0, b, false, msgp.ErrShortBytes
		}
		return binary.BigEndian.Uint64(b[1:9]), b[9:], true, nil
	}
	if isBin(c) {
		v, rest, err := msgp.ReadBytesZC(b)
		if err != nil {
			return 0, b, false, err
		}
		if len(v) > 8 {
			v = v[len(v)-8:]
		}
		var h uint64
		for _, x := range v {
			h = h<<8 | uint64(x)
		}
		return h, rest, true, nil
	}
	v, _, rest, ok, err := readInt(b)
	return v, rest, ok, err
}

// readStr reads a str value without copying. ok is false, and b returned
// unchanged, when the next value is not a str.
func readStr(b []byte) ([]byte, []byte, bool, error) {
	if len(b) == 0 {
		return nil, b, false, msgp.ErrShortBytes
	}
	if !isStr(b[0]) {
		return nil, b, false, nil
	}
	s, rest, err := msgp.ReadStringZC(b)
	if err != nil {
		return nil, b, false, err
	}
	return s, rest, true, nil
}

// readNumber reads ts: a float64, a float32 or an integer.
func readNumber(b []byte) (float64, []byte, bool, error) {
	if len(b) == 0 {
		return 0, b, false, msgp.ErrShortBytes
	}
	switch b[0] {
	case 0xcb:
		f, rest, err := msgp.ReadFloat64Bytes(b)
		return f, rest, err == nil, err
	case 0xca:
		f, rest, err := msgp.ReadFloat32Bytes(b)
		return float64(f), rest, err == nil, err
	}
	v, neg, rest, ok, err := readInt(b)
	if !ok || err != nil {
		return 0, b, false, err
	}
	if neg {
		return float64(int64(v)), rest, true, nil
	}
	return float64(v), rest, true, nil
}

// evType is the type tag of a wire event.
type evType uint8

const (
	evNone    evType = iota // no tag read (yet)
	evUnknown               // a tag naming no type this package knows
	evStored
	evRemoved
	evCleared
)

func parseType(tag []byte) evType {
	switch string(tag) {
	case "BlockStored":
		return evStored
	case "BlockRemoved":
		return evRemoved
	case "AllBlocksCleared":
		return evCleared
	}
	return evUnknown
}

// field names one field of a wire event, for the bad and present masks.
type field uint8

const (
	fIgnore    field = iota // any field this package does not read
	fHashes                 // block_hashes
	fParent                 // parent_block_hash
	fTokens                 // token_ids
	fBlockSize              // block_size
	fLoraID                 // lora_id (deprecated; only its presence is read)
	fMedium                 // medium
	fLoraName               // lora_name
	fExtraKeys              // extra_keys (opaque; only non-nil entries are counted)
	fGroup                  // group_idx
	fKind                   // kv_cache_spec_kind
	fLocality               // locality: LOCAL or REMOTE, relative to the engine
)

func (f field) bit() uint16 { return 1 << f }

// Positional fields of the array encoding, after the tag, in the order of
// vLLM's BlockStored and BlockRemoved (vllm/distributed/kv_events.py):
// kv_cache_spec_sliding_window is not read; locality follows it in a store
// and group_idx in a remove. Positions past the end of a table (ownership,
// and whatever comes next) are ignored.
var (
	storedFields  = [...]field{fHashes, fParent, fTokens, fBlockSize, fLoraID, fMedium, fLoraName, fExtraKeys, fGroup, fKind, fIgnore, fLocality}
	removedFields = [...]field{fHashes, fMedium, fGroup, fLocality}
)

func positional(t evType, i int) field {
	switch t {
	case evStored:
		if i < len(storedFields) {
			return storedFields[i]
		}
	case evRemoved:
		if i < len(removedFields) {
			return removedFields[i]
		}
	}
	return fIgnore
}

func keyField(k []byte) field {
	switch string(k) {
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoraID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoraName
	case "extra_keys", "mm_keys", "block_mm_infos":
		// TensorRT-LLM's KV cache manager V2 writes each block's
		// multimodal keys as mm_keys, Dynamo's TensorRT-LLM relay as
		// block_mm_infos: both one entry a block, as vLLM's extra_keys.
		return fExtraKeys
	case "group_idx":
		return fGroup
	case "kv_cache_spec_kind":
		return fKind
	case "locality":
		return fLocality
	}
	return fIgnore
}

// wireEvent is one engine event as read, before any rule is applied. Its
// slices are reused from event to event; the byte slices point into the
// payload.
type wireEvent struct {
	typ      evType
	badShape bool   // not an array or a map, or no string type tag
	bad      uint16 // field bits: a value of the wrong type or range
	present  uint16 // field bits: a non-nil value was read

	hashes    []uint64
	parent    uint64
	tokens    []uint32
	blockSize uint64
	medium    []byte
	loraName  []byte
	group     uint64
	kind      []byte
	locality  []byte
	// salted: an array store carried SGLang's request metadata where vLLM
	// writes lora_name. SGLang's BlockStoredWithMetadata (msgspec
	// array_like, python/sglang/srt/disaggregation/kv_events.py; read at
	// amdpilot-org/sglang a029c210, whose review calls that wire shape
	// unchanged from its sglang base) is [tag, block_hashes,
	// parent_block_hash, token_ids, block_size, lora_id, medium,
	// {"cache_salt": salt}]. The engine's block hashes cover the salt, the
	// content hashes here do not: the blocks count in
	// Stats.ExtraKeyBlocks, as those with extra_keys do.
	salted bool
	// extraKeys is extra_keys' per-block entries, read whole, after the
	// array header (nil when absent or not a list): which blocks carry
	// extra keys is only counted once the decoder knows how many blocks
	// it kept (see extraKeyBlocks).
	extraKeys []byte
	// mmToken is 1 + the index of token_ids' first str, 0 when none:
	// TensorRT-LLM writes a multimodal item's start as its digest in hex
	// among the integer tokens (kv_cache_events.py EventTokenId = int | str).
	// The block holding it, and every later one, cannot be hashed from
	// tokens (blocks drops them as ReasonMMToken).
	mmToken int
}

// reset empties e, keeping its slices' storage up to maxKeptBytes each.
func (e *wireEvent) reset() {
	*e = wireEvent{hashes: reuse(e.hashes), tokens: reuse(e.tokens)}
}

func (e *wireEvent) has(f field) bool { return e.present&f.bit() != 0 }

// maxBlockSize bounds block_size: anything larger is out of range.
const maxBlockSize = 1 << 24

// readEvent reads one event, in either encoding, into e.
func readEvent(b []byte, e *wireEvent) ([]byte, error) {
	e.reset()
	if len(b) == 0 {
		return b, msgp.ErrShortBytes
	}
	switch {
	case isArray(b[0]):
		n, rest, err := arrayHeader(b)
		if err != nil {
			return b, err
		}
		b = rest
		if n == 0 {
			e.badShape = true
			return b, nil
		}
		tag, rest, ok, err := readStr(b)
		if err != nil {
			return b, err
		}
		if !ok {
			e.badShape = true
			return skipN(b, n)
		}
		b = rest
		e.typ = parseType(tag)
		for i := 1; i < n; i++ {
			f := positional(e.typ, i-1)
			if f == fLoraName && len(b) > 0 && isMap(b[0]) {
				// SGLang's BlockStoredWithMetadata: its metadata, a map
				// ({"cache_salt": ...}), where vLLM writes lora_name
				// (salted).
				e.salted = true
				if b, err = msgp.Skip(b); err != nil {
					return b, err
				}
				continue
			}
			if b, err = readField(b, f, e); err != nil {
				return b, err
			}
		}
		return b, nil

	case isMap(b[0]):
		n, rest, err := mapHeader(b)
		if err != nil {
			return b, err
		}
		b = rest
		for i := 0; i < n; i++ {
			key, rest, ok, err := readStr(b)
			if err != nil {
				return b, err
			}
			if !ok { // a key that is not a string is an unknown key
				if b, err = skipN(b, 2); err != nil {
					return b, err
				}
				continue
			}
			b = rest
			if string(key) == "type" {
				tag, rest, ok, err := readStr(b)
				if err != nil {
					return b, err
				}
				if !ok {
					e.badShape = true
					if b, err = msgp.Skip(b); err != nil {
						return b, err
					}
					continue
				}
				b = rest
				e.typ = parseType(tag)
				continue
			}
			if b, err = readField(b, keyField(key), e); err != nil {
				return b, err
			}
		}
		if e.typ == evNone {
			e.badShape = true
		}
		return b, nil
	}
	e.badShape = true
	return msgp.Skip(b)
}

// readField reads the value of field f into e. A nil value leaves the field
// absent; a value of the wrong type is skipped and marks the field bad.
func readField(b []byte, f field, e *wireEvent) ([]byte, error) {
	if len(b) == 0 {
		return b, msgp.ErrShortBytes
	}
	if b[0] == mnil {
		return b[1:], nil
	}
	var (
		rest []byte
		ok   bool
		err  error
	)
	switch f {
	case fIgnore:
		return msgp.Skip(b)
	case fLoraID:
		e.present |= f.bit()
		return msgp.Skip(b)
	case fExtraKeys:
		return readExtraKeys(b, e)
	case fHashes:
		return readHashes(b, e)
	case fTokens:
		return readTokens(b, e)
	case fParent:
		e.parent, rest, ok, err = readHash(b)
	case fBlockSize:
		// Any size is read: one unlike the registered size drops the
		// event's blocks as a block-size mismatch (counted where an
		// operator looks for a worker registered wrong), not as a bad
		// field. 0 is vLLM's "unknown", which the decoder reads as no
		// size or a bad field depending on the tokens (convert).
		e.blockSize, rest, ok, err = readUint(b, math.MaxUint64)
	case fGroup:
		e.group, rest, ok, err = readUint(b, math.MaxInt64)
	case fMedium:
		e.medium, rest, ok, err = readStr(b)
	case fLoraName:
		e.loraName, rest, ok, err = readStr(b)
	case fKind:
		e.kind, rest, ok, err = readStr(b)
	case fLocality:
		e.locality, rest, ok, err = readStr(b)
	default:
		panic(fmt.Sprintf("engine: unhandled field %d", f))
	}
	if err != nil {
		return b, err
	}
	if !ok {
		e.bad |= f.bit()
		return msgp.Skip(b)
	}
	e.present |= f.bit()
	return rest, nil
}

// readHashes reads block_hashes: an array of hashes.
func readHashes(b []byte, e *wireEvent) ([]byte, error) {
	e.hashes = e.hashes[:0]
	if !isArray(b[0]) {
		e.bad |= fHashes.bit()
		return msgp.Skip(b)
	}
	n, b, err := arrayHeader(b)
	if err != nil {
		return b, err
	}
	// Sized once: arrayHeader checked n against the bytes left, and a hash
	// takes at least one, so the storage is at most 8 bytes a payload byte
	// (grown by append, it cost several times its final size). The kept
	// storage serves when it is large enough.
	hs := e.hashes[:0]
	if cap(hs) < n {
		hs = make([]uint64, 0, n)
	}
	for i := 0; i < n; i++ {
		h, rest, ok, err := readHash(b)
		if err != nil {
			e.hashes = hs[:0]
			return b, err
		}
		if !ok {
			e.hashes = hs[:0]
			e.bad |= fHashes.bit()
			return skipN(b, n-i)
		}
		hs = append(hs, h)
		b = rest
	}
	e.hashes = hs
	e.present |= fHashes.bit()
	return b, nil
}

// readTokens reads token_ids: an array of integers in [0, 2^32), or of token
// pairs (readTokenPairs). This is the hottest loop of the package (16 or more
// values per block), so the encodings a real vocabulary uses are decoded
// inline and the rest go through readUint. Whether they are pairs is told
// once, by the first value.
func readTokens(b []byte, e *wireEvent) ([]byte, error) {
	if !isArray(b[0]) {
		e.tokens = e.tokens[:0]
		e.bad |= fTokens.bit()
		return msgp.Skip(b)
	}
	n, b, err := arrayHeader(b)
	if err != nil {
		return b, err
	}
	toks := e.tokens[:0]
	if cap(toks) < n {
		toks = make([]uint32, 0, n)
	}
	toks = toks[:n]
	if n > 0 && isArray(b[0]) {
		return readTokenPairs(b, toks, e)
	}
	for i := range toks {
		// With 5 bytes left, the common encodings need no further length check.
		if len(b) >= 5 {
			switch c := b[0]; {
			case c <= 0x7f:
				toks[i] = uint32(c)
				b = b[1:]
				continue
			case c == 0xce:
				toks[i] = binary.BigEndian.Uint32(b[1:5])
				b = b[5:]
				continue
			case c == 0xcd:
				toks[i] = uint32(b[1])<<8 | uint32(b[2])
				b = b[3:]
				continue
			}
		}
		if len(b) > 0 && isStr(b[0]) { // a multimodal digest (mmToken)
			if e.mmToken == 0 {
				e.mmToken = i + 1
			}
			if b, err = msgp.Skip(b); err != nil {
				e.tokens = toks[:0]
				return b, err
			}
			toks[i] = 0
			continue
		}
		v, rest, ok, err := readUint(b, math.MaxUint32)
		if err != nil {
			e.tokens = toks[:0]
			return b, err
		}
		if !ok {
			e.tokens = toks[:0]
			e.bad |= fTokens.bit()
			return skipN(b, n-i)
		}
		toks[i] = uint32(v)
		b = rest
	}
	e.tokens = toks
	e.present |= fTokens.bit()
	return b, nil
}

// readTokenPairs reads the len(toks) values of a token_ids array whose first
// value is an array. SGLang with EAGLE speculative decoding keys its radix
// tree by token bigrams, and its event recorder publishes each page's tokens
// as the pairs (t[j], t[j+1]), one per token of the page, block_size counting
// the pairs (sgl-project/sglang python/sglang/srt/mem_cache/events.py,
// KVCacheEventRecorder.record_store; msgspec writes a pair as a 2-element
// array). A pair's first element is the page's token: toks gets the first
// elements, so the blocks hash as a plain request's for the same prompt.
// Upstream builds the pairs from one token sequence, and a node's key shares
// its first token with its parent's last (a store it coalesces into the one
// before continues that store's chain), so each pair's second element is the
// next pair's first. A value that is not a 2-element array of tokens, or a
// pair that breaks that chain, makes token_ids a bad field, as a mix of pairs
// and integers does.
func readTokenPairs(b []byte, toks []uint32, e *wireEvent) ([]byte, error) {
	var next uint64
	for i := range toks {
		if len(b) == 0 {
			e.tokens = toks[:0]
			return b, msgp.ErrShortBytes
		}
		pair := b
		ok := isArray(b[0])
		var m int
		var err error
		if ok {
			if m, b, err = arrayHeader(b); err != nil {
				e.tokens = toks[:0]
				return b, err
			}
			ok = m == 2
		}
		var first, second uint64
		if ok {
			first, b, ok, err = readUint(b, math.MaxUint32)
		}
		if ok {
			second, b, ok, err = readUint(b, math.MaxUint32)
		}
		if err != nil {
			e.tokens = toks[:0]
			return b, err
		}
		if !ok || (i > 0 && first != next) {
			e.tokens = toks[:0]
			e.bad |= fTokens.bit()
			return skipN(pair, len(toks)-i)
		}
		toks[i] = uint32(first)
		next = second
	}
	e.tokens = toks
	e.present |= fTokens.bit()
	return b, nil
}

// readExtraKeys reads extra_keys without interpreting it: a list of one entry
// per block, each nil or a list (multimodal ids, LoRA name, cache salt). Only
// the non-nil entries are counted (extraKeyBlocks); any other shape is
// skipped as opaque.
func readExtraKeys(b []byte, e *wireEvent) ([]byte, error) {
	if !isArray(b[0]) {
		return msgp.Skip(b)
	}
	n, b, err := arrayHeader(b)
	if err != nil {
		return b, err
	}
	entries := b
	for i := 0; i < n; i++ {
		if b, err = msgp.Skip(b); err != nil {
			return b, err
		}
	}
	e.extraKeys = entries[:len(entries)-len(b)]
	return b, nil
}

// extraKeyBlocks counts the blocks, among the first n, whose engine hash
// covers an extra key: from the first block whose entry holds one on,
// since each block's engine hash chains its parent's (vLLM puts a cache
// salt on block 0 only, and every later block's hash covers it). An entry
// holds one unless it is nil, empty, or only the event's lora_name (the
// content hashes are seeded by it: a route under the same adapter finds
// them). Only the kept blocks count, not those a store lost. A store that
// continues a chain whose salted or multimodal block was in an earlier
// event is not counted: the decoder keeps no such state across events.
func (e *wireEvent) extraKeyBlocks(n int) int {
	b := e.extraKeys
	for i := 0; i < n && len(b) > 0; i++ {
		entry := b
		var err error
		if b, err = msgp.Skip(b); err != nil {
			break // cannot happen: readExtraKeys skipped the same entries
		}
		if e.holdsExtraKey(entry[:len(entry)-len(b)]) {
			return n - i
		}
	}
	return 0
}

// holdsExtraKey reports whether one block's extra_keys entry holds a key
// its content hash does not cover (extraKeyBlocks).
func (e *wireEvent) holdsExtraKey(entry []byte) bool {
	switch {
	case entry[0] == mnil:
		return false
	case isArray(entry[0]):
		n, rest, err := arrayHeader(entry)
		if err != nil || n == 0 {
			return err != nil
		}
		if n == 1 && e.has(fLoraName) && len(e.loraName) > 0 {
			s, _, ok, err := readStr(rest)
			return err != nil || !ok || string(s) != string(e.loraName)
		}
	case isMap(entry[0]):
		n, _, err := mapHeader(entry)
		return err != nil || n > 0
	}
	return true
}
