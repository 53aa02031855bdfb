package backend

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// CUDAConfig configures OpenCUDA.
type CUDAConfig struct {
	// Library is the driver library to dlopen; "" means libcuda.so.1.
	Library string
	// Device is the CUDA device ordinal (as the driver numbers devices,
	// after CUDA_VISIBLE_DEVICES).
	Device int
	// Logger logs the device opened and the failures the backend goes on
	// after; nil means slog.Default().
	Logger *slog.Logger
}

// CUDA is the Backend that copies with the CUDA driver API on one device.
//
// Thread binding: a CUDA context is current per OS thread, and a goroutine
// may move between OS threads at any point where it is not locked. Every
// method that calls the driver therefore brackets its calls with enter and
// leave, which lock the goroutine to its thread and make the device's
// primary context current there (cuCtxSetCurrent costs a thread-local store).
// The alternative, one goroutine locked to one thread that serves every
// call, would serialise all streams behind a channel hop; this way any
// number of copy workers issue copies in parallel, and no method needs its
// caller to lock a thread.
//
// The primary context is shared with anything else in the process that uses
// the device (the CUDA runtime uses the same one), and retained until Close.
type CUDA struct {
	drv  *driver
	dev  int32
	ctx  uintptr
	name string
	log  *slog.Logger

	reg    registry
	closed atomic.Bool

	mu      sync.Mutex // guards the sets below and orders allocs, frees and IPC exports against Close
	streams map[*cudaStream]struct{}
	events  map[*cudaEvent]struct{}
}

var _ Backend = (*CUDA)(nil)

// OpenCUDA loads the CUDA driver and retains the primary context of
// cfg.Device. It fails with an error wrapping ErrNoCUDA when the library, the
// driver or the device is missing.
func OpenCUDA(cfg CUDAConfig) (*CUDA, error) {
	path := cfg.Library
	if path == "" {
		path = defaultCUDALibrary
	}
	d, err := loadDriver(path)
	if err != nil {
		return nil, fmt.Errorf("open cuda: %w: %w", ErrNoCUDA, err)
	}
	if err := d.check("cuInit", d.cuInit(0)); err != nil {
		return nil, fmt.Errorf("open cuda: %w: %w", ErrNoCUDA, err)
	}
	var count int32
	if err := d.check("cuDeviceGetCount", d.cuDeviceGetCount(&count)); err != nil {
		return nil, fmt.Errorf("open cuda: %w: %w", ErrNoCUDA, err)
	}
	if cfg.Device < 0 || cfg.Device >= int(count) {
		return nil, fmt.Errorf("open cuda: device %d of %d: %w", cfg.Device, count, ErrNoCUDA)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	c := &CUDA{
		log:     log,
		drv:     d,
		streams: make(map[*cudaStream]struct{}),
		events:  make(map[*cudaEvent]struct{}),
	}
	if err := d.check("cuDeviceGet", d.cuDeviceGet(&c.dev, int32(cfg.Device))); err != nil {
		return nil, fmt.Errorf("open cuda: %w", err)
	}
	if err := d.check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&c.ctx, c.dev)); err != nil {
		return nil, fmt.Errorf("open cuda device %d: %w", cfg.Device, err)
	}
	var name [256]byte
	c.name = fmt.Sprintf("cuda:%d", cfg.Device)
	if d.cuDeviceGetName(&name[0], int32(len(name)), c.dev) == cudaSuccess {
		if i := bytes.IndexByte(name[:], 0); i > 0 {
			c.name += " " + string(name[:i])
		}
	}
	var ver int32
	_ = d.cuDriverGetVersion(&ver)
	c.log.Info("offload backend: CUDA opened", "device", c.name, "driver_version", ver, "library", path)
	return c, nil
}

// Kind is KindCUDA.
func (c *CUDA) Kind() Kind { return KindCUDA }

// Name is "cuda:<ordinal> <device name>".
func (c *CUDA) Name() string { return c.name }

// enter pins the calling goroutine to its OS thread and makes the primary
// context current on that thread; leave unpins it. See the type comment.
func (c *CUDA) enter() error {
	runtime.LockOSThread()
	if err := c.drv.check("cuCtxSetCurrent", c.drv.cuCtxSetCurrent(c.ctx)); err != nil {
		runtime.UnlockOSThread()
		return err
	}
	return nil
}

func (c *CUDA) leave() { runtime.UnlockOSThread() }

