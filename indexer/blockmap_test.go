package indexer

import (
	"fmt"
	"testing"

	"pgregory.net/rapid"
)

// check verifies the map's invariants: the directory has 1<<depth entries
// and every segment fills the aligned run of them its local depth says;
// every key is in the segment of its hash, reachable from its home slot
// (no empty slot between), once; the counts add up; no segment is fuller
// than 7/8.
func (m *blockMap) check() error {
	if m.dir == nil {
		if m.n != 0 {
			return fmt.Errorf("block map: no segments, count %d", m.n)
		}
		return nil
	}
	if len(m.dir) != 1<<m.depth {
		return fmt.Errorf("block map: directory of %d entries at depth %d", len(m.dir), m.depth)
	}
	total := 0
	seen := map[uint64]bool{}
	for i := 0; i < len(m.dir); {
		s := m.dir[i]
		if s.depth > m.depth {
			return fmt.Errorf("block map: segment depth %d over the directory's %d", s.depth, m.depth)
		}
		span := 1 << (m.depth - s.depth)
		if i%span != 0 {
			return fmt.Errorf("block map: segment at entry %d not aligned to its span %d", i, span)
		}
		for j := i; j < i+span; j++ {
			if m.dir[j] != s {
				return fmt.Errorf("block map: entry %d is not its run's segment", j)
			}
		}
		full := 0
		mask := len(s.slots) - 1
		for k, sl := range s.slots {
			if sl.n == nil {
				continue
			}
			full++
			if seen[sl.eh] {
				return fmt.Errorf("block map: key %#x twice", sl.eh)
			}
			seen[sl.eh] = true
			h := m.hash(sl.eh)
			if m.seg(h) != s {
				return fmt.Errorf("block map: key %#x in the wrong segment", sl.eh)
			}
			for j := int(h) & mask; j != k; j = (j + 1) & mask {
				if s.slots[j].n == nil {
					return fmt.Errorf("block map: key %#x in slot %d, unreachable from its home %d", sl.eh, k, int(h)&mask)
				}
			}
		}
		if full != s.n {
			return fmt.Errorf("block map: segment with %d full slots, count %d", full, s.n)
		}
		if s.n*8 > len(s.slots)*7 {
			return fmt.Errorf("block map: segment of %d entries in %d slots", s.n, len(s.slots))
		}
		total += full
		i += span
	}
	if total != m.n {
		return fmt.Errorf("block map: %d entries in segments, count %d", total, m.n)
	}
	return nil
}

// TestBlockMapMatchesMap runs random puts, lookup-and-fill inserts, gets
// and deletes against a Go map, over key sets of several sizes: small ones
// make runs of colliding keys that deletes shift back, large ones split
// segments and double the directory.
func TestBlockMapMatchesMap(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		nodes := make([]*node, 8)
		for i := range nodes {
			nodes[i] = &node{seq: uint64(i)}
		}
		// Aimed keys share the top 51 bits of their mixed hashes under
		// seed 0, as engine hashes chosen by inverting mix64 would if the
		// seed were known: every split of their segment leaves them all in
		// one half.
		aimed := rapid.Bool().Draw(rt, "aimed")
		seed := uint64(0)
		if !aimed {
			seed = rapid.Uint64().Draw(rt, "seed")
		}
		defer setBlockSeed(seed)()
		m := newBlockMap(rapid.IntRange(0, 40).Draw(rt, "hint"), nil)
		ref := map[uint64]*node{}
		// Small key sets make long colliding runs inside one segment;
		// large ones split segments and double the directory.
		keys := rapid.SampledFrom([]int{20, 200, 5000}).Draw(rt, "keys")
		key := func(i uint64) uint64 {
			if aimed {
				return mix64Inverse(0x5a5a5a5a5a5a5<<13 | i)
			}
			return i * 0x9e3779b97f4a7c15
		}
		for step := rapid.IntRange(0, 3*keys).Draw(rt, "steps"); step > 0; step-- {
			k := key(rapid.Uint64Range(0, uint64(keys)).Draw(rt, "key"))
			n := nodes[rapid.IntRange(0, len(nodes)-1).Draw(rt, "node")]
			switch rapid.IntRange(0, 3).Draw(rt, "op") {
			case 0:
				m.put(k, n, nil)
				ref[k] = n
			case 1:
				slot, old := m.lookup(k, nil)
				if want := ref[k]; old != want {
					rt.Fatalf("lookup %#x: %v, want %v", k, old, want)
				}
				if old == nil {
					m.setAt(slot, k, n)
					ref[k] = n
				}
			case 2:
				m.del(k)
				delete(ref, k)
			case 3:
				got, ok := m.get(k)
				want, wok := ref[k]
				if got != want || ok != wok {
					rt.Fatalf("get %#x: %v %v, want %v %v", k, got, ok, want, wok)
				}
			}
			if keys < 1000 || step%101 == 0 {
				if err := m.check(); err != nil {
					rt.Fatal(err)
				}
			}
		}
		if err := m.check(); err != nil {
			rt.Fatal(err)
		}
		if m.len() != len(ref) {
			rt.Fatalf("len %d, want %d", m.len(), len(ref))
		}
		seen := 0
		for k, n := range m.all() {
			if ref[k] != n {
				rt.Fatalf("all: %#x -> %v, want %v", k, n, ref[k])
			}
			seen++
		}
		if seen != len(ref) {
			rt.Fatalf("all yielded %d entries, want %d", seen, len(ref))
		}
	})
}

