package api

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"runtime"
	"strconv"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
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
			{"route token_ids 0, escaped key", repeatTo(`{"token\u005fids":[`, same(`0`), `]}`, size), route, true},
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
