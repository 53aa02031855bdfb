package jsonscan

import "bytes"

// Walker reads the structure of a JSON text in one pass, without
// checking its syntax and without allocating: the keys of its objects and
// the elements of its arrays, each with its depth. It is what sizes a
// body before it is decoded (Elements, and the API's route bodies), so it
// reads every byte once and a flat array of numbers at memory speed.
//
// On bytes that are not JSON what it reports is only some of their
// structure, and the decoder that follows refuses them; it never reads
// out of b.
//
// Depth is counted in containers: the top-level value's keys or elements
// are at depth 1, those of a container in it at depth 2, and so on.
type Walker struct {
	b      []byte
	i      int    // the next byte to read
	depth  int    // containers open
	arrays uint64 // bit d: the container at depth d is an array (d < 64)
	key    bool   // in an object, after '{' or ',': a string next is a key
	open   bool   // just after '[': the next value is the array's first element
	keysTo int    // the deepest depth whose keys Next reports

	// findFlat's answer, for the arrays whose elements start at or
	// before flatEnd.
	flatEnd, flatFrom int
	searched          int // bytes findFlat searched, for the tests

	// What Next stopped at.
	Kind  Kind
	Depth int    // the depth of the key or of the elements
	Count int    // Elems: how many elements, at least 1
	Key   []byte // Key: its text between the quotes, escapes not undone (aliases b)
	Esc   bool   // Key: its text holds an escape
}

// Kind is what Walker.Next stopped at.
type Kind uint8

const (
	// Key: a key of an object (Key, Esc, Depth).
	Key Kind = iota + 1
	// Elems: Count elements of an array (Depth), every value counted
	// whatever its kind. The elements of one array may come as several
	// Elems.
	Elems
)

// NewWalker returns a Walker at the start of b that reports the keys of
// the objects at depths 1 to keysTo (none for 0) and the elements of
// every array. Keys not reported cost nothing more than other strings.
func NewWalker(b []byte, keysTo int) Walker {
	return Walker{b: b, keysTo: min(keysTo, 63), flatEnd: -1}
}

// Next reads on to the next key or elements and reports whether there
// was one before b's end.
func (w *Walker) Next() bool {
	b, i := w.b, w.i // i in a register: the loops below are the hot path
	for i < len(b) {
		c := b[i]
		i++
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		case ']', '}':
			w.open, w.key = false, false
			if w.depth > 0 {
				w.depth--
			}
			continue
		}
		if w.open {
			// c starts the first element of the array just opened: report
			// it, and read c itself at the next call.
			w.open = false
			w.i = i - 1
			return w.elems(1)
		}
		switch c {
		case '"':
			start, esc := i, false
			for ; i < len(b) && b[i] != '"'; i++ {
				if b[i] == '\\' {
					esc = true
					i++ // the escaped byte cannot end the string
				}
			}
			end := min(i, len(b))
			i++ // past the closing quote
			if w.key {
				w.key = false
				w.i = i
				w.Kind, w.Depth, w.Key, w.Esc, w.Count = Key, w.depth, b[start:end], esc, 0
				return true
			}
		case '[', '{':
			w.depth++
			w.key = false
			if w.depth < 64 {
				if c == '[' {
					w.arrays |= 1 << w.depth
				} else {
					w.arrays &^= 1 << w.depth
					w.key = w.depth <= w.keysTo
				}
			}
			if c == '{' {
				continue
			}
			// The array of numbers every client sends: its elements are
			// its commas, counted at memory speed up to its ']' when
			// nothing in it nests or quotes.
			if i > w.flatEnd {
				w.findFlat(i)
			}
			if i < w.flatFrom {
				w.open = true
				continue
			}
			elems := b[i:w.flatEnd]
			i = w.flatEnd // the ']' is next
			if len(bytes.TrimLeft(elems, " \t\n\r")) > 0 {
				w.i = i
				return w.elems(bytes.Count(elems, []byte{','}) + 1)
			}
		case ',':
			if w.depth < 64 && w.arrays&(1<<w.depth) != 0 {
				w.i = i
				return w.elems(1)
			}
			w.key = w.depth > 0 && w.depth <= w.keysTo
		}
	}
	w.i = i
	return false
}

// findFlat finds, for the arrays that open at from or after it, where
// those that are flat (hold no container and no string) end: the first
// ']' at or after from, flatEnd, and the position after the last '[',
// '{' or '"' before it, flatFrom. An array whose elements start at j in
// [from, flatEnd] is flat if and only if j >= flatFrom; one that opens
// later looks again. Each byte is searched once, however deep the arrays
// nest ([[[[...]]]] would make a search per '[' quadratic).
func (w *Walker) findFlat(from int) {
	b := w.b
	end := bytes.IndexByte(b[from:], ']')
	if end < 0 {
		// No array that opens from here on closes: none is flat.
		w.searched += len(b) - from
		w.flatEnd, w.flatFrom = len(b), len(b)+1
		return
	}
	w.searched += 4*end + 1 // the ']', then three bytes over seg
	w.flatEnd = from + end
	seg := b[from:w.flatEnd]
	last := max(lastIndexByte(seg, '['), lastIndexByte(seg, '{'), lastIndexByte(seg, '"'))
	w.flatFrom = from + last + 1
}

// lastIndexByte is bytes.LastIndexByte through bytes.IndexByte, which
// reads at memory speed where LastIndexByte reads a byte at a time: a
// flat array of 1 MiB is searched for three bytes it does not hold.
func lastIndexByte(s []byte, c byte) int {
	last := -1
	for {
		j := bytes.IndexByte(s[last+1:], c)
		if j < 0 {
			return last
		}
		last += j + 1
	}
}

func (w *Walker) elems(n int) bool {
	w.Kind, w.Depth, w.Count, w.Key, w.Esc = Elems, w.depth, n, nil, false
	return true
}

// CountDepth is how deep Elements counts: arrays nested deeper are not
// counted (no request body of the API nests its arrays that deep).
const CountDepth = 8

// Elements counts, for each nesting depth d below CountDepth, the
// elements of the arrays that are d containers deep, themselves counted:
// in {"a":[1,2,{"b":[3]}]} n[2] is 3 and n[4] is 1. It reads b once
// (Walker) and allocates nothing, to size what decoding b would allocate
// before it is decoded. On bytes that are not JSON its counts are only
// some counts, and the decoder that follows reports the error. Every
// value counts, whatever its kind, as a decoder that meets a value of the
// wrong kind still makes room for it.
func Elements(b []byte) (n [CountDepth]int) {
	w := NewWalker(b, 0)
	for w.Next() {
		if w.Kind == Elems && w.Depth < CountDepth {
			n[w.Depth] += w.Count
		}
	}
	return n
}