// call runs f with the context current.
func (c *CUDA) call(f func() error) error {
	if err := c.enter(); err != nil {
		return err
	}
	defer c.leave()
	return f()
}

// AllocDevice allocates with cuMemAlloc.
func (c *CUDA) AllocDevice(n int) (DeviceBuffer, error) {
	if n <= 0 {
		return DeviceBuffer{}, fmt.Errorf("alloc device %d bytes: %w", n, ErrInvalidArgument)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return DeviceBuffer{}, fmt.Errorf("alloc device: %w", ErrClosed)
	}
	var d uint64
	if err := c.call(func() error { return c.drv.check("cuMemAlloc_v2", c.drv.cuMemAlloc(&d, uintptr(n))) }); err != nil {
		return DeviceBuffer{}, fmt.Errorf("alloc device %d bytes: %w", n, err)
	}
	rec := &regionRec{base: Ptr(d), n: n, kind: memDevice, fd: -1}
	if err := c.reg.add(rec); err != nil {
		c.release(rec)
		return DeviceBuffer{}, err
	}
	return DeviceBuffer{region{rec.base, n}}, nil
}

// AllocHost allocates pinned, portable host memory with cuMemHostAlloc.
func (c *CUDA) AllocHost(n int) (HostBuffer, error) {
	if n <= 0 {
		return HostBuffer{}, fmt.Errorf("alloc host %d bytes: %w", n, ErrInvalidArgument)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return HostBuffer{}, fmt.Errorf("alloc host: %w", ErrClosed)
	}
	var p unsafe.Pointer
	if err := c.call(func() error {
		return c.drv.check("cuMemHostAlloc", c.drv.cuMemHostAlloc(&p, uintptr(n), cuMemHostAllocPortable))
	}); err != nil {
		return HostBuffer{}, fmt.Errorf("alloc pinned host %d bytes: %w", n, err)
	}
	rec := &regionRec{base: Ptr(p), n: n, kind: memHost, b: unsafe.Slice((*byte)(p), n), fd: -1}
	if err := c.reg.add(rec); err != nil {
		c.release(rec)
		return HostBuffer{}, err
	}
	return HostBuffer{region{rec.base, n}, rec.b}, nil
}

// release frees one region's memory. The caller has removed it from reg.
func (c *CUDA) release(rec *regionRec) error {
	return c.call(func() error {
		switch {
		case rec.kind == memHost:
			return c.drv.check("cuMemFreeHost", c.drv.cuMemFreeHost(unsafe.Pointer(unsafe.SliceData(rec.b))))
		case rec.ipc:
			return c.drv.check("cuIpcCloseMemHandle", c.drv.cuIpcCloseMemHandle(uint64(rec.base)))
		default:
			return c.drv.check("cuMemFree_v2", c.drv.cuMemFree(uint64(rec.base)))
		}
	})
}

// FreeDevice frees b, or closes its IPC mapping; see Backend.
func (c *CUDA) FreeDevice(b DeviceBuffer) error { return c.free(b.region, memDevice) }

// FreeHost frees pinned memory; see Backend.
func (c *CUDA) FreeHost(b HostBuffer) error { return c.free(b.region, memHost) }

// free unregisters the region (refused with ErrBusy while a copy using it is
// being issued), then waits for the device to go idle before releasing the
// memory, so that no copy still queued can touch it: frees are rare (pool
// setup and teardown), and a DMA into released pinned memory would corrupt
// whatever reuses it.
//
// It holds c.mu throughout, as the allocations do: a free that passed its
// closed check must end before Close takes the regions and releases the
// context (it called the driver on a released context, and the region
// was never freed).
func (c *CUDA) free(r region, kind memKind) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return fmt.Errorf("free %s: %w", kind, ErrClosed)
	}
	rec, err := c.reg.remove(r.ptr, r.n, kind)
	if err != nil {
		return err
	}
	if err := c.call(func() error { return c.drv.check("cuCtxSynchronize", c.drv.cuCtxSynchronize()) }); err != nil {
		c.log.Warn("offload backend: synchronize before free failed", "err", err)
	}
	if err := c.release(rec); err != nil {
		return fmt.Errorf("free %s %#x+%d: %w", kind, r.ptr, r.n, err)
	}
	return nil
}

