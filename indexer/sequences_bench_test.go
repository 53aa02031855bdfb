package indexer

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
)

// removeBookedWorkers books perWorker requests of 8 blocks on each of n
// one-rank workers, then removes the workers one by one (as a lease sweep
// does) and returns the time of the removals alone.
func removeBookedWorkers(b *testing.B, n, perWorker int) time.Duration {
	b.Helper()
	s := NewSequences()
	seq := make([]uint64, 8)
	for w := 1; w <= n; w++ {
		for j := range perWorker {
			for k := range seq {
				seq[k] = uint64(w)<<20 | uint64(j)<<8 | uint64(k)
			}
			if _, err := s.Add(fmt.Sprint(w, "/", j), kvevent.Rank{Worker: uint64(w)}, seq, 128, 0, 1); err != nil {
				b.Fatal(err)
			}
		}
	}
	start := time.Now()
	for w := 1; w <= n; w++ {
		if got := s.RemoveWorker(uint64(w)); got != perWorker {
			b.Fatalf("removing worker %d freed %d bookings, want %d", w, got, perWorker)
		}
	}
	d := time.Since(start)
	if live, _ := s.Count(); live != 0 {
		b.Fatalf("%d live bookings left", live)
	}
	return d
}

// BenchmarkRemoveBookedWorkers: the cost per removal of a worker holding
// 4 live bookings when 1,000 and when 16,000 such workers are removed, and
// their ratio (near 1 when a removal's cost does not grow with the
// bookings of other workers; it grew with them, ratio ≈ 16, while a
// removal walked every booking: docs/benchmarks.md).
func BenchmarkRemoveBookedWorkers(b *testing.B) {
	const small, large, per = 1000, 16000, 4
	var ds, dl time.Duration
	for b.Loop() {
		ds += removeBookedWorkers(b, small, per)
		dl += removeBookedWorkers(b, large, per)
	}
	ps, pl := float64(ds.Nanoseconds())/float64(b.N*small), float64(dl.Nanoseconds())/float64(b.N*large)
	b.ReportMetric(ps, "ns/removal_of_1k")
	b.ReportMetric(pl, "ns/removal_of_16k")
	b.ReportMetric(pl/ps, "ratio")
}
