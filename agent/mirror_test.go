package agent

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestPoolBlockBelowARemovedParentSurvivesADump: the engine stores 1, G2
// holds 2 below it, and the engine evicts 1, its last copy. Nothing
// reaches 2 until 1 is stored again: the agent parks it and takes it off
// the router, and a dump meanwhile cannot lose it; the engine storing 1
// again brings it back. From a review: the mirror kept 2 below a block
// it no longer held, a dump (which leaves out what no lookup reaches)
// took 2 off the router, and the engine storing 1 again never brought it
// back.
func TestPoolBlockBelowARemovedParentSurvivesADump(t *testing.T) {
	for _, dump := range []bool{false, true} {
		t.Run(fmt.Sprintf("dump=%v", dump), func(t *testing.T) {
			r := startRouter(t)
			reg := prometheus.NewRegistry()
			a, _ := startAgentWith(t, r, Config{Registerer: reg})
			must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
			x := storedChain(1, 2)
			x.Tier = kvevent.TierHostPinned
			_, err := a.Publish(rank, []kvevent.Event{x})
			must(t, err)
			waitFor(t, "1 and the pool's 2 on the router", func() bool { return matched(r, 2) == 2 })
			must(t, a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{1}}}))
			caughtUp(t, r, a)
			if n, h := metric(t, reg, "kvagent_offload_parked_blocks"), tierBlocks(r, kvevent.TierHostPinned); n != 1 || h != 0 {
				t.Fatalf("after 1 was evicted: %v pool blocks parked (want 1), the router holds %d G2 blocks (want 0)", n, h)
			}
			if dump { // any dump: the router asked for one, a lapse, a buffer overrun
				resyncAndWait(t, a)
			}
			must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
			caughtUp(t, r, a)
			if got := matched(r, 2); got != 2 {
				t.Fatalf("the router matches %d of the engine's 1 and the pool's 2, want 2", got)
			}
		})
	}
}

// TestPoolBlockBelowARemovedParentSurvivesAClear: as above, with the
// engine restarting while 1 is evicted. From a review: the clear dropped
// 2 for good (its parent's hash was no longer known), though the pool
// held it.
func TestPoolBlockBelowARemovedParentSurvivesAClear(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
	x := storedChain(1, 2, 3)
	x.Tier = kvevent.TierDisk
	_, err := a.Publish(rank, []kvevent.Event{x})
	must(t, err)
	must(t, a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{1}}}))
	a.Reset(rank)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
	caughtUp(t, r, a)
	waitFor(t, "the router to match the engine's 1 and the pool's 2 and 3", func() bool {
		return matched(r, 3) == 3 && tierBlocks(r, kvevent.TierDisk) == 2
	})
}

// entrySet is a rank dump's residencies as sorted "hash:mask" strings.
func entrySet(d indexer.RankDump) []string {
	out := make([]string, 0, len(d.Entries))
	for _, e := range d.Entries {
		out = append(out, fmt.Sprintf("%d:%b", e.EngineHash, e.Mask))
	}
	slices.Sort(out)
	return out
}

