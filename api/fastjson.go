package api

import (
	"bytes"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"

	"github.com/kvrouter/kvrouter/internal/jsonscan"
	"github.com/kvrouter/kvrouter/internal/strictkeys"
)

// The route request is the API's hot path, and encoding/json spends most of
// its time there scanning the prompt's numbers twice (once to find the
// value's end, once to convert it). decodeRouteRequest reads the common
// shape of a route body in one pass: a flat object of the known keys,
// each written exactly and once, whose strings have no escapes. Anything
// else (escapes, overrides, unknown keys, a key in another letter case or
// given twice, numbers out of range, bad syntax) goes to decodeJSON with
// the same bytes, so every error answer and every corner of JSON stays
// exactly what decodeJSON gives. FuzzRouteRequestFastPath checks that the
// fast path agrees with decodeJSON on every body it accepts.

var routeBodyPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// decodeRouteRequest decodes a POST /v1/route body into req. Slices that
// req holds on entry (emptied) are reused for the decoded ones.
func decodeRouteRequest(r *http.Request, req *RouteRequest) error {
	if rb, ok := r.Body.(*replayBody); ok {
		// The Server's own body: read into its kept bytes, which a forward
		// replays anyway; they stay valid until the handler returns.
		b, err := rb.readRest()
		if err != nil {
			return bodyError(err)
		}
		return decodeRouteBody(b, req)
	}
	buf := routeBodyPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer func() {
		if buf.Cap() <= 1<<20 { // a huge body's buffer is not kept
			routeBodyPool.Put(buf)
		}
	}()
	if _, err := buf.ReadFrom(r.Body); err != nil {
		return bodyError(err)
	}
	return decodeRouteBody(buf.Bytes(), req)
}

// routePresizeFrom is the body size from which decodeRouteBody sizes the
// arrays before it decodes them (routeArrays). An array grown by
// appending allocates about five times its final size on the way (Go
// grows a large slice by a quarter), which made a body of 1 MiB of block
// hashes ("0,") allocate 21 MB; sized first, it allocates its final size
// (4 MB) once. Below this a body is decoded without the extra pass over
// it: whatever it holds, it stays within its decode budget.
const routePresizeFrom = 256 << 10

func decodeRouteBody(b []byte, req *RouteRequest) error {
	hashes, tokens := req.BlockHashes[:0], req.TokenIDs[:0]
	if len(b) >= routePresizeFrom {
		// Each array is sized for its own elements, under the key
		// encoding/json takes for it (escapes undone, letter case
		// folded), not under any bytes that spell its name: a string
		// value "token_ids" is not the array, and "block\u005fhashes"
		// is. Both paths then fill what was sized, without growing it.
		h, t := routeArrays(b)
		if h.named > 1 || t.named > 1 {
			// An array given twice: encoding/json decodes each into the
			// slice so far, and one of [] or null in between drops its
			// room, so the last one grows as it goes. No client writes
			// one; it is held to the budget instead.
			if err := checkDecodeBudget(b, &routeGrownCosts); err != nil {
				return err
			}
		}
		hashes = slices.Grow(hashes, h.elems)
		tokens = slices.Grow(tokens, t.elems)
	}
	*req = RouteRequest{BlockHashes: hashes, TokenIDs: tokens}
	if fastRouteRequest(b, req) {
		return nil
	}
	*req = RouteRequest{}
	if len(b) >= routePresizeFrom {
		// encoding/json decodes into the capacity a slice has.
		req.BlockHashes, req.TokenIDs = hashes[:0], tokens[:0]
	}
	return decodeJSONBytes(b, req, false)
}

// routeArray is what a route body holds of one of its arrays: how many
// of its top-level keys name it, and the elements of those that are
// arrays.
type routeArray struct{ named, elems int }

// routeArrays reads the top-level keys of b, a route body, as
// encoding/json matches them to RouteRequest's fields, and counts what
// the body holds of block_hashes and token_ids. It reads b in one pass
// (jsonscan.Walker), allocating only for a key written with an escape,
// and does not check b's syntax: on bytes that are not JSON the counts
// are only some counts, and encoding/json, which reads the whole body
// before it decodes any of it, refuses them.
func routeArrays(b []byte) (hashes, tokens routeArray) {
	var in *routeArray // the array field whose value is being read, if any
	w := jsonscan.NewWalker(b, 1)
	for w.Next() {
		switch {
		case w.Kind == jsonscan.Key && w.Depth == 1:
			// A key of the top-level object; its value follows, up to
			// the next key.
			if in = routeArrayNamed(w.Key, w.Esc, &hashes, &tokens); in != nil {
				in.named++
			}
		case w.Kind == jsonscan.Elems && w.Depth == 2 && in != nil:
			// Elements two deep are those of an array that is the value
			// of the key just read.
			in.elems += w.Count
		}
	}
	return hashes, tokens
}

// routeArrayNamed returns which of hashes and tokens a top-level key
// names, raw (between its quotes, with an escape if esc), as
// encoding/json takes a key for a field: its text equal to the field's
// name, or equal but for Unicode's case folding; nil for any other key.
func routeArrayNamed(raw []byte, esc bool, hashes, tokens *routeArray) *routeArray {
	var k string
	if esc {
		var err error
		if k, err = strictkeys.Unescape(raw); err != nil {
			return nil // not JSON: encoding/json refuses the body
		}
	} else if len(raw) > 3*len("block_hashes") {
		return nil // too long for either name, each letter folded to 3 bytes (U+212A for k)
	} else {
		k = string(raw) // no allocation: only compared
	}
	switch {
	case strings.EqualFold(k, "block_hashes"):
		return hashes
	case strings.EqualFold(k, "token_ids"):
		return tokens
	}
	return nil
}

// fastRouteRequest parses b into req and reports whether it could; when it
// returns false req holds garbage and the caller decodes b again. The
// arrays are appended to req's (empty) slices, so that a caller can reuse
// them; a key absent from b leaves its slice as it was (empty, which the
// API treats as absent, like nil).
func fastRouteRequest(b []byte, req *RouteRequest) bool {
	p := jsonscan.New(b)
	return p.Object(func(key []byte) bool {
		ok := false
		switch string(key) { // no allocation: only compared
		case "block_hashes":
			req.BlockHashes, ok = p.Uints(req.BlockHashes[:0], math.MaxUint64)
		case "token_ids":
			req.TokenIDs, ok = p.Uint32s(req.TokenIDs[:0])
		case "isl":
			var v uint64
			v, ok = p.Uint(math.MaxInt)
			req.ISL = int(v)
		case "lora_name":
			req.LoRAName, ok = p.Text()
		case "cache_salt":
			req.CacheSalt, ok = p.Text()
		case "model":
			req.Model, ok = p.Text()
		case "book":
			req.Book, ok = p.Bool()
		case "request_id":
			req.RequestID, ok = p.Text()
		case "brief":
			req.Brief, ok = p.Bool()
		default: // overrides, unknown keys: encoding/json
			return false
		}
		return ok
	})
}
