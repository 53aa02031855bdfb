package eventplane

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// owner plays the node agent: it keeps each rank's live state (the model
// the router's index must end up equal to), publishes every change, and
// answers dumps from the same state under the same lock.
type owner struct {
	mu    sync.Mutex
	rng   *rand.Rand
	pub   *Publisher
	ranks map[kvevent.Rank]*ownedRank
	hash  uint64
}

type ownedRank struct {
	live map[uint64]kvevent.Event // by the id it was published under
	last uint64
}

func newOwner(seed uint64) *owner {
	return &owner{rng: rand.New(rand.NewPCG(seed, 7)), ranks: map[kvevent.Rank]*ownedRank{}}
}

func (o *owner) rank(r kvevent.Rank) *ownedRank {
	or := o.ranks[r]
	if or == nil {
		or = &ownedRank{live: map[uint64]kvevent.Event{}}
		o.ranks[r] = or
	}
	return or
}

// step makes one change on rank r — store a fresh chain, or remove a live
// one whole — and publishes it.
func (o *owner) step(ctx context.Context, t testing.TB, r kvevent.Rank) {
	o.mu.Lock()
	defer o.mu.Unlock()
	or := o.rank(r)
	var ev kvevent.Event
	if len(or.live) > 4 && o.rng.IntN(3) == 0 {
		ids := make([]uint64, 0, len(or.live))
		for id := range or.live {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		id := ids[o.rng.IntN(len(ids))]
		old := or.live[id]
		ev = kvevent.Event{Kind: kvevent.KindRemoved, Tier: old.Tier}
		for _, b := range old.Blocks {
			ev.Removed = append(ev.Removed, b.EngineHash)
		}
		delete(or.live, id)
	} else {
		ev = kvevent.Event{Kind: kvevent.KindStored, Tier: kvevent.Tier(o.rng.IntN(kvevent.NumTiers))}
		for range 1 + o.rng.IntN(4) {
			o.hash++
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: o.hash, LocalHash: o.hash*0x9e3779b97f4a7c15 | 1})
		}
	}
	// Under o.mu, which dump takes too: PublishWait never waits for a
	// dump's room (TestPublishWaitUnderTheDumpLock).
	id, err := o.pub.PublishWait(ctx, r, []kvevent.Event{ev})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	or.last = id
	if ev.Kind == kvevent.KindStored {
		or.live[id] = ev
	}
}

// orphans publishes n stores on rank r whose parent the router never
// learns, which the owner does not keep (its engine has since dropped
// them): the router holds them as orphans, past its bound drops the
// oldest, and must ask for a dump of the rank.
func (o *owner) orphans(ctx context.Context, t testing.TB, r kvevent.Rank, n int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	or := o.rank(r)
	for range n {
		o.hash++
		ev := kvevent.Event{Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Parent: 1<<63 | o.hash, HasParent: true,
			Blocks: []kvevent.Block{{EngineHash: o.hash, LocalHash: o.hash*0x9e3779b97f4a7c15 | 1}}}
		id, err := o.pub.PublishWait(ctx, r, []kvevent.Event{ev})
		if err != nil {
			t.Fatalf("publish: %v", err)
		}
		or.last = id
	}
}

// dump is the publisher's DumpFunc.
func (o *owner) dump(r kvevent.Rank) ([]kvevent.Event, uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	or := o.rank(r)
	ids := make([]uint64, 0, len(or.live))
	for id := range or.live {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	out := make([]kvevent.Event, 0, len(ids))
	for _, id := range ids {
		out = append(out, or.live[id])
	}
	return out, or.last
}

// entries is the number of (rank, block) residencies the index must hold.
func (o *owner) entries() (n int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, or := range o.ranks {
		for _, ev := range or.live {
			n += int64(len(ev.Blocks))
		}
	}
	return n
}
