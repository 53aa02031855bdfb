package engine

import (
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/vmihailenco/msgpack/v5"
)

// benchPayloads returns n realistic batches, alternately in the array and
// the map encoding, with events of both encodings: per batch, five
// BlockStored of 16 blocks × 16 tokens (token ids of a 150k vocabulary,
// full-width 64-bit hashes, half of them negative as signed ints), one
// offload store of the previous store's blocks without tokens, and two
// BlockRemoved of 8 hashes.
func benchPayloads(t tb, n int) [][]byte {
	rng := rand.New(rand.NewPCG(1, 2))
	hash := func() any {
		h := rng.Uint64()
		if h&1 == 0 {
			return i64(int64(h)) // the engine sends signed 64-bit ints
		}
		return u64(h)
	}
	var out [][]byte
	for p := 0; p < n; p++ {
		var events []any
		var last []any
		for s := 0; s < 5; s++ {
			hashes := make([]any, 16)
			for i := range hashes {
				hashes[i] = hash()
			}
			toks := make([]uint32, 16*16)
			for i := range toks {
				toks[i] = uint32(rng.IntN(150000))
			}
			if s%2 == 0 {
				events = append(events, []any{"BlockStored", hashes, hash(), toks, 16, nil, "GPU", nil})
			} else {
				events = append(events, omap{"type", "BlockStored", "block_hashes", hashes, "parent_block_hash", hash(),
					"token_ids", toks, "block_size", 16, "lora_id", nil, "medium", "GPU", "lora_name", nil})
			}
			last = hashes
		}
		events = append(events, []any{"BlockStored", last, nil, []uint32{}, 16, nil, "CPU", nil})
		for r := 0; r < 2; r++ {
			hashes := make([]any, 8)
			for i := range hashes {
				hashes[i] = hash()
			}
			if r == 0 {
				events = append(events, []any{"BlockRemoved", hashes, "GPU"})
			} else {
				events = append(events, omap{"type", "BlockRemoved", "block_hashes", hashes, "medium", "GPU"})
			}
		}
		if p%2 == 0 {
			out = append(out, pack(t, []any{1.7e9 + float64(p), events, 0}))
		} else {
			out = append(out, pack(t, omap{"ts", 1.7e9 + float64(p), "events", events, "data_parallel_rank", 0}))
		}
	}
	return out
}

