package e2e

import (
	"context"
	"encoding/binary"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/internal/wirepack"
)

// TestAgentIndexesVLLMOffloadingBytes publishes vLLM's own bytes through a
// real kvagent to a cluster: frames and payloads built as vLLM's
// ZmqEventPublisher and msgspec write them (wire.md), with the encodings
// the decoder's interop tests pin (kvevent/engine, upstream_compat_test.go:
// TestVLLMOffloadPlaceholderStoreIsIndexed,
// TestVLLMOffloadEvictionFanOutRemovesEveryHash), sent as they are over
// real libzmq. The other agent tests publish what publisher.py encodes from
// event specs, which is our reading of the wire; this one sends the bytes
// the decoder's tests were checked against, so that the whole path from
// the engine's socket to the router's index is held to them.
//
// The sequence is vLLM's with its offloading connector: a device store of
// a chain of 3 blocks with their tokens; the connector's placeholder
// stores of those blocks on the host (block_size 0, no tokens, no parent,
// medium CPU, one event per block); then the device evicts the chain in one
// BlockRemoved that names a hash twice. The router must hold the 3 blocks
// on the host, chained where a route of the prompt finds them, and none on
// the device. Then two device copies of the chain (two requests filled it
// at once), evicted one at a time: the blocks stay on the device until the
// second eviction. A last AllBlocksCleared empties the rank.
func TestAgentIndexesVLLMOffloadingBytes(t *testing.T) {
	pypub.Require(t)
	c := startClusterNATS(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The tiered view: a route counts the device prefix, then the host
	// blocks after it, so that it tells the tiers apart.
	c.waitFor(readyTimeout, "the tiered view to be set", func() (bool, string) {
		err := c.cl.SetSettings(ctx, indexer.DefaultParams(), indexer.ViewTiered)
		return err == nil, fmt.Sprint(err)
	})
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*"})
	startAgent(t, c, pub)
	pub.WaitSub()
	c.waitFor(readyTimeout, "the agent to register worker 1", func() (bool, string) {
		ws, err := c.cl.Workers(ctx)
		return err == nil && len(ws) == 1 && ws[0].WorkerID == 1, fmt.Sprint(ws, err)
	})

	// vLLM's block hashes are 64-bit ints, written as uint64 (0xcf) when
	// they need the top bit.
	const h1, h2, h3 = uint64(0xdab89baa7b5857c0), uint64(0x8ab89baa7b5857c1), uint64(0x7ab89baa7b5857c2)
	hashes := []any{wirepack.U64(h1), wirepack.U64(h2), wirepack.U64(h3)}
	prompt := make([]uint32, 3*agentBlockSize)
	for i := range prompt {
		prompt[i] = uint32(1000 + 7*i)
	}
	var seq uint64
	// publish sends one KVEventBatch as vLLM's ZmqEventPublisher does:
	// [topic, seq as 8 bytes big-endian, payload], the topic vLLM's default
	// "", the payload msgspec's array_like [ts, events, data_parallel_rank].
	publish := func(events ...any) {
		t.Helper()
		payload, err := wirepack.Pack([]any{1.7e9 + float64(seq)/4, events, 0})
		if err != nil {
			t.Fatal(err)
		}
		pub.Raw(nil, binary.BigEndian.AppendUint64(nil, seq), payload)
		seq++
	}
	// wantIndex waits until the rank holds want per tier, and a route of
	// the prompt finds overlap: the device prefix, then the host blocks
	// after it.
	wantIndex := func(what string, want, overlap api.TierBlocks) {
		t.Helper()
		c.waitFor(convergeTimeout, what, func() (bool, string) {
			cctx, ccancel := context.WithTimeout(ctx, callTimeout)
			defer ccancel()
			got, ok := rankBlocks(cctx, c.nodes[0], 1)
			if !ok || got != want {
				return false, fmt.Sprintf("worker 1 rank 0 holds %+v", got)
			}
			res, err := c.cl.Route(cctx, api.RouteRequest{TokenIDs: prompt})
			if err != nil {
				return false, fmt.Sprintf("route: %v", err)
			}
			if o := overlapOf(res, 1); o != overlap.Array() {
				return false, fmt.Sprintf("the route of the prompt overlaps %v", o)
			}
			return true, ""
		})
	}

	// The device store: tagged array_like BlockStored [tag, block_hashes,
	// parent_block_hash, token_ids, block_size, lora_id, medium,
	// lora_name], msgspec leaving out the trailing defaults.
	publish([]any{"BlockStored", hashes, nil, prompt, agentBlockSize, nil, "GPU", nil})
	wantIndex("the device store of 3 blocks", api.TierBlocks{Device: 3}, api.TierBlocks{Device: 3})

	// The offloading connector's placeholders (events.py,
	// OffloadingEventsTracker._placeholder_stored), one store per block.
	var placeholders []any
	for _, h := range hashes {
		placeholders = append(placeholders, []any{"BlockStored", []any{h}, nil, []any{}, 0, nil, "CPU", nil})
	}
	publish(placeholders...)
	wantIndex("the host placeholders of the 3 blocks", api.TierBlocks{Device: 3, Host: 3}, api.TierBlocks{Device: 3})

	// The device evicts the chain, tail first, one hash named twice.
	publish([]any{"BlockRemoved", []any{hashes[2], hashes[1], hashes[0], hashes[2]}, "GPU"})
	wantIndex("the device eviction to leave the 3 blocks on the host only", api.TierBlocks{Host: 3}, api.TierBlocks{Host: 3})

	// Two requests fill the chain on the device at once: vLLM's prefix cache
	// does not de-duplicate, so each caches a copy and announces it. The
	// eviction of one copy leaves the other, routed to; the blocks go with
	// the second eviction. A marker store after the first eviction shows it
	// was applied (batches apply in order).
	for range 2 {
		publish([]any{"BlockStored", hashes, nil, prompt, agentBlockSize, nil, "GPU", nil})
	}
	wantIndex("two device copies of the chain", api.TierBlocks{Device: 3, Host: 3}, api.TierBlocks{Device: 3})
	const marker = uint64(0x1234)
	markerTokens := make([]uint32, agentBlockSize)
	for i := range markerTokens {
		markerTokens[i] = uint32(50000 + i)
	}
	publish(
		[]any{"BlockRemoved", []any{hashes[2], hashes[1], hashes[0]}, "GPU"},
		[]any{"BlockStored", []any{wirepack.U64(marker)}, nil, markerTokens, agentBlockSize, nil, "GPU", nil})
	wantIndex("the eviction of one copy to leave the other", api.TierBlocks{Device: 4, Host: 3}, api.TierBlocks{Device: 3})
	publish([]any{"BlockRemoved", []any{hashes[2], hashes[1], hashes[0]}, "GPU"})
	wantIndex("the eviction of the last copy", api.TierBlocks{Device: 1, Host: 3}, api.TierBlocks{Host: 3})

	// A reset of the engine's prefix cache: AllBlocksCleared, a tag with no
	// fields, wipes the rank in every tier.
	publish([]any{"AllBlocksCleared"})
	wantIndex("the clear to empty the rank", api.TierBlocks{}, api.TierBlocks{})
}
