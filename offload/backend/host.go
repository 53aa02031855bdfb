package backend

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Host is the Backend that works everywhere: device and host memory are both
// host memory from mmap, and each stream is a worker goroutine that runs its
// queued copies with copy(), in order.
//
// "Device" memory is a shared mapping (a memfd on Linux) so that ExportIPC
// can hand it to another process; host memory is a private anonymous
// mapping. Both are page-aligned and never seen by the Go garbage collector.
type Host struct {
	reg    registry
	closed atomic.Bool

	mu      sync.Mutex // guards the sets below and orders Alloc against Close
	streams map[*hostStream]struct{}
	events  map[*hostEvent]struct{}
}

var _ Backend = (*Host)(nil)

// NewHost returns a host Backend. It starts no goroutine until NewStream.
func NewHost() (*Host, error) {
	return &Host{
		streams: make(map[*hostStream]struct{}),
		events:  make(map[*hostEvent]struct{}),
	}, nil
}

// Kind is KindHost.
func (h *Host) Kind() Kind { return KindHost }

// Name is "host".
func (h *Host) Name() string { return "host" }

// AllocDevice maps n bytes of shared memory that ExportIPC can share.
func (h *Host) AllocDevice(n int) (DeviceBuffer, error) {
	rec, err := h.alloc(n, memDevice)
	if err != nil {
		return DeviceBuffer{}, err
	}
	return DeviceBuffer{region{rec.base, rec.n}}, nil
}

// AllocHost maps n bytes of private, page-aligned memory.
func (h *Host) AllocHost(n int) (HostBuffer, error) {
	rec, err := h.alloc(n, memHost)
	if err != nil {
		return HostBuffer{}, err
	}
	return HostBuffer{region{rec.base, rec.n}, rec.b}, nil
}

func (h *Host) alloc(n int, kind memKind) (*regionRec, error) {
	if n <= 0 {
		return nil, fmt.Errorf("alloc %s %d bytes: %w", kind, n, ErrInvalidArgument)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return nil, fmt.Errorf("alloc %s: %w", kind, ErrClosed)
	}
	var (
		b   []byte
		fd  = -1
		err error
	)
	if kind == memDevice {
		b, fd, err = mapShared(n)
	} else {
		b, err = unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANON)
	}
	if err != nil {
		if errors.Is(err, unix.ENOMEM) || errors.Is(err, unix.EFBIG) || errors.Is(err, unix.EINVAL) {
			err = fmt.Errorf("%w (%w)", ErrOutOfMemory, err)
		}
		return nil, fmt.Errorf("alloc %s %d bytes: %w", kind, n, err)
	}
	rec := &regionRec{base: Ptr(unsafe.Pointer(unsafe.SliceData(b))), n: n, kind: kind, b: b, fd: fd}
	if err := h.reg.add(rec); err != nil {
		releaseHost(rec)
		return nil, err
	}
	return rec, nil
}

// FreeDevice unmaps b; see Backend.
func (h *Host) FreeDevice(b DeviceBuffer) error { return h.free(b.region, memDevice) }

// FreeHost unmaps b; see Backend.
func (h *Host) FreeHost(b HostBuffer) error { return h.free(b.region, memHost) }

func (h *Host) free(r region, kind memKind) error {
	if h.closed.Load() {
		return fmt.Errorf("free %s: %w", kind, ErrClosed)
	}
	rec, err := h.reg.remove(r.ptr, r.n, kind)
	if err != nil {
		return err
	}
	return releaseHost(rec)
}

func releaseHost(rec *regionRec) error {
	var errs []error
	if err := unix.Munmap(rec.b); err != nil {
		errs = append(errs, fmt.Errorf("munmap %#x+%d: %w", rec.base, rec.n, err))
	}
	if rec.fd >= 0 {
		if err := unix.Close(rec.fd); err != nil {
			errs = append(errs, fmt.Errorf("close memfd %d: %w", rec.fd, err))
		}
	}
	return errors.Join(errs...)
}

