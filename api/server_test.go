package api_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/internal/rawhttp"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// routeCase is one request to one route and what must come back.
type routeCase struct {
	name   string
	setup  func(t *testing.T, n *node)
	method string
	path   string
	body   string
	code   int
	reason string   // for error answers
	msg    []string // substrings of the error message
	check  func(t *testing.T, a answer)
	// byBackend: the refusal is the backend's (it knows what the API
	// cannot), so the request does reach it.
	byBackend bool
}

const (
	storedEv  = `{"event_id":1,"type":"stored","tier":"device","blocks":[{"hash":11,"local_hash":101},{"hash":12,"local_hash":102}]}`
	removedEv = `{"event_id":2,"type":"removed","tier":"device","hashes":[12]}`
)

func events(evs ...string) string {
	return `{"batches":[{"worker_id":1,"dp_rank":0,"events":[` + strings.Join(evs, ",") + `]}]}`
}

func TestRoutes(t *testing.T) {
	cases := []routeCase{
		// POST /v1/route
		{name: "route by tokens", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2,3,4,5,6,7,8,9]}`, code: 200, check: checkRouteShape},
		{name: "route brief", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2,3,4,5,6,7,8,9],"brief":true}`, code: 200,
			check: func(t *testing.T, a answer) {
				m := a.json(t)
				want := sorted("worker_id", "dp_rank", "cost", "decided_by", "block_size", "request_blocks", "booked", "overlap", "params")
				if got := keysOf(m); !equal(got, want) {
					t.Fatalf("brief route keys = %v, want %v", got, want)
				}
			}},
		{name: "route by hashes with overrides", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"block_hashes":[101,102],"isl":8,"overrides":{"overlap_score_credit":2,"temperature":0}}`, code: 200, check: checkRouteShape},
		{name: "route books", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2,3,4],"book":true,"request_id":"r-1"}`, code: 200,
			check: func(t *testing.T, a answer) {
				if a.json(t)["booked"] != true {
					t.Fatalf("booked = %v, want true", a.json(t)["booked"])
				}
			}},
		{name: "route with no workers", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2,3,4]}`, code: 503, reason: api.ReasonNoWorkers},
		{name: "route bad JSON", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2`, code: 400, reason: api.ReasonBadJSON, msg: []string{"ends early"}},
		{name: "route not JSON", method: "POST", path: "/v1/route",
			body: `token_ids=1`, code: 400, reason: api.ReasonBadJSON},
		{name: "route unknown field", method: "POST", path: "/v1/route",
			body: `{"tokens":[1,2,3]}`, code: 400, reason: api.ReasonBadJSON, msg: []string{`unknown field "tokens"`}},
		{name: "route unknown override", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"busy_prefill_tokens":0}}`, code: 400, reason: api.ReasonBadJSON, msg: []string{"busy_prefill_tokens"}},
		{name: "route negative override", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"prefill_load_scale":-1}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"prefill_load_scale"}},
		{name: "route token over u32", method: "POST", path: "/v1/route",
			body: `{"token_ids":[4294967296]}`, code: 400, reason: api.ReasonBadJSON},
		{name: "route negative hash", method: "POST", path: "/v1/route",
			body: `{"block_hashes":[-1]}`, code: 400, reason: api.ReasonBadJSON},
		{name: "route both inputs", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"block_hashes":[1]}`, code: 400, reason: api.ReasonInvalid, msg: []string{"not both"}},
		{name: "route no input", method: "POST", path: "/v1/route",
			body: `{"lora_name":"x"}`, code: 400, reason: api.ReasonInvalid},
		{name: "route lora_name at its bound", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"lora_name":"` + strings.Repeat("l", limits.MaxNameLen) + `"}`, code: 200},
		{name: "route lora_name over its bound", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"lora_name":"` + strings.Repeat("l", limits.MaxNameLen+1) + `"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"lora_name", "bytes long"}},
		{name: "route cache_salt at its bound", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"cache_salt":"` + strings.Repeat("s", limits.MaxNameLen) + `"}`, code: 200},
		{name: "route cache_salt over its bound", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"cache_salt":"` + strings.Repeat("s", limits.MaxNameLen+1) + `"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"cache_salt", "bytes long"}},
		{name: "route negative isl", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"isl":-3}`, code: 400, reason: api.ReasonInvalid, msg: []string{"isl"}},
		// From a review: the booking recorded an isl below the prompt it held.
		{name: "route isl below its token_ids", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1,2,3],"isl":2}`, code: 400, reason: api.ReasonInvalid, msg: []string{"isl = 2", "3 token_ids"}},
		// From a review: an isl of 2^63-1 booked that many prefill tokens,
		// and two such bookings overflowed the rank's load.
		{name: "route isl over the longest input", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"isl":9223372036854775807,"book":true,"request_id":"x"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"isl"}},
		{name: "route book without id", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"book":true}`, code: 400, reason: api.ReasonInvalid, msg: []string{"request_id"}},
		{name: "route trailing data", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1]} {"token_ids":[2]}`, code: 400, reason: api.ReasonBadJSON, msg: []string{"more than one"}},
		{name: "route empty body", method: "POST", path: "/v1/route",
			code: 400, reason: api.ReasonBadJSON, msg: []string{"empty"}},
		{name: "route array body", method: "POST", path: "/v1/route",
			body: `[1,2]`, code: 400, reason: api.ReasonBadJSON},
		// From a review: the edges of a route's numbers and inputs. A number
		// JSON cannot hold, a string or a JavaScript literal where a number
		// goes, and a fraction for an integer are bad JSON; an override out of
		// range, an empty input, an isl past 2^32 and an empty request id to
		// book under are invalid. A null overrides object, a weight of -0 and
		// the smallest positive temperature (a sampled decision) route.
		{name: "route temperature past float64", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":1e400}}`, code: 400, reason: api.ReasonBadJSON, msg: []string{"temperature"}},
		{name: "route temperature too large", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":1e13}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"temperature"}},
		{name: "route temperature a string", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":"NaN"}}`, code: 400, reason: api.ReasonBadJSON},
		{name: "route temperature NaN", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":NaN}}`, code: 400, reason: api.ReasonBadJSON},
		{name: "route temperature Infinity", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":Infinity}}`, code: 400, reason: api.ReasonBadJSON},
		{name: "route fractional isl", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"isl":1.5}`, code: 400, reason: api.ReasonBadJSON, msg: []string{"isl"}},
		{name: "route empty tokens", method: "POST", path: "/v1/route",
			body: `{"token_ids":[],"isl":0}`, code: 400, reason: api.ReasonInvalid, msg: []string{"token_ids"}},
		{name: "route empty hashes", method: "POST", path: "/v1/route",
			body: `{"block_hashes":[],"isl":0}`, code: 400, reason: api.ReasonInvalid, msg: []string{"block_hashes"}},
		{name: "route isl past 2^32", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"isl":4294967297}`, code: 400, reason: api.ReasonInvalid, msg: []string{"isl"}},
		{name: "route book with an empty id", method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"book":true,"request_id":""}`, code: 400, reason: api.ReasonInvalid, msg: []string{"request_id"}},
		// The model is a metrics label (kvrouter_route_requests_total) and
		// is logged; a worker's model with a control character is refused
		// too. A printable one no worker serves is routed: routing does
		// not filter by it. From a review: a route took any model.
		{name: "route a model with a line break", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"model":"llama\n4242"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"model", "control character"}},
		{name: "route a model with a tab", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"model":"llama\tforged","brief":true}`, code: 400, reason: api.ReasonInvalid, msg: []string{"model", "control character"}},
		{name: "route a model no worker serves", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"model":"Llama 3.1 (modèle)"}`, code: 200, check: checkRouteShape},
		{name: "route null overrides", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":null}`, code: 200, check: checkRouteShape},
		{name: "route weight -0", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"host_cache_hit_weight":-0.0}}`, code: 200, check: checkRouteShape},
		{name: "route smallest temperature", setup: withWorkers, method: "POST", path: "/v1/route",
			body: `{"token_ids":[1],"overrides":{"temperature":5e-324}}`, code: 200, check: checkRouteShape},

		// bookings
		{name: "prefill done", method: "POST", path: "/v1/requests/r-1/prefill_done", code: 204},
		{name: "free", method: "DELETE", path: "/v1/requests/r-1", code: 204},
		{name: "free escaped id", method: "DELETE", path: "/v1/requests/a%2Fb", code: 204},
		{name: "free id too long", method: "DELETE", path: "/v1/requests/" + strings.Repeat("x", 300), code: 400, reason: api.ReasonInvalid},
		{name: "free id with control char", method: "DELETE", path: "/v1/requests/a%0Ab", code: 400, reason: api.ReasonInvalid},

		// workers
		{name: "workers", setup: withWorkers, method: "GET", path: "/v1/workers", code: 200, check: checkWorkersShape},
		{name: "register", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"dp_ranks":[0,1],"block_size":16,"capacity_blocks":{"device":100,"host":0,"disk":5,"external":0},"endpoint":"http://w7:8000","model":"llama"}`,
			code: 204},
		{name: "register worker 0", method: "POST", path: "/v1/workers", body: `{"worker_id":0,"block_size":16}`, code: 204},
		{name: "register without id", method: "POST", path: "/v1/workers",
			body: `{"block_size":16}`, code: 400, reason: api.ReasonInvalid, msg: []string{"worker_id"}},
		{name: "register zero block size", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7}`, code: 400, reason: api.ReasonInvalid, msg: []string{"block_size"}},
		{name: "register negative capacity", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"capacity_blocks":{"disk":-1}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"capacity_blocks.disk"}},
		// From a review: a capacity of 2^63-1 panicked every replica's
		// apply (the index's slack overflowed).
		{name: "register a capacity past the bound", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"capacity_blocks":{"device":9223372036854775807}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"capacity_blocks.device", "1099511627776"}},
		{name: "register unknown tier in capacity", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"capacity_blocks":{"gpu":1}}`, code: 400, reason: api.ReasonBadJSON, msg: []string{`"gpu"`}},
		// From a review: a lease past about 292 years overflowed the
		// leader's lease check, which removed the worker at once.
		{name: "register a lease of a year", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"lease_ms":31536000000}`, code: 204},
		{name: "register a lease over a year", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"lease_ms":31536000001}`, code: 400, reason: api.ReasonInvalid, msg: []string{"lease_ms", "a year"}},
		{name: "register a lease of max int64", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"lease_ms":9223372036854775807}`, code: 400, reason: api.ReasonInvalid, msg: []string{"lease_ms"}},
		{name: "register duplicate dp rank", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"dp_ranks":[1,1]}`, code: 400, reason: api.ReasonInvalid, msg: []string{"twice"}},
		// A model is printed in kvctl's tables and in logs: a line break
		// or a tab in it split a table's row into rows that read as other
		// workers'. From a review.
		{name: "register a model with a line break", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"model":"llama\n4242  0  llama"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"model", "control character"}},
		{name: "register a model with a tab", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"model":"llama\tforged"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"model", "control character"}},
		{name: "register a model of spaces and non-ASCII", method: "POST", path: "/v1/workers",
			body: `{"worker_id":7,"block_size":16,"model":"Llama 3.1 (modèle)"}`, code: 204},
		{name: "deregister", setup: withWorkers, method: "DELETE", path: "/v1/workers/2", code: 204},
		{name: "deregister unknown", method: "DELETE", path: "/v1/workers/99", code: 404, reason: api.ReasonUnknownWorker},
		{name: "deregister bad id", method: "DELETE", path: "/v1/workers/abc", code: 400, reason: api.ReasonInvalid},
		{name: "deregister id over u64", method: "DELETE", path: "/v1/workers/18446744073709551616", code: 400, reason: api.ReasonInvalid},

		// index and settings
		{name: "index stats", method: "GET", path: "/v1/index/stats", code: 200, check: checkStatsShape},
		{name: "settings", method: "PUT", path: "/v1/settings", body: `{"params":{"overlap_score_credit":2},"view":"tiered"}`, code: 204,
			check: func(t *testing.T, a answer) {}},
		{name: "settings bad view", method: "PUT", path: "/v1/settings", body: `{"view":"fancy"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"fancy"}},
		{name: "settings negative", method: "PUT", path: "/v1/settings", body: `{"params":{"temperature":-1}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"temperature"}},
		// A weight that overflows every route's cost (a 500 on every route
		// after the write) is refused. From a review.
		{name: "settings weight too large", method: "PUT", path: "/v1/settings", body: `{"params":{"prefill_load_scale":1e308}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"prefill_load_scale", "1e+12"}},
		{name: "route override too large", setup: withWorkers, method: "POST", path: "/v1/route", body: `{"isl":16,"overrides":{"prefill_load_scale":1e308}}`, code: 400, reason: api.ReasonInvalid, msg: []string{"prefill_load_scale"}},
		// A null decodes into a struct as nothing: it must not stand for
		// a body of every default (settings reset, a rank emptied).
		{name: "settings null", method: "PUT", path: "/v1/settings", body: ` null `, code: 400, reason: api.ReasonBadJSON, msg: []string{"JSON object"}},
		{name: "settings number", method: "PUT", path: "/v1/settings", body: `5`, code: 400, reason: api.ReasonBadJSON, msg: []string{"JSON object"}},
		{name: "dump null", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump", body: `null`, code: 400, reason: api.ReasonBadJSON},
		{name: "route null", method: "POST", path: "/v1/route", body: "\n null", code: 400, reason: api.ReasonBadJSON},
		{name: "register null", method: "POST", path: "/v1/workers", body: `null`, code: 400, reason: api.ReasonBadJSON},
		{name: "register a salt too long", method: "POST", path: "/v1/workers",
			body: `{"worker_id":9,"block_size":16,"salt":"` + strings.Repeat("s", 1025) + `"}`, code: 400, reason: api.ReasonInvalid},
		{name: "transfer null", method: "POST", path: "/v1/cluster/leader/transfer", body: `null`, code: 400, reason: api.ReasonBadJSON},

		// events
		{name: "events", method: "POST", path: "/v1/events", body: events(storedEv, removedEv), code: 200,
			check: func(t *testing.T, a answer) {
				acks := a.json(t)["acks"].([]any)
				if len(acks) != 1 {
					t.Fatalf("acks = %v", acks)
				}
				want := sorted("worker_id", "dp_rank", "cursor", "applied", "dups", "gap")
				if got := keysOf(acks[0]); !equal(got, want) {
					t.Fatalf("ack keys = %v, want %v", got, want)
				}
				ack := acks[0].(map[string]any)
				if ack["cursor"] != 2.0 || ack["applied"] != 2.0 || ack["worker_id"] != 1.0 {
					t.Fatalf("ack = %v", ack)
				}
			}},
		{name: "events cleared without tier", method: "POST", path: "/v1/events", body: events(`{"event_id":1,"type":"cleared"}`), code: 200},
		// docs/api.md: a cleared event clears every tier, and a tier given
		// with it is ignored, an unknown one too. From a review: it was
		// parsed, and an unknown one refused.
		{name: "events cleared with an unknown tier", method: "POST", path: "/v1/events", body: events(`{"event_id":1,"type":"cleared","tier":"gpu"}`), code: 200},
		{name: "events cleared with a tier", method: "POST", path: "/v1/events", body: events(`{"event_id":1,"type":"cleared","tier":"host"}`), code: 200},
		{name: "events unknown tier", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"stored","tier":"gpu2","blocks":[{"hash":1,"local_hash":1}]}`),
			code: 400, reason: api.ReasonInvalid, msg: []string{`unknown tier "gpu2"`, "batch 0", "event 0"}},
		{name: "events missing tier", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"removed","hashes":[1]}`), code: 400, reason: api.ReasonInvalid, msg: []string{"tier is missing"}},
		{name: "events unknown type", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"evicted","tier":"host","hashes":[1]}`), code: 400, reason: api.ReasonInvalid, msg: []string{`"evicted"`}},
		{name: "events stored without blocks", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"stored","tier":"host"}`), code: 400, reason: api.ReasonInvalid, msg: []string{"no blocks"}},
		{name: "events hash repeated", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"stored","tier":"host","blocks":[{"hash":5,"local_hash":1},{"hash":5,"local_hash":2}]}`),
			code: 400, reason: api.ReasonInvalid, msg: []string{"repeated"}},
		{name: "events own parent", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"stored","tier":"disk","parent_hash":5,"blocks":[{"hash":5,"local_hash":1}]}`),
			code: 400, reason: api.ReasonInvalid, msg: []string{"own parent"}},
		{name: "events removed without hashes", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"removed","tier":"disk"}`), code: 400, reason: api.ReasonInvalid, msg: []string{"no hashes"}},
		{name: "events removed with blocks", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"removed","tier":"disk","hashes":[1],"blocks":[{"hash":1,"local_hash":1}]}`),
			code: 400, reason: api.ReasonInvalid},
		{name: "events cleared with hashes", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"cleared","hashes":[1]}`), code: 400, reason: api.ReasonInvalid},
		{name: "events ids not consecutive", method: "POST", path: "/v1/events",
			body: events(storedEv, strings.Replace(removedEv, `"event_id":2`, `"event_id":4`, 1)), code: 400, reason: api.ReasonInvalid, msg: []string{"rise by one"}},
		{name: "events ids wrapping", method: "POST", path: "/v1/events",
			body: events(`{"event_id":18446744073709551615,"type":"cleared"}`, `{"event_id":0,"type":"cleared"}`), code: 400, reason: api.ReasonInvalid, msg: []string{"rise by one"}},
		{name: "events no batches", method: "POST", path: "/v1/events", body: `{"batches":[]}`, code: 400, reason: api.ReasonInvalid},
		{name: "events without worker_id", method: "POST", path: "/v1/events",
			body: `{"batches":[{"dp_rank":0,"events":[{"event_id":1,"type":"cleared"}]}]}`, code: 400, reason: api.ReasonInvalid, msg: []string{"batch 0", "worker_id is missing"}},
		{name: "events with a null worker_id", method: "POST", path: "/v1/events",
			body: `{"batches":[{"worker_id":null,"events":[{"event_id":1,"type":"cleared"}]}]}`, code: 400, reason: api.ReasonInvalid, msg: []string{"worker_id is missing"}},
		{name: "events without dp_rank", method: "POST", path: "/v1/events",
			body: `{"batches":[{"worker_id":1,"events":[{"event_id":1,"type":"cleared"}]}]}`, code: 200},
		{name: "events empty batch", method: "POST", path: "/v1/events", body: events(), code: 400, reason: api.ReasonInvalid, msg: []string{"no events"}},
		{name: "events unknown field", method: "POST", path: "/v1/events",
			body: events(`{"event_id":1,"type":"cleared","medium":"GPU"}`), code: 400, reason: api.ReasonBadJSON, msg: []string{"medium"}},
		{name: "events dp rank over u32", method: "POST", path: "/v1/events",
			body: `{"batches":[{"worker_id":1,"dp_rank":4294967296,"events":[{"event_id":1,"type":"cleared"}]}]}`, code: 400, reason: api.ReasonBadJSON},

		// dumps
		{name: "dump", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump",
			body: `{"cursor":42,"events":[` + storedEv + `]}`, code: 200,
			check: func(t *testing.T, a answer) {
				m := a.json(t)
				if m["cursor"] != 42.0 || m["events"] != 1.0 {
					t.Fatalf("dump answer = %v", m)
				}
			}},
		{name: "dump empty", setup: withWorkers, method: "POST", path: "/v1/ranks/1/1/dump", body: `{"cursor":3,"events":[]}`, code: 200},
		{name: "dump of an unregistered worker", method: "POST", path: "/v1/ranks/9/0/dump", body: `{"cursor":3,"events":[]}`, code: 200}, // as its events are
		{name: "dump without events", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump", body: `{"cursor":3}`,
			code: 400, reason: api.ReasonInvalid, msg: []string{"events is missing"}},
		{name: "dump with null events", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump", body: `{"cursor":3,"events":null}`,
			code: 400, reason: api.ReasonInvalid, msg: []string{"events is missing"}},
		{name: "dump with a remove", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump",
			body: `{"cursor":42,"events":[` + removedEv + `]}`, code: 400, reason: api.ReasonInvalid, msg: []string{"stored events only"}},
		{name: "dump bad tier", setup: withWorkers, method: "POST", path: "/v1/ranks/1/0/dump",
			body: `{"cursor":42,"events":[` + strings.Replace(storedEv, "device", "nvme", 1) + `]}`, code: 400, reason: api.ReasonInvalid, msg: []string{`"nvme"`}},
		{name: "dump bad worker", method: "POST", path: "/v1/ranks/x/0/dump", body: `{"cursor":1}`, code: 400, reason: api.ReasonInvalid},
		{name: "dump dp over u32", method: "POST", path: "/v1/ranks/1/4294967296/dump", body: `{"cursor":1}`, code: 400, reason: api.ReasonInvalid},

		// cluster
		{name: "status", method: "GET", path: "/v1/cluster/status", code: 200, check: checkStatusShape},
		{name: "members", method: "GET", path: "/v1/cluster/members", code: 200,
			check: func(t *testing.T, a answer) {
				ms := a.json(t)["members"].([]any)
				want := sorted("id", "raft_addr", "http_addr", "voter", "leader")
				if len(ms) != 1 || !equal(keysOf(ms[0]), want) {
					t.Fatalf("members = %v, want one with keys %v", ms, want)
				}
			}},
		{name: "add member", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"10.0.0.2:7946","http_addr":"10.0.0.2:7080"}`, code: 204},
		{name: "add member bad address", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"10.0.0.2","http_addr":"10.0.0.2:7080"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"raft_addr"}},
		{name: "add member wildcard raft address", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"0.0.0.0:7946","http_addr":"10.0.0.2:7080"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"raft_addr", "every interface"}},
		// From a review: a wildcard http_addr went into the member table,
		// and a follower forwarded the writes for that leader to itself.
		{name: "add member wildcard http address", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"10.0.0.2:7946","http_addr":"0.0.0.0:7080"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"http_addr", "every interface"}},
		{name: "add member wildcard IPv6 http address", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"10.0.0.2:7946","http_addr":"[::]:7080"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"http_addr", "every interface"}},
		{name: "add member http port 0", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"10.0.0.2:7946","http_addr":"10.0.0.2:0"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"http_addr"}},
		{name: "add member bad port", method: "POST", path: "/v1/cluster/members",
			body: `{"id":"n2","raft_addr":"h:1","http_addr":"h:99999"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"http_addr"}},
		{name: "add member no id", method: "POST", path: "/v1/cluster/members",
			body: `{"raft_addr":"h:1","http_addr":"h:2"}`, code: 400, reason: api.ReasonInvalid},
		{name: "remove member", setup: func(t *testing.T, n *node) {
			if err := n.fake.AddMember(t.Context(), "n2", "h:1", "h:2"); err != nil {
				t.Fatal(err)
			}
		}, method: "DELETE", path: "/v1/cluster/members/n2", code: 204},
		{name: "remove unknown member", method: "DELETE", path: "/v1/cluster/members/n9", code: 400, reason: api.ReasonInvalid, byBackend: true},
		{name: "transfer to any", setup: func(t *testing.T, n *node) {
			if err := n.fake.AddMember(t.Context(), "n2", "h:1", "h:2"); err != nil {
				t.Fatal(err)
			}
		}, method: "POST", path: "/v1/cluster/leader/transfer", code: 204},
		{name: "transfer to one", setup: func(t *testing.T, n *node) {
			if err := n.fake.AddMember(t.Context(), "n2", "h:1", "h:2"); err != nil {
				t.Fatal(err)
			}
		}, method: "POST", path: "/v1/cluster/leader/transfer", body: `{"to":"n2"}`, code: 204},
		{name: "transfer bad body", method: "POST", path: "/v1/cluster/leader/transfer", body: `{"to":5}`, code: 400, reason: api.ReasonBadJSON},
		{name: "transfer to an overlong id", method: "POST", path: "/v1/cluster/leader/transfer",
			body: `{"to":"` + strings.Repeat("n", limits.MaxIDLen+1) + `"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"to is", "bytes long"}},
		{name: "transfer to an id with a control character", method: "POST", path: "/v1/cluster/leader/transfer",
			body: `{"to":"n\u00002"}`, code: 400, reason: api.ReasonInvalid, msg: []string{"to "}},

		// health
		{name: "healthz", method: "GET", path: "/healthz", code: 200},
		{name: "readyz", method: "GET", path: "/readyz", code: 200,
			check: func(t *testing.T, a answer) {
				if m := a.json(t); m["ready"] != true || m["applied_index"] != 10.0 {
					t.Fatalf("readyz = %v", m)
				}
			}},
		{name: "readyz not ready", setup: func(t *testing.T, n *node) { n.fake.SetReady(false) },
			method: "GET", path: "/readyz", code: 503, reason: api.ReasonNotReady,
			check: func(t *testing.T, a answer) {
				if m := a.json(t); m["applied_index"] != 10.0 {
					t.Fatalf("readyz = %v, want the applied index", m)
				}
			}},
		{name: "readyz removed", setup: func(t *testing.T, n *node) {
			st := n.fake.Status()
			st.Ready, st.Removed, st.LeaderID = false, true, ""
			n.fake.SetStatus(st)
		},
			method: "GET", path: "/readyz", code: 503, reason: api.ReasonNotReady,
			check: func(t *testing.T, a answer) {
				if m := a.json(t); !strings.Contains(fmt.Sprint(m["error"]), "removed from the cluster: stop this node") {
					t.Fatalf("readyz of a removed node = %v, want it to say so", m)
				}
			}},
		{name: "readyz apply halted", setup: func(t *testing.T, n *node) {
			st := n.fake.Status()
			st.Ready, st.ApplyHalted = false, "apply halted at entry 11 (term 2): bad command: written by a later build: command type 12: upgrade this node"
			n.fake.SetStatus(st)
		},
			method: "GET", path: "/readyz", code: 503, reason: api.ReasonNotReady,
			check: func(t *testing.T, a answer) {
				if m := a.json(t); !strings.Contains(fmt.Sprint(m["error"]), "apply halted at entry 11 (term 2)") ||
					!strings.Contains(fmt.Sprint(m["error"]), "upgrade this node") {
					t.Fatalf("readyz of a node halted at an entry of a later build = %v, want it to say so", m)
				}
			}},
		{name: "metrics", method: "GET", path: "/metrics", code: 200,
			check: func(t *testing.T, a answer) {
				if !strings.Contains(string(a.body), "kvrouter_route_requests_total") {
					t.Fatalf("metrics lack kvrouter_route_requests_total:\n%s", a.body)
				}
			}},

		// unknown routes
		{name: "unknown path", method: "GET", path: "/v1/nothing", code: 404, reason: api.ReasonNotFound},
		{name: "wrong method", method: "GET", path: "/v1/route", code: 405, reason: api.ReasonMethodNotAllowed,
			check: func(t *testing.T, a answer) {
				if a.header.Get("Allow") != "POST" {
					t.Fatalf("Allow = %q, want POST", a.header.Get("Allow"))
				}
			}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, "n1", api.Options{})
			if tc.setup != nil {
				tc.setup(t, n)
			}
			before := n.fake.Calls()
			a := send(t, n.http.URL, tc.method, tc.path, tc.body)
			if a.code != tc.code {
				t.Fatalf("%s %s: code %d, want %d; body %s", tc.method, tc.path, a.code, tc.code, a.body)
			}
			if tc.code >= 400 {
				if ct := a.header.Get("Content-Type"); ct != "application/json" {
					t.Errorf("error Content-Type = %q, want application/json", ct)
				}
				m := a.json(t)
				if m["reason"] != tc.reason {
					t.Errorf("reason = %v, want %q (body %s)", m["reason"], tc.reason, a.body)
				}
				msg, _ := m["error"].(string)
				for _, s := range tc.msg {
					if !strings.Contains(msg, s) {
						t.Errorf("error %q does not mention %q", msg, s)
					}
				}
			}
			if (tc.code == 400 || tc.code == 413) && !tc.byBackend {
				// A refused request reaches nothing of the backend.
				if after := n.fake.Calls(); !maps.Equal(before, after) {
					t.Errorf("a refused request reached the backend: calls %v -> %v", before, after)
				}
			}
			if tc.check != nil {
				tc.check(t, a)
			}
			if m := n.fake.Malformed(); m != 0 {
				t.Errorf("%d malformed arguments reached the backend", m)
			}
		})
	}
}

func equal(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }

func checkRouteShape(t *testing.T, a answer) {
	t.Helper()
	m := a.json(t)
	want := sorted("worker_id", "dp_rank", "cost", "decided_by", "block_size", "request_blocks", "booked", "overlap", "params", "candidates")
	if got := keysOf(m); !equal(got, want) {
		t.Fatalf("route keys = %v, want %v", got, want)
	}
	cands := m["candidates"].([]any)
	if len(cands) != 4 {
		t.Fatalf("%d candidates, want 4 (2 workers x 2 ranks)", len(cands))
	}
	wantC := sorted("worker_id", "dp_rank", "chosen", "overlap", "credit", "prefill_blocks", "potential_decode_blocks",
		"active_requests", "active_prefill_tokens", "active_decode_blocks", "cost", "busy", "probability")
	if got := keysOf(cands[0]); !equal(got, wantC) {
		t.Fatalf("candidate keys = %v, want %v", got, wantC)
	}
	if got := keysOf(cands[0].(map[string]any)["overlap"]); !equal(got, sorted("device", "host", "disk", "external")) {
		t.Fatalf("overlap keys = %v", got)
	}
	chosen := 0
	for _, c := range cands {
		if c.(map[string]any)["chosen"] == true {
			chosen++
		}
	}
	if chosen != 1 {
		t.Fatalf("%d candidates chosen, want 1", chosen)
	}
	if m["block_size"] != 4.0 {
		t.Fatalf("block_size = %v, want 4", m["block_size"])
	}
}

func checkWorkersShape(t *testing.T, a answer) {
	t.Helper()
	ws := a.json(t)["workers"].([]any)
	if len(ws) != 2 {
		t.Fatalf("%d workers, want 2", len(ws))
	}
	want := sorted("worker_id", "dp_ranks", "block_size", "capacity_blocks", "model", "ranks")
	if got := keysOf(ws[0]); !equal(got, want) {
		t.Fatalf("worker keys = %v, want %v", got, want)
	}
	ranks := ws[0].(map[string]any)["ranks"].([]any)
	if got, want := keysOf(ranks[0]), sorted("dp_rank", "blocks", "last_event_id", "needs_resync", "load", "last_heard_ms", "silent", "busy"); !equal(got, want) {
		t.Fatalf("rank keys = %v, want %v", got, want)
	}
	load := ranks[0].(map[string]any)["load"]
	if got, want := keysOf(load), sorted("active_prefill_tokens", "active_decode_blocks", "active_requests"); !equal(got, want) {
		t.Fatalf("load keys = %v, want %v", got, want)
	}
}

func checkStatsShape(t *testing.T, a answer) {
	t.Helper()
	m := a.json(t)
	want := sorted("nodes", "ranks", "entries", "blocks", "orphan_events", "orphan_blocks", "need_resync", "over_capacity", "counters", "heap_bytes", "memory_bytes")
	if got := keysOf(m); !equal(got, want) {
		t.Fatalf("stats keys = %v, want %v", got, want)
	}
	if h, _ := m["heap_bytes"].(float64); h <= 0 {
		t.Fatalf("heap_bytes = %v, want the node's heap", m["heap_bytes"])
	}
	if got := len(keysOf(m["counters"])); got != 11 {
		t.Fatalf("%d counters, want 11", got)
	}
}

func checkStatusShape(t *testing.T, a answer) {
	t.Helper()
	want := sorted("id", "raft_addr", "http_addr", "state", "term", "last_index", "commit_index", "applied_index",
		"leader_id", "leader_http", "last_contact_ms", "snapshot_index", "digest", "ready")
	if got := keysOf(a.json(t)); !equal(got, want) {
		t.Fatalf("status keys = %v, want %v", got, want)
	}
}

func TestBodyOverLimitIs413(t *testing.T) {
	n := newNode(t, "n1", api.Options{MaxBodyBytes: 1 << 10})
	big := `{"token_ids":[` + strings.Repeat("1,", 2000) + `1]}`
	for _, path := range []string{"/v1/route", "/v1/events", "/v1/workers"} {
		before := n.fake.Calls()
		a := send(t, n.http.URL, "POST", path, big)
		if a.code != http.StatusRequestEntityTooLarge || a.reason(t) != api.ReasonTooLarge {
			t.Fatalf("POST %s with %d bytes: %d %s, want 413 too_large", path, len(big), a.code, a.body)
		}
		if after := n.fake.Calls(); !maps.Equal(before, after) {
			t.Fatalf("an oversized body reached the backend: %v -> %v", before, after)
		}
	}
}

func TestSettingsLeftOutTakeDefaults(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	a := send(t, n.http.URL, "PUT", "/v1/settings", `{"params":{"overlap_score_credit":2,"busy_prefill_tokens":500}}`)
	if a.code != 204 {
		t.Fatalf("PUT /v1/settings: %d %s", a.code, a.body)
	}
	want := indexer.DefaultParams()
	want.OverlapScoreCredit, want.BusyPrefillTokens = 2, 500
	if got := n.fake.Settings(); got.Params != want || got.View != indexer.ViewDedup {
		t.Fatalf("settings = %+v, want %+v (dedup)", got, want)
	}
}

// TestKeysThatOnlyFoldToAFieldAreRefused: a key is a field's only when it
// is its name exactly. docs/api.md ("Strict input") promises that unknown
// fields are refused before anything reaches the node; from a review:
// encoding/json matches keys without their case and with Unicode folding
// (U+212A KELVIN SIGN for 'k', U+017F LONG S for 's'), so a key that is no
// field was taken for one, and the last of them won over the real field.
// The route's fast path and encoding/json's path answer alike.
func TestKeysThatOnlyFoldToAFieldAreRefused(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, c := range []struct{ method, path, body, key string }{
		// registers worker 10, not 9
		{"POST", "/v1/workers", `{"worker_id":9,"block_size":4,"WORKER_ID":10}`, "WORKER_ID"},
		// books nothing: "BOOK" overrides "book"
		{"POST", "/v1/route", `{"isl":5,"book":true,"request_id":"r1","BOOK":false}`, "BOOK"},
		// books: "booK" (Kelvin sign) is read as "book"
		{"POST", "/v1/route", "{\"isl\":5,\"boo\u212a\":true,\"request_id\":\"r2\"}", "boo\u212a"},
		{"POST", "/v1/route", `{"isl":5,"overrides":{"Temperature":1}}`, "Temperature"},
		// disk capacity under a long-s spelling of "disk"
		{"POST", "/v1/workers", "{\"worker_id\":12,\"block_size\":4,\"capacity_blocks\":{\"di\u017fk\":7}}", "di\u017fk"},
		{"PUT", "/v1/settings", `{"params":{"TEMPERATURE":1}}`, "TEMPERATURE"},
		{"POST", "/v1/events", events(`{"event_id":1,"Type":"cleared"}`), "Type"},
		{"POST", "/v1/cluster/members", `{"id":"n4","raft_addr":"10.0.0.4:7946","Http_Addr":"10.0.0.4:7080"}`, "Http_Addr"},
	} {
		refusedKey(t, n, c.method, c.path, c.body, c.key)
	}
}

// TestDuplicateKeysAreRefused: a key given twice in one object, at any
// depth, is refused (400 bad_json naming it). From a review: encoding/json
// took the last one, and merged the objects of a nested key given twice: a
// settings body with "params" twice was applied as the merge of both,
// though fields of params left out take the defaults (the route's
// "overrides" merged alike).
func TestDuplicateKeysAreRefused(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, c := range []struct{ method, path, body, key string }{
		{"PUT", "/v1/settings", `{"params":{"temperature":2},"params":{"host_cache_hit_weight":0.5}}`, "params"},
		{"PUT", "/v1/settings", `{"params":{"temperature":2,"temperature":1}}`, "temperature"},
		{"POST", "/v1/route", `{"isl":5,"overrides":{"temperature":2},"overrides":{"prefill_load_scale":2}}`, "overrides"},
		{"POST", "/v1/route", `{"isl":5,"isl":6}`, "isl"},
		{"POST", "/v1/route", `{"isl":5,"book":true,"request_id":"a","request_id":"b"}`, "request_id"},
		{"POST", "/v1/workers", `{"worker_id":9,"block_size":4,"capacity_blocks":{"disk":7,"disk":8}}`, "disk"},
		{"POST", "/v1/events", events(`{"event_id":1,"type":"cleared","type":"stored"}`), "type"},
		{"POST", "/v1/cluster/members", `{"id":"n4","id":"n5","raft_addr":"10.0.0.4:7946","http_addr":"10.0.0.4:7080"}`, "id"},
	} {
		refusedKey(t, n, c.method, c.path, c.body, c.key)
	}
}

// refusedKey sends body to path and checks it is refused, 400 bad_json
// naming key, before it reaches the node.
func refusedKey(t *testing.T, n *node, method, path, body, key string) {
	t.Helper()
	before := n.fake.Calls()
	a := send(t, n.http.URL, method, path, body)
	if a.code != 400 || a.reason(t) != api.ReasonBadJSON || !strings.Contains(a.json(t)["error"].(string), fmt.Sprintf("%q", key)) {
		t.Errorf("%s %s %s: %d %s, want 400 bad_json naming %q", method, path, body, a.code, a.body, key)
	}
	if after := n.fake.Calls(); !maps.Equal(before, after) {
		t.Errorf("%s %s %s reached the backend: %v -> %v", method, path, body, before, after)
	}
}

// TestOverloadedRouteAnswers503WithBusyCandidates: a route with every rank
// busy answers 503 overloaded with every candidate and why it is busy, or,
// brief, with none of them.
func TestOverloadedRouteAnswers503WithBusyCandidates(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	a := send(t, n.http.URL, "PUT", "/v1/settings", `{"params":{"busy_prefill_tokens":1}}`)
	if a.code != 204 {
		t.Fatal(a.code, string(a.body))
	}
	// Load every rank past the threshold.
	for i := range 4 {
		a := send(t, n.http.URL, "POST", "/v1/route", fmt.Sprintf(`{"token_ids":[1,2,3,4],"book":true,"request_id":"r%d"}`, i))
		if a.code != 200 {
			t.Fatalf("booking %d: %d %s", i, a.code, a.body)
		}
	}
	a = send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4]}`)
	if a.code != 503 || a.reason(t) != api.ReasonOverloaded {
		t.Fatalf("route with every rank busy: %d %s, want 503 overloaded", a.code, a.body)
	}
	cands, _ := a.json(t)["candidates"].([]any)
	if len(cands) != 4 {
		t.Fatalf("overloaded answer has %d candidates, want 4: %s", len(cands), a.body)
	}
	for _, c := range cands {
		if m := c.(map[string]any); m["busy"] != true || m["busy_reason"] != "prefill_tokens" {
			t.Fatalf("candidate %v: want busy for prefill_tokens", m)
		}
	}
	if got := counterValue(t, n.reg, "kvrouter_route_requests_total", map[string]string{"outcome": "busy"}); got != 1 {
		t.Fatalf("route busy count = %v, want 1", got)
	}
	// docs/api.md's brief: no candidates, on a 503 too; a hot path that
	// meets every rank busy gets the reason, not every rank's scores.
	a = send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"brief":true}`)
	if a.code != 503 || a.reason(t) != api.ReasonOverloaded {
		t.Fatalf("brief route with every rank busy: %d %s, want 503 overloaded", a.code, a.body)
	}
	if _, ok := a.json(t)["candidates"]; ok {
		t.Fatalf("brief overloaded answer lists candidates: %s", a.body)
	}
}

func TestMetricsLabelRoutesByPatternNotPath(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	for _, id := range []string{"a", "b", "c"} {
		if a := send(t, n.http.URL, "POST", "/v1/requests/"+id+"/prefill_done", ""); a.code != 204 {
			t.Fatal(a.code, string(a.body))
		}
	}
	send(t, n.http.URL, "GET", "/v1/no/such/"+"path", "")
	send(t, n.http.URL, "POST", "/v1/route", `{`)
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total",
		map[string]string{"route": "POST /v1/requests/{id}/prefill_done", "code": "204"}); got != 3 {
		t.Fatalf("prefill_done requests counted %v, want 3 under the pattern", got)
	}
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"route": "unmatched", "code": "404"}); got != 1 {
		t.Fatalf("unmatched requests counted %v, want 1", got)
	}
	if got := counterValue(t, n.reg, "kvrouter_route_requests_total", map[string]string{"outcome": "error"}); got != 1 {
		t.Fatalf("route errors counted %v, want 1", got)
	}
	mfs, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "route" && strings.Contains(lp.GetValue(), "/a/") {
					t.Fatalf("%s has a path as its route label: %q", mf.GetName(), lp.GetValue())
				}
			}
		}
	}
}

func TestTwoServersShareARegistry(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	// A second server on the same registry reuses the collectors instead of
	// failing to register them.
	s2 := api.NewServer(n.fake, api.Options{Registerer: n.reg, Gatherer: n.reg})
	defer s2.Close()
	send(t, n.http.URL, "GET", "/healthz", "")
	if got := counterValue(t, n.reg, "kvrouter_http_requests_total", map[string]string{"route": "GET /healthz"}); got != 1 {
		t.Fatalf("healthz counted %v, want 1", got)
	}
}

func TestBackendPanicIsAnswered500(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	n.fake.SetHook(func(method string) error {
		if method == "Workers" {
			panic("boom")
		}
		return nil
	})
	a := send(t, n.http.URL, "GET", "/v1/workers", "")
	if a.code != 500 || a.reason(t) != api.ReasonInternal {
		t.Fatalf("a panicking backend: %d %s, want 500 internal", a.code, a.body)
	}
}

func TestBackendErrorsMapToStatus(t *testing.T) {
	cases := []struct {
		err    error
		code   int
		reason string
	}{
		{fmt.Errorf("x: %w", indexer.ErrOverloaded), 503, api.ReasonOverloaded},
		{fmt.Errorf("x: %w", indexer.ErrNoWorkers), 503, api.ReasonNoWorkers},
		{fmt.Errorf("x: %w", indexer.ErrInvalidRequest), 400, api.ReasonInvalid},
		{fmt.Errorf("x: %w", raftfsm.ErrShutdown), 503, api.ReasonShuttingDown},
		{fmt.Errorf("x: %w", raftfsm.ErrStateReplaced), 503, api.ReasonStateReplaced},
		{fmt.Errorf("x: %w", raftfsm.ErrSaveShutDown), 503, api.ReasonShuttingDown},
		// A restore a closing node refuses before Raft has it: nothing
		// installed, sent on to the next node.
		{fmt.Errorf("x: %w: %w", raftfsm.ErrNotProposed, raftfsm.ErrShutdown), 503, api.ReasonNoLeader},
		{fmt.Errorf("x: %w", raftfsm.ErrNoLeader), 503, api.ReasonNoLeader},
		{fmt.Errorf("x: %w", raftfsm.ErrUnreachable), 503, api.ReasonUnreachable},
		{fmt.Errorf("x: %w", raftfsm.ErrUnregisteredRank), 409, api.ReasonUnregisteredRank},
		{fmt.Errorf("x: %w", raftfsm.ErrBlockSizeConflict), 409, api.ReasonConflict},
		{fmt.Errorf("x: %w", raftfsm.ErrInsufficientStorage), 507, api.ReasonInsufficientStorage},
		{fmt.Errorf("register: %w", raftfsm.ErrTooManyRanks), 507, api.ReasonInsufficientStorage},
		{fmt.Errorf("disk on fire"), 500, api.ReasonInternal},
	}
	for _, tc := range cases {
		t.Run(tc.reason, func(t *testing.T) {
			n := newNode(t, "n1", api.Options{})
			withWorkers(t, n)
			n.fake.SetHook(func(string) error { return tc.err })
			a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4]}`)
			if a.code != tc.code || a.reason(t) != tc.reason {
				t.Fatalf("backend error %v: %d %s, want %d %s", tc.err, a.code, a.body, tc.code, tc.reason)
			}
			if msg := a.json(t)["error"].(string); !strings.Contains(msg, tc.err.Error()) {
				t.Fatalf("error %q does not carry the backend's %q", msg, tc.err)
			}
		})
	}
}

