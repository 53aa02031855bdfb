package raftfsm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
)

// rec is one record of a hand-built stream.
type rec struct{ k, v []byte }

// buildStream lays out a stream by hand, as the format comment says:
// version 1 with the counts in the header, version 2 with them after the
// records. headCounts and tailCounts override what is written there.
func buildStream(version uint32, recs []rec, headCounts, tailCounts map[byte]uint64) []byte {
	inOrder := func(c map[byte]uint64) []kindCount {
		if c == nil {
			return nil
		}
		l := []kindCount{}
		for k := 0; k < 256; k++ {
			if n, ok := c[byte(k)]; ok {
				l = append(l, kindCount{byte(k), n})
			}
		}
		return l
	}
	return buildStreamCounts(version, recs, inOrder(headCounts), inOrder(tailCounts))
}

// kindCount is one entry of a count block.
type kindCount struct {
	kind byte
	n    uint64
}

// buildStreamCounts is buildStream with its count blocks written entry by
// entry, as given (a kind may be named twice); a nil tailCounts writes no
// block after the records.
func buildStreamCounts(version uint32, recs []rec, headCounts, tailCounts []kindCount) []byte {
	countBlock := func(c []kindCount) []byte {
		b := []byte{byte(len(c))}
		for _, e := range c {
			b = append(b, e.kind)
			b = binary.LittleEndian.AppendUint64(b, e.n)
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

// TestSnapshotFormatVersions: a version 4 stream (version 3 whose load
// meta may be the sweeps' clock), a version 3 stream (version 2 whose
// cursors may carry an incarnation), a version 2 stream (counts after the records,
// written in one pass) and a version 1 stream (counts in the header) are
// all read, and a stream whose counts disagree with its records, or that
// puts them in the wrong place, or of a later version or of version 0,
// or whose count block names a kind twice (even when the last count of
// it is right), is refused; wantMsg, where given, is in the refusal.
func TestSnapshotFormatVersions(t *testing.T) {
	recs := []rec{{[]byte{store.KindCursor, 1}, []byte("c")}, {[]byte{store.KindCursor, 2}, []byte("d")},
		{[]byte{store.KindWorker, 1}, []byte("w")}}
	counts := map[byte]uint64{store.KindCursor: 2, store.KindWorker: 1}
	twice := []kindCount{{store.KindCursor, 5}, {store.KindWorker, 1}, {store.KindCursor, 2}}
	for _, tc := range []struct {
		name       string
		stream     []byte
		wantErr    bool
		wantFormat uint32
		wantMsg    string
	}{
		{"version 4", buildStream(4, recs, nil, counts), false, 4, ""},
		{"version 3", buildStream(3, recs, nil, counts), false, 3, ""},
		{"version 2", buildStream(2, recs, nil, counts), false, 2, ""},
		{"version 1", buildStream(1, recs, counts, nil), false, 1, ""},
		{"version 2, a count short", buildStream(2, recs, nil, map[byte]uint64{store.KindCursor: 1, store.KindWorker: 1}), true, 0, ""},
		{"version 2, a kind missing", buildStream(2, recs, nil, map[byte]uint64{store.KindCursor: 2}), true, 0, ""},
		{"version 2, counts in the header", buildStream(2, recs, counts, counts), true, 0, ""},
		{"version 1, counts short", buildStream(1, recs, map[byte]uint64{store.KindCursor: 2}, nil), true, 0, ""},
		{"version 3, counts in the header", buildStream(3, recs, counts, counts), true, 0, ""},
		{"version 5", buildStream(5, recs, nil, counts), true, 0, "format version 5"},
		// Laid out as version 1 is, so that only the version refuses it.
		{"version 0", buildStream(0, recs, counts, nil), true, 0, "format version 0"},
		{"version 1, a kind counted twice", buildStreamCounts(1, recs, twice, nil), true, 0, "counted twice"},
		{"version 2, a kind counted twice", buildStreamCounts(2, recs, nil, twice), true, 0, "counted twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			info, err := InspectSnapshot(bytes.NewReader(tc.stream))
			if tc.wantErr {
				if !errors.Is(err, ErrBadSnapshot) || !strings.Contains(fmt.Sprint(err), tc.wantMsg) {
					t.Fatalf("read %+v, %v; want ErrBadSnapshot, %q", info, err, tc.wantMsg)
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

// errAtEOF reads r and answers err where r would end: a stream whose
// connection or disk fails after its last byte.
type errAtEOF struct {
	r   io.Reader
	err error
}

func (e *errAtEOF) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err == io.EOF {
		return n, e.err
	}
	return n, err
}

// TestSnapshotReadErrorAfterTheChecksum: a read error where the stream
// should end (a failing disk or a dropped connection after the checksum)
// is that error, not ErrBadSnapshot: only a byte read past the checksum
// makes the file corrupt. From a review: any error there was reported as
// "trailing bytes after the checksum", hiding the real one.
func TestSnapshotReadErrorAfterTheChecksum(t *testing.T) {
	stream := buildStream(snapshotVersion, nil, map[byte]uint64{}, map[byte]uint64{})
	if _, err := InspectSnapshot(bytes.NewReader(stream)); err != nil {
		t.Fatalf("clean stream: %v", err)
	}
	ioErr := errors.New("connection reset")
	_, err := InspectSnapshot(&errAtEOF{r: bytes.NewReader(stream), err: ioErr})
	if !errors.Is(err, ioErr) || errors.Is(err, ErrBadSnapshot) {
		t.Errorf("I/O error after the checksum: err %v, want the I/O error and not ErrBadSnapshot", err)
	}
	// A byte past the checksum is still a corrupt file, whatever follows it.
	_, err = InspectSnapshot(&errAtEOF{r: bytes.NewReader(append(bytes.Clone(stream), 1)), err: ioErr})
	if !errors.Is(err, ErrBadSnapshot) {
		t.Errorf("a byte past the checksum: err %v, want ErrBadSnapshot", err)
	}
}

// batchStream builds a version 2 stream of n cursor records of 1 KiB each
// (key and value), record i keyed i, so that recBatchBytes/1024 records
// make a batch; dup, if not negative, makes record dup a copy of the one
// before it (a key out of order).
func batchStream(n, dup int) []byte {
	recs := make([]rec, n)
	for i := range recs {
		j := i
		if i == dup {
			j = i - 1
		}
		k := binary.BigEndian.AppendUint64([]byte{store.KindCursor}, uint64(j))
		recs[i] = rec{k, bytes.Repeat([]byte{byte(i)}, 1024-len(k))}
	}
	return buildStream(2, recs, nil, map[byte]uint64{store.KindCursor: uint64(n)})
}

// TestSnapshotLoadAcrossBatches: a stream of several batches loads whole
// (one table per batch, written on several goroutines), and a key out of
// order is found where one batch meets the next, and inside a batch, and
// wins over a truncation further on, as it did when one goroutine did it
// all.
func TestSnapshotLoadAcrossBatches(t *testing.T) {
	per := recBatchBytes / 1024
	n := 3*per + 17
	dir := filepath.Join(t.TempDir(), "fsm")
	info, err := loadSnapshot(bytes.NewReader(batchStream(n, -1)), dir, 0, 0, false, quiet, nil)
	if err != nil {
		t.Fatal(err)
	}
	if info.Records[store.KindName(store.KindCursor)] != int64(n) {
		t.Fatalf("info %+v", info)
	}
	db, err := store.OpenState(dir, store.StateOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	err = db.Scan(store.KindCursor, func(k, v []byte) error {
		// Scan hands over the key without its kind byte.
		if want := binary.BigEndian.AppendUint64(nil, uint64(got)); !bytes.Equal(k, want) || len(k)+len(v) != 1023 || v[0] != byte(got) {
			return fmt.Errorf("record %d: key %x", got, k)
		}
		got++
		return nil
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil || got != n {
		t.Fatalf("%d records back, want %d: %v", got, n, err)
	}

	for _, tc := range []struct {
		name     string
		dup, cut int
	}{
		{"at a batch boundary", per, 0},
		{"at the second boundary", 2 * per, 0},
		{"inside a batch", per + 5, 0},
		{"then truncated", 2*per + 3, 3000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			stream := batchStream(n, tc.dup)
			stream = stream[:len(stream)-tc.cut]
			dir := filepath.Join(t.TempDir(), "fsm")
			_, err := loadSnapshot(bytes.NewReader(stream), dir, 0, 0, false, quiet, nil)
			if !errors.Is(err, ErrBadSnapshot) || !strings.Contains(err.Error(), "out of order") {
				t.Fatalf("load: %v, want ErrBadSnapshot for keys out of order", err)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Fatalf("a failed load left %s: %v", dir, err)
			}
		})
	}
	t.Run("truncated", func(t *testing.T) {
		stream := batchStream(n, -1)
		_, err := loadSnapshot(bytes.NewReader(stream[:len(stream)/2]), filepath.Join(t.TempDir(), "fsm"), 0, 0, false, quiet, nil)
		if !errors.Is(err, ErrBadSnapshot) || !strings.Contains(err.Error(), "truncated") {
			t.Fatalf("load: %v, want ErrBadSnapshot for a truncated stream", err)
		}
	})
}

// FuzzRestoreRecords: snapshot streams with a good checksum and counts
// around fuzzed records (each: a kind byte, a key and a value of lengths
// the input gives), restored into a fresh FSM. Nothing may panic. A stream
// that is refused leaves the state as it was; a stream that restores
// gives the state a start then loads from the new directory; none fails
// the node (records that decode but do not make a consistent state are
// refused before the swap).
func FuzzRestoreRecords(f *testing.F) {
	f.Add([]byte{store.KindNode, 8, 17, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 1})
	f.Add([]byte{store.KindEntry, 20, 13})
	f.Add([]byte{store.KindCursor, 12, 8, store.KindWorker, 8, 3})
	f.Add([]byte{store.KindCursor, 12, 16}) // a cursor with an incarnation
	f.Fuzz(func(t *testing.T, in []byte) {
		var recs []rec
		counts := map[byte]uint64{}
		for len(in) >= 3 && len(recs) < 64 {
			kind, kl, vl := in[0], int(in[1]%32), int(in[2]%64)
			in = in[3:]
			k := append([]byte{kind}, make([]byte, kl)...)
			n := copy(k[1:], in)
			in = in[n:]
			v := make([]byte, vl)
			n = copy(v, in)
			in = in[n:]
			recs = append(recs, rec{k: k, v: v})
			counts[kind]++
		}
		stream := buildStream(snapshotVersion, recs, map[byte]uint64{}, counts)
		dir := filepath.Join(t.TempDir(), "fsm")
		g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
		if err != nil {
			t.Fatal(err)
		}
		before := g.Digest()
		err = g.Restore(nopCloser{bytes.NewReader(stream)})
		if err != nil {
			if g.Digest() != before {
				t.Fatalf("a refused stream (%v) changed the state", err)
			}
			g.Close()
			return
		}
		restored := g.Digest()
		g.Close()
		h, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { t.Fatal(err) }})
		if err != nil {
			t.Fatalf("restored directory does not open: %v", err)
		}
		defer h.Close()
		if h.Digest() != restored {
			t.Fatalf("restore built digest %#x, the directory loads %#x", restored, h.Digest())
		}
	})
}

// FuzzRestoreStream: raw bytes as a snapshot stream, so the outer framing
// (magic, version, header, counts, checksum trailer) is fuzzed too, not
// only the records (FuzzRestoreRecords). Seeded with a real stream, a
// truncated one, one with a byte past the checksum and bit-flipped ones,
// which InspectSnapshot must refuse with ErrBadSnapshot. Nothing may panic; a FSM holding a
// state that refuses a stream keeps it exactly, and one that restores a
// stream loads the same state back from its directory. A stream the
// online restore's and the seed's check (checkSnapshot) passes must
// restore (Raft's user restore panics when the FSM refuses one), and one
// that restores must be one InspectSnapshot reads.
//
// The FSM holding the fixture's state is built once per fuzzing process
// and kept from input to input: a refused stream leaves it as it was (the
// property checked), and one that restores is followed by a restore of
// the fixture's own snapshot. Opening a FSM and applying the fixture for
// every input, most of them refused, ran some 0.2 s per input.
func FuzzRestoreStream(f *testing.F) {
	// The input running, for the FSM's OnFatal, which outlives each one.
	var cur atomic.Pointer[testing.T]
	open := func(tb testing.TB, dir string) *FSM {
		tb.Helper()
		g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) {
			if t := cur.Load(); t != nil {
				t.Errorf("fatal: %v", err)
				return
			}
			f.Errorf("fatal: %v", err)
		}})
		if err != nil {
			tb.Fatal(err)
		}
		return g
	}
	dir := filepath.Join(f.TempDir(), "fsm")
	g := open(f, dir)
	defer func() { g.Close() }()
	var w logWriter
	applyFixture(f, g, &w)
	snap := snapshotBytes(f, g)
	fixture := g.Digest()
	f.Add(snap)
	bads := [][]byte{{}, snap[:len(snap)/2], snap[:len(snap)-1], append(slices.Clone(snap), 0)}
	for _, at := range []int{0, 5, 12, len(snap) / 2, len(snap) - 3} {
		flipped := slices.Clone(snap)
		flipped[at] ^= 0x10
		bads = append(bads, flipped)
	}
	for i, b := range bads {
		// The seeds other than the real stream are corrupt: refused.
		if _, err := InspectSnapshot(bytes.NewReader(b)); !errors.Is(err, ErrBadSnapshot) {
			f.Fatalf("corrupt seed %d: InspectSnapshot = %v, want ErrBadSnapshot", i, err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		cur.Store(t)
		defer cur.Store(nil)
		if d := g.Digest(); d != fixture {
			t.Fatalf("the FSM holds digest %#x before the input, want the fixture's %#x", d, fixture)
		}
		_, ierr := InspectSnapshot(bytes.NewReader(in))
		_, cerr := checkSnapshot(bytes.NewReader(in), indexer.New(indexer.Config{}))
		err := g.Restore(nopCloser{bytes.NewReader(in)})
		if err != nil {
			if g.Digest() != fixture {
				t.Fatalf("a refused stream (%v) changed the state", err)
			}
			if cerr == nil {
				t.Fatalf("checkSnapshot passed a stream the restore refuses: %v", err)
			}
			return
		}
		if ierr != nil {
			t.Fatalf("a stream InspectSnapshot refuses (%v) restored", ierr)
		}
		restored := g.Digest()
		g.Close()
		g = open(t, dir)
		if g.Digest() != restored {
			t.Fatalf("restore built digest %#x, the directory loads %#x", restored, g.Digest())
		}
		// Back to the fixture's state for the next input.
		if err := g.Restore(nopCloser{bytes.NewReader(snap)}); err != nil || g.Digest() != fixture {
			t.Fatalf("the fixture's snapshot restored: %v, digest %#x, want %#x", err, g.Digest(), fixture)
		}
	})
}

// TestSeedDataDirChecksTheStream: seeding a new node's directory refuses a
// stream whose records do not make a consistent state, writing nothing,
// and seeds one that does.
func TestSeedDataDirChecksTheStream(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	orphanEntry := rec{k: append([]byte{store.KindEntry}, make([]byte, 20)...), v: []byte{0, 0, 0, 0, 0, 0, 0, 5, 1, 0, 0, 0, 1}}
	bad := filepath.Join(t.TempDir(), "bad.snap")
	if err := os.WriteFile(bad, buildStream(snapshotVersion, []rec{orphanEntry}, map[byte]uint64{}, map[byte]uint64{store.KindEntry: 1}), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "node")
	if err := SeedDataDir(context.Background(), bad, dir, "n1", peers); !errors.Is(err, ErrBadSnapshot) {
		t.Fatalf("seed from an inconsistent stream: %v, want ErrBadSnapshot", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "fsm")); !os.IsNotExist(err) {
		t.Fatalf("a refused seed left %s/fsm behind", dir)
	}

	f, good := fixtureSnapshotFile(t)
	// What a seed killed part-way leaves: its half-built state beside
	// fsm/, not in it. From a review: it was built in fsm/, and a killed
	// seed left a valid, empty state there, which the next seed refused
	// and a node started from.
	half := filepath.Join(dir, "fsm.restore")
	if err := os.MkdirAll(half, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(half, "000001.sst"), []byte("half"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed after a killed one: %v", err)
	}
	if _, err := os.Stat(half); !os.IsNotExist(err) {
		t.Fatalf("the seed left %s", half)
	}
	g := openTestFSM(t, filepath.Join(dir, "fsm"))
	defer g.Close()
	if g.Digest() != f.Digest() {
		t.Fatalf("seeded digest %#x, want %#x", g.Digest(), f.Digest())
	}
}

// TestAnInterruptedSeedWritesNoState: a seed whose context ended (kvctl
// interrupted) stops reading the file, returns the context's error, and
// leaves no state in the directory, neither fsm/ nor its half-built
// fsm.restore. From a review: the seed never looked at the context, so
// Ctrl-C was swallowed until it had written the whole state.
func TestAnInterruptedSeedWritesNoState(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, good := fixtureSnapshotFile(t)
	dir := filepath.Join(t.TempDir(), "node")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := SeedDataDir(ctx, good, dir, "n1", peers); !errors.Is(err, context.Canceled) {
		t.Fatalf("seed with its context ended: %v, want context.Canceled", err)
	}
	for _, sub := range []string{"fsm", "fsm.restore", "snapshots"} {
		if _, err := os.Stat(filepath.Join(dir, sub)); !os.IsNotExist(err) {
			t.Errorf("an interrupted seed left %s/%s (%v)", dir, sub, err)
		}
	}
	// The directory takes a seed afterwards.
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed after an interrupted one: %v", err)
	}
}

// TestSeedIsTheClustersFirstRaftSnapshot: a seeded directory holds the
// state as a Raft snapshot at index 2, term 1 (an entry no bootstrapped
// log holds) whose configuration is the peers, and the state records that
// index and term as applied. From a review of
// docs/operations.md: the seed was in no log and no snapshot, so a node
// added to the seeded cluster was sent the log from its first entry and
// built an empty state (e2e: TestOfflineSeedNewCluster).
func TestSeedIsTheClustersFirstRaftSnapshot(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}, {ID: "n2", RaftAddr: "127.0.0.1:3", HTTPAddr: "127.0.0.1:4"}}
	f, good := fixtureSnapshotFile(t)
	dir := filepath.Join(t.TempDir(), "node")
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatal(err)
	}
	snaps, err := raft.NewFileSnapshotStore(dir, 2, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	list, err := snaps.List()
	if err != nil || len(list) != 1 {
		t.Fatalf("Raft snapshots of the seeded directory: %v, %v; want one", list, err)
	}
	m := list[0]
	if m.Index != 2 || m.Term != 1 || m.ConfigurationIndex != 2 || len(m.Configuration.Servers) != 2 ||
		m.Configuration.Servers[1].ID != "n2" || m.Configuration.Servers[1].Address != "127.0.0.1:3" {
		t.Fatalf("seed snapshot %+v: want index 2, term 1, the peers as configuration", m)
	}
	_, rc, err := snaps.Open(m.ID)
	if err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer g.Close()
	if err := g.Restore(rc); err != nil {
		t.Fatal(err)
	}
	if g.Digest() != f.Digest() {
		t.Fatalf("the seed snapshot's digest %#x, want the file's %#x", g.Digest(), f.Digest())
	}
	h := openTestFSM(t, filepath.Join(dir, "fsm"))
	defer h.Close()
	if idx, term := h.Applied(); idx != 2 || term != 1 {
		t.Fatalf("the seeded state is at %d/%d, want index 2, term 1 (the snapshot's)", idx, term)
	}
}

// TestSeedDropsTheSavedClustersMemberTable: a seeded directory holds none
// of the saved cluster's member table (its addresses are another
// cluster's, which forwarding and `members list` must not use): the new
// cluster's leader writes its own from --peers. The rest of the state is
// the file's. From a review: nothing failed with the seed keeping the
// old table.
func TestSeedDropsTheSavedClustersMemberTable(t *testing.T) {
	f, snap := fixtureSnapshot(t)
	if len(f.Members()) == 0 {
		t.Fatal("the fixture has no member table")
	}
	file := filepath.Join(t.TempDir(), "good.snap")
	if err := os.WriteFile(file, snap, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "node")
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:7000", HTTPAddr: "127.0.0.1:7080"}}
	if err := SeedDataDir(context.Background(), file, dir, "n1", peers); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, filepath.Join(dir, "fsm"))
	defer g.Close()
	if m := g.Members(); len(m) != 0 {
		t.Fatalf("the seeded state holds the saved cluster's member table %v", m)
	}
	if g.Digest() != f.Digest() {
		t.Fatalf("seeded digest %#x, want the saved %#x", g.Digest(), f.Digest())
	}
}

// TestSeedDataDirRefusesRaftSnapshots: a directory whose fsm/ and raft/
// were removed but whose snapshots/ holds one is refused. From a review:
// it was seeded, and the node, finding Raft state, did not bootstrap and
// restored the old snapshot over the seed. An empty snapshots/ is fine.
func TestSeedDataDirRefusesRaftSnapshots(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, snap := fixtureSnapshot(t)
	good := filepath.Join(t.TempDir(), "good.snap")
	if err := os.WriteFile(good, snap, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "node")
	snaps, err := raft.NewFileSnapshotStore(dir, 2, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	conf := raft.Configuration{Servers: []raft.Server{{Suffrage: raft.Voter, ID: "n1", Address: "127.0.0.1:1"}}}
	sink, err := snaps.Create(raft.SnapshotVersionMax, 43, 2, conf, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write(snap); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(dir, "snapshots", sink.ID())
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); !errors.Is(err, ErrInvalid) {
		t.Fatalf("seed into a directory holding a Raft snapshot: %v, want ErrInvalid", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "fsm")); !os.IsNotExist(err) {
		t.Fatalf("a refused seed wrote %s/fsm", dir)
	}
	if err := os.RemoveAll(old); err != nil {
		t.Fatal(err)
	}
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed into a directory with an empty snapshots/: %v", err)
	}
}

// TestSeedDataDirRefusesNodeState: a directory that holds a node's fsm/
// or raft/ (a node ran on it, or was seeded) is refused, ErrInvalid, and
// the seed writes nothing into it: no fsm.restore/, no snapshots/, no
// Raft snapshot; only its lock (LOCK), taken before it looks, is left.
// Seeded, a node would start on the old state, or the seed's state would
// be renamed over it. No test pinned this refusal: only the Raft
// snapshot's (TestSeedDataDirRefusesRaftSnapshots).
func TestSeedDataDirRefusesNodeState(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, good := fixtureSnapshotFile(t)
	for _, sub := range []string{"fsm", "raft"} {
		t.Run(sub, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "node")
			for _, d := range []string{sub, "lost+found"} {
				if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(dir, sub, "state"), []byte("a node's"), 0o644); err != nil {
				t.Fatal(err)
			}
			before := treeOf(t, dir)
			err := SeedDataDir(context.Background(), good, dir, "n1", peers)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "already holds node state") {
				t.Errorf("seed into a directory holding %s/: %v, want ErrInvalid, already holds node state", sub, err)
			}
			after := treeOf(t, dir)
			delete(after, lockFile)
			if !maps.Equal(before, after) {
				t.Fatalf("a refused seed changed %s: %v before, %v after (LOCK left out)", dir, before, after)
			}
		})
	}
}

