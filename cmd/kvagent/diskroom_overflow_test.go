package main

import (
	"log/slog"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// From a second review: the tier's bytes (--disk-blocks × --block-bytes ×
// ranks) are multiplied in uint64 without an overflow check. Each rank's
// pool passes its own bound (BlockSize × Capacity <= MaxInt), --dp-size
// takes up to 4096 ranks, and a product past 2^64 wraps: 4 ranks of 2^30
// blocks of 4 GiB (16 EiB in all) come to 0 bytes, "fits", and no warning.
func TestADiskTierPast2To64BytesIsWarnedAbout(t *testing.T) {
	oc := offloadConfig{DiskDir: "/g3", DiskBlocks: 1 << 30, BlockBytes: 1 << 32}
	const ranks = 4
	pools := []diskPool{{Dir: "/g3/dp0"}, {Dir: "/g3/dp1"}, {Dir: "/g3/dp2"}, {Dir: "/g3/dp3"}}
	var log testlog.Buffer
	warnIfDiskTierExceedsFreeSpace(oc, pools, oneDisk(1<<40), // 1 TiB free
		slog.New(slog.NewTextHandler(&log, nil)))
	if lines := log.Lines("larger than the free space of its file system"); len(lines) != 1 {
		t.Fatalf("a disk tier of %d ranks × %d blocks × %d bytes (2^64 bytes) on 1 TiB free: %d warnings, want 1\nlog: %s",
			ranks, oc.DiskBlocks, oc.BlockBytes, len(lines), log.String())
	}
}
