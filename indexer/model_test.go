package indexer

import (
	"cmp"
	"fmt"
	"math/bits"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/kvevent"
)

// model is a deliberately naive reference of the index's rules: blocks are
// identified by their full path of content hashes (a string key), nothing
// is shared, and every query is answered by brute force.
type model struct {
	cfg     Config
	ranks   map[kvevent.Rank]*mRank
	evicted uint64 // entries dropped from a tier for capacity
}

type mEntry struct {
	path  []uint64
	mask  kvevent.Mask
	order uint32 // the rank's store counter when the residency began
}

type mRank struct {
	blocks       map[uint64]mEntry
	orphans      []orphan
	needsResync  bool
	cap          [kvevent.NumTiers]int64 // 0: unbounded
	order        uint32                  // counts new residencies
	overCapacity bool                    // a tier went past its capacity and slack
}

func newModel(cfg Config) *model {
	return &model{cfg: cfg.withDefaults(), ranks: map[kvevent.Rank]*mRank{}}
}

func pathKey(p []uint64) string {
	var b strings.Builder
	for _, h := range p {
		fmt.Fprintf(&b, "%x/", h)
	}
	return b.String()
}

func (m *model) rank(r kvevent.Rank, create bool) *mRank {
	mr := m.ranks[r]
	if mr == nil && create {
		mr = &mRank{blocks: map[uint64]mEntry{}}
		m.ranks[r] = mr
	}
	return mr
}

// wellFormed is the model's own reading of what a valid event is
// (kvevent's Event doc and semantics.md), written out here rather than
// calling kvevent.Event.Validate, so that a Validate that refuses a good
// event (or takes a bad one) disagrees with the model: a tier in range; a
// known kind; a store with at least one block, no engine hash twice, and
// no block that is its parent (the first, its own; a later one, its
// descendant); a remove with at least one hash. A clear carries nothing
// and is always good.
func wellFormed(ev *kvevent.Event) bool {
	if ev.Tier >= kvevent.NumTiers {
		return false
	}
	switch ev.Kind {
	case kvevent.KindStored:
		if len(ev.Blocks) == 0 {
			return false
		}
		seen := map[uint64]bool{}
		if ev.HasParent {
			seen[ev.Parent] = true
		}
		for _, b := range ev.Blocks {
			if seen[b.EngineHash] {
				return false
			}
			seen[b.EngineHash] = true
		}
		return true
	case kvevent.KindRemoved:
		return len(ev.Removed) > 0
	case kvevent.KindCleared:
		return true
	default:
		return false
	}
}

// apply applies ev and reports whether it was well formed (a malformed
// event changes nothing).
func (m *model) apply(ev *kvevent.Event, now int64) bool {
	if !wellFormed(ev) {
		return false
	}
	switch ev.Kind {
	case kvevent.KindStored:
		mr := m.rank(ev.Rank, true)
		m.expire(mr, now)
		m.store(mr, ev.Tier, ev.HasParent, ev.Parent, ev.Blocks, now, true)
	case kvevent.KindRemoved:
		mr := m.rank(ev.Rank, false)
		if mr == nil {
			return true
		}
		m.expire(mr, now)
		for _, eh := range ev.Removed {
			m.remove(mr, eh, ev.Tier, true)
		}
	case kvevent.KindCleared:
		if mr := m.rank(ev.Rank, false); mr != nil {
			// The rank keeps its capacity and its store counter.
			mr.blocks = map[uint64]mEntry{}
			mr.orphans = nil
			mr.needsResync = false
			mr.overCapacity = false
		}
	}
	return true
}

func (m *model) expire(mr *mRank, now int64) {
	// A held store is never later than the time the rank is given: one
	// stamped later (time went back) is taken as held now.
	for i := range mr.orphans {
		mr.orphans[i].at = min(mr.orphans[i].at, now)
	}
	for len(mr.orphans) > 0 && now-mr.orphans[0].at > int64(m.cfg.OrphanTTL) {
		mr.orphans = mr.orphans[1:]
		mr.needsResync = true
	}
}

