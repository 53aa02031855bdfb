package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestASignalEndsKvctlWaitingOnAFifo: kvctl waiting on a FIFO (a named
// pipe) given as a file is ended by SIGTERM, exit 1, "kvctl: interrupted",
// as docs/kvctl.md says of whatever kvctl is doing: whether the FIFO's
// producer has not opened it yet (kvctl waits in open(2)) or opened it,
// wrote a few bytes and stalled (kvctl waits in a read). From a review:
// the open ran outside the read that an interrupt abandons, and a file's
// reads looked at the context only between reads, not during one that
// waits: kvctl ignored the signal. And from a later one: --token-file
// and --tls-ca (a process substitution, --token-file <(pass show
// kvrouter)) were read with os.ReadFile, outside the command's context.
func TestASignalEndsKvctlWaitingOnAFifo(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		args   func(fifo string) []string
		writer bool // a producer opened the FIFO and stalls
	}{
		{"route --tokens FIFO, no writer yet", func(f string) []string { return []string{"--endpoints", deadAddr(t), "route", "--tokens", f} }, false},
		{"snapshot inspect FIFO, no writer yet", func(f string) []string { return []string{"snapshot", "inspect", f} }, false},
		{"snapshot inspect FIFO, stalled writer", func(f string) []string { return []string{"snapshot", "inspect", f} }, true},
		{"--token-file FIFO, no writer yet", func(f string) []string { return []string{"--endpoints", deadAddr(t), "--token-file", f, "status"} }, false},
		{"--token-file FIFO, stalled writer", func(f string) []string { return []string{"--endpoints", deadAddr(t), "--token-file", f, "status"} }, true},
		{"--tls-ca FIFO, no writer yet", func(f string) []string { return []string{"--endpoints", deadAddr(t), "--tls-ca", f, "status"} }, false},
	} {
		fifo := filepath.Join(t.TempDir(), "fifo")
		if err := syscall.Mkfifo(fifo, 0o600); err != nil {
			t.Fatal(err)
		}
		// kvctl waits on the FIFO, its signal handling (set up first) in
		// place, once it waits in open(2) for a writer, or once it has
		// read the bytes a writer sent.
		waiting := func(pid int) bool { return inFifoOpen(t, pid) }
		var w *os.File
		if tc.writer {
			// O_RDWR: opens without waiting for a reader, and holds the
			// FIFO open; the bytes begin a snapshot, then it stalls.
			if w, err = os.OpenFile(fifo, os.O_RDWR, 0); err != nil {
				t.Fatal(err)
			}
			if _, err := w.Write([]byte("KVRS")); err != nil {
				t.Fatal(err)
			}
			waiting = func(int) bool {
				n, err := unix.IoctlGetInt(int(w.Fd()), unix.TIOCINQ) // FIONREAD: bytes not read yet
				return err == nil && n == 0
			}
		}
		cmd := exec.Command(exe, append([]string{"-test.run=^TestKvctlProcess$", "-test.count=1", "--"}, tc.args(fifo)...)...)
		cmd.Env = append(os.Environ(), processEnv+"=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		go func() {
			_ = cmd.Wait()
			close(exited)
		}()
		for deadline := time.Now().Add(time.Minute); !waiting(cmd.Process.Pid); time.Sleep(10 * time.Millisecond) {
			select {
			case <-exited:
				t.Fatalf("%s: kvctl exited %d before waiting on the FIFO: %s", tc.name, cmd.ProcessState.ExitCode(), stderr.String())
			default:
			}
			if time.Now().After(deadline) {
				_ = cmd.Process.Kill()
				<-exited
				t.Fatalf("%s: kvctl did not wait on the FIFO within a minute", tc.name)
			}
		}
		if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		select {
		case <-exited:
			if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(stderr.String(), "kvctl: interrupted") {
				t.Errorf("%s: after SIGTERM exit %d, stderr %q; want 1 and kvctl: interrupted", tc.name, code, stderr.String())
			}
		case <-time.After(30 * time.Second): // a hang deadline
			_ = cmd.Process.Kill()
			<-exited
			t.Errorf("%s: kvctl still waited on the FIFO 30s after SIGTERM (stderr %q)", tc.name, stderr.String())
		}
		if w != nil {
			w.Close()
		}
	}
}

