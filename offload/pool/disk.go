package pool

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/kvevent"
)

// DiskPool is the G3 pool: blocks in a Pebble database in one directory,
// which a later OpenDisk on that directory finds again. Its events carry
// kvevent.TierDisk.
//
// Key layout (one kind byte, then a big-endian hash):
//
//	'h'            format version (1) and block size (8)
//	'i'            identity: what wrote the blocks (DiskOptions.Identity)
//	'm' hash(8)    metadata: version(1) parent(8) local(8) stamp(8)
//	'd' hash(8)    the block's bytes
//
// A block's two keys are written in one batch, so they appear together.
// Opening scans only the small 'm' keys (and the 'd' keys with the length
// of their values, not the values) to rebuild the pool; the stamp restores
// the eviction order as of each block's registration. What it cannot use
// (half a block, bytes of another length than the block size, metadata
// that does not decode or names an invalid block, blocks on a loop of
// parents, a key of the wrong length) it deletes, leaving the valid blocks as they are.
//
// All methods are safe for concurrent use.
type DiskPool struct {
	c          *core
	db         *pebble.DB
	dir        string
	opts       DiskOptions
	bs         int
	unregister func()

	// io is held shared by every call that uses db outside the core's
	// lock, and exclusively by Close, so the database is never closed
	// under a write or a read.
	io sync.RWMutex

	// Group commit of SyncFlush: each Put, once its batch is committed,
	// takes a number from committed; flushed is the highest number known
	// to be on disk. A Put whose number is covered returns without
	// flushing. Guarded by flushMu.
	committed atomic.Uint64
	flushMu   sync.Mutex
	flushed   uint64

	// flushes follows Pebble's flushes: Puts are refused while the last
	// one failed.
	flushes *flushWatch
	// l0 follows L0's depth: Puts are refused while it is l0Refuse
	// sublevels or more.
	l0 *l0Watch

	// damage records the damage a background job of Pebble's met;
	// watchDamage, a goroutine from OpenDisk to Close, then shuts the
	// pool down. stop ends it at Close.
	damage   *damageWatch
	stop     chan struct{}
	stopOnce sync.Once
	watcher  sync.WaitGroup
	// closed is set by Close (the core is closed by the shutdown too).
	closed atomic.Bool
}

// SyncMode is how a DiskPool makes a Put durable before it returns.
type SyncMode uint8

const (
	// SyncFlush (the default) runs Pebble without a write-ahead log: a Put
	// commits its batch to the memtable and then flushes the memtable
	// (concurrent Puts share one flush). A block's bytes are written to disk
	// once, into a blob file. Evictions become durable with the next flush
	// or Close; after a crash, blocks evicted since may reappear.
	SyncFlush SyncMode = iota
	// SyncWAL runs Pebble with its write-ahead log and commits every Put's
	// batch with Sync. A block's bytes are written twice: to the log, then
	// to a blob file when the memtable is flushed.
	SyncWAL
)

func (m SyncMode) String() string {
	switch m {
	case SyncFlush:
		return "flush"
	case SyncWAL:
		return "wal"
	}
	return fmt.Sprintf("sync(%d)", uint8(m))
}

// DiskOptions tunes a DiskPool's Pebble database. The zero value is the
// tuned default (see DESIGN.md).
type DiskOptions struct {
	Sync SyncMode
	// MemTableSize, default 64 MiB. A Put batch of at least about half of it
	// skips the memtable (Pebble queues it for flushing as is). Under
	// SyncWAL, writes stall while four memtables' worth wait for flushing.
	MemTableSize uint64
	// FS, default the operating system's.
	FS vfs.FS
	// Identity names what the blocks are KV of, as the writer knows it
	// (kvagent: worker id, model, salt, block size in tokens). It is
	// recorded in the pool; a pool opened with another identity, or one
	// that recorded none (written before identities were), drops its
	// blocks at open instead of restoring them: they would be advertised
	// and onboarded as KV of an engine they do not belong to.
	Identity string
}

const (
	diskFormat  = 1
	kindHeader  = 'h'
	kindIdent   = 'i'
	kindMeta    = 'm'
	kindData    = 'd'
	metaLen     = 1 + 8 + 8 + 8
	headerLen   = 1 + 8
	defaultMemT = 64 << 20
)

func hashKey(kind byte, h uint64) []byte {
	k := make([]byte, 9)
	k[0] = kind
	binary.BigEndian.PutUint64(k[1:], h)
	return k
}

func encodeMeta(b Block, stamp uint64) []byte {
	v := make([]byte, metaLen)
	v[0] = diskFormat
	binary.BigEndian.PutUint64(v[1:], b.Parent)
	binary.BigEndian.PutUint64(v[9:], b.Local)
	binary.BigEndian.PutUint64(v[17:], stamp)
	return v
}

// noWriteStall is MemTableStopWritesThreshold under SyncFlush: so high
// that Pebble never stalls a write for its queue of memtables.
//
// Pebble stalls every write (a commit that rotates the memtable, an
// AsyncFlush) while the memtables and large batches queued for flushing
// add up to MemTableStopWritesThreshold memtables, until a flush brings
// them under. On a full disk no flush does. A Put batch of half a memtable
// or more is queued as a memtable of its own, so one Put of four
// memtables' worth, or a few concurrent smaller ones, stalled its own
// flush for good, and Close behind it: the flush watch ends a wait for a
// failed flush, not Pebble's stall. Under SyncFlush the stall bounds
// nothing the callers do not: every Put waits for its own flush, so the
// queue holds the batches of the Puts in flight (whose callers hold the
// bytes too) and, on a full disk, what was queued before the first flush
// failed (later Puts are refused until one succeeds). Under SyncWAL Puts
// do not wait for flushes, and the stall is what bounds the memtables.
// (1<<20 memtables of Pebble's largest, 4 GiB, still fit a uint64.)
const noWriteStall = 1 << 20

// l0StopWrites is Pebble's L0StopWritesThreshold (see pebbleOptions):
// twice l0Refuse. A Put checks L0's depth once, before it writes, and adds
// one flush (one sublevel) at most after it (its own, or one a Put beside
// it shares; a Put over maxBatchBytes adds one per batch), and Pebble
// flushes one memtable queue at a time: L0 passes l0Refuse by about the
// Puts in flight. The pool's lock does not bound them (Puts share it), its
// callers do: the offload manager's copy workers, 2 per path by default
// (--offload-workers). A margin of 16 sublevels is many times that, so
// the Puts never reach the stall; and the stall stays a bound, where 1000
// (the previous build's) let L0 grow as deep as the writes took it.
const l0StopWrites = 2 * l0Refuse

