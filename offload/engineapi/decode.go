package engineapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"

	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
)

// decode reads exactly one JSON object of type T from body: anything but
// an object (null included), unknown fields, trailing data and type
// mismatches are ErrBadRequest, and a refusal returns a zero T. Field names
// must be spelled exactly as the API's (encoding/json alone would take
// "DP_Rank" for dp_rank), each at most once, and dp_rank is required where
// T has it: a forgotten field must not address rank 0; so is, in every
// object, each field tagged required:"true" (an offload block's g1_block,
// hash and local: left out, each would be 0, a G1 block or a content hash
// that names another block). A list of more than maxList items is
// refused before anything else (checkListLengths). encoding/json parses
// next: it refuses JSON nested past 10000 levels cheaply, where the key
// walk's Decoder.Token would stack every level.
func decode[T any](body []byte, maxList int) (T, error) {
	var v, zero T
	if err := checkListLengths(body, maxList); err != nil {
		return zero, fmt.Errorf("%w: %v; split the request", ErrBadRequest, err)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		return zero, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return zero, fmt.Errorf("%w: data after the JSON object", ErrBadRequest)
	}
	// Valid JSON, nested at most encoding/json's 10000 levels: walk it.
	if err := checkKeys(body, reflect.TypeFor[T]()); err != nil {
		return zero, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	return v, nil
}

// trackedDepth is how deep checkListLengths counts lists. The API's lists
// are top-level fields (depth 1); a list deeper than this is one no
// request type has, which encoding/json refuses without decoding its items.
const trackedDepth = 64

// checkListLengths refuses a body in which a JSON array has more than most
// items, before anything is decoded: decoding costs some 90 bytes
// allocated per byte of a list of small numbers (the values, the slices'
// growth, the key walk's tokens), so a request's count limits, checked
// only on the decoded request, would let one body of MaxBodyBytes cost
// gigabytes first. It allocates nothing: one pass over the bytes, counting
// the commas of each open array outside strings. It does not validate the
// JSON (encoding/json does, next); on malformed JSON it may refuse or pass
// a body that is refused anyway.
func checkListLengths(body []byte, most int) error {
	var commas [trackedDepth]int // per open container: commas so far; -1: an object
	depth := 0
	inString, escaped := false, false
	for _, c := range body {
		switch {
		case inString:
			switch {
			case escaped:
				escaped = false
			case c == '\\':
				escaped = true
			case c == '"':
				inString = false
			}
		case c == '"':
			inString = true
		case c == '[' || c == '{':
			if depth < trackedDepth {
				commas[depth] = 0
				if c == '{' {
					commas[depth] = -1
				}
			}
			depth++
		case c == ']' || c == '}':
			depth = max(depth-1, 0)
		case c == ',' && depth > 0 && depth <= trackedDepth && commas[depth-1] >= 0:
			// n commas: n+1 items, in JSON that encoding/json takes.
			if commas[depth-1]++; commas[depth-1] >= most {
				return fmt.Errorf("a list of more than %d items", most)
			}
		}
	}
	return nil
}

// checkBlock refuses a G1 block id outside a region of n blocks.
func checkBlock(what string, id, n int) error {
	if id < 0 || id >= n {
		return fmt.Errorf("%w: %s %d: the region has %d blocks", ErrBadRequest, what, id, n)
	}
	return nil
}

// check refuses the whole request if any block is bad for a region of n
// blocks, so that an Offload never applies in part.
func (q *OffloadRequest) rank() uint32 { return q.DPRank }

func (q *OffloadRequest) check(n int) error {
	// Each G1 block can be named once: a longer request is refused before
	// anything is sized by its length.
	if len(q.Blocks) > n {
		return fmt.Errorf("%w: %d blocks: the region has %d", ErrBadRequest, len(q.Blocks), n)
	}
	seen := make(map[int]bool, len(q.Blocks))
	for i, b := range q.Blocks {
		if err := checkBlock(fmt.Sprintf("blocks[%d]: g1_block", i), b.G1Block, n); err != nil {
			return err
		}
		if b.Hash == 0 {
			return fmt.Errorf("%w: blocks[%d]: hash 0", ErrBadRequest, i)
		}
		if b.Parent == b.Hash {
			return fmt.Errorf("%w: blocks[%d]: block %d is its own parent", ErrBadRequest, i, uint64(b.Hash))
		}
		if seen[b.G1Block] {
			return fmt.Errorf("%w: blocks[%d]: g1_block %d named twice", ErrBadRequest, i, b.G1Block)
		}
		seen[b.G1Block] = true
	}
	return nil
}

func (q *FreeRequest) rank() uint32 { return q.DPRank }

func (q *FreeRequest) check(n int) error {
	if most := max(n, MaxRequestBlocks); len(q.G1Blocks) > most {
		return fmt.Errorf("%w: %d g1_blocks: at most %d in one request (the region has %d blocks); split it",
			ErrBadRequest, len(q.G1Blocks), most, n)
	}
	for i, id := range q.G1Blocks {
		if err := checkBlock(fmt.Sprintf("g1_blocks[%d]", i), id, n); err != nil {
			return err
		}
	}
	return nil
}

// check refuses a lookup of more than MaxRequestBlocks hashes: the pools'
// locks are held across the whole lookup.
func (q *LookupRequest) check() error {
	if len(q.Hashes) > MaxRequestBlocks {
		return fmt.Errorf("%w: %d hashes: at most %d in one lookup; split it", ErrBadRequest, len(q.Hashes), MaxRequestBlocks)
	}
	return nil
}

func (q *OnboardRequest) rank() uint32 { return q.DPRank }

func (q *OnboardRequest) check(n int) error {
	if len(q.Hashes) != len(q.G1Blocks) {
		return fmt.Errorf("%w: %d hashes for %d g1_blocks", ErrBadRequest, len(q.Hashes), len(q.G1Blocks))
	}
	if q.TimeoutMs < 0 || q.TimeoutMs > MaxTimeoutMs {
		return fmt.Errorf("%w: timeout_ms %d (want 0..%d)", ErrBadRequest, q.TimeoutMs, MaxTimeoutMs)
	}
	// Each G1 block can be named once: a longer request is refused before
	// anything is sized by its length.
	if len(q.G1Blocks) > n {
		return fmt.Errorf("%w: %d g1_blocks: the region has %d", ErrBadRequest, len(q.G1Blocks), n)
	}
	seen := make(map[int]bool, len(q.G1Blocks))
	for i, id := range q.G1Blocks {
		if err := checkBlock(fmt.Sprintf("g1_blocks[%d]", i), id, n); err != nil {
			return err
		}
		if q.Hashes[i] == 0 {
			return fmt.Errorf("%w: hashes[%d]: hash 0", ErrBadRequest, i)
		}
		if seen[id] {
			return fmt.Errorf("%w: g1_blocks[%d]: block %d named twice", ErrBadRequest, i, id)
		}
		seen[id] = true
	}
	return nil
}

// check returns the handle and layout of a registration for a backend of
// kind, whose pools hold blocks of blockSize bytes, of at most maxBlocks
// blocks: the Manager's state is sized by num_blocks, and nothing else
// bounds it (a sparse shm file passes the mapping's length check).
func (q *RegisterRequest) check(kind backend.Kind, blockSize, maxBlocks int) (backend.IPCHandle, manager.Layout, error) {
	l := manager.Layout{BlockSize: q.BlockSizeBytes, Blocks: q.NumBlocks}
	if q.BlockSizeBytes != blockSize {
		return nil, l, fmt.Errorf("%w: block_size_bytes %d: the agent's pools hold blocks of %d bytes (--block-bytes)",
			ErrBadRequest, q.BlockSizeBytes, blockSize)
	}
	if err := l.Validate(); err != nil {
		return nil, l, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	if q.NumBlocks > maxBlocks {
		return nil, l, fmt.Errorf("%w: num_blocks %d: the agent takes regions of at most %d blocks (--offload-max-region-blocks)",
			ErrBadRequest, q.NumBlocks, maxBlocks)
	}
	switch {
	case len(q.IPCHandle) > 0 && q.ShmPath != "":
		return nil, l, fmt.Errorf("%w: both ipc_handle and shm_path", ErrBadRequest)
	case len(q.IPCHandle) > 0:
		return backend.IPCHandle(q.IPCHandle), l, nil
	case q.ShmPath == "":
		return nil, l, fmt.Errorf("%w: neither ipc_handle nor shm_path", ErrBadRequest)
	case kind != backend.KindHost:
		return nil, l, fmt.Errorf("%w: shm_path needs the host backend; this agent copies with %s (send ipc_handle)",
			ErrBadRequest, kind)
	case !filepath.IsAbs(q.ShmPath):
		return nil, l, fmt.Errorf("%w: shm_path %q is not absolute", ErrBadRequest, q.ShmPath)
	}
	return backend.IPCHandle(q.ShmPath), l, nil
}

// requiredKey is the field every request that has it must name.
const requiredKey = "dp_rank"

// fieldTypes maps a struct type to its fields' exact JSON names and types.
var fieldTypes sync.Map // reflect.Type → map[string]field

// field is one JSON field of a struct: its type, and whether every object
// decoded into the struct must name it (the tag required:"true").
type field struct {
	typ      reflect.Type
	required bool
}

func fieldsOf(t reflect.Type) map[string]field {
	if m, ok := fieldTypes.Load(t); ok {
		return m.(map[string]field)
	}
	m := map[string]field{}
	for f := range t.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if !f.IsExported() || name == "-" {
			continue
		}
		if name == "" {
			name = f.Name
		}
		m[name] = field{typ: f.Type, required: f.Tag.Get("required") == "true"}
	}
	fieldTypes.Store(t, m)
	return m
}

// checkKeys walks body's JSON along the shape of t: the top level must be
// an object; in every object decoded into a struct each key must be
// exactly one of its fields' JSON names, and appear once, and every
// required field must be named; the top level must name dp_rank when t has
// it. The values' types are left to
// encoding/json.
func checkKeys(body []byte, t reflect.Type) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber() // numbers are skipped, not parsed
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok != json.Delim('{') {
		return fmt.Errorf("the body is %v, not a JSON object", tok)
	}
	seen, err := checkObject(dec, t)
	if err != nil {
		return err
	}
	if _, has := fieldsOf(t)[requiredKey]; has && !seen[requiredKey] {
		return fmt.Errorf("%s is required", requiredKey)
	}
	return nil
}

