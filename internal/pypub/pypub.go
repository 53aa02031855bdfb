// Package pypub drives publisher.py, a stand-in for an inference engine's
// KV event publisher over real libzmq (Debian's python3-zmq and
// python3-msgpack), from Go tests: the engine subscriber's tests and the
// end-to-end tests of kvagent. It is for tests only.
package pypub

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"
)

// DebianPython is Debian's interpreter, which has python3-zmq and
// python3-msgpack; the pyenv python3 on PATH does not.
const DebianPython = "/usr/bin/python3"

var pythonOK = sync.OnceValue(func() error {
	return exec.Command(DebianPython, "-c", "import zmq, msgpack").Run()
})

// Required reports whether a test that needs the python peers fails when
// they are missing, instead of skipping: on CI (the environment sets CI;
// .ci/run does, and scripts/deps.sh test has installed them there), or
// when KVROUTER_REQUIRE_PY is set. A skip there would pass CI with the
// interop tests never run.
func Required() bool {
	return os.Getenv("CI") != "" || os.Getenv("KVROUTER_REQUIRE_PY") != ""
}

// Missing ends a test whose python peer is missing: it skips it, or fails
// it where the peers are Required.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	if Required() {
		t.Fatalf(format+" (required here: CI or KVROUTER_REQUIRE_PY is set; `scripts/deps.sh test` installs the python peers)", args...)
	}
	t.Skipf(format, args...)
}

// Require skips the test when Debian's python3 with zmq and msgpack is
// missing, or fails it where they are Required.
func Require(t testing.TB) {
	t.Helper()
	if err := pythonOK(); err != nil {
		Missing(t, "%s with zmq and msgpack not available: %v", DebianPython, err)
	}
}

// Config is publisher.py's configuration.
type Config struct {
	Pub         string `json:"pub"`
	Connect     bool   `json:"connect,omitempty"`
	Replay      string `json:"replay,omitempty"`
	ReplayShape int    `json:"replay_shape,omitempty"`
	Topic       string `json:"topic,omitempty"`
	ReplayPace  int    `json:"replay_pace,omitempty"` // see publisher.py
}

// Pub is a running publisher.py: an engine's publisher over
// real libzmq, driven one command at a time.
type Pub struct {
	t      testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr bytes.Buffer
	closed bool

	Pub, Replay string // the endpoints, ports resolved
}

// Start runs publisher.py with cfg until the test ends, and reads the
// endpoints it bound.
func Start(t testing.TB, cfg Config) *Pub {
	t.Helper()
	Require(t)
	arg, _ := json.Marshal(cfg)
	p := &Pub{t: t, cmd: exec.Command(DebianPython, script(), string(arg)), lines: make(chan string, 16)}
	p.cmd.Stderr = &p.stderr
	var err error
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	t.Cleanup(p.Close)
	var hello struct{ Pub, Replay string }
	p.Read(&hello)
	p.Pub, p.Replay = hello.Pub, hello.Replay
	return p
}

// Read decodes the publisher's next line of output into v.
func (p *Pub) Read(v any) {
	p.t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			p.Close()
			p.t.Fatalf("publisher exited: %s", p.stderr.String())
		}
		if err := json.Unmarshal([]byte(line), v); err != nil {
			p.t.Fatalf("publisher said %q: %v", line, err)
		}
	case <-time.After(15 * time.Second):
		p.t.Fatalf("publisher silent for 15s")
	}
}

// Do sends one command and waits for its answer.
func (p *Pub) Do(cmd any) {
	p.t.Helper()
	b, _ := json.Marshal(cmd)
	if _, err := p.stdin.Write(append(b, '\n')); err != nil {
		p.t.Fatalf("write to publisher: %v", err)
	}
	var r struct {
		OK  bool
		Err string
	}
	p.Read(&r)
	if !r.OK {
		p.t.Fatalf("publisher: %s", r.Err)
	}
}

// WaitSub waits (10 s at most) for a subscriber to subscribe.
func (p *Pub) WaitSub() { p.t.Helper(); p.Do(map[string]string{"cmd": "wait_sub"}) }

// NextSub waits (10 s at most) for the next (un)subscription the event
// socket reports, and returns it: 1 then the topic when a first subscriber
// subscribed to it, 0 then the topic when the last one left (its
// connection closed). A test that restarts the subscriber waits for the 0
// before it starts the next one, whose subscription is then reported.
func (p *Pub) NextSub() []byte {
	p.t.Helper()
	b, _ := json.Marshal(map[string]string{"cmd": "wait_sub"})
	if _, err := p.stdin.Write(append(b, '\n')); err != nil {
		p.t.Fatalf("write to publisher: %v", err)
	}
	var r struct {
		OK       bool
		Err, Sub string
	}
	p.Read(&r)
	if !r.OK {
		p.t.Fatalf("publisher: %s", r.Err)
	}
	sub, err := hex.DecodeString(r.Sub)
	if err != nil || len(sub) == 0 {
		p.t.Fatalf("publisher: subscription %q: %v", r.Sub, err)
	}
	return sub
}

// Raw publishes frames as one message, as they are.
func (p *Pub) Raw(frames ...[]byte) {
	p.t.Helper()
	hexes := make([]string, len(frames))
	for i, f := range frames {
		hexes[i] = hex.EncodeToString(f)
	}
	p.Do(map[string]any{"cmd": "raw", "frames": hexes})
}

// ForgetBelow drops the kept batches below seq, as an overrun replay
// buffer would.
func (p *Pub) ForgetBelow(seq uint64) {
	p.t.Helper()
	p.Do(map[string]any{"cmd": "forget_below", "seq": seq})
}

// Close ends the publisher: EOF on its stdin, then waits for it (killing
// it after a while).
func (p *Pub) Close() {
	if p.closed {
		return
	}
	p.closed = true
	p.stdin.Close()
	timer := time.AfterFunc(10*time.Second, func() { p.cmd.Process.Kill() })
	defer timer.Stop()
	for range p.lines { // the stdout pipe must be drained before Wait
	}
	if err := p.cmd.Wait(); err != nil {
		p.t.Errorf("publisher: %v\n%s", err, p.stderr.String())
	}
}

// script is publisher.py's path: beside this file.
func script() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "publisher.py")
}

// Batches: what the "batch" command takes.

// EvSpec is one event of a batch, as publisher.py encodes it.
type EvSpec struct {
	Type      string   `json:"type"`
	Map       bool     `json:"map,omitempty"`
	Hashes    []uint64 `json:"hashes,omitempty"`
	Parent    *uint64  `json:"parent,omitempty"`
	Tokens    []uint32 `json:"tokens,omitempty"`
	BlockSize int      `json:"block_size,omitempty"`
	Medium    string   `json:"medium,omitempty"`
	LoraName  string   `json:"lora_name,omitempty"`
	ExtraKeys []any    `json:"extra_keys,omitempty"` // per block: nil or a list
	GroupIdx  *int     `json:"group_idx,omitempty"`
	Kind      string   `json:"kind,omitempty"` // kv_cache_spec_kind
}

// BatchCmd is the "batch" command: encode a batch, keep it for replay, and
// publish it unless Live is false (a batch the PUB dropped).
type BatchCmd struct {
	Cmd    string   `json:"cmd"`
	Seq    uint64   `json:"seq"`
	Form   string   `json:"form"`
	DP     *uint32  `json:"dp"`
	Events []EvSpec `json:"events"`
	Live   bool     `json:"live"`
}