func pebbleOptions(o DiskOptions, logger *slog.Logger, flushes *flushWatch, l0 *l0Watch, damage *damageWatch) *pebble.Options {
	popts := &pebble.Options{
		FS:                 failedBlobsFS{o.FS},
		Logger:             pebbleLogger{logger},
		EventListener:      eventListener(logger, flushes, l0, damage),
		FormatMajorVersion: pebble.FormatValueSeparation,
		DisableWAL:         o.Sync == SyncFlush,
		MemTableSize:       o.MemTableSize,
		// SyncWAL: up to four memtables may queue for flushing before
		// writes stall, a burst of offloads absorbed while the disk
		// catches up. SyncFlush: no stall (see noWriteStall).
		MemTableStopWritesThreshold: 4,
		// Pebble stalls every write while L0 holds this many sublevels,
		// until a compaction brings it under; on a full disk none does,
		// and a Put waited in its flush for good, Close behind it. Puts
		// are refused once L0 is l0Refuse deep, whatever the cause
		// (l0Watch), so that they never reach the stall: it sits a
		// margin above, for the Puts in flight (see l0StopWrites).
		L0StopWritesThreshold: l0StopWrites,
		// The block cache only ever holds keys and metadata worth caching;
		// block bytes are read once per onboarding.
		CacheSize: 8 << 20,
	}
	if o.Sync == SyncFlush {
		popts.MemTableStopWritesThreshold = noWriteStall
	}
	// KV tensors do not compress (and compressing 2 MiB per block costs a
	// core on a small machine); keys are tiny.
	popts.ApplyCompressionSettings(func() pebble.DBCompressionSettings { return pebble.DBCompressionNone })
	// Value separation: a block's bytes go to a blob file when the memtable
	// is flushed and stay there; compactions move only the small keys and
	// blob references, never the blocks.
	popts.Experimental.ValueSeparationPolicy = func() pebble.ValueSeparationPolicy {
		policy := pebble.ValueSeparationPolicy{
			Enabled:     true,
			MinimumSize: 1024, // block bytes; metadata (25 bytes) stays inline
			// Hash keys are spread over the whole key space, so every
			// key sstable overlaps every blob file: Pebble's default depth
			// (a handful) would make each compaction of the tiny key files
			// rewrite all the block bytes. Never rewrite for depth; point
			// reads of one value do not care how many blob files a table
			// references.
			MaxBlobReferenceDepth: 1 << 20,
			// No blob-file rewrites: space from evicted blocks comes back
			// only when a blob file is entirely dead (LRU evicts roughly
			// in registration order, so most die whole). A rewrite reads
			// every live block of its file, and Pebble (v2.1) reports a
			// damaged one with no file metadata, a panic on its
			// compaction goroutine ("unknown metadata type: <nil>") that
			// nothing can recover: one flipped byte in a block ended the
			// process, and again after each restart. The cost is disk
			// space where blocks of one Put die at different times (see
			// DESIGN.md). 1.0 is Pebble's "never rewrite".
			TargetGarbageRatio: 1.0,
		}
		if testHookValueSeparation != nil {
			testHookValueSeparation(&policy)
		}
		return policy
	}
	// One output file per flush. The default (2 MB) splits a flush of 16
	// blocks into 16 sstables, each with its own blob file (Pebble pairs
	// them one to one) and its own fsync, which halved the write rate.
	popts.TargetFileSizes[0] = 128 << 20
	return popts
}

// testHookValueSeparation, nil outside tests, adjusts the value separation
// policy (to make Pebble's blob-file rewrites start at once).
var testHookValueSeparation func(*pebble.ValueSeparationPolicy)

// eventListener reports Pebble's events the pool cares about to logger.
//
// Pebble's default DataCorruption listener calls Logger.Fatalf, and Fatalf
// must not return: one flipped byte in an sstable killed the process, from
// whichever goroutine met it first, often Pebble's own table-stats loader
// started by the open, where nothing can recover. Corruption is already
// returned to the read that meets it (as ErrCorrupt: OpenDisk fails, a
// block's read fails and drops it); the listener logs it, once per file
// (see damageWatch), and the corruption a background job meets shuts the
// pool down, as does a compaction that keeps failing to read a file
// (CompactionEnd). EnsureDefaults fills in only the hooks left nil, so the
// fatal default is not added back.
//
// Compactions are reported to damage, flushes to flushes, and both to l0
// (L0's depth changes only at them). A failed flush is also a background
// error, and Pebble retries it at once, over and over: flushes logs the
// first failure and the recovery, and the background error of each retry
// is not logged again. Other background errors are logged at most once
// per errorLogEvery (errorLog). Errors are logged by their text: Pebble's
// carry a stack trace, which a text handler would print whole.
func eventListener(logger *slog.Logger, flushes *flushWatch, l0 *l0Watch, damage *damageWatch) *pebble.EventListener {
	errs := &errorLog{log: logger}
	return &pebble.EventListener{
		DataCorruption: damage.file,
		BackgroundError: func(err error) {
			if !damage.background(err) && !flushes.failedWith(err) {
				errs.error(err)
			}
		},
		CompactionEnd: func(info pebble.CompactionInfo) {
			damage.compaction(info)
			l0.changed()
		},
		FlushEnd: func(info pebble.FlushInfo) {
			flushes.end(info)
			l0.changed()
		},
	}
}

// errorLogEvery is how often, at most, the pool logs a failed background
// job of Pebble's.
const errorLogEvery = 10 * time.Second

// An errorLog logs the background errors no watch accounts for, one line
// per errorLogEvery at most, which says how many it left out since the
// last. Pebble retries a failed compaction at once, for as long as it
// fails (a full disk: each retry names another output file), and reports
// each failure: thousands of lines a second, logged one by one.
type errorLog struct {
	log *slog.Logger

	mu      sync.Mutex
	at      time.Time // of the last line
	omitted int       // errors not logged since
}

func (l *errorLog) error(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if !l.at.IsZero() && now.Sub(l.at) < errorLogEvery {
		l.omitted++
		return
	}
	args := []any{"err", err.Error()}
	if l.omitted > 0 {
		args = append(args, "omitted", l.omitted)
	}
	l.log.Error("offload pool: pebble background job failed (logged once per "+errorLogEvery.String()+
		" at most; omitted: failures left out since the last line)", args...)
	l.at, l.omitted = now, 0
}

// A damageWatch follows the damage Pebble reports through its
// EventListener.
//
// A read that meets a damaged file gets the corruption back and the pool
// goes on (a block's read fails and the block is dropped; an open fails).
// A background job does not: a compaction that meets a damaged sstable
// fails, and Pebble picks it again at once, for ever (it sets no problem
// span on L0, and one of five minutes below), reporting the damage twice
// each time: thousands of lines a second, and a core. L0, never compacted
// again, grows with every flush until Pebble stalls every write: a Put
// then waits in its flush for ever, and Close behind it. Pebble's default
// listener ended the process at the first report instead. The watch logs
// each damaged file once, records the first corruption a background job
// meets, and the pool shuts itself down (watchDamage).
//
// A file the disk cannot read (a bad sector: EIO, or Pebble's "could not
// read footer") is not corruption to Pebble, and the compaction that reads
// it is retried at once, for ever, just the same. The watch counts the
// failed compactions while they fail with the same error (compactionFailures
// of them shut the pool down), leaving out those that fail because the
// disk is full, which end once there is room, and those Pebble cancels.
type damageWatch struct {
	log *slog.Logger

	mu     sync.Mutex
	err    error           // why the pool shuts down: the first damage a background job met
	found  chan struct{}   // closed then
	logged map[string]bool // the damaged files logged

	failed  string // the error of the last compaction that failed
	repeats int    // the failed compactions since the last other error
}

// compactionFailures is how many failed compactions, with no failure of
// another error between, must fail with the same error (neither
// corruption nor a full disk) for the pool to shut down. Pebble retries
// an L0 compaction at once and, below L0, after 30 seconds: one failure
// may be passing, the same one three times is a file that cannot be read.
// Compactions that succeed in between do not restart the count: they did
// not read that file.
const compactionFailures = 3

func newDamageWatch(log *slog.Logger) *damageWatch {
	return &damageWatch{log: log, found: make(chan struct{}), logged: make(map[string]bool)}
}

// file is the DataCorruption hook: it logs each damaged file once.
func (w *damageWatch) file(info pebble.DataCorruptionInfo) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.logged[info.Path] {
		return
	}
	w.logged[info.Path] = true
	w.log.Error("offload pool: pebble found a damaged file", "path", info.Path, "err", info.Details.Error())
}

