package raftfsm

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
	"github.com/prometheus/client_golang/prometheus"
)

// The snapshot stream: a whole state database, self-checking.
//
//	header   magic "KVRSNAP\x00", format version (u32 LE), applied index and
//	         term (u64 LE each), a count block (below) that is empty from
//	         version 2 on
//	records  uvarint key length, key (kind byte first), uvarint value
//	         length, value; in key order
//	end      a zero key length
//	counts   version 2 to 4: the count block, so that the writer streams
//	         the database in one pass
//	trailer  SHA-256 of every byte before it
//
// A count block is the number of kinds (u8) and per kind its byte and record
// count (u64 LE). Version 3 is version 2 whose cursor records may carry the
// rank's publisher incarnation (16-byte values, store.PutCursor); version 2
// (every cursor 8 bytes: incarnation 0) and version 1 (counts in the
// header, the writer scanning the database twice) are still read. An
// earlier build refuses version 3 by its version, rather than failing on
// a cursor value it cannot decode. Version 4 is version 3 whose load meta
// record may be the sweeps' clock (key 'c') where it was the expiry
// horizon (key 'l', still read): a build before it would read the clock as
// a horizon, and refuse bookings stamped before the latest sweep.
//
// The version says what a writer may have written; a local state database
// has none, and is read as any version.
//
// Restore checks the counts and the checksum before anything replaces the
// live state, so a truncated or bit-flipped file is refused whole.

const (
	snapshotMagic   = "KVRSNAP\x00"
	snapshotVersion = 4 // written; 1 to 4 are read
	maxRecordBytes  = 64 << 20
)

type fsmSnapshot struct {
	view           *store.StateSnapshot
	logger         *slog.Logger
	persistSeconds prometheus.Histogram
	gen            uint64 // the snapshot store's install generation when it was taken (snapshotStore)
	// since is the FSM's count of the bytes applied since the last
	// snapshot, and bytes what it held when this one was taken: a
	// persisted snapshot takes them off (those applied since stay); one
	// that failed leaves them, as Raft compacts no log for it.
	since *atomic.Int64
	bytes int64
}

// Persist streams the view (raft.FSMSnapshot). The applied index comes
// from the same view as the records. The sink is marked as the FSM's own
// (ownSink): its Close cancels it if a leader's snapshot or a user
// restore was put in place since the view was taken.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	defer observeSince(s.persistSeconds, time.Now())
	ownSink(sink, s.gen)
	if _, err := writeSnapshot(sink, s.view); err != nil {
		sink.Cancel()
		return err
	}
	if err := sink.Close(); err != nil {
		return err
	}
	if s.since != nil {
		// Not below 0: a restore that started the count over (restoreFrom)
		// between the sink's Close and here took these bytes off already.
		for {
			n := s.since.Load()
			if s.since.CompareAndSwap(n, max(n-s.bytes, 0)) {
				break
			}
		}
	}
	return nil
}

// Release closes the view; it always runs, so the Pebble snapshot never leaks.
func (s *fsmSnapshot) Release() { s.view.Close() }

// writeSnapshot writes the stream of a view and returns what it wrote.
func writeSnapshot(w io.Writer, view *store.StateSnapshot) (SnapshotInfo, error) {
	idx, term, err := view.Applied()
	if err != nil {
		return SnapshotInfo{}, err
	}
	return encodeSnapshot(w, idx, term, view.Each)
}

// encodeSnapshot writes a stream (the current format) of the records each
// gives, in key order, and returns what it wrote. The records are encoded
// here while a blockWriter writes and hashes the blocks before them.
func encodeSnapshot(w io.Writer, idx, term uint64, each func(fn func(k, v []byte) error) error) (SnapshotInfo, error) {
	h := sha256.New()
	bw := newBlockWriter(w, h)
	b := append(bw.buf, snapshotMagic...)
	b = binary.LittleEndian.AppendUint32(b, snapshotVersion)
	b = binary.LittleEndian.AppendUint64(b, idx)
	b = binary.LittleEndian.AppendUint64(b, term)
	b = append(b, 0) // the header's count block is empty: counts follow the records
	bw.buf = b
	info := SnapshotInfo{FormatVersion: snapshotVersion, Index: idx, Term: term, Records: map[string]int64{}}
	var counts [256]int64
	err := each(func(k, v []byte) error {
		counts[k[0]]++
		b := binary.AppendUvarint(bw.buf, uint64(len(k)))
		b = append(b, k...)
		b = binary.AppendUvarint(b, uint64(len(v)))
		bw.buf = append(b, v...)
		if len(bw.buf) >= snapWriteBlock {
			return bw.flush()
		}
		return nil
	})
	if err != nil {
		bw.finish()
		return info, fmt.Errorf("write snapshot records: %w", err)
	}
	b = append(bw.buf, 0)
	b = append(b, 0) // the count block's kind count, set below
	nk := len(b) - 1
	for k, n := range counts {
		if n > 0 {
			b[nk]++
			b = append(b, byte(k))
			b = binary.LittleEndian.AppendUint64(b, uint64(n))
			info.Records[store.KindName(byte(k))] = n
		}
	}
	bw.buf = b
	n, err := bw.finish()
	if err != nil {
		return info, fmt.Errorf("write snapshot: %w", err)
	}
	sum := h.Sum(nil)
	if _, err := w.Write(sum); err != nil {
		return info, fmt.Errorf("write snapshot trailer: %w", err)
	}
	info.Bytes = n + int64(len(sum))
	info.SHA256 = hex.EncodeToString(sum)
	return info, nil
}