// inFifoOpen reports whether a thread of process pid waits in open(2) of
// a FIFO for its writer, as /proc/PID/task/TID/wchan tells (the kernel's
// fifo_open, or wait_for_partner within it). It skips the test where
// /proc tells no kernel function: this process's own threads, some
// asleep in the kernel, show none in their wchan.
func inFifoOpen(t *testing.T, pid int) bool {
	t.Helper()
	own, _ := filepath.Glob("/proc/self/task/*/wchan")
	if !slices.ContainsFunc(own, func(f string) bool {
		b, err := os.ReadFile(f)
		wchan := strings.TrimSpace(string(b))
		return err == nil && wchan != "" && wchan != "0"
	}) {
		t.Skip("/proc/PID/task/TID/wchan names no kernel function here: nothing tells that kvctl waits in open(2)")
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/wchan", pid))
	return slices.ContainsFunc(tasks, func(f string) bool {
		b, _ := os.ReadFile(f)
		wchan := string(b)
		return strings.Contains(wchan, "fifo") || strings.Contains(wchan, "partner")
	})
}

// TestASecondSignalKillsKvctlStuckOnItsOutput: docs/kvctl.md says "A
// second signal kills it at once", and main's comment names the case: a
// step that does not look at the context (an output pipe that nothing
// drains) cannot hold kvctl. kvctl workers -o json writes about a MiB
// into a stdout pipe nobody reads; the first SIGTERM cancels the context
// that the blocked write never looks at, a later one must kill the
// process. From a review: with main's context.AfterFunc(ctx, stop)
// deleted every kvctl test passed, and kvctl ignored every later signal.
func TestASecondSignalKillsKvctlStuckOnItsOutput(t *testing.T) {
	c := newCluster(t)
	for id := uint64(1); id <= 3000; id++ {
		if err := c.leader().RegisterWorker(context.Background(), raftfsm.WorkerInfo{
			ID: id, DPRanks: []uint32{0}, BlockSize: 16, Model: "a-model-name-long-enough-to-fill-the-pipe"}); err != nil {
			t.Fatal(err)
		}
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	capacity, err := unix.FcntlInt(r.Fd(), unix.F_GETPIPE_SZ, 0)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestKvctlProcess$", "-test.count=1", "--",
		"--endpoints", c.nodes[0].addr(), "workers", "-o", "json")
	cmd.Env = append(os.Environ(), processEnv+"=1")
	cmd.Stdout = w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	w.Close()
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	// kvctl is blocked in its write once the pipe holds all it can.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n, err := unix.IoctlGetInt(int(r.Fd()), unix.TIOCINQ) // FIONREAD: the bytes the pipe holds
		if err != nil {
			t.Fatal(err)
		}
		if n >= capacity {
			break
		}
		select {
		case <-exited:
			t.Fatalf("kvctl exited before the signals (%v), %d bytes in the pipe: the output did not fill it", cmd.ProcessState, n)
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("the pipe holds %d of its %d bytes after 30 s: kvctl did not fill it", n, capacity)
		}
	}
	// The first signal cancels; a later one kills. They are sent until
	// kvctl ends, a tenth of a second apart, so that two coming together
	// and read as one cannot pass for a second signal ignored.
	_ = cmd.Process.Signal(syscall.SIGTERM)
	for deadline := time.Now().Add(5 * time.Second); ; {
		select {
		case <-exited:
		case <-time.After(100 * time.Millisecond):
			if time.Now().Before(deadline) {
				_ = cmd.Process.Signal(syscall.SIGTERM)
				continue
			}
			_ = cmd.Process.Kill()
			<-exited
			t.Fatalf("kvctl, stuck writing to a pipe nobody reads, still ran 5 s after a second SIGTERM; want it killed at once (docs/kvctl.md)")
		}
		break
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGTERM {
		t.Errorf("kvctl ended with %v; want killed by the second SIGTERM", cmd.ProcessState)
	}
}
