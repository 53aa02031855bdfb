package indexer

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// loadStateReference is LoadState as it was before the Loader: the
// obvious rebuild (paths built on demand through a map of node records,
// entries set through the write path). The Loader must produce the same
// index from the same records, consistent or not.
func (ix *Index) loadStateReference(nodes map[uint64]DumpNode, ranks []RankDump) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	j := ix.journal
	ix.journal = nil
	defer func() { ix.journal = j }()
	ix.resetLocked()
	built := make(map[uint64]*node, len(nodes))
	var build func(seq uint64, depth int) (*node, error)
	build = func(seq uint64, depth int) (*node, error) {
		if n, ok := built[seq]; ok {
			return n, nil
		}
		dn, ok := nodes[seq]
		if !ok || depth > 1<<20 {
			return nil, fmt.Errorf("%w: node %#x missing or in a cycle", ErrBadDump, seq)
		}
		parent := &ix.root
		if !dn.Root {
			p, err := build(dn.Parent, depth+1)
			if err != nil {
				return nil, err
			}
			parent = p
		}
		c := parent.child(dn.Local)
		if c == nil {
			c = ix.pool.get(parent, dn.Local, dn.Seq)
			ix.names.put(dn.Seq, c, &ix.tables)
			parent.addChild(c)
			ix.nodes++
		}
		built[seq] = c
		return c, nil
	}
	for i := range ranks {
		d := &ranks[i]
		rs := ix.rankFor(d.Rank, true)
		rs.cap = d.Capacity
		for _, e := range d.Entries {
			if e.Mask == 0 || e.Mask >= 1<<kvevent.NumTiers {
				ix.resetLocked()
				return fmt.Errorf("%w: entry %#x of %s has mask %#x", ErrBadDump, e.EngineHash, d.Rank, e.Mask)
			}
			n, err := build(e.Seq, 0)
			if err != nil {
				ix.resetLocked()
				return fmt.Errorf("load %s: %w", d.Rank, err)
			}
			for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
				if e.Mask.Has(t) {
					ix.setBit(rs, n, e.EngineHash, t)
				}
			}
			n.holders[n.find(rs.slot)].order = e.Order
		}
		rs.order = d.Order
		for _, o := range d.Orphans {
			or := orphan{at: o.At, tier: o.Tier, parent: o.Parent, blocks: slices.Clone(o.Blocks)}
			rs.orphans = append(rs.orphans, or)
			rs.orphanBlocks += len(or.blocks)
			ix.orphanDigest(rs, &or, +1)
		}
	}
	for _, n := range built {
		ix.unlink(n)
	}
	return nil
}

// loadCase is a durable copy: the records of a live index's journal, then
// possibly damaged.
type loadCase struct {
	nodes map[uint64]DumpNode
	ranks []RankDump
	meta  map[kvevent.Rank]RankMeta
	// aliased: two node records name one (parent, local) position. The
	// write path never makes such a copy (a node's seq is a hash of its
	// parent's and its content), and the node takes the seq of whichever
	// record is linked first, which differs between the rebuilds (the
	// reference goes in entry order, the Loader in seq order): such a copy
	// must load, consistently, but not necessarily to the same digest.
	aliased bool
}

