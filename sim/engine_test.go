package sim

import (
	"errors"
	"math"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// request builds an engine request of prompt tokens whose full blocks (of
// bs tokens) have content hashes base, base+1, ...: two requests with the
// same base share their whole prefix.
func request(id, prompt, output, bs int, base uint64) *EngineRequest {
	local := make([]uint64, prompt/bs)
	for i := range local {
		local[i] = base + uint64(i)
	}
	return &EngineRequest{ID: id, Prompt: prompt, Output: output, Local: local, Seq: kvevent.SequenceHashes(nil, local)}
}

// pass is what one engine pass did, for assertions.
type pass struct {
	start, dur int64
	tokens     map[int]int // request id -> tokens computed
	first      []int
	finished   []int
}

// drive runs e until it is idle, starting at now, and returns its passes.
func drive(t *testing.T, e *Engine, now int64, limit int) []pass {
	t.Helper()
	var out []pass
	var po PassOutcome
	for i := 0; i < limit; i++ {
		d, ok, err := e.StartPass(now)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			return out
		}
		p := pass{start: now, dur: d, tokens: map[int]int{}}
		for _, w := range e.batch {
			p.tokens[w.r.ID] = w.n
		}
		now += d
		e.FinishPass(now, &po)
		for _, r := range po.FirstTokens {
			p.first = append(p.first, r.ID)
		}
		for _, r := range po.Finished {
			p.finished = append(p.finished, r.ID)
		}
		out = append(out, p)
	}
	t.Fatalf("engine still busy after %d passes", limit)
	return nil
}

// startPass starts a pass on e, failing the test on an error.
func startPass(t *testing.T, e *Engine, now int64) (int64, bool) {
	t.Helper()
	d, ok, err := e.StartPass(now)
	if err != nil {
		t.Fatal(err)
	}
	return d, ok
}

func ms(ns int64) float64 { return float64(ns) / 1e6 }

func TestTimingFormulas(t *testing.T) {
	tm := DefaultTiming()
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"prefill 0 tokens", tm.PrefillMs(0), 16.5},
		{"prefill 512 tokens", tm.PrefillMs(512), 4.21e-7*512*512 + 1.518e-2*512 + 16.5},
		{"prefill 8192 tokens", tm.PrefillMs(8192), 4.21e-7*8192*8192 + 1.518e-2*8192 + 16.5},
		{"decode empty", tm.DecodeStepMs(0), 5.74},
		{"decode full", tm.DecodeStepMs(1), -25.74 + 54.01 + 5.74},
		{"decode half", tm.DecodeStepMs(0.5), -25.74*0.25 + 54.01*0.5 + 5.74},
	} {
		if math.Abs(c.got-c.want) > 1e-9 {
			t.Errorf("%s: %v ms, want %v", c.name, c.got, c.want)
		}
	}
	// simulator.md's examples.
	if v := tm.PrefillMs(512); math.Abs(v-24.3) > 0.2 {
		t.Errorf("512 new tokens take %.2f ms, want ≈ 24", v)
	}
	if v := tm.PrefillMs(8192); math.Abs(v-169.1) > 0.5 {
		t.Errorf("8,192 new tokens take %.2f ms, want ≈ 169", v)
	}
	// The floor of 1 ms holds for any use the polynomial would take below it.
	if v := (Timing{DecodeA: 0, DecodeB: 0, DecodeC: -3}).DecodeStepMs(0.3); v != 1 {
		t.Errorf("decode floor: %v, want 1", v)
	}
}