// background takes a background job's error and reports whether it is
// corruption, which shuts the pool down.
func (w *damageWatch) background(err error) bool {
	if !pebble.IsCorruptionError(err) {
		return false
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.shut(fmt.Errorf("pebble met damaged data: %w", err),
		"a background job of pebble's met damaged data; the disk pool shuts down: "+
			"its blocks are dropped and its writes and reads fail; a restart refuses the pool "+
			"(deleting its directory starts it empty)")
	return true
}

// compaction is the CompactionEnd hook: the compactionFailures-th
// failure with the same error (and none other between) shuts the pool
// down.
// Corruption is left to background, which sees it next.
func (w *damageWatch) compaction(info pebble.CompactionInfo) {
	err := info.Err
	if err == nil || errors.Is(err, pebble.ErrCancelledCompaction) || pebble.IsCorruptionError(err) || diskFull(err) {
		return
	}
	text := err.Error()
	w.mu.Lock()
	defer w.mu.Unlock()
	if text != w.failed {
		w.failed, w.repeats = text, 0
	}
	w.repeats++
	if w.repeats < compactionFailures {
		return
	}
	w.shut(fmt.Errorf("a compaction of pebble's failed %d times: %w", w.repeats, err),
		"a compaction of pebble's failed "+fmt.Sprint(compactionFailures)+" times with the same "+
			"error (a file it cannot read: a failing disk?); the disk pool shuts down: its blocks are "+
			"dropped and its writes and reads fail until a restart")
}

// shut records why the pool shuts down and logs it, the first time. The
// caller holds w.mu.
func (w *damageWatch) shut(err error, msg string) {
	if w.err != nil {
		return
	}
	w.err = err
	close(w.found)
	w.log.Error("offload pool: "+msg, "err", err.Error())
}

// diskFull says whether err is a write refused for want of room.
func diskFull(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT)
}

// state returns a channel closed once a background job has met damaged
// data (see damageWatch), and why the pool shuts down (nil before).
func (w *damageWatch) state() (<-chan struct{}, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.found, w.err
}

// A flushWatch follows Pebble's flushes through its EventListener: whether
// the last one failed, and a channel closed at the next failure.
//
// Pebble retries a failed flush at once, for as long as it fails (a full
// disk), and DB.Flush waits for a flush that succeeds: a Put waiting in it
// never returned, nor did Close behind it. With the watch, a wait for a
// flush ends at the flush's failure, and Puts are refused while the last
// flush failed: each refused Put would have queued one more memtable that
// cannot be written, held in memory until the disk has room (and under
// SyncWAL, once they add up to MemTableStopWritesThreshold memtables,
// Pebble stalls every commit, an eviction's delete under the pool's lock
// included, until a flush succeeds; see noWriteStall).
type flushWatch struct {
	log *slog.Logger

	mu       sync.Mutex
	err      error         // the last flush's error; nil once one succeeds
	failures int           // flushes failed since the last success
	failed   chan struct{} // closed at the next failure
	total    uint64        // flushes failed since the open
}

func newFlushWatch(log *slog.Logger) *flushWatch {
	return &flushWatch{log: log, failed: make(chan struct{})}
}

// end is the FlushEnd hook. Pebble calls it under its own lock: it must not
// call into the database.
func (w *flushWatch) end(info pebble.FlushInfo) {
	err := info.Err
	// Pebble's errEmptyTable (unexported) reports a flush that succeeded
	// without writing a table: only its text tells it apart.
	if err != nil && err.Error() == "pebble: empty table" {
		err = nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if err == nil {
		if w.failures > 0 {
			w.log.Warn("offload pool: a flush succeeded again; writes to the disk pool resume",
				"failed_flushes", w.failures)
		}
		w.err, w.failures = nil, 0
		return
	}
	if w.failures == 0 {
		w.log.Error("offload pool: a flush failed (disk full or failing?); writes to the disk pool fail "+
			"until Pebble's retries of it succeed", "err", err.Error())
	}
	w.err = err
	w.failures++
	w.total++
	close(w.failed)
	w.failed = make(chan struct{})
}

// state returns a channel closed at the next failed flush, how many have
// failed so far, and the error of the last flush: nil when it succeeded.
func (w *flushWatch) state() (<-chan struct{}, uint64, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failed, w.total, w.err
}

// failedWith says whether err is the last flush's failure.
func (w *flushWatch) failedWith(err error) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err != nil && errors.Is(err, w.err)
}

// An l0Watch follows L0's depth, in sublevels, and refuses Puts while it
// is l0Refuse or more, whatever the cause: compactions that fail for want
// of room, or that lag behind the writes on a healthy disk. Pebble's
// compactions go on meanwhile, and the refusal ends by itself at the first
// Put that finds L0 shallow again.
//
// A flush writes a Put's keys and, from value separation's MinimumSize on,
// its bytes; a compaction of L0 writes the keys of every L0 file merged.
// With smaller blocks, whose bytes stay in the sstables (a compaction
// rewrites them), flushes go on fitting on a filling disk where no
// compaction of L0 does: every Put's flush added a sublevel until Pebble's
// L0StopWritesThreshold, and Pebble stalled every write for good, a Put
// waiting in its flush and Close behind it. Refusing only once a
// compaction had failed for want of room came too late (L0 was often 40
// to 60 sublevels deep by then), and on a healthy disk under heavy writes
// nothing bounded L0 but the stall (85 sublevels in 25 s, reads 20 to 30 %
// slower). Refusing at a depth bounds L0 in both cases, and the stall
// (l0StopWrites) sits above it by a margin for the Puts in flight.
//
// L0's depth changes only when a flush or a compaction ends: the hooks
// count them (events), and a Put reads Pebble's metrics only when one has
// ended since the last read.
type l0Watch struct {
	log *slog.Logger

	// events counts the flushes and compactions ended. The hooks add to
	// it under Pebble's lock, after the version they made is installed.
	events atomic.Uint64

	mu      sync.Mutex
	seen    uint64 // events at the last read of depth
	read    bool   // depth was read at least once
	depth   int    // L0's sublevels at the last read
	refused int    // Puts refused since the refusal began; 0 while none is
}

func newL0Watch(log *slog.Logger) *l0Watch { return &l0Watch{log: log} }

// changed is part of the FlushEnd and CompactionEnd hooks. Pebble calls it
// under its own lock: it must not call into the database, nor take mu
// (check holds mu while it reads Pebble's metrics, under Pebble's lock).
func (w *l0Watch) changed() { w.events.Add(1) }

// check is nil unless a Put must be refused: L0 is l0Refuse sublevels deep
// or more. sublevels reads L0's depth from Pebble (its metrics, under its
// lock), only when a flush or a compaction ended since the last read. The
// first refusal of an episode, and the first Put let through after it,
// are logged.
func (w *l0Watch) check(sublevels func() int) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	// events is loaded before the read: a flush ending during it is read
	// again by the next Put.
	if ev := w.events.Load(); !w.read || ev != w.seen {
		w.depth, w.seen, w.read = sublevels(), ev, true
	}
	if w.depth >= l0Refuse {
		if w.refused == 0 {
			w.log.Warn(fmt.Sprintf("offload pool: L0 is %d sublevels deep; writes to the disk pool fail "+
				"until compactions bring it under %d", w.depth, l0Refuse))
		}
		w.refused++
		return fmt.Errorf("%w: %d sublevels deep, refused until compactions bring it under %d",
			ErrL0Deep, w.depth, l0Refuse)
	}
	if w.refused > 0 {
		w.log.Warn(fmt.Sprintf("offload pool: compactions brought L0 under %d sublevels; writes to the disk pool resume",
			l0Refuse), "refused_puts", w.refused)
		w.refused = 0
	}
	return nil
}

