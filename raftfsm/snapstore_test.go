package raftfsm

import (
	"fmt"
	"testing"
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