// treeOf lists what dir holds, each path relative to it with its size
// (-1 for a directory).
func treeOf(t *testing.T, dir string) map[string]int64 {
	t.Helper()
	tree := map[string]int64{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		size := int64(-1)
		if !d.IsDir() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			size = fi.Size()
		}
		tree[rel] = size
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return tree
}

// TestSeedDataDirTakesASnapshotsDirWithoutRaftSnapshots: a snapshots/
// that holds a plain file, or a directory without the meta.json Raft
// reads, holds no Raft snapshot (Raft lists none, and a node would start
// on the directory as an empty one): the seed takes the directory and
// leaves those alone, as docs/operations.md promises (it refuses only
// fsm/, raft/ or a Raft snapshot in snapshots/). From a review: any entry
// but a NAME.tmp/ was taken for a Raft snapshot, and the seed refused.
func TestSeedDataDirTakesASnapshotsDirWithoutRaftSnapshots(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:7000", HTTPAddr: "127.0.0.1:7080"}}
	_, good := fixtureSnapshotFile(t)
	dir := filepath.Join(t.TempDir(), "node")
	note := filepath.Join(dir, "snapshots", "README")
	noMeta := filepath.Join(dir, "snapshots", "2-43-1700000000000")
	if err := os.MkdirAll(noMeta, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(note, []byte("backups go elsewhere\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	snaps, err := raft.NewFileSnapshotStore(dir, 2, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if list, err := snaps.List(); err != nil || len(list) != 0 {
		t.Fatalf("Raft lists %v, %v in the directory before the seed; want none", list, err)
	}
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed of a directory whose snapshots/ holds no Raft snapshot: %v", err)
	}
	if list, err := snaps.List(); err != nil || len(list) != 1 || list[0].Index != 2 {
		t.Fatalf("Raft snapshots of the seeded directory: %v, %v; want the seed's", list, err)
	}
	for _, p := range []string{note, noMeta} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("the seed did not leave %s alone: %v", p, err)
		}
	}
}

