//go:build unix

package eventplane

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestANATSCAFileIsReadUpToACap: docs/operations.md, Security: "a CA file
// [is read] up to 8 MiB (kvrouter's, kvagent's, kvsim's and kvctl's
// alike): a larger one (a wrong path, /dev/zero) is refused, naming its
// flag, instead of read without end". --nats-tls-ca (and --nats-creds)
// are read by CheckFiles before the node or agent starts. A FIFO that
// gives 9 MiB and never ends stands for /dev/zero without eating the
// machine's memory: a capped read refuses it at 8 MiB + 1 (a creds file
// at 64 KiB + 1). From a review: both were read with os.ReadFile.
func TestANATSCAFileIsReadUpToACap(t *testing.T) {
	for _, flag := range []string{"--nats-tls-ca", "--nats-creds"} {
		fifo := filepath.Join(t.TempDir(), "endless")
		if err := syscall.Mkfifo(fifo, 0o600); err != nil {
			t.Fatal(err)
		}
		w := make(chan *os.File, 1)
		go func() {
			f, err := os.OpenFile(fifo, os.O_WRONLY, 0)
			if err != nil {
				w <- nil
				return
			}
			w <- f
			f.Write(bytes.Repeat([]byte("A"), 9<<20)) // and stays open
		}()
		o := ClientOptions{TLSCA: fifo}
		if flag == "--nats-creds" {
			o = ClientOptions{Creds: fifo}
		}
		done := make(chan error, 1)
		go func() { done <- o.CheckFiles() }()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), flag) || !strings.Contains(err.Error(), "larger") {
				t.Errorf("%s of an endless file: %v, want it refused as larger than the cap, naming the flag", flag, err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s of a file that never ends: CheckFiles still reading after 5 s (9 MiB given), want it refused past a cap", flag)
		}
		if f := <-w; f != nil {
			f.Close() // lets a stuck read end
		}
	}
}
