package pool_test

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/benchenv"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// The offload pool benchmarks (KVROUTER_BENCH=1 go test -run TestBenchOffload
// -v ./offload/pool/). Each prints one BENCH line per figure next to its
// baseline, measured in the same run and interleaved round by round, so
// that drift on a shared machine hits both alike:
//
//	BENCH offload.disk     G2→G3 writes of 2 MiB blocks into the disk pool
//	                       (SyncFlush, the default) vs a sequential file write
//	                       of the same bytes from the same G2 slots, fsync per
//	                       batch, in the same directory
//	BENCH offload.disk_wal the same with SyncWAL
//	BENCH offload.host     G1→G2 registrations of 2 MiB blocks through the
//	                       host backend's copies vs one copy() loop of the
//	                       same bytes into the same slots
//
// Knobs (environment, all optional):
//
//	KVROUTER_BENCH_DISK_MIB      bytes written per side and mode (default 1024)
//	KVROUTER_BENCH_DISK_BATCH    blocks per Put and per fsync (default 16: 32 MiB)
//	KVROUTER_BENCH_DISK_WRITERS  concurrent Put callers (default 1)
//	KVROUTER_BENCH_DISK_DIR      directory (default: the test's temporary one)
//	KVROUTER_BENCH_HOST_ROUNDS   rounds of 256 MiB each side (default 8)

const benchBlock = 2 << 20

// nopSink accepts every event, as a publisher with room does.
type nopSink struct{}

func (nopSink) Publish(kvevent.Rank, []kvevent.Event) (uint64, error) { return 0, nil }

func TestBenchOffloadDisk(t *testing.T) {
	benchenv.Skip(t, "bench-offload")
	totalMiB := benchenv.Int("KVROUTER_BENCH_DISK_MIB", 1024)
	batch := benchenv.Int("KVROUTER_BENCH_DISK_BATCH", 16)
	writers := benchenv.Int("KVROUTER_BENCH_DISK_WRITERS", 1)
	blocks := totalMiB << 20 / benchBlock / (batch * writers) * (batch * writers)
	if blocks == 0 {
		t.Fatal("KVROUTER_BENCH_DISK_MIB too small for one batch per writer")
	}
	dir := os.Getenv("KVROUTER_BENCH_DISK_DIR")
	if dir == "" {
		dir = t.TempDir()
	} else {
		var err error
		dir, err = os.MkdirTemp(dir, "offload-bench")
		check(t, err)
		defer os.RemoveAll(dir)
	}

	// The G2 pool the blocks come from: 2 batches per writer of distinct
	// bytes, pinned while they are written out, as the offload worker does.
	be := hostBackend(t)
	srcBlocks := 2 * batch * writers
	g2, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: srcBlocks, BlockSize: benchBlock})
	check(t, err)
	defer g2.Close()
	for i := range srcBlocks {
		check(t, g2.Register(pool.Block{Hash: uint64(i + 1)}, pattern(benchBlock, uint64(i+1))))
	}
	slots := make([]pool.Slot, srcBlocks)
	for i := range slots {
		slots[i], err = g2.Acquire(uint64(i + 1))
		check(t, err)
	}

	for _, mode := range []pool.SyncMode{pool.SyncFlush, pool.SyncWAL} {
		ours, base := benchDisk(t, filepath.Join(dir, mode.String()), mode, slots, blocks, batch, writers)
		mb := func(d time.Duration) float64 { return float64(blocks*benchBlock) / d.Seconds() / 1e6 }
		name := "offload.disk"
		if mode != pool.SyncFlush {
			name += "_" + mode.String()
		}
		fmt.Printf("BENCH %s block_mib=2 mb_per_s=%.4g raw_mb_per_s=%.4g ratio=%.2f\n",
			name, mb(ours), mb(base), base.Seconds()/ours.Seconds())
		t.Logf("%s: %d blocks in batches of %d, %d writer(s), sync=%s", name, blocks, batch, writers, mode)
	}
}

