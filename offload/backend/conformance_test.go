package backend_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// TestConformance runs the Backend contract against every backend this
// machine has: host always, the cuda backend on a fake libcuda when a C
// compiler is present, and on the real driver when Detect finds a GPU.
func TestConformance(t *testing.T) {
	for _, bc := range backendCases(t) {
		t.Run(bc.name, func(t *testing.T) {
			spec, skip := bc.prepare()
			if skip != "" {
				t.Skip(skip)
			}
			be := mustOpen(t, spec)
			t.Logf("backend %s", be.Name())
			t.Run("AllocatedBuffersAreAlignedAndFreedOnce", func(t *testing.T) { testAlloc(t, be) })
			t.Run("RoundTripKeepsEveryByte", func(t *testing.T) { testRoundTrip(t, be) })
			t.Run("EventFiresOnlyAfterItsCopies", func(t *testing.T) { testEventQuery(t, be) })
			t.Run("ScatteredBlockBatchesLandInPlace", func(t *testing.T) { testScatteredBatch(t, be) })
			t.Run("DeviceToDeviceAndHostToHost", func(t *testing.T) { testSameSideCopies(t, be) })
			t.Run("ManyStreamsCopyConcurrently", func(t *testing.T) { testManyStreams(t, be) })
			t.Run("DestroyedStreamStillFinishesQueuedCopies", func(t *testing.T) { testDestroyStreamDrains(t, be) })
			t.Run("BadArgumentsAreErrorsNotCrashes", func(t *testing.T) { testBadArgs(t, be) })
			t.Run("IPCRegionIsSharedWithExporter", func(t *testing.T) { testIPC(t, be, spec) })
			t.Run("ClosedBackendRefusesEveryCall", func(t *testing.T) { testClosed(t, spec) })
			t.Run("CloseDuringCopiesIsOrderly", func(t *testing.T) { testCloseUnderLoad(t, spec) })
		})
	}
}

func testAlloc(t *testing.T, be backend.Backend) {
	page := uintptr(os.Getpagesize())
	h := must(be.AllocHost(3*int(page) + 5)).ok(t)
	if h.Len() != 3*int(page)+5 || len(h.Bytes()) != h.Len() || h.Ptr() == 0 {
		t.Fatalf("host buffer len %d, bytes %d, ptr %#x", h.Len(), len(h.Bytes()), h.Ptr())
	}
	if uintptr(h.Ptr())%page != 0 {
		t.Errorf("host buffer at %#x is not page-aligned", h.Ptr())
	}
	fill(h.Bytes(), 1) // writable all the way to the end
	d := must(be.AllocDevice(1 << 20)).ok(t)
	if d.Len() != 1<<20 || d.Ptr() == 0 {
		t.Fatalf("device buffer len %d ptr %#x", d.Len(), d.Ptr())
	}
	check(t, be.FreeHost(h))
	check(t, be.FreeDevice(d))
	if err := be.FreeHost(h); !errors.Is(err, backend.ErrBadHandle) {
		t.Errorf("second FreeHost = %v, want ErrBadHandle", err)
	}
	if err := be.FreeDevice(d); !errors.Is(err, backend.ErrBadHandle) {
		t.Errorf("second FreeDevice = %v, want ErrBadHandle", err)
	}
}

func testRoundTrip(t *testing.T, be backend.Backend) {
	const n = 4<<20 + 24 // not a multiple of anything convenient
	src := must(be.AllocHost(n)).ok(t)
	dst := must(be.AllocHost(n)).ok(t)
	dev := must(be.AllocDevice(n)).ok(t)
	defer be.FreeHost(src)
	defer be.FreeHost(dst)
	defer be.FreeDevice(dev)
	fill(src.Bytes(), 2)
	clear(dst.Bytes())

	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)
	e := must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(e)

	check(t, be.CopyAsync(s, dev.Ptr(), src.Ptr(), n)) // H2D
	check(t, be.CopyAsync(s, dst.Ptr(), dev.Ptr(), n)) // D2H, ordered after it
	check(t, be.Record(e, s))
	check(t, be.Synchronize(e))
	if !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatal("bytes differ after H2D then D2H")
	}
	if done, err := be.Query(e); !done || err != nil {
		t.Fatalf("Query after Synchronize = %v, %v; want true, nil", done, err)
	}
}