// drawLoadCase builds a live index from random events with a journal and
// returns its durable copy; when damage is set it also adds records a
// consistent copy never holds (a node with a missing parent, a cycle, a
// record naming an existing position, an unheld extra node, an entry on a
// node its rank already holds, an entry of a missing node, a bad mask).
func drawLoadCase(t *rapid.T, damage bool) loadCase {
	ix := New(propCfg)
	j := newCopyJournal()
	ix.SetJournal(j)
	now := int64(0)
	for i, s := range rapid.SliceOfN(genStep(), 1, 60).Draw(t, "steps") {
		now += int64(s.dt)
		_ = s.apply(ix, now) // a malformed event changes nothing
		if i%3 == 0 {
			ix.FlushJournal()
		}
	}
	ix.FlushJournal()
	c := loadCase{nodes: j.nodes, meta: j.meta}
	var seqs []uint64
	for s := range c.nodes {
		seqs = append(seqs, s)
	}
	slices.Sort(seqs)
	if damage && len(seqs) > 0 {
		pick := func(label string) uint64 { return rapid.SampledFrom(seqs).Draw(t, label) }
		for _, k := range rapid.SliceOfN(rapid.IntRange(0, 4), 1, 3).Draw(t, "damage") {
			fresh := rapid.Uint64Range(1000, 1010).Draw(t, "fresh")
			switch k {
			case 0: // a chain whose top names a missing parent
				c.nodes[fresh] = DumpNode{Seq: fresh, Parent: 999, Local: 7}
				c.nodes[fresh+100] = DumpNode{Seq: fresh + 100, Parent: fresh, Local: 8}
			case 1: // a cycle through two records
				c.nodes[fresh] = DumpNode{Seq: fresh, Parent: fresh + 100, Local: 7}
				c.nodes[fresh+100] = DumpNode{Seq: fresh + 100, Parent: fresh, Local: 8}
			case 2: // a second record for an existing position
				p := c.nodes[pick("alias")]
				c.nodes[fresh] = DumpNode{Seq: fresh, Parent: p.Parent, Root: p.Root, Local: p.Local}
				c.aliased = true
			case 3: // an unheld node below an existing one
				c.nodes[fresh] = DumpNode{Seq: fresh, Parent: pick("under"), Local: fresh}
			}
		}
	}
	for r, m := range c.meta {
		d := RankDump{Rank: r, Capacity: m.Capacity, Order: m.Order, Orphans: m.Orphans}
		for _, e := range j.entries[r] {
			d.Entries = append(d.Entries, e)
		}
		slices.SortFunc(d.Entries, func(a, b DumpEntry) int { return cmp.Compare(a.EngineHash, b.EngineHash) })
		c.ranks = append(c.ranks, d)
	}
	slices.SortFunc(c.ranks, func(a, b RankDump) int { return a.Rank.Compare(b.Rank) })
	if damage && len(c.ranks) > 0 {
		var all []uint64
		for s := range c.nodes {
			all = append(all, s)
		}
		slices.Sort(all)
		for _, k := range rapid.SliceOfN(rapid.IntRange(0, 3), 0, 2).Draw(t, "entry damage") {
			d := &c.ranks[rapid.IntRange(0, len(c.ranks)-1).Draw(t, "rank")]
			eh := rapid.Uint64Range(1, 12).Draw(t, "eh")
			if slices.ContainsFunc(d.Entries, func(e DumpEntry) bool { return e.EngineHash == eh }) {
				continue // the copy's keys are unique per rank and hash
			}
			e := DumpEntry{EngineHash: eh, Mask: 1, Order: 5}
			switch k {
			case 0, 1: // on any node record (held by the rank already, or not)
				if len(all) == 0 {
					continue
				}
				e.Seq = rapid.SampledFrom(all).Draw(t, "entry node")
			case 2:
				e.Seq = 4242 // missing
			case 3:
				if len(all) == 0 {
					continue
				}
				e.Seq, e.Mask = all[0], kvevent.Mask(rapid.SampledFrom([]int{0, 16}).Draw(t, "mask"))
			}
			d.Entries = append(d.Entries, e)
			slices.SortFunc(d.Entries, func(a, b DumpEntry) int { return cmp.Compare(a.EngineHash, b.EngineHash) })
		}
	}
	return c
}

// loadPebbleStyle feeds a Loader the way FSM.load does: node records in
// seq order, the lower half of the seqs on one goroutine (AddNode) and
// the upper half beside it (NodeRecords, then AddNodes), then the first
// links them (LinkNodes) while another adds the entries grouped by rank
// in hash order and the rank records; Finish
// works in parts parts (Spread) when parts > 1. detached builds into a new
// index (FinishDetached) that ix then takes, as a snapshot restore does.
func (c *loadCase) loadPebbleStyle(ix *Index, parts int, detached bool) error {
	l := NewLoader(0, 0)
	if parts > 1 {
		l.Spread(parts, spreadGo)
	}
	seqs := make([]uint64, 0, len(c.nodes))
	for s := range c.nodes {
		seqs = append(seqs, s)
	}
	slices.Sort(seqs)
	half, _ := slices.BinarySearch(seqs, 1<<63)
	var upper NodeRecords
	upperDone, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for _, s := range seqs[:half] {
			n := c.nodes[s]
			l.AddNode(s, n.Parent, n.Root, n.Local)
		}
		<-upperDone
		l.AddNodes(&upper)
		l.LinkNodes()
	}()
	for _, s := range seqs[half:] {
		n := c.nodes[s]
		upper.Add(s, n.Parent, n.Root, n.Local)
	}
	close(upperDone)
	for _, d := range c.ranks {
		for _, e := range d.Entries {
			l.AddEntry(d.Rank, e.EngineHash, e.Seq, e.Mask, e.Order)
		}
	}
	for _, d := range c.ranks {
		m := c.meta[d.Rank]
		m.Capacity, m.Order, m.Orphans = d.Capacity, d.Order, d.Orphans
		l.AddRank(m)
	}
	<-done
	if !detached {
		return l.Finish(ix)
	}
	d, err := l.FinishDetached(ix)
	if err != nil {
		return err
	}
	ix.Take(d)
	if st := d.Stats(); st.Nodes != 0 || st.Entries != 0 || st.Ranks != 0 {
		return fmt.Errorf("the taken index still holds %+v", st)
	}
	return nil
}

