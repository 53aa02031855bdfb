package compat

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/tinylib/msgp/msgp"
)

// TestEveryHashPathFindsASaltedLoRAStore: the same prompt hashed by every
// path that turns token ids into content hashes — kvevent.LocalHashes, the
// engine decoder (the agent's and the agentless path's), the simulated
// engine's wire, /v1/route, the compatible /query and /selection/select —
// lands on the same blocks: a store decoded from an engine's tokens is
// found by each route path, full blocks only, under its LoRA name and the
// worker's salt, and by none without either. Each path seeds its hashes
// itself (kvevent.SeedFor), so one that dropped the LoRA name or the salt
// would match nothing and still answer 200.
func TestEveryHashPathFindsASaltedLoRAStore(t *testing.T) {
	const bs, salt, lora = 4, "tenant-a", "ad"
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 4294967295, 0, 65536, 70000}
	routed := append(append([]uint32{}, prompt...), 9, 9) // a partial last block

	// The engine's store, as vLLM's array encoding carries it.
	var p []byte
	p = msgp.AppendArrayHeader(p, 3)
	p = msgp.AppendFloat64(p, 1.5)
	p = msgp.AppendArrayHeader(p, 1)
	p = msgp.AppendArrayHeader(p, 9)
	p = msgp.AppendString(p, "BlockStored")
	p = msgp.AppendArrayHeader(p, 3)
	for _, h := range []int64{-5, 1 << 40, -1 << 62} {
		p = msgp.AppendInt64(p, h)
	}
	p = msgp.AppendNil(p)
	p = msgp.AppendArrayHeader(p, uint32(len(prompt)))
	for _, tk := range prompt {
		p = msgp.AppendUint32(p, tk)
	}
	p = msgp.AppendInt(p, bs)
	p = msgp.AppendNil(p)
	p = msgp.AppendString(p, "GPU")
	p = msgp.AppendString(p, lora)
	p = msgp.AppendNil(p)
	p = msgp.AppendUint32(p, 0)

	d, err := engine.NewDecoder(engine.Config{Rank: kvevent.Rank{Worker: 7}, BlockSize: bs, Seed: engine.SaltedSeed(salt)})
	if err != nil {
		t.Fatal(err)
	}
	var b engine.Batch
	if err := d.Decode(p, &b); err != nil || len(b.Events) != 1 {
		t.Fatalf("decode: %v, %d events, stats %+v", err, len(b.Events), d.Stats())
	}
	ev := b.Events[0]
	want := kvevent.LocalHashes(nil, routed, bs, kvevent.SeedFor(lora, salt))
	if len(want) != 3 || len(ev.Blocks) != 3 {
		t.Fatalf("LocalHashes gave %d, the decoder %d blocks, want 3", len(want), len(ev.Blocks))
	}
	for i := range want {
		if ev.Blocks[i].LocalHash != want[i] {
			t.Fatalf("block %d: decoder %#x, LocalHashes %#x", i, ev.Blocks[i].LocalHash, want[i])
		}
	}

	// The simulated engine's wire (no LoRA, no salt) decodes to the
	// Expander's own content hashes.
	{
		wp := sim.AppendBatch(nil, 1, []sim.WireEvent{{Kind: kvevent.KindStored, Hashes: []uint64{11, 12, 13}, Tokens: prompt, BlockSize: bs}}, 0)
		sd, _ := engine.NewDecoder(engine.Config{Rank: kvevent.Rank{Worker: 7}, BlockSize: bs})
		var sb engine.Batch
		if err := sd.Decode(wp, &sb); err != nil || len(sb.Events) != 1 {
			t.Fatalf("sim wire decode: %v", err)
		}
		plain := kvevent.LocalHashes(nil, prompt, bs, kvevent.Seed)
		for i, bl := range sb.Events[0].Blocks {
			if bl.LocalHash != plain[i] {
				t.Fatalf("sim wire block %d: %#x, want %#x", i, bl.LocalHash, plain[i])
			}
		}
	}

	n := startNode(t)
	ctx := context.Background()
	if err := n.node.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 7, DPRanks: []uint32{0}, BlockSize: bs, Model: "llama", Salt: salt,
		Capacity: [4]int64{1000, 0, 0, 0}}); err != nil {
		t.Fatal(err)
	}
	ev.Rank, ev.EventID = kvevent.Rank{Worker: 7}, 1
	ev.Blocks = append([]kvevent.Block(nil), ev.Blocks...)
	if _, err := n.node.IngestEvents(ctx, []raftfsm.RankBatch{{Rank: ev.Rank, Events: []kvevent.Event{ev}}}); err != nil {
		t.Fatal(err)
	}

	// /v1/route over HTTP, with the LoRA and salt, and without either.
	for _, c := range []struct {
		lora, salt string
		want       float64
	}{{lora, salt, 3}, {"", salt, 0}, {lora, "", 0}} {
		body := map[string]any{"token_ids": routed, "lora_name": c.lora, "cache_salt": c.salt, "brief": true}
		r := n.do(t, codecJSON, "POST", "/v1/route", body)
		var m struct {
			Overlap map[string]float64 `json:"overlap"`
		}
		if r.code != 200 || json.Unmarshal(r.body, &m) != nil {
			t.Fatalf("/v1/route %v: %d %s", body, r.code, r.body)
		}
		if m.Overlap["device"] != c.want {
			t.Errorf("/v1/route lora %q salt %q: overlap %s, want %v device blocks", c.lora, c.salt, r.body, c.want)
		}
	}
	// The compatible /query and /selection/select.
	r := n.do(t, codecJSON, "POST", "/query", QueryRequest{TokenIDs: routed, ModelName: "llama", LoRAName: lora, CacheSalt: salt})
	if r.code != 200 || !containsScore(r.body, 3*bs) {
		t.Errorf("/query: %d %s, want a score of 3 blocks (12 tokens)", r.code, r.body)
	}
	r = n.do(t, codecJSON, "POST", "/selection/select", SelectRequest{ModelName: "llama", TokenIDs: routed, ISLTokens: len(routed), LoRAName: lora, CacheSalt: salt})
	var sel SelectResponse
	if r.code != 200 || json.Unmarshal(r.body, &sel) != nil || sel.Overlap.GPU != 3*bs {
		t.Errorf("/selection/select: %d %s, want a GPU overlap of 3 blocks (12 tokens)", r.code, r.body)
	}
}

