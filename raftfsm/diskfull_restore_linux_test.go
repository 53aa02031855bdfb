package raftfsm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// TestAUserRestoreOnANearlyFullDiskDoesNotCrashTheLeader (from a review):
// A leader whose disk holds the restore's spools and Raft's copy of the
// stream but not the FSM's load of it. hashicorp/raft's
// restoreUserSnapshot panicked when FSM.Restore returned the disk's error:
// the leader crashed with a goroutine dump, the restore already stored in
// its snapshot store. The leader now checks its free space before it
// hands the stream to Raft: the restore is refused
// (ErrInsufficientStorage), nothing installed, and the node serves on.
func TestAUserRestoreOnANearlyFullDiskDoesNotCrashTheLeader(t *testing.T) {
	foreign := foreignSnapshot(t)
	c, trs := newUnstartedCluster(t, 3, quietLeader)
	for i, d := range c.dirs {
		testtmpfs.Mount(t, d, "64m")
		c.startOn(i, trs[i])
	}
	l := c.leader()
	i := slices.Index(c.nodes, l)
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return l.CheckLeader() == nil })
	c.converged()

	pages := func(n int) int { return (n + 4095) / 4096 }
	// the spool, the stream with its members replaced (a little larger),
	// Raft's state.bin and meta.json.
	room := pages(len(foreign)) + 2*(pages(len(foreign))+1) + 1
	var st syscall.Statfs_t
	if err := syscall.Statfs(c.dirs[i], &st); err != nil {
		t.Fatal(err)
	}
	free := int(st.Bavail) * int(st.Bsize)
	filler, err := os.Create(filepath.Join(c.dirs[i], "filler"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := filler.Write(make([]byte, free-room*4096)); err != nil {
		t.Fatal(err)
	}
	filler.Close()
	t.Logf("snapshot %d bytes; %d pages left free on %s's disk", len(foreign), room, l.cfg.ID)

	_, err = l.RestoreSnapshot(context.Background(), strings.NewReader(string(foreign)))
	t.Logf("restore: %v", err)
	if !errors.Is(err, ErrInsufficientStorage) || !strings.Contains(err.Error(), "nothing was installed") {
		t.Fatalf("restore on a nearly full disk answered %v, want ErrInsufficientStorage, nothing installed", err)
	}
	left, _ := filepath.Glob(filepath.Join(c.dirs[i], "restore-*.snap"))
	if len(left) > 0 {
		t.Errorf("the refused restore left its spools: %v", left)
	}
	os.Remove(filepath.Join(c.dirs[i], "filler"))
	// The leader serves on, with its state: no worker 9 of the snapshot.
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 100, BlockSize: 16}); err != nil {
		t.Fatalf("the leader after the refused restore: %v", err)
	}
	c.converged()
	for _, n := range c.nodes {
		if _, ok := n.fsm.Workers()[9]; ok {
			t.Errorf("%s holds the refused restore's worker 9", n.cfg.ID)
		}
	}
}
