package indexer

import "iter"

// blockMap is a rank's engine hash → node map (rankState.blocks): open
// addressing with linear probing over a power-of-two table of (hash, node)
// slots. A slot with a nil node is empty; every key sits in the run of
// full slots that starts at its home slot (mix64 of the key), so a probe
// stops at the first empty slot. A delete shifts the rest of the run back
// over the hole instead of leaving a tombstone (Knuth's algorithm R), so
// probes never pass deleted slots and the table needs no rebuilding under
// churn. The table doubles when it is 7/8 full and never shrinks (like a
// Go map).
//
// Why not a Go map: storing a block looks its engine hash up and, nearly
// always, inserts it; a Go map hashes and probes twice for that, here
// lookup finds the slot the insert then fills (setAt). Growing doubles one
// array; the Go map's incremental growth left about twice the garbage per
// entry on the cluster ingest benchmark, and its hashing and probing were
// a quarter of the index's apply time there.
//
// A blockMap must not be changed while all's iteration runs.
type blockMap struct {
	slots []blockSlot // len is 0 or a power of two
	n     int         // full slots
}

type blockSlot struct {
	eh uint64
	n  *node // nil: empty
}

const blockMapMinSlots = 8

// newBlockMap returns a map with room for hint entries before it grows.
func newBlockMap(hint int) blockMap {
	if hint <= 0 {
		return blockMap{}
	}
	size := blockMapMinSlots
	for size*7/8 < hint {
		size *= 2
	}
	return blockMap{slots: make([]blockSlot, size)}
}

// len returns the number of entries.
func (m *blockMap) len() int { return m.n }

func (m *blockMap) home(eh uint64) int { return int(mix64(eh) & uint64(len(m.slots)-1)) }

// get returns the node eh maps to.
func (m *blockMap) get(eh uint64) (*node, bool) {
	if m.n == 0 {
		return nil, false
	}
	mask := len(m.slots) - 1
	for i := m.home(eh); ; i = (i + 1) & mask {
		s := &m.slots[i]
		if s.n == nil {
			return nil, false
		}
		if s.eh == eh {
			return s.n, true
		}
	}
}

// lookup returns the slot of eh and the node it maps to, or, when eh is
// not in the map (n nil), the empty slot where setAt would put it. It
// grows the table first if one more entry would overfill it, so the slot
// stays valid until the map is next changed.
func (m *blockMap) lookup(eh uint64) (slot int, n *node) {
	if (m.n+1)*8 > len(m.slots)*7 {
		m.grow()
	}
	mask := len(m.slots) - 1
	for i := m.home(eh); ; i = (i + 1) & mask {
		s := &m.slots[i]
		if s.n == nil || s.eh == eh {
			return i, s.n
		}
	}
}

// setAt fills slot (an empty one that lookup returned for eh, with no
// change to the map since) with eh → n.
func (m *blockMap) setAt(slot int, eh uint64, n *node) {
	m.slots[slot] = blockSlot{eh: eh, n: n}
	m.n++
}

// put maps eh to n (not nil), replacing any node eh mapped to.
func (m *blockMap) put(eh uint64, n *node) {
	i, old := m.lookup(eh)
	if old != nil {
		m.slots[i].n = n
		return
	}
	m.setAt(i, eh, n)
}

// del removes eh, if present.
func (m *blockMap) del(eh uint64) {
	if m.n == 0 {
		return
	}
	mask := len(m.slots) - 1
	i := m.home(eh)
	for {
		s := &m.slots[i]
		if s.n == nil {
			return
		}
		if s.eh == eh {
			break
		}
		i = (i + 1) & mask
	}
	// Close the hole at i: move back each later entry of the run whose
	// home is not between the hole and it (cyclically), i.e. which a probe
	// from its home would no longer reach across the hole.
	for j := (i + 1) & mask; m.slots[j].n != nil; j = (j + 1) & mask {
		h := m.home(m.slots[j].eh)
		if (j-h)&mask >= (j-i)&mask {
			m.slots[i] = m.slots[j]
			i = j
		}
	}
	m.slots[i] = blockSlot{}
	m.n--
}

// grow doubles the table (or makes the first one) and reinserts every entry.
func (m *blockMap) grow() {
	old := m.slots
	size := 2 * len(old)
	if size < blockMapMinSlots {
		size = blockMapMinSlots
	}
	m.slots = make([]blockSlot, size)
	mask := size - 1
	for _, s := range old {
		if s.n == nil {
			continue
		}
		i := m.home(s.eh)
		for m.slots[i].n != nil {
			i = (i + 1) & mask
		}
		m.slots[i] = s
	}
}

// all yields every entry, in no particular order.
func (m *blockMap) all() iter.Seq2[uint64, *node] {
	return func(yield func(uint64, *node) bool) {
		for _, s := range m.slots {
			if s.n != nil && !yield(s.eh, s.n) {
				return
			}
		}
	}
}