// l0Sublevels reads L0's depth, in sublevels, from Pebble's metrics.
func (p *DiskPool) l0Sublevels() int { return int(p.db.Metrics().Levels[0].Sublevels) }

// l0Refuse is how deep L0 may grow, in sublevels, before Puts are refused
// (see l0Watch): four times Pebble's L0CompactionThreshold (4), so that
// Pebble compacts L0 well before the refusal and keeps doing so during it,
// and a healthy disk under a steady load seldom meets it. A burst of synced
// writes (SyncFlush, each Put its own flush) meets it easily where the
// machine is slow (the long crash test of four such writers under -race).
const l0Refuse = 16

// OpenDisk opens the disk pool in dir, creating it if needed. An existing
// pool is rebuilt from its keys: the blocks, their parents and their
// registration order; if it holds more than cfg.Capacity blocks, the excess
// is evicted (least recently registered leaves first) without events.
// Entries it cannot use (half a block, bytes of another length than
// cfg.BlockSize, metadata that does not decode or names a block Put would
// refuse, a block on a loop of parents, a key of the wrong length) are
// deleted and logged with their counts; if that deletion fails, it is logged and
// the pool opens with its valid blocks all the same. It fails with
// ErrCorrupt when dir holds a pool of another block size or format, or
// one whose keys Pebble finds damaged (a damaged sstable: the pool is a
// cache, and deleting dir starts it empty). A
// pool of another opts.Identity (or none recorded) is emptied first: its
// blocks are deleted, not restored, and the count logged.
//
// Damage that one of Pebble's background jobs (a compaction) meets while
// the pool is open, or a file a compaction keeps failing to read, shuts
// the pool down (see Close).
func OpenDisk(dir string, cfg Config, opts DiskOptions) (*DiskPool, error) {
	if err := cfg.check(); err != nil {
		return nil, fmt.Errorf("open disk pool %s: %w", dir, err)
	}
	if opts.Sync != SyncFlush && opts.Sync != SyncWAL {
		return nil, fmt.Errorf("open disk pool %s: %w: sync mode %d", dir, ErrInvalid, opts.Sync)
	}
	if opts.MemTableSize == 0 {
		opts.MemTableSize = defaultMemT
	}
	if opts.FS == nil {
		opts.FS = vfs.Default
	}
	logger := cfg.Logger.With("component", "offload.pool.disk", "dir", dir)
	flushes, l0, damage := newFlushWatch(logger), newL0Watch(logger), newDamageWatch(logger)
	db, err := pebble.Open(dir, pebbleOptions(opts, logger, flushes, l0, damage))
	if err != nil {
		return nil, fmt.Errorf("open disk pool %s: %w", dir, corrupt(err))
	}
	p := &DiskPool{db: db, dir: dir, opts: opts, bs: cfg.BlockSize, flushes: flushes, l0: l0, damage: damage,
		stop: make(chan struct{})}
	p.c = newCore(cfg, kvevent.TierDisk, p)
	if err := p.load(); err != nil {
		db.Close()
		return nil, fmt.Errorf("open disk pool %s: %w", dir, corrupt(err))
	}
	// A background job (the table stats of the open, a compaction) may
	// have met damage the scan did not read.
	if _, err := damage.state(); err != nil {
		db.Close()
		return nil, fmt.Errorf("open disk pool %s: %w: %w", dir, ErrCorrupt, err)
	}
	if p.unregister, err = registerMetrics(cfg.Registerer, p.c); err != nil {
		db.Close()
		return nil, fmt.Errorf("open disk pool %s: %w", dir, err)
	}
	p.watcher.Add(1)
	go p.watchDamage()
	return p, nil
}

// watchDamage shuts the pool down once a background job of Pebble's has met
// damaged data or a file it cannot read (see damageWatch), or returns at
// Close. The shutdown waits for the calls in progress, as Close does, then
// drops every block with its REMOVE (none of them can be relied on, and
// kept they would stay advertised for good), closes the core and closes
// the database, which ends Pebble's retries. It does not flush: a flush
// adds to an L0 that can no longer be compacted. Later calls fail as after
// Close; Put and reads with the damage (ErrCorrupt).
func (p *DiskPool) watchDamage() {
	defer p.watcher.Done()
	found, _ := p.damage.state()
	select {
	case <-found:
	case <-p.stop:
		return
	}
	p.io.Lock()
	defer p.io.Unlock()
	if !p.c.retire() {
		return
	}
	if err := p.db.Close(); err != nil {
		p.c.cfg.Logger.Warn("offload pool: closing the damaged disk pool's database", "dir", p.dir, "err", err)
	}
}

// Err is nil while the pool works. Once it has shut itself down (damage,
// or a file it cannot read, met by one of Pebble's background jobs: see
// Close), or is shutting down, it is why, wrapping ErrCorrupt: every Put
// and read fails from then on, until the pool is opened again. After
// Close it is ErrClosed. It takes no lock a Pebble write may hold, so it
// never waits on the disk.
func (p *DiskPool) Err() error {
	if p.closed.Load() {
		return ErrClosed
	}
	if _, err := p.damage.state(); err != nil {
		return fmt.Errorf("%w: the disk pool was shut down: %v", ErrCorrupt, err)
	}
	return nil
}

// FlushFailed is nil unless the last flush failed (a full disk): Puts are
// then refused at once until Pebble's retries of it succeed, and a caller
// can skip preparing a write that would be refused. It takes no lock a
// Pebble write may hold.
func (p *DiskPool) FlushFailed() error {
	_, _, err := p.flushes.state()
	return err
}

// closedErr is nil while the pool is open, the damage (ErrCorrupt) once
// watchDamage has shut it down, and ErrClosed once Close has run.
func (p *DiskPool) closedErr() error {
	if !p.isClosed() {
		return nil
	}
	if err := p.Err(); err != nil {
		return err
	}
	return ErrClosed
}

// corrupt wraps ErrCorrupt around an error Pebble marks as corruption
// (which errors.Is does not see: Pebble marks it the cockroachdb/errors way).
func corrupt(err error) error {
	if pebble.IsCorruptionError(err) && !errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return err
}

