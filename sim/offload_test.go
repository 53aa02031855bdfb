package sim

import (
	"bytes"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
)

// offloadRun drives an engine pass by pass and keeps every event it
// published.
type offloadRun struct {
	t      *testing.T
	e      *Engine
	now    int64
	events []kvevent.Event
	passes []pass
}

func openOffloadEngine(t *testing.T, cfg EngineConfig) *offloadRun {
	t.Helper()
	e, err := OpenEngine(RankOf(0), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Close(); err != nil {
			t.Error(err)
		}
	})
	return &offloadRun{t: t, e: e}
}

// serve submits r and runs the engine until it is idle.
func (o *offloadRun) serve(r *EngineRequest) {
	o.t.Helper()
	r.Arrival = o.now
	if !o.e.Submit(r) {
		o.t.Fatalf("request %d refused", r.ID)
	}
	var po PassOutcome
	for i := 0; ; i++ {
		if i > 1000 {
			o.t.Fatal("engine still busy")
		}
		d, ok, err := o.e.StartPass(o.now)
		if err != nil {
			o.t.Fatal(err)
		}
		if !ok {
			return
		}
		p := pass{start: o.now, dur: d, tokens: map[int]int{}}
		for _, w := range o.e.batch {
			p.tokens[w.r.ID] = w.n
		}
		o.now += d
		o.e.FinishPass(o.now, &po)
		o.events = append(o.events, po.Events...)
		o.passes = append(o.passes, p)
	}
}

// stored reports whether an event stored h in tier, and removed whether
// one removed it, among the events from index from on.
func (o *offloadRun) stored(from int, tier kvevent.Tier, h uint64) bool {
	for _, ev := range o.events[from:] {
		if ev.Kind == kvevent.KindStored && ev.Tier == tier && slices.ContainsFunc(ev.Blocks, func(b kvevent.Block) bool { return b.EngineHash == h }) {
			return true
		}
	}
	return false
}

func (o *offloadRun) removed(from int, tier kvevent.Tier, h uint64) bool {
	for _, ev := range o.events[from:] {
		if ev.Kind == kvevent.KindRemoved && ev.Tier == tier && slices.Contains(ev.Removed, h) {
			return true
		}
	}
	return false
}

// g1Bytes reads block h's bytes out of its G1 slot.
func g1Bytes(t *testing.T, off *offloader, h uint64) []byte {
	t.Helper()
	b, ok := off.slots[h]
	if !ok {
		t.Fatalf("block %#x not in G1", h)
	}
	off.run([]backend.Copy{{Dst: off.stagePtr(0), Src: off.slotPtr(b.slot), N: off.bs}})
	return bytes.Clone(off.stageBytes(0))
}

func want(h uint64, n int) []byte {
	b := make([]byte, n)
	content(b, h)
	return b
}

