package engine

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
)

// Test inputs are encoded with vmihailenco/msgpack, an encoder this package
// does not use to decode, through its low-level calls so that each test
// chooses the exact encoding: field order, integer widths, bin or int hashes.

// Fixed-width integers: pack writes them in their own width even when a
// shorter one would do.
type (
	u8  uint8
	u16 uint16
	u32 uint32
	u64 uint64
	i8  int8
	i16 int16
	i32 int32
	i64 int64
)

// raw is inserted verbatim.
type raw []byte

// omap is a map written in the order given: key, value, key, value, ...
type omap []any

func pack(t tb, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	if err := packTo(e, &buf, v); err != nil {
		t.Fatalf("pack %v: %v", v, err)
	}
	return buf.Bytes()
}

func packTo(e *msgpack.Encoder, buf *bytes.Buffer, v any) error {
	switch v := v.(type) {
	case nil:
		return e.EncodeNil()
	case bool:
		return e.EncodeBool(v)
	case string:
		return e.EncodeString(v)
	case int:
		return e.EncodeInt(int64(v))
	case uint64:
		return e.EncodeUint(v)
	case uint32:
		return e.EncodeUint(uint64(v))
	case u8:
		return e.EncodeUint8(uint8(v))
	case u16:
		return e.EncodeUint16(uint16(v))
	case u32:
		return e.EncodeUint32(uint32(v))
	case u64:
		return e.EncodeUint64(uint64(v))
	case i8:
		return e.EncodeInt8(int8(v))
	case i16:
		return e.EncodeInt16(int16(v))
	case i32:
		return e.EncodeInt32(int32(v))
	case i64:
		return e.EncodeInt64(int64(v))
	case float32:
		return e.EncodeFloat32(v)
	case float64:
		return e.EncodeFloat64(v)
	case []byte:
		return e.EncodeBytes(v)
	case raw:
		_, err := buf.Write(v)
		return err
	case []uint64:
		if err := e.EncodeArrayLen(len(v)); err != nil {
			return err
		}
		for _, x := range v {
			if err := e.EncodeUint(x); err != nil {
				return err
			}
		}
		return nil
	case []uint32:
		if err := e.EncodeArrayLen(len(v)); err != nil {
			return err
		}
		for _, x := range v {
			if err := e.EncodeUint(uint64(x)); err != nil {
				return err
			}
		}
		return nil
	case []any:
		if err := e.EncodeArrayLen(len(v)); err != nil {
			return err
		}
		for _, x := range v {
			if err := packTo(e, buf, x); err != nil {
				return err
			}
		}
		return nil
	case omap:
		if len(v)%2 != 0 {
			return fmt.Errorf("omap of odd length %d", len(v))
		}
		if err := e.EncodeMapLen(len(v) / 2); err != nil {
			return err
		}
		for _, x := range v {
			if err := packTo(e, buf, x); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("pack: unsupported %T", v)
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
