package pool_test

import (
	"errors"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/kvrouter/kvrouter/offload/pool"
)

// model is a deliberately naive reference of the pool's rules: a map of
// blocks and a list in order of use (least recent first). Eviction scans the
// list for the first written, unreferenced block that no block in the pool
// names as its parent; every check is a scan.
type model struct {
	capacity int
	blocks   map[uint64]*mBlock
	order    []uint64 // least recently used first
}

type mBlock struct {
	parent uint64
	refs   int
	ready  bool
}

func newModel(capacity int) *model {
	return &model{capacity: capacity, blocks: map[uint64]*mBlock{}}
}

func (m *model) use(h uint64) {
	m.order = slices.DeleteFunc(m.order, func(x uint64) bool { return x == h })
	m.order = append(m.order, h)
}

func (m *model) hasChild(h uint64) bool {
	for _, b := range m.blocks {
		if b.parent == h {
			return true
		}
	}
	return false
}

// ancestor reports whether anc is h or one of its ancestors in the pool.
func (m *model) ancestor(h, anc uint64) bool {
	seen := map[uint64]bool{}
	for h != 0 && !seen[h] {
		if h == anc {
			return true
		}
		seen[h] = true
		b := m.blocks[h]
		if b == nil {
			return false
		}
		h = b.parent
	}
	return false
}

// reserve returns the evicted hash (0 for none) and the error class.
func (m *model) reserve(h, parent uint64) (uint64, error) {
	if h == 0 || h == parent {
		return 0, pool.ErrInvalid
	}
	if b := m.blocks[h]; b != nil {
		if b.ready {
			m.use(h)
		}
		return 0, pool.ErrExists
	}
	if parent != 0 && m.hasChild(h) && m.ancestor(parent, h) {
		return 0, pool.ErrInvalid
	}
	var victim uint64
	if len(m.blocks) >= m.capacity {
		for _, x := range m.order {
			if b := m.blocks[x]; b.ready && b.refs == 0 && !m.hasChild(x) && x != parent {
				victim = x
				break
			}
		}
		if victim == 0 {
			return 0, pool.ErrFull
		}
		delete(m.blocks, victim)
		m.order = slices.DeleteFunc(m.order, func(x uint64) bool { return x == victim })
	}
	m.blocks[h] = &mBlock{parent: parent}
	m.use(h)
	return victim, nil
}

func (m *model) commit(h uint64) { m.blocks[h].ready = true }

func (m *model) abort(h uint64) {
	delete(m.blocks, h)
	m.order = slices.DeleteFunc(m.order, func(x uint64) bool { return x == h })
}

func (m *model) acquire(h uint64) error {
	b := m.blocks[h]
	if b == nil || !b.ready {
		return pool.ErrNotFound
	}
	b.refs++
	m.use(h)
	return nil
}

func (m *model) release(h uint64) error {
	b := m.blocks[h]
	switch {
	case b == nil || !b.ready:
		return pool.ErrNotFound
	case b.refs == 0:
		return pool.ErrNotHeld
	}
	b.refs--
	return nil
}

func (m *model) stats() (used, pending, referenced, inactive int) {
	for _, b := range m.blocks {
		switch {
		case !b.ready:
			pending++
		case b.refs > 0:
			referenced++
		default:
			inactive++
		}
	}
	return len(m.blocks), pending, referenced, inactive
}

var sentinels = []error{pool.ErrInvalid, pool.ErrExists, pool.ErrFull, pool.ErrNotFound, pool.ErrNotHeld}

// class maps err to the sentinel it wraps (nil for nil).
func class(err error) error {
	for _, s := range sentinels {
		if errors.Is(err, s) {
			return s
		}
	}
	return err
}

func TestPoolMatchesModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		capacity := rapid.IntRange(1, 5).Draw(rt, "capacity")
		s := newSink(t)
		p := newHostPool(t, capacity, s)
		defer p.Close()
		m := newModel(capacity)
		genHash := rapid.Uint64Range(0, 10)
		var pending []pool.Reservation
		universe := []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}

		for step := range rapid.IntRange(1, 80).Draw(rt, "steps") {
			_ = step
			var wantErr error
			var wantEvicted []uint64
			var wantStored []uint64
			var gotErr error
			switch op := rapid.IntRange(0, 5).Draw(rt, "op"); op {
			case 0, 1: // register (op 0) or reserve and hold (op 1)
				h, parent := genHash.Draw(rt, "hash"), genHash.Draw(rt, "parent")
				var victim uint64
				victim, wantErr = m.reserve(h, parent)
				if victim != 0 {
					wantEvicted = []uint64{victim}
				}
				b := pool.Block{Hash: h, Parent: parent, Local: h + 1000}
				r, err := p.Reserve(b)
				gotErr = err
				if err == nil {
					if op == 0 {
						m.commit(h)
						wantStored = []uint64{h}
						check(t, p.Commit(r))
					} else {
						pending = append(pending, r)
					}
				}
			case 2: // commit or abort a held reservation
				if len(pending) == 0 {
					continue
				}
				i := rapid.IntRange(0, len(pending)-1).Draw(rt, "reservation")
				r := pending[i]
				pending = slices.Delete(pending, i, i+1)
				if rapid.Bool().Draw(rt, "commit") {
					m.commit(r.Hash)
					wantStored = []uint64{r.Hash}
					gotErr = p.Commit(r)
				} else {
					m.abort(r.Hash)
					p.Abort(r)
				}
			case 3:
				h := genHash.Draw(rt, "acquire")
				wantErr = m.acquire(h)
				_, gotErr = p.Acquire(h)
				if h == 0 {
					wantErr = pool.ErrInvalid
				}
			case 4, 5:
				h := genHash.Draw(rt, "release")
				wantErr = m.release(h)
				gotErr = p.Release(h)
			}
			if class(gotErr) != wantErr {
				rt.Fatalf("error %v, model says %v", gotErr, wantErr)
			}
			evs := s.take()
			if got := removed(evs); !slices.Equal(got, wantEvicted) {
				rt.Fatalf("evicted %v, model evicts %v", got, wantEvicted)
			}
			var stored []uint64
			for _, b := range storedBlocks(evs) {
				stored = append(stored, b.Hash)
				if mb := m.blocks[b.Hash]; mb == nil || mb.parent != b.Parent || b.Local != b.Hash+1000 {
					rt.Fatalf("STORE %+v does not match the model's %+v", b, mb)
				}
			}
			if !slices.Equal(stored, wantStored) {
				rt.Fatalf("stored %v, model stores %v", stored, wantStored)
			}
			used, pend, ref, inactive := m.stats()
			st := p.Stats()
			if st.Used != used || st.Pending != pend || st.Referenced != ref || st.Inactive != inactive {
				rt.Fatalf("stats %+v, model used %d pending %d referenced %d inactive %d", st, used, pend, ref, inactive)
			}
			got := p.Lookup(universe, nil)
			for i, h := range universe {
				b := m.blocks[h]
				if want := b != nil && b.ready; got[i] != want {
					rt.Fatalf("lookup %d = %v, model says %v", h, got[i], want)
				}
			}
		}
		evs, _ := p.Dump()
		checkParentOrder(t, evs)
		n := 0
		for _, b := range storedBlocks(evs) {
			if mb := m.blocks[b.Hash]; mb == nil || !mb.ready || mb.parent != b.Parent {
				rt.Fatalf("dump has %+v, model has %+v", b, mb)
			}
			n++
		}
		if _, _, ref, inactive := m.stats(); n != ref+inactive {
			rt.Fatalf("dump has %d blocks, model %d", n, ref+inactive)
		}
		p.Abort(pending...)
	})
}
