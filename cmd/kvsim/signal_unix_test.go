//go:build unix

package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// processEnv makes the test binary run kvsim's main (TestKVSimProcess)
// with the arguments after "--".
const processEnv = "KVSIM_TEST_PROCESS"

// TestKVSimProcess is kvsim itself in a child process of
// TestInterruptRemovesG3Dirs; run directly it does nothing.
func TestKVSimProcess(t *testing.T) {
	if os.Getenv(processEnv) != "1" {
		return
	}
	i := slices.Index(os.Args, "--")
	os.Args = append([]string{"kvsim"}, os.Args[i+1:]...)
	main() // exits
}

// TestInterruptRemovesG3Dirs: Ctrl-C of a replay with a G3 tier stops
// it, lets the workers close, so that their Pebble directories
// (kvsim-g3-*) are removed as docs/sim.md promises, and exits 1 with
// "kvsim: interrupted" (as kvctl does). kvsim had no signal handling: the
// directories stayed behind.
func TestInterruptRemovesG3Dirs(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	cmd := exec.Command(exe, "-test.run=^TestKVSimProcess$", "-test.count=1", "--",
		"replay", "--trace", "../../traces/mooncake_synthetic_trace.jsonl", "--speed", "5",
		"--offload-host-blocks", "1024", "--offload-disk-blocks", "4096", "--offload-dir", dir, "-o", "bench")
	cmd.Env = append(os.Environ(), processEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stopped := false
	defer func() {
		if !stopped {
			_ = cmd.Process.Kill()
			<-exited
		}
	}()

	// Until the first workers' G3 directories exist: the replay runs.
	g3 := func() []string {
		m, _ := filepath.Glob(filepath.Join(dir, "kvsim-g3-*"))
		return m
	}
	for deadline := time.Now().Add(2 * time.Minute); len(g3()) == 0; {
		select {
		case err := <-exited:
			stopped = true
			t.Fatalf("kvsim exited (%v) before its G3 directories appeared: %s", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("no kvsim-g3-* directory in %s after 2 minutes: %s", dir, stderr.String())
		}
	}
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	select {
	case err = <-exited:
		stopped = true
	case <-time.After(2 * time.Minute):
		t.Fatalf("kvsim still runs 2 minutes after SIGINT: %s", stderr.String())
	}
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(stderr.String(), "kvsim: interrupted") {
		t.Errorf("after SIGINT: exit %d (%v), stderr %q; want exit 1 and \"kvsim: interrupted\"", code, err, stderr.String())
	}
	if left := g3(); len(left) > 0 {
		t.Errorf("after SIGINT: G3 directories left behind: %v", left)
	}
}

// startStuckLiveReplay starts kvsim on a live replay against a fake
// cluster that stops answering at its 20th route (the reason a user hits
// Ctrl-C), and returns once that route is in flight, with the process and
// the channel its exit arrives on. stderr may be read once it exited.
func startStuckLiveReplay(t *testing.T) (*exec.Cmd, <-chan error, *bytes.Buffer) {
	t.Helper()
	f, addr := fakeCluster(t)
	release := make(chan struct{})
	// Registered after fakeCluster's: runs first, as the server's Close
	// waits for its handlers.
	t.Cleanup(func() { close(release) })
	var routes atomic.Int64
	var hung atomic.Bool
	stuck := make(chan struct{})
	f.SetHook(func(m string) error {
		if m == "Route" && routes.Add(1) == 20 {
			hung.Store(true)
			close(stuck)
		}
		if hung.Load() {
			<-release
		}
		return nil
	})
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestKVSimProcess$", "-test.count=1", "--",
		"replay", "--live", "--endpoints", addr, "--trace", genTrace(t), "--workers", "2", "--policies", "round_robin")
	cmd.Env = append(os.Environ(), processEnv+"=1")
	stderr := new(bytes.Buffer)
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	select {
	case <-stuck:
	case err := <-exited:
		t.Fatalf("kvsim exited (%v) before the cluster hung: %s", err, stderr)
	case <-time.After(2 * time.Minute):
		t.Fatal("no 20th route after 2 minutes")
	}
	return cmd, exited, stderr
}

// One Ctrl-C of a live replay whose cluster stopped answering ends kvsim
// (exit 1, "kvsim: interrupted", the bookings that may remain told): the
// route in flight is cancelled and the frees give up after the first that
// fails. kvsim waited out the route's timeout, then made a prefill-done and
// two frees, 10 s each, one after another, per request in flight: minutes.
func TestInterruptOfALiveReplayOnAStuckClusterEnds(t *testing.T) {
	cmd, exited, stderr := startStuckLiveReplay(t)
	if err := cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	var err error
	select {
	case err = <-exited:
	case <-time.After(time.Minute):
		_ = cmd.Process.Kill()
		<-exited
		t.Fatalf("kvsim still runs a minute after SIGINT on a stuck cluster: %s", stderr)
	}
	if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(stderr.String(), "kvsim: interrupted") ||
		!strings.Contains(stderr.String(), "may remain") {
		t.Errorf("after SIGINT: exit %d (%v), stderr %q; want exit 1, \"kvsim: interrupted\" and the bookings that may remain", code, err, stderr)
	}
}

// A second Ctrl-C kills kvsim at once (the default action of SIGINT),
// whatever the first one's cleanup still waits for: signal.NotifyContext
// caught SIGINT until the run returned, so further Ctrl-Cs were swallowed.
// SIGINT is sent until kvsim is gone, as the first one's handling (which
// gives SIGINT back its default action) runs a moment after it.
func TestSecondInterruptKillsKVSim(t *testing.T) {
	cmd, exited, stderr := startStuckLiveReplay(t)
	deadline := time.Now().Add(time.Minute)
	for {
		if err := cmd.Process.Signal(syscall.SIGINT); err != nil && !errors.Is(err, os.ErrProcessDone) {
			t.Fatal(err)
		}
		select {
		case <-exited:
		case <-time.After(50 * time.Millisecond):
			if time.Now().After(deadline) {
				_ = cmd.Process.Kill()
				<-exited
				t.Fatalf("kvsim still runs after a minute of SIGINTs: %s", stderr)
			}
			continue
		}
		break
	}
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
		t.Errorf("kvsim ended with %v, stderr %q; want killed by the second SIGINT", cmd.ProcessState, stderr)
	}
}
