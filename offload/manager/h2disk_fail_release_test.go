package manager_test

import (
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/offload/manager"
)

// From a review (a test gap): a G2 block whose promotion to G3 fails (a
// full disk) must be released, so that G2 can still evict it. Had h2disk
// released its pinned G2 blocks only after a successful write, every
// existing test passed, and on a full disk G2 filled with blocks pinned for
// good: each later offload to G2 found it full.
func TestFailedPromotionToAFullDiskLeavesTheG2BlocksEvictable(t *testing.T) {
	f := newFullDiskManager(t, slog.New(slog.DiscardHandler), 16, 4, 64, 1)
	fs, h, m := f.fs, f.h, f.m

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
