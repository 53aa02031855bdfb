package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/store"
)

// ErrUnplacedState is returned by SaveDataDir for a state applied past
// the newest Raft snapshot that the Raft log holds no entry for: nothing
// in the directory tells whether it is the newer committed state or one
// a node's start would restore the snapshot over (refuseUnplacedState).
var ErrUnplacedState = errors.New("state past the newest Raft snapshot, absent from the Raft log")

// SaveOptions configures SaveDataDir.
type SaveOptions struct {
	// AppliedOnly saves the state as the node's FSM applied it (once
	// reconciled with the newest Raft snapshot), without the entries its
	// Raft log holds after the applied index.
	AppliedOnly bool
	// TempDir is where the working copy of the directory's state and log
	// is made (a directory of its own inside it, locked while the save
	// runs and removed at the end; a killed save's is removed by the next
	// save in TempDir): as
	// much free space as fsm/ and raft/ take. Beside the output file, so
	// that the copy lands on the disk the operator chose for it; empty:
	// os.TempDir().
	TempDir string
	// Logger logs the rebuild (default: discarded).
	Logger *slog.Logger
}

// SaveReport says what SaveDataDir did.
type SaveReport struct {
	// Snapshot is what was written: the stream's index, term, counts,
	// size and checksum, as the online save reports them.
	Snapshot SnapshotInfo
	// AppliedIndex and AppliedTerm are the state's applied entry once
	// reconciled with the newest Raft snapshot, before the log's entries.
	AppliedIndex, AppliedTerm uint64
	// LogFirstIndex and LogLastIndex are the Raft log's bounds (0, 0: an
	// empty log).
	LogFirstIndex, LogLastIndex uint64
	// LogLastTerm is the term of the log's last entry (0: an empty log).
	// With LogLastIndex it ranks survivors as Raft's election rule does
	// (the higher last term, then the higher last index): the file's
	// index and term are those of the last applied command, and a log
	// may end in a later term's entries the FSM never sees (a new
	// leader's no-op), or in a deposed leader's entries of an older term.
	LogLastTerm uint64
	// LogEntries is how many of the log's entries after AppliedIndex were
	// applied (0 with AppliedOnly): offline there is no commit index, and
	// some of them may never have been committed. Entries Raft never
	// hands to the FSM (no-ops, barriers) are counted too.
	LogEntries uint64
	// LogEntriesLeft is how many entries after AppliedIndex the log holds
	// that were not applied (AppliedOnly).
	LogEntriesLeft uint64
	// LogEntriesDetached is how many entries after AppliedIndex were left
	// out, AppliedOnly or not, because they do not continue the newest Raft
	// snapshot (detachedTail): another history, which a node's start
	// drops or its leader overwrites before anything applies it.
	LogEntriesDetached uint64
}

