package jsonscan

import (
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
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