// sameIndex fails unless a and b hold the same logical state.
// blockMapBytes is the memory of every rank's block map in ix.
func blockMapBytes(ix *Index) int64 {
	var n int64
	for _, rs := range ix.ranks {
		if rs != nil {
			n += rs.blocks.bytes()
		}
	}
	return n
}

func sameIndex(t *rapid.T, a, b *Index) {
	if a.Digest() != b.Digest() {
		t.Fatalf("digest %#x, want %#x", a.Digest(), b.Digest())
	}
	sa, sb := a.Stats(), b.Stats()
	// The names' map is sized for every node a Loader built, before it
	// unlinks those no entry needs (a damaged copy's), where the
	// reference grows it, and a rank's block map is sized for every
	// record of the rank, before a damaged copy's duplicates are
	// remapped: their memory may differ, nothing else.
	sa.MemoryBytes -= a.names.bytes() + blockMapBytes(a)
	sb.MemoryBytes -= b.names.bytes() + blockMapBytes(b)
	if sa != sb {
		t.Fatalf("stats %+v, want %+v", sa, sb)
	}
	ra, rb := a.Ranks(), b.Ranks()
	slices.SortFunc(ra, kvevent.Rank.Compare)
	slices.SortFunc(rb, kvevent.Rank.Compare)
	if !slices.Equal(ra, rb) {
		t.Fatalf("ranks %v, want %v", ra, rb)
	}
	for _, r := range ra {
		da, err1 := a.DumpRank(r)
		db, err2 := b.DumpRank(r)
		if err1 != nil || err2 != nil {
			t.Fatalf("dump %s: %v %v", r, err1, err2)
		}
		if !reflect.DeepEqual(da, db) {
			t.Fatalf("rank %s: dump\n%+v\nwant\n%+v", r, da, db)
		}
	}
	var ma, mb Matches
	for _, q := range [][]uint64{{11}, {11, 12}, {12, 13, 14}, {13, 11, 12, 14}, {14, 14, 14}} {
		for _, view := range []View{ViewDedup, ViewTiered} {
			a.FindMatchesByTier(q, view, false, &ma)
			b.FindMatchesByTier(q, view, false, &mb)
			for _, m := range []*Matches{&ma, &mb} {
				if err := ranksOnce(m); err != nil {
					t.Fatalf("query %v view %v: %v", q, view, err)
				}
			}
			if !equalMatches(toMap(&ma), toMap(&mb)) || !slicesEqual(ma.Frequencies, mb.Frequencies) {
				t.Fatalf("query %v view %v: %v, want %v", q, view, toMap(&ma), toMap(&mb))
			}
		}
	}
}

