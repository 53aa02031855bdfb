package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// StateDB is the router FSM's state on its own Pebble database (the node's
// fsm/ directory), separate from the Raft log. The FSM writes it in groups
// (StateBatch): each group, with the applied index that ends it, becomes
// one sorted sstable ingested atomically and durably. There is no Pebble
// WAL and nothing goes through the memtable: the Raft log is the
// write-ahead log, and after a crash the database holds the state at a
// group boundary at or past the last snapshot (the FSM commits its group
// when Raft takes one), so the state and the index that produced it never
// disagree and Raft replays the rest.
//
// The database is written far more than it is read (it is read whole at
// start and when a snapshot streams), and its bulk is a tree-node and a
// residency record per cached block, under random engine hashes: see
// OpenState for the options that make such writes cheap.
//
// Key layout: one kind byte, then the kind's key. Integers are big-endian
// so that keys of one kind sort by them.
//
//	0x01 'a'                      applied index and term (16 bytes)
//	0x02 worker(8) dp(4)          rank cursor: last applied event id (8), then,
//	                              when not 0, the publisher incarnation of the
//	                              dump that last replaced the rank (8)
//	0x03 worker(8)                worker registration (opaque, the FSM's encoding)
//	0x04 seq(8)                   index tree node: parent seq(8) local(8) flags(1)
//	0x05 worker(8) dp(4) eh(8)    residency: node seq(8) mask(1) order(4)
//	0x06 worker(8) dp(4)          rank metadata (opaque)
//	0x07 request id               live booking (opaque)
//	0x08 request id               freed booking tombstone (opaque)
//	0x09 'c'                      load tracker's sweep clock (opaque); an earlier
//	                              build kept 'l' (its expiry horizon) instead,
//	                              read at start and deleted by the next sweep
//	0x0a 's'                      cluster settings (opaque)
//	0x0b member id                cluster member (opaque)
type StateDB struct {
	// mu guards db against Close: every method that uses db holds it for
	// reading (a scan for all of its iteration), Close holds it for
	// writing and sets db to nil, and later calls fail with ErrClosed.
	// Views are the exception: they use db under viewMu (see below).
	mu     sync.RWMutex
	db     *pebble.DB
	opts   *pebble.Options // the options it was opened with (table writers take theirs)
	fs     vfs.FS          // the database's filesystem (group tables are written on it)
	dir    string
	logger *slog.Logger
	groups atomic.Uint64 // group tables written, for their file names
	stalls *WriteStalls  // nil: not counted

	// viewMu guards views and every view's use of the database. Close
	// closes the views' snapshots and iterators first: Raft may install
	// a leader's snapshot (a restore, which closes this database to swap
	// it) while a snapshot of this one is still being persisted, and
	// Raft holds that view while it waits for the restore, so Close must
	// not wait for it. A view whose database closed fails with ErrClosed.
	viewMu  sync.Mutex
	views   map[*StateSnapshot]struct{}
	closing bool // Close has begun: a new view opens closed

	scratch commitScratch // its groups' commits and views sort and gather here
}

// Record kinds of the state database.
const (
	KindApplied  byte = 0x01
	KindCursor   byte = 0x02
	KindWorker   byte = 0x03
	KindNode     byte = 0x04
	KindEntry    byte = 0x05
	KindRank     byte = 0x06
	KindBooking  byte = 0x07
	KindTomb     byte = 0x08
	KindLoadMeta byte = 0x09
	KindSettings byte = 0x0a
	KindMember   byte = 0x0b
	kindEnd      byte = 0x0c
)

// KindName is the label of a record kind in snapshot inspections.
func KindName(k byte) string {
	switch k {
	case KindApplied:
		return "applied"
	case KindCursor:
		return "cursors"
	case KindWorker:
		return "workers"
	case KindNode:
		return "nodes"
	case KindEntry:
		return "residencies"
	case KindRank:
		return "ranks"
	case KindBooking:
		return "bookings"
	case KindTomb:
		return "freed_bookings"
	case KindLoadMeta:
		return "load_meta"
	case KindSettings:
		return "settings"
	case KindMember:
		return "members"
	}
	return fmt.Sprintf("kind_%#x", k)
}

