package indexer

import (
	"fmt"
	"testing"

	"pgregory.net/rapid"
)

// check verifies the table's invariants: the count of full slots, and
// that every key is found from its home slot (no empty slot between its
// home and it), once.
func (m *blockMap) check() error {
	full := 0
	seen := map[uint64]bool{}
	mask := len(m.slots) - 1
	for i, s := range m.slots {
		if s.n == nil {
			continue
		}
		full++
		if seen[s.eh] {
			return fmt.Errorf("block map: key %#x twice", s.eh)
		}
		seen[s.eh] = true
		for j := m.home(s.eh); j != i; j = (j + 1) & mask {
			if m.slots[j].n == nil {
				return fmt.Errorf("block map: key %#x in slot %d, unreachable from its home %d", s.eh, i, m.home(s.eh))
			}
		}
	}
	if full != m.n {
		return fmt.Errorf("block map: %d full slots, count %d", full, m.n)
	}
	if len(m.slots) > 0 && m.n*8 > len(m.slots)*7 {
		return fmt.Errorf("block map: %d entries in %d slots", m.n, len(m.slots))
	}
	return nil
}

// TestBlockMapMatchesMap runs random puts, lookup-and-fill inserts, gets
// and deletes against a Go map. Keys come from a small set, so that runs
// of colliding keys form and deletes shift them back.
func TestBlockMapMatchesMap(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		nodes := make([]*node, 8)
		for i := range nodes {
			nodes[i] = &node{seq: uint64(i)}
		}
		m := newBlockMap(rapid.IntRange(0, 40).Draw(rt, "hint"))
		ref := map[uint64]*node{}
		keys := rapid.IntRange(1, 200).Draw(rt, "keys")
		for step := rapid.IntRange(0, 600).Draw(rt, "steps"); step > 0; step-- {
			k := rapid.Uint64Range(0, uint64(keys)).Draw(rt, "key") * 0x9e3779b97f4a7c15
			n := nodes[rapid.IntRange(0, len(nodes)-1).Draw(rt, "node")]
			switch rapid.IntRange(0, 3).Draw(rt, "op") {
			case 0:
				m.put(k, n)
				ref[k] = n
			case 1:
				slot, old := m.lookup(k)
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
			if err := m.check(); err != nil {
				rt.Fatal(err)
			}
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

// TestBlockMapDeleteShiftsRuns fills a small table with keys that share a
// home slot and keys homed inside their run, deletes from the middle, and
// checks every key is still found.
func TestBlockMapDeleteShiftsRuns(t *testing.T) {
	m := newBlockMap(6) // 8 slots
	var same, other []uint64
	for k := uint64(1); len(same) < 3 || len(other) < 3; k++ {
		switch {
		case m.home(k) == 6 && len(same) < 3:
			same = append(same, k)
		case m.home(k) == 7 && len(other) < 3:
			other = append(other, k)
		}
	}
	n := &node{}
	// Slots 6, 7, 0 for same; other's keys (home 7) land at 1, 2, 3.
	for _, k := range append(append([]uint64(nil), same...), other...) {
		m.put(k, n)
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
