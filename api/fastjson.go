package api

import (
	"bytes"
	"io"
	"math"
	"net/http"
	"sync"
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
	p := fastParser{b: b}
	p.ws()
	if !p.lit('{') {
		return false
	}
	p.ws()
	if p.lit('}') {
		return p.end()
	}
	seen := 0 // a bit per key: a repeated key goes to encoding/json
	for {
		key, ok := p.str()
		if !ok {
			return false
		}
		p.ws()
		if !p.lit(':') {
			return false
		}
		p.ws()
		var bit int
		switch string(key) {
		case "block_hashes":
			bit = 1
			req.BlockHashes, ok = p.uints(req.BlockHashes[:0], math.MaxUint64)
		case "token_ids":
			bit = 2
			var v []uint64
			v, ok = p.uints(nil, math.MaxUint32)
			if ok && v != nil {
				req.TokenIDs = make([]uint32, len(v))
				for i, x := range v {
					req.TokenIDs[i] = uint32(x)
				}
			}
		case "isl":
			bit = 4
			var v uint64
			v, ok = p.uint(math.MaxInt)
			req.ISL = int(v)
		case "lora_name":
			bit = 8
			var s []byte
			s, ok = p.str()
			req.LoRAName = string(s)
		case "cache_salt":
			bit = 16
			var s []byte
			s, ok = p.str()
			req.CacheSalt = string(s)
		case "book":
			bit = 32
			req.Book, ok = p.boolean()
		case "request_id":
			bit = 64
			var s []byte
			s, ok = p.str()
			req.RequestID = string(s)
		case "brief":
			bit = 128
			req.Brief, ok = p.boolean()
		default: // overrides, unknown keys: encoding/json
			return false
		}
		if !ok || seen&bit != 0 {
			return false
		}
		seen |= bit
		p.ws()
		if p.lit('}') {
			return p.end()
		}
		if !p.lit(',') {
			return false
		}
		p.ws()
	}
}

// fastParser reads JSON tokens from b; every method reports false on
// anything it does not handle.
type fastParser struct {
	b []byte
	i int
}

func (p *fastParser) ws() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *fastParser) lit(c byte) bool {
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// end: only whitespace may follow the object.
func (p *fastParser) end() bool {
	p.ws()
	return p.i == len(p.b)
}

// str reads a string without escapes or control characters; the result
// aliases b.
func (p *fastParser) str() ([]byte, bool) {
	if !p.lit('"') {
		return nil, false
	}
	start := p.i
	for p.i < len(p.b) {
		c := p.b[p.i]
		switch {
		case c == '"':
			s := p.b[start:p.i]
			p.i++
			return s, true
		case c == '\\' || c < 0x20 || c >= 0x80:
			return nil, false // escapes, control and non-ASCII bytes: encoding/json
		}
		p.i++
	}
	return nil, false
}

// uint reads a non-negative integer no larger than limit, in JSON's
// syntax (no leading zeros, no fraction or exponent).
func (p *fastParser) uint(limit uint64) (uint64, bool) {
	start := p.i
	var v uint64
	for p.i < len(p.b) {
		c := p.b[p.i]
		if c < '0' || c > '9' {
			break
		}
		d := uint64(c - '0')
		if v > (limit-d)/10 {
			return 0, false
		}
		v = v*10 + d
		p.i++
	}
	n := p.i - start
	if n == 0 || (n > 1 && p.b[start] == '0') {
		return 0, false
	}
	if p.i < len(p.b) {
		switch p.b[p.i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	return v, true
}

// uints reads an array of non-negative integers (or null) into dst.
func (p *fastParser) uints(dst []uint64, limit uint64) ([]uint64, bool) {
	if bytes.HasPrefix(p.b[p.i:], []byte("null")) {
		p.i += 4
		return nil, true
	}
	if !p.lit('[') {
		return nil, false
	}
	if dst == nil {
		dst = []uint64{} // as encoding/json: [] is empty, not null
	}
	p.ws()
	if p.lit(']') {
		return dst, true
	}
	for {
		v, ok := p.uint(limit)
		if !ok {
			return nil, false
		}
		dst = append(dst, v)
		p.ws()
		if p.lit(']') {
			return dst, true
		}
		if !p.lit(',') {
			return nil, false
		}
		p.ws()
	}
}

func (p *fastParser) boolean() (bool, bool) {
	switch {
	case bytes.HasPrefix(p.b[p.i:], []byte("true")):
		p.i += 4
		return true, true
	case bytes.HasPrefix(p.b[p.i:], []byte("false")):
		p.i += 5
		return false, true
	}
	return false, false
}
