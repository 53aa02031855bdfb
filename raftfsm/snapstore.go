package raftfsm

import (
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"

	"github.com/hashicorp/raft"
)

// snapshotsKept is how many Raft snapshots a node's store keeps.
const snapshotsKept = 2

// snapshotStore is a node's Raft snapshot store: Raft's FileSnapshotStore
// (snapshots/ under the data directory), with two changes.
//
// Its Open tells FSM.Restore which snapshot it restores. Raft's Restore
// says nothing of the stream's index and term, and every restore of
// hashicorp/raft v1.8.0 (a leader's snapshot installed through the
// restore future in runFSM, a user restore through the same future, a
// start's restoreSnapshot, off here) opens the snapshot by its id and
// hands the stream it got to Restore, wrapped in a reader that unwraps
// (raft.ReadCloserWrapper). Restore took the store's newest before, the
// first of List: FileSnapshotStore lists by term first, so a deposed
// leader's user restore at (R, T2) stood for a new leader's snapshot at
// (S, T1 < T2) that Raft installed over it, and the FSM skipped the
// entries up to R (TestRestoreTakesTheIndexOfTheSnapshotRaftJustSaved).
//
// It reaps after a new snapshot is in place, by its own rule
// (snapshotSink.Close): every snapshot listed above the new one goes, then
// all but the newest snapshotsKept. FileSnapshotStore's own reap, in the
// sink's Close before Raft opens the snapshot to restore it, keeps the
// newest by term: a node holding two snapshots of a later term than a
// leader's snapshot it installs (its own and a user restore, as a deposed
// leader) deleted the one it had just received, Raft could not open it,
// and the install failed at every try. A snapshot listed above the one
// Raft has just written is of no use: Raft's last snapshot is the new one
// (the state is the new one's, and the log continues it), while Raft's
// start and a leader's send (both take the first of List) would take the
// one above, of another history (TestAWrittenSnapshotIsKeptOverOnesOfALaterTerm).
//
// The FSM's own snapshots are told apart from the others (a leader's
// snapshot installed, a user restore), because Raft writes its own on its
// snapshot goroutine (takeSnapshot: the sink created after runFSM took
// the FSM's snapshot, persisted there) while the main goroutine installs
// a leader's snapshot or runs a user restore (installSnapshot,
// restoreUserSnapshot: create, copy, close, then the restore future to
// runFSM). FSMSnapshot.Persist marks its sink as the FSM's own (ownSink),
// with the store's install generation read when FSM.Snapshot ran
// (snapshotTaken). An install's or a restore's Close moves the generation
// on and marks a restore pending until FSM.Restore (restored); FSM.Snapshot
// refuses meanwhile, when it would take the state before the restore. An
// own sink closing with another generation than its own holds the state
// before an install or a restore closed meanwhile: it is cancelled, not
// put in place, and Raft tries again later. Put in place, its reap deleted
// the install or the restore listed above it, and the store's newest
// (what Raft's start and a leader's send take) was the state before it
// (TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne); or, of a later
// term than the install and kept by the install's reap, it stood first
// itself (TestAnInstallDropsAnOwnSnapshotOfTheOldHistoryClosedDuringIt).
type snapshotStore struct {
	*raft.FileSnapshotStore
	dir    string // snapshots/
	logger *slog.Logger

	// mu orders the sinks' closes and reaps, and FSM.Snapshot's read of
	// the install generation, with one another.
	mu sync.Mutex
	// createMu orders the Creates, so that a failed one knows the
	// NAME.tmp directories it made (partialsSince).
	createMu sync.Mutex
	// gen counts the installs and user restores closed (the sinks not the
	// FSM's own); restoring is set by one's Close and cleared by the next
	// FSM.Restore (restored).
	gen       uint64
	restoring bool
}