// SaveDataDir writes a snapshot of a stopped node's state, read from its
// data directory, to w: the offline save (kvctl snapshot save FILE
// --data-dir DIR), for a cluster that lost its majority for good, where
// the online save has no leader to ask. The stream is in the format of the
// online save (header, records, counts, checksum trailer), so that kvctl
// snapshot inspect, the online restore and the offline seed (SeedDataDir)
// take it.
//
// It takes the directory's lock (ErrDataDirInUse while a node runs on
// it; the lock file is created if the directory has none, as a node's
// start creates it) and never changes what the directory holds: the
// state database (fsm/, or the fsm.old/ an interrupted restore's swap
// left, as a start rolls it back: cleanupRestore) and the Raft log (raft/)
// are copied into a directory of its own in opts.TempDir, and the Raft
// snapshots are linked there (copied across filesystems), read only.
// Pebble writes to what it opens (a WAL replayed into a new one, recycled
// logs overwritten in place), and the state is rebuilt and replayed
// through the FSM's own writes: done on the copy, the node's directory
// is left as it was, and a node started on it afterwards starts as it
// would have.
//
// On the copy it does what a node's start does before Raft hands it
// anything (NewNode): the state is loaded, refused where the start
// refuses it (refuseStateWithoutItsLog: a state past its log with no
// snapshot, or one without its applied index), and reconciled with the
// newest Raft snapshot (catchUpFromSnapshot: restored when behind it or
// of another history). The state database is written unsynced and made
// durable at snapshots, so that step is what brings it to the newest
// snapshot. Then, unless opts.AppliedOnly, the log's entries after the
// state's applied index (and after the newest snapshot's, as Raft hands
// over only those) are applied through ApplyBatch, in order, as Raft
// would hand them over: commands and configurations, in batches. Offline
// there is no commit index: every entry in the log is applied, committed
// or not. An acknowledged write on a follower may be only in its log; an
// entry never committed (its client saw no acknowledgement, or an
// unknown outcome) is applied as well. An entry of a later build halts
// the apply (ErrLaterBuild), and the save fails rather than save a state
// that stops short of it.
func SaveDataDir(ctx context.Context, dataDir string, w io.Writer, opts SaveOptions) (SaveReport, error) {
	var rep SaveReport
	if dataDir == "" {
		return rep, fmt.Errorf("%w: no data directory to save", ErrInvalid)
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	if fi, err := os.Stat(dataDir); err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, err)
	} else if !fi.IsDir() {
		return rep, fmt.Errorf("%w: %s is not a directory", ErrInvalid, dataDir)
	}
	tempDir := opts.TempDir
	if tempDir == "" {
		tempDir = os.TempDir()
	}
	if err := OutsideDataDir(dataDir, tempDir); err != nil {
		return rep, fmt.Errorf("save: the working directory: %w", err)
	}
	lock, err := lockDataDir(dataDir)
	if err != nil {
		return rep, err
	}
	defer lock.Close()
	has := false
	for _, sub := range []string{"fsm", "fsm.old", "raft", "snapshots"} {
		if _, err := os.Stat(filepath.Join(dataDir, sub)); err == nil {
			has = true
		}
	}
	if !has {
		return rep, fmt.Errorf("%w: %s holds no node state (no fsm/, raft/ or snapshots/): nothing to save", ErrInvalid, dataDir)
	}
	removeDeadSaves(tempDir, logger)
	work, err := os.MkdirTemp(tempDir, saveWorkPrefix+"*")
	if err != nil {
		return rep, fmt.Errorf("save: make a working directory: %w", err)
	}
	// Held for the save's life: a later save in tempDir removes the
	// working directory of one killed (removeDeadSaves), never this one.
	workLock, err := lockSaveWork(work)
	if err != nil {
		os.RemoveAll(work)
		return rep, fmt.Errorf("save: lock the working directory: %w", err)
	}
	defer removeSaveWork(work, workLock, logger)
	if err := copyNodeState(ctx, dataDir, work); err != nil {
		return rep, fmt.Errorf("save: copy %s: %w", dataDir, err)
	}

	var fatal error
	n := &Node{cfg: Config{DataDir: work}, logger: logger}
	n.fsm, err = openFSM(FSMConfig{Dir: filepath.Join(work, "fsm"), Logger: logger,
		// The FSM's writes go to the copy: a failure fails the save.
		OnFatal: func(err error) {
			if fatal == nil {
				fatal = err
			}
		}})
	if err != nil {
		return rep, fmt.Errorf("save: open the state of %s: %w", dataDir, err)
	}
	defer n.fsm.Close()
	if err := n.fsm.loadState(); err != nil {
		return rep, fmt.Errorf("save: load the state of %s: %w", dataDir, err)
	}
	if n.logs, err = store.OpenLogStore(filepath.Join(work, "raft"), store.LogStoreOptions{Logger: logger, Stalls: &n.logStalls}); err != nil {
		return rep, fmt.Errorf("save: open the Raft log of %s: %w", dataDir, err)
	}
	defer n.logs.Close()
	if n.snaps, err = openSnapshotStore(work, logger); err != nil {
		return rep, fmt.Errorf("save: open the Raft snapshots of %s: %w", dataDir, err)
	}
	// The log as the directory holds it: what ranks the survivors.
	if rep.LogFirstIndex, err = n.logs.FirstIndex(); err != nil {
		return rep, fmt.Errorf("save: read the Raft log's first index: %w", err)
	}
	if rep.LogLastIndex, err = n.logs.LastIndex(); err != nil {
		return rep, fmt.Errorf("save: read the Raft log's last index: %w", err)
	}
	if rep.LogLastIndex > 0 {
		var l raft.Log
		if err := n.logs.GetLog(rep.LogLastIndex, &l); err != nil {
			return rep, fmt.Errorf("save: read the Raft log's last entry %d: %w", rep.LogLastIndex, err)
		}
		rep.LogLastTerm = l.Term
	}
	// What a start does before Raft hands the FSM anything. Their
	// errors name the copy's paths, which are gone once this returns:
	// they name the data directory's instead (copyPaths).
	if err := n.refuseStateWithoutItsLog(); err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, copyPaths(err, work, dataDir))
	}
	if err := n.refuseUnplacedState(); err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, copyPaths(err, work, dataDir))
	}
	// A log that begins after a gap above the newest snapshot, or ends
	// below it, is deleted (on the copy), as a start deletes it.
	if err := n.dropDetachedLog(); err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, copyPaths(err, work, dataDir))
	}
	if err := n.catchUpFromSnapshot(); err != nil {
		return rep, fmt.Errorf("save %s: reconcile the state with the newest Raft snapshot: %w", dataDir, copyPaths(err, work, dataDir))
	}
	if fatal != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, fatal)
	}
	n.fsm.release(nil)
	rep.AppliedIndex, rep.AppliedTerm = n.fsm.Applied()
	first, err := n.logs.FirstIndex()
	if err != nil {
		return rep, fmt.Errorf("save: read the Raft log's first index: %w", err)
	}
	last, err := n.logs.LastIndex()
	if err != nil {
		return rep, fmt.Errorf("save: read the Raft log's last index: %w", err)
	}
	end, why, err := n.detachedTail(last)
	if err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, err)
	}
	// Raft hands over the entries after its newest snapshot (handed, set
	// by catchUpFromSnapshot) and the FSM skips those up to its applied
	// index: the first entry either would apply.
	from := max(rep.AppliedIndex, n.fsm.handed.Load()) + 1
	if rep.LogLastIndex >= max(from, end+1) {
		// Counted in the log as found: dropDetachedLog's deletion too.
		rep.LogEntriesDetached = rep.LogLastIndex - max(from, end+1) + 1
		logger.Warn("left out the Raft log's entries that do not continue the newest snapshot, as a node's start never applies them",
			"from", max(from, end+1), "to", rep.LogLastIndex, "why", why)
	}
	if end >= from {
		if opts.AppliedOnly {
			rep.LogEntriesLeft = end - from + 1
		} else {
			if first > from {
				return rep, fmt.Errorf("save %s: %w: the Raft log starts at index %d, after the state's next entry %d", dataDir, store.ErrCorrupt, first, from)
			}
			if err := applyLogTail(ctx, n, from, end); err != nil {
				return rep, fmt.Errorf("save %s: %w", dataDir, err)
			}
			if fatal != nil {
				return rep, fmt.Errorf("save %s: %w", dataDir, fatal)
			}
			rep.LogEntries = end - from + 1
		}
	}
	// As the online save reads the state (SaveSnapshot).
	view, _, err := n.fsm.view()
	if err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, err)
	}
	defer view.Close()
	if rep.Snapshot, err = writeSnapshot(ctxWriter{ctx: ctx, w: w}, view); err != nil {
		return rep, fmt.Errorf("save %s: %w", dataDir, err)
	}
	return rep, nil
}

