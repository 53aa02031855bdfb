package backend

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
)

var (
	// ErrNoCUDA means CUDA was asked for but the driver library is missing,
	// fails to initialise or reports no device; the error wraps the reason.
	ErrNoCUDA = errors.New("CUDA not available")
	// ErrClosed means the Backend was closed.
	ErrClosed = errors.New("backend closed")
	// ErrInvalidArgument means an argument can never be valid: a nil pointer,
	// a size of zero or less, a malformed IPC handle, overlapping copy ranges.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrOutOfRange means a pointer and length do not lie inside one live
	// region of this Backend (an unknown pointer, a freed region, or a copy
	// that runs past the end of its region).
	ErrOutOfRange = errors.New("address range not inside a live region")
	// ErrBadHandle means a Stream, Event or buffer is nil, was destroyed or
	// freed, or belongs to another Backend.
	ErrBadHandle = errors.New("unknown or destroyed handle")
	// ErrBusy means a region cannot be freed while copies that use it are
	// still queued or running; wait for their events and free it again.
	ErrBusy = errors.New("region has copies in flight")
	// ErrOutOfMemory means an allocation failed for lack of memory.
	ErrOutOfMemory = errors.New("out of memory")
	// ErrUnsupported means this Backend cannot do that on this platform.
	ErrUnsupported = errors.New("not supported")
	// ErrFault means a copy touched memory that has no pages behind it any
	// more: the file behind a region from OpenIPCHandle shrank (an engine
	// that restarted re-created its shm file), or (host) was removed from
	// its path, as by an engine that re-creates it with unlink and create.
	// The copy fails; the process and the stream live on.
	ErrFault = errors.New("memory fault: the file behind a mapped region shrank or was removed")
)

// Kind names a Backend implementation.
type Kind string

const (
	// KindAuto picks KindCUDA when Detect finds a GPU, KindHost otherwise.
	KindAuto Kind = "auto"
	// KindHost copies host memory with copy(); it works everywhere.
	KindHost Kind = "host"
	// KindCUDA copies with the CUDA driver API on GPU 0.
	KindCUDA Kind = "cuda"
)

// ParseKind turns a flag value ("auto", "host", "cuda") into a Kind.
func ParseKind(s string) (Kind, error) {
	switch k := Kind(strings.ToLower(strings.TrimSpace(s))); k {
	case KindAuto, KindHost, KindCUDA:
		return k, nil
	case "":
		return KindAuto, nil
	default:
		return "", fmt.Errorf("backend kind %q (want auto, host or cuda): %w", s, ErrInvalidArgument)
	}
}

// Ptr is an address in a Backend's memory: a device address (CUdeviceptr) or
// a host address. It is an integer, so the Go garbage collector never follows
// it; the region it points into is kept alive by the Backend until freed.
type Ptr uintptr

// Add returns p advanced by off bytes.
func (p Ptr) Add(off int) Ptr { return p + Ptr(off) }

// region is the part shared by HostBuffer and DeviceBuffer.
type region struct {
	ptr Ptr
	n   int
}

// Ptr is the address of the first byte.
func (r region) Ptr() Ptr { return r.ptr }

// Len is the size in bytes.
func (r region) Len() int { return r.n }

// At returns the address off bytes into the region. It does not check off;
// copies check every range they are given.
func (r region) At(off int) Ptr { return r.ptr.Add(off) }

// A DeviceBuffer is memory on the copy device: GPU memory for cuda, a shared
// memory mapping for host. The host cannot read it directly.
type DeviceBuffer struct{ region }

// A HostBuffer is host memory the device copies to and from at full speed:
// pinned (page-locked) for cuda, page-aligned for host.
type HostBuffer struct {
	region
	b []byte
}

// Bytes is the host's view of the buffer. It is valid until FreeHost or
// Close; reading it while a copy into it is in flight reads torn data.
func (h HostBuffer) Bytes() []byte { return h.b }

// IPCHandle names device memory so that another process can map it: the 64
// bytes of a CUipcMemHandle for cuda, a file path for host.
type IPCHandle []byte

// A Stream is an ordered queue of copies on one Backend. It is created by
// NewStream and is only valid with the Backend that made it.
type Stream interface{ isStream() }

// An Event marks a point in a Stream. It is created by NewEvent, placed by
// Record and fires when every copy queued on that stream before the Record
// has finished.
type Event interface{ isEvent() }

// Copy is one copy of a batch: N bytes from Src to Dst.
type Copy struct {
	Dst, Src Ptr
	N        int
}

