package engine

import (
	"encoding/binary"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// A generator of engine batches in every encoding wire.md allows, and a
// model that says, from the generated fields rather than from the bytes,
// which router events they must give. The same specs are encoded by
// vmihailenco/msgpack here and by Debian's python3-msgpack in
// python_test.go.

// genEvent is one engine event and how to encode it. Pointer and slice
// fields are nil when the engine sends nil (or omits the field).
type genEvent struct {
	Type      string   `json:"type"`
	Hashes    []uint64 `json:"hashes"`
	Parent    *uint64  `json:"parent"`
	Tokens    []uint32 `json:"tokens"`
	BlockSize *int     `json:"block_size"`
	LoraID    *int     `json:"lora_id"`
	Medium    *string  `json:"medium"`
	LoraName  *string  `json:"lora_name"`
	ExtraKeys bool     `json:"extra_keys"` // per-block extra keys, the odd blocks non-nil
	Group     *int     `json:"group"`
	Kind      *string  `json:"kind"`
	Locality  *string  `json:"locality"`

	Map         bool     `json:"map"`          // map encoding, else array
	Order       []string `json:"order"`        // map encoding: key order (the type key included)
	HashEnc     int      `json:"hash_enc"`     // 0 uint, 1 signed int, 2 bin of 8, 3 bin of 32 (sha256-like)
	ExplicitNil bool     `json:"explicit_nil"` // map: write nil fields as nil rather than leave them out
	Extra       bool     `json:"extra"`        // unknown trailing fields / unknown keys
	Bad         string   `json:"bad"`          // a field given a value of the wrong type
}

// genBatch is one batch and how to encode it.
type genBatch struct {
	Form   int        `json:"form"`    // 0 [ts, events, dp], 1 [ts, events], 2 {ts, events, data_parallel_rank}
	TSKind int        `json:"ts_kind"` // 0 float64, 1 float32, 2 int
	TS     float64    `json:"ts"`
	DP     *uint32    `json:"dp"`
	Events []genEvent `json:"events"`
}

// Field names in array position order, per type.
var genFields = map[string][]string{
	"BlockStored":  {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"},
	"BlockRemoved": {"block_hashes", "medium", "group_idx", "locality"},
}

// hashValue encodes h as HashEnc says.
func (g *genEvent) hashValue(h uint64) any {
	switch g.HashEnc {
	case 1:
		return int(int64(h))
	case 2:
		return binary.BigEndian.AppendUint64(nil, h)
	case 3:
		b := make([]byte, 24, 32)
		for i := range b {
			b[i] = 0x11
		}
		return binary.BigEndian.AppendUint64(b, h)
	}
	return h
}

// value returns the value of one field as pack writes it (nil when nil).
func (g *genEvent) value(name string) any {
	if name == g.Bad {
		switch name {
		case "medium", "lora_name", "kv_cache_spec_kind":
			return 7
		}
		return "x"
	}
	switch name {
	case "block_hashes":
		if g.Hashes == nil {
			return nil
		}
		hs := make([]any, len(g.Hashes))
		for i, h := range g.Hashes {
			hs[i] = g.hashValue(h)
		}
		return hs
	case "parent_block_hash":
		if g.Parent == nil {
			return nil
		}
		return g.hashValue(*g.Parent)
	case "token_ids":
		if g.Tokens == nil {
			return nil
		}
		return g.Tokens
	case "block_size":
		return intOrNil(g.BlockSize)
	case "lora_id":
		return intOrNil(g.LoraID)
	case "medium":
		return strOrNil(g.Medium)
	case "lora_name":
		return strOrNil(g.LoraName)
	case "extra_keys":
		if !g.ExtraKeys {
			return nil
		}
		ks := make([]any, len(g.Hashes))
		for i := range ks {
			if i%2 == 1 {
				ks[i] = []any{"mm-hash", i}
			}
		}
		return ks
	case "group_idx":
		return intOrNil(g.Group)
	case "kv_cache_spec_kind":
		return strOrNil(g.Kind)
	case "locality":
		return strOrNil(g.Locality)
	}
	return nil
}

func intOrNil(p *int) any {
	if p == nil {
		return nil
	}
	return *p
}

func strOrNil(p *string) any {
	if p == nil {
		return nil
	}
	return *p
}

// encode returns the event as pack's input.
func (g *genEvent) encode() any {
	if g.Map {
		var m omap
		for _, k := range g.Order {
			if k == "type" {
				m = append(m, "type", g.Type)
				continue
			}
			v := g.value(k)
			if v == nil && !g.ExplicitNil {
				continue
			}
			m = append(m, k, v)
		}
		if g.Extra {
			m = append(m, "ownership", []any{1, "x"}, "session_id", "rack-7")
		}
		return m
	}
	fields := genFields[g.Type]
	n := 0 // trailing nil fields are omitted
	for i, f := range fields {
		if g.value(f) != nil {
			n = i + 1
		}
	}
	out := []any{g.Type}
	for _, f := range fields[:n] {
		out = append(out, g.value(f))
	}
	if g.Extra {
		for len(out) <= len(fields) {
			out = append(out, nil)
		}
		out = append(out, "ownership?", omap{"owner", 1}, 2.5)
	}
	return out
}

func (gb *genBatch) encode() any {
	var ts any
	switch gb.TSKind {
	case 1:
		ts = float32(gb.TS)
	case 2:
		ts = int(gb.TS)
	default:
		ts = gb.TS
	}
	events := make([]any, len(gb.Events))
	for i := range gb.Events {
		events[i] = gb.Events[i].encode()
	}
	var dp any
	if gb.DP != nil {
		dp = int(*gb.DP)
	}
	switch gb.Form {
	case 1:
		return []any{ts, events}
	case 2:
		m := omap{"events", events, "ts", ts}
		if dp != nil {
			m = append(m, "data_parallel_rank", dp)
		}
		return m
	}
	return []any{ts, events, dp}
}

// model applies the rules to generated fields. It keeps the content hashes
// it has seen, and their parents, as the decoder does, and the copies of
// each (tier, engine hash) stored and not removed (the tests never reach
// either bound).
type model struct {
	rank     kvevent.Rank
	learned  map[uint64]learned
	copies   map[tierHash]int
	skipped  [NumReasons]uint64
	absorbed uint64
	mixed    bool // a batch of another dp rank was seen
}

type tierHash struct {
	t kvevent.Tier
	h uint64
}

func newModel(r kvevent.Rank) *model {
	return &model{rank: r, learned: map[uint64]learned{}, copies: map[tierHash]int{}}
}

var fieldOf = map[string]string{
	"block_hashes": "hashes", "parent_block_hash": "parent", "token_ids": "tokens", "block_size": "block_size",
	"medium": "medium", "lora_name": "lora_name", "group_idx": "group", "kv_cache_spec_kind": "kind",
}

func (m *model) batch(gb *genBatch) []kvevent.Event {
	if gb.DP != nil && gb.Form != 1 && *gb.DP != m.rank.DP {
		// Another dp rank's batch is left out whole. The decoder converts
		// the first one before it reads the rank (after the events), then
		// takes its events back: what its stores taught stays, every copy
		// counted goes. Later ones it reads the rank of first.
		if !m.mixed {
			skipped, absorbed := m.skipped, m.absorbed
			m.batch(&genBatch{Form: 1, Events: gb.Events})
			m.skipped, m.absorbed = skipped, absorbed
			clear(m.copies)
			m.mixed = true
		}
		m.skipped[ReasonOtherDPRank] += uint64(len(gb.Events))
		return nil
	}
	r := m.rank
	var out []kvevent.Event
	for i := range gb.Events {
		g := &gb.Events[i]
		ev, why, ok := m.event(g)
		if !ok {
			switch {
			case why == absorbed:
				m.absorbed++
			case g.Type == "BlockRemoved" && (why == ReasonBadField || why == ReasonUnknownMedium) && g.Bad != "block_hashes":
				// A remove that could not apply took a copy from some
				// tier: its hashes' counts go in every tier.
				for k := range m.copies {
					if slices.Contains(g.Hashes, k.h) {
						delete(m.copies, k)
					}
				}
				m.skipped[why]++
			default:
				m.skipped[why]++
			}
			continue
		}
		switch ev.Kind {
		case kvevent.KindStored:
			for _, b := range ev.Blocks {
				m.copies[tierHash{ev.Tier, b.EngineHash}]++
			}
		case kvevent.KindCleared:
			clear(m.copies)
		}
		ev.Rank = r
		out = append(out, ev)
	}
	return out
}

func (m *model) event(g *genEvent) (kvevent.Event, Reason, bool) {
	const bs = 16
	var none kvevent.Event
	fields, known := genFields[g.Type]
	if g.Type == "AllBlocksCleared" {
		// A clear has no fields, in either form: whatever it carries, it
		// clears the rank.
		return kvevent.Event{Kind: kvevent.KindCleared}, 0, true
	}
	if !known {
		return none, ReasonUnknownType, false
	}
	if g.Map && g.Type == "BlockRemoved" { // a map may carry any field; the kind is read on every event
		fields = append(slices.Clone(fields), "kv_cache_spec_kind")
	}
	if g.Bad != "" && fieldOf[g.Bad] != "" && slices.Contains(fields, g.Bad) {
		return none, ReasonBadField, false
	}
	// block_size 0 (vLLM's "unknown"): no size without tokens, out of range
	// with them.
	blockSize := g.BlockSize
	if g.Type == "BlockStored" && blockSize != nil && *blockSize == 0 {
		if len(g.Tokens) > 0 {
			return none, ReasonBadField, false
		}
		blockSize = nil
	}
	switch {
	case g.Kind != nil && (g.Map || g.Type == "BlockStored"):
		if *g.Kind != "full_attention" {
			return none, ReasonNotMainGroup, false
		}
	case g.Group != nil && *g.Group != 0:
		return none, ReasonNotMainGroup, false
	}
	tier := kvevent.TierDevice
	if g.Locality != nil && strings.EqualFold(*g.Locality, "REMOTE") {
		tier = kvevent.TierExternal // whatever the medium
	} else if g.Medium != nil {
		t, err := kvevent.ParseMedium(*g.Medium)
		if err != nil {
			return none, ReasonUnknownMedium, false
		}
		tier = t
	}
	if len(g.Hashes) == 0 {
		return none, ReasonNoBlocks, false
	}
	if g.Type == "BlockRemoved" {
		// Each hash named takes a copy off its count; those whose last copy
		// goes (or never counted) are removed, each once, in the order
		// their last copy went.
		var hs []uint64
		for _, h := range g.Hashes {
			k := tierHash{tier, h}
			if m.copies[k] > 1 {
				m.copies[k]--
				continue
			}
			delete(m.copies, k)
			if !slices.Contains(hs, h) {
				hs = append(hs, h)
			}
		}
		if len(hs) == 0 {
			return none, absorbed, false
		}
		return kvevent.Event{Kind: kvevent.KindRemoved, Tier: tier, Removed: hs}, 0, true
	}
	for i := range g.Hashes {
		if slices.Contains(g.Hashes[:i], g.Hashes[i]) {
			return none, ReasonRepeatedHash, false
		}
	}
	ev := kvevent.Event{Kind: kvevent.KindStored, Tier: tier}
	parent := g.Parent
	if l, ok := m.learned[g.Hashes[0]]; ok && parent == nil && len(g.Tokens) == 0 && l.hasParent {
		parent = &l.parent // a store without tokens or parent: the learned one
	}
	if parent != nil {
		if *parent == g.Hashes[0] {
			return none, ReasonParentIsFirst, false
		}
		if slices.Contains(g.Hashes[1:], *parent) {
			return none, ReasonRepeatedHash, false
		}
		ev.HasParent, ev.Parent = true, *parent
	}
	if len(g.Tokens) > 0 && g.LoraID != nil && g.LoraName == nil {
		return none, ReasonUnnamedLoRA, false
	}
	if blockSize != nil && *blockSize != bs {
		return none, ReasonBlockSize, false
	}
	if len(g.Tokens) == 0 {
		for _, h := range g.Hashes {
			l, ok := m.learned[h]
			if !ok {
				break
			}
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: l.local})
		}
		if len(ev.Blocks) == 0 {
			return none, ReasonUnresolved, false
		}
		return ev, 0, true
	}
	if len(g.Tokens) > len(g.Hashes)*bs {
		return none, ReasonBlockSize, false
	}
	if len(g.Tokens) < len(g.Hashes)*bs && blockSize == nil {
		// Fewer tokens and no block_size: the engine's blocks may be
		// smaller than bs, so no span of bs tokens is known to be a block.
		return none, ReasonBlockSize, false
	}
	seed := kvevent.Seed
	if g.LoraName != nil {
		seed = kvevent.SeedFor(*g.LoraName, "")
	}
	for i, h := range g.Hashes {
		if (i+1)*bs > len(g.Tokens) {
			break
		}
		l := kvevent.LocalHash(g.Tokens[i*bs:(i+1)*bs], seed)
		if i == 0 {
			m.learned[h] = learned{local: l, parent: ev.Parent, hasParent: ev.HasParent}
		} else {
			m.learned[h] = learned{local: l, parent: g.Hashes[i-1], hasParent: true}
		}
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: h, LocalHash: l})
	}
	if len(ev.Blocks) == 0 {
		return none, ReasonBlockSize, false
	}
	return ev, 0, true
}

