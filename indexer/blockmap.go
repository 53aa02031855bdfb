package indexer

import (
	"iter"
	"math/bits"
	"math/rand/v2"
	"unsafe"
)

// blockMap is a rank's engine hash → node map (rankState.blocks).
//
// It is extendible hashing over small open-addressing tables. The key's
// hash h (mix64 of the engine hash and the map's seed) picks a segment by
// its top bits, from a directory of 1<<depth segment pointers; a segment
// whose local depth is below the directory's fills a run of directory
// entries. Inside a segment, linear probing over a power-of-two table of
// (engine hash, node) slots from the home slot h's low bits: a slot with a
// nil node is empty, and every key sits in the run of full slots that
// starts at its home, so a probe stops at the first empty slot. A delete
// shifts the rest of the run back over the hole instead of leaving a
// tombstone (Knuth's algorithm R).
//
// Growth: a segment at 7/8 full doubles in place while it is smaller than
// segSlots; a full-sized one splits in two by the next bit of h (doubling
// the directory when its depth is the directory's). So growing never
// copies more than one 16 KiB segment at once: the apply that grows a map
// of millions of blocks pauses for microseconds, not for a copy of the
// whole table, and the memory freed is one segment, not the old table.
// Nothing shrinks (like a Go map).
//
// Aimed keys: the hash is mix64(eh ^ seed), with a seed drawn at random
// for each map (newBlockSeed), because mix64 alone is unkeyed and
// invertible: whoever chooses engine hashes could otherwise give thousands
// of them one home slot in one segment (every lookup then probes past all
// of them: quadratic time, 2.75 s for 40,000 keys, on every replica) or
// hashes that share their top 54 bits. A seed is one map's, in one
// process, and never replicated: all() yields in an order that differs
// between replicas and restarts, and its callers must not let that order
// decide anything (DumpRank sorts, clearRank's drops commute, evictOldest
// breaks ties without it).
//
// The directory bound stays as a second line: the directory may only
// double while its depth stays within dirSlackBits of what the entry count
// needs (bits.Len(n/segSlots)); past that a full segment grows in place
// instead, past segSlots, and splits later, once the count allows a deeper
// directory. Random hashes never come near the bound (their directory is
// at most one bit deeper than the count needs). Hashes that share their
// top bits can make at most one segment per directory entry, so at most
// 2<<dirSlackBits segments per segSlots entries (1<<dirSlackBits under
// segSlots entries): memory stays O(entries) whatever the hashes.
//
// Why not a Go map: storing a block looks its engine hash up and, nearly
// always, inserts it; a Go map hashes and probes twice for that, here
// lookup finds the slot the insert then fills (setAt).
//
// A blockMap must not be changed while all's iteration runs.
type blockMap struct {
	dir   []*bmSegment // 1<<depth entries; nil while the map is empty
	depth uint
	n     int
	seed  uint64 // drawn with dir's first allocation
}

type bmSegment struct {
	slots []blockSlot // len a power of two; over segSlots only when splitting was refused (maySplit)
	n     int
	depth uint // local depth: the top depth bits of h are the same for every key here
}

type blockSlot struct {
	eh uint64
	n  *node // nil: empty
}

const (
	segSlots    = 1024 // a full-sized segment: 16 KiB
	minSegSlots = 8
	// dirSlackBits is how much deeper than bits.Len(n/segSlots) the
	// directory may grow (maySplit). Growing 3M random keys, the directory
	// was never more than one bit deeper than that.
	dirSlackBits = 3
	// maxSegDepth bounds splitting whatever the count (the hash has 64
	// bits to split by); dirSlackBits makes it unreachable in practice.
	maxSegDepth = 54
)

// newBlockSeed draws a map's hash seed. Tests replace it to aim keys at a
// known seed or to compare maps of different seeds.
var newBlockSeed = rand.Uint64

// hash returns the hash of engine hash eh: its top bits pick the segment,
// its low bits the home slot.
func (m *blockMap) hash(eh uint64) uint64 { return mix64(eh ^ m.seed) }

// newBlockMap returns a map with room for about hint entries before it
// grows. Its full-sized tables come from t (nil: made): a rebuild sizes
// its maps at once, hundreds of megabytes of tables for millions of
// blocks, whose first writes fault once per 4 KiB page unless they come
// from t's slabs advised for huge pages.
func newBlockMap(hint int, t *segTables) blockMap {
	if hint <= 0 {
		return blockMap{}
	}
	m := blockMap{seed: newBlockSeed()}
	if hint <= segSlots*7/8 {
		size := minSegSlots
		for size*7/8 < hint {
			size *= 2
		}
		m.dir = []*bmSegment{{slots: make([]blockSlot, size)}}
		return m
	}
	m.depth = mapDepth(hint)
	m.dir = make([]*bmSegment, 1<<m.depth)
	for i := range m.dir {
		m.dir[i] = &bmSegment{slots: t.get(), depth: m.depth}
	}
	return m
}

// mapDepth is the directory depth newBlockMap gives a map for hint
// entries over segSlots*7/8: full-sized segments, each expected to be
// about 60 % full.
func mapDepth(hint int) uint {
	var d uint
	for (1<<d)*segSlots*6/10 < hint {
		d++
	}
	return d
}

