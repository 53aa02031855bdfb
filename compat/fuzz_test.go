package compat

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/vmihailenco/msgpack/v5"
)

// FuzzRequestBodies feeds arbitrary bytes, in both encodings, to the
// decoders of every request body and to the event conversion: nothing
// panics, and an event that converts is valid.
func FuzzRequestBodies(f *testing.F) {
	f.Add([]byte(`{"instance_id":1,"events":[{"event_id":1,"type":"stored","parent_hash":-5,"blocks":[{"block_hash":1,"tokens_hash":18446744073709551615}]}]}`), false)
	f.Add([]byte(`{"block_hashes":[1,-2,3],"model_name":"m"}`), false)
	f.Add([]byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x91, 0x82, 0xa8, 'e', 'v', 'e', 'n', 't', '_', 'i', 'd', 0x01, 0xa4, 't', 'y', 'p', 'e', 0xa7, 'c', 'l', 'e', 'a', 'r', 'e', 'd'}, true)
	// Lengths past the body, and nesting past maxMsgpackDepth: the node
	// died of them (out of memory, a stack overflow) before checkMsgpack.
	f.Add([]byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0xdd, 0xff, 0xff, 0xff, 0xff}, true)
	f.Add([]byte{0x81, 0xa9, 't', 'o', 'k', 'e', 'n', '_', 'i', 'd', 's', 0xdc, 0xff, 0xff, 0x01}, true)
	f.Add([]byte{0x81, 0xaa, 'm', 'o', 'd', 'e', 'l', '_', 'n', 'a', 'm', 'e', 0xdb, 0xff, 0xff, 0xff, 0xff, 'm'}, true)
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'x', 0x00}, true)
	f.Add(nested(maxMsgpackDepth+10), true)
	// Arrays where a request and an event belong: the library read them
	// field by field (checkMsgpackShape refuses them).
	f.Add([]byte{0x9a, 0x05, 0xa3, 't', 'c', 'p', 0xa5, 'l', 'l', 'a', 'm', 'a', 0xa0, 0xa0, 0x04, 0xc0, 0xa0, 0xa0, 0xc2}, true)
	f.Add([]byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x91, 0x98, 0xc0, 0x00, 0x01, 0xa7, 'c', 'l', 'e', 'a', 'r', 'e', 'd', 0xc0, 0xc0, 0xc0, 0xc0}, true)
	f.Fuzz(func(t *testing.T, body []byte, mp bool) {
		c := codecJSON
		if mp {
			c = codecMsgpack
		}
		req := func() *http.Request {
			r, _ := http.NewRequest("POST", "/", bytes.NewReader(body))
			return r
		}
		var ev EventsRequest
		if decode(req(), c, &ev) == nil {
			for i := range ev.Events {
				if e, err := ev.Events[i].toEvent(kvevent.Rank{Worker: 1}); err == nil {
					if err := e.Validate(); err != nil {
						t.Fatalf("converted event %+v is invalid: %v", e, err)
					}
				}
			}
		}
		var q QueryByHashRequest
		_ = decode(req(), c, &q)
		var qt QueryRequest
		_ = decode(req(), c, &qt)
		var reg RegisterRequest
		if decode(req(), c, &reg) == nil {
			_ = checkEndpoint("endpoint", reg.Endpoint)
		}
	})
}