// TestEngineChunksPrefillWithinBudget: a prompt larger than the budget is
// prefilled in chunks across passes, its first token comes at the end of
// the last chunk, then one token per pass; each pass takes the prefill
// polynomial of its tokens (or a decode step), divided by the speed.
func TestEngineChunksPrefillWithinBudget(t *testing.T) {
	for _, speed := range []float64{1, 2} {
		cfg := EngineConfig{NumGPUBlocks: 1000, BlockSize: 16, MaxNumBatchedTokens: 100, Speed: speed}
		e := NewEngine(RankOf(0), cfg)
		if !e.Submit(request(1, 250, 3, 16, 100)) {
			t.Fatal("submit refused")
		}
		ps := drive(t, e, 0, 20)
		if len(ps) != 5 {
			t.Fatalf("%d passes, want 3 prefill chunks + 2 decode steps", len(ps))
		}
		tm := DefaultTiming()
		for i, want := range []int{100, 100, 50, 1, 1} {
			if got := ps[i].tokens[1]; got != want {
				t.Errorf("pass %d computed %d tokens, want %d", i, got, want)
			}
		}
		for i, n := range []int{100, 100, 50} {
			if got, want := ms(ps[i].dur), tm.PrefillMs(n)/speed; math.Abs(got-want) > 1e-5 {
				t.Errorf("speed %v: prefill pass %d took %.6f ms, want %.6f", speed, i, got, want)
			}
		}
		// The decode step sees the KV in use: 16 blocks (15 prompt + the
		// partial one with the first generated token).
		if got, want := ms(ps[3].dur), tm.DecodeStepMs(16.0/1000)/speed; math.Abs(got-want) > 1e-5 {
			t.Errorf("decode pass took %.6f ms, want %.6f", got, want)
		}
		if len(ps[2].first) != 1 || len(ps[4].finished) != 1 || len(ps[3].finished) != 0 {
			t.Fatalf("first token at pass %v, finish at %v: want the last chunk, then after 2 more tokens", ps[2].first, ps[4].finished)
		}
		if e.Cache().Active() != 0 || e.Cache().Reserved() != 0 || e.Cache().Len() != 15 {
			t.Fatalf("after the request: %d active, %d reserved, %d cached blocks; want 0, 0, 15",
				e.Cache().Active(), e.Cache().Reserved(), e.Cache().Len())
		}
	}
}

// TestEngineDecodeTimeIgnoresInactiveCachedBlocks: a decode step's time
// follows the KV use of the blocks in-flight requests pin or reserve
// (KVUse), not the blocks left cached by finished ones: a worker whose
// cache is full of reusable blocks decodes as fast as a cold one. Timing
// the steps by every cached block left every timed test green.
func TestEngineDecodeTimeIgnoresInactiveCachedBlocks(t *testing.T) {
	cfg := EngineConfig{NumGPUBlocks: 100, BlockSize: 16}
	cold, warm := NewEngine(RankOf(0), cfg), NewEngine(RankOf(1), cfg)
	warm.Submit(request(9, 80*16, 1, 16, 1000)) // 80 blocks, cached once it finishes
	drive(t, warm, 0, 10)
	if warm.cache.Len() < 80 || warm.KVUse() != 0 {
		t.Fatalf("warm worker: %d blocks cached, KV use %g; want 80 cached, none in use", warm.cache.Len(), warm.KVUse())
	}
	var got [2][]float64
	for i, e := range []*Engine{cold, warm} {
		e.Submit(request(1, 64, 5, 16, 100))
		for _, p := range drive(t, e, 0, 10)[1:] { // the passes after the prefill decode
			got[i] = append(got[i], ms(p.dur))
		}
	}
	if len(got[0]) != 4 || !slices.Equal(got[0], got[1]) {
		t.Fatalf("decode steps: cold worker %v ms, worker holding 80 inactive blocks %v ms; want 4 steps, the same on both", got[0], got[1])
	}
}