// TestOffloadEvictedBlockGoesToG2AndComesBack: a block G1 evicts is copied
// into G2 (a STORE with the host tier, before G1's REMOVE); a later request
// for it loads it back into G1 with its bytes intact, and that costs the
// transfer of its real KV size instead of its prefill.
func TestOffloadEvictedBlockGoesToG2AndComesBack(t *testing.T) {
	const bs, bb = 16, 256
	cfg := EngineConfig{NumGPUBlocks: 6, BlockSize: bs, Offload: OffloadConfig{HostBlocks: 8, BlockBytes: bb}}
	o := openOffloadEngine(t, cfg)
	off := o.e.off

	a := request(1, 4*bs+1, 1, bs, 100) // 4 full blocks and one token more
	o.serve(a)
	for _, h := range a.Seq {
		if got := g1Bytes(t, off, h); !bytes.Equal(got, want(h, bb)) {
			t.Fatalf("G1 block %#x does not hold its synthetic bytes", h)
		}
	}
	mark := len(o.events)
	// Another prompt of 4 full blocks and a partial one: b needs 5 of G1's
	// 6 blocks, so G1 evicts 3 of a's, leaves first (a's root stays).
	b := request(2, 4*bs+1, 1, bs, 900)
	o.serve(b)
	var gone []uint64
	for _, h := range a.Seq {
		if _, ok := off.slots[h]; !ok {
			gone = append(gone, h)
		}
	}
	if len(gone) == 0 {
		t.Fatal("the test meant G1 to evict some of the first request's blocks")
	}
	for _, h := range gone {
		if !o.stored(mark, kvevent.TierHostPinned, h) || !o.removed(mark, kvevent.TierDevice, h) {
			t.Fatalf("evicted block %#x: want a host-tier STORE and a device REMOVE", h)
		}
		got := make([]byte, bb)
		if err := off.host.Read(h, got); err != nil || !bytes.Equal(got, want(h, bb)) {
			t.Fatalf("G2 copy of block %#x: err %v, bytes equal %t", h, err, bytes.Equal(got, want(h, bb)))
		}
	}
	// The host STORE comes before the device REMOVE: an index never loses
	// the node in between.
	for _, h := range gone {
		si := slices.IndexFunc(o.events[mark:], func(ev kvevent.Event) bool {
			return ev.Kind == kvevent.KindStored && ev.Tier == kvevent.TierHostPinned &&
				slices.ContainsFunc(ev.Blocks, func(b kvevent.Block) bool { return b.EngineHash == h })
		})
		ri := slices.IndexFunc(o.events[mark:], func(ev kvevent.Event) bool {
			return ev.Kind == kvevent.KindRemoved && ev.Tier == kvevent.TierDevice && slices.Contains(ev.Removed, h)
		})
		if si > ri {
			t.Fatalf("block %#x: host STORE at %d after device REMOVE at %d", h, si, ri)
		}
	}
	// An index fed the events sees a's prefix on the worker tier by tier.
	ix := indexer.New(indexer.Config{})
	for i := range o.events {
		if err := ix.Apply(&o.events[i], 0); err != nil {
			t.Fatal(err)
		}
	}
	var m indexer.Matches
	ix.FindMatchesByTier(a.Local, indexer.ViewTiered, false, &m)
	if len(m.Ranks) != 1 || int(m.Ranks[0].Blocks[kvevent.TierDevice]) != 4-len(gone) || int(m.Ranks[0].Blocks[kvevent.TierHostPinned]) != len(gone) {
		t.Fatalf("tiered match of the first prompt: %+v; want %d device + %d host blocks", m.Ranks, 4-len(gone), len(gone))
	}

	// a again: the G1 prefix, then the rest from G2, one token computed.
	g1 := 4 - len(gone)
	a2 := request(3, 4*bs+1, 1, bs, 100)
	start := len(o.passes)
	o.serve(a2)
	if a2.CachedTokens != g1*bs || a2.HostTokens != len(gone)*bs || a2.DiskTokens != 0 {
		t.Fatalf("G1 %d, G2 %d, G3 %d tokens; want %d, %d, 0", a2.CachedTokens, a2.HostTokens, a2.DiskTokens, g1*bs, len(gone)*bs)
	}
	p := o.passes[start]
	if p.tokens[3] != 1 {
		t.Fatalf("the pass computed %d tokens, want 1 (the rest loaded)", p.tokens[3])
	}
	tm := DefaultTiming()
	load := tm.TransferMs(len(gone), bs, 20)
	if wantMs := tm.PrefillMs(1) + load; math.Abs(ms(p.dur)-wantMs) > 1e-5 {
		t.Fatalf("the pass took %.6f ms, want prefill(1) + transfer = %.6f ms", ms(p.dur), wantMs)
	}
	// A 16-token block is 16 × 128 KiB = 2 MiB of real KV, at 20 GB/s.
	if math.Abs(load-float64(len(gone))*16*131072/20e9*1e3) > 1e-9 {
		t.Fatalf("transfer of %d blocks: %.6f ms", len(gone), load)
	}
	for _, h := range a.Seq {
		if got := g1Bytes(t, off, h); !bytes.Equal(got, want(h, bb)) {
			t.Fatalf("onboarded block %#x: G1 bytes differ", h)
		}
	}
	st, _ := o.e.OffloadStats()
	if st.LoadedHost != uint64(len(gone)) || st.Checked != st.LoadedHost || st.Mismatches != 0 {
		t.Fatalf("stats %+v", st)
	}
	if o.e.LoadNs != int64(math.Round(load*1e6)) {
		t.Fatalf("engine load time %d ns, want %.0f", o.e.LoadNs, load*1e6)
	}
}

