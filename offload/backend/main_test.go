package backend_test

import (
	_ "embed"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/offload/backend"
)

// expectGPUEnv, when "1", turns "no GPU found" from a skip into a failure:
// scripts/gpu-check.sh sets it so that a GPU run cannot pass by skipping.
const expectGPUEnv = "KVROUTER_EXPECT_GPU"

var (
	//go:embed testdata/fakecuda.c
	fakeCUDASource []byte

	fakeOnce sync.Once
	fakeDir  string
	fakeLib  string
	fakeErr  error
)

func TestMain(m *testing.M) {
	testwatch.Start()
	// goleak.VerifyTestMain hands its exit code to the cleanup, which
	// must exit with it: a cleanup that returns makes the binary exit 0,
	// and a leak goleak found, or a failed test, passed the package.
	goleak.VerifyTestMain(testwatch.Settled(m), goleak.Cleanup(func(code int) {
		if fakeDir != "" {
			os.RemoveAll(fakeDir)
		}
		os.Exit(code)
	}))
}

// leakEnv, when "1", makes TestALeakFailsThePackage leak a goroutine for
// good instead of re-running the test binary.
const leakEnv = "KVROUTER_BACKEND_LEAK"

// TestALeakFailsThePackage runs this test binary again with one test that
// leaks a goroutine for good: goleak's check in TestMain must fail the run
// (a non-zero exit), as in every other package.
func TestALeakFailsThePackage(t *testing.T) {
	if os.Getenv(leakEnv) == "1" {
		testwatch.LeakGrace = time.Millisecond // the leak is for good: no need to wait
		block := make(chan struct{})
		go func() { <-block }()
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestALeakFailsThePackage$", "-test.count=1")
	cmd.Env = append(os.Environ(), leakEnv+"=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("a test binary whose test leaked a goroutine for good exited with %v, want a failure (goleak's exit 1): the leak passes the package; output:\n%s", err, out)
	}
	if !strings.Contains(string(out), "found unexpected goroutines") {
		t.Fatalf("the leaking test binary failed (%v) but not for its leak; output:\n%s", err, out)
	}
}

// fakeCUDALibrary builds testdata/fakecuda.c into a shared library once per
// test binary, or says why it cannot (no C compiler).
func fakeCUDALibrary() (string, error) {
	fakeOnce.Do(func() {
		cc := os.Getenv("CC")
		if cc == "" {
			cc = "cc"
		}
		if _, err := exec.LookPath(cc); err != nil {
			fakeErr = err
			return
		}
		if fakeDir, fakeErr = os.MkdirTemp("", "fakecuda"); fakeErr != nil {
			return
		}
		src := filepath.Join(fakeDir, "fakecuda.c")
		if fakeErr = os.WriteFile(src, fakeCUDASource, 0o600); fakeErr != nil {
			return
		}
		fakeLib = filepath.Join(fakeDir, "libfakecuda.so")
		out, err := exec.Command(cc, "-shared", "-fPIC", "-O2", "-o", fakeLib, src, "-lpthread").CombinedOutput()
		if err != nil {
			fakeErr = errors.New(cc + ": " + err.Error() + ": " + string(out))
		}
	})
	return fakeLib, fakeErr
}

// A backendCase is one Backend the conformance suite runs against. prepare
// returns the spec for openSpec (so that a helper process can open the same
// kind), or why the backend is unavailable here.
type backendCase struct {
	name    string
	prepare func() (spec, skip string)
}

func backendCases(t *testing.T) []backendCase {
	return []backendCase{
		{"host", func() (string, string) { return "host", "" }},
		{"cuda-fake", func() (string, string) {
			lib, err := fakeCUDALibrary()
			if err != nil {
				return "", "no C compiler to build the fake libcuda: " + err.Error()
			}
			return "cuda-fake:" + lib, ""
		}},
		{"cuda", func() (string, string) {
			if backend.Detect() == backend.KindCUDA {
				return "cuda", ""
			}
			if os.Getenv(expectGPUEnv) == "1" {
				_, err := backend.OpenCUDA(backend.CUDAConfig{})
				t.Fatalf("%s=1 but no usable GPU: %v", expectGPUEnv, err)
			}
			return "", "no GPU: libcuda.so.1 missing or no device"
		}},
	}
}

// openSpec opens "host", "cuda" or "cuda-fake:<library path>".
func openSpec(spec string) (backend.Backend, error) {
	switch {
	case spec == "host":
		return backend.NewHost()
	case spec == "cuda":
		return backend.OpenCUDA(backend.CUDAConfig{})
	case strings.HasPrefix(spec, "cuda-fake:"):
		return backend.OpenCUDA(backend.CUDAConfig{Library: strings.TrimPrefix(spec, "cuda-fake:")})
	}
	return nil, errors.New("unknown backend spec " + spec)
}

func mustOpen(t testing.TB, spec string) backend.Backend {
	t.Helper()
	be, err := openSpec(spec)
	if err != nil {
		t.Fatalf("open %s: %v", spec, err)
	}
	t.Cleanup(func() {
		if err := be.Close(); err != nil {
			t.Errorf("close %s: %v", spec, err)
		}
	})
	return be
}

// fill writes a pattern determined by seed (xorshift64*), 8 bytes at a time.
func fill(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 | 1
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		x ^= x >> 12
		x ^= x << 25
		x ^= x >> 27
		binary.LittleEndian.PutUint64(w[:], x*0x2545F4914F6CDD1D)
		copy(b[i:], w[:])
	}
}

func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	fill(b, seed)
	return b
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for backoff := time.Microsecond; !cond(); backoff = min(2*backoff, 10*time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(backoff)
	}
}

// must(f()).ok(t) is f's value, or a fatal test error.
func must[T any](v T, err error) result[T] { return result[T]{v, err} }

type result[T any] struct {
	v   T
	err error
}

func (r result[T]) ok(t testing.TB) T {
	t.Helper()
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.v
}

func check(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