// load checks the header and the identity (writing both into a new pool)
// and restores the blocks.
func (p *DiskPool) load() error {
	hk := []byte{kindHeader}
	v, closer, err := p.db.Get(hk)
	switch {
	case errors.Is(err, pebble.ErrNotFound):
		hdr := make([]byte, headerLen)
		hdr[0] = diskFormat
		binary.BigEndian.PutUint64(hdr[1:], uint64(p.bs))
		b := p.db.NewBatch()
		b.Set(hk, hdr, nil)
		b.Set([]byte{kindIdent}, []byte(p.opts.Identity), nil)
		err := p.commitBatch(b)
		b.Close()
		if err != nil {
			return err
		}
	case err != nil:
		return err
	default:
		ok := len(v) == headerLen && v[0] == diskFormat
		var bs uint64
		if ok {
			bs = binary.BigEndian.Uint64(v[1:])
		}
		closer.Close()
		if !ok {
			return fmt.Errorf("%w: header %x", ErrCorrupt, v)
		}
		if bs != uint64(p.bs) {
			return fmt.Errorf("%w: pool of %d-byte blocks, opened for %d", ErrCorrupt, bs, p.bs)
		}
		if err := p.checkIdentity(); err != nil {
			return err
		}
	}

	// Which blocks have bytes, and whether they are BlockSize long: the
	// length comes with the key (a blob reference records it), so no
	// block's bytes are read. Bytes of another length never read back
	// (read fails them ErrCorrupt): restored, the block would be advertised
	// and routed to until its first onboarding failed.
	data := make(map[uint64]bool) // hash → bytes of the block size
	var malformed [][]byte        // keys in a block's range of another length
	if err := p.scan(kindData, func(k []byte, it *pebble.Iterator) error {
		h, ok := keyHash(k)
		if !ok {
			malformed = append(malformed, slices.Clone(k))
			return nil
		}
		lv := it.LazyValue()
		data[h] = lv.Len() == p.bs
		return nil
	}); err != nil {
		return err
	}
	var bs []restored
	var incomplete, invalid []uint64
	if err := p.scan(kindMeta, func(k []byte, it *pebble.Iterator) error {
		h, ok := keyHash(k)
		if !ok {
			malformed = append(malformed, slices.Clone(k))
			return nil
		}
		sized, ok := data[h]
		if !ok {
			incomplete = append(incomplete, h)
			return nil
		}
		delete(data, h)
		v, err := it.ValueAndErr()
		if err != nil {
			return err
		}
		if !sized || len(v) != metaLen || v[0] != diskFormat {
			invalid = append(invalid, h)
			return nil
		}
		b := Block{Hash: h, Parent: binary.BigEndian.Uint64(v[1:]), Local: binary.BigEndian.Uint64(v[9:])}
		if b.check() != nil { // a zero hash, or its own parent
			invalid = append(invalid, h)
			return nil
		}
		bs = append(bs, restored{Block: b, stamp: binary.BigEndian.Uint64(v[17:])})
		return nil
	}); err != nil {
		return err
	}
	for h := range data { // bytes without metadata
		incomplete = append(incomplete, h)
	}
	bs, looped := splitLoops(bs)
	invalid = append(invalid, looped...)
	p.dropInvalid(incomplete, invalid, malformed)
	slices.SortFunc(bs, func(a, b restored) int {
		if a.stamp != b.stamp {
			return cmpU64(a.stamp, b.stamp)
		}
		return cmpU64(a.Hash, b.Hash)
	})
	p.c.restore(bs)
	return nil
}

// splitLoops returns the blocks of bs that are on no loop of parents, and
// the hashes of those that are. Put refuses a block that would be its own
// ancestor, so only damage or a foreign writer leaves a loop on disk;
// restored, its blocks would each keep another's child count above zero
// and never be evicted, nor dumped (none of them is a root). A block that
// merely descends from a loop is kept: with the loop deleted, its parent
// is not in the pool, as a child of any deleted block's is.
//
// Each block names one parent, so a walk up from a block either leaves
// the pool, reaches a block already settled, or comes back to a block of
// the same walk: that block and those after it on the walk are the loop.
// Every block is walked over once: O(len(bs)).
func splitLoops(bs []restored) (kept []restored, looped []uint64) {
	idx := make(map[uint64]int, len(bs))
	for i, b := range bs {
		idx[b.Hash] = i
	}
	const (
		unseen = iota
		walking
		settled
	)
	state := make([]uint8, len(bs))
	onLoop := make([]bool, len(bs))
	var path []int
	for i := range bs {
		path = path[:0]
		for j, in := i, true; in && state[j] != settled; j, in = idx[bs[j].Parent] {
			if state[j] == walking {
				for _, k := range path[slices.Index(path, j):] {
					onLoop[k] = true
				}
				break
			}
			state[j] = walking
			path = append(path, j)
		}
		for _, k := range path {
			state[k] = settled
		}
	}
	kept = bs[:0]
	for i, b := range bs {
		if onLoop[i] {
			looped = append(looped, b.Hash)
		} else {
			kept = append(kept, b)
		}
	}
	return kept, looped
}

// checkIdentity empties an existing pool whose recorded identity is not
// opts.Identity, or that recorded none, and records opts.Identity.
//
// The blocks' hashes do not say what they are KV of: the same tokens hash
// alike under another model (of the same block size), and a salt is only
// as distinct as the operator made it. Restored, such blocks would be
// republished as the new engine's and could be onboarded into it. A pool
// without a record was written by a kvagent from before identities were
// recorded: nothing says it matches, and dropping a cache costs only its
// refill, so it is emptied too (once; the record is written with the
// deletion).
func (p *DiskPool) checkIdentity() error {
	ik := []byte{kindIdent}
	was, recorded := "", false
	v, closer, err := p.db.Get(ik)
	switch {
	case errors.Is(err, pebble.ErrNotFound):
	case err != nil:
		return fmt.Errorf("read the identity: %w", err)
	default:
		was, recorded = string(v), true
		closer.Close()
	}
	if recorded && was == p.opts.Identity {
		return nil
	}
	n := 0
	if err := p.scan(kindMeta, func([]byte, *pebble.Iterator) error { n++; return nil }); err != nil {
		return err
	}
	// Range deletions: one tombstone per range, whatever the pool's size;
	// Pebble reclaims the space as it compacts.
	b := p.db.NewBatch()
	defer b.Close()
	for _, kind := range []byte{kindMeta, kindData} {
		if err := b.DeleteRange([]byte{kind}, []byte{kind + 1}, nil); err != nil {
			return err
		}
	}
	if err := b.Set(ik, []byte(p.opts.Identity), nil); err != nil {
		return err
	}
	if err := p.commitBatch(b); err != nil {
		return fmt.Errorf("drop the blocks of another identity: %w", err)
	}
	why := "the pool was written for another identity"
	if !recorded {
		was = "(none recorded: written by an older kvagent)"
		why = "the pool records no identity"
	}
	p.c.cfg.Logger.Warn("offload pool: dropped the disk pool's blocks at open, not restoring them: "+why,
		"dir", p.dir, "blocks", n, "was", was, "now", p.opts.Identity)
	return nil
}

// dropInvalid deletes, at open, what the pool cannot use and would never
// evict: half blocks (metadata or bytes alone: Put writes both in one batch,
// so only damage makes them), blocks whose bytes are not BlockSize long or
// whose metadata does not decode or names a block no Put accepts (a zero
// hash, its own parent, a loop of parents), and keys of
// the wrong length in a block's key range. Only those keys are deleted,
// each exactly as found, so a valid block is never touched. It logs what it
// deleted; a failed deletion is logged and does not fail the open: the
// valid blocks are restored either way, and the next open tries again.
func (p *DiskPool) dropInvalid(incomplete, invalid []uint64, malformed [][]byte) {
	n := len(incomplete) + len(invalid) + len(malformed)
	if n == 0 {
		return
	}
	log := p.c.cfg.Logger.With("dir", p.dir, "incomplete", len(incomplete), "invalid", len(invalid),
		"malformed_keys", len(malformed))
	b := p.db.NewBatch()
	defer b.Close()
	for _, hs := range [][]uint64{incomplete, invalid} {
		for _, h := range hs {
			b.Delete(hashKey(kindMeta, h), nil)
			b.Delete(hashKey(kindData, h), nil)
		}
	}
	for _, k := range malformed {
		b.Delete(k, nil)
	}
	var err error
	if testHookDropCommit != nil {
		err = testHookDropCommit(b)
	} else {
		// Durable with the next flush (or Close), as an eviction is; after
		// a crash before then, the next open deletes them again.
		err = b.Commit(pebble.NoSync)
	}
	if err != nil {
		log.Warn("offload pool: could not delete the unusable entries found at open; they stay on disk unused "+
			"until the next open deletes them", "err", err)
		return
	}
	log.Warn("offload pool: deleted unusable entries found at open (damaged or foreign data)")
}

// testHookDropCommit, nil outside tests, replaces the commit of the batch
// in which dropInvalid deletes (to make it fail).
var testHookDropCommit func(*pebble.Batch) error

