package api

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// keysOfType adds the JSON field names of every struct reachable from t.
func keysOfType(t reflect.Type, names map[string]bool) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Array {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return
	}
	for i := 0; i < t.NumField(); i++ {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		names[name] = true
		keysOfType(t.Field(i).Type, names)
	}
}

// keysExactAndOnce walks b token by token and reports whether every key
// is one of names and no object gives a key twice.
func keysExactAndOnce(b []byte, names map[string]bool) bool {
	dec := json.NewDecoder(bytes.NewReader(b))
	type frame struct {
		object bool
		seen   map[string]bool
		key    bool // the next token of an object is a key
	}
	var stack []frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return true // the end (decodeJSON took b whole)
		}
		if n := len(stack); n > 0 && stack[n-1].object && stack[n-1].key {
			if d, ok := tok.(json.Delim); ok && d == '}' {
				stack = stack[:n-1]
				continue
			}
			k := tok.(string)
			if !names[k] || stack[n-1].seen[k] {
				return false
			}
			stack[n-1].seen[k] = true
			stack[n-1].key = false
			continue
		}
		if n := len(stack); n > 0 && stack[n-1].object {
			stack[n-1].key = true // a value: a key comes next
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, frame{object: true, seen: map[string]bool{}, key: true})
		case json.Delim('['):
			stack = append(stack, frame{})
		case json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
	}
}

// FuzzDecodeJSONTakesOnlyExactKeysOnce: a body decodeJSON takes has no
// key that is not a field's name exactly, and no key twice in an object,
// at any depth (whatever encoding/json would take). From a review: keys
// matched without their case or by Unicode folding, and keys given twice,
// were taken.
func FuzzDecodeJSONTakesOnlyExactKeysOnce(f *testing.F) {
	for _, s := range []string{
		`{"worker_id":9,"block_size":4,"WORKER_ID":10}`,
		"{\"worker_id\":12,\"block_size\":4,\"capacity_blocks\":{\"di\u017fk\":7}}",
		`{"params":{"temperature":2},"params":{"host_cache_hit_weight":0.5},"view":"tiered"}`,
		`{"batches":[{"worker_id":1,"dp_rank":0,"events":[{"event_id":1,"type":"stored","tier":"device","blocks":[{"hash":1,"local_hash":2}]}]}]}`,
		`{"isl":5,"overrides":{"temperature":2,"Temperature":1}}`,
		`{"id":"n4","raft_addr":"a:1","http_addr":"b:2","id":"n5"}`,
		`{"cursor":3,"events":[{"event_id":1,"type":"stored","tier":"device","blocks":[]}]}`,
		`{"isl":5,"b\u006fok":true}`,
	} {
		for i := range 7 {
			f.Add(uint8(i), s)
		}
	}
	types := []func() any{
		func() any { return new(RegisterWorkerRequest) }, func() any { return new(SettingsRequest) },
		func() any { return new(EventsRequest) }, func() any { return new(RouteRequest) },
		func() any { return new(AddMemberRequest) }, func() any { return new(DumpRequest) },
		func() any { return new(TransferLeaderRequest) },
	}
	f.Fuzz(func(t *testing.T, which uint8, body string) {
		v := types[int(which)%len(types)]()
		if decodeJSONBytes([]byte(body), v, false) != nil {
			return
		}
		names := map[string]bool{}
		keysOfType(reflect.TypeOf(v), names)
		if !keysExactAndOnce([]byte(body), names) {
			t.Fatalf("%T took %q: a key that is no field's name, or one given twice", v, body)
		}
	})
}