// snapReader parses a stream while hashing every byte it consumes.
type snapReader struct {
	r    *bufio.Reader
	h    hash.Hash
	n    int64
	buf  []byte
	key  []byte // the last key, reused: callers keep a key only until the next call
	one  [1]byte
	rerr error // the last error of the reader under ReadByte
	info SnapshotInfo
	want map[byte]uint64
	got  [256]uint64
}

func newSnapReader(r io.Reader) *snapReader {
	return &snapReader{r: bufio.NewReaderSize(r, 1<<20), h: sha256.New(), want: map[byte]uint64{}}
}

func (s *snapReader) ReadByte() (byte, error) {
	b, err := s.r.ReadByte()
	if err == nil {
		s.one[0] = b
		s.h.Write(s.one[:])
		s.n++
	}
	s.rerr = err
	return b, err
}

// full reads the next n bytes into s.buf, which it grows as the bytes
// arrive (doubling, from fullChunk) rather than to n at once: n is a
// length the stream gives, up to maxRecordBytes, and a stream that gives
// one without the bytes (a few dozen bytes saying 64 MiB) must not cost
// more memory than it holds, twice over and a chunk.
func (s *snapReader) full(n int) ([]byte, error) {
	p := s.buf[:0]
	for len(p) < n {
		if len(p) == cap(p) {
			p = slices.Grow(p, min(n-len(p), max(len(p), fullChunk)))
		}
		m, err := io.ReadFull(s.r, p[len(p):min(n, cap(p))])
		p = p[:len(p)+m]
		if err != nil {
			s.buf = p[:0]
			return nil, err
		}
	}
	s.buf = p
	s.h.Write(p)
	s.n += int64(n)
	return p, nil
}

// fullChunk is the least full grows its buffer by.
const fullChunk = 64 << 10

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadSnapshot, fmt.Sprintf(format, args...))
}

func truncated(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return bad("truncated stream")
	}
	return fmt.Errorf("read snapshot: %w", err)
}

func (s *snapReader) header() error {
	p, err := s.full(len(snapshotMagic) + 4 + 16 + 1)
	if err != nil {
		return truncated(err)
	}
	if string(p[:8]) != snapshotMagic {
		return bad("not a kvrouter snapshot (bad magic)")
	}
	v := binary.LittleEndian.Uint32(p[8:])
	if v < 1 || v > snapshotVersion {
		return bad("format version %d (this build reads 1 to %d)", v, snapshotVersion)
	}
	s.info = SnapshotInfo{FormatVersion: v, Index: binary.LittleEndian.Uint64(p[12:]), Term: binary.LittleEndian.Uint64(p[20:]), Records: map[string]int64{}}
	if v >= 2 && p[28] != 0 {
		return bad("version %d announces counts in the header", v)
	}
	return s.counts(int(p[28]))
}

// counts reads n entries of a count block.
func (s *snapReader) counts(n int) error {
	for i := 0; i < n; i++ {
		q, err := s.full(9)
		if err != nil {
			return truncated(err)
		}
		if !store.ValidKind(q[0]) {
			return bad("unknown record kind %#x in the counts", q[0])
		}
		if _, dup := s.want[q[0]]; dup {
			return bad("record kind %#x counted twice", q[0])
		}
		s.want[q[0]] = binary.LittleEndian.Uint64(q[1:])
		s.info.Records[store.KindName(q[0])] = int64(s.want[q[0]])
	}
	return nil
}

// uvarint reads a uvarint, hashing its bytes in one write: read byte by
// byte (binary.ReadUvarint), the hash's per-call cost was most of the
// parse. Near the end of the stream it falls back to binary.ReadUvarint,
// which tells a truncated stream from a read error. A varint longer than
// 64 bits is a bad snapshot, not a read error.
func (s *snapReader) uvarint() (uint64, error) {
	p, _ := s.r.Peek(binary.MaxVarintLen64)
	v, n := binary.Uvarint(p)
	if n < 0 {
		return 0, bad("a record length overflows 64 bits")
	}
	if n == 0 {
		s.rerr = nil
		v, err := binary.ReadUvarint(s)
		if err != nil && s.rerr == nil { // the reader was fine: the varint was not
			return 0, bad("a record length overflows 64 bits")
		}
		return v, err
	}
	s.h.Write(p[:n])
	s.n += int64(n)
	s.r.Discard(n)
	return v, nil
}

