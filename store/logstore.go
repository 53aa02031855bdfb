package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
)

// DefaultLogMemTableSize is the memtable size of the log database unless
// LogStoreOptions says otherwise. Pebble's 4 MiB default halves append
// throughput under raft's append-then-compact pattern: the many small L0
// tables each overlap the head range tombstones and keep compactions busy
// (see DESIGN.md for the measurement).
const DefaultLogMemTableSize = 64 << 20

// LogStoreOptions configures OpenLogStore. The zero value is ready to use.
type LogStoreOptions struct {
	// FS is the filesystem the database lives on; nil means the OS
	// filesystem. Tests pass vfs.NewCrashableMem() to simulate crashes.
	FS vfs.FS
	// Logger receives Pebble's messages and the store's own; nil means
	// slog.Default().
	Logger *slog.Logger
	// MemTableSize bounds one Pebble memtable; 0 means
	// DefaultLogMemTableSize. Up to two may be held at once.
	MemTableSize uint64
	// CacheBytes bounds the cache of recently stored entries (see
	// logCache); 0 means DefaultLogCacheBytes, a negative value no cache.
	CacheBytes int64
	// cacheSlots, when set, replaces logCacheSlots (tests).
	cacheSlots int
	// Stalls, when set, adds up the time Pebble stalls this store's
	// writes.
	Stalls *WriteStalls

	// tune, when set, adjusts the Pebble options just before Open. It is for
	// this package's tests (small memtables to force flushes during crash
	// tests); it must not touch anything the durability argument relies on.
	tune func(*pebble.Options)
}

// LogStore is the Raft log store and stable store of one node, on its own
// Pebble database. It is safe for concurrent use: reads run in parallel with
// each other and with writes; writes are serialized, because hashicorp/raft
// calls StoreLogs from its main loop and DeleteRange from its snapshot
// goroutine, and the cached first/last index must move with the data.
type LogStore struct {
	logger *slog.Logger

	// writeMu serializes writers so that a commit and the update of the
	// cached bounds that follows it are never interleaved with another
	// writer's. Lock order: writeMu, then mu.
	writeMu sync.Mutex

	// mu guards db against Close: every method holds it for reading while it
	// uses db, Close holds it for writing and sets db to nil.
	mu sync.RWMutex
	db *pebble.DB

	firstIndex atomic.Uint64
	lastIndex  atomic.Uint64
	// boundsUnknown is set when a DeleteRange committed but could not read
	// the new bounds: firstIndex and lastIndex then name entries that may
	// be gone, and the next FirstIndex or LastIndex reads them from disk
	// (reloadBounds), which also overwrites whatever StoreLogs moved them
	// to meanwhile. Written under writeMu.
	boundsUnknown atomic.Bool

	cache *logCache // nil when disabled

	stalls *WriteStalls // nil: not counted
}

var (
	_ raft.LogStore          = (*LogStore)(nil)
	_ raft.StableStore       = (*LogStore)(nil)
	_ raft.MonotonicLogStore = (*LogStore)(nil)
)

// OpenLogStore opens (creating if needed) the log store database in dir and
// loads the first and last log index.
func OpenLogStore(dir string, opts LogStoreOptions) (*LogStore, error) {
	logger := opts.Logger
	if logger == nil {
		logger = slog.Default()
	}
	logger = logger.With("component", "store.logstore", "dir", dir)
	popts := &pebble.Options{
		FS:                 opts.FS,
		Logger:             pebbleLogger{logger},
		FormatMajorVersion: pebble.FormatNewest,
		MemTableSize:       opts.MemTableSize,
	}
	if popts.MemTableSize == 0 {
		popts.MemTableSize = DefaultLogMemTableSize
	}
	if popts.FS == nil {
		popts.FS = vfs.Default
	}
	opts.Stalls.listen(popts, logger)
	if opts.tune != nil {
		opts.tune(popts)
	}
	db, err := pebble.Open(dir, popts)
	if err != nil {
		return nil, fmt.Errorf("open log store %s: %w", dir, err)
	}
	cacheBytes := opts.CacheBytes
	if cacheBytes == 0 {
		cacheBytes = DefaultLogCacheBytes
	}
	slots := opts.cacheSlots
	if slots == 0 {
		slots = logCacheSlots
	}
	s := &LogStore{logger: logger, db: db, cache: newLogCache(cacheBytes, slots), stalls: opts.Stalls}
	if err := s.checkLayout(); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("open log store %s: %w", dir, err)
	}
	if err := s.loadBounds(); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("open log store %s: %w", dir, err)
	}
	logger.Debug("log store open", "first_index", s.firstIndex.Load(), "last_index", s.lastIndex.Load())
	return s, nil
}

