package manager

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// Layout is how the engine's G1 KV cache is cut into blocks: Blocks blocks
// of BlockSize bytes each, one after another, block id i at byte offset
// i × BlockSize. A G1 block id is an int in [0, Blocks).
type Layout struct {
	// BlockSize is the size of one block in bytes, > 0. It must equal the
	// block size of the pools the manager copies into.
	BlockSize int
	// Blocks is the number of blocks in the region, > 0.
	Blocks int
}

// Size is the region's size in bytes.
func (l Layout) Size() int { return l.BlockSize * l.Blocks }

// Validate reports ErrInvalid when the layout cannot describe a region: a
// size of zero or less, or one that overflows an int.
func (l Layout) Validate() error {
	if l.BlockSize <= 0 || l.Blocks <= 0 {
		return fmt.Errorf("%w: G1 layout of %d blocks × %d bytes", ErrInvalid, l.Blocks, l.BlockSize)
	}
	if l.Blocks > math.MaxInt/l.BlockSize {
		return fmt.Errorf("%w: G1 layout of %d blocks × %d bytes overflows", ErrInvalid, l.Blocks, l.BlockSize)
	}
	return nil
}

// A Region is the engine's G1 KV cache as the manager's Backend addresses
// it: Base is the address of block 0 in device memory of that Backend (a
// DeviceBuffer from OpenIPCHandle, see MapRegion), and Layout says where
// every other block is.
type Region struct {
	Base backend.Ptr
	Layout
}

// Validate reports ErrInvalid for a nil base or an invalid layout.
func (r Region) Validate() error {
	if r.Base == 0 {
		return fmt.Errorf("%w: G1 region with a nil base", ErrInvalid)
	}
	return r.Layout.Validate()
}

// Check returns an error wrapping ErrBadBlock unless 0 ≤ id < Blocks.
func (r Region) Check(id int) error {
	if id < 0 || id >= r.Blocks {
		return fmt.Errorf("%w: G1 block %d (the region has %d)", ErrBadBlock, id, r.Blocks)
	}
	return nil
}

// Block returns the address of G1 block id, or an error wrapping
// ErrBadBlock when id is out of range.
func (r Region) Block(id int) (backend.Ptr, error) {
	if err := r.Check(id); err != nil {
		return 0, err
	}
	return r.at(id), nil
}

// at is Block for an id already checked.
func (r Region) at(id int) backend.Ptr { return r.Base.Add(id * r.BlockSize) }

// A Mapping is a G1 region this process mapped from the engine's export
// with MapRegion. Close unmaps it.
type Mapping struct {
	Region
	be   backend.Backend
	buf  backend.DeviceBuffer
	once sync.Once
	err  error
}

// MapRegion maps the engine's G1 memory exported as h (a CUDA IPC handle
// for the cuda backend; the path of a shared memory file, such as
// /dev/shm/engine-rank0, for the host backend) with be.OpenIPCHandle, for
// l.Size() bytes, and returns it as a Region addressed by G1 block id. It
// fails with ErrInvalid for a bad layout and with the backend's error
// (backend.ErrOutOfRange when the export is shorter than the layout) when
// the mapping fails. Close the Mapping after the Manager using it.
func MapRegion(be backend.Backend, h backend.IPCHandle, l Layout) (*Mapping, error) {
	if be == nil {
		return nil, fmt.Errorf("map G1 region: %w: nil backend", ErrInvalid)
	}
	if err := l.Validate(); err != nil {
		return nil, fmt.Errorf("map G1 region: %w", err)
	}
	buf, err := be.OpenIPCHandle(h, l.Size())
	if err != nil {
		return nil, fmt.Errorf("map G1 region of %d bytes: %w", l.Size(), err)
	}
	return &Mapping{Region: Region{Base: buf.Ptr(), Layout: l}, be: be, buf: buf}, nil
}

// Close unmaps the region (the engine's memory stays). Every copy using it
// must have finished: close the Manager first. A second Close returns the
// first one's result.
func (m *Mapping) Close() error {
	m.once.Do(func() {
		if err := m.be.FreeDevice(m.buf); err != nil && !errors.Is(err, backend.ErrClosed) {
			m.err = fmt.Errorf("unmap G1 region: %w", err)
		}
	})
	return m.err
}