// TestBlockMapDeleteShiftsRuns fills a small segment with keys that share
// a home slot and keys homed inside their run, wrapping around the
// segment's end, deletes from the middle, and checks every key is still
// found.
func TestBlockMapDeleteShiftsRuns(t *testing.T) {
	m := newBlockMap(6, nil) // one segment of 8 slots
	home := func(k uint64) int { return int(m.hash(k)) & 7 }
	var same, other []uint64
	for k := uint64(1); len(same) < 3 || len(other) < 3; k++ {
		switch {
		case home(k) == 6 && len(same) < 3:
			same = append(same, k)
		case home(k) == 7 && len(other) < 3:
			other = append(other, k)
		}
	}
	n := &node{}
	// Slots 6, 7, 0 for same; other's keys (home 7) land at 1, 2, 3.
	for _, k := range append(append([]uint64(nil), same...), other...) {
		m.put(k, n, nil)
	}
	if len(m.dir) != 1 || len(m.dir[0].slots) != 8 {
		t.Fatalf("want one segment of 8 slots, have %d segments", len(m.dir))
	}
	if err := m.check(); err != nil {
		t.Fatal(err)
	}
	m.del(same[0]) // the hole at 6 must be filled from the wrapped run
	if err := m.check(); err != nil {
		t.Fatal(err)
	}
	for _, k := range append(same[1:], other...) {
		if _, ok := m.get(k); !ok {
			t.Fatalf("key %#x lost after a delete", k)
		}
	}
	if _, ok := m.get(same[0]); ok {
		t.Fatalf("deleted key %#x still found", same[0])
	}
}

// TestBlockMapSplits grows a map across many segment splits and directory
// doublings, with deletes between, and checks it against a Go map.
func TestBlockMapSplits(t *testing.T) {
	for _, hint := range []int{0, 5000} {
		m := newBlockMap(hint, nil)
		ref := map[uint64]*node{}
		n := &node{}
		for i := uint64(1); i <= 20_000; i++ {
			m.put(i*7919, n, nil)
			ref[i*7919] = n
			if i%3 == 0 {
				m.del((i - 1) * 7919)
				delete(ref, (i-1)*7919)
			}
		}
		if err := m.check(); err != nil {
			t.Fatal(err)
		}
		if m.depth < 3 || m.len() != len(ref) {
			t.Fatalf("hint %d: depth %d, %d entries (want %d)", hint, m.depth, m.len(), len(ref))
		}
		got := 0
		for k := range m.all() {
			if ref[k] == nil {
				t.Fatalf("all yielded %#x, not in the map", k)
			}
			got++
		}
		if got != len(ref) {
			t.Fatalf("all yielded %d entries, want %d", got, len(ref))
		}
	}
}

// mix64Inverse inverts mix64 (the SplitMix64 finaliser is a bijection):
// what anyone who controls engine hashes can compute to aim keys at one
// segment.
func mix64Inverse(y uint64) uint64 {
	unshift := func(x uint64, s uint) uint64 { // inverts x ^= x >> s
		r := x
		for i := uint(0); i < 64/s+1; i++ {
			r = x ^ r>>s
		}
		return r
	}
	inv := func(a uint64) uint64 { // inverse of an odd a mod 2^64 (Newton)
		x := a
		for range 6 {
			x *= 2 - a*x
		}
		return x
	}
	y = unshift(y, 31)
	y *= inv(0x94d049bb133111eb)
	y = unshift(y, 27)
	y *= inv(0xbf58476d1ce4e5b9)
	return unshift(y, 30)
}

// setBlockSeed makes every block map created from now on use seed, and
// returns what puts the random seeds back. Seed 0 is what keys aimed by
// mix64Inverse hit: the seed an attacker would need to know.
func setBlockSeed(seed uint64) (restore func()) {
	old := newBlockSeed
	newBlockSeed = func() uint64 { return seed }
	return func() { newBlockSeed = old }
}

