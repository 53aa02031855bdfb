package manager_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// From a review (a test gap): a G2 block whose promotion to G3 fails (a
// full disk) must be released, so that G2 can still evict it. Had h2disk
// released its pinned G2 blocks only after a successful write, every
// existing test passed, and on a full disk G2 filled with blocks pinned for
// good: each later offload to G2 found it full.
func TestFailedPromotionToAFullDiskLeavesTheG2BlocksEvictable(t *testing.T) {
	quiet := slog.New(slog.DiscardHandler)
	raw, err := backend.NewHost()
	check(t, err)
	t.Cleanup(func() { raw.Close() })
	fs := &fullFS{FS: vfs.Default}
	s := &sink{t: t}
	h, err := pool.NewHost(raw, pool.Config{Rank: rank, Capacity: 4, BlockSize: bs, Sink: s, Logger: quiet})
	check(t, err)
	t.Cleanup(func() { h.Close() })
	d, err := pool.OpenDisk(t.TempDir(), pool.Config{Rank: rank, Capacity: 64, BlockSize: bs, Sink: s, Logger: quiet},
		pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { d.Close() })
	g1 := newG1Sim(t, 16)
	mp, err := manager.MapRegion(raw, backend.IPCHandle(g1.path), manager.Layout{BlockSize: bs, Blocks: 16})
	check(t, err)
	t.Cleanup(func() { mp.Close() })
	m, err := manager.New(manager.Config{Rank: rank, Backend: raw, G1: mp.Region, Host: h, Disk: d, Workers: 1,
		Filter: manager.FilterConfig{Always: true}, Logger: quiet})
	check(t, err)
	t.Cleanup(func() { m.Close() })
	t.Cleanup(func() { fs.full.Store(false) })

	fs.full.Store(true)
	for i := range 12 {
		hash := uint64(100 + i)
		if _, err := m.Offload([]manager.OffloadRequest{{G1Block: i, Hash: hash, Local: hash, Priority: 1}}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "the copy into G2 and the promotion to G3 to end", func() bool {
			st := m.Stats()
			return st.Paths[manager.D2H].InFlight == 0 && st.Paths[manager.H2Disk].InFlight == 0 &&
				st.Paths[manager.D2H].Blocks+st.Paths[manager.D2H].Full+st.Paths[manager.D2H].Failed == uint64(i+1) &&
				st.Paths[manager.H2Disk].Queued == st.Paths[manager.H2Disk].Failed+st.Paths[manager.H2Disk].Blocks+st.Paths[manager.H2Disk].Skipped
		})
	}
	st := m.Stats()
	if hs := h.Stats(); st.Paths[manager.D2H].Full != 0 || hs.Referenced != 0 {
		t.Fatalf("after promotions to a full disk failed: G2 refused %d blocks as full, %d G2 blocks still referenced (%+v); want none",
			st.Paths[manager.D2H].Full, hs.Referenced, hs)
	}
	if st.Paths[manager.H2Disk].Failed == 0 {
		t.Fatalf("no promotion failed: %+v", st.Paths[manager.H2Disk])
	}
}