func testEventQuery(t *testing.T, be backend.Backend) {
	fresh := must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(fresh)
	if done, err := be.Query(fresh); !done || err != nil {
		t.Fatalf("Query of a never-recorded event = %v, %v; want true, nil", done, err)
	}

	const block, blocks = 256 << 10, 16
	src := must(be.AllocHost(block * blocks)).ok(t)
	dst := must(be.AllocHost(block * blocks)).ok(t)
	dev := must(be.AllocDevice(block * blocks)).ok(t)
	defer be.FreeHost(src)
	defer be.FreeHost(dst)
	defer be.FreeDevice(dev)
	fill(src.Bytes(), 3)

	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)
	up, down := must(be.NewEvent()).ok(t), must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(up)
	defer be.DestroyEvent(down)
	for i := range blocks {
		check(t, be.CopyAsync(s, dev.At(i*block), src.At(i*block), block))
	}
	check(t, be.Record(up, s))
	for i := range blocks {
		check(t, be.CopyAsync(s, dst.At(i*block), dev.At(i*block), block))
	}
	check(t, be.Record(down, s))

	waitFor(t, 30*time.Second, "the D2H event", func() bool {
		done, err := be.Query(down)
		if err != nil {
			t.Fatalf("Query: %v", err)
		}
		return done
	})
	// Stream order: the earlier event has fired too.
	if done, err := be.Query(up); !done || err != nil {
		t.Fatalf("earlier event: Query = %v, %v after a later one fired", done, err)
	}
	if !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatal("bytes differ once the event fired")
	}
}

func testScatteredBatch(t *testing.T, be backend.Backend) {
	const block, blocks = 64 << 10, 32
	src := must(be.AllocHost(block * blocks)).ok(t)
	dst := must(be.AllocHost(block * blocks)).ok(t)
	pool := must(be.AllocDevice(block * blocks)).ok(t)
	defer be.FreeHost(src)
	defer be.FreeHost(dst)
	defer be.FreeDevice(pool)
	fill(src.Bytes(), 4)

	// Host block i goes to device slot perm[i], and comes back to host block i.
	perm := make([]int, blocks)
	for i := range perm {
		perm[i] = (i*7 + 3) % blocks
	}
	var up, down []backend.Copy
	for i, slot := range perm {
		up = append(up, backend.Copy{Dst: pool.At(slot * block), Src: src.At(i * block), N: block})
		down = append(down, backend.Copy{Dst: dst.At(i * block), Src: pool.At(slot * block), N: block})
	}
	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)
	check(t, be.CopyBatchAsync(s, up))
	check(t, be.CopyBatchAsync(s, down))
	check(t, be.SynchronizeStream(s))
	if !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatal("blocks did not come back to their places")
	}
}

func testSameSideCopies(t *testing.T, be backend.Backend) {
	const n = 1 << 20
	a := must(be.AllocHost(n)).ok(t)
	b := must(be.AllocHost(n)).ok(t)
	out := must(be.AllocHost(n)).ok(t)
	d1 := must(be.AllocDevice(n)).ok(t)
	d2 := must(be.AllocDevice(n)).ok(t)
	defer be.FreeHost(a)
	defer be.FreeHost(b)
	defer be.FreeHost(out)
	defer be.FreeDevice(d1)
	defer be.FreeDevice(d2)
	fill(a.Bytes(), 5)

	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)
	e := must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(e)
	check(t, be.CopyAsync(s, b.Ptr(), a.Ptr(), n))       // H2H
	check(t, be.CopyAsync(s, d1.Ptr(), b.Ptr(), n))      // H2D
	check(t, be.CopyAsync(s, d2.At(n/2), d1.Ptr(), n/2)) // D2D, halves swapped
	check(t, be.CopyAsync(s, d2.Ptr(), d1.At(n/2), n/2)) //
	check(t, be.CopyAsync(s, out.Ptr(), d2.Ptr(), n))    // D2H
	check(t, be.Record(e, s))
	check(t, be.Synchronize(e))
	want := append(bytes.Clone(a.Bytes()[n/2:]), a.Bytes()[:n/2]...)
	if !bytes.Equal(out.Bytes(), want) {
		t.Fatal("H2H, D2D, D2H chain changed the bytes")
	}
}

