package backend_test

import (
	"fmt"
	"os"
	"runtime"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// The benchmarks print one BENCH line each, comparing the backend with its
// baseline measured in the same run:
//
//	go test ./offload/backend -run XXX -bench BenchmarkHostCopy
//	go test ./offload/backend -run XXX -bench BenchmarkGPUCopy   (skips without a GPU)
//
// Each body runs once (b.Loop), so each line is printed once.

const benchBlock = 2 << 20 // 2 MiB: a typical KV block group

// blockCopies splits n bytes into benchBlock copies dst<-src, dealt round
// robin to the given number of streams.
func blockCopies(dst, src backend.Ptr, n, streams int) [][]backend.Copy {
	per := make([][]backend.Copy, streams)
	for i, off := 0, 0; off < n; i, off = i+1, off+benchBlock {
		per[i%streams] = append(per[i%streams], backend.Copy{Dst: dst.Add(off), Src: src.Add(off), N: min(benchBlock, n-off)})
	}
	return per
}

// copyBlocks queues each stream's share as one batch, records an event per
// stream and waits for all of them.
func copyBlocks(b *testing.B, be backend.Backend, ss []backend.Stream, es []backend.Event, per [][]backend.Copy) {
	for i, s := range ss {
		if err := be.CopyBatchAsync(s, per[i]); err != nil {
			b.Fatal(err)
		}
		if err := be.Record(es[i], s); err != nil {
			b.Fatal(err)
		}
	}
	for _, e := range es {
		if err := be.Synchronize(e); err != nil {
			b.Fatal(err)
		}
	}
}

func streamsAndEvents(b *testing.B, be backend.Backend, k int) ([]backend.Stream, []backend.Event) {
	ss := make([]backend.Stream, k)
	es := make([]backend.Event, k)
	for i := range k {
		ss[i] = must(be.NewStream()).ok(b)
		es[i] = must(be.NewEvent()).ok(b)
	}
	return ss, es
}

func gbps(bytes int, d time.Duration) float64 { return float64(bytes) / d.Seconds() / 1e9 }

// BenchmarkHostCopy: 256 MiB in 2 MiB blocks through the host backend on a
// few streams, against one copy() of the same bytes between the same buffers.
// Each iteration times both, interleaved, so drift (clock, neighbours) hits
// both alike; ns/op covers the pair.
func BenchmarkHostCopy(b *testing.B) {
	const total = 256 << 20
	be := mustOpen(b, "host")
	src := must(be.AllocHost(total)).ok(b)
	dst := must(be.AllocHost(total)).ok(b)
	fill(src.Bytes(), 1)
	clear(dst.Bytes()) // fault every page in before timing
	k := min(4, runtime.GOMAXPROCS(0))
	ss, es := streamsAndEvents(b, be, k)
	per := blockCopies(dst.Ptr(), src.Ptr(), total, k)
	copyBlocks(b, be, ss, es, per)

	var ours, base time.Duration
	for b.Loop() {
		t0 := time.Now()
		copyBlocks(b, be, ss, es, per)
		t1 := time.Now()
		copy(dst.Bytes(), src.Bytes())
		ours, base = ours+t1.Sub(t0), base+time.Since(t1)
	}
	oursGB, baseGB := gbps(total*b.N, ours), gbps(total*b.N, base)
	fmt.Printf("BENCH offload.host_copy gb_per_s=%.3g memmove_gb_per_s=%.3g ratio=%.2f block_mib=2 streams=%d\n",
		oursGB, baseGB, oursGB/baseGB, k)
}

// BenchmarkGPUCopy: 1 GiB in 2 MiB blocks between device memory and pinned
// host memory on 4 streams, each direction, against one large copy of the
// same bytes on one stream (the PCIe ceiling), interleaved per iteration.
// ceiling_gb_per_s is the faster direction's single large copy.
func BenchmarkGPUCopy(b *testing.B) {
	if backend.Detect() != backend.KindCUDA {
		if os.Getenv(expectGPUEnv) == "1" {
			_, err := backend.OpenCUDA(backend.CUDAConfig{})
			b.Fatalf("%s=1 but no usable GPU: %v", expectGPUEnv, err)
		}
		b.Skip("no GPU: libcuda.so.1 missing or no device")
	}
	const total, streams = 1 << 30, 4
	be := mustOpen(b, "cuda")
	host := must(be.AllocHost(total)).ok(b)
	dev := must(be.AllocDevice(total)).ok(b)
	fill(host.Bytes(), 1)
	ss, es := streamsAndEvents(b, be, streams)
	d2h := blockCopies(host.Ptr(), dev.Ptr(), total, streams)
	h2d := blockCopies(dev.Ptr(), host.Ptr(), total, streams)
	one := func(dst, src backend.Ptr) {
		if err := be.CopyAsync(ss[0], dst, src, total); err != nil {
			b.Fatal(err)
		}
		if err := be.SynchronizeStream(ss[0]); err != nil {
			b.Fatal(err)
		}
	}
	copyBlocks(b, be, ss, es, h2d) // warm up both directions
	copyBlocks(b, be, ss, es, d2h)

	var tD2H, tH2D, cD2H, cH2D time.Duration
	lap := func(acc *time.Duration, f func()) {
		t0 := time.Now()
		f()
		*acc += time.Since(t0)
	}
	for b.Loop() {
		lap(&tD2H, func() { copyBlocks(b, be, ss, es, d2h) })
		lap(&tH2D, func() { copyBlocks(b, be, ss, es, h2d) })
		lap(&cD2H, func() { one(host.Ptr(), dev.Ptr()) })
		lap(&cH2D, func() { one(dev.Ptr(), host.Ptr()) })
	}
	bytes := total * b.N
	d2hGB, h2dGB := gbps(bytes, tD2H), gbps(bytes, tH2D)
	ceilD2H, ceilH2D := gbps(bytes, cD2H), gbps(bytes, cH2D)
	fmt.Printf("BENCH offload.gpu d2h_gb_per_s=%.3g h2d_gb_per_s=%.3g ceiling_gb_per_s=%.3g d2h_ceiling_gb_per_s=%.3g h2d_ceiling_gb_per_s=%.3g d2h_ratio=%.2f h2d_ratio=%.2f block_mib=2 streams=%d device=%q\n",
		d2hGB, h2dGB, max(ceilD2H, ceilH2D), ceilD2H, ceilH2D, d2hGB/ceilD2H, h2dGB/ceilH2D, streams, be.Name())
}

// BenchmarkCUDACallOverhead measures what one CopyAsync costs the caller on
// the cuda backend (purego call, context bind, range checks) against the
// fake driver, whose copies are deferred and tiny.
func BenchmarkCUDACallOverhead(b *testing.B) {
	lib, err := fakeCUDALibrary()
	if err != nil {
		b.Skipf("no C compiler to build the fake libcuda: %v", err)
	}
	be := mustOpen(b, "cuda-fake:"+lib)
	h := must(be.AllocHost(1 << 20)).ok(b)
	d := must(be.AllocDevice(1 << 20)).ok(b)
	s := must(be.NewStream()).ok(b)
	i := 0
	for b.Loop() {
		if err := be.CopyAsync(s, d.At(i%1024*1024), h.At(i%1024*1024), 64); err != nil {
			b.Fatal(err)
		}
		if i++; i%4096 == 0 {
			if err := be.SynchronizeStream(s); err != nil {
				b.Fatal(err)
			}
		}
	}
	fmt.Printf("BENCH offload.cuda_call ns_per_copy_async=%.0f\n", float64(b.Elapsed().Nanoseconds())/float64(b.N))
}
