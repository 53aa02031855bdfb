// Package hugepage asks the kernel to back large, long-lived slices with
// transparent huge pages.
//
// Why: the index is built by filling hundreds of megabytes of fresh memory
// (a restart's or a restore's rebuild, the tree's node slabs as it grows),
// and on the virtual machines we run on a first touch of a 4 KiB page is
// expensive: filling 250 MB of new nodes took 1.1–2.3 s with 4 KiB pages
// and 0.12–0.35 s with 2 MiB ones. Go's runtime no longer advises its heap
// for huge pages itself (since Go 1.21.1), and most hosts run THP in
// "madvise" mode, so without the advice every such page is a 4 KiB fault.
//
// Invariants: the advice is a hint that never changes the contents of
// memory; only whole 2 MiB pages inside one allocation of at least
// MinBytes are advised, so neighbouring objects are never touched and the
// number of memory mappings the advice splits stays small. Memory that is
// dropped soon after (a build's scratch arrays) is handed back with
// Unadvise first, so that the kernel's background collapsing does not
// refill pages the Go runtime has returned.
package hugepage

import (
	"sync"
	"sync/atomic"
	"unsafe"
)

const (
	// Size is a transparent huge page on amd64 and arm64 (4 KiB base
	// pages).
	Size = 2 << 20
	// MinBytes is the smallest allocation advised: two huge pages, so
	// that at least one lies wholly inside it.
	MinBytes = 2 * Size
)

// Make returns make([]T, n, n) advised for huge pages when it is large.
func Make[T any](n int) []T {
	s := make([]T, n)
	Advise(s)
	return s
}

// MakeCap returns make([]T, 0, n) advised for huge pages when it is
// large.
func MakeCap[T any](n int) []T {
	s := make([]T, 0, n)
	Advise(s)
	return s
}

// Advise advises the whole huge pages inside s's backing array (up to its
// capacity) for transparent huge pages. It is best done before the array
// is first written. Errors (a kernel without THP) are ignored: the advice
// is only a hint.
func Advise[T any](s []T) { advise(span(s)) }

// Unadvise withdraws Advise's hint, before s is dropped.
func Unadvise[T any](s []T) { unadvise(span(s)) }

// span returns the huge-page-aligned part of s's backing array, or a nil
// slice when it is too small to hold a whole huge page.
func span[T any](s []T) []byte {
	var zero T
	size := uintptr(cap(s)) * unsafe.Sizeof(zero)
	if size < MinBytes {
		return nil
	}
	base := unsafe.Pointer(unsafe.SliceData(s))
	p := uintptr(base)
	lo := (p + Size - 1) &^ (Size - 1)
	hi := (p + size) &^ (Size - 1)
	if hi <= lo {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Add(base, lo-p)), hi-lo)
}

// Scratch collects the arrays of one job (a rebuild's scratch) that are
// advised for huge pages and dropped together, so that Release withdraws
// the advice from all of them before they are dropped. It is safe for
// concurrent use.
type Scratch struct {
	mu    sync.Mutex
	spans [][]byte
}

// MakeIn is Make, the array recorded in sc (nil: not recorded).
func MakeIn[T any](sc *Scratch, n int) []T {
	s := make([]T, n)
	sc.add(span(s))
	return s
}

// MakeCapIn is MakeCap, the array recorded in sc (nil: not recorded).
func MakeCapIn[T any](sc *Scratch, n int) []T {
	s := make([]T, 0, n)
	sc.add(span(s))
	return s
}

func (sc *Scratch) add(b []byte) {
	if len(b) == 0 {
		return
	}
	advise(b)
	if sc == nil {
		return
	}
	sc.mu.Lock()
	sc.spans = append(sc.spans, b)
	sc.mu.Unlock()
	held.Add(int64(len(b)))
}

// held is the bytes recorded in every Scratch and not yet released.
var held atomic.Int64

// Held returns the bytes advised through a Scratch and not yet released,
// in the whole process: for tests that check a job releases its scratch.
func Held() int64 { return held.Load() }

// Release withdraws the advice from every array recorded, and forgets
// them. Call it before the arrays are dropped: without it, the kernel's
// background collapsing may refill huge pages in memory the Go runtime
// has returned to it.
func (sc *Scratch) Release() {
	if sc == nil {
		return
	}
	sc.mu.Lock()
	spans := sc.spans
	sc.spans = nil
	sc.mu.Unlock()
	for _, b := range spans {
		unadvise(b)
		held.Add(-int64(len(b)))
	}
}
