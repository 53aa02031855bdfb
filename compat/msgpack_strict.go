package compat

import (
	"bytes"
	"fmt"
	"math"
	"reflect"
	"strings"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The msgpack library converts any integer into an unsigned field by
// truncation: instance_id -1 became 2^64-1, dp_rank 2^32+3 registered rank
// 3, token ids wrapped. It converts an unsigned one past 2^63-1 into a
// signed field likewise: isl_tokens 2^63 became -2^63, block_size 2^64-1
// became -1, answered "is negative" of a positive number. JSON refuses
// such numbers; these decoders make msgpack refuse them too (a 400 that
// names the number sent). They are registered for the whole process, for
// every uint32, uint64, int, int32 and int64 the library decodes: this
// package is its only user here.
func init() {
	for _, c := range []struct {
		v        any
		min, max int64
	}{{int(0), math.MinInt, math.MaxInt}, {int64(0), math.MinInt64, math.MaxInt64}, {int32(0), math.MinInt32, math.MaxInt32}} {
		msgpack.Register(c.v, nil, func(d *msgpack.Decoder, v reflect.Value) error {
			i, err := decodeSigned(d, c.min, c.max)
			v.SetInt(i)
			return err
		})
	}
	msgpack.Register(uint64(0), nil, func(d *msgpack.Decoder, v reflect.Value) error {
		u, err := decodeUnsigned(d, math.MaxUint64)
		v.SetUint(u)
		return err
	})
	msgpack.Register(uint32(0), nil, func(d *msgpack.Decoder, v reflect.Value) error {
		u, err := decodeUnsigned(d, math.MaxUint32)
		v.SetUint(u)
		return err
	})
}

// decodeUnsigned reads an integer in [0, max], or nil as 0; a negative or
// larger integer, or anything else, is an error.
func decodeUnsigned(d *msgpack.Decoder, max uint64) (uint64, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	var u uint64
	switch {
	case c == msgpcode.Nil: // as JSON's null: the zero value
		return 0, d.DecodeNil()
	case c <= msgpcode.PosFixedNumHigh, c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		if u, err = d.DecodeUint64(); err != nil {
			return 0, err
		}
	case c >= msgpcode.NegFixedNumLow, c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		i, err := d.DecodeInt64()
		if err != nil {
			return 0, err
		}
		if i < 0 {
			return 0, fmt.Errorf("msgpack: %d where an unsigned integer belongs", i)
		}
		u = uint64(i)
	default:
		return 0, fmt.Errorf("msgpack: code %#x where an unsigned integer belongs", c)
	}
	if u > max {
		return 0, fmt.Errorf("msgpack: %d is out of range (at most %d)", u, max)
	}
	return u, nil
}

// decodeSigned reads an integer in [min, max], or nil as 0; a smaller or
// larger integer (an unsigned one past max among them), or anything else,
// is an error.
func decodeSigned(d *msgpack.Decoder, min, max int64) (int64, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	switch {
	case c == msgpcode.Nil: // as JSON's null: the zero value
		return 0, d.DecodeNil()
	case c <= msgpcode.PosFixedNumHigh, c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		u, err := d.DecodeUint64()
		if err != nil {
			return 0, err
		}
		if u > uint64(max) {
			return 0, fmt.Errorf("msgpack: %d is out of range (at most %d)", u, max)
		}
		return int64(u), nil
	case c >= msgpcode.NegFixedNumLow, c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		i, err := d.DecodeInt64()
		if err != nil {
			return 0, err
		}
		if i < min || i > max {
			return 0, fmt.Errorf("msgpack: %d is out of range [%d, %d]", i, min, max)
		}
		return i, nil
	}
	return 0, fmt.Errorf("msgpack: code %#x where an integer belongs", c)
}

// maxMsgpackDepth bounds the nesting of a MessagePack body's arrays and
// maps, as encoding/json bounds JSON's (10000 levels): the bodies that
// nest deeper are refused in either encoding.
const maxMsgpackDepth = 10000

// checkMsgpack refuses b unless it is one well-formed MessagePack value,
// and nothing after it (as encoding/json refuses a second JSON value),
// nested at most maxMsgpackDepth deep. The msgpack library must never see
// the others: it allocates an array's elements from the length its header
// declares before it reads one (its allocation limit is never applied, in
// v5.4.1), so that 13 bytes declaring 2^32-1 events ran the process out of
// memory; and it recurses once a level, so that a few megabytes of nested
// arrays overflowed the goroutine stack. Both are fatal errors, not panics
// a recover catches.
//
// The walk is one pass and does not recurse: left holds, for each open
// array or map, how many values it still holds (a map's keys and values
// both count), at the bottom one for the body itself. A declared length is
// checked against the bytes that remain before anything is skipped or
// opened: an array of n values needs n bytes more at least (every value
// takes one at least), a map of n entries 2n, a string, binary or
// extension of n bytes n. A walk that passes has seen every value, so no
// length the library allocates by is past the body's; what it allocates
// for them, a Go value per byte of nil at worst, checkMsgpackShape bounds.
func checkMsgpack(b []byte) error {
	left := []uint64{1}
	pos := 0
	for len(left) > 0 {
		if left[len(left)-1] == 0 {
			left = left[:len(left)-1]
			continue
		}
		left[len(left)-1]--
		if pos >= len(b) {
			return fmt.Errorf("the body ends inside a value (%d bytes)", len(b))
		}
		at, c := pos, b[pos]
		pos++
		// A value is its code, then a length of lenBytes bytes, then size
		// bytes (plus the length, when it counts bytes), or, for an array
		// or a map (container), n values: the length times perLen, 1 for
		// an array, 2 for a map.
		var lenBytes int
		var size, n, perLen uint64
		container, what := false, "a value"
		switch {
		case c <= msgpcode.PosFixedNumHigh, c >= msgpcode.NegFixedNumLow,
			c == msgpcode.Nil, c == msgpcode.False, c == msgpcode.True:
		case msgpcode.IsFixedMap(c):
			container, what, n = true, "a map", 2*uint64(c&msgpcode.FixedMapMask)
		case msgpcode.IsFixedArray(c):
			container, what, n = true, "an array", uint64(c&msgpcode.FixedArrayMask)
		case msgpcode.IsFixedString(c):
			what, size = "a string", uint64(c&msgpcode.FixedStrMask)
		case c == msgpcode.Uint8, c == msgpcode.Int8:
			size = 1
		case c == msgpcode.Uint16, c == msgpcode.Int16:
			size = 2
		case c == msgpcode.Uint32, c == msgpcode.Int32, c == msgpcode.Float:
			size = 4
		case c == msgpcode.Uint64, c == msgpcode.Int64, c == msgpcode.Double:
			size = 8
		case msgpcode.IsFixedExt(c): // a type byte, then 1, 2, 4, 8 or 16 bytes
			what, size = "an extension", 1+1<<(c-msgpcode.FixExt1)
		case c == msgpcode.Str8, c == msgpcode.Bin8:
			what, lenBytes = "a string or binary", 1
		case c == msgpcode.Str16, c == msgpcode.Bin16:
			what, lenBytes = "a string or binary", 2
		case c == msgpcode.Str32, c == msgpcode.Bin32:
			what, lenBytes = "a string or binary", 4
		case c == msgpcode.Ext8:
			what, lenBytes, size = "an extension", 1, 1
		case c == msgpcode.Ext16:
			what, lenBytes, size = "an extension", 2, 1
		case c == msgpcode.Ext32:
			what, lenBytes, size = "an extension", 4, 1
		case c == msgpcode.Array16:
			container, what, lenBytes, perLen = true, "an array", 2, 1
		case c == msgpcode.Array32:
			container, what, lenBytes, perLen = true, "an array", 4, 1
		case c == msgpcode.Map16:
			container, what, lenBytes, perLen = true, "a map", 2, 2
		case c == msgpcode.Map32:
			container, what, lenBytes, perLen = true, "a map", 4, 2
		default:
			return fmt.Errorf("byte %d: %#x is not a MessagePack code", at, c)
		}
		if lenBytes > 0 {
			if len(b)-pos < lenBytes {
				return fmt.Errorf("byte %d: the body ends inside %s's length", at, what)
			}
			var l uint64
			for _, x := range b[pos : pos+lenBytes] {
				l = l<<8 | uint64(x)
			}
			pos += lenBytes
			if container {
				n = perLen * l
			} else {
				size += l
			}
		}
		rest := uint64(len(b) - pos)
		if size > rest {
			return fmt.Errorf("byte %d: %s of %d bytes, where %d remain", at, what, size, rest)
		}
		if n > rest {
			return fmt.Errorf("byte %d: %s of %d values, where %d bytes remain", at, what, n, rest)
		}
		pos += int(size)
		if container {
			if len(left) > maxMsgpackDepth {
				return fmt.Errorf("byte %d: arrays and maps nested deeper than %d", at, maxMsgpackDepth)
			}
			left = append(left, n)
		}
	}
	if pos < len(b) {
		return fmt.Errorf("byte %d: %d bytes after the body's value", pos, len(b)-pos)
	}
	return nil
}

// checkMsgpackShape refuses body b, which checkMsgpack passed, unless each
// value of it that decodes into a struct of t (the type decoded into: a
// request, its events, their blocks) is a map or nil, as JSON's object or
// null. The msgpack library reads an array of as many values as a struct
// has fields into them in declaration order, and an empty one as the zero
// struct, so that a /register of [5, "tcp://…", "llama", …] registered
// instance 5, and an event given as an array was applied, where JSON
// refuses an array for an object. The walk follows t and skips whatever
// it does not decode into a struct.
//
// It also adds up what the decode will allocate for the body's arrays and
// maps (a slice's length times its element's size, a map's entries times
// key and value, a pointer's target) and refuses a body whose sum is past
// decodeBudget: an element takes one byte of the body at least (a nil),
// but an Event takes over 100 bytes of memory, so that a 32 MiB body of
// nil events asked for 7.5 GB.
func checkMsgpackShape(b []byte, t reflect.Type) error {
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(bytes.NewReader(b))
	w := shapeWalk{budget: decodeBudget(len(b))}
	return w.check(d, t)
}

// shapeWalk is checkMsgpackShape's state: key is the buffer a struct's
// keys are read into, reused for every key: a string per key was most of
// the allocations of a large body's decode (2008 of 3522 for /events of
// 1000 blocks), and fields[string(key)] allocates none. alloc is what the
// values seen so far decode into, refused past budget.
type shapeWalk struct {
	key           []byte
	alloc, budget uint64
}

// grow adds n values of size bytes each to w's allocation; an error past
// its budget.
func (w *shapeWalk) grow(n int, size uintptr) error {
	w.alloc += uint64(max(n, 0)) * uint64(size)
	if w.alloc > w.budget {
		return errDecodeBudget(w.budget)
	}
	return nil
}

var (
	customDecoderType = reflect.TypeFor[msgpack.CustomDecoder]()
	unmarshalerType   = reflect.TypeFor[msgpack.Unmarshaler]()
)

// check checks the next value of d, to be decoded into a t.
func (w *shapeWalk) check(d *msgpack.Decoder, t reflect.Type) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	for t.Kind() == reflect.Pointer {
		if c != msgpcode.Nil { // the library allocates what it points to
			if err := w.grow(1, t.Elem().Size()); err != nil {
				return err
			}
		}
		t = t.Elem()
	}
	if c == msgpcode.Nil || reflect.PointerTo(t).Implements(customDecoderType) || reflect.PointerTo(t).Implements(unmarshalerType) {
		// The library's nil is the zero value; a type that decodes
		// itself judges its own shape.
		return d.Skip()
	}
	isMap := msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
	isArray := msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
	switch {
	case t.Kind() == reflect.Struct:
		if !isMap {
			what := fmt.Sprintf("code %#x", c)
			if isArray {
				what = "an array"
			}
			return fmt.Errorf("%s where an object (%s) belongs", what, t.Name())
		}
		n, err := d.DecodeMapLen()
		if err != nil {
			return err
		}
		fields := structFields(t)
		for range n {
			// As the library reads a key: a string or binary, nil as "".
			l, err := d.DecodeBytesLen()
			if err != nil {
				return err
			}
			l = max(l, 0)
			if cap(w.key) < l {
				w.key = make([]byte, l)
			}
			w.key = w.key[:l]
			if l > 0 {
				if err := d.ReadFull(w.key); err != nil {
					return err
				}
			}
			f, ok := fields[string(w.key)]
			if !ok {
				if err := d.Skip(); err != nil {
					return err
				}
				continue
			}
			// f.name, not key: the value's check reuses key.
			if err := w.check(d, f.typ); err != nil {
				return fmt.Errorf("%s: %w", f.name, err)
			}
		}
		return nil
	case isArray && (t.Kind() == reflect.Slice || t.Kind() == reflect.Array):
		n, err := d.DecodeArrayLen()
		if err != nil {
			return err
		}
		if t.Kind() == reflect.Slice {
			if err := w.grow(n, t.Elem().Size()); err != nil {
				return err
			}
		}
		for i := range n {
			if err := w.check(d, t.Elem()); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
		}
		return nil
	case isMap && t.Kind() == reflect.Map:
		n, err := d.DecodeMapLen()
		if err != nil {
			return err
		}
		if err := w.grow(n, t.Key().Size()+t.Elem().Size()); err != nil {
			return err
		}
		for range n {
			if err := d.Skip(); err != nil {
				return err
			}
			if err := w.check(d, t.Elem()); err != nil {
				return err
			}
		}
		return nil
	}
	return d.Skip()
}

// shapeFields caches structFields.
var shapeFields sync.Map // reflect.Type → map[string]shapeField

// shapeField is a struct field as shapeWalk.check sees it: the name the
// msgpack library decodes it by, and its type.
type shapeField struct {
	name string
	typ  reflect.Type
}

// structFields maps the names the msgpack library decodes a struct's
// fields by (with the "json" tag: the tag's name, or the field's; "-" is
// none) to the fields; an embedded struct's fields are its own.
func structFields(t reflect.Type) map[string]shapeField {
	if m, ok := shapeFields.Load(t); ok {
		return m.(map[string]shapeField)
	}
	m := map[string]shapeField{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		if f.Anonymous && name == "" {
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				for k, v := range structFields(ft) {
					if _, ok := m[k]; !ok {
						m[k] = v
					}
				}
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		m[name] = shapeField{name: name, typ: f.Type}
	}
	shapeFields.Store(t, m)
	return m
}
