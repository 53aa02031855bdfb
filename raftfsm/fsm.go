package raftfsm

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/rankmap"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/zeebo/xxh3"
)

// FSM is the router's replicated state machine: the tiered index, the load
// tracker, per-rank event cursors, worker registrations, cluster settings
// and the member table, in memory and in a Pebble state database.
//
// Apply is deterministic: time comes from the command (the leader stamps
// it), nothing iterates a map into state, and the same entries give the
// same state and Digest on every replica.
//
// Durability: the changes of applied entries (through the index's and the
// tracker's journals) and the applied index and term go into one
// store.StateBatch (an arena of records, written out as one ingested
// sstable), which the FSM keeps across ApplyBatch calls and commits as a
// group when it reaches store.GroupBytes, and always before a snapshot or
// Close; a restore discards it (after any background commit ends), since
// the stream replaces the state it changes. The tracker's added and
// changed bookings go into the group once each, as they stand, just before
// it commits or is laid under a read view (indexer.Sequences.FlushJournal):
// told at every change, a request's output blocks rewrote its whole booking
// once per block. So the state database holds the state as of one
// applied index, never a part of an entry. Entries at or below the
// applied index are skipped: Raft re-delivers every entry after its last
// snapshot on each restart, and without the skip refcounts and residency
// would double-apply.
type FSM struct {
	logger *slog.Logger
	dir    string // the state database's directory

	dbMu sync.RWMutex // write-held only while Restore swaps the database
	db   *store.StateDB

	ix   *indexer.Index
	seqs *indexer.Sequences
	// pending is the leader's bookings decided and proposed but not yet
	// applied (route.go); a booking's apply settles it.
	pending pendingBooks

	// batch holds the changes applied since the last group commit (nil
	// when there are none). A full group commits on its own goroutine
	// (commitAsync): committing receives its result, inflight is its
	// batch, and spare an empty batch for the group after. Only the FSM
	// goroutine, or a caller holding dbMu for writing, touches them.
	batch      *store.StateBatch
	inflight   *store.StateBatch
	spare      *store.StateBatch
	committing chan error
	commitErr  error // a background commit's failure, for good: the database lacks that group
	groupBytes int
	jrnl       journal
	applyGate  chan struct{} // Config.applyGate (tests)
	isClosed   bool          // Close ran; under dbMu
	// replaced counts the state databases a restore closed (restoreFrom);
	// under dbMu. A save whose view failed tells a restore's close from
	// the node's by it (FSM.cutOff).
	replaced uint64

	// snaps is the node's Raft snapshot store (nil for a bare FSM): the
	// FSM's own snapshots are marked in it, and refused while an install
	// or a user restore it holds is not yet restored (snapshotStore). Set
	// before Raft starts.
	snaps *snapshotStore

	// userRestore is set by RestoreSnapshot while Raft runs a user
	// restore (raft.Restore): Restore then takes a failed load as fatal
	// (restoreFrom).
	userRestore atomic.Bool

	// duringRestore, for tests: Restore calls it once the FSM is started,
	// before it reads the stream (while Raft waits for the install).
	duringRestore func()
	// afterSwap, for tests: restoreFrom calls it once the restored
	// directory is in place, before it opens it (a crash there).
	afterSwap func()

	// holdAfterLoad, set before loadState, keeps the collector off after
	// a successful load until endLoadHold (collector.go): a node's start,
	// which replays its log tail before it is ready.
	holdAfterLoad bool
	loadHold      atomic.Pointer[func()]
	scratch       decodeScratch // ApplyBatch's commands decode into it

	// stateMu is held by ApplyBatch while it changes the state and moves
	// the applied index, and by a restore while it installs the restored
	// state and its index, so that AppliedDigest reads the pair as one.
	stateMu sync.Mutex
	curMu   sync.RWMutex
	// cursors and heard find one worker's ranks without a scan (removing
	// a worker must not cost O(ranks): rankmap).
	cursors rankmap.Map[rankCursor]
	// heard is when each rank's events (or dump) last reached the log, in
	// the leader's clock as the commands carry it: equal on every replica,
	// kept in memory only (unknown after a restart or a restore until the
	// rank sends: install drops them).
	heard rankmap.Map[int64]
	// registered is when each worker last registered (leader's clock, in
	// memory only, like heard): a rank's silence counts from it too.
	registered map[uint64]int64
	// restoredAt is when this node last restored a snapshot (unix ns, its
	// own clock; 0: never since it started): the restored state holds no
	// last-heard times, so a rank's silence counts from it too.
	restoredAt atomic.Int64

	// wtab is the worker table as the apply path reads and changes it
	// (in place, by the apply goroutine only); wview holds the copy
	// published at the end of each ApplyBatch that changed it
	// (publishWorkers), which every other reader gets.
	wtab map[uint64]WorkerInfo
	// wdirty: wtab changed since the last publish; in worker wone's entry
	// alone unless wmany (markWorker).
	wdirty, wmany bool
	wone          uint64
	wview         atomic.Pointer[workerView] // copy-on-write
	settings      atomic.Pointer[Settings]
	members       atomic.Pointer[map[string]Member]

	applied     atomic.Uint64
	appliedTerm atomic.Uint64
	// handed is the index of the last entry Raft handed over (ApplyBatch,
	// skipped entries included), of the snapshot restored, or of the
	// snapshot Raft starts from (Node.catchUpFromSnapshot): the index Raft
	// labels a snapshot with, at least. Snapshot refuses while applied is
	// above it (ErrReplaying).
	handed atomic.Uint64
	// sinceSnap is the bytes of the entries applied since the last
	// snapshot persisted (Node.maybeSnapshot), those re-delivered after a
	// restart included: the log still holds them. A restore starts it
	// over (restoreFrom).
	sinceSnap atomic.Int64
	malformed atomic.Uint64
	// halt is set at the first entry of a later build (ErrLaterBuild) and
	// stays until a restore: the FSM applies neither it nor any entry
	// after it, and its Snapshot refuses (see Halted). A restart on a
	// build that reads the entry applies it, as Raft replays the entries
	// above the applied index.
	halt atomic.Pointer[ApplyHalt]

	// Figures for the node's metrics (Collector): bookings the sweep
	// expired, how long each ApplyBatch and snapshot write took, and the
	// last restore (seconds, as float64 bits).
	expiredBookings atomic.Uint64
	// Digest checks (applyCheck): the last one applied, and counts.
	checkMu          sync.Mutex
	lastCheck        CheckPoint
	checksCompared   atomic.Uint64
	digestMismatches atomic.Uint64
	// configAt reads the Raft configuration entry at an index of this
	// node's log (false: none there, or not readable); set by the node
	// before Raft starts. configMismatches counts the checks whose carried
	// configuration differed from it (applyCheck).
	configAt         func(index uint64) ([]raft.Server, bool)
	configMismatches atomic.Uint64
	applySeconds     prometheus.Histogram
	persistSeconds   prometheus.Histogram
	restoreSeconds   atomic.Uint64
	stalls           store.WriteStalls // the state database's write stalls
	// events counts the events of event batches by op, tier and outcome
	// since this node started (kvrouter_events_applied_total).
	events [kvevent.KindCleared + 1][kvevent.NumTiers][numOutcomes]atomic.Uint64

	// onFatal is called when the state database fails under Apply, which
	// must not happen silently: a committed entry cannot be refused.
	onFatal func(error)

	// started is closed by release, once the state is loaded (and, in a
	// node, caught up with the newest snapshot): Raft's calls (ApplyBatch,
	// Snapshot, Restore) wait for it, so that a node can start Raft while
	// its state still loads. startErr, set before the close, fails them.
	started  chan struct{}
	startErr error
}