// checkObject checks the keys of an object whose '{' was read, through its
// '}', and returns them.
func checkObject(dec *json.Decoder, t reflect.Type) (map[string]bool, error) {
	fields := fieldsOf(t)
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, _ := tok.(string)
		f, ok := fields[key]
		if !ok {
			return nil, fmt.Errorf("unknown field %q", key)
		}
		if seen[key] {
			return nil, fmt.Errorf("field %q given twice", key)
		}
		seen[key] = true
		if err := checkValue(dec, f.typ); err != nil {
			return nil, err
		}
	}
	if _, err := dec.Token(); err != nil { // '}'
		return nil, err
	}
	var missing []string
	for name, f := range fields {
		if f.required && !seen[name] {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing) // one message for one body
		return nil, fmt.Errorf("%s required in every %s", strings.Join(missing, ", "), t.Name())
	}
	return seen, nil
}

// checkValue checks the next value for a Go value of type t: objects for
// structs and arrays of them are walked, null is refused unless t is a
// list (or map, pointer, interface), where it is empty (encoding/json takes
// null for a number as 0: {"dp_rank":null} would address rank 0), and
// anything else is skipped.
func checkValue(dec *json.Decoder, t reflect.Type) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok == nil {
		switch t.Kind() {
		case reflect.Slice, reflect.Map, reflect.Pointer, reflect.Interface:
			return nil // empty
		}
		return fmt.Errorf("null where a %v is expected", t)
	}
	d, ok := tok.(json.Delim)
	if !ok {
		return nil // a scalar
	}
	switch {
	case d == '{' && t.Kind() == reflect.Struct:
		_, err := checkObject(dec, t)
		return err
	case d == '[' && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array):
		for dec.More() {
			if err := checkValue(dec, t.Elem()); err != nil {
				return err
			}
		}
		_, err := dec.Token() // ']'
		return err
	}
	// A value of another shape: encoding/json refuses it; skip it.
	for depth := 1; depth > 0; {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		if d, ok := tok.(json.Delim); ok {
			if d == '{' || d == '[' {
				depth++
			} else {
				depth--
			}
		}
	}
	return nil
}