// next returns the next record, or nil key at the end marker. Both slices
// are valid only until the next call.
func (s *snapReader) next() (key, value []byte, err error) {
	kl, err := s.uvarint()
	if err != nil {
		return nil, nil, truncated(err)
	}
	if kl == 0 {
		return nil, nil, nil
	}
	if kl > maxRecordKey {
		return nil, nil, bad("record key of %d bytes (at most %d)", kl, maxRecordKey)
	}
	k, err := s.full(int(kl))
	if err != nil {
		return nil, nil, truncated(err)
	}
	s.key = append(s.key[:0], k...) // k is s.buf, which the value reuses
	key = s.key
	if !store.ValidKind(key[0]) {
		return nil, nil, bad("record of unknown kind %#x", key[0])
	}
	vl, err := s.uvarint()
	if err != nil {
		return nil, nil, truncated(err)
	}
	if vl > maxRecordBytes {
		return nil, nil, bad("record value of %d bytes", vl)
	}
	v, err := s.full(int(vl))
	if err != nil {
		return nil, nil, truncated(err)
	}
	s.got[key[0]]++
	return key, v, nil
}

// finish reads the counts of a version 2 or 3 stream, and checks the
// counts and the trailer.
func (s *snapReader) finish() error {
	if s.info.FormatVersion >= 2 {
		nk, err := s.ReadByte()
		if err != nil {
			return truncated(err)
		}
		if err := s.counts(int(nk)); err != nil {
			return err
		}
	}
	for k, n := range s.want {
		if s.got[k] != n {
			return bad("%d %s records, the counts say %d", s.got[k], store.KindName(k), n)
		}
	}
	for k, n := range s.got {
		if n != 0 && s.want[byte(k)] != n {
			return bad("%d %s records not in the counts", n, store.KindName(byte(k)))
		}
	}
	sum := s.h.Sum(nil)
	var trailer [sha256.Size]byte
	if _, err := io.ReadFull(s.r, trailer[:]); err != nil {
		return truncated(err)
	}
	if !bytes.Equal(sum, trailer[:]) {
		return bad("checksum mismatch (the file is corrupted)")
	}
	// Only a byte read past the checksum makes the file corrupt; a read
	// that fails where the stream should end (a disk error, a dropped
	// connection) is that error, as it is mid-stream (truncated).
	switch _, err := s.r.ReadByte(); {
	case err == nil:
		return bad("trailing bytes after the checksum")
	case err != io.EOF:
		return fmt.Errorf("read snapshot: %w", err)
	}
	s.info.Bytes = s.n + sha256.Size
	s.info.SHA256 = hex.EncodeToString(sum)
	return nil
}

// InspectSnapshot reads a whole stream and reports what it holds, checking
// its counts and checksum; a bad stream is ErrBadSnapshot.
func InspectSnapshot(r io.Reader) (SnapshotInfo, error) {
	s := newSnapReader(r)
	if err := s.header(); err != nil {
		return SnapshotInfo{}, err
	}
	// Every record is counted and left out: fill returns at the end marker.
	if _, err := s.fill(&recBatch{}, func(byte) bool { return true }); err != nil {
		return SnapshotInfo{}, err
	}
	if err := s.finish(); err != nil {
		return SnapshotInfo{}, err
	}
	return s.info, nil
}

