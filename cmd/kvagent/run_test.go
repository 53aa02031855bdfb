package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/internal/rawhttp"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/nvml"
)

// A registration the router refuses as invalid ends the agent with the
// router's reason (main exits 1 with it), after one try: retrying it would
// be refused for ever.
func TestARefusedRegistrationEndsTheAgent(t *testing.T) {
	var tries atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		tries.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		w.Write([]byte(`{"error":"the registration is wrong","reason":"invalid"}`))
	}))
	defer srv.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0") // a port nothing listens on once closed
	if err != nil {
		t.Fatal(err)
	}
	port := closed.Addr().(*net.TCPAddr).Port
	closed.Close()
	a := app()
	a.ExitErrHandler = func(*cli.Context, error) {}
	done := make(chan error, 1)
	go func() {
		done <- a.Run([]string{"kvagent", "--metrics-addr", "", "--log-level", "error", "--worker-id", "1", "--block-size", "4",
			"--nats-url", "nats://127.0.0.1:" + strconv.Itoa(port), "--engine-endpoint", "tcp://127.0.0.1:" + strconv.Itoa(port),
			"--router", strings.TrimPrefix(srv.URL, "http://")})
	}()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("kvagent still runs 30 s after the router refused its registration (%d tries)", tries.Load())
	}
	if ec, ok := err.(cli.ExitCoder); err == nil || ok && ec.ExitCode() != 1 ||
		!strings.Contains(err.Error(), "refuses the worker's registration") || !strings.Contains(err.Error(), "the registration is wrong") {
		t.Fatalf("kvagent: %v, want an error (exit 1) with the router's reason", err)
	}
	if n := tries.Load(); n != 1 {
		t.Errorf("%d registrations sent, want 1", n)
	}
}

// TestCUDABackendWithoutAGPUFails: --backend cuda on a machine without a
// GPU exits 1 saying there is no CUDA, and what to give instead. From a
// review: it panicked (a nil *CUDA closed through the Backend interface).
func TestCUDABackendWithoutAGPUFails(t *testing.T) {
	if backend.Detect() == backend.KindCUDA {
		t.Skip("a GPU machine: the test is about machines without one")
	}
	a := app()
	a.ExitErrHandler = func(*cli.Context, error) {}
	sock := filepath.Join(shortTempDir(t), "s")
	err := a.Run([]string{"kvagent", "--metrics-addr", "", "--log-level", "error", "--worker-id", "1", "--block-size", "4",
		"--nats-url", "nats://127.0.0.1:1", "--offload-socket", sock, "--block-bytes", "64", "--host-blocks", "4", "--backend", "cuda"})
	var ec cli.ExitCoder
	if err == nil || errors.As(err, &ec) && ec.ExitCode() != 1 || !errors.Is(err, backend.ErrNoCUDA) || !strings.Contains(err.Error(), "--backend host") {
		t.Fatalf("kvagent --backend cuda without a GPU: %v, want exit 1 saying there is no CUDA and naming --backend host", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the offload socket is left behind: %v", err)
	}
}

// shortTempDir is a temporary directory with a path short enough for a
// Unix socket (t.TempDir's can be past the 108 bytes of sun_path).
func shortTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvagent")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// TestAPortInUseFailsBeforeAnythingStarts: a --metrics-addr or a --bind
// endpoint in use fails the start (exit 1, naming the flag) before the
// offload socket is made, the worker registered or the engine followed.
// From a review: the agent made the offload socket and logged "engine API
// listening" before it found --metrics-addr in use, and logged "following
// the engine" (and with --router registered the worker) before its bind
// failed.
func TestAPortInUseFailsBeforeAnythingStarts(t *testing.T) {
	var registrations atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		registrations.Add(1)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	inUse, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer inUse.Close()
	// start runs kvagent with args and returns how it ended, once it has.
	start := func(name string, args []string) (*agentRun, error) {
		r := startKvagent(t, append([]string{"--worker-id", "1", "--block-size", "4",
			"--nats-url", "nats://127.0.0.1:" + strconv.Itoa(freePort(t)), "--router", strings.TrimPrefix(srv.URL, "http://"),
			"--offload-socket", filepath.Join(shortTempDir(t), "s"), "--block-bytes", "64", "--host-blocks", "4", "--backend", "host"},
			args...)...)
		select {
		case err := <-r.done:
			close(r.done)
			r.err = err
			return r, err
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: kvagent still runs 30 s after its start with a port in use", name)
			return nil, nil
		}
	}
	for _, tc := range []struct {
		name string
		args func() []string
		want string
	}{
		{"metrics", func() []string { return []string{"--metrics-addr", inUse.Addr().String()} }, "--metrics-addr"},
		{"bind", func() []string { return []string{"--bind", "--engine-endpoint", "tcp://" + inUse.Addr().String()} }, "--bind"},
		{"bind, rank 1", func() []string {
			// Rank 0 binds the port below one in use, which must be free:
			// a port another process took meanwhile fails rank 0, and the
			// loop below tries another pair.
			return []string{"--bind", "--dp-size", "2", "--engine-endpoint", "tcp://127.0.0.1:" + strconv.Itoa(belowAPortInUse(t))}
		}, "rank 1"},
	} {
		var r *agentRun
		var err error
		for try := 1; ; try++ {
			r, err = start(tc.name, tc.args())
			if tc.name != "bind, rank 1" || err == nil || !strings.Contains(err.Error(), "rank 0's") || try == 5 {
				break
			}
			t.Logf("%s: rank 0's port was taken meanwhile (%v); another pair", tc.name, err)
		}
		var ec cli.ExitCoder
		if err == nil || errors.As(err, &ec) && ec.ExitCode() != 1 || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "address already in use") {
			t.Errorf("%s: kvagent: %v, want exit 1 naming %s and the address in use", tc.name, err, tc.want)
		}
		for _, started := range []string{"engine API listening", "following the engine", "worker registered"} {
			if r.logs.has(started) {
				t.Errorf("%s: kvagent logged %q before it failed:\n%s", tc.name, started, r.logs)
			}
		}
		if n := registrations.Load(); n != 0 {
			t.Errorf("%s: %d registrations sent before the start failed", tc.name, n)
		}
	}
}