// TestEngineServesRunningFirst: a decoding request takes its token before a
// newcomer's prefill, which gets what is left of the budget; a pass that
// mixes both costs the sum of the prefill and the decode terms.
func TestEngineServesRunningFirst(t *testing.T) {
	cfg := EngineConfig{NumGPUBlocks: 1000, BlockSize: 16, MaxNumBatchedTokens: 100}
	e := NewEngine(RankOf(0), cfg)
	e.Submit(request(1, 32, 5, 16, 100))
	var po PassOutcome
	d, _ := startPass(t, e, 0)
	e.FinishPass(d, &po)
	e.Submit(request(2, 250, 1, 16, 500))
	d2, _ := startPass(t, e, d)
	got := map[int]int{}
	for _, w := range e.batch {
		got[w.r.ID] = w.n
	}
	if got[1] != 1 || got[2] != 99 || e.batch[0].r.ID != 1 {
		t.Fatalf("pass computed %v (in order %d first), want 1 decode token for 1 first, then 99 prefill tokens for 2", got, e.batch[0].r.ID)
	}
	tm := DefaultTiming()
	if want := tm.PrefillMs(99) + tm.DecodeStepMs(e.KVUse()); math.Abs(ms(d2)-want) > 1e-5 {
		t.Fatalf("mixed pass took %.6f ms, want prefill(99) + decode(u) = %.6f", ms(d2), want)
	}
}

// TestEngineRunningLimitQueues: at most MaxNumSeqs run; the others wait in
// FIFO order, marked queued, and start as running ones finish.
func TestEngineRunningLimitQueues(t *testing.T) {
	cfg := EngineConfig{NumGPUBlocks: 1000, BlockSize: 16, MaxNumSeqs: 2}
	e := NewEngine(RankOf(0), cfg)
	rs := []*EngineRequest{request(1, 64, 2, 16, 100), request(2, 64, 2, 16, 200), request(3, 64, 2, 16, 300)}
	for _, r := range rs {
		e.Submit(r)
	}
	ps := drive(t, e, 0, 20)
	if _, ok := ps[0].tokens[3]; ok || len(ps[0].tokens) != 2 {
		t.Fatalf("first pass ran %v, want requests 1 and 2 only", ps[0].tokens)
	}
	if !rs[2].Queued || rs[0].Queued || rs[1].Queued {
		t.Fatalf("queued flags %v %v %v, want only the third", rs[0].Queued, rs[1].Queued, rs[2].Queued)
	}
	if rs[2].FirstTokenAt <= rs[0].FinishedAt-1 {
		t.Fatalf("request 3 got its first token at %d, before a running slot freed (%d)", rs[2].FirstTokenAt, rs[0].FinishedAt)
	}
}

// TestEnginePreemptsNewestUnderMemoryPressure: when a running request needs
// a block and none is free, the newest running request is preempted: its
// blocks unpinned (still cached), its progress dropped; it is recomputed
// later, reusing the blocks that survived, and finishes with all its
// output.
func TestEnginePreemptsNewestUnderMemoryPressure(t *testing.T) {
	// 8 blocks of 4 tokens; two requests of 3 prompt blocks each growing
	// by 10 generated tokens cannot both hold their 6 blocks.
	cfg := EngineConfig{NumGPUBlocks: 8, BlockSize: 4}
	e := NewEngine(RankOf(0), cfg)
	a, b := request(1, 12, 10, 4, 100), request(2, 12, 10, 4, 200)
	e.Submit(a)
	e.Submit(b)
	ps := drive(t, e, 0, 100)
	if a.Preemptions != 0 || b.Preemptions == 0 {
		t.Fatalf("preemptions: older %d, newer %d; want the newer one preempted", a.Preemptions, b.Preemptions)
	}
	if a.generated != 10 || b.generated != 10 || a.FinishedAt == 0 || b.FinishedAt == 0 {
		t.Fatalf("generated %d and %d, finished at %d and %d", a.generated, b.generated, a.FinishedAt, b.FinishedAt)
	}
	if a.FinishedAt >= b.FinishedAt {
		t.Fatal("the preempted request finished first")
	}
	// The recompute found b's prompt blocks still cached: it prefilled the
	// generated tokens and the last prompt token only.
	recompute := 0
	seen := false
	for _, p := range ps {
		if n, ok := p.tokens[2]; ok && n > 1 {
			if seen {
				recompute = n
			}
			seen = true
		}
	}
	if recompute == 0 || recompute >= 12 {
		t.Fatalf("recompute pass computed %d tokens for the preempted request; want fewer than its 12-token prompt (cache reused)", recompute)
	}
	if e.Cache().Active() != 0 || e.Cache().Reserved() != 0 {
		t.Fatalf("blocks left pinned: %d active, %d reserved", e.Cache().Active(), e.Cache().Reserved())
	}
}

