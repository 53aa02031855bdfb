package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// TestAWrittenSnapshotIsKeptOverOnesOfALaterTerm: a node holding two
// snapshots of a later term (its own and a user restore, as a deposed
// leader) installs a leader's snapshot of an older entry's term. Raft's
// FileSnapshotStore reaped by term in the sink's Close, before Raft opens
// the snapshot to restore it: it deleted the one just received, and the
// install failed at every try. The node's store keeps the new one and
// drops those listed above it (another history's), and past that keeps
// the newest snapshotsKept.
func TestAWrittenSnapshotIsKeptOverOnesOfALaterTerm(t *testing.T) {
	stream := []byte("a snapshot")
	snaps, err := openSnapshotStore(t.TempDir(), quiet)
	if err != nil {
		t.Fatal(err)
	}
	saveRaftSnapshot(t, snaps, stream, 50, 5)       // its own
	saveRaftSnapshot(t, snaps, stream, 100, 5)      // its user restore
	id := saveRaftSnapshot(t, snaps, stream, 90, 4) // the leader's
	if _, rc, err := snaps.Open(id); err != nil {
		t.Fatalf("Raft cannot open the snapshot it has just received: %v", err)
	} else {
		rc.Close()
	}
	listed := func() string {
		list, err := snaps.List()
		if err != nil {
			t.Fatal(err)
		}
		s := ""
		for _, m := range list {
			s += fmt.Sprintf("(%d, %d) ", m.Index, m.Term)
		}
		return s
	}
	if got, want := listed(), "(90, 4) "; got != want {
		t.Errorf("after the install the store lists %s; want %s", got, want)
	}
	saveRaftSnapshot(t, snaps, stream, 95, 6)
	saveRaftSnapshot(t, snaps, stream, 120, 6)
	if got, want := listed(), "(120, 6) (95, 6) "; got != want {
		t.Errorf("after two snapshots of the node's own the store lists %s; want %s", got, want)
	}
}

// TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne: Raft's
// takeSnapshot (its snapshot goroutine) creates its sink at (X, T) and
// persists the state while the main goroutine installs a leader's snapshot
// at (S > X, T) (installSnapshot) or a user restore at R = last+1
// (restoreUserSnapshot): that sink closes first, Raft restores it. When the
// older sink closed, its reap dropped every snapshot listed above it: the
// one just installed, which the state and the log (cleared, continuing at
// S+1) continue. The older sink, the FSM's own, taken before the install,
// is now cancelled: its Close fails (ErrRestorePending), Raft tries again.
func TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne(t *testing.T) {
	snaps, err := openSnapshotStore(t.TempDir(), quiet)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	// takeSnapshot: the FSM's snapshot at X = 100, persisting.
	gen, err := snaps.snapshotTaken()
	if err != nil {
		t.Fatal(err)
	}
	own, err := snaps.Create(raft.SnapshotVersionMax, 100, 3, raft.Configuration{}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	ownSink(own, gen)
	if _, err := own.Write([]byte("own state at 100")); err != nil {
		t.Fatal(err)
	}
	// installSnapshot meanwhile: the leader's at S = 500, same term.
	installed := saveRaftSnapshot(t, snaps, []byte("leader's state at 500"), 500, 3)
	// The persist ends.
	if err := own.Close(); !errors.Is(err, ErrRestorePending) {
		t.Fatalf("the close of the FSM's snapshot taken before the install returned %v; want it cancelled (%v)", err, ErrRestorePending)
	}
	list, err := snaps.List()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range list {
		ids = append(ids, m.ID)
	}
	if len(list) == 0 || list[0].ID != installed {
		t.Fatalf("after the older snapshot's close the store lists %v; the snapshot just installed (%s, index 500) is gone: "+
			"a restart starts from index 100 under a log that begins at 501, and a leader sends the state at 100", ids, installed)
	}
}

// TestAnInstallDropsAnOwnSnapshotOfTheOldHistoryClosedDuringIt: a deposed
// leader holds its user restore at (600, T5), in no log. Raft's snapshot
// goroutine persists its own snapshot of that state at (700, T5) while the
// main goroutine installs the new leader's snapshot at (500, T4): the
// own one closes while the leader's stream is still being received. The
// leader's sink closes last and the FSM restores it. Before f0f9c7e the
// install's reap dropped every snapshot listed above it; now it keeps
// (700, T5), not there when the install's sink was created, and the
// store's newest (what Raft's start and a leader's send take) is the old
// history's state, not the one the FSM holds and the log continues. The
// install's reap drops every snapshot listed above it again; an own
// snapshot closed after the install is cancelled
// (TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne).
func TestAnInstallDropsAnOwnSnapshotOfTheOldHistoryClosedDuringIt(t *testing.T) {
	for _, ownFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("own sink created before the install's: %v", ownFirst), func(t *testing.T) {
			snaps, err := openSnapshotStore(t.TempDir(), quiet)
			if err != nil {
				t.Fatal(err)
			}
			_, trans := raft.NewInmemTransport("")
			defer trans.Close()
			saveRaftSnapshot(t, snaps, []byte("user restore at 600"), 600, 5)
			snaps.restored() // the FSM restored it
			var own, inst raft.SnapshotSink
			create := func(index, term uint64) raft.SnapshotSink {
				s, err := snaps.Create(raft.SnapshotVersionMax, index, term, raft.Configuration{}, 1, trans)
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			// The FSM's snapshot, taken before the install's close.
			gen, err := snaps.snapshotTaken()
			if err != nil {
				t.Fatal(err)
			}
			if ownFirst {
				own = create(700, 5)
				inst = create(500, 4)
			} else {
				inst = create(500, 4)
				own = create(700, 5)
			}
			ownSink(own, gen)
			if _, err := own.Write([]byte("old history at 700")); err != nil {
				t.Fatal(err)
			}
			if err := own.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := inst.Write([]byte("leader's state at 500")); err != nil {
				t.Fatal(err)
			}
			if err := inst.Close(); err != nil {
				t.Fatal(err)
			}
			list, err := snaps.List()
			if err != nil {
				t.Fatal(err)
			}
			got := ""
			for _, m := range list {
				got += fmt.Sprintf("(%d, %d) ", m.Index, m.Term)
			}
			if len(list) == 0 || list[0].ID != inst.ID() {
				t.Fatalf("after the install the store lists %s: the newest is not the installed (500, 4), "+
					"a restart or a leader's send takes another history's state", got)
			}
		})
	}
}

