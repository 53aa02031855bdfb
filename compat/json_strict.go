package compat

import (
	"bytes"
	"encoding/json"
	"reflect"
)

// checkJSONShape refuses JSON body b, to be decoded into a t, when what
// encoding/json would allocate for its arrays and maps is past
// decodeBudget, as checkMsgpackShape does for MessagePack: an array of n
// nulls is 5n bytes, and encoding/json allocates n Events for it (over 100
// bytes each, 130 times the body with the slice's growth). A body that is
// not valid JSON passes: encoding/json refuses it before it allocates.
func checkJSONShape(b []byte, t reflect.Type) error {
	if !json.Valid(b) {
		return nil
	}
	w := jsonWalk{b: b, budget: decodeBudget(len(b))}
	return w.value(t)
}

// jsonWalk walks a valid JSON body along the type it decodes into, adding
// up in alloc what the decode allocates for it.
type jsonWalk struct {
	b             []byte
	pos           int
	alloc, budget uint64
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

func (w *jsonWalk) ws() {
	for w.pos < len(w.b) {
		switch w.b[w.pos] {
		case ' ', '\t', '\n', '\r':
			w.pos++
		default:
			return
		}
	}
}

// str skips the string at w.pos and returns its raw contents.
func (w *jsonWalk) str() []byte {
	i := w.pos + 1
	for w.b[i] != '"' {
		if w.b[i] == '\\' {
			i++
		}
		i++
	}
	s := w.b[w.pos+1 : i]
	w.pos = i + 1
	return s
}

// value walks the next value, to be decoded into a t (nil: skipped).
func (w *jsonWalk) value(t reflect.Type) error {
	w.ws()
	c := w.b[w.pos]
	for t != nil && t.Kind() == reflect.Pointer {
		if c != 'n' { // encoding/json allocates what it points to
			if err := w.grow(1, t.Elem().Size()); err != nil {
				return err
			}
		}
		t = t.Elem()
	}
	if t != nil && reflect.PointerTo(t).Implements(jsonUnmarshalerType) {
		t = nil // a type that decodes itself (Hash) allocates nothing here
	}
	switch c {
	case '{':
		w.pos++
		var fields map[string]shapeField
		isMap := t != nil && t.Kind() == reflect.Map
		if t != nil && t.Kind() == reflect.Struct {
			fields = structFields(t)
		}
		if w.ws(); w.b[w.pos] == '}' {
			w.pos++
			return nil
		}
		for {
			w.ws()
			key := w.str()
			w.ws()
			w.pos++ // ':'
			var vt reflect.Type
			switch {
			case fields != nil:
				var f shapeField
				var ok bool
				if bytes.IndexByte(key, '\\') < 0 {
					f, ok = fields[string(key)]
				} else {
					f, ok = fields[unescapeKey(key)]
				}
				if ok {
					vt = f.typ
				}
			case isMap:
				if err := w.grow(1, t.Key().Size()+t.Elem().Size()); err != nil {
					return err
				}
				vt = t.Elem()
			}
			if err := w.value(vt); err != nil {
				return err
			}
			if w.ws(); w.b[w.pos] == '}' {
				w.pos++
				return nil
			}
			w.pos++ // ','
		}
	case '[':
		w.pos++
		var et reflect.Type
		isSlice := t != nil && t.Kind() == reflect.Slice
		if t != nil && (isSlice || t.Kind() == reflect.Array) {
			et = t.Elem()
		}
		if w.ws(); w.b[w.pos] == ']' {
			w.pos++
			return nil
		}
		for {
			if isSlice {
				if err := w.grow(1, et.Size()); err != nil {
					return err
				}
			}
			if err := w.value(et); err != nil {
				return err
			}
			if w.ws(); w.b[w.pos] == ']' {
				w.pos++
				return nil
			}
			w.pos++ // ','
		}
	case '"':
		w.str()
	default: // a number, true, false or null
		for ; w.pos < len(w.b); w.pos++ {
			switch w.b[w.pos] {
			case ',', ']', '}', ' ', '\t', '\n', '\r':
				return nil
			}
		}
	}
	return nil
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
