package raftfsm

import (
	"bytes"
	"encoding/binary"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/store"
)

// TestARecordWithBytesNoBuildWritesIsRefused pins that a state record's
// decoder takes only the bytes its encoder writes: a rank meta, member or
// tomb record with one trailing byte, and a booking record whose trailing
// discount is 0 (encodeBooking writes the discount only when it is set),
// are refused at restore (ErrBadSnapshot) naming the record's kind, where
// the same record without them restores. Each passed every raftfsm test
// under its sabotage: the rank meta, member and tomb decoders returning
// d.err instead of d.done() (trailing bytes taken), the booking's discount
// taken from 0 up.
func TestARecordWithBytesNoBuildWritesIsRefused(t *testing.T) {
	var rank enc
	encodeRankMeta(&rank, &indexer.RankMeta{Rank: r1, Order: 3})
	var member enc
	member.str("127.0.0.1:1")
	member.str("127.0.0.1:2")
	var tomb enc
	tomb.sv(7)
	var booking enc
	encodeBooking(&booking, &indexer.Booking{ID: "q", Rank: r1, SeqHashes: []uint64{1}, ISL: 8, CreatedAt: 7})
	cases := []struct {
		name, names string
		kind        byte
		key         []byte
		good, bad   []byte
	}{
		{"rank meta", "ranks record", store.KindRank,
			binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64(nil, r1.Worker), r1.DP),
			rank.b, append(bytes.Clone(rank.b), 0)},
		{"member", "members record", store.KindMember, []byte("n1"), member.b, append(bytes.Clone(member.b), 0)},
		{"tomb", "freed_bookings record", store.KindTomb, []byte("q"), tomb.b, append(bytes.Clone(tomb.b), 0)},
		{"booking (a discount of 0)", "bookings record", store.KindBooking, []byte("q"), booking.b, append(bytes.Clone(booking.b), 0)},
	}
	restore := func(kind byte, key, v []byte) error {
		stream := buildStream(snapshotVersion, []rec{{k: append([]byte{kind}, key...), v: v}},
			map[byte]uint64{}, map[byte]uint64{kind: 1})
		g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
		defer g.Close()
		return g.Restore(nopCloser{bytes.NewReader(stream)})
	}
	for _, c := range cases {
		if err := restore(c.kind, c.key, c.good); err != nil {
			t.Fatalf("%s record as written: %v, want it restored", c.name, err)
		}
		if err := restore(c.kind, c.key, c.bad); !errors.Is(err, ErrBadSnapshot) || !strings.Contains(err.Error(), c.names) {
			t.Errorf("%s record %x, with a byte no build writes at its end: %v, want ErrBadSnapshot naming the %s", c.name, c.bad, err, c.names)
		}
	}
}

// TestTheClockDeletesAnEarlierBuildsHorizon pins that the sweeps' clock
// ('c'), written over a state of an earlier build that holds its expiry
// horizon ('l'), deletes the horizon (journal.Clock): the state then
// holds no 'l', and a snapshot saved from it restores. Under the
// sabotage of that delete taken out every raftfsm test passed; the state
// then held both, which the state never writes together, and a snapshot
// saved from it was refused at restore as not canonical.
func TestTheClockDeletesAnEarlierBuildsHorizon(t *testing.T) {
	var e enc
	e.sv(int64(500))
	stream := buildStream(3, []rec{{k: []byte{store.KindLoadMeta, loadMetaHorizon}, v: e.b}}, nil, map[byte]uint64{store.KindLoadMeta: 1})
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	if err := f.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatal(err)
	}
	w := logWriter{index: 50} // past the stream's applied index, 42
	f.ApplyBatch([]*raft.Log{w.next(encodeExpire(1000, 10))})
	snap := snapshotBytes(t, f) // commits the group batch
	var keys []string
	if err := f.db.Scan(store.KindLoadMeta, func(k, _ []byte) error {
		keys = append(keys, string(k))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || keys[0] != string(rune(loadMetaClock)) {
		t.Errorf("load meta records after the sweep over an earlier build's horizon: %q, want the clock %q alone", keys, string(rune(loadMetaClock)))
	}
	g := openTestFSM(t, filepath.Join(t.TempDir(), "restored"))
	defer g.Close()
	if err := g.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatalf("restore of a snapshot saved after the sweep: %v, want it restored", err)
	}
	if g.Digest() != f.Digest() {
		t.Fatalf("restored: digest %#x, want %#x", g.Digest(), f.Digest())
	}
}