// mapTables is the number of full-sized tables newBlockMap takes for hint
// entries.
func mapTables(hint int) int {
	if hint <= segSlots*7/8 {
		return 0
	}
	return 1 << mapDepth(hint)
}

// len returns the number of entries.
func (m *blockMap) len() int { return m.n }

// bytes returns the memory the map holds: its directory and segments (a
// segment fills a run of directory entries).
func (m *blockMap) bytes() int64 {
	b := int64(len(m.dir)) * int64(unsafe.Sizeof((*bmSegment)(nil)))
	var prev *bmSegment
	for _, s := range m.dir {
		if s != prev && s != nil {
			b += int64(unsafe.Sizeof(bmSegment{})) + int64(len(s.slots))*int64(unsafe.Sizeof(blockSlot{}))
		}
		prev = s
	}
	return b
}

// seg returns the segment of hash h.
func (m *blockMap) seg(h uint64) *bmSegment {
	return m.dir[h>>(64-m.depth)] // a shift by 64 is 0
}

// get returns the node eh maps to.
func (m *blockMap) get(eh uint64) (*node, bool) {
	if m.n == 0 {
		return nil, false
	}
	h := m.hash(eh)
	s := m.seg(h)
	mask := len(s.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		sl := &s.slots[i]
		if sl.n == nil {
			return nil, false
		}
		if sl.eh == eh {
			return sl.n, true
		}
	}
}

// bmRef names a slot: lookup's answer, setAt's argument.
type bmRef struct {
	s *bmSegment
	i int
}

// lookup returns the slot of eh and the node it maps to, or, when eh is
// not in the map (n nil), the empty slot where setAt would put it. It
// grows the map first if one more entry would overfill eh's segment, so
// the slot stays valid until the map is next changed. Full-sized tables
// come from t (nil: made).
func (m *blockMap) lookup(eh uint64, t *segTables) (ref bmRef, n *node) {
	if m.dir == nil {
		m.dir = []*bmSegment{{slots: make([]blockSlot, minSegSlots)}}
		m.seed = newBlockSeed()
	}
	h := m.hash(eh)
	s := m.seg(h)
	for (s.n+1)*8 > len(s.slots)*7 {
		m.grow(s, h, t)
		s = m.seg(h)
	}
	mask := len(s.slots) - 1
	for i := int(h) & mask; ; i = (i + 1) & mask {
		sl := &s.slots[i]
		if sl.n == nil || sl.eh == eh {
			return bmRef{s, i}, sl.n
		}
	}
}

// setAt fills the empty slot lookup returned for eh (no change to the map
// since) with eh → n.
func (m *blockMap) setAt(ref bmRef, eh uint64, n *node) {
	ref.s.slots[ref.i] = blockSlot{eh: eh, n: n}
	ref.s.n++
	m.n++
}

// put maps eh to n (not nil), replacing any node eh mapped to. Full-sized
// tables come from t (nil: made).
func (m *blockMap) put(eh uint64, n *node, t *segTables) {
	ref, old := m.lookup(eh, t)
	if old != nil {
		ref.s.slots[ref.i].n = n
		return
	}
	m.setAt(ref, eh, n)
}

// fillSegments puts the pairs (each node not nil) into their segments
// without growing any, and returns how many it added, and the pairs it
// left because their segment was full (for put, which grows it). It
// changes only the segments of the pairs' hashes, and not the map's
// count, to which the caller adds what it added: calls for pairs of
// disjoint sets of segments may run side by side while nothing else
// changes the map (fillNames).
func (m *blockMap) fillSegments(pairs []blockSlot) (added int, over []blockSlot) {
	for _, p := range pairs {
		h := m.hash(p.eh)
		s := m.seg(h)
		if (s.n+1)*8 > len(s.slots)*7 {
			over = append(over, p)
			continue
		}
		mask := len(s.slots) - 1
		for i := int(h) & mask; ; i = (i + 1) & mask {
			sl := &s.slots[i]
			if sl.n == nil {
				*sl = p
				s.n++
				added++
				break
			}
			if sl.eh == p.eh {
				sl.n = p.n
				break
			}
		}
	}
	return added, over
}

// del removes eh, if present.
func (m *blockMap) del(eh uint64) {
	if m.n == 0 {
		return
	}
	h := m.hash(eh)
	s := m.seg(h)
	mask := len(s.slots) - 1
	i := int(h) & mask
	for {
		sl := &s.slots[i]
		if sl.n == nil {
			return
		}
		if sl.eh == eh {
			break
		}
		i = (i + 1) & mask
	}
	// Close the hole at i: move back each later entry of the run whose
	// home is not between the hole and it (cyclically), i.e. which a probe
	// from its home would no longer reach across the hole.
	for j := (i + 1) & mask; s.slots[j].n != nil; j = (j + 1) & mask {
		home := int(m.hash(s.slots[j].eh)) & mask
		if (j-home)&mask >= (j-i)&mask {
			s.slots[i] = s.slots[j]
			i = j
		}
	}
	s.slots[i] = blockSlot{}
	s.n--
	m.n--
}