// TestRoutedTokensAreCounted: a routed request's prompt tokens, the
// chosen rank's cached tokens per tier as the index predicts them, and
// the best any eligible rank had (metrics.md: is routing winning?).
func TestRoutedTokensAreCounted(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	storePrompt8(t, n, kvevent.TierHostPinned)
	a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4,5,6,7,8,9,10]}`)
	if a.code != 200 {
		t.Fatal(a.code, string(a.body))
	}
	for name, want := range map[string]float64{
		"kvrouter_route_prompt_tokens_total":      10,
		"kvrouter_route_best_cached_tokens_total": 8,
	} {
		if got := counterValue(t, n.reg, name, nil); got != want {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	for tier, want := range map[string]float64{"host": 8, "device": 0} {
		if got := counterValue(t, n.reg, "kvrouter_route_predicted_cached_tokens_total", map[string]string{"tier": tier}); got != want {
			t.Errorf("predicted cached tokens on %s = %v, want %v", tier, got, want)
		}
	}
}

// storePrompt8 has rank 2/1 store, in tier, the two blocks (block size
// 4) of the tokens 1 to 8.
func storePrompt8(t *testing.T, n *node, tier kvevent.Tier) {
	t.Helper()
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	r := kvevent.Rank{Worker: 2, DP: 1}
	ev := kvevent.Event{Rank: r, EventID: 1, Kind: kvevent.KindStored, Tier: tier}
	for i, h := range kvevent.LocalHashes(nil, tokens, 4, kvevent.Seed) {
		ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: uint64(50 + i), LocalHash: h})
	}
	if _, err := n.fake.IngestEvents(context.Background(), []raftfsm.RankBatch{{Rank: r, Events: []kvevent.Event{ev}}}); err != nil {
		t.Fatal(err)
	}
}

// TestBriefRouteCountsBestCachedTokensOfEveryEligibleRank: a brief
// answer holds the chosen candidate only, and the best cached tokens are
// still the best eligible rank's. Rank 2/1 holds the prompt but is loaded,
// so the route picks an idle rank with nothing cached; full or brief, the
// decision adds the 8 tokens 2/1 holds.
func TestBriefRouteCountsBestCachedTokensOfEveryEligibleRank(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	storePrompt8(t, n, kvevent.TierDevice)
	// 400 prompt tokens booked on 2/1 (its cache makes it the cheapest).
	a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4,5,6,7,8],"isl":400,"book":true,"request_id":"load"}`)
	if m := a.json(t); a.code != 200 || m["worker_id"] != 2.0 || m["dp_rank"] != 1.0 {
		t.Fatalf("booking the load: %d %s", a.code, a.body)
	}
	for _, body := range []string{`{"token_ids":[1,2,3,4,5,6,7,8]}`, `{"token_ids":[1,2,3,4,5,6,7,8],"brief":true}`} {
		before := counterValue(t, n.reg, "kvrouter_route_best_cached_tokens_total", nil)
		a := send(t, n.http.URL, "POST", "/v1/route", body)
		if m := a.json(t); a.code != 200 || m["worker_id"] == 2.0 && m["dp_rank"] == 1.0 {
			t.Fatalf("route %s: %d %s (want a rank other than the loaded 2/1)", body, a.code, a.body)
		}
		if got := counterValue(t, n.reg, "kvrouter_route_best_cached_tokens_total", nil) - before; got != 8 {
			t.Errorf("route %s added %v best cached tokens, want 8 (on 2/1, eligible though loaded)", body, got)
		}
	}
}