// checkSnapshot reads a whole stream as InspectSnapshot does, and also
// builds the state it describes apart from any FSM's (like gives the
// index configuration) and drops it: a stream whose records do not
// decode, are out of key order, do not make a consistent state, or are
// not the records that state writes, one per item under its key
// (stateBuilder.canonical), is ErrBadSnapshot, like a corrupt one. The
// online restore checks with it before it hands a stream to Raft, whose
// user restore panics when the FSM refuses one, and the seed before it
// writes a directory. It refuses more than the restore does (never
// less). The collector stays on: the state built is garbage once
// checked, and the restore that follows builds it again.
func checkSnapshot(r io.Reader, like *indexer.Index) (SnapshotInfo, error) {
	s := newSnapReader(r)
	if err := s.header(); err != nil {
		return SnapshotInfo{}, err
	}
	b := newStateBuilder()
	b.names = true
	// As restoreFrom loads it: the applied record is left out, and the
	// keys must rise strictly, as the state's sorted tables refuse them
	// otherwise (store.SortedTable.Set). Whatever the restore would
	// refuse must be refused here: Raft's user restore panics when the
	// FSM's Restore fails.
	skip := func(kind byte) bool { return kind == store.KindApplied }
	var prev []byte
	var orderErr error
	add := func(k, v []byte) error {
		if prev != nil && bytes.Compare(k, prev) <= 0 {
			orderErr = fmt.Errorf("%w: %w: record keys out of order", ErrBadSnapshot, store.ErrCorrupt)
			return orderErr
		}
		prev = append(prev[:0], k...)
		return b.add(k, v)
	}
	batch := &recBatch{}
	for {
		batch.Reset()
		end, err := s.fill(batch, skip)
		_ = batch.Each(add) // b.add's error comes back from b.wait
		if err == nil {
			err = orderErr
		}
		if err != nil {
			b.discard()
			return SnapshotInfo{}, err
		}
		if end {
			break
		}
	}
	if err := s.finish(); err != nil {
		b.discard()
		return SnapshotInfo{}, err
	}
	if err := b.wait(); err != nil {
		b.discard()
		return SnapshotInfo{}, fmt.Errorf("%w: %v", ErrBadSnapshot, err)
	}
	if err := b.prepare(like); err != nil {
		return SnapshotInfo{}, fmt.Errorf("%w: %v", ErrBadSnapshot, err)
	}
	if err := b.canonical(); err != nil {
		return SnapshotInfo{}, fmt.Errorf("%w: records the state would not write: %v", ErrBadSnapshot, err)
	}
	return s.info, nil
}

// replaceMembers copies the stream r to w, in the current format, with its
// member table (the store.KindMember records) replaced by members, and
// returns what it wrote. Every other record is copied as it is, in its
// place; the member records, in key order, go where the kind order puts
// them; the counts and the checksum are those of what is written. r is
// read whole and checked as InspectSnapshot checks a stream (its counts
// and checksum): a damaged one is ErrBadSnapshot, and w then holds part of
// a stream. The online restore installs another cluster's stream with
// the member table of the cluster it restores into.
//
// Every rank's metadata record (store.KindRank) is written with
// NeedsResync set: a stream an operator restores (online here, offline
// through SeedDataDir) is older than what the engines hold now, and an
// idle rank would never show its agent the difference. The flag goes
// into the state every replica installs, so each answers alike: acks and
// heartbeat answers name the rank (docs/events.md), and its agent's dump
// clears it. Raft's own restores (a leader's snapshot sent to a follower
// that lags, the newest one at start) are current state, and go through
// loadSnapshot alone: they mark nothing.
func replaceMembers(w io.Writer, r io.Reader, members []Member) (SnapshotInfo, error) {
	s := newSnapReader(r)
	if err := s.header(); err != nil {
		return SnapshotInfo{}, err
	}
	members = slices.Clone(members)
	slices.SortFunc(members, func(a, b Member) int { return cmp.Compare(a.ID, b.ID) })
	for i, m := range members {
		if m.ID == "" || len(m.ID) >= maxRecordKey || i > 0 && members[i-1].ID == m.ID {
			return SnapshotInfo{}, fmt.Errorf("%w: member table: bad or repeated member id %q", ErrInvalid, m.ID)
		}
	}
	isMember := func(kind byte) bool { return kind == store.KindMember }
	return encodeSnapshot(w, s.info.Index, s.info.Term, func(fn func(k, v []byte) error) error {
		written := false
		writeMembers := func() error {
			written = true
			var key []byte
			for i := range members {
				key = append(append(key[:0], store.KindMember), members[i].ID...)
				if err := fn(key, encodeMemberValue(&members[i])); err != nil {
					return err
				}
			}
			return nil
		}
		batch := &recBatch{}
		for {
			batch.Reset()
			end, err := s.fill(batch, isMember)
			if err != nil {
				return err
			}
			err = batch.Each(func(k, v []byte) error {
				if !written && k[0] > store.KindMember {
					if err := writeMembers(); err != nil {
						return err
					}
				}
				if k[0] == store.KindRank {
					m, err := decodeRankMeta(v, kvevent.Rank{})
					if err != nil {
						return fmt.Errorf("%w: rank record %x: %v", ErrBadSnapshot, k[1:], err)
					}
					if !m.NeedsResync {
						m.NeedsResync = true
						e := &enc{}
						encodeRankMeta(e, &m)
						v = e.b
					}
				}
				return fn(k, v)
			})
			if err != nil {
				return err
			}
			if end {
				break
			}
		}
		if !written {
			if err := writeMembers(); err != nil {
				return err
			}
		}
		return s.finish()
	})
}

