package compat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// parseRef is Hash.UnmarshalJSON's reference: ParseInt, then ParseUint,
// on what JSON allows (no leading '+').
func parseRef(s string) (Hash, bool) {
	if len(s) > 0 && s[0] == '+' {
		return 0, false
	}
	if v, err := strconv.ParseInt(s, 10, 64); err == nil {
		return Hash(v), true
	}
	if v, err := strconv.ParseUint(s, 10, 64); err == nil {
		return Hash(v), true
	}
	return 0, false
}

func TestHashJSON(t *testing.T) {
	for _, s := range []string{"0", "1", "-1", "9223372036854775807", "-9223372036854775808", "9223372036854775808",
		"18446744073709551615", "18446744073709551616", "-9223372036854775809", "99999999999999999999",
		"", "-", "1.5", "1e3", "+1", "0x10", "null", "\"1\"", "007"} {
		var h Hash
		err := h.UnmarshalJSON([]byte(s))
		want, ok := parseRef(s)
		if ok != (err == nil) || (ok && h != want) {
			t.Errorf("%q: got %d, %v; want %d, ok %v", s, h, err, want, ok)
		}
		if ok {
			b, _ := h.MarshalJSON()
			var back Hash
			if err := back.UnmarshalJSON(b); err != nil || back != h {
				t.Errorf("%q: round trip through %s gave %d, %v", s, b, back, err)
			}
		}
	}
}

func FuzzHashJSON(f *testing.F) {
	f.Add("18446744073709551615")
	f.Add("-9223372036854775808")
	f.Fuzz(func(t *testing.T, s string) {
		var h Hash
		err := h.UnmarshalJSON([]byte(s))
		want, ok := parseRef(s)
		if ok != (err == nil) || (ok && h != want) {
			t.Fatalf("%q: got %d, %v; want %d, ok %v", s, h, err, want, ok)
		}
	})
}

// nested returns a MessagePack map {"model_name": "m", "x": v} where v is
// depth arrays of one element each, around a 0.
func nested(depth int) []byte {
	b := append([]byte{0x82, 0xaa}, "model_name"...)
	b = append(b, 0xa1, 'm', 0xa1, 'x')
	b = append(b, bytes.Repeat([]byte{0x91}, depth)...)
	return append(b, 0x00)
}