func testManyStreams(t *testing.T, be backend.Backend) {
	const workers, block, rounds = 16, 128 << 10, 4
	src := must(be.AllocHost(workers * block)).ok(t)
	dst := must(be.AllocHost(workers * block)).ok(t)
	dev := must(be.AllocDevice(workers * block)).ok(t)
	defer be.FreeHost(src)
	defer be.FreeHost(dst)
	defer be.FreeDevice(dev)

	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := streamWorker(be, src, dst, dev, w, block, rounds); err != nil {
				t.Errorf("worker %d: %v", w, err)
			}
		}()
	}
	wg.Wait()
}

// streamWorker moves its own slice up and down on its own stream, rounds
// times with a new pattern each time, and checks every round.
func streamWorker(be backend.Backend, src, dst backend.HostBuffer, dev backend.DeviceBuffer, w, block, rounds int) error {
	s, err := be.NewStream()
	if err != nil {
		return err
	}
	defer be.DestroyStream(s)
	e, err := be.NewEvent()
	if err != nil {
		return err
	}
	defer be.DestroyEvent(e)
	off := w * block
	for r := range rounds {
		fill(src.Bytes()[off:off+block], uint64(100*w+r))
		if err := be.CopyAsync(s, dev.At(off), src.At(off), block); err != nil {
			return err
		}
		if err := be.CopyAsync(s, dst.At(off), dev.At(off), block); err != nil {
			return err
		}
		if err := be.Record(e, s); err != nil {
			return err
		}
		if err := be.Synchronize(e); err != nil {
			return err
		}
		if !bytes.Equal(dst.Bytes()[off:off+block], src.Bytes()[off:off+block]) {
			return fmt.Errorf("round %d: bytes differ", r)
		}
	}
	return nil
}

func testDestroyStreamDrains(t *testing.T, be backend.Backend) {
	const n = 8 << 20
	src := must(be.AllocHost(n)).ok(t)
	dst := must(be.AllocHost(n)).ok(t)
	dev := must(be.AllocDevice(n)).ok(t)
	defer be.FreeHost(src)
	defer be.FreeHost(dst)
	defer be.FreeDevice(dev)
	fill(src.Bytes(), 6)
	s := must(be.NewStream()).ok(t)
	e := must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(e)
	check(t, be.CopyAsync(s, dev.Ptr(), src.Ptr(), n))
	check(t, be.CopyAsync(s, dst.Ptr(), dev.Ptr(), n))
	check(t, be.Record(e, s))
	check(t, be.DestroyStream(s))
	check(t, be.Synchronize(e))
	if !bytes.Equal(dst.Bytes(), src.Bytes()) {
		t.Fatal("copies queued before DestroyStream did not complete")
	}
}