// loadSnapshot writes a stream into a fresh state directory dir and checks
// it; on any error dir is removed. The stream's applied index is never
// kept (a stream may come from another cluster's log): dir records index
// and term as its applied index instead, when index is not 0 (a restore
// of Raft's own snapshot at index), and none otherwise (seeding a new
// cluster, whose log starts again at 1). dropMembers leaves out the member
// table (seeding a cluster on other addresses). build, unless nil, is
// given every record written (so that it holds what the directory holds),
// and a record it cannot decode fails the load, as a bad snapshot, once
// the stream's checksum is known to be good.
func loadSnapshot(r io.Reader, dir string, index, term uint64, dropMembers bool, logger *slog.Logger, build *stateBuilder) (SnapshotInfo, error) {
	if err := os.RemoveAll(dir); err != nil {
		return SnapshotInfo{}, fmt.Errorf("clear %s: %w", dir, err)
	}
	db, err := store.OpenState(dir, store.StateOptions{Logger: logger, DisableWAL: true})
	if err != nil {
		return SnapshotInfo{}, err
	}
	fail := func(err error) (SnapshotInfo, error) {
		db.Close()
		os.RemoveAll(dir)
		return SnapshotInfo{}, err
	}
	s := newSnapReader(r)
	if err := s.header(); err != nil {
		return fail(err)
	}
	// Records come in key order: write sstables and ingest them rather
	// than going through the memtable.
	ld := db.NewSortedLoader()
	fail = func(err error) (SnapshotInfo, error) {
		if build != nil {
			build.discard() // after the tree's linking, if it started
		}
		ld.Abort()
		db.Close()
		os.RemoveAll(dir)
		if errors.Is(err, store.ErrCorrupt) {
			err = fmt.Errorf("%w: %v", ErrBadSnapshot, err)
		}
		return SnapshotInfo{}, err
	}
	skip := func(kind byte) bool {
		return kind == store.KindApplied || dropMembers && kind == store.KindMember
	}
	if err := loadRecords(s, skip, ld, build); err != nil {
		return fail(err)
	}
	if err := s.finish(); err != nil {
		return fail(err)
	}
	if build != nil {
		if err := build.wait(); err != nil {
			return fail(fmt.Errorf("%w: %v", ErrBadSnapshot, err))
		}
	}
	if err := ld.Finish(); err != nil {
		return fail(err)
	}
	if index != 0 {
		g := db.NewBatch()
		g.SetApplied(index, term)
		err := g.Commit()
		g.Close()
		if err != nil {
			return fail(fmt.Errorf("record applied index %d: %w", index, err))
		}
	}
	if err := db.Close(); err != nil {
		return fail(err)
	}
	if err := syncDir(dir); err != nil {
		return fail(err)
	}
	return s.info, nil
}

// restoreFrom replaces the state with a stream: load into dir.restore,
// check, then swap directories (dir → dir.old, dir.restore → dir, remove
// dir.old) with the parent directory synced after each rename, and rebuild
// the in-memory state. cleanupRestore finishes or rolls back a swap that a
// crash interrupted. The restored state's applied index and term are index
// and term (the Raft snapshot's the stream is, or 0), installed with it.
func (f *FSM) restoreFrom(r io.Reader, index, term uint64) error {
	start := time.Now()
	tmp, old := f.dir+".restore", f.dir+".old"
	// The in-memory state is built from the stream as it is written (b),
	// rather than read back from the new directory after the swap; the
	// collector is off meanwhile, as for FSM.load.
	defer holdCollector()()
	b := newStateBuilder()
	// The stream's applied index is dropped for index: Raft delivers only
	// entries after the snapshot it restores, and every one of them must
	// apply, whatever index the stream was taken at (a user restore into a
	// younger cluster). index is recorded in tmp, before the swap, so
	// that no write after the swap can fail on its own: a failure there
	// comes after the state was replaced, and is fatal.
	info, err := loadSnapshot(r, tmp, index, term, false, f.logger, b)
	if err != nil {
		err = fmt.Errorf("restore: %w", err)
		if f.userRestore.Load() && !errors.Is(err, ErrBadSnapshot) {
			// hashicorp/raft panics on any error of a user restore's
			// FSM.Restore (restoreUserSnapshot), with a goroutine dump and
			// no word of what to do; it has stored the restore in its
			// snapshot store by then, and cannot take it back. A leader's
			// install (InstallSnapshot) gets the error instead: Raft tries
			// it again. A bad snapshot is refused as before (RestoreSnapshot
			// checks the stream first).
			f.onFatal(fmt.Errorf("a user restore (kvctl snapshot restore) could not load the snapshot into the state database, and Raft has already stored it: %w; "+
				"free space in the data directory (see the error) and restart the node: it installs the restore from its Raft snapshot at the start; then check kvctl status on every node before restoring again", err))
		}
		return err
	}
	b.applied, b.appliedTerm = index, term
	// The records decode; do they make a consistent state? Checked before
	// the swap, so that a stream that does not is refused and the node
	// keeps its state.
	if err := b.prepare(f.ix); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("restore: %w: %v", ErrBadSnapshot, err)
	}
	f.dbMu.Lock()
	defer f.dbMu.Unlock()
	f.dropGroup() // changes to the state the stream replaces
	f.replaced++  // a save reading the database closed fails (FSM.cutOff)
	if err := f.db.Close(); err != nil {
		// Closed all the same (StateDB.Close), and its contents are being
		// replaced: returning here would leave the FSM on a closed database.
		f.logger.Warn("restore: closing the state database failed; replacing it anyway", "err", err)
	}
	parent := filepath.Dir(f.dir)
	steps := []func() error{
		func() error { return os.Rename(f.dir, old) },
		func() error { return syncDir(parent) },
		func() error { return os.Rename(tmp, f.dir) },
		func() error { return syncDir(parent) },
		func() error { return os.RemoveAll(old) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			// Leave it to cleanupRestore at the next start; this node
			// cannot go on without a state database.
			f.onFatal(fmt.Errorf("restore swap: %w", err))
			return err
		}
	}
	if f.afterSwap != nil {
		f.afterSwap()
	}
	db, err := store.OpenState(f.dir, store.StateOptions{Logger: f.logger, Stalls: &f.stalls})
	if err != nil {
		f.onFatal(fmt.Errorf("reopen restored state: %w", err))
		return err
	}
	f.db = db
	if err := b.install(f); err != nil {
		f.onFatal(fmt.Errorf("install restored state: %w", err))
		return err
	}
	f.handed.Store(index) // Raft hands over the entries after it
	// The state is the snapshot's: the log Raft keeps starts after it,
	// and the count towards the next snapshot starts over.
	f.sinceSnap.Store(0)
	f.resetCheck()
	f.restoredAt.Store(time.Now().UnixNano())
	f.logLoaded("state restored from snapshot", b, start)
	f.restoreSeconds.Store(math.Float64bits(time.Since(start).Seconds()))
	f.logger.Info("snapshot restored", "index", info.Index, "term", info.Term, "bytes", info.Bytes)
	return nil
}

