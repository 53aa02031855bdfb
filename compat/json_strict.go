package compat

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"reflect"
	"slices"
	"strings"
)

// checkJSONShape checks JSON body b, to be decoded into a t, and returns
// the body encoding/json is to decode.
//
// It refuses b when what encoding/json would allocate for its arrays and
// maps is past decodeBudget, as checkMsgpackShape does for MessagePack: an
// array of n nulls is 5n bytes, and encoding/json allocates n Events for
// it (over 100 bytes each, 130 times the body with the slice's growth).
//
// And it makes a request's keys match its fields exactly, as MessagePack's
// do: encoding/json matches a key to a field case-insensitively when none
// matches exactly, so that {"model_name":"llama","Model_Name":"other"}
// named model "other" in JSON and "llama" in MessagePack. A key that
// differs from a field's name only in case is unknown, and ignored as
// unknown keys are: the body returned is a copy of b with each such key
// written over with '~', which no field's name holds or folds to.
//
// A body that is not valid JSON passes as it is, once the walk finds it
// so: encoding/json checks the whole body before it decodes anything,
// allocates nothing for one it refuses, and says what is wrong with it.
// (The walk does not check the body whole itself: json.Valid first cost
// more than the walk, a fifth of the decode of an /events body.)
func checkJSONShape(b []byte, t reflect.Type) ([]byte, error) {
	w := jsonWalk{b: b, budget: decodeBudget(len(b))}
	if err := w.value(t, 0); err != nil {
		if errors.Is(err, errJSONInvalid) {
			return b, nil
		}
		return nil, err
	}
	if len(w.folded) == 0 {
		return b, nil
	}
	out := slices.Clone(b)
	for _, k := range w.folded {
		for i := k[0]; i < k[1]; i++ {
			out[i] = '~'
		}
	}
	return out, nil
}

// errJSONInvalid ends a jsonWalk of a body that is not valid JSON.
var errJSONInvalid = errors.New("not valid JSON")

// maxJSONDepth is encoding/json's bound on nesting: a body nested deeper
// is refused there, and the walk, which recurses once a level, stops.
const maxJSONDepth = 10000

// jsonWalk walks a JSON body along the type it decodes into, adding up in
// alloc what the decode allocates for it, and noting in folded the
// contents (from, to) of each key that would match a field only by case.
type jsonWalk struct {
	b             []byte
	pos           int
	alloc, budget uint64
	folded        [][2]int
}

// grow adds n values of size bytes each to w's allocation; an error past
// its budget.
func (w *jsonWalk) grow(n int, size uintptr) error {
	w.alloc += uint64(n) * uint64(size)
	if w.alloc > w.budget {
		return errDecodeBudget(w.budget)
	}
	return nil
}

// ws skips whitespace and returns the byte after it, 0 at the end (no
// value, key or delimiter starts with 0).
func (w *jsonWalk) ws() byte {
	for ; w.pos < len(w.b); w.pos++ {
		switch c := w.b[w.pos]; c {
		case ' ', '\t', '\n', '\r':
		default:
			return c
		}
	}
	return 0
}

// str skips the string at w.pos (its opening quote) and returns its raw
// contents.
func (w *jsonWalk) str() ([]byte, error) {
	i := w.pos + 1
	for ; i < len(w.b) && w.b[i] != '"'; i++ {
		if w.b[i] == '\\' {
			i++
		}
	}
	if i >= len(w.b) {
		return nil, errJSONInvalid
	}
	s := w.b[w.pos+1 : i]
	w.pos = i + 1
	return s, nil
}

