// Package rankmap is a map keyed by rank that also finds one worker's
// ranks in time proportional to their number.
//
// Why: removing a worker (a lease expiry, the leader's removal of a stray
// worker) must find its ranks, and a scan of every rank for each removal
// made removing many workers quadratic on every replica: 16,000 stray
// workers of one rank each took 10 s of apply per replica, 32,000 took
// 36 s (raftfsm's BenchmarkRemoveManyWorkers measures it now).
//
// Invariant: for every worker w, the list of w holds exactly the dp ranks
// d with (w, d) in the map, each once, and each rank's entry keeps its
// position in that list; no worker has an empty list. A lookup is one Go
// map lookup, as with a plain map; a store of a new key and a delete also
// touch the worker's list, in O(1) (a delete moves the list's last dp
// into the hole: a scan of the list made removing a worker of k ranks
// O(k²)).
package rankmap

import (
	"iter"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Map is a map from rank to V. The zero value is an empty map ready to
// use. It is not safe for concurrent use; its owner locks.
type Map[V any] struct {
	m   map[kvevent.Rank]entry[V]
	dps map[uint64][]uint32 // worker -> its dp ranks in m, in no order
}

// entry is a rank's value and the position of its dp in its worker's list.
type entry[V any] struct {
	v V
	i uint32
}

// Len returns the number of ranks in the map.
func (m *Map[V]) Len() int { return len(m.m) }

// Get returns r's value, and whether r is in the map.
func (m *Map[V]) Get(r kvevent.Rank) (V, bool) {
	e, ok := m.m[r]
	return e.v, ok
}

// Set stores v as r's value.
func (m *Map[V]) Set(r kvevent.Rank, v V) {
	if m.m == nil {
		m.m, m.dps = map[kvevent.Rank]entry[V]{}, map[uint64][]uint32{}
	}
	e, ok := m.m[r]
	if !ok { // a new key
		dps := m.dps[r.Worker]
		e.i = uint32(len(dps))
		m.dps[r.Worker] = append(dps, r.DP)
	}
	e.v = v
	m.m[r] = e
}

// Delete removes r and reports whether it was in the map.
func (m *Map[V]) Delete(r kvevent.Rank) bool {
	e, ok := m.m[r]
	if !ok {
		return false
	}
	delete(m.m, r)
	dps := m.dps[r.Worker]
	last := len(dps) - 1
	if last == 0 {
		delete(m.dps, r.Worker)
		return true
	}
	if int(e.i) != last {
		moved := kvevent.Rank{Worker: r.Worker, DP: dps[last]}
		dps[e.i] = moved.DP
		me := m.m[moved]
		me.i = e.i
		m.m[moved] = me
	}
	m.dps[r.Worker] = dps[:last]
	return true
}

// WorkerRanks appends worker's ranks in the map to dst, sorted, and
// returns the extended slice.
func (m *Map[V]) WorkerRanks(dst []kvevent.Rank, worker uint64) []kvevent.Rank {
	n := len(dst)
	for _, dp := range m.dps[worker] {
		dst = append(dst, kvevent.Rank{Worker: worker, DP: dp})
	}
	slices.SortFunc(dst[n:], kvevent.Rank.Compare)
	return dst
}

// All yields every rank and its value, in no particular order. The map
// must not change during the iteration.
func (m *Map[V]) All() iter.Seq2[kvevent.Rank, V] {
	return func(yield func(kvevent.Rank, V) bool) {
		for r, e := range m.m {
			if !yield(r, e.v) {
				return
			}
		}
	}
}
