package api

import (
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestEventBlocksAreBounded: an event takes at most 2^20 blocks (stored)
// or hashes (removed), the only bound on them before the body limit; one
// more is refused 400 invalid, and reaches neither the node nor its Raft
// log.
func TestEventBlocksAreBounded(t *testing.T) {
	const bound = 1 << 20 // maxBlockLen, written out: raising it must fail here
	rank := kvevent.Rank{Worker: 1}
	for _, n := range []int{bound, bound + 1} {
		blocks := make([]Block, n)
		hashes := make([]uint64, n)
		for i := range blocks {
			blocks[i] = Block{Hash: uint64(i) + 1, LocalHash: uint64(i) + 1}
			hashes[i] = uint64(i) + 1
		}
		for _, e := range []Event{
			{EventID: 1, Type: EventStored, Tier: "device", Blocks: blocks},
			{EventID: 1, Type: EventRemoved, Tier: "device", Hashes: hashes},
		} {
			_, err := e.toKV(rank)
			switch {
			case n <= bound && err != nil:
				t.Errorf("a %s event of %d blocks: %v, want it taken", e.Type, n, err)
			case n > bound && (err == nil || !strings.Contains(err.Error(), "more than 1048576 blocks")):
				t.Errorf("a %s event of %d blocks: %v, want it refused naming the bound", e.Type, n, err)
			}
			if err != nil {
				if code, reason := classify(err); code != 400 || reason != ReasonInvalid {
					t.Errorf("a %s event of %d blocks: %d %s, want 400 invalid", e.Type, n, code, reason)
				}
			}
		}
	}
}