// TestSeedAfterAKilledSeedsPartialRaftSnapshot: a seed killed while it
// wrote the Raft snapshot (kvctl's second signal) leaves it half-written
// in snapshots/ as NAME.tmp, which Raft lists as no snapshot: the next
// seed removes it and seeds the directory. From a review: the check took
// it for a Raft snapshot and refused the directory for good.
func TestSeedAfterAKilledSeedsPartialRaftSnapshot(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, good := fixtureSnapshotFile(t)
	dir := filepath.Join(t.TempDir(), "node")
	half := filepath.Join(dir, "snapshots", "1-2-1700000000000.tmp")
	if err := os.MkdirAll(half, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(half, "state.bin"), []byte("half"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed after one killed while it wrote the Raft snapshot: %v", err)
	}
	if _, err := os.Stat(half); !os.IsNotExist(err) {
		t.Fatalf("the seed left %s (%v)", half, err)
	}
	snaps, err := raft.NewFileSnapshotStore(dir, 2, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if list, err := snaps.List(); err != nil || len(list) != 1 || list[0].Index != 2 {
		t.Fatalf("Raft snapshots of the seeded directory: %v, %v; want the seed's", list, err)
	}
}

// TestSeedDataDirLeavesOtherFilesAlone: the seed wants a directory that
// holds no node state (fsm/, raft/, Raft snapshots), not an empty one: a
// mount point's lost+found/ and files that are not a node's are taken and
// left as they are (kvctl snapshot restore --help and docs/operations.md
// say so; they said "empty").
func TestSeedDataDirLeavesOtherFilesAlone(t *testing.T) {
	peers := []Member{{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"}}
	_, good := fixtureSnapshotFile(t)
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "lost+found"), 0o700); err != nil {
		t.Fatal(err)
	}
	note := filepath.Join(dir, "README")
	if err := os.WriteFile(note, []byte("kvrouter n1"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := SeedDataDir(context.Background(), good, dir, "n1", peers); err != nil {
		t.Fatalf("seed into a directory with lost+found/ and a README: %v", err)
	}
	if b, err := os.ReadFile(note); err != nil || string(b) != "kvrouter n1" {
		t.Fatalf("%s after the seed: %q, %v; want it as it was", note, b, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "lost+found")); err != nil || !fi.IsDir() {
		t.Fatalf("lost+found after the seed: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "fsm")); err != nil {
		t.Fatalf("the seed wrote no fsm/: %v", err)
	}
}

// TestRestoreRefusesABadOrphan: a rank's held orphan of an unknown tier
// is refused at restore (ErrBadSnapshot, state unchanged); loaded, it
// would have failed the apply that later adopts it, on every replica.
func TestRestoreRefusesABadOrphan(t *testing.T) {
	var e enc
	encodeRankMeta(&e, &indexer.RankMeta{Orphans: []indexer.DumpOrphan{{Tier: kvevent.Tier(7), Parent: 1, Blocks: []kvevent.Block{{EngineHash: 2, LocalHash: 3}}}}})
	k := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64([]byte{store.KindRank}, 1), 0)
	stream := buildStream(snapshotVersion, []rec{{k: k, v: e.b}}, map[byte]uint64{}, map[byte]uint64{store.KindRank: 1})
	g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer g.Close()
	before := g.Digest()
	if err := g.Restore(nopCloser{bytes.NewReader(stream)}); !errors.Is(err, ErrBadSnapshot) {
		t.Fatalf("restore of a bad orphan: %v, want ErrBadSnapshot", err)
	}
	if g.Digest() != before {
		t.Fatal("a refused restore changed the state")
	}
}

// TestRestoreRefusesALongKey: a record key longer than a command could
// write (an id over maxKeyID) is refused at restore. One of 65536 bytes
// passed before and wrapped the state database's 16-bit key length at the
// next group commit, which then failed on every replica.
func TestRestoreRefusesALongKey(t *testing.T) {
	for _, n := range []int{maxKeyID + 1, 1<<16 - 1, 1 << 16} {
		id := strings.Repeat("x", n)
		var e enc
		encodeBooking(&e, &indexer.Booking{ID: id, Rank: r1, ISL: 1, CreatedAt: 1})
		stream := buildStream(snapshotVersion, []rec{{k: append([]byte{store.KindBooking}, id...), v: e.b}},
			map[byte]uint64{}, map[byte]uint64{store.KindBooking: 1})
		g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
		if err := g.Restore(nopCloser{bytes.NewReader(stream)}); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("restore of a booking id of %d bytes: %v, want ErrBadSnapshot", n, err)
		}
		if _, err := checkSnapshot(bytes.NewReader(stream), indexer.New(indexer.Config{})); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("check of a booking id of %d bytes: %v, want ErrBadSnapshot", n, err)
		}
		g.Close()
	}
}

// TestCheckRefusesKeysOutOfOrder: a stream whose checksum and counts are
// good but two records of one kind are swapped (or one is repeated) is
// refused by the check before a user restore, as the restore refuses it.
// From a review: the check only checked the kinds' order, and Raft's user
// restore panics when FSM.Restore fails, which took the process down.
func TestCheckRefusesKeysOutOfOrder(t *testing.T) {
	_, snap := fixtureSnapshot(t)
	s := newSnapReader(bytes.NewReader(snap))
	if err := s.header(); err != nil {
		t.Fatal(err)
	}
	var recs []rec
	counts := map[byte]uint64{}
	for {
		k, v, err := s.next()
		if err != nil {
			t.Fatal(err)
		}
		if k == nil {
			break
		}
		recs = append(recs, rec{bytes.Clone(k), bytes.Clone(v)})
		counts[k[0]]++
	}
	i := 0 // two neighbours of one kind: i and i+1
	for i+1 < len(recs) && recs[i].k[0] != recs[i+1].k[0] {
		i++
	}
	if i+1 == len(recs) {
		t.Fatal("the fixture has no two records of one kind")
	}
	swapped := slices.Clone(recs)
	swapped[i], swapped[i+1] = swapped[i+1], swapped[i]
	repeated := slices.Clone(recs)
	repeated[i+1] = repeated[i]
	for name, rs := range map[string][]rec{"swapped": swapped, "repeated": repeated} {
		stream := buildStream(snapshotVersion, rs, map[byte]uint64{}, counts)
		if _, err := checkSnapshot(bytes.NewReader(stream), indexer.New(indexer.Config{})); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("check of a stream with two records %s: %v, want ErrBadSnapshot", name, err)
		}
		g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
		if err := g.Restore(nopCloser{bytes.NewReader(stream)}); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("restore of a stream with two records %s: %v, want ErrBadSnapshot", name, err)
		}
		g.Close()
	}
	if _, err := checkSnapshot(bytes.NewReader(buildStream(snapshotVersion, recs, map[byte]uint64{}, counts)), indexer.New(indexer.Config{})); err != nil {
		t.Fatalf("the stream rebuilt unchanged: %v", err)
	}
}