// ExportIPC returns the path of b's memfd under /proc, which any process
// allowed to read this one's file descriptors can map with OpenIPCHandle.
func (h *Host) ExportIPC(b DeviceBuffer) (IPCHandle, error) {
	if h.closed.Load() {
		return nil, fmt.Errorf("export IPC: %w", ErrClosed)
	}
	rec, ok := h.reg.lookup(b.ptr, b.n, memDevice)
	if !ok {
		return nil, fmt.Errorf("export IPC %#x+%d: %w", b.ptr, b.n, ErrBadHandle)
	}
	if rec.ipc || rec.fd < 0 {
		return nil, fmt.Errorf("export IPC %#x+%d: not memory from AllocDevice with a memfd: %w",
			b.ptr, b.n, ErrUnsupported)
	}
	return IPCHandle(fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), rec.fd)), nil
}

// OpenIPCHandle maps the first n bytes of the file named by h (a path, such
// as /dev/shm/worker-3 or a handle from ExportIPC) shared and read-write.
//
// The file stays open with the mapping: the file may shrink under it (an
// engine that restarts re-creates its file with O_TRUNC), and each batch
// that copies to or from the region checks the file's size first, so that
// the common case of a shrunk file is an ErrFault from CopyBatchAsync
// rather than a fault in the middle of a copy.
func (h *Host) OpenIPCHandle(hd IPCHandle, n int) (DeviceBuffer, error) {
	path := strings.TrimRight(string(hd), "\x00") // C callers may NUL-pad a fixed buffer
	if n <= 0 || path == "" || path[0] != '/' || len(path) > 4096 {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle %q size %d: want an absolute path and a size > 0: %w",
			path, n, ErrInvalidArgument)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle: %w", ErrClosed)
	}
	b, fd, linked, err := mapFile(path, n)
	if err != nil {
		return DeviceBuffer{}, fmt.Errorf("open IPC handle %q: %w", path, err)
	}
	rec := &regionRec{base: Ptr(unsafe.Pointer(unsafe.SliceData(b))), n: n, kind: memDevice, ipc: true, b: b, fd: fd,
		linked: linked}
	if err := h.reg.add(rec); err != nil {
		releaseHost(rec)
		return DeviceBuffer{}, err
	}
	return DeviceBuffer{region{rec.base, n}}, nil
}

// mapFile maps the first n bytes of path shared and read-write, and returns
// the mapping, the file, kept open for checkBacking, and whether the file
// has a name (a link count above 0: not a memfd, nor a file already
// removed).
func mapFile(path string, n int) ([]byte, int, bool, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, -1, false, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, -1, false, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, -1, false, fmt.Errorf("not a regular file: %w", ErrInvalidArgument)
	}
	if st.Size < int64(n) {
		unix.Close(fd)
		return nil, -1, false, fmt.Errorf("file holds %d bytes, want %d: %w", st.Size, n, ErrOutOfRange)
	}
	b, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, -1, false, err
	}
	return b, fd, st.Nlink > 0, nil
}

// checkBacking fails with ErrFault when the file behind a region of rs
// mapped by OpenIPCHandle is now shorter than the mapping: touching the
// missing pages would raise SIGBUS. It is the cheap, common-case check (one
// fstat per region per batch); a file that shrinks after it is caught by
// copyJob. It fails the same way when the file, named when mapped, has no
// name left: an engine that restarts may remove its file and create a new
// one at the same path, and the mapping of the old one, whole, would copy
// the dead engine's bytes out and the agent's into memory nobody reads.
// The link count comes with the same fstat; a file that was never named
// (a memfd, as ExportIPC's) is not checked.
func checkBacking(rs []resolved) error {
	var last *regionRec
	for _, rc := range rs {
		for _, rec := range [2]*regionRec{rc.dst, rc.src} {
			if !rec.ipc || rec == last {
				continue
			}
			last = rec
			var st unix.Stat_t
			if err := unix.Fstat(rec.fd, &st); err != nil {
				return fmt.Errorf("copy: stat the file behind region %#x+%d: %w", rec.base, rec.n, err)
			}
			if st.Size < int64(rec.n) {
				return fmt.Errorf("copy: the file behind region %#x+%d holds %d bytes now: %w",
					rec.base, rec.n, st.Size, ErrFault)
			}
			if rec.linked && st.Nlink == 0 {
				return fmt.Errorf("copy: the file behind region %#x+%d has been removed (re-created at its path?): %w",
					rec.base, rec.n, ErrFault)
			}
		}
	}
	return nil
}