// expireAll is ExpireOrphans: every rank's held stores aged at now.
func (m *model) expireAll(now int64) {
	for _, mr := range m.ranks {
		m.expire(mr, now)
	}
}

func orphanBlocks(os []orphan) int {
	n := 0
	for _, o := range os {
		n += len(o.blocks)
	}
	return n
}

func (m *model) store(mr *mRank, t kvevent.Tier, hasParent bool, parent uint64, blocks []kvevent.Block, now int64, hold bool) {
	var path []uint64
	if hasParent {
		e, ok := mr.blocks[parent]
		if !ok {
			if !hold {
				return
			}
			if len(blocks) > m.cfg.OrphanMaxBlocks {
				mr.needsResync = true
				return
			}
			mr.orphans = append(mr.orphans, orphan{at: now, tier: t, parent: parent, blocks: slices.Clone(blocks)})
			for len(mr.orphans) > m.cfg.OrphanMaxEvents || orphanBlocks(mr.orphans) > m.cfg.OrphanMaxBlocks {
				mr.orphans = mr.orphans[1:]
				mr.needsResync = true
			}
			return
		}
		path = slices.Clone(e.path)
	}
	for _, b := range blocks {
		path = append(path, b.LocalHash)
		key := pathKey(path)
		if !hold && m.takesAName(mr, key, b.EngineHash) {
			// An adopted store is older than whatever gave the name: it
			// is cut here, with the rest of its blocks, no resync asked
			// (the agent's mirror, which a dump is, cut it too).
			break
		}
		if e, ok := mr.blocks[b.EngineHash]; ok && pathKey(e.path) != key {
			delete(mr.blocks, b.EngineHash)
		}
		// The residency at this path, under this engine hash or another,
		// keeps its tiers and its age; a new one is the youngest.
		var mask kvevent.Mask
		var order uint32
		found := false
		for eh, e := range mr.blocks {
			if pathKey(e.path) == key {
				mask, order, found = e.mask, e.order, true
				delete(mr.blocks, eh)
			}
		}
		if !found {
			mr.order++
			order = mr.order
		}
		mr.blocks[b.EngineHash] = mEntry{path: slices.Clone(path), mask: mask | t.Bit(), order: order}
	}
	for i := 0; i < len(mr.orphans); {
		o := mr.orphans[i]
		if _, ok := mr.blocks[o.parent]; !ok {
			i++
			continue
		}
		mr.orphans = slices.Delete(slices.Clone(mr.orphans), i, i+1)
		m.store(mr, o.tier, true, o.parent, o.blocks, now, false)
		i = 0
	}
	m.enforce(mr, t)
}

// takesAName reports whether storing eh at the path would move eh from
// another path or rename the path, held under another engine hash.
func (m *model) takesAName(mr *mRank, key string, eh uint64) bool {
	for h, e := range mr.blocks {
		if (h == eh) != (pathKey(e.path) == key) {
			return true
		}
	}
	return false
}

// setCapacity sets the rank's capacity (creating it) and enforces it in
// every tier.
func (m *model) setCapacity(r kvevent.Rank, c [kvevent.NumTiers]int64) {
	mr := m.rank(r, true)
	mr.cap = c
	for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
		m.enforce(mr, t)
	}
}

