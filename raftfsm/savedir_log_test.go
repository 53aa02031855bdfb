package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/store"
)

// lastLog reads dir's Raft log's last entry (a copy of raft/, so the
// directory itself is never opened by Pebble).
func lastLog(t *testing.T, dir string) raft.Log {
	t.Helper()
	cp := filepath.Join(t.TempDir(), "raft")
	if err := copyTree(context.Background(), filepath.Join(dir, "raft"), cp, false); err != nil {
		t.Fatal(err)
	}
	ls, err := store.OpenLogStore(cp, store.LogStoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ls.Close()
	last, err := ls.LastIndex()
	if err != nil {
		t.Fatal(err)
	}
	var l raft.Log
	if err := ls.GetLog(last, &l); err != nil {
		t.Fatal(err)
	}
	return l
}

// appendLogs appends entries to dir's Raft log in place.
func appendLogs(t *testing.T, dir string, logs []*raft.Log) {
	t.Helper()
	ls, err := store.OpenLogStore(filepath.Join(dir, "raft"), store.LogStoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ls.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
	if err := ls.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestSaveDataDirReportRanksSurvivorsAsRaftWould: docs/operations.md,
// Majority lost, step 3, keeps the file of the survivor whose log Raft's
// election rule ranks first: the higher last term, then the higher last
// index, as the report (and kvctl) gives them. Survivor A led term T and
// appended 3 entries it never replicated (deposed); survivor B voted in
// term T+1 and holds the new leader's no-op at the next index (committed
// with the lost members). Raft elects B; the file's index and term (the
// last applied command's) and the log's last index alone rank A first,
// whose file holds 3 entries the cluster's committed history replaced.
func TestSaveDataDirReportRanksSurvivorsAsRaftWould(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	for id := uint64(1); id <= 3; id++ {
		if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	c.stop(0)
	base := lastLog(t, c.dirs[0])
	if base.Type != raft.LogCommand {
		t.Fatalf("last entry %+v: want a command", base)
	}
	a, b := filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")
	for _, d := range []string{a, b} {
		if err := copyTree(context.Background(), c.dirs[0], d, false); err != nil {
			t.Fatal(err)
		}
	}
	// A: the deposed leader of term T, 3 unreplicated entries.
	var tail []*raft.Log
	for i := uint64(1); i <= 3; i++ {
		tail = append(tail, &raft.Log{Index: base.Index + i, Term: base.Term, Type: raft.LogCommand, Data: base.Data})
	}
	appendLogs(t, a, tail)
	// B: the next leader's no-op, term T+1, at the same index.
	appendLogs(t, b, []*raft.Log{{Index: base.Index + 1, Term: base.Term + 1, Type: raft.LogNoop}})

	_, ra := saveDir(t, a, SaveOptions{})
	_, rb := saveDir(t, b, SaveOptions{})
	if ra.LogLastIndex != base.Index+3 || ra.LogLastTerm != base.Term || rb.LogLastIndex != base.Index+1 || rb.LogLastTerm != base.Term+1 {
		t.Fatalf("A's report says the log ends at index %d, term %d (want %d, %d); B's at %d, %d (want %d, %d)",
			ra.LogLastIndex, ra.LogLastTerm, base.Index+3, base.Term, rb.LogLastIndex, rb.LogLastTerm, base.Index+1, base.Term+1)
	}
	if rb.LogLastTerm < ra.LogLastTerm || (rb.LogLastTerm == ra.LogLastTerm && rb.LogLastIndex <= ra.LogLastIndex) {
		t.Fatalf("the reports rank A (log last index %d, term %d) over B (%d, %d); Raft elects B", ra.LogLastIndex, ra.LogLastTerm, rb.LogLastIndex, rb.LogLastTerm)
	}
}

// TestSaveDataDirStopsAtALogOfAnotherHistory: hashicorp/raft's
// InstallSnapshot compacts the log only up to the snapshot's index: a
// deposed leader's uncommitted tail after it stays until the new leader's
// AppendEntries truncates it. A survivor killed between the two holds the
// new leader's snapshot (index S, term T) and, after it, entries of a
// lower term: another history (a log's terms never fall). A start never
// applies them (the leader overwrites them first); the save leaves them
// out, and says how many.
func TestSaveDataDirStopsAtALogOfAnotherHistory(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	for id := uint64(1); id <= 3; id++ {
		if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.leader().raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	snap := lastLog(t, c.dirs[0]) // the snapshot was taken at the log's end
	if snap.Term < 2 {
		t.Fatalf("snapshot's entry %+v: want a term above 1", snap)
	}
	appendLogs(t, c.dirs[0], []*raft.Log{{Index: snap.Index + 1, Term: snap.Term - 1, Type: raft.LogCommand,
		Data: encodeRegister(time.Now().UnixNano(), &WorkerInfo{ID: 99, DPRanks: []uint32{0}, BlockSize: 16})}})
	_, rep := saveDir(t, c.dirs[0], SaveOptions{})
	if rep.LogEntries > 0 || rep.LogEntriesDetached != 1 || rep.Snapshot.Term < snap.Term {
		t.Fatalf("the save of a log with an entry of term %d after the newest snapshot (index %d, term %d): report %+v; want it left out and counted (LogEntriesDetached 1)",
			snap.Term-1, snap.Index, snap.Term, rep)
	}
}

// TestSaveDataDirKeepsTheStateOfAnEmptyLog: a stopped node whose fsm/
// holds a state applied at index N (worker 4 registered), past its newest
// Raft snapshot (N-1), and whose raft/ is gone. A start restores the
// snapshot over the state (catchUpFromSnapshot: the log holds no entry at
// N); the save did too, and saved index N-1 without worker 4, saying
// nothing. Nothing tells a committed write from a deposed leader's
// uncommitted restore there: the save refuses, naming both indexes, and
// leaves no state dropped silently.
func TestSaveDataDirKeepsTheStateOfAnEmptyLog(t *testing.T) {
	c, p := pastSnapshotWithoutLog(t)
	snapIndex, applied := p.snapIndex, p.applied
	var buf bytes.Buffer
	rep, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: t.TempDir()})
	switch {
	case err == nil && rep.Snapshot.Index < applied:
		t.Fatalf("fsm/ holds the state applied at index %d; the save succeeded with the state at index %d (report %+v), and says nothing of what it dropped", applied, rep.Snapshot.Index, rep)
	case err != nil && (!errors.Is(err, ErrUnplacedState) || !strings.Contains(err.Error(), fmt.Sprintf("applied at index %d", applied)) ||
		!strings.Contains(err.Error(), fmt.Sprintf("snapshot (index %d", snapIndex)) || strings.Contains(err.Error(), ".kvrouter-save-")):
		t.Fatalf("save: %v; want ErrUnplacedState naming the state's index %d and the snapshot's %d, and the data directory's paths", err, applied, snapIndex)
	}
}

// TestSaveDataDirIntoItsOwnSubdirectory: kvctl puts the working copy
// beside FILE (TempDir: FILE's directory). A TempDir inside DIR (its
// root, raft/, or a link to raft/) put the copy inside what is being
// copied: the copy recursed into itself, and DIR changed. It is refused
// (ErrInvalid), DIR left as it was.
func TestSaveDataDirIntoItsOwnSubdirectory(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(filepath.Join(c.dirs[0], "raft"), link); err != nil {
		t.Fatal(err)
	}
	before := treePrint(t, c.dirs[0])
	for _, tmp := range []string{filepath.Join(c.dirs[0], "raft"), c.dirs[0], link} {
		var buf bytes.Buffer
		_, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: tmp})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "inside the data directory") || strings.Contains(err.Error(), ".kvrouter-save-") {
			t.Errorf("save with its working copy in %s: %.400v; want ErrInvalid, a refusal of a place inside DIR", tmp, err)
		}
	}
	if after := treePrint(t, c.dirs[0]); after != before {
		t.Errorf("directory changed:\n%s\nwas:\n%s", after, before)
	}
	if err := OutsideDataDir(c.dirs[0], filepath.Join(c.dirs[0]+"-other", "x")); err != nil {
		t.Errorf("a sibling whose name begins with DIR's: %v", err)
	}
}

