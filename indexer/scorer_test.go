// scorer_test.go checks each rule of semantics.md §5 on its own, then Select
// as a whole against refSelect, a brute-force reference that recomputes the
// cost from the formula and walks the tie chain one filter at a time.

package indexer

import (
	"errors"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

func mkCand(r kvevent.Rank, dev, host, disk, ext uint32, l Load, potentialDecode int64) Candidate {
	return Candidate{Rank: r, Overlap: [kvevent.NumTiers]uint32{dev, host, disk, ext}, Load: l, PotentialDecodeBlocks: potentialDecode}
}

func mustSelectRank(t *testing.T, p Params, req Request, cands []Candidate, rng *rand.Rand) *Decision {
	t.Helper()
	var d Decision
	if err := Select(p, req, cands, rng, &d); err != nil {
		t.Fatalf("Select: %v", err)
	}
	return &d
}

func TestDefaultParamsAreTheSpecDefaults(t *testing.T) {
	want := Params{OverlapScoreCredit: 1.0, HostCacheHitWeight: 0.75, DiskCacheHitWeight: 0.25, PrefillLoadScale: 1.0}
	if got := DefaultParams(); got != want {
		t.Fatalf("DefaultParams = %+v, want %+v", got, want)
	}
}

func TestOverridesReplaceOnlyTheFieldsTheySet(t *testing.T) {
	temp, credit := 0.5, 2.0
	p := DefaultParams()
	p.BusyPrefillTokens = 100
	got := p.With(&Overrides{Temperature: &temp, OverlapScoreCredit: &credit})
	want := p
	want.Temperature, want.OverlapScoreCredit = 0.5, 2.0
	if got != want {
		t.Fatalf("With = %+v, want %+v", got, want)
	}
	if p.With(nil) != p {
		t.Fatal("With(nil) changed the params")
	}
}

func TestCostTermsFollowTheFormula(t *testing.T) {
	req := Request{ISL: 100, BlockSize: 16}
	cases := []struct {
		name                     string
		p                        Params
		c                        Candidate
		credit, prefill, cost    float64
		wantRaw                  float64
		wantOverlap, wantReqBlks int64
	}{
		{
			name: "idle, nothing cached", p: DefaultParams(),
			c:      mkCand(wkA0, 0, 0, 0, 0, Load{}, 7),
			credit: 0, wantRaw: 100.0 / 16, prefill: 100.0 / 16, cost: 100.0/16 + 7,
		},
		{
			name: "device hit credits 1 per block", p: DefaultParams(),
			c:      mkCand(wkA0, 4, 0, 0, 0, Load{}, 7),
			credit: 4, wantRaw: 6.25, prefill: 2.25, cost: 2.25 + 7, wantOverlap: 4,
		},
		{
			name: "host 0.75, disk and external 0.25", p: DefaultParams(),
			c:      mkCand(wkA0, 1, 2, 1, 3, Load{}, 7),
			credit: 1 + 1.5 + 0.25*4, wantRaw: 6.25, prefill: 6.25 - 3.5, cost: 2.75 + 7, wantOverlap: 7,
		},
		{
			name: "active prefill tokens add to raw prefill", p: DefaultParams(),
			c:      mkCand(wkA0, 0, 0, 0, 0, Load{ActivePrefillTokens: 60}, 0),
			credit: 0, wantRaw: 10, prefill: 10, cost: 10,
		},
		{
			name: "credit never makes prefill negative", p: DefaultParams(),
			c:      mkCand(wkA0, 50, 0, 0, 0, Load{}, 3),
			credit: 50, wantRaw: 6.25, prefill: 0, cost: 3, wantOverlap: 50,
		},
		{
			name: "prefill load scale and active request weight",
			p:    Params{OverlapScoreCredit: 1, PrefillLoadScale: 2, DecodeActiveRequestWeight: 0.5},
			c:    mkCand(wkA0, 2, 0, 0, 0, Load{ActiveRequests: 4}, 10),
			// raw 6.25, credit 2, prefill 4.25; cost 8.5 + 10 + 2
			credit: 2, wantRaw: 6.25, prefill: 4.25, cost: 20.5, wantOverlap: 2,
		},
	}
	for _, c := range cases {
		d := mustSelectRank(t, c.p, req, []Candidate{c.c}, nil)
		s := d.Candidates[0]
		if s.Credit != c.credit || s.RawPrefillBlocks != c.wantRaw || s.PrefillBlocks != c.prefill || s.Cost != c.cost || s.OverlapBlocks != c.wantOverlap {
			t.Errorf("%s: credit %v raw %v prefill %v cost %v overlap %d; want %v %v %v %v %d",
				c.name, s.Credit, s.RawPrefillBlocks, s.PrefillBlocks, s.Cost, s.OverlapBlocks, c.credit, c.wantRaw, c.prefill, c.cost, c.wantOverlap)
		}
		if d.Cost != c.cost || d.Rank != wkA0 || d.Index != 0 {
			t.Errorf("%s: decision %v cost %v index %d", c.name, d.Rank, d.Cost, d.Index)
		}
	}
}

func TestRequestBlocksRoundsUp(t *testing.T) {
	for _, c := range []struct {
		isl, bs int
		want    int64
	}{{0, 16, 0}, {1, 16, 1}, {16, 16, 1}, {17, 16, 2}, {math.MaxInt, 1, math.MaxInt64}, {math.MaxInt, 16, math.MaxInt/16 + 1}} {
		d := mustSelectRank(t, DefaultParams(), Request{ISL: c.isl, BlockSize: c.bs}, []Candidate{{Rank: wkA0}}, nil)
		if d.RequestBlocks != c.want {
			t.Errorf("isl %d bs %d: request blocks %d, want %d", c.isl, c.bs, d.RequestBlocks, c.want)
		}
	}
}

func TestCheapestRankWinsAtZeroTemperature(t *testing.T) {
	cands := []Candidate{
		mkCand(wkA0, 0, 0, 0, 0, Load{}, 8),  // 6.25 + 8
		mkCand(wkB0, 4, 0, 0, 0, Load{}, 10), // 2.25 + 10
		mkCand(wkC0, 6, 0, 0, 0, Load{}, 8),  // 0.25 + 8: cheapest
		mkCand(wkA1, 6, 0, 0, 0, Load{}, 9),  // one block dearer
	}
	d := mustSelectRank(t, DefaultParams(), Request{ISL: 100, BlockSize: 16}, cands, nil)
	if d.Rank != wkC0 || d.DecidedBy != DecidedByCost {
		t.Fatalf("chose %v by %v, want %v by cost", d.Rank, d.DecidedBy, wkC0)
	}
}

func TestCostTieGoesToLongerOverlap(t *testing.T) {
	// Both cost 5: A by a long overlap plus decode load, B with none.
	cands := []Candidate{
		mkCand(wkB0, 0, 0, 0, 0, Load{}, 0),     // prefill 5, decode 0
		mkCand(wkA0, 5, 0, 0, 0, Load{}, 5),     // prefill 0, decode 5
		mkCand(wkC0, 0, 4, 0, 0, Load{}, 5-2+1), // prefill 5-3=2, decode 4: cost 6
	}
	d := mustSelectRank(t, DefaultParams(), Request{ISL: 80, BlockSize: 16}, cands, nil)
	if d.Rank != wkA0 || d.DecidedBy != DecidedByOverlap {
		t.Fatalf("chose %v by %v, want %v by overlap", d.Rank, d.DecidedBy, wkA0)
	}
}

func TestCostAndOverlapTieGoesToFewerActiveBlocks(t *testing.T) {
	cands := []Candidate{
		mkCand(wkA0, 2, 0, 0, 0, Load{ActiveDecodeBlocks: 9}, 10),
		mkCand(wkB0, 2, 0, 0, 0, Load{ActiveDecodeBlocks: 3}, 10),
	}
	d := mustSelectRank(t, DefaultParams(), Request{ISL: 80, BlockSize: 16}, cands, nil)
	if d.Rank != wkB0 || d.DecidedBy != DecidedByActiveBlocks {
		t.Fatalf("chose %v by %v, want %v by active blocks", d.Rank, d.DecidedBy, wkB0)
	}
}

func TestFullTieIsStickyPerPrefixAndSpreadAcrossPrefixes(t *testing.T) {
	var ranks []kvevent.Rank
	for w := range 8 {
		ranks = append(ranks, kvevent.Rank{Worker: uint64(w + 1)})
	}
	cands := make([]Candidate, len(ranks))
	reversed := make([]Candidate, len(ranks))
	for i, r := range ranks {
		cands[i] = Candidate{Rank: r, PotentialDecodeBlocks: 4}
		reversed[len(ranks)-1-i] = cands[i]
	}
	seen := map[kvevent.Rank]bool{}
	for first := uint64(0); first < 64; first++ {
		req := Request{ISL: 64, BlockSize: 16, FirstBlockHash: first * 0x1234567}
		d1 := mustSelectRank(t, DefaultParams(), req, cands, nil)
		d2 := mustSelectRank(t, DefaultParams(), req, reversed, nil)
		if d1.Rank != d2.Rank {
			t.Fatalf("prefix %d: tie went to %v or %v depending on candidate order", first, d1.Rank, d2.Rank)
		}
		if d1.DecidedBy != DecidedByRendezvous {
			t.Fatalf("prefix %d: decided by %v, want rendezvous", first, d1.DecidedBy)
		}
		seen[d1.Rank] = true
	}
	if len(seen) < 6 { // 64 prefixes over 8 ranks: all but never fewer than 6
		t.Fatalf("ties of 64 prefixes went to only %d of 8 ranks", len(seen))
	}
}

func TestRendezvousHashIsPinned(t *testing.T) {
	// A change here reroutes every tied prefix in a running fleet: do it on
	// purpose, never by accident. The values were computed independently in
	// Python from the definition (three chained SplitMix64 finalisers).
	cases := []struct {
		first uint64
		r     kvevent.Rank
		want  uint64
	}{
		{0, kvevent.Rank{}, 0xb415092a9e97c1a4},
		{1, kvevent.Rank{Worker: 1}, 0x614a86e28adff5b4},
		{0xdeadbeef, kvevent.Rank{Worker: 7, DP: 3}, 0xd09cf7c63a3b21b8},
	}
	for _, c := range cases {
		if got := rendezvous(c.first, c.r); got != c.want {
			t.Errorf("rendezvous(%#x, %v) = %#x, want %#x", c.first, c.r, got, c.want)
		}
	}
}

func TestDuplicateRankFallsBackToInputOrder(t *testing.T) {
	c := Candidate{Rank: wkA0, PotentialDecodeBlocks: 1}
	d := mustSelectRank(t, DefaultParams(), Request{ISL: 16, BlockSize: 16}, []Candidate{c, c}, nil)
	if d.Index != 0 || d.DecidedBy != DecidedByInputOrder {
		t.Fatalf("index %d by %v, want 0 by input order", d.Index, d.DecidedBy)
	}
}

func TestBusyRanksAreSkipped(t *testing.T) {
	p := DefaultParams()
	p.BusyDecodeFraction = 0.8
	p.BusyPrefillTokens = 1000
	cheap := func(r kvevent.Rank, l Load, capacity int64) Candidate {
		c := mkCand(r, 10, 0, 0, 0, l, 0)
		c.CapacityBlocks = capacity
		return c
	}
	cases := []struct {
		name   string
		busy   Candidate
		reason BusyReason
	}{
		{"decode over fraction", cheap(wkA0, Load{ActiveDecodeBlocks: 81}, 100), BusyDecodeBlocks},
		{"prefill over limit", cheap(wkA0, Load{ActivePrefillTokens: 1001}, 0), BusyPrefillTokens},
		{"both", cheap(wkA0, Load{ActiveDecodeBlocks: 81, ActivePrefillTokens: 1001}, 100), BusyDecodeBlocks | BusyPrefillTokens},
	}
	for _, c := range cases {
		other := mkCand(wkB0, 0, 0, 0, 0, Load{ActiveDecodeBlocks: 500}, 500) // dear, but not busy
		d := mustSelectRank(t, p, Request{ISL: 160, BlockSize: 16}, []Candidate{c.busy, other}, nil)
		if d.Rank != wkB0 {
			t.Errorf("%s: chose busy rank %v", c.name, d.Rank)
		}
		if s := d.Candidates[0]; !s.Busy || s.BusyReason != c.reason {
			t.Errorf("%s: busy %v reason %v, want %v", c.name, s.Busy, s.BusyReason, c.reason)
		}
		if d.BusyRanks != 1 {
			t.Errorf("%s: busy ranks %d, want 1", c.name, d.BusyRanks)
		}
		if d.BestOverlapBlocks != 0 {
			t.Errorf("%s: best eligible overlap %d, want 0 (the busy rank's 10 blocks are not eligible)", c.name, d.BestOverlapBlocks)
		}
	}
}

func TestBusyThresholdsAtTheLimitAreNotBusy(t *testing.T) {
	p := Params{BusyDecodeFraction: 0.5, BusyPrefillTokens: 100}
	c := Candidate{Rank: wkA0, Load: Load{ActiveDecodeBlocks: 50, ActivePrefillTokens: 100}, CapacityBlocks: 100}
	d := mustSelectRank(t, p, Request{BlockSize: 16}, []Candidate{c}, nil)
	if d.Candidates[0].Busy {
		t.Fatal("a rank exactly at its thresholds is busy; the rule is 'over'")
	}
}

func TestDecodeThresholdIgnoresUnknownCapacity(t *testing.T) {
	p := Params{BusyDecodeFraction: 0.5}
	c := Candidate{Rank: wkA0, Load: Load{ActiveDecodeBlocks: 1 << 40}}
	if d := mustSelectRank(t, p, Request{BlockSize: 16}, []Candidate{c}, nil); d.Candidates[0].Busy {
		t.Fatal("a rank of unknown capacity counted as busy")
	}
}

func TestWorkerWithOneFreeRankStillTakesRequests(t *testing.T) {
	p := Params{PrefillLoadScale: 1, BusyPrefillTokens: 10}
	cands := []Candidate{
		{Rank: wkA0, Load: Load{ActivePrefillTokens: 11}},
		{Rank: wkA1, Load: Load{ActivePrefillTokens: 5}},
	}
	d := mustSelectRank(t, p, Request{BlockSize: 16}, cands, nil)
	if d.Rank != wkA1 {
		t.Fatalf("chose %v, want the worker's free rank %v", d.Rank, wkA1)
	}
}

func TestAllBusyIsOverloadedWithReasonNeverASilentPick(t *testing.T) {
	p := DefaultParams()
	p.BusyDecodeFraction = 0.9
	p.BusyPrefillTokens = 4096
	cands := []Candidate{
		{Rank: wkA0, Load: Load{ActiveDecodeBlocks: 95}, CapacityBlocks: 100},
		{Rank: wkB0, Load: Load{ActivePrefillTokens: 5000}},
	}
	var d Decision
	err := Select(p, Request{ISL: 16, BlockSize: 16}, cands, nil, &d)
	if !errors.Is(err, ErrOverloaded) {
		t.Fatalf("error = %v, want ErrOverloaded", err)
	}
	for _, want := range []string{"all 2 ranks busy", "decode block capacity", "4096 active prefill tokens"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if d.Index != -1 || d.Chosen() != nil || len(d.Candidates) != 2 || d.BusyRanks != 2 {
		t.Fatalf("decision after overload: index %d, %d candidates, %d busy", d.Index, len(d.Candidates), d.BusyRanks)
	}
}

func TestNoCandidatesIsNoWorkers(t *testing.T) {
	var d Decision
	if err := Select(DefaultParams(), Request{BlockSize: 16}, nil, nil, &d); !errors.Is(err, ErrNoWorkers) {
		t.Fatalf("error = %v, want ErrNoWorkers", err)
	}
}

func TestInvalidInputIsAnErrorNotAPanic(t *testing.T) {
	ok := []Candidate{{Rank: wkA0}}
	nan := math.NaN()
	cases := []struct {
		name  string
		p     Params
		req   Request
		cands []Candidate
		rng   *rand.Rand
		want  error
	}{
		{"zero block size", DefaultParams(), Request{ISL: 10}, ok, nil, ErrInvalidRequest},
		{"negative block size", DefaultParams(), Request{ISL: 10, BlockSize: -16}, ok, nil, ErrInvalidRequest},
		{"negative isl", DefaultParams(), Request{ISL: -1, BlockSize: 16}, ok, nil, ErrInvalidRequest},
		{"NaN weight", Params{HostCacheHitWeight: nan}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"infinite scale", Params{PrefillLoadScale: math.Inf(1)}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"negative weight", Params{OverlapScoreCredit: -1}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"negative temperature", Params{Temperature: -0.5}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"negative busy tokens", Params{BusyPrefillTokens: -1}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"temperature without rng", Params{Temperature: 1}, Request{BlockSize: 16}, ok, nil, ErrInvalidParams},
		{"negative load", DefaultParams(), Request{BlockSize: 16}, []Candidate{{Rank: wkA0, Load: Load{ActiveRequests: -1}}}, nil, ErrInvalidCandidate},
		{"negative potential", DefaultParams(), Request{BlockSize: 16}, []Candidate{{Rank: wkA0, PotentialDecodeBlocks: -1}}, nil, ErrInvalidCandidate},
		{"negative capacity", DefaultParams(), Request{BlockSize: 16}, []Candidate{{Rank: wkA0, CapacityBlocks: -1}}, nil, ErrInvalidCandidate},
		// Select takes weights over MaxWeight (stored settings of an older
		// version); one that makes a cost overflow is still an error.
		{"cost overflows", Params{PrefillLoadScale: math.MaxFloat64}, Request{ISL: math.MaxInt, BlockSize: 1}, ok, nil, ErrInvalidCandidate},
	}
	for _, c := range cases {
		var d Decision
		err := Select(c.p, c.req, c.cands, c.rng, &d)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: error = %v, want %v", c.name, err, c.want)
		}
		if d.Chosen() != nil {
			t.Errorf("%s: a rank was chosen despite the error", c.name)
		}
	}
}

// TestValidateBoundsWeights: new settings and overrides (Validate) take
// weights up to MaxWeight, where costs cannot overflow; Select takes
// larger ones, which a cluster may hold from an older version, and routes
// with them. From reviews: a weight of 1e308 made every route a 500, and
// the bound first applied in Select broke routes under stored settings.
func TestValidateBoundsWeights(t *testing.T) {
	for _, p := range []Params{{PrefillLoadScale: math.MaxFloat64}, {Temperature: 2 * MaxWeight}, {BusyDecodeFraction: MaxWeight + 1}} {
		if err := p.Validate(); !errors.Is(err, ErrInvalidParams) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalidParams", p, err)
		}
	}
	if err := (Params{OverlapScoreCredit: MaxWeight, Temperature: MaxWeight}).Validate(); err != nil {
		t.Errorf("weights at MaxWeight: %v", err)
	}
	stored := DefaultParams()
	stored.PrefillLoadScale = 2 * MaxWeight
	var d Decision
	if err := Select(stored, Request{ISL: 64, BlockSize: 16}, []Candidate{{Rank: wkA0}}, nil, &d); err != nil || d.Rank != wkA0 {
		t.Fatalf("Select under a stored weight over MaxWeight: %v (rank %v)", err, d.Rank)
	}
}