// cleanupRestore finishes or rolls back a restore a crash interrupted.
func cleanupRestore(dir string) error {
	tmp, old := dir+".restore", dir+".old"
	if err := os.RemoveAll(tmp); err != nil {
		return fmt.Errorf("remove half-done restore %s: %w", tmp, err)
	}
	if _, err := os.Stat(old); err == nil {
		if _, err := os.Stat(dir); err == nil {
			return os.RemoveAll(old) // the swap completed
		}
		if err := os.Rename(old, dir); err != nil { // the swap did not
			return fmt.Errorf("roll back interrupted restore: %w", err)
		}
		return syncDir(filepath.Dir(dir))
	}
	return nil
}

// syncDir fsyncs a directory, so that the entries made in it (a
// rename's, a new file's) survive a power loss. The renames go through
// os, not Pebble's vfs, so no test filesystem sees them: a variable for
// tests, which record its calls (TestARestoreSyncsEachStepOfItsSwap).
var syncDir = func(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// SeedDataDir writes a snapshot file into a new node's data directory, so
// that a new cluster starts from it (kvctl snapshot restore --data-dir).
// The state becomes the new cluster's first Raft snapshot, at index 2 with
// the peers as its configuration (seedRaftSnapshot), in place of a
// bootstrap: every node of the new cluster must be seeded from the same
// file with the same peers, and nodes added later receive the state from
// a leader's snapshot (as does one started unseeded with the same --peers,
// while the seeded nodes are a majority). It refuses a directory that already holds node
// state (fsm/, raft/, a Raft snapshot), removes what a seed killed
// part-way leaves (fsm.restore/, a Raft snapshot's snapshots/NAME.tmp/),
// and leaves alone the files that are not a node's (a mount point's
// lost+found/): the directory need not be empty. Once ctx ends the file's reads fail with its error, and the
// seed ends without an fsm/, as a refused one does.
func SeedDataDir(ctx context.Context, snapshotPath, dataDir, nodeID string, peers []Member) error {
	if nodeID == "" || len(peers) == 0 {
		return fmt.Errorf("%w: seeding needs a node id and the peers", ErrInvalid)
	}
	// Held while the directory is checked and written: a node started on
	// it meanwhile would find it empty, and lose what it wrote to fsm/.
	if err := os.MkdirAll(dataDir, dataDirMode); err != nil {
		return err
	}
	lock, err := lockDataDir(dataDir)
	if err != nil {
		return err
	}
	defer lock.Close()
	for _, sub := range []string{"fsm", "raft"} {
		if _, err := os.Stat(filepath.Join(dataDir, sub)); err == nil {
			return fmt.Errorf("%w: %s already holds node state; seed a directory that holds none", ErrInvalid, dataDir)
		}
	}
	// Raft snapshots are state too (raft.HasExistingState): a node would
	// not bootstrap, and would restore the newest of them over the seed.
	// They are what Raft's store lists, by its rule: a plain file, or a
	// directory without a meta.json Raft reads, is none (a node would
	// start on the directory as an empty one), and is left alone as other
	// files are. One still being written (NAME.tmp, which Raft lists as
	// none) is what a seed killed while it wrote its own leaves: it is
	// removed, as that seed's fsm.restore is.
	snapDir := filepath.Join(dataDir, "snapshots")
	if _, err := os.Stat(snapDir); err == nil {
		// Only a snapshots/ already there is listed: the store creates
		// one, which a seed refused later (a bad stream) must not leave.
		snaps, err := raft.NewFileSnapshotStoreWithLogger(dataDir, 1, hclogAdapter(slog.New(slog.DiscardHandler)))
		if err != nil {
			return fmt.Errorf("seed: list the Raft snapshots in %s: %w", snapDir, err)
		}
		list, err := snaps.List()
		if err != nil {
			return fmt.Errorf("seed: list the Raft snapshots in %s: %w", snapDir, err)
		}
		if len(list) > 0 {
			return fmt.Errorf("%w: %s already holds Raft snapshots (%s in %s); seed a directory that holds no node state", ErrInvalid, dataDir, list[0].ID, snapDir)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if _, err := removePartialSnapshots(dataDir); err != nil {
		return err
	}
	f, err := os.Open(snapshotPath)
	if err != nil {
		return err
	}
	defer f.Close()
	r := ctxReader{ctx: ctx, r: f}
	// Checked whole first, so that a stream the nodes could not load is
	// refused here rather than at their first start.
	if _, err := checkSnapshot(r, indexer.New(indexer.Config{})); err != nil {
		return err
	}
	// The free space is checked as an online restore's is: Pebble takes a
	// MANIFEST it cannot write (the state's load on a full disk) as fatal,
	// and the seed ended in a panic and a goroutine dump. Space can still
	// run out (another writer), but not for want of checking; a free
	// space that cannot be read is not checked.
	if st, err := f.Stat(); err == nil {
		if avail, err := diskFree(dataDir); err == nil {
			if err := restoreSpaceError(dataDir, st.Size(), avail); err != nil {
				return fmt.Errorf("seed: nothing was written: %w", err)
			}
		}
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return err
	}
	// The state is built beside fsm/ and renamed into place whole: built in
	// fsm/, a seed killed part-way left a valid, empty state there, which a
	// second seed refused and a node started from. A killed seed now leaves
	// only fsm.restore, which the next seed removes (a node started on the
	// directory removes it too, and starts empty: docs/operations.md).
	// The new cluster's member table comes from its own leaders, not from
	// the cluster the snapshot was taken on.
	dir := filepath.Join(dataDir, "fsm")
	// Through replaceMembers, with no members (loadSnapshot drops them
	// anyway): it marks every rank as needing a resync, as the online
	// restore's stream does.
	pr, pw := io.Pipe()
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		_, err := replaceMembers(pw, r, nil)
		pw.CloseWithError(err)
	}()
	_, err = loadSnapshot(pr, dir+".restore", 0, 0, true, slog.New(slog.DiscardHandler), nil)
	pr.CloseWithError(errors.New("seed: the load ended")) // the copy's next write fails
	<-copied
	if err != nil {
		return err
	}
	if err := seedRaftSnapshot(dataDir, dir+".restore", peers); err != nil {
		os.RemoveAll(dir + ".restore")
		return err
	}
	if err := os.Rename(dir+".restore", dir); err != nil {
		return err
	}
	// The new fsm/ entry is durable too: without it a power loss could
	// leave an empty directory, and the node would start with no state.
	return syncDir(dataDir)
}

// isPartialSnapshot reports whether an entry of the snapshots directory
// is a Raft snapshot still being written (NAME.tmp/, renamed to NAME once
// whole), which Raft lists as no snapshot.
func isPartialSnapshot(e fs.DirEntry) bool {
	return e.IsDir() && strings.HasSuffix(e.Name(), ".tmp")
}

// removePartialSnapshots removes the Raft snapshots still being written
// in dataDir's snapshots/ directory and returns their paths: what a
// process killed while it wrote one leaves (a seed's, or Raft's own while
// it persisted a snapshot or received a leader's), as large as the state.
// Raft never removes them: its reaping lists whole snapshots only. The
// caller holds the directory's lock, so no writer of one is running.
func removePartialSnapshots(dataDir string) ([]string, error) {
	snapDir := filepath.Join(dataDir, "snapshots")
	ents, err := os.ReadDir(snapDir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	var removed []string
	for _, e := range ents {
		if !isPartialSnapshot(e) {
			continue
		}
		p := filepath.Join(snapDir, e.Name())
		if err := os.RemoveAll(p); err != nil {
			return removed, fmt.Errorf("remove a partial Raft snapshot: %w", err)
		}
		removed = append(removed, p)
	}
	return removed, nil
}

// ContextReader returns a reader of r whose reads fail with ctx's error
// once ctx ends: a long read of a local file (a seed or a check of a
// snapshot of many GiB) stops at an interrupt. A read that fails once ctx
// ended (a file closed because of it) fails with ctx's error too.
func ContextReader(ctx context.Context, r io.Reader) io.Reader { return ctxReader{ctx: ctx, r: r} }

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := c.r.Read(p)
	if err != nil && c.ctx.Err() != nil {
		return n, c.ctx.Err()
	}
	return n, err
}

// seedIndex and seedTerm are the Raft index and term of a seeded state:
// the new cluster's first snapshot, in place of a bootstrap's first entry.
//
// They are an index and term that no bootstrapped cluster's log holds: a
// bootstrap writes index 1 in term 1, and its nodes write index 2 on in
// their first election's term, 2 or later. Seeds were at index 1, term 1
// (legacySeedIndex), the very entry a bootstrap writes: a node started on
// an empty directory with the same --peers (not seeded) bootstrapped, and
// Raft found matching entries at index 1 on both sides and never sent it
// the seed, so it applied the log from index 2 on an empty state and
// served from it. At index 2 such a node lacks the entry the leader's log
// starts after, and the leader sends it the seed (InstallSnapshot); its
// votes are refused by the seeded nodes, whose logs end further on.
//
// The seed cannot be at the bootstrap's index in a later term instead:
// hashicorp/raft keeps a follower's entry at the index of a snapshot it
// installs, compares the leader's entries against that entry rather than
// the snapshot, and the leader sends the snapshot again without end.
const (
	seedIndex, seedTerm = 2, 1
	// The seed of earlier builds, whose seeded directories still start.
	legacySeedIndex, legacySeedTerm = 1, 1
)

// isSeed reports whether a Raft snapshot at index and term is a seed.
func isSeed(index, term uint64) bool {
	return (index == seedIndex && term == seedTerm) || (index == legacySeedIndex && term == legacySeedTerm)
}

// seedRaftSnapshot makes the state built in stateDir the new cluster's
// first Raft snapshot, at index 2, term 1 (seedIndex, seedTerm) with the
// peers as its configuration.
//
// The seeded state is in no Raft log: had the nodes bootstrapped an empty
// log instead, a node added later (--join) would have been sent that log
// from its first entry and built its state from nothing but it, an empty
// index that served routes as ready. Raft sends a node that needs entries
// a log no longer holds the newest snapshot instead: the seeded state.
// The state records the seed's index as applied, so the nodes apply the
// log from the next one on, and a node whose fsm/ is lost (a seed killed before its
// rename) restores the snapshot at start (Node.catchUpFromSnapshot).
func seedRaftSnapshot(dataDir, stateDir string, peers []Member) error {
	return seedRaftSnapshotAt(dataDir, stateDir, peers, seedIndex, seedTerm)
}

// seedRaftSnapshotAt is seedRaftSnapshot at the given index and term (the
// tests make earlier builds' seeds with it).
func seedRaftSnapshotAt(dataDir, stateDir string, peers []Member, index, term uint64) error {
	db, err := store.OpenState(stateDir, store.StateOptions{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	defer db.Close()
	b := db.NewBatch()
	b.SetApplied(index, term)
	if err := b.Commit(); err != nil {
		return fmt.Errorf("seed: record the applied index: %w", err)
	}
	if err := db.Sync(); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(dataDir, 2, hclogAdapter(slog.New(slog.DiscardHandler)))
	if err != nil {
		return fmt.Errorf("seed: snapshot store: %w", err)
	}
	var conf raft.Configuration
	for _, p := range peers {
		conf.Servers = append(conf.Servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
	}
	// The transport only encodes the peers' addresses for the snapshot's
	// legacy peer list, as the nodes' own transport does (the address
	// itself).
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	sink, err := snaps.Create(raft.SnapshotVersionMax, index, term, conf, index, trans)
	if err != nil {
		return fmt.Errorf("seed: create the Raft snapshot: %w", err)
	}
	view := db.Snapshot()
	defer view.Close()
	if _, err := writeSnapshot(sink, view); err != nil {
		sink.Cancel()
		return fmt.Errorf("seed: write the Raft snapshot: %w", err)
	}
	if err := sink.Close(); err != nil {
		return fmt.Errorf("seed: write the Raft snapshot: %w", err)
	}
	return nil
}