// keyHash returns the hash of a block key (kind byte, big-endian hash), and
// false for a key of another length.
func keyHash(k []byte) (uint64, bool) {
	if len(k) != 9 {
		return 0, false
	}
	return binary.BigEndian.Uint64(k[1:]), true
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// scan calls f for every key that starts with kind, in key order. The key
// is valid only until f returns.
func (p *DiskPool) scan(kind byte, f func(k []byte, it *pebble.Iterator) error) error {
	it, err := p.db.NewIter(&pebble.IterOptions{LowerBound: []byte{kind}, UpperBound: []byte{kind + 1}})
	if err != nil {
		return err
	}
	for it.First(); it.Valid(); it.Next() {
		if err := f(it.Key(), it); err != nil {
			it.Close()
			return err
		}
	}
	return errors.Join(it.Error(), it.Close())
}

// place: a disk block needs no slot.
func (p *DiskPool) place(*entry) {}

// drop deletes a block's keys. It runs under the core's lock, as an
// unsynced batch: a memtable insert (and, with SyncWAL, a buffered log
// append), not a disk write. It must run under the lock: done later, it
// could delete the bytes of the same hash registered again in between.
func (p *DiskPool) drop(e *entry, _ bool) error {
	b := p.db.NewBatch()
	defer b.Close()
	b.Delete(hashKey(kindMeta, e.Hash), nil)
	b.Delete(hashKey(kindData, e.Hash), nil)
	return b.Commit(pebble.NoSync)
}

// Put stores blocks with their bytes (data[i] is blocks[i]'s, BlockSize
// bytes each) durably: in one Pebble batch, or in several, in order, when
// they are over maxBatchBytes (2 GiB) together; on disk when Put returns
// (see SyncMode), then their STORE events. It reserves room in order,
// evicting as needed, skips (and revives) blocks already held, and stops at
// the first block that does not fit (ErrFull), storing those before it:
// stored counts the blocks it stored, err says why it stopped early. A
// batch never evicts its own blocks. A bad argument changes nothing (a
// batch that would make one of its blocks its own ancestor included); a
// failed write, of any of its batches, stores nothing (evictions made to
// find room stand; after a crash, the blocks of batches written before
// may come back, see the restart invariant in the package doc). A
// flush that fails (a full disk) fails the Put, and every Put after it at
// once, storing nothing, until Pebble's retries of that flush succeed; so
// does every Put while L0 is l0Refuse sublevels deep or more, until
// Pebble's compactions bring it under (see l0Watch). Put copies the bytes:
// data may be reused once it returns.
//
// The pool's lock is not held while its batches are written, so concurrent
// Puts overlap their copies and share flushes.
func (p *DiskPool) Put(blocks []Block, data [][]byte) (stored int, err error) {
	stored, _, _, err = p.put(blocks, data)
	return stored, err
}

// PutCounting is Put that also returns how many blocks it skipped (and
// revived) as held or being written before it stopped, if it did: of the
// blocks it did not store, the rest are those it had no room for, or could
// not write, or did not reach.
func (p *DiskPool) PutCounting(blocks []Block, data [][]byte) (stored, held int, err error) {
	stored, held, _, err = p.put(blocks, data)
	return stored, held, err
}

// put is PutCounting; skipped is the error of the last block it skipped as
// held or being written (ErrExists, with ErrBusy for the latter).
func (p *DiskPool) put(blocks []Block, data [][]byte) (stored, held int, skipped, err error) {
	if len(blocks) != len(data) {
		return 0, 0, nil, fmt.Errorf("put: %w: %d blocks, %d buffers", ErrInvalid, len(blocks), len(data))
	}
	if p.bs > maxBatchBytes-putBatchBytes(0) {
		// A batch holds one block at least (and Pebble panics at 4 GiB).
		return 0, 0, nil, fmt.Errorf("put: %w: block size %d bytes, over the %d bytes of a batch",
			ErrInvalid, p.bs, maxBatchBytes)
	}
	for i, b := range blocks {
		if err := b.check(); err != nil {
			return 0, 0, nil, fmt.Errorf("put: %w", err)
		}
		if len(data[i]) != p.bs {
			return 0, 0, nil, fmt.Errorf("put %#x: %w: %d bytes, block size %d", b.Hash, ErrInvalid, len(data[i]), p.bs)
		}
	}
	p.io.RLock()
	defer p.io.RUnlock()
	// Closed first: a Close on a full disk leaves the last flush failed
	// for good, and later calls fail with ErrClosed, as Close says.
	if err := p.closedErr(); err != nil {
		return 0, 0, nil, fmt.Errorf("put: %w", err)
	}
	if _, _, err := p.flushes.state(); err != nil {
		return 0, 0, nil, fmt.Errorf("put: refused until a flush succeeds: the last one failed: %w", err)
	}
	if err := p.l0.check(p.l0Sublevels); err != nil {
		return 0, 0, nil, fmt.Errorf("put: %w", err)
	}

	es, idx, held, skipped, stop := p.c.reserveAll(blocks)
	if len(es) == 0 {
		return 0, held, skipped, stop
	}
	// A pending entry's Block and stamp do not change until commit or
	// abort, so they are read here without the lock. Pebble panics on a
	// batch of 4 GiB (ErrBatchTooLarge), with the entries reserved: a Put
	// over maxBatchBytes is written in several batches, in order.
	per := max(1, maxBatchBytes/putBatchBytes(p.bs))
	for i := 0; i < len(es) && err == nil; i += per {
		part := es[i:min(i+per, len(es))]
		batch := p.db.NewBatchWithSize(len(part) * putBatchBytes(p.bs))
		for j, e := range part {
			batch.Set(hashKey(kindMeta, e.Hash), encodeMeta(e.Block, e.stamp), nil)
			batch.Set(hashKey(kindData, e.Hash), data[idx[i+j]], nil)
		}
		err = p.commitBatch(batch)
		batch.Close()
	}
	if err != nil {
		// abort deletes the keys of every batch of the Put (drop), under
		// the lock as an eviction does: those written before the failure,
		// so that a failed Put stores nothing, and the failed one, since a
		// batch whose flush failed is in a memtable that Pebble keeps
		// retrying: without the delete it would reach the disk once there
		// is room, and the next open would restore blocks the pool never
		// held. The delete is durable with the next flush, as an eviction
		// is (after a crash before then, the blocks come back: valid
		// blocks, as evicted ones do).
		p.c.abort(es)
		return 0, held, skipped, fmt.Errorf("put %d blocks: %w", len(es), err)
	}
	if err := p.c.commit(es); err != nil {
		return 0, held, skipped, err
	}
	return len(es), held, skipped, stop
}

func (p *DiskPool) commitBatch(b *pebble.Batch) error {
	if testHookCommitBatch != nil {
		if err := testHookCommitBatch(b); err != nil {
			return err
		}
	}
	if p.opts.Sync == SyncWAL {
		return b.Commit(pebble.Sync)
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		return err
	}
	return p.flushThrough(p.committed.Add(1))
}

// putBatchBytes is at least the bytes that a block of bs bytes adds to a
// Put's batch (its two keys, their values and Pebble's record headers).
func putBatchBytes(bs int) int { return bs + 2*9 + metaLen + 32 }

// testHookCommitBatch, nil outside tests, sees each batch commitBatch
// commits, and fails the commit when it returns an error.
var testHookCommitBatch func(*pebble.Batch) error

// maxBatchBytes bounds the bytes of one batch of a Put (see putBatchBytes):
// Pebble's Batch.grow panics (ErrBatchTooLarge) at 4 GiB. A variable for
// tests.
var maxBatchBytes = math.MaxInt32

// flushThrough returns once the batch numbered gen is on disk, or fails
// when the flush does. A flush covers every batch committed before it
// started (AsyncFlush rotates the memtable under Pebble's commit lock), so
// the number read before it is what it makes durable.
func (p *DiskPool) flushThrough(gen uint64) error {
	p.flushMu.Lock()
	defer p.flushMu.Unlock()
	if p.flushed >= gen {
		return nil
	}
	// While flushes fail, another would only queue one more memtable that
	// cannot be written (see flushWatch).
	if _, _, err := p.flushes.state(); err != nil {
		return fmt.Errorf("flush: the last one failed: %w", err)
	}
	through := p.committed.Load()
	if err := p.flush(); err != nil {
		return err
	}
	p.flushed = through
	return nil
}

// flush flushes the memtable and returns once it is on disk, or once a
// flush that included it failed: the memtable then stays queued, and
// Pebble retries it until the disk takes it (see flushWatch).
//
// Pebble flushes one at a time, each every memtable queued when it starts.
// The first failure after AsyncFlush may be of a flush already running,
// without this memtable (the disk freed a moment ago, say); the second is
// of one that started after it, so with it. Pebble retries at once, so the
// second comes right after the first while the disk stays full.
func (p *DiskPool) flush() error {
	failed, before, _ := p.flushes.state()
	done, err := p.db.AsyncFlush()
	if err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	for {
		select {
		case <-done:
			return nil
		case <-failed:
		}
		var n uint64
		failed, n, err = p.flushes.state()
		if err == nil || n < before+2 {
			continue // a retry succeeded since (done closes), or it may not have been ours
		}
		select {
		case <-done:
			return nil
		default:
			return fmt.Errorf("flush: %w", err)
		}
	}
}

// Register stores one block; see Put. It fails with ErrExists when the
// block is already held (reviving it) or another Put is writing it (the
// error wraps ErrBusy too: that write may still fail).
func (p *DiskPool) Register(b Block, data []byte) error {
	n, _, skipped, err := p.put([]Block{b}, [][]byte{data})
	if err == nil && n == 0 {
		return skipped
	}
	return err
}

// Read copies a stored block into dst (BlockSize bytes). The block is
// referenced while it is read, so it cannot be evicted under the read, and
// a successful read counts as a use and a hit, as Acquire does. A block
// whose bytes fail to read (ErrCorrupt) is dropped from the pool, with its
// REMOVE, once no reader holds it; the failed read is neither a hit nor a
// use. A caller that has acquired the block already uses ReadHeld.
func (p *DiskPool) Read(hash uint64, dst []byte) error {
	if len(dst) != p.bs {
		return fmt.Errorf("read %#x: %w: %d bytes, block size %d", hash, ErrInvalid, len(dst), p.bs)
	}
	p.io.RLock()
	defer p.io.RUnlock()
	e, err := p.c.ref(hash, false)
	if errors.Is(err, ErrClosed) {
		return fmt.Errorf("read %#x: %w", hash, p.closedErr())
	}
	if err != nil {
		return err
	}
	err = p.read(e, dst)
	if err == nil {
		p.c.used(e)
	}
	return errors.Join(err, p.c.release(hash))
}

// ReadHeld copies a stored block that the caller has acquired (and not yet
// released) into dst (BlockSize bytes). The read is part of that Acquire's
// use: it counts no hit and does not touch the eviction order again. It
// fails with ErrNotHeld when the block has no reference, ErrNotFound when
// it is not stored. A block whose bytes fail to read (ErrCorrupt, then
// and for every later ReadHeld of it) is hidden at once and dropped, with
// its REMOVE, by the last Release.
func (p *DiskPool) ReadHeld(hash uint64, dst []byte) error {
	if len(dst) != p.bs {
		return fmt.Errorf("read %#x: %w: %d bytes, block size %d", hash, ErrInvalid, len(dst), p.bs)
	}
	p.io.RLock()
	defer p.io.RUnlock()
	e, err := p.c.held(hash)
	if errors.Is(err, ErrClosed) {
		return fmt.Errorf("read %#x: %w", hash, p.closedErr())
	}
	if err != nil {
		return err
	}
	return p.read(e, dst)
}

// read copies e's bytes, which the caller holds a reference on, into dst.
// Bytes that are missing, of the wrong length or that Pebble reports
// corrupt (a checksum mismatch; a blob file missing or damaged, see get)
// fail with ErrCorrupt, and e is marked damaged: kept, the block
// would stay advertised and be acquired (a hit and a use each time) for
// good, never readable. So does the readFailures-th I/O error in a row
// (see unreadable); an earlier one leaves the block as it is.
func (p *DiskPool) read(e *entry, dst []byte) error {
	hash := e.Hash
	var n int
	err := p.get(hashKey(kindData, hash), func(v []byte) {
		if n = len(v); n == p.bs {
			copy(dst, v)
		}
	})
	switch {
	case errors.Is(err, pebble.ErrNotFound):
		err = fmt.Errorf("read %#x: %w: bytes missing", hash, ErrCorrupt)
	case pebble.IsCorruptionError(err): // Pebble marks its errors the cockroachdb/errors way
		err = fmt.Errorf("read %#x: %w (%w)", hash, ErrCorrupt, err)
	case err != nil:
		if !unreadable(e, err) {
			return fmt.Errorf("read %#x: %w", hash, err)
		}
		err = fmt.Errorf("read %#x: %w: unreadable %d times in a row (%w)", hash, ErrCorrupt, readFailures, err)
	case n != p.bs:
		err = fmt.Errorf("read %#x: %w: %d bytes stored, block size %d", hash, ErrCorrupt, n, p.bs)
	}
	if err != nil {
		p.c.damage(e)
		return err
	}
	if e.readFails.Load() != 0 { // a load, not a store, on the hot path
		e.readFails.Store(0)
	}
	return nil
}

// readFailures is how many reads of a block in a row must fail with an
// I/O error for the block to be dropped as damaged. A file the disk cannot
// read (a bad sector under a blob file: EIO, which Pebble reports as
// "could not read footer" or the plain I/O error, not as corruption) fails
// every read of the blocks in it, and kept, each such block stayed
// advertised and, acquired by every onboarding (a use, so the LRU order
// kept it), failed for good. One failure may be passing; the same block
// failing three times with no success between is bytes that cannot be
// read.
const readFailures = 3

// unreadable counts a read of e's bytes that failed with err, neither
// corruption nor missing bytes, and says whether it is the readFailures-th
// failure in a row. Errors that say nothing of the block are not counted:
// the pool or its database closed, a context ended, and the process or the
// system out of file descriptors or memory (EMFILE, ENFILE, ENOMEM), which
// would fail every block's read at once and drop healthy blocks with the
// unreadable ones.
func unreadable(e *entry, err error) bool {
	switch {
	case errors.Is(err, ErrClosed), errors.Is(err, pebble.ErrClosed),
		errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded),
		errors.Is(err, syscall.EMFILE), errors.Is(err, syscall.ENFILE), errors.Is(err, syscall.ENOMEM):
		return false
	}
	return e.readFails.Add(1) >= readFailures
}

