package raftfsm

import (
	"bytes"
	"fmt"
	"io"
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
// S+1) continue. The reap now drops only those that were there when the
// older sink was created.
func TestASnapshotClosedAfterAnInstallKeepsTheInstalledOne(t *testing.T) {
	snaps, err := openSnapshotStore(t.TempDir(), quiet)
	if err != nil {
		t.Fatal(err)
	}
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	// takeSnapshot: the FSM's snapshot at X = 100, persisting.
	own, err := snaps.Create(raft.SnapshotVersionMax, 100, 3, raft.Configuration{}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := own.Write([]byte("own state at 100")); err != nil {
		t.Fatal(err)
	}
	// installSnapshot meanwhile: the leader's at S = 500, same term.
	installed := saveRaftSnapshot(t, snaps, []byte("leader's state at 500"), 500, 3)
	// The persist ends.
	if err := own.Close(); err != nil {
		t.Fatal(err)
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

// heldPersistFSM is a toy raft.FSM whose snapshot's Persist waits for release.
type heldPersistFSM struct {
	entered chan struct{}
	release chan struct{}
}

func (f *heldPersistFSM) Apply(*raft.Log) interface{} { return nil }
func (f *heldPersistFSM) Snapshot() (raft.FSMSnapshot, error) {
	return heldPersistSnapshot{f}, nil
}
func (f *heldPersistFSM) Restore(rc io.ReadCloser) error {
	_, err := io.Copy(io.Discard, rc)
	rc.Close()
	return err
}

type heldPersistSnapshot struct{ f *heldPersistFSM }

func (s heldPersistSnapshot) Persist(sink raft.SnapshotSink) error {
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
// restore.
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
	fsm := &heldPersistFSM{entered: make(chan struct{}), release: make(chan struct{})}
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
	if err := <-snapDone; err != nil {
		t.Fatal(err)
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
