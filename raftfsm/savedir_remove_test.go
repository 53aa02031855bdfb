package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// copyTreeForTest copies the regular files and directories under src to dst.
func copyTreeForTest(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		to := filepath.Join(dst, rel)
		if d.IsDir() {
			return os.MkdirAll(to, 0o700)
		}
		if !d.Type().IsRegular() {
			return nil
		}
		in, err := os.Open(p)
		if err != nil {
			return err
		}
		defer in.Close()
		out, err := os.Create(to)
		if err != nil {
			return err
		}
		defer out.Close()
		_, err = io.Copy(out, in)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestSaveDataDirRemovesASaveKilledDuringItsOwnRemoval: a save killed
// (kill -9, OOM) while it removes its own working directory leaves what
// it had not removed yet, as large as the copy; the next save beside it
// must remove that (docs/kvctl.md), and removeDeadSaves removes only a
// directory with a LOCK it can take. A save that released its lock and
// then removed the directory in readdir order could take LOCK first and
// leave fsm/ and raft/ without it, for ever. The test stops the removal
// after each entry (saveWorkRemoveStep), checks that LOCK is still there
// and held, keeps a copy of the first such directory as a kill would
// leave it, and runs the next save.
func TestSaveDataDirRemovesASaveKilledDuringItsOwnRemoval(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	tmp := t.TempDir()
	killed := filepath.Join(tmp, saveWorkPrefix+"killed")
	steps := 0
	saveWorkRemoveStep = func(work string) {
		steps++
		if _, err := os.Stat(filepath.Join(work, lockFile)); err != nil {
			t.Errorf("removal step %d of %s: LOCK already gone: %v", steps, work, err)
		}
		if l, err := lockDataDir(work); err == nil {
			l.Close()
			t.Errorf("removal step %d of %s: its lock is not held", steps, work)
		}
		if steps == 1 {
			copyTreeForTest(t, work, killed)
		}
	}
	defer func() { saveWorkRemoveStep = nil }()
	if _, err := SaveDataDir(context.Background(), c.dirs[0], io.Discard, SaveOptions{TempDir: tmp}); err != nil {
		t.Fatal(err)
	}
	saveWorkRemoveStep = nil
	if steps == 0 {
		t.Fatal("the save's working directory was removed without removeSaveWork's steps")
	}
	if works, _ := filepath.Glob(filepath.Join(tmp, saveWorkPrefix+"*")); len(works) != 1 || works[0] != killed {
		t.Fatalf("working directories after the save: %v, want only the copy %s", works, killed)
	}
	var buf bytes.Buffer
	if _, err := SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: tmp}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(killed); err == nil {
		var left []string
		_ = filepath.WalkDir(killed, func(p string, d fs.DirEntry, err error) error {
			if err == nil && !d.IsDir() {
				rel, _ := filepath.Rel(killed, p)
				left = append(left, rel)
			}
			return nil
		})
		t.Fatalf("a save killed while removing its working directory is not removed by the next save: %d files left: %s",
			len(left), strings.Join(left, " "))
	}
	if works, _ := filepath.Glob(filepath.Join(tmp, saveWorkPrefix+"*")); len(works) != 0 {
		t.Fatalf("working directories after the second save: %v, want none", works)
	}
}

// captureWriter calls at once, at its first Write (the save's working
// directory is then fully copied), then takes everything.
type captureWriter struct {
	once sync.Once
	at   func()
	buf  bytes.Buffer
}

func (w *captureWriter) Write(p []byte) (int, error) {
	w.once.Do(w.at)
	return w.buf.Write(p)
}

// TestTwoSavesOfOneDataDirSayWhatHoldsIt: two offline saves of one data
// directory (two shells, a retry while the first still runs) cannot run
// at once: the second is refused with ErrDataDirInUse. Its message must
// not send the operator to look for a kvrouter process that does not
// exist: the holder is the other save (kvctl), which lockDataDir's
// message ("held by another kvrouter process (stop it, or give this one
// another --data-dir)") does not say.
func TestTwoSavesOfOneDataDirSayWhatHoldsIt(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.stop(0)
	var second error
	w := &captureWriter{at: func() {
		var buf bytes.Buffer
		_, second = SaveDataDir(context.Background(), c.dirs[0], &buf, SaveOptions{TempDir: t.TempDir()})
	}}
	if _, err := SaveDataDir(context.Background(), c.dirs[0], w, SaveOptions{TempDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(second, ErrDataDirInUse) {
		t.Fatalf("a second save while the first runs: %v, want ErrDataDirInUse", second)
	}
	if !strings.Contains(second.Error(), "save") {
		t.Fatalf("a second save of %s while another save holds it: %q: names a kvrouter process, not the save that holds it", c.dirs[0], second)
	}
}
