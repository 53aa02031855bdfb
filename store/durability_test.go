package store

import (
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// walFS counts syncs of Pebble's write-ahead log files (*.log), and the
// bytes written to them.
type walFS struct {
	vfs.FS
	syncs   atomic.Int64
	written atomic.Int64
}

type walFile struct {
	vfs.File
	fs *walFS
}

func (f walFile) Sync() error     { f.fs.syncs.Add(1); return f.File.Sync() }
func (f walFile) SyncData() error { f.fs.syncs.Add(1); return f.File.SyncData() }

func (f walFile) Write(p []byte) (int, error) {
	f.fs.written.Add(int64(len(p)))
	return f.File.Write(p)
}

func (f walFile) WriteAt(p []byte, off int64) (int, error) {
	f.fs.written.Add(int64(len(p)))
	return f.File.WriteAt(p, off)
}

func (fs *walFS) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil || !strings.HasSuffix(name, ".log") {
		return f, err
	}
	return walFile{File: f, fs: fs}, nil
}

func (fs *walFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, c)
	return fs.wrap(name, f, err)
}

func (fs *walFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.ReuseForWrite(oldname, newname, c)
	return fs.wrap(newname, f, err)
}

func (fs *walFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	return fs.wrap(name, f, err)
}

// TestStoreLogsIsOneGroupCommit checks that a StoreLogs of many entries
// costs one WAL sync, not one per entry, and that every other write method
// syncs once too.
func TestStoreLogsIsOneGroupCommit(t *testing.T) {
	fs := &walFS{FS: vfs.NewMem()}
	s := openTestLogStore(t, fs, "raft")

	ops := []struct {
		name string
		do   func() error
	}{
		{"StoreLogs of 64 entries", func() error { return s.StoreLogs(testLogs(1, 64, 1)) }},
		{"StoreLog", func() error { return s.StoreLog(testLog(65, 1)) }},
		{"DeleteRange head", func() error { return s.DeleteRange(1, 32) }},
		{"DeleteRange tail", func() error { return s.DeleteRange(60, 65) }},
		{"Set", func() error { return s.Set([]byte("LastVoteCand"), []byte("n2")) }},
		{"SetUint64", func() error { return s.SetUint64([]byte("CurrentTerm"), 9) }},
	}
	for _, op := range ops {
		before := fs.syncs.Load()
		if err := op.do(); err != nil {
			t.Fatalf("%s: %v", op.name, err)
		}
		if n := fs.syncs.Load() - before; n != 1 {
			t.Errorf("%s synced the WAL %d times, want exactly 1", op.name, n)
		}
	}
}

// TestEveryWriteIsDurableWhenItReturns crashes the filesystem right after
// each write returns, keeping no unsynced data at all: what the reopened
// store shows is only what the write synced.
func TestEveryWriteIsDurableWhenItReturns(t *testing.T) {
	type step struct {
		name  string
		do    func(s *LogStore) error
		check func(t *testing.T, s *LogStore)
	}
	steps := []step{
		{"StoreLogs", func(s *LogStore) error { return s.StoreLogs(testLogs(1, 20, 1)) },
			func(t *testing.T, s *LogStore) {
				mustBounds(t, s, 1, 20)
				for _, l := range testLogs(1, 20, 1) {
					mustHave(t, s, l)
				}
			}},
		{"StoreLog", func(s *LogStore) error { return s.StoreLog(testLog(21, 1)) },
			func(t *testing.T, s *LogStore) { mustBounds(t, s, 1, 21); mustHave(t, s, testLog(21, 1)) }},
		{"DeleteRange head", func(s *LogStore) error { return s.DeleteRange(1, 5) },
			func(t *testing.T, s *LogStore) { mustBounds(t, s, 6, 21); mustMiss(t, s, 5) }},
		{"DeleteRange tail", func(s *LogStore) error { return s.DeleteRange(19, 21) },
			func(t *testing.T, s *LogStore) { mustBounds(t, s, 6, 18); mustMiss(t, s, 19) }},
		{"Set", func(s *LogStore) error { return s.Set([]byte("LastVoteCand"), []byte("n3")) },
			func(t *testing.T, s *LogStore) {
				if v, err := s.Get([]byte("LastVoteCand")); err != nil || string(v) != "n3" {
					t.Fatalf("LastVoteCand = %q, %v", v, err)
				}
			}},
		{"SetUint64", func(s *LogStore) error { return s.SetUint64([]byte("CurrentTerm"), 4) },
			func(t *testing.T, s *LogStore) {
				if v, err := s.GetUint64([]byte("CurrentTerm")); err != nil || v != 4 {
					t.Fatalf("CurrentTerm = %d, %v", v, err)
				}
			}},
	}
	fs := vfs.NewCrashableMem()
	s := openTestLogStore(t, fs, "raft")
	for _, st := range steps {
		if err := st.do(s); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: 0})
		t.Run(st.name, func(t *testing.T) {
			r := openTestLogStore(t, crashed, "raft")
			st.check(t, r)
		})
	}
}
