package jsonscan

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// walk is what a Walker reports of b, one line an event: "key D text"
// (with " esc" when the key holds an escape) or "elems D N".
func walk(b []byte) []string {
	var out []string
	w := NewWalker(b, 63)
	for w.Next() {
		switch w.Kind {
		case Key:
			s := fmt.Sprintf("key %d %s", w.Depth, w.Key)
			if w.Esc {
				s += " esc"
			}
			out = append(out, s)
		case Elems:
			out = append(out, fmt.Sprintf("elems %d %d", w.Depth, w.Count))
		default:
			out = append(out, fmt.Sprintf("kind %d", w.Kind))
		}
	}
	return out
}

func TestWalkerReportsKeysAndElementsByDepth(t *testing.T) {
	for _, tc := range []struct {
		body string
		want string // walk's lines, joined by "; "
	}{
		{`{}`, ``},
		{`[]`, ``},
		{`[ ]`, ``},
		{`7`, ``},
		{`"x"`, ``},
		// A flat array of numbers comes as one run of its elements.
		{`[1, 2 ,3]`, `elems 1 3`},
		{`{"a":[1,2],"b":{"c":[ 3 ]}}`, `key 1 a; elems 2 2; key 1 b; key 2 c; elems 3 1`},
		// An array that nests or quotes comes element by element.
		{`{"a":[1,{"k":"v"},[2]]}`, `key 1 a; elems 2 1; elems 2 1; key 3 k; elems 2 1; elems 3 1`},
		{`["x", "y"]`, `elems 1 1; elems 1 1`},
		// Strings that are values are no keys, whatever they hold; an
		// escaped quote does not end a string; an escape is said.
		{`{"a":"b","c\"":["d",{"e\u0066":1}]}`, `key 1 a; key 1 c\" esc; elems 2 1; elems 2 1; key 3 e\u0066 esc`},
		// A key after an empty object or array inside an array.
		{`[{},{"a":1},[],"s"]`, `elems 1 1; elems 1 1; key 2 a; elems 1 1; elems 1 1`},
		// Commas, brackets and braces in strings are text.
		{`{"a,[{":"]},{","b":[",]"]}`, `key 1 a,[{; key 1 b; elems 2 1`},
	} {
		if got := strings.Join(walk([]byte(tc.body)), "; "); got != tc.want {
			t.Errorf("walk(%s) = %q, want %q", tc.body, got, tc.want)
		}
	}
}

// FuzzWalker: on any bytes the Walker ends without reading out of them,
// every event is a key or a positive count at a positive depth, and on
// valid JSON Elements agrees with encoding/json (refElements).
func FuzzWalker(f *testing.F) {
	for _, s := range []string{`{"a":[1,2,{"b":[3]}]}`, `[[1],[2,3]]`, `{"k\"":"v"}`, `]]}}{[`, `[,,`, `{"a":[1,`, `"\`, `[1 2]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		w := NewWalker(b, 63)
		for w.Next() {
			switch {
			case w.Depth < 1:
				t.Fatalf("%q: an event at depth %d", b, w.Depth)
			case w.Kind == Elems && w.Count < 1:
				t.Fatalf("%q: elems of count %d", b, w.Count)
			case w.Kind != Elems && w.Kind != Key:
				t.Fatalf("%q: kind %d", b, w.Kind)
			}
		}
		var v any
		if json.Unmarshal(b, &v) != nil {
			return
		}
		var want [CountDepth]int
		refElements(v, 0, &want)
		if got := Elements(b); got != want {
			t.Fatalf("Elements(%s) = %v, encoding/json's %v", b, got, want)
		}
	})
}

type benchBody struct {
	name string
	b    []byte
}

// benchBodies are a 1 MiB events body (objects in arrays, read element
// by element) and a 1 MiB flat array of hashes (one run).
func benchBodies() []benchBody {
	var ev strings.Builder
	ev.WriteString(`{"batches":[{"worker_id":1,"dp_rank":0,"events":[`)
	for i := 0; ev.Len() < 1<<20; i++ {
		if i > 0 {
			ev.WriteString(",")
		}
		fmt.Fprintf(&ev, `{"event_id":%d,"type":"stored","tier":"gpu","blocks":[{"hash":%d,"parent":%d}]}`, i+1, 1e12+i, 1e12+i-1)
	}
	ev.WriteString(`]}]}`)
	var flat strings.Builder
	flat.WriteString(`{"block_hashes":[`)
	for i := 0; flat.Len() < 1<<20; i++ {
		if i > 0 {
			flat.WriteString(",")
		}
		fmt.Fprintf(&flat, "%d", 1e15+i)
	}
	flat.WriteString(`]}`)
	return []benchBody{{"events", []byte(ev.String())}, {"flat", []byte(flat.String())}}
}

// BenchmarkElements: Elements over each of benchBodies, against
// json.Valid of the same body (a syntax pass, which the decode that
// follows Elements makes anyway).
func BenchmarkElements(b *testing.B) {
	for _, body := range benchBodies() {
		b.Run(body.name, func(b *testing.B) {
			b.SetBytes(int64(len(body.b)))
			for b.Loop() {
				_ = Elements(body.b)
			}
		})
		b.Run(body.name+"/json.Valid", func(b *testing.B) {
			b.SetBytes(int64(len(body.b)))
			for b.Loop() {
				_ = json.Valid(body.b)
			}
		})
	}
}

// TestWalkerSearchesEachByteForFlatArraysOnce: however the arrays nest,
// the search for flat arrays reads each byte a bounded number of times;
// a search from each '[' to the first ']' after it would read
// [[[[...]]]] quadratically (2^31 bytes for these 64 KiB).
func TestWalkerSearchesEachByteForFlatArraysOnce(t *testing.T) {
	const n = 32 << 10
	for _, b := range [][]byte{
		[]byte(strings.Repeat("[", n) + strings.Repeat("]", n)),
		[]byte(strings.Repeat("[1,", n) + strings.Repeat("]", n)),
		[]byte(strings.Repeat(`[{"a":`, n)),
		[]byte(strings.Repeat("[", n) + "1" + strings.Repeat(",[]]", n)),
	} {
		w := NewWalker(b, 63)
		for w.Next() {
		}
		if w.searched > 4*len(b) {
			t.Errorf("%.12s...: searched %d bytes of %d", b, w.searched, len(b))
		}
	}
	// The counts stay right: the innermost array of [[[1,2]]] is flat.
	if got := strings.Join(walk([]byte(`[[[1,2]],[3]]`)), "; "); got != "elems 1 1; elems 2 1; elems 3 2; elems 1 1; elems 2 1" {
		t.Fatalf("walk = %q", got)
	}
}