// Generators. Hashes come from a small pool so that repeats, parents equal
// to the first block and offload stores of known blocks all happen often.
var hashPool = []uint64{0, 1, 2, 127, 128, 0xffff, 1 << 32, 1<<63 - 1, 1 << 63, 1<<64 - 1, goldenHash, 0x8000000000000001}

func genHashes(t *rapid.T, label string) []uint64 {
	// rapid draws small integers more often: the common shape comes first.
	switch rapid.IntRange(0, 19).Draw(t, label+"-shape") {
	case 19:
		return nil
	case 18:
		return []uint64{}
	case 16, 17: // repeats allowed
		return rapid.SliceOfN(rapid.SampledFrom(hashPool), 1, 5).Draw(t, label)
	}
	return rapid.SliceOfNDistinct(rapid.SampledFrom(hashPool), 1, 5, rapid.ID[uint64]).Draw(t, label)
}

func optional[T any](t *rapid.T, label string, g *rapid.Generator[T], pNil int) *T {
	if rapid.IntRange(0, 99).Draw(t, label+"-nil") < pNil {
		return nil
	}
	v := g.Draw(t, label)
	return &v
}

func genEventOf(t *rapid.T) genEvent {
	g := genEvent{
		Type: rapid.SampledFrom([]string{"BlockStored", "BlockStored", "BlockStored", "BlockStored", "BlockStored",
			"BlockRemoved", "BlockRemoved", "BlockRemoved", "AllBlocksCleared", "BlockTouched"}).Draw(t, "type"),
	}
	g.Hashes = genHashes(t, "hashes")
	g.Parent = optional(t, "parent", rapid.SampledFrom(hashPool), 60)
	switch rapid.IntRange(0, 9).Draw(t, "tokens-shape") {
	case 0, 1: // offload store: no tokens
		if rapid.Bool().Draw(t, "tokens-nil") {
			g.Tokens = nil
		} else {
			g.Tokens = []uint32{}
		}
	case 2: // any length
		g.Tokens = rapid.SliceOfN(rapid.Uint32(), 0, 100).Draw(t, "tokens")
	default: // whole blocks
		n := len(g.Hashes) * 16
		g.Tokens = rapid.SliceOfN(rapid.Uint32Range(0, 200000), n, n).Draw(t, "tokens")
	}
	g.BlockSize = optional(t, "block_size", rapid.SampledFrom([]int{16, 16, 16, 32, 0}), 20)
	g.LoraID = optional(t, "lora_id", rapid.IntRange(1, 3), 85)
	g.Medium = optional(t, "medium", rapid.SampledFrom([]string{"GPU", "cpu", "CPU_TIER2", "DISK", "REMOTE", "TPU"}), 40)
	g.LoraName = optional(t, "lora_name", rapid.SampledFrom([]string{"ad", "", "other"}), 80)
	g.ExtraKeys = rapid.IntRange(0, 4).Draw(t, "extra_keys") == 0
	g.Group = optional(t, "group", rapid.IntRange(0, 2), 75)
	g.Kind = optional(t, "kind", rapid.SampledFrom([]string{"full_attention", "sliding_window"}), 80)
	g.Locality = optional(t, "locality", rapid.SampledFrom([]string{"REMOTE", "remote", "LOCAL", "rack-7"}), 70)

	g.Map = rapid.Bool().Draw(t, "map")
	g.HashEnc = rapid.IntRange(0, 3).Draw(t, "hash_enc")
	g.ExplicitNil = rapid.Bool().Draw(t, "explicit_nil")
	g.Extra = rapid.IntRange(0, 3).Draw(t, "extra") == 0
	if rapid.IntRange(0, 9).Draw(t, "bad?") == 0 {
		g.Bad = rapid.SampledFrom([]string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"}).Draw(t, "bad")
		if !g.Map && !slices.Contains(genFields[g.Type], g.Bad) {
			g.Bad = "" // the array form has no slot for it
		}
	}
	if g.Map {
		keys := append([]string{"type"}, genFields["BlockStored"]...)
		if g.Type != "BlockStored" {
			keys = append([]string{"type"}, genFields["BlockRemoved"]...)
			keys = append(keys, "kv_cache_spec_kind")
		}
		g.Order = rapid.Permutation(keys).Draw(t, "order")
	}
	if g.Type == "AllBlocksCleared" && !g.Map {
		g.Bad = ""
	}
	return g
}

func genBatchOf(t *rapid.T) genBatch {
	gb := genBatch{
		Form:   rapid.IntRange(0, 2).Draw(t, "form"),
		TSKind: rapid.IntRange(0, 2).Draw(t, "ts_kind"),
		TS:     float64(rapid.IntRange(0, 1<<20).Draw(t, "ts")) / 4,
		DP:     optional(t, "dp", rapid.Uint32Range(0, 3), 30), // the decoders under test follow dp rank 2
	}
	gb.Events = rapid.SliceOfN(rapid.Custom(genEventOf), 0, 8).Draw(t, "events")
	return gb
}

func TestGeneratedBatchesDecodeAsModelled(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		r := kvevent.Rank{Worker: 3, DP: 2}
		d := newTestDecoder(t, Config{Rank: r})
		m := newModel(r)
		for _, gb := range rapid.SliceOfN(rapid.Custom(genBatchOf), 1, 4).Draw(t, "batches") {
			payload := pack(t, gb.encode())
			var b Batch
			if err := d.Decode(payload, &b); err != nil {
				t.Fatalf("decode: %v\npayload % x", err, payload)
			}
			assertEvents(t, b.Events, m.batch(&gb))
			if b.TS != gb.TS && !(gb.TSKind == 2 && b.TS == float64(int(gb.TS))) {
				t.Fatalf("ts %v, want %v", b.TS, gb.TS)
			}
		}
		if got := d.Stats().Skipped; got != m.skipped {
			t.Fatalf("skipped by reason %v, model %v", got, m.skipped)
		}
		if got := d.Stats().Absorbed; got != m.absorbed {
			t.Fatalf("removes absorbed by copies: %d, model %d", got, m.absorbed)
		}
	})
}