// TestRetriedBookedRouteAnswersTheFirstTrysRank: docs/api.md's book: a
// route sent again with the same request_id (a retry) answers the rank the
// first try booked, and counts the load once. The first booking loads its
// rank, so the retry's own decision would pick another one; the fake kept
// the first booking but answered that other rank, booked: true.
func TestRetriedBookedRouteAnswersTheFirstTrysRank(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	const body = `{"token_ids":[1,2,3,4,5,6,7,8],"book":true,"request_id":"r1"}`
	first := send(t, n.http.URL, "POST", "/v1/route", body)
	if first.code != 200 {
		t.Fatal(first.code, string(first.body))
	}
	j := first.json(t)
	again := send(t, n.http.URL, "POST", "/v1/route", body)
	if again.code != 200 {
		t.Fatal(again.code, string(again.body))
	}
	k := again.json(t)
	if k["worker_id"] != j["worker_id"] || k["dp_rank"] != j["dp_rank"] || k["booked"] != true {
		t.Fatalf("retry answered %v/%v booked %v; the first try booked %v/%v",
			k["worker_id"], k["dp_rank"], k["booked"], j["worker_id"], j["dp_rank"])
	}
	if got := n.fake.Bookings(); len(got) != 1 {
		t.Fatalf("bookings %v, want r1 alone", got)
	}
}