// enforce applies the capacity rule (semantics.md §3, DESIGN.md) to tier
// t, by brute force: past capacity plus slack, the tier is cleared on the
// oldest entries down to the capacity, and the rank is flagged. An entry
// is as old as the youngest entry at or below it along a chain the rank
// holds in t without a gap; among entries of one age the deepest goes
// first (a chain is trimmed from its leaf), then the lower engine hash.
func (m *model) enforce(mr *mRank, t kvevent.Tier) {
	c := mr.cap[t]
	if c <= 0 {
		return
	}
	type aged struct {
		eh          uint64
		young, tail uint32 // the youngest order below, and how many blocks below it is
	}
	var held []aged
	inT := map[string]bool{}
	for _, e := range mr.blocks {
		if e.mask.Has(t) {
			inT[pathKey(e.path)] = true
		}
	}
	if int64(len(inT)) <= c+int64(float64(c)*m.cfg.CapacitySlack) {
		return
	}
	mr.overCapacity = true
	for eh, x := range mr.blocks {
		if !x.mask.Has(t) {
			continue
		}
		a := aged{eh: eh, young: x.order}
		for _, y := range mr.blocks {
			if !y.mask.Has(t) || len(y.path) <= len(x.path) || !slices.Equal(y.path[:len(x.path)], x.path) {
				continue
			}
			unbroken := true
			for d := len(x.path) + 1; d < len(y.path); d++ {
				if !inT[pathKey(y.path[:d])] {
					unbroken = false
					break
				}
			}
			if unbroken && y.order > a.young {
				a.young, a.tail = y.order, uint32(len(y.path)-len(x.path))
			}
		}
		held = append(held, a)
	}
	slices.SortFunc(held, func(a, b aged) int {
		if a.young != b.young {
			return cmp.Compare(a.young, b.young)
		}
		if a.tail != b.tail {
			return cmp.Compare(a.tail, b.tail)
		}
		return cmp.Compare(a.eh, b.eh)
	})
	for _, a := range held[:int64(len(held))-c] {
		m.remove(mr, a.eh, t, false)
		m.evicted++
	}
}

// remove clears tier t of eh; engine says the engine removed it, not a
// capacity trim, which leaves held stores alone.
func (m *model) remove(mr *mRank, eh uint64, t kvevent.Tier, engine bool) {
	// Every held store of eh in t is cut, whether eh is held in t,
	// elsewhere or not at all: adopted later, it would undo the remove.
	if engine {
		var kept []orphan
		for _, o := range mr.orphans {
			j := slices.IndexFunc(o.blocks, func(b kvevent.Block) bool { return b.EngineHash == eh })
			switch {
			case o.tier != t || j < 0:
				kept = append(kept, o)
			case j > 0:
				o.blocks = o.blocks[:j]
				kept = append(kept, o)
			}
		}
		mr.orphans = kept
	}
	e, ok := mr.blocks[eh]
	if !ok || !e.mask.Has(t) {
		return
	}
	e.mask &^= t.Bit()
	if e.mask == 0 {
		delete(mr.blocks, eh)
	} else {
		mr.blocks[eh] = e
	}
}

func (m *model) removeWorker(w uint64) {
	for r := range m.ranks {
		if r.Worker == w {
			delete(m.ranks, r)
		}
	}
}

// maskAt returns the rank's mask at the path, 0 when it holds nothing there.
func (mr *mRank) maskAt(key string) kvevent.Mask {
	for _, e := range mr.blocks {
		if pathKey(e.path) == key {
			return e.mask
		}
	}
	return 0
}

// nodeExists: some rank holds the path or a descendant of it.
func (m *model) nodeExists(key string) bool {
	for _, mr := range m.ranks {
		for _, e := range mr.blocks {
			if strings.HasPrefix(pathKey(e.path), key) {
				return true
			}
		}
	}
	return false
}

// matchLen returns the rank's contiguous match in blocks per tier, capped at limit.
func (mr *mRank) match(hashes []uint64, view View, limit int) [kvevent.NumTiers]uint32 {
	var out [kvevent.NumTiers]uint32
	phase := -1
	for d := 0; d < limit && d < len(hashes); d++ {
		mk := mr.maskAt(pathKey(hashes[:d+1]))
		if mk == 0 {
			break
		}
		if view == ViewDedup {
			out[0]++
			continue
		}
		if phase < 0 {
			phase = bits.TrailingZeros8(uint8(mk))
		} else if !mk.Has(kvevent.Tier(phase)) {
			higher := uint8(mk) &^ (1<<(phase+1) - 1)
			if higher == 0 {
				break
			}
			phase = bits.TrailingZeros8(higher)
		}
		out[phase]++
	}
	return out
}