// copyJob runs a job's copies in order and stops at the first that faults.
//
// A region from OpenIPCHandle is a shared mapping of another process's
// file; if that file shrinks (after checkBacking passed), touching the
// pages past its end raises SIGBUS, which by default kills the whole
// process. With SetPanicOnFault the fault becomes a panic of this goroutine
// instead, recovered here into an error. The setting is per goroutine; the
// caller's is restored.
func copyJob(copies []resolved) (err error) {
	i := 0
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		re, ok := r.(runtime.Error)
		addr, isFault := r.(interface{ Addr() uintptr })
		if !ok || !isFault {
			panic(r) // not a memory fault: a bug, not bad input
		}
		c := copies[i]
		err = fmt.Errorf("copy %d: %s %#x+%d to %s %#x+%d: fault at %#x (%v): %w",
			i, c.src.kind, c.src.base.Add(c.srcOff), c.n, c.dst.kind, c.dst.base.Add(c.dstOff), c.n,
			addr.Addr(), re, ErrFault)
	}()
	for ; i < len(copies); i++ {
		c := copies[i]
		copy(c.dst.b[c.dstOff:c.dstOff+c.n], c.src.b[c.srcOff:c.srcOff+c.n])
	}
	return nil
}

// A hostStream is a FIFO of copy jobs drained by one goroutine.
//
// submitted numbers the jobs queued so far and completed the last one
// finished; an event is a mark (stream, value of submitted when recorded),
// and it has fired once completed reaches that value. Nothing else is
// needed for ordering because a stream runs its jobs strictly in order.
//
// A job that fails (ErrFault) is reported by the event recorded after it:
// each mark covers the jobs since the previous Record on the stream. The
// failure of a job not yet covered waits in faults for the next Record (or
// SynchronizeStream); one already covered is written into its mark, which
// stays in marks until it has fired. A failed job does not fail the
// stream: later jobs run and report on their own.
type hostStream struct {
	owner *Host

	mu        sync.Mutex
	work      sync.Cond // signalled when a job is queued or closing is set
	done      sync.Cond // broadcast when completed advances
	queue     []hostJob
	submitted uint64
	completed uint64
	recorded  uint64      // submitted at the latest Record
	marks     []*hostMark // recorded and not yet fired, ascending seq
	faults    []error     // failures of jobs after recorded
	closing   bool

	exited chan struct{}
}

// A hostMark is where an event was recorded: it fires when the stream's
// job seq has finished, and reports the first failure of the jobs in
// (from, seq]. err is guarded by s.mu.
type hostMark struct {
	s         *hostStream
	from, seq uint64
	err       error
}

type hostJob struct {
	seq    uint64
	copies []resolved
}

func (*hostStream) isStream() {}

// NewStream starts a worker goroutine for the stream.
func (h *Host) NewStream() (Stream, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return nil, fmt.Errorf("new stream: %w", ErrClosed)
	}
	s := &hostStream{owner: h, exited: make(chan struct{})}
	s.work.L = &s.mu
	s.done.L = &s.mu
	h.streams[s] = struct{}{}
	go s.run()
	return s, nil
}

func (s *hostStream) run() {
	defer close(s.exited)
	s.mu.Lock()
	for {
		for len(s.queue) == 0 && !s.closing {
			s.work.Wait()
		}
		if len(s.queue) == 0 { // closing, and drained
			s.mu.Unlock()
			return
		}
		job := s.queue[0]
		s.queue[0] = hostJob{}
		s.queue = s.queue[1:]
		s.mu.Unlock()

		err := copyJob(job.copies)
		unpin(job.copies)

		s.mu.Lock()
		if err != nil {
			s.failLocked(job.seq, err)
		}
		s.completed = job.seq
		fired := 0
		for fired < len(s.marks) && s.marks[fired].seq <= s.completed {
			fired++
		}
		s.marks = append(s.marks[:0], s.marks[fired:]...)
		s.done.Broadcast()
	}
}

