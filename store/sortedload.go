package store

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/cockroachdb/pebble/v2/objstorage/objstorageprovider"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// SortedLoader bulk-loads records that arrive in strictly increasing key
// order — a snapshot stream is written from an iterator, so it is — by
// writing sstables directly and ingesting them: no memtable, no WAL, every
// byte written once. A key out of order is ErrCorrupt (the stream is bad),
// and Abort removes what was written.
type SortedLoader struct {
	s     *StateDB
	n     int
	mu    sync.Mutex // guards paths while tables (SortedTable) are written
	paths []string
	w     *sstable.Writer
	size  int64
	last  []byte
}

// sortedTableBytes is where a loader starts a new table.
const sortedTableBytes = 256 << 20

// NewSortedLoader starts a sorted bulk load into s, which must be a fresh,
// empty database on the OS filesystem.
func (s *StateDB) NewSortedLoader() *SortedLoader { return &SortedLoader{s: s} }

// Set writes one record (full key, kind byte first).
func (l *SortedLoader) Set(key, value []byte) error {
	if len(key) == 0 || !ValidKind(key[0]) {
		return fmt.Errorf("%w: record key of unknown kind", ErrCorrupt)
	}
	if l.last != nil && bytes.Compare(key, l.last) <= 0 {
		return fmt.Errorf("%w: record keys out of order", ErrCorrupt)
	}
	if l.w == nil {
		path := filepath.Join(l.s.dir, fmt.Sprintf("load-%06d.sst", l.n))
		l.n++
		f, err := vfs.Default.Create(path, vfs.WriteCategoryUnspecified)
		if err != nil {
			return fmt.Errorf("bulk load: %w", err)
		}
		l.paths = append(l.paths, path)
		l.w = sstable.NewWriter(objstorageprovider.NewFileWritable(f), sstable.WriterOptions{TableFormat: l.s.db.TableFormat()})
		l.size = 0
	}
	if err := l.w.Set(key, value); err != nil {
		return fmt.Errorf("bulk load: %w", err)
	}
	l.last = append(l.last[:0], key...)
	l.size += int64(len(key) + len(value))
	if l.size >= sortedTableBytes {
		return l.closeTable()
	}
	return nil
}

func (l *SortedLoader) closeTable() error {
	if l.w == nil {
		return nil
	}
	err := l.w.Close()
	l.w = nil
	if err != nil {
		return fmt.Errorf("bulk load: close table: %w", err)
	}
	return nil
}

// Finish closes the last table and ingests every table into the database.
func (l *SortedLoader) Finish() error {
	if err := l.closeTable(); err != nil {
		l.Abort()
		return err
	}
	if len(l.paths) == 0 {
		return nil
	}
	if err := l.s.db.Ingest(context.Background(), l.paths); err != nil {
		l.Abort()
		return fmt.Errorf("bulk load: ingest: %w", err)
	}
	for _, p := range l.paths {
		os.Remove(p) // ingested tables are linked into the store; the originals may linger
	}
	return nil
}

// Abort discards what was written.
func (l *SortedLoader) Abort() {
	if l.w != nil {
		l.w.Close()
		l.w = nil
	}
	for _, p := range l.paths {
		os.Remove(p)
	}
	l.paths = nil
}
