package indexer_test

import (
	"bytes"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/vmihailenco/msgpack/v5"
)

func packEvent(t *testing.T, v any) []byte {
	var buf bytes.Buffer
	if err := msgpack.NewEncoder(&buf).Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// TestPlaceholdersKeepAChainReachableAfterDeviceEviction: vLLM's offload
// placeholders (token-less, parentless, block_size 0) decoded into the index: device chain,
// CPU placeholders of each block, the device evicts all three: the chain is
// still reachable on the host tier; a STORAGE placeholder then joins it.
func TestPlaceholdersKeepAChainReachableAfterDeviceEviction(t *testing.T) {
	rank := kvevent.Rank{Worker: 7}
	d, err := engine.NewDecoder(engine.Config{Rank: rank, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	ix := indexer.New(indexer.Config{})
	toks := make([]uint32, 12)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	apply := func(evs ...any) {
		var b engine.Batch
		if err := d.Decode(packEvent(t, []any{1.0, evs, nil}), &b); err != nil {
			t.Fatal(err)
		}
		for i := range b.Events {
			if err := ix.Apply(&b.Events[i], 1); err != nil {
				t.Fatalf("apply %+v: %v", b.Events[i], err)
			}
		}
	}
	h := []uint64{101, 102, 103}
	apply([]any{"BlockStored", h, nil, toks, 4, nil, "GPU"})
	for _, x := range h {
		apply([]any{"BlockStored", []uint64{x}, nil, []uint32{}, 0, nil, "CPU"})
	}
	apply([]any{"BlockRemoved", h, "GPU"})
	apply([]any{"BlockStored", []uint64{103}, nil, []uint32{}, 0, nil, "STORAGE"})
	for _, x := range h {
		tiers, parentHeld := ix.HeldUnder(rank, x)
		if !tiers.Has(kvevent.TierHostPinned) || !parentHeld {
			t.Errorf("block %d: tiers %v, parent held %v; want host, reachable", x, tiers, parentHeld)
		}
	}
	if tiers, _ := ix.HeldUnder(rank, 103); !tiers.Has(kvevent.TierDisk) {
		t.Errorf("block 103 tiers %v, want disk too", tiers)
	}
	if c := ix.Counters(); c.OrphansHeld != 0 || c.Remapped != 0 {
		t.Errorf("counters %+v", c)
	}
}