// TestTheMetricsServerHasItsTimeouts: the --metrics-addr server gives a
// request's header 10 s and closes a keep-alive connection idle for 2
// minutes, and sets no read or write timeout. The start stops on a --bind
// endpoint in use, once the server was made. From a review: deleting both
// timeouts passed every test of the package.
func TestTheMetricsServerHasItsTimeouts(t *testing.T) {
	var got *http.Server
	metricsServing = func(s *http.Server) { got = s }
	t.Cleanup(func() { metricsServing = nil })
	inUse, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer inUse.Close()
	r := startKvagent(t, "--metrics-addr", "127.0.0.1:0", "--worker-id", "1", "--block-size", "4",
		"--nats-url", "nats://127.0.0.1:"+strconv.Itoa(freePort(t)), "--bind", "--engine-endpoint", "tcp://"+inUse.Addr().String())
	if err := r.waitEnded(t); err == nil || !strings.Contains(err.Error(), "--bind") {
		t.Fatalf("kvagent with its engine endpoint in use: %v, want the --bind error", err)
	}
	if got == nil {
		t.Fatal("no --metrics-addr server was made")
	}
	if got.ReadHeaderTimeout != 10*time.Second || got.IdleTimeout != 2*time.Minute || got.ReadTimeout != 0 || got.WriteTimeout != 0 || got.MaxHeaderBytes != 0 {
		t.Errorf("the --metrics-addr server: header timeout %v, idle %v, read %v, write %v, max header bytes %d; want 10s, 2m0s, none, none, the default",
			got.ReadHeaderTimeout, got.IdleTimeout, got.ReadTimeout, got.WriteTimeout, got.MaxHeaderBytes)
	}
	if got.ErrorLog == nil {
		t.Error("the --metrics-addr server has no ErrorLog: net/http would log through the default logger, unbounded and past --log-level")
	}
}