// TestOffloadG2EvictionGoesToG3: with the filter at 1 every block reaches
// G3, so a block G2 evicts is still in G3 (a disk STORE, and no disk
// REMOVE), and a request loads it from there, checked, at G3's bandwidth.
// At the default threshold 2 a block offloaded once never reaches G3.
func TestOffloadG2EvictionGoesToG3(t *testing.T) {
	const bs, bb = 16, 128
	for _, threshold := range []int{1, 2} {
		cfg := EngineConfig{NumGPUBlocks: 6, BlockSize: bs,
			Offload: OffloadConfig{HostBlocks: 4, DiskBlocks: 32, BlockBytes: bb, DiskThreshold: threshold, Dir: t.TempDir()}}
		o := openOffloadEngine(t, cfg)
		off := o.e.off
		a := request(1, 4*bs+1, 1, bs, 100)
		o.serve(a)
		// Two more prompts push a's blocks out of G1, then out of G2.
		o.serve(request(2, 4*bs+1, 1, bs, 900))
		o.serve(request(3, 4*bs+1, 1, bs, 1900))
		var outOfG2 []uint64
		for _, h := range a.Seq {
			if o.removed(0, kvevent.TierHostPinned, h) {
				outOfG2 = append(outOfG2, h)
			}
		}
		if len(outOfG2) == 0 {
			t.Fatal("the test meant G2 to evict some of the first request's blocks")
		}
		held := off.disk.Lookup(outOfG2, nil)
		for i, h := range outOfG2 {
			switch {
			case threshold == 1 && (!held[i] || !o.stored(0, kvevent.TierDisk, h) || o.removed(0, kvevent.TierDisk, h)):
				t.Fatalf("threshold 1: block %#x evicted from G2 is not in G3", h)
			case threshold == 2 && (held[i] || o.stored(0, kvevent.TierDisk, h)):
				t.Fatalf("threshold 2: block %#x seen once was written to G3", h)
			}
		}
		if threshold == 2 {
			continue
		}
		got := make([]byte, bb)
		if err := off.disk.Read(outOfG2[0], got); err != nil || !bytes.Equal(got, want(outOfG2[0], bb)) {
			t.Fatalf("G3 bytes of %#x: err %v", outOfG2[0], err)
		}
		a2 := request(4, 4*bs+1, 1, bs, 100)
		start := len(o.passes)
		o.serve(a2)
		if a2.DiskTokens == 0 {
			t.Fatalf("nothing loaded from G3: G1 %d, G2 %d tokens", a2.CachedTokens, a2.HostTokens)
		}
		if a2.CachedTokens+a2.HostTokens+a2.DiskTokens != 4*bs {
			t.Fatalf("G1 %d + G2 %d + G3 %d tokens, want the whole prefix %d", a2.CachedTokens, a2.HostTokens, a2.DiskTokens, 4*bs)
		}
		tm := DefaultTiming()
		wantMs := tm.PrefillMs(1) + tm.TransferMs(a2.HostTokens/bs, bs, 20) + tm.TransferMs(a2.DiskTokens/bs, bs, 5)
		if d := ms(o.passes[start].dur); math.Abs(d-wantMs) > 1e-5 {
			t.Fatalf("the pass took %.6f ms, want %.6f", d, wantMs)
		}
		for _, h := range a.Seq {
			if got := g1Bytes(t, off, h); !bytes.Equal(got, want(h, bb)) {
				t.Fatalf("onboarded block %#x: G1 bytes differ", h)
			}
		}
		if st, _ := o.e.OffloadStats(); st.LoadedDisk == 0 || st.Mismatches != 0 || st.Checked != st.LoadedHost+st.LoadedDisk {
			t.Fatalf("stats %+v", st)
		}
	}
}

// TestOffloadWithoutG2WritesHotBlocksToG3: without G2 the filter gates the
// G1 → G3 path: a block evicted for the first time is lost, one seen twice
// is written.
func TestOffloadWithoutG2WritesHotBlocksToG3(t *testing.T) {
	const bs, bb = 16, 64
	o := openOffloadEngine(t, EngineConfig{NumGPUBlocks: 6, BlockSize: bs,
		Offload: OffloadConfig{DiskBlocks: 32, BlockBytes: bb, Dir: t.TempDir()}})
	for i, base := range []uint64{100, 900, 100, 900} {
		o.serve(request(i, 4*bs+1, 1, bs, base))
	}
	st, _ := o.e.OffloadStats()
	if st.Cold == 0 || st.DiskWritten == 0 || st.Offloaded != 0 {
		t.Fatalf("stats %+v: want cold blocks and G3 writes, nothing in a G2", st)
	}
}

