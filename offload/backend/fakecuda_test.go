package backend_test

import (
	"bytes"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ebitengine/purego"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// fakeHooks are the fake driver's test hooks (testdata/fakecuda.c). The
// library is opened by path, as the backend opened it, so the hooks read the
// same state the backend's calls changed.
type fakeHooks struct {
	liveAllocs func() int32
	ctxRefs    func() int32
	setDelayUS func(int32)
	setStrict  func(int32)
}

func fakeHooksOrSkip(t *testing.T) (string, *fakeHooks) {
	t.Helper()
	lib := fakeOrSkip(t)
	h, err := purego.Dlopen(lib, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		t.Fatalf("dlopen %s: %v", lib, err)
	}
	var f fakeHooks
	purego.RegisterLibFunc(&f.liveAllocs, h, "fakecuda_live_allocs")
	purego.RegisterLibFunc(&f.ctxRefs, h, "fakecuda_ctx_refs")
	purego.RegisterLibFunc(&f.setDelayUS, h, "fakecuda_set_delay_us")
	purego.RegisterLibFunc(&f.setStrict, h, "fakecuda_set_strict_thread")
	return lib, &f
}

// delay makes every cuCtxSetCurrent sleep us microseconds until the test
// ends.
func (f *fakeHooks) delay(t *testing.T, us int32) {
	f.setDelayUS(us)
	t.Cleanup(func() { f.setDelayUS(0) })
}

// TestCUDACloseFreesEverything: Close frees every region it still holds
// (device and pinned host memory) and releases the primary context it
// retained; a Close that only forgot them leaked both for the process's life.
func TestCUDACloseFreesEverything(t *testing.T) {
	lib, f := fakeHooksOrSkip(t)
	allocs0, refs0 := f.liveAllocs(), f.ctxRefs()
	be, err := backend.OpenCUDA(backend.CUDAConfig{Library: lib})
	check(t, err)
	if got := f.ctxRefs(); got != refs0+1 {
		t.Fatalf("after OpenCUDA: %d context retains, want %d", got, refs0+1)
	}
	d := must(be.AllocDevice(1 << 16)).ok(t)
	h := must(be.AllocHost(1 << 16)).ok(t)
	must(be.AllocDevice(4096)).ok(t)
	s := must(be.NewStream()).ok(t)
	check(t, be.CopyAsync(s, d.Ptr(), h.Ptr(), 1<<16)) // still queued at Close
	if got := f.liveAllocs(); got != allocs0+3 {
		t.Fatalf("after 3 allocations: %d live, want %d", got, allocs0+3)
	}
	check(t, be.Close())
	if got, refs := f.liveAllocs(), f.ctxRefs(); got != allocs0 || refs != refs0 {
		t.Fatalf("after Close: %d allocations live and %d context retains, want %d and %d",
			got, refs, allocs0, refs0)
	}
}

// TestCUDAFreeWaitsForQueuedCopies: freeing memory that a queued copy still
// reads or writes waits for the device first (cuCtxSynchronize), so the copy
// completes and the driver never frees memory under it. The fake driver
// refuses such a free (CUDA_ERROR_ILLEGAL_STATE) instead of finishing the
// copy itself, as the real cuMemFree may or may not.
func TestCUDAFreeWaitsForQueuedCopies(t *testing.T) {
	lib := fakeOrSkip(t)
	be := mustOpen(t, "cuda-fake:"+lib)
	const n = 1 << 16
	want := pattern(n, 7)
	src := must(be.AllocHost(n)).ok(t)
	copy(src.Bytes(), want)
	dev := must(be.AllocDevice(n)).ok(t)
	dst := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	check(t, be.CopyAsync(s, dev.Ptr(), src.Ptr(), n))
	if err := be.FreeHost(src); err != nil {
		t.Fatalf("FreeHost of a queued copy's source: %v", err)
	}
	check(t, be.CopyAsync(s, dst.Ptr(), dev.Ptr(), n))
	if err := be.FreeDevice(dev); err != nil {
		t.Fatalf("FreeDevice of a queued copy's source: %v", err)
	}
	check(t, be.SynchronizeStream(s))
	if !bytes.Equal(dst.Bytes(), want) {
		t.Fatal("the copies queued before the frees did not complete")
	}
}

// TestCUDACallsStayOnTheThreadOfTheirContext: a CUDA context is current per
// OS thread, so every method must make it current and call the driver on
// one thread. The fake driver sleeps in cuCtxSetCurrent, where Go hands the
// goroutine's P to the busy goroutines; an unlocked goroutine then comes
// back on another thread, and the fake, strict about the thread here (this
// test is its only caller), fails the next call with
// CUDA_ERROR_INVALID_CONTEXT even where an earlier call left the context
// current on that thread.
func TestCUDACallsStayOnTheThreadOfTheirContext(t *testing.T) {
	lib, f := fakeHooksOrSkip(t)
	be := mustOpen(t, "cuda-fake:"+lib)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	var stop atomic.Bool
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
			}
		}()
	}
	defer func() { stop.Store(true); wg.Wait() }()
	f.delay(t, 2000)
	f.setStrict(1)
	defer f.setStrict(0)
	for i := range 20 {
		h, err := be.AllocHost(4096)
		if err != nil {
			t.Fatalf("alloc %d: %v", i, err)
		}
		if err := be.FreeHost(h); err != nil {
			t.Fatalf("free %d: %v", i, err)
		}
	}
}

// TestCUDAFreeRacingACopyWaitsOrIsBusy: a copy pins the regions it resolved
// until the driver has queued it, so a free racing it either comes first
// (the copy then finds no region) or is refused with ErrBusy; it never
// releases the memory between the copy's check and its driver call. The
// fake driver sleeps in cuCtxSetCurrent, which lies in that window.
func TestCUDAFreeRacingACopyWaitsOrIsBusy(t *testing.T) {
	lib, f := fakeHooksOrSkip(t)
	be := mustOpen(t, "cuda-fake:"+lib)
	f.delay(t, 1000)
	s := must(be.NewStream()).ok(t)
	for i := range 20 {
		src := must(be.AllocHost(4096)).ok(t)
		dst := must(be.AllocDevice(4096)).ok(t)
		copied := make(chan error, 1)
		go func() { copied <- be.CopyAsync(s, dst.Ptr(), src.Ptr(), 4096) }()
		runtime.Gosched()
		ferr := be.FreeHost(src)
		cerr := <-copied
		var ce *backend.CUDAError
		if errors.As(cerr, &ce) || (ferr != nil && !errors.Is(ferr, backend.ErrBusy)) {
			t.Fatalf("iteration %d: copy: %v; free racing it: %v; want the copy to fail with no driver error, or the free with ErrBusy", i, cerr, ferr)
		}
		check(t, be.SynchronizeStream(s))
		if ferr != nil {
			check(t, be.FreeHost(src))
		}
		check(t, be.FreeDevice(dst))
	}
}