// TestLoaderMatchesReference: on random durable copies, consistent or
// damaged, LoadState and a Loader fed like FSM.load feeds it (concurrent
// node records, linked before Finish), alone and in parts (Spread), with
// batched lookups or not, build the index the reference rebuild builds, or
// fail alike with ErrBadDump.
func TestLoaderMatchesReference(t *testing.T) {
	for range loadPropertyRounds() {
		rapid.Check(t, func(t *rapid.T) {
			c := drawLoadCase(t, rapid.Bool().Draw(t, "damage"))
			// The batched lookups (load_batch.go) serve copies of 64Ki
			// records and more: force them here, in one or many partitions.
			if rapid.Bool().Draw(t, "batched") {
				defer func(m, p int) { batchMinRecs, batchPartRecs = m, p }(batchMinRecs, batchPartRecs)
				batchMinRecs, batchPartRecs = 0, rapid.SampledFrom([]int{1, 2, 4, 1 << 20}).Draw(t, "partRecs")
			}
			ref := New(propCfg)
			refErr := ref.loadStateReference(c.nodes, c.ranks)
			if refErr == nil {
				for r, m := range c.meta {
					ref.SetRankFlags(r, m.NeedsResync, m.OverCapacity)
				}
			}
			viaState := New(propCfg)
			err := viaState.LoadState(c.nodes, c.ranks)
			if err == nil {
				for r, m := range c.meta {
					viaState.SetRankFlags(r, m.NeedsResync, m.OverCapacity)
				}
			}
			viaLoader := New(propCfg)
			errL := c.loadPebbleStyle(viaLoader, 0, false)
			viaSpread := New(propCfg)
			errS := c.loadPebbleStyle(viaSpread, rapid.IntRange(2, 3).Draw(t, "parts"), false)
			// Detached, into an index that held something before: a failed
			// build leaves what it held, a good one replaces it whole.
			viaDetached := New(propCfg)
			viaDetached.Apply(&kvevent.Event{Rank: kvevent.Rank{Worker: 999}, EventID: 1, Kind: kvevent.KindStored,
				Blocks: []kvevent.Block{{EngineHash: 7, LocalHash: 77}}}, 1)
			held := viaDetached.Digest()
			// The counters are the process's, kept across a load; start
			// them at zero like the other indexes' (the Apply counted).
			viaDetached.counters = Counters{}
			errD := c.loadPebbleStyle(viaDetached, rapid.IntRange(0, 3).Draw(t, "detachedParts"), true)
			if errD != nil && viaDetached.Digest() != held {
				t.Fatalf("a failed detached build changed the index it was for")
			}
			if errD != nil {
				viaDetached = New(propCfg) // compared below as a failed load's empty index
			}
			for _, got := range []struct {
				ix  *Index
				err error
			}{{viaState, err}, {viaLoader, errL}, {viaSpread, errS}, {viaDetached, errD}} {
				if (got.err == nil) != (refErr == nil) || (got.err != nil && !errors.Is(got.err, ErrBadDump)) {
					t.Fatalf("error %v, reference %v", got.err, refErr)
				}
				if got.err != nil {
					if st := got.ix.Stats(); st.Nodes != 0 || st.Entries != 0 || st.Ranks != 0 {
						t.Fatalf("failed load left %+v", st)
					}
					continue
				}
				if !c.aliased {
					sameIndex(t, got.ix, ref)
				}
				checkInvariants(t, got.ix)
			}
		})
	}
}

// TestSeqIndexFinds: the directory lookup finds every record and nothing
// else, on uniform and on skewed hashes.
func TestSeqIndexFinds(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 2, 3, 17, 1000, 5000} {
		for _, skew := range []bool{false, true} {
			var recs []loadNode
			want := map[uint64]bool{}
			for len(recs) < n {
				s := rng.Uint64()
				if skew {
					s >>= rng.IntN(64) // mostly tiny values, crowded in bucket 0
				}
				if !want[s] {
					want[s] = true
					recs = append(recs, loadNode{seq: s})
				}
			}
			x := newSeqIndex(recs, nil)
			for i, r := range x.recs {
				if got := x.find(r.seq); got != i {
					t.Fatalf("n=%d skew=%v: find(%#x) = %d, want %d", n, skew, r.seq, got, i)
				}
			}
			for range 1000 {
				s := rng.Uint64()
				if got := x.find(s); (got >= 0) != want[s] {
					t.Fatalf("n=%d skew=%v: find(%#x) = %d", n, skew, s, got)
				}
			}
			if got := x.find(^uint64(0)); (got >= 0) != want[^uint64(0)] {
				t.Fatalf("find(max) = %d", got)
			}
		}
	}
}

// spreadGo runs f(0) … f(parts-1) on goroutines of their own, as
// FSM.load does.
func spreadGo(parts int, f func(part int)) {
	var wg sync.WaitGroup
	for p := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(p)
		}()
	}
	wg.Wait()
}

// TestLoaderSpreadFallsBack: a copy with two holders of one rank on a node
// makes the parts give up (the serial path alone loads it as the write
// path would), and the index loads as without Spread.
func TestLoaderSpreadFallsBack(t *testing.T) {
	load := func(parts int) *Index {
		ix := New(Config{})
		l := NewLoader(0, 0)
		if parts > 1 {
			l.Spread(parts, spreadGo)
		}
		l.AddNode(1, 0, true, 11)
		l.AddNode(2, 1, false, 12)
		r := kvevent.Rank{Worker: 1}
		l.AddEntry(r, 100, 1, 1, 1)
		l.AddEntry(r, 101, 2, 1, 2)
		l.AddEntry(r, 102, 2, 2, 3) // a second holder of r on node 2
		l.AddEntry(kvevent.Rank{Worker: 2}, 100, 2, 1, 1)
		l.AddRank(RankMeta{Rank: r})
		if err := l.Finish(ix); err != nil {
			t.Fatal(err)
		}
		return ix
	}
	want := load(0)
	for _, parts := range []int{2, 3} {
		got := load(parts)
		if got.Digest() != want.Digest() || got.Stats() != want.Stats() {
			t.Fatalf("parts %d: digest %#x stats %+v, want %#x %+v", parts, got.Digest(), got.Stats(), want.Digest(), want.Stats())
		}
	}
}