// TestRouteWithAnISLOutOfTheNodesBoundsIs400: an isl below the prompt's
// tokens or over raftfsm.MaxISL is refused 400: by the API where it can
// tell (token_ids), by the node otherwise (block_hashes: the block size
// is the node's), and by the fake that stands in for the node here. From
// a review: the fake took and booked an isl below the blocks' tokens, so
// an api test could pass on a route a node refuses.
func TestRouteWithAnISLOutOfTheNodesBoundsIs400(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, body := range []string{
		`{"block_hashes":[1,2,3],"isl":1,"book":true,"request_id":"below-blocks"}`,
		`{"token_ids":[1,2,3,4,5,6,7,8],"isl":3,"book":true,"request_id":"below-tokens"}`,
		fmt.Sprintf(`{"block_hashes":[1],"isl":%d,"book":true,"request_id":"above"}`, raftfsm.MaxISL+1),
	} {
		if r := send(t, n.http.URL, "POST", "/v1/route", body); r.code != 400 || r.json(t)["reason"] != string(api.ReasonInvalid) {
			t.Errorf("route %s: %d %s, want 400 invalid", body, r.code, r.body)
		}
	}
	if got := n.fake.Bookings(); len(got) != 0 {
		t.Fatalf("bookings %v, want none", got)
	}
}

