package pool

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testtmpfs"
)

// From a second review: on a filling disk L0 was to grow past l0Refuse "by
// the Puts in flight at most", far from the stall, but the refusal armed
// only once a compaction had failed for want of room; before that, with
// small blocks (inline in the sstables, so each compaction of L0 rewrites
// them), compactions fall behind one writer's Puts on a disk that still
// has room, and nothing bounded L0 short of the stall (1000): 51
// sublevels. Puts are now refused at l0Refuse sublevels whatever the
// cause.
func TestL0StaysShallowOnAFillingDiskOfSmallBlocks(t *testing.T) {
	const bs = 512
	dir := t.TempDir()
	testtmpfs.Mount(t, dir, "4m")
	filler := filepath.Join(dir, "filler")
	if err := os.WriteFile(filler, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := OpenDisk(filepath.Join(dir, "pool"), Config{Capacity: 1 << 20, BlockSize: bs, Sink: &orderSink{}}, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filler); p.Close() })
	buf := make([]byte, bs)
	h := uint64(1)
	fails, deepest, at := 0, 0, 0
	for i := 0; i < 3000 && fails < 50; i++ {
		blocks := make([]Block, 16)
		data := make([][]byte, 16)
		for j := range blocks {
			blocks[j] = Block{Hash: h * 0x9e3779b97f4a7c15, Local: h}
			data[j] = buf
			h++
		}
		if _, err := p.Put(blocks, data); err != nil {
			fails++
		}
		if d := int(p.db.Metrics().Levels[0].Sublevels); d > deepest {
			deepest, at = d, i
		}
	}
	// One Put in flight at a time: it adds one flush at most past the check.
	if deepest > l0Refuse+1 {
		t.Fatalf("L0 reached %d sublevels (Put #%d; %d blocks stored, %d Puts refused) with one Put in flight, "+
			"want at most %d (l0Refuse and the Put in flight)", deepest, at, p.Stats().Used, fails, l0Refuse+1)
	}
}