// TestChunksKeepOrder: records come back in the order added, whatever the
// chunking (a reserved first chunk, doubling chunks, full-size chunks).
func TestChunksKeepOrder(t *testing.T) {
	for _, tc := range []struct{ reserve, n int }{{0, 0}, {0, 1}, {0, chunkMin}, {0, 3*chunkMax + 5}, {10, 1000}, {1000, 1000}, {2 * chunkMax, 5 * chunkMax}} {
		var c chunks[int]
		c.reserve(tc.reserve, nil)
		for i := range tc.n {
			*c.next() = i
		}
		if c.n != tc.n {
			t.Fatalf("%+v: n %d", tc, c.n)
		}
		for k, ch := range c.all {
			if k < len(c.all)-1 && len(ch) != cap(ch) {
				t.Fatalf("%+v: chunk %d of %d not full (%d of %d)", tc, k, len(c.all), len(ch), cap(ch))
			}
			if cap(ch) > max(chunkMax, tc.reserve) {
				t.Fatalf("%+v: chunk %d holds %d", tc, k, cap(ch))
			}
		}
		flat := c.flatten(nil)
		if len(flat) != tc.n {
			t.Fatalf("%+v: flatten gave %d", tc, len(flat))
		}
		for i, v := range flat {
			if v != i {
				t.Fatalf("%+v: record %d is %d", tc, i, v)
			}
		}
	}
}

// TestChunkSlabsCarveDisjointChunks: collections whose chunks come from
// one chunkSlab (a Loader's ranks' residencies) keep their own records in
// order, no two chunks share memory, and the large slabs are advised,
// which the slab's release withdraws.
func TestChunkSlabsCarveDisjointChunks(t *testing.T) {
	before := hugepage.Held()
	slab := &chunkSlab[int]{}
	a, b := chunks[int]{from: slab}, chunks[int]{from: slab}
	const na, nb = 20*chunkMax + 5, 3*chunkMax + 7 // a's slabs grow past hugepage.MinBytes
	for i, j := 0, 0; i < na || j < nb; {
		for k := 0; k < 1000 && i < na; k++ {
			*a.next() = i
			i++
		}
		for k := 0; k < 300 && j < nb; k++ {
			*b.next() = -j
			j++
		}
	}
	type span struct{ lo, hi uintptr }
	var spans []span
	for _, c := range []*chunks[int]{&a, &b} {
		for _, ch := range c.all {
			lo := uintptr(unsafe.Pointer(unsafe.SliceData(ch)))
			spans = append(spans, span{lo, lo + uintptr(cap(ch))*unsafe.Sizeof(0)})
		}
	}
	slices.SortFunc(spans, func(x, y span) int { return cmp.Compare(x.lo, y.lo) })
	for k := 1; k < len(spans); k++ {
		if spans[k].lo < spans[k-1].hi {
			t.Fatalf("two chunks share memory: [%#x, %#x) and [%#x, %#x)", spans[k-1].lo, spans[k-1].hi, spans[k].lo, spans[k].hi)
		}
	}
	for name, c := range map[string]struct {
		c    *chunks[int]
		n    int
		sign int
	}{"a": {&a, na, 1}, "b": {&b, nb, -1}} {
		flat := c.c.flatten(nil)
		if len(flat) != c.n {
			t.Fatalf("%s: %d records, want %d", name, len(flat), c.n)
		}
		for i, v := range flat {
			if v != c.sign*i {
				t.Fatalf("%s: record %d is %d", name, i, v)
			}
		}
	}
	if hugepage.Held() == before {
		t.Fatalf("no slab was advised: %d records of 8 bytes", na+nb)
	}
	slab.release()
	if h := hugepage.Held(); h != before || slab.rest != nil {
		t.Fatalf("%d bytes advised after the slab's release, %d before; the slab keeps a rest of %d", h, before, cap(slab.rest))
	}
}

