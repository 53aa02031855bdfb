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

// A Room is the file system that holds a directory and its free bytes.
type Room struct {
	// Device identifies the file system (stat's st_dev of the directory):
	// two directories with the same Device share their free space.
	Device uint64
	// Available is what Available answers for the directory.
	Available uint64
}

// RoomOf returns the file system that holds dir and its free bytes. dir
// is followed where it is a symbolic link, as a write under it would be.
// Stat_t.Dev's type differs between systems: converted.
func RoomOf(dir string) (Room, error) {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return Room{}, err
	}
	avail, err := Available(dir)
	if err != nil {
		return Room{}, err
	}
	return Room{Device: uint64(st.Dev), Available: avail}, nil
}
