package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/jsonscan"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// repeatTo writes prefix, then elem(i) for i = 0, 1, ... joined by
// commas while the body stays within size, then suffix.
func repeatTo(prefix string, elem func(i int) string, suffix string, size int) []byte {
	var b bytes.Buffer
	b.WriteString(prefix)
	for i := 0; ; i++ {
		e := elem(i)
		if b.Len()+1+len(e)+len(suffix) > size {
			break
		}
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(e)
	}
	b.WriteString(suffix)
	return b.Bytes()
}

func same(s string) func(int) string { return func(int) string { return s } }

// totalAlloc returns the bytes f allocated (runtime.MemStats.TotalAlloc:
// every allocation, freed or not).
func totalAlloc(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestJSONBodiesAllocateWithinTheirBudget decodes bodies of the smallest
// elements each endpoint's arrays take ("{}" or "0", a few bytes that
// decode to a struct of up to a hundred bytes) as the handlers do, and
// checks that none allocates more than its budget, 8 times its size or
// 16 MiB: a body of 1 MiB of "{}" events allocated 234 MB before its
// first event was refused.
func TestJSONBodiesAllocateWithinTheirBudget(t *testing.T) {
	if raceEnabled {
		// The race detector's instrumentation allocates besides (the
		// route's sized slices take twice their size): only the refusals
		// are checked.
		t.Log("under -race: allocations not checked")
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	hash := func(int) string { return strconv.FormatUint(r.Uint64()|1<<63, 10) }
	events := func(body []byte) error {
		var req EventsRequest
		err := checkDecodeBudget(body, &eventsCosts)
		if err == nil {
			err = decodeJSONBytes(body, &req, false)
		}
		if err == nil {
			_, err = rankBatches(&req)
		}
		return err
	}
	dump := func(body []byte) error {
		var req DumpRequest
		err := checkDecodeBudget(body, &dumpCosts)
		if err == nil {
			err = decodeJSONBytes(body, &req, false)
		}
		if err == nil {
			_, err = dumpEvents(kvevent.Rank{Worker: 1}, &req)
		}
		return err
	}
	register := func(body []byte) error {
		var req RegisterWorkerRequest
		err := checkDecodeBudget(body, &registerCosts)
		if err == nil {
			err = decodeJSONBytes(body, &req, false)
		}
		if err == nil {
			_, err = workerInfo(&req)
		}
		return err
	}
	route := func(body []byte) error {
		var req RouteRequest
		err := decodeRouteBody(body, &req)
		if err == nil {
			err = CheckRoute(&req)
		}
		return err
	}
	const stored = `{"worker_id":1,"events":[{"event_id":1,"type":"stored","tier":"device","blocks":[`
	for _, size := range []int{1 << 20, 4 << 20} {
		for _, tc := range []struct {
			name    string
			body    []byte
			decode  func([]byte) error
			refused bool // 413 too_large before decoding
		}{
			{"events {}", repeatTo(`{"batches":[{"worker_id":1,"events":[`, same(`{}`), `]}]}`, size), events, true},
			{"batches {}", repeatTo(`{"batches":[`, same(`{}`), `]}`, size), events, true},
			{"batches 0", repeatTo(`{"batches":[`, same(`0`), `]}`, size), events, true},
			{"blocks {}", repeatTo(`{"batches":[`+stored, same(`{}`), `]}]}]}`, size), events, true},
			{"hashes 0", repeatTo(`{"batches":[{"worker_id":1,"events":[{"event_id":1,"type":"removed","tier":"device","hashes":[`, same(`0`), `]}]}]}`, size), events, true},
			{"blocks", repeatTo(`{"batches":[`+stored, func(i int) string {
				return `{"hash":` + hash(i) + `,"local_hash":` + hash(i) + `}`
			}, `]}]}]}`, size), events, false},
			// Real events of the smallest kinds: within the floor, and, as
			// the node's decoded events take some 700 bytes each, over the
			// budget past it (documented: a request of 20000 events or
			// fewer is never refused for its budget).
			{"removed events", repeatTo(`{"batches":[{"worker_id":1,"events":[`, func(i int) string {
				return `{"event_id":` + strconv.Itoa(i+1) + `,"type":"removed","tier":"host","hashes":[` + hash(i) + `]}`
			}, `]}]}`, size), events, size > 1<<20},
			{"cleared events", repeatTo(`{"batches":[{"worker_id":1,"events":[`, func(i int) string {
				return `{"event_id":` + strconv.Itoa(i+1) + `,"type":"cleared"}`
			}, `]}]}`, size), events, true},
			{"stored events", repeatTo(`{"batches":[{"worker_id":1,"events":[`, func(i int) string {
				return `{"event_id":` + strconv.Itoa(i+1) + `,"type":"stored","tier":"device","blocks":[{"hash":` + hash(i) + `,"local_hash":` + hash(i) +
					`},{"hash":` + hash(i) + `,"local_hash":` + hash(i) + `}]}`
			}, `]}]}`, size), events, false},
			{"dump {}", repeatTo(`{"cursor":1,"events":[`, same(`{}`), `]}`, size), dump, true},
			{"dump blocks {}", repeatTo(`{"cursor":1,"events":[{"type":"stored","tier":"disk","blocks":[`, same(`{}`), `]}]}`, size), dump, true},
			{"dp_ranks 0", repeatTo(`{"worker_id":1,"block_size":16,"dp_ranks":[`, same(`0`), `]}`, size), register, size > 1<<20},
			{"route block_hashes 0", repeatTo(`{"block_hashes":[`, same(`0`), `]}`, size), route, false},
			{"route token_ids 0", repeatTo(`{"token_ids":[`, same(`0`), `]}`, size), route, false},
			// Not the fast path's (an escape): encoding/json's.
			{"route block_hashes 0, escaped", repeatTo(`{"model":"\u0041","block_hashes":[`, same(`0`), `]}`, size), route, false},
			// Sized under the key encoding/json reads (routeArrays).
			{"route token_ids 0, escaped key", repeatTo(`{"token\u005fids":[`, same(`0`), `]}`, size), route, false},
			{"route block_hashes, escaped key", repeatTo(`{"block\u005fhashes":[`, hash, `]}`, size), route, false},
		} {
			var err error
			got := totalAlloc(func() { err = tc.decode(tc.body) })
			budget := decodeBudget(len(tc.body))
			t.Logf("%s, %d bytes: allocated %d (%.1f times), budget %d: %v", tc.name, len(tc.body), got, float64(got)/float64(len(tc.body)), budget, err)
			var he *httpError
			if refused := errors.As(err, &he) && he.reason == ReasonTooLarge; refused != tc.refused {
				t.Errorf("%s, %d bytes: refused too_large %v, want %v (%v)", tc.name, len(tc.body), refused, tc.refused, err)
			}
			// TotalAlloc counts the whole process: a little room for what
			// else runs (the route's encoding/json path takes its budget
			// to within a few hundred bytes: a copy of the body growing to
			// 4 times its size, and the hashes 4 times it).
			if int64(got) > budget+budget/100 && !raceEnabled {
				t.Errorf("%s, %d bytes: decoding allocated %d bytes, over its budget of %d", tc.name, len(tc.body), got, budget)
			}
		}
	}
}

// TestRouteArraysAllocateByTheirKeysNotTheirNamesInTheText: a large
// route body's arrays are sized under the keys encoding/json takes for
// them, escapes undone and letter case folded. They were sized, or the
// body held to its budget, by whether the bytes "token_ids" and
// "block_hashes" occurred anywhere in it, which a string value or an
// empty array of the other field also makes true: a body of 4 MiB of
// "0," under "block\u005fhashes", with a lora_name of "token_ids", was
// neither sized nor refused, and allocated 128 MB (30.5 times its size)
// where its budget is 8 times.
func TestRouteArraysAllocateByTheirKeysNotTheirNamesInTheText(t *testing.T) {
	if raceEnabled {
		t.Log("under -race: allocations not checked")
	}
	size := 4 << 20
	// half the body's elements under token_ids, the rest under block_hashes.
	both := repeatTo(`{"model":"\u0041","token_ids":[`, same(`0`), `],"block_hashes":[`, size/2)
	for _, tc := range []struct {
		name    string
		body    []byte
		refused bool
	}{
		{"the other array's name as a value", repeatTo(`{"lora_name":"token_ids","block\u005fhashes":[`, same(`0`), `]}`, size), false},
		{"the other array's name as a request id", repeatTo(`{"request_id":"block_hashes","token\u005fids":[`, same(`0`), `]}`, size), false},
		{"the other array empty", repeatTo(`{"token_ids":[],"block\u005fhashes":[`, same(`0`), `]}`, size), false},
		{"the key in capitals", repeatTo(`{"token_ids":null,"BLOCK_HASHES":[`, same(`0`), `]}`, size), false},
		{"the key folded (U+017F for s)", repeatTo(`{"block_ha\u017fhes":[`, same(`0`), `]}`, size), false},
		{"both arrays, an escape", repeatTo(string(both), same(`0`), `]}`, size), false},
		// Given twice, the second empty: encoding/json drops the room the
		// first had, and grows the third.
		{"an array given three times", repeatTo(`{"block_hashes":[0],"block_hashes":[],"block_hashes":[`, same(`0`), `]}`, size), true},
		{"an array given twice, folded", repeatTo(`{"token_ids":[0],"Token_IDs":null,"TOKEN_IDS":[`, same(`0`), `]}`, size), true},
	} {
		var err error
		got := totalAlloc(func() {
			var req RouteRequest
			err = decodeRouteBody(tc.body, &req)
		})
		budget := decodeBudget(len(tc.body))
		t.Logf("%s, %d bytes: allocated %d (%.1f times), budget %d: %v", tc.name, len(tc.body), got, float64(got)/float64(len(tc.body)), budget, err)
		var he *httpError
		if refused := errors.As(err, &he) && he.reason == ReasonTooLarge; refused != tc.refused {
			t.Errorf("%s: refused too_large %v, want %v (%v)", tc.name, refused, tc.refused, err)
		}
		if int64(got) > budget+budget/100 && !raceEnabled {
			t.Errorf("%s: decoding allocated %d bytes, over its budget of %d", tc.name, got, budget)
		}
	}
}

func TestRouteArraysCountsWhatEncodingJSONFills(t *testing.T) {
	for _, tc := range []struct {
		body           string
		hashes, tokens routeArray
	}{
		{`{}`, routeArray{}, routeArray{}},
		{`{"block_hashes":[1,2,3],"token_ids":[]}`, routeArray{1, 3}, routeArray{1, 0}},
		{` { "lora_name" : "token_ids" , "block\u005fhashes" : [ 1 , 2 ] } `, routeArray{1, 2}, routeArray{}},
		{`{"Token_Ids":null,"token_ids":[1],"x":{"block_hashes":[1,2]},"y":["block_hashes",[1,2]]}`, routeArray{}, routeArray{2, 1}},
		// Elements of the wrong kind take room too.
		{`{"token_ids":[[1,2],{"a":1,"b":2},"x,y"]}`, routeArray{}, routeArray{1, 3}},
		{`{"token_ids":["x,y]",1],"block_hashes":[{"z":"]"}]}`, routeArray{1, 1}, routeArray{1, 2}},
		{`{"block_ha\u017fhes":[1],"block_hashe\"":[1,2]}`, routeArray{1, 1}, routeArray{}},
	} {
		h, tk := routeArrays([]byte(tc.body))
		if h != tc.hashes || tk != tc.tokens {
			t.Errorf("routeArrays(%s) = %+v, %+v, want %+v, %+v", tc.body, h, tk, tc.hashes, tc.tokens)
		}
	}
	// Not JSON: some counts, no panic.
	for _, b := range []string{`{"token_ids":[`, `{"token_ids`, `{"token\`, `]]}}{[`, `{"token_ids":[1,`} {
		_, _ = routeArrays([]byte(b))
	}
}

// refRouteArrays is routeArrays's specification on a valid JSON object:
// its top-level keys as encoding/json reads them, and the elements of
// each value that is an array.
func refRouteArrays(t *testing.T, b []byte) (hashes, tokens routeArray) {
	dec := json.NewDecoder(bytes.NewReader(b))
	if _, err := dec.Token(); err != nil { // '{'
		t.Fatal(err)
	}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		var v any
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
		var a *routeArray
		switch key := k.(string); {
		case strings.EqualFold(key, "block_hashes"):
			a = &hashes
		case strings.EqualFold(key, "token_ids"):
			a = &tokens
		default:
			continue
		}
		a.named++
		if elems, ok := v.([]any); ok {
			a.elems += len(elems)
		}
	}
	return hashes, tokens
}

func TestRouteArraysAgreesWithEncodingJSON(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	keys := []string{`token_ids`, `block_hashes`, `token\u005fids`, `block\u005fhashes`, `TOKEN_IDS`, `Block_Hashes`,
		`block_ha\u017fhes`, `to\u212aen_ids`, `token_id`, `lora_name`, `model`, `x\"block_hashes`, `isl`}
	var value func(depth int) string
	value = func(depth int) string {
		switch k := r.IntN(8); {
		case depth > 3 || k == 0:
			return strconv.Itoa(r.IntN(1000))
		case k == 1:
			return `null`
		case k == 2:
			return `"` + keys[r.IntN(len(keys))] + []string{`"`, `,[]{}"`, `,]"`}[r.IntN(3)]
		case k <= 5:
			var b strings.Builder
			b.WriteString("[")
			for i := range r.IntN(5) {
				if i > 0 {
					b.WriteString(" , "[r.IntN(2) : 2+r.IntN(2)])
				}
				b.WriteString(value(depth + 1))
			}
			b.WriteString("]")
			return b.String()
		default:
			var b strings.Builder
			b.WriteString("{")
			for i := range r.IntN(4) {
				if i > 0 {
					b.WriteString(",")
				}
				b.WriteString(`"` + keys[r.IntN(len(keys))] + `": ` + value(depth+1))
			}
			b.WriteString("}")
			return b.String()
		}
	}
	for range 3000 {
		var b strings.Builder
		b.WriteString("{")
		for i := range r.IntN(5) {
			if i > 0 {
				b.WriteString(",\n")
			}
			b.WriteString(` "` + keys[r.IntN(len(keys))] + `" :` + value(1))
		}
		b.WriteString("}")
		body := []byte(b.String())
		wantH, wantT := refRouteArrays(t, body)
		if h, tk := routeArrays(body); h != wantH || tk != wantT {
			t.Fatalf("routeArrays(%s) = %+v, %+v, want %+v, %+v", body, h, tk, wantH, wantT)
		}
	}
}

// TestEventsDecodeCostIsWhatTheNodeCharges: a client's count of a POST
// /v1/events (EventsDecodeCost) is what checkDecodeBudget charges its
// body, so that a client splitting by it is never refused.
func TestEventsDecodeCostIsWhatTheNodeCharges(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	for range 200 {
		batches := make([]raftfsm.RankBatch, r.IntN(4))
		for i := range batches {
			rank := kvevent.Rank{Worker: 1, DP: uint32(i)}
			batches[i].Rank = rank
			for j := range r.IntN(5) {
				e := kvevent.Event{Rank: rank, EventID: uint64(j + 1), Tier: kvevent.TierDevice}
				switch r.IntN(3) {
				case 0:
					e.Kind = kvevent.KindStored
					e.Blocks = make([]kvevent.Block, r.IntN(4))
				case 1:
					e.Kind = kvevent.KindRemoved
					e.Removed = make([]uint64, r.IntN(4))
				default:
					e.Kind = kvevent.KindCleared
				}
				batches[i].Events = append(batches[i].Events, e)
			}
		}
		body, err := json.Marshal(EventsRequestFrom(batches))
		if err != nil {
			t.Fatal(err)
		}
		n := jsonscan.Elements(body)
		var want int64
		for d, c := range eventsCosts {
			want += int64(n[d]) * int64(c)
		}
		if got := EventsDecodeCost(batches); got != want {
			t.Fatalf("EventsDecodeCost = %d, the node charges %s %d", got, body, want)
		}
	}
}
