package engineapi_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// No test may leave a goroutine behind: a handler, a copy worker or a
// connection that outlives the server's Close is a leak.
func TestMain(m *testing.M) {
	testwatch.Start()
	ignores := []goleak.Option{
		goleak.IgnoreTopFunction("github.com/cockroachdb/pebble/v2/internal/cache.(*shard).releaseLoop"),
		goleak.IgnoreAnyFunction("github.com/cockroachdb/pebble/v2.(*tableCacheShard).releaseLoop"),
	}
	goleak.VerifyTestMain(testwatch.Settled(m, ignores...), ignores...)
}

const bs = 1024 // bytes per block: small blocks keep the tests fast

var worker uint64 = 5

func rankOf(dp uint32) kvevent.Rank { return kvevent.Rank{Worker: worker, DP: dp} }

// seed returns the seed of a test's random bytes, from KVROUTER_TEST_SEED
// when set, and logs it so a failure can be replayed.
func seed(t testing.TB) uint64 { return testseed.Seed(t) }

func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
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

// shortDir returns a directory with a short path: a Unix socket path must
// fit in 108 bytes, and t.TempDir's embed the test's name.
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "eapi")
	check(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// sink records the pools' events.
type sink struct {
	mu  sync.Mutex
	evs []kvevent.Event
}

func (s *sink) Publish(_ kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.evs = append(s.evs, evs...)
	return uint64(len(s.evs)), nil
}

func (s *sink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.evs)
}

// g1Sim is an engine's G1 region on the host backend: a file mapped
// shared, which the agent maps again by its path.
type g1Sim struct {
	path string
	mem  []byte
}

func newG1Sim(t testing.TB, dir string, blocks int) *g1Sim {
	t.Helper()
	f, err := os.CreateTemp(dir, "g1-")
	check(t, err)
	defer f.Close()
	check(t, f.Truncate(int64(blocks*bs)))
	mem, err := unix.Mmap(int(f.Fd()), 0, blocks*bs, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	check(t, err)
	t.Cleanup(func() { unix.Munmap(mem) })
	return &g1Sim{path: f.Name(), mem: mem}
}

func (g *g1Sim) block(id int) []byte { return g.mem[id*bs : (id+1)*bs] }

// gated holds the copy batches that match until release. entered
// receives each batch held.
type gated struct {
	backend.Backend
	match   func([]backend.Copy) bool
	entered chan struct{}
	open    chan struct{}
	once    sync.Once
}

func (g *gated) CopyBatchAsync(s backend.Stream, cs []backend.Copy) error {
	if g.match != nil && g.match(cs) {
		select {
		case g.entered <- struct{}{}:
		default:
		}
		<-g.open
	}
	return g.Backend.CopyBatchAsync(s, cs)
}

func (g *gated) release() { g.once.Do(func() { close(g.open) }) }

func (g *gated) waitEntered(t testing.TB) {
	t.Helper()
	select {
	case <-g.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no copy reached the gate")
	}
}

// failingStreams is a backend whose NewStream fails while fail is set, as
// a device out of resources does: a manager cannot start on it.
type failingStreams struct {
	backend.Backend
	fail atomic.Bool
}

func (f *failingStreams) NewStream() (backend.Stream, error) {
	if f.fail.Load() {
		return nil, fmt.Errorf("new stream: %w", backend.ErrOutOfMemory)
	}
	return f.Backend.NewStream()
}

type gateKind int

const (
	noGate      gateKind = iota
	gateIntoG2           // hold copies into the host pool (offload)
	gateOutOfG2          // hold copies out of the host pool into G1 (onboard)
)

type rigConfig struct {
	ranks   int // dp ranks served; default 1
	blocks  int // G1 blocks per rank; default 64
	hostCap int // G2 blocks per rank; 0: none
	diskCap int // G3 blocks per rank; 0: none
	gate    gateKind
	streams bool // serve through r.streams, whose NewStream can be made to fail
	settle  time.Duration
	mgr     manager.Config
	checker engineapi.Checker
	// maxRegion is Config.MaxRegionBlocks; 0: the default.
	maxRegion int
	// pedantic: the server's metrics go to a pedantic registry.
	pedantic bool
}

// A rig is an engine API server on the host backend with the pools of its
// ranks, a client, and the engine's side: a simulated G1 region per rank.
type rig struct {
	t    *testing.T
	dir  string
	rng  *rand.Rand
	raw  *backend.Host
	gate *gated
	sink *sink
	host []*pool.HostPool
	disk []*pool.DiskPool
	srv  *engineapi.Server
	reg  *prometheus.Registry // the server's metrics
	c    *engineapi.Client
	g1   []*g1Sim
	n    int
	next uint64

	bytes   map[uint64][]byte // each block's bytes when offloaded
	streams *failingStreams   // with rigConfig.streams: the backend the server uses
}

func newRig(t *testing.T, rc rigConfig) *rig {
	t.Helper()
	if rc.ranks == 0 {
		rc.ranks = 1
	}
	if rc.blocks == 0 {
		rc.blocks = 64
	}
	raw, err := backend.NewHost()
	check(t, err)
	t.Cleanup(func() { check(t, raw.Close()) }) // runs last: after the server and pools
	r := &rig{t: t, dir: shortDir(t), rng: rand.New(rand.NewPCG(seed(t), 1)), raw: raw, sink: &sink{},
		n: rc.blocks, next: 1 << 32, bytes: map[uint64][]byte{}, reg: prometheus.NewRegistry()}
	if rc.pedantic {
		r.reg = prometheus.NewPedanticRegistry()
	}
	var be backend.Backend = raw
	var ranks []engineapi.RankPools
	for dp := range rc.ranks {
		rp := engineapi.RankPools{Rank: rankOf(uint32(dp))}
		pc := pool.Config{Rank: rp.Rank, BlockSize: bs, Sink: r.sink}
		if rc.hostCap > 0 {
			pc.Capacity = rc.hostCap
			rp.Host, err = pool.NewHost(raw, pc)
			check(t, err)
			t.Cleanup(func() { check(t, rp.Host.Close()) })
		}
		if rc.diskCap > 0 {
			pc.Capacity = rc.diskCap
			rp.Disk, err = pool.OpenDisk(filepath.Join(r.dir, "disk"+strconv.Itoa(dp)), pc, pool.DiskOptions{})
			check(t, err)
			t.Cleanup(func() { check(t, rp.Disk.Close()) })
		}
		r.host, r.disk = append(r.host, rp.Host), append(r.disk, rp.Disk)
		r.g1 = append(r.g1, newG1Sim(t, r.dir, rc.blocks))
		ranks = append(ranks, rp)
	}
	if rc.gate != noGate {
		region := r.host[0].Region()
		inG2 := func(p backend.Ptr) bool { return p >= region.Ptr() && p < region.Ptr().Add(region.Len()) }
		r.gate = &gated{Backend: raw, entered: make(chan struct{}, 1024), open: make(chan struct{})}
		if rc.gate == gateIntoG2 {
			r.gate.match = func(cs []backend.Copy) bool { return inG2(cs[0].Dst) }
		} else {
			r.gate.match = func(cs []backend.Copy) bool { return inG2(cs[0].Src) && !inG2(cs[0].Dst) }
		}
		be = r.gate
	}
	if rc.streams {
		r.streams = &failingStreams{Backend: be}
		be = r.streams
	}
	r.srv, err = engineapi.Listen(engineapi.Config{Socket: filepath.Join(r.dir, "kvagent.sock"), Backend: be,
		Ranks: ranks, Manager: rc.mgr, Checker: rc.checker, SettleTimeout: rc.settle, MaxRegionBlocks: rc.maxRegion, Registerer: r.reg})
	check(t, err)
	t.Cleanup(func() { check(t, r.srv.Close()) })
	if r.gate != nil {
		t.Cleanup(r.gate.release) // runs before Close: a held copy would stall it
	}
	r.c = engineapi.NewClient(r.srv.Socket())
	t.Cleanup(r.c.Close)
	return r
}

func (r *rig) ctx() context.Context { return context.Background() }

// register registers rank dp's simulated G1 region.
func (r *rig) register(dp uint32) engineapi.RegisterResponse {
	r.t.Helper()
	res, err := r.c.Register(r.ctx(), engineapi.RegisterRequest{DPRank: dp, ShmPath: r.g1[dp].path,
		BlockSizeBytes: bs, NumBlocks: r.n})
	check(r.t, err)
	return res
}

// compute plays the engine computing independent blocks into G1 blocks
// ids of rank dp: random bytes; it returns the offload requests.
func (r *rig) compute(dp uint32, prio int, ids ...int) []engineapi.OffloadBlock {
	out := make([]engineapi.OffloadBlock, len(ids))
	for i, id := range ids {
		r.next++
		b := r.g1[dp].block(id)
		for j := range b {
			b[j] = byte(r.rng.Uint32())
		}
		r.bytes[r.next] = slices.Clone(b)
		out[i] = engineapi.OffloadBlock{G1Block: id, Hash: engineapi.Hash(r.next), Local: engineapi.Hash(r.next ^ 0xfeed), Priority: prio}
	}
	return out
}

func (r *rig) offload(dp uint32, blocks []engineapi.OffloadBlock) engineapi.OffloadResponse {
	r.t.Helper()
	res, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{DPRank: dp, Blocks: blocks})
	check(r.t, err)
	return res
}

