package backend

import (
	"errors"
	"testing"
)

// A copy queued on the host backend reads and writes region memory from a
// worker goroutine; unmapping the region under it would fault the process.
func TestHostFreeWithCopiesInFlightIsRefused(t *testing.T) {
	h, src, dst := hostWithTwoRegions(t)
	// Pin as CopyBatchAsync does, without a worker to unpin: the copy is
	// "in flight" for as long as the test wants.
	rs, err := h.reg.resolve([]Copy{{Dst: dst.Ptr(), Src: src.Ptr(), N: 1 << 16}}, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.FreeHost(src); !errors.Is(err, ErrBusy) {
		t.Fatalf("FreeHost with a copy in flight: err = %v, want ErrBusy", err)
	}
	if err := h.FreeDevice(dst); !errors.Is(err, ErrBusy) {
		t.Fatalf("FreeDevice with a copy in flight: err = %v, want ErrBusy", err)
	}
	unpin(rs)
	if err := h.FreeHost(src); err != nil {
		t.Fatalf("FreeHost once the copy finished: %v", err)
	}
	if err := h.FreeDevice(dst); err != nil {
		t.Fatalf("FreeDevice once the copy finished: %v", err)
	}
}

// TestCopyOnAStreamDestroyedMeanwhileUnpinsItsRegions: a CopyBatchAsync
// that finds its stream destroyed between resolving its copies (which pins
// their regions) and queueing them fails with ErrBadHandle and unpins
// them; left pinned, every later Free of the regions would be ErrBusy.
// From a review: nothing tested the unpin.
func TestCopyOnAStreamDestroyedMeanwhileUnpinsItsRegions(t *testing.T) {
	h, src, dst := hostWithTwoRegions(t)
	s, err := h.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	hs := s.(*hostStream)
	rs, err := h.reg.resolve([]Copy{{Dst: dst.Ptr(), Src: src.Ptr(), N: 1 << 16}}, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	hs.mu.Lock()
	hs.closing = true // DestroyStream, between CopyBatchAsync's stream check and its enqueue
	hs.mu.Unlock()
	if err := hs.enqueue(rs); !errors.Is(err, ErrBadHandle) {
		t.Fatalf("a copy queued on a destroyed stream: %v, want ErrBadHandle", err)
	}
	if err := h.FreeHost(src); err != nil {
		t.Fatalf("FreeHost after the refused copy: %v, want its region unpinned", err)
	}
	if err := h.FreeDevice(dst); err != nil {
		t.Fatalf("FreeDevice after the refused copy: %v, want its region unpinned", err)
	}
	hs.mu.Lock()
	hs.closing = false // for DestroyStream's own bookkeeping
	hs.mu.Unlock()
	if err := h.DestroyStream(s); err != nil {
		t.Fatal(err)
	}
}

// hostWithTwoRegions opens a host backend, closed when the test ends, with
// a 64 KiB host buffer and a 64 KiB device buffer.
func hostWithTwoRegions(t *testing.T) (*Host, HostBuffer, DeviceBuffer) {
	t.Helper()
	h, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	src, err := h.AllocHost(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := h.AllocDevice(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	return h, src, dst
}

func TestRegistryRefusesOverlappingRegions(t *testing.T) {
	var r registry
	for _, rec := range []*regionRec{{base: 0x1000, n: 0x1000}, {base: 0x3000, n: 0x1000}} {
		if err := r.add(rec); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ base, n int }{{0x1800, 0x100}, {0x0800, 0x1000}, {0x1fff, 2}, {0x2fff, 2}, {0x0, 0x10000}} {
		if err := r.add(&regionRec{base: Ptr(c.base), n: c.n}); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("add %#x+%#x over live regions: err = %v, want ErrInvalidArgument", c.base, c.n, err)
		}
	}
	if err := r.add(&regionRec{base: 0x2000, n: 0x1000}); err != nil {
		t.Errorf("add into the exact gap: %v", err)
	}
}