// checkLayout records the layout version in a new database and refuses a
// database written with another one.
func (s *LogStore) checkLayout() error {
	v, closer, err := s.db.Get(metaFormatKey)
	if errors.Is(err, pebble.ErrNotFound) {
		if err := s.db.Set(metaFormatKey, []byte{layoutVersion}, pebble.Sync); err != nil {
			return fmt.Errorf("write layout version: %w", err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("read layout version: %w", err)
	}
	defer closer.Close()
	if len(v) != 1 {
		return fmt.Errorf("layout version is %d bytes, want 1: %w", len(v), ErrCorrupt)
	}
	if v[0] != layoutVersion {
		return fmt.Errorf("layout version %d, this build reads %d: %w", v[0], layoutVersion, ErrUnsupportedVersion)
	}
	return nil
}

// loadBounds reads the smallest and largest log index from disk into the
// cached atomics. Callers hold writeMu (or own the store exclusively, as
// OpenLogStore does) and mu for reading.
func (s *LogStore) loadBounds() error {
	it, err := s.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixLog},
		UpperBound: logKeyUpperBound(),
	})
	if err != nil {
		return fmt.Errorf("load log bounds: %w", err)
	}
	var first, last uint64
	var ok bool
	if it.First() {
		if first, ok = logKeyIndex(it.Key()); !ok {
			_ = it.Close()
			return fmt.Errorf("load log bounds: malformed log key %x: %w", it.Key(), ErrCorrupt)
		}
		if !it.Last() {
			_ = it.Close()
			return fmt.Errorf("load log bounds: last key vanished: %w", errors.Join(ErrCorrupt, it.Error()))
		}
		if last, ok = logKeyIndex(it.Key()); !ok {
			_ = it.Close()
			return fmt.Errorf("load log bounds: malformed log key %x: %w", it.Key(), ErrCorrupt)
		}
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		return fmt.Errorf("load log bounds: %w", err)
	}
	s.firstIndex.Store(first)
	s.lastIndex.Store(last)
	s.boundsUnknown.Store(false)
	return nil
}

// reloadBounds reads the bounds from disk if a DeleteRange left them
// unknown. It takes writeMu before mu (the lock order), so that no writer
// moves the bounds between the read and its store.
func (s *LogStore) reloadBounds() error {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return ErrClosed
	}
	if !s.boundsUnknown.Load() { // another caller read them first
		return nil
	}
	return s.loadBounds()
}

// FirstIndex returns the smallest stored log index, or 0 for an empty log.
func (s *LogStore) FirstIndex() (uint64, error) {
	if s.boundsUnknown.Load() {
		if err := s.reloadBounds(); err != nil {
			return 0, fmt.Errorf("first index: %w", err)
		}
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return 0, fmt.Errorf("first index: %w", ErrClosed)
	}
	return s.firstIndex.Load(), nil
}

// LastIndex returns the largest stored log index, or 0 for an empty log.
func (s *LogStore) LastIndex() (uint64, error) {
	if s.boundsUnknown.Load() {
		if err := s.reloadBounds(); err != nil {
			return 0, fmt.Errorf("last index: %w", err)
		}
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return 0, fmt.Errorf("last index: %w", ErrClosed)
	}
	return s.lastIndex.Load(), nil
}