// FSMConfig configures a FSM.
type FSMConfig struct {
	Dir     string // the state database directory (created if missing)
	Logger  *slog.Logger
	Index   indexer.Config
	OnFatal func(error) // default: log and panic
	// GroupBytes is the size at which applied changes are committed as a
	// group (default store.GroupBytes).
	GroupBytes int
}

var _ raft.BatchingFSM = (*FSM)(nil)

// OpenFSM opens the state database in cfg.Dir and rebuilds the in-memory
// state from it.
func OpenFSM(cfg FSMConfig) (*FSM, error) {
	f, err := openFSM(cfg)
	if err != nil {
		return nil, err
	}
	if err := f.loadState(); err != nil {
		f.db.Close()
		return nil, err
	}
	f.release(nil)
	return f, nil
}

// applyBookAdd applies the add of booking b at now and returns its
// outcome. It settles b's pending booking in the same step (the caller
// holds the pending bookings' lock), so that a leader's route decision
// counts b once: pending before, in the tracker after.
func (f *FSM) applyBookAdd(b *Booking, now int64) bookOutcome {
	f.pending.p.Settle(b.ID)
	if w, ok := f.wtab[b.Rank.Worker]; !ok || !slices.Contains(w.DPRanks, b.Rank.DP) {
		// The rank left after the decision that chose it: a booking
		// there would come back as phantom load if the worker
		// registered again within the expiry.
		return bookOutcome{rank: b.Rank, left: true}
	}
	// The tracker stamps it no earlier than the latest sweep
	// (indexer.Sequences.Add): a sweep from a leader whose clock ran
	// ahead must not refuse the bookings of one whose clock did not.
	_, err := f.seqs.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens, now)
	// The booking as it stands: a retried add (an id already live) books
	// nothing, and its caller answers with the rank the first one booked.
	r, live := f.seqs.RankOf(b.ID)
	return bookOutcome{rank: r, live: live, freed: !live && f.seqs.Freed(b.ID), err: err}
}

// openFSM opens the state database and returns an FSM with an empty
// state: loadState fills it, and Raft's calls wait for release.
func openFSM(cfg FSMConfig) (*FSM, error) {
	f := &FSM{logger: cfg.Logger, dir: cfg.Dir, onFatal: cfg.OnFatal, groupBytes: cfg.GroupBytes, started: make(chan struct{}),
		applySeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_raft_apply_duration_seconds",
			Help: "Time the FSM took to apply one batch of committed entries.", Buckets: prometheus.ExponentialBuckets(50e-6, 4, 10)}),
		persistSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_raft_snapshot_duration_seconds",
			Help: "Time one Raft snapshot took to write.", Buckets: prometheus.ExponentialBuckets(0.01, 4, 10)})}
	if f.groupBytes <= 0 {
		f.groupBytes = store.GroupBytes
	}
	if f.logger == nil {
		f.logger = slog.Default()
	}
	if f.onFatal == nil {
		f.onFatal = func(err error) {
			f.logger.Error("state database failed under apply; stopping", "err", err)
			panic(err)
		}
	}
	if err := cleanupRestore(f.dir); err != nil {
		return nil, err
	}
	db, err := store.OpenState(f.dir, store.StateOptions{Logger: f.logger, Stalls: &f.stalls})
	if err != nil {
		return nil, err
	}
	f.db = db
	f.ix = indexer.New(cfg.Index)
	f.seqs = indexer.NewSequences()
	// The pending bookings watch the tracker: every change of f.seqs
	// is made under f.pending.mu (pendingBooks).
	f.pending.p = indexer.NewPending(f.seqs)
	f.jrnl.f = f
	return f, nil
}

// loadState rebuilds the in-memory state from the state database. The
// caller closes the database if it fails.
func (f *FSM) loadState() error {
	if err := f.load(); err != nil {
		return err
	}
	f.ix.SetJournal(&f.jrnl)
	f.seqs.SetJournal(&f.jrnl)
	return nil
}

// release lets Raft's calls through, once; with an error (the node failed
// to start) each of them fails with it instead.
func (f *FSM) release(err error) {
	select {
	case <-f.started:
	default:
		f.startErr = err
		close(f.started)
	}
}

// endLoadHold releases the collector holdAfterLoad kept off, if it did.
func (f *FSM) endLoadHold() {
	if release := f.loadHold.Swap(nil); release != nil {
		(*release)()
	}
}

// waitStarted waits for release and returns its error.
func (f *FSM) waitStarted() error {
	<-f.started
	return f.startErr
}

// Close commits the open group and closes the state database: the group
// is what keeps the applies since the last commit (without it the next
// start would replay them from the Raft log).
func (f *FSM) Close() error {
	f.endLoadHold()
	f.dbMu.Lock()
	defer f.dbMu.Unlock()
	if f.isClosed {
		return nil
	}
	f.isClosed = true
	if err := f.commitGroup(); err != nil {
		f.logger.Warn("commit applied entries at close", "err", err)
	}
	if err := f.db.Sync(); err != nil {
		f.logger.Warn("sync state db at close", "err", err)
	}
	// The groups' buffers and the tree's slabs are advised for huge
	// pages: withdrawn before they are dropped (internal/hugepage).
	f.dropGroup()
	f.ix.Release()
	return f.db.Close()
}

// Index returns the in-memory index (for lookups).
func (f *FSM) Index() *indexer.Index { return f.ix }

// Sequences returns the load tracker (for lookups).
func (f *FSM) Sequences() *indexer.Sequences { return f.seqs }

// BytesSinceSnapshot is the size of the entries applied since the last
// Snapshot.
func (f *FSM) BytesSinceSnapshot() int64 { return f.sinceSnap.Load() }

// ApplyHalt is the entry of a later build the FSM halted at (Halted): its
// index and term, and the decoder's error (ErrLaterBuild). As an error it
// is what ApplyBatch answers for that entry and every one after it, and
// wraps ErrLaterBuild.
type ApplyHalt struct {
	Index, Term uint64
	Err         error
}

func (h *ApplyHalt) Error() string {
	return fmt.Sprintf("apply halted at entry %d (term %d): %v: upgrade this node", h.Index, h.Term, h.Err)
}

// Unwrap makes errors.Is(h, ErrLaterBuild) true.
func (h *ApplyHalt) Unwrap() error { return h.Err }

// Halted returns the entry of a later build that the FSM halted at, or nil
// when it applies. Halted, it applies no entry until the node is restarted
// on a build that reads that one (or restores a snapshot past it): its
// applied index stays before the entry, so that the upgraded build
// applies the entry and the rest from the Raft log, which Snapshot keeps
// uncompacted by refusing meanwhile.
func (f *FSM) Halted() *ApplyHalt { return f.halt.Load() }

// Applied returns the last applied index and term.
func (f *FSM) Applied() (index, term uint64) { return f.applied.Load(), f.appliedTerm.Load() }

