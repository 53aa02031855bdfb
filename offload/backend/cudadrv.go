package backend

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// This file binds the few CUDA driver API functions the copy backend needs,
// at run time, with purego: no cgo, no CUDA headers, no toolkit at build time.
// The Go signatures below mirror cuda.h (CUDA 11.x/12.x) exactly; purego
// cannot check them, so each one names its C prototype. Versioned symbols
// (_v2) are the ones cuda.h maps the plain names to.

const defaultCUDALibrary = "libcuda.so.1"

// cuResult is CUresult.
type cuResult int32

// CUresult values this package branches on (cuda.h).
const (
	cudaSuccess            cuResult = 0
	cudaErrorInvalidValue  cuResult = 1
	cudaErrorOutOfMemory   cuResult = 2
	cudaErrorNoDevice      cuResult = 100
	cudaErrorInvalidDevice cuResult = 101
	cudaErrorNotReady      cuResult = 600
)

// Flags (cuda.h).
const (
	cuMemHostAllocPortable       = 0x01 // CU_MEMHOSTALLOC_PORTABLE
	cuStreamNonBlocking          = 0x01 // CU_STREAM_NON_BLOCKING
	cuEventBlockingSync          = 0x01 // CU_EVENT_BLOCKING_SYNC
	cuEventDisableTiming         = 0x02 // CU_EVENT_DISABLE_TIMING
	cuIpcMemLazyEnablePeerAccess = 0x01 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	cuIpcHandleSize              = 64   // CU_IPC_HANDLE_SIZE
)

// cuIpcMemHandle is CUipcMemHandle: passed by value, 64 bytes, so the SysV
// ABI puts it on the stack (MEMORY class), which purego does for structs
// over 16 bytes.
type cuIpcMemHandle struct {
	reserved [cuIpcHandleSize]byte
}

// driver holds the bound functions of one loaded libcuda. CUdevice is int,
// CUdeviceptr is unsigned long long, CUcontext/CUstream/CUevent are pointers.
type driver struct {
	path string

	// CUresult cuInit(unsigned int Flags)
	cuInit func(flags uint32) cuResult
	// CUresult cuDriverGetVersion(int *driverVersion)
	cuDriverGetVersion func(v *int32) cuResult
	// CUresult cuDeviceGetCount(int *count)
	cuDeviceGetCount func(n *int32) cuResult
	// CUresult cuDeviceGet(CUdevice *device, int ordinal)
	cuDeviceGet func(dev *int32, ordinal int32) cuResult
	// CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
	cuDeviceGetName func(name *byte, n int32, dev int32) cuResult
	// CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
	cuDevicePrimaryCtxRetain func(ctx *uintptr, dev int32) cuResult
	// CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
	cuDevicePrimaryCtxRelease func(dev int32) cuResult
	// CUresult cuCtxSetCurrent(CUcontext ctx)
	cuCtxSetCurrent func(ctx uintptr) cuResult
	// CUresult cuCtxSynchronize(void)
	cuCtxSynchronize func() cuResult
	// CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
	cuMemAlloc func(dptr *uint64, n uintptr) cuResult
	// CUresult cuMemFree_v2(CUdeviceptr dptr)
	cuMemFree func(dptr uint64) cuResult
	// CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
	cuMemHostAlloc func(pp *unsafe.Pointer, n uintptr, flags uint32) cuResult
	// CUresult cuMemFreeHost(void *p)
	cuMemFreeHost func(p unsafe.Pointer) cuResult
	// CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
	cuMemGetAddressRange func(base *uint64, size *uintptr, dptr uint64) cuResult
	// CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
	cuStreamCreate func(s *uintptr, flags uint32) cuResult
	// CUresult cuStreamDestroy_v2(CUstream hStream)
	cuStreamDestroy func(s uintptr) cuResult
	// CUresult cuStreamSynchronize(CUstream hStream)
	cuStreamSynchronize func(s uintptr) cuResult
	// CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
	cuMemcpyDtoHAsync func(dst uintptr, src uint64, n uintptr, s uintptr) cuResult
	// CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)
	cuMemcpyHtoDAsync func(dst uint64, src uintptr, n uintptr, s uintptr) cuResult
	// CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
	cuMemcpyDtoDAsync func(dst, src uint64, n uintptr, s uintptr) cuResult
	// CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
	// (unified addressing: used for host to host)
	cuMemcpyAsync func(dst, src uint64, n uintptr, s uintptr) cuResult
	// CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
	cuEventCreate func(e *uintptr, flags uint32) cuResult
	// CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
	cuEventRecord func(e, s uintptr) cuResult
	// CUresult cuEventQuery(CUevent hEvent)
	cuEventQuery func(e uintptr) cuResult
	// CUresult cuEventSynchronize(CUevent hEvent)
	cuEventSynchronize func(e uintptr) cuResult
	// CUresult cuEventDestroy_v2(CUevent hEvent)
	cuEventDestroy func(e uintptr) cuResult
	// CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
	cuIpcGetMemHandle func(h *cuIpcMemHandle, dptr uint64) cuResult
	// CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
	cuIpcOpenMemHandle func(dptr *uint64, h cuIpcMemHandle, flags uint32) cuResult
	// CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
	cuIpcCloseMemHandle func(dptr uint64) cuResult
	// CUresult cuGetErrorName(CUresult error, const char **pStr)
	cuGetErrorName func(code cuResult, s *unsafe.Pointer) cuResult
	// CUresult cuGetErrorString(CUresult error, const char **pStr)
	cuGetErrorString func(code cuResult, s *unsafe.Pointer) cuResult
}

