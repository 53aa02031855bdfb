//go:build unix

package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
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
