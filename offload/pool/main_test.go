package pool_test

import (
	"encoding/binary"
	"maps"
	"slices"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// Every test must leave no goroutine behind: a Pebble database or a backend
// stream that outlives its test is a leak here, not noise.
func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}

var rank = kvevent.Rank{Worker: 7, DP: 1}

// sink records what a pool publishes and fails the test on any event that
// kvevent.Validate rejects or that names another rank.
type sink struct {
	t   testing.TB
	mu  sync.Mutex
	evs []kvevent.Event
	id  uint64
	err error // returned by Publish when set
}

func newSink(t testing.TB) *sink { return &sink{t: t} }

func (s *sink) Publish(r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return 0, s.err
	}
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			s.t.Errorf("published an invalid event %+v: %v", evs[i], err)
		}
		if r != rank || evs[i].Rank != rank {
			s.t.Errorf("published for rank %v (event says %v), want %v", r, evs[i].Rank, rank)
		}
	}
	s.evs = append(s.evs, evs...)
	s.id += uint64(len(evs))
	return s.id, nil
}

// take returns the events published since the last take.
func (s *sink) take() []kvevent.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	evs := s.evs
	s.evs = nil
	return evs
}

// removed lists the hashes of the REMOVE events among evs, in order.
func removed(evs []kvevent.Event) []uint64 {
	var hs []uint64
	for _, ev := range evs {
		if ev.Kind == kvevent.KindRemoved {
			hs = append(hs, ev.Removed...)
		}
	}
	return hs
}

// advertised lists, sorted, the hashes evs store and do not remove after:
// what a subscriber of evs takes the pool to hold.
func advertised(evs []kvevent.Event) []uint64 {
	stored := map[uint64]bool{}
	for _, b := range storedBlocks(evs) {
		stored[b.Hash] = true
	}
	for _, h := range removed(evs) {
		delete(stored, h)
	}
	return slices.Sorted(maps.Keys(stored))
}

// storedBlocks flattens the STORE events among evs into Blocks (parent of
// each chain member resolved), in order.
func storedBlocks(evs []kvevent.Event) []pool.Block {
	var bs []pool.Block
	for _, ev := range evs {
		if ev.Kind != kvevent.KindStored {
			continue
		}
		parent := uint64(0)
		if ev.HasParent {
			parent = ev.Parent
		}
		for _, b := range ev.Blocks {
			bs = append(bs, pool.Block{Hash: b.EngineHash, Parent: parent, Local: b.LocalHash})
			parent = b.EngineHash
		}
	}
	return bs
}

// chain returns n blocks, each the child of the one before; the first has
// parent root (0 for none). Hashes are base+1 .. base+n.
func chain(base uint64, root uint64, n int) []pool.Block {
	bs := make([]pool.Block, n)
	parent := root
	for i := range bs {
		h := base + uint64(i) + 1
		bs[i] = pool.Block{Hash: h, Parent: parent, Local: h * 0x9E3779B97F4A7C15}
		parent = h
	}
	return bs
}

// pattern returns n bytes determined by seed.
func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	fill(b, seed)
	return b
}

// fill writes a pattern determined by seed (xorshift64*).
func fill(b []byte, seed uint64) {
	x := seed*0x9E3779B97F4A7C15 | 1
	var w [8]byte
	for i := 0; i < len(b); i += 8 {
		x ^= x >> 12
		x ^= x << 25
		x ^= x >> 27
		binary.LittleEndian.PutUint64(w[:], x*0x2545F4914F6CDD1D)
		copy(b[i:], w[:])
	}
}

func hostBackend(t testing.TB) backend.Backend {
	t.Helper()
	be, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := be.Close(); err != nil {
			t.Errorf("close backend: %v", err)
		}
	})
	return be
}

const testBlock = 256 // bytes: small blocks keep the unit tests fast

func newHostPool(t testing.TB, capacity int, s pool.Sink) *pool.HostPool {
	t.Helper()
	p, err := pool.NewHost(hostBackend(t), pool.Config{Rank: rank, Capacity: capacity, BlockSize: testBlock, Sink: s})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close host pool: %v", err)
		}
	})
	return p
}

// A pools case runs a test against both tiers through one small interface.
type anyPool interface {
	Register(b pool.Block, data []byte) error
	Read(hash uint64, dst []byte) error
	Release(hash uint64) error
	Lookup(hashes []uint64, dst []bool) []bool
	Prefix(hashes []uint64) int
	Dump() ([]kvevent.Event, uint64)
	Stats() pool.Stats
	Close() error
}

type poolCase struct {
	name    string
	tier    kvevent.Tier
	open    func(t testing.TB, capacity int, s pool.Sink) anyPool
	acquire func(p anyPool, h uint64) error
}

func poolCases() []poolCase {
	return []poolCase{
		{"host", kvevent.TierHostPinned,
			func(t testing.TB, c int, s pool.Sink) anyPool { return newHostPool(t, c, s) },
			func(p anyPool, h uint64) error { _, err := p.(*pool.HostPool).Acquire(h); return err }},
		{"disk", kvevent.TierDisk,
			func(t testing.TB, c int, s pool.Sink) anyPool { return openDiskPool(t, t.TempDir(), c, s) },
			func(p anyPool, h uint64) error { return p.(*pool.DiskPool).Acquire(h) }},
	}
}

func openDiskPool(t testing.TB, dir string, capacity int, s pool.Sink) *pool.DiskPool {
	t.Helper()
	p, err := pool.OpenDisk(dir, pool.Config{Rank: rank, Capacity: capacity, BlockSize: testBlock, Sink: s}, pool.DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("close disk pool: %v", err)
		}
	})
	return p
}

func register(t testing.TB, p anyPool, bs ...pool.Block) {
	t.Helper()
	for _, b := range bs {
		if err := p.Register(b, pattern(testBlock, b.Hash)); err != nil {
			t.Fatalf("register %#x: %v", b.Hash, err)
		}
	}
}

func present(p anyPool, hs ...uint64) []uint64 {
	var got []uint64
	for i, ok := range p.Lookup(hs, nil) {
		if ok {
			got = append(got, hs[i])
		}
	}
	return got
}