// TestCheckMsgpackRefusesWhatTheLibraryCannotSurvive: a MessagePack body
// whose declared lengths exceed what it holds, or that nests arrays and
// maps deeper than encoding/json allows, is refused before the msgpack
// library sees it; bodies of every kind of value that are whole pass.
func TestCheckMsgpackRefusesWhatTheLibraryCannotSurvive(t *testing.T) {
	ok := map[string][]byte{
		"fixed values":   {0x96, 0x00, 0x7f, 0xe0, 0xc0, 0xc2, 0xc3},
		"numbers":        {0x96, 0xcc, 1, 0xd1, 1, 2, 0xce, 1, 2, 3, 4, 0xd3, 1, 2, 3, 4, 5, 6, 7, 8, 0xca, 1, 2, 3, 4, 0xcb, 1, 2, 3, 4, 5, 6, 7, 8},
		"strings":        {0x94, 0xa2, 'a', 'b', 0xd9, 1, 'a', 0xda, 0, 1, 'a', 0xdb, 0, 0, 0, 1, 'a'},
		"binaries":       {0x93, 0xc4, 1, 'a', 0xc5, 0, 1, 'a', 0xc6, 0, 0, 0, 1, 'a'},
		"extensions":     {0x93, 0xd4, 1, 'a', 0xd8, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0xc7, 1, 5, 'a'},
		"empty ones":     {0x84, 0x90, 0x80, 0xdc, 0, 0, 0xdf, 0, 0, 0, 0, 0xa0, 0xc4, 0, 0xdd, 0, 0, 0, 0, 0xc0},
		"long arrays":    {0x92, 0xdc, 0, 2, 1, 2, 0xde, 0, 1, 0xa1, 'k', 0x01},
		"nested at most": nested(maxMsgpackDepth - 1), // the outer map is a level
	}
	for name, b := range ok {
		if err := checkMsgpack(b); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	huge := []byte{0xff, 0xff, 0xff, 0xff}
	bad := map[string][]byte{
		"array32 of 2^32-1 events":   append([]byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0xdd}, huge...),
		"array16 past the body":      {0xdc, 0, 3, 1, 2},
		"fixarray past the body":     {0x93, 1, 2},
		"map32 of 2^32-1 entries":    append([]byte{0xdf}, huge...),
		"map of 2 entries, 3 values": {0x82, 1, 2, 3},
		"str32 of 4 GiB":             append(append([]byte{0xdb}, huge...), 'a'),
		"bin32 of 4 GiB":             append([]byte{0xc6}, huge...),
		"ext32 of 4 GiB":             append([]byte{0xc9}, append(huge, 1)...),
		"fixext16 cut short":         {0xd8, 1, 2},
		"uint64 cut short":           {0xcf, 1, 2},
		"a length cut short":         {0xdd, 0, 0},
		"0xc1":                       {0x91, 0xc1},
		"nested too deep":            nested(maxMsgpackDepth),
		"8 MiB of nested arrays":     nested(8 << 20),
		"empty":                      {},
		"two values":                 {0x01, 0x02},
		"a map and a byte":           {0x81, 0xa1, 'k', 0x01, 0xc0},
	}
	for name, b := range bad {
		if err := checkMsgpack(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// TestMsgpackNestedToTheLimitDecodes: a body nested as deep as
// checkMsgpack allows decodes without exhausting the library's stack.
func TestMsgpackNestedToTheLimitDecodes(t *testing.T) {
	var q QueryRequest
	if err := decodeBytes(nested(maxMsgpackDepth-1), codecMsgpack, &q); err != nil || q.ModelName != "m" {
		t.Fatalf("decoded %+v, %v", q, err)
	}
}

// TestMsgpackBodyCannotKillTheNode: from a review. A 13-byte body whose
// "events" array declared 2^32-1 elements ran the node out of memory (the
// msgpack library allocated them all before reading one), and a body of 8
// MiB of nested arrays overflowed its stack: fatal errors, not panics, so
// one request killed the node, follower or leader. Both are a 400 now.
// The node runs in a child process, so that a crash shows as a failure.
func TestMsgpackBodyCannotKillTheNode(t *testing.T) {
	const childEnv = "COMPAT_TEST_MSGPACK_CHILD"
	if os.Getenv(childEnv) == "1" {
		n := startNode(t)
		for _, c := range []struct {
			path string
			body []byte
		}{
			{"/events", []byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0xdd, 0xff, 0xff, 0xff, 0xff}},
			{"/query", []byte{0x81, 0xa9, 't', 'o', 'k', 'e', 'n', '_', 'i', 'd', 's', 0xdd, 0xff, 0xff, 0xff, 0xff}},
			{"/query", nested(12 << 20)},
		} {
			r := n.do(t, codecMsgpack, "POST", c.path, c.body)
			fmt.Printf("ANSWER %s %d %s\n", c.path, r.code, bytes.TrimSpace(r.body))
		}
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestMsgpackBodyCannotKillTheNode$", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.CombinedOutput()
	head := string(out)
	for _, cut := range []string{"\nruntime stack:", "\ngoroutine "} {
		if i := strings.Index(head, cut); i > 0 {
			head = head[:i]
		}
	}
	head = head[:min(len(head), 2000)]
	if err != nil {
		t.Fatalf("the node died (%v):\n%s", err, head)
	}
	if got := strings.Count(head, "ANSWER "); got != 3 {
		t.Fatalf("%d answers of 3:\n%s", got, head)
	}
	if strings.Count(head, " 400 ") != 3 {
		t.Fatalf("want three 400s:\n%s", head)
	}
	t.Logf("%s", head)
}

// TestMsgpackArrayIsNoRequestObject: a body is a request object in either
// encoding. The msgpack library reads an array of as many values as a
// struct has fields into them in declaration order, so that a MessagePack [5, "tcp://…", "llama", …] to
// /register registered instance 5, where JSON's array is a 400; an
// event given as an array was applied. Both are a 400, and write nothing.
func TestMsgpackArrayIsNoRequestObject(t *testing.T) {
	n := startNode(t)
	reg := []any{5, "tcp://10.0.0.1:5557", "llama", "", "", 4, nil, "", "", false}
	jb, err := json.Marshal(reg)
	if err != nil {
		t.Fatal(err)
	}
	mustCode(t, n.do(t, codecJSON, "POST", "/register", jb), 400, "a JSON array")
	mp := func(v any) []byte {
		var buf bytes.Buffer
		if err := msgpack.NewEncoder(&buf).Encode(v); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	if r := n.do(t, codecMsgpack, "POST", "/register", mp(reg)); r.code != 400 {
		t.Errorf("a MessagePack array as /register's body: %d %s, want 400 as JSON's; worker table %v", r.code, r.body, n.node.WorkerTable())
	}
	registerRanks(t, n, 0)
	// An Event has 8 fields: instance_id, dp_rank, event_id, type, medium,
	// parent_hash, blocks, block_hashes.
	ev := []any{nil, 0, 1, "stored", "GPU", nil, []any{map[string]any{"block_hash": 1, "tokens_hash": 2}}, nil}
	body := mp(map[string]any{"instance_id": 1, "model_name": "llama", "events": []any{ev}})
	if r := n.do(t, codecMsgpack, "POST", "/events", body); r.code != 400 {
		t.Errorf("an event given as a MessagePack array: %d %s, want 400", r.code, r.body)
	}
	// The same event as a map is applied: only the array was wrong.
	evm := map[string]any{"dp_rank": 0, "event_id": 1, "type": "stored", "blocks": []any{map[string]any{"block_hash": 1, "tokens_hash": 2}}}
	body = mp(map[string]any{"instance_id": 1, "model_name": "llama", "events": []any{evm}})
	mustCode(t, n.do(t, codecMsgpack, "POST", "/events", body), 200, "the event as a map")
}

// TestMsgpackShapeCheckAllocations: checkMsgpackShape allocates a few
// times per body, not once per map key. From a review: it read each key
// into a string, 2008 of the 3522 allocations of a MessagePack /events
// body of 1000 blocks.
func TestMsgpackShapeCheckAllocations(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop its items (the decoder's); make test runs Alloc tests without -race")
	}
	req := EventsRequest{InstanceID: 1, ModelName: "m"}
	ev := Event{EventID: 1, Type: "stored"}
	for i := range 1000 {
		ev.Blocks = append(ev.Blocks, Block{BlockHash: Hash(i + 1), TokensHash: Hash(i + 7)})
	}
	req.Events = []Event{ev}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.SetCustomStructTag("json")
	if err := e.Encode(&req); err != nil {
		t.Fatal(err)
	}
	b := buf.Bytes()
	whole := testing.AllocsPerRun(20, func() {
		var r EventsRequest
		if err := decodeBytes(b, codecMsgpack, &r); err != nil {
			t.Fatal(err)
		}
	})
	shape := testing.AllocsPerRun(20, func() {
		if err := checkMsgpackShape(b, reflect.TypeOf(&EventsRequest{})); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("decodeBytes: %.0f allocs; of which checkMsgpackShape: %.0f", whole, shape)
	if shape > 4 {
		t.Errorf("checkMsgpackShape allocates %.0f times for one 1000-block body (decodeBytes in all %.0f), want at most 4: not one per map key", shape, whole)
	}
}

// TestDecodeAllocationIsBoundedByTheBody: from a review. A body's
// arrays decode into at most decodeBudget of memory, in either encoding:
// an events array of n nils is n bytes of MessagePack and n Events (over
// 100 bytes each) decoded, 224 times the body (7.5 GB for a 32 MiB body);
// n JSON nulls 130 times. Both are a 400 now, refused before the decode
// allocates; arrays of real values as short as their encoding allows (a
// hash of one byte) still decode.
func TestDecodeAllocationIsBoundedByTheBody(t *testing.T) {
	n := 1 << 20
	nils := append([]byte{0x81, 0xa6}, "events"...)
	nils = append(nils, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	nils = append(nils, bytes.Repeat([]byte{0xc0}, n)...)
	jsonNulls := []byte(`{"events":[null` + strings.Repeat(",null", n/4-1) + `]}`)
	for _, c := range []struct {
		name string
		c    codec
		body []byte
	}{{"MessagePack nils", codecMsgpack, nils}, {"JSON nulls", codecJSON, jsonNulls}} {
		if c.c == codecMsgpack {
			if err := checkMsgpack(c.body); err != nil {
				t.Fatalf("%s: %v (the body is well formed)", c.name, err)
			}
		}
		var ms0, ms1 runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms0)
		var req EventsRequest
		err := decodeBytes(c.body, c.c, &req)
		runtime.ReadMemStats(&ms1)
		alloc := ms1.TotalAlloc - ms0.TotalAlloc
		t.Logf("%s: %v; body %d bytes, allocated %d bytes (%.1fx)", c.name, err, len(c.body), alloc, float64(alloc)/float64(len(c.body)))
		if !errors.Is(err, errBody) {
			t.Errorf("%s: %d events decoded (%v), want a bad request body", c.name, len(req.Events), err)
		}
		if alloc > decodeBytesPerByte*uint64(len(c.body)) {
			t.Errorf("%s: a %d-byte body allocated %d bytes (%.0fx)", c.name, len(c.body), alloc, float64(alloc)/float64(len(c.body)))
		}
	}
	// Hashes of one byte each: 8 bytes of memory per byte of the body.
	hashes := append([]byte{0x82, 0xaa}, "model_name"...)
	hashes = append(hashes, 0xa1, 'm', 0xac)
	hashes = append(hashes, "block_hashes"...)
	hashes = append(hashes, 0xdd, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
	hashes = append(hashes, bytes.Repeat([]byte{0x01}, n)...)
	var q QueryByHashRequest
	if err := decodeBytes(hashes, codecMsgpack, &q); err != nil || len(q.BlockHashes) != n {
		t.Errorf("%d one-byte hashes in MessagePack: %d decoded, %v", n, len(q.BlockHashes), err)
	}
	js := []byte(`{"model_name":"m","block_hashes":[1` + strings.Repeat(",1", n-1) + `]}`)
	q = QueryByHashRequest{}
	if _, err := checkJSONShape(js, reflect.TypeOf(&q)); err != nil {
		t.Errorf("%d one-digit hashes in JSON: %v", n, err)
	}
}

// The /query_by_hash JSON fast path (QueryByHashRequest.scanJSON) is held
// to the same rule as every other decode (docs/compat.md: a body whose
// arrays "would decode into more than 16 bytes of memory per byte of the
// body (past a 64 KiB floor)" is refused): a body of n one-digit hashes
// decodes into 8 bytes per 2 body bytes, and must not allocate more than
// the budget on the way (the slice grown by append from nothing costs
// several times its final size).
func TestQueryByHashJSONFastPathAllocatesWithinTheBudget(t *testing.T) {
	n := 1 << 20
	body := []byte(`{"model_name":"m","block_hashes":[1` + strings.Repeat(",1", n-1) + `]}`)
	var q QueryByHashRequest
	var ms0, ms1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	err := decodeBytes(body, codecJSON, &q)
	runtime.ReadMemStats(&ms1)
	alloc := ms1.TotalAlloc - ms0.TotalAlloc
	if err == nil && len(q.BlockHashes) != n {
		t.Fatalf("%d hashes decoded, want %d", len(q.BlockHashes), n)
	}
	if budget := decodeBudget(len(body)); alloc > budget {
		t.Fatalf("a %d-byte body of %d hashes (%v) allocated %d bytes (%.1fx), over its budget of %d",
			len(body), n, err, alloc, float64(alloc)/float64(len(body)), budget)
	}
}

// BenchmarkDecodeQueryByHashJSON decodes /query_by_hash bodies through the
// JSON fast path (scanJSON): a prompt's 64 hashes, the common size, and a
// body of 1 MiB, whose slice is sized once when the scanner runs out of
// room instead of grown by append.
func BenchmarkDecodeQueryByHashJSON(b *testing.B) {
	for _, tc := range []struct {
		name string
		n    int
	}{{"hashes 64", 64}, {"hashes 1MiB", (1 << 20) / 21}} {
		hs := make([]string, tc.n)
		for i := range hs {
			hs[i] = strconv.FormatUint(12345678901234567890-uint64(i), 10)
		}
		body := []byte(`{"model_name":"m","block_hashes":[` + strings.Join(hs, ",") + `]}`)
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var q QueryByHashRequest
				if err := decodeBytes(body, codecJSON, &q); err != nil || len(q.BlockHashes) != tc.n {
					b.Fatal(err, len(q.BlockHashes))
				}
			}
		})
	}
}

// TestHashNullIsRefusedInBothEncodings: from a review. A block hash of
// null was a 400 in JSON and a hash 0 in MessagePack (the library reads a
// nil as the zero value before a type's own decoder): one body, two
// answers. Both refuse it; a parent hash of null is none in both.
func TestHashNullIsRefusedInBothEncodings(t *testing.T) {
	mp := func(v any) []byte {
		var buf bytes.Buffer
		if err := msgpack.NewEncoder(&buf).Encode(v); err != nil {
			t.Fatal(err)
		}
		return buf.Bytes()
	}
	for _, c := range []struct {
		name string
		json string
		mp   any
		v    func() any
	}{
		{"query_by_hash's block_hashes", `{"model_name":"m","block_hashes":[null]}`,
			map[string]any{"model_name": "m", "block_hashes": []any{nil}}, func() any { return new(QueryByHashRequest) }},
		{"a stored block's block_hash", `{"instance_id":1,"events":[{"event_id":1,"type":"stored","blocks":[{"block_hash":null,"tokens_hash":5}]}]}`,
			map[string]any{"instance_id": 1, "events": []any{map[string]any{"event_id": 1, "type": "stored",
				"blocks": []any{map[string]any{"block_hash": nil, "tokens_hash": 5}}}}}, func() any { return new(EventsRequest) }},
		{"a removed event's block_hashes", `{"instance_id":1,"events":[{"event_id":1,"type":"removed","block_hashes":[1,null]}]}`,
			map[string]any{"instance_id": 1, "events": []any{map[string]any{"event_id": 1, "type": "removed",
				"block_hashes": []any{1, nil}}}}, func() any { return new(EventsRequest) }},
	} {
		if err := decodeBytes([]byte(c.json), codecJSON, c.v()); !errors.Is(err, errBody) {
			t.Errorf("%s null in JSON: %v, want a bad request body", c.name, err)
		}
		v := c.v()
		if err := decodeBytes(mp(c.mp), codecMsgpack, v); !errors.Is(err, errBody) {
			t.Errorf("%s nil in MessagePack: %v (decoded %+v), want a bad request body", c.name, err, v)
		}
	}
	js := `{"instance_id":1,"events":[{"event_id":1,"type":"stored","parent_hash":null,"blocks":[{"block_hash":-1,"tokens_hash":5}]}]}`
	m := map[string]any{"instance_id": 1, "events": []any{map[string]any{"event_id": 1, "type": "stored", "parent_hash": nil,
		"blocks": []any{map[string]any{"block_hash": -1, "tokens_hash": 5}}}}}
	var rj, rm EventsRequest
	if err := decodeBytes([]byte(js), codecJSON, &rj); err != nil {
		t.Fatal(err)
	}
	if err := decodeBytes(mp(m), codecMsgpack, &rm); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(rj, rm) || rm.Events[0].ParentHash != nil || rm.Events[0].Blocks[0].BlockHash != Hash(math.MaxUint64) {
		t.Errorf("a parent hash of null: JSON %+v, MessagePack %+v", rj.Events, rm.Events)
	}
}

// TestKeysMatchExactlyInBothEncodings: from a review. encoding/json
// matched a key to a field case-insensitively, the msgpack library
// exactly, so {"model_name":"llama","Model_Name":"other"} named model
// "other" in JSON and "llama" in MessagePack. A key that differs from a
// field's name only in case is unknown in both, and ignored as unknown
// keys are, at every level of the body; escapes in a key are read as
// encoding/json reads them.
func TestKeysMatchExactlyInBothEncodings(t *testing.T) {
	js := `{"model_name":"llama","Model_Name":"other","block_hashes":[1]}`
	var qj, qm QueryByHashRequest
	if err := decodeBytes([]byte(js), codecJSON, &qj); err != nil {
		t.Fatal(err)
	}
	// The same map, key for key, in MessagePack (a fixmap keeps the order).
	mp := []byte{0x83}
	for _, kv := range [][2]string{{"model_name", "llama"}, {"Model_Name", "other"}} {
		mp = append(mp, byte(0xa0|len(kv[0])))
		mp = append(mp, kv[0]...)
		mp = append(mp, byte(0xa0|len(kv[1])))
		mp = append(mp, kv[1]...)
	}
	mp = append(mp, 0xac)
	mp = append(mp, "block_hashes"...)
	mp = append(mp, 0x91, 0x01)
	if err := decodeBytes(mp, codecMsgpack, &qm); err != nil {
		t.Fatal(err)
	}
	if qj.ModelName != "llama" || qm.ModelName != "llama" {
		t.Errorf("one body, models: JSON %q, MessagePack %q; want llama", qj.ModelName, qm.ModelName)
	}
	body := []byte(`{"Model_Name":"other","MODEL_NAME":"x","model_n\u0061me":"llama","instance_id":3,` +
		`"events":[{"Event_ID":9,"event_id":1,"TYPE":"removed","type":"stored","blocks":[{"Block_Hash":5,"block_hash":7,"tokens_Hash":8}]}]}`)
	orig := slices.Clone(body)
	var r EventsRequest
	if err := decodeBytes(body, codecJSON, &r); err != nil {
		t.Fatal(err)
	}
	want := EventsRequest{ModelName: "llama", InstanceID: 3, Events: []Event{{EventID: 1, Type: "stored", Blocks: []Block{{BlockHash: 7}}}}}
	if !reflect.DeepEqual(r, want) {
		t.Errorf("keys in other cases: decoded %+v, want %+v", r, want)
	}
	if !bytes.Equal(body, orig) {
		t.Errorf("the decode wrote over its caller's body: %s", body)
	}
}

// TestHashMsgpackRefusesWhatIsNoInteger: a block hash in MessagePack is a
// signed or unsigned 64-bit integer, as in JSON (TestHashJSON): a float,
// even a whole one, a string or a bool is refused in both.
func TestHashMsgpackRefusesWhatIsNoInteger(t *testing.T) {
	for _, c := range []struct {
		v    any
		json string
	}{{1.5, "1.5"}, {2.0, "2.0"}, {float32(3), "3e0"}, {"1", `"1"`}, {true, "true"}} {
		var buf bytes.Buffer
		if err := msgpack.NewEncoder(&buf).Encode(map[string]any{"model_name": "m", "block_hashes": []any{c.v}}); err != nil {
			t.Fatal(err)
		}
		var q QueryByHashRequest
		if err := decodeBytes(buf.Bytes(), codecMsgpack, &q); !errors.Is(err, errBody) {
			t.Errorf("a hash of %T %v in MessagePack: %v (decoded %v), want a bad request body", c.v, c.v, err, q.BlockHashes)
		}
		if err := decodeBytes([]byte(`{"model_name":"m","block_hashes":[`+c.json+`]}`), codecJSON, &q); !errors.Is(err, errBody) {
			t.Errorf("a hash of %s in JSON: %v, want a bad request body", c.json, err)
		}
	}
	for _, v := range []any{int64(-1), uint64(math.MaxUint64), int8(-128), uint8(200)} {
		var buf bytes.Buffer
		if err := msgpack.NewEncoder(&buf).Encode(map[string]any{"model_name": "m", "block_hashes": []any{v}}); err != nil {
			t.Fatal(err)
		}
		var q QueryByHashRequest
		if err := decodeBytes(buf.Bytes(), codecMsgpack, &q); err != nil || len(q.BlockHashes) != 1 {
			t.Errorf("a hash of %T %v in MessagePack: %v, %v", v, v, q.BlockHashes, err)
		}
	}
}

// TestMsgpackIntFieldsDoNotWrap: docs/compat.md, "Other numbers must fit
// their field in either encoding (... MessagePack used to wrap them)". An
// unsigned MessagePack integer past 2^63-1 does not fit a signed field
// (isl_tokens, cached_tokens, block_size), and JSON refuses the same
// number; MessagePack must not read it as a negative one (the 400 then
// said "isl_tokens -9223372036854775808 is negative" of a positive
// number, or "input length -1").
func TestMsgpackIntFieldsDoNotWrap(t *testing.T) {
	for _, u := range []uint64{1 << 63, math.MaxUint64} {
		for _, c := range []struct {
			field string
			v     func() any
		}{
			{"isl_tokens", func() any { return new(SelectRequest) }},
			{"cached_tokens", func() any { return new(ReservationRequest) }},
			{"block_size", func() any { return new(RegisterRequest) }},
		} {
			js := fmt.Sprintf(`{"%s":%d}`, c.field, u)
			if err := decodeBytes([]byte(js), codecJSON, c.v()); !errors.Is(err, errBody) {
				t.Fatalf("%s in JSON: %v, want a bad request body", js, err)
			}
			var buf bytes.Buffer
			if err := msgpack.NewEncoder(&buf).Encode(map[string]any{c.field: u}); err != nil {
				t.Fatal(err)
			}
			v := c.v()
			if err := decodeBytes(buf.Bytes(), codecMsgpack, v); !errors.Is(err, errBody) {
				t.Errorf("%s %d in MessagePack: %v (decoded %+v), want a bad request body as in JSON", c.field, u, err, v)
			}
		}
	}
}

// A body that does not decode is answered with the encoding named once:
// the libraries' errors start with it, and were answered "bad request
// body: json: json: cannot unmarshal ...".
func TestBadBodyNamesItsEncodingOnce(t *testing.T) {
	n := startNode(t)
	for _, tc := range []struct {
		c    codec
		body []byte
	}{
		{codecJSON, []byte(`{"instance_id": "vllm-1", "model_name": "llama"}`)},
		{codecJSON, []byte(`{"instance_id": 1,`)},
		{codecJSON, []byte(`{"dp_rank": -1}`)},
		{codecMsgpack, []byte{0x81, 0xab, 'i', 'n', 's', 't', 'a', 'n', 'c', 'e', '_', 'i', 'd', 0xa1, 'x'}},
		{codecMsgpack, []byte{0x81, 0xab, 'i', 'n', 's', 't', 'a', 'n', 'c', 'e', '_', 'i', 'd', 0xc1}},
	} {
		r := n.do(t, tc.c, "POST", "/register", tc.body)
		var e ErrorBody
		if err := decodeBytes(r.body, tc.c, &e); err != nil {
			t.Fatalf("%q: answer %q: %v", tc.body, r.body, err)
		}
		enc := map[codec]string{codecJSON: "json", codecMsgpack: "msgpack"}[tc.c]
		if r.code != 400 || !strings.HasPrefix(e.Error, "bad request body: "+enc+": ") || strings.Contains(e.Error, enc+": "+enc+": ") {
			t.Errorf("register with %q: %d %q, want 400 \"bad request body: %s: ...\", the encoding named once", tc.body, r.code, e.Error, enc)
		}
	}
}