// failLocked records that job seq failed with err, for the event that
// covers it. The caller holds s.mu.
func (s *hostStream) failLocked(seq uint64, err error) {
	err = fmt.Errorf("job %d: %w", seq, err)
	if seq > s.recorded {
		s.faults = append(s.faults, err)
		return
	}
	for _, m := range s.marks {
		if m.from < seq && seq <= m.seq && m.err == nil {
			m.err = err
		}
	}
}

// stop makes the worker exit once its queue is drained and waits for it.
func (s *hostStream) stop() {
	s.mu.Lock()
	s.closing = true
	s.work.Signal()
	s.mu.Unlock()
	<-s.exited
}

func (h *Host) stream(s Stream) (*hostStream, error) {
	hs, ok := s.(*hostStream)
	if !ok || hs == nil || hs.owner != h {
		return nil, fmt.Errorf("stream %T: %w", s, ErrBadHandle)
	}
	if h.closed.Load() {
		return nil, ErrClosed
	}
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if hs.closing {
		return nil, fmt.Errorf("stream destroyed: %w", ErrBadHandle)
	}
	return hs, nil
}

// DestroyStream waits for s's queued copies, then stops its goroutine.
func (h *Host) DestroyStream(s Stream) error {
	hs, err := h.stream(s)
	if err != nil {
		return fmt.Errorf("destroy stream: %w", err)
	}
	h.mu.Lock()
	_, live := h.streams[hs]
	h.mu.Unlock()
	if !live {
		return fmt.Errorf("destroy stream: already destroyed: %w", ErrBadHandle)
	}
	// Drain before forgetting the stream: until then a concurrent Close
	// still sees it and waits for its copies before unmapping regions.
	hs.stop()
	h.mu.Lock()
	delete(h.streams, hs)
	h.mu.Unlock()
	return nil
}

// CopyAsync queues one copy; see Backend.
func (h *Host) CopyAsync(s Stream, dst, src Ptr, n int) error {
	return h.CopyBatchAsync(s, []Copy{{Dst: dst, Src: src, N: n}})
}

// CopyBatchAsync queues the copies as one job of s; see Backend.
func (h *Host) CopyBatchAsync(s Stream, copies []Copy) error {
	hs, err := h.stream(s)
	if err != nil {
		return fmt.Errorf("copy: %w", err)
	}
	rs, err := h.reg.resolve(copies, true, make([]resolved, 0, len(copies)))
	if err != nil {
		return err
	}
	if err := checkBacking(rs); err != nil {
		unpin(rs)
		return err
	}
	return hs.enqueue(rs)
}

// enqueue queues resolved, pinned copies as one job; on an error it unpins
// them.
func (hs *hostStream) enqueue(rs []resolved) error {
	hs.mu.Lock()
	if hs.closing {
		hs.mu.Unlock()
		unpin(rs)
		return fmt.Errorf("copy: stream destroyed: %w", ErrBadHandle)
	}
	hs.submitted++
	hs.queue = append(hs.queue, hostJob{seq: hs.submitted, copies: rs})
	hs.work.Signal()
	hs.mu.Unlock()
	return nil
}

// SynchronizeStream waits until s has run every copy queued so far.
func (h *Host) SynchronizeStream(s Stream) error {
	hs, err := h.stream(s)
	if err != nil {
		return fmt.Errorf("synchronize stream: %w", err)
	}
	hs.mu.Lock()
	hs.waitLocked(hs.submitted)
	faults := hs.faults
	hs.faults = nil
	hs.mu.Unlock()
	if len(faults) > 0 {
		return fmt.Errorf("synchronize stream: %w", errors.Join(faults...))
	}
	return nil
}

// waitLocked blocks until the job numbered seq has finished. Workers drain
// their queue even when the stream is being destroyed, so this always ends.
func (s *hostStream) waitLocked(seq uint64) {
	for s.completed < seq {
		s.done.Wait()
	}
}

type hostEvent struct {
	owner *Host

	mu        sync.Mutex
	m         *hostMark // nil until recorded
	destroyed bool
}

func (*hostEvent) isEvent() {}

// NewEvent creates an event that counts as fired until it is recorded.
func (h *Host) NewEvent() (Event, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed.Load() {
		return nil, fmt.Errorf("new event: %w", ErrClosed)
	}
	e := &hostEvent{owner: h}
	h.events[e] = struct{}{}
	return e, nil
}