// TestOffloadReplayIsDeterministic: two replays with offload tiers, same
// trace, configuration and seed, give identical results.
func TestOffloadReplayIsDeterministic(t *testing.T) {
	reqs := loadTrace(t, "mooncake_arxiv_trace_first1000.jsonl")[:70]
	pr := prepare(t, reqs, 64)
	cfg := TimedConfig{Workers: 2, Speed: 2, Engine: EngineConfig{NumGPUBlocks: 1024,
		Offload: OffloadConfig{HostBlocks: 512, DiskBlocks: 2048, DiskThreshold: 1, Dir: t.TempDir()}}}
	for _, name := range []string{"router", "round_robin"} {
		var runs [2]Result
		for i := range runs {
			p, err := NewSuitePolicy(name, SuiteConfig{Mode: ModeTimed, Timed: cfg, Seed: 3})
			if err != nil {
				t.Fatal(err)
			}
			if r, ok := p.(*Router); ok && r.View != indexer.ViewTiered {
				t.Fatal("with offload tiers the router must read the index tier by tier")
			}
			if runs[i], err = RunTimed(pr, cfg, p); err != nil {
				t.Fatal(err)
			}
		}
		a, b := runs[0], runs[1]
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("%s: two replays differ:\n%+v\n%+v\n%+v\n%+v", name, a, *a.Offload, b, *b.Offload)
		}
		st := a.Offload
		t.Logf("%s: %+v", name, *st)
		if st == nil || st.LoadedHost == 0 || st.LoadedDisk == 0 || st.HostEvictions == 0 || st.DiskEvictions == 0 || st.Mismatches != 0 || a.HostTokens == 0 || a.DiskTokens == 0 {
			t.Fatalf("%s: the test meant both tiers to be used: %+v", name, st)
		}
		if st.Offloaded+st.Revived+st.OffloadFull != a.Evicted {
			t.Fatalf("%s: %d blocks evicted from G1, %d offloaded + %d revived + %d lost", name, a.Evicted, st.Offloaded, st.Revived, st.OffloadFull)
		}
		if !strings.HasPrefix(BenchLine("arxiv", a), "BENCH sim_offload.arxiv."+name+" ") {
			t.Fatalf("bench line %q", BenchLine("arxiv", a))
		}
	}
}

// TestOffloadOffIsUnchanged: without G2 or G3 (whatever else the offload
// config says) a worker is the worker without offload: the same results,
// device events only, no offload figures in the report.
func TestOffloadOffIsUnchanged(t *testing.T) {
	reqs := loadTrace(t, "mooncake_arxiv_trace_first1000.jsonl")[:200]
	pr := prepare(t, reqs, 64)
	base := TimedConfig{Workers: 4, Speed: 6, Engine: EngineConfig{NumGPUBlocks: 1024}}
	other := base
	other.Engine.Offload = OffloadConfig{BlockBytes: 4096, HostGBps: 3, DiskThreshold: 1}
	var rs []Result
	for _, cfg := range []TimedConfig{base, other} {
		p, err := NewSuitePolicy("router", SuiteConfig{Mode: ModeTimed, Timed: cfg, Seed: 3})
		if err != nil {
			t.Fatal(err)
		}
		if p.(*Router).View != indexer.ViewDedup {
			t.Fatal("without offload tiers the router keeps the cluster's default view")
		}
		seen := &tierSpy{Policy: p}
		r, err := RunTimed(pr, cfg, seen)
		if err != nil {
			t.Fatal(err)
		}
		if seen.other != 0 || seen.device == 0 {
			t.Fatalf("%d device events, %d of other tiers", seen.device, seen.other)
		}
		rs = append(rs, r)
	}
	if !reflect.DeepEqual(rs[0], rs[1]) || rs[0].Offload != nil || rs[0].HostTokens != 0 || rs[0].OffloadHitRate != 0 || rs[0].Evicted == 0 {
		t.Fatalf("results differ or carry offload figures: %+v vs %+v", rs[0], rs[1])
	}
	var b strings.Builder
	if err := WriteTable(&b, rs[:1]); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(b.String(), "G2") || strings.HasPrefix(BenchLine("arxiv", rs[0]), "BENCH sim_offload") {
		t.Fatalf("report without tiers mentions them:\n%s", b.String())
	}
}

