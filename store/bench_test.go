package store

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// BenchmarkStoreLogs measures group-committed appends the way raft issues
// them (64 entries of 4 KiB per StoreLogs, each call one synced batch) on the
// real filesystem, and in the same run a baseline: appending the same
// encoded bytes to a plain file with one fsync per batch, the floor any
// durable log pays on this disk.
//
//	go test ./store/ -run '^$' -bench StoreLogs -benchtime 3s
func BenchmarkStoreLogs(b *testing.B) {
	benchStoreLogs(b, "store.logs", 0)
}

// BenchmarkStoreLogsCompacting adds what raft does after each snapshot: the
// head of the log is deleted (one range tombstone) every 64 batches, keeping
// the newest 1024 entries. This is the pattern DefaultLogMemTableSize is
// tuned for.
func BenchmarkStoreLogsCompacting(b *testing.B) {
	benchStoreLogs(b, "store.logs_compacting", 64)
}

func benchStoreLogs(b *testing.B, figure string, compactEvery int) {
	const entries, size, keep = 64, 4 << 10, 1024
	dir := b.TempDir()
	s, err := OpenLogStore(filepath.Join(dir, "raft"), LogStoreOptions{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()

	payload := make([]byte, size)
	_, _ = rand.NewChaCha8([32]byte{1}).Read(payload) // incompressible
	batch := make([]*raft.Log, entries)
	now := time.Now()
	next := uint64(1)
	fill := func() {
		for i := range batch {
			batch[i] = &raft.Log{Index: next, Term: 1, Type: raft.LogCommand, Data: payload, AppendedAt: now}
			next++
		}
	}

	b.SetBytes(entries * size)
	b.ReportAllocs()
	calls := 0
	for b.Loop() {
		fill()
		if err := s.StoreLogs(batch); err != nil {
			b.Fatal(err)
		}
		if calls++; compactEvery > 0 && calls%compactEvery == 0 {
			first, _ := s.FirstIndex()
			if err := s.DeleteRange(first, next-1-keep); err != nil {
				b.Fatal(err)
			}
		}
	}
	ours := float64(b.N*entries) / b.Elapsed().Seconds()

	// The baseline writes exactly the bytes StoreLogs encoded for a batch.
	var encoded []byte
	fill()
	for _, l := range batch {
		encoded = appendLog(encoded, l)
	}
	base := baselineAppendFsync(b, filepath.Join(dir, "baseline.log"), encoded, b.N) * entries

	b.ReportMetric(ours, "entries/s")
	b.ReportMetric(base, "baseline_entries/s")
	fmt.Printf("BENCH %s entries_per_s=%.3g baseline_entries_per_s=%.3g ratio=%.2f\n", figure, ours, base, ours/base)
}

// baselineAppendFsync appends rec to a fresh file n times, fsyncing after
// each append, and returns appends per second.
func baselineAppendFsync(b *testing.B, path string, rec []byte, n int) float64 {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND|os.O_TRUNC, 0o644)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	start := time.Now()
	for range n {
		if _, err := f.Write(rec); err != nil {
			b.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			b.Fatal(err)
		}
	}
	return float64(n) / time.Since(start).Seconds()
}
