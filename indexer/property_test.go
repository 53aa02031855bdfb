package indexer

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// A small universe, so that random events collide: shared prefixes,
// removes of held and unknown hashes, reused engine hashes (within an
// event too, which is malformed), orphans whose parent arrives later, and
// orphans that age out.
var (
	propWorkers = []uint64{1, 2, 3}
	propLocals  = []uint64{11, 12, 13, 14}
	propHashes  = rapid.Uint64Range(1, 10)
	// propAllHashes is every hash propHashes draws.
	propAllHashes = []uint64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	// propHotHashes draws half its hashes from the first three.
	propHotHashes = rapid.OneOf(rapid.Uint64Range(1, 3), propHashes)
)

func genRank() *rapid.Generator[kvevent.Rank] {
	return rapid.Custom(func(t *rapid.T) kvevent.Rank {
		return kvevent.Rank{Worker: rapid.SampledFrom(propWorkers).Draw(t, "worker"), DP: rapid.Uint32Range(0, 1).Draw(t, "dp")}
	})
}

type step struct {
	ev           kvevent.Event
	removeWorker uint64 // when non-zero, the step removes this worker instead
	setCapacity  bool   // the step sets ev.Rank's capacity instead
	capacity     [kvevent.NumTiers]int64
	expire       bool          // the step ages every rank's held stores instead (ExpireOrphans)
	dt           time.Duration // may be negative: time goes back
}

// apply applies the step to ix at time now: Apply's error for an event.
func (s *step) apply(ix *Index, now int64) error {
	switch {
	case s.removeWorker != 0:
		ix.RemoveWorker(s.removeWorker)
	case s.setCapacity:
		ix.SetCapacity(s.ev.Rank, s.capacity)
	case s.expire:
		ix.ExpireOrphans(now)
	default:
		ev := s.ev
		return ix.Apply(&ev, now)
	}
	return nil
}

func genStep() *rapid.Generator[step] {
	return rapid.Custom(func(t *rapid.T) step {
		s := step{dt: time.Duration(rapid.IntRange(0, 1500).Draw(t, "dt_ms")) * time.Millisecond}
		if rapid.IntRange(0, 15).Draw(t, "clock_back") == 0 {
			// Time goes back: a new leader's clock behind the old one's,
			// or a clock step (held stores are pulled back, orphan.go).
			s.dt = -3 * s.dt
		}
		// Half the steps go to one rank and two tiers, their hashes
		// leaning to the low ones: spread over the whole universe, a
		// history seldom removes a block in the tier (or another) that a
		// held store of the same rank has it in (removeOne's cuts), adopts
		// a held store, or fills a rank past its capacity.
		if rapid.Bool().Draw(t, "hot") {
			s.ev.Rank = kvevent.Rank{Worker: propWorkers[0]}
			s.ev.Tier = kvevent.Tier(rapid.IntRange(0, 1).Draw(t, "hot tier"))
		} else {
			s.ev.Rank = genRank().Draw(t, "rank")
			s.ev.Tier = kvevent.Tier(rapid.IntRange(0, kvevent.NumTiers-1).Draw(t, "tier"))
		}
		switch k := rapid.IntRange(0, 22).Draw(t, "kind"); {
		case k < 12:
			s.ev.Kind = kvevent.KindStored
			if rapid.IntRange(0, 15).Draw(t, "big") == 0 {
				// A store longer than the orphan buffer's bound (propCfg's
				// OrphanMaxBlocks, 8): held, it is dropped at once and asks
				// a resync (holdOrphan). Its hashes are all the universe's,
				// each once, or it would be malformed.
				hs := rapid.Permutation(propAllHashes).Draw(t, "big hashes")
				for _, h := range hs[:propCfg.OrphanMaxBlocks+1] {
					s.ev.Blocks = append(s.ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: rapid.SampledFrom(propLocals).Draw(t, "local")})
				}
				s.ev.HasParent, s.ev.Parent = rapid.Bool().Draw(t, "hasParent"), hs[len(hs)-1]
				return s
			}
			n := rapid.IntRange(1, 4).Draw(t, "n")
			for i := 0; i < n; i++ {
				s.ev.Blocks = append(s.ev.Blocks, kvevent.Block{
					EngineHash: propHotHashes.Draw(t, "eh"),
					LocalHash:  rapid.SampledFrom(propLocals).Draw(t, "local"),
				})
			}
			if rapid.Bool().Draw(t, "hasParent") {
				s.ev.HasParent, s.ev.Parent = true, propHotHashes.Draw(t, "parent")
			}
		case k < 17:
			s.ev.Kind = kvevent.KindRemoved
			s.ev.Removed = rapid.SliceOfN(propHotHashes, 1, 3).Draw(t, "removed")
		case k < 19:
			s.ev.Kind = kvevent.KindCleared
		case k < 20:
			s.removeWorker = rapid.SampledFrom(propWorkers).Draw(t, "removeWorker")
			return s
		case k < 22:
			// Capacities small enough for the universe's ranks to pass
			// them, with and without slack (propCfg's 0.5: none below 2).
			s.setCapacity = true
			for tr := range s.capacity {
				s.capacity[tr] = rapid.SampledFrom([]int64{0, 0, 1, 2, 3, 5}).Draw(t, "capacity")
			}
			return s
		default:
			// The replicated sweep: time alone ages the held stores out.
			s.expire = true
			return s
		}
		// Now and then a malformed event: the index must refuse it (and
		// only it) as the model does, and change nothing.
		switch rapid.IntRange(0, 15).Draw(t, "malformed") {
		case 0:
			s.ev.Tier = kvevent.Tier(rapid.IntRange(kvevent.NumTiers, 255).Draw(t, "bad tier"))
		case 1:
			s.ev.Kind = rapid.SampledFrom([]kvevent.Kind{0, kvevent.KindCleared + 1, 255}).Draw(t, "bad kind")
		case 2:
			s.ev.Blocks, s.ev.Removed = nil, nil
		}
		return s
	})
}