// ValidKind reports whether k is a record kind of this format.
func ValidKind(k byte) bool { return k >= KindApplied && k < kindEnd }

// StateOptions configures OpenState.
type StateOptions struct {
	FS     vfs.FS
	Logger *slog.Logger
	// DisableWAL is kept for callers that bulk-load a fresh directory
	// (restores); the state database never writes a WAL now (see StateDB),
	// so it changes nothing.
	DisableWAL bool
	// Stalls, when set, adds up the time Pebble stalls this database's
	// writes.
	Stalls *WriteStalls
}

// Pebble options of the state database, measured on the cluster ingest
// benchmark (raftfsm TestBenchClusterIngest; 2 cores, 3 replicas per
// machine). Each block event writes about 1.4 keys (a residency, and a
// tree node when the block is new) with random engine hashes, so:
//
//   - The FSM's groups skip the memtable (StateBatch); the memtable only
//     sees what else is written (nothing in steady state).
//   - Every group table overlaps the whole residency keyspace, so each
//     L0 compaction rewrites the base level. Letting L0 reach more
//     sublevels before compacting, and a larger base level, trade read
//     amplification (reads are only the full scans at start and in
//     snapshots) for several times less compaction work.
//   - No WAL: the Raft log is the write-ahead log (StateDB), and the WAL
//     doubled every byte written.
//   - Tables are not compressed and have 32 KiB blocks (the default is
//     Snappy and 4 KiB): the records are random hashes that Snappy cannot
//     shrink, and every table is written to be read whole. On the group
//     commit benchmark (BenchmarkGroupCommit) this made writing a group
//     about 15 % cheaper; Pebble's compactions write the same way.
const (
	stateMemTableSize      = 16 << 20
	stateMemTableStop      = 8
	stateL0CompactionSubs  = 32
	stateL0StopWritesSubs  = 256
	stateL0CompactionFiles = 2000
	stateLBaseMaxBytes     = 1 << 30
	stateBlockBytes        = 32 << 10
)

// OpenState opens (creating if needed) the state database in dir.
func OpenState(dir string, opts StateOptions) (*StateDB, error) {
	logger := opts.Logger
	if logger == nil {
		logger = slog.Default()
	}
	logger = logger.With("component", "store.state", "dir", dir)
	popts := &pebble.Options{
		FS:                 opts.FS,
		Logger:             pebbleLogger{logger},
		FormatMajorVersion: pebble.FormatNewest,
		DisableWAL:         true, // see StateDB
		MemTableSize:       stateMemTableSize,

		MemTableStopWritesThreshold: stateMemTableStop,
		L0CompactionThreshold:       stateL0CompactionSubs,
		L0CompactionFileThreshold:   stateL0CompactionFiles,
		L0StopWritesThreshold:       stateL0StopWritesSubs,
		LBaseMaxBytes:               stateLBaseMaxBytes,
	}
	// An ingest that overlaps the memtable would otherwise be queued as a
	// flushable, in memory only until a flush, and with the WAL off that is
	// not durable when Ingest returns. Nothing writes to this memtable
	// today; this keeps every group commit durable if something ever does.
	popts.Experimental.DisableIngestAsFlushable = func() bool { return true }
	// Level 0's settings carry over to every level below it.
	popts.Levels[0].BlockSize = stateBlockBytes
	popts.Levels[0].Compression = func() *sstable.CompressionProfile { return sstable.NoCompression }
	if popts.FS == nil {
		popts.FS = vfs.Default
	}
	opts.Stalls.listen(popts, logger)
	popts.EnsureDefaults() // Open defaults a copy; createTable reads these
	db, err := pebble.Open(dir, popts)
	if err != nil {
		return nil, fmt.Errorf("open state db %s: %w", dir, err)
	}
	removeStaleGroups(popts.FS, dir)
	return &StateDB{db: db, opts: popts, fs: popts.FS, dir: dir, logger: logger, stalls: opts.Stalls}, nil
}

