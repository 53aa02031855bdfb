package store

import (
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
	"pgregory.net/rapid"
)

// TestLogStoreMatchesInmemStore drives this store and raft's reference
// InmemStore with the same raft-shaped operations (contiguous appends, head
// compaction, tail truncation, stable-store writes) and requires the same
// answers from both after every step, and from this store after a reopen:
// with the default entry cache, with one so small that it evicts by bytes
// and by slots all the time, and with none.
func TestLogStoreMatchesInmemStore(t *testing.T) {
	for _, tc := range []struct {
		name  string
		bytes int64
		slots int
	}{{"default cache", 0, 0}, {"tiny cache", 300, 5}, {"no cache", -1, 0}} {
		t.Run(tc.name, func(t *testing.T) { checkLogStoreMatchesInmemStore(t, tc.bytes, tc.slots) })
	}
}

func checkLogStoreMatchesInmemStore(t *testing.T, cacheBytes int64, cacheSlots int) {
	rapid.Check(t, func(rt *rapid.T) {
		fs := vfs.NewMem()
		opts := LogStoreOptions{FS: fs, Logger: logStoreTestLogger(t), CacheBytes: cacheBytes, cacheSlots: cacheSlots}
		s, err := OpenLogStore("raft", opts)
		if err != nil {
			rt.Fatalf("open: %v", err)
		}
		defer func() { _ = s.Close() }()
		ref := raft.NewInmemStore()
		term := uint64(1)

		steps := rapid.IntRange(1, 30).Draw(rt, "steps")
		for step := range steps {
			first, _ := ref.FirstIndex()
			last, _ := ref.LastIndex()
			switch op := rapid.IntRange(0, 4).Draw(rt, fmt.Sprintf("op%d", step)); {
			case op <= 1 || last == 0: // append a batch after the last entry
				start := last + 1
				if last == 0 {
					start = rapid.Uint64Range(1, 50).Draw(rt, "start")
				}
				n := rapid.Uint64Range(1, 20).Draw(rt, "n")
				logs := testLogs(start, start+n-1, term)
				if err := s.StoreLogs(logs); err != nil {
					rt.Fatalf("StoreLogs: %v", err)
				}
				_ = ref.StoreLogs(logs)
			case op == 2: // compact the head
				max := rapid.Uint64Range(first, last).Draw(rt, "compactTo")
				if err := s.DeleteRange(first, max); err != nil {
					rt.Fatalf("DeleteRange head: %v", err)
				}
				_ = ref.DeleteRange(first, max)
			case op == 3: // truncate a conflicting tail; later appends use a new term
				min := rapid.Uint64Range(first, last).Draw(rt, "truncateFrom")
				if err := s.DeleteRange(min, last); err != nil {
					rt.Fatalf("DeleteRange tail: %v", err)
				}
				_ = ref.DeleteRange(min, last)
				term++
			case op == 4:
				if err := s.SetUint64([]byte("CurrentTerm"), term); err != nil {
					rt.Fatalf("SetUint64: %v", err)
				}
				_ = ref.SetUint64([]byte("CurrentTerm"), term)
			}
			compareStores(rt, s, ref)
		}
		if err := s.Close(); err != nil {
			rt.Fatalf("close: %v", err)
		}
		s, err = OpenLogStore("raft", opts)
		if err != nil {
			rt.Fatalf("reopen: %v", err)
		}
		compareStores(rt, s, ref)
	})
}

func compareStores(rt *rapid.T, s *LogStore, ref *raft.InmemStore) {
	first, err := s.FirstIndex()
	if err != nil {
		rt.Fatalf("FirstIndex: %v", err)
	}
	last, err := s.LastIndex()
	if err != nil {
		rt.Fatalf("LastIndex: %v", err)
	}
	rFirst, _ := ref.FirstIndex()
	rLast, _ := ref.LastIndex()
	if first != rFirst || last != rLast {
		rt.Fatalf("bounds [%d, %d], reference [%d, %d]", first, last, rFirst, rLast)
	}
	lo := uint64(0)
	if first > 2 {
		lo = first - 2
	}
	for i := lo; i <= last+2; i++ {
		var got, want raft.Log
		gotErr, wantErr := s.GetLog(i, &got), ref.GetLog(i, &want)
		if gotErr != wantErr {
			rt.Fatalf("GetLog(%d) error %v, reference %v", i, gotErr, wantErr)
		}
		if gotErr == nil && !logsEqual(&got, &want) {
			rt.Fatalf("GetLog(%d) = %+v, reference %+v", i, got, want)
		}
	}
	got, err := s.GetUint64([]byte("CurrentTerm"))
	want, _ := ref.GetUint64([]byte("CurrentTerm"))
	if err != nil || got != want {
		rt.Fatalf("GetUint64 = %d, %v; reference %d", got, err, want)
	}
}