// TestStaleNoOpsDoNotStandForTheSnapshot: at start, a state behind the
// newest snapshot skips the restore only when the log's entries up to the
// snapshot hold no command and the entry at its index is the snapshot's
// own. From a review: after a crash between Raft's install of a leader's
// snapshot and its restore, the log still held a deposed leader's
// uncommitted no-ops at those indexes, and the restore was skipped.
func TestStaleNoOpsDoNotStandForTheSnapshot(t *testing.T) {
	dir := t.TempDir()
	f, snap := fixtureSnapshot(t)
	logs, err := store.OpenLogStore(filepath.Join(dir, "raft"), store.LogStoreOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	// Entries 1-3 are no-ops of term 1; the snapshot is at 3, term 2.
	for i := uint64(1); i <= 3; i++ {
		if err := logs.StoreLog(&raft.Log{Index: i, Term: 1, Type: raft.LogNoop}); err != nil {
			t.Fatal(err)
		}
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dir, 2, hclogAdapter(quiet))
	if err != nil {
		t.Fatal(err)
	}
	sink, err := snaps.Create(raft.SnapshotVersionMax, 3, 2, raft.Configuration{}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write(snap); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, filepath.Join(dir, "fsm"))
	defer g.Close()
	n := &Node{logger: quiet, logs: logs, snaps: snaps, fsm: g}
	if err := n.catchUpFromSnapshot(); err != nil {
		t.Fatal(err)
	}
	if g.Digest() != f.Digest() {
		t.Fatalf("state digest %#x after the start, want the snapshot's %#x", g.Digest(), f.Digest())
	}
}

// seedFixture seeds a directory for n1 (at a free loopback address) and
// the peers peersFor gives, from the fixture; it returns the fixture's
// digest, the directory, a cluster to make transports, and n1 alone as
// peers.
func seedFixture(t *testing.T, peersFor func(addr string) []Member) (uint64, string, *testCluster, []Member) {
	t.Helper()
	c := &testCluster{t: t}
	tr := c.transport("127.0.0.1:0")
	addr := string(tr.LocalAddr())
	tr.Close()
	f, snap := fixtureSnapshot(t)
	file := filepath.Join(t.TempDir(), "b.snap")
	if err := os.WriteFile(file, snap, 0o644); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "n1")
	if err := SeedDataDir(context.Background(), file, dir, "n1", peersFor(addr)); err != nil {
		t.Fatal(err)
	}
	return f.Digest(), dir, c, []Member{{ID: "n1", RaftAddr: addr, HTTPAddr: "http-n1"}}
}

