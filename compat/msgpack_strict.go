package compat

import (
	"fmt"
	"math"
	"reflect"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The msgpack library converts any integer into an unsigned field by
// truncation: instance_id -1 became 2^64-1, dp_rank 2^32+3 registered rank
// 3, token ids wrapped. JSON refuses such numbers; these decoders make
// msgpack refuse them too (a 400). They are registered for the whole
// process, for every uint32 and uint64 the library decodes: this package
// is its only user here.
func init() {
	msgpack.Register(uint64(0), nil, func(d *msgpack.Decoder, v reflect.Value) error {
		u, err := decodeUnsigned(d, math.MaxUint64)
		v.SetUint(u)
		return err
	})
	msgpack.Register(uint32(0), nil, func(d *msgpack.Decoder, v reflect.Value) error {
		u, err := decodeUnsigned(d, math.MaxUint32)
		v.SetUint(u)
		return err
	})
}

// decodeUnsigned reads an integer in [0, max], or nil as 0; a negative or
// larger integer, or anything else, is an error.
func decodeUnsigned(d *msgpack.Decoder, max uint64) (uint64, error) {
	c, err := d.PeekCode()
	if err != nil {
		return 0, err
	}
	var u uint64
	switch {
	case c == msgpcode.Nil: // as JSON's null: the zero value
		return 0, d.DecodeNil()
	case c <= msgpcode.PosFixedNumHigh, c == msgpcode.Uint8, c == msgpcode.Uint16, c == msgpcode.Uint32, c == msgpcode.Uint64:
		if u, err = d.DecodeUint64(); err != nil {
			return 0, err
		}
	case c >= msgpcode.NegFixedNumLow, c == msgpcode.Int8, c == msgpcode.Int16, c == msgpcode.Int32, c == msgpcode.Int64:
		i, err := d.DecodeInt64()
		if err != nil {
			return 0, err
		}
		if i < 0 {
			return 0, fmt.Errorf("msgpack: %d where an unsigned integer belongs", i)
		}
		u = uint64(i)
	default:
		return 0, fmt.Errorf("msgpack: code %#x where an unsigned integer belongs", c)
	}
	if u > max {
		return 0, fmt.Errorf("msgpack: %d is out of range (at most %d)", u, max)
	}
	return u, nil
}