// TestTheMetricsServerClosesAConnectionWithAnUnreadBody: nothing on
// --metrics-addr reads a body; a request that declares one whose bytes
// never come is answered at once and its connection closed, not held while
// net/http waits on the body with no deadline (the server sets no read
// timeout). Connection: close alone answered but did not close: net/http's
// finishRequest still read up to 256 KiB of the body first. From a review
// of kvrouter's ports, which share these settings.
func TestTheMetricsServerClosesAConnectionWithAnUnreadBody(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "up 1") })
	srv := httptest.NewServer(newMetricsServer(mux, slog.New(slog.DiscardHandler)).Handler)
	defer srv.Close()
	code, b, err := rawhttp.SendThenRead(t, srv.Listener.Addr().String(), "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
	if code != http.StatusOK || string(b) != "up 1\n" {
		t.Fatalf("GET /metrics, its body never sent: %d %q, want 200 \"up 1\\n\"", code, b)
	}
	if err != io.EOF {
		t.Fatalf("GET /metrics, its body never sent: answered, but the connection was not closed within 10s: read: %v", err)
	}
}

// belowAPortInUse returns a port that was free a moment ago and holds the
// port above it in use until the test ends: for --dp-size 2 with --bind,
// rank 1's endpoint then is in use and rank 0's is not.
func belowAPortInUse(t *testing.T) int {
	t.Helper()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := l.Addr().(*net.TCPAddr).Port
		if p > 1 {
			if probe, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p-1)); err == nil {
				probe.Close()
				t.Cleanup(func() { l.Close() })
				return p - 1
			}
		}
		l.Close()
	}
}

// TestStoppedIsLoggedLast: "kvagent stopped" is logged once the agent has
// stopped: the offload side closed (its socket gone) and the publisher's
// last events had their wait. From a review: it was logged before both.
func TestStoppedIsLoggedLast(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "s")
	var sockAtStopped atomic.Value
	r := startKvagentLogging(t, func(line string) {
		if strings.Contains(line, "kvagent stopped") {
			_, err := os.Stat(sock)
			sockAtStopped.Store(err == nil)
		}
	}, "--worker-id", "1", "--block-size", "4", "--nats-url", "nats://127.0.0.1:"+strconv.Itoa(freePort(t)),
		"--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)),
		"--offload-socket", sock, "--block-bytes", "64", "--host-blocks", "4", "--backend", "host")
	waitFor(t, "the agent following the engine", func() bool { return r.logs.has("following the engine") })
	if err := r.stop(t); err != nil {
		t.Fatalf("kvagent: %v", err)
	}
	if v, _ := sockAtStopped.Load().(bool); v || sockAtStopped.Load() == nil {
		t.Fatalf("kvagent stopped logged while the offload socket was still there (%v), or not at all:\n%s", sockAtStopped.Load(), r.logs)
	}
	lines := strings.Split(strings.TrimSpace(r.logs.String()), "\n")
	if !strings.Contains(lines[len(lines)-1], "kvagent stopped") {
		t.Fatalf("the log does not end with kvagent stopped:\n%s", r.logs)
	}
}