var propCfg = Config{OrphanMaxEvents: 3, OrphanMaxBlocks: 8, OrphanTTL: 2 * time.Second, CapacitySlack: 0.5}

func toMap(m *Matches) map[kvevent.Rank][kvevent.NumTiers]uint32 {
	out := map[kvevent.Rank][kvevent.NumTiers]uint32{}
	for _, r := range m.Ranks {
		out[r.Rank] = r.Blocks
	}
	return out
}

// ranksOnce is nil when m lists each rank at most once. toMap keeps a
// rank's last entry, so equalMatches alone cannot see a rank listed
// twice, which compat's query API would count twice in Frequencies.
func ranksOnce(m *Matches) error {
	seen := make(map[kvevent.Rank]bool, len(m.Ranks))
	for _, r := range m.Ranks {
		if seen[r.Rank] {
			return fmt.Errorf("rank %v listed twice in %+v", r.Rank, m.Ranks)
		}
		seen[r.Rank] = true
	}
	return nil
}

func equalMatches(a, b map[kvevent.Rank][kvevent.NumTiers]uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func TestIndexMatchesModel(t *testing.T) {
	for range loadPropertyRounds() {
		checkIndexMatchesModel(t)
	}
}

func checkIndexMatchesModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		ix, mod := New(propCfg), newModel(propCfg)
		now := int64(0)
		steps := rapid.SliceOfN(genStep(), 40, 120).Draw(t, "steps")
		for _, s := range steps {
			now += int64(s.dt)
			err := s.apply(ix, now)
			switch {
			case s.removeWorker != 0:
				mod.removeWorker(s.removeWorker)
			case s.setCapacity:
				mod.setCapacity(s.ev.Rank, s.capacity)
			case s.expire:
				mod.expireAll(now)
			default:
				good := mod.apply(&s.ev, now)
				if (err == nil) != good || err != nil && !errors.Is(err, kvevent.ErrMalformed) {
					t.Fatalf("%+v: index says %v, model says well formed %v", s.ev, err, good)
				}
			}
			mod.checkState(t, ix)
			if ix.Digest() != mod.digest() {
				t.Fatalf("after %+v: digest %#x, model %#x", s, ix.Digest(), mod.digest())
			}
			mod.checkCapacity(t, ix)
			mod.checkStats(t, ix)
		}
		checkInvariants(t, ix)

		var got Matches
		for q := 0; q < 8; q++ {
			hashes := rapid.SliceOfN(rapid.SampledFrom(propLocals), 1, 6).Draw(t, "query")
			for _, view := range []View{ViewDedup, ViewTiered} {
				for _, early := range []bool{false, true} {
					ix.FindMatchesByTier(hashes, view, early, &got)
					want, wantFreq := mod.find(hashes, view, early)
					if err := ranksOnce(&got); err != nil {
						t.Fatalf("query %v view %v early %v: %v", hashes, view, early, err)
					}
					if !equalMatches(toMap(&got), want) {
						t.Fatalf("query %v view %v early %v: index %v, model %v", hashes, view, early, toMap(&got), want)
					}
					if !slicesEqual(got.Frequencies, wantFreq) {
						t.Fatalf("query %v view %v early %v: frequencies %v, model %v", hashes, view, early, got.Frequencies, wantFreq)
					}
				}
			}
		}

		// Dump every rank and load it into a fresh index: same state.
		fresh := New(propCfg)
		for _, r := range ix.Ranks() {
			d, err := ix.DumpRank(r)
			if err != nil {
				t.Fatal(err)
			}
			if err := fresh.LoadRank(&d); err != nil {
				t.Fatalf("load dump of %v: %v", r, err)
			}
		}
		if fresh.Digest() != ix.Digest() {
			t.Fatalf("dump/load: digest %#x, want %#x", fresh.Digest(), ix.Digest())
		}
		if a, b := fresh.Stats(), ix.Stats(); a.Nodes != b.Nodes || a.Entries != b.Entries || a.Blocks != b.Blocks {
			t.Fatalf("dump/load: stats %+v, want %+v", a, b)
		}
		checkInvariants(t, fresh)
		// The model's resync flags must agree with the index's.
		for r, mr := range mod.ranks {
			if got := contains(ix.NeedsResync(), r); got != mr.needsResync {
				t.Fatalf("rank %v needs resync: index %v, model %v", r, got, mr.needsResync)
			}
		}
	})
}