// GetLog reads the entry at index into log. A missing index returns
// raft.ErrLogNotFound itself: raft compares it with ==, and a wrapped error
// would make the leader retry forever instead of sending a snapshot.
func (s *LogStore) GetLog(index uint64, log *raft.Log) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("get log %d: %w", index, ErrClosed)
	}
	if s.cache.get(index, log) {
		return nil
	}
	v, closer, err := s.db.Get(logKey(index))
	if errors.Is(err, pebble.ErrNotFound) {
		return raft.ErrLogNotFound
	}
	if err != nil {
		return fmt.Errorf("get log %d: %w", index, err)
	}
	// decodeLog copies everything it keeps out of v, so the getter can be
	// closed (and Pebble free or reuse v's block) right after.
	l, err := decodeLog(v)
	if cerr := closer.Close(); cerr != nil && err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("get log %d: %w", index, err)
	}
	if l.Index != index {
		return fmt.Errorf("get log %d: entry holds index %d: %w", index, l.Index, ErrCorrupt)
	}
	*log = l
	return nil
}

// StoreLog stores one entry; see StoreLogs.
func (s *LogStore) StoreLog(log *raft.Log) error {
	return s.StoreLogs([]*raft.Log{log})
}

// StoreLogs stores entries in one synced Pebble batch: all of them or none
// survive a crash, and one fsync pays for the whole batch (group commit).
// A batch with a nil entry or one at index 0 is refused whole. After Close
// every batch, refused or not, returns ErrClosed.
func (s *LogStore) StoreLogs(logs []*raft.Log) error {
	// Closed is checked first, as in DeleteRange: a closed store answers
	// ErrClosed whatever it is given (doc.go).
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("store logs: %w", ErrClosed)
	}
	if len(logs) == 0 {
		return nil
	}
	lo, hi := ^uint64(0), uint64(0)
	size := 0
	for i, l := range logs {
		if l == nil {
			return fmt.Errorf("store logs: entry %d of %d is nil: %w", i, len(logs), ErrInvalidArgument)
		}
		// Raft's log starts at 1, and a bound of 0 means an empty log: an
		// entry at 0 would leave the cached bounds and the disk disagreeing.
		if l.Index == 0 {
			return fmt.Errorf("store logs: entry %d of %d has index 0, and a Raft log starts at 1: %w", i, len(logs), ErrInvalidArgument)
		}
		lo, hi = min(lo, l.Index), max(hi, l.Index)
		size += logKeyLen + encodedLogSizeHint(l)
	}

	b := s.db.NewBatchWithSize(size + 64)
	defer b.Close()
	var buf []byte
	for _, l := range logs {
		// Batch.Set copies key and value into the batch, so buf is reused.
		buf = appendLog(buf[:0], l)
		if err := b.Set(logKey(l.Index), buf, nil); err != nil {
			return fmt.Errorf("store logs %d..%d: add %d: %w", lo, hi, l.Index, err)
		}
	}
	if err := commitLogBatch(b); err != nil {
		return fmt.Errorf("store logs %d..%d: %w", lo, hi, err)
	}
	s.cache.add(logs)

	// Only after the commit is durable may readers see the new bounds.
	if first := s.firstIndex.Load(); first == 0 || lo < first {
		s.firstIndex.Store(lo)
	}
	if hi > s.lastIndex.Load() {
		s.lastIndex.Store(hi)
	}
	return nil
}

// DeleteRange deletes the entries min..max inclusive with one synced range
// tombstone, whatever the size of the range. Raft uses it both to compact
// the head of the log after a snapshot and to truncate a conflicting tail.
// The cached bounds are recomputed from disk afterwards, so a range that
// covers missing indexes, or the whole log, leaves them exact.
func (s *LogStore) DeleteRange(min, max uint64) error {
	s.writeMu.Lock()
	defer s.writeMu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("delete range %d..%d: %w", min, max, ErrClosed)
	}
	if min > max {
		return fmt.Errorf("delete range %d..%d: min > max: %w", min, max, ErrInvalidArgument)
	}

	b := s.db.NewBatch()
	defer b.Close()
	if err := b.DeleteRange(logKey(min), logSpanEnd(max), nil); err != nil {
		return fmt.Errorf("delete range %d..%d: %w", min, max, err)
	}
	// Dropped before the commit: a reader between the two would find
	// entries the log no longer holds.
	s.cache.deleted(min, max)
	if err := commitLogBatch(b); err != nil {
		return fmt.Errorf("delete range %d..%d: %w", min, max, err)
	}
	if err := s.loadBounds(); err != nil {
		// The tombstone is durable; only the read of the new bounds
		// failed. Left as they were, the bounds would name entries that
		// are gone (after a tail truncation and a re-append, a LastIndex
		// the store does not hold). They cannot be worked out from the
		// range alone either: the log may have a hole (DESIGN.md,
		// Durability argument 5), and a range ending in it leaves the
		// bound at the far side of the hole. So the next FirstIndex or
		// LastIndex reads them.
		s.boundsUnknown.Store(true)
		return fmt.Errorf("delete range %d..%d (done; its new bounds are read again at the next FirstIndex or LastIndex): %w", min, max, err)
	}
	return nil
}