// TestRouteCandidateMarkedChosenIsTheAnsweredRank: the explanation's one
// "chosen" candidate is the rank the answer names. From a review: marking
// candidates[0] chosen passed every api test (checkRouteShape counts one
// chosen candidate, never which).
func TestRouteCandidateMarkedChosenIsTheAnsweredRank(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for i := range 8 {
		// Booked, so that the cheapest rank moves on from candidates[0].
		a := send(t, n.http.URL, "POST", "/v1/route", fmt.Sprintf(`{"token_ids":[9,9,9,9],"book":true,"request_id":"c%d"}`, i))
		if a.code != 200 {
			t.Fatal(a.code, string(a.body))
		}
		m := a.json(t)
		for _, c := range m["candidates"].([]any) {
			c := c.(map[string]any)
			same := c["worker_id"] == m["worker_id"] && c["dp_rank"] == m["dp_rank"]
			if c["chosen"] == true != same {
				t.Fatalf("route %d answered %v/%v, candidate %v/%v chosen=%v", i, m["worker_id"], m["dp_rank"], c["worker_id"], c["dp_rank"], c["chosen"])
			}
		}
	}
}

// TestRouteCandidatesCarryEveryCostTerm: each candidate of a route's
// answer carries its own cost terms, checked against figures worked by
// hand from semantics §5, not only by key name. Rank 1/0 holds docs/api.md's
// example (blocks 101 and 102 on device, 103 on host: the example's
// figures), and rank 2/1 carries a booking, so that its load terms are not
// zero. From a review: zeroing credit, prefill_blocks, active_requests,
// active_prefill_tokens or active_decode_blocks in the answer passed every
// api, e2e and sim test (checkRouteShape checks their keys).
func TestRouteCandidatesCarryEveryCostTerm(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	store := func(r kvevent.Rank, id uint64, tier kvevent.Tier, parent uint64, hashes ...uint64) {
		t.Helper()
		ev := kvevent.Event{Rank: r, EventID: id, Kind: kvevent.KindStored, Tier: tier, HasParent: parent != 0, Parent: parent}
		for _, h := range hashes {
			ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: 1000 + h, LocalHash: h})
		}
		if _, err := n.fake.IngestEvents(context.Background(), []raftfsm.RankBatch{{Rank: r, Events: []kvevent.Event{ev}}}); err != nil {
			t.Fatal(err)
		}
	}
	store(kvevent.Rank{Worker: 1}, 1, kvevent.TierDevice, 0, 101, 102)
	store(kvevent.Rank{Worker: 1}, 2, kvevent.TierHostPinned, 1102, 103)
	store(kvevent.Rank{Worker: 2, DP: 1}, 1, kvevent.TierDevice, 0, 201, 202)
	// Booked on 2/1, which holds its two blocks (cost 3 + 2 against 5 + 2
	// elsewhere): 20 tokens, 8 of them cached.
	if a := send(t, n.http.URL, "POST", "/v1/route", `{"block_hashes":[201,202],"isl":20,"book":true,"request_id":"load"}`); a.code != 200 ||
		a.json(t)["worker_id"] != 2.0 || a.json(t)["dp_rank"] != 1.0 {
		t.Fatalf("booking the load: %d %s (want 2/1)", a.code, a.body)
	}
	a := send(t, n.http.URL, "POST", "/v1/route",
		`{"block_hashes":[101,102,103],"isl":12,"overrides":{"decode_active_request_weight":0.5}}`)
	if a.code != 200 {
		t.Fatal(a.code, string(a.body))
	}
	// Credit: 1 × device + 0.75 × host; prefill blocks: (active prefill
	// tokens + isl) / 4 − credit; potential decode blocks: the booked
	// distinct blocks + the request's 3 the rank does not hold; cost:
	// prefill blocks + potential + 0.5 × active requests.
	const want = `[
	 {"worker_id": 1, "dp_rank": 0, "chosen": true,
	  "overlap": {"device": 2, "host": 1, "disk": 0, "external": 0},
	  "credit": 2.75, "prefill_blocks": 0.25, "potential_decode_blocks": 3,
	  "active_requests": 0, "active_prefill_tokens": 0, "active_decode_blocks": 0,
	  "cost": 3.25, "busy": false, "probability": 0},
	 {"worker_id": 1, "dp_rank": 1, "chosen": false,
	  "overlap": {"device": 0, "host": 0, "disk": 0, "external": 0},
	  "credit": 0, "prefill_blocks": 3, "potential_decode_blocks": 3,
	  "active_requests": 0, "active_prefill_tokens": 0, "active_decode_blocks": 0,
	  "cost": 6, "busy": false, "probability": 0},
	 {"worker_id": 2, "dp_rank": 0, "chosen": false,
	  "overlap": {"device": 0, "host": 0, "disk": 0, "external": 0},
	  "credit": 0, "prefill_blocks": 3, "potential_decode_blocks": 3,
	  "active_requests": 0, "active_prefill_tokens": 0, "active_decode_blocks": 0,
	  "cost": 6, "busy": false, "probability": 0},
	 {"worker_id": 2, "dp_rank": 1, "chosen": false,
	  "overlap": {"device": 0, "host": 0, "disk": 0, "external": 0},
	  "credit": 0, "prefill_blocks": 6, "potential_decode_blocks": 5,
	  "active_requests": 1, "active_prefill_tokens": 12, "active_decode_blocks": 2,
	  "cost": 11.5, "busy": false, "probability": 0}]`
	var wantCands []any
	if err := json.Unmarshal([]byte(want), &wantCands); err != nil {
		t.Fatal(err)
	}
	key := func(c any) string {
		m := c.(map[string]any)
		return fmt.Sprint(m["worker_id"], "/", m["dp_rank"])
	}
	got := map[string]any{}
	for _, c := range a.json(t)["candidates"].([]any) {
		got[key(c)] = c
	}
	if len(got) != len(wantCands) {
		t.Fatalf("candidates %v, want %d ranks", got, len(wantCands))
	}
	for _, w := range wantCands {
		g, ok := got[key(w)]
		if !ok {
			t.Errorf("no candidate %s", key(w))
			continue
		}
		gb, _ := json.Marshal(g)
		wb, _ := json.Marshal(w)
		if string(gb) != string(wb) {
			t.Errorf("candidate %s:\n got  %s\n want %s", key(w), gb, wb)
		}
	}
}

