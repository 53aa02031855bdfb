package store

import (
	"encoding/binary"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
)

// Log entry encoding, version 1. Every field of raft.Log is kept; integers are
// varints so that the fixed overhead of a small entry is a handful of bytes.
//
//	byte     version            = 1
//	byte     flags              bit 0: AppendedAt present; other bits must be 0
//	uvarint  Index
//	uvarint  Term
//	byte     Type
//	uvarint  len(Data)          then Data
//	uvarint  len(Extensions)    then Extensions
//	if flags&1:
//	  varint   AppendedAt Unix seconds
//	  uvarint  AppendedAt nanoseconds within the second (< 1e9)
//
// The decoder is strict: an unknown version, a set reserved flag, a length
// past the end of the buffer, an out-of-range nanosecond or trailing bytes are
// errors wrapping ErrCorrupt or ErrUnsupportedVersion, never panics and never
// allocations sized by an unchecked length. An empty Data or Extensions
// decodes as nil. AppendedAt decodes in UTC without a monotonic reading; the
// instant is preserved exactly (time.Time.Equal holds).
const (
	codecV1 byte = 1

	flagAppendedAt byte = 1 << 0
	flagsKnown          = flagAppendedAt
)

// encodedLogSizeHint returns an upper bound of the encoded size of l.
func encodedLogSizeHint(l *raft.Log) int {
	return 2 + 3*binary.MaxVarintLen64 + 1 + 2*binary.MaxVarintLen64 +
		len(l.Data) + len(l.Extensions) + 2*binary.MaxVarintLen64
}

// appendLog appends the version-1 encoding of l to dst and returns the
// extended slice.
func appendLog(dst []byte, l *raft.Log) []byte {
	var flags byte
	if !l.AppendedAt.IsZero() {
		flags |= flagAppendedAt
	}
	dst = append(dst, codecV1, flags)
	dst = binary.AppendUvarint(dst, l.Index)
	dst = binary.AppendUvarint(dst, l.Term)
	dst = append(dst, byte(l.Type))
	dst = binary.AppendUvarint(dst, uint64(len(l.Data)))
	dst = append(dst, l.Data...)
	dst = binary.AppendUvarint(dst, uint64(len(l.Extensions)))
	dst = append(dst, l.Extensions...)
	if flags&flagAppendedAt != 0 {
		dst = binary.AppendVarint(dst, l.AppendedAt.Unix())
		dst = binary.AppendUvarint(dst, uint64(l.AppendedAt.Nanosecond()))
	}
	return dst
}

// logDecoder reads the fields of one encoded entry; the first error sticks.
type logDecoder struct {
	buf []byte
	off int
	err error
}

func (d *logDecoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("decode log entry at byte %d: %s: %w", d.off, fmt.Sprintf(format, args...), ErrCorrupt)
	}
}

func (d *logDecoder) byte(what string) byte {
	if d.err != nil {
		return 0
	}
	if d.off >= len(d.buf) {
		d.fail("%s: unexpected end of entry", what)
		return 0
	}
	b := d.buf[d.off]
	d.off++
	return b
}

func (d *logDecoder) uvarint(what string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.buf[d.off:])
	if n <= 0 {
		d.fail("%s: bad uvarint", what)
		return 0
	}
	d.off += n
	return v
}

func (d *logDecoder) varint(what string) int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.buf[d.off:])
	if n <= 0 {
		d.fail("%s: bad varint", what)
		return 0
	}
	d.off += n
	return v
}

// span reads a length and returns the [start, end) offsets of that many bytes,
// checking the length against what is left before anything is sliced.
func (d *logDecoder) span(what string) (int, int) {
	n := d.uvarint(what + " length")
	if d.err != nil {
		return 0, 0
	}
	if n > uint64(len(d.buf)-d.off) {
		d.fail("%s: length %d exceeds the %d bytes left", what, n, len(d.buf)-d.off)
		return 0, 0
	}
	start := d.off
	d.off += int(n)
	return start, d.off
}

// decodeLog decodes buf into a fresh raft.Log. The result never aliases buf:
// Data and Extensions are copied into one new allocation (capped, so that an
// append to Data cannot overwrite Extensions), which lets callers hand buf
// back to Pebble as soon as decodeLog returns.
func decodeLog(buf []byte) (raft.Log, error) {
	if len(buf) == 0 {
		return raft.Log{}, fmt.Errorf("decode log entry: empty value: %w", ErrCorrupt)
	}
	if buf[0] != codecV1 {
		return raft.Log{}, fmt.Errorf("decode log entry: version %d: %w", buf[0], ErrUnsupportedVersion)
	}
	d := logDecoder{buf: buf, off: 1}
	flags := d.byte("flags")
	if flags&^flagsKnown != 0 {
		d.fail("unknown flags %#02x", flags)
	}
	var l raft.Log
	l.Index = d.uvarint("index")
	l.Term = d.uvarint("term")
	l.Type = raft.LogType(d.byte("type"))
	dataStart, dataEnd := d.span("data")
	extStart, extEnd := d.span("extensions")
	var sec int64
	var nsec uint64
	if flags&flagAppendedAt != 0 {
		sec = d.varint("appended-at seconds")
		nsec = d.uvarint("appended-at nanoseconds")
		if d.err == nil && nsec >= uint64(time.Second) {
			d.fail("appended-at nanoseconds %d out of range", nsec)
		}
	}
	if d.err == nil && d.off != len(buf) {
		d.fail("%d trailing bytes", len(buf)-d.off)
	}
	if d.err != nil {
		return raft.Log{}, d.err
	}

	nData, nExt := dataEnd-dataStart, extEnd-extStart
	if nData+nExt > 0 {
		payload := make([]byte, nData+nExt)
		copy(payload, buf[dataStart:dataEnd])
		copy(payload[nData:], buf[extStart:extEnd])
		if nData > 0 {
			l.Data = payload[:nData:nData]
		}
		if nExt > 0 {
			l.Extensions = payload[nData:]
		}
	}
	if flags&flagAppendedAt != 0 {
		l.AppendedAt = time.Unix(sec, int64(nsec)).UTC()
	}
	return l, nil
}