// logBatchCommitting and logBatchCommitted, when set (tests), run in a
// writer (StoreLogs, DeleteRange) just before and just after its batch
// commits: a read there sees what a concurrent reader would between the
// cache and bounds updates and the commit.
var logBatchCommitting, logBatchCommitted func()

// commitLogBatch commits a write of the log, synced.
func commitLogBatch(b *pebble.Batch) error {
	if logBatchCommitting != nil {
		logBatchCommitting()
	}
	if err := b.Commit(pebble.Sync); err != nil {
		return err
	}
	if logBatchCommitted != nil {
		logBatchCommitted()
	}
	return nil
}

// IsMonotonic reports true, so that after installing or restoring a
// snapshot raft deletes the old log (one range tombstone here, cheap)
// instead of keeping it beside the snapshot. The store itself keeps
// whatever it is given, holes included: raft leaves one below a snapshot
// when it is killed between installing the snapshot and deleting the old
// log, and appends from the snapshot's next index after a restart (see
// DESIGN.md, Durability argument 5, for why that is harmless to raft).
func (s *LogStore) IsMonotonic() bool { return true }

// Set stores val under key, synced.
func (s *LogStore) Set(key, val []byte) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("set %q: %w", key, ErrClosed)
	}
	if err := s.db.Set(stableKey(key), val, pebble.Sync); err != nil {
		return fmt.Errorf("set %q: %w", key, err)
	}
	return nil
}

// Get returns a copy of the value stored under key. A key never set returns
// ErrKeyNotFound, unwrapped: its text "not found" is what raft checks for.
func (s *LogStore) Get(key []byte) ([]byte, error) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return nil, fmt.Errorf("get %q: %w", key, ErrClosed)
	}
	v, closer, err := s.db.Get(stableKey(key))
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, ErrKeyNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("get %q: %w", key, err)
	}
	out := make([]byte, len(v))
	copy(out, v)
	if err := closer.Close(); err != nil {
		return nil, fmt.Errorf("get %q: %w", key, err)
	}
	return out, nil
}

// SetUint64 stores val under key as 8 big-endian bytes, synced. It shares
// the keyspace of Set: the same key holds one value or the other.
func (s *LogStore) SetUint64(key []byte, val uint64) error {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], val)
	if err := s.Set(key, b[:]); err != nil {
		return fmt.Errorf("set uint64: %w", err)
	}
	return nil
}

// GetUint64 returns the uint64 stored under key, or 0, nil for a key never
// set.
func (s *LogStore) GetUint64(key []byte) (uint64, error) {
	v, err := s.Get(key)
	if err == ErrKeyNotFound {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("get uint64: %w", err)
	}
	if len(v) != 8 {
		return 0, fmt.Errorf("get uint64 %q: value is %d bytes, want 8: %w", key, len(v), ErrCorrupt)
	}
	return binary.BigEndian.Uint64(v), nil
}

// Close closes the database. Later calls to any method, Close included,
// return an error wrapping ErrClosed.
func (s *LogStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.db == nil {
		return fmt.Errorf("close log store: %w", ErrClosed)
	}
	err := s.db.Close()
	s.db = nil
	s.stalls.closed()
	if err != nil {
		return fmt.Errorf("close log store: %w", err)
	}
	return nil
}