var (
	driversMu sync.Mutex
	drivers   = map[string]*driver{} // by library path; a loaded driver is never unloaded
)

// loadDriver dlopens libcuda at path and binds every function, once per path
// per process. Unloading the CUDA driver under live threads it started is not
// safe, so a loaded driver stays loaded.
func loadDriver(path string) (*driver, error) {
	driversMu.Lock()
	defer driversMu.Unlock()
	if d := drivers[path]; d != nil {
		return d, nil
	}
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", path, err)
	}
	d := &driver{path: path}
	syms := []struct {
		fn    any
		names []string // first found wins
	}{
		{&d.cuInit, []string{"cuInit"}},
		{&d.cuDriverGetVersion, []string{"cuDriverGetVersion"}},
		{&d.cuDeviceGetCount, []string{"cuDeviceGetCount"}},
		{&d.cuDeviceGet, []string{"cuDeviceGet"}},
		{&d.cuDeviceGetName, []string{"cuDeviceGetName"}},
		{&d.cuDevicePrimaryCtxRetain, []string{"cuDevicePrimaryCtxRetain"}},
		{&d.cuDevicePrimaryCtxRelease, []string{"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"}},
		{&d.cuCtxSetCurrent, []string{"cuCtxSetCurrent"}},
		{&d.cuCtxSynchronize, []string{"cuCtxSynchronize"}},
		{&d.cuMemAlloc, []string{"cuMemAlloc_v2"}},
		{&d.cuMemFree, []string{"cuMemFree_v2"}},
		{&d.cuMemHostAlloc, []string{"cuMemHostAlloc"}},
		{&d.cuMemFreeHost, []string{"cuMemFreeHost"}},
		{&d.cuMemGetAddressRange, []string{"cuMemGetAddressRange_v2"}},
		{&d.cuStreamCreate, []string{"cuStreamCreate"}},
		{&d.cuStreamDestroy, []string{"cuStreamDestroy_v2"}},
		{&d.cuStreamSynchronize, []string{"cuStreamSynchronize"}},
		{&d.cuMemcpyDtoHAsync, []string{"cuMemcpyDtoHAsync_v2"}},
		{&d.cuMemcpyHtoDAsync, []string{"cuMemcpyHtoDAsync_v2"}},
		{&d.cuMemcpyDtoDAsync, []string{"cuMemcpyDtoDAsync_v2"}},
		{&d.cuMemcpyAsync, []string{"cuMemcpyAsync"}},
		{&d.cuEventCreate, []string{"cuEventCreate"}},
		{&d.cuEventRecord, []string{"cuEventRecord"}},
		{&d.cuEventQuery, []string{"cuEventQuery"}},
		{&d.cuEventSynchronize, []string{"cuEventSynchronize"}},
		{&d.cuEventDestroy, []string{"cuEventDestroy_v2"}},
		{&d.cuIpcGetMemHandle, []string{"cuIpcGetMemHandle"}},
		{&d.cuIpcOpenMemHandle, []string{"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"}},
		{&d.cuIpcCloseMemHandle, []string{"cuIpcCloseMemHandle"}},
		{&d.cuGetErrorName, []string{"cuGetErrorName"}},
		{&d.cuGetErrorString, []string{"cuGetErrorString"}},
	}
	for _, s := range syms {
		var addr uintptr
		for _, name := range s.names {
			if addr, err = purego.Dlsym(h, name); err == nil {
				break
			}
		}
		if addr == 0 {
			// Keep the handle open: the library may have started threads.
			return nil, fmt.Errorf("load %s: missing symbol %s (driver too old?)", path, s.names[0])
		}
		purego.RegisterFunc(s.fn, addr)
	}
	drivers[path] = d
	return d, nil
}

