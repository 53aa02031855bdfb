package raftfsm

import "golang.org/x/sys/unix"

// diskFree returns the bytes free to an unprivileged writer on the file
// system that holds dir (statfs's available blocks, not its free ones:
// the blocks reserved for root are not a node's to take). Statfs_t's
// field types differ between systems: both converted.
func diskFree(dir string) (uint64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, err
	}
	return uint64(st.Bavail) * uint64(st.Bsize), nil
}
