package manager_test

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// Every test must leave no goroutine behind: a copy worker, a backend
// stream or a Pebble database that outlives its test is a leak here.
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}

var rank = kvevent.Rank{Worker: 3, DP: 0}

const bs = 1024 // bytes per block: small blocks keep the tests fast

// seed returns the seed for a test's random bytes, from
// KVROUTER_TEST_SEED when set, and logs it so a failure can be replayed.
func seed(t testing.TB) uint64 { return testseed.Seed(t) }

// waitFor polls cond until it holds or the timeout passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %v waiting for %s", timeout, what)
		}
		time.Sleep(time.Millisecond)
	}
}

func check(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// sink records what the pools publish and fails the test on an event that
// kvevent.Validate rejects or that names another rank.
type sink struct {
	t   testing.TB
	mu  sync.Mutex
	evs []kvevent.Event
}

func (s *sink) Publish(r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			s.t.Errorf("published an invalid event %+v: %v", evs[i], err)
		}
		if r != rank || evs[i].Rank != rank {
			s.t.Errorf("published for rank %v, want %v", r, rank)
		}
	}
	s.evs = append(s.evs, evs...)
	return uint64(len(s.evs)), nil
}

// stored lists the hashes of the STORE events of tier, in order.
func (s *sink) stored(tier kvevent.Tier) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var hs []uint64
	for _, ev := range s.evs {
		if ev.Kind == kvevent.KindStored && ev.Tier == tier {
			for _, b := range ev.Blocks {
				hs = append(hs, b.EngineHash)
			}
		}
	}
	return hs
}

// removed lists the hashes of the REMOVE events of tier, in order.
func (s *sink) removed(tier kvevent.Tier) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var hs []uint64
	for _, ev := range s.evs {
		if ev.Kind == kvevent.KindRemoved && ev.Tier == tier {
			hs = append(hs, ev.Removed...)
		}
	}
	return hs
}

// g1Sim is the engine's side of the G1 region: a file mapped shared, as an
// engine on the host backend exports its KV cache, which the manager maps
// again through MapRegion.
type g1Sim struct {
	path string
	mem  []byte
}

func newG1Sim(t testing.TB, blocks int) *g1Sim {
	t.Helper()
	path := filepath.Join(t.TempDir(), "g1")
	f, err := os.Create(path)
	check(t, err)
	defer f.Close()
	check(t, f.Truncate(int64(blocks*bs)))
	mem, err := unix.Mmap(int(f.Fd()), 0, blocks*bs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	check(t, err)
	t.Cleanup(func() { unix.Munmap(mem) })
	return &g1Sim{path: path, mem: mem}
}

func (g *g1Sim) block(id int) []byte { return g.mem[id*bs : (id+1)*bs] }

// gated holds the copy batches that match until release: before queueing
// them or, with after, once queued (the copy may run, the worker waits).
// entered receives each batch held.
type gated struct {
	backend.Backend
	match   func([]backend.Copy) bool
	after   bool
	entered chan []backend.Copy
	open    chan struct{}
	once    sync.Once
	slow    func() time.Duration // when set, matching copies are delayed, not held
}

func (g *gated) CopyBatchAsync(s backend.Stream, cs []backend.Copy) error {
	if g.match == nil || !g.match(cs) {
		return g.Backend.CopyBatchAsync(s, cs)
	}
	if g.slow != nil {
		// A slow transfer: the copy starts late, so the engine may free and
		// overwrite the block between the worker's first check and the copy.
		time.Sleep(g.slow())
		return g.Backend.CopyBatchAsync(s, cs)
	}
	var err error
	if g.after {
		err = g.Backend.CopyBatchAsync(s, cs)
	}
	select {
	case g.entered <- cs:
	default: // nobody is counting any more
	}
	<-g.open
	if !g.after {
		err = g.Backend.CopyBatchAsync(s, cs)
	}
	return err
}

func (g *gated) release() { g.once.Do(func() { close(g.open) }) }

// waitEntered waits until a held batch arrives.
func (g *gated) waitEntered(t testing.TB) []backend.Copy {
	t.Helper()
	select {
	case cs := <-g.entered:
		return cs
	case <-time.After(10 * time.Second):
		t.Fatal("no copy reached the gate")
		return nil
	}
}

// readGate is a file system whose block reads (DiskPool.read, the
// copies' own reads) are held, while armed, until release: a disk read
// that stalls. entered is signalled on each read held. Pebble's own reads
// (a compaction's, started by the tables the pool's writes flush) pass:
// held too, one of them could signal entered before any copy read, and a
// test would go on while its copy had not started. While failing is set,
// those block reads fail with EIO instead: a disk that cannot be read.
type readGate struct {
	vfs.FS
	armed   atomic.Bool
	failing atomic.Bool
	entered chan struct{}
	open    chan struct{}
	once    sync.Once
}

func newReadGate() *readGate {
	return &readGate{FS: vfs.Default, entered: make(chan struct{}, 1), open: make(chan struct{})}
}

type gatedFile struct {
	vfs.File
	g *readGate
}

func (g *readGate) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := g.FS.Open(name, opts...)
	if err != nil {
		return nil, err
	}
	return gatedFile{f, g}, nil
}

