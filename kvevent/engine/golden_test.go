package engine

import (
	"bytes"
	"encoding/hex"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// The golden bytes of wire.md, pinned. If one of these tests fails, the
// decoder no longer reads what engines send.

const goldenCleared = `93 cb 3f f8 00 00 00 00 00 00 91 81 a4 74 79 70 65
b0 41 6c 6c 42 6c 6f 63 6b 73 43 6c 65 61 72 65 64 00`

const (
	goldenRemovedArray = `93 ac "BlockRemoved" 91 cf da b8 9b aa 7b 58 57 c0 a3 "GPU"`
	goldenRemovedMap   = `83 a4 "type" ac "BlockRemoved" ac "block_hashes" 91 cf da b8 9b aa 7b 58 57 c0
	                      a6 "medium" a3 "GPU"`
	goldenHash = 0xdab89baa7b5857c0
)

func newTestDecoder(t tb, cfg Config) *Decoder {
	t.Helper()
	if cfg.BlockSize == 0 {
		cfg.BlockSize = 16
	}
	d, err := NewDecoder(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestGoldenAllBlocksClearedBatch(t *testing.T) {
	payload := unhex(t, goldenCleared)
	if got := hex.EncodeToString(payload); got != "93cb3ff80000000000009181a474797065b0416c6c426c6f636b73436c656172656400" {
		t.Fatalf("golden hex transcribed wrong: %s", got)
	}
	// The encoder the tests use writes exactly these bytes.
	if enc := pack(t, []any{1.5, []any{omap{"type", "AllBlocksCleared"}}, 0}); !bytes.Equal(enc, payload) {
		t.Fatalf("test encoder gives % x, golden is % x", enc, payload)
	}

	d := newTestDecoder(t, Config{Rank: kvevent.Rank{Worker: 7, DP: 0}})
	var b Batch
	if err := d.Decode(payload, &b); err != nil {
		t.Fatal(err)
	}
	if b.TS != 1.5 || !b.HasDPRank || b.DPRank != 0 {
		t.Fatalf("ts %v dp %v/%v, want 1.5 and dp 0", b.TS, b.DPRank, b.HasDPRank)
	}
	want := []kvevent.Event{{Rank: kvevent.Rank{Worker: 7, DP: 0}, Kind: kvevent.KindCleared}}
	assertEvents(t, b.Events, want)
}

func TestGoldenBlockRemovedBothEncodings(t *testing.T) {
	arr, mp := unhex(t, goldenRemovedArray), unhex(t, goldenRemovedMap)
	if got := hex.EncodeToString(arr); got != "93ac426c6f636b52656d6f76656491cfdab89baa7b5857c0a3475055" {
		t.Fatalf("array golden transcribed wrong: %s", got)
	}
	if got := hex.EncodeToString(mp); got != "83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cfdab89baa7b5857c0a66d656469756da3475055" {
		t.Fatalf("map golden transcribed wrong: %s", got)
	}
	if enc := pack(t, []any{"BlockRemoved", []uint64{goldenHash}, "GPU"}); !bytes.Equal(enc, arr) {
		t.Fatalf("test encoder gives % x, golden is % x", enc, arr)
	}
	if enc := pack(t, omap{"type", "BlockRemoved", "block_hashes", []uint64{goldenHash}, "medium", "GPU"}); !bytes.Equal(enc, mp) {
		t.Fatalf("test encoder gives % x, golden is % x", enc, mp)
	}

	for name, ev := range map[string][]byte{"array": arr, "map": mp} {
		for _, shape := range []struct {
			name    string
			payload []byte
			dp      uint32
		}{
			{"3-array batch", pack(t, []any{2.0, []any{raw(ev)}, 1}), 1},
			{"2-array batch", pack(t, []any{2.0, []any{raw(ev)}}), 1},
			{"map batch", pack(t, omap{"ts", 2.0, "events", []any{raw(ev)}}), 1},
		} {
			d := newTestDecoder(t, Config{Rank: kvevent.Rank{Worker: 1, DP: 1}})
			var b Batch
			if err := d.Decode(shape.payload, &b); err != nil {
				t.Fatalf("%s event in %s: %v", name, shape.name, err)
			}
			want := []kvevent.Event{{
				Rank: kvevent.Rank{Worker: 1, DP: shape.dp}, Kind: kvevent.KindRemoved,
				Tier: kvevent.TierDevice, Removed: []uint64{goldenHash},
			}}
			assertEvents(t, b.Events, want)
		}
	}
}
