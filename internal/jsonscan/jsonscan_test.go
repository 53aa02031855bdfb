package jsonscan

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// refUint is Uint's specification: the longest run of digits, in JSON's
// syntax, read by strconv, no larger than limit.
func refUint(s string, limit uint64) (uint64, int, bool) {
	n := 0
	for n < len(s) && s[n] >= '0' && s[n] <= '9' {
		n++
	}
	if n == 0 || (n > 1 && s[0] == '0') {
		return 0, 0, false
	}
	if n < len(s) && (s[n] == '.' || s[n] == 'e' || s[n] == 'E') {
		return 0, 0, false
	}
	v, err := strconv.ParseUint(s[:n], 10, 64)
	if err != nil || v > limit {
		return 0, 0, false
	}
	return v, n, true
}

func checkUint(t *testing.T, s string, limit uint64) {
	t.Helper()
	p := New([]byte(s))
	v, ok := p.Uint(limit)
	wv, wn, wok := refUint(s, limit)
	if ok != wok || (ok && (v != wv || p.i != wn)) {
		t.Fatalf("Uint(%q, %d) = %d, %v at %d; want %d, %v at %d", s, limit, v, ok, p.i, wv, wok, wn)
	}
}

var uintCases = []string{
	"", "0", "00", "01", "1", "9", "10", "123", "123,", "123]", "1.5", "1e5", "1E5", "-1", "x",
	"9999999999999999999",  // 19 digits
	"10000000000000000000", // 20 digits
	"18446744073709551615", // max uint64
	"18446744073709551616", // max + 1
	"19999999999999999999",
	"99999999999999999999",
	"184467440737095516150",
	"4294967295", "4294967296",
	"9223372036854775807", "9223372036854775808",
}

