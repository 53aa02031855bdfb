package compat

import (
	"strconv"
	"testing"
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