// ExportIPC returns b's CUipcMemHandle. It holds c.mu, as free does: the
// memory can be neither freed nor released by Close meanwhile.
func (c *CUDA) ExportIPC(b DeviceBuffer) (IPCHandle, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return nil, fmt.Errorf("export IPC: %w", ErrClosed)
	}
	rec, ok := c.reg.lookup(b.ptr, b.n, memDevice)
	if !ok {
		return nil, fmt.Errorf("export IPC %#x+%d: %w", b.ptr, b.n, ErrBadHandle)
	}
	if rec.ipc {
		return nil, fmt.Errorf("export IPC %#x+%d: memory mapped from another process: %w", b.ptr, b.n, ErrUnsupported)
	}
	var h cuIpcMemHandle
	if err := c.call(func() error {
		return c.drv.check("cuIpcGetMemHandle", c.drv.cuIpcGetMemHandle(&h, uint64(rec.base)))
	}); err != nil {
		return nil, fmt.Errorf("export IPC %#x+%d: %w", b.ptr, b.n, err)
	}
	return IPCHandle(bytes.Clone(h.reserved[:])), nil
}

// OpenIPCHandle maps another process's device memory with cuIpcOpenMemHandle
// and checks with cuMemGetAddressRange that it holds at least n bytes.
// CUDA refuses to open a handle in the process that exported it.
func (c *CUDA) OpenIPCHandle(hd IPCHandle, n int) (DeviceBuffer, error) {
	if len(hd) != cuIpcHandleSize || n <= 0 {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle (%d bytes, size %d): want %d bytes and a size > 0: %w",
			len(hd), n, cuIpcHandleSize, ErrInvalidArgument)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle: %w", ErrClosed)
	}
	var h cuIpcMemHandle
	copy(h.reserved[:], hd)
	var d, base uint64
	var size uintptr
	err := c.call(func() error {
		if err := c.drv.check("cuIpcOpenMemHandle_v2", c.drv.cuIpcOpenMemHandle(&d, h, cuIpcMemLazyEnablePeerAccess)); err != nil {
			return err
		}
		err := c.drv.check("cuMemGetAddressRange_v2", c.drv.cuMemGetAddressRange(&base, &size, d))
		if err == nil && (base != d || uint64(size) < uint64(n)) {
			err = fmt.Errorf("exported allocation holds %d bytes from %#x, want %d from %#x: %w",
				size, base, n, d, ErrOutOfRange)
		}
		if err != nil {
			c.drv.cuIpcCloseMemHandle(d)
		}
		return err
	})
	if err != nil {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle: %w", err)
	}
	rec := &regionRec{base: Ptr(d), n: n, kind: memDevice, ipc: true, fd: -1}
	if err := c.reg.add(rec); err != nil {
		c.release(rec)
		return DeviceBuffer{}, err
	}
	return DeviceBuffer{region{rec.base, n}}, nil
}

type cudaStream struct {
	owner     *CUDA
	mu        sync.RWMutex // read-held while the handle is in use; write-held to destroy it
	h         uintptr
	destroyed bool
}

func (*cudaStream) isStream() {}

// NewStream creates a non-blocking stream (it does not synchronise with the
// legacy default stream that other libraries in the process may use).
func (c *CUDA) NewStream() (Stream, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return nil, fmt.Errorf("new stream: %w", ErrClosed)
	}
	s := &cudaStream{owner: c}
	if err := c.call(func() error { return c.drv.check("cuStreamCreate", c.drv.cuStreamCreate(&s.h, cuStreamNonBlocking)) }); err != nil {
		return nil, fmt.Errorf("new stream: %w", err)
	}
	c.streams[s] = struct{}{}
	return s, nil
}

// useStream read-locks a live stream of c; the caller must RUnlock it.
func (c *CUDA) useStream(s Stream) (*cudaStream, error) {
	cs, ok := s.(*cudaStream)
	if !ok || cs == nil || cs.owner != c {
		return nil, fmt.Errorf("stream %T: %w", s, ErrBadHandle)
	}
	if c.closed.Load() {
		return nil, ErrClosed
	}
	cs.mu.RLock()
	if cs.destroyed {
		cs.mu.RUnlock()
		return nil, fmt.Errorf("stream destroyed: %w", ErrBadHandle)
	}
	return cs, nil
}

// DestroyStream destroys s; queued copies still complete.
func (c *CUDA) DestroyStream(s Stream) error {
	cs, err := c.useStream(s)
	if err != nil {
		return fmt.Errorf("destroy stream: %w", err)
	}
	cs.mu.RUnlock()
	// Destroy before forgetting, so that a concurrent Close either waits for
	// this stream's users or finds it already destroyed.
	err = c.destroyStream(cs)
	c.mu.Lock()
	delete(c.streams, cs)
	c.mu.Unlock()
	return err
}

