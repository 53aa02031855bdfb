// Package wirepack writes MessagePack in exactly the encoding a test
// chooses (field order, integer widths, an int or bin hash, bytes
// inserted verbatim), for tests that build an engine's KV event payloads
// byte for byte as vLLM's or SGLang's publisher does: the decoder's
// interop tests (kvevent/engine) and the end-to-end tests that publish
// through a real kvagent (e2e). One builder for both, so that the bytes
// the end-to-end tests send are the ones the decoder's tests pin.
//
// It encodes with vmihailenco/msgpack, an encoder the decoder does not use
// to decode, through its low-level calls. It is for tests only.
package wirepack

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Fixed-width integers: Pack writes them in their own width even when a
// shorter one would do (a Go int, uint32 or uint64 is written in the
// shortest form, as msgspec writes a Python int).
type (
	U8  uint8
	U16 uint16
	U32 uint32
	U64 uint64
	I8  int8
	I16 int16
	I32 int32
	I64 int64
)

// Raw is inserted verbatim.
type Raw []byte

// Map is a map written in the order given: key, value, key, value, ...
type Map []any

// Pack encodes v: nil, bool, string, int, uint32, uint64, the fixed-width
// integers, float32, float64, []byte (bin), Raw, []uint64 and []uint32
// (arrays of shortest-form integers), []any (an array) and Map.
func Pack(v any) ([]byte, error) {
	var buf bytes.Buffer
	if err := packTo(msgpack.NewEncoder(&buf), &buf, v); err != nil {
		return nil, fmt.Errorf("pack %v: %w", v, err)
	}
	return buf.Bytes(), nil
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
	case U8:
		return e.EncodeUint8(uint8(v))
	case U16:
		return e.EncodeUint16(uint16(v))
	case U32:
		return e.EncodeUint32(uint32(v))
	case U64:
		return e.EncodeUint64(uint64(v))
	case I8:
		return e.EncodeInt8(int8(v))
	case I16:
		return e.EncodeInt16(int16(v))
	case I32:
		return e.EncodeInt32(int32(v))
	case I64:
		return e.EncodeInt64(int64(v))
	case float32:
		return e.EncodeFloat32(v)
	case float64:
		return e.EncodeFloat64(v)
	case []byte:
		return e.EncodeBytes(v)
	case Raw:
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
	case Map:
		if len(v)%2 != 0 {
			return fmt.Errorf("map of odd length %d", len(v))
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
	return fmt.Errorf("unsupported %T", v)
}

// Anys returns xs as a []any, each element as it is (for Pack's arrays of
// element types it has no slice case for).
func Anys[T any](xs []T) []any {
	out := make([]any, len(xs))
	for i, x := range xs {
		out[i] = x
	}
	return out
}
