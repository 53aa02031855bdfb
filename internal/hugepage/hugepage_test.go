package hugepage

import (
	"testing"
	"unsafe"
)

// TestSpanIsTheWholeHugePagesInside: the span advised lies inside the
// array, starts and ends on huge page boundaries, and leaves out less
// than a huge page at each end; arrays under MinBytes get none.
func TestSpanIsTheWholeHugePagesInside(t *testing.T) {
	for _, n := range []int{0, 1, MinBytes/8 - 1, MinBytes / 8, MinBytes/8 + 4093, 3 * MinBytes / 8} {
		s := make([]uint64, n)
		b := span(s)
		size := uintptr(n) * 8
		if size < MinBytes {
			if b != nil {
				t.Fatalf("n=%d (%d bytes): span of %d bytes, want none", n, size, len(b))
			}
			continue
		}
		if len(b) == 0 {
			t.Fatalf("n=%d: no span in %d bytes", n, size)
		}
		p, lo, hi := uintptr(unsafe.Pointer(&s[0])), uintptr(unsafe.Pointer(&b[0])), uintptr(unsafe.Pointer(&b[0]))+uintptr(len(b))
		if lo%Size != 0 || hi%Size != 0 {
			t.Fatalf("n=%d: span [%#x, %#x) not on huge page boundaries", n, lo, hi)
		}
		if lo < p || hi > p+size || lo-p >= Size || p+size-hi >= Size {
			t.Fatalf("n=%d: span [%#x, %#x) in the array [%#x, %#x)", n, lo, hi, p, p+size)
		}
	}
}

// TestMakeKeepsContentsAndShape: the advice changes nothing a program
// sees.
func TestMakeKeepsContentsAndShape(t *testing.T) {
	sc := &Scratch{}
	a := MakeIn[uint32](sc, MinBytes)
	b := MakeCapIn[uint32](sc, MinBytes)
	c := MakeIn[byte](sc, 10) // too small to advise: not recorded
	if len(a) != MinBytes || len(b) != 0 || cap(b) != MinBytes || len(c) != 10 {
		t.Fatalf("shapes: len(a)=%d len(b)=%d cap(b)=%d len(c)=%d", len(a), len(b), cap(b), len(c))
	}
	for i := range a {
		if a[i] != 0 {
			t.Fatalf("a[%d] = %d, want 0", i, a[i])
		}
		a[i] = uint32(i)
	}
	if len(sc.spans) != 2 {
		t.Fatalf("%d spans recorded, want 2", len(sc.spans))
	}
	if h := Held(); h < 2*Size {
		t.Fatalf("Held() = %d with two arrays of %d bytes recorded", h, 4*MinBytes)
	}
	sc.Release()
	if len(sc.spans) != 0 || Held() != 0 {
		t.Fatalf("%d spans and %d bytes held after Release", len(sc.spans), Held())
	}
	for i := range a {
		if a[i] != uint32(i) {
			t.Fatalf("after Release a[%d] = %d", i, a[i])
		}
	}
	var none *Scratch
	if d := MakeIn[uint64](none, MinBytes); len(d) != MinBytes {
		t.Fatalf("nil Scratch: len %d", len(d))
	}
	none.Release() // a nil Scratch records nothing and releases nothing
}

// TestGrowMovesTheAdvice: Grow keeps the elements, records the new array
// and forgets the old one (withdrawing its advice), and leaves a buffer
// with room, and arrays sc never recorded, alone.
func TestGrowMovesTheAdvice(t *testing.T) {
	sc := &Scratch{}
	s := Grow[uint32](sc, nil, 10) // too small to advise
	s = append(s, 1, 2, 3)
	if len(sc.spans) != 0 || cap(s) < 10 {
		t.Fatalf("small grow: %d spans, cap %d", len(sc.spans), cap(s))
	}
	if g := Grow(sc, s, 5); &g[0] != &s[0] {
		t.Fatal("a buffer with room was reallocated")
	}
	big := Grow(sc, s, MinBytes/4)
	if len(big) != 3 || big[0] != 1 || big[2] != 3 || cap(big) < 3+MinBytes/4 {
		t.Fatalf("grown: len %d cap %d %v", len(big), cap(big), big)
	}
	if len(sc.spans) != 1 || Held() != int64(len(sc.spans[0])) {
		t.Fatalf("after one large grow: %d spans, %d bytes held", len(sc.spans), Held())
	}
	first := sc.spans[0]
	bigger := Grow(sc, big, cap(big))
	if len(bigger) != 3 || bigger[1] != 2 {
		t.Fatalf("grown again: %v", bigger)
	}
	if len(sc.spans) != 1 || unsafe.SliceData(sc.spans[0]) == unsafe.SliceData(first) {
		t.Fatalf("after the second grow: %d spans, the old array's still recorded: %v", len(sc.spans), len(sc.spans) == 1)
	}
	if Held() != int64(len(sc.spans[0])) {
		t.Fatalf("Held() = %d, want the new array's %d", Held(), len(sc.spans[0]))
	}
	other := MakeIn[uint32](nil, MinBytes) // advised, recorded nowhere
	_ = Grow(sc, other, 1)
	if len(sc.spans) != 2 {
		t.Fatalf("%d spans, want 2 (the new array from other; other itself not recorded)", len(sc.spans))
	}
	sc.Release()
	if Held() != 0 {
		t.Fatalf("Held() = %d after Release", Held())
	}
}
