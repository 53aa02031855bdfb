// Package strictkeys checks the keys of a JSON value against the Go type
// it was decoded into, exactly and each once, where encoding/json is
// looser: it takes a key for a field when the two match without their
// case, and with Unicode's folding besides (U+212A KELVIN SIGN is 'k',
// U+017F LONG S is 's'), and it takes a key given twice, the last one
// winning, or, for an object, merged into the first. DisallowUnknownFields
// refuses neither, so "WORKER_ID" after "worker_id" changed the worker
// registered, and "params" twice in a settings body set the union of both.
// The API's request bodies (api's decodeJSON) and the simulator's trace
// rows (sim.ReadTrace) are checked with it.
//
// Check walks a body encoding/json has just decoded, with the type it
// decoded into, and refuses any key that is not a field's name exactly
// and any key an object gives twice, at any depth. The body is valid JSON
// (the decoder read it whole first), so the walk only tells values apart;
// it still checks every bound, and reports what it cannot read instead of
// panicking. Maps and values decoded by their own UnmarshalJSON (or
// UnmarshalText) take any key, once. The API's route fast path
// (fastRouteRequest) needs none of this: it takes only exact keys, each
// once (jsonscan.Scanner.Object), and leaves the rest to decodeJSON.
package strictkeys

import (
	"encoding"
	"encoding/json"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"unicode/utf8"
)

// Check reports the first key of b, a JSON value decoded into a value
// of type t, that is not one of t's field names exactly, or that its
// object gives twice; nil when there is none.
func Check(b []byte, t reflect.Type) error {
	w := keyWalker{b: b}
	if err := w.value(shapeOf(t)); err != nil {
		return err
	}
	return nil
}

// keyError is Check's error: where in the body, and what.
type keyError struct {
	// at holds the fields and indexes from the error up to the top,
	// innermost first, joined once by Error: batches[0].events[2]. Built
	// up as the walk unwinds, one append a level, not a copy of the path
	// so far (quadratic in the depth).
	at  []string
	msg string
}

func (e *keyError) Error() string {
	if len(e.at) == 0 {
		return e.msg
	}
	var b strings.Builder
	for i := len(e.at) - 1; i >= 0; i-- {
		if i < len(e.at)-1 && e.at[i][0] != '[' {
			b.WriteByte('.')
		}
		b.WriteString(e.at[i])
	}
	return b.String() + ": " + e.msg
}

// in puts err under the field (or, with brackets, the index) at.
func in(at string, err error) error {
	if ke, ok := err.(*keyError); ok {
		if at == "" {
			at = `""` // a field named "" keeps its place in the path
		}
		ke.at = append(ke.at, at)
	}
	return err
}

// A shape is what Check needs of a type: which JSON values it takes
// keys from, and which keys. Shapes are built once per type and kept.
type shape struct {
	kind   shapeKind
	fields map[string]int // shapeStruct: a field's JSON name → its position
	types  []*shape       // shapeStruct: each field's shape, by position
	elem   *shape         // shapeMap: the values'; shapeList: the elements'
	// intKeys: a shapeMap whose keys are integers, which encoding/json
	// parses ("1" and "01" are one key); otherwise its keys are text.
	intKeys bool
}

type shapeKind uint8

const (
	shapeAny    shapeKind = iota // takes any key, once: a map's, an interface's, a type's own UnmarshalJSON's
	shapeStruct                  // takes its fields' names, each once
	shapeMap                     // takes any key, once; its values have elem's shape
	shapeList                    // a slice or an array of elem
	shapeScalar                  // a string, a number or a bool: no keys
)

var (
	shapes   sync.Map   // reflect.Type → *shape, complete
	shapesMu sync.Mutex // serializes building

	jsonUnmarshaler = reflect.TypeFor[json.Unmarshaler]()
	textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()
)

// shapeOf returns t's shape.
func shapeOf(t reflect.Type) *shape {
	if s, ok := shapes.Load(t); ok {
		return s.(*shape)
	}
	shapesMu.Lock()
	defer shapesMu.Unlock()
	built := map[reflect.Type]*shape{}
	s := buildShape(t, built)
	for t, s := range built { // published whole: a reader never sees one half-built
		shapes.Store(t, s)
	}
	return s
}