// refuseUnplacedState refuses (ErrUnplacedState) a state applied at A,
// past the newest Raft snapshot at S and of a term at least its, when the
// Raft log holds no entry at A (raft/ lost or emptied, or ending below
// A). catchUpFromSnapshot keeps such a state only where the log holds its
// entry, with its term (stateOfSnapshotsHistory), and restores the
// snapshot over it otherwise (with a warning naming what it drops: a
// start cannot refuse, its leader catches it up), a start's choice that
// is right for a deposed leader's user restore at A: applied without a
// commit, in no log, and replaced by the new leader's snapshot at S. But
// an entry the FSM applied from the log was committed, and a state past
// S whose log was lost is then the newer committed state: restored over,
// the save would drop committed writes without a word. The directory
// cannot tell the two apart, so the save says so, with both indexes,
// rather than pick one. A log that holds an entry at A decides (kept or
// restored, as a start does), as does a term below the snapshot's.
func (n *Node) refuseUnplacedState() error {
	list, err := n.snaps.List()
	if err != nil || len(list) == 0 {
		return err
	}
	newest := list[0]
	applied, appliedTerm := n.fsm.Applied()
	if applied <= newest.Index || appliedTerm < newest.Term {
		return nil
	}
	var at raft.Log
	err = n.logs.GetLog(applied, &at)
	if err == nil {
		return nil
	} else if !errors.Is(err, raft.ErrLogNotFound) {
		return fmt.Errorf("read the Raft log's entry %d: %w", applied, err)
	}
	last, err := n.logs.LastIndex()
	if err != nil {
		return fmt.Errorf("read the Raft log's last index: %w", err)
	}
	return fmt.Errorf("%w: %s holds a state applied at index %d (term %d), past the newest Raft snapshot (index %d, term %d), and the Raft log "+
		"(last index %d) holds no entry at %d to tell whether the cluster committed it: it is the newer committed state if raft/ was lost, "+
		"and an uncommitted restore's if the node was a deposed leader (a node's start restores the snapshot over it); "+
		"save another survivor's directory, put back the raft/ %s came with, or, to save the snapshot's state at index %d as a start takes it, "+
		"save a copy of %s without its fsm/",
		ErrUnplacedState, n.fsm.dir, applied, appliedTerm, newest.Index, newest.Term, last, applied, n.fsm.dir, newest.Index, n.cfg.DataDir)
}

