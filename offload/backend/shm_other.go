//go:build !linux

package backend

import "golang.org/x/sys/unix"

// mapShared maps n bytes of shared anonymous memory. Without memfd there is
// no descriptor to export, so ExportIPC fails with ErrUnsupported.
func mapShared(n int) ([]byte, int, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANON)
	return b, -1, err
}
