package sim

import (
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// fleetEvents publishes Stored events to a policy as workers would, with
// per-worker event ids.
type fleetEvents struct {
	p   Policy
	ids map[int]uint64
}

// store tells p that worker w holds the first n blocks of local.
func (f *fleetEvents) store(w int, local []uint64, n int) {
	if f.ids == nil {
		f.ids = map[int]uint64{}
	}
	seq := kvevent.SequenceHashes(nil, local[:n])
	ev := kvevent.Event{Rank: RankOf(w), Kind: kvevent.KindStored, Tier: kvevent.TierDevice}
	for i := 0; i < n; i++ {
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: seq[i], LocalHash: local[i]})
	}
	f.ids[w]++
	ev.EventID = f.ids[w]
	f.p.Observe(&ev, 0)
}

func query(id string, bs int, local ...uint64) *RouteQuery {
	return &RouteQuery{ID: id, Local: local, Seq: kvevent.SequenceHashes(nil, local), ISL: bs * len(local), BlockSize: bs}
}

func route(t *testing.T, p Policy, q *RouteQuery) int {
	t.Helper()
	w, _, err := p.Route(q, 0)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestRoundRobinCycles(t *testing.T) {
	p := &RoundRobin{Workers: 3}
	for k, want := range []int{0, 1, 2, 0, 1} {
		if got := route(t, p, query("q", 16, 1)); got != want {
			t.Fatalf("request %d went to %d, want %d", k, got, want)
		}
	}
}

func TestRandomIsSeededAndUniform(t *testing.T) {
	a, b, c := NewRandom(4, 7), NewRandom(4, 7), NewRandom(4, 8)
	counts := make([]int, 4)
	differ := false
	for k := 0; k < 4000; k++ {
		q := query("q", 16, 1)
		wa, wb, wc := route(t, a, q), route(t, b, q), route(t, c, q)
		if wa != wb {
			t.Fatalf("request %d: same seed chose %d and %d", k, wa, wb)
		}
		differ = differ || wa != wc
		counts[wa]++
	}
	if !differ {
		t.Fatal("seeds 7 and 8 chose the same 4,000 workers")
	}
	for w, n := range counts {
		if n < 850 || n > 1150 {
			t.Fatalf("worker %d got %d of 4,000 requests, want about 1,000", w, n)
		}
	}
}

// TestLongestPrefixRule: the longest cached prefix wins; a tie goes to the
// worker with fewer live requests, then the lower index.
func TestLongestPrefixRule(t *testing.T) {
	p := NewLongestPrefix(3)
	f := fleetEvents{p: p}
	doc := []uint64{10, 11, 12, 13}
	f.store(1, doc, 1)
	f.store(2, doc, 3)
	q := query("a", 16, doc...)
	if w, cached, _ := p.Route(q, 0); w != 2 || cached != 48 {
		t.Fatalf("routed to %d predicting %d cached tokens, want worker 2 with 48", w, cached)
	}
	other := []uint64{20, 21}
	f.store(0, other, 2)
	f.store(1, other, 2)
	p.Started(query("live", 16, 99), 0, 0, 0)
	if w := route(t, p, query("b", 16, other...)); w != 1 {
		t.Fatalf("tie on prefix went to %d, want 1 (fewer live requests)", w)
	}
	p.Finished("live", 0)
	if w := route(t, p, query("c", 16, other...)); w != 0 {
		t.Fatalf("full tie went to %d, want the lower index 0", w)
	}
}

// TestLeastLoadedIgnoresTheCache: least_loaded is the router's cost with
// no overlap credit: where the router takes the worker holding the
// prompt despite its extra load, least_loaded takes the idle one.
func TestLeastLoadedIgnoresTheCache(t *testing.T) {
	doc := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	router := NewRouter(2, 16, indexer.DefaultParams(), 1)
	least := NewLeastLoaded(2, 16, indexer.DefaultParams(), 1)
	for _, p := range []Policy{router, least} {
		f := fleetEvents{p: p}
		f.store(0, doc, len(doc))
		p.Started(query("busy", 16, 50), 0, 0, 0)
	}
	if w := route(t, router, query("q", 16, doc...)); w != 0 {
		t.Fatalf("router chose %d, want 0 (8 cached blocks outweigh 1 block of load)", w)
	}
	if w := route(t, least, query("q", 16, doc...)); w != 1 {
		t.Fatalf("least_loaded chose %d, want 1 (the idle worker)", w)
	}
}

// TestRouterBooksTheTokensItPredictedUncached: Started books a request's
// prefill load as its prompt less the tokens the router predicted cached
// on the chosen worker, as the cluster's router does; BookWholePrompt
// (cache-only mode) books the whole prompt. Booking the whole prompt in
// every mode left every test green.
func TestRouterBooksTheTokensItPredictedUncached(t *testing.T) {
	for _, whole := range []bool{false, true} {
		p := NewRouter(2, 16, indexer.DefaultParams(), 1)
		p.BookWholePrompt = whole
		q := query("warm", 16, 1, 2, 3, 4, 5, 6, 7, 8) // 128 tokens
		p.Started(q, 0, 96, 0)
		want := int64(32)
		if whole {
			want = 128
		}
		loads, _ := p.seqs.PotentialDecodeBlocks(nil, nil, nil)
		var got int64 = -1
		for _, l := range loads {
			if l.Rank == RankOf(0) {
				got = l.Load.ActivePrefillTokens
			}
		}
		if got != want {
			t.Errorf("BookWholePrompt %t: worker 0 has %d prefill tokens booked (loads %+v), want %d", whole, got, loads, want)
		}
	}
}

// TestGreedyBalancedRule: the longest prefix among the workers that stay
// within the tolerance of the mean assigned load once they take the
// request.
func TestGreedyBalancedRule(t *testing.T) {
	p := NewGreedyBalanced(2, 0.05)
	f := fleetEvents{p: p}
	doc := []uint64{1, 2, 3, 4}
	f.store(0, doc, 4)
	q := query("q", 16, doc...)
	if w := route(t, p, q); w != 0 {
		t.Fatalf("balanced fleet: chose %d, want 0 (holds the prefix)", w)
	}
	p.Started(query("big", 16, make([]uint64, 10)...), 0, 0, 0) // 160 tokens on worker 0
	// Worker 0 would hold 224 of 288 tokens: far over 1.05 × the mean.
	if w := route(t, p, q); w != 1 {
		t.Fatalf("overloaded holder: chose %d, want 1", w)
	}
}

func TestCeilingCountsPrefixesSeenBefore(t *testing.T) {
	reqs := []Request{
		{InputLength: 1024, OutputLength: 1, HashIDs: []uint64{1, 2}},
		{InputLength: 1536, OutputLength: 1, HashIDs: []uint64{1, 2, 3}},
		{InputLength: 1024, OutputLength: 1, HashIDs: []uint64{4, 2}}, // same id 2, other parent: no match
		{InputLength: 1000, OutputLength: 1, HashIDs: []uint64{1, 5}},
	}
	r := Ceiling(prepare(t, reqs, 512), ModeCache)
	if r.CachedTokens != 1024+512 || r.PromptTokens != 1024+1536+1024+1000 {
		t.Fatalf("ceiling counted %d of %d tokens, want %d of %d", r.CachedTokens, r.PromptTokens, 1536, 4584)
	}
}