// pebbleBlobOpenPanic is what Pebble (v2.1) panics with when it cannot open
// a blob file to read a value from it; see get.
const pebbleBlobOpenPanic = "unknown metadata type: <nil>"

// get calls f with key's value, valid only during the call. It fails with
// pebble.ErrNotFound when key is not set, and wraps pebble.ErrCorruption
// when Pebble reports the value's file corrupt.
//
// It reads through an iterator of its own, not DB.Get, for one failure
// Pebble does not return: a blob file (where a block's bytes live) that is
// missing, truncated or has a damaged footer fails to open, and Pebble
// reports that corruption with no file metadata, which panics
// (fileCacheHandle.findOrCreateBlob calls DB.reportCorruption with nil: "unknown
// metadata type: <nil>"). The panic comes after the file cache has dropped
// the failed open and before the corruption is reported anywhere, so the
// one thing it leaves behind is the iterator that was reading: DB.Get's
// is out of reach (leaked, it would pin its version, and Close would fail
// on it), this one is closed here like any other. That panic, and no
// other, becomes a pebble.ErrCorruption; the database stays usable.
func (p *DiskPool) get(key []byte, f func(v []byte)) (err error) {
	it, err := p.db.NewIter(nil)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := it.Close(); err == nil {
			err = cerr
		}
	}()
	defer func() {
		if r := recover(); r != nil {
			if s, ok := r.(string); !ok || s != pebbleBlobOpenPanic {
				panic(r)
			}
			err = fmt.Errorf("%w: its blob file is missing or damaged (pebble: %s)", pebble.ErrCorruption, r)
		}
	}()
	if !it.SeekPrefixGE(key) || !bytes.Equal(it.Key(), key) {
		if err := it.Error(); err != nil {
			return err
		}
		return pebble.ErrNotFound
	}
	v, err := it.ValueAndErr()
	if err != nil {
		return err
	}
	f(v)
	return nil
}