// Close closes the database. Open views are closed with it: their reads
// then fail with ErrClosed, and so do the database's methods (a group's
// Commit, Applied, Scan, Sync). It waits for the methods that are using
// the database, not for views. A second Close does nothing.
func (s *StateDB) Close() error {
	// After the database: a commit holding the scratch finishes its
	// write, then fails to ingest; one that takes it later gets plain
	// memory (commitScratch).
	defer s.scratch.release()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.db == nil {
		return nil
	}
	s.viewMu.Lock()
	s.closing = true
	for v := range s.views {
		v.release()
	}
	s.viewMu.Unlock()
	err := s.db.Close()
	s.db = nil
	s.stalls.closed()
	return err
}

// Dir returns the database's directory.
func (s *StateDB) Dir() string { return s.dir }

// Sync makes everything written durable. Group commits (StateBatch) are
// durable when they return; Sync flushes whatever else reached the
// memtable (nothing in steady state), so that callers need not know which
// writes went which way. The FSM calls it when Raft takes a snapshot and
// at Close.
func (s *StateDB) Sync() error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("sync state db: %w", ErrClosed)
	}
	if err := s.db.Flush(); err != nil {
		return fmt.Errorf("sync state db: %w", err)
	}
	return nil
}

// Applied returns the applied index and term recorded in the database, or
// zeros for a fresh one.
func (s *StateDB) Applied() (index, term uint64, err error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return 0, 0, fmt.Errorf("read applied index: %w", ErrClosed)
	}
	return readApplied(s.db)
}

func readApplied(r pebble.Reader) (uint64, uint64, error) {
	v, c, err := r.Get(appliedKey)
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, 0, nil
	}
	if err != nil {
		return 0, 0, fmt.Errorf("read applied index: %w", err)
	}
	defer c.Close()
	return DecodeApplied(v)
}

// DecodeApplied decodes the value of the applied record: index and term.
func DecodeApplied(v []byte) (index, term uint64, err error) {
	if len(v) != 16 {
		return 0, 0, fmt.Errorf("%w: applied record of %d bytes", ErrCorrupt, len(v))
	}
	return binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:]), nil
}

var appliedKey = []byte{KindApplied, 'a'}

// Scan calls fn for every record of a kind, in key order, with the key
// without its kind byte. The slices are valid only during the call.
func (s *StateDB) Scan(kind byte, fn func(key, value []byte) error) error {
	return s.ScanRange(kind, nil, nil, fn)
}

// ScanRange is Scan of the records of a kind whose keys (without the
// kind byte) are at or above from and below to; a nil bound is the
// kind's first or last key. Scans of disjoint ranges may run side by
// side. A Close waits for the scan; fn must not call the database's
// other methods (a Close waiting between would hold them back for good).
func (s *StateDB) ScanRange(kind byte, from, to []byte, fn func(key, value []byte) error) error {
	lower, upper := append([]byte{kind}, from...), append([]byte{kind}, to...)
	if to == nil {
		upper = []byte{kind + 1}
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("scan %s: %w", KindName(kind), ErrClosed)
	}
	it, err := s.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: upper})
	if err != nil {
		return fmt.Errorf("scan %s: %w", KindName(kind), err)
	}
	for it.First(); it.Valid(); it.Next() {
		if err := fn(it.Key()[1:], it.Value()); err != nil {
			it.Close()
			return err
		}
	}
	if err := it.Close(); err != nil {
		return fmt.Errorf("scan %s: %w", KindName(kind), err)
	}
	return nil
}