// AppliedDigest returns the applied index and the state's digest at that
// index, read between two ApplyBatch calls. (Applied and Digest read apart
// may pair an index with the state of a batch applying after it:
// replicas at one applied index would show different digests.)
func (f *FSM) AppliedDigest() (index, digest uint64) {
	f.stateMu.Lock()
	defer f.stateMu.Unlock()
	return f.applied.Load(), f.Digest()
}

// workerView is what publishWorkers publishes of the worker table, as one
// value behind one pointer: a route reads its block size and candidates
// from one publish (stored as separate atomics one after another, a route
// could pair one publish's block size with another's candidates). Never
// modified once published.
type workerView struct {
	workers map[uint64]WorkerInfo
	// cands is every registered rank as a route candidate, in rank order,
	// rebuilt with workers so that a route decision neither allocates nor
	// sorts for it.
	cands []indexer.Candidate
	// blockSize is the one /v1 routes hash with (blockSizeOf): worker
	// blockSizeFrom's when hasBlockSize, else DefaultBlockSize;
	// blockSizePlain says that worker has no model (withoutModel).
	blockSize      int
	blockSizeFrom  uint64
	hasBlockSize   bool
	blockSizePlain bool
	// routeCands is cands less the ranks of workers of another block size
	// than blockSize (ofBlockSize): the candidates of a route that hashes
	// with blockSize, built here so that the route pays nothing for the
	// filter. cands itself (the same array) when every worker has it.
	routeCands []indexer.Candidate
}

// published returns the worker table as of the end of the last
// ApplyBatch, with its route candidates and block size (do not modify).
func (f *FSM) published() *workerView { return f.wview.Load() }

// Workers returns the registered workers (do not modify), as of the end
// of the last ApplyBatch.
func (f *FSM) Workers() map[uint64]WorkerInfo { return f.published().workers }

// RankCount returns how many dp ranks the registered workers list in
// all, as of the end of the last ApplyBatch.
func (f *FSM) RankCount() int { return len(f.published().cands) }

// setWorkers makes ws the apply path's table (owned by it from now on)
// and publishes it (a restore or an open).
func (f *FSM) setWorkers(ws map[uint64]WorkerInfo) {
	f.wtab, f.wdirty, f.wmany = ws, true, true
	f.publishWorkers()
}

// publishWorkers publishes a copy of the apply path's table, when it
// changed, with its candidate list and block size. ApplyBatch calls it
// once at its end, before anyone can see the entries applied: registering
// N workers by N entries cost O(N) each when every registration published
// (a clone of the table and a sort of every candidate; 8,000 workers took
// 21 s of apply per replica), and costs that once per batch now, so a
// storm of registrations, whose entries commit in large batches, is
// amortised; a batch that changed one worker splices its candidates in
// without a sort (spliceWorker). The apply path itself reads only wtab: entries of one batch
// see each other's changes, whatever the batch boundaries (they differ
// between replicas).
func (f *FSM) publishWorkers() {
	if !f.wdirty {
		return
	}
	v := &workerView{workers: maps.Clone(f.wtab)}
	if f.wmany {
		for id, w := range v.workers {
			v.cands = appendCandidates(v.cands, id, w)
		}
		slices.SortFunc(v.cands, func(a, b indexer.Candidate) int { return a.Rank.Compare(b.Rank) })
		v.blockSize, v.blockSizeFrom, v.hasBlockSize, v.blockSizePlain = blockSizeOf(v.workers)
	} else {
		// One worker changed (a registration or a removal at a time: a
		// trickle): its candidates are spliced into the sorted list,
		// O(ranks) without a sort.
		f.spliceWorker(v, f.wone)
	}
	v.routeCands = ofBlockSize(v.cands, v.workers, v.blockSize)
	f.wdirty, f.wmany = false, false
	f.wview.Store(v)
}

// markWorker notes that the apply path's table changed in worker id's
// entry (publishWorkers).
func (f *FSM) markWorker(id uint64) {
	if f.wdirty && f.wone != id {
		f.wmany = true
	}
	f.wdirty, f.wone = true, id
}

// spliceWorker fills v's candidates and block size (as blockSizeOf) from
// the published ones, v's table differing from the published table in
// worker id's entry alone. It must give what a rebuild gives: replicas
// batch the same entries differently.
func (f *FSM) spliceWorker(v *workerView, id uint64) {
	prev := f.published()
	old := prev.cands
	lo, _ := slices.BinarySearchFunc(old, kvevent.Rank{Worker: id}, func(c indexer.Candidate, r kvevent.Rank) int { return c.Rank.Compare(r) })
	hi := lo
	for hi < len(old) && old[hi].Rank.Worker == id {
		hi++
	}
	w, ok := v.workers[id]
	cands := make([]indexer.Candidate, 0, len(old)-(hi-lo)+len(w.DPRanks))
	cands = append(cands, old[:lo]...)
	if ok {
		cands = appendCandidates(cands, id, w)
		slices.SortFunc(cands[lo:], func(a, b indexer.Candidate) int { return a.Rank.Compare(b.Rank) })
	}
	v.cands = append(cands, old[hi:]...)
	v.blockSize, v.blockSizeFrom, v.hasBlockSize, v.blockSizePlain = prev.blockSize, prev.blockSizeFrom, prev.hasBlockSize, prev.blockSizePlain
	switch plain := withoutModel(w); {
	case ok && w.BlockSize > 0 && (!prev.hasBlockSize || (id == prev.blockSizeFrom && plain == prev.blockSizePlain) ||
		setsBlockSizeBefore(id, plain, prev.blockSizeFrom, prev.blockSizePlain)):
		v.blockSize, v.blockSizeFrom, v.hasBlockSize, v.blockSizePlain = w.BlockSize, id, true, plain
	case prev.hasBlockSize && id == prev.blockSizeFrom:
		// The worker it came from left, has none now, or gained or lost
		// a model (another may come before it now).
		v.blockSize, v.blockSizeFrom, v.hasBlockSize, v.blockSizePlain = blockSizeOf(v.workers)
	}
}

// appendCandidates appends worker id's ranks, as route candidates, to
// cands.
func appendCandidates(cands []indexer.Candidate, id uint64, w WorkerInfo) []indexer.Candidate {
	for _, dp := range w.DPRanks {
		cands = append(cands, indexer.Candidate{Rank: kvevent.Rank{Worker: id, DP: dp}, CapacityBlocks: w.Capacity[kvevent.TierDevice]})
	}
	return cands
}

// servesBlockSize reports whether w's ranks are route candidates of a
// route that hashes with block size bs: semantics.md §1 makes the block
// size one per model, the same for every worker, and a worker of another
// block size holds no block of the route's hashes, while its bookings
// would name blocks it lacks. A worker that registered none (0, only in
// entries of builds that took one) has nothing that says it differs.
func servesBlockSize(w WorkerInfo, bs int) bool {
	return w.BlockSize == bs || w.BlockSize <= 0
}