// detachedTail returns the last index up to which the Raft log (ending
// at last) continues the newest Raft snapshot, and, where that is below
// last, why the entries after it do not. A log continues the snapshot at
// S, term T, when its entry at S, if it holds one, is the snapshot's own
// (logAtSnapshot, as catchUpFromSnapshot checks it), and its terms never
// fall from T on: a log's terms never fall, and an entry after S of a
// term below T, or after a lower term than an entry before it, is of
// another history. Raft persists an installed snapshot before it clears
// the log (removeOldLogs), and a leader overwrites a follower's entries
// that conflict with its own before any are applied; a node killed in
// between keeps its older tail (a deposed leader's uncommitted entries)
// after the snapshot, which a start never applies. Without a snapshot,
// only the terms are checked.
func (n *Node) detachedTail(last uint64) (uint64, string, error) {
	if last == 0 {
		return 0, "", nil
	}
	list, err := n.snaps.List()
	if err != nil {
		return 0, "", fmt.Errorf("list Raft snapshots: %w", err)
	}
	first, err := n.logs.FirstIndex()
	if err != nil {
		return 0, "", fmt.Errorf("read the Raft log's first index: %w", err)
	}
	var prev uint64
	if len(list) > 0 {
		newest := list[0]
		if held, own := n.logAtSnapshot(newest); held && !own {
			return newest.Index, fmt.Sprintf("the log's entry at the newest snapshot's index %d is not of its term %d", newest.Index, newest.Term), nil
		}
		first, prev = max(first, newest.Index+1), newest.Term
	}
	for idx := first; idx <= last; idx++ {
		var l raft.Log
		if err := n.logs.GetLog(idx, &l); err != nil {
			return 0, "", fmt.Errorf("read the Raft log's entry %d: %w", idx, err)
		}
		if l.Term < prev {
			return idx - 1, fmt.Sprintf("the log's entry %d is of term %d, below the term %d before it", idx, l.Term, prev), nil
		}
		prev = l.Term
	}
	return last, "", nil
}

// saveWorkPrefix begins the name of a save's working directory.
const saveWorkPrefix = ".kvrouter-save-"

// saveWorkRemoveStep, when set (tests), runs in removeSaveWork after
// each entry but LOCK is removed: where a kill leaves the directory to
// the next save's removeDeadSaves.
var saveWorkRemoveStep func(work string)

