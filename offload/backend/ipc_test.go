package backend_test

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/offload/backend"
)

// The IPC test needs a second process: CUDA refuses to open an IPC handle in
// the process that exported it, and a real engine always is another process.
// The test binary re-runs itself as the exporter (TestIPCExporterProcess),
// which talks to the parent over stdin/stdout:
//
//	child:  "IPC-HANDLE <hex>"   device memory filled with pattern(seed)
//	parent: "CHECK <seed>"       the parent wrote pattern(seed) into it
//	child:  "IPC-CHECK ok" or "IPC-CHECK bad"
//	parent closes stdin; the child frees everything and exits.
const (
	exporterEnv     = "KVROUTER_IPC_EXPORTER"
	exporterSizeEnv = "KVROUTER_IPC_SIZE"
	exporterSeedEnv = "KVROUTER_IPC_SEED"
)

func testIPC(t *testing.T, be backend.Backend, spec string) {
	const n = 4 << 20
	x := startExporter(t, spec, n, 11)

	buf := must(be.OpenIPCHandle(x.handle, n)).ok(t)
	if _, err := be.OpenIPCHandle(x.handle, 2*n); !errors.Is(err, backend.ErrOutOfRange) {
		t.Errorf("OpenIPCHandle for more bytes than exported: err = %v, want ErrOutOfRange", err)
	}
	host := must(be.AllocHost(n)).ok(t)
	defer be.FreeHost(host)
	s := must(be.NewStream()).ok(t)
	defer be.DestroyStream(s)

	// Read what the exporter wrote.
	check(t, be.CopyAsync(s, host.Ptr(), buf.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	if !bytes.Equal(host.Bytes(), pattern(n, 11)) {
		t.Fatal("the mapped region does not hold the exporter's bytes")
	}
	// Write, and let the exporter read it back.
	fill(host.Bytes(), 12)
	check(t, be.CopyAsync(s, buf.Ptr(), host.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	if got := x.ask(t, "CHECK 12", "IPC-CHECK "); got != "ok" {
		t.Fatalf("exporter read back the region: %s", got)
	}
	check(t, be.FreeDevice(buf))
	x.stop(t)
}

type exporter struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr *bytes.Buffer
	handle backend.IPCHandle
	done   bool
}

func startExporter(t *testing.T, spec string, n int, seed uint64) *exporter {
	t.Helper()
	exe, err := os.Executable()
	check(t, err)
	cmd := exec.Command(exe, "-test.run=^TestIPCExporterProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(),
		exporterEnv+"="+spec,
		exporterSizeEnv+"="+strconv.Itoa(n),
		exporterSeedEnv+"="+strconv.FormatUint(seed, 10))
	x := &exporter{cmd: cmd, lines: make(chan string, 16), stderr: new(bytes.Buffer)}
	cmd.Stderr = x.stderr
	x.stdin, err = cmd.StdinPipe()
	check(t, err)
	stdout, err := cmd.StdoutPipe()
	check(t, err)
	check(t, cmd.Start())
	go func() {
		defer close(x.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			x.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() { x.stop(t) })

	h := x.await(t, "IPC-HANDLE ")
	x.handle, err = hex.DecodeString(h)
	if err != nil {
		t.Fatalf("exporter sent a bad handle %q: %v", h, err)
	}
	return x
}

// await returns the rest of the first line starting with prefix.
func (x *exporter) await(t *testing.T, prefix string) string {
	t.Helper()
	timeout := time.After(60 * time.Second)
	for {
		select {
		case line, ok := <-x.lines:
			if !ok {
				x.stop(t)
				t.Fatalf("exporter exited before %q; stderr:\n%s", prefix, x.stderr)
			}
			if rest, found := strings.CutPrefix(line, prefix); found {
				return rest
			}
		case <-timeout:
			t.Fatalf("no %q from the exporter within 60s", prefix)
		}
	}
}

func (x *exporter) ask(t *testing.T, req, prefix string) string {
	t.Helper()
	if _, err := fmt.Fprintln(x.stdin, req); err != nil {
		t.Fatalf("write to exporter: %v", err)
	}
	return x.await(t, prefix)
}

// stop closes the exporter's stdin, drains its output and reaps it.
func (x *exporter) stop(t *testing.T) {
	if x.done {
		return
	}
	x.done = true
	x.stdin.Close()
	for range x.lines {
	}
	if err := x.cmd.Wait(); err != nil {
		t.Errorf("exporter: %v; stderr:\n%s", err, x.stderr)
	}
}

// TestIPCExporterProcess is the exporter side of testIPC; run directly it
// skips.
func TestIPCExporterProcess(t *testing.T) {
	spec := os.Getenv(exporterEnv)
	if spec == "" {
		t.Skip("helper process for the IPC conformance test")
	}
	n, err := strconv.Atoi(os.Getenv(exporterSizeEnv))
	check(t, err)
	seed, err := strconv.ParseUint(os.Getenv(exporterSeedEnv), 10, 64)
	check(t, err)

	be := mustOpen(t, spec)
	dev := must(be.AllocDevice(n)).ok(t)
	host := must(be.AllocHost(n)).ok(t)
	s := must(be.NewStream()).ok(t)
	fill(host.Bytes(), seed)
	check(t, be.CopyAsync(s, dev.Ptr(), host.Ptr(), n))
	check(t, be.SynchronizeStream(s))
	h := must(be.ExportIPC(dev)).ok(t)
	fmt.Printf("IPC-HANDLE %x\n", []byte(h))

	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		req, ok := strings.CutPrefix(sc.Text(), "CHECK ")
		if !ok {
			continue
		}
		want, err := strconv.ParseUint(req, 10, 64)
		check(t, err)
		check(t, be.CopyAsync(s, host.Ptr(), dev.Ptr(), n))
		check(t, be.SynchronizeStream(s))
		verdict := "ok"
		if !bytes.Equal(host.Bytes(), pattern(n, want)) {
			verdict = "bad"
		}
		fmt.Printf("IPC-CHECK %s\n", verdict)
	}
}