// TestSeedKilledBeforeItsRenameRestoresAtStart: a seed killed after its
// Raft snapshot was written, before fsm/ was renamed into place: the start
// restores the snapshot, at applied index 2 (the seed's), with the file's
// state.
func TestSeedKilledBeforeItsRenameRestoresAtStart(t *testing.T) {
	digest, dir, c, self := seedFixture(t, func(a string) []Member { return []Member{{ID: "n1", RaftAddr: a, HTTPAddr: "http-n1"}} })
	if err := os.Rename(filepath.Join(dir, "fsm"), filepath.Join(dir, "fsm.restore")); err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{}) // nothing applied past the snapshot
	n, err := NewNode(Config{ID: "n1", RaftAddr: self[0].RaftAddr, HTTPAddr: "http-n1", DataDir: dir, Peers: self,
		Transport: c.transport(self[0].RaftAddr), Logger: quiet, applyGate: gate})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { close(gate); n.Close() }()
	if i, tm := n.fsm.Applied(); i != 2 || tm != 1 || n.fsm.Digest() != digest {
		t.Fatalf("applied %d/%d digest %#x, want 2/1 %#x", i, tm, n.fsm.Digest(), digest)
	}
}

// TestSeededNodeStartedWithOtherPeersIsRefused: a seeded directory's
// configuration is the seed's; a first start with other --peers is refused
// with what to do, rather than the start's peers silently ignored (a node
// that never elects). From a review.
func TestSeededNodeStartedWithOtherPeersIsRefused(t *testing.T) {
	_, dir, c, self := seedFixture(t, func(a string) []Member {
		return []Member{{ID: "n1", RaftAddr: a, HTTPAddr: "http-n1"}, {ID: "n2", RaftAddr: "127.0.0.1:9", HTTPAddr: "http-n2"}}
	})
	n, err := NewNode(Config{ID: "n1", RaftAddr: self[0].RaftAddr, HTTPAddr: "http-n1", DataDir: dir, Peers: self,
		Transport: c.transport(self[0].RaftAddr), Logger: quiet})
	if err == nil {
		n.Close()
		t.Fatal("a seeded node started with other --peers than the seed's: started")
	}
	wantRefused(t, "start with other peers than the seed's", err, ErrStartRefused, "n2=127.0.0.1:9")
}