// heldPersistFSM is a toy raft.FSM whose snapshot's Persist waits for
// release. It marks its snapshots in the store as FSM does.
type heldPersistFSM struct {
	snaps   *snapshotStore
	entered chan struct{}
	release chan struct{}
}

func (f *heldPersistFSM) Apply(*raft.Log) interface{} { return nil }
func (f *heldPersistFSM) Snapshot() (raft.FSMSnapshot, error) {
	gen, err := f.snaps.snapshotTaken()
	if err != nil {
		return nil, err
	}
	return heldPersistSnapshot{f, gen}, nil
}
func (f *heldPersistFSM) Restore(rc io.ReadCloser) error {
	defer f.snaps.restored()
	_, err := io.Copy(io.Discard, rc)
	rc.Close()
	return err
}

type heldPersistSnapshot struct {
	f   *heldPersistFSM
	gen uint64
}

func (s heldPersistSnapshot) Persist(sink raft.SnapshotSink) error {
	ownSink(sink, s.gen)
	close(s.f.entered)
	<-s.f.release
	if _, err := sink.Write([]byte("state before the restore")); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}
func (heldPersistSnapshot) Release() {}

// TestAUserRestoreDuringASnapshotsPersistIsKept: with hashicorp/raft
// v1.8.0 itself and the node's snapshot store. Raft's snapshot goroutine
// persists a snapshot at X while the main goroutine runs a user restore
// (raft.Restore), numbered X+1 or later: the restore's snapshot closes,
// the FSM restores it. Then the older sink closed, and its reap removed
// the restore's snapshot, the one listed above it: the store's newest
// (what Raft's start and a leader's send take) was the state before the
// restore. The older snapshot, taken before the restore, is now cancelled
// (Raft's snapshot fails with ErrRestorePending).
func TestAUserRestoreDuringASnapshotsPersistIsKept(t *testing.T) {
	dir := t.TempDir()
	snaps, err := openSnapshotStore(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	addr, trans := raft.NewInmemTransport("")
	defer trans.Close()
	conf := raft.DefaultConfig()
	conf.LocalID = "a"
	conf.HeartbeatTimeout, conf.ElectionTimeout = 50*time.Millisecond, 50*time.Millisecond
	conf.LeaderLeaseTimeout = 50 * time.Millisecond
	conf.SnapshotThreshold, conf.SnapshotInterval = 1<<40, time.Hour
	conf.Logger = hclogAdapter(quiet)
	st := raft.NewInmemStore()
	fsm := &heldPersistFSM{snaps: snaps, entered: make(chan struct{}), release: make(chan struct{})}
	if err := raft.BootstrapCluster(conf, st, st, snaps, trans, raft.Configuration{Servers: []raft.Server{{ID: "a", Address: addr}}}); err != nil {
		t.Fatal(err)
	}
	r, err := raft.NewRaft(conf, fsm, st, st, snaps, trans)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Shutdown()
	waitFor(t, 5*time.Second, "leader", func() bool { return r.State() == raft.Leader })
	for range 5 {
		if err := r.Apply([]byte("x"), time.Second).Error(); err != nil {
			t.Fatal(err)
		}
	}
	snapDone := make(chan error, 1)
	go func() { snapDone <- r.Snapshot().Error() }()
	<-fsm.entered
	restore := []byte("the restored state")
	meta := &raft.SnapshotMeta{Version: raft.SnapshotVersionMax, Size: int64(len(restore))}
	// Raft numbers the restore's snapshot after its last index (and
	// appends a no-op after it).
	restored := r.LastIndex() + 1
	if err := r.Restore(meta, bytes.NewReader(restore), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	close(fsm.release)
	// Raft wraps the persist's error as text.
	if err := <-snapDone; err == nil || !strings.Contains(err.Error(), ErrRestorePending.Error()) {
		t.Fatalf("the snapshot persisted across the user restore returned %v; want it cancelled (%v)", err, ErrRestorePending)
	}
	list, err := snaps.List()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range list {
		got = append(got, fmt.Sprintf("(%d, %d)", m.Index, m.Term))
	}
	kept := len(list) > 0 && list[0].Index == restored
	if kept {
		_, rc, err := snaps.Open(list[0].ID)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		kept = bytes.Equal(b, restore)
	}
	if !kept {
		t.Fatalf("after the user restore at index %d and the snapshot persisted across it, the store lists %v: "+
			"the restore's snapshot was reaped; a restart or a follower's install takes the state before the restore", restored, got)
	}
}

// TestAnFSMSnapshotIsRefusedBetweenAnInstallsCloseAndItsRestore: Raft's
// main goroutine closes a leader's snapshot in the node's store, then
// hands it to the FSM goroutine to restore; a Raft snapshot taken on that
// goroutine meanwhile held the state before the install, and its reap
// dropped the install listed above it. FSM.Snapshot refuses until the
// restore, and an FSM snapshot taken before the install's close is
// cancelled when it is persisted after it.
func TestAnFSMSnapshotIsRefusedBetweenAnInstallsCloseAndItsRestore(t *testing.T) {
	snaps, err := openSnapshotStore(t.TempDir(), quiet)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	defer src.Close()
	var w logWriter
	applyFixture(t, src, &w)
	index, _ := src.Applied()
	dst := openTestFSM(t, filepath.Join(t.TempDir(), "dst"))
	defer dst.Close()
	dst.snaps = snaps
	before, err := dst.Snapshot() // the state before the install
	if err != nil {
		t.Fatal(err)
	}
	defer before.Release()
	// Raft's main goroutine receives and closes a leader's snapshot.
	installed := saveRaftSnapshot(t, snaps, snapshotBytes(t, src), index, 2)
	if s, err := dst.Snapshot(); !errors.Is(err, ErrRestorePending) {
		if err == nil {
			s.Release()
		}
		t.Fatalf("a snapshot between the install's close and its restore answered %v; want %v", err, ErrRestorePending)
	}
	// Raft's snapshot goroutine persists the one taken before.
	sink, err := snaps.Create(raft.SnapshotVersionMax, 1, 1, raft.Configuration{}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if err := before.Persist(sink); !errors.Is(err, ErrRestorePending) {
		t.Fatalf("the persist of a snapshot taken before the install answered %v; want it cancelled (%v)", err, ErrRestorePending)
	}
	if list, err := snaps.List(); err != nil {
		t.Fatal(err)
	} else if len(list) != 1 || list[0].ID != installed {
		t.Fatalf("after the stale snapshot's persist the store lists %d snapshots; want the install alone", len(list))
	}
	_, rc, err := snaps.Open(installed)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.Restore(rc); err != nil {
		t.Fatal(err)
	}
	s, err := dst.Snapshot()
	if err != nil {
		t.Fatalf("a snapshot after the install's restore: %v", err)
	}
	s.Release()
}

// TestASnapshotWhoseCloseFailsLeavesNoPartialSnapshot: FileSnapshotSink's
// Close leaves its NAME.tmp, a whole state.bin, when its final meta.json
// write fails (a full disk); the store's sink removes it. The write is
// made to fail with a directory where meta.json goes (root or not).
func TestASnapshotWhoseCloseFailsLeavesNoPartialSnapshot(t *testing.T) {
	dir := t.TempDir()
	snaps, err := openSnapshotStore(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	sink, err := snaps.Create(1, 10, 2, raft.Configuration{}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write([]byte("the state")); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, "snapshots", sink.ID()+".tmp")
	meta := filepath.Join(tmp, "meta.json")
	if err := os.Remove(meta); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(meta, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err == nil {
		t.Fatal("Close with meta.json unwritable succeeded")
	}
	left, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*.tmp"))
	if len(left) > 0 {
		t.Fatalf("a snapshot whose Close failed left %v, want no partial snapshot", left)
	}
}

// TestAFailedCreateKeepsTheSnapshotsBeingWritten: a Create that fails
// removes the NAME.tmp it made, not another sink's still being written.
func TestAFailedCreateKeepsTheSnapshotsBeingWritten(t *testing.T) {
	dir := t.TempDir()
	snaps, err := openSnapshotStore(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	open, err := snaps.Create(1, 10, 2, raft.Configuration{}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Cancel()
	if _, err := snaps.Create(2, 20, 2, raft.Configuration{}, 1, nil); err == nil {
		t.Fatal("Create of an unsupported version succeeded")
	}
	left, _ := filepath.Glob(filepath.Join(dir, "snapshots", "*.tmp"))
	if want := filepath.Join(dir, "snapshots", open.ID()+".tmp"); len(left) != 1 || left[0] != want {
		t.Fatalf("after a failed Create the store holds %v, want the sink being written (%s)", left, want)
	}
}