// TestLargestWeightsKeepCostsFinite: at MaxWeight, with the largest
// request and loads, every cost is finite: Select chooses, and its
// overflow check (ErrInvalidCandidate) is never reached through valid
// parameters.
func TestLargestWeightsKeepCostsFinite(t *testing.T) {
	p := Params{OverlapScoreCredit: MaxWeight, HostCacheHitWeight: MaxWeight, DiskCacheHitWeight: MaxWeight,
		PrefillLoadScale: MaxWeight, DecodeActiveRequestWeight: MaxWeight, BusyDecodeFraction: MaxWeight}
	load := Load{ActivePrefillTokens: math.MaxInt64, ActiveDecodeBlocks: math.MaxInt64, ActiveRequests: math.MaxInt64}
	cands := []Candidate{{Rank: wkA0, Load: load, PotentialDecodeBlocks: math.MaxInt64, CapacityBlocks: math.MaxInt64}, {Rank: wkA1}}
	var d Decision
	if err := Select(p, Request{ISL: math.MaxInt, BlockSize: 1}, cands, nil, &d); err != nil {
		t.Fatalf("Select at MaxWeight: %v", err)
	}
	for _, c := range d.Candidates {
		if math.IsInf(c.Cost, 0) || math.IsNaN(c.Cost) {
			t.Fatalf("rank %v: cost %v", c.Rank, c.Cost)
		}
	}
}

