package backend_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// shrunkChildEnv names the shm file for the child side of
// TestHostCopyFromShrunkFileIsAnError.
const shrunkChildEnv = "KVROUTER_TEST_SHRUNK_SHM_FILE"

// An engine that restarts re-creates its shm file (O_TRUNC): the agent's
// mapping of the old file then has no pages behind it, and a plain copy out
// of it raises SIGBUS, which would kill the whole agent. The copy must fail
// with ErrFault instead, and the process live on. The copy runs in a child
// process, so that a regression shows as a failed test rather than a dead
// test binary.
func TestHostCopyFromShrunkFileIsAnError(t *testing.T) {
	if path := os.Getenv(shrunkChildEnv); path != "" {
		shrunkFileChild(t, path)
		return
	}
	path := filepath.Join(t.TempDir(), "engine-rank0")
	if err := os.WriteFile(path, pattern(1<<20, 5), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestHostCopyFromShrunkFileIsAnError$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), shrunkChildEnv+"="+path)
	out, err := cmd.CombinedOutput()
	if len(out) > 4000 {
		out = out[:4000]
	}
	if err != nil {
		t.Fatalf("the child died on a copy out of a shrunk shm file: %v\n%s", err, out)
	}
	t.Logf("child:\n%s", out)
}

func shrunkFileChild(t *testing.T, path string) {
	const n = 1 << 20
	be := mustOpen(t, "host")
	g1 := must(be.OpenIPCHandle(backend.IPCHandle(path), n)).ok(t)
	dst := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	e := must(be.NewEvent()).ok(t)
	copyBatch := func() error {
		if err := be.CopyBatchAsync(s, []backend.Copy{{Dst: dst.Ptr(), Src: g1.Ptr(), N: n}}); err != nil {
			return err
		}
		check(t, be.Record(e, s))
		return be.Synchronize(e)
	}
	check(t, copyBatch())

	check(t, os.Truncate(path, 0)) // the engine re-creates its file
	// A file already short is caught before the copy is queued
	// (checkBacking): CopyBatchAsync itself fails.
	if err := be.CopyBatchAsync(s, []backend.Copy{{Dst: dst.Ptr(), Src: g1.Ptr(), N: n}}); !errors.Is(err, backend.ErrFault) {
		t.Fatalf("CopyBatchAsync out of a file already shrunk: err = %v, want ErrFault before it is queued", err)
	}
	err := copyBatch()
	t.Logf("copy out of the shrunk file: %v", err)
	if !errors.Is(err, backend.ErrFault) {
		t.Fatalf("copy out of the shrunk file: err = %v, want ErrFault", err)
	}
	// The failure is the copy's, not the stream's: once the file is back to
	// its size, the same mapping copies again.
	check(t, os.Truncate(path, n))
	check(t, copyBatch())
	check(t, be.FreeDevice(g1))
}