// routerHoldsTheMirror waits until the publisher has nothing pending and
// the router holds exactly the residencies the mirror holds.
func routerHoldsTheMirror(t *testing.T, r *router, a *Agent) {
	t.Helper()
	var mir, rt []string
	deadline := time.Now().Add(15 * time.Second)
	for {
		if a.Publisher().Pending() == 0 && a.Publisher().Synced(rank) != 0 {
			a.mu.Lock()
			md, _ := a.mirror.DumpRank(rank)
			a.mu.Unlock()
			rd, _ := r.node.FSM().Index().DumpRank(rank)
			if mir, rt = entrySet(md), entrySet(rd); slices.Equal(mir, rt) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the router and the mirror disagree:\nmirror %v\nrouter %v", mir, rt)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// randomTree is a fixed tree of blocks 1..n: parent[h] < h, 0 for a root
// block.
func randomTree(rng *rand.Rand, n int) []uint64 {
	parent := make([]uint64, n+1)
	for h := 2; h <= n; h++ {
		if rng.IntN(4) > 0 {
			parent[h] = uint64(1 + rng.IntN(h-1))
		}
	}
	return parent
}

// TestMirrorRouterAndPoolsAgree drives engine stores (a block once its
// parent is stored, as vLLM does) and removes (of any block, its parent
// too), pool stores and removes in G2 and G3, engine clears and resets,
// and dumps asked for, at random. Each pool block is always either in
// the mirror in its tier or parked, never both, and the mirror holds no
// pool block the pools do not; once the publisher has nothing pending,
// the router holds what the mirror holds. From a review: a pool block
// below a block the engine evicted was lost at a clear, and left out of
// dumps.
func TestMirrorRouterAndPoolsAgree(t *testing.T) {
	s := seed(t)
	for round := range uint64(6) {
		t.Run(fmt.Sprint(round), func(t *testing.T) { mirrorModel(t, rand.New(rand.NewPCG(s, round)), round) })
	}
}

func mirrorModel(t *testing.T, rng *rand.Rand, round uint64) {
	r := startRouter(t)
	cfg := Config{}
	if round%2 == 1 {
		cfg.Publisher.BufferEvents = 3 // DropOldest, and batches in parts
	}
	a, _ := startAgentWith(t, r, cfg)
	const n = 40
	parent := randomTree(rng, n)
	ev := func(h uint64, tier kvevent.Tier) kvevent.Event {
		e := storedChain(parent[h], h)
		e.Tier = tier
		return e
	}
	pools := map[kvevent.Tier]map[uint64]bool{kvevent.TierHostPinned: {}, kvevent.TierDisk: {}}
	eng := map[uint64]bool{}
	var steps []string
	defer func() {
		if t.Failed() {
			for _, l := range steps {
				t.Log(l)
			}
		}
	}()
	// check returns what breaks the rule for the pools' blocks, or "".
	check := func() string {
		a.mu.Lock()
		defer a.mu.Unlock()
		md, _ := a.mirror.DumpRank(rank)
		held := map[kvevent.Tier]map[uint64]bool{kvevent.TierHostPinned: {}, kvevent.TierDisk: {}}
		for _, e := range md.Entries {
			for tier := range held {
				if e.Mask.Has(tier) {
					held[tier][e.EngineHash] = true
				}
			}
		}
		p := a.parked[rank]
		for tier, hs := range pools {
			for h := range hs {
				isParked := false
				if p != nil {
					_, isParked = p.blocks[parkKey{tier, h}]
				}
				switch {
				case !held[tier][h] && !isParked:
					return fmt.Sprintf("pool block %d in %v neither in the mirror nor parked", h, tier)
				case held[tier][h] && isParked:
					return fmt.Sprintf("pool block %d in %v both in the mirror and parked", h, tier)
				}
			}
			for h := range held[tier] {
				if !hs[h] {
					return fmt.Sprintf("the mirror holds %d in %v, which the pool does not", h, tier)
				}
			}
		}
		if p != nil {
			for k := range p.blocks {
				if !pools[k.tier][k.hash] {
					return fmt.Sprintf("%d in %v parked, which the pool does not hold", k.hash, k.tier)
				}
			}
		}
		return ""
	}
	for step := range 400 {
		if msg := check(); msg != "" {
			t.Fatalf("before step %d: %s", step, msg)
		}
		note := func(what string, args ...any) {
			steps = append(steps, fmt.Sprintf("step %d: ", step)+fmt.Sprintf(what, args...))
		}
		h := uint64(1 + rng.IntN(n))
		tier := kvevent.TierHostPinned + kvevent.Tier(rng.IntN(2))
		switch k := rng.IntN(20); {
		case k < 8:
			if parent[h] == 0 || eng[parent[h]] {
				must(t, a.Events(rank, 0, []kvevent.Event{ev(h, kvevent.TierDevice)}))
				eng[h] = true
				note("engine store %d (parent %d)", h, parent[h])
			}
		case k < 11:
			if eng[h] {
				must(t, a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{h}}}))
				delete(eng, h)
				note("engine remove %d", h)
			}
		case k < 14:
			if !pools[tier][h] {
				_, err := a.Publish(rank, []kvevent.Event{ev(h, tier)})
				must(t, err)
				pools[tier][h] = true
				note("pool store %d in %v (parent %d)", h, tier, parent[h])
			}
		case k < 17:
			if pools[tier][h] {
				_, err := a.Publish(rank, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Tier: tier, Removed: []uint64{h}}})
				must(t, err)
				delete(pools[tier], h)
				note("pool remove %d in %v", h, tier)
			}
		case k == 17:
			a.Publisher().Resync(rank)
			note("a dump asked for")
		case k == 18:
			if round%2 == 1 {
				a.Resync(rank, enginesub.ReasonOverrun)
			} else {
				a.Reset(rank)
			}
			clear(eng)
			note("reset")
		default:
			must(t, a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindCleared}}))
			clear(eng)
			note("engine cleared")
		}
	}
	if msg := check(); msg != "" {
		t.Fatalf("at the end: %s", msg)
	}
	routerHoldsTheMirror(t, r, a)
}

