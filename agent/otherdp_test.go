package agent

import (
	"context"
	"testing"
	"time"

	"github.com/tinylib/msgp/msgp"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/sim/enginepub"
)

// TestBatchOfAnotherDPRankIsNotFiledUnderTheFollowedRank: Dynamo's
// TensorRT-LLM relay publisher (ai-dynamo/dynamo components/src/dynamo/trtllm
// publisher.py, ZmqKvEventPublisher: one PUB socket and one sequence for
// the worker, each batch [ts, [event], attention_dp_rank]) sends every
// attention-DP rank's events on the one endpoint, which the agent follows
// as rank 0. The agent filed every event under the rank followed, so rank
// 3's blocks were indexed as rank 0's (the router sent rank 0 requests for
// a prefix only rank 3 held), and rank 3's clear cleared rank 0. Through
// the agent as New configures it, over real libzmq: rank 3's store and
// clear are left out, and rank 0's own batches, on the same sequence,
// still apply without a resync.
func TestBatchOfAnotherDPRankIsNotFiledUnderTheFollowedRank(t *testing.T) {
	r := startRouter(t)
	pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", Buffer: -1, Linger: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	a, _ := startAgentWith(t, r, Config{Endpoint: pub.Endpoint()})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	block := func(first uint32) ([]uint32, uint64) {
		toks := []uint32{first, first + 1, first + 2, first + 3}
		return toks, kvevent.LocalHash(toks, kvevent.Seed)
	}
	send := func(dp int, add func(b []byte) []byte) {
		t.Helper()
		b := msgp.AppendArrayHeader(nil, 3)
		b = msgp.AppendArrayHeader(msgp.AppendFloat64(b, 1.5), 1)
		if _, err := pub.Publish(msgp.AppendInt(add(b), dp)); err != nil {
			t.Fatal(err)
		}
	}
	store := func(h uint64, toks []uint32) func(b []byte) []byte {
		return func(b []byte) []byte { return hybridStore(b, h, toks, 0, "full_attention") }
	}
	otherToks, otherLocal := block(1)
	ownToks, ownLocal := block(100)
	send(3, store(0x11, otherToks))
	send(0, store(0x21, ownToks)) // rank 0's own, after it on the sequence
	waitFor(t, "rank 0's own block", func() bool { return heldBy(r, ownLocal) })
	if heldBy(r, otherLocal) {
		t.Fatal("rank 0 holds the block of a batch whose data_parallel_rank is 3")
	}

	send(3, func(b []byte) []byte { return msgp.AppendString(msgp.AppendArrayHeader(b, 1), "AllBlocksCleared") })
	markToks, markLocal := block(200)
	send(0, store(0x22, markToks))
	waitFor(t, "rank 0's batch after rank 3's clear", func() bool { return heldBy(r, markLocal) })
	if !heldBy(r, ownLocal) {
		t.Fatal("rank 3's AllBlocksCleared cleared rank 0's block")
	}
	st := a.Subscribers()[0].Stats()
	if st.Resyncs != 0 || st.Decoder.Skipped[engine.ReasonOtherDPRank] != 2 {
		t.Fatalf("subscriber stats %+v: want no resync and 2 events of rank 3 skipped as %v", st, engine.ReasonOtherDPRank)
	}
}