// removeSaveWork removes a save's working directory work at the save's
// end, on success or failure, while it holds the directory's lock: every
// entry but LOCK, then LOCK, then the lock is released. A save killed
// meanwhile (kill -9, OOM) leaves LOCK beside what it had not removed
// yet, and the next save beside it removes the rest (removeDeadSaves).
// Releasing the lock first and removing the directory whole, in readdir
// order, could take LOCK first: a kill then left fsm/ and raft/ (the
// copy, as large as the data directory) without LOCK, which
// removeDeadSaves keeps for ever, as it keeps a directory a save has just
// made and not yet locked. An entry that cannot be removed keeps LOCK
// too, for the next save to try again.
func removeSaveWork(work string, lock *os.File, logger *slog.Logger) {
	defer lock.Close()
	names, err := readDirNames(work)
	for _, name := range names {
		if name == lockFile {
			continue
		}
		if rerr := os.RemoveAll(filepath.Join(work, name)); rerr != nil && err == nil {
			err = rerr
		}
		if saveWorkRemoveStep != nil {
			saveWorkRemoveStep(work)
		}
	}
	if err == nil {
		err = os.Remove(filepath.Join(work, lockFile))
	}
	if err == nil {
		err = os.Remove(work)
	}
	if err != nil {
		logger.Warn("could not remove the save's working directory: the next save beside it removes it", "dir", work, "err", err)
	}
}

// readDirNames returns the names of the entries of dir.
func readDirNames(dir string) ([]string, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.Readdirnames(-1)
}

// saveWorkLockStep, when set (tests), runs in lockSaveWork at each step
// between the working directory's making and its lock's taking effect:
// where a concurrent save's removeDeadSaves must still keep it.
var saveWorkLockStep func(work string)

// lockSaveWork takes the lock of a save's working directory work, just
// made, as lockDataDir would, but creates and locks the file under
// another name (LOCK.new) and only then renames it to LOCK: a concurrent
// save's removeDeadSaves, which removes a directory whose LOCK it can
// take, finds none (and keeps the directory) until the LOCK it would open
// is held. A LOCK created in place and locked after (lockDataDir) left a
// moment where that save took the lock and removed a live save's
// directory, which then failed its copy.
func lockSaveWork(work string) (*os.File, error) {
	tmp := filepath.Join(work, lockFile+".new")
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	if saveWorkLockStep != nil {
		saveWorkLockStep(work)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", tmp, err)
	}
	if saveWorkLockStep != nil {
		saveWorkLockStep(work)
	}
	// The lock follows the file, not its name.
	if err := os.Rename(tmp, filepath.Join(work, lockFile)); err != nil {
		f.Close()
		return nil, err
	}
	if saveWorkLockStep != nil {
		saveWorkLockStep(work)
	}
	return f, nil
}

// removeDeadSaves removes the working directories that killed saves left
// in tempDir: a save holds its directory's lock (LOCK) for its life, and
// removes the directory at its end, so one whose lock can be taken is a
// dead save's, as large as the fsm/ and raft/ it copied, and nothing else
// would ever remove it. One without a lock file (a save between making
// it and locking it, or killed then, with nothing copied yet) is left: a
// save's LOCK appears only once held (lockSaveWork).
// Failures are logged: they do not stop this save.
func removeDeadSaves(tempDir string, logger *slog.Logger) {
	dirs, err := filepath.Glob(filepath.Join(tempDir, saveWorkPrefix+"*"))
	if err != nil {
		return
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, lockFile)); err != nil {
			continue
		}
		lock, err := lockDataDir(d)
		if err != nil {
			continue // a live save's, or unreadable: left
		}
		if err := os.RemoveAll(d); err != nil {
			logger.Warn("could not remove a killed save's working directory", "dir", d, "err", err)
		} else {
			logger.Info("removed a killed save's working directory", "dir", d)
		}
		lock.Close()
	}
}

// OutsideDataDir refuses (ErrInvalid) a directory p that is dataDir or
// inside it, symbolic links resolved (a p not there yet by its nearest
// existing parent): the offline save's working copy, and kvctl's FILE
// and its FILE.RANDOM.part, go in p, and inside dataDir they would
// change the directory the save must leave as it was, and the copy of
// raft/ or fsm/ would copy itself without end.
func OutsideDataDir(dataDir, p string) error {
	// Each failure names its path: EvalSymlinks's errors can be a bare
	// errno ("not a directory" for a parent that is a regular file).
	d, err := resolvePath(dataDir)
	if err != nil {
		return fmt.Errorf("resolve %s: %w", dataDir, err)
	}
	q, err := resolvePath(p)
	if err != nil {
		return fmt.Errorf("resolve %s: %w", p, err)
	}
	rel, err := filepath.Rel(d, q)
	if err != nil {
		return fmt.Errorf("%w: %s against %s: %v", ErrInvalid, p, dataDir, err)
	}
	if rel == "." || (rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator))) {
		return fmt.Errorf("%w: %s is inside the data directory %s: the save writes there, and must leave %s as it was; give a place outside it", ErrInvalid, p, dataDir, dataDir)
	}
	return nil
}