func (m *model) find(hashes []uint64, view View, earlyExit bool) (map[kvevent.Rank][kvevent.NumTiers]uint32, []uint32) {
	res := map[kvevent.Rank][kvevent.NumTiers]uint32{}
	var freq []uint32
	if len(hashes) == 0 || !m.nodeExists(pathKey(hashes[:1])) {
		return res, freq
	}
	holdersAt := func(d int) (n uint32) {
		k := pathKey(hashes[:d+1])
		for _, mr := range m.ranks {
			if mr.maskAt(k) != 0 {
				n++
			}
		}
		return n
	}
	full := map[kvevent.Rank]uint32{}
	for r, mr := range m.ranks {
		c := mr.match(hashes, view, len(hashes))
		full[r] = c[0] + c[1] + c[2] + c[3]
	}
	activeAt := func(d int) (n int) { // ranks matching at least d+1 blocks
		for _, t := range full {
			if int(t) >= d+1 {
				n++
			}
		}
		return n
	}
	freq = append(freq, holdersAt(0))
	walked := 1
	active := activeAt(0)
	for d := 1; d < len(hashes); d++ {
		if active == 0 || (earlyExit && active == 1) {
			break
		}
		if !m.nodeExists(pathKey(hashes[:d+1])) {
			break
		}
		freq = append(freq, holdersAt(d))
		walked = d + 1
		active = activeAt(d)
	}
	for r, mr := range m.ranks {
		if mr.maskAt(pathKey(hashes[:1])) != 0 {
			res[r] = mr.match(hashes, view, walked)
		}
	}
	return res, freq
}

func (m *model) digest() uint64 {
	var d uint64
	for r, mr := range m.ranks {
		rk := rankKey(r)
		for eh, e := range mr.blocks {
			seq := kvevent.SequenceHashes(nil, e.path)
			d += residencyTerm(rk, seq[len(seq)-1], eh, e.mask)
		}
		for i := range mr.orphans {
			o := &mr.orphans[i]
			parent := o.parent
			for _, b := range o.blocks {
				d += orphanTerm(rk, parent, b.EngineHash, b.LocalHash, o.tier)
				parent = b.EngineHash
			}
		}
	}
	return d
}