// Types for the walker's rules that no API body reaches today (strictkeys.Check): embedded
// structs, maps with integer keys, an any field.
type (
	keysLeaf struct {
		Name int `json:"name"`
	}
	keysDeep struct {
		X map[string]int `json:"x"`
	}
	keysDepth1 struct{ keysDeep }
	keysOther  struct {
		X []keysLeaf `json:"x"`
	}
	// keysEmbeds gives "x" at depth 2 (keysDepth1.keysDeep.X, a map)
	// and at depth 1 (keysOther.X, a list of keysLeaf): encoding/json
	// decodes "x" into the shallower.
	keysEmbeds struct {
		keysDepth1
		keysOther
	}
	keysIntMap struct {
		M map[uint32]string `json:"m"`
	}
	keysStrMap struct {
		M map[string]int `json:"m"`
	}
	keysAny struct {
		V any `json:"v"`
	}
)

// TestCheckKeysTakesTheShallowestEmbeddedField: an embedded struct's
// fields are named breadth first, as encoding/json resolves them, so a
// key goes to the shape of the field it decodes into. From a review: the
// walk went depth first, took the deeper map's shape for "x", and let a
// case-folded "NAME" through into keysLeaf.Name.
func TestDecodeJSONKeysTakesTheShallowestEmbeddedField(t *testing.T) {
	var v keysEmbeds
	if err := decodeJSONBytes([]byte(`{"x":[{"name":1}]}`), &v, false); err != nil || len(v.X) != 1 || v.X[0].Name != 1 {
		t.Fatalf("exact keys: %v, decoded %+v", err, v)
	}
	err := decodeJSONBytes([]byte(`{"x":[{"NAME":1}]}`), &keysEmbeds{}, false)
	if err == nil || !strings.Contains(err.Error(), `x[0]: unknown field "NAME"`) {
		t.Fatalf("a case-folded key in the shallower field: %v, want it refused", err)
	}
}

// TestCheckKeysTellsMapKeysApartAsEncodingJSON: two keys a map holds as
// one are one key given twice: "1" and "01" in a map with integer keys,
// and two invalid UTF-8 bytes (each read as U+FFFD). From a review.
func TestDecodeJSONKeysTellsMapKeysApartAsEncodingJSON(t *testing.T) {
	for _, c := range []struct {
		body string
		v    any
		ok   bool
	}{
		{`{"m":{"1":"a","01":"b"}}`, &keysIntMap{}, false},
		{`{"m":{"1":"a","2":"b"}}`, &keysIntMap{}, true},
		{"{\"m\":{\"\xff\":1,\"\xfe\":2}}", &keysStrMap{}, false},
		{"{\"m\":{\"\xff\":1,\"\uFFFD\":2}}", &keysStrMap{}, false},
		{`{"m":{"01":1,"1":2}}`, &keysStrMap{}, true}, // text keys: two
	} {
		err := decodeJSONBytes([]byte(c.body), c.v, false)
		if (err == nil) != c.ok {
			t.Errorf("%q: %v, want taken %v", c.body, err, c.ok)
		}
	}
}

// TestCheckKeysNamesADeepKeysPath: the error names the path from the top,
// fields joined by dots, indexes in brackets, an empty field name quoted,
// however deep.
func TestDecodeJSONKeysNamesADeepKeysPath(t *testing.T) {
	err := decodeJSONBytes([]byte(`{"v":{"a":[{"":[0,{"b":1,"b":2}]}]}}`), &keysAny{}, false)
	if want := `v.a[0].""[1]: key "b" given twice`; err == nil || !strings.Contains(err.Error(), want) {
		t.Fatalf("%v, want %q", err, want)
	}
	const depth = 5000
	var sb strings.Builder
	sb.WriteString(`{"v":`)
	for range depth {
		sb.WriteString(`{"k":`)
	}
	sb.WriteString(`{"a":1,"a":2}`)
	sb.WriteString(strings.Repeat("}", depth+1))
	err = decodeJSONBytes([]byte(sb.String()), &keysAny{}, false)
	if want := "v" + strings.Repeat(".k", depth) + `: key "a" given twice`; err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Fatalf("a key twice %d objects deep: %.200v…, want the path to it", depth, err)
	}
}
