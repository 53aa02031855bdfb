package manager_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/offload/manager"
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
	f := newFullDiskManager(t, logger, 8, 0, 256, 1)
	fs, m := f.fs, f.m

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