// TestOverlongLengthIsABadSnapshot: a record length of more than 64 bits
// (a bit flip can make one) is a bad snapshot, which the API answers 400
// bad_snapshot, not a read error (500), wherever the stream is read; and
// the FSM keeps its state. From a review.
func TestOverlongLengthIsABadSnapshot(t *testing.T) {
	build := func(tail []byte) []byte {
		b := []byte(snapshotMagic)
		b = binary.LittleEndian.AppendUint32(b, snapshotVersion)
		b = binary.LittleEndian.AppendUint64(b, 42)
		b = binary.LittleEndian.AppendUint64(b, 3)
		b = append(b, 0)
		b = append(b, tail...)
		sum := sha256.Sum256(b)
		return append(b, sum[:]...)
	}
	over := bytes.Repeat([]byte{0xff}, 10)
	cases := map[string][]byte{
		"key length":   build(append(slices.Clone(over), make([]byte, 64)...)),
		"value length": build(append(append([]byte{2, store.KindCursor, 1}, over...), make([]byte, 64)...)),
	}
	for name, stream := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := InspectSnapshot(bytes.NewReader(stream)); !errors.Is(err, ErrBadSnapshot) {
				t.Errorf("inspect: %v, want ErrBadSnapshot", err)
			}
			if _, err := checkSnapshot(bytes.NewReader(stream), indexer.New(indexer.Config{})); !errors.Is(err, ErrBadSnapshot) {
				t.Errorf("check (the online restore's): %v, want ErrBadSnapshot", err)
			}
			f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
			defer f.Close()
			var w logWriter
			f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 7, BlockSize: 16}))})
			if err := f.Restore(nopCloser{bytes.NewReader(stream)}); !errors.Is(err, ErrBadSnapshot) {
				t.Errorf("restore: %v, want ErrBadSnapshot", err)
			}
			if _, ok := f.Workers()[7]; !ok {
				t.Errorf("the refused restore lost worker 7: %v", f.Workers())
			}
		})
	}
}

