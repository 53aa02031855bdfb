package raftfsm

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/store"
)

// rec is one record of a hand-built stream.
type rec struct{ k, v []byte }

// buildStream lays out a stream by hand, as the format comment says:
// version 1 with the counts in the header, version 2 with them after the
// records. headCounts and tailCounts override what is written there.
func buildStream(version uint32, recs []rec, headCounts, tailCounts map[byte]uint64) []byte {
	countBlock := func(c map[byte]uint64) []byte {
		b := []byte{byte(len(c))}
		for k := 0; k < 256; k++ {
			if n, ok := c[byte(k)]; ok {
				b = append(b, byte(k))
				b = binary.LittleEndian.AppendUint64(b, n)
			}
		}
		return b
	}
	b := []byte(snapshotMagic)
	b = binary.LittleEndian.AppendUint32(b, version)
	b = binary.LittleEndian.AppendUint64(b, 42)
	b = binary.LittleEndian.AppendUint64(b, 3)
	b = append(b, countBlock(headCounts)...)
	for _, r := range recs {
		b = binary.AppendUvarint(b, uint64(len(r.k)))
		b = append(b, r.k...)
		b = binary.AppendUvarint(b, uint64(len(r.v)))
		b = append(b, r.v...)
	}
	b = append(b, 0)
	if tailCounts != nil {
		b = append(b, countBlock(tailCounts)...)
	}
	sum := sha256.Sum256(b)
	return append(b, sum[:]...)
}

// TestSnapshotFormatVersions: a version 2 stream (counts after the records,
// written in one pass) and a version 1 stream (counts in the header) are
// both read, and a stream whose counts disagree with its records, or that
// puts them in the wrong place, is refused.
func TestSnapshotFormatVersions(t *testing.T) {
	recs := []rec{{[]byte{store.KindCursor, 1}, []byte("c")}, {[]byte{store.KindCursor, 2}, []byte("d")},
		{[]byte{store.KindWorker, 1}, []byte("w")}}
	counts := map[byte]uint64{store.KindCursor: 2, store.KindWorker: 1}
	for _, tc := range []struct {
		name       string
		stream     []byte
		wantErr    bool
		wantFormat uint32
	}{
		{"version 2", buildStream(2, recs, nil, counts), false, 2},
		{"version 1", buildStream(1, recs, counts, nil), false, 1},
		{"version 2, a count short", buildStream(2, recs, nil, map[byte]uint64{store.KindCursor: 1, store.KindWorker: 1}), true, 0},
		{"version 2, a kind missing", buildStream(2, recs, nil, map[byte]uint64{store.KindCursor: 2}), true, 0},
		{"version 2, counts in the header", buildStream(2, recs, counts, counts), true, 0},
		{"version 1, counts short", buildStream(1, recs, map[byte]uint64{store.KindCursor: 2}, nil), true, 0},
		{"version 3", buildStream(3, recs, nil, counts), true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			info, err := InspectSnapshot(bytes.NewReader(tc.stream))
			if tc.wantErr {
				if !errors.Is(err, ErrBadSnapshot) {
					t.Fatalf("read %+v, %v; want ErrBadSnapshot", info, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if info.FormatVersion != tc.wantFormat || info.Index != 42 || info.Term != 3 ||
				info.Records[store.KindName(store.KindCursor)] != 2 || info.Records[store.KindName(store.KindWorker)] != 1 ||
				info.Bytes != int64(len(tc.stream)) {
				t.Fatalf("info %+v", info)
			}
		})
	}
}