// HasRecords reports whether the database holds any record, the applied
// record included: one seek, whatever the state's size.
func (s *StateDB) HasRecords() (bool, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return false, fmt.Errorf("look for records: %w", ErrClosed)
	}
	it, err := s.db.NewIter(nil)
	if err != nil {
		return false, fmt.Errorf("look for records: %w", err)
	}
	has := it.First()
	if err := it.Close(); err != nil {
		return false, fmt.Errorf("look for records: %w", err)
	}
	return has, nil
}

// UnknownRecord returns the key of a record of a kind this format does
// not know (ValidKind), nil if there is none: a later build's, read
// after a downgrade, or damage. Such keys sort below the first kind or
// past the last, so it costs two bounded seeks, whatever the state's
// size.
func (s *StateDB) UnknownRecord() ([]byte, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return nil, fmt.Errorf("look for records of unknown kinds: %w", ErrClosed)
	}
	for _, bounds := range []pebble.IterOptions{{UpperBound: []byte{KindApplied}}, {LowerBound: []byte{kindEnd}}} {
		it, err := s.db.NewIter(&bounds)
		if err != nil {
			return nil, fmt.Errorf("look for records of unknown kinds: %w", err)
		}
		var key []byte
		if it.First() {
			key = bytes.Clone(it.Key())
		}
		if err := it.Close(); err != nil {
			return nil, fmt.Errorf("look for records of unknown kinds: %w", err)
		}
		if key != nil {
			return key, nil
		}
	}
	return nil, nil
}

func (b *StateBatch) k(kind byte) []byte {
	b.key = append(b.key[:0], kind)
	return b.key
}

func appendRank(k []byte, worker uint64, dp uint32) []byte {
	k = binary.BigEndian.AppendUint64(k, worker)
	return binary.BigEndian.AppendUint32(k, dp)
}

// SetApplied records the applied index and term.
func (b *StateBatch) SetApplied(index, term uint64) {
	v := binary.BigEndian.AppendUint64(b.val[:0], index)
	v = binary.BigEndian.AppendUint64(v, term)
	b.set(appliedKey, v)
}

// PutCursor records a rank's last applied event id and the publisher
// incarnation of the dump that last replaced the rank. An incarnation of 0
// (none, or unfenced) is left out: the value is then 8 bytes, as it was
// before incarnations existed (DecodeCursor).
func (b *StateBatch) PutCursor(worker uint64, dp uint32, id, incarnation uint64) {
	k := appendRank(b.k(KindCursor), worker, dp)
	v := binary.BigEndian.AppendUint64(b.val[:0], id)
	if incarnation != 0 {
		v = binary.BigEndian.AppendUint64(v, incarnation)
	}
	b.set(k, v)
}

// DeleteCursor drops a rank's cursor.
func (b *StateBatch) DeleteCursor(worker uint64, dp uint32) {
	b.del(appendRank(b.k(KindCursor), worker, dp))
}

// PutNode records an index tree node.
func (b *StateBatch) PutNode(seq, parent uint64, root bool, local uint64) {
	k := binary.BigEndian.AppendUint64(b.k(KindNode), seq)
	v := binary.BigEndian.AppendUint64(b.val[:0], parent)
	v = binary.BigEndian.AppendUint64(v, local)
	flags := byte(0)
	if root {
		flags = 1
	}
	b.set(k, append(v, flags))
}

// DeleteNode drops an index tree node.
func (b *StateBatch) DeleteNode(seq uint64) {
	b.del(binary.BigEndian.AppendUint64(b.k(KindNode), seq))
}

// PutEntry records a residency.
func (b *StateBatch) PutEntry(worker uint64, dp uint32, eh, seq uint64, mask uint8, order uint32) {
	k := binary.BigEndian.AppendUint64(appendRank(b.k(KindEntry), worker, dp), eh)
	v := binary.BigEndian.AppendUint64(b.val[:0], seq)
	v = append(v, mask)
	b.set(k, binary.BigEndian.AppendUint32(v, order))
}

