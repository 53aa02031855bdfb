package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v2"
	"go.uber.org/goleak"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/pool"
	"github.com/kvrouter/kvrouter/raftfsm"
)

func TestMain(m *testing.M) {
	testwatch.Start()
	ignores := []goleak.Option{
		goleak.IgnoreTopFunction("github.com/cockroachdb/pebble/v2/internal/cache.(*shard).releaseLoop"),
		goleak.IgnoreAnyFunction("github.com/cockroachdb/pebble/v2.(*tableCacheShard).releaseLoop"),
	}
	goleak.VerifyTestMain(testwatch.Settled(m, ignores...), ignores...)
}

var quiet = slog.New(slog.DiscardHandler)

// fakeAgent records what the pools publish and restore.
type fakeAgent struct {
	mu        sync.Mutex
	published map[kvevent.Rank]int // blocks stored
	restored  map[kvevent.Rank][]kvevent.Event
}

func newFakeAgent() *fakeAgent {
	return &fakeAgent{published: map[kvevent.Rank]int{}, restored: map[kvevent.Rank][]kvevent.Event{}}
}

func (f *fakeAgent) Publish(r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range evs {
		f.published[r] += len(ev.Blocks)
	}
	return 1, nil
}

// CheckOffload accepts every block: the fake knows nothing the engine
// reported.
func (f *fakeAgent) CheckOffload(kvevent.Rank, uint64, kvevent.Block) error { return nil }

func (f *fakeAgent) Restore(r kvevent.Rank, evs []kvevent.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.restored[r] = append(f.restored[r], evs...)
	return nil
}

