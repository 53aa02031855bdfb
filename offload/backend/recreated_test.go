package backend_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// An engine that restarts may re-create its shm file by removing it and
// creating a new one at the same path (shm_unlink + shm_open(O_CREAT)),
// rather than with O_TRUNC. The agent's mapping still names the old,
// unlinked file, of full size: a copy out of it reads the dead engine's
// bytes, and one into it writes where no engine reads, and both succeed.
// Like a shrunk file (ErrFault), a region whose file is no longer the one
// at its path (unlinked: no links left) should fail its copies.
func TestHostCopyFromUnlinkedShmFileIsAnError(t *testing.T) {
	const n = 1 << 16
	path := filepath.Join(t.TempDir(), "engine-rank0")
	check(t, os.WriteFile(path, pattern(n, 1), 0o600))
	be := mustOpen(t, "host")
	g1 := must(be.OpenIPCHandle(backend.IPCHandle(path), n)).ok(t)
	dst := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	e := must(be.NewEvent()).ok(t)

	check(t, os.Remove(path)) // the engine restarts: a new file, new bytes
	check(t, os.WriteFile(path, pattern(n, 2), 0o600))

	err := be.CopyBatchAsync(s, []backend.Copy{{Dst: dst.Ptr(), Src: g1.Ptr(), N: n}})
	if err == nil {
		check(t, be.Record(e, s))
		err = be.Synchronize(e)
	}
	if err == nil {
		stale := bytes.Equal(dst.Bytes(), pattern(n, 1))
		t.Fatalf("copy out of a region whose shm file was removed and re-created succeeded (read the old file's bytes: %v), want ErrFault", stale)
	}
	if !errors.Is(err, backend.ErrFault) {
		t.Fatalf("copy: %v, want ErrFault", err)
	}
	check(t, be.FreeDevice(g1))
}

// Files that have no name by design keep copying: a memfd (ExportIPC's,
// opened through /proc) and a file removed before it was mapped. Only a
// file that had a name when mapped and lost it is taken for a re-created
// one.
func TestHostCopyFromUnnamedFileWorks(t *testing.T) {
	const n = 1 << 16
	be := mustOpen(t, "host")
	dst := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	e := must(be.NewEvent()).ok(t)
	copyOut := func(what string, g1 backend.DeviceBuffer, want []byte) {
		t.Helper()
		clear(dst.Bytes())
		check(t, be.CopyBatchAsync(s, []backend.Copy{{Dst: dst.Ptr(), Src: g1.Ptr(), N: n}}))
		check(t, be.Record(e, s))
		check(t, be.Synchronize(e))
		if !bytes.Equal(dst.Bytes(), want) {
			t.Fatalf("copy out of %s: other bytes", what)
		}
	}

	dev := must(be.AllocDevice(n)).ok(t)
	src := must(be.AllocHost(n)).ok(t)
	copy(src.Bytes(), pattern(n, 3))
	check(t, be.CopyAsync(s, dev.Ptr(), src.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	g1 := must(be.OpenIPCHandle(must(be.ExportIPC(dev)).ok(t), n)).ok(t)
	copyOut("an exported memfd", g1, pattern(n, 3))
	check(t, be.FreeDevice(g1))
	check(t, be.FreeDevice(dev))

	path := filepath.Join(t.TempDir(), "engine-rank0")
	check(t, os.WriteFile(path, pattern(n, 4), 0o600))
	f := must(os.Open(path)).ok(t)
	defer f.Close()
	check(t, os.Remove(path))
	g1 = must(be.OpenIPCHandle(backend.IPCHandle(fmt.Sprintf("/proc/self/fd/%d", f.Fd())), n)).ok(t)
	copyOut("a file removed before it was mapped", g1, pattern(n, 4))
	check(t, be.FreeDevice(g1))
}