// TestKeepMovesTheCostWithTheChoice: a booking kept on its rank reports
// that rank's cost, not the cost of the rank Select chose. From a review.
func TestKeepMovesTheCostWithTheChoice(t *testing.T) {
	cands := []Candidate{
		{Rank: wkA0, Load: Load{ActivePrefillTokens: 400}},
		{Rank: wkA1},
	}
	var d Decision
	if err := Select(DefaultParams(), Request{ISL: 4, BlockSize: 4}, cands, nil, &d); err != nil {
		t.Fatal(err)
	}
	if d.Rank != wkA1 {
		t.Fatalf("chose %v, want the idle rank %v", d.Rank, wkA1)
	}
	if !d.Keep(wkA0) {
		t.Fatal("Keep: not a candidate")
	}
	if c := d.Chosen(); c.Rank != wkA0 || d.Cost != c.Cost || d.DecidedBy != DecidedByBooking {
		t.Fatalf("after Keep: decision rank %v cost %v by %v; chosen %v cost %v", d.Rank, d.Cost, d.DecidedBy, c.Rank, c.Cost)
	}
}

func TestDecisionIsResetBetweenCalls(t *testing.T) {
	var d Decision
	p := DefaultParams()
	p.Temperature = 1
	rng := rand.New(rand.NewPCG(1, 2))
	if err := Select(p, Request{ISL: 64, BlockSize: 16}, []Candidate{{Rank: wkA0}, {Rank: wkB0, PotentialDecodeBlocks: 3}, {Rank: wkC0}}, rng, &d); err != nil {
		t.Fatal(err)
	}
	if err := Select(DefaultParams(), Request{ISL: 16, BlockSize: 16}, []Candidate{{Rank: wkB0}}, nil, &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Candidates) != 1 || d.Candidates[0].Probability != 0 || d.DecidedBy != DecidedByCost || d.Params.Temperature != 0 || d.RequestBlocks != 1 {
		t.Fatalf("stale decision fields: %+v", d)
	}
}