func TestOffloadFlagsAreChecked(t *testing.T) {
	ok := offloadConfig{Socket: "/s", Backend: backend.KindHost, BlockBytes: 64, HostBlocks: 4,
		Workers: 1, Queue: 1, Threshold: 2, OnboardTimeout: time.Second, MaxRegion: 1}
	for _, tc := range []struct {
		name string
		edit func(*offloadConfig)
		want string // "" for no error
	}{
		{"host only", func(*offloadConfig) {}, ""},
		{"offload off ignores the rest", func(c *offloadConfig) { *c = offloadConfig{} }, ""},
		{"disk only", func(c *offloadConfig) { c.HostBlocks, c.DiskDir, c.DiskBlocks = 0, "/d", 8 }, ""},
		{"no block size", func(c *offloadConfig) { c.BlockBytes = 0 }, "--block-bytes"},
		{"negative cuda device", func(c *offloadConfig) { c.CUDADevice = -1 }, "--cuda-device"},
		{"no pool", func(c *offloadConfig) { c.HostBlocks = 0 }, "--host-blocks or --disk-blocks"},
		{"disk blocks without a dir", func(c *offloadConfig) { c.DiskBlocks = 8 }, "--disk-dir"},
		{"disk dir without blocks", func(c *offloadConfig) { c.DiskDir = "/d" }, "--disk-dir"},
		{"no workers", func(c *offloadConfig) { c.Workers = 0 }, "--offload-workers"},
		{"threshold 0", func(c *offloadConfig) { c.Threshold = 0 }, "--offload-filter-threshold"},
		{"no region blocks", func(c *offloadConfig) { c.MaxRegion = 0 }, "--offload-max-region-blocks"},
		// From a review: past 2^32-1 the threshold passed the check and
		// failed each rank's filter once the pools were open (exit 1,
		// <disk-dir>/dp0 made).
		{"threshold past 32 bits", func(c *offloadConfig) { c.Threshold = math.MaxUint32 + 1 }, "--offload-filter-threshold"},
		{"threshold at 32 bits", func(c *offloadConfig) { c.Threshold = math.MaxUint32 }, ""},
		// From a review: a socket the engine API could not listen on
		// failed the start once the pools were open.
		{"socket in no directory", func(c *offloadConfig) { c.Socket = "/nonexistent-kvagent-dir/s" }, "--offload-socket"},
		{"socket in a file", func(c *offloadConfig) { c.Socket = "/dev/null/s" }, "--offload-socket"},
		{"socket path past the limit", func(c *offloadConfig) { c.Socket = "/tmp/" + strings.Repeat("s", 108) }, "--offload-socket"},
	} {
		c := ok
		tc.edit(&c)
		err := c.check()
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s: %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
	// The flags reach the check before anything is started, as usage
	// errors: TestLivenessFlagsAreChecked.
}

// TestOffloadReopensEachRanksDiskPoolAndRestoresIt: each rank's G3 pool
// lives in <disk-dir>/dp<rank>; after a restart every block of a pool goes
// to the agent's Restore under its own parent (which makes them part of the
// rank's first dump): two root chains, and a chain longer than the 256
// blocks a reopened pool's dump cuts its events at, so the restore is more
// than one event; and Close leaves no socket and no goroutine behind.
func TestOffloadReopensEachRanksDiskPoolAndRestoresIt(t *testing.T) {
	sockDir, err := os.MkdirTemp("", "kvagent")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sockDir)
	oc := offloadConfig{Socket: filepath.Join(sockDir, "s"), Backend: backend.KindHost, BlockBytes: 64,
		HostBlocks: 4, DiskDir: t.TempDir(), DiskBlocks: 512, Workers: 1, Queue: 8, Threshold: 2, OnboardTimeout: time.Second}
	ranks := []kvevent.Rank{{Worker: 1, DP: 0}, {Worker: 1, DP: 1}}
	start := func(f *fakeAgent) *offload {
		t.Helper()
		o, err := startOffload(oc, ranks, f, prometheus.NewRegistry(), quiet)
		if err != nil {
			t.Fatal(err)
		}
		return o
	}

	f := newFakeAgent()
	o := start(f)
	c := engineapi.NewClient(oc.Socket)
	defer c.Close()
	st, err := c.Stats(context.Background())
	if err != nil || len(st.Ranks) != 2 || st.Ranks[1].Host == nil || st.Ranks[1].Disk == nil || st.Backend != "host" {
		t.Fatalf("stats: %+v, %v", st, err)
	}
	// Each rank's blocks, block → parent (0: a root): rank 1 holds a root
	// chain of 300 blocks (1..300) and one of 3 (1001..1003), rank 0 one
	// of 2 (2001, 2002).
	want := []map[uint64]uint64{{}, {}}
	put := func(rank int, first, n uint64) {
		t.Helper()
		blocks := make([]pool.Block, n)
		data := make([][]byte, n)
		for i := range n {
			h := first + i
			blocks[i] = pool.Block{Hash: h, Local: 100 + h}
			if i > 0 {
				blocks[i].Parent = h - 1
			}
			want[rank][h] = blocks[i].Parent
			data[i] = make([]byte, 64)
		}
		if stored, err := o.disks[rank].Put(blocks, data); err != nil || stored != int(n) {
			t.Fatalf("rank %d: stored %d of %d blocks: %v", rank, stored, n, err)
		}
	}
	put(1, 1, 300)
	put(1, 1001, 3)
	put(0, 2001, 2)
	if f.published[ranks[1]] != 303 || f.published[ranks[0]] != 2 || len(f.restored) != 0 {
		t.Fatalf("published %v, restored %v; want 303 blocks of rank 1 and 2 of rank 0 published, nothing restored",
			f.published, f.restored)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, err := os.Stat(oc.Socket); !os.IsNotExist(err) {
		t.Fatalf("the socket outlived Close: %v", err)
	}
	if _, err := os.Stat(filepath.Join(oc.DiskDir, "dp1")); err != nil {
		t.Fatalf("rank 1's disk pool is not in <disk-dir>/dp1: %v", err)
	}

	f = newFakeAgent()
	o = start(f)
	defer o.Close()
	for i, r := range ranks {
		got := map[uint64]uint64{}
		for _, ev := range f.restored[r] {
			if ev.Kind != kvevent.KindStored || ev.Tier != kvevent.TierDisk {
				t.Fatalf("rank %v: restored a %v event of tier %v, want disk stores", r, ev.Kind, ev.Tier)
			}
			parent := uint64(0)
			if ev.HasParent {
				parent = ev.Parent
			}
			for _, b := range ev.Blocks {
				if _, dup := got[b.EngineHash]; dup {
					t.Fatalf("rank %v: block %d restored twice", r, b.EngineHash)
				}
				got[b.EngineHash] = parent
				parent = b.EngineHash
			}
		}
		if !maps.Equal(got, want[i]) {
			t.Fatalf("rank %v: restored %d blocks in %d events, want all %d under their parents (missing or misplaced: %v)",
				r, len(got), len(f.restored[r]), len(want[i]), differ(want[i], got))
		}
	}
	if err := c.Health(context.Background()); err != nil {
		t.Fatalf("the restarted engine API: %v", err)
	}
}

// differ lists the blocks of want that got lacks or holds under another
// parent, and those got holds that want does not, in order, the first 10.
func differ(want, got map[uint64]uint64) []uint64 {
	var hs []uint64
	for h, p := range want {
		if q, ok := got[h]; !ok || q != p {
			hs = append(hs, h)
		}
	}
	for h := range got {
		if _, ok := want[h]; !ok {
			hs = append(hs, h)
		}
	}
	slices.Sort(hs)
	return hs[:min(len(hs), 10)]
}

// TestBuildInfo: kvagent_build_info is 1 with the version and Go version
// (metrics.md: build facts in an *_info gauge).
func TestBuildInfo(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(buildInfo())
	fams, err := reg.Gather()
	if err != nil || len(fams) != 1 || fams[0].GetName() != "kvagent_build_info" {
		t.Fatalf("gathered %v, %v", fams, err)
	}
	m := fams[0].GetMetric()[0]
	labels := map[string]string{}
	for _, l := range m.GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	if m.GetGauge().GetValue() != 1 || labels["version"] != version || labels["go_version"] != runtime.Version() {
		t.Fatalf("kvagent_build_info %v = %v", labels, m.GetGauge().GetValue())
	}
}

// TestLivenessFlagsAreChecked: flags the agent could not run with are
// usage errors (exit 2) before anything starts. From a review: a missing
// --worker-id exited 1, a negative lease or capacity was retried against
// the router's refusal for ever, and a lease not longer than the heartbeat
// interval let the worker be removed between heartbeats.
func TestLivenessFlagsAreChecked(t *testing.T) {
	base := []string{"kvagent", "--metrics-addr", ""}
	junk := filepath.Join(t.TempDir(), "junk")
	if err := os.WriteFile(junk, []byte("junk\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--block-size", "4"}, "--worker-id"},
		{[]string{"--worker-id", "1"}, "--block-size"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--lease", "-1s"}, "--lease"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--lease", "500us"}, "--lease"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--lease", "1s", "--heartbeat-interval", "1s"}, "--heartbeat-interval"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--heartbeat-interval", "0s"}, "--heartbeat-interval"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--capacity-host", "-3"}, "--capacity-host"},
		// From a review: a rank past 32 bits wrapped to another worker's
		// (4294967296 was rank 0), and the offload flags failed with exit 1.
		{[]string{"--worker-id", "1", "--block-size", "4", "--dp-start", "4294967296"}, "--dp-start"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--dp-start", "4294967295", "--dp-size", "2"}, "--dp-start"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--dp-start", "18446744073709551615", "--dp-size", "2"}, "--dp-start"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--offload-socket", "/tmp/x.sock", "--host-blocks", "4"}, "--block-bytes"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--backend", "tpu"}, "--backend"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--router", "h:1", "--router-token-file", "/nonexistent/token"}, "--router-token"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--router", "h:1", "--router-token", "a", "--router-token-file", junk}, "--router-token"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--router", "h:1", "--router-tls-ca", junk}, "--router-tls-ca"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--router-token", "a"}, "no --router"},
		{[]string{"--worker-id", "1", "--block-size", "4", "--salt", strings.Repeat("s", 1025)}, "--salt"},
	} {
		a := app()
		a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		err := a.Run(append(base, tc.args...))
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("kvagent %v: %v, want exit 2 naming %s", tc.args, err, tc.want)
		}
	}
}

