package main

import (
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/diskfree"
	"github.com/kvrouter/kvrouter/internal/testlog"
)

// oneDisk answers, for every directory, one file system with free bytes.
func oneDisk(free uint64) func(string) (diskfree.Room, error) {
	return func(string) (diskfree.Room, error) { return diskfree.Room{Device: 1, Available: free}, nil }
}

// A disk tier larger than its directory's free space (plus what the pools
// hold) fills the disk, and G3 then fails every write until there is room:
// kvagent warns at start, naming the figures and what to do. A tier that
// fits, counting the blocks the pools hold already, is not warned about.
func TestADiskTierLargerThanTheFreeSpaceIsWarnedAbout(t *testing.T) {
	oc := offloadConfig{DiskDir: "/g3", DiskBlocks: 100, BlockBytes: 1 << 20}
	// 2 ranks, 200 MiB in all; the pools hold held between them.
	pools := func(held uint64) []diskPool {
		return []diskPool{{Dir: "/g3/dp0", Held: held / 2}, {Dir: "/g3/dp1", Held: held - held/2}}
	}
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
			asked := map[string]bool{}
			warnIfDiskTierExceedsFreeSpace(oc, pools(tc.held),
				func(dir string) (diskfree.Room, error) {
					asked[dir] = true
					return diskfree.Room{Device: 7, Available: tc.free}, nil
				}, slog.New(slog.NewTextHandler(&log, nil)))
			if !asked["/g3/dp0"] || !asked["/g3/dp1"] || len(asked) != 2 {
				t.Errorf("free space asked of %v, want the pools' directories /g3/dp0 and /g3/dp1", asked)
			}
			lines := log.Lines("larger than the free space of its file system")
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
				"disk_blocks_that_fit=80", "lower --disk-blocks", `dirs="/g3/dp0 /g3/dp1"`, "ranks=2"} {
				if !strings.Contains(lines[0], want) {
					t.Errorf("warning %q does not say %s", lines[0], want)
				}
			}
		})
	}
}

// A rank's directory under --disk-dir may be a mount point, or a symbolic
// link, to a disk of its own: --disk-dir's free space then says nothing
// of that pool's room. Each file system is checked for the pools it holds,
// and warned about on its own: here dp1 and dp2 share a disk that has
// room for one pool, not two, and dp0's disk has room for its pool.
func TestADiskTierIsCheckedOnEachFileSystemItsPoolsLiveOn(t *testing.T) {
	oc := offloadConfig{DiskDir: "/g3", DiskBlocks: 100, BlockBytes: 1 << 20} // 100 MiB a pool
	disks := map[string]diskfree.Room{
		"/g3/dp0": {Device: 1, Available: 1 << 40},   // --disk-dir's disk: room for its one pool
		"/g3/dp1": {Device: 2, Available: 150 << 20}, // a second disk, for dp1 and dp2: room for 1.5 pools
		"/g3/dp2": {Device: 2, Available: 150 << 20},
		"/g3/dp3": {Device: 3, Available: 100 << 20}, // a third, exactly the pool's size
	}
	pools := []diskPool{{Dir: "/g3/dp0"}, {Dir: "/g3/dp1", Held: 20 << 20}, {Dir: "/g3/dp2"}, {Dir: "/g3/dp3"}}
	var log testlog.Buffer
	warnIfDiskTierExceedsFreeSpace(oc, pools, func(dir string) (diskfree.Room, error) {
		r, ok := disks[dir]
		if !ok {
			t.Errorf("free space asked of %q, not a pool's directory", dir)
		}
		return r, nil
	}, slog.New(slog.NewTextHandler(&log, nil)))
	lines := log.Lines("larger than the free space of its file system")
	if len(lines) != 1 {
		t.Fatalf("%d warnings for pools on 3 disks, one of them short of room for its 2 pools; want 1:\n%s", len(lines), log.String())
	}
	for _, want := range []string{`dirs="/g3/dp1 /g3/dp2"`, "ranks=2", "tier_bytes=209715200", "free_bytes=157286400",
		"held_bytes=20971520", "disk_blocks_that_fit=85"} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("warning %q does not say %s", lines[0], want)
		}
	}
}

// Two disks each short of room are two warnings, one each.
func TestEachFileSystemShortOfRoomIsWarnedAboutOnce(t *testing.T) {
	oc := offloadConfig{DiskDir: "/g3", DiskBlocks: 100, BlockBytes: 1 << 20}
	var log testlog.Buffer
	warnIfDiskTierExceedsFreeSpace(oc, []diskPool{{Dir: "/g3/dp0"}, {Dir: "/g3/dp1"}, {Dir: "/g3/dp2"}},
		func(dir string) (diskfree.Room, error) {
			dev := uint64(1)
			if dir == "/g3/dp1" {
				dev = 2
			}
			return diskfree.Room{Device: dev, Available: 50 << 20}, nil
		}, slog.New(slog.NewTextHandler(&log, nil)))
	lines := log.Lines("larger than the free space of its file system")
	if len(lines) != 2 || !strings.Contains(lines[0], `dirs="/g3/dp0 /g3/dp2"`) || !strings.Contains(lines[1], "dirs=/g3/dp1") {
		t.Fatalf("warnings for 2 disks short of room, dp0 and dp2 on one, dp1 on the other: want one each, in rank order:\n%s", log.String())
	}
}

func TestAnUnknownFreeSpaceIsNotWarnedAbout(t *testing.T) {
	var log testlog.Buffer
	warnIfDiskTierExceedsFreeSpace(offloadConfig{DiskDir: "/g3", DiskBlocks: 1, BlockBytes: 1}, []diskPool{{Dir: "/g3/dp0"}},
		func(string) (diskfree.Room, error) { return diskfree.Room{}, errors.New("statfs failed") },
		slog.New(slog.NewTextHandler(&log, nil)))
	if s := log.String(); s != "" {
		t.Fatalf("logged at Info or above for an unknown free space: %s", s)
	}
}
