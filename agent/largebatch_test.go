package agent

import (
	"testing"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/kvevent"
)

// smallBuffer is the publisher's per-rank buffer of the large-batch tests:
// a batch past it costs a few dozen events, not 65537.
const smallBuffer = 16

// largeBatch is a store of the chain 1, 2, 3 in tier, removes of blocks
// the rank never held, then the remove of block 3: more events than
// smallBuffer, more than twice. Applied whole, in order, the rank holds
// the chain 1, 2.
func largeBatch(tier kvevent.Tier) []kvevent.Event {
	st := storedChain(0, 1, 2, 3)
	st.Tier = tier
	evs := []kvevent.Event{st}
	for i := range 2*smallBuffer + 5 {
		evs = append(evs, kvevent.Event{Rank: rank, Kind: kvevent.KindRemoved, Tier: tier, Removed: []uint64{1<<40 + uint64(i)}})
	}
	return append(evs, kvevent.Event{Rank: rank, Kind: kvevent.KindRemoved, Tier: tier, Removed: []uint64{3}})
}

// TestLargeEngineBatchIsPublished: an engine batch of more events than the
// publisher's buffer holds is published in parts, in order, with
// consecutive ids, and reaches the router whole. From a review: the agent
// published it as one batch, which the publisher refuses (ErrTooLarge):
// the subscriber resynced the rank, the agent cleared it on the router,
// and every store of the batch was lost (a vLLM step that evicts more
// than 65536 blocks sends that many removes in one batch).
func TestLargeEngineBatchIsPublished(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgentWith(t, r, Config{Publisher: eventplane.PublisherConfig{BufferEvents: smallBuffer}})
	evs := largeBatch(kvevent.TierDevice)
	if err := a.Events(rank, 0, evs); err != nil {
		t.Fatalf("an engine batch of %d events, the buffer holding %d: %v", len(evs), smallBuffer, err)
	}
	if _, last := a.Publisher().Cursor(rank); last != uint64(len(evs)) {
		t.Fatalf("last id %d after a batch of %d events, want one id per event", last, len(evs))
	}
	waitFor(t, "the router to hold the chain 1, 2 (the store and the last remove applied)", func() bool { return matched(r, 3) == 2 })
}

// TestLargeOffloadBatchIsPublished: a batch of an offload pool (Publish)
// of more events than the publisher's buffer holds is published in parts
// too, and Publish returns the id of its last event.
func TestLargeOffloadBatchIsPublished(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgentWith(t, r, Config{Publisher: eventplane.PublisherConfig{BufferEvents: smallBuffer}})
	evs := largeBatch(kvevent.TierHostPinned)
	last, err := a.Publish(rank, evs)
	if err != nil {
		t.Fatalf("an offload batch of %d events, the buffer holding %d: %v", len(evs), smallBuffer, err)
	}
	if _, cur := a.Publisher().Cursor(rank); last != uint64(len(evs)) || cur != last {
		t.Fatalf("Publish returned %d, the publisher's last id is %d, after a batch of %d events", last, cur, len(evs))
	}
	waitFor(t, "the router to hold the chain 1, 2 in host memory", func() bool {
		return tieredMatch(r, []uint64{1001, 1002, 1003})[kvevent.TierHostPinned] == 2
	})
}

// TestInvalidLargeBatchPublishesNothing: a batch published in parts is
// checked whole first: an invalid event in a later part leaves the
// publisher and the mirror as they were (no part of it goes out).
func TestInvalidLargeBatchPublishesNothing(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgentWith(t, r, Config{Publisher: eventplane.PublisherConfig{BufferEvents: smallBuffer}})
	for _, tc := range []struct {
		name    string
		publish func([]kvevent.Event) error
	}{
		{"Events", func(evs []kvevent.Event) error { return a.Events(rank, 0, evs) }},
		{"Publish", func(evs []kvevent.Event) error { _, err := a.Publish(rank, evs); return err }},
	} {
		evs := largeBatch(kvevent.TierDevice)
		evs[len(evs)-1].Removed = nil // a remove with no hashes
		if err := tc.publish(evs); err == nil {
			t.Fatalf("%s: a batch with an invalid last event was taken", tc.name)
		}
		if _, last := a.Publisher().Cursor(rank); last != 0 {
			t.Fatalf("%s: %d events published of a batch with an invalid event", tc.name, last)
		}
		if d, _ := a.dump(rank); len(d) != 0 {
			t.Fatalf("%s: the mirror took %d blocks of a batch with an invalid event", tc.name, len(d))
		}
	}
}
