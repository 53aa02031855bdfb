package indexer

import "github.com/kvrouter/kvrouter/internal/hugepage"

// chunks is an append-only collection whose records never move once
// added: they go into chunks whose sizes double from chunkMin up to
// chunkMax. Collecting n records this way copies none of them and clears
// each byte once, where a slice grown by append copies each record about
// four times (large slices grow by a quarter) and leaves every outgrown
// backing array to the collector.
type chunks[T any] struct {
	all [][]T // every chunk but the last is full, unless joined (join)
	n   int   // records in all
}

const chunkMin, chunkMax = 64, 1 << 16

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
		c.all = append(c.all, make([]T, 0, size))
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
