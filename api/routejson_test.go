package api

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api/apitest"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// randFloat draws floats of every magnitude encoding/json formats
// differently: zero (both signs), tiny (exponent form), ordinary, huge.
func randFloat(rng *rand.Rand) float64 {
	switch rng.IntN(8) {
	case 0:
		return 0
	case 1:
		return math.Copysign(0, -1)
	case 2:
		return (rng.Float64() - 0.5) * 1e-7
	case 3:
		return rng.Float64() * math.Pow(10, float64(rng.IntN(40)-20))
	case 4:
		return -rng.Float64() * 1e22
	case 5:
		return float64(rng.IntN(1000)) / 4
	case 6:
		return 1e21
	default:
		return rng.NormFloat64() * 1000
	}
}

func randRouteResult(rng *rand.Rand) raftfsm.RouteResult {
	var res raftfsm.RouteResult
	d := &res.Decision
	d.Rank = kvevent.Rank{Worker: rng.Uint64() >> rng.IntN(64), DP: rng.Uint32() >> rng.IntN(32)}
	d.Cost = randFloat(rng)
	d.DecidedBy = indexer.DecidedBy(rng.IntN(10))
	d.RequestBlocks = rng.Int64N(1<<20) - 3
	d.Params = indexer.Params{OverlapScoreCredit: randFloat(rng), HostCacheHitWeight: randFloat(rng),
		DiskCacheHitWeight: randFloat(rng), PrefillLoadScale: randFloat(rng),
		DecodeActiveRequestWeight: randFloat(rng), Temperature: randFloat(rng),
		BusyDecodeFraction: randFloat(rng), BusyPrefillTokens: rng.Int64() - rng.Int64()}
	if rng.IntN(4) > 0 {
		d.Params = indexer.DefaultParams() // the cached case
	}
	res.BlockSize = rng.IntN(1 << 10)
	res.Booked = rng.IntN(2) == 0
	d.Index = -1
	if rng.IntN(5) > 0 {
		d.Index = 0
		c := indexer.CandidateScore{Rank: d.Rank, Cost: d.Cost}
		for t := range c.Overlap {
			c.Overlap[t] = rng.Uint32() >> rng.IntN(32)
		}
		d.Candidates = []indexer.CandidateScore{c}
	}
	return res
}

// TestBriefRouteResponseMatchesEncodingJSON: the hand-written brief answer
// is byte for byte encoding/json's, or refuses.
func TestBriefRouteResponseMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var buf []byte
	for i := 0; i < 20000; i++ {
		res := randRouteResult(rng)
		want, err := json.Marshal(routeResponse(&res, true))
		if err != nil {
			t.Fatal(err)
		}
		got, ok := appendBriefRouteResponse(buf[:0], &res)
		if !ok {
			t.Fatalf("refused %+v", res)
		}
		if string(got) != string(want) {
			t.Fatalf("hand-written\n%s\nencoding/json\n%s", got, want)
		}
		buf = got
	}
}

// TestBriefRouteResponseRefusesWhatJSONCannotWrite: NaN and infinities
// are left to encoding/json (which answers them with an error).
func TestBriefRouteResponseRefusesWhatJSONCannotWrite(t *testing.T) {
	for _, f := range []float64{math.NaN(), math.Inf(1), math.Inf(-1)} {
		res := raftfsm.RouteResult{BlockSize: 16}
		res.Decision.Index = -1
		res.Decision.Cost = f
		if _, ok := appendBriefRouteResponse(nil, &res); ok {
			t.Errorf("cost %v: written", f)
		}
		res.Decision.Cost = 1
		res.Decision.Params.Temperature = f
		if _, ok := appendBriefRouteResponse(nil, &res); ok {
			t.Errorf("temperature %v: written", f)
		}
	}
}

func TestAppendJSONFloatMatchesEncodingJSON(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 100000; i++ {
		f := randFloat(rng)
		if i%2 == 0 {
			f = math.Float64frombits(rng.Uint64())
		}
		want, err := json.Marshal(f)
		got, ok := appendJSONFloat(nil, f)
		if (err == nil) != ok || (ok && string(got) != string(want)) {
			t.Fatalf("%v (%#x): %s %v, encoding/json %s %v", f, math.Float64bits(f), got, ok, want, err)
		}
	}
}

// TestRouteReusesNothingAcrossRequests: the route handler's pooled request
// and body buffers carry nothing from one request to the next: every body
// gets the same answer whatever came before it.
func TestRouteReusesNothingAcrossRequests(t *testing.T) {
	f := apitest.New("n1", "")
	for _, id := range []uint64{1, 2} {
		if err := f.RegisterWorker(context.Background(), raftfsm.WorkerInfo{
			ID: id, DPRanks: []uint32{0, 1}, BlockSize: 4, Capacity: [4]int64{1000, 2000, 0, 0}, Model: "m"}); err != nil {
			t.Fatal(err)
		}
	}
	s := NewServer(f, Options{Logger: slog.New(slog.DiscardHandler)})
	defer s.Close()
	bodies := []string{
		`{"block_hashes":[1,2,3,4,5,6,7,8],"brief":true}`,
		`{"token_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"brief":true}`,
		`{"token_ids":[1,2,3,4,5,6,7,8,9],"block_hashes":null}`,
		`{"isl":40}`,
		`{"block_hashes":[5],"overrides":{"temperature":0}}`,
		`{"token_ids":null,"isl":3,"brief":true}`,
		`{"block_hashes":[],"isl":7}`,
		`{"block_hashes":[9,8,7],"lora_name":"a\u0062","brief":true}`,
		`{"block_hashes":[1],"unknown":1}`,
		`{"block_hashes":[1,2],"token_ids":[3]}`,
		`{"block_hashes":[1,2`,
	}
	answer := func(body string) string {
		rec := httptest.NewRecorder()
		s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/route", strings.NewReader(body)))
		return fmt.Sprintf("%d %s", rec.Code, rec.Body.Bytes())
	}
	want := make(map[string]string)
	for _, b := range bodies {
		want[b] = answer(b)
	}
	rng := rand.New(rand.NewPCG(9, 10))
	for i := 0; i < 500; i++ {
		b := bodies[rng.IntN(len(bodies))]
		if got := answer(b); got != want[b] {
			t.Fatalf("%s: answered %s after other requests, %s at first", b, got, want[b])
		}
	}
}

// TestBriefParamsKeepTheSignOfZero: the cached encoding of the last params
// is not reused for params equal to them but for a zero's sign. From a
// review: one client's temperature -0 made every later brief answer say
// -0 (or the reverse), where encoding/json writes each as it is.
func TestBriefParamsKeepTheSignOfZero(t *testing.T) {
	plus := indexer.DefaultParams()
	minus := plus
	minus.Temperature = math.Copysign(0, -1)
	for _, order := range [][2]indexer.Params{{plus, minus}, {minus, plus}} {
		for _, p := range order {
			got, ok := appendParams(nil, p)
			want, err := json.Marshal(p)
			if !ok || err != nil || string(got) != string(want) {
				t.Fatalf("params with temperature %v: %s, want %s", p.Temperature, got, want)
			}
		}
	}
}