// BenchmarkDecode decodes the payloads with this package.
func BenchmarkDecode(b *testing.B) {
	payloads := benchPayloads(b, 64)
	d := newTestDecoder(b, Config{Rank: rank})
	var batch Batch
	blocks := 0
	for _, p := range payloads {
		batch.Reset()
		if err := d.Decode(p, &batch); err != nil {
			b.Fatal(err)
		}
		blocks += batch.BlockEvents()
	}
	for b.Loop() {
		for _, p := range payloads {
			batch.Reset()
			if err := d.Decode(p, &batch); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "block_events/s")
}

// BenchmarkDecodeGeneric is the baseline: vmihailenco/msgpack's generic
// Unmarshal into interface{}, then a walk of the result that extracts the
// same fields and does the same downstream work (content hashes of the
// tokens), as a subscriber built on a generic decoder would.
func BenchmarkDecodeGeneric(b *testing.B) {
	payloads := benchPayloads(b, 64)
	blocks := 0
	for _, p := range payloads {
		n, err := genericDecode(p, 16)
		if err != nil {
			b.Fatal(err)
		}
		blocks += n
	}
	for b.Loop() {
		for _, p := range payloads {
			if _, err := genericDecode(p, 16); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(blocks)*float64(b.N)/b.Elapsed().Seconds(), "block_events/s")
}

// TestBenchDecode prints the decoder's BENCH line (make bench; gated by
// KVROUTER_BENCH like the other areas' benchmarks).
func TestBenchDecode(t *testing.T) {
	benchenv.Skip(t, "bench-events")
	deadline := time.Now().Add(3 * time.Second)
	fmt.Println(compareDecode(t, func() bool { return time.Now().Before(deadline) }))
}

// BenchmarkDecodeVsGeneric prints the same line under go test -bench (once:
// b.Loop runs the body of a benchmark function a single time).
func BenchmarkDecodeVsGeneric(b *testing.B) {
	fmt.Println(compareDecode(b, b.Loop))
}

// compareDecode times this package and the generic baseline on the same
// payloads, interleaved round by round for as long as more says, and returns
// the BENCH line. Rates are block events (stored blocks + removed hashes)
// per second of process CPU time, so that they are per core and hold on a
// shared machine; the wall-clock rates follow on the same line.
func compareDecode(t tb, more func() bool) string {
	payloads := benchPayloads(t, 64)
	d := newTestDecoder(t, Config{Rank: rank})
	var batch Batch
	blocks := 0
	for _, p := range payloads {
		batch.Reset()
		if err := d.Decode(p, &batch); err != nil {
			t.Fatal(err)
		}
		blocks += batch.BlockEvents()
		if n, err := genericDecode(p, 16); err != nil || n != batch.BlockEvents() {
			t.Fatalf("baseline decoded %d block events (%v), ours %d", n, err, batch.BlockEvents())
		}
	}
	var ours, base, oursWall, baseWall time.Duration
	rounds := 0
	for more() {
		c0, t0 := cpuNow(), time.Now()
		for _, p := range payloads {
			batch.Reset()
			if err := d.Decode(p, &batch); err != nil {
				t.Fatal(err)
			}
		}
		c1, t1 := cpuNow(), time.Now()
		for _, p := range payloads {
			if _, err := genericDecode(p, 16); err != nil {
				t.Fatal(err)
			}
		}
		c2, t2 := cpuNow(), time.Now()
		ours, base = ours+c1-c0, base+c2-c1
		oursWall, baseWall = oursWall+t1.Sub(t0), baseWall+t2.Sub(t1)
		rounds++
	}
	n := float64(blocks * rounds)
	o, g, ratio := decodeRates(n, ours, base)
	return fmt.Sprintf("BENCH events.decode block_events_per_s=%.3g baseline_block_events_per_s=%.3g ratio=%.2f"+
		" wall_block_events_per_s=%.3g wall_baseline_block_events_per_s=%.3g block_events=%d cpu_clock=%v",
		o, g, ratio, n/oursWall.Seconds(), n/baseWall.Seconds(), blocks*rounds, cpuClock)
}

// decodeRates returns the rates of n block events decoded in ours and in
// base, and ratio, ours over the baseline's: above 1 when this package
// decodes faster.
func decodeRates(n float64, ours, base time.Duration) (oursRate, baseRate, ratio float64) {
	oursRate, baseRate = n/ours.Seconds(), n/base.Seconds()
	return oursRate, baseRate, oursRate / baseRate
}

// TestDecodeRatesRatioIsOursOverTheBaseline: events.decode's ratio is this
// package's rate over the generic decode's, so that a faster decoder
// reads as a ratio above 1.
func TestDecodeRatesRatioIsOursOverTheBaseline(t *testing.T) {
	o, g, ratio := decodeRates(1000, time.Second, 4*time.Second)
	if o != 1000 || g != 250 || ratio != 4 {
		t.Errorf("decodeRates(1000 block events, ours 1s, baseline 4s) = %v/s, %v/s, ratio %v; want 1000/s, 250/s, ratio 4", o, g, ratio)
	}
}

// genericDecode decodes a payload the generic way and returns its block
// events (blocks stored, with their content hashes computed, plus hashes
// removed).
func genericDecode(p []byte, blockSize int) (int, error) {
	var v any
	if err := msgpack.Unmarshal(p, &v); err != nil {
		return 0, err
	}
	var events []any
	switch batch := v.(type) {
	case []any:
		if len(batch) < 2 {
			return 0, fmt.Errorf("short batch")
		}
		events, _ = batch[1].([]any)
	case map[string]any:
		events, _ = batch["events"].([]any)
	default:
		return 0, fmt.Errorf("batch %T", v)
	}
	n := 0
	var locals []uint64
	for _, ev := range events {
		var typ string
		var hashes, toks []any
		var medium string
		switch ev := ev.(type) {
		case []any:
			if len(ev) == 0 {
				continue
			}
			typ, _ = ev[0].(string)
			if len(ev) > 1 {
				hashes, _ = ev[1].([]any)
			}
			switch typ {
			case "BlockStored":
				if len(ev) > 3 {
					toks, _ = ev[3].([]any)
				}
				if len(ev) > 6 {
					medium, _ = ev[6].(string)
				}
				if len(ev) > 2 {
					_, _ = genericHash(ev[2])
				}
			case "BlockRemoved":
				if len(ev) > 2 {
					medium, _ = ev[2].(string)
				}
			}
		case map[string]any:
			typ, _ = ev["type"].(string)
			hashes, _ = ev["block_hashes"].([]any)
			toks, _ = ev["token_ids"].([]any)
			medium, _ = ev["medium"].(string)
			_, _ = genericHash(ev["parent_block_hash"])
		}
		if _, err := kvevent.ParseMedium(medium); err != nil {
			continue
		}
		hs := make([]uint64, 0, len(hashes))
		for _, h := range hashes {
			x, ok := genericHash(h)
			if !ok {
				return 0, fmt.Errorf("hash %T", h)
			}
			hs = append(hs, x)
		}
		switch typ {
		case "BlockStored":
			tk := make([]uint32, 0, len(toks))
			for _, t := range toks {
				x, ok := genericHash(t)
				if !ok {
					return 0, fmt.Errorf("token %T", t)
				}
				tk = append(tk, uint32(x))
			}
			locals = kvevent.LocalHashes(locals[:0], tk, blockSize, kvevent.Seed)
			n += len(hs)
		case "BlockRemoved":
			n += len(hs)
		}
	}
	return n, nil
}

func genericHash(v any) (uint64, bool) {
	switch v := v.(type) {
	case int8:
		return uint64(v), true
	case int16:
		return uint64(v), true
	case int32:
		return uint64(v), true
	case int64:
		return uint64(v), true
	case uint8:
		return uint64(v), true
	case uint16:
		return uint64(v), true
	case uint32:
		return uint64(v), true
	case uint64:
		return v, true
	case []byte:
		var h uint64
		if len(v) > 8 {
			v = v[len(v)-8:]
		}
		for _, x := range v {
			h = h<<8 | uint64(x)
		}
		return h, true
	}
	return 0, false
}
