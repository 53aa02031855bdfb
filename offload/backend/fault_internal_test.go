package backend

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"testing"
)

// faultChildEnv names the shm file for the child side of
// TestHostCopyFaultIsReportedByItsEvent.
const faultChildEnv = "KVROUTER_TEST_FAULT_SHM_FILE"

// The file behind a mapped region shrinks after CopyBatchAsync checked it
// and before the worker copies: the copy faults in the worker. The fault
// must become ErrFault, reported by the event recorded after the job (or by
// SynchronizeStream when no event covers it), and the stream must go on
// copying. The jobs are queued past checkBacking, so that the worker meets
// the shrunk file; they run in a child process, so that a regression fails
// the test instead of killing the test binary.
func TestHostCopyFaultIsReportedByItsEvent(t *testing.T) {
	if path := os.Getenv(faultChildEnv); path != "" {
		copyFaultChild(t, path)
		return
	}
	path := filepath.Join(t.TempDir(), "engine-rank0")
	if err := os.WriteFile(path, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHostCopyFaultIsReportedByItsEvent$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), faultChildEnv+"="+path)
	out, err := cmd.CombinedOutput()
	if len(out) > 4000 {
		out = out[:4000]
	}
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	t.Logf("child:\n%s", out)
}

func copyFaultChild(t *testing.T, path string) {
	const n = 1 << 20
	h, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	g1, err := h.OpenIPCHandle(IPCHandle(path), n)
	if err != nil {
		t.Fatal(err)
	}
	dst, err := h.AllocHost(n)
	if err != nil {
		t.Fatal(err)
	}
	s, err := h.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	e, err := h.NewEvent()
	if err != nil {
		t.Fatal(err)
	}
	hs := s.(*hostStream)
	// queue queues the copy as CopyBatchAsync does, but without
	// checkBacking.
	queue := func() {
		t.Helper()
		rs, err := h.reg.resolve([]Copy{{Dst: dst.Ptr(), Src: g1.Ptr(), N: n}}, true, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := hs.enqueue(rs); err != nil {
			t.Fatal(err)
		}
	}
	record := func() {
		t.Helper()
		if err := h.Record(e, s); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}

	queue()
	record()
	err = h.Synchronize(e)
	t.Logf("synchronize after a faulting copy: %v", err)
	if !errors.Is(err, ErrFault) {
		t.Fatalf("Synchronize after a faulting copy: err = %v, want ErrFault", err)
	}
	if done, err := h.Query(e); !done || !errors.Is(err, ErrFault) {
		t.Fatalf("Query after a faulting copy = %v, %v; want true, ErrFault", done, err)
	}

	// Not sticky: the next batch on the stream reports its own outcome.
	if err := os.Truncate(path, n); err != nil {
		t.Fatal(err)
	}
	queue()
	record()
	if err := h.Synchronize(e); err != nil {
		t.Fatalf("Synchronize after the file is back: %v", err)
	}

	// A failure no Record covers is SynchronizeStream's to report, once.
	if err := os.Truncate(path, 0); err != nil {
		t.Fatal(err)
	}
	queue()
	if err := h.SynchronizeStream(s); !errors.Is(err, ErrFault) {
		t.Fatalf("SynchronizeStream after a faulting copy: err = %v, want ErrFault", err)
	}
	if err := h.SynchronizeStream(s); err != nil {
		t.Fatalf("second SynchronizeStream: %v (the failure was reported already)", err)
	}
	// Nor does a Record after it report it again.
	record()
	if err := h.Synchronize(e); err != nil {
		t.Fatalf("Synchronize of an event recorded after a reported failure: %v", err)
	}

	// A job that failed before the Record that covers it is that Record's
	// to report.
	queue()
	hs.mu.Lock()
	hs.waitLocked(hs.submitted)
	hs.mu.Unlock()
	record()
	if err := h.Synchronize(e); !errors.Is(err, ErrFault) {
		t.Fatalf("Synchronize of an event recorded after its job failed: err = %v, want ErrFault", err)
	}
	if err := os.Truncate(path, n); err != nil {
		t.Fatal(err)
	}
	if err := h.FreeDevice(g1); err != nil {
		t.Fatal(err)
	}
}

// copyJob turns on SetPanicOnFault only for itself: the goroutine's own
// setting is restored, or a later nil dereference elsewhere on a worker
// would be a recoverable panic instead of a crash.
func TestCopyJobRestoresPanicOnFault(t *testing.T) {
	src, dst := make([]byte, 64), make([]byte, 64)
	rs := []resolved{{dst: &regionRec{b: dst, kind: memHost}, src: &regionRec{b: src, kind: memHost}, n: 64}}
	for _, was := range []bool{false, true} {
		debug.SetPanicOnFault(was)
		if err := copyJob(rs); err != nil {
			t.Fatal(err)
		}
		if now := debug.SetPanicOnFault(false); now != was {
			t.Fatalf("SetPanicOnFault was %v before copyJob, %v after", was, now)
		}
	}
}