// TestRouteMetricsByModelAndStage: routes count under their model (the
// first 32 names, later ones as other, none when unnamed), and each stage
// of a decision is timed; a booking's only when booked.
func TestRouteMetricsByModelAndStage(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	route := func(body string) {
		t.Helper()
		if a := send(t, n.http.URL, "POST", "/v1/route", body); a.code != 200 {
			t.Fatalf("route %s: %d %s", body, a.code, a.body)
		}
	}
	route(`{"token_ids":[1,2,3,4],"model":"llama"}`)
	route(`{"token_ids":[1,2,3,4],"model":"llama","book":true,"request_id":"q1"}`)
	route(`{"token_ids":[1,2,3,4]}`)
	for i := range 40 {
		route(fmt.Sprintf(`{"token_ids":[1,2,3,4],"model":"m%02d"}`, i))
	}
	count := func(model, outcome string) float64 {
		return counterValue(t, n.reg, "kvrouter_route_requests_total", map[string]string{"model": model, "outcome": outcome})
	}
	if got := count("llama", "routed"); got != 2 {
		t.Fatalf("llama routed %v, want 2", got)
	}
	if got := count("none", "routed"); got != 1 {
		t.Fatalf("unnamed routed %v, want 1", got)
	}
	// llama takes 1 of the 32 labels (none is outside the cap): m00..m30
	// get their own.
	if got := count("m30", "routed"); got != 1 {
		t.Fatalf("m30 routed %v, want 1", got)
	}
	if got := count("m31", "routed"); got != 0 {
		t.Fatalf("m31 has a label of its own (%v), past the cap", got)
	}
	if got := count("other", "routed"); got != 9 {
		t.Fatalf("other routed %v, want 9 (m31..m39)", got)
	}
	route(`{"token_ids":[1,2,3,4]}`)
	if got := count("none", "routed"); got != 2 {
		t.Fatalf("unnamed routed %v past the cap, want 2 under none", got)
	}
	if a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1],"model":"`+strings.Repeat("x", 1025)+`"}`); a.code != 400 {
		t.Fatalf("an overlong model: %d %s, want 400", a.code, a.body)
	}
	routes := uint64(44)
	for _, stage := range []string{"decode", "hash", "match", "load", "score", "backend"} {
		if got := histogramCount(t, n.reg, "kvrouter_route_duration_seconds", map[string]string{"stage": stage}); got != routes {
			t.Fatalf("stage %s timed %d times, want %d", stage, got, routes)
		}
	}
	if got := histogramCount(t, n.reg, "kvrouter_route_duration_seconds", map[string]string{"stage": "book"}); got != 1 {
		t.Fatalf("stage book timed %d times, want 1", got)
	}
}

// TestModelLabelCapIsSharedByServersOfOneRegistry: Servers that share a
// registry share kvrouter_route_requests_total's cap of 32 model labels,
// as they share the family. From a review: the cap was counted per
// Server, so that each Server (and each one made again in-process on the
// same registry) added 32 labels more.
func TestModelLabelCapIsSharedByServersOfOneRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	opts := api.Options{Logger: slog.New(slog.DiscardHandler), Registerer: reg, Gatherer: reg}
	for s := range 2 {
		fake := apitest.New("n1", "")
		srv := api.NewServer(fake, opts)
		hs := httptest.NewServer(srv)
		for _, id := range []uint64{1, 2} {
			if err := fake.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 4, Model: "m"}); err != nil {
				t.Fatal(err)
			}
		}
		for i := range 32 {
			if a := send(t, hs.URL, "POST", "/v1/route", fmt.Sprintf(`{"token_ids":[1,2,3,4],"model":"s%d-m%02d"}`, s, i)); a.code != 200 {
				t.Fatalf("route: %d %s", a.code, a.body)
			}
		}
		hs.Close()
		srv.Close()
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	models := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() != "kvrouter_route_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "model" && l.GetValue() != "none" && l.GetValue() != "other" {
					models[l.GetValue()] = true
				}
			}
		}
	}
	if len(models) != 32 {
		t.Errorf("kvrouter_route_requests_total has %d model labels on one registry, want 32", len(models))
	}
	if got := counterValue(t, reg, "kvrouter_route_requests_total", map[string]string{"model": "other", "outcome": "routed"}); got != 32 {
		t.Errorf("other routed %v, want 32 (the second Server's models, past the shared cap)", got)
	}
}

// TestRefusedRoutesTakeNoModelLabel: a route request refused as invalid
// gives its model no series of its own (it counts under the model's
// series when it has one, under other otherwise), so junk cannot use up
// the per-model labels valid requests get. From a review: the label was
// taken before the request was validated, and 32 refused requests with
// made-up model names left every real model under other.
func TestRefusedRoutesTakeNoModelLabel(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	count := func(model, outcome string) float64 {
		return counterValue(t, n.reg, "kvrouter_route_requests_total", map[string]string{"model": model, "outcome": outcome})
	}
	if a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"model":"llama"}`); a.code != 200 {
		t.Fatalf("route: %d %s", a.code, a.body)
	}
	for i := range 40 {
		// Neither token_ids, block_hashes nor isl: refused by validation.
		if a := send(t, n.http.URL, "POST", "/v1/route", fmt.Sprintf(`{"model":"junk%02d"}`, i)); a.code != 400 {
			t.Fatalf("an empty route: %d %s, want 400", a.code, a.body)
		}
	}
	if a := send(t, n.http.URL, "POST", "/v1/route", `{"model":"llama"}`); a.code != 400 {
		t.Fatalf("an empty route: %d %s, want 400", a.code, a.body)
	}
	if got := count("junk00", "error"); got != 0 {
		t.Fatalf("a refused request's model got a series of its own (%v errors)", got)
	}
	if got := count("other", "error"); got != 40 {
		t.Fatalf("other errors %v, want the 40 refused requests of unlabelled models", got)
	}
	if got := count("llama", "error"); got != 1 {
		t.Fatalf("llama errors %v, want 1: a labelled model counts its refused requests", got)
	}
	if a := send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"model":"mistral"}`); a.code != 200 {
		t.Fatalf("route: %d %s", a.code, a.body)
	}
	if got := count("mistral", "routed"); got != 1 {
		t.Fatalf("mistral routed %v under its own label, want 1: refused requests used up the labels", got)
	}
}

// TestStalledBodyIsCutAndSlowHandlersAreNot: a client that sends its
// headers and stalls its body is cut off after BodyTimeout; a booking that
// takes longer than BodyTimeout once the body is read still answers (the
// deadline bounds reads, not the request's context). From a review: a
// stalled body held its connection and handler for ever.
func TestStalledBodyIsCutAndSlowHandlersAreNot(t *testing.T) {
	n := newNode(t, "n1", api.Options{BodyTimeout: 100 * time.Millisecond})
	withWorkers(t, n)

	conn, err := net.Dial("tcp", n.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"token_ids\":[")
	if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn) // the server answers and closes, or just closes
	if err != nil {
		t.Fatalf("the stalled body's connection stays open: %v (read %q)", err, got)
	}

	slow := make(chan struct{})
	n.fake.SetHook(func(method string) error {
		if method == "Route" {
			<-slow
		}
		return nil
	})
	done := make(chan answer, 1)
	go func() {
		done <- send(t, n.http.URL, "POST", "/v1/route", `{"token_ids":[1,2,3,4],"book":true,"request_id":"slow"}`)
	}()
	time.Sleep(300 * time.Millisecond) // a handler slower than BodyTimeout: the point of the test
	close(slow)
	if a := <-done; a.code != 200 {
		t.Fatalf("a route slower than the body timeout: %d %s", a.code, a.body)
	}
}

// TestStalledBodyIsARequestTimeoutNotBadJSON: a body that stalls past
// BodyTimeout is a slow or stuck client or network, not malformed input:
// it is answered 408 request_timeout, which a client may send again (the
// agent takes any 4xx but 408 and 429 for a refusal for good), and the
// message names no address. From a review: it was 400 bad_json, with the
// connection's two addresses in the message.
func TestStalledBodyIsARequestTimeoutNotBadJSON(t *testing.T) {
	n := newNode(t, "n1", api.Options{BodyTimeout: 100 * time.Millisecond})
	withWorkers(t, n)
	for _, c := range []struct{ path, head string }{
		{"/v1/route", `{"token_ids":[`},          // the route's own read
		{"/v1/workers", `{"worker_id":7,`},       // decodeJSON's
		{"/v1/route", `{"token_ids":[1],"Isl":`}, // what the fast path leaves to decodeJSON, stalled
	} {
		code, reason, msg := sendRaw(t, n, c.path, c.head, false)
		if code != http.StatusRequestTimeout || reason != api.ReasonRequestTimeout || strings.Contains(msg, "127.0.0.1") {
			t.Errorf("%s with a body stalled past the body timeout: %d %s %q, want 408 request_timeout naming no address", c.path, code, reason, msg)
		}
	}
}

// TestBodyCutOffIsNotBadJSON: a body whose connection ends before its
// Content-Length is a request that broke off, not malformed input: 503
// canceled (nothing was proposed), naming no address.
func TestBodyCutOffIsNotBadJSON(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, c := range []struct{ path, head string }{
		{"/v1/route", `{"token_ids":[`},
		{"/v1/workers", `{"worker_id":7,`},
	} {
		code, reason, msg := sendRaw(t, n, c.path, c.head, true)
		if code != http.StatusServiceUnavailable || reason != api.ReasonCanceled || strings.Contains(msg, "127.0.0.1") {
			t.Errorf("%s with a body cut off: %d %s %q, want 503 canceled naming no address", c.path, code, reason, msg)
		}
	}
}

// TestMalformedChunkedBodyIsBadJSONNotCanceled: a chunked body whose
// framing is malformed is the client's fault, which sent again fails
// again: 400 bad_json, not 503 canceled ("send it again"), which a
// retrying client would loop on. From a review.
func TestMalformedChunkedBodyIsBadJSONNotCanceled(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, path := range []string{"/v1/route", "/v1/workers"} {
		req := "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
			"5\r\n{\"wor\r\nzz\r\n" // "zz" is no chunk size
		code, reason, msg := sendRawRequest(t, n, path, req, false)
		if code != http.StatusBadRequest || reason != api.ReasonBadJSON || !strings.Contains(msg, "framing") {
			t.Errorf("%s with a malformed chunk size: %d %s %q, want 400 bad_json naming the framing", path, code, reason, msg)
		}
	}
}

// sendRaw posts head as the first bytes of a 100-byte body to path on n,
// and then stalls, or closes its side of the connection when cut; it
// returns the answer's status, reason and message.
func sendRaw(t *testing.T, n *node, path, head string, cut bool) (int, string, string) {
	t.Helper()
	return sendRawRequest(t, n, path,
		fmt.Sprintf("POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n%s", path, head), cut)
}

// sendRawRequest writes req, an HTTP request as bytes, to n, and then
// stalls, or closes its side of the connection when cut; it returns the
// answer's status, reason and message.
func sendRawRequest(t *testing.T, n *node, path, req string, cut bool) (int, string, string) {
	t.Helper()
	code, b := rawhttp.Send(t, n.addr(), req, cut)
	var body api.ErrorResponse
	if err := json.Unmarshal(b, &body); err != nil {
		t.Fatalf("%s: %d, not an error body: %v", path, code, err)
	}
	return code, body.Reason, body.Error
}

// TestBodyDeadlineCutsOnlyBodies: a request without a body whose handler
// runs past BodyTimeout keeps its context, and so does the next request on
// the same connection. From a review: the deadline applied to net/http's
// read watching the connection, whose timeout cancelled the connection's
// context for good (every compat route takes an optional body).
func TestBodyDeadlineCutsOnlyBodies(t *testing.T) {
	n := newNode(t, "n1", api.Options{BodyTimeout: 100 * time.Millisecond})
	n.api.HandleFunc("GET /x/slow", func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(300 * time.Millisecond) // a handler slower than the body timeout: the point of the test
		fmt.Fprintf(w, "%v", r.Context().Err())
		return nil
	})
	n.api.HandleFunc("GET /x/quick", func(w http.ResponseWriter, r *http.Request) error {
		fmt.Fprintf(w, "%v", r.Context().Err())
		return nil
	})
	slow := send(t, n.http.URL, "GET", "/x/slow", "")
	next := send(t, n.http.URL, "GET", "/x/quick", "") // the same keep-alive connection
	if string(slow.body) != "<nil>" || string(next.body) != "<nil>" {
		t.Fatalf("contexts: the slow request's %s, the next one's %s", slow.body, next.body)
	}
}

// TestAnUnreadBodyIsBoundedByTheBodyTimeout: a request whose body no
// handler reads (a probe, a 401 before the token is looked at, a route
// that takes no body, a path that names none) and whose Content-Length's
// bytes never come is answered once BodyTimeout passes. From a review:
// net/http drains an unread body before it answers, and only a JSON
// route's read had a deadline, so such a request held its connection for
// as long as the client liked, without a token.
func TestAnUnreadBodyIsBoundedByTheBodyTimeout(t *testing.T) {
	n := newNode(t, "n1", api.Options{BodyTimeout: 100 * time.Millisecond, Token: "s3cret"})
	for _, c := range []struct {
		name, req string
		code      int
	}{
		{"GET /healthz", "GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", http.StatusOK},
		{"POST /v1/route without the token", "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n", http.StatusUnauthorized},
		{"POST /v1/requests/r1/prefill_done", "POST /v1/requests/r1/prefill_done HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nContent-Length: 10\r\n\r\n", 0},
		{"POST /v1/nowhere", "POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nTransfer-Encoding: chunked\r\n\r\n", http.StatusNotFound},
	} {
		code, b := rawhttp.Send(t, n.addr(), c.req, false) // fails after 10 s without an answer
		if c.code != 0 && code != c.code {
			t.Errorf("%s, its body never sent: %d %s, want %d", c.name, code, b, c.code)
		}
	}
}

// TestASnapshotUploadOutlastsTheBodyTimeout: a restore's upload has no
// body deadline (it may take long; its client bounds it): one that stalls
// past BodyTimeout and then goes on is installed.
func TestASnapshotUploadOutlastsTheBodyTimeout(t *testing.T) {
	n := newNode(t, "n1", api.Options{BodyTimeout: 100 * time.Millisecond})
	withWorkers(t, n)
	snap := send(t, n.http.URL, "GET", "/v1/snapshot", "")
	if snap.code != 200 {
		t.Fatalf("setup: GET /v1/snapshot: %d %s", snap.code, snap.body)
	}
	conn, err := net.Dial("tcp", n.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	half := len(snap.body) / 2
	fmt.Fprintf(conn, "POST /v1/snapshot/restore HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(snap.body), snap.body[:half])
	time.Sleep(300 * time.Millisecond) // an upload stalled past the body timeout: the point of the test
	if _, err := conn.Write(snap.body[half:]); err != nil {
		t.Fatal(err)
	}
	if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to the restore: %v", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || n.fake.Restores() != 1 {
		t.Fatalf("a restore whose upload stalled past the body timeout: %d %s, restores %d; want 200, 1", resp.StatusCode, b, n.fake.Restores())
	}
}

// TestRegistrationKeepsTheSalt: a worker registered with a salt lists it,
// and a salt too long for a name is refused (400).
func TestRegistrationKeepsTheSalt(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	if a := send(t, n.http.URL, "POST", "/v1/workers", `{"worker_id":8,"block_size":16,"salt":"tenant-a"}`); a.code != 204 {
		t.Fatalf("register with a salt: %d %s", a.code, a.body)
	}
	ws := send(t, n.http.URL, "GET", "/v1/workers", "").json(t)["workers"].([]any)
	if len(ws) != 1 || ws[0].(map[string]any)["salt"] != "tenant-a" {
		t.Fatalf("workers = %v, want worker 8 with its salt", ws)
	}
}

// TestBodyOverItsDecodeBudgetIs413 sends each endpoint whose arrays hold
// structs 1 MiB of the smallest such elements ("{}": a few bytes that
// decode to a hundred or more): refused 413 too_large before anything
// reaches the backend, where each decoded to hundreds of MB first.
func TestBodyOverItsDecodeBudgetIs413(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	fill := func(prefix, elem, suffix string) string {
		return prefix + strings.Repeat(elem+",", (1<<20)/(len(elem)+1)) + elem + suffix
	}
	for _, tc := range []struct{ path, body string }{
		{"/v1/events", fill(`{"batches":[{"worker_id":1,"events":[`, `{}`, `]}]}`)},
		{"/v1/events", fill(`{"batches":[`, `{}`, `]}`)},
		{"/v1/events", fill(`{"batches":[{"worker_id":1,"events":[{"event_id":1,"type":"stored","tier":"device","blocks":[`, `{}`, `]}]}]}`)},
		{"/v1/ranks/1/0/dump", fill(`{"cursor":1,"events":[`, `{}`, `]}`)},
		// 28 bytes a rank decoded, from 2: over the 16 MiB floor from 1.2 MiB on.
		{"/v1/workers", `{"worker_id":1,"block_size":16,"dp_ranks":[` + strings.Repeat("0,", 700_000) + `0]}`},
	} {
		body := tc.body
		before := n.fake.Calls()
		a := send(t, n.http.URL, "POST", tc.path, body)
		if a.code != http.StatusRequestEntityTooLarge || a.reason(t) != api.ReasonTooLarge || !strings.Contains(string(a.body), "budget") {
			t.Fatalf("POST %s with %d bytes (%.40s...): %d %.300s, want 413 too_large over the budget", tc.path, len(body), body, a.code, a.body)
		}
		if after := n.fake.Calls(); !maps.Equal(before, after) {
			t.Fatalf("a body over its budget reached the backend: %v -> %v", before, after)
		}
	}
}

// TestLargestClientRequestsAreWithinTheirBudget sends what the in-repo
// clients send at their largest: a kvagent request (8192 events, the
// publisher's cap, of the smallest kind, and of stored chains) and a
// route of a million tokens, all answered, none refused for its budget.
// The requests have minutes: under -race on a loaded machine one took
// more than send's 10 s, and the test is of the budget, not of speed.
func TestLargestClientRequestsAreWithinTheirBudget(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	const events = 8192
	for _, kind := range []kvevent.Kind{kvevent.KindCleared, kvevent.KindRemoved, kvevent.KindStored} {
		evs := make([]kvevent.Event, events)
		for i := range evs {
			e := kvevent.Event{Rank: kvevent.Rank{Worker: 1}, EventID: uint64(i + 1), Kind: kind, Tier: kvevent.TierDevice}
			switch kind {
			case kvevent.KindRemoved:
				e.Removed = []uint64{uint64(i) + 1<<63}
			case kvevent.KindStored:
				for j := range 16 {
					h := uint64(i*16+j) + 1<<63
					e.Blocks = append(e.Blocks, kvevent.Block{EngineHash: h, LocalHash: h})
				}
			}
			evs[i] = e
		}
		body, err := json.Marshal(api.EventsRequestFrom([]raftfsm.RankBatch{{Rank: kvevent.Rank{Worker: 1}, Events: evs}}))
		if err != nil {
			t.Fatal(err)
		}
		if a := sendWithin(t, 2*time.Minute, n.http.URL, "POST", "/v1/events", string(body)); a.code != http.StatusOK {
			t.Fatalf("%d %v events, %d bytes: %d %.300s", events, kind, len(body), a.code, a.body)
		}
	}
	tokens := make([]string, 1<<20)
	for i := range tokens {
		tokens[i] = fmt.Sprint(i % 50000)
	}
	body := `{"token_ids":[` + strings.Join(tokens, ",") + `]}`
	if a := sendWithin(t, 2*time.Minute, n.http.URL, "POST", "/v1/route", body); a.code == http.StatusRequestEntityTooLarge {
		t.Fatalf("a route of %d tokens, %d bytes: %d %.300s", len(tokens), len(body), a.code, a.body)
	}
}

// TestStatusAndReadyzShowTheNATSConnection: /v1/cluster/status and
// /readyz both carry the node's NATS connection as NATSConnected says it
// now (kvctl status reads it from the first), and a server given no
// NATSConnected leaves the field out of both.
func TestStatusAndReadyzShowTheNATSConnection(t *testing.T) {
	var up atomic.Bool
	n := newNode(t, "n1", api.Options{NATSConnected: up.Load})
	bare := newNode(t, "n2", api.Options{})
	natsOf := func(n *node, path string) (string, bool) {
		t.Helper()
		resp, err := http.Get(n.http.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		v, ok := m["nats"]
		s, _ := v.(string)
		return s, ok
	}
	for _, path := range []string{"/v1/cluster/status", "/readyz"} {
		for _, want := range []string{"disconnected", "connected", "disconnected"} {
			up.Store(want == "connected")
			if got, _ := natsOf(n, path); got != want {
				t.Fatalf("%s: nats = %q, want %q", path, got, want)
			}
		}
		if got, ok := natsOf(bare, path); ok {
			t.Fatalf("%s without NATSConnected: nats = %q, want no field", path, got)
		}
	}
}

// TestGetSettingsAnswersThePutShape: GET /v1/settings answers the
// settings the node's state holds, every field given, in the shape of PUT
// /v1/settings' body (so that what it answers can be put back), on a
// follower from its own state, not forwarded.
func TestGetSettingsAnswersThePutShape(t *testing.T) {
	leader, follower := pair(t, api.Options{})
	a := send(t, leader.http.URL, "GET", "/v1/settings", "")
	if a.code != 200 || !strings.Contains(string(a.body), `"overlap_score_credit":1`) || !strings.Contains(string(a.body), `"busy_prefill_tokens":0`) ||
		!strings.Contains(string(a.body), `"view":"dedup"`) {
		t.Fatalf("GET /v1/settings of the defaults: %d %s", a.code, a.body)
	}
	put := `{"params":{"overlap_score_credit":2,"host_cache_hit_weight":0.5,"disk_cache_hit_weight":0.125,"prefill_load_scale":3,` +
		`"decode_active_request_weight":4,"temperature":0.25,"busy_decode_fraction":0.875,"busy_prefill_tokens":500},"view":"tiered"}`
	if a := send(t, leader.http.URL, "PUT", "/v1/settings", put); a.code != 204 {
		t.Fatalf("PUT /v1/settings: %d %s", a.code, a.body)
	}
	if a := send(t, leader.http.URL, "GET", "/v1/settings", ""); a.code != 200 || strings.TrimSpace(string(a.body)) != put {
		t.Fatalf("GET /v1/settings after the PUT of\n%s\n%d %s", put, a.code, a.body)
	}
	if a := send(t, leader.http.URL, "PUT", "/v1/settings", put); a.code != 204 {
		t.Fatalf("the answer put back: %d %s", a.code, a.body)
	}
	a = send(t, follower.http.URL, "GET", "/v1/settings", "")
	if a.code != 200 || a.header.Get(api.HeaderForwardedTo) != "" || !strings.Contains(string(a.body), `"view":"dedup"`) {
		t.Fatalf("GET /v1/settings on the follower: %d %s (forwarded to %q), want its own state's", a.code, a.body, a.header.Get(api.HeaderForwardedTo))
	}
}

// olderBuildSettings is a backend whose state holds settings an older
// build stored: a weight over indexer.MaxWeight, which the FSM and a
// restore still take (raftfsm's command.refused, docs/operations.md).
type olderBuildSettings struct {
	*apitest.Fake
	held raftfsm.Settings
}

func (b *olderBuildSettings) Settings() raftfsm.Settings { return b.held }

// TestGetSettingsAnswerPutBackSetsTheSameSettings pins docs/api.md's
// GET /v1/settings: "the answer put back sets the same settings", also
// on a cluster whose state holds a weight over indexer.MaxWeight that an
// older build stored (and this build keeps): the answer, put back as
// kvctl settings set does, is taken, not refused 400 invalid.
func TestGetSettingsAnswerPutBackSetsTheSameSettings(t *testing.T) {
	p := indexer.DefaultParams()
	p.PrefillLoadScale = 1e15 // over MaxWeight: an older build stored it
	b := &olderBuildSettings{Fake: apitest.New("n1", ""), held: raftfsm.Settings{Params: p, View: indexer.ViewDedup}}
	s := api.NewServer(b, api.Options{Logger: slog.New(slog.DiscardHandler)})
	hs := httptest.NewServer(s)
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	a := send(t, hs.URL, "GET", "/v1/settings", "")
	if a.code != 200 {
		t.Fatalf("GET /v1/settings: %d %s", a.code, a.body)
	}
	if put := send(t, hs.URL, "PUT", "/v1/settings", string(a.body)); put.code != 204 {
		t.Fatalf("the GET /v1/settings answer %s put back: %d %s, want 204 (the same settings)", strings.TrimSpace(string(a.body)), put.code, strings.TrimSpace(string(put.body)))
	}
	// A new value over MaxWeight is refused as before, also one that is
	// another field's held value.
	for _, body := range []string{`{"params":{"prefill_load_scale":2e15}}`, `{"params":{"prefill_load_scale":1e15,"host_cache_hit_weight":1e15}}`} {
		put := send(t, hs.URL, "PUT", "/v1/settings", body)
		if put.code != 400 || !strings.Contains(string(put.body), "(want 0 to 1e+12)") {
			t.Errorf("PUT /v1/settings %s: %d %s, want 400 (want 0 to 1e+12)", body, put.code, strings.TrimSpace(string(put.body)))
		}
	}
}

// TestAConnectWithNoRouteNamesItsTarget: a CONNECT's target is an
// authority (host:443), its path empty; the no-route error names the
// authority. From a review: it read "no route CONNECT ; see docs/api.md".
func TestAConnectWithNoRouteNamesItsTarget(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	code, b := rawhttp.Send(t, n.addr(), "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n", false)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil || code < 400 {
		t.Fatalf("CONNECT example.com:443: %d %s (%v), want a JSON error", code, b, err)
	}
	if msg := fmt.Sprint(m["error"]); !strings.Contains(msg, "CONNECT example.com:443") {
		t.Errorf("CONNECT example.com:443: error %q names no target", msg)
	}
}

// TestNoRouteNamesThePathTheClientSent: a handler in front of the Server
// that rewrites the path (compat.SelectionHandler adds /selection)
// records the client's path with api.WithSentPath, and the Server's 404
// and 405 name that path, to the client and to a HandleErrors writer
// alike, not the one it routed. Without it they name the routed path.
// From a review: compat put the client's path back by rewriting the
// message's text.
func TestNoRouteNamesThePathTheClientSent(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	var written string
	n.api.HandleErrors("/front", func(w http.ResponseWriter, _ *http.Request, code int, msg string) bool {
		written = msg
		return false
	})
	for _, c := range []struct {
		method, routed, sent string
		code                 int
		want                 string
	}{
		{"GET", "/front/nowhere", "/nowhere", 404, "no route GET /nowhere; "},
		{"GET", "/front/nowhere", "", 404, "no route GET /front/nowhere; "},
		{"DELETE", "/v1/route", "/route", 405, "DELETE is not allowed on /route (allowed: "},
		{"DELETE", "/v1/route", "", 405, "DELETE is not allowed on /v1/route (allowed: "},
	} {
		written = ""
		r := httptest.NewRequest(c.method, c.routed, nil)
		if c.sent != "" {
			r = r.WithContext(api.WithSentPath(r.Context(), c.sent))
		}
		rec := httptest.NewRecorder()
		n.api.ServeHTTP(rec, r)
		var e api.ErrorResponse
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || rec.Code != c.code || !strings.HasPrefix(e.Error, c.want) {
			t.Errorf("%s %s sent as %q: %d %s, want %d %q...", c.method, c.routed, c.sent, rec.Code, rec.Body, c.code, c.want)
		}
		if strings.HasPrefix(c.routed, "/front/") && !strings.HasPrefix(written, c.want) {
			t.Errorf("%s %s sent as %q: the HandleErrors writer got %q, want %q...", c.method, c.routed, c.sent, written, c.want)
		}
	}
}
