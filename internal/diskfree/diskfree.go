// Package diskfree says how many bytes a file system has free for an
// unprivileged writer. It is shared by raftfsm (a restore's room) and
// kvagent (the room of the disk tier), which must not depend on each other.
package diskfree

import "golang.org/x/sys/unix"

// Available returns the bytes free to an unprivileged writer on the file
// system that holds dir (statfs's available blocks, not its free ones:
// the blocks reserved for root are not a process's to take). Statfs_t's
// field types differ between systems: both converted.
func Available(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return uint64(st.Bavail) * uint64(st.Bsize), nil
}
