package raftfsm

import (
	"encoding/binary"
	"fmt"
	"math"
)

// enc appends a compact binary encoding: unsigned varints for integers,
// length-prefixed bytes. It never fails.
type enc struct{ b []byte }

func (e *enc) u8(v uint8)    { e.b = append(e.b, v) }
func (e *enc) uv(v uint64)   { e.b = binary.AppendUvarint(e.b, v) }
func (e *enc) sv(v int64)    { e.b = binary.AppendVarint(e.b, v) }
func (e *enc) u64(v uint64)  { e.b = binary.LittleEndian.AppendUint64(e.b, v) }
func (e *enc) f64(v float64) { e.u64(math.Float64bits(v)) }
func (e *enc) str(s string)  { e.uv(uint64(len(s))); e.b = append(e.b, s...) }
func (e *enc) bool(v bool) {
	if v {
		e.u8(1)
	} else {
		e.u8(0)
	}
}

// dec reads what enc wrote. The first error sticks; every read after it
// returns zero values, so decoders read straight through and check err once.
// Lengths are checked against the bytes left before anything is allocated.
type dec struct {
	b   []byte
	off int
	err error
}

func (d *dec) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated or invalid %s at byte %d", ErrBadCommand, what, d.off)
	}
}

func (d *dec) u8(what string) uint8 {
	if d.err != nil || d.off >= len(d.b) {
		d.fail(what)
		return 0
	}
	v := d.b[d.off]
	d.off++
	return v
}

func (d *dec) uv(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b[d.off:])
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.off += n
	return v
}

func (d *dec) sv(what string) int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b[d.off:])
	if n <= 0 {
		d.fail(what)
		return 0
	}
	d.off += n
	return v
}

func (d *dec) u64(what string) uint64 {
	if d.err != nil || len(d.b)-d.off < 8 {
		d.fail(what)
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b[d.off:])
	d.off += 8
	return v
}

func (d *dec) f64(what string) float64 { return math.Float64frombits(d.u64(what)) }

func (d *dec) bool(what string) bool {
	switch d.u8(what) {
	case 0:
		return false
	case 1:
		return true
	}
	d.fail(what)
	return false
}

// count reads a length and checks that at least min bytes per element remain.
func (d *dec) count(what string, min int) int {
	n := d.uv(what)
	if d.err != nil {
		return 0
	}
	if min < 1 {
		min = 1
	}
	if n > uint64(len(d.b)-d.off)/uint64(min) {
		d.fail(what + " count")
		return 0
	}
	return int(n)
}

func (d *dec) bytes(what string) []byte {
	n := d.count(what, 1)
	if d.err != nil {
		return nil
	}
	p := d.b[d.off : d.off+n]
	d.off += n
	return p
}

func (d *dec) str(what string) string { return string(d.bytes(what)) }

// maxKeyID is the longest id that becomes part of a state database key
// (request and member ids; the API allows 256 bytes). The state
// database's group handles hold a key's length in 16 bits, and a longer
// id would be a command no API sends: it is refused as malformed.
const maxKeyID = 4096

// maxRecordKey is the longest state database key a snapshot record may
// carry: a kind byte and an id. The fixed-layout keys are shorter, and
// the state database's group commits hold keys of at most 65535 bytes.
const maxRecordKey = 1 + maxKeyID

// id reads an id that keys a state database record (see maxKeyID).
func (d *dec) id(what string) string { return string(d.idBytes(what)) }

// idBytes is id without the copy: a slice of the data.
func (d *dec) idBytes(what string) []byte {
	b := d.bytes(what)
	if d.err == nil && len(b) > maxKeyID {
		d.err = fmt.Errorf("%w: %s of %d bytes (at most %d)", ErrBadCommand, what, len(b), maxKeyID)
		return nil
	}
	return b
}

func (d *dec) done() error {
	if d.err == nil && d.off != len(d.b) {
		d.err = fmt.Errorf("%w: %d trailing bytes", ErrBadCommand, len(d.b)-d.off)
	}
	return d.err
}
