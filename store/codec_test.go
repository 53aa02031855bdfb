package store

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

func TestCodecRoundTrip(t *testing.T) {
	cases := []struct {
		name string
		log  raft.Log
	}{
		{"zero entry", raft.Log{}},
		{"command", *testLog(12, 3)},
		{"configuration with no payload", raft.Log{Index: 1, Term: 1, Type: raft.LogConfiguration}},
		{"max index and term", raft.Log{Index: math.MaxUint64, Term: math.MaxUint64, Type: raft.LogBarrier}},
		{"unknown future type survives", raft.Log{Index: 2, Term: 1, Type: raft.LogType(200)}},
		{"4 KiB payload", raft.Log{Index: 3, Term: 1, Data: make([]byte, 4096)}},
		{"extensions only", raft.Log{Index: 4, Term: 1, Extensions: []byte("chunk")}},
		{"appended before 1970", raft.Log{Index: 5, Term: 1, AppendedAt: time.Date(1969, 7, 20, 20, 17, 40, 123, time.UTC)}},
		{"appended with nanoseconds", raft.Log{Index: 6, Term: 1, AppendedAt: time.Unix(1_750_000_000, 999_999_999)}},
		{"appended far in the future", raft.Log{Index: 7, Term: 1, AppendedAt: time.Date(9999, 12, 31, 23, 59, 59, 1, time.UTC)}},
		{"appended in a non-UTC zone", raft.Log{Index: 8, Term: 1, AppendedAt: time.Date(2025, 1, 2, 3, 4, 5, 6, time.FixedZone("x", 3600))}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			enc := appendLog(nil, &tc.log)
			if len(enc) > encodedLogSizeHint(&tc.log) {
				t.Fatalf("encoded %d bytes, size hint %d", len(enc), encodedLogSizeHint(&tc.log))
			}
			got, err := decodeLog(enc)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if !logsEqual(&got, &tc.log) {
				t.Fatalf("round trip = %+v, want %+v", got, tc.log)
			}
		})
	}
}

func TestCodecIsCompact(t *testing.T) {
	// A small command entry pays a few bytes of framing, not a msgpack map.
	l := raft.Log{Index: 1000, Term: 7, Type: raft.LogCommand, Data: make([]byte, 10), AppendedAt: time.Unix(1_750_000_000, 5)}
	if n := len(appendLog(nil, &l)); n > 10+16 {
		t.Fatalf("encoded size %d, want at most %d", n, 10+16)
	}
}

func TestCodecRejectsMalformedInput(t *testing.T) {
	valid := appendLog(nil, testLog(300, 2))
	cases := []struct {
		name string
		buf  []byte
		want error
	}{
		{"empty", nil, ErrCorrupt},
		{"unknown version", append([]byte{9}, valid[1:]...), ErrUnsupportedVersion},
		{"version zero", append([]byte{0}, valid[1:]...), ErrUnsupportedVersion},
		{"unknown flag", append([]byte{codecV1, 0x80}, valid[2:]...), ErrCorrupt},
		{"trailing byte", append(append([]byte{}, valid...), 0), ErrCorrupt},
		{"data length past end", []byte{codecV1, 0, 1, 1, 0, 0xff, 0xff, 0x03}, ErrCorrupt},
		{"data length overflows uint64", []byte{codecV1, 0, 1, 1, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}, ErrCorrupt},
		{"index varint overlong", []byte{codecV1, 0, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}, ErrCorrupt},
		{"nanoseconds out of range", binaryLogWithNanos(uint64(time.Second)), ErrCorrupt},
	}
	// Every strict prefix of a valid entry is truncated and must be refused.
	for n := 1; n < len(valid); n++ {
		cases = append(cases, struct {
			name string
			buf  []byte
			want error
		}{name: "truncated", buf: valid[:n], want: ErrCorrupt})
	}
	for _, tc := range cases {
		l, err := decodeLog(tc.buf)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s (% x): decode = %+v, %v; want %v", tc.name, tc.buf, l, err, tc.want)
		}
	}
}

// binaryLogWithNanos encodes an otherwise empty entry whose AppendedAt
// carries the given nanosecond field.
func binaryLogWithNanos(nsec uint64) []byte {
	b := []byte{codecV1, flagAppendedAt, 1, 1, 0, 0, 0, 2} // sec = varint(1)
	for nsec >= 0x80 {
		b = append(b, byte(nsec)|0x80)
		nsec >>= 7
	}
	return append(b, byte(nsec))
}

// FuzzDecodeLog feeds arbitrary bytes to the logDecoder. It must never panic;
// whatever it accepts must survive encode and decode again unchanged.
// Run: go test ./store/ -run '^$' -fuzz FuzzDecodeLog -fuzztime 30s
func FuzzDecodeLog(f *testing.F) {
	f.Add([]byte{})
	f.Add(appendLog(nil, &raft.Log{}))
	f.Add(appendLog(nil, testLog(1, 1)))
	f.Add(appendLog(nil, &raft.Log{Index: math.MaxUint64, Term: 9, Type: raft.LogConfiguration, Data: []byte("cfg")}))
	f.Add(binaryLogWithNanos(uint64(time.Second) - 1))
	f.Fuzz(func(t *testing.T, buf []byte) {
		l, err := decodeLog(buf)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrUnsupportedVersion) {
				t.Fatalf("decode error %v wraps neither ErrCorrupt nor ErrUnsupportedVersion", err)
			}
			return
		}
		again, err := decodeLog(appendLog(nil, &l))
		if err != nil {
			t.Fatalf("re-decode of an accepted entry: %v", err)
		}
		if !logsEqual(&again, &l) {
			t.Fatalf("re-decode = %+v, want %+v", again, l)
		}
	})
}

// FuzzEncodeRoundTrip builds entries from arbitrary fields: every entry must
// decode back to itself.
func FuzzEncodeRoundTrip(f *testing.F) {
	f.Add(uint64(1), uint64(1), uint8(0), []byte("x"), []byte(nil), int64(1_750_000_000), int64(5))
	f.Fuzz(func(t *testing.T, index, term uint64, typ uint8, data, ext []byte, sec, nsec int64) {
		l := raft.Log{Index: index, Term: term, Type: raft.LogType(typ), Data: data, Extensions: ext,
			AppendedAt: time.Unix(sec, nsec)}
		got, err := decodeLog(appendLog(nil, &l))
		if err != nil {
			t.Fatalf("decode of a fresh encoding: %v", err)
		}
		if !logsEqual(&got, &l) {
			t.Fatalf("round trip = %+v, want %+v", got, l)
		}
	})
}