func testBadArgs(t *testing.T, be backend.Backend) {
	const n = 1 << 16
	h := must(be.AllocHost(n)).ok(t)
	d := must(be.AllocDevice(n)).ok(t)
	defer be.FreeHost(h)
	defer be.FreeDevice(d)
	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)
	e := must(be.NewEvent()).ok(t)
	defer be.DestroyEvent(e)
	deadS := must(be.NewStream()).ok(t)
	check(t, be.DestroyStream(deadS))
	deadE := must(be.NewEvent()).ok(t)
	check(t, be.DestroyEvent(deadE))
	other := must(backend.NewHost()).ok(t)
	defer other.Close()
	foreignS := must(other.NewStream()).ok(t)
	foreignE := must(other.NewEvent()).ok(t)
	freed := must(be.AllocDevice(n)).ok(t)
	check(t, be.FreeDevice(freed))
	goMem := make([]byte, n)
	goPtr := backend.Ptr(uintptr(unsafe.Pointer(&goMem[0])))
	fill(h.Bytes(), 7)

	copyCases := []struct {
		name     string
		s        backend.Stream
		dst, src backend.Ptr
		n        int
		want     error
	}{
		{"nil stream", nil, d.Ptr(), h.Ptr(), n, backend.ErrBadHandle},
		{"destroyed stream", deadS, d.Ptr(), h.Ptr(), n, backend.ErrBadHandle},
		{"stream of another backend", foreignS, d.Ptr(), h.Ptr(), n, backend.ErrBadHandle},
		{"zero size", s, d.Ptr(), h.Ptr(), 0, backend.ErrInvalidArgument},
		{"negative size", s, d.Ptr(), h.Ptr(), -1, backend.ErrInvalidArgument},
		{"nil dst", s, 0, h.Ptr(), n, backend.ErrInvalidArgument},
		{"nil src", s, d.Ptr(), 0, n, backend.ErrInvalidArgument},
		{"one byte past the end", s, d.Ptr(), h.Ptr(), n + 1, backend.ErrOutOfRange},
		{"starts inside, ends outside", s, d.At(n - 8), h.Ptr(), 16, backend.ErrOutOfRange},
		{"freed buffer", s, freed.Ptr(), h.Ptr(), 16, backend.ErrOutOfRange},
		{"wild pointer", s, 0x1000, h.Ptr(), 16, backend.ErrOutOfRange},
		{"Go heap memory", s, d.Ptr(), goPtr, 16, backend.ErrOutOfRange},
		{"address wraps around", s, backend.Ptr(^uintptr(0) - 4), h.Ptr(), 16, backend.ErrOutOfRange},
		{"size wraps around", s, d.At(8), h.At(8), int(^uint(0) >> 1), backend.ErrOutOfRange},
		{"overlapping ranges", s, h.At(16), h.Ptr(), 64, backend.ErrInvalidArgument},
	}
	for _, c := range copyCases {
		if err := be.CopyAsync(c.s, c.dst, c.src, c.n); !errors.Is(err, c.want) {
			t.Errorf("CopyAsync %s: err = %v, want %v", c.name, err, c.want)
		}
	}

	// A batch with one bad copy queues nothing: the good first copy must not land.
	clearDevice(t, be, s, d)
	bad := []backend.Copy{{Dst: d.Ptr(), Src: h.Ptr(), N: 64}, {Dst: d.At(n - 8), Src: h.Ptr(), N: 64}}
	if err := be.CopyBatchAsync(s, bad); !errors.Is(err, backend.ErrOutOfRange) {
		t.Errorf("batch with a bad copy: err = %v, want ErrOutOfRange", err)
	}
	if err := be.CopyBatchAsync(s, nil); !errors.Is(err, backend.ErrInvalidArgument) {
		t.Errorf("empty batch: err = %v, want ErrInvalidArgument", err)
	}
	got := must(be.AllocHost(64)).ok(t)
	defer be.FreeHost(got)
	check(t, be.CopyAsync(s, got.Ptr(), d.Ptr(), 64))
	check(t, be.SynchronizeStream(s))
	if !bytes.Equal(got.Bytes(), make([]byte, 64)) {
		t.Error("a rejected batch queued its valid first copy")
	}

	allocCases := []struct {
		name string
		err  error
		want error
	}{
		{"AllocHost(0)", second(be.AllocHost(0)), backend.ErrInvalidArgument},
		{"AllocHost(-1)", second(be.AllocHost(-1)), backend.ErrInvalidArgument},
		{"AllocDevice(0)", second(be.AllocDevice(0)), backend.ErrInvalidArgument},
		{"FreeDevice(zero buffer)", be.FreeDevice(backend.DeviceBuffer{}), backend.ErrBadHandle},
		{"FreeHost(zero buffer)", be.FreeHost(backend.HostBuffer{}), backend.ErrBadHandle},
		{"ExportIPC(zero buffer)", second(be.ExportIPC(backend.DeviceBuffer{})), backend.ErrBadHandle},
		{"OpenIPCHandle(nil)", second(be.OpenIPCHandle(nil, n)), backend.ErrInvalidArgument},
		{"OpenIPCHandle(size 0)", second(be.OpenIPCHandle(make(backend.IPCHandle, 64), 0)), backend.ErrInvalidArgument},
		{"Record(nil event)", be.Record(nil, s), backend.ErrBadHandle},
		{"Record(on nil stream)", be.Record(e, nil), backend.ErrBadHandle},
		{"Record(destroyed event)", be.Record(deadE, s), backend.ErrBadHandle},
		{"Record(on destroyed stream)", be.Record(e, deadS), backend.ErrBadHandle},
		{"Record(foreign event)", be.Record(foreignE, s), backend.ErrBadHandle},
		{"Query(nil)", second(be.Query(nil)), backend.ErrBadHandle},
		{"Query(destroyed)", second(be.Query(deadE)), backend.ErrBadHandle},
		{"Synchronize(nil)", be.Synchronize(nil), backend.ErrBadHandle},
		{"Synchronize(destroyed)", be.Synchronize(deadE), backend.ErrBadHandle},
		{"SynchronizeStream(destroyed)", be.SynchronizeStream(deadS), backend.ErrBadHandle},
		{"DestroyStream twice", be.DestroyStream(deadS), backend.ErrBadHandle},
		{"DestroyEvent twice", be.DestroyEvent(deadE), backend.ErrBadHandle},
		{"DestroyEvent(nil)", be.DestroyEvent(nil), backend.ErrBadHandle},
	}
	for _, c := range allocCases {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: err = %v, want %v", c.name, c.err, c.want)
		}
	}
	// Absurd sizes fail as out of memory (a driver may call them invalid).
	for name, err := range map[string]error{
		"AllocDevice(1<<62)": second(be.AllocDevice(1 << 62)),
		"AllocHost(1<<62)":   second(be.AllocHost(1 << 62)),
	} {
		if !errors.Is(err, backend.ErrOutOfMemory) && !errors.Is(err, backend.ErrInvalidArgument) {
			t.Errorf("%s: err = %v, want ErrOutOfMemory", name, err)
		}
	}
	// A handle of the right shape that names nothing: the exact error is the
	// driver's, but it must be an error.
	junk := make(backend.IPCHandle, 64)
	copy(junk, "/nonexistent/kvrouter-ipc-test")
	if _, err := be.OpenIPCHandle(junk, n); err == nil {
		t.Error("OpenIPCHandle(junk) succeeded")
	}
}

