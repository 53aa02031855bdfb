package raftfsm

import (
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestCollectorReportsTheIndexFiguresOfItsState: index_blocks{tier},
// index_nodes, index_entries, workers, events_orphaned_blocks and
// index_ranks_needing_resync carry the node's figures, each its own: the
// data gives every tier a different count, more entries than nodes (two
// ranks hold one chain), held orphans and a rank needing a resync, so
// that one tier's figure reported for every tier, nodes and entries
// swapped, or a figure left at 0 reads wrong.
func TestCollectorReportsTheIndexFiguresOfItsState(t *testing.T) {
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.Index.OrphanMaxBlocks = 4 })
	l := c.leader()
	for _, w := range []WorkerInfo{{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 1}}, {ID: 2, BlockSize: 16}} {
		if err := l.RegisterWorker(ctx(t), w); err != nil {
			t.Fatal(err)
		}
	}
	ra, rb, rc := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 1}, kvevent.Rank{Worker: 2}
	// ra and rb hold one chain of 4 on the device: 4 nodes, 8 entries.
	// rc holds a chain of 6: 3 blocks on the host, 2 on disk, 1 external.
	chain := chainEvents(rc, 1, 6, 500)
	for i := range chain {
		chain[i].Tier = []kvevent.Tier{kvevent.TierHostPinned, kvevent.TierHostPinned, kvevent.TierHostPinned,
			kvevent.TierDisk, kvevent.TierDisk, kvevent.TierExternal}[i]
	}
	// rc then stores 2 blocks under a parent it never stored (held), and ra
	// 5 under another, over OrphanMaxBlocks: dropped, ra needs a resync.
	held := kvevent.Event{Rank: rc, EventID: 7, Kind: kvevent.KindStored, HasParent: true, Parent: 123456,
		Blocks: []kvevent.Block{{EngineHash: 900, LocalHash: 1900}, {EngineHash: 901, LocalHash: 1901}}}
	tooLong := kvevent.Event{Rank: ra, EventID: 5, Kind: kvevent.KindStored, HasParent: true, Parent: 654321}
	for i := range uint64(5) {
		tooLong.Blocks = append(tooLong.Blocks, kvevent.Block{EngineHash: 700 + i, LocalHash: 1700 + i})
	}
	ingestRetrying(t, c, []RankBatch{
		{Rank: ra, Events: append(chainEvents(ra, 1, 4, 10), tooLong)},
		{Rank: rb, Events: chainEvents(rb, 1, 4, 10)},
		{Rank: rc, Events: append(chain, held)},
	})

	m := gather(t, NewCollector(l))
	for key, want := range map[string]float64{
		"kvrouter_index_blocks{tier=device}":    8,
		"kvrouter_index_blocks{tier=host}":      3,
		"kvrouter_index_blocks{tier=disk}":      2,
		"kvrouter_index_blocks{tier=external}":  1,
		"kvrouter_index_nodes{}":                10,
		"kvrouter_index_entries{}":              14,
		"kvrouter_workers{}":                    2,
		"kvrouter_events_orphaned_blocks{}":     2,
		"kvrouter_index_ranks_needing_resync{}": 1,
	} {
		if s, ok := m[key]; !ok || s.GetGauge().GetValue() != want {
			t.Errorf("%s = %v (found %v), want %v (index stats %+v)", key, s.GetGauge().GetValue(), ok, want, l.IndexStats())
		}
	}
}