// clusteredKeys returns n engine hashes whose mixed hashes under seed 0
// share their top shared bits (prefix's low shared bits), differing below;
// n at most 1<<(64-shared).
func clusteredKeys(prefix uint64, shared uint, n int) []uint64 {
	keys := make([]uint64, n)
	for i := range keys {
		keys[i] = mix64Inverse(prefix<<(64-shared) | uint64(i))
	}
	return keys
}

func TestMix64Inverse(t *testing.T) {
	for _, x := range []uint64{0, 1, 0x5555555555555400, 1 << 63, ^uint64(0), 0x0123456789abcdef} {
		if got := mix64(mix64Inverse(x)); got != x {
			t.Fatalf("mix64(mix64Inverse(%#x)) = %#x", x, got)
		}
	}
}

// TestBlockMapClusteredHashes: keys whose mixed hashes share their top 54
// bits (two full groups of 1024, 53 bits shared between them) and a second
// cluster sharing 40, among random keys. Every split of their segment
// leaves all of them in one half; before the directory's depth was bounded
// by the entry count, the first put past a segment's 7/8 split it again
// and again, doubling the directory towards 2^54 entries (out of memory).
// The directory must stay small, and the map must still agree with a Go
// map through deletes and reinserts.
func TestBlockMapClusteredHashes(t *testing.T) {
	t.Cleanup(setBlockSeed(0)) // the keys are aimed at seed 0
	keys := clusteredKeys(0x5555555555555400>>10>>1, 53, 2048)
	keys = append(keys, clusteredKeys(0xabcdef1234, 40, 1500)...)
	for i := uint64(1); i <= 1000; i++ {
		keys = append(keys, i*0x9e3779b97f4a7c15)
	}
	for _, hint := range []int{0, 100, 5000} {
		m := newBlockMap(hint, nil)
		ref := map[uint64]*node{}
		nodes := []*node{{seq: 1}, {seq: 2}}
		for i, k := range keys {
			m.put(k, nodes[i%2], nil)
			ref[k] = nodes[i%2]
			if m.depth > 8 {
				t.Fatalf("hint %d: %d entries made a directory of depth %d", hint, m.len(), m.depth)
			}
		}
		blockMapAgrees(t, &m, ref)
		for i, k := range keys {
			if i%3 != 0 {
				m.del(k)
				delete(ref, k)
			}
		}
		blockMapAgrees(t, &m, ref)
		for i, k := range keys {
			if i%3 == 1 {
				if s, old := m.lookup(k, nil); old == nil {
					m.setAt(s, k, nodes[0])
					ref[k] = nodes[0]
				}
			}
		}
		blockMapAgrees(t, &m, ref)
		// Normal growth afterwards: the deep segments split again once the
		// entry count allows a deeper directory.
		for i := uint64(1); i <= 30_000; i++ {
			k := mix64(i ^ 0xfeed)
			m.put(k, nodes[1], nil)
			ref[k] = nodes[1]
		}
		blockMapAgrees(t, &m, ref)
		t.Logf("hint %d: %d entries, directory depth %d, %d KiB", hint, m.len(), m.depth, m.bytes()>>10)
		if lim := 16 * (m.len()/segSlots + 1); len(m.dir) > lim {
			t.Fatalf("hint %d: %d entries, directory of %d (over %d)", hint, m.len(), len(m.dir), lim)
		}
	}
}

// TestBlockMapClusteredMemory: the memory of a map of aimed keys stays
// within a small multiple of that of random keys.
func TestBlockMapClusteredMemory(t *testing.T) {
	t.Cleanup(setBlockSeed(0)) // the keys are aimed at seed 0
	var aimed, random blockMap
	nd := &node{}
	for i := uint64(0); i < 64; i++ {
		// 64 clusters of 1000 keys, each sharing 50 bits.
		for _, k := range clusteredKeys(mix64(i)>>14, 50, 1000) {
			aimed.put(k, nd, nil)
		}
	}
	for i := uint64(0); i < uint64(aimed.len()); i++ {
		random.put(mix64(i), nd, nil)
	}
	if err := aimed.check(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d entries: aimed %d KiB (depth %d), random %d KiB (depth %d)",
		aimed.len(), aimed.bytes()>>10, aimed.depth, random.bytes()>>10, random.depth)
	if aimed.bytes() > 20*random.bytes() {
		t.Fatalf("aimed keys take %d KiB, random ones %d KiB", aimed.bytes()>>10, random.bytes()>>10)
	}
}