func TestSelectDoesNotAllocateAtSteadyState(t *testing.T) {
	cands := make([]Candidate, 64)
	for i := range cands {
		cands[i] = mkCand(kvevent.Rank{Worker: uint64(i)}, uint32(i%5), uint32(i%3), 1, 0, Load{ActiveDecodeBlocks: int64(i)}, int64(100+i%7))
	}
	req := Request{ISL: 2048, BlockSize: 16, FirstBlockHash: 99}
	rng := rand.New(rand.NewPCG(7, 7))
	for _, temp := range []float64{0, 0.7} {
		p := DefaultParams()
		p.Temperature = temp
		var d Decision
		allocs := testing.AllocsPerRun(200, func() {
			if err := Select(p, req, cands, rng, &d); err != nil {
				t.Fatal(err)
			}
		})
		if allocs != 0 {
			t.Errorf("temperature %v: Select allocates %v times per call", temp, allocs)
		}
	}
}

func TestSoftmaxProbabilitiesFollowTheFormula(t *testing.T) {
	p := Params{PrefillLoadScale: 1, Temperature: 0.5}
	// Costs 0 (ISL 0), 2, 4 from potential decode blocks alone; one busy.
	p.BusyPrefillTokens = 100
	cands := []Candidate{
		{Rank: wkA0, PotentialDecodeBlocks: 0},
		{Rank: wkB0, PotentialDecodeBlocks: 2},
		{Rank: wkC0, PotentialDecodeBlocks: 4},
		{Rank: wkA1, Load: Load{ActivePrefillTokens: 101}},
	}
	d := mustSelectRank(t, p, Request{BlockSize: 16}, cands, rand.New(rand.NewPCG(1, 1)))
	// p ∝ exp(-(c-0)/((4-0)*0.5)) = exp(-c/2)
	w := []float64{1, math.Exp(-1), math.Exp(-2)}
	sum := w[0] + w[1] + w[2]
	for i, wi := range w {
		if got, want := d.Candidates[i].Probability, wi/sum; math.Abs(got-want) > 1e-12 {
			t.Errorf("candidate %d: probability %v, want %v", i, got, want)
		}
	}
	if d.Candidates[3].Probability != 0 {
		t.Errorf("busy candidate has probability %v", d.Candidates[3].Probability)
	}
	if d.DecidedBy != DecidedBySample {
		t.Errorf("decided by %v, want sample", d.DecidedBy)
	}
}