func (c *CUDA) destroyStream(cs *cudaStream) error {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.destroyed {
		return fmt.Errorf("destroy stream: %w", ErrBadHandle)
	}
	cs.destroyed = true
	return c.call(func() error { return c.drv.check("cuStreamDestroy_v2", c.drv.cuStreamDestroy(cs.h)) })
}

// CopyAsync queues one copy; see Backend.
func (c *CUDA) CopyAsync(s Stream, dst, src Ptr, n int) error {
	var one [1]resolved
	return c.copyBatch(s, []Copy{{Dst: dst, Src: src, N: n}}, one[:0])
}

// CopyBatchAsync queues the copies under one context switch. Every copy is
// checked before any is queued; after a driver error part-way it waits for
// the copies queued before it (cuStreamSynchronize), so that none is still
// running when the caller gives the failed batch's buffers back.
func (c *CUDA) CopyBatchAsync(s Stream, copies []Copy) error {
	return c.copyBatch(s, copies, make([]resolved, 0, len(copies)))
}

func (c *CUDA) copyBatch(s Stream, copies []Copy, buf []resolved) error {
	cs, err := c.useStream(s)
	if err != nil {
		return fmt.Errorf("copy: %w", err)
	}
	defer cs.mu.RUnlock()
	// Pinned while the copies are being issued, so a racing free cannot
	// release the memory between the check and the driver call; free then
	// waits for the device (cuCtxSynchronize) before releasing anything.
	rs, err := c.reg.resolve(copies, true, buf)
	if err != nil {
		return err
	}
	defer unpin(rs)
	if err := c.enter(); err != nil {
		return fmt.Errorf("copy: %w", err)
	}
	defer c.leave()
	d := c.drv
	for i, rc := range rs {
		dst, src, n := uintptr(rc.dst.base)+uintptr(rc.dstOff), uintptr(rc.src.base)+uintptr(rc.srcOff), uintptr(rc.n)
		var op string
		var r cuResult
		switch {
		case rc.dst.kind == memHost && rc.src.kind == memDevice:
			op, r = "cuMemcpyDtoHAsync_v2", d.cuMemcpyDtoHAsync(dst, uint64(src), n, cs.h)
		case rc.dst.kind == memDevice && rc.src.kind == memHost:
			op, r = "cuMemcpyHtoDAsync_v2", d.cuMemcpyHtoDAsync(uint64(dst), src, n, cs.h)
		case rc.dst.kind == memDevice:
			op, r = "cuMemcpyDtoDAsync_v2", d.cuMemcpyDtoDAsync(uint64(dst), uint64(src), n, cs.h)
		default:
			op, r = "cuMemcpyAsync", d.cuMemcpyAsync(uint64(dst), uint64(src), n, cs.h)
		}
		if err := d.check(op, r); err != nil {
			err = fmt.Errorf("copy %d of %d (%d queued): %w", i, len(rs), i, err)
			if i > 0 {
				err = errors.Join(err, d.check("cuStreamSynchronize", d.cuStreamSynchronize(cs.h)))
			}
			return err
		}
	}
	return nil
}

// SynchronizeStream waits with cuStreamSynchronize.
func (c *CUDA) SynchronizeStream(s Stream) error {
	cs, err := c.useStream(s)
	if err != nil {
		return fmt.Errorf("synchronize stream: %w", err)
	}
	defer cs.mu.RUnlock()
	return c.call(func() error { return c.drv.check("cuStreamSynchronize", c.drv.cuStreamSynchronize(cs.h)) })
}

type cudaEvent struct {
	owner     *CUDA
	mu        sync.RWMutex
	h         uintptr
	destroyed bool
}

func (*cudaEvent) isEvent() {}

// NewEvent creates an event without timing and with blocking sync, so that
// Synchronize sleeps in the driver instead of spinning a CPU core.
func (c *CUDA) NewEvent() (Event, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed.Load() {
		return nil, fmt.Errorf("new event: %w", ErrClosed)
	}
	e := &cudaEvent{owner: c}
	if err := c.call(func() error {
		return c.drv.check("cuEventCreate", c.drv.cuEventCreate(&e.h, cuEventDisableTiming|cuEventBlockingSync))
	}); err != nil {
		return nil, fmt.Errorf("new event: %w", err)
	}
	c.events[e] = struct{}{}
	return e, nil
}