// FuzzQueryByHashScan: on every body the one-pass reader accepts, it gives
// what encoding/json gives.
func FuzzQueryByHashScan(f *testing.F) {
	f.Add([]byte(`{"block_hashes":[1,-2,18446744073709551615,-9223372036854775808],"model_name":"m","tenant_id":"t"}`))
	f.Add([]byte(` { "block_hashes" : [ ] , "model_name" : "" } `))
	f.Add([]byte(`{"block_hashes":null}`))
	f.Add([]byte(`{"block_hashes":[-0,01]}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var got QueryByHashRequest
		if !got.scanJSON(b) {
			return
		}
		var want QueryByHashRequest
		if err := json.Unmarshal(b, &want); err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: scanned %+v, encoding/json %+v (%v)", b, got, want, err)
		}
	})
}

// FuzzCheckMsgpackAgreesWithTheLibrary: checkMsgpack passes a body when
// the msgpack library reads one value from it and nothing is left, and
// only then, up to its bound on nesting.
func FuzzCheckMsgpackAgreesWithTheLibrary(f *testing.F) {
	f.Add([]byte{0x82, 0xa1, 'a', 0x93, 0x01, 0xcd, 0x01, 0x02, 0xc0, 0xa1, 'b', 0xd4, 0x01, 0x02})
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x92, 0xc7, 0x02, 0x05, 'a', 'b', 0xc9, 0x00, 0x00, 0x00, 0x00, 0x01})
	f.Add([]byte{0xc1})
	f.Add([]byte{0x81, 0xa1, 'k', 0x01, 0x81, 0xa1, 'k', 0x02})
	f.Add(nested(maxMsgpackDepth + 1))
	f.Fuzz(func(t *testing.T, b []byte) {
		err := checkMsgpack(b)
		r := bytes.NewReader(b)
		skip := msgpack.NewDecoder(r).Skip()
		if skip == nil && r.Len() > 0 {
			skip = fmt.Errorf("%d bytes after the value", r.Len())
		}
		if err == nil && skip != nil {
			t.Fatalf("%x: checkMsgpack passed what the library refuses: %v", b, skip)
		}
		if err != nil && skip == nil && len(b) <= maxMsgpackDepth {
			t.Fatalf("%x: checkMsgpack refused what the library reads: %v", b, err)
		}
	})
}

// FuzzJSONWalk: checkJSONShape's walk, which checks no body whole before
// it walks it, never panics, and reads every valid JSON body to its end
// (or to a refusal for its size): a walk that stopped early on valid JSON
// would miss the arrays and keys after that point.
func FuzzJSONWalk(f *testing.F) {
	f.Add([]byte(`{"instance_id":1,"events":[{"event_id":1,"type":"stored","parent_hash":-5,"blocks":[{"block_hash":1,"tokens_hash":18446744073709551615}]}]}`))
	f.Add([]byte(` {"model_n\u0061me" : "a\"b\\" , "Model_Name":"x", "x":[1.5e+3,-0,true,false,null,{},[],"\u00e9"]} `))
	f.Add([]byte(`{"events":[null,null,{}],"kv_events_endpoints":{"0":"a"}}`))
	f.Add([]byte(`{"events":[`))
	f.Add([]byte(`{"a":}`))
	f.Add([]byte(`[,]`))
	f.Add([]byte(`"abc\`))
	f.Add([]byte(strings.Repeat("[", maxJSONDepth+5)))
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, typ := range []reflect.Type{reflect.TypeFor[*EventsRequest](), reflect.TypeFor[*CatalogWorker](), reflect.TypeFor[*QueryRequest]()} {
			w := jsonWalk{b: body, budget: decodeBudget(len(body))}
			err := w.value(typ, 0)
			if !json.Valid(body) || strings.Contains(fmt.Sprint(err), "decode into more than") {
				continue
			}
			if err != nil || w.ws() != 0 {
				t.Fatalf("%v: a valid body's walk: %v, stopped at byte %d of %d", typ, err, w.pos, len(body))
			}
		}
	})
}

// TestQueryByHashScanAllocatesOnlyItsValues pins the hot-path rule of
// the developers' guide ("no per-event allocation you can avoid") on
// /query_by_hash's one-pass reader: a body allocates its hashes (decoded
// straight into []Hash) and its strings, nothing per key. It allocated
// each key as a string, and the hashes twice, as []uint64 and then as a
// copy into []Hash.
func TestQueryByHashScanAllocatesOnlyItsValues(t *testing.T) {
	b := []byte(`{"block_hashes":[1,-2,3,4],"model_name":"model","tenant_id":"tenant"}`)
	var q QueryByHashRequest
	n := testing.AllocsPerRun(100, func() {
		if !q.scanJSON(b) {
			t.Fatal("not taken by the one-pass reader")
		}
	})
	// The hashes' slice, sized once for its 4 hashes, and the two
	// strings.
	if n != 3 {
		t.Errorf("scanJSON allocated %.0f times per body, want 3", n)
	}
}
