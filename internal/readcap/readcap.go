// Package readcap reads the small files a command is pointed at by a flag
// (a token, a CA bundle, NATS credentials) up to a bound, so that a path
// that never ends (/dev/zero, a FIFO whose producer writes on) is refused
// instead of growing the process until the kernel kills it. Every binary
// reads them through it, so that the bounds docs/operations.md (Security)
// promises hold for each flag alike.
package readcap

import (
	"fmt"
	"io"
	"os"
)

// MaxCAFileBytes bounds a CA file: a CA bundle (the system's whole, some
// hundred KiB) is a few MiB at most.
const MaxCAFileBytes = 8 << 20

// OpenFunc opens a file to read: os.Open (Open), or a caller's own, such
// as one whose reads an interrupt ends (a FIFO's producer may never open
// it, or stall).
type OpenFunc func(path string) (io.ReadCloser, error)

// Open is os.Open as an OpenFunc.
func Open(path string) (io.ReadCloser, error) { return os.Open(path) }

// Read reads what open gives of path, failing on a file of more than
// limit bytes.
func Read(open OpenFunc, path string, limit int64) ([]byte, error) {
	f, err := open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// A byte more than limit, to tell a larger file.
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err // an *os.PathError names path; open's own may not (an interrupt)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%s is larger than %d KiB, the most that is read of one: is it the right file?", path, limit>>10)
	}
	return b, nil
}