// scribble plays the engine reusing G1 blocks: Free, then other bytes.
func (r *rig) scribble(dp uint32, ids ...int) {
	r.t.Helper()
	res, err := r.c.Free(r.ctx(), engineapi.FreeRequest{DPRank: dp, G1Blocks: ids})
	check(r.t, err)
	if res.Freed != len(ids) {
		r.t.Fatalf("freed %d of %d blocks", res.Freed, len(ids))
	}
	for _, id := range ids {
		b := r.g1[dp].block(id)
		for j := range b {
			b[j] = byte(r.rng.Uint32())
		}
	}
}

func (r *rig) stats() engineapi.StatsResponse {
	r.t.Helper()
	s, err := r.c.Stats(r.ctx())
	check(r.t, err)
	return s
}

func (r *rig) rankStats(dp uint32) engineapi.RankStats {
	r.t.Helper()
	rs, ok := r.stats().Rank(dp)
	if !ok {
		r.t.Fatalf("stats lack dp rank %d", dp)
	}
	return rs
}

// idle waits until rank dp has no copy queued or running.
func (r *rig) idle(dp uint32) {
	r.t.Helper()
	waitFor(r.t, "the offload manager to go idle", func() bool { return r.rankStats(dp).Idle() })
}

func (r *rig) checkBytes(dp uint32, id int, h engineapi.Hash) {
	r.t.Helper()
	if !slices.Equal(r.g1[dp].block(id), r.bytes[uint64(h)]) {
		r.t.Fatalf("G1 block %d of rank %d does not hold the bytes of block %#x", id, dp, uint64(h))
	}
}

func hashesOf(bs []engineapi.OffloadBlock) []engineapi.Hash {
	hs := make([]engineapi.Hash, len(bs))
	for i, b := range bs {
		hs[i] = b.Hash
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