func contains(rs []kvevent.Rank, r kvevent.Rank) bool {
	for _, x := range rs {
		if x == r {
			return true
		}
	}
	return false
}

func slicesEqual(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// checkInvariants walks the whole tree and checks the package invariants.
func checkInvariants(t interface{ Fatalf(string, ...any) }, ix *Index) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	var nodes, entries int64
	var perTier [kvevent.NumTiers]int64
	var walk func(n *node)
	walk = func(n *node) {
		n.forEachChild(func(c *node) {
			nodes++
			if c.parent != n {
				t.Fatalf("node %#x: parent link broken", c.seq)
			}
			if named, _ := ix.names.get(c.seq); named != c {
				t.Fatalf("node %#x: its name maps to another node (%p, not %p)", c.seq, named, c)
			}
			if len(c.holders) == 0 && !c.hasChildren() {
				t.Fatalf("node %#x is held by nobody and has no children: should be unlinked", c.seq)
			}
			for i, h := range c.holders {
				if i > 0 && c.holders[i-1].slot() >= h.slot() {
					t.Fatalf("node %#x: holders not in slot order", c.seq)
				}
				entries++
				if h.mask() == 0 {
					t.Fatalf("node %#x: holder with empty mask", c.seq)
				}
				rs := ix.ranks[h.slot()]
				if rs == nil || func() *node { n, _ := rs.blocks.get(h.eh); return n }() != c {
					t.Fatalf("node %#x: holder %#x not mapped back by its rank", c.seq, h.eh)
				}
				for tr := kvevent.Tier(0); tr < kvevent.NumTiers; tr++ {
					if h.mask().Has(tr) {
						perTier[tr]++
					}
				}
			}
			walk(c)
		})
	}
	walk(&ix.root)
	if err := ix.names.check(); err != nil {
		t.Fatalf("names: %v", err)
	}
	if int64(ix.names.len()) != nodes {
		t.Fatalf("%d names for %d nodes", ix.names.len(), nodes)
	}
	if nodes != ix.nodes || entries != ix.entries || perTier != ix.perTier {
		t.Fatalf("counts: walked nodes=%d entries=%d tiers=%v, kept nodes=%d entries=%d tiers=%v",
			nodes, entries, perTier, ix.nodes, ix.entries, ix.perTier)
	}
	var mapped int64
	live := 0
	for _, rs := range ix.ranks {
		if rs != nil {
			live++
			if s, ok := ix.slots.Get(rs.rank); !ok || s != rs.slot {
				t.Fatalf("rank %v in slot %d: slots map it to %d (%v)", rs.rank, rs.slot, s, ok)
			}
			if got := ix.slots.WorkerRanks(nil, rs.rank.Worker); !slices.Contains(got, rs.rank) {
				t.Fatalf("rank %v not among its worker's ranks %v", rs.rank, got)
			}
			mapped += int64(rs.blocks.len())
			if err := rs.blocks.check(); err != nil {
				t.Fatalf("rank %v: %v", rs.rank, err)
			}
		}
	}
	if live != ix.slots.Len() {
		t.Fatalf("%d ranks in slots, %d mapped", live, ix.slots.Len())
	}
	if mapped != entries {
		t.Fatalf("rank maps hold %d entries, tree holds %d", mapped, entries)
	}
}
