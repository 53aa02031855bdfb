// Package jsonscan reads the common shapes of hot-path JSON request bodies
// (flat objects of known keys, arrays of integers, strings without escapes)
// in one pass, with no reflection. It handles a subset of JSON on purpose:
// whatever it does not handle it reports, and the caller decodes that body
// with encoding/json instead, so every error and corner case stays
// encoding/json's. The callers' fuzz tests check that on every body the
// scanner accepts, it agrees with encoding/json.
//
// A Walker reads the structure of any body, JSON or not, in one pass
// without allocating: its objects' keys and its arrays' elements by
// depth, which size what decoding the body will take before it is
// decoded (Elements; the API's route bodies). It reads each byte a
// bounded number of times however the body nests.
package jsonscan

import (
	"bytes"
	"math"
	"math/bits"
)

// Scanner reads JSON tokens from a body; every method reports false on
// anything it does not handle, and the caller then decodes the body with
// encoding/json.
type Scanner struct {
	b []byte
	i int
}

// New returns a Scanner of b.
func New(b []byte) *Scanner { return &Scanner{b: b} }

// WS skips whitespace.
func (p *Scanner) WS() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// Lit consumes byte c if it comes next.
func (p *Scanner) Lit(c byte) bool {
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// End reports whether only whitespace is left.
func (p *Scanner) End() bool {
	p.WS()
	return p.i == len(p.b)
}

// Str reads a string without escapes, control or non-ASCII bytes; the
// result aliases the body.
func (p *Scanner) Str() ([]byte, bool) {
	if !p.Lit('"') {
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

// Uint reads a non-negative integer no larger than limit, in JSON's
// syntax (no leading zeros, no fraction or exponent).
func (p *Scanner) Uint(limit uint64) (uint64, bool) {
	b, start := p.b, p.i
	i := start
	var v uint64
	// Up to 19 digits cannot overflow a uint64 (10^19 - 1 < 2^64).
	for end := min(len(b), start+19); i < end; i++ {
		d := b[i] - '0'
		if d > 9 {
			break
		}
		v = v*10 + uint64(d)
	}
	if i < len(b) && b[i]-'0' <= 9 {
		// A 20th digit: it may overflow; a 21st always does.
		hi, lo := bits.Mul64(v, 10)
		lo, carry := bits.Add64(lo, uint64(b[i]-'0'), 0)
		if hi != 0 || carry != 0 {
			return 0, false
		}
		v = lo
		i++
		if i < len(b) && b[i]-'0' <= 9 {
			return 0, false
		}
	}
	n := i - start
	if n == 0 || (n > 1 && b[start] == '0') || v > limit {
		return 0, false
	}
	if i < len(b) {
		switch b[i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	p.i = i
	return v, true
}

// array appends the elements of a JSON array of numbers to dst, each read
// by elem; null gives nil, [] an empty non-nil slice (as encoding/json).
// When dst runs out of room it is grown once for as many elements as the
// rest of the array can hold (room): grown by append, a quarter at a time
// once large, it cost five times its final size, past the 16 bytes a
// body byte a caller's budget allows (compat's /query_by_hash). A dst with
// room enough (a caller's reused or presized slice) is never counted.
func array[T any](p *Scanner, dst []T, elem func() (T, bool)) ([]T, bool) {
	if bytes.HasPrefix(p.b[p.i:], []byte("null")) {
		p.i += 4
		return nil, true
	}
	if !p.Lit('[') {
		return nil, false
	}
	if dst == nil {
		dst = []T{}
	}
	p.WS()
	if p.Lit(']') {
		return dst, true
	}
	for {
		if len(dst) == cap(dst) {
			// make and copy rather than slices.Grow, whose append of
			// room zero elements allocates them apart under the race
			// detector: one allocation of that capacity either way.
			g := make([]T, len(dst), len(dst)+p.room())
			copy(g, dst)
			dst = g
		}
		v, ok := elem()
		if !ok {
			return nil, false
		}
		dst = append(dst, v)
		p.WS()
		if p.Lit(']') {
			return dst, true
		}
		if !p.Lit(',') {
			return nil, false
		}
		p.WS()
	}
}

// room is the most elements the rest of an array of numbers holds, read
// at one of its elements: one more than the commas before the first ']',
// and no more than its bytes fit at a digit and a comma each. On bytes
// that are not such an array it is only some count, at most half of them.
func (p *Scanner) room() int {
	b := p.b[p.i:]
	if end := bytes.IndexByte(b, ']'); end >= 0 {
		b = b[:end]
	}
	return min(bytes.Count(b, []byte{','})+1, len(b)/2+1)
}

// Uints appends an array of non-negative integers no larger than limit to
// dst; null gives nil, [] an empty non-nil slice (as encoding/json).
func (p *Scanner) Uints(dst []uint64, limit uint64) ([]uint64, bool) {
	return array(p, dst, func() (uint64, bool) { return p.Uint(limit) })
}

// Uint32s appends an array of integers in [0, 2^32) to dst, as Uints.
func (p *Scanner) Uint32s(dst []uint32) ([]uint32, bool) {
	return array(p, dst, func() (uint32, bool) {
		v, ok := p.Uint(math.MaxUint32)
		return uint32(v), ok
	})
}

// Int64s appends an array of 64-bit integers, signed or unsigned (what
// fits an int64 or a uint64), as their 64-bit patterns, as Uints.
func (p *Scanner) Int64s(dst []uint64) ([]uint64, bool) {
	return Int64sOf(p, dst)
}

// Int64sOf is Int64s into a slice of any type of 64-bit patterns, so
// that a caller decodes straight into its own type instead of copying.
func Int64sOf[T ~uint64](p *Scanner, dst []T) ([]T, bool) {
	return array(p, dst, func() (T, bool) {
		neg := p.Lit('-')
		limit := uint64(math.MaxUint64)
		if neg {
			limit = 1 << 63
		}
		v, ok := p.Uint(limit)
		if neg {
			v = -v
		}
		return T(v), ok
	})
}

// Bool reads true or false.
func (p *Scanner) Bool() (bool, bool) {
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

// Object reads a whole body that is one flat JSON object: for each key it
// calls value, which reads the key's value with the Scanner and reports
// whether it could. It reports false on anything else: a key value
// refuses (an unknown key), a key given twice (encoding/json keeps the
// last, and callers leave that to it), and trailing bytes after the object.
// The key is the bytes between its quotes, valid only during the call: a
// callback compares it (switch string(key), which does not allocate) and
// keeps a copy if it needs one. A string key would escape into the func
// value and cost one allocation per key of every body.
func (p *Scanner) Object(value func(key []byte) bool) bool {
	p.WS()
	if !p.Lit('{') {
		return false
	}
	p.WS()
	if p.Lit('}') {
		return p.End()
	}
	var seen [8][]byte // request bodies have a few keys; more go to encoding/json
	n := 0
	for {
		key, ok := p.Str()
		if !ok || n == len(seen) {
			return false
		}
		for _, k := range seen[:n] {
			if bytes.Equal(k, key) {
				return false
			}
		}
		seen[n] = key
		n++
		p.WS()
		if !p.Lit(':') {
			return false
		}
		p.WS()
		if !value(key) {
			return false
		}
		p.WS()
		if p.Lit('}') {
			return p.End()
		}
		if !p.Lit(',') {
			return false
		}
		p.WS()
	}
}

// Null consumes a null if it comes next.
func (p *Scanner) Null() bool {
	if bytes.HasPrefix(p.b[p.i:], []byte("null")) {
		p.i += 4
		return true
	}
	return false
}

// Text is Str as a Go string (a copy).
func (p *Scanner) Text() (string, bool) {
	b, ok := p.Str()
	return string(b), ok
}