// drawRankCounts runs n seeded selections and counts the ranks chosen. The seed
// is fixed, so the counts are the same on every run: the bounds below are
// loose sanity checks, never flaky.
func drawRankCounts(t *testing.T, p Params, cands []Candidate, n int) map[kvevent.Rank]int {
	rng := rand.New(rand.NewPCG(42, 1042))
	counts := map[kvevent.Rank]int{}
	var d Decision
	for range n {
		if err := Select(p, Request{ISL: 32, BlockSize: 16}, cands, rng, &d); err != nil {
			t.Fatal(err)
		}
		counts[d.Rank]++
	}
	return counts
}

func TestSoftmaxPrefersTheCheapestAndIsUniformOnEqualCosts(t *testing.T) {
	p := DefaultParams()
	p.Temperature = 0.5
	const n = 20000
	counts := drawRankCounts(t, p, []Candidate{
		{Rank: wkA0, PotentialDecodeBlocks: 0},
		{Rank: wkB0, PotentialDecodeBlocks: 5},
		{Rank: wkC0, PotentialDecodeBlocks: 10},
	}, n)
	if !(counts[wkA0] > counts[wkB0] && counts[wkB0] > counts[wkC0] && counts[wkC0] > 0) {
		t.Fatalf("counts %v: want cheapest > middle > dearest > 0", counts)
	}
	// Expected shares: exp(0), exp(-1), exp(-2) over their sum: .665 .245 .090.
	if f := float64(counts[wkA0]) / n; f < 0.62 || f > 0.71 {
		t.Fatalf("cheapest chosen %.3f of the time, want about 0.665", f)
	}

	uniform := drawRankCounts(t, p, []Candidate{{Rank: wkA0}, {Rank: wkB0}, {Rank: wkC0}, {Rank: wkA1}}, n)
	for r, c := range uniform {
		if f := float64(c) / n; f < 0.22 || f > 0.28 {
			t.Fatalf("equal costs: rank %v chosen %.3f of the time, want about 0.25", r, f)
		}
	}
}

