package agent

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/sim/enginepub"
	"github.com/tinylib/msgp/msgp"
)

// hybridStore is the map event of a device store of one block, hash h with
// tokens, by group g of kind kind (a hybrid model's KV cache groups).
func hybridStore(b []byte, h uint64, tokens []uint32, g int, kind string) []byte {
	b = msgp.AppendMapHeader(b, 6)
	b = msgp.AppendString(msgp.AppendString(b, "type"), "BlockStored")
	b = msgp.AppendArrayHeader(msgp.AppendString(b, "block_hashes"), 1)
	b = msgp.AppendUint64(b, h)
	b = msgp.AppendArrayHeader(msgp.AppendString(b, "token_ids"), uint32(len(tokens)))
	for _, tok := range tokens {
		b = msgp.AppendUint32(b, tok)
	}
	b = msgp.AppendInt(msgp.AppendString(b, "block_size"), len(tokens))
	b = msgp.AppendInt(msgp.AppendString(b, "group_idx"), g)
	return msgp.AppendString(msgp.AppendString(b, "kv_cache_spec_kind"), kind)
}

// hybridRemove is the map event of group g removing block h: as vLLM
// sends it, with a group_idx and no kv_cache_spec_kind.
func hybridRemove(b []byte, h uint64, g int) []byte {
	b = msgp.AppendMapHeader(b, 3)
	b = msgp.AppendString(msgp.AppendString(b, "type"), "BlockRemoved")
	b = msgp.AppendArrayHeader(msgp.AppendString(b, "block_hashes"), 1)
	b = msgp.AppendUint64(b, h)
	return msgp.AppendInt(msgp.AppendString(b, "group_idx"), g)
}

// hybridBatch is the batch [ts, events] of n events that add appends.
func hybridBatch(n uint32, add func(b []byte) []byte) []byte {
	b := msgp.AppendArrayHeader(nil, 2)
	b = msgp.AppendFloat64(b, 1.5)
	return add(msgp.AppendArrayHeader(b, n))
}

// heldBy says whether the router's index holds the block of content hash
// local for rank 7.
func heldBy(r *router, local uint64) bool {
	var m indexer.Matches
	r.node.FindMatches([]uint64{local}, indexer.ViewDedup, &m)
	for _, rm := range m.Ranks {
		if rm.Rank == rank && rm.Total() == 1 {
			return true
		}
	}
	return false
}

// TestHybridModelRemovesFollowTheirGroupsKind: a hybrid model whose
// sliding-window layers are group 0 and whose full-attention layers are
// group 1, through the agent as New configures it, over real libzmq.
// group 0's remove of a block full attention still holds is left out, and
// group 1's remove reaches the router. From a review: the agent's decoder
// filed every event without a kv_cache_spec_kind (every BlockRemoved) by
// wire.md's rule, group 0 being the main one, so it did the opposite: the
// router dropped blocks full attention held, and kept routing to blocks it
// had evicted. With NoLearnGroupKinds (kvagent --learn-group-kinds=false)
// it follows wire.md's rule, as before.
func TestHybridModelRemovesFollowTheirGroupsKind(t *testing.T) {
	t.Run("learned", func(t *testing.T) { hybridRemoves(t, false) })
	t.Run("wire rule", func(t *testing.T) { hybridRemoves(t, true) })
}

// hybridRemoves has the agent, with NoLearnGroupKinds set to noLearn,
// follow a hybrid model's groups 0 (sliding window) and 1 (full attention)
// storing a block, then group 0 removing it, then group 1.
func hybridRemoves(t *testing.T, noLearn bool) {
	r := startRouter(t)
	pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", Buffer: -1, Linger: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	a, _ := startAgentWith(t, r, Config{Endpoint: pub.Endpoint(), NoLearnGroupKinds: noLearn})
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	block := func(first uint32) ([]uint32, uint64) {
		toks := []uint32{first, first + 1, first + 2, first + 3}
		return toks, kvevent.LocalHash(toks, kvevent.Seed)
	}
	toks, local := block(1)
	send := func(n uint32, add func(b []byte) []byte) {
		t.Helper()
		if _, err := pub.Publish(hybridBatch(n, add)); err != nil {
			t.Fatal(err)
		}
	}
	// Both groups store the block (vLLM gives it one hash in every group).
	send(2, func(b []byte) []byte {
		return hybridStore(hybridStore(b, 0x11, toks, 0, "sliding_window"), 0x11, toks, 1, "full_attention")
	})
	waitFor(t, "the block in the router's index", func() bool { return heldBy(r, local) })

	// The sliding window moves past the block: full attention still holds
	// it. A store after the remove tells when the batch has been applied.
	mark1, markLocal1 := block(100)
	send(2, func(b []byte) []byte { return hybridStore(hybridRemove(b, 0x11, 0), 0x21, mark1, 1, "full_attention") })
	waitFor(t, "the batch of group 0's remove applied", func() bool { return heldBy(r, markLocal1) })
	if held := heldBy(r, local); held == noLearn {
		t.Fatalf("NoLearnGroupKinds %v: after group 0's (sliding window) remove the router holds the block: %v", noLearn, held)
	}

	// Full attention evicts it.
	mark2, markLocal2 := block(200)
	send(2, func(b []byte) []byte { return hybridStore(hybridRemove(b, 0x11, 1), 0x22, mark2, 1, "full_attention") })
	waitFor(t, "the batch of group 1's remove applied", func() bool { return heldBy(r, markLocal2) })
	if heldBy(r, local) {
		t.Fatalf("NoLearnGroupKinds %v: group 1's (full attention) remove did not reach the router: it routes to a block the engine evicted", noLearn)
	}
	// Group 0's store, and one of the removes, are what was left out.
	st := a.Subscribers()[0].Stats()
	if n := st.Decoder.Skipped[engine.ReasonNotMainGroup]; n != 2 {
		t.Fatalf("NoLearnGroupKinds %v: %d events skipped as not_main_group, want 2 (group 0's store, and a remove)", noLearn, n)
	}
}

// TestEngineBlocksAreHashedWithTheSalt: a worker registered with a salt
// (kvagent --salt, the engine's additional salt) has its blocks' content
// hashes seeded with it, through the agent as New configures it, over
// real libzmq: the router, which hashes a route's prompt with the
// worker's salt, finds the block under the salted hash, and not under
// the unsalted one. From a review: New giving its decoder no seed left
// every test but the end-to-end TestAgentRestartResyncs green.
func TestEngineBlocksAreHashedWithTheSalt(t *testing.T) {
	r := startRouter(t)
	pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", Buffer: -1, Linger: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	const salt = "tenant-a"
	cfg := Config{Endpoint: pub.Endpoint()}
	cfg.Registration.Salt = salt
	startAgentWith(t, r, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := pub.WaitSubscribed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	toks := []uint32{1, 2, 3, 4}
	salted, plain := kvevent.LocalHash(toks, kvevent.SeedFor("", salt)), kvevent.LocalHash(toks, kvevent.Seed)
	if _, err := pub.Publish(hybridBatch(1, func(b []byte) []byte { return hybridStore(b, 0x11, toks, 0, "full_attention") })); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the block in the router's index", func() bool { return heldBy(r, salted) || heldBy(r, plain) })
	if !heldBy(r, salted) || heldBy(r, plain) {
		t.Fatalf("the router holds the block under its salted hash %v, under its unsalted one %v: want the salted one only",
			heldBy(r, salted), heldBy(r, plain))
	}
}
