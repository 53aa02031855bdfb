package pool

import (
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
)

// HostPool is the G2 pool: Capacity slots of BlockSize bytes in one region
// of host memory from a Backend (pinned on CUDA, so device copies into and
// out of a slot run at full speed). Its events carry kvevent.TierHostPinned.
//
// A block gets in either by Register (a copy() from Go memory) or by
// Reserve, a device copy into the reservation's Ptr, and Commit (or Abort);
// RegisterFrom does the latter for a batch. A block is read back through
// Acquire, whose Slot gives the address for a copy out, then Release; or
// with Read into a caller buffer.
//
// All methods are safe for concurrent use.
type HostPool struct {
	c          *core
	be         backend.Backend
	buf        backend.HostBuffer
	bs         int
	free       []int32 // free slots; guarded by c.mu (the storage hooks run under it)
	unregister func()
}

// Slot is where a block's bytes live in a HostPool.
type Slot struct {
	Hash  uint64
	Index int         // slot number, 0 ≤ Index < Capacity
	Ptr   backend.Ptr // address of the slot in the pool's Backend, for CopyAsync
	Bytes []byte      // the host's view of the slot, BlockSize bytes
}

// A Reservation is a slot claimed for a block that is not written yet. Fill
// Bytes (or copy to Ptr with the Backend and wait for the copy), then Commit
// it; or Abort it.
type Reservation struct {
	Slot
	e *entry
}

// NewHost allocates cfg.Capacity × cfg.BlockSize bytes of host memory from
// be for a new, empty pool. Close frees it; be must outlive the pool.
func NewHost(be backend.Backend, cfg Config) (*HostPool, error) {
	if err := cfg.check(); err != nil {
		return nil, fmt.Errorf("new host pool: %w", err)
	}
	if be == nil {
		return nil, fmt.Errorf("new host pool: %w: nil backend", ErrInvalid)
	}
	buf, err := be.AllocHost(cfg.Capacity * cfg.BlockSize)
	if err != nil {
		return nil, fmt.Errorf("new host pool of %d × %d bytes: %w", cfg.Capacity, cfg.BlockSize, err)
	}
	p := &HostPool{be: be, buf: buf, bs: cfg.BlockSize, free: make([]int32, cfg.Capacity)}
	for i := range p.free { // pop from the end: slot 0 first
		p.free[i] = int32(cfg.Capacity - 1 - i)
	}
	p.c = newCore(cfg, kvevent.TierHostPinned, p)
	if p.unregister, err = registerMetrics(cfg.Registerer, p.c); err != nil {
		be.FreeHost(buf)
		return nil, fmt.Errorf("new host pool: %w", err)
	}
	return p, nil
}

func (p *HostPool) place(e *entry) {
	e.slot = p.free[len(p.free)-1]
	p.free = p.free[:len(p.free)-1]
}

func (p *HostPool) drop(e *entry, _ bool) error {
	p.free = append(p.free, e.slot)
	return nil
}

func (p *HostPool) slot(e *entry) Slot {
	off := int(e.slot) * p.bs
	return Slot{Hash: e.Hash, Index: int(e.slot), Ptr: p.buf.At(off), Bytes: p.buf.Bytes()[off : off+p.bs : off+p.bs]}
}

// Reserve claims a slot for b, evicting the least recently used evictable
// block if the pool is full (publishing its REMOVE). It fails with ErrFull,
// changing nothing, when nothing can be evicted, and with ErrExists when b
// is already held (the block is then counted as used now: no copy needed)
// or being written by another caller (the error wraps ErrBusy too: that
// write may still be aborted).
func (p *HostPool) Reserve(b Block) (Reservation, error) {
	e, err := p.c.reserve(b)
	if err != nil {
		return Reservation{}, err
	}
	return Reservation{Slot: p.slot(e), e: e}, nil
}

// Commit marks reserved blocks as stored and publishes their STORE events.
// Their bytes must be in place: a device copy into them must have finished.
func (p *HostPool) Commit(rs ...Reservation) error {
	return p.c.commit(entriesOf(rs))
}

// Abort gives reserved slots back without storing their blocks. No copy
// into them may still be running.
func (p *HostPool) Abort(rs ...Reservation) {
	p.c.abort(entriesOf(rs))
}

func entriesOf(rs []Reservation) []*entry {
	es := make([]*entry, len(rs))
	for i, r := range rs {
		es[i] = r.e
	}
	return es
}

// Register stores b with a copy of data (BlockSize bytes) from Go memory.
// It fails with ErrExists when b is already held (reviving it, see
// Reserve), ErrFull when nothing can be evicted, ErrInvalid on a bad
// argument; on every error the pool is unchanged.
func (p *HostPool) Register(b Block, data []byte) error {
	if len(data) != p.bs {
		return fmt.Errorf("register %#x: %w: %d bytes, block size %d", b.Hash, ErrInvalid, len(data), p.bs)
	}
	r, err := p.Reserve(b)
	if err != nil {
		return err
	}
	copy(r.Bytes, data)
	return p.Commit(r)
}