func TestSoftmaxWithTinyTemperaturePicksOnlyTheCheapest(t *testing.T) {
	p := Params{PrefillLoadScale: 1, Temperature: 5e-324}
	counts := drawRankCounts(t, p, []Candidate{{Rank: wkA0, PotentialDecodeBlocks: 1}, {Rank: wkB0, PotentialDecodeBlocks: 2}}, 100)
	if counts[wkA0] != 100 {
		t.Fatalf("counts %v: a temperature that underflows must act as 0", counts)
	}
}

// ---- Select against a brute-force reference ----

// refSelect is the reference: cost from the §5 formula written out again,
// then the tie chain as successive filters.
func refSelect(p Params, req Request, cands []Candidate) (int, bool) {
	type row struct {
		i       int
		cost    float64
		overlap int64
		active  int64
		rv      uint64
	}
	var rows []row
	for i, c := range cands {
		busy := (p.BusyDecodeFraction > 0 && c.CapacityBlocks > 0 && float64(c.Load.ActiveDecodeBlocks) > p.BusyDecodeFraction*float64(c.CapacityBlocks)) ||
			(p.BusyPrefillTokens > 0 && c.Load.ActivePrefillTokens > p.BusyPrefillTokens)
		if busy {
			continue
		}
		credit := p.OverlapScoreCredit*float64(c.Overlap[0]) + p.HostCacheHitWeight*float64(c.Overlap[1]) +
			p.DiskCacheHitWeight*(float64(c.Overlap[2])+float64(c.Overlap[3]))
		raw := float64(c.Load.ActivePrefillTokens+int64(req.ISL)) / float64(req.BlockSize)
		cost := p.PrefillLoadScale*math.Max(raw-credit, 0) + float64(c.PotentialDecodeBlocks) + p.DecodeActiveRequestWeight*float64(c.Load.ActiveRequests)
		ov := int64(c.Overlap[0]) + int64(c.Overlap[1]) + int64(c.Overlap[2]) + int64(c.Overlap[3])
		rows = append(rows, row{i, cost, ov, c.Load.ActiveDecodeBlocks, rendezvous(req.FirstBlockHash, c.Rank)})
	}
	if len(rows) == 0 {
		return -1, false
	}
	keep := func(better func(a, b row) bool, equal func(a, b row) bool) {
		best := rows[0]
		for _, r := range rows[1:] {
			if better(r, best) {
				best = r
			}
		}
		var out []row
		for _, r := range rows {
			if equal(r, best) {
				out = append(out, r)
			}
		}
		rows = out
	}
	keep(func(a, b row) bool { return a.cost < b.cost }, func(a, b row) bool { return a.cost == b.cost })
	keep(func(a, b row) bool { return a.overlap > b.overlap }, func(a, b row) bool { return a.overlap == b.overlap })
	keep(func(a, b row) bool { return a.active < b.active }, func(a, b row) bool { return a.active == b.active })
	keep(func(a, b row) bool { return a.rv > b.rv }, func(a, b row) bool { return a.rv == b.rv })
	return rows[0].i, true
}