func second[T any](_ T, err error) error { return err }

func clearDevice(t *testing.T, be backend.Backend, s backend.Stream, d backend.DeviceBuffer) {
	t.Helper()
	zero := must(be.AllocHost(d.Len())).ok(t)
	defer be.FreeHost(zero)
	clear(zero.Bytes())
	check(t, be.CopyAsync(s, d.Ptr(), zero.Ptr(), d.Len()))
	check(t, be.SynchronizeStream(s))
}

// testClosed pins doc.go's "after Close, every other method that can fail
// returns ErrClosed" and "a second Close returns nil": every method of the
// Backend interface is called after Close, and a method the interface
// gains without a call here fails the test (Kind and Name, which cannot
// fail, and Close aside).
// OpenIPCHandle, CopyBatchAsync and SynchronizeStream were unpinned (the
// host's closed check in OpenIPCHandle deletable with every test passing).
func testClosed(t *testing.T, spec string) {
	be, err := openSpec(spec)
	check(t, err)
	h := must(be.AllocHost(4096)).ok(t)
	d := must(be.AllocDevice(4096)).ok(t)
	s := must(be.NewStream()).ok(t)
	e := must(be.NewEvent()).ok(t)
	ipc := must(be.ExportIPC(d)).ok(t)
	check(t, be.CopyAsync(s, d.Ptr(), h.Ptr(), 4096))
	check(t, be.Record(e, s))
	check(t, be.Close())

	calls := map[string]error{
		"AllocHost":         second(be.AllocHost(1)),
		"AllocDevice":       second(be.AllocDevice(1)),
		"FreeHost":          be.FreeHost(h),
		"FreeDevice":        be.FreeDevice(d),
		"NewStream":         second(be.NewStream()),
		"NewEvent":          second(be.NewEvent()),
		"CopyAsync":         be.CopyAsync(s, d.Ptr(), h.Ptr(), 16),
		"CopyBatchAsync":    be.CopyBatchAsync(s, []backend.Copy{{Dst: d.Ptr(), Src: h.Ptr(), N: 16}}),
		"SynchronizeStream": be.SynchronizeStream(s),
		"Record":            be.Record(e, s),
		"Query":             second(be.Query(e)),
		"Synchronize":       be.Synchronize(e),
		"DestroyStream":     be.DestroyStream(s),
		"DestroyEvent":      be.DestroyEvent(e),
		"ExportIPC":         second(be.ExportIPC(d)),
		"OpenIPCHandle":     second(be.OpenIPCHandle(ipc, 4096)),
	}
	for name, err := range calls {
		if !errors.Is(err, backend.ErrClosed) {
			t.Errorf("%s after Close: err = %v, want ErrClosed", name, err)
		}
	}
	iface := reflect.TypeFor[backend.Backend]()
	for i := range iface.NumMethod() {
		name := iface.Method(i).Name
		if _, ok := calls[name]; !ok && name != "Kind" && name != "Name" && name != "Close" {
			t.Errorf("Backend.%s is not called after Close here: add it", name)
		}
	}
	if err := be.Close(); err != nil {
		t.Errorf("second Close = %v, want nil", err)
	}
}