// ofBlockSize returns the candidates of cands (in rank order) whose worker
// in ws serves block size bs (servesBlockSize), in rank order: cands
// itself when all do, else a new slice.
func ofBlockSize(cands []indexer.Candidate, ws map[uint64]WorkerInfo, bs int) []indexer.Candidate {
	var out []indexer.Candidate // nil while every candidate so far is kept
	for i := 0; i < len(cands); {
		id := cands[i].Rank.Worker
		j := i + 1
		for j < len(cands) && cands[j].Rank.Worker == id {
			j++
		}
		switch {
		case servesBlockSize(ws[id], bs):
			if out != nil {
				out = append(out, cands[i:j]...)
			}
		case out == nil:
			out = append(make([]indexer.Candidate, 0, len(cands)-(j-i)), cands[:i]...)
		}
		i = j
	}
	if out == nil {
		return cands
	}
	return out
}

// Settings returns the cluster settings.
func (f *FSM) Settings() Settings { return *f.settings.Load() }

// Members returns the member table (do not modify).
func (f *FSM) Members() map[string]Member { return *f.members.Load() }

// rankCursor is what the FSM keeps per rank beside its index state: the
// last applied event id, and the publisher incarnation of the dump that
// last replaced the rank (0: none since the rank's state began, or an
// unfenced dump). One map value, so that an event batch reads and writes
// both with one lookup each.
type rankCursor struct {
	id          uint64
	incarnation uint64
}

// Cursor returns a rank's last applied event id.
func (f *FSM) Cursor(r kvevent.Rank) uint64 {
	return f.rankCursor(r).id
}

// HasCursor reports whether the FSM holds a cursor of rank r: a dump of
// the rank, or its events from the first id on, applied since its state
// last began. A rank without one holds nothing its publisher sent: none
// of it has reached the log yet, or its state was removed since (its
// worker deregistered, its registration dropped it, a restored state
// lacks it).
func (f *FSM) HasCursor(r kvevent.Rank) bool {
	f.curMu.RLock()
	defer f.curMu.RUnlock()
	_, ok := f.cursors.Get(r)
	return ok
}

// Incarnation returns the publisher incarnation of the dump that last
// replaced rank r's state, or 0 (none, or an unfenced dump).
func (f *FSM) Incarnation(r kvevent.Rank) uint64 {
	return f.rankCursor(r).incarnation
}

func (f *FSM) rankCursor(r kvevent.Rank) rankCursor {
	f.curMu.RLock()
	defer f.curMu.RUnlock()
	c, _ := f.cursors.Get(r)
	return c
}

// Digest is the state digest: the index's and the load tracker's, mixed
// with the cursors (each with its rank's incarnation), the registrations (each whole, as its record
// encodes it: ranks, capacities, endpoints, positional ids) and the
// settings. Equal on replicas at equal applied index, and on a state
// saved and restored into another cluster: the member table, which is
// each cluster's own (a restore or a seed keeps the cluster's), is left
// out. (Before the eleventh session's build a registration counted only
// its block size, rank count and device capacity, and the settings not at
// all: replicas that disagreed there passed every check.)
func (f *FSM) Digest() uint64 { return f.digestWith(f.Workers()) }