// genCandidates draws candidates from one to three shapes, each candidate a
// copy of a shape on its own rank with sometimes one field nudged, so that
// exact cost ties, and ties further down the chain, are common.
func genCandidates() *rapid.Generator[[]Candidate] {
	small := func(hi int64) *rapid.Generator[int64] { return rapid.Int64Range(0, hi) }
	shape := rapid.Custom(func(t *rapid.T) Candidate {
		var ov [kvevent.NumTiers]uint32
		for i := range ov {
			ov[i] = uint32(rapid.IntRange(0, 3).Draw(t, "overlap"))
		}
		return Candidate{
			Overlap: ov,
			Load: Load{
				ActivePrefillTokens: small(64).Draw(t, "prefill") * 8,
				ActiveDecodeBlocks:  small(6).Draw(t, "decode"),
				ActiveRequests:      small(3).Draw(t, "requests"),
			},
			PotentialDecodeBlocks: small(8).Draw(t, "potential"),
			CapacityBlocks:        small(10).Draw(t, "capacity"),
		}
	})
	return rapid.Custom(func(t *rapid.T) []Candidate {
		shapes := rapid.SliceOfN(shape, 1, 3).Draw(t, "shapes")
		n := rapid.IntRange(0, 10).Draw(t, "n")
		out := make([]Candidate, n)
		for i := range out {
			c := rapid.SampledFrom(shapes).Draw(t, "shape")
			c.Rank = kvevent.Rank{Worker: uint64(rapid.IntRange(0, 5).Draw(t, "worker")), DP: uint32(rapid.IntRange(0, 1).Draw(t, "dp"))}
			switch rapid.IntRange(0, 5).Draw(t, "nudge") {
			case 1:
				c.Load.ActiveDecodeBlocks = small(6).Draw(t, "decode")
			case 2:
				// Move a block between tiers: the overlap stays, the credit may not.
				if c.Overlap[0] > 0 {
					c.Overlap[0]--
					c.Overlap[rapid.IntRange(1, 3).Draw(t, "tier")]++
				}
			case 3:
				// One decode block less, one device block of credit less:
				// often an equal cost with a shorter overlap.
				if c.PotentialDecodeBlocks > 0 && c.Overlap[0] > 0 {
					c.PotentialDecodeBlocks--
					c.Overlap[0]--
				}
			}
			out[i] = c
		}
		return out
	})
}

func TestSelectMatchesBruteForceReference(t *testing.T) {
	for range loadPropertyRounds() {
		checkSelectMatchesBruteForceReference(t)
	}
}

func checkSelectMatchesBruteForceReference(t *testing.T) {
	weights := []float64{0, 0.25, 0.5, 0.75, 1, 2}
	rapid.Check(t, func(t *rapid.T) {
		p := Params{
			OverlapScoreCredit:        rapid.SampledFrom(weights).Draw(t, "credit"),
			HostCacheHitWeight:        rapid.SampledFrom(weights).Draw(t, "host"),
			DiskCacheHitWeight:        rapid.SampledFrom(weights).Draw(t, "disk"),
			PrefillLoadScale:          rapid.SampledFrom(weights).Draw(t, "scale"),
			DecodeActiveRequestWeight: rapid.SampledFrom(weights).Draw(t, "reqw"),
			BusyDecodeFraction:        rapid.SampledFrom([]float64{0, 0.5, 0.9}).Draw(t, "busyfrac"),
			BusyPrefillTokens:         rapid.SampledFrom([]int64{0, 128, 400}).Draw(t, "busytok"),
		}
		req := Request{
			ISL:            rapid.IntRange(0, 100).Draw(t, "isl"),
			BlockSize:      rapid.SampledFrom([]int{1, 4, 16}).Draw(t, "bs"),
			FirstBlockHash: rapid.Uint64().Draw(t, "first"),
		}
		cands := genCandidates().Draw(t, "cands")
		var d Decision
		err := Select(p, req, cands, nil, &d)
		want, ok := refSelect(p, req, cands)
		switch {
		case len(cands) == 0:
			if !errors.Is(err, ErrNoWorkers) {
				t.Fatalf("no candidates: error %v", err)
			}
		case !ok:
			if !errors.Is(err, ErrOverloaded) {
				t.Fatalf("all busy: error %v", err)
			}
		case err != nil:
			t.Fatalf("Select: %v", err)
		case d.Index != want:
			t.Fatalf("chose %d (%v, cost %v, by %v); reference %d (cost %v)", d.Index, d.Rank, d.Cost, d.DecidedBy, want, d.Candidates[want].Cost)
		}
		if err == nil && (d.Rank != cands[d.Index].Rank || d.Cost != d.Candidates[d.Index].Cost || d.Candidates[d.Index].Busy) {
			t.Fatalf("decision fields disagree: %+v", d)
		}
	})
}

