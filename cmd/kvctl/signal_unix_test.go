//go:build unix

package main

import (
	"bytes"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// processEnv makes the test binary run kvctl's main (TestKvctlProcess)
// with the arguments after "--".
const processEnv = "KVCTL_TEST_PROCESS"

// TestKvctlProcess is kvctl itself in a child process of
// TestASignalEndsKvctlReadingStdin; run directly it does nothing.
func TestKvctlProcess(t *testing.T) {
	if os.Getenv(processEnv) != "1" {
		return
	}
	i := slices.Index(os.Args, "--")
	os.Args = append([]string{"kvctl"}, os.Args[i+1:]...)
	main() // exits
}

// TestASignalEndsKvctlReadingStdin: "producer | kvctl route --tokens -"
// whose producer stalls is ended by SIGINT (Ctrl-C) and by SIGTERM (a
// supervisor), exit 1, "kvctl: interrupted", as docs/kvctl.md says. From
// a review: main's signal.NotifyContext stopped Go's default handling of
// both, and the read of stdin never looked at the context: kvctl ignored
// them, and once stdin ended it routed as if nothing had happened.
func TestASignalEndsKvctlReadingStdin(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		cmd := exec.Command(exe, "-test.run=^TestKvctlProcess$", "-test.count=1", "--",
			"--endpoints", deadAddr(t), "route", "--tokens", "-")
		cmd.Env = append(os.Environ(), processEnv+"=1")
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan error, 1)
		go func() { exited <- cmd.Wait() }()
		// Once far more went into stdin than a pipe holds, kvctl is
		// reading it, its signal handling in place; then the producer
		// stalls, stdin still open.
		chunk := bytes.Repeat([]byte("1 "), 32<<10)
		for written := 0; written < 4<<20; written += len(chunk) {
			if _, err := stdin.Write(chunk); err != nil {
				_ = cmd.Process.Kill()
				<-exited
				t.Fatalf("%v: kvctl stopped reading stdin before the signal: %v: %s", sig, err, stderr.String())
			}
		}
		if err := cmd.Process.Signal(sig); err != nil {
			t.Fatal(err)
		}
		select {
		case err = <-exited:
		case <-time.After(2 * time.Minute):
			_ = cmd.Process.Kill()
			<-exited
			t.Fatalf("%v: kvctl still read stdin 2 minutes after the signal: %s", sig, stderr.String())
		}
		stdin.Close()
		if code := cmd.ProcessState.ExitCode(); code != 1 || !strings.Contains(stderr.String(), "kvctl: interrupted") {
			t.Errorf("after %v: exit %d (%v), stderr %q; want exit 1 and \"kvctl: interrupted\"", sig, code, err, stderr.String())
		}
	}
}