type tierSpy struct {
	Policy
	device, other int
}

func (s *tierSpy) Observe(ev *kvevent.Event, now int64) {
	if ev.Tier == kvevent.TierDevice {
		s.device++
	} else {
		s.other++
	}
	s.Policy.Observe(ev, now)
}

// TestEngineEventsMatchItsHoldingsInEveryTier: under a seeded random load
// with preemptions, with and without G2 and G3, the events an engine
// publishes say, after every pass and in every tier, exactly what it
// holds: no block stored twice, none removed that was not stored, none
// held that was not announced, none announced that is not held. From a
// review: the tiers' events were checked against holdings only along
// hand-written paths.
func TestEngineEventsMatchItsHoldingsInEveryTier(t *testing.T) {
	const seed = 12345
	t.Logf("seed %d", seed)
	for _, oc := range []OffloadConfig{{}, {HostBlocks: 12}, {HostBlocks: 12, DiskBlocks: 20, DiskThreshold: 1}, {DiskBlocks: 20, DiskThreshold: 1}} {
		e, err := OpenEngine(RankOf(0), EngineConfig{NumGPUBlocks: 24, BlockSize: 16, MaxNumBatchedTokens: 48, Offload: oc, MaxWaiting: -1})
		if err != nil {
			t.Fatal(err)
		}
		var told [kvevent.NumTiers]map[uint64]bool // what the events say each tier holds
		for i := range told {
			told[i] = map[uint64]bool{}
		}
		seen := map[uint64]bool{} // every block a request had
		holds := func(tier kvevent.Tier, h uint64) bool {
			switch {
			case tier == kvevent.TierDevice:
				_, ok := e.cache.blocks[h]
				return ok
			case tier == kvevent.TierHostPinned && e.off != nil && e.off.host != nil:
				return e.off.host.Lookup([]uint64{h}, nil)[0]
			case tier == kvevent.TierDisk && e.off != nil && e.off.disk != nil:
				return e.off.disk.Lookup([]uint64{h}, nil)[0]
			}
			return false
		}
		var po PassOutcome
		var now int64
		var bad []string
		note := func(format string, args ...any) {
			if len(bad) < 10 {
				bad = append(bad, fmt.Sprintf(format, args...))
			}
		}
		rng := uint64(seed)
		rand := func(n int) int { rng = splitmix(rng); return int(rng % uint64(n)) }
		for step := 0; step < 300; step++ {
			if rand(2) == 0 {
				prompt := 16*(1+rand(8)) + rand(16)
				r := request(step, prompt, 1+rand(20), 16, uint64(1+rand(4))*1000)
				for _, h := range r.Seq {
					seen[h] = true
				}
				e.Submit(r)
			}
			d, ok, err := e.StartPass(now)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				continue
			}
			now += d
			e.FinishPass(now, &po)
			for _, ev := range po.Events {
				s := told[ev.Tier]
				switch ev.Kind {
				case kvevent.KindStored:
					for _, b := range ev.Blocks {
						if s[b.EngineHash] {
							note("step %d: %v stored %#x, already stored", step, ev.Tier, b.EngineHash)
						}
						s[b.EngineHash] = true
					}
				case kvevent.KindRemoved:
					for _, h := range ev.Removed {
						if !s[h] {
							note("step %d: %v removed %#x, never stored", step, ev.Tier, h)
						}
						delete(s, h)
					}
				}
			}
			for h := range seen {
				for _, tier := range []kvevent.Tier{kvevent.TierDevice, kvevent.TierHostPinned, kvevent.TierDisk} {
					if got := holds(tier, h); got != told[tier][h] {
						note("step %d: %v holds %#x: %v, its events say %v", step, tier, h, got, told[tier][h])
					}
				}
			}
		}
		if e.Preemptions == 0 {
			t.Errorf("offload %+v: no preemption: the test meant some", oc)
		}
		if err := e.Close(); err != nil {
			t.Error(err)
		}
		if len(bad) > 0 {
			t.Errorf("offload %+v: %v", oc, bad)
		}
	}
}