// digestWith is Digest with worker table ws: the published one, or the
// apply path's own (a check entry's, applyCheck).
func (f *FSM) digestWith(ws map[uint64]WorkerInfo) uint64 {
	d := f.ix.Digest()*0x9e3779b97f4a7c15 + f.seqs.Digest()
	f.curMu.RLock()
	for r, c := range f.cursors.All() {
		x := mix(c.id + 0x7f4a7c15)
		if c.incarnation != 0 {
			// A rank without one mixes as before incarnations existed.
			x = mix(x ^ c.incarnation)
		}
		d += mix(r.Worker ^ mix(uint64(r.DP)^x))
	}
	f.curMu.RUnlock()
	var e enc
	for id, w := range ws {
		e.b = e.b[:0]
		encodeWorker(&e, &w) // its maps are written in key order
		d += mix(id ^ xxh3.Hash(e.b))
	}
	settings := f.Settings()
	e.b = e.b[:0]
	encodeSettingsValue(&e, &settings)
	d += mix(xxh3.Hash(e.b) ^ 0x5e771495)
	return d
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// Apply applies one entry (raft.FSM).
func (f *FSM) Apply(l *raft.Log) interface{} { return f.ApplyBatch([]*raft.Log{l})[0] }

// ApplyBatch applies entries (raft.BatchingFSM) into the group batch,
// committed once it is full (see FSM). The response of a command entry is
// its result value (see the command types) or an error value for a domain
// error; it is nil for skipped entries and for configuration, barrier and
// no-op entries.
func (f *FSM) ApplyBatch(logs []*raft.Log) []interface{} {
	if err := f.waitStarted(); err != nil {
		out := make([]interface{}, len(logs))
		for i := range out {
			out[i] = err
		}
		return out
	}
	if f.applyGate != nil {
		<-f.applyGate
	}
	f.dbMu.RLock()
	defer f.dbMu.RUnlock()
	defer observeSince(f.applySeconds, time.Now())
	out := make([]interface{}, len(logs))
	if f.isClosed { // Raft outlived the node's Close: apply nothing
		for i := range out {
			out[i] = ErrShutdown
		}
		return out
	}
	// The state changes entry by entry and the applied index moves at the
	// end: AppliedDigest reads the two under stateMu, as one.
	f.stateMu.Lock()
	defer f.stateMu.Unlock()
	applied := f.applied.Load()
	if f.batch == nil {
		f.batch = f.newBatch()
	}
	var last, lastTerm uint64
	if len(logs) > 0 {
		f.handed.Store(logs[len(logs)-1].Index)
	}
	for i, l := range logs {
		if l.Index <= applied {
			// Re-delivered after a restart: already in the state, but
			// still in the log after Raft's last snapshot (Raft
			// re-delivers only those), so counted towards the next one
			// as before the restart.
			f.sinceSnap.Add(int64(len(l.Data)))
			continue
		}
		if h := f.halt.Load(); h != nil {
			// Halted at an entry of a later build: this one and every
			// one after it wait for the node's upgrade (and its applied
			// index stays before them), each answered with the halt.
			out[i] = h
			continue
		}
		f.scratch.reset()
		var c command
		if l.Type == raft.LogCommand {
			var err error
			c, err = decodeCommandInto(l.Data, &f.scratch)
			if err == nil {
				err = c.refused()
			}
			if errors.Is(err, ErrLaterBuild) {
				h := &ApplyHalt{Index: l.Index, Term: l.Term, Err: err}
				f.halt.Store(h)
				f.logger.Error("apply halted at an entry of a later build: upgrade this node; it applies the entry and those after it once restarted on a build that reads it",
					"index", l.Index, "term", l.Term, "err", err)
				out[i] = h
				continue
			} else if err != nil {
				// Garbled, or settings no build writes (command.refused):
				// skipped, as a domain error (a committed entry cannot be
				// refused).
				last, lastTerm = l.Index, l.Term
				f.sinceSnap.Add(int64(len(l.Data)))
				f.malformed.Add(1)
				f.logger.Warn("skipping undecodable entry", "index", l.Index, "err", err)
				out[i] = err
				continue
			}
		}
		last, lastTerm = l.Index, l.Term
		f.sinceSnap.Add(int64(len(l.Data)))
		if l.Type == raft.LogCommand {
			out[i] = f.applyCommand(&c, l.Index)
		}
	}
	f.publishWorkers()
	if last == 0 {
		return out
	}
	f.ix.FlushJournal()
	f.batch.SetApplied(last, lastTerm)
	// The bookings changed since the last flush count, though they go into
	// the batch only at it: a group of bookings alone must fill too.
	if f.batch.Len()+f.seqs.UnjournaledBytes() >= f.groupBytes {
		f.seqs.FlushJournal()
		if err := f.commitAsync(); err != nil {
			f.onFatal(fmt.Errorf("apply entries up to %d: %w", last, err))
			return out
		}
	}
	f.applied.Store(last)
	f.appliedTerm.Store(lastTerm)
	return out
}

// commitGroup commits the group batch, if any, after the group committing
// in the background; the batch stays, empty, for the next group. Callers
// hold dbMu and run on the FSM goroutine (or exclude it).
func (f *FSM) commitGroup() error {
	if err := f.waitCommit(); err != nil {
		return err
	}
	if f.batch == nil {
		return nil
	}
	f.seqs.FlushJournal()
	return f.batch.Commit()
}

// newBatch starts a group with room for a whole one (its commit comes
// once it holds groupBytes; one more command may take it past that).
func (f *FSM) newBatch() *store.StateBatch {
	b := f.db.NewBatch()
	b.Reserve(f.groupBytes + f.groupBytes/4)
	return b
}

// commitAsync hands the full group to a goroutine that commits it, and
// goes on in the spare batch: a group's commit (sort, write, sync, ingest:
// a few hundred milliseconds for 16 MiB on a busy 2-core machine) no
// longer stalls the entries applied after it, nor every client waiting on
// one of them. One group commits at a time, in order: the next full group
// first waits for the one before (and fails with its error). What a crash
// loses is unchanged: the database holds the state at the end of the last
// group ingested, and Raft replays the entries after it.
func (f *FSM) commitAsync() error {
	if err := f.waitCommit(); err != nil {
		return err
	}
	full := f.batch
	f.batch = f.spare
	if f.batch == nil {
		f.batch = f.newBatch()
	}
	f.spare = nil
	done := make(chan error, 1)
	f.inflight, f.committing = full, done
	go func() { done <- full.Commit() }()
	return nil
}

// waitCommit waits for the group committing in the background, if any,
// and keeps its emptied batch as the spare.
// A failure stays: no later group may commit over the missing one.
func (f *FSM) waitCommit() error {
	if f.committing != nil {
		err := <-f.committing
		f.spare, f.inflight, f.committing = f.inflight, nil, nil
		if err != nil {
			f.spare.Close() // its contents are not known to be empty
			f.spare = nil
			f.commitErr = fmt.Errorf("commit applied entries in the background: %w", err)
		}
	}
	return f.commitErr
}

// view opens a read view of the state as applied so far, from outside
// the FSM goroutine (a user's snapshot save): it holds dbMu for writing,
// so no apply runs meanwhile. The open group is laid over the database
// (StateBatch.View) rather than committed: a commit's table could start
// an L0 compaction that would share the cores with the save (it did on
// the 5M snapshot benchmark). Raft's own snapshots still commit (see
// Snapshot): their log truncation needs the state durable.
// It also returns how many state databases a restore had closed by then,
// for cutOff.
func (f *FSM) view() (*store.StateSnapshot, uint64, error) {
	f.dbMu.Lock()
	defer f.dbMu.Unlock()
	if err := f.waitCommit(); err != nil {
		return nil, 0, err // the database lacks a group the index holds
	}
	if f.batch == nil {
		return f.db.Snapshot(), f.replaced, nil
	}
	f.seqs.FlushJournal() // the group lacks the bookings' latest changes until then
	return f.batch.View(), f.replaced, nil
}

// cutOff returns the error of a save whose view, taken when restores had
// closed replaced state databases (view), failed with err: ErrStateReplaced
// when a restore has closed its database since, ErrSaveShutDown when the
// FSM's Close has (the node is going away: another node answers the save
// again), err otherwise.
func (f *FSM) cutOff(err error, replaced uint64) error {
	if !errors.Is(err, store.ErrClosed) {
		return err
	}
	f.dbMu.RLock()
	defer f.dbMu.RUnlock()
	switch {
	case f.replaced != replaced:
		return fmt.Errorf("%w: %v", ErrStateReplaced, err)
	case f.isClosed:
		return fmt.Errorf("%w: %v", ErrSaveShutDown, err)
	}
	return err
}

// dropGroup discards the group batch (its state is being replaced), once
// the group committing in the background, if any, is done with the
// database.
func (f *FSM) dropGroup() {
	_ = f.waitCommit() // the state it wrote is being replaced too
	f.commitErr = nil
	for _, b := range []**store.StateBatch{&f.batch, &f.spare} {
		if *b != nil {
			(*b).Close()
			*b = nil
		}
	}
}

// applyCommand applies one decoded command and returns its response.
func (f *FSM) applyCommand(c *command, index uint64) interface{} {
	switch c.typ {
	case cmdEvents:
		acks := make([]RankAck, len(c.batches))
		for i := range c.batches {
			acks[i] = f.applyRankBatch(&c.batches[i], c.now)
		}
		return acks
	case cmdReplace:
		if f.unlisted(c.rank) {
			// Refused as the rank's events are (applyRankBatch): a dump
			// (an agent's Resync of every rank at its start) would plant
			// state and a cursor that no sweep takes away. A log written
			// before this check replays such a dump as nothing: the state
			// it built was wrong.
			return RankAck{Rank: c.rank, Unregistered: true}
		}
		cur := f.Cursor(c.rank)
		if c.cursor < cur {
			// A dump older than what is applied (a retried command): applying
			// it would move the rank back in time.
			return RankAck{Rank: c.rank, Cursor: cur}
		}
		// ReplaceRank skips the events it cannot store (a remove, a store
		// without blocks or with a bad tier: ReplaceRankFenced refuses
		// them, a log written by another writer may hold them) and counts
		// them in the index's malformed count (events_rejected_total): the
		// ack counts only the events applied, as an event batch's does.
		malformed := f.ix.ReplaceRank(c.rank, c.stored, c.now)
		f.setCursor(c.rank, rankCursor{id: c.cursor, incarnation: c.incarnation})
		f.noteHeard(c.rank, c.now)
		return RankAck{Rank: c.rank, Cursor: c.cursor, Applied: len(c.stored) - malformed}
	case cmdRegister:
		w := c.worker
		if len(w.DPRanks) == 0 {
			w.DPRanks = []uint32{0}
		}
		for _, r := range f.droppedRanks(&w) {
			f.removeRank(r)
		}
		f.wtab[w.ID] = w
		f.markWorker(w.ID)
		f.curMu.Lock()
		if f.registered == nil {
			f.registered = map[uint64]int64{}
		}
		f.registered[w.ID] = c.now
		f.curMu.Unlock()
		for _, dp := range w.DPRanks {
			f.ix.SetCapacity(kvevent.Rank{Worker: w.ID, DP: dp}, w.Capacity)
		}
		var e enc
		encodeWorker(&e, &w)
		f.batch.Put(store.KindWorker, u64key(w.ID), e.b)
		return nil
	case cmdDeregister:
		return f.removeWorker(c.workerID)
	case cmdRemoveRanks:
		return f.removeUnregistered(c.ranks)
	case cmdBook:
		var out interface{}
		f.pending.mu.Lock()
		defer f.pending.mu.Unlock()
		for op := range c.books.all() {
			switch op.kind {
			case bookAdd:
				if o := f.applyBookAdd(&op.b, c.now); c.books.n == 1 {
					out = o
				}
			case bookPrefillDone:
				f.seqs.PrefillDone(op.b.ID)
			case bookFree:
				f.seqs.Free(op.b.ID)
			case bookOutput:
				f.seqs.AddOutputBlock(op.b.ID, op.b.SeqHashes[0])
			case bookDecay:
				f.seqs.SetDecay(op.b.ID, indexer.DecayScale-op.b.Discount)
			}
		}
		return out
	case cmdExpire:
		f.pending.mu.Lock()
		n := f.seqs.Expire(c.now, time.Duration(c.maxAgeNs))
		f.pending.mu.Unlock()
		f.expiredBookings.Add(uint64(n))
		f.ix.ExpireOrphans(c.now)
		return n
	case cmdSettings:
		s := c.settings
		f.settings.Store(&s)
		var e enc
		encodeSettingsValue(&e, &s)
		f.batch.Put(store.KindSettings, []byte{'s'}, e.b)
		return nil
	case cmdMember:
		next := maps.Clone(f.Members())
		next[c.member.ID] = c.member
		f.members.Store(&next)
		f.batch.Put(store.KindMember, []byte(c.member.ID), encodeMemberValue(&c.member))
		return nil
	case cmdMemberGone:
		next := maps.Clone(f.Members())
		delete(next, c.member.ID)
		f.members.Store(&next)
		f.batch.Delete(store.KindMember, []byte(c.member.ID))
		return nil
	case cmdCheck:
		return f.applyCheck(c, index)
	}
	return fmt.Errorf("%w: command type %d", ErrBadCommand, c.typ)
}

// droppedRanks returns, in rank order, the ranks of w's worker whose state
// the registration w drops, as a deregistration drops a worker's, so that a
// later registration of the rank starts clean: those the previous
// registration listed and w does not, and, when w is Positional, every rank
// of the worker that w does not list and that holds a cursor or a
// last-heard time. A Positional worker's unlisted rank takes neither events
// nor dumps (unlisted), but a dump or events taken before (the worker not
// registered yet: an agent's Resync at its start; or registered non-
// Positional, which takes any of its ranks' events) would otherwise keep
// their blocks and cursor (until the leader's sweep, a grace later:
// UnregisteredRanks), and a registration listing the rank meanwhile
// would resume at that cursor: the agent's numbering, under which the
// engine's first positions are duplicates. Blocks and bookings need no
// search of their own: a rank gets blocks only with a cursor, and bookings
// only while listed. The worker's ranks come from the per-worker lists of
// cursors and heard, not a scan of every rank.
func (f *FSM) droppedRanks(w *WorkerInfo) []kvevent.Rank {
	var out []kvevent.Rank
	if prev, ok := f.wtab[w.ID]; ok {
		for _, dp := range prev.DPRanks {
			if !slices.Contains(w.DPRanks, dp) {
				out = append(out, kvevent.Rank{Worker: w.ID, DP: dp})
			}
		}
	}
	if w.Positional {
		f.curMu.RLock()
		held := f.cursors.WorkerRanks(nil, w.ID)
		held = f.heard.WorkerRanks(held, w.ID)
		f.curMu.RUnlock()
		for _, r := range held {
			if !slices.Contains(w.DPRanks, r.DP) {
				out = append(out, r)
			}
		}
	}
	// Sorted and each once, so that every replica's batch deletes the same
	// keys in one order.
	slices.SortFunc(out, kvevent.Rank.Compare)
	return slices.Compact(out)
}

// unlisted says whether r's worker is Positional and does not list r: a
// rank that takes neither events nor dumps (RankAck.Unregistered).
func (f *FSM) unlisted(r kvevent.Rank) bool {
	w := f.wtab[r.Worker]
	return w.Positional && !slices.Contains(w.DPRanks, r.DP)
}

// applyRankBatch applies a rank's events through its cursor: an id at or
// below the cursor is a duplicate (a re-delivery) and is skipped; the next
// id applies and advances the cursor; an id past it is a gap, and nothing
// after the gap applies, so the index never runs ahead of a missing event.
// A Positional worker's rank that the worker does not list applies nothing
// (RankAck.Unregistered).
//
// First the fence: a batch of a publisher incarnation other than the one
// whose dump last replaced the rank (both non-zero) applies nothing, not
// even as duplicates, and is acknowledged Fenced and Resync at the rank's
// cursor. Its ids are another numbering's: a dead incarnation's request
// that commits after its successor's dump would otherwise apply on top of
// the new state, and make the successor's events with those ids
// duplicates (docs/events.md). A batch or a rank without an incarnation
// (0) is not fenced, nor is a batch of positions (PositionalIncarnation),
// which applies only to a Positional worker's listed rank.
func (f *FSM) applyRankBatch(rb *RankBatch, now int64) RankAck {
	positions := rb.Incarnation == PositionalIncarnation
	if f.unlisted(rb.Rank) || (positions && !f.wtab[rb.Rank.Worker].Positional) {
		// Only the leader's own subscriber sends a Positional rank's
		// events, and it runs on for up to a poll after the rank was
		// unregistered: applied, they would rebuild state and a cursor
		// that no sweep takes away (the worker is registered), and that
		// a later registration of the rank would resume from; or, its
		// worker registered again with non-positional ids, take the
		// poster's first ids.
		return RankAck{Rank: rb.Rank, Unregistered: true}
	}
	rc := f.rankCursor(rb.Rank)
	cur := rc.id
	ack := RankAck{Rank: rb.Rank}
	if rb.Incarnation != 0 && !positions && rc.incarnation != 0 && rb.Incarnation != rc.incarnation {
		// Not heard: the sender is another incarnation than the rank's,
		// dead or about to be, and a rank whose own publisher went quiet
		// must still be reported silent.
		for i := range rb.Events {
			f.countEvent(&rb.Events[i], outcomeFenced)
		}
		ack.Cursor, ack.Resync, ack.Fenced = cur, true, true
		return ack
	}
	f.noteHeard(rb.Rank, now)
	// A positional worker's ids are its engine stream's positions: they
	// only go up, with holes between batches, so nothing is a gap.
	positional := f.wtab[rb.Rank.Worker].Positional
	for i := range rb.Events {
		ev := &rb.Events[i]
		if ev.EventID <= cur {
			ack.Dups++
			f.countEvent(ev, outcomeDuplicate)
			continue
		}
		if ev.EventID != cur+1 && !positional {
			ack.Gap = true
			for j := i; j < len(rb.Events); j++ {
				f.countEvent(&rb.Events[j], outcomeGap)
			}
			break
		}
		// A malformed event still consumes its id: it is counted by the
		// index and skipped, and the stream goes on.
		// TryApply, not Apply: the error would be formatted and dropped.
		if !f.ix.TryApply(ev, now) {
			f.countEvent(ev, outcomeMalformed)
		} else {
			f.countEvent(ev, outcomeApplied)
		}
		cur = ev.EventID
		ack.Applied++
	}
	if ack.Applied > 0 {
		rc.id = cur
		f.setCursor(rb.Rank, rc)
	}
	ack.Cursor = cur
	ack.Resync = f.ix.RankNeedsResync(rb.Rank)
	return ack
}

// Outcomes of an event in an event batch (kvrouter_events_applied_total).
const (
	outcomeApplied   = iota // applied to the index
	outcomeDuplicate        // at or below the rank's cursor: applied before
	outcomeGap              // after a gap in its batch: not applied
	outcomeMalformed        // consumed its id, refused by the index
	outcomeFenced           // in a batch of another incarnation than the rank's: not applied
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"applied", "duplicate", "gap", "malformed", "fenced"}

func (f *FSM) countEvent(ev *kvevent.Event, outcome int) {
	if ev.Kind <= kvevent.KindCleared && ev.Tier < kvevent.NumTiers {
		f.events[ev.Kind][ev.Tier][outcome].Add(1)
	}
}

func (f *FSM) noteHeard(r kvevent.Rank, now int64) {
	f.curMu.Lock()
	f.heard.Set(r, now)
	f.curMu.Unlock()
}

// LastHeard returns when rank r's events last reached the log (unix nanos
// of the leader's clock), or 0 when not since this node started.
func (f *FSM) LastHeard(r kvevent.Rank) int64 {
	f.curMu.RLock()
	defer f.curMu.RUnlock()
	t, _ := f.heard.Get(r)
	return t
}

// RegisteredAt returns when worker id last registered (unix nanos of the
// leader's clock), or 0 when not since this node started.
func (f *FSM) RegisteredAt(id uint64) int64 {
	f.curMu.RLock()
	defer f.curMu.RUnlock()
	return f.registered[id]
}

// RestoredAt is when this node last restored a snapshot (unix ns, its own
// clock), or 0.
func (f *FSM) RestoredAt() int64 { return f.restoredAt.Load() }

// UnregisteredRanks returns, in rank order, the ranks this node holds a
// cursor or a last-heard time of that no registration lists: those of a
// worker that is not registered, and those of a registered worker that its
// registration does not list. Events and dumps apply whether or not their
// rank is registered (a registration, or a re-registration adding the
// rank, may commit after an agent's first events), so an agent that goes
// on publishing after its worker was removed or its rank dropped, one that
// never registers, or anyone publishing a rank a registered worker does
// not list, leaves ranks that no deregistration takes away unless asked
// to (the leader's sweep does, eventplane: DeregisterWorker of a worker
// not registered, RemoveUnregisteredRanks of a registered worker's). A
// registered worker's unlisted rank has no capacity either (only the
// listed ranks get the registration's), so until then it grows without
// bound. A registered Positional worker's unlisted ranks are never in it:
// they hold nothing, as its registration dropped what they took before
// (droppedRanks) and they take nothing since (unlisted). It allocates
// only when there are some.
func (f *FSM) UnregisteredRanks() []kvevent.Rank {
	workers := f.Workers()
	stray := func(r kvevent.Rank) bool {
		w, ok := workers[r.Worker]
		return !ok || !slices.Contains(w.DPRanks, r.DP)
	}
	var out []kvevent.Rank
	f.curMu.RLock()
	for r := range f.cursors.All() {
		if stray(r) {
			out = append(out, r)
		}
	}
	for r := range f.heard.All() {
		if stray(r) {
			if _, dup := f.cursors.Get(r); !dup {
				out = append(out, r)
			}
		}
	}
	f.curMu.RUnlock()
	slices.SortFunc(out, kvevent.Rank.Compare)
	return out
}

// removeUnregistered removes the state of each of ranks that no
// registration lists when the entry applies (UnregisteredRanks), as a
// deregistration removes a worker's, and returns how many it removed. A
// rank that a registration committed before the entry lists keeps its
// state: the leader listed the rank unregistered before that registration
// (an agent's first events ahead of it) and the removal is stale. Ranks
// are removed in rank order, so that every replica's batch deletes the
// same keys in one order.
//
// The count is of the ranks that held a cursor or index state as the
// entry applied: one whose state went after the leader's listing (its
// worker's deregistration, or a Positional re-registration dropping it,
// committed first) removes nothing, and the leader adds the count to
// kvrouter_unregistered_ranks_removed_total. A last-heard time alone does
// not count: it is in memory only, and a replica that restarted would
// answer otherwise than one that did not. The count is the apply's answer
// only, in no replica's stored state: removeRank runs for every unlisted
// rank either way, so what each replica stores is unchanged.
func (f *FSM) removeUnregistered(ranks []kvevent.Rank) int {
	ranks = slices.Clone(ranks)
	slices.SortFunc(ranks, kvevent.Rank.Compare)
	ranks = slices.Compact(ranks)
	n := 0
	for _, r := range ranks {
		if w, ok := f.wtab[r.Worker]; ok && slices.Contains(w.DPRanks, r.DP) {
			continue
		}
		if f.removeRank(r) {
			n++
		}
	}
	return n
}

func (f *FSM) setCursor(r kvevent.Rank, c rankCursor) {
	f.curMu.Lock()
	f.cursors.Set(r, c)
	f.curMu.Unlock()
	f.batch.PutCursor(r.Worker, r.DP, c.id, c.incarnation)
}

// removeRank drops one rank's index state, bookings and cursor (with its
// incarnation), and reports whether it held index state or a cursor (what
// every replica stores alike, a restarted one too).
func (f *FSM) removeRank(r kvevent.Rank) bool {
	held := f.ix.RemoveRank(r)
	f.pending.mu.Lock()
	f.seqs.RemoveRank(r)
	f.pending.mu.Unlock()
	f.curMu.Lock()
	_, cursor := f.cursors.Get(r)
	f.cursors.Delete(r)
	f.heard.Delete(r)
	f.curMu.Unlock()
	f.batch.DeleteCursor(r.Worker, r.DP)
	return held || cursor
}

// removeWorker removes worker id's registration and its ranks' state. It
// answers how many of its ranks held index state or a cursor (as
// removeRank counts them): an int, or, for a worker not registered, an
// unknownWorkerError carrying it (ErrUnknownWorker, which an operator's
// removal of the id answers too, whether or not it took ranks). The
// leader's sweep of unregistered workers counts what its own entry
// removed from it: another removal of the id committed first leaves
// nothing to count. The count is the apply's answer only, in no
// replica's stored state (removeUnregistered says why).
func (f *FSM) removeWorker(id uint64) interface{} {
	_, known := f.wtab[id]
	held := f.ix.WorkerRanks(nil, id)
	f.ix.RemoveWorker(id)
	f.pending.mu.Lock()
	f.seqs.RemoveWorker(id)
	f.pending.mu.Unlock()
	f.curMu.Lock()
	// In rank order, so that every replica's batch deletes in one order.
	removed := len(held)
	for _, r := range f.cursors.WorkerRanks(nil, id) {
		if _, ok := slices.BinarySearchFunc(held, r, kvevent.Rank.Compare); !ok {
			removed++
		}
		f.cursors.Delete(r)
		f.batch.DeleteCursor(r.Worker, r.DP)
	}
	// A rank heard of with no cursor too: its batches began past a gap,
	// and nothing of them applied.
	for _, r := range f.heard.WorkerRanks(nil, id) {
		f.heard.Delete(r)
	}
	delete(f.registered, id)
	f.curMu.Unlock()
	if !known {
		return &unknownWorkerError{id: id, removed: removed}
	}
	delete(f.wtab, id)
	f.markWorker(id)
	f.batch.Delete(store.KindWorker, u64key(id))
	return removed
}

// unknownWorkerError is a deregistration's answer for a worker not
// registered: ErrUnknownWorker, with how many of its ranks' state the
// entry removed all the same (removeWorker).
type unknownWorkerError struct {
	id      uint64
	removed int
}

func (e *unknownWorkerError) Error() string {
	return fmt.Sprintf("deregister %d: %v", e.id, ErrUnknownWorker)
}

func (e *unknownWorkerError) Unwrap() error { return ErrUnknownWorker }

func u64key(v uint64) []byte {
	var e enc
	e.u64(v)
	return e.b
}

// journal writes the index's and the tracker's changes into the batch of
// the ApplyBatch in progress.
type journal struct {
	f *FSM
	// booked is Booked's record, reused: the batch copies what it is
	// given, and a group's flush writes up to a group of bookings (a
	// record grown afresh per booking allocated 4.5 times their bytes).
	booked enc
}

func (j *journal) NodeCreated(seq, parent uint64, root bool, local uint64) {
	j.f.batch.PutNode(seq, parent, root, local)
}
func (j *journal) NodeFreed(seq uint64) { j.f.batch.DeleteNode(seq) }
func (j *journal) EntrySet(r kvevent.Rank, eh, seq uint64, m kvevent.Mask, order uint32) {
	j.f.batch.PutEntry(r.Worker, r.DP, eh, seq, uint8(m), order)
}
func (j *journal) EntryDeleted(r kvevent.Rank, eh uint64) { j.f.batch.DeleteEntry(r.Worker, r.DP, eh) }
func (j *journal) RankMeta(m indexer.RankMeta) {
	var e enc
	encodeRankMeta(&e, &m)
	j.f.batch.PutRank(m.Rank.Worker, m.Rank.DP, e.b)
}
func (j *journal) RankRemoved(r kvevent.Rank) { j.f.batch.DeleteRank(r.Worker, r.DP) }

func (j *journal) Booked(b indexer.Booking) {
	j.booked.b = j.booked.b[:0]
	encodeBooking(&j.booked, &b)
	j.f.batch.Delete(store.KindTomb, []byte(b.ID))
	j.f.batch.Put(store.KindBooking, []byte(b.ID), j.booked.b)
}
func (j *journal) Freed(fb indexer.FreedBooking) {
	var e enc
	e.sv(fb.CreatedAt)
	j.f.batch.Delete(store.KindBooking, []byte(fb.ID))
	j.f.batch.Put(store.KindTomb, []byte(fb.ID), e.b)
}
func (j *journal) Gone(id string) {
	j.f.batch.Delete(store.KindBooking, []byte(id))
	j.f.batch.Delete(store.KindTomb, []byte(id))
}
func (j *journal) Clock(c int64) {
	var e enc
	e.sv(c)
	j.f.batch.Put(store.KindLoadMeta, []byte{loadMetaClock}, e.b)
	j.f.batch.Delete(store.KindLoadMeta, []byte{loadMetaHorizon}) // an earlier build's; see stateBuilder.small
}

// The keys of the tracker's load meta records (store.KindLoadMeta).
const (
	loadMetaClock   = 'c' // the sweeps' clock (indexer.SequencesSnapshot.Clock)
	loadMetaHorizon = 'l' // earlier builds: the expiry horizon, read as the clock
)

// Snapshot commits the group batch, makes the state database durable up to
// the applied index and opens a consistent read view of it (raft.FSM). It
// runs on the FSM goroutine, so no apply is in flight.
//
// It refuses (ErrReplaying) while the state is ahead of the entries Raft
// has handed over: after a restart the state may be past Raft's last
// snapshot, and the FSM skips the entries Raft re-delivers up to its
// applied index. Raft labels a snapshot with the last entry it handed
// over, and the stream would hold the state at a later index: a follower
// installing it applies the entries between again, and they are not
// idempotent (a booking added and then expired by a sweep comes back).
// Raft tries again later (its own snapshots, Node.maybeSnapshot and
// compactLog log the failure); a user's save (SaveSnapshot) is not a Raft
// snapshot and is not refused. It refuses too (ErrRestorePending) between
// the close of a leader's snapshot or a user restore in the node's store
// and its Restore: the state is the one before it (snapshotStore).
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	if err := f.waitStarted(); err != nil {
		return nil, err
	}
	f.dbMu.RLock()
	defer f.dbMu.RUnlock()
	if f.isClosed {
		return nil, ErrShutdown
	}
	if h := f.halt.Load(); h != nil {
		// Raft labels a snapshot with the last entry it handed over, past
		// the halted one: it would compact the log past an entry the
		// state lacks, which the node's upgrade could no longer apply.
		return nil, fmt.Errorf("no snapshot while %w", h)
	}
	if applied, handed := f.applied.Load(), f.handed.Load(); applied > handed {
		return nil, fmt.Errorf("%w: the state is at index %d, Raft has handed over the entries up to %d since the start, and labels a snapshot with the last of them; Raft tries again later",
			ErrReplaying, applied, handed)
	}
	var gen uint64
	if f.snaps != nil {
		var err error
		if gen, err = f.snaps.snapshotTaken(); err != nil {
			return nil, err
		}
	}
	if err := f.commitGroup(); err != nil {
		return nil, fmt.Errorf("commit applied entries: %w", err)
	}
	if err := f.db.Sync(); err != nil {
		return nil, err
	}
	// Raft calls Snapshot between two ApplyBatch calls: the count is the
	// one of the view's entries; those applied during the Persist stay.
	return &fsmSnapshot{view: f.db.Snapshot(), logger: f.logger, persistSeconds: f.persistSeconds, gen: gen,
		since: &f.sinceSnap, bytes: f.sinceSnap.Load()}, nil
}