// TestLoaderCollectsFromItsSlabs: a Loader's node records, its ranks'
// residencies and the NodeRecords it hands out are carved from slabs, not
// made one by one, and the Loader keeps the NodeRecords to release them.
func TestLoaderCollectsFromItsSlabs(t *testing.T) {
	l := NewLoader(0, 0)
	up := l.NodeRecords()
	for s := uint64(1); s <= 3*chunkMin; s++ {
		l.AddNode(s, 0, true, s)
		up.Add(s+1000, 0, true, s)
		l.AddEntry(kvevent.Rank{Worker: 1}, s, s, 1, 1)
		l.AddEntry(kvevent.Rank{Worker: 2}, s, s, 1, 1)
	}
	if l.nodes.from != &l.nodeSlab || up.c.from != &up.slab || l.ranks[0].entries.from != &l.entrySlab || l.ranks[1].entries.from != &l.entrySlab {
		t.Fatal("the Loader's collections do not take their chunks from its slabs")
	}
	if !slices.Contains(l.records, up) {
		t.Fatal("the Loader does not keep the NodeRecords it handed out, to release their slabs")
	}
	// The ranks' entries alternate: the second rank's first chunk starts
	// where the first rank's ended, in one slab.
	a, b := l.ranks[0].entries.all[0], l.ranks[1].entries.all[0]
	if unsafe.SliceData(b) != (*loadEntry)(unsafe.Add(unsafe.Pointer(unsafe.SliceData(a)), uintptr(cap(a))*unsafe.Sizeof(loadEntry{}))) {
		t.Fatal("the ranks' first chunks were not carved one after the other from one slab")
	}
	// And a chunk is no longer than the collection asked for.
	if len(l.nodes.all) < 2 || cap(l.nodes.all[0]) != chunkMin || cap(l.nodes.all[1]) != 2*chunkMin {
		t.Fatalf("node chunks of %d and %d records, want %d and %d", cap(l.nodes.all[0]), cap(l.nodes.all[1]), chunkMin, 2*chunkMin)
	}
	l.AddNodes(up)
	if err := l.Finish(New(Config{})); err != nil {
		t.Fatal(err)
	}
}

// TestChunksJoin: joined collections give back the first's records, then
// the second's, and a record added after the join comes last.
func TestChunksJoin(t *testing.T) {
	for _, tc := range []struct{ a, b int }{{0, 0}, {0, 5}, {5, 0}, {3, chunkMin + 1}, {2*chunkMax + 1, chunkMax + 3}} {
		var a, b chunks[int]
		for i := range tc.a {
			*a.next() = i
		}
		for i := range tc.b {
			*b.next() = tc.a + i
		}
		a.join(&b)
		*a.next() = tc.a + tc.b
		if b.n != 0 || len(b.all) != 0 {
			t.Fatalf("%+v: the joined collection kept %d records", tc, b.n)
		}
		flat := a.flatten(nil)
		if a.n != tc.a+tc.b+1 || len(flat) != a.n {
			t.Fatalf("%+v: n %d, flatten gave %d", tc, a.n, len(flat))
		}
		for i, v := range flat {
			if v != i {
				t.Fatalf("%+v: record %d is %d", tc, i, v)
			}
		}
	}
}

// TestTakeAddsEveryCounter: Take adds each of the taken index's counters
// (a counter added to Counters and not to Take fails here).
func TestTakeAddsEveryCounter(t *testing.T) {
	o, ix := New(Config{}), New(Config{})
	v := reflect.ValueOf(&o.counters).Elem()
	for i := 0; i < v.NumField(); i++ {
		v.Field(i).SetUint(uint64(i + 1))
	}
	want := o.counters
	ix.Take(o)
	if ix.counters != want || o.counters != (Counters{}) {
		t.Fatalf("after Take: counters %+v (want %+v), the taken index keeps %+v", ix.counters, want, o.counters)
	}
}

// TestLoaderRefusesABadOrphan: held orphans come from the state database
// or a restored snapshot, outside bytes; one of an unknown tier (or with
// no blocks) is refused as a dump's is, and the index is left empty,
// instead of loading and failing the apply that later adopts it.
func TestLoaderRefusesABadOrphan(t *testing.T) {
	for _, o := range []DumpOrphan{
		{Tier: kvevent.Tier(7), Parent: 1, Blocks: chain(2)},
		{Tier: host, Parent: 1},
	} {
		ix := New(Config{})
		mustApply(t, ix, stored(rk1, dev, chain(9)))
		l := NewLoader(0, 0)
		l.AddRank(RankMeta{Rank: rk1, Orphans: []DumpOrphan{o}})
		if err := l.Finish(ix); !errors.Is(err, ErrBadDump) {
			t.Fatalf("orphan %+v: Finish = %v, want ErrBadDump", o, err)
		}
		if st := ix.Stats(); st.Entries != 0 || st.Nodes != 0 {
			t.Fatalf("orphan %+v: a refused load left %+v", o, st)
		}
		mustApply(t, ix, stored(rk1, dev, chain(1))) // the parent a bad orphan would wait for
	}
}