// TestEngineAdmitsNothingInAPassThatPreempted: a pass that had to preempt
// to find room for its running requests admits no waiting one, the
// preempted request included (as vLLM's scheduler, which schedules no
// prefill in a step that preempted): admitting it would take back blocks
// the running requests are short of. Admitting in such a pass left every
// test green.
func TestEngineAdmitsNothingInAPassThatPreempted(t *testing.T) {
	// Two running requests that cannot both hold their blocks (6 blocks
	// of 4 tokens, 14 tokens each), a third waiting for a running slot,
	// and a budget of 4 tokens: the preempted request, at the head of the
	// queue, would be readmitted at once for the 3 tokens the budget
	// leaves, which need fewer blocks than it gave back.
	cfg := EngineConfig{NumGPUBlocks: 6, BlockSize: 4, MaxNumBatchedTokens: 4, MaxNumSeqs: 2}
	e := NewEngine(RankOf(0), cfg)
	rs := []*EngineRequest{request(1, 4, 10, 4, 100), request(2, 4, 10, 4, 200), request(3, 4, 2, 4, 300)}
	for _, r := range rs {
		e.Submit(r)
	}
	var po PassOutcome
	now, preempting := int64(0), 0
	for i := 0; ; i++ {
		if i == 100 {
			t.Fatal("engine still busy after 100 passes")
		}
		running := map[int]bool{}
		for _, r := range e.running {
			running[r.ID] = true
		}
		preemptions := map[int]int{}
		for _, r := range rs {
			preemptions[r.ID] = r.Preemptions
		}
		before := e.Preemptions
		d, ok := startPass(t, e, now)
		if !ok {
			break
		}
		if e.Preemptions > before {
			preempting++
			for _, w := range e.batch {
				if !running[w.r.ID] || w.r.Preemptions > preemptions[w.r.ID] {
					t.Errorf("pass %d preempted and admitted request %d (running before it: %v)", i, w.r.ID, running)
				}
			}
		}
		now += d
		e.FinishPass(now, &po)
	}
	if preempting == 0 {
		t.Fatal("no pass preempted")
	}
	for _, r := range rs {
		if r.FinishedAt == 0 || r.generated != r.Output {
			t.Errorf("request %d: generated %d of %d, finished at %d", r.ID, r.generated, r.Output, r.FinishedAt)
		}
	}
}

// TestEngineAdmissionCountsCachedPrefix: a request admitted after another
// with the same prompt finds its full blocks cached, except the block of
// the last token (one token is always computed).
func TestEngineAdmissionCountsCachedPrefix(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 100, BlockSize: 16})
	first := request(1, 160, 1, 16, 100)
	e.Submit(first)
	drive(t, e, 0, 10)
	again, longer := request(2, 160, 1, 16, 100), request(3, 170, 1, 16, 100)
	e.Submit(again)
	e.Submit(longer)
	drive(t, e, 0, 10)
	if first.CachedTokens != 0 || again.CachedTokens != 144 || longer.CachedTokens != 160 {
		t.Fatalf("cached tokens %d, %d, %d; want 0, 144 (not the last block), 160", first.CachedTokens, again.CachedTokens, longer.CachedTokens)
	}
}