// DeleteEntry drops a residency.
func (b *StateBatch) DeleteEntry(worker uint64, dp uint32, eh uint64) {
	b.del(binary.BigEndian.AppendUint64(appendRank(b.k(KindEntry), worker, dp), eh))
}

// PutRank records a rank's metadata (opaque).
func (b *StateBatch) PutRank(worker uint64, dp uint32, meta []byte) {
	b.set(appendRank(b.k(KindRank), worker, dp), meta)
}

// DeleteRank drops a rank's metadata.
func (b *StateBatch) DeleteRank(worker uint64, dp uint32) {
	b.del(appendRank(b.k(KindRank), worker, dp))
}

// Put sets an opaque record of a kind keyed by key (workers, bookings,
// tombstones, settings, members).
func (b *StateBatch) Put(kind byte, key, value []byte) {
	b.set(append(b.k(kind), key...), value)
}

// Delete drops an opaque record.
func (b *StateBatch) Delete(kind byte, key []byte) {
	b.del(append(b.k(kind), key...))
}

// DecodeNode decodes a node record's value. Its last byte is the root
// flag, 0 or 1 (PutNode has never written another): any other value is
// refused, not read as "not a root", so that a damaged flag is not taken
// for a valid record.
func DecodeNode(v []byte) (parent, local uint64, root bool, err error) {
	if len(v) != 17 {
		return 0, 0, false, fmt.Errorf("%w: node record of %d bytes", ErrCorrupt, len(v))
	}
	if v[16] > 1 {
		return 0, 0, false, fmt.Errorf("%w: node record with root flag %d, want 0 or 1", ErrCorrupt, v[16])
	}
	return binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:]), v[16] == 1, nil
}

// DecodeEntry decodes a residency record.
func DecodeEntry(k, v []byte) (worker uint64, dp uint32, eh, seq uint64, mask uint8, order uint32, err error) {
	if len(k) != 20 || len(v) != 13 {
		return 0, 0, 0, 0, 0, 0, fmt.Errorf("%w: residency record of %d/%d bytes", ErrCorrupt, len(k), len(v))
	}
	return binary.BigEndian.Uint64(k), binary.BigEndian.Uint32(k[8:]), binary.BigEndian.Uint64(k[12:]),
		binary.BigEndian.Uint64(v), v[8], binary.BigEndian.Uint32(v[9:]), nil
}

// DecodeRankKey decodes a cursor or rank-metadata key.
func DecodeRankKey(k []byte) (worker uint64, dp uint32, err error) {
	if len(k) != 12 {
		return 0, 0, fmt.Errorf("%w: rank key of %d bytes", ErrCorrupt, len(k))
	}
	return binary.BigEndian.Uint64(k), binary.BigEndian.Uint32(k[8:]), nil
}

// DecodeCursor decodes a cursor record's value (PutCursor): the last
// applied event id, and the incarnation, 0 when the value has none (8
// bytes: written with incarnation 0, or before incarnations existed).
func DecodeCursor(v []byte) (id, incarnation uint64, err error) {
	switch len(v) {
	case 8:
		return binary.BigEndian.Uint64(v), 0, nil
	case 16:
		return binary.BigEndian.Uint64(v), binary.BigEndian.Uint64(v[8:]), nil
	}
	return 0, 0, fmt.Errorf("%w: cursor value of %d bytes, want 8 or 16", ErrCorrupt, len(v))
}

// DecodeU64 decodes an 8-byte big-endian value (tree node keys).
func DecodeU64(v []byte) (uint64, error) {
	if len(v) != 8 {
		return 0, fmt.Errorf("%w: value of %d bytes, want 8", ErrCorrupt, len(v))
	}
	return binary.BigEndian.Uint64(v), nil
}

// RemoveAll removes a state directory (a half-done restore).
func RemoveAll(dir string) error { return os.RemoveAll(dir) }