func TestUintAgreesWithStrconv(t *testing.T) {
	limits := []uint64{math.MaxUint64, math.MaxUint32, math.MaxInt64, 1 << 63, 0, 9, 10}
	for _, s := range uintCases {
		for _, l := range limits {
			checkUint(t, s, l)
			checkUint(t, s+" ", l)
		}
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for i := 0; i < 200000; i++ {
		var s string
		switch rng.IntN(3) {
		case 0:
			s = strconv.FormatUint(rng.Uint64()>>rng.IntN(64), 10)
		case 1:
			b := make([]byte, 1+rng.IntN(22))
			for j := range b {
				b[j] = "0123456789.e,]"[rng.IntN(14)]
			}
			s = string(b)
		default:
			s = strconv.FormatUint(rng.Uint64(), 10) + strconv.Itoa(rng.IntN(10))
		}
		checkUint(t, s, limits[rng.IntN(len(limits))])
	}
}

func FuzzUint(f *testing.F) {
	for _, s := range uintCases {
		f.Add(s, uint64(math.MaxUint64))
	}
	f.Fuzz(func(t *testing.T, s string, limit uint64) { checkUint(t, s, limit) })
}

func TestUint32s(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint32
		ok   bool
	}{
		{"null", nil, true},
		{"[]", []uint32{}, true},
		{"[ 1 , 2,4294967295 ]", []uint32{1, 2, math.MaxUint32}, true},
		{"[4294967296]", nil, false},
		{"[1,]", nil, false},
		{"[-1]", nil, false},
		{"[1.0]", nil, false},
	} {
		p := New([]byte(c.in))
		got, ok := p.Uint32s(nil)
		if ok != c.ok || (ok && (!slices.Equal(got, c.want) || (got == nil) != (c.want == nil))) {
			t.Errorf("Uint32s(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
	// Appends to what it is given.
	p := New([]byte("[3]"))
	if got, ok := p.Uint32s([]uint32{1, 2}); !ok || !slices.Equal(got, []uint32{1, 2, 3}) {
		t.Errorf("Uint32s appends: %v, %v", got, ok)
	}
}

func BenchmarkUints(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	body := []byte("[")
	for i := 0; i < 128; i++ {
		if i > 0 {
			body = append(body, ',')
		}
		body = strconv.AppendUint(body, rng.Uint64(), 10)
	}
	body = append(body, ']')
	dst := make([]uint64, 0, 128)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		p := New(body)
		var ok bool
		if dst, ok = p.Uints(dst[:0], math.MaxUint64); !ok {
			b.Fatal("refused")
		}
	}
}

func TestInt64s(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []uint64
		ok   bool
	}{
		{"null", nil, true},
		{"[]", []uint64{}, true},
		{"[0,-0,1,-1]", []uint64{0, 0, 1, math.MaxUint64}, true},
		{"[9223372036854775807,-9223372036854775808]", []uint64{math.MaxInt64, 1 << 63}, true},
		{"[18446744073709551615]", []uint64{math.MaxUint64}, true},
		// Below the smallest int64: no 64-bit pattern is its value. With
		// the negative limit raised, -(2^64-1) wrapped to 1.
		{"[-9223372036854775809]", nil, false},
		{"[-18446744073709551615]", nil, false},
		{"[-18446744073709551616]", nil, false},
		{"[18446744073709551616]", nil, false},
		{"[-]", nil, false},
		{"[--1]", nil, false},
		{"[- 1]", nil, false},
		{"[-01]", nil, false},
		{"[+1]", nil, false},
		{"[-1.5]", nil, false},
		{"[-1e3]", nil, false},
		{"[1,]", nil, false},
		{"[1", nil, false},
		{"[1 2]", nil, false},
		{"nul", nil, false},
		{"", nil, false},
	} {
		p := New([]byte(c.in))
		got, ok := p.Int64s(nil)
		if ok != c.ok || (ok && (!slices.Equal(got, c.want) || (got == nil) != (c.want == nil))) {
			t.Errorf("Int64s(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

func TestUints(t *testing.T) {
	for _, c := range []struct {
		in    string
		limit uint64
		want  []uint64
		ok    bool
	}{
		{"null", math.MaxUint64, nil, true},
		{" [ ] ", math.MaxUint64, nil, false}, // the caller skips the whitespace before a value
		{"[ ]", math.MaxUint64, []uint64{}, true},
		{"[0,18446744073709551615]", math.MaxUint64, []uint64{0, math.MaxUint64}, true},
		{"[10]", 10, []uint64{10}, true},
		{"[11]", 10, nil, false},
		{"[-1]", math.MaxUint64, nil, false},
		{"[1,,2]", math.MaxUint64, nil, false},
		{"[,]", math.MaxUint64, nil, false},
		{`["1"]`, math.MaxUint64, nil, false},
		{"[null]", math.MaxUint64, nil, false},
		{"{}", math.MaxUint64, nil, false},
	} {
		p := New([]byte(c.in))
		got, ok := p.Uints(nil, c.limit)
		if ok != c.ok || (ok && (!slices.Equal(got, c.want) || (got == nil) != (c.want == nil))) {
			t.Errorf("Uints(%q, %d) = %v, %v; want %v, %v", c.in, c.limit, got, ok, c.want, c.ok)
		}
	}
}

func TestStr(t *testing.T) {
	for _, c := range []struct {
		in, want string
		ok       bool
		next     int // where the scanner is after a string it read
	}{
		{`""`, "", true, 2},
		{`"abc" `, "abc", true, 5},
		{`"a b"x`, "a b", true, 5},
		{`"a\"b"`, "", false, 0},          // an escape: encoding/json's
		{`"a\nb"`, "", false, 0},          // an escape
		{"\"a\tb\"", "", false, 0},        // a control byte
		{"\"a\x7fb\"", "a\x7fb", true, 5}, // DEL is no control byte to JSON
		{"\"é\"", "", false, 0},           // non-ASCII
		{`"abc`, "", false, 0},            // no closing quote
		{`abc"`, "", false, 0},
		{``, "", false, 0},
	} {
		p := New([]byte(c.in))
		got, ok := p.Str()
		if ok != c.ok || string(got) != c.want || (ok && p.i != c.next) {
			t.Errorf("Str(%q) = %q, %v at %d; want %q, %v at %d", c.in, got, ok, p.i, c.want, c.ok, c.next)
		}
	}
}

func TestBool(t *testing.T) {
	for _, c := range []struct {
		in       string
		want, ok bool
	}{
		{"true", true, true},
		{"false", false, true},
		{"true,", true, true},
		{"tru", false, false},
		{"fals", false, false},
		{"True", false, false},
		{"null", false, false},
		{"1", false, false},
		{"", false, false},
	} {
		p := New([]byte(c.in))
		got, ok := p.Bool()
		if got != c.want || ok != c.ok {
			t.Errorf("Bool(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

func TestObject(t *testing.T) {
	// value takes the keys a, b, c ... (any key of one letter) with an
	// integer value, and refuses any other key.
	for _, c := range []struct {
		in   string
		keys string // the keys read, in order
		ok   bool
	}{
		{`{}`, "", true},
		{` { } `, "", true},
		{`{"a":1}`, "a", true},
		{` {"a" : 1 , "b":2} `, "ab", true},
		{`{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8}`, "abcdefgh", true},
		{`{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9}`, "abcdefgh", false}, // past the keys it tracks
		{`{"a":1,"a":2}`, "a", false}, // a key twice: encoding/json keeps the last
		{`{"a":1}{}`, "a", false},     // trailing data
		{`{"a":1} x`, "a", false},
		{`{"a":1,}`, "a", false},
		{`{"a" 1}`, "", false},
		{`{"a":1 "b":2}`, "a", false},
		{`{"long":1}`, "", false}, // refused by value
		{`{"a":x}`, "", false},    // refused by value
		{`{a:1}`, "", false},
		{`{"a":1`, "a", false},
		{`[]`, "", false},
		{``, "", false},
	} {
		var keys []byte
		p := New([]byte(c.in))
		ok := p.Object(func(key []byte) bool {
			if len(key) != 1 {
				return false
			}
			if _, ok := p.Uint(math.MaxUint64); !ok {
				return false
			}
			keys = append(keys, key...)
			return true
		})
		if ok != c.ok || string(keys) != c.keys {
			t.Errorf("Object(%q) = %v reading keys %q; want %v reading %q", c.in, ok, keys, c.ok, c.keys)
		}
	}
}

// FuzzScannersAgreeWithEncodingJSON: whatever body a scanner takes whole,
// encoding/json takes too, with the same value (the callers fall back to
// encoding/json on anything a scanner refuses, so a scanner may refuse
// more, never take more or read otherwise).
func FuzzScannersAgreeWithEncodingJSON(f *testing.F) {
	for _, s := range []string{
		"null", "[]", "[1,2,3]", "[-1,0,18446744073709551615]", "[-9223372036854775808]",
		"[-9223372036854775809]", "[-18446744073709551615]", "[4294967295]", "[4294967296]",
		`"abc"`, `"a\"b"`, "true", "false", "[1 , 2 ]", "[01]", "[1e3]", "[-]",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b := []byte(s)
		{
			p := New(b)
			if got, ok := p.Int64s(nil); ok && p.End() {
				var want []json.Number
				if err := json.Unmarshal(b, &want); err != nil || len(want) != len(got) || (want == nil) != (got == nil) {
					t.Fatalf("Int64s(%q) = %v; encoding/json: %v, %v", s, got, want, err)
				}
				for i, n := range want {
					var w uint64
					if v, err := strconv.ParseInt(n.String(), 10, 64); err == nil {
						w = uint64(v)
					} else if v, err := strconv.ParseUint(n.String(), 10, 64); err == nil {
						w = v
					} else {
						t.Fatalf("Int64s(%q) took %s, which fits no 64-bit integer", s, n)
					}
					if got[i] != w {
						t.Fatalf("Int64s(%q)[%d] = %d, want %d", s, i, got[i], w)
					}
				}
			}
		}
		{
			p := New(b)
			if got, ok := p.Uints(nil, math.MaxUint64); ok && p.End() {
				var want []uint64
				if err := json.Unmarshal(b, &want); err != nil || !slices.Equal(got, want) || (want == nil) != (got == nil) {
					t.Fatalf("Uints(%q) = %v; encoding/json: %v, %v", s, got, want, err)
				}
			}
		}
		{
			p := New(b)
			if got, ok := p.Uint32s(nil); ok && p.End() {
				var want []uint32
				if err := json.Unmarshal(b, &want); err != nil || !slices.Equal(got, want) || (want == nil) != (got == nil) {
					t.Fatalf("Uint32s(%q) = %v; encoding/json: %v, %v", s, got, want, err)
				}
			}
		}
		{
			p := New(b)
			if got, ok := p.Str(); ok && p.End() {
				var want string
				if err := json.Unmarshal(b, &want); err != nil || string(got) != want {
					t.Fatalf("Str(%q) = %q; encoding/json: %q, %v", s, got, want, err)
				}
			}
		}
		{
			p := New(b)
			if got, ok := p.Bool(); ok && p.End() {
				var want bool
				if err := json.Unmarshal(b, &want); err != nil || got != want {
					t.Fatalf("Bool(%q) = %v; encoding/json: %v, %v", s, got, want, err)
				}
			}
		}
		// Object over keys of Uints values: what it takes whole is a JSON
		// object of arrays of unsigned integers, each key once.
		var got map[string][]uint64
		p := New(b)
		if p.Object(func(key []byte) bool {
			v, ok := p.Uints(nil, math.MaxUint64)
			if got == nil {
				got = map[string][]uint64{}
			}
			got[string(key)] = v
			return ok
		}) {
			var want map[string][]uint64
			if err := json.Unmarshal(b, &want); err != nil || len(want) != len(got) {
				t.Fatalf("Object(%q) = %v; encoding/json: %v, %v", s, got, want, err)
			}
			for k, v := range want {
				if g, ok := got[k]; !ok || !slices.Equal(g, v) {
					t.Fatalf("Object(%q)[%q] = %v; encoding/json: %v", s, k, g, v)
				}
			}
		}
	})
}

// refElements is Elements's specification on valid JSON: the elements of
// every array, by how many containers (the array's own included) hold it.
func refElements(v any, depth int, n *[CountDepth]int) {
	switch v := v.(type) {
	case []any:
		if depth+1 < CountDepth {
			n[depth+1] += len(v)
		}
		for _, e := range v {
			refElements(e, depth+1, n)
		}
	case map[string]any:
		for _, e := range v {
			refElements(e, depth+1, n)
		}
	}
}

func TestElementsCountsArrayElementsByDepth(t *testing.T) {
	for _, tc := range []struct {
		body string
		want map[int]int
	}{
		{`{}`, nil},
		{`[]`, nil},
		{`[ ]`, nil},
		{`[1]`, map[int]int{1: 1}},
		{`{"a":[1,2,{"b":[3]}]}`, map[int]int{2: 3, 4: 1}},
		{`{"batches":[{"worker_id":1,"events":[{},{},{"blocks":[{},{}],"hashes":[1,2,3]}]},{"events":[]}]}`,
			map[int]int{2: 2, 4: 3, 6: 5}},
		// Commas and brackets in strings and keys count nothing; an escaped
		// quote does not end a string.
		{`{"a,[":["x,]\"[,", "\\", ",{"], "b":{"c":"]]"}}`, map[int]int{2: 3}},
		// Objects' commas are not elements.
		{`[{"a":1,"b":2},{"c":[[],[1,2]]}]`, map[int]int{1: 2, 3: 2, 4: 2}},
		// Deeper than CountDepth: not counted, and no harm to the counts above.
		{`[[[[[[[[[[1,2]]]]]]]]],3]`, map[int]int{1: 2, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}},
	} {
		var want [CountDepth]int
		for d, c := range tc.want {
			want[d] = c
		}
		if got := Elements([]byte(tc.body)); got != want {
			t.Errorf("Elements(%s) = %v, want %v", tc.body, got, want)
		}
		var v any
		if err := json.Unmarshal([]byte(tc.body), &v); err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		var ref [CountDepth]int
		refElements(v, 0, &ref)
		if ref != want {
			t.Errorf("the reference counts %v in %s, the table %v", ref, tc.body, want)
		}
	}
	// Not JSON: some counts, no panic.
	for _, b := range []string{`]]]]`, `[,,,`, `"`, `["\`, `}{[`} {
		_ = Elements([]byte(b))
	}
}

func TestElementsAgreesWithEncodingJSON(t *testing.T) {
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 0))
	var gen func(depth int) any
	gen = func(depth int) any {
		switch k := r.IntN(6); {
		case depth > 10 || k == 0:
			return r.IntN(100)
		case k == 1:
			return `s,[]{}"\` + strconv.Itoa(r.IntN(10))
		case k <= 3:
			a := make([]any, r.IntN(4))
			for i := range a {
				a[i] = gen(depth + 1)
			}
			return a
		default:
			m := map[string]any{}
			for i := range r.IntN(4) {
				m[`k"[,`+strconv.Itoa(i)] = gen(depth + 1)
			}
			return m
		}
	}
	for range 2000 {
		v := gen(0)
		b, err := json.MarshalIndent(v, "", " ")
		if err != nil {
			t.Fatal(err)
		}
		var want [CountDepth]int
		refElements(v, 0, &want)
		if got := Elements(b); got != want {
			t.Fatalf("Elements(%s) = %v, want %v", b, got, want)
		}
	}
}

// TestArraysAreSizedOnce: an array longer than the room its slice has is
// sized once for the rest (room), instead of grown by append, which cost
// five times its final size; a slice with room enough is only filled.
func TestArraysAreSizedOnce(t *testing.T) {
	body := []byte("[1" + strings.Repeat(", 1", 9999) + " ]")
	var got []uint64
	n := testing.AllocsPerRun(10, func() {
		var ok bool
		if got, ok = New(body).Uints(nil, math.MaxUint64); !ok || len(got) != 10000 {
			t.Fatalf("Uints: %d values, %v", len(got), ok)
		}
	})
	if n != 1 || cap(got) > 10000+10000/8 {
		t.Errorf("10000 values into a nil slice: %.0f allocations, capacity %d, want 1 of about 10000", n, cap(got))
	}
	dst := make([]uint64, 3, 5)
	if got, _ := New(body).Uints(dst, math.MaxUint64); len(got) != 10003 {
		t.Errorf("appended to 3 values: %d", len(got))
	}
	if n := testing.AllocsPerRun(10, func() { New(body).Uints(got[:0], math.MaxUint64) }); n != 0 {
		t.Errorf("into a slice with room: %.0f allocations, want 0", n)
	}
}

// TestRoomIsTheArraysOwn: the room an array is sized for counts the commas
// of its own rest only, up to its first ']', not those of later arrays or
// strings of the body; and on bytes that are not an array of numbers (a
// run of commas) it is at most half of them, as it would be at a digit and
// a comma an element.
func TestRoomIsTheArraysOwn(t *testing.T) {
	body := []byte("[1, 2] " + `"` + strings.Repeat(",", 10000) + `" [1` + strings.Repeat(",1", 10000) + "]")
	got, ok := New(body).Uints(nil, math.MaxUint64)
	if !ok || len(got) != 2 {
		t.Fatalf("Uints of the first array: %v, %v", got, ok)
	}
	if cap(got) > 8 {
		t.Errorf("the first array of 2 values was sized for %d: the commas after its ']' counted", cap(got))
	}

	commas := []byte("[1" + strings.Repeat(",", 10000) + "]")
	var ms0, ms1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	got, ok = New(commas).Uints(nil, math.MaxUint64)
	runtime.ReadMemStats(&ms1)
	if ok {
		t.Fatalf("Uints of %q...: %v, want a failure", commas[:8], got)
	}
	bound := uint64(8 * (len(commas)/2 + 1))
	if grown := ms1.TotalAlloc - ms0.TotalAlloc; grown > bound+bound/4 {
		t.Errorf("a 1 and %d commas allocated %d bytes, over room's bound of half its bytes (%d)", 10000, grown, bound)
	}
}