// resolvePath returns p absolute, its symbolic links resolved; the part
// of p not there yet is joined to its nearest existing parent, resolved.
func resolvePath(p string) (string, error) {
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	var rest []string
	for {
		r, err := filepath.EvalSymlinks(abs)
		if err == nil {
			return filepath.Join(append([]string{r}, rest...)...), nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", err
		}
		parent := filepath.Dir(abs)
		if parent == abs {
			return "", err
		}
		rest = append([]string{filepath.Base(abs)}, rest...)
		abs = parent
	}
}

// applyLogTail applies the log's entries from..to to the node's FSM as
// Raft hands them over: commands and configurations, in batches of at
// most raftMaxAppendEntries.
func applyLogTail(ctx context.Context, n *Node, from, to uint64) error {
	batch := make([]*raft.Log, 0, raftMaxAppendEntries)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		for _, res := range n.fsm.ApplyBatch(batch) {
			var h *ApplyHalt
			if err, ok := res.(error); ok && errors.As(err, &h) {
				return fmt.Errorf("the Raft log's entry %d: %w: save it with a build that reads it, or give --applied-only", h.Index, h)
			}
		}
		batch = batch[:0]
		return nil
	}
	for idx := from; idx <= to; idx++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		l := new(raft.Log)
		if err := n.logs.GetLog(idx, l); err != nil {
			return fmt.Errorf("read the Raft log's entry %d: %w", idx, err)
		}
		if l.Type != raft.LogCommand && l.Type != raft.LogConfiguration {
			continue // Raft does not hand them to the FSM
		}
		batch = append(batch, l)
		if len(batch) == cap(batch) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// copyNodeState copies what a node's start reads from dataDir into work:
// fsm/ and fsm.old/ (whichever are there) and raft/ whole, and the Raft
// snapshots that are whole (not NAME.tmp/), linked where the filesystem
// allows, copied otherwise: nothing writes to a whole snapshot.
func copyNodeState(ctx context.Context, dataDir, work string) error {
	for _, sub := range []string{"fsm", "fsm.old", "raft"} {
		if err := copyTree(ctx, filepath.Join(dataDir, sub), filepath.Join(work, sub), false); err != nil {
			return err
		}
	}
	snapDir := filepath.Join(dataDir, "snapshots")
	ents, err := os.ReadDir(snapDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(work, "snapshots"), dataDirMode); err != nil {
		return err
	}
	for _, e := range ents {
		if !e.IsDir() || isPartialSnapshot(e) {
			continue
		}
		if err := copyTree(ctx, filepath.Join(snapDir, e.Name()), filepath.Join(work, "snapshots", e.Name()), true); err != nil {
			return err
		}
	}
	return nil
}

// copyTree copies the directory src to dst, a regular file at a time
// (linked when link and the filesystem allows); a src that is not there
// is no error. Anything but directories and regular files is refused.
func copyTree(ctx context.Context, src, dst string, link bool) error {
	if _, err := os.Stat(src); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		to := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(to, dataDirMode)
		case !d.Type().IsRegular():
			return fmt.Errorf("%s is not a regular file", p)
		}
		if link && os.Link(p, to) == nil {
			return nil
		}
		return copyFile(p, to)
	})
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// copyPaths returns err, as errors.Is and errors.As see it, with the
// working copy's directory work named as the data directory it was
// copied from.
func copyPaths(err error, work, dataDir string) error {
	return &renamedError{msg: strings.ReplaceAll(err.Error(), work, dataDir), err: err}
}

type renamedError struct {
	msg string
	err error
}

func (e *renamedError) Error() string { return e.msg }
func (e *renamedError) Unwrap() error { return e.err }

// ctxWriter fails its writes with ctx's error once ctx ends.
type ctxWriter struct {
	ctx context.Context
	w   io.Writer
}

func (c ctxWriter) Write(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.w.Write(p)
}