// TestSaveDataDirRemovesAKilledSavesWorkingDirectory: a save killed
// outright leaves its working directory (as large as fsm/ and raft/) in
// TempDir, where nothing else removes it. A save holds its directory's
// lock for its life: the next save in TempDir removes a directory whose
// lock it can take (its save is dead), and keeps one a live save holds,
// and one not locked yet.
func TestSaveDataDirRemovesAKilledSavesWorkingDirectory(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	tmp := t.TempDir()
	dead, live, fresh := filepath.Join(tmp, ".kvrouter-save-1"), filepath.Join(tmp, ".kvrouter-save-2"), filepath.Join(tmp, ".kvrouter-save-3")
	for _, d := range []string{dead, live, fresh} {
		if err := os.MkdirAll(filepath.Join(d, "raft"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "raft", "000002.log"), []byte("copied"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{dead, live} {
		if err := os.WriteFile(filepath.Join(d, lockFile), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	lock, err := lockDataDir(live) // a save still running
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	var buf bytes.Buffer
	if _, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: tmp}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dead); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the killed save's %s: %v; want it removed", dead, err)
	}
	for _, d := range []string{live, fresh} {
		if _, err := os.Stat(filepath.Join(d, "raft", "000002.log")); err != nil {
			t.Errorf("%s: %v; want it kept", d, err)
		}
	}
	if left, _ := os.ReadDir(tmp); len(left) != 2 {
		t.Errorf("TempDir holds %v; want the live and the unlocked directories alone", left)
	}
}

// TestSaveDataDirKeepsALiveSavesFreshWorkingDirectory: a save makes its
// working directory, then locks it; a second save in the same TempDir
// that runs removeDeadSaves in between must not take the first one's
// fresh directory for a dead save's (a LOCK it can take) and remove it
// under the save, which then fails, or worse, copies into nothing. The
// hook runs the second save's cleanup at each step of the lock's taking.
func TestSaveDataDirKeepsALiveSavesFreshWorkingDirectory(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	tmp := t.TempDir()
	var steps int
	saveWorkLockStep = func(work string) {
		steps++
		removeDeadSaves(tmp, slog.New(slog.DiscardHandler))
		if _, err := os.Stat(work); err != nil {
			t.Errorf("step %d of the lock's taking: a concurrent save's cleanup removed the live save's %s: %v", steps, work, err)
		}
	}
	defer func() { saveWorkLockStep = nil }()
	var buf bytes.Buffer
	if _, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: tmp}); err != nil {
		t.Fatalf("the save whose working directory a concurrent cleanup saw being locked: %v", err)
	}
	if steps == 0 {
		t.Fatal("the hook never ran")
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("TempDir holds %v after the save; want nothing", left)
	}
}