// benchDisk writes blocks blocks into a fresh disk pool holding half of
// them (so the second half evicts), and the same bytes into plain files,
// alternating in 4 rounds; it returns the time each side took.
func benchDisk(t *testing.T, dir string, mode pool.SyncMode, slots []pool.Slot, blocks, batch, writers int) (ours, base time.Duration) {
	check(t, os.MkdirAll(dir, 0o755))
	p, err := pool.OpenDisk(filepath.Join(dir, "pool"),
		pool.Config{Rank: rank, Capacity: blocks / 2, BlockSize: benchBlock, Sink: nopSink{}},
		pool.DiskOptions{Sync: mode})
	check(t, err)
	defer func() { check(t, p.Close()) }()

	const rounds = 4
	perRound := (blocks / rounds) / (batch * writers) * (batch * writers)
	next := uint64(1)
	for r := range rounds {
		n := perRound
		if r == rounds-1 {
			n = blocks - perRound*(rounds-1)
		}
		// Ours: each writer Puts its own chains of batch blocks.
		t0 := time.Now()
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			first := next + uint64(w*n/writers)
			go func() {
				defer wg.Done()
				bs := make([]pool.Block, batch)
				data := make([][]byte, batch)
				for i := 0; i < n/writers; i += batch {
					for j := range batch {
						h := first + uint64(i+j)
						bs[j] = pool.Block{Hash: h, Local: h}
						if j > 0 {
							bs[j].Parent = h - 1
						}
						data[j] = slots[(w*2*batch+i+j)%len(slots)].Bytes
					}
					if k, err := p.Put(bs, data); err != nil || k != batch {
						t.Errorf("put: %d stored, %v", k, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		ours += time.Since(t0)
		next += uint64(n)

		// Baseline: the same bytes, one sequential file per writer, fsync
		// per batch.
		t1 := time.Now()
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				name := filepath.Join(dir, fmt.Sprintf("raw-%d-%d", r, w))
				f, err := os.Create(name)
				if err != nil {
					t.Error(err)
					return
				}
				defer os.Remove(name)
				defer f.Close()
				for i := 0; i < n/writers; i += batch {
					for j := range batch {
						if _, err := f.Write(slots[(w*2*batch+i+j)%len(slots)].Bytes); err != nil {
							t.Error(err)
							return
						}
					}
					if err := f.Sync(); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		base += time.Since(t1)
		if t.Failed() {
			t.FailNow()
		}
	}
	st := p.Stats()
	t.Logf("sync=%s: %d blocks held (%d MiB), %d evicted; database %d MiB on disk", mode, st.Used,
		st.Used*benchBlock>>20, st.Evictions, p.DiskBytes()>>20)
	return ours, base
}

func TestBenchOffloadHost(t *testing.T) {
	benchenv.Skip(t, "bench-offload")
	const total = 256 << 20 // per round and side
	const perRound = total / benchBlock
	const batch = 16
	rounds := benchenv.Int("KVROUTER_BENCH_HOST_ROUNDS", 8)
	be := hostBackend(t)
	src, err := be.AllocHost(total) // stands in for G1
	check(t, err)
	defer be.FreeHost(src)
	fill(src.Bytes(), 1)
	// Half the blocks of a round: every registration past the first half
	// round evicts, as in steady state.
	p, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: perRound / 2, BlockSize: benchBlock, Sink: nopSink{}})
	check(t, err)
	defer p.Close()
	clear(p.Region().Bytes()) // fault every page in before timing

	k := min(4, runtime.GOMAXPROCS(0))
	streams := make([]backend.Stream, k)
	events := make([]backend.Event, k)
	for i := range k {
		streams[i], err = be.NewStream()
		check(t, err)
		events[i], err = be.NewEvent()
		check(t, err)
	}
	defer func() {
		for i := range k {
			be.DestroyEvent(events[i])
			be.DestroyStream(streams[i])
		}
	}()

	next := uint64(1)
	round := func() {
		// Each worker registers chains of batch blocks from its share.
		var wg sync.WaitGroup
		for w := range k {
			wg.Add(1)
			first := next
			go func() {
				defer wg.Done()
				bs := make([]pool.Block, batch)
				srcs := make([]backend.Ptr, batch)
				for i := w * batch; i < perRound; i += k * batch {
					for j := range batch {
						h := first + uint64(i+j)
						bs[j] = pool.Block{Hash: h, Local: h}
						if j > 0 {
							bs[j].Parent = h - 1
						}
						srcs[j] = src.At((i + j) * benchBlock)
					}
					if n, err := p.RegisterFrom(streams[w], events[w], bs, srcs); err != nil || n != batch {
						t.Errorf("register: %d stored, %v", n, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		next += perRound
	}
	round() // warm up: fills the pool
	dst := p.Region().Bytes()
	var ours, base time.Duration
	for range rounds {
		t0 := time.Now()
		round()
		t1 := time.Now()
		for i := range perRound {
			o := i % (perRound / 2) * benchBlock
			copy(dst[o:o+benchBlock], src.Bytes()[i*benchBlock:(i+1)*benchBlock])
		}
		ours, base = ours+t1.Sub(t0), base+time.Since(t1)
		if t.Failed() {
			t.FailNow()
		}
	}
	gb := func(d time.Duration) float64 { return float64(rounds*total) / d.Seconds() / 1e9 }
	fmt.Printf("BENCH offload.host gb_per_s=%.3g memmove_gb_per_s=%.3g ratio=%.2f\n", gb(ours), gb(base), base.Seconds()/ours.Seconds())
	st := p.Stats()
	t.Logf("%d streams, batches of %d blocks; %d registered, %d evicted", k, batch, st.Registered, st.Evictions)
}