// Close while workers copy, destroy streams and free buffers: every call
// either works or fails with ErrClosed / ErrBadHandle, and nothing faults.
func testCloseUnderLoad(t *testing.T, spec string) {
	be, err := openSpec(spec)
	check(t, err)
	const workers, n = 4, 256 << 10
	var copies atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				err := churn(be, n, &copies)
				if errors.Is(err, backend.ErrClosed) || errors.Is(err, backend.ErrBadHandle) ||
					errors.Is(err, backend.ErrOutOfRange) { // a region freed by Close
					return
				}
				if err != nil {
					t.Errorf("during Close: %v", err)
					return
				}
			}
		}()
	}
	waitFor(t, 30*time.Second, "copies to start", func() bool { return copies.Load() >= 3*workers })
	check(t, be.Close())
	wg.Wait()
}

// churn allocates, copies round trip on a fresh stream, and frees.
func churn(be backend.Backend, n int, copies *atomic.Int64) error {
	h, err := be.AllocHost(n)
	if err != nil {
		return err
	}
	defer be.FreeHost(h)
	d, err := be.AllocDevice(n)
	if err != nil {
		return err
	}
	defer be.FreeDevice(d)
	s, err := be.NewStream()
	if err != nil {
		return err
	}
	defer be.DestroyStream(s)
	for range 4 {
		if err := be.CopyAsync(s, d.Ptr(), h.Ptr(), n); err != nil {
			return err
		}
		if err := be.CopyAsync(s, h.Ptr(), d.Ptr(), n); err != nil {
			return err
		}
		copies.Add(1)
	}
	return be.SynchronizeStream(s)
}
