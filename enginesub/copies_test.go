package enginesub

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/tinylib/msgp/msgp"
)

// storedTwiceThenTruncated is a batch that announces four events, two
// stores of h (two copies) and the two removes of those copies, which the
// payload cuts off (corrupted on the way): the decoder reads the two stores,
// then fails the payload (ErrPayload). The engine holds no copy of h after it.
func storedTwiceThenTruncated(h uint64) []byte {
	b := msgp.AppendArrayHeader(nil, 3)
	b = msgp.AppendFloat64(b, 1.5)
	b = msgp.AppendArrayHeader(b, 4)
	b = appendStored(b, h)
	b = appendStored(b, h)
	// events[2]: a BlockRemoved of h, cut off after its type; events[3] lost
	b = msgp.AppendArrayHeader(b, 2)
	b = msgp.AppendString(b, "BlockRemoved")
	return b
}

// A rejected payload (ErrPayload) is lost whole: the sink never gets its
// stores, and its events past the bad bytes (removes, perhaps) were never
// read. The copies the decoder counted from the part it read must go with
// it, as at any resync; but a rejected batch right after a resync does not
// resync again (c.resynced), so nothing forgets them. The two copies counted
// from the rejected batch then absorb the removes of the one copy the
// engine stores next, and the router keeps a block the engine evicted.
func TestRejectedBatchAfterResyncLeavesNoCopiesCounted(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, nil)
	const h = 0xd0d0
	for i, p := range [][]byte{
		{0xc1},                      // 0: not a batch: resync bad_payload
		storedTwiceThenTruncated(h), // 1: rejected too; no second resync
		storedOnce(h),               // 2: the engine's one copy of h
		removedPayload(h, 0),        // 3: ... evicted
	} {
		if err := c.live(bg, [][]byte{{}, seqFrame(uint64(i)), p}); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	last := calls[len(calls)-1]
	if len(last.events) != 1 || last.events[0].Kind != kvevent.KindRemoved || !slices.Equal(last.events[0].Removed, []uint64{h}) {
		t.Fatalf("sink calls %s; batch 3 gave the sink %v, want the remove of %#x (copies still counted: %d): the router keeps a block the engine evicted",
			trace(calls), last.events, h, c.dec.Stats().Copies)
	}
}

// The same with one rejected payload: the batch that shows a gap (no replay
// endpoint: the rank resyncs, then the batch is applied) is the one
// rejected. Its two stores stay counted after the resync's ForgetCopies.
func TestRejectedBatchAtAGapLeavesNoCopiesCounted(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, nil)
	const h = 0xd1d1
	for _, m := range [][][]byte{
		{{}, seqFrame(0), storedOnce(0xeeee)},
		{{}, seqFrame(2), storedTwiceThenTruncated(h)}, // 1 lost: resync gap; then rejected
		{{}, seqFrame(3), storedOnce(h)},
		{{}, seqFrame(4), removedPayload(h, 0)},
	} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	last := calls[len(calls)-1]
	if len(last.events) != 1 || last.events[0].Kind != kvevent.KindRemoved {
		t.Fatalf("sink calls %s; batch 4 gave the sink %v, want the remove of %#x (copies still counted: %d)",
			trace(calls), last.events, h, c.dec.Stats().Copies)
	}
}