// A Backend copies KV blocks between memory tiers.
//
// All methods are safe for concurrent use. Sizes are in bytes. No method
// panics on bad input: it returns an error wrapping one of the sentinel
// errors of this package (or a *CUDAError).
type Backend interface {
	// Kind is KindHost or KindCUDA.
	Kind() Kind

	// Name describes the backend for logs, e.g. "cuda:0 NVIDIA H200".
	Name() string

	// AllocDevice allocates n > 0 bytes of device memory. The contents are
	// undefined. It fails with ErrOutOfMemory when the device is full.
	AllocDevice(n int) (DeviceBuffer, error)

	// FreeDevice releases a DeviceBuffer from AllocDevice, or unmaps one from
	// OpenIPCHandle (the exporter's memory stays). Copies using it should have
	// finished: host refuses with ErrBusy while any is queued; cuda refuses
	// while one is being issued and otherwise waits for the device to go
	// idle first. Freeing twice fails with ErrBadHandle.
	FreeDevice(b DeviceBuffer) error

	// AllocHost allocates n > 0 bytes of host memory for copies: pinned and
	// portable for cuda, page-aligned for host. The contents are undefined.
	AllocHost(n int) (HostBuffer, error)

	// FreeHost releases a HostBuffer. Every copy using it must have finished
	// (see FreeDevice); afterwards its Bytes must not be touched.
	FreeHost(b HostBuffer) error

	// NewStream creates a stream. Streams are cheap enough to keep one per
	// copy worker, not cheap enough to make one per copy.
	NewStream() (Stream, error)

	// DestroyStream destroys s. Copies already queued still complete and
	// events already recorded on s still fire. It may block until they do.
	DestroyStream(s Stream) error

	// CopyAsync starts copying n bytes from src to dst on stream s and returns
	// at once. The copy is complete when an Event recorded after it fires.
	// src and dst must stay valid until then. It never blocks on the copy.
	// Either pointer may be device or host memory of this Backend (D2H, H2D,
	// D2D, H2H); the direction follows from the regions they lie in. The two
	// ranges must not overlap.
	CopyAsync(s Stream, dst, src Ptr, n int) error

	// CopyBatchAsync queues many copies on s as CopyAsync does, in order, for
	// the cost of one call. It checks every copy first and queues none if any
	// is invalid. If the driver then fails one, it waits for those queued
	// before it: on any error, no copy of the batch is still running when it
	// returns, so the caller may give the batch's buffers back at once.
	CopyBatchAsync(s Stream, copies []Copy) error

	// SynchronizeStream blocks until every copy queued on s has finished.
	// It returns an error of those copies (host: only of those queued
	// since the last Record on s; the events report the others).
	SynchronizeStream(s Stream) error

	// NewEvent creates an event. An event that was never recorded counts as
	// fired. An event may be recorded again; it then tracks the new point.
	NewEvent() (Event, error)

	// Record places e on s after every copy queued on s so far.
	Record(e Event, s Stream) error

	// Query reports, without blocking, whether e has fired. An error from a
	// copy before e (cuda reports device faults this way; host, ErrFault
	// for a copy queued between the previous Record on the stream and e)
	// is returned here.
	Query(e Event) (done bool, err error)

	// Synchronize blocks until e has fired and returns the error Query
	// would. It does not spin a CPU.
	Synchronize(e Event) error

	// DestroyEvent destroys e. Destroying an event that has not fired is
	// allowed; the copies before it still complete.
	DestroyEvent(e Event) error

	// ExportIPC returns a handle by which another process maps b with
	// OpenIPCHandle. b must come from AllocDevice of this Backend. The handle
	// is valid while b is.
	ExportIPC(b DeviceBuffer) (IPCHandle, error)

	// OpenIPCHandle maps device memory exported by another process (for cuda:
	// a CUipcMemHandle; for host: the path of a shared memory file, such as
	// one under /dev/shm) and returns its first n bytes as a DeviceBuffer.
	// It fails with ErrOutOfRange when the exported memory is shorter than n.
	// Release the mapping with FreeDevice. Map each handle once per process:
	// CUDA hands a second open the same mapping, which is refused here.
	OpenIPCHandle(h IPCHandle, n int) (DeviceBuffer, error)

	// Close waits for queued copies, releases every stream, event and region
	// of the Backend and stops its goroutines. Later calls return ErrClosed;
	// a second Close returns nil.
	Close() error
}

// Open opens a Backend of the given kind. KindAuto picks cuda when Detect
// finds a GPU and host otherwise; KindCUDA fails with an error wrapping
// ErrNoCUDA when the driver or a device is missing. On an error the
// Backend is nil.
func Open(kind Kind) (Backend, error) { return OpenWith(kind, nil) }

// OpenWith is Open logging through log (nil: slog.Default()): the kind
// KindAuto picked and why, and what the backend opened logs.
func OpenWith(kind Kind, log *slog.Logger) (Backend, error) {
	return OpenDevice(kind, 0, log)
}

// cudaLibrary is the driver OpenDevice and Detect load: libcuda.so.1, or
// the fake driver of a test that checks what reaches it (export_test.go).
var cudaLibrary = defaultCUDALibrary

// OpenDevice is OpenWith on CUDA device ordinal dev (as the driver numbers
// devices, after CUDA_VISIBLE_DEVICES) when the kind is or picks cuda.
// KindAuto falls back to host copies, logging why, when dev is not there.
func OpenDevice(kind Kind, dev int, log *slog.Logger) (Backend, error) {
	if log == nil {
		log = slog.Default()
	}
	switch kind {
	case KindAuto, "":
		if err := probeCUDA(cudaLibrary); err != nil {
			log.Info("offload backend: using host copies", "reason", err)
			return NewHost()
		}
		b, err := OpenCUDA(CUDAConfig{Library: cudaLibrary, Device: dev, Logger: log})
		if err != nil {
			log.Warn("offload backend: CUDA found but failed to open, using host copies", "err", err)
			return NewHost()
		}
		return b, nil
	case KindHost:
		return NewHost()
	case KindCUDA:
		b, err := OpenCUDA(CUDAConfig{Library: cudaLibrary, Device: dev, Logger: log})
		if err != nil {
			return nil, err // not b: a nil *CUDA is a non-nil Backend
		}
		return b, nil
	default:
		return nil, fmt.Errorf("open backend %q: %w", kind, ErrInvalidArgument)
	}
}

// Detect reports the kind Open(KindAuto) would pick: KindCUDA when
// libcuda.so.1 loads, initialises and reports at least one device, KindHost
// otherwise. It creates no CUDA context.
func Detect() Kind {
	if err := probeCUDA(cudaLibrary); err != nil {
		slog.Debug("offload backend: no CUDA", "reason", err)
		return KindHost
	}
	return KindCUDA
}