// value walks the next value, to be decoded into a t (nil: skipped),
// nested depth levels deep.
func (w *jsonWalk) value(t reflect.Type, depth int) error {
	c := w.ws()
	for t != nil && t.Kind() == reflect.Pointer {
		if c != 'n' { // encoding/json allocates what it points to
			if err := w.grow(1, t.Elem().Size()); err != nil {
				return err
			}
		}
		t = t.Elem()
	}
	if (c == '{' || c == '[') && t != nil && reflect.PointerTo(t).Implements(jsonUnmarshalerType) {
		// A type that decodes itself judges its own shape. (Asked only of
		// an object or array: a scalar is skipped whatever its type, and
		// the question, of every hash of a body, was most of the walk.)
		t = nil
	}
	if (c == '{' || c == '[') && depth >= maxJSONDepth {
		return errJSONInvalid
	}
	switch c {
	case '{':
		w.pos++
		var fields map[string]shapeField
		isMap := t != nil && t.Kind() == reflect.Map
		if t != nil && t.Kind() == reflect.Struct {
			fields = structFields(t)
		}
		if w.ws() == '}' {
			w.pos++
			return nil
		}
		for {
			if w.ws() != '"' {
				return errJSONInvalid
			}
			from := w.pos + 1
			key, err := w.str()
			if err != nil {
				return err
			}
			if w.ws() != ':' {
				return errJSONInvalid
			}
			w.pos++
			var vt reflect.Type
			switch {
			case fields != nil:
				k := ""
				if bytes.IndexByte(key, '\\') >= 0 {
					k = unescapeKey(key)
				}
				var f shapeField
				var ok bool
				if k == "" {
					f, ok = fields[string(key)]
				} else {
					f, ok = fields[k]
				}
				switch {
				case ok:
					vt = f.typ
				case foldsToField(fields, cmp.Or(k, string(key))):
					w.folded = append(w.folded, [2]int{from, from + len(key)})
				}
			case isMap:
				if err := w.grow(1, t.Key().Size()+t.Elem().Size()); err != nil {
					return err
				}
				vt = t.Elem()
			}
			if err := w.value(vt, depth+1); err != nil {
				return err
			}
			switch w.ws() {
			case '}':
				w.pos++
				return nil
			case ',':
				w.pos++
			default:
				return errJSONInvalid
			}
		}
	case '[':
		w.pos++
		var et reflect.Type
		isSlice := t != nil && t.Kind() == reflect.Slice
		if t != nil && (isSlice || t.Kind() == reflect.Array) {
			et = t.Elem()
		}
		if w.ws() == ']' {
			w.pos++
			return nil
		}
		for {
			if isSlice {
				if err := w.grow(1, et.Size()); err != nil {
					return err
				}
			}
			if err := w.value(et, depth+1); err != nil {
				return err
			}
			switch w.ws() {
			case ']':
				w.pos++
				return nil
			case ',':
				w.pos++
			default:
				return errJSONInvalid
			}
		}
	case '"':
		_, err := w.str()
		return err
	}
	// A number, true, false or null: up to the next delimiter, and one
	// byte at least.
	from := w.pos
	for ; w.pos < len(w.b); w.pos++ {
		switch w.b[w.pos] {
		case ',', ']', '}', ':', '"', '{', '[', ' ', '\t', '\n', '\r':
			if w.pos == from {
				return errJSONInvalid
			}
			return nil
		}
	}
	if w.pos == from {
		return errJSONInvalid
	}
	return nil
}

// foldsToField reports whether key matches a field of fields when case is
// ignored, as encoding/json matches a key that matches none exactly.
func foldsToField(fields map[string]shapeField, key string) bool {
	for name := range fields {
		if strings.EqualFold(name, key) {
			return true
		}
	}
	return false
}

// unescapeKey is a key's raw contents with escapes, as encoding/json
// reads them.
func unescapeKey(raw []byte) string {
	var s string
	q := make([]byte, 0, len(raw)+2)
	q = append(append(append(q, '"'), raw...), '"')
	if err := json.Unmarshal(q, &s); err != nil {
		return string(raw)
	}
	return s
}

var jsonUnmarshalerType = reflect.TypeFor[json.Unmarshaler]()
