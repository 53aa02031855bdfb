package indexer

import (
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/hugepage"
)

// chunks is an append-only collection whose records never move once
// added: they go into chunks whose sizes double from chunkMin up to
// chunkMax. Collecting n records this way copies none of them and clears
// each byte once, where a slice grown by append copies each record about
// four times (large slices grow by a quarter) and leaves every outgrown
// backing array to the collector.
//
// The chunks come from from's slabs when from is set (make otherwise).
type chunks[T any] struct {
	all  [][]T // every chunk but the last is full, unless joined (join)
	n    int   // records in all
	from *chunkSlab[T]
}

const chunkMin, chunkMax = 64, 1 << 16

// chunkSlab carves chunks out of slabs of about chunkSlabBytes, advised
// for huge pages, for collections that are dropped together (a Loader's).
// Why: a rebuild collects hundreds of megabytes of
// records (5M tree nodes of 48 bytes, and their residencies, 24 bytes
// each, in hundreds of ranks' chunks of at most chunkMax records, too
// small to advise one by one), and on the virtual machines we run on the
// first touch of each 4 KiB page was half the page faults of a restart
// in a fresh process (74k of 148k at 5M blocks). A chunk that does not
// fit in the slab's rest starts a new slab; the rest (less than one
// chunk) is left unused. Slabs double from minChunkSlabBytes, so that a
// small load stays small, up to chunkSlabBytes: 64 MiB, because only the
// whole huge pages inside a slab are advised and the pages at its two
// ends (about a huge page's worth) fault once per 4 KiB, an eighth of a
// 16 MiB slab (a 5M-block restore's faults: 60–66k with 16 MiB slabs,
// 58–60k with 64 MiB ones). A chunkSlab is used by one goroutine at a time.
//
// The slabs' advice is recorded in the chunkSlab's own scratch, not the
// Loader's, so that release, once the collections are dropped (the node
// records when LinkNodes has copied them, the residencies once applied),
// leaves nothing of the chunkSlab's that reaches them: the collector may
// have them while the rest of the load runs, as it could have chunks made
// one by one.
type chunkSlab[T any] struct {
	rest []T // the current slab's unused part: len 0
	next int // bytes of the next slab; 0 before the first
	huge hugepage.Scratch
}

// release withdraws the advice from the slabs and drops the chunkSlab's
// references to them; chunks taken after it come from new slabs.
func (s *chunkSlab[T]) release() {
	s.huge.Release()
	s.rest = nil
}

const minChunkSlabBytes, chunkSlabBytes = 64 << 10, 64 << 20

// take returns an empty chunk of capacity n.
func (s *chunkSlab[T]) take(n int) []T {
	if s == nil {
		return make([]T, 0, n)
	}
	if cap(s.rest) < n {
		var zero T
		size := max(s.next, minChunkSlabBytes)
		s.next = min(2*size, chunkSlabBytes)
		s.rest = hugepage.MakeCapIn[T](&s.huge, max(n, size/int(unsafe.Sizeof(zero))))
	}
	c := s.rest[:0:n]
	s.rest = s.rest[n:n:cap(s.rest)]
	return c
}

// reserve makes the first chunk hold n records (a known count), its
// array recorded in sc.
func (c *chunks[T]) reserve(n int, sc *hugepage.Scratch) {
	if n > 0 && c.n == 0 {
		c.all = [][]T{hugepage.MakeCapIn[T](sc, n)}
	}
}

// next appends a zero record and returns it, to be filled in place.
func (c *chunks[T]) next() *T {
	k := len(c.all) - 1
	if k < 0 || len(c.all[k]) == cap(c.all[k]) {
		size := chunkMin
		if k >= 0 {
			size = min(2*cap(c.all[k]), max(chunkMax, cap(c.all[k])))
		}
		c.all = append(c.all, c.from.take(size))
		k++
	}
	last := &c.all[k]
	*last = (*last)[:len(*last)+1]
	c.n++
	return &(*last)[len(*last)-1]
}

// flatten returns the records in one slice, in the order added: the first
// chunk itself when it is the only one, else one exact-size copy, its
// array recorded in sc.
func (c *chunks[T]) flatten(sc *hugepage.Scratch) []T {
	if len(c.all) == 1 {
		return c.all[0]
	}
	out := hugepage.MakeCapIn[T](sc, c.n)
	for _, ch := range c.all {
		out = append(out, ch...)
	}
	return out
}

// join moves o's records after c's, without copying them, and empties o.
func (c *chunks[T]) join(o *chunks[T]) {
	c.all = append(c.all, o.all...)
	c.n += o.n
	*o = chunks[T]{}
}