// TestRegistrationCarriesTheTokenOverTLS: with --router-tls-ca and a
// token, the agent registers over TLS with "Authorization: Bearer".
func TestRegistrationCarriesTheTokenOverTLS(t *testing.T) {
	var got atomic.Value
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Store(r.Header.Get("Authorization"))
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	pool := x509.NewCertPool()
	pool.AddCert(srv.Certificate())
	cl, err := newRouterClient([]string{strings.TrimPrefix(srv.URL, "https://")}, routerSec{token: "tok", tls: &tls.Config{RootCAs: pool}})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := cl.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatalf("registration over TLS: %v", err)
	}
	if a, _ := got.Load().(string); a != "Bearer tok" {
		t.Fatalf("Authorization %q, want Bearer tok", a)
	}
}

// TestRegistrationPassesOverAHungNode: a node that accepts connections and
// never answers costs a registration one try's share, and the next node
// takes it. From a review: with the client's defaults every registration
// spent its whole 5 s on the hung first node.
func TestRegistrationPassesOverAHungNode(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0") // accepted by the kernel, never answered
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	var hits atomic.Int32
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.WriteHeader(http.StatusNoContent)
	}))
	defer ok.Close()
	cl, err := newRouterClient([]string{hung.Addr().String(), strings.TrimPrefix(ok.URL, "http://")}, routerSec{})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // the agent's registration bound
	defer cancel()
	if err := cl.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 1, BlockSize: 4}); err != nil || hits.Load() != 1 {
		t.Fatalf("registration with a hung first node: %v, %d reached the healthy one", err, hits.Load())
	}
}

