package raftfsm

import (
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"

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
// (snapshotSink.Close): every snapshot listed above the new one that was
// already there when the new one's sink was created goes, then all but the
// newest snapshotsKept. FileSnapshotStore's own reap, in the
// sink's Close before Raft opens the snapshot to restore it, keeps the
// newest by term: a node holding two snapshots of a later term than a
// leader's snapshot it installs (its own and a user restore, as a deposed
// leader) deleted the one it had just received, Raft could not open it,
// and the install failed at every try. A snapshot listed above the one
// Raft has just written is of no use: Raft's last snapshot is the new one
// (the state is the new one's, and the log continues it), while Raft's
// start and a leader's send (both take the first of List) would take the
// one above, of another history (TestAWrittenSnapshotIsKeptOverOnesOfALaterTerm).
// A snapshot created while the new one was being written is kept, though
// listed above it: Raft writes its own snapshot on its snapshot goroutine
// while the main goroutine installs a leader's snapshot or runs a user
// restore, whose sink closes first and which the FSM restores; the older
// sink's reap deleted it, and the store's newest (what Raft's start and a
// leader's send take) was the state before it
// (TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne).
type snapshotStore struct {
	*raft.FileSnapshotStore
	dir    string // snapshots/
	logger *slog.Logger
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
// snapshotStore's rule once the snapshot is in place.
func (s *snapshotStore) Create(version raft.SnapshotVersion, index, term uint64, configuration raft.Configuration,
	configurationIndex uint64, trans raft.Transport) (raft.SnapshotSink, error) {
	// The snapshots there now are the only ones Close may drop for being
	// listed above this one: one created meanwhile is newer, whatever its
	// term (snapshotStore).
	list, err := s.List()
	if err != nil {
		return nil, fmt.Errorf("list snapshots before creating one: %w", err)
	}
	before := make(map[string]bool, len(list))
	for _, m := range list {
		before[m.ID] = true
	}
	sink, err := s.FileSnapshotStore.Create(version, index, term, configuration, configurationIndex, trans)
	if err != nil {
		return nil, err
	}
	return &snapshotSink{SnapshotSink: sink, store: s, before: before}, nil
}

type snapshotSink struct {
	raft.SnapshotSink
	store  *snapshotStore
	before map[string]bool // ids of the snapshots listed when the sink was created
}

// Close puts the snapshot in place, then reaps: every snapshot listed
// before it (of a later term: another history's) that was there when the
// sink was created, then all but the newest snapshotsKept. A failed reap
// costs disk space only; it is logged.
func (k *snapshotSink) Close() error {
	if err := k.SnapshotSink.Close(); err != nil {
		return err
	}
	if err := k.store.reap(k.ID(), k.before); err != nil {
		k.store.logger.Warn("reaping Raft snapshots failed", "err", err)
	}
	return nil
}

// reap removes the snapshots listed before written (the one just put in
// place) whose ids are in existed (those there when written's sink was
// created), then all after the newest snapshotsKept of the rest.
func (s *snapshotStore) reap(written string, existed map[string]bool) error {
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
		if i < at && existed[m.ID] {
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
