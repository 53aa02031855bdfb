package manager_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// From a review: while the G3 disk stays full, every D2Disk batch fails at
// once ("refused until a flush succeeds") and the manager logs "offload:
// writing blocks to disk failed" for each of them: one WARN line per batch
// for as long as the disk is full (an hour of a full disk under an engine
// that offloads is millions of lines). The pool's own failures are logged
// at most once per 10 s (errorLog), and the same flood for a pool shut
// down for damage was fixed (TestDiskPoolShutDownForDamageStopsOffloadsToDisk);
// the full disk still floods. The failures are counted
// (kvagent_offload_dropped_total{reason="error"}); the log should say it
// a bounded number of times (with how many were left out).
func TestAFullDiskDoesNotFloodTheLog(t *testing.T) {
	var log testlog.Buffer
	logger := slog.New(slog.NewTextHandler(&log, nil))
	raw, err := backend.NewHost()
	check(t, err)
	t.Cleanup(func() { raw.Close() })
	fs := &fullFS{FS: vfs.Default}
	s := &sink{t: t}
	d, err := pool.OpenDisk(t.TempDir(), pool.Config{Rank: rank, Capacity: 256, BlockSize: bs, Sink: s, Logger: logger},
		pool.DiskOptions{FS: fs})
	check(t, err)
	t.Cleanup(func() { d.Close() })
	g1 := newG1Sim(t, 8)
	mp, err := manager.MapRegion(raw, backend.IPCHandle(g1.path), manager.Layout{BlockSize: bs, Blocks: 8})
	check(t, err)
	t.Cleanup(func() { mp.Close() })
	m, err := manager.New(manager.Config{Rank: rank, Backend: raw, G1: mp.Region, Disk: d, Workers: 1,
		Filter: manager.FilterConfig{Always: true}, Logger: logger})
	check(t, err)
	t.Cleanup(func() { m.Close() })
	t.Cleanup(func() { fs.full.Store(false) })

	fs.full.Store(true)
	const batches = 200
	start := time.Now()
	for i := range batches {
		h := uint64(100 + i)
		if _, err := m.Offload([]manager.OffloadRequest{{G1Block: i % 8, Hash: h, Local: h, Priority: 1}}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, time.Minute, "the D2Disk write to fail", func() bool {
			return m.Stats().Paths[manager.D2Disk].Failed == uint64(i+1)
		})
	}
	lines := log.Lines("writing blocks to disk failed")
	t.Logf("%d failed batches in %v on a full disk", batches, time.Since(start))
	if len(lines) > 5 {
		t.Fatalf("%d WARN lines \"writing blocks to disk failed\" for %d failed batches in %v of a full disk, want a few (rate-limited); first: %s",
			len(lines), batches, time.Since(start).Round(time.Millisecond), lines[0])
	}
}