// TestOffloadFlagsWithoutTheSocketAreUsageErrors: an offload flag without
// --offload-socket is a usage error (exit 2) naming --offload-socket. From
// a review: "--host-blocks 10" or "--disk-dir /tmp/x" alone started an
// agent with no offload, and no word of it.
func TestOffloadFlagsWithoutTheSocketAreUsageErrors(t *testing.T) {
	// Without the check the agent starts: the context stops it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, args := range [][]string{
		{"--host-blocks", "10"},
		{"--disk-dir", "/nonexistent/g3"},
		{"--disk-blocks", "10"},
		{"--block-bytes", "64"},
		{"--backend", "host"},
		{"--onboard-timeout", "2s"},
		{"--offload-max-region-blocks", "16"},
		{"--cuda-device", "1"},
	} {
		a := app()
		a.ExitErrHandler = func(*cli.Context, error) {}
		err := a.RunContext(ctx, append([]string{"kvagent", "--metrics-addr", "", "--log-level", "error", "--worker-id", "1", "--block-size", "4",
			"--nats-url", "nats://127.0.0.1:1"}, args...))
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), "--offload-socket") || !strings.Contains(err.Error(), args[0]) {
			t.Errorf("kvagent %v: %v, want exit 2 naming %s and --offload-socket", args, err, args[0])
		}
	}
	t.Setenv("KVAGENT_HOST_BLOCKS", "10")
	a := app()
	a.ExitErrHandler = func(*cli.Context, error) {}
	err := a.RunContext(ctx, []string{"kvagent", "--metrics-addr", "", "--log-level", "error", "--worker-id", "1", "--block-size", "4", "--nats-url", "nats://127.0.0.1:1"})
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), "KVAGENT_HOST_BLOCKS") {
		t.Errorf("KVAGENT_HOST_BLOCKS without an offload socket: %v, want exit 2 naming the variable", err)
	}
}

// TestADiskDirInUseSaysSo: a --disk-dir whose pool another process holds
// (another kvagent) fails saying it is locked, naming the flag. From a
// review: the error was "open disk pool ...: resource temporarily
// unavailable".
func TestADiskDirInUseSaysSo(t *testing.T) {
	oc := offloadConfig{Socket: filepath.Join(shortTempDir(t), "s"), Backend: backend.KindHost, BlockBytes: 64,
		DiskDir: t.TempDir(), DiskBlocks: 16, Workers: 1, Queue: 8, Threshold: 2, OnboardTimeout: time.Second}
	dir := filepath.Join(oc.DiskDir, "dp0")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// The lock is a process's (fcntl), so another process holds it: this
	// test binary, running TestHelperHoldsALock.
	holder := exec.Command(os.Args[0], "-test.run=^TestHelperHoldsALock$")
	holder.Env = append(os.Environ(), "KVAGENT_TEST_HOLD_LOCK="+filepath.Join(dir, "LOCK"))
	release, err := holder.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Wait()
	defer release.Close()
	if line, err := bufio.NewReader(out).ReadString('\n'); line != "locked\n" {
		t.Fatalf("the lock holder said %q, %v", line, err)
	}
	o, err := startOffload(oc, []kvevent.Rank{{Worker: 1, DP: 0}}, newFakeAgent(), prometheus.NewRegistry(), quiet)
	if err == nil {
		o.Close()
		t.Fatal("the agent opened a disk pool another process holds")
	}
	if !strings.Contains(err.Error(), "locked by another process") || !strings.Contains(err.Error(), "--disk-dir "+oc.DiskDir) {
		t.Fatalf("a disk pool in use: %v, want it said locked by another process, naming --disk-dir %s", err, oc.DiskDir)
	}
}