// TestGPUProbesLogThroughTheAgentsLogger: what the GPU telemetry (NVML)
// and the offload backend say as they open goes through the agent's
// logger, which --log-level filters, and nothing through the default
// logger. From a review: "nvml: no GPU telemetry" and "offload backend:
// using host copies" went through the default logger, in its own format,
// even with --log-level error.
func TestGPUProbesLogThroughTheAgentsLogger(t *testing.T) {
	var defaultLog logBuffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&defaultLog, nil)))
	defer slog.SetDefault(old)
	noNVML := !nvml.Open(nvml.Config{Library: "libnvidia-ml.so.1", Logger: slog.New(slog.DiscardHandler)}).Available()
	for _, level := range []string{"info", "error"} {
		sock := filepath.Join(shortTempDir(t), "s")
		r := startKvagent(t, "--log-level", level, "--worker-id", "1", "--block-size", "4",
			"--nats-url", "nats://127.0.0.1:"+strconv.Itoa(freePort(t)), "--engine-endpoint", "tcp://127.0.0.1:"+strconv.Itoa(freePort(t)),
			"--offload-socket", sock, "--block-bytes", "64", "--host-blocks", "4")
		waitFor(t, "the offload socket", func() bool { _, err := os.Stat(sock); return err == nil })
		if err := r.stop(t); err != nil {
			t.Fatalf("kvagent: %v", err)
		}
		if level == "info" && (!r.logs.has("level=INFO", "offload backend:") || noNVML && !r.logs.has("level=INFO", "nvml: no GPU telemetry")) {
			t.Errorf("--log-level info: the agent's log lacks the offload backend's or NVML's lines:\n%s", r.logs)
		}
		if level == "error" && (r.logs.has("offload backend:") || r.logs.has("nvml:")) {
			t.Errorf("--log-level error: the agent's log has the offload backend's or NVML's lines:\n%s", r.logs)
		}
	}
	if s := defaultLog.String(); s != "" {
		t.Errorf("logged through the default logger:\n%s", s)
	}
}

// TestASecondSignalEndsASlowStart: kvagent takes signals from its start,
// so that one during a slow start (pinned memory, a disk pool opening)
// still closes what was opened; a second one then ends the process at
// once, as a signal does by default, so that a start that hangs can still
// be stopped, as kvrouter's can. The other process runs kvagent with an
// offload backend whose open hangs (TestHelperStartsSlowly), and is sent
// SIGINT until it ends. From a review: the signals were caught until Run
// returned, and a start that hung took every SIGINT and SIGTERM.
func TestASecondSignalEndsASlowStart(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperStartsSlowly$")
	cmd.Env = append(os.Environ(), slowStartEnv+"="+strconv.Itoa(freePort(t)))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
	}()
	if line, err := bufio.NewReader(out).ReadString('\n'); line != "opening\n" {
		t.Fatalf("the slow start said %q, %v, want it opening the backend", line, err)
	}
	// The first SIGINT is the start's to take (it stops once started); a
	// later one, once the first was taken, ends the process.
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(5 * time.Second)
	for {
		if err := cmd.Process.Signal(syscall.SIGINT); err != nil && !errors.Is(err, os.ErrProcessDone) {
			t.Fatal(err)
		}
		select {
		case err := <-exited:
			exited <- err // for the deferred kill
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("kvagent after SIGINTs during a start that hangs: %v, want it killed by SIGINT", err)
			}
			if ws, ok := ee.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGINT {
				t.Errorf("kvagent after SIGINTs during a start that hangs: %v, want it killed by SIGINT", err)
			}
			return
		case <-deadline:
			t.Fatal("kvagent still runs 5 s into SIGINTs every 100 ms during a start that hangs (in the offload backend's open)")
		case <-tick.C:
		}
	}
}

// slowStartEnv, set in its environment, makes the test binary run
// TestHelperStartsSlowly's kvagent, its NATS at the port it holds.
const slowStartEnv = "KVAGENT_TEST_SLOW_START"

// TestHelperStartsSlowly is TestASecondSignalEndsASlowStart's other
// process: it runs kvagent with an offload backend whose open says
// "opening" and hangs for a minute.
func TestHelperStartsSlowly(t *testing.T) {
	port := os.Getenv(slowStartEnv)
	if port == "" {
		t.Skip("TestASecondSignalEndsASlowStart's helper process")
	}
	openBackend = func(backend.Kind, int, *slog.Logger) (backend.Backend, error) {
		fmt.Println("opening")
		time.Sleep(time.Minute) // the start that hangs
		return nil, errors.New("gave up")
	}
	_ = app().Run([]string{"kvagent", "--metrics-addr", "", "--log-level", "error", "--worker-id", "1", "--block-size", "4",
		"--nats-url", "nats://127.0.0.1:" + port, "--offload-socket", filepath.Join(shortTempDir(t), "s"),
		"--block-bytes", "64", "--host-blocks", "4", "--backend", "host"})
}
