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
