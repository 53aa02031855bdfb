package api

import (
	"reflect"
	"testing"
)

// jsonRouteRequest decodes b as decodeJSON does: encoding/json, and
// every key a field's name exactly, once.
func jsonRouteRequest(b []byte) (RouteRequest, error) {
	var req RouteRequest
	err := decodeJSONBytes(b, &req, false)
	return req, err
}

var routeBodies = []string{
	`{"block_hashes":[1,2,18446744073709551615],"isl":12,"brief":true}`,
	`{"token_ids":[1,2,3,4294967295],"lora_name":"a","cache_salt":"s","book":true,"request_id":"r-1"}`,
	` { "block_hashes" : [ ] , "token_ids" : null , "isl" : 0 } `,
	`{}`,
	`{"block_hashes":[01]}`,
	`{"block_hashes":[1.5]}`,
	`{"block_hashes":[18446744073709551616]}`,
	`{"token_ids":[4294967296]}`,
	`{"isl":-1}`,
	`{"isl":1e3}`,
	`{"request_id":"a\"b"}`,
	`{"Block_Hashes":[1]}`,
	`{"block_hashes":[1],"block_hashes":[2]}`,
	`{"isl":5,"book":true,"BOOK":false}`,
	"{\"isl\":5,\"boo\u212a\":true}",
	`{"isl":5,"b\u006fok":true}`,
	`{"overrides":{"temperature":0}}`,
	`{"brief":null}`,
	`{"unknown":1}`,
	`{"isl":1}{}`,
	`{"isl":1} x`,
	`[1]`,
	``,
}

// TestRouteFastPathAgreesWithEncodingJSON: on every body it accepts, the
// fast path gives what encoding/json gives; the others it leaves to it.
func TestRouteFastPathAgreesWithEncodingJSON(t *testing.T) {
	fast := 0
	for _, body := range routeBodies {
		var got RouteRequest
		if !fastRouteRequest([]byte(body), &got) {
			continue
		}
		fast++
		want, err := jsonRouteRequest([]byte(body))
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s: fast path %+v, encoding/json %+v (%v)", body, got, want, err)
		}
	}
	if fast < 4 {
		t.Fatalf("the fast path took only %d of the bodies", fast)
	}
}

func FuzzRouteRequestFastPath(f *testing.F) {
	for _, b := range routeBodies {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var got RouteRequest
		if !fastRouteRequest(b, &got) {
			return
		}
		want, err := jsonRouteRequest(b)
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: fast path %+v, encoding/json %+v (%v)", b, got, want, err)
		}
	})
}

// BenchmarkDecodeRouteBody decodes route bodies of plain keys, the shape
// every client sends: below routePresizeFrom, and above it, where the
// arrays are sized before they are filled.
func BenchmarkDecodeRouteBody(b *testing.B) {
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"tokens 8k", repeatTo(`{"token_ids":[`, same(`12345`), `],"brief":true}`, 48<<10)},
		{"tokens 1MiB", repeatTo(`{"token_ids":[`, same(`12345`), `],"brief":true}`, 1<<20)},
		{"hashes 1MiB", repeatTo(`{"block_hashes":[`, same(`12345678901234567890`), `],"brief":true}`, 1<<20)},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(tc.body)))
			b.ReportAllocs()
			for b.Loop() {
				var req RouteRequest
				if err := decodeRouteBody(tc.body, &req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestRouteFastPathAllocatesNothingPerKey pins the hot-path rule of the
// developers' guide ("no per-event allocation you can avoid") on the
// route body's fast path: with a request whose arrays are already sized
// (the handler's pooled one), parsing a body of plain keys allocates
// nothing. jsonscan.Scanner.Object handed each key to its callback as
// string(key), a conversion that escapes into the func value and so
// allocated once per key of every /v1/route body.
func TestRouteFastPathAllocatesNothingPerKey(t *testing.T) {
	for _, body := range []string{
		`{"block_hashes":[1,2,3]}`,
		`{"block_hashes":[1,2,3],"isl":64,"brief":true}`,
		`{"token_ids":[1,2,3],"book":false,"brief":true}`,
	} {
		b := []byte(body)
		var req RouteRequest
		if !fastRouteRequest(b, &req) { // sizes req's arrays
			t.Fatalf("%s: not taken by the fast path", body)
		}
		n := testing.AllocsPerRun(100, func() {
			if !fastRouteRequest(b, &req) {
				t.Fatalf("%s: not taken by the fast path", body)
			}
		})
		if n != 0 {
			t.Errorf("%s: the fast path allocated %.0f times per body, want 0", body, n)
		}
	}
}
