package compat

import (
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestAgentlessLeavesOutBatchesOfAnotherDPRank: the leader's subscriber of
// an instance's dp rank 0 commits its batches as rank 0's (positionSink),
// as kvagent files them. An engine that publishes every dp rank's batches
// on the endpoint registered for rank 0 (Dynamo's TensorRT-LLM relay with
// attention DP, each batch [ts, events, attention_dp_rank]) had rank 3's
// blocks indexed as rank 0's and rank 3's clear clear rank 0: they are
// left out, and rank 0's own batches on the same sequence apply.
func TestAgentlessLeavesOutBatchesOfAnotherDPRank(t *testing.T) {
	n := startNode(t)
	pub := newEngine(t, false)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: pub.Endpoint(),
		ModelName: "llama", BlockSize: testBlockSize, DPRank: u32(0)}), 201, "register")
	ag := NewAgentless(n.node, AgentlessConfig{Poll: 20 * time.Millisecond, Registerer: prometheus.NewRegistry(), Logger: quiet})
	defer ag.Close()
	waitSubscribed(t, pub, 1)
	ofRank3 := func(ev map[string]any) []byte {
		b, err := msgpack.Marshal([]any{1.5, []any{ev}, 3})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, p := range [][]byte{
		storeBatch(100, 1),
		ofRank3(map[string]any{"type": "BlockStored", "block_hashes": []uint64{77},
			"block_size": testBlockSize, "token_ids": slices.Repeat([]uint32{7}, testBlockSize)}),
		ofRank3(map[string]any{"type": "AllBlocksCleared"}),
		storeBatch(101, 2),
	} {
		if _, err := pub.Publish(p); err != nil {
			t.Fatal(err)
		}
	}
	r := kvevent.Rank{Worker: WorkerID(1, "llama", DefaultTenant)}
	var stored []kvevent.Event
	waitFor(t, 10*time.Second, "rank 0's batch after rank 3's", func() bool {
		d, err := n.node.DumpRank(r)
		if err != nil {
			return false
		}
		stored = d.StoredEvents()
		return slices.ContainsFunc(stored, func(e kvevent.Event) bool { return e.Blocks[0].EngineHash == 101 })
	})
	var hashes []uint64
	for _, e := range stored {
		for _, b := range e.Blocks {
			hashes = append(hashes, b.EngineHash)
		}
	}
	slices.Sort(hashes)
	if !slices.Equal(hashes, []uint64{100, 101}) {
		t.Fatalf("rank 0 holds the engine hashes %v, want [100 101]: rank 3's store and clear are not rank 0's", hashes)
	}
}