func (f gatedFile) ReadAt(p []byte, off int64) (int, error) {
	armed, failing := f.g.armed.Load(), f.g.failing.Load()
	if (armed || failing) && bytes.Contains(debug.Stack(), []byte("pool.(*DiskPool).read(")) {
		if failing {
			return 0, syscall.EIO
		}
		select {
		case f.g.entered <- struct{}{}:
		default:
		}
		<-f.g.open
	}
	return f.File.ReadAt(p, off)
}

func (g *readGate) release() { g.once.Do(func() { close(g.open) }) }

// waitEntered waits until a read is held.
func (g *readGate) waitEntered(t testing.TB) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no disk read reached the gate")
	}
}

type gateKind int

const (
	noGate      gateKind = iota
	gateD2H              // hold copies out of G1 before they are queued
	gateD2HLate          // hold copies out of G1 once queued
	gateIntoG1           // hold copies into G1 before they are queued
	slowFromG1           // delay copies out of G1 by up to 200µs
)

type rigConfig struct {
	blocks  int // G1 blocks; default 64
	hostCap int // G2 blocks; 0: no host pool
	diskCap int // G3 blocks; 0: no disk pool
	gate    gateKind
	diskFS  *readGate      // when set, the disk pool reads through it
	cfg     manager.Config // Workers, BatchSize, QueueCapacity, Filter, OnboardTimeout
}

// A rig is a manager on the host backend with its pools, a recording sink
// and a simulated engine G1 region.
type rig struct {
	t      *testing.T
	raw    *backend.Host
	region manager.Region
	rng    *rand.Rand
	sink   *sink
	gate   *gated
	host   *pool.HostPool
	disk   *pool.DiskPool
	g1     *g1Sim
	reg    *prometheus.Registry
	m      *manager.Manager
	next   uint64 // last hash handed out

	mu    sync.Mutex
	bytes map[uint64][]byte // what each block's bytes were when offloaded
}

func newRig(t *testing.T, rc rigConfig) *rig {
	t.Helper()
	if rc.blocks == 0 {
		rc.blocks = 64
	}
	raw, err := backend.NewHost()
	check(t, err)
	t.Cleanup(func() {
		if err := raw.Close(); err != nil {
			t.Errorf("close backend: %v", err)
		}
	})
	r := &rig{t: t, raw: raw, rng: rand.New(rand.NewPCG(seed(t), 1)), sink: &sink{t: t}, reg: prometheus.NewRegistry(),
		bytes: map[uint64][]byte{}, next: 1000}
	var be backend.Backend = raw
	if rc.gate != noGate {
		r.gate = &gated{Backend: raw, after: rc.gate == gateD2HLate,
			entered: make(chan []backend.Copy, 64), open: make(chan struct{})}
		be = r.gate
	}
	pcfg := pool.Config{Rank: rank, BlockSize: bs, Sink: r.sink}
	if rc.hostCap > 0 {
		pcfg.Capacity = rc.hostCap
		r.host, err = pool.NewHost(raw, pcfg)
		check(t, err)
		t.Cleanup(func() { check(t, r.host.Close()) })
	}
	if rc.diskCap > 0 {
		pcfg.Capacity = rc.diskCap
		var opts pool.DiskOptions
		if rc.diskFS != nil {
			opts.FS = rc.diskFS
		}
		r.disk, err = pool.OpenDisk(t.TempDir(), pcfg, opts)
		check(t, err)
		t.Cleanup(func() { check(t, r.disk.Close()) })
	}
	r.g1 = newG1Sim(t, rc.blocks)
	mp, err := manager.MapRegion(be, backend.IPCHandle(r.g1.path), manager.Layout{BlockSize: bs, Blocks: rc.blocks})
	check(t, err)
	t.Cleanup(func() { check(t, mp.Close()) })
	r.region = mp.Region
	if r.gate != nil {
		inG1 := func(p backend.Ptr) bool { return p >= mp.Base && p < mp.Base.Add(mp.Size()) }
		switch rc.gate {
		case slowFromG1:
			rng := rand.New(rand.NewPCG(r.rng.Uint64(), 3))
			var mu sync.Mutex
			r.gate.slow = func() time.Duration {
				mu.Lock()
				defer mu.Unlock()
				return time.Duration(rng.IntN(200)) * time.Microsecond
			}
			r.gate.match = func(cs []backend.Copy) bool { return inG1(cs[0].Src) }
		case gateD2H, gateD2HLate:
			r.gate.match = func(cs []backend.Copy) bool { return inG1(cs[0].Src) }
		case gateIntoG1:
			r.gate.match = func(cs []backend.Copy) bool { return inG1(cs[0].Dst) }
		}
	}
	cfg := rc.cfg
	cfg.Rank, cfg.Backend, cfg.G1, cfg.Host, cfg.Disk, cfg.Registerer = rank, be, mp.Region, r.host, r.disk, r.reg
	r.m, err = manager.New(cfg)
	check(t, err)
	t.Cleanup(func() { r.close(t) })
	if r.gate != nil {
		t.Cleanup(r.gate.release) // runs before Close: a held copy would block it
	}
	if rc.diskFS != nil {
		t.Cleanup(rc.diskFS.release) // runs before Close: a held read would block it
	}
	return r
}

