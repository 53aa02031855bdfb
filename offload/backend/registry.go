package backend

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
)

// memKind says which side of the copy engine a region lives on.
type memKind uint8

const (
	memDevice memKind = iota + 1
	memHost
)

func (k memKind) String() string {
	if k == memDevice {
		return "device"
	}
	return "host"
}

// A regionRec is one live allocation or mapping of a backend.
type regionRec struct {
	base Ptr
	n    int
	kind memKind
	ipc  bool   // mapped by OpenIPCHandle rather than allocated
	b    []byte // host view, when this process can address the memory
	fd   int    // host backend: the memfd behind device memory, else -1
	// linked: host backend, the file behind an IPC mapping had a name
	// when mapped (a memfd, or a file removed before, has none by design).
	linked bool

	// inflight counts queued and running copies that touch the region. The
	// host backend's workers read and write region memory directly, so
	// unmapping it under a running copy would fault the whole process;
	// freeing is refused (ErrBusy) while inflight > 0.
	inflight atomic.Int64
}

// A registry holds a backend's live regions, sorted by base address. Every
// pointer a caller passes is resolved here before it reaches copy() or the
// driver: that is what turns a bad pointer into an error instead of a fault.
type registry struct {
	mu sync.RWMutex
	rs []*regionRec // sorted by base; regions never overlap
}

func (r *registry) add(rec *regionRec) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sort.Search(len(r.rs), func(i int) bool { return r.rs[i].base >= rec.base })
	if i < len(r.rs) && r.rs[i].base < rec.base.Add(rec.n) ||
		i > 0 && r.rs[i-1].base.Add(r.rs[i-1].n) > rec.base {
		return fmt.Errorf("register %s region %#x+%d: overlaps a live region: %w",
			rec.kind, rec.base, rec.n, ErrInvalidArgument)
	}
	r.rs = append(r.rs, nil)
	copy(r.rs[i+1:], r.rs[i:])
	r.rs[i] = rec
	return nil
}

// remove unregisters the region that starts at base with length n and kind,
// refusing with ErrBusy while copies use it. The caller releases the memory.
func (r *registry) remove(base Ptr, n int, kind memKind) (*regionRec, error) {
	if base == 0 || n <= 0 {
		return nil, fmt.Errorf("free %s buffer %#x+%d: %w", kind, base, n, ErrBadHandle)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sort.Search(len(r.rs), func(i int) bool { return r.rs[i].base >= base })
	if i == len(r.rs) || r.rs[i].base != base || r.rs[i].n != n || r.rs[i].kind != kind {
		return nil, fmt.Errorf("free %s buffer %#x+%d: not a live buffer of this backend: %w",
			kind, base, n, ErrBadHandle)
	}
	rec := r.rs[i]
	if k := rec.inflight.Load(); k > 0 {
		return nil, fmt.Errorf("free %s buffer %#x+%d: %d copies in flight: %w", kind, base, n, k, ErrBusy)
	}
	r.rs = append(r.rs[:i], r.rs[i+1:]...)
	return rec, nil
}

// takeAll unregisters and returns every region (for Close).
func (r *registry) takeAll() []*regionRec {
	r.mu.Lock()
	defer r.mu.Unlock()
	rs := r.rs
	r.rs = nil
	return rs
}

// find returns the region holding [p, p+n) and the offset of p in it. The
// caller holds r.mu.
func (r *registry) findLocked(p Ptr, n int) (*regionRec, int, bool) {
	i := sort.Search(len(r.rs), func(i int) bool { return r.rs[i].base > p }) - 1
	if i < 0 {
		return nil, 0, false
	}
	rec := r.rs[i]
	off := uintptr(p - rec.base)
	if off >= uintptr(rec.n) || uintptr(n) > uintptr(rec.n)-off {
		return nil, 0, false
	}
	return rec, int(off), true
}

// lookup returns the region that starts exactly at base with length n.
func (r *registry) lookup(base Ptr, n int, kind memKind) (*regionRec, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	rec, off, ok := r.findLocked(base, n)
	if !ok || off != 0 || rec.n != n || rec.kind != kind {
		return nil, false
	}
	return rec, true
}

// A resolved copy: both ends located in their regions.
type resolved struct {
	dst, src       *regionRec
	dstOff, srcOff int
	n              int
}

// resolve checks every copy and locates both of its ends. With pin set, it
// also counts each copy in flight on both regions, under the same lock that
// remove takes, so no region can be freed between the check and the copy;
// the caller must unpin every resolved copy exactly once.
func (r *registry) resolve(copies []Copy, pin bool, out []resolved) ([]resolved, error) {
	if len(copies) == 0 {
		return out, fmt.Errorf("copy batch: no copies: %w", ErrInvalidArgument)
	}
	for i, c := range copies {
		if c.N <= 0 {
			return out, fmt.Errorf("copy %d: size %d: %w", i, c.N, ErrInvalidArgument)
		}
		if c.Dst == 0 || c.Src == 0 {
			return out, fmt.Errorf("copy %d: nil pointer (dst %#x, src %#x): %w", i, c.Dst, c.Src, ErrInvalidArgument)
		}
	}
	r.mu.RLock()
	defer r.mu.RUnlock()
	start := len(out)
	for i, c := range copies {
		d, doff, ok := r.findLocked(c.Dst, c.N)
		if !ok {
			return out[:start], fmt.Errorf("copy %d: dst %#x+%d: %w", i, c.Dst, c.N, ErrOutOfRange)
		}
		s, soff, ok := r.findLocked(c.Src, c.N)
		if !ok {
			return out[:start], fmt.Errorf("copy %d: src %#x+%d: %w", i, c.Src, c.N, ErrOutOfRange)
		}
		if d == s && doff < soff+c.N && soff < doff+c.N {
			return out[:start], fmt.Errorf("copy %d: dst %#x and src %#x overlap (%d bytes): %w",
				i, c.Dst, c.Src, c.N, ErrInvalidArgument)
		}
		out = append(out, resolved{dst: d, src: s, dstOff: doff, srcOff: soff, n: c.N})
	}
	if pin {
		for _, rc := range out[start:] {
			rc.dst.inflight.Add(1)
			rc.src.inflight.Add(1)
		}
	}
	return out, nil
}

func unpin(rs []resolved) {
	for _, rc := range rs {
		rc.dst.inflight.Add(-1)
		rc.src.inflight.Add(-1)
	}
}
