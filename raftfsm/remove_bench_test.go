package raftfsm

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
)

// removeStrays applies events of n workers of one rank each (none
// registered: the strays the leader's sweep removes), then one
// deregistration entry per worker, and returns the time of the
// deregistrations alone.
func removeStrays(b *testing.B, n int) time.Duration {
	b.Helper()
	f := openTestFSM(b, filepath.Join(b.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	var logs []*raft.Log
	var rb []RankBatch
	for i := 1; i <= n; i++ {
		r := kvevent.Rank{Worker: uint64(i)}
		rb = append(rb, RankBatch{Rank: r, Events: chainEvents(r, 1, 1, uint64(i)*10)})
		if len(rb) == 256 || i == n {
			logs = append(logs, w.next(encodeEvents(2, rb)))
			rb = nil
		}
	}
	f.ApplyBatch(logs)
	if got := len(f.UnregisteredRanks()); got != n {
		b.Fatalf("%d stray ranks, want %d", got, n)
	}
	start := time.Now()
	for i := 1; i <= n; i++ {
		f.ApplyBatch([]*raft.Log{w.next(encodeDeregister(3, uint64(i)))})
	}
	d := time.Since(start)
	if got := len(f.UnregisteredRanks()); got != 0 {
		b.Fatalf("%d stray ranks left", got)
	}
	return d
}

// BenchmarkRemoveManyWorkers: the cost per removal of a worker when
// 1,000 and when 16,000 workers are removed one entry each, and their
// ratio (near 1 when the cost of a removal does not grow with the ranks
// held: 1.6 to 1.7 on the 2-core VM, the larger maps missing the cache
// more; 15 before removal found a worker's ranks without a scan:
// internal/rankmap, docs/benchmarks.md).
func BenchmarkRemoveManyWorkers(b *testing.B) {
	const small, large = 1000, 16000
	var ds, dl time.Duration
	for b.Loop() {
		ds += removeStrays(b, small)
		dl += removeStrays(b, large)
	}
	ps, pl := float64(ds.Nanoseconds())/float64(b.N*small), float64(dl.Nanoseconds())/float64(b.N*large)
	b.ReportMetric(ps, "ns/removal_of_1k")
	b.ReportMetric(pl, "ns/removal_of_16k")
	b.ReportMetric(pl/ps, "ratio")
}
