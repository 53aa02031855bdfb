package store

import (
	"context"
	"fmt"
	"sync"

	"github.com/cockroachdb/pebble/v2/objstorage/objstorageprovider"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// SortedLoader bulk-loads records that arrive in strictly increasing key
// order — a snapshot stream is written from an iterator, so it is — by
// writing sstables directly and ingesting them: no memtable, no WAL, every
// byte written once. A key out of order is ErrCorrupt (the stream is bad),
// and Abort removes what was written. Records go in through Set, one
// table after another, or through tables written at once (NewTable).
type SortedLoader struct {
	s     *StateDB
	mu    sync.Mutex // guards paths while tables (SortedTable) are written
	paths []string

	// Set's tables: the one being written, its place, its size so far,
	// and the last key of the one before it.
	cur   *SortedTable
	n     int
	size  int64
	after []byte
}

// sortedTableBytes is where Set starts a new table.
const sortedTableBytes = 256 << 20

// NewSortedLoader starts a sorted bulk load into s, which must be a fresh,
// empty database.
func (s *StateDB) NewSortedLoader() *SortedLoader { return &SortedLoader{s: s} }

// createTable creates the file path on the database's filesystem and
// returns a table writer for it in the database's format, with the
// options of the database's own tables (OpenState).
func (s *StateDB) createTable(path string) (*sstable.Writer, error) {
	s.mu.RLock()
	if s.db == nil {
		s.mu.RUnlock()
		return nil, ErrClosed
	}
	format := s.db.TableFormat()
	s.mu.RUnlock()
	f, err := s.fs.Create(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, err
	}
	return sstable.NewWriter(objstorageprovider.NewFileWritable(f), s.opts.MakeWriterOptions(0, format)), nil
}

// ingest links the tables at paths into the database; after Close it
// fails with ErrClosed.
func (s *StateDB) ingest(paths []string) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return ErrClosed
	}
	return s.db.Ingest(context.Background(), paths)
}

// Set writes one record (full key, kind byte first).
func (l *SortedLoader) Set(key, value []byte) error {
	if l.cur == nil {
		l.cur = l.NewTable(l.n, l.after)
		l.n++
		l.size = 0
	}
	if err := l.cur.Set(key, value); err != nil {
		return err
	}
	l.size += int64(len(key) + len(value))
	if l.size >= sortedTableBytes {
		return l.closeTable()
	}
	return nil
}

func (l *SortedLoader) closeTable() error {
	if l.cur == nil {
		return nil
	}
	l.after = append(l.after[:0], l.cur.last...)
	err := l.cur.Close()
	l.cur = nil
	return err
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
	if err := l.s.ingest(l.paths); err != nil {
		l.Abort()
		return fmt.Errorf("bulk load: ingest: %w", err)
	}
	for _, p := range l.paths {
		// Ingested tables are linked into the store under Pebble's names;
		// these may linger (removeStaleGroups takes them at the next open).
		_ = l.s.fs.Remove(p)
	}
	return nil
}

// Abort discards what was written.
func (l *SortedLoader) Abort() {
	if l.cur != nil {
		l.cur.Close()
		l.cur = nil
	}
	for _, p := range l.paths {
		_ = l.s.fs.Remove(p)
	}
	l.paths = nil
}
