package backend_test

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// A simulated engine publishes its "GPU" KV cache as a shared memory file;
// the host backend maps it by path and both sides see each other's writes.
func TestHostMapsSharedMemoryFileByPath(t *testing.T) {
	dir := "/dev/shm"
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		dir = t.TempDir()
	}
	f, err := os.CreateTemp(dir, "kvrouter-test-*")
	check(t, err)
	path := f.Name()
	defer os.Remove(path)
	const n = 1 << 20
	check(t, f.Truncate(n))
	_, err = f.WriteAt(pattern(n, 21), 0)
	check(t, err)
	check(t, f.Close())

	be := mustOpen(t, "host")
	if _, err := be.OpenIPCHandle(backend.IPCHandle(path), n+1); !errors.Is(err, backend.ErrOutOfRange) {
		t.Errorf("mapping more than the file holds: err = %v, want ErrOutOfRange", err)
	}
	if _, err := be.OpenIPCHandle(backend.IPCHandle(filepath.Base(path)), n); !errors.Is(err, backend.ErrInvalidArgument) {
		t.Errorf("relative path: err = %v, want ErrInvalidArgument", err)
	}
	if _, err := be.OpenIPCHandle(backend.IPCHandle(dir), n); err == nil {
		t.Error("mapping a directory succeeded")
	}
	dev := must(be.OpenIPCHandle(backend.IPCHandle(path), n)).ok(t)
	host := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	check(t, be.CopyAsync(s, host.Ptr(), dev.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	if !bytes.Equal(host.Bytes(), pattern(n, 21)) {
		t.Fatal("mapped file contents differ")
	}
	fill(host.Bytes(), 22)
	check(t, be.CopyAsync(s, dev.Ptr(), host.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	check(t, be.FreeDevice(dev))
	got, err := os.ReadFile(path)
	check(t, err)
	if !bytes.Equal(got, pattern(n, 22)) {
		t.Fatal("writes through the mapping did not reach the file")
	}
}

func TestHostCloseStopsEveryStreamGoroutine(t *testing.T) {
	before := goleak.IgnoreCurrent()
	be := must(backend.NewHost()).ok(t)
	src := must(be.AllocHost(1 << 20)).ok(t)
	dst := must(be.AllocHost(1 << 20)).ok(t)
	for range 8 {
		s := must(be.NewStream()).ok(t)
		check(t, be.CopyAsync(s, dst.Ptr(), src.Ptr(), 1<<20))
	}
	check(t, be.Close()) // streams still open and busy
	goleak.VerifyNone(t, before)
}
