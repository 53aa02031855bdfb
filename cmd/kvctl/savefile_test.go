package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestSnapshotSaveOverANonRegularFILE: a FILE that is there and is not a
// regular file (here a FIFO; a socket or a device node alike) is refused
// as a usage error, as a directory is, by the save from the leader and
// the offline save alike, and left as it was. The save renamed its
// verified temporary file over it and exited 0: a reader waiting on the
// FIFO was never served and, run as root, `kvctl snapshot save /dev/null
// --data-dir DIR` replaced the system's /dev/null with a regular file.
func TestSnapshotSaveOverANonRegularFILE(t *testing.T) {
	dir := stoppedNodeDir(t)
	fifo := filepath.Join(t.TempDir(), "pipe")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	h := &harness{inspect: raftfsm.InspectSnapshot}
	for _, args := range [][]string{
		{"--endpoints=" + deadAddr(t), "snapshot", "save", fifo, "--data-dir", dir},
		{"--endpoints=" + deadAddr(t), "snapshot", "save", fifo},
	} {
		r := h.run(t, args...)
		fi, err := os.Lstat(fifo)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&os.ModeNamedPipe == 0 {
			t.Fatalf("kvctl %s: exit %d, stdout %q: the FIFO %s was replaced by a %v file, want it refused and kept",
				strings.Join(args, " "), r.code, r.stdout, fifo, fi.Mode())
		}
		if r.code != 2 || !strings.Contains(r.stderr, fifo+": FILE is a FIFO") {
			t.Errorf("kvctl %s: exit %d, stderr %q, want exit 2 saying FILE is a FIFO", strings.Join(args, " "), r.code, r.stderr)
		}
	}
}

// TestSnapshotSaveDirNamesTheFILEThatIsWrong: an offline save to a FILE
// whose parent is a regular file (a typo: backup.snap/x.snap) fails
// naming FILE, as the online save does ("create a temporary file beside
// FILE: open FILE.N.part: not a directory"). It said "snapshot save
// --data-dir DIR: not a directory; nothing was saved" (OutsideDataDir's
// bare ENOTDIR), saying DIR, a directory, is none.
func TestSnapshotSaveDirNamesTheFILEThatIsWrong(t *testing.T) {
	dir := stoppedNodeDir(t)
	notDir := filepath.Join(t.TempDir(), "backup.snap")
	if err := os.WriteFile(notDir, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(notDir, "x.snap")
	h := &harness{inspect: raftfsm.InspectSnapshot}
	r := h.run(t, "--endpoints="+deadAddr(t), "snapshot", "save", file, "--data-dir", dir)
	if r.code == 0 || !strings.Contains(r.stderr, file) {
		t.Fatalf("save --data-dir %s to %s: exit %d, stderr %q: want a failure naming FILE", dir, file, r.code, r.stderr)
	}
}