// closeWait bounds the rig's Close at the end of a test.
const closeWait = 30 * time.Second

// close closes the manager at the end of a test, failing it when Close
// does not return within closeWait. A test goroutine that panics runs its
// cleanups before the panic goes on: after a panic with the manager's lock
// held, Close would wait for that lock until the binary's -timeout (ten
// minutes by default) instead of letting the panic end the binary now.
func (r *rig) close(t *testing.T) {
	closed := make(chan error, 1)
	go func() { closed <- r.m.Close() }()
	timer := time.NewTimer(closeWait)
	defer timer.Stop()
	select {
	case err := <-closed:
		check(t, err)
	case <-timer.C:
		// Errorf, not Fatalf: a Goexit here would swallow the panic
		// that may be why Close is stuck.
		t.Errorf("Close did not return within %v (a panic with the manager's lock held?)", closeWait)
	}
}

// compute plays the engine computing a chain of n blocks into G1 blocks
// ids: it fills each with random bytes and returns the offload requests.
// The chain continues parent (0 for a new sequence).
func (r *rig) compute(parent uint64, prio int, ids ...int) []manager.OffloadRequest {
	reqs := make([]manager.OffloadRequest, len(ids))
	for i, id := range ids {
		r.next++
		h := r.next
		b := r.g1.block(id)
		for j := 0; j < len(b); j += 8 {
			v := r.rng.Uint64()
			for k := range 8 {
				b[j+k] = byte(v >> (8 * k))
			}
		}
		r.mu.Lock()
		r.bytes[h] = slices.Clone(b)
		r.mu.Unlock()
		reqs[i] = manager.OffloadRequest{G1Block: id, Hash: h, Parent: parent, Local: h ^ 0xabcdef, Priority: prio}
		parent = h
	}
	return reqs
}

// recompute plays the engine computing block req again into G1 block id
// (a later request with the same prefix): same bytes, same hashes.
func (r *rig) recompute(req manager.OffloadRequest, id int) manager.OffloadRequest {
	r.mu.Lock()
	copy(r.g1.block(id), r.bytes[req.Hash])
	r.mu.Unlock()
	req.G1Block = id
	return req
}

// scribble plays the engine reusing G1 blocks: it frees them, then writes
// other bytes into them.
func (r *rig) scribble(ids ...int) {
	check(r.t, r.m.Free(ids...))
	for _, id := range ids {
		b := r.g1.block(id)
		for j := range b {
			b[j] = byte(r.rng.Uint32())
		}
	}
}

func (r *rig) offload(reqs []manager.OffloadRequest) manager.OffloadResult {
	r.t.Helper()
	res, err := r.m.Offload(reqs)
	check(r.t, err)
	return res
}

// idle waits until no path has work queued or in flight.
func (r *rig) idle() {
	r.t.Helper()
	waitFor(r.t, 10*time.Second, "the manager to go idle", func() bool {
		s := r.m.Stats()
		for _, p := range s.Paths {
			if p.Depth != 0 || p.InFlight != 0 {
				return false
			}
		}
		return true
	})
}

// holds reports whether G1 block id holds what hash h held when offloaded.
func (r *rig) holds(id int, h uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Equal(r.g1.block(id), r.bytes[h])
}

// onboarderRand returns a generator for a second goroutine, derived from
// the test's seed (rig.rng belongs to the engine's goroutine).
func (r *rig) onboarderRand() *rand.Rand { return rand.New(rand.NewPCG(r.rng.Uint64(), 2)) }

// checkBytes fails unless G1 block id holds what hash h held when offloaded.
func (r *rig) checkBytes(id int, h uint64) {
	r.t.Helper()
	r.mu.Lock()
	want := r.bytes[h]
	r.mu.Unlock()
	if !slices.Equal(r.g1.block(id), want) {
		r.t.Fatalf("G1 block %d does not hold the bytes of block %#x", id, h)
	}
}

func hashesOf(reqs []manager.OffloadRequest) []uint64 {
	hs := make([]uint64, len(reqs))
	for i, q := range reqs {
		hs[i] = q.Hash
	}
	return hs
}

func ids(from, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}