// unmarshals reports whether t, or a pointer to it, decodes itself
// (UnmarshalJSON, UnmarshalText): it takes what it takes.
func unmarshals(t reflect.Type) bool {
	pt := reflect.PointerTo(t)
	return t.Implements(jsonUnmarshaler) || t.Implements(textUnmarshaler) ||
		pt.Implements(jsonUnmarshaler) || pt.Implements(textUnmarshaler)
}

// buildShape builds t's shape and those it holds, into built (a type
// that holds itself is built once). A struct's fields are named as
// encoding/json names them: the tag's name, else the Go name; "-" and
// unexported fields left out; an embedded struct's fields (without a name
// of their own in the tag) lifted into the struct's where it has none of
// that name (encoding/json's rule but for its conflicts at one depth;
// none of the API's bodies embeds a struct).
func buildShape(t reflect.Type, built map[reflect.Type]*shape) *shape {
	if s, ok := shapes.Load(t); ok {
		return s.(*shape)
	}
	if s, ok := built[t]; ok {
		return s
	}
	if unmarshals(t) {
		built[t] = anyShape
		return anyShape
	}
	if t.Kind() == reflect.Pointer {
		// A pointer is its value's shape (shared, not copied: that one
		// may still be being built, a struct that holds a pointer to
		// itself).
		s := buildShape(t.Elem(), built)
		built[t] = s
		return s
	}
	s := &shape{}
	built[t] = s
	switch t.Kind() {
	case reflect.Struct:
		s.kind, s.fields = shapeStruct, map[string]int{}
		// Breadth first, as encoding/json resolves names: a struct's own
		// fields, then those of the structs it embeds, then those they
		// embed; a name taken at a shallower depth wins.
		for level := []reflect.Type{t}; len(level) > 0; {
			var next []reflect.Type
			for _, t := range level {
				for i := 0; i < t.NumField(); i++ {
					sf := t.Field(i)
					tag := sf.Tag.Get("json")
					if tag == "-" {
						continue
					}
					name, _, _ := strings.Cut(tag, ",")
					if sf.Anonymous && name == "" {
						ft := sf.Type
						if ft.Kind() == reflect.Pointer {
							ft = ft.Elem()
						}
						if ft.Kind() == reflect.Struct {
							next = append(next, ft)
							continue
						}
					}
					if !sf.IsExported() {
						continue
					}
					if name == "" {
						name = sf.Name
					}
					if _, dup := s.fields[name]; !dup {
						s.fields[name] = len(s.types)
						s.types = append(s.types, buildShape(sf.Type, built))
					}
				}
			}
			level = next
		}
	case reflect.Map:
		s.kind, s.elem = shapeMap, buildShape(t.Elem(), built)
		if !unmarshals(t.Key()) {
			switch t.Key().Kind() {
			case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
				reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Uintptr:
				s.intKeys = true
			}
		}
	case reflect.Slice, reflect.Array:
		s.kind, s.elem = shapeList, buildShape(t.Elem(), built)
	case reflect.Interface:
		// shapeAny
	default:
		s.kind = shapeScalar
	}
	return s
}

// keyWalker reads a valid JSON text.
type keyWalker struct {
	b []byte
	i int
}

func (w *keyWalker) ws() {
	for w.i < len(w.b) {
		switch w.b[w.i] {
		case ' ', '\t', '\n', '\r':
			w.i++
		default:
			return
		}
	}
}

func (w *keyWalker) broken() error {
	return &keyError{msg: fmt.Sprintf("unreadable JSON at byte %d", w.i)}
}

// value reads one value of shape s.
func (w *keyWalker) value(s *shape) error {
	w.ws()
	if w.i >= len(w.b) {
		return w.broken()
	}
	switch w.b[w.i] {
	case '{':
		return w.object(s)
	case '[':
		elem := anyShape
		if s.kind == shapeList {
			elem = s.elem
		}
		w.i++
		w.ws()
		if w.i < len(w.b) && w.b[w.i] == ']' {
			w.i++
			return nil
		}
		for n := 0; ; n++ {
			if err := w.value(elem); err != nil {
				return in("["+strconv.Itoa(n)+"]", err)
			}
			w.ws()
			if w.i >= len(w.b) {
				return w.broken()
			}
			c := w.b[w.i]
			w.i++
			if c == ']' {
				return nil
			}
			if c != ',' {
				return w.broken()
			}
		}
	case '"':
		_, _, err := w.str()
		return err
	default: // a number, true, false or null
		for w.i < len(w.b) {
			switch w.b[w.i] {
			case ',', ']', '}', ' ', '\t', '\n', '\r':
				return nil
			}
			w.i++
		}
		return nil
	}
}

