package api

import (
	"bytes"
	"io"
	"math"
	"net/http"
	"sync"

	"github.com/kvrouter/kvrouter/internal/jsonscan"
)

// The route request is the API's hot path, and encoding/json spends most of
// its time there scanning the prompt's numbers twice (once to find the
// value's end, once to convert it). decodeRouteRequest reads the common
// shape of a route body in one pass: a flat object of the known keys whose
// strings have no escapes. Anything else (escapes, overrides, unknown keys,
// numbers out of range, bad syntax) goes to encoding/json with the same
// bytes, so every error answer and every corner of JSON stays exactly what
// decodeJSON gives. FuzzRouteRequestFastPath checks that the fast path
// agrees with encoding/json on every body it accepts.

var routeBodyPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// decodeRouteRequest decodes a POST /v1/route body into req.
func decodeRouteRequest(r *http.Request, req *RouteRequest) error {
	buf := routeBodyPool.Get().(*bytes.Buffer)
	buf.Reset()
	defer func() {
		if buf.Cap() <= 1<<20 { // a huge body's buffer is not kept
			routeBodyPool.Put(buf)
		}
	}()
	if _, err := buf.ReadFrom(r.Body); err != nil {
		return jsonError(err)
	}
	if fastRouteRequest(buf.Bytes(), req) {
		return nil
	}
	*req = RouteRequest{}
	r.Body = io.NopCloser(bytes.NewReader(buf.Bytes()))
	return decodeJSON(r, req, false)
}

// fastRouteRequest parses b into req and reports whether it could; when it
// returns false req holds garbage and the caller decodes b again.
func fastRouteRequest(b []byte, req *RouteRequest) bool {
	p := jsonscan.New(b)
	return p.Object(func(key string) bool {
		ok := false
		switch key {
		case "block_hashes":
			req.BlockHashes, ok = p.Uints(req.BlockHashes[:0], math.MaxUint64)
		case "token_ids":
			var v []uint64
			v, ok = p.Uints(nil, math.MaxUint32)
			if ok && v != nil {
				req.TokenIDs = make([]uint32, len(v))
				for i, x := range v {
					req.TokenIDs[i] = uint32(x)
				}
			}
		case "isl":
			var v uint64
			v, ok = p.Uint(math.MaxInt)
			req.ISL = int(v)
		case "lora_name":
			req.LoRAName, ok = p.Text()
		case "cache_salt":
			req.CacheSalt, ok = p.Text()
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
