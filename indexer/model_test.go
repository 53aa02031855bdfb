package indexer

import (
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
	cfg   Config
	ranks map[kvevent.Rank]*mRank
}

type mEntry struct {
	path []uint64
	mask kvevent.Mask
}

type mRank struct {
	blocks      map[uint64]mEntry
	orphans     []orphan
	needsResync bool
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
// known kind; a store with at least one block, no engine hash twice, and a
// first block that is not its own parent; a remove with at least one hash.
// A clear carries nothing and is always good.
func wellFormed(ev *kvevent.Event) bool {
	if ev.Tier >= kvevent.NumTiers {
		return false
	}
	switch ev.Kind {
	case kvevent.KindStored:
		if len(ev.Blocks) == 0 || ev.HasParent && ev.Blocks[0].EngineHash == ev.Parent {
			return false
		}
		seen := map[uint64]bool{}
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
			m.remove(mr, eh, ev.Tier)
		}
	case kvevent.KindCleared:
		if mr := m.rank(ev.Rank, false); mr != nil {
			mr.blocks = map[uint64]mEntry{}
			mr.orphans = nil
			mr.needsResync = false
		}
	}
	return true
}

func (m *model) expire(mr *mRank, now int64) {
	for len(mr.orphans) > 0 && now-mr.orphans[0].at > int64(m.cfg.OrphanTTL) {
		mr.orphans = mr.orphans[1:]
		mr.needsResync = true
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
		if e, ok := mr.blocks[b.EngineHash]; ok && pathKey(e.path) != key {
			delete(mr.blocks, b.EngineHash)
		}
		var mask kvevent.Mask
		for eh, e := range mr.blocks {
			if pathKey(e.path) == key {
				mask = e.mask
				delete(mr.blocks, eh)
			}
		}
		mr.blocks[b.EngineHash] = mEntry{path: slices.Clone(path), mask: mask | t.Bit()}
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
}

func (m *model) remove(mr *mRank, eh uint64, t kvevent.Tier) {
	e, ok := mr.blocks[eh]
	if !ok {
		for i := range mr.orphans {
			o := &mr.orphans[i]
			if o.tier != t {
				continue
			}
			if j := slices.IndexFunc(o.blocks, func(b kvevent.Block) bool { return b.EngineHash == eh }); j >= 0 {
				if j == 0 {
					mr.orphans = slices.Delete(slices.Clone(mr.orphans), i, i+1)
				} else {
					o.blocks = o.blocks[:j]
				}
				return
			}
		}
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
			got[e.EngineHash] = fmt.Sprintf("%s mask %v", pathKey(path), e.Mask)
		}
		want := map[uint64]string{}
		var wantOrphans []DumpOrphan
		if mr := m.ranks[r]; mr != nil {
			for eh, e := range mr.blocks {
				want[eh] = fmt.Sprintf("%s mask %v", pathKey(e.path), e.mask)
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
	}
}