func openSnapshotStore(dataDir string, logger *slog.Logger) (*snapshotStore, error) {
	// Raft reaps nothing (retain: all); snapshotSink.Close does.
	fs, err := raft.NewFileSnapshotStoreWithLogger(dataDir, math.MaxInt, hclogAdapter(logger))
	if err != nil {
		return nil, err
	}
	return &snapshotStore{FileSnapshotStore: fs, dir: filepath.Join(dataDir, "snapshots"), logger: logger}, nil
}

// openedSnapshot is a stream snapshotStore.Open returned, with the
// snapshot's meta (openedMeta).
type openedSnapshot struct {
	io.ReadCloser
	meta raft.SnapshotMeta
}

// Open opens a snapshot as FileSnapshotStore does; its stream carries the
// snapshot's meta for FSM.Restore.
func (s *snapshotStore) Open(id string) (*raft.SnapshotMeta, io.ReadCloser, error) {
	meta, rc, err := s.FileSnapshotStore.Open(id)
	if err != nil {
		return nil, nil, err
	}
	return meta, &openedSnapshot{ReadCloser: rc, meta: *meta}, nil
}

// openedMeta returns the meta of the snapshot r was opened from
// (snapshotStore.Open), through Raft's wrappers; false for a stream of
// another source.
func openedMeta(r io.Reader) (raft.SnapshotMeta, bool) {
	for range 8 { // Raft wraps once; a bound all the same
		switch w := r.(type) {
		case *openedSnapshot:
			return w.meta, true
		case raft.ReadCloserWrapper:
			r = w.WrappedReadCloser()
		default:
			return raft.SnapshotMeta{}, false
		}
	}
	return raft.SnapshotMeta{}, false
}

// Create starts a snapshot as FileSnapshotStore does; its sink reaps by
// snapshotStore's rule once the snapshot is in place. A Create that fails
// removes the NAME.tmp directory it made: FileSnapshotStore's leaves it
// when its meta.json or state.bin cannot be written (a full disk), and
// Raft retries, each try leaving one more until the next start
// (removePartialSnapshots), taking the room the next try needs
// (TestARaftSnapshotFailedOnAFullDiskLeavesNoPartialSnapshot). Raft names
// the directory by the clock (snapshotName), so the failed Create's is the
// one that was not there before it: Creates are serialized (createMu) and a
// sink still being written keeps its directory.
func (s *snapshotStore) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	s.createMu.Lock()
	defer s.createMu.Unlock()
	before, _ := s.partials()
	sink, err := s.FileSnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		s.removePartialsSince(before)
		return nil, err
	}
	return &snapshotSink{SnapshotSink: sink, store: s}, nil
}

// partials returns the names of the snapshots being written (NAME.tmp
// directories) in the store.
func (s *snapshotStore) partials() (map[string]bool, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	names := make(map[string]bool)
	for _, e := range ents {
		if isPartialSnapshot(e) {
			names[e.Name()] = true
		}
	}
	return names, nil
}

// removePartialsSince removes the NAME.tmp directories not in before: a
// failed Create's. A failed removal costs disk space until the next start;
// it is logged. Without the list from before the Create (nil), it removes
// nothing: a sink still being written would go with it.
func (s *snapshotStore) removePartialsSince(before map[string]bool) {
	if before == nil {
		return
	}
	now, err := s.partials()
	if err != nil {
		s.logger.Warn("listing Raft's partial snapshots after a failed one failed", "err", err)
		return
	}
	for name := range now {
		if before[name] {
			continue
		}
		s.removePartial(filepath.Join(s.dir, name))
	}
}

// removePartial removes a failed snapshot's NAME.tmp directory; a failed
// removal is logged (removePartialSnapshots removes it at the next start).
func (s *snapshotStore) removePartial(path string) {
	if err := os.RemoveAll(path); err != nil {
		s.logger.Warn("removing a failed Raft snapshot failed; the next start removes it", "path", path, "err", err)
	}
}