// containsScore reports whether a /query answer scores some rank n.
func containsScore(body []byte, n int) bool {
	var q struct {
		Scores map[string]map[string]int `json:"scores"`
	}
	if json.Unmarshal(body, &q) != nil {
		return false
	}
	for _, ranks := range q.Scores {
		for _, s := range ranks {
			if s == n {
				return true
			}
		}
	}
	return false
}

// TestBookedLoadCountsEachPositionOfRepeatedContent: a /v1/route booking
// keys its blocks by sequence hash (semantics.md §1, §6), so a prompt whose
// two blocks have the same tokens holds two active decode blocks, not one
// (booked by content hash, the two would be one key).
func TestBookedLoadCountsEachPositionOfRepeatedContent(t *testing.T) {
	const bs = 4
	n := startNode(t)
	if err := n.node.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 7, DPRanks: []uint32{0}, BlockSize: bs,
		Capacity: [4]int64{1000, 0, 0, 0}}); err != nil {
		t.Fatal(err)
	}
	body := map[string]any{"token_ids": []uint32{5, 5, 5, 5, 5, 5, 5, 5}, "book": true, "request_id": "r1", "brief": true}
	if r := n.do(t, codecJSON, "POST", "/v1/route", body); r.code != 200 {
		t.Fatalf("route: %d %s", r.code, r.body)
	}
	r := n.do(t, codecJSON, "GET", "/v1/workers", nil)
	var w struct {
		Workers []struct {
			Ranks []struct {
				Load struct {
					ActiveDecodeBlocks int64 `json:"active_decode_blocks"`
				} `json:"load"`
			} `json:"ranks"`
		} `json:"workers"`
	}
	if err := json.Unmarshal(r.body, &w); err != nil || len(w.Workers) != 1 || len(w.Workers[0].Ranks) != 1 {
		t.Fatalf("workers: %d %s", r.code, r.body)
	}
	if got := w.Workers[0].Ranks[0].Load.ActiveDecodeBlocks; got != 2 {
		t.Fatalf("active decode blocks %d, want 2 (two positions of the same content): %s", got, r.body)
	}
}