// Acquire takes a reference on a stored block, so it is not evicted until
// Release (while, say, several reads onboard it), and counts as its use. It
// fails with ErrNotFound (a miss) when the block is not stored.
func (p *DiskPool) Acquire(hash uint64) error {
	_, err := p.c.acquire(hash)
	return err
}

// Release drops a reference taken by Acquire.
func (p *DiskPool) Release(hash uint64) error { return p.c.release(hash) }

// Lookup appends to dst, per hash, whether the block is stored, and returns
// it. It does not count as a use.
func (p *DiskPool) Lookup(hashes []uint64, dst []bool) []bool { return p.c.lookup(hashes, dst) }

// Revive appends to dst, per hash, whether the block is stored, and returns
// it. Unlike Lookup, each stored block is revived, as Put revives a block
// it finds held: it counts as used now in the eviction order and in
// Stats.Revived. A caller that would write blocks calls it to skip those
// held already without a copy, and without leaving them to be evicted as
// if unused. A block still being written counts as not stored (Put then
// answers for it).
func (p *DiskPool) Revive(hashes []uint64, dst []bool) []bool { return p.c.revive(hashes, dst) }

// Prefix returns how many of the leading hashes are stored.
func (p *DiskPool) Prefix(hashes []uint64) int { return p.c.prefix(hashes) }

// Dump returns the stored blocks as STORE events, every block after its
// parent when that is in the pool, and the id the Sink returned for the
// last event this pool published (0 after a reopen, until it publishes):
// what the agent republishes as this tier's part of its rank's full dump.
func (p *DiskPool) Dump() ([]kvevent.Event, uint64) { return p.c.dump() }

// DumpTo calls f with the stored blocks as Dump returns them, under the
// pool's lock: no event of the pool's is published while f runs, so every
// later one (an eviction's REMOVE, or those of a shutdown for damage, see
// Close) comes after what f did with the blocks. kvagent republishes a
// reopened pool's blocks so: with Dump, a shutdown right after the open
// could publish its REMOVEs before the blocks were republished, and they
// stayed advertised. f must not call into the pool; it may publish (the
// lock order is pool → sink). A pool shut down holds no blocks: f gets
// none. It returns f's error.
func (p *DiskPool) DumpTo(f func(stored []kvevent.Event) error) error { return p.c.dumpTo(f) }

// Stats returns the pool's counters.
func (p *DiskPool) Stats() Stats { return p.c.stats() }

// DiskBytes is the space the pool's database takes on disk, including
// blob files that still hold evicted blocks not yet reclaimed.
func (p *DiskPool) DiskBytes() uint64 {
	p.io.RLock()
	defer p.io.RUnlock()
	if p.isClosed() {
		return 0
	}
	return p.db.Metrics().DiskSpaceUsage()
}

func (p *DiskPool) isClosed() bool {
	p.c.mu.Lock()
	defer p.c.mu.Unlock()
	return p.c.closed
}

// Dir is the pool's directory.
func (p *DiskPool) Dir() string { return p.dir }

// Close waits for Puts and Reads in progress, makes the evictions durable
// and closes the database. When that flush fails (a full disk), it closes
// the database all the same and says so: what changed since the last
// flush is lost, as after a crash (evicted blocks may come back at the
// next open). Later calls fail with ErrClosed; a second Close returns nil.
//
// A pool that one of Pebble's background jobs found damaged (or could
// not read) has shut itself down already (its blocks dropped with their REMOVEs, its
// database closed, the damage logged; Puts and reads fail with
// ErrCorrupt): Close then only ends it, and returns nil.
func (p *DiskPool) Close() error {
	p.stopOnce.Do(func() { close(p.stop) })
	p.watcher.Wait()
	p.io.Lock()
	defer p.io.Unlock()
	if p.closed.Swap(true) {
		return nil
	}
	p.unregister()
	if !p.c.close() {
		return nil // shut down by watchDamage: the database is closed
	}
	var errs []error
	// Damaged: no flush, as watchDamage does not flush.
	if _, damaged := p.damage.state(); p.opts.Sync == SyncFlush && damaged == nil {
		if err := p.flush(); err != nil {
			errs = append(errs, fmt.Errorf("evictions since the last flush are not on disk: %w", err))
		}
	}
	errs = append(errs, p.db.Close())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close disk pool %s: %w", p.dir, err)
	}
	return nil
}

// pebbleLogger routes Pebble's logging to slog; its routine messages go to
// Debug.
type pebbleLogger struct{ l *slog.Logger }

func (p pebbleLogger) Infof(format string, args ...any) { p.l.Debug(fmt.Sprintf(format, args...)) }
func (p pebbleLogger) Errorf(format string, args ...any) {
	p.l.Error(fmt.Sprintf(format, args...))
}

// Fatalf must not return (Pebble's contract): it logs one line, which
// names the directory (the logger's dir) and, where Pebble's error carries
// one, the cause (disk full, an I/O error), and ends the process with
// status 1 (fatalExit), instead of a panic, whose goroutine dump buried the
// reason. Corruption no longer comes here (eventListener); what does is
// what Pebble holds unrecoverable: a failed commit ("pebble: fatal commit
// error": with SyncWAL, a failed log write or sync, on the goroutine of the
// Put or of an eviction's delete, the latter under the pool's lock), a
// failed MANIFEST write or sync (a flush or compaction installing its
// files, on Pebble's goroutine; the open of a pool on a disk still full,
// which writes a new MANIFEST), and its invariant checks. Pebble raises
// most of them on its own goroutines, where no caller could be given an
// error. Each ends the process.
func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	attrs := []any{"err", msg}
	if cause := fatalCause(args); cause != "" {
		attrs = append(attrs, "cause", cause)
	}
	p.l.Error("offload pool: pebble failed beyond recovery; exiting", attrs...)
	fatalExit(1)
	panic("pebble fatal: " + msg) // fatalExit returned (a test's)
}

// fatalExit ends the process after a Fatalf of Pebble's; tests replace it.
var fatalExit = os.Exit

// fatalCause names the cause of a Fatalf of Pebble's from the errors among
// its arguments: "disk full" (ENOSPC, EDQUOT), "I/O error" (EIO), or "".
func fatalCause(args []any) string {
	for _, a := range args {
		err, ok := a.(error)
		if !ok {
			continue
		}
		switch {
		case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
			return "disk full"
		case errors.Is(err, syscall.EIO):
			return "I/O error"
		}
	}
	return ""
}