func (c *CUDA) useEvent(e Event) (*cudaEvent, error) {
	ce, ok := e.(*cudaEvent)
	if !ok || ce == nil || ce.owner != c {
		return nil, fmt.Errorf("event %T: %w", e, ErrBadHandle)
	}
	if c.closed.Load() {
		return nil, ErrClosed
	}
	ce.mu.RLock()
	if ce.destroyed {
		ce.mu.RUnlock()
		return nil, fmt.Errorf("event destroyed: %w", ErrBadHandle)
	}
	return ce, nil
}

// Record records e on s with cuEventRecord.
func (c *CUDA) Record(e Event, s Stream) error {
	ce, err := c.useEvent(e)
	if err != nil {
		return fmt.Errorf("record: %w", err)
	}
	defer ce.mu.RUnlock()
	cs, err := c.useStream(s)
	if err != nil {
		return fmt.Errorf("record: %w", err)
	}
	defer cs.mu.RUnlock()
	return c.call(func() error { return c.drv.check("cuEventRecord", c.drv.cuEventRecord(ce.h, cs.h)) })
}

// Query asks cuEventQuery.
func (c *CUDA) Query(e Event) (bool, error) {
	ce, err := c.useEvent(e)
	if err != nil {
		return false, fmt.Errorf("query: %w", err)
	}
	defer ce.mu.RUnlock()
	var r cuResult
	if err := c.call(func() error { r = c.drv.cuEventQuery(ce.h); return nil }); err != nil {
		return false, fmt.Errorf("query: %w", err)
	}
	switch r {
	case cudaSuccess:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	default:
		return false, fmt.Errorf("query: %w", c.drv.check("cuEventQuery", r))
	}
}

// Synchronize waits with cuEventSynchronize.
func (c *CUDA) Synchronize(e Event) error {
	ce, err := c.useEvent(e)
	if err != nil {
		return fmt.Errorf("synchronize: %w", err)
	}
	defer ce.mu.RUnlock()
	return c.call(func() error { return c.drv.check("cuEventSynchronize", c.drv.cuEventSynchronize(ce.h)) })
}

// DestroyEvent destroys e with cuEventDestroy.
func (c *CUDA) DestroyEvent(e Event) error {
	ce, err := c.useEvent(e)
	if err != nil {
		return fmt.Errorf("destroy event: %w", err)
	}
	ce.mu.RUnlock()
	err = c.destroyEvent(ce)
	c.mu.Lock()
	delete(c.events, ce)
	c.mu.Unlock()
	return err
}

func (c *CUDA) destroyEvent(ce *cudaEvent) error {
	ce.mu.Lock()
	defer ce.mu.Unlock()
	if ce.destroyed {
		return fmt.Errorf("destroy event: %w", ErrBadHandle)
	}
	ce.destroyed = true
	return c.call(func() error { return c.drv.check("cuEventDestroy_v2", c.drv.cuEventDestroy(ce.h)) })
}

// Close destroys streams and events, waits for the device, frees every
// region and releases the primary context.
func (c *CUDA) Close() error {
	c.mu.Lock()
	if c.closed.Swap(true) {
		c.mu.Unlock()
		return nil
	}
	streams, events := c.streams, c.events
	c.streams, c.events = nil, nil
	c.mu.Unlock()

	var errs []error
	// Destroying takes each handle's write lock, so calls still using a
	// handle finish first; none can start after closed was set.
	for s := range streams {
		if err := c.destroyStream(s); err != nil && !errors.Is(err, ErrBadHandle) {
			errs = append(errs, err)
		}
	}
	for e := range events {
		if err := c.destroyEvent(e); err != nil && !errors.Is(err, ErrBadHandle) {
			errs = append(errs, err)
		}
	}
	if err := c.call(func() error { return c.drv.check("cuCtxSynchronize", c.drv.cuCtxSynchronize()) }); err != nil {
		errs = append(errs, err)
	}
	for _, rec := range c.reg.takeAll() {
		if err := c.release(rec); err != nil {
			errs = append(errs, err)
		}
	}
	if err := c.drv.check("cuDevicePrimaryCtxRelease_v2", c.drv.cuDevicePrimaryCtxRelease(c.dev)); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close %s: %w", c.name, err)
	}
	return nil
}
