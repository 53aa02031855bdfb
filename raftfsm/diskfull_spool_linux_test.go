package raftfsm

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// TestARestoreSpoolOnAFullDisk: an online restore whose upload cannot be
// spooled (the disk full) is refused, nothing installed, and its spool
// removed. From a review.
func TestARestoreSpoolOnAFullDisk(t *testing.T) {
	foreign := foreignSnapshot(t)
	c, trs := newUnstartedCluster(t, 1, nil)
	d := c.dirs[0]
	testtmpfs.Mount(t, d, "64m")
	c.startOn(0, trs[0])
	n := c.leader()
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return n.CheckLeader() == nil })
	fp := testtmpfs.Fill(t, d)
	_, err := n.RestoreSnapshot(context.Background(), strings.NewReader(string(foreign)))
	left, _ := filepath.Glob(filepath.Join(d, "restore-*"))
	os.Remove(fp)
	t.Logf("restore: %v; left %v", err, left)
	if err == nil || !strings.Contains(err.Error(), "no space left on device") || !strings.Contains(err.Error(), "nothing was installed") || len(left) > 0 {
		t.Fatalf("restore on a full disk: %v, left %v", err, left)
	}
}
