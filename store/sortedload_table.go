package store

import (
	"bytes"
	"fmt"
	"path/filepath"

	"github.com/cockroachdb/pebble/v2/sstable"
)

// SortedTable writes one table of a SortedLoader, so that several runs of
// the sorted stream can be written at once, each on its own goroutine:
// table seq holds the run whose keys come after those of table seq-1.
// Within a table keys must increase, and its first key must come after the
// after key given to NewTable (the last key of the run before it), so the
// whole load is checked as Set checks it. The loader's Set and its tables
// must not be mixed in one load.
type SortedTable struct {
	l    *SortedLoader
	name string
	w    *sstable.Writer
	last []byte
}

// NewTable starts table seq (from 0, each once) of the load. after is the
// key the table's keys must follow (nil: none); it is copied. Tables may
// be started and written concurrently; every table must be closed, and
// before Finish or Abort.
func (l *SortedLoader) NewTable(seq int, after []byte) *SortedTable {
	t := &SortedTable{l: l, name: fmt.Sprintf("load-%06d.sst", seq)}
	if after != nil {
		t.last = append([]byte(nil), after...)
	}
	return t
}

// Set writes one record (full key, kind byte first).
func (t *SortedTable) Set(key, value []byte) error {
	if len(key) == 0 || !ValidKind(key[0]) {
		return fmt.Errorf("%w: record key of unknown kind", ErrCorrupt)
	}
	if t.last != nil && bytes.Compare(key, t.last) <= 0 {
		return fmt.Errorf("%w: record keys out of order", ErrCorrupt)
	}
	if t.w == nil {
		path := filepath.Join(t.l.s.dir, t.name)
		w, err := t.l.s.createTable(path)
		if err != nil {
			return fmt.Errorf("bulk load: %w", err)
		}
		t.l.mu.Lock()
		t.l.paths = append(t.l.paths, path)
		t.l.mu.Unlock()
		t.w = w
	}
	if err := t.w.Set(key, value); err != nil {
		return fmt.Errorf("bulk load: %w", err)
	}
	t.last = append(t.last[:0], key...)
	return nil
}

// Close finishes the table; after an error it only releases the table,
// which Abort then removes.
func (t *SortedTable) Close() error {
	if t.w == nil {
		return nil
	}
	err := t.w.Close()
	t.w = nil
	if err != nil {
		return fmt.Errorf("bulk load: close table: %w", err)
	}
	return nil
}