// snapshotTaken returns the install generation for an FSM snapshot taken
// now (FSM.Snapshot, on Raft's FSM goroutine), which its Persist gives
// its sink (ownSink). It refuses (ErrRestorePending) while an install or a
// user restore is in place and not yet restored: the FSM still holds the
// state before it.
func (s *snapshotStore) snapshotTaken() (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.restoring {
		return 0, fmt.Errorf("%w: a leader's snapshot or a user restore is in place and not yet restored; Raft tries again later", ErrRestorePending)
	}
	return s.gen, nil
}

// restored clears the mark an install's or a user restore's Close set:
// FSM.Restore has run.
func (s *snapshotStore) restored() {
	s.mu.Lock()
	s.restoring = false
	s.mu.Unlock()
}

// ownSink marks sink, if it is a snapshotStore's, as the FSM's own
// snapshot taken at install generation gen (snapshotTaken). Raft hands
// FSMSnapshot.Persist the sink its store created, unwrapped.
func ownSink(sink raft.SnapshotSink, gen uint64) {
	if k, ok := sink.(*snapshotSink); ok {
		k.own, k.gen = true, gen
	}
}

type snapshotSink struct {
	raft.SnapshotSink
	store *snapshotStore
	own   bool   // the FSM's own snapshot (ownSink); else an install or a user restore
	gen   uint64 // the store's install generation when the FSM's snapshot was taken
}

// Close puts the snapshot in place, then reaps: every snapshot listed
// before it (of a later term: another history's), then all but the newest
// snapshotsKept. A failed reap costs disk space only; it is logged. An
// install's or a user restore's Close moves the store's install
// generation on and marks a restore pending; the FSM's own snapshot,
// taken before an install or a restore closed, is cancelled instead
// (snapshotStore).
func (k *snapshotSink) Close() error {
	s := k.store
	s.mu.Lock()
	defer s.mu.Unlock()
	if k.own && k.gen != s.gen {
		if err := k.SnapshotSink.Cancel(); err != nil {
			s.logger.Warn("cancelling a stale Raft snapshot failed", "err", err)
		}
		return fmt.Errorf("%w: the FSM's snapshot was taken before a leader's snapshot or a user restore put in place meanwhile; Raft tries again later", ErrRestorePending)
	}
	if err := k.SnapshotSink.Close(); err != nil {
		// FileSnapshotSink's Close leaves its NAME.tmp, a whole
		// state.bin, when its final meta.json write or the rename fails
		// (a full disk); Raft does not try that snapshot again.
		s.removePartial(filepath.Join(s.dir, k.ID()+".tmp"))
		return err
	}
	if !k.own {
		s.gen++
		s.restoring = true
	}
	if err := s.reap(k.ID()); err != nil {
		s.logger.Warn("reaping Raft snapshots failed", "err", err)
	}
	return nil
}

// reap removes the snapshots listed before written (the one just put in
// place), then all after the newest snapshotsKept of the rest.
func (s *snapshotStore) reap(written string) error {
	list, err := s.List()
	if err != nil {
		return err
	}
	at := -1
	for i, m := range list {
		if m.ID == written {
			at = i
			break
		}
	}
	if at < 0 {
		return fmt.Errorf("the snapshot %s just written is not listed", written)
	}
	w := list[at]
	var drop, rest []raft.SnapshotMeta
	for i, m := range list {
		if i < at {
			s.logger.Warn("removing a Raft snapshot of a later term than the one Raft has just written: another history's (a deposed leader's user restore, say)",
				"snapshot", m.Index, "snapshot_term", m.Term, "written", w.Index, "written_term", w.Term)
			drop = append(drop, *m)
			continue
		}
		rest = append(rest, *m)
	}
	if len(rest) > snapshotsKept {
		drop = append(drop, rest[snapshotsKept:]...)
	}
	for _, m := range drop {
		s.logger.Info("reaping Raft snapshot", "id", m.ID)
		if err := os.RemoveAll(filepath.Join(s.dir, m.ID)); err != nil {
			return fmt.Errorf("remove snapshot %s: %w", m.ID, err)
		}
	}
	return nil
}