// Restore replaces the whole state with a snapshot stream (raft.FSM): it
// is written into a fresh directory and checked first, then swapped in.
//
// The stream's own applied index is dropped (restoreFrom). Raft restores
// a snapshot of its store, opened by its id just before it calls Restore:
// a leader's (InstallSnapshot) or a user's (raft.Restore, numbered after
// the log's last index), whose index Raft then takes as applied and
// delivers only entries after. Restore installs that index with the state,
// read from the stream (a node's snapshotStore.Open marks it; 0 for a
// stream of another source: a bare FSM), so that status and readiness
// report it, never 0 meanwhile, and the directory swapped in holds it, so
// that a restart before the next command does not restore the snapshot
// again. It is not the store's newest (the first of List), which is by
// term first: a deposed leader's user restore of a later term than the
// leader's snapshot Raft installs over it. Every failure after the swap
// is fatal (onFatal): the state is replaced by then, and an error would
// tell Raft the restore did not happen. Once it returns, the FSM's own
// snapshots are taken again (snapshotStore.restored): the state is the
// restored one or, when it failed, the one before it, whose next snapshot
// reaps the failed install listed above it.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	if f.snaps != nil {
		defer f.snaps.restored()
	}
	if err := f.waitStarted(); err != nil {
		return err
	}
	if f.duringRestore != nil {
		f.duringRestore()
	}
	meta, _ := openedMeta(rc)
	return f.restoreFrom(rc, meta.Index, meta.Term)
}