// TestHelperHoldsALock is TestADiskDirInUseSaysSo's other process: it
// locks the file KVAGENT_TEST_HOLD_LOCK names as Pebble does, says
// "locked", and holds the lock until its stdin closes.
func TestHelperHoldsALock(t *testing.T) {
	name := os.Getenv("KVAGENT_TEST_HOLD_LOCK")
	if name == "" {
		t.Skip("TestADiskDirInUseSaysSo's helper process")
	}
	f, err := os.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.FcntlFlock(f.Fd(), syscall.F_SETLK, &syscall.Flock_t{Type: syscall.F_WRLCK}); err != nil {
		t.Fatal(err)
	}
	fmt.Println("locked")
	io.Copy(io.Discard, os.Stdin)
}

// TestOffloadFlagsAtTheirDefaultsNeedNoSocket: an offload flag's empty
// variable (a templated KVAGENT_DISK_DIR=) or its default spelled out
// (--backend auto) asks for nothing, and starts no usage error. From a
// review: both were refused, exit 2, with offload off.
func TestOffloadFlagsAtTheirDefaultsNeedNoSocket(t *testing.T) {
	offloadOnly := func(args ...string) error {
		a := app()
		a.Action = func(c *cli.Context) error { _, err := offloadConfigFrom(c); return err }
		a.ExitErrHandler = func(*cli.Context, error) {}
		return a.Run(append([]string{"kvagent"}, args...))
	}
	t.Setenv("KVAGENT_DISK_DIR", "")
	for _, args := range [][]string{nil, {"--backend", "auto"}, {"--host-blocks", "0"}, {"--cuda-device", "0"}} {
		if err := offloadOnly(args...); err != nil {
			t.Errorf("kvagent %v with KVAGENT_DISK_DIR empty, no offload socket: %v, want no error", args, err)
		}
	}
	if err := offloadOnly("--host-blocks", "10"); err == nil || !strings.Contains(err.Error(), "--offload-socket") {
		t.Errorf("--host-blocks 10 without an offload socket: %v, want an error naming --offload-socket", err)
	}
}

// TestCUDADeviceFlagIsParsed: --cuda-device (or KVAGENT_CUDA_DEVICE) names
// the device the cuda backend opens, 0 when not given; a negative one is
// refused before anything starts.
func TestCUDADeviceFlagIsParsed(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "s")
	parse := func(args ...string) (offloadConfig, error) {
		var oc offloadConfig
		a := app()
		a.Action = func(c *cli.Context) (err error) { oc, err = offloadConfigFrom(c); return err }
		a.ExitErrHandler = func(*cli.Context, error) {}
		err := a.Run(append([]string{"kvagent", "--offload-socket", sock, "--block-bytes", "64", "--host-blocks", "4"}, args...))
		return oc, err
	}
	if oc, err := parse(); err != nil || oc.CUDADevice != 0 {
		t.Errorf("no --cuda-device: device %d, %v; want 0", oc.CUDADevice, err)
	}
	if oc, err := parse("--cuda-device", "3"); err != nil || oc.CUDADevice != 3 {
		t.Errorf("--cuda-device 3: device %d, %v; want 3", oc.CUDADevice, err)
	}
	if _, err := parse("--cuda-device", "-1"); err == nil || !strings.Contains(err.Error(), "--cuda-device") {
		t.Errorf("--cuda-device -1: %v, want an error naming --cuda-device", err)
	}
	t.Setenv("KVAGENT_CUDA_DEVICE", "2")
	if oc, err := parse(); err != nil || oc.CUDADevice != 2 {
		t.Errorf("KVAGENT_CUDA_DEVICE=2: device %d, %v; want 2", oc.CUDADevice, err)
	}
}

// TestStartOffloadOpensTheCUDADevice: startOffload asks the backend for
// the device --cuda-device names. One that opened device 0 whatever the
// flag passed every test (OpenDevice loads the real libcuda.so.1).
func TestStartOffloadOpensTheCUDADevice(t *testing.T) {
	defer func(f func(backend.Kind, int, *slog.Logger) (backend.Backend, error)) { openBackend = f }(openBackend)
	refused := errors.New("no device here")
	got := -1
	openBackend = func(kind backend.Kind, dev int, log *slog.Logger) (backend.Backend, error) {
		got = dev
		return nil, refused
	}
	oc := offloadConfig{Backend: backend.KindCUDA, CUDADevice: 3}
	if o, err := startOffload(oc, []kvevent.Rank{{Worker: 1, DP: 0}}, newFakeAgent(), prometheus.NewRegistry(), quiet); !errors.Is(err, refused) || got != 3 {
		if err == nil {
			o.Close()
		}
		t.Fatalf("startOffload with --cuda-device 3 asked the backend for device %d (%v), want 3", got, err)
	}
}