// TestLoaderReleasesItsScratch: the huge page advice on a rebuild's
// scratch arrays (internal/hugepage) is withdrawn whichever way the
// Loader ends: Finish, Finish of a bad copy, or Discard after LinkNodes.
func TestLoaderReleasesItsScratch(t *testing.T) {
	const chain = 200_000 // node records of 48 bytes: scratch arrays of MiBs
	fill := func(bad bool) *Loader {
		l := NewLoader(0, 0)
		l.Spread(2, spreadGo)
		r := kvevent.Rank{Worker: 1}
		for s := uint64(1); s <= chain; s++ {
			l.AddNode(s, s-1, s == 1, s+1000)
			l.AddEntry(r, s, s, 1, uint32(s))
		}
		if bad {
			l.AddEntry(r, chain+1, chain+1, 1, 1) // names no node
		}
		l.AddRank(RankMeta{Rank: r, Capacity: [kvevent.NumTiers]int64{chain + 1}})
		return l
	}
	for _, tc := range []struct {
		name string
		end  func(*Loader) error
		bad  bool
	}{
		{"finish", func(l *Loader) error { return l.Finish(New(Config{})) }, false},
		{"finish of a bad copy", func(l *Loader) error { return l.Finish(New(Config{})) }, true},
		{"discard", func(l *Loader) error { l.Discard(); return nil }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := fill(tc.bad)
			l.LinkNodes()
			if hugepage.Held() == 0 {
				t.Fatal("LinkNodes advised no scratch array: the test needs larger ones")
			}
			err := tc.end(l)
			if (err != nil) != tc.bad {
				t.Fatalf("end: %v", err)
			}
			if h := hugepage.Held(); h != 0 {
				t.Fatalf("%d bytes still advised after the Loader ended", h)
			}
		})
	}
}

// TestSpreadBuildHandsOnItsSlabTails: a parallel build's parts fill pools
// of their own, and the index adopts the first; the others' partly used
// slabs (up to 10 MiB each) are handed on to it, not stranded, and the
// tree's next nodes take them first. From a review.
func TestSpreadBuildHandsOnItsSlabTails(t *testing.T) {
	const parts, subtrees, depth = 8, 4096, 50
	l := NewLoader(0, 0)
	l.Spread(parts, spreadGo)
	r := kvevent.Rank{Worker: 1}
	seq := uint64(0)
	for s := 0; s < subtrees; s++ {
		parent := uint64(0)
		for d := 0; d < depth; d++ {
			seq++
			l.AddNode(seq, parent, d == 0, uint64(s)<<20|uint64(d))
			l.AddEntry(r, seq, seq, 1, uint32(seq))
			parent = seq
		}
	}
	l.AddRank(RankMeta{Rank: r})
	l.LinkNodes()
	tails := 0
	for p := 1; p < len(l.pools); p++ {
		tails += cap(l.pools[p].slab) - len(l.pools[p].slab)
	}
	if tails == 0 {
		t.Fatal("the parts' pools have no partly used slab: the test needs another shape")
	}
	ix := New(Config{})
	if err := l.Finish(ix); err != nil {
		t.Fatal(err)
	}
	spare := 0
	for _, s := range ix.pool.spare {
		spare += cap(s) - len(s)
	}
	if spare != tails {
		t.Fatalf("the index's pool holds %d spare nodes; the parts left %d", spare, tails)
	}
	// New nodes come from the current slab, then the spare ones, before
	// any new slab.
	slabs, room := len(ix.pool.spare), cap(ix.pool.slab)-len(ix.pool.slab)
	for i := 0; i <= room; i++ {
		ix.pool.get(nil, 0, 0)
	}
	if len(ix.pool.spare) != slabs-1 {
		t.Fatalf("after filling the current slab: %d spare slabs, want %d", len(ix.pool.spare), slabs-1)
	}
}