// TestATruncatedRecordAllocatesOnlyTheBytesItHolds: a stream of a few
// dozen bytes whose one record announces a value of maxRecordBytes (64
// MiB) and then ends is refused as truncated, by the inspection and by
// the check before a user restore, without allocating the length it
// announces. From a review: the reader allocated the whole value before
// reading it, 64 MiB for a 37-byte upload.
func TestATruncatedRecordAllocatesOnlyTheBytesItHolds(t *testing.T) {
	b := []byte(snapshotMagic)
	b = binary.LittleEndian.AppendUint32(b, snapshotVersion)
	b = binary.LittleEndian.AppendUint64(b, 1)
	b = binary.LittleEndian.AppendUint64(b, 1)
	b = append(b, 0)                            // no counts in the header
	b = append(b, 2, store.KindWorker, 1)       // a key of 2 bytes
	b = binary.AppendUvarint(b, maxRecordBytes) // a value of 64 MiB...
	b = append(b, 'x')                          // ...of which one byte is there
	for name, read := range map[string]func() error{
		"inspect": func() error { _, err := InspectSnapshot(bytes.NewReader(b)); return err },
		"check": func() error {
			_, err := checkSnapshot(bytes.NewReader(b), indexer.New(indexer.Config{}))
			return err
		},
	} {
		var m0, m1 runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m0)
		err := read()
		runtime.ReadMemStats(&m1)
		if !errors.Is(err, ErrBadSnapshot) || !strings.Contains(err.Error(), "truncated") {
			t.Errorf("%s: %v, want ErrBadSnapshot for a truncated stream", name, err)
		}
		if d := m1.TotalAlloc - m0.TotalAlloc; d > 8<<20 {
			t.Errorf("%s of a %d-byte stream allocated %d MiB", name, len(b), d>>20)
		}
	}
}

