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
