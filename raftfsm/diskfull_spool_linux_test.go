package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// leaderOnTmpfs starts a one-node cluster whose data directory, returned,
// is a 64 MiB tmpfs (testtmpfs.Mount: root only, skipped otherwise), and
// returns its node once it leads and has set up its leadership.
func leaderOnTmpfs(t *testing.T) (*Node, string) {
	t.Helper()
	c, trs := newUnstartedCluster(t, 1, nil)
	d := c.dirs[0]
	testtmpfs.Mount(t, d, "64m")
	c.startOn(0, trs[0])
	n := c.leader()
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return n.CheckLeader() == nil })
	return n, d
}

// TestARestoreSpoolOnAFullDisk: an online restore whose upload cannot be
// spooled (the disk full) is refused, ErrInsufficientStorage, nothing
// installed, and its spool removed. From a review.
func TestARestoreSpoolOnAFullDisk(t *testing.T) {
	foreign := foreignSnapshot(t)
	n, d := leaderOnTmpfs(t)
	fp := testtmpfs.Fill(t, d)
	_, err := n.RestoreSnapshot(context.Background(), strings.NewReader(string(foreign)))
	left, _ := filepath.Glob(filepath.Join(d, "restore-*"))
	os.Remove(fp)
	t.Logf("restore: %v; left %v", err, left)
	if !errors.Is(err, ErrInsufficientStorage) || !strings.Contains(err.Error(), "no space left on device") || !strings.Contains(err.Error(), "nothing was installed") || len(left) > 0 {
		t.Fatalf("restore on a full disk: %v, left %v", err, left)
	}
}

// fillingReader hands out r's bytes and, after the first after of them,
// fills the disk at dir: the disk runs out while the upload streams,
// after any check made before it began.
type fillingReader struct {
	t      *testing.T
	r      io.Reader
	dir    string
	after  int
	read   int
	filler string
}

func (f *fillingReader) Read(p []byte) (int, error) {
	if f.filler == "" && f.read >= f.after {
		f.filler = testtmpfs.Fill(f.t, f.dir)
	}
	p = p[:min(len(p), max(f.after-f.read, 1))]
	n, err := f.r.Read(p)
	f.read += n
	return n, err
}

// TestARestoreWhoseDiskFillsWhileItSpoolsIsInsufficientStorage: a disk
// that fills while the upload spools (another writer, after any check of
// its free space) refuses the restore as the free-space check does,
// ErrInsufficientStorage (the API's 507 insufficient_storage, to free
// space and send it again), not a bare write error (500 internal); the
// spool is removed and the cluster keeps its state.
func TestARestoreWhoseDiskFillsWhileItSpoolsIsInsufficientStorage(t *testing.T) {
	foreign := foreignSnapshot(t)
	n, d := leaderOnTmpfs(t)

	fr := &fillingReader{t: t, r: bytes.NewReader(foreign), dir: d, after: len(foreign) / 2}
	_, err := n.RestoreSnapshot(context.Background(), fr)
	left, _ := filepath.Glob(filepath.Join(d, "restore-*"))
	if fr.filler == "" {
		t.Fatal("the upload was spooled before the disk was filled")
	}
	os.Remove(fr.filler)
	t.Logf("restore: %v", err)
	if !errors.Is(err, ErrInsufficientStorage) || !strings.Contains(err.Error(), "nothing was installed") || !strings.Contains(err.Error(), "no space left on device") {
		t.Fatalf("a restore whose disk filled while it spooled answered %v, want ErrInsufficientStorage, nothing installed, saying the disk is full", err)
	}
	if len(left) > 0 {
		t.Errorf("the refused restore left its spool: %v", left)
	}
	if _, ok := n.fsm.Workers()[9]; ok {
		t.Error("the leader holds the refused restore's worker 9")
	}
}