// anyShape is the shape of a value that takes any key, once.
var anyShape = &shape{kind: shapeAny}

// object reads an object of shape s: a struct's keys must be its fields'
// names exactly; no object may give a key twice.
func (w *keyWalker) object(s *shape) error {
	elem := anyShape // of a map's values
	if s.kind == shapeMap {
		elem = s.elem
	}
	var seenField uint64            // a struct's fields, by position (up to 64; more in seenKey)
	var seenKey map[string]struct{} // a map's keys, and any other object's
	w.i++                           // '{'
	w.ws()
	if w.i < len(w.b) && w.b[w.i] == '}' {
		w.i++
		return nil
	}
	for {
		w.ws()
		raw, esc, err := w.str()
		if err != nil {
			return err
		}
		// The key as encoding/json reads it; raw itself, without an
		// escape (looked up without a copy: no allocation per key).
		var unesc string
		if esc {
			if unesc, err = Unescape(raw); err != nil {
				return w.broken()
			}
		}
		key := func() string {
			if esc {
				return unesc
			}
			return string(raw)
		}
		vs := elem
		pos := -1
		if s.kind == shapeStruct {
			var p int
			var ok bool
			if esc {
				p, ok = s.fields[unesc]
			} else {
				p, ok = s.fields[string(raw)]
			}
			if !ok {
				return &keyError{msg: fmt.Sprintf("unknown field %q (field names match exactly, letter case included)", key())}
			}
			vs, pos = s.types[p], p
		}
		if pos >= 0 && pos < 64 {
			if seenField&(1<<pos) != 0 {
				return &keyError{msg: fmt.Sprintf("field %q given twice", key())}
			}
			seenField |= 1 << pos
		} else {
			k := mapKey(key(), s.intKeys)
			if _, dup := seenKey[k]; dup {
				return &keyError{msg: fmt.Sprintf("key %q given twice", k)}
			}
			if seenKey == nil {
				seenKey = map[string]struct{}{}
			}
			seenKey[k] = struct{}{}
		}
		w.ws()
		if w.i >= len(w.b) || w.b[w.i] != ':' {
			return w.broken()
		}
		w.i++
		if err := w.value(vs); err != nil {
			return in(key(), err)
		}
		w.ws()
		if w.i >= len(w.b) {
			return w.broken()
		}
		c := w.b[w.i]
		w.i++
		if c == '}' {
			return nil
		}
		if c != ',' {
			return w.broken()
		}
	}
}

// mapKey is key as the map encoding/json decodes it into holds it, for
// telling two keys apart: a number when the map's keys are integers
// (intKeys), text with each invalid UTF-8 byte as U+FFFD otherwise.
func mapKey(key string, intKeys bool) string {
	if intKeys {
		if n, err := strconv.ParseInt(key, 10, 64); err == nil {
			return strconv.FormatInt(n, 10)
		}
		if n, err := strconv.ParseUint(key, 10, 64); err == nil {
			return strconv.FormatUint(n, 10)
		}
		return key
	}
	if !utf8.ValidString(key) {
		return strings.ToValidUTF8(key, "\uFFFD")
	}
	return key
}

// str reads a string: its bytes between the quotes, and whether they
// hold an escape.
func (w *keyWalker) str() ([]byte, bool, error) {
	if w.i >= len(w.b) || w.b[w.i] != '"' {
		return nil, false, w.broken()
	}
	w.i++
	start, esc := w.i, false
	for w.i < len(w.b) {
		switch w.b[w.i] {
		case '"':
			s := w.b[start:w.i]
			w.i++
			return s, esc, nil
		case '\\':
			esc = true
			w.i++ // the escaped byte (a \u's hex digits are plain)
		}
		w.i++
	}
	return nil, false, w.broken()
}

// Unescape returns the text of a JSON string's bytes between its quotes,
// which hold an escape (api's route fast path names keys with it too).
func Unescape(raw []byte) (string, error) {
	var s string
	err := json.Unmarshal(append(append([]byte{'"'}, raw...), '"'), &s)
	return s, err
}