// RegisterFrom stores blocks whose bytes are at src (one Ptr per block, in
// device or host memory of the pool's Backend): it reserves a slot for each
// in order, queues all the copies on s with one CopyBatchAsync, records e
// after them, waits for e and commits. Blocks already held are revived and
// skipped. It stops at the first block that does not fit (ErrFull) and
// stores those before it: stored counts the blocks it stored, err says why
// it stopped early. A bad argument changes nothing (a batch that would make
// one of its blocks its own ancestor included); a failed copy stores
// nothing.
func (p *HostPool) RegisterFrom(s backend.Stream, e backend.Event, blocks []Block, src []backend.Ptr) (stored int, err error) {
	if len(src) != len(blocks) {
		return 0, fmt.Errorf("register from device: %w: %d blocks, %d sources", ErrInvalid, len(blocks), len(src))
	}
	for _, b := range blocks {
		if err := b.check(); err != nil {
			return 0, fmt.Errorf("register from device: %w", err)
		}
	}
	es, idx, _, _, stop := p.c.reserveAll(blocks)
	rs := make([]Reservation, len(es))
	copies := make([]backend.Copy, len(es))
	for j, e := range es {
		// A pending entry's slot does not change until commit or abort.
		rs[j] = Reservation{Slot: p.slot(e), e: e}
		copies[j] = backend.Copy{Dst: rs[j].Ptr, Src: src[idx[j]], N: p.bs}
	}
	if len(rs) == 0 {
		return 0, stop
	}
	if err := p.copyIn(s, e, copies); err != nil {
		p.Abort(rs...)
		return 0, fmt.Errorf("register from device: %w", err)
	}
	if err := p.Commit(rs...); err != nil {
		return 0, err
	}
	return len(rs), stop
}

// copyIn runs the copies and waits for them. On an error it still waits for
// whatever was queued, so the slots can be given back.
func (p *HostPool) copyIn(s backend.Stream, e backend.Event, copies []backend.Copy) error {
	if err := p.be.CopyBatchAsync(s, copies); err != nil {
		return err // a failed batch leaves no copy of it running
	}
	err := p.be.Record(e, s)
	if err == nil {
		err = p.be.Synchronize(e)
	}
	if err != nil {
		return errors.Join(err, p.be.SynchronizeStream(s))
	}
	return nil
}

// Acquire takes a reference on a stored block, so it is not evicted until
// Release, and counts as its use. It fails with ErrNotFound (a miss) when
// the block is not stored.
func (p *HostPool) Acquire(hash uint64) (Slot, error) {
	e, err := p.c.acquire(hash)
	if err != nil {
		return Slot{}, err
	}
	return p.slot(e), nil
}

// Release drops a reference taken by Acquire.
func (p *HostPool) Release(hash uint64) error { return p.c.release(hash) }

// Read copies a stored block into dst (BlockSize bytes).
func (p *HostPool) Read(hash uint64, dst []byte) error {
	if len(dst) != p.bs {
		return fmt.Errorf("read %#x: %w: %d bytes, block size %d", hash, ErrInvalid, len(dst), p.bs)
	}
	s, err := p.Acquire(hash)
	if err != nil {
		return err
	}
	copy(dst, s.Bytes)
	return p.Release(hash)
}

// Lookup appends to dst, per hash, whether the block is stored, and returns
// it. It does not count as a use.
func (p *HostPool) Lookup(hashes []uint64, dst []bool) []bool { return p.c.lookup(hashes, dst) }

// Prefix returns how many of the leading hashes are stored.
func (p *HostPool) Prefix(hashes []uint64) int { return p.c.prefix(hashes) }

// Dump returns the stored blocks as STORE events, every block after its
// parent when that is in the pool, and the id the Sink returned for the
// last event this pool published.
func (p *HostPool) Dump() ([]kvevent.Event, uint64) { return p.c.dump() }

// Stats returns the pool's counters.
func (p *HostPool) Stats() Stats { return p.c.stats() }

// Region is the pool's memory: slot i is the BlockSize bytes at offset
// i × BlockSize.
func (p *HostPool) Region() backend.HostBuffer { return p.buf }

// Close frees the pool's memory, and first publishes a REMOVE of every
// block it held: their bytes are gone, and the router, which would go on
// routing to them until the worker left (kvagent's stop keeps the worker
// registered), must not. No copy into or out of it may still run; later
// calls fail with ErrClosed. A second Close returns nil and publishes
// nothing.
func (p *HostPool) Close() error {
	if !p.c.retire() {
		return nil
	}
	p.unregister()
	if err := p.be.FreeHost(p.buf); err != nil {
		return fmt.Errorf("close host pool: %w", err)
	}
	return nil
}