// maySplit reports whether the full segment s may split: a split that
// would double the directory must leave its depth within dirSlackBits of
// what the entry count needs, so that keys aimed at one segment cannot
// make the directory outgrow the map.
func (m *blockMap) maySplit(s *bmSegment) bool {
	if s.depth >= maxSegDepth {
		return false
	}
	return s.depth < m.depth || m.depth < uint(bits.Len(uint(m.n/segSlots)))+dirSlackBits
}

// grow makes room in segment s, the segment of hash h: it doubles a small
// segment in place, and splits a full-sized one in two by the next bit of
// the hash, or doubles it in place too when it may not split. Full-sized
// tables come from t and a full-sized table replaced goes back to it.
func (m *blockMap) grow(s *bmSegment, h uint64, t *segTables) {
	if len(s.slots) < segSlots || !m.maySplit(s) {
		old := s.slots
		if 2*len(old) == segSlots {
			s.slots = t.get()
		} else {
			s.slots = make([]blockSlot, 2*len(old))
		}
		s.n = 0
		for _, sl := range old {
			if sl.n != nil {
				s.insert(sl, m.hash(sl.eh))
			}
		}
		t.put(old)
		return
	}
	if s.depth == m.depth {
		// Double the directory: entry i becomes entries 2i and 2i+1.
		dir := make([]*bmSegment, 2*len(m.dir))
		for i, p := range m.dir {
			dir[2*i], dir[2*i+1] = p, p
		}
		m.dir = dir
		m.depth++
	}
	var lo, hi *bmSegment
	if len(s.slots) == segSlots {
		lo, hi = s.split(m.seed, t)
	} else {
		lo, hi = s.splitLarge(m.seed)
	}
	// s filled the directory entries whose top (old) s.depth bits are h's:
	// the first half of that run goes to lo, the second to hi.
	span := 1 << (m.depth - (s.depth - 1))
	first := int(h>>(64-(s.depth-1))) * span // h>>64 is 0
	for i := first; i < first+span/2; i++ {
		m.dir[i] = lo
	}
	for i := first + span/2; i < first+span; i++ {
		m.dir[i] = hi
	}
}

// split splits the full-sized segment s by the hash bit after its depth:
// s becomes the lower half (its entries are copied out and those of the
// lower half put back); only the upper half is a new segment, with a table
// from t.
func (s *bmSegment) split(seed uint64, t *segTables) (lo, hi *bmSegment) {
	var tmp [segSlots]blockSlot
	copy(tmp[:], s.slots)
	clear(s.slots)
	s.n = 0
	s.depth++
	lo = s
	hi = &bmSegment{slots: t.get(), depth: s.depth}
	distribute(tmp[:], seed, 64-s.depth, lo, hi) // bit 64-depth tells lo from hi
	return lo, hi
}

// splitLarge splits a segment grown past segSlots while it could not split
// (maySplit): each half gets a table sized for its share, at least
// segSlots, so that a half holding nearly all the keys again is not
// immediately full. Only maps fed aimed keys come here.
func (s *bmSegment) splitLarge(seed uint64) (lo, hi *bmSegment) {
	bit := 64 - (s.depth + 1)
	nhi := 0
	for _, sl := range s.slots {
		if sl.n != nil && mix64(sl.eh^seed)>>bit&1 != 0 {
			nhi++
		}
	}
	size := func(n int) int {
		sz := segSlots
		for (n+1)*8 > sz*7 {
			sz *= 2
		}
		return sz
	}
	old := s.slots
	s.slots = make([]blockSlot, size(s.n-nhi))
	s.n = 0
	s.depth++
	lo = s
	hi = &bmSegment{slots: make([]blockSlot, size(nhi)), depth: s.depth}
	distribute(old, seed, bit, lo, hi)
	return lo, hi
}

// distribute inserts the entries of slots into lo, or into hi where their
// hash (under seed) has the given bit set.
func distribute(slots []blockSlot, seed uint64, bit uint, lo, hi *bmSegment) {
	for _, sl := range slots {
		if sl.n == nil {
			continue
		}
		kh := mix64(sl.eh ^ seed)
		if kh>>bit&1 == 0 {
			lo.insert(sl, kh)
		} else {
			hi.insert(sl, kh)
		}
	}
}

// insert puts a slot's entry, whose key is not in s and whose hash is kh,
// into s (which has room).
func (s *bmSegment) insert(sl blockSlot, kh uint64) {
	mask := len(s.slots) - 1
	i := int(kh) & mask
	for s.slots[i].n != nil {
		i = (i + 1) & mask
	}
	s.slots[i] = sl
	s.n++
}

// all yields every entry, in an order that depends on the map's seed and
// history: it must not decide anything replicated.
func (m *blockMap) all() iter.Seq2[uint64, *node] {
	return func(yield func(uint64, *node) bool) {
		for i := 0; i < len(m.dir); {
			s := m.dir[i]
			for _, sl := range s.slots {
				if sl.n != nil && !yield(sl.eh, sl.n) {
					return
				}
			}
			i += 1 << (m.depth - s.depth)
		}
	}
}