// checkState compares every rank's state in ix, as DumpRank shows it, with
// the model's, without the digest's hashing: each engine hash's path of
// content hashes and tier mask, and the held orphans in order. A rank that
// either side does not know counts as empty.
func (m *model) checkState(t interface{ Fatalf(string, ...any) }, ix *Index) {
	ranks := map[kvevent.Rank]bool{}
	for r := range m.ranks {
		ranks[r] = true
	}
	for _, r := range ix.Ranks() {
		ranks[r] = true
	}
	for r := range ranks {
		var d RankDump
		if slices.Contains(ix.Ranks(), r) {
			var err error
			if d, err = ix.DumpRank(r); err != nil {
				t.Fatalf("dump %v: %v", r, err)
			}
		}
		bySeq := map[uint64]DumpNode{}
		for _, n := range d.Nodes {
			bySeq[n.Seq] = n
		}
		got := map[uint64]string{}
		for _, e := range d.Entries {
			var path []uint64
			for n := bySeq[e.Seq]; ; n = bySeq[n.Parent] {
				path = append(path, n.Local)
				if n.Root {
					break
				}
			}
			slices.Reverse(path)
			got[e.EngineHash] = fmt.Sprintf("%s mask %v order %d", pathKey(path), e.Mask, e.Order)
		}
		want := map[uint64]string{}
		var wantOrphans []DumpOrphan
		var wantCap [kvevent.NumTiers]int64
		var wantOrder uint32
		if mr := m.ranks[r]; mr != nil {
			wantCap, wantOrder = mr.cap, mr.order
			for eh, e := range mr.blocks {
				want[eh] = fmt.Sprintf("%s mask %v order %d", pathKey(e.path), e.mask, e.order)
			}
			for _, o := range mr.orphans {
				wantOrphans = append(wantOrphans, DumpOrphan{At: o.at, Tier: o.tier, Parent: o.parent, Blocks: o.blocks})
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("rank %v holds %v, model %v", r, got, want)
		}
		if fmt.Sprint(d.Orphans) != fmt.Sprint(wantOrphans) {
			t.Fatalf("rank %v orphans %v, model %v", r, d.Orphans, wantOrphans)
		}
		if d.Capacity != wantCap || d.Order != wantOrder {
			t.Fatalf("rank %v capacity %v store counter %d, model %v %d", r, d.Capacity, d.Order, wantCap, wantOrder)
		}
	}
}

// checkCapacity compares what the index reports of capacity with the
// model: the evictions, each rank's over-capacity flag, and the bound
// itself (no tier past its capacity and slack after any step).
func (m *model) checkCapacity(t interface{ Fatalf(string, ...any) }, ix *Index) {
	if got := ix.Stats().Counters.CapacityEvicted; got != m.evicted {
		t.Fatalf("%d entries evicted for capacity, model %d", got, m.evicted)
	}
	for _, st := range ix.RankStats() {
		mr := m.ranks[st.Rank]
		if mr == nil {
			t.Fatalf("rank %v unknown to the model", st.Rank)
		}
		if st.OverCapacity != mr.overCapacity {
			t.Fatalf("rank %v over capacity: index %v, model %v", st.Rank, st.OverCapacity, mr.overCapacity)
		}
		for tr, c := range st.Capacity {
			if c > 0 && st.Blocks[tr] > c+int64(float64(c)*m.cfg.CapacitySlack) {
				t.Fatalf("rank %v holds %d blocks in tier %d, capacity %d", st.Rank, st.Blocks[tr], tr, c)
			}
		}
	}
}

// checkStats compares RankStats (per-tier blocks, held stores, the resync
// flag) with the model, and Stats with their sum over the ranks.
func (m *model) checkStats(t interface{ Fatalf(string, ...any) }, ix *Index) {
	var sum [kvevent.NumTiers]int64
	orphans, oblocks, resync, over := 0, 0, 0, 0
	for _, st := range ix.RankStats() {
		mr := m.ranks[st.Rank]
		if mr == nil {
			t.Fatalf("rank %v unknown to the model", st.Rank)
		}
		var want [kvevent.NumTiers]int64
		for _, e := range mr.blocks {
			for tr := kvevent.Tier(0); tr < kvevent.NumTiers; tr++ {
				if e.mask.Has(tr) {
					want[tr]++
				}
			}
		}
		if st.Blocks != want || st.OrphanEvents != len(mr.orphans) || st.NeedsResync != mr.needsResync {
			t.Fatalf("rank %v stats %+v, model blocks %v held stores %d resync %v", st.Rank, st, want, len(mr.orphans), mr.needsResync)
		}
		for tr := range sum {
			sum[tr] += want[tr]
		}
		orphans += len(mr.orphans)
		oblocks += orphanBlocks(mr.orphans)
		if mr.needsResync {
			resync++
		}
		if mr.overCapacity {
			over++
		}
	}
	gs := ix.Stats()
	if gs.Blocks != sum || gs.OrphanEvents != orphans || gs.OrphanBlocks != oblocks || gs.NeedResync != resync || gs.OverCapacity != over || gs.Ranks != len(m.ranks) {
		t.Fatalf("stats %+v; model blocks %v held stores %d of %d blocks, %d need a resync, %d over capacity, %d ranks", gs, sum, orphans, oblocks, resync, over, len(m.ranks))
	}
}
