package raftfsm

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"syscall"
)

// lockFile is the file in a node's data directory that the running node
// holds an exclusive lock on (flock: the kernel drops it when the process
// dies, kill -9 included, so a crash leaves nothing to clean up).
const lockFile = "LOCK"

// dataDirMode is the mode a data directory is created with: owner only.
// It holds the cluster's whole state, as a saved snapshot does (kvctl
// snapshot save writes that owner-only), and Pebble and Raft create their
// files 0666&^umask, readable by every local user under the usual umask
// 022: the directory's mode is what keeps them from others.
const dataDirMode = 0o700

// warnIfDataDirOpen logs, once per start, that an existing data directory
// is open to its group or to others (one made by an older build, 0755, or
// by hand). It is not changed here: the operator may share it on purpose,
// and a chmod behind their back would surprise more than it protects.
func warnIfDataDirOpen(logger *slog.Logger, dir string) {
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm()&0o077 == 0 {
		return
	}
	logger.Warn("the data directory is open to other local users, and it holds the cluster's whole state: chmod 700 it",
		"dir", dir, "mode", fi.Mode().Perm().String())
}

// lockDataDir takes the data directory's lock, or fails with
// ErrDataDirInUse when another process (or another Node in this one)
// holds it. It is taken before anything in the directory is touched: a
// start also tidies what an interrupted restore left (fsm.restore/,
// fsm.old/), which under a running node would undo the restore it is in
// the middle of.
func lockDataDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, lockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock the data directory: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			// An offline save (kvctl snapshot save --data-dir) holds it
			// too, for its copy: the operator of a second save looks for
			// no kvrouter process.
			return nil, fmt.Errorf("%w: %s is held by another kvrouter process or a kvctl snapshot save --data-dir (stop it, or give this one another --data-dir)", ErrDataDirInUse, path)
		}
		return nil, fmt.Errorf("lock the data directory: %s: %w", path, err)
	}
	return f, nil
}

// DataDirLock is a data directory's lock taken before the node starts
// (LockDataDir): a program that does other things first (kvrouter listens
// on its ports) refuses a directory in use before them, and hands the lock
// to the node (Config.DataDirLock) with no moment unlocked. A second lock
// of the directory, from another process or this one, would be refused.
type DataDirLock struct {
	mu  sync.Mutex
	dir string   // absolute
	f   *os.File // nil once the node took it, or closed
}

// LockDataDir makes dir if need be and takes its lock, or fails with
// ErrDataDirInUse when another process (or a lock or node in this one)
// holds it.
func LockDataDir(dir string) (*DataDirLock, error) {
	if dir == "" {
		return nil, fmt.Errorf("%w: no data directory to lock", ErrInvalid)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("lock the data directory: %w", err)
	}
	if err := os.MkdirAll(abs, dataDirMode); err != nil {
		return nil, fmt.Errorf("lock the data directory: %w", err)
	}
	f, err := lockDataDir(abs)
	if err != nil {
		return nil, err
	}
	return &DataDirLock{dir: abs, f: f}, nil
}

// Close releases the lock, unless a node took it over: then the node's
// Close does.
func (l *DataDirLock) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// lockOrTake returns dir's lock: the one given, taken over (it must be
// dir's, and not yet taken or closed), or else a lock it takes.
func lockOrTake(dir string, given *DataDirLock) (*os.File, error) {
	if given == nil {
		return lockDataDir(dir)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("lock the data directory: %w", err)
	}
	given.mu.Lock()
	defer given.mu.Unlock()
	switch {
	case abs != given.dir:
		return nil, fmt.Errorf("%w: Config.DataDirLock locks %s, not the data directory %s", ErrInvalid, given.dir, abs)
	case given.f == nil:
		return nil, fmt.Errorf("%w: Config.DataDirLock of %s was closed, or taken by another node", ErrInvalid, given.dir)
	}
	f := given.f
	given.f = nil
	return f, nil
}