// TestEngineRejects: a full waiting queue and a request larger than the
// whole cache are refused.
func TestEngineRejects(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 10, BlockSize: 16, MaxWaiting: 1})
	if e.Submit(request(1, 160, 1, 16, 1)) {
		t.Fatal("a request of 161 tokens fits no 160-token cache")
	}
	if !e.Submit(request(2, 16, 1, 16, 1)) || e.Submit(request(3, 16, 1, 16, 1)) {
		t.Fatal("want the first accepted and the second refused by a 1-deep queue")
	}
}

// TestEngineEventsRebuildItsCache: the Stored and Removed events of a busy
// engine, applied in order, leave an index holding exactly the engine's
// cached blocks.
func TestEngineEventsRebuildItsCache(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 40, BlockSize: 16, MaxNumBatchedTokens: 64})
	ix := indexer.New(indexer.Config{})
	var po PassOutcome
	now := int64(0)
	id := uint64(1)
	for i := 0; i < 30; i++ {
		e.Submit(request(i, 16*(3+i%5), 2, 16, uint64(i%4)*1000))
		if i%3 == 0 {
			e.Submit(request(100+i, 100, 1, 16, 5000+uint64(i)*100))
		}
		for k := 0; k < 3; k++ {
			d, ok := startPass(t, e, now)
			if !ok {
				break
			}
			now += d
			e.FinishPass(now, &po)
			for j := range po.Events {
				po.Events[j].EventID = id
				id++
				if err := ix.Apply(&po.Events[j], now); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if got, want := ix.Stats().Entries, int64(e.Cache().Len()); got != want {
		t.Fatalf("index holds %d blocks, cache %d", got, want)
	}
	if e.Cache().Evicted == 0 {
		t.Fatal("the test meant to evict")
	}
	if st := ix.Stats(); st.Counters.UnknownRemoves != 0 || st.OrphanEvents != 0 {
		t.Fatalf("engine events did not apply cleanly: %+v", st)
	}
}

// TestTimingWithTheKVSizeAloneKeepsTheDefaultModel: a Timing that sets only
// KVBytesPerToken (whose zero means its default) keeps the default
// polynomial, in an engine and in a replay. From a review: the default
// applied only to an all-zero Timing, and an 8,192-token prefill took 0 ms.
func TestTimingWithTheKVSizeAloneKeepsTheDefaultModel(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{Timing: Timing{KVBytesPerToken: 65536}})
	e.Submit(request(0, 8192, 1, 64, 1))
	d, _ := startPass(t, e, 0)
	want := DefaultTiming().PrefillMs(8192)
	if got := ms(d); got < want*0.99 || got > want*1.01 {
		t.Fatalf("an 8,192-token prefill pass took %.2f ms, want the default model's %.2f", got, want)
	}
	if got := e.cfg.Timing.BlockBytes(64); got != 65536*64 {
		t.Fatalf("block bytes %v, want the configured KV size's %d", got, 65536*64)
	}
	if c := (Config{Timing: Timing{KVBytesPerToken: 65536}}).withDefaults(); c.Timing.PrefillB == 0 || c.Timing.KVBytesPerToken != 65536 {
		t.Fatalf("replay config timing %+v, want the default polynomial and the KV size 65536", c.Timing)
	}
}

// TestEnginePassTimeOutOfRangeFailsTheReplay: a pass time divided by a
// tiny engine speed used to overflow int64 and be clamped to 1 ns, so the
// slowest engine reported the best TTFT. A slow engine's passes take
// their time; one past the clock fails the replay (ErrBadConfig).
func TestEnginePassTimeOutOfRangeFailsTheReplay(t *testing.T) {
	reqs := []Request{{InputLength: 8192, OutputLength: 1, HashIDs: make([]uint64, 16)}}
	for i := range reqs[0].HashIDs {
		reqs[0].HashIDs[i] = uint64(i)
	}
	pr := prepare(t, reqs, 64)
	want := DefaultTiming().PrefillMs(8192)
	r, err := RunTimed(pr, TimedConfig{Workers: 1, Engine: EngineConfig{Speed: 1e-6}}, &RoundRobin{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	if got := r.TTFTMs[0]; math.Abs(got-want/1e-6)/(want/1e-6) > 1e-9 {
		t.Errorf("engine speed 1e-6: TTFT %g ms, want prefill(8192)/1e-6 = %g ms", got, want/1e-6)
	}
	if _, err := RunTimed(pr, TimedConfig{Workers: 1, Engine: EngineConfig{Speed: 1e-13}}, &RoundRobin{Workers: 1}); !errors.Is(err, ErrBadConfig) {
		t.Errorf("engine speed 1e-13 (a %g ns pass): err %v, want ErrBadConfig", want*1e6/1e-13, err)
	}
}

// TestHugeKVSizeDoesNotMakePassesFree: with offload tiers every admission
// adds the transfer time of what it onboards; with nothing onboarded that
// is 0 whatever the KV size. A block size in bytes that overflowed to +Inf
// used to give 0 × Inf = NaN, and every pass took 1 ns.
func TestHugeKVSizeDoesNotMakePassesFree(t *testing.T) {
	tm := Timing{KVBytesPerToken: 1e308}
	if got := tm.TransferMs(0, 64, 20); got != 0 {
		t.Errorf("TransferMs of no blocks = %v, want 0", got)
	}
	reqs := []Request{{InputLength: 8192, OutputLength: 1, HashIDs: make([]uint64, 16)}}
	for i := range reqs[0].HashIDs {
		reqs[0].HashIDs[i] = uint64(i)
	}
	cfg := TimedConfig{Workers: 1, Engine: EngineConfig{Timing: tm, Offload: OffloadConfig{HostBlocks: 16}}}
	r, err := RunTimed(prepare(t, reqs, 64), cfg, &RoundRobin{Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	if want := DefaultTiming().PrefillMs(8192); math.Abs(r.TTFTMs[0]-want) > 1e-5 {
		t.Errorf("an 8,192-token prefill, nothing onboarded: TTFT %g ms, want prefill(8192) = %g ms", r.TTFTMs[0], want)
	}
}

// TestEnginePreemptionOrder: three running requests that cannot all hold
// their blocks (4 each, 8 in all), and a fourth waiting for a running slot. The newest
// running request is preempted (not an older one), goes back to the head
// of the queue (readmitted before the fourth, which waited longer), and
// its recompute covers its prompt and every token it had generated
// (simulator.md: "recomputed later"), which no cache holds here (the
// requests have no full prompt block).
func TestEnginePreemptionOrder(t *testing.T) {
	cfg := EngineConfig{NumGPUBlocks: 8, BlockSize: 4, MaxNumSeqs: 3}
	e := NewEngine(RankOf(0), cfg)
	rs := []*EngineRequest{
		{ID: 1, Prompt: 3, Output: 12}, {ID: 2, Prompt: 3, Output: 12}, {ID: 3, Prompt: 3, Output: 12},
		{ID: 4, Prompt: 3, Output: 2},
	}
	for _, r := range rs {
		if !e.Submit(r) {
			t.Fatalf("request %d refused", r.ID)
		}
	}
	var po PassOutcome
	now := int64(0)
	victim, generatedAt := -1, 0
	admitted := []int{} // request ids in order of (re)admission
	for i := 0; ; i++ {
		if i == 200 {
			t.Fatal("engine still busy after 200 passes")
		}
		var newest *EngineRequest
		if len(e.running) > 0 {
			newest = e.running[len(e.running)-1]
		}
		running := map[int]bool{}
		for _, r := range e.running {
			running[r.ID] = true
		}
		gen := map[int]int{}
		for _, r := range rs {
			gen[r.ID] = r.generated
		}
		before := e.Preemptions
		d, ok := startPass(t, e, now)
		if !ok {
			break
		}
		if e.Preemptions > before && victim < 0 {
			for _, r := range rs {
				if r.Preemptions > 0 {
					victim, generatedAt = r.ID, gen[r.ID]
				}
			}
			if newest == nil || victim != newest.ID {
				t.Fatalf("pass %d preempted request %d; want the newest running one (running before it: %v)", i, victim, running)
			}
		}
		for _, w := range e.batch {
			if running[w.r.ID] {
				continue
			}
			admitted = append(admitted, w.r.ID)
			if w.r.ID == victim && w.n != 3+generatedAt {
				t.Errorf("the preempted request was recomputed for %d tokens; want its prompt and the %d tokens it had generated: %d", w.n, generatedAt, 3+generatedAt)
			}
		}
		now += d
		e.FinishPass(now, &po)
	}
	if victim < 0 || generatedAt == 0 {
		t.Fatalf("no preemption of a request that had generated tokens (victim %d, generated %d)", victim, generatedAt)
	}
	if want := []int{1, 2, 3, victim, 4}; !slices.Equal(admitted, want) {
		t.Errorf("admissions in order %v; want %v: the preempted request back at the head of the queue", admitted, want)
	}
	for _, r := range rs {
		if r.FinishedAt == 0 || r.generated != r.Output {
			t.Errorf("request %d: generated %d of %d, finished at %d", r.ID, r.generated, r.Output, r.FinishedAt)
		}
	}
}

// TestEngineAdmitsInQueueOrder: admission is head-of-line: a waiting
// request whose blocks do not fit yet holds back the ones behind it, even
// one that would fit (simulator.md: FIFO admission), so that a long prompt
// is not starved by a stream of short ones.
func TestEngineAdmitsInQueueOrder(t *testing.T) {
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 10, BlockSize: 4})
	long := &EngineRequest{ID: 1, Prompt: 24, Output: 4} // holds 6 to 7 blocks
	if !e.Submit(long) {
		t.Fatal("request 1 refused")
	}
	var po PassOutcome
	d, _ := startPass(t, e, 0)
	e.FinishPass(d, &po)
	big := &EngineRequest{ID: 2, Prompt: 32, Output: 1}  // 8 blocks: waits for request 1
	small := &EngineRequest{ID: 3, Prompt: 4, Output: 1} // 1 block: would fit at once
	if !e.Submit(big) || !e.Submit(small) {
		t.Fatal("requests 2 and 3 refused")
	}
	drive(t, e, d, 100)
	if small.FirstTokenAt < big.FirstTokenAt || !small.Queued {
		t.Fatalf("the request behind one that did not fit got its first token at %d, before it (%d), queued %v; want it to wait its turn",
			small.FirstTokenAt, big.FirstTokenAt, small.Queued)
	}
}

// TestEngineCountsCachedTokensAtFirstAdmission: a preempted request
// readmitted finds its own prompt blocks cached (left there by its first
// run); its CachedTokens, and so the hit rate, stay those of its first
// admission (simulator.md: "found cached at each request's first
// admission"), or preemption would raise the hit rate.
func TestEngineCountsCachedTokensAtFirstAdmission(t *testing.T) {
	// As TestEnginePreemptsNewestUnderMemoryPressure: b is preempted.
	e := NewEngine(RankOf(0), EngineConfig{NumGPUBlocks: 8, BlockSize: 4})
	a, b := request(1, 12, 10, 4, 100), request(2, 12, 10, 4, 200)
	e.Submit(a)
	e.Submit(b)
	drive(t, e, 0, 100)
	if b.Preemptions == 0 {
		t.Fatal("no preemption")
	}
	if a.CachedTokens != 0 || b.CachedTokens != 0 {
		t.Fatalf("cached tokens %d and %d; want 0 and 0, as at their first admission (nothing cached)", a.CachedTokens, b.CachedTokens)
	}
}
