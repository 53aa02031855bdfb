package store

import (
	"errors"
	"path/filepath"
	"testing"
)

// TestHasRecordsCountsEveryKey pins StateDB.HasRecords, which a start
// asks of a state without an applied index (raftfsm's
// refuseStateWithoutItsLog): a fresh database holds nothing, not even a
// record of its own at open; any key counts, of any kind: a record, the
// applied record alone, a load meta record alone, a record of a kind
// this format does not know (a later build's); a record deleted again
// does not; a closed database answers ErrClosed, and one opened again
// holds what it held.
func TestHasRecordsCountsEveryKey(t *testing.T) {
	open := func(t *testing.T) *StateDB {
		t.Helper()
		s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return s
	}
	commit := func(t *testing.T, s *StateDB, fill func(b *StateBatch)) {
		t.Helper()
		b := s.NewBatch()
		defer b.Close()
		fill(b)
		if err := b.Commit(); err != nil {
			t.Fatal(err)
		}
	}
	has := func(t *testing.T, s *StateDB, what string, want bool) {
		t.Helper()
		got, err := s.HasRecords()
		if err != nil || got != want {
			t.Fatalf("%s: HasRecords %v, %v; want %v", what, got, err, want)
		}
	}

	s := open(t)
	has(t, s, "a fresh database", false)
	commit(t, s, func(b *StateBatch) { b.PutCursor(1, 0, 7, 0) })
	has(t, s, "one cursor", true)
	commit(t, s, func(b *StateBatch) { b.DeleteCursor(1, 0) })
	has(t, s, "its cursor deleted again", false)

	for _, c := range []struct {
		what string
		fill func(b *StateBatch)
	}{
		{"the applied record alone", func(b *StateBatch) { b.SetApplied(3, 1) }},
		{"a load meta record alone", func(b *StateBatch) { b.Put(KindLoadMeta, []byte("m"), []byte{1}) }},
		{"a worker alone", func(b *StateBatch) { b.Put(KindWorker, []byte{0, 0, 0, 0, 0, 0, 0, 1}, []byte("w")) }},
		{"a later build's record alone", func(b *StateBatch) { b.Put(kindEnd, []byte("x"), []byte{1}) }},
		{"a record below the first kind alone", func(b *StateBatch) { b.Put(0x00, []byte("x"), []byte{1}) }},
	} {
		s := open(t)
		commit(t, s, c.fill)
		has(t, s, c.what, true)
	}

	// As a start finds it: written, closed and opened again.
	dir := filepath.Join(t.TempDir(), "fsm")
	s, err := OpenState(dir, StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	commit(t, s, func(b *StateBatch) { b.PutCursor(1, 0, 7, 0) })
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if got, err := s.HasRecords(); got || !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed database: HasRecords %v, %v; want false, %v", got, err, ErrClosed)
	}
	if s, err = OpenState(dir, StateOptions{Logger: logStoreTestLogger(t)}); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	has(t, s, "one cursor, opened again", true)
}
