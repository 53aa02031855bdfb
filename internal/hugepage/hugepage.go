// Package hugepage asks the kernel to back large, long-lived slices with
// transparent huge pages.
//
// Why: the index's rebuild (at a restart or a restore) fills hundreds of
// megabytes of fresh memory at once, a growing index and the state
// machine's write groups fill it as events come, and on the virtual
// machines we run on a first touch of a 4 KiB page is expensive:
// filling 250 MB of new nodes took 1.1–2.3 s with 4 KiB pages
// and 0.12–0.35 s with 2 MiB ones. Go's runtime no longer advises its heap
// for huge pages itself (since Go 1.21.1), and most hosts run THP in
// "madvise" mode, so without the advice every such page is a 4 KiB fault.
//
// Invariants: the advice is a hint that never changes the contents of
// memory; only whole 2 MiB pages inside one allocation of at least
// MinBytes are advised, so neighbouring objects are never touched and the
// number of memory mappings the advice splits stays small. Every array
// advised is recorded in a Scratch, whose Release withdraws the advice
// when the job ends, so that the kernel's background collapsing does not
// refill pages the Go runtime has returned once the arrays are dropped.
package hugepage

import (
	"slices"
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

// MakeIn returns make([]T, n, n), advised for huge pages when it is at
// least MinBytes and recorded in sc (nil: advised, not recorded). The
// advice is best given before the array is first written; errors (a
// kernel without THP) are ignored: it is only a hint.
func MakeIn[T any](sc *Scratch, n int) []T {
	s := make([]T, n)
	sc.add(span(s))
	return s
}

// MakeCapIn is MakeIn for make([]T, 0, n).
func MakeCapIn[T any](sc *Scratch, n int) []T {
	s := make([]T, 0, n)
	sc.add(span(s))
	return s
}

// Grow is slices.Grow for a long-lived buffer that grows by large steps
// (a write group's arena): when s lacks room for n more elements, it
// returns a new array holding s's elements, advised and recorded in sc as
// MakeCapIn's, and withdraws the advice from s's array if sc recorded it
// (the caller drops that array).
func Grow[T any](sc *Scratch, s []T, n int) []T {
	if n <= cap(s)-len(s) {
		return s
	}
	g := append(MakeCapIn[T](sc, len(s)+n), s...)
	sc.forget(span(s))
	return g
}

// forget withdraws the advice from b, one of sc's records, and drops the
// record; b not recorded in sc is left alone.
func (sc *Scratch) forget(b []byte) {
	if sc == nil || len(b) == 0 {
		return
	}
	sc.mu.Lock()
	i := slices.IndexFunc(sc.spans, func(x []byte) bool { return unsafe.SliceData(x) == unsafe.SliceData(b) })
	if i >= 0 {
		sc.spans = slices.Delete(sc.spans, i, i+1)
	}
	sc.mu.Unlock()
	if i >= 0 {
		unadvise(b)
		held.Add(-int64(len(b)))
	}
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

// MoveTo hands every array recorded in sc to dst (their owner changes:
// a tree moved into another index), leaving sc empty.
func (sc *Scratch) MoveTo(dst *Scratch) {
	if sc == nil || dst == nil || sc == dst {
		return
	}
	sc.mu.Lock()
	spans := sc.spans
	sc.spans = nil
	sc.mu.Unlock()
	dst.mu.Lock()
	dst.spans = append(dst.spans, spans...)
	dst.mu.Unlock()
}

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
