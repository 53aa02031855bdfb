package api

import (
	"bytes"
	"math"
	"net/http"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/internal/jsonscan"
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
// arrays before it decodes them. An array grown by appending allocates
// about five times its final size on the way (Go grows a large slice by
// a quarter), which made a body of 1 MiB of block hashes ("0,") allocate
// 21 MB; sized first, it allocates its final size (4 MB) once. Below
// this a body is decoded without the extra pass over it: whatever it
// holds, it stays within its decode budget.
const routePresizeFrom = 256 << 10

func decodeRouteBody(b []byte, req *RouteRequest) error {
	hashes, tokens := req.BlockHashes[:0], req.TokenIDs[:0]
	n := 0
	if len(b) >= routePresizeFrom {
		// token_ids and block_hashes are the body's only arrays: n is
		// their elements, and the one the body names is sized for them.
		n = jsonscan.Elements(b)[2]
		hasTokens := bytes.Contains(b, []byte(`"token_ids"`))
		hasHashes := bytes.Contains(b, []byte(`"block_hashes"`))
		if !hasTokens && !hasHashes {
			// A key written with escapes: which array is not known, and
			// encoding/json grows it as it goes. No client writes one;
			// it is held to the budget instead.
			if err := checkDecodeBudget(b, &routeGrownCosts); err != nil {
				return err
			}
		}
		if hasHashes {
			hashes = slices.Grow(hashes, n)
		}
		if hasTokens {
			tokens = slices.Grow(tokens, n)
		}
	}
	*req = RouteRequest{BlockHashes: hashes, TokenIDs: tokens}
	if fastRouteRequest(b, req) {
		return nil
	}
	*req = RouteRequest{}
	if n > 0 {
		// encoding/json decodes into the capacity a slice has.
		req.BlockHashes, req.TokenIDs = hashes[:0], tokens[:0]
	}
	return decodeJSONBytes(b, req, false)
}

// fastRouteRequest parses b into req and reports whether it could; when it
// returns false req holds garbage and the caller decodes b again. The
// arrays are appended to req's (empty) slices, so that a caller can reuse
// them; a key absent from b leaves its slice as it was (empty, which the
// API treats as absent, like nil).
func fastRouteRequest(b []byte, req *RouteRequest) bool {
	p := jsonscan.New(b)
	return p.Object(func(key string) bool {
		ok := false
		switch key {
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