// TestLinkedNodeRecordsGoToTheCollector: once LinkNodes has flattened the
// node records into the seq index, it drops their chunks (l.nodes), and
// the collector may have them while the rest of the load runs, as
// applySerial's "the collector may have them while the rest loads" says
// of each rank's residencies. operations.md ("Memory and the garbage
// collector") has an operator size a start's peak or set GOMEMLIMIT so
// that the runtime collects the load's temporaries as the heap nears the
// limit: chunks that stay reachable until Finish (a slab's record in the
// Loader's scratch, or the slab's unused tail) are a second copy of every
// node record (48 bytes a block) in the load's peak.
func TestLinkedNodeRecordsGoToTheCollector(t *testing.T) {
	const chain = 400_000 // 19 MB of records: slabs past hugepage.MinBytes
	l := NewLoader(0, 0)
	for s := uint64(1); s <= chain; s++ {
		l.AddNode(s, s-1, s == 1, s+1000)
	}
	var freed atomic.Int64
	n := int64(len(l.nodes.all))
	for _, ch := range l.nodes.all {
		runtime.AddCleanup(&ch[:1][0], func(f *atomic.Int64) { f.Add(1) }, &freed)
	}
	l.LinkNodes()
	if l.linkErr != nil {
		t.Fatal(l.linkErr)
	}
	for deadline := time.Now().Add(5 * time.Second); freed.Load() < n && time.Now().Before(deadline); {
		runtime.GC()
	}
	if got := freed.Load(); got < n {
		t.Errorf("%d of %d node record chunks still reachable after LinkNodes dropped them (held until Finish)", n-got, n)
	}
	l.Discard() // l stays reachable until here
}

// TestLoaderBuildsInLargeSlabs: a Loader's pools take slabs of
// loadSlab's size, a quarter of a part's share of the nodes, above
// maxNodeSlab when the load is large, and its maps take the tables the
// build reserved from one slab, so that fewer of the rebuild's pages lie
// outside the whole huge pages advised; the index that adopts the tree
// takes the usual sizes again as it grows.
func TestLoaderBuildsInLargeSlabs(t *testing.T) {
	if got := loadSlab(1000, 2); got != nodeSlab {
		t.Fatalf("loadSlab of a small load: %d, want nodeSlab (%d)", got, nodeSlab)
	}
	if got := loadSlab(1<<30, 2); got != maxLoadSlab {
		t.Fatalf("loadSlab of a huge load: %d, want maxLoadSlab (%d)", got, maxLoadSlab)
	}
	const chain = 4*maxNodeSlab + 4*1000 // slabs of maxNodeSlab+1000 nodes
	l := NewLoader(0, 0)
	for s := uint64(1); s <= chain; s++ {
		l.AddNode(s, s-1, s == 1, s+1000)
	}
	r := kvevent.Rank{Worker: 1}
	l.AddEntry(r, 7, chain, 1, 1) // the chain's end is held: no node is pruned
	l.AddRank(RankMeta{Rank: r, Capacity: [kvevent.NumTiers]int64{1}})
	l.LinkNodes()
	if l.linkErr != nil {
		t.Fatal(l.linkErr)
	}
	want := loadSlab(chain, l.parts)
	if want <= maxNodeSlab {
		t.Fatalf("the test needs slabs over maxNodeSlab: loadSlab(%d) = %d", chain, want)
	}
	if p := l.pools[0]; cap(p.slab) != want || len(p.slab) != cap(p.slab) {
		t.Fatalf("the pool's last slab: %d of %d nodes, want %d of %d", len(p.slab), cap(p.slab), want, want)
	}
	ix := New(Config{})
	if err := l.Finish(ix); err != nil {
		t.Fatal(err)
	}
	if ix.nodes != chain {
		t.Fatalf("%d nodes, want %d", ix.nodes, chain)
	}
	// The names' map's tables were reserved at once: one slab holds them
	// all (its segments, about 60 % full, never split in the fill), where
	// slabs grown one after another end at maxSegSlab.
	if n := mapTables(chain); cap(ix.tables.slab) != n || len(ix.tables.slab) != n {
		t.Fatalf("the tables' last slab: %d of %d, want the %d the build reserved", len(ix.tables.slab), cap(ix.tables.slab), n)
	}
	for i := 0; i < 2; i++ {
		room := cap(ix.pool.slab) - len(ix.pool.slab)
		for j := 0; j <= room; j++ { // fills the slab, then takes a new one
			ix.pool.get(nil, 0, 0)
		}
		if c := cap(ix.pool.slab); c > maxNodeSlab {
			t.Fatalf("the grown tree's slab %d holds %d nodes, over maxNodeSlab (%d)", i+1, c, maxNodeSlab)
		}
	}
}
