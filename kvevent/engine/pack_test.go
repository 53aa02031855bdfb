package engine

import (
	"encoding/hex"
	"strings"

	"github.com/kvrouter/kvrouter/internal/wirepack"
)

// Test inputs are encoded with internal/wirepack, which writes each one in
// the exact encoding the test chooses: field order, integer widths, bin or
// int hashes. The e2e tests publish its bytes through a real kvagent.

// Fixed-width integers: pack writes them in their own width even when a
// shorter one would do.
type (
	u8  = wirepack.U8
	u16 = wirepack.U16
	u32 = wirepack.U32
	u64 = wirepack.U64
	i8  = wirepack.I8
	i16 = wirepack.I16
	i32 = wirepack.I32
	i64 = wirepack.I64
)

// raw is inserted verbatim.
type raw = wirepack.Raw

// omap is a map written in the order given: key, value, key, value, ...
type omap = wirepack.Map

func pack(t tb, v any) []byte {
	t.Helper()
	b, err := wirepack.Pack(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// unhex reads hex with spaces and "quoted text" (written as its bytes), the
// notation of wire.md's golden examples.
func unhex(t tb, s string) []byte {
	t.Helper()
	var out []byte
	for len(s) > 0 {
		s = strings.TrimLeft(s, " \n\t")
		if s == "" {
			break
		}
		if s[0] == '"' {
			end := strings.IndexByte(s[1:], '"')
			if end < 0 {
				t.Fatalf("unterminated text in %q", s)
			}
			out = append(out, s[1:1+end]...)
			s = s[2+end:]
			continue
		}
		if len(s) < 2 {
			t.Fatalf("odd hex in %q", s)
		}
		b, err := hex.DecodeString(s[:2])
		if err != nil {
			t.Fatalf("bad hex %q: %v", s[:2], err)
		}
		out = append(out, b...)
		s = s[2:]
	}
	return out
}