// blockMapAgrees checks m's invariants and that gets and all agree with
// ref.
func blockMapAgrees(t *testing.T, m *blockMap, ref map[uint64]*node) {
	t.Helper()
	if err := m.check(); err != nil {
		t.Fatal(err)
	}
	if m.len() != len(ref) {
		t.Fatalf("len %d, want %d", m.len(), len(ref))
	}
	for k, want := range ref {
		if got, ok := m.get(k); !ok || got != want {
			t.Fatalf("get %#x: %v %v, want %v", k, got, ok, want)
		}
	}
	seen := 0
	for k, n := range m.all() {
		if ref[k] != n {
			t.Fatalf("all: %#x -> %v, want %v", k, n, ref[k])
		}
		seen++
	}
	if seen != len(ref) {
		t.Fatalf("all yielded %d entries, want %d", seen, len(ref))
	}
}

// probeDistance returns the sum over m's keys of how far each sits past
// its home slot: the extra slots a lookup of every key reads.
func (m *blockMap) probeDistance() (sum, most int) {
	for i := 0; i < len(m.dir); {
		s := m.dir[i]
		mask := len(s.slots) - 1
		for k, sl := range s.slots {
			if sl.n != nil {
				d := (k - int(m.hash(sl.eh))) & mask
				sum += d
				most = max(most, d)
			}
		}
		i += 1 << (m.depth - s.depth)
	}
	return sum, most
}

// TestBlockMapAimedAtOneHomeSlot: 40,000 engine hashes chosen (by
// inverting mix64) so that, were the seed 0, they would share one segment
// and one home slot in it. Unseeded, every lookup probed past all the
// keys before it: 2.75 s to insert them in a review, quadratic, on every
// replica. A map's own random seed spreads them like any keys.
func TestBlockMapAimedAtOneHomeSlot(t *testing.T) {
	const n = 40_000
	keys := make([]uint64, n)
	for i := range keys {
		// Top 14 and low 26 bits shared: no split the directory bound
		// allows separates them, and a segment of up to 2^26 slots gives
		// them one home.
		keys[i] = mix64Inverse(0x2a5a<<50 | uint64(i)<<26 | 0x155_5555)
	}
	var m blockMap
	nd := &node{}
	for _, k := range keys {
		m.put(k, nd, nil)
	}
	if err := m.check(); err != nil {
		t.Fatal(err)
	}
	sum, most := m.probeDistance()
	t.Logf("seed %#x: %d keys, %d segments' directory, probe distance mean %.2f, max %d",
		m.seed, m.len(), len(m.dir), float64(sum)/n, most)
	if sum > 8*n {
		t.Fatalf("%d aimed keys sit %d slots past their homes in all (mean %.1f): aimed keys still collide",
			n, sum, float64(sum)/n)
	}
}

// TestBlockMapFillSegmentsLeavesFullSegmentsToPut: fillSegments, the
// names' parallel fill, adds pairs without growing any segment; the pairs
// of a segment that fills up are left over, in order, and put then grows
// it: the map ends holding every pair, with its invariants, as one put
// after another leaves it.
func TestBlockMapFillSegmentsLeavesFullSegmentsToPut(t *testing.T) {
	m := newBlockMap(4*segSlots, nil) // sized at once: every segment at the directory's depth
	if m.depth == 0 {
		t.Fatalf("a map sized for %d keys has one segment", 4*segSlots)
	}
	// Keys of segment 0 to past its 7/8, then some of the others'.
	first := m.dir[0]
	var pairs []blockSlot
	nodes := map[uint64]*node{}
	in0, others := 0, 0
	for k := uint64(1); in0 < segSlots; k++ {
		if m.seg(m.hash(k)) == first {
			in0++
		} else if others < 300 {
			others++
		} else {
			continue
		}
		n := &node{seq: k}
		nodes[k] = n
		pairs = append(pairs, blockSlot{eh: k, n: n})
	}
	added, over := m.fillSegments(pairs)
	if want := segSlots - segSlots*7/8; len(over) != want {
		t.Fatalf("%d pairs left over, want the %d past segment 0's 7/8", len(over), want)
	}
	if added+len(over) != len(pairs) {
		t.Fatalf("added %d and left %d of %d pairs", added, len(over), len(pairs))
	}
	for _, p := range over {
		if m.seg(m.hash(p.eh)) != first {
			t.Fatalf("pair %#x left over, but its segment is not the full one", p.eh)
		}
	}
	m.n += added
	for _, p := range over {
		m.put(p.eh, p.n, nil) // splits segment 0
	}
	blockMapAgrees(t, &m, nodes)
}
