package limits

import (
	"strings"
	"testing"
)

func TestID(t *testing.T) {
	for _, c := range []struct {
		id, want string
	}{
		{"req-1", ""},
		{strings.Repeat("x", MaxIDLen), ""},
		{"", "is empty"},
		{strings.Repeat("x", MaxIDLen+1), "is 257 bytes long (at most 256)"},
		{"a\xffb", "is not valid UTF-8"},
		{"a\nb", `"a\nb" holds a control character`},
		{"a\x7fb", `"a\x7fb" holds a control character`},
		{"a\u0085b", `"a\u0085b" holds a control character`},
		{"é-☃", ""},
	} {
		if got := ID(c.id); got != c.want {
			t.Errorf("ID(%q) = %q, want %q", c.id, got, c.want)
		}
	}
}

func TestName(t *testing.T) {
	if got := Name(strings.Repeat("m", MaxNameLen)); got != "" {
		t.Errorf("a name of %d bytes: %q", MaxNameLen, got)
	}
	if got := Name(strings.Repeat("m", MaxNameLen+1)); got != "is 1025 bytes long (at most 1024)" {
		t.Errorf("a name of %d bytes: %q", MaxNameLen+1, got)
	}
}

func TestPrintableName(t *testing.T) {
	for _, c := range []struct {
		s, want string
	}{
		{"", ""},
		{"Llama 3.1 (modèle)", ""},
		{strings.Repeat("m", MaxNameLen+1), "is 1025 bytes long (at most 1024)"},
		{"a\nb", `"a\nb" holds a control character`},
		{"a\tb", `"a\tb" holds a control character`},
		{"a\u0085b", `"a\u0085b" holds a control character`},
	} {
		if got := PrintableName(c.s); got != c.want {
			t.Errorf("PrintableName(%q) = %q, want %q", c.s, got, c.want)
		}
	}
}

func TestDPRanks(t *testing.T) {
	many := make([]uint32, MaxDPRanks+1)
	for i := range many {
		many[i] = uint32(i)
	}
	for _, c := range []struct {
		ranks []uint32
		want  string
	}{
		{nil, ""},
		{[]uint32{3, 0, 1}, ""},
		{many[:MaxDPRanks], ""},
		{many, "4097 dp ranks (at most 4096)"},
		{[]uint32{0, 0}, "dp rank 0 is listed twice"},
		{[]uint32{5, 1, 7, 1, 5}, "dp rank 1 is listed twice"},
	} {
		if got := DPRanks(c.ranks); got != c.want {
			t.Errorf("DPRanks(%v) = %q, want %q", c.ranks, got, c.want)
		}
	}
}
