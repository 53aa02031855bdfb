package store

import (
	"errors"
	"path/filepath"
	"testing"
)

func TestSortedLoaderIngestsInOrderAndRefusesDisorder(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	db, err := OpenState(dir, StateOptions{DisableWAL: true})
	if err != nil {
		t.Fatal(err)
	}
	l := db.NewSortedLoader()
	for _, k := range [][]byte{{KindCursor, 1}, {KindCursor, 2}, {KindWorker, 1}} {
		if err := l.Set(k, []byte{9}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Set([]byte{KindCursor, 3}, nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a key out of order: %v, want ErrCorrupt", err)
	}
	if err := l.Set([]byte{0x7f}, nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a key of unknown kind: %v, want ErrCorrupt", err)
	}
	if err := l.Finish(); err != nil {
		t.Fatal(err)
	}
	n := 0
	if err := db.Scan(KindCursor, func(k, v []byte) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("%d cursor records after the load, want 2", n)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "load-*.sst")); len(m) != 0 {
		t.Fatalf("load tables left behind: %v", m)
	}
}

// TestSortedTablesWrittenAtOnce: tables of one load, written on their own
// goroutines, ingest together; a table whose first key does not follow the
// key it was given is ErrCorrupt, as a key out of order is to Set.
func TestSortedTablesWrittenAtOnce(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	db, err := OpenState(dir, StateOptions{DisableWAL: true})
	if err != nil {
		t.Fatal(err)
	}
	l := db.NewSortedLoader()
	errs := make(chan error, 3)
	for seq := 0; seq < 3; seq++ {
		go func() {
			var after []byte
			if seq > 0 {
				after = []byte{KindCursor, byte(10*seq - 1)}
			}
			tb := l.NewTable(seq, after)
			for i := 0; i < 10; i++ {
				if err := tb.Set([]byte{KindCursor, byte(10*seq + i)}, []byte{9}); err != nil {
					tb.Close()
					errs <- err
					return
				}
			}
			errs <- tb.Close()
		}()
	}
	for i := 0; i < 3; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	tb := l.NewTable(3, []byte{KindCursor, 29})
	if err := tb.Set([]byte{KindCursor, 29}, nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a table's first key not after the one before: %v, want ErrCorrupt", err)
	}
	if err := tb.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.Finish(); err != nil {
		t.Fatal(err)
	}
	n := 0
	if err := db.Scan(KindCursor, func(k, v []byte) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	if n != 30 {
		t.Fatalf("%d cursor records after the load, want 30", n)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, "load-*.sst")); len(m) != 0 {
		t.Fatalf("load tables left behind: %v", m)
	}
}
