package raftfsm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// lockFile is the file in a node's data directory that the running node
// holds an exclusive lock on (flock: the kernel drops it when the process
// dies, kill -9 included, so a crash leaves nothing to clean up).
const lockFile = "LOCK"

// lockDataDir takes the data directory's lock, or fails with
// ErrDataDirInUse when another process (or another Node in this one)
// holds it. It is taken before anything in the directory is touched: a
// start also tidies what an interrupted restore left (fsm.restore/,
// fsm.old/), which under a running node would undo the restore it is in
// the middle of.
func lockDataDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, lockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock the data directory: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is held by another kvrouter process (stop it, or give this one another --data-dir)", ErrDataDirInUse, path)
		}
		return nil, fmt.Errorf("lock the data directory: %s: %w", path, err)
	}
	return f, nil
}