// CUDAError is a CUDA driver call that returned an error CUresult.
type CUDAError struct {
	Op   string // the driver function, e.g. "cuMemAlloc_v2"
	Code int    // the CUresult value
	Name string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Desc string // the driver's description, e.g. "out of memory"
}

func (e *CUDAError) Error() string {
	if e.Desc == "" {
		return fmt.Sprintf("%s: %s (%d)", e.Op, e.Name, e.Code)
	}
	return fmt.Sprintf("%s: %s (%d): %s", e.Op, e.Name, e.Code, e.Desc)
}

// Is lets callers test a CUDAError against this package's sentinels.
func (e *CUDAError) Is(target error) bool {
	switch cuResult(e.Code) {
	case cudaErrorOutOfMemory:
		return target == ErrOutOfMemory
	case cudaErrorInvalidValue:
		return target == ErrInvalidArgument
	case cudaErrorNoDevice, cudaErrorInvalidDevice:
		return target == ErrNoCUDA
	}
	return false
}

// check turns a CUresult into nil or a *CUDAError for op.
func (d *driver) check(op string, r cuResult) error {
	if r == cudaSuccess {
		return nil
	}
	e := &CUDAError{Op: op, Code: int(r), Name: fmt.Sprintf("CUDA_ERROR_%d", r)}
	var p unsafe.Pointer
	if d.cuGetErrorName(r, &p) == cudaSuccess && p != nil {
		e.Name = goString(p)
	}
	p = nil
	if d.cuGetErrorString(r, &p) == cudaSuccess && p != nil {
		e.Desc = goString(p)
	}
	return e
}

// goString copies the NUL-terminated C string at p, at most 256 bytes.
func goString(p unsafe.Pointer) string {
	var b []byte
	for i := 0; i < 256; i++ {
		c := *(*byte)(unsafe.Add(p, i))
		if c == 0 {
			break
		}
		b = append(b, c)
	}
	return string(b)
}

// probeCUDA reports why CUDA cannot be used (an error wrapping ErrNoCUDA), or
// nil when the library loads, initialises and has at least one device. It
// creates no context.
func probeCUDA(path string) error {
	d, err := loadDriver(path)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrNoCUDA, err)
	}
	if err := d.check("cuInit", d.cuInit(0)); err != nil {
		return fmt.Errorf("%w: %w", ErrNoCUDA, err)
	}
	var n int32
	if err := d.check("cuDeviceGetCount", d.cuDeviceGetCount(&n)); err != nil {
		return fmt.Errorf("%w: %w", ErrNoCUDA, err)
	}
	if n < 1 {
		return fmt.Errorf("%w: no CUDA device", ErrNoCUDA)
	}
	return nil
}