func (h *Host) event(e Event) (*hostEvent, error) {
	he, ok := e.(*hostEvent)
	if !ok || he == nil || he.owner != h {
		return nil, fmt.Errorf("event %T: %w", e, ErrBadHandle)
	}
	if h.closed.Load() {
		return nil, ErrClosed
	}
	return he, nil
}

// target returns where e was recorded, or ErrBadHandle once destroyed.
func (he *hostEvent) target() (*hostMark, error) {
	he.mu.Lock()
	defer he.mu.Unlock()
	if he.destroyed {
		return nil, ErrBadHandle
	}
	return he.m, nil
}

// Record marks the end of the copies queued on s so far.
func (h *Host) Record(e Event, s Stream) error {
	he, err := h.event(e)
	if err != nil {
		return fmt.Errorf("record: %w", err)
	}
	hs, err := h.stream(s)
	if err != nil {
		return fmt.Errorf("record: %w", err)
	}
	if _, err := he.target(); err != nil {
		return fmt.Errorf("record: event destroyed: %w", err)
	}
	hs.mu.Lock()
	if hs.closing {
		hs.mu.Unlock()
		return fmt.Errorf("record: stream destroyed: %w", ErrBadHandle)
	}
	// The mark takes over the failures of the jobs since the last Record;
	// later failures of its jobs reach it through marks.
	m := &hostMark{s: hs, from: hs.recorded, seq: hs.submitted}
	if len(hs.faults) > 0 {
		m.err = hs.faults[0]
		hs.faults = nil
	}
	hs.recorded = m.seq
	if hs.completed < m.seq {
		hs.marks = append(hs.marks, m)
	}
	hs.mu.Unlock()
	he.mu.Lock()
	defer he.mu.Unlock()
	if he.destroyed {
		return fmt.Errorf("record: event destroyed: %w", ErrBadHandle)
	}
	he.m = m
	return nil
}

// Query reports whether the copies before e have finished.
func (h *Host) Query(e Event) (bool, error) {
	he, err := h.event(e)
	if err != nil {
		return false, fmt.Errorf("query: %w", err)
	}
	m, err := he.target()
	if err != nil {
		return false, fmt.Errorf("query: %w", err)
	}
	if m == nil {
		return true, nil
	}
	m.s.mu.Lock()
	done, err := m.s.completed >= m.seq, m.err
	m.s.mu.Unlock()
	if !done {
		return false, nil // report a failure once no copy before e runs
	}
	if err != nil {
		return true, fmt.Errorf("query: %w", err)
	}
	return true, nil
}

// Synchronize waits on a condition variable until e has fired.
func (h *Host) Synchronize(e Event) error {
	he, err := h.event(e)
	if err != nil {
		return fmt.Errorf("synchronize: %w", err)
	}
	m, err := he.target()
	if err != nil {
		return fmt.Errorf("synchronize: %w", err)
	}
	if m == nil {
		return nil
	}
	m.s.mu.Lock()
	m.s.waitLocked(m.seq)
	err = m.err
	m.s.mu.Unlock()
	if err != nil {
		return fmt.Errorf("synchronize: %w", err)
	}
	return nil
}

// DestroyEvent forgets e.
func (h *Host) DestroyEvent(e Event) error {
	he, err := h.event(e)
	if err != nil {
		return fmt.Errorf("destroy event: %w", err)
	}
	he.mu.Lock()
	was := he.destroyed
	he.destroyed = true
	he.mu.Unlock()
	if was {
		return fmt.Errorf("destroy event: already destroyed: %w", ErrBadHandle)
	}
	h.mu.Lock()
	delete(h.events, he)
	h.mu.Unlock()
	return nil
}

// Close drains and stops every stream, then unmaps every region.
func (h *Host) Close() error {
	h.mu.Lock()
	if h.closed.Swap(true) {
		h.mu.Unlock()
		return nil
	}
	streams := h.streams
	h.streams, h.events = nil, nil
	h.mu.Unlock()

	// Streams first: their queued copies still read and write the regions.
	for s := range streams {
		s.stop()
	}
	var errs []error
	for _, rec := range h.reg.takeAll() {
		if err := releaseHost(rec); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("close host backend: %w", err)
	}
	return nil
}
