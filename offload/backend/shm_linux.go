package backend

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// mapShared maps n bytes of a fresh memfd, shared and read-write, and returns
// the mapping and the descriptor (kept open so ExportIPC can name it). A
// memfd lives outside /dev/shm, so container limits on /dev/shm do not cap
// the simulated device memory.
func mapShared(n int) ([]byte, int, error) {
	fd, err := unix.MemfdCreate("kvrouter-device", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("ftruncate memfd: %w", err)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, -1, fmt.Errorf("mmap memfd: %w", err)
	}
	return b, fd, nil
}