// TestConcurrentEngineAndPoolsLeaveTheRouterHoldingTheMirror: engine
// batches, pool batches and dumps asked for, at once; once the publisher
// has nothing pending the router holds what the mirror holds. From a
// review: dumps left out pool blocks below a block the engine evicted,
// which the mirror kept.
func TestConcurrentEngineAndPoolsLeaveTheRouterHoldingTheMirror(t *testing.T) {
	s := seed(t)
	for round := range uint64(4) {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			r := startRouter(t)
			cfg := Config{}
			if round%2 == 1 {
				cfg.Publisher.BufferEvents = 4
			}
			a, _ := startAgentWith(t, r, cfg)
			const n = 40
			parent := randomTree(rand.New(rand.NewPCG(s, round)), n)
			ev := func(h uint64, tier kvevent.Tier) kvevent.Event {
				e := storedChain(parent[h], h)
				e.Tier = tier
				return e
			}
			var wg sync.WaitGroup
			wg.Add(3)
			go func() { // the engine
				defer wg.Done()
				rng := rand.New(rand.NewPCG(s, round<<8|1))
				eng := map[uint64]bool{}
				for range 400 {
					h := uint64(1 + rng.IntN(n))
					switch k := rng.IntN(10); {
					case k < 5:
						if parent[h] == 0 || eng[parent[h]] {
							_ = a.Events(rank, 0, []kvevent.Event{ev(h, kvevent.TierDevice)})
							eng[h] = true
						}
					case k < 8:
						if eng[h] {
							_ = a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{h}}})
							delete(eng, h)
						}
					case k == 8:
						_ = a.Events(rank, 0, []kvevent.Event{{Rank: rank, Kind: kvevent.KindCleared}})
						clear(eng)
					default:
						a.Reset(rank)
						clear(eng)
					}
				}
			}()
			go func() { // the pools
				defer wg.Done()
				rng := rand.New(rand.NewPCG(s, round<<8|2))
				pools := map[kvevent.Tier]map[uint64]bool{kvevent.TierHostPinned: {}, kvevent.TierDisk: {}}
				for range 400 {
					h := uint64(1 + rng.IntN(n))
					tier := kvevent.TierHostPinned + kvevent.Tier(rng.IntN(2))
					if !pools[tier][h] {
						_, _ = a.Publish(rank, []kvevent.Event{ev(h, tier)})
						pools[tier][h] = true
					} else {
						_, _ = a.Publish(rank, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Tier: tier, Removed: []uint64{h}}})
						delete(pools[tier], h)
					}
				}
			}()
			go func() { // dumps asked for
				defer wg.Done()
				for range 40 {
					a.Publisher().Resync(rank)
					time.Sleep(time.Millisecond) // spreads them over the run; nothing waits on it
				}
			}()
			wg.Wait()
			routerHoldsTheMirror(t, r, a)
		})
	}
}
