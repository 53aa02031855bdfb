package main

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// A disk tier larger than its directory's free space (plus what the pools
// hold) fills the disk, and G3 then fails every write until there is room:
// kvagent warns at start, naming the figures and what to do. A tier that
// fits, counting the blocks the pools hold already, is not warned about.
func TestADiskTierLargerThanTheFreeSpaceIsWarnedAbout(t *testing.T) {
	oc := offloadConfig{DiskDir: "/g3", DiskBlocks: 100, BlockBytes: 1 << 20}
	const ranks = 2 // 200 MiB in all
	for _, tc := range []struct {
		name       string
		free, held uint64
		warn       bool
	}{
		{"fits in the free space", 200 << 20, 0, false},
		{"fits with what the pools hold", 150 << 20, 50 << 20, false},
		{"larger than free plus held", 150 << 20, 10 << 20, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log testlog.Buffer
			warnIfDiskTierExceedsFreeSpace(oc, ranks, tc.held,
				func(dir string) (uint64, error) {
					if dir != oc.DiskDir {
						t.Errorf("free space asked of %q, want --disk-dir %q", dir, oc.DiskDir)
					}
					return tc.free, nil
				}, slog.New(slog.NewTextHandler(&log, nil)))
			lines := log.Lines("larger than the free space of --disk-dir")
			if !tc.warn {
				if len(lines) != 0 {
					t.Fatalf("warned of a tier that fits: %s", lines[0])
				}
				return
			}
			if len(lines) != 1 {
				t.Fatalf("%d warnings, want 1:\n%s", len(lines), log.String())
			}
			for _, want := range []string{"tier_bytes=209715200", "free_bytes=157286400", "held_bytes=10485760",
				"disk_blocks_that_fit=80", "lower --disk-blocks", "dir=/g3"} {
				if !strings.Contains(lines[0], want) {
					t.Errorf("warning %q does not say %s", lines[0], want)
				}
			}
		})
	}
}

func TestAnUnknownFreeSpaceIsNotWarnedAbout(t *testing.T) {
	var log testlog.Buffer
	warnIfDiskTierExceedsFreeSpace(offloadConfig{DiskDir: "/g3", DiskBlocks: 1, BlockBytes: 1}, 1, 0,
		func(string) (uint64, error) { return 0, errors.New("statfs failed") },
		slog.New(slog.NewTextHandler(&log, nil)))
	if s := log.String(); s != "" {
		t.Fatalf("logged at Info or above for an unknown free space: %s", s)
	}
}
