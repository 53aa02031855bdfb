package pool_test

import (
	"runtime"
	"testing"

	"github.com/kvrouter/kvrouter/offload/pool"
)

// An empty pool's memory does not grow with its configured capacity:
// --disk-blocks may be up to 2^31-1, and a map sized for that up front
// would take tens of GiB per rank before the first block.
func TestEmptyLargeDiskPoolHoldsLittleHeap(t *testing.T) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	p, err := pool.OpenDisk(t.TempDir(), pool.Config{Rank: rank, Capacity: 1 << 24, BlockSize: 4096}, pool.DiskOptions{})
	check(t, err)
	defer p.Close()
	runtime.GC()
	runtime.ReadMemStats(&after)
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("an empty disk pool of 2^24 blocks holds %d KiB of heap", grew>>10)
	// Pebble's own state (memtable arena, caches) is allocated outside
	// the Go heap or lazily; 64 MiB is far above an empty pool's need and
	// far below the 577 MiB a map presized for 2^24 entries takes.
	if grew > 64<<20 {
		t.Fatalf("an empty pool of 2^24 blocks allocated %d MiB up front", grew>>20)
	}
}