// TestUnseededPeerGetsTheSeedBySnapshot: a seeded cluster whose third node
// was started with the same --peers on an empty directory (the operator
// forgot to seed it) bootstraps it, and the seeded nodes send it the seed
// by a snapshot. From a review: the seed's snapshot was at index 1, term
// 1, the very entry a bootstrap writes, so Raft took the two logs for
// matching and never sent the seed: the node applied the log from index 2
// on an empty state, reported ready and could lead.
func TestUnseededPeerGetsTheSeedBySnapshot(t *testing.T) {
	c := &testCluster{t: t}
	base := t.TempDir()
	trs := make([]*raft.NetworkTransport, 3)
	for i := 0; i < 3; i++ {
		c.dirs = append(c.dirs, filepath.Join(base, c.id(i)))
		trs[i] = c.transport("127.0.0.1:0")
		c.addrs = append(c.addrs, string(trs[i].LocalAddr()))
		c.nodes = append(c.nodes, nil)
	}
	t.Cleanup(c.close)
	f, snap := fixtureSnapshot(t)
	file := filepath.Join(t.TempDir(), "b.snap")
	if err := os.WriteFile(file, snap, 0o644); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ { // n3 is not seeded
		if err := SeedDataDir(context.Background(), file, c.dirs[i], c.id(i), c.peers()); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 3; i++ {
		c.startOn(i, trs[i])
	}
	l := c.leader()
	if l == c.nodes[2] {
		t.Errorf("n3, which was not seeded, leads the seeded cluster")
	}
	// One command after the seed, so that every node has applied past it.
	if err := l.SetSettings(context.Background(), l.fsm.Settings()); err != nil {
		t.Fatal(err)
	}
	want := l.raft.LastIndex()
	waitFor(t, 10*time.Second, "all nodes to apply the command", func() bool {
		for _, n := range c.nodes {
			if n.raft.AppliedIndex() < want {
				return false
			}
		}
		return true
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.nodes[2].WaitReady(ctx); err != nil {
		t.Errorf("n3 ready: %v", err)
	}
	for i, n := range c.nodes {
		if n.fsm.Digest() != f.Digest() {
			t.Errorf("%s: digest %#x, want the seed's %#x (entries %d, workers %d): it runs in the cluster with an empty state",
				c.id(i), n.fsm.Digest(), f.Digest(), n.fsm.Index().Stats().Entries, len(n.fsm.Workers()))
		}
	}
}

// TestEarlierBuildsSeedStillStarts: a directory seeded by an earlier build
// (its seed snapshot at index 1, term 1) is still a seed: a start with
// other --peers than its own is refused, and one with its peers starts
// with its state.
func TestEarlierBuildsSeedStillStarts(t *testing.T) {
	digest, dir, c, self := seedFixture(t, func(a string) []Member { return []Member{{ID: "n1", RaftAddr: a, HTTPAddr: "http-n1"}} })
	// Made over as an earlier build made it: the same state, recorded as
	// applied at index 1, term 1, and the snapshot there.
	if err := os.RemoveAll(filepath.Join(dir, "snapshots")); err != nil {
		t.Fatal(err)
	}
	if err := seedRaftSnapshotAt(dir, filepath.Join(dir, "fsm"), self, legacySeedIndex, legacySeedTerm); err != nil {
		t.Fatal(err)
	}
	other := append(slices.Clone(self), Member{ID: "n2", RaftAddr: "127.0.0.1:9", HTTPAddr: "http-n2"})
	n, err := NewNode(Config{ID: "n1", RaftAddr: self[0].RaftAddr, HTTPAddr: "http-n1", DataDir: dir, Peers: other,
		Transport: c.transport(self[0].RaftAddr), Logger: quiet})
	if err == nil {
		n.Close()
		t.Fatal("an earlier build's seed started with other --peers than the seed's: started")
	}
	wantRefused(t, "start with other peers than the seed's", err, ErrStartRefused, "n1=")
	n, err = NewNode(Config{ID: "n1", RaftAddr: self[0].RaftAddr, HTTPAddr: "http-n1", DataDir: dir, Peers: self,
		Transport: c.transport(self[0].RaftAddr), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	waitFor(t, 10*time.Second, "n1 to lead", n.IsLeader)
	if err := n.SetSettings(context.Background(), n.fsm.Settings()); err != nil {
		t.Fatal(err)
	}
	if n.fsm.Digest() != digest {
		t.Fatalf("digest %#x, want the seed's %#x", n.fsm.Digest(), digest)
	}
}
