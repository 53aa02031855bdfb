package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// kvrouterProcess is the test binary run as kvrouter with args (TestMain),
// its stderr kept, and the channel its exit comes on; the cleanup kills it
// if it still runs.
func kvrouterProcess(t *testing.T, args ...string) (*exec.Cmd, *bytes.Buffer, chan error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), asProcessEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case err := <-exited:
			exited <- err
		default:
			cmd.Process.Kill()
			<-exited
		}
	})
	return cmd, &stderr, exited
}

// TestASignalStopsTheNodeGracefully: SIGTERM (a supervisor's stop) and
// SIGINT (Ctrl-C) each shut a running node down as its own ends do, exit
// 0 (docs/operations.md), not the signal's default death that leaves
// Pebble and the embedded NATS server unclosed. From a review: with
// os.Interrupt taken out of the signals the node takes, every test stayed
// green.
func TestASignalStopsTheNodeGracefully(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			httpAddr := freeAddr(t)
			cmd, stderr, exited := kvrouterProcess(t, "--data-dir", filepath.Join(t.TempDir(), "data"), "--http-addr", httpAddr,
				"--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0", "--log-level", "error")
			pollReady(t, httpAddr)
			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-exited:
				exited <- err // for the cleanup
				if err != nil {
					t.Errorf("kvrouter after %v: %v (stderr %q), want a shutdown, exit 0", sig, err, stderr)
				}
			case <-time.After(15 * time.Second):
				t.Errorf("kvrouter still runs 15 s after %v", sig)
			}
		})
	}
}

// TestARefusedStartExits1: a second kvrouter on a running node's data
// directory (the same --data-dir, its own ports) exits 1 saying the
// directory is held, as docs/operations.md says: a start refused by what
// it finds, not by its command line (exit 2). From a review: with main's
// os.Exit(1) made os.Exit(0), or the lock's error made a usage error,
// every test stayed green.
func TestARefusedStartExits1(t *testing.T) {
	dataDir, httpAddr := filepath.Join(t.TempDir(), "data"), freeAddr(t)
	kvrouterProcess(t, "--data-dir", dataDir, "--http-addr", httpAddr,
		"--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0", "--log-level", "error")
	pollReady(t, httpAddr)
	_, stderr, exited := kvrouterProcess(t, "--data-dir", dataDir, "--http-addr", freeAddr(t),
		"--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0", "--log-level", "error")
	select {
	case err := <-exited:
		exited <- err // for the cleanup
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 {
			t.Errorf("a second kvrouter on a running node's data directory: %v (stderr %q), want exit 1", err, stderr)
		}
		if !strings.Contains(stderr.String(), "held by another kvrouter process") {
			t.Errorf("a second kvrouter on a running node's data directory: stderr %q, want it to say the directory is held", stderr)
		}
	case <-time.After(15 * time.Second):
		t.Error("a second kvrouter on a running node's data directory still runs 15 s on, want it refused")
	}
}