func TestSoftmaxIsAValidDistributionOverEligibleRanks(t *testing.T) {
	for range loadPropertyRounds() {
		checkSoftmaxIsAValidDistributionOverEligibleRanks(t)
	}
}

func checkSoftmaxIsAValidDistributionOverEligibleRanks(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		p := DefaultParams()
		p.Temperature = rapid.Float64Range(0.01, 10).Draw(t, "temp")
		p.BusyPrefillTokens = 256
		cands := genCandidates().Filter(func(c []Candidate) bool { return len(c) > 0 }).Draw(t, "cands")
		rng := rand.New(rand.NewPCG(rapid.Uint64().Draw(t, "seed"), 0))
		var d Decision
		err := Select(p, Request{ISL: 40, BlockSize: 16}, cands, rng, &d)
		if errors.Is(err, ErrOverloaded) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		var sum float64
		for i, s := range d.Candidates {
			if s.Busy && s.Probability != 0 || !s.Busy && s.Probability <= 0 {
				t.Fatalf("candidate %d busy %v probability %v", i, s.Busy, s.Probability)
			}
			sum += s.Probability
			for _, o := range d.Candidates {
				if !s.Busy && !o.Busy && s.Cost < o.Cost && s.Probability < o.Probability {
					t.Fatalf("cheaper candidate less likely: %v@%v vs %v@%v", s.Cost, s.Probability, o.Cost, o.Probability)
				}
			}
		}
		if math.Abs(sum-1) > 1e-9 {
			t.Fatalf("probabilities sum to %v", sum)
		}
		if d.Chosen() == nil || d.Chosen().Busy {
			t.Fatalf("chose %d", d.Index)
		}
	})
}

// TestPreferMovesOnlyACostTie: Prefer takes a rank tied on cost with the
// chosen one, never a dearer or busy one, and leaves a sampled decision.
func TestPreferMovesOnlyACostTie(t *testing.T) {
	r := func(w uint64) kvevent.Rank { return kvevent.Rank{Worker: w} }
	cands := []Candidate{{Rank: r(1)}, {Rank: r(2)}, {Rank: r(3), Load: Load{ActivePrefillTokens: 32}}}
	var d Decision
	if err := Select(DefaultParams(), Request{ISL: 64, BlockSize: 16, FirstBlockHash: 7}, cands, nil, &d); err != nil {
		t.Fatal(err)
	}
	if d.Rank == r(3) {
		t.Fatalf("the loaded rank won: %+v", d)
	}
	other := r(1)
	if d.Rank == other {
		other = r(2)
	}
	if !d.Prefer(other) || d.Rank != other || d.DecidedBy != DecidedBySession || d.Chosen().Rank != other {
		t.Fatalf("Prefer(%v) did not take the tie: %+v", other, d)
	}
	if d.Prefer(r(3)) || d.Rank != other {
		t.Fatalf("Prefer took the dearer rank 3: %+v", d)
	}
	if d.Prefer(r(9)) {
		t.Fatal("Prefer took a rank that is no candidate")
	}
	// Rank 5 ties rank 4 on cost, but its small capacity makes the same
	// decode blocks busy: a session that used rank 5 last is not sent back.
	params := DefaultParams()
	params.BusyDecodeFraction = 0.5
	busy := []Candidate{
		{Rank: r(4), Load: Load{ActiveDecodeBlocks: 4}, PotentialDecodeBlocks: 8, CapacityBlocks: 100},
		{Rank: r(5), Load: Load{ActiveDecodeBlocks: 4}, PotentialDecodeBlocks: 8, CapacityBlocks: 4},
	}
	var db Decision
	if err := Select(params, Request{ISL: 64, BlockSize: 16, FirstBlockHash: 7}, busy, nil, &db); err != nil {
		t.Fatal(err)
	}
	if db.Rank != r(4) || !db.Candidates[1].Busy || db.Candidates[1].Cost != db.Cost {
		t.Fatalf("want rank 4 chosen and rank 5 busy at its cost: %+v", db)
	}
	if db.Prefer(r(5)) || db.Rank != r(4) {
		t.Fatalf("Prefer took the busy rank 5: %+v", db)
	}
	d.DecidedBy = DecidedBySample
	if d.Prefer(r(1)) && other != r(1) {
		t.Fatal("Prefer moved a sampled decision")
	}
}
