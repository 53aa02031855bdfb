package raftfsm

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestARestoreSpoolOnAFullDisk: review rvS5 (a check; passes).
func TestARestoreSpoolOnAFullDisk(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a tmpfs")
	}
	foreign := foreignSnapshot(t)
	c, trs := newUnstartedCluster(t, 1, nil)
	d := c.dirs[0]
	os.MkdirAll(d, 0o755)
	if err := syscall.Mount("tmpfs", d, "tmpfs", 0, "size=64m"); err != nil {
		t.Skipf("mount: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(d, syscall.MNT_DETACH) })
	c.startOn(0, trs[0])
	n := c.leader()
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return n.CheckLeader() == nil })
	fp := filepath.Join(d, "filler")
	f, _ := os.Create(fp)
	buf := make([]byte, 4096)
	for {
		if _, err := f.Write(buf); err != nil {
			break
		}
	}
	f.Close()
	_, err := n.RestoreSnapshot(context.Background(), strings.NewReader(string(foreign)))
	left, _ := filepath.Glob(filepath.Join(d, "restore-*"))
	os.Remove(fp)
	t.Logf("restore: %v; left %v", err, left)
	if err == nil || !strings.Contains(err.Error(), "no space left on device") || !strings.Contains(err.Error(), "nothing was installed") || len(left) > 0 {
		t.Fatalf("restore on a full disk: %v, left %v", err, left)
	}
}