// TestSaveDataDirOfARestoresLeftovers: what an interrupted restore or
// snapshot leaves is read as a start reads it. A directory holding only
// fsm.old/ (a restore's swap killed after fsm/ was moved aside) and no
// Raft snapshot saves fsm.old/'s state (a start rolls it back:
// cleanupRestore), seen with AppliedOnly, where the log would otherwise
// rebuild the state; a partial snapshot NAME.tmp/ (a killed writer's,
// holding what a whole snapshot never does) is skipped, the file the
// same as without it.
func TestSaveDataDirOfARestoresLeftovers(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	for id := uint64(1); id <= 3; id++ {
		if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	applied, _ := c.leader().fsm.Applied()
	c.stop(0)
	dir := c.dirs[0]
	if ents, _ := os.ReadDir(filepath.Join(dir, "snapshots")); len(ents) != 0 {
		t.Fatalf("snapshots/ holds %v; want none", ents)
	}
	if err := os.Rename(filepath.Join(dir, "fsm"), filepath.Join(dir, "fsm.old")); err != nil {
		t.Fatal(err)
	}
	_, rep := saveDir(t, dir, SaveOptions{AppliedOnly: true})
	if rep.AppliedIndex != applied || rep.Snapshot.Records["workers"] != 3 {
		t.Fatalf("the save of a directory holding only fsm.old/: %+v; want fsm.old/'s state, applied at %d, with 3 workers", rep, applied)
	}

	partial := filepath.Join(dir, "snapshots", "99-999-1.tmp")
	if err := os.MkdirAll(partial, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(partial, "meta.json"), []byte(`{"Index":`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("nowhere", filepath.Join(partial, "state.bin")); err != nil {
		t.Fatal(err)
	}
	_, with := saveDir(t, dir, SaveOptions{})
	if err := os.RemoveAll(partial); err != nil {
		t.Fatal(err)
	}
	if _, without := saveDir(t, dir, SaveOptions{}); with.Snapshot.SHA256 != without.Snapshot.SHA256 || with.AppliedIndex != without.AppliedIndex {
		t.Fatalf("the save with a partial snapshot: %+v; without it: %+v", with, without)
	}
}

// pastSnapshot is where pastSnapshotWithoutLog left its node: the newest
// Raft snapshot's index and term, and the state's applied entry past it.
type pastSnapshot struct {
	snapIndex, snapTerm, applied, appliedTerm uint64
}

// pastSnapshotWithoutLog returns a one-node cluster whose node is stopped
// with fsm/ applied one registration (worker 4) past its newest Raft
// snapshot (workers 1 to 3) and raft/ removed: the log holds no entry at
// the applied index, the case a start restores the snapshot over
// (catchUpFromSnapshot) and an offline save refuses (ErrUnplacedState).
func pastSnapshotWithoutLog(t *testing.T) (*testCluster, pastSnapshot) {
	t.Helper()
	c := newTestCluster(t, 1, nil)
	for id := uint64(1); id <= 3; id++ {
		if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.leader().raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	var p pastSnapshot
	p.snapIndex, p.snapTerm = c.leader().fsm.Applied()
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 4, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	p.applied, p.appliedTerm = c.leader().fsm.Applied()
	c.stop(0)
	if err := os.RemoveAll(filepath.Join(c.dirs[0], "raft")); err != nil {
		t.Fatal(err)
	}
	return c, p
}
