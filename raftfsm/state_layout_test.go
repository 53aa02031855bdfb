package raftfsm

import (
	"bufio"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/store"
)

// layoutRow is one row of the key layout table in store/state.go's
// StateDB comment: a kind and, for a kind of one record, its key.
type layoutRow struct {
	kind  byte
	fixed string // the key after the kind byte, "" when it varies
}

// stateKeyLayout reads the key layout table of store/state.go's comment.
func stateKeyLayout(t *testing.T) map[byte]layoutRow {
	t.Helper()
	fh, err := os.Open(filepath.Join("..", "store", "state.go"))
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	rows := map[byte]layoutRow{}
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "//\t0x")
		if !ok {
			continue
		}
		fields := strings.Fields(line)
		k, err := strconv.ParseUint(fields[0], 16, 8)
		if err != nil || len(fields) < 2 {
			t.Fatalf("key layout row %q: want a kind in hex and its key", line)
		}
		row := layoutRow{kind: byte(k)}
		if q := fields[1]; len(q) == 3 && q[0] == '\'' && q[2] == '\'' {
			row.fixed = q[1:2]
		}
		rows[row.kind] = row
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(rows) == 0 {
		t.Fatal("no key layout rows found in store/state.go")
	}
	return rows
}

// TestTheStateKeyLayoutCommentNamesTheKeysTheFSMWrites holds the key
// layout table of store/state.go's comment to the state database the FSM
// writes: after applying every command type (and a sweep, which writes the
// load tracker's clock) each record's kind is a row of the table, a
// kind of one record holds it under the row's key, and every row is
// written. A row naming a key no build writes (0x09 'l', where the FSM
// writes 'c') fails it.
func TestTheStateKeyLayoutCommentNamesTheKeysTheFSMWrites(t *testing.T) {
	rows := stateKeyLayout(t)
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	f.ApplyBatch([]*raft.Log{w.next(encodeExpire(100, 0))})
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	snap.Release()

	if k, err := f.db.UnknownRecord(); err != nil || k != nil {
		t.Fatalf("a record of a kind the format does not know: %x (%v)", k, err)
	}
	for kind := byte(0); kind < 0xff; kind++ {
		if !store.ValidKind(kind) {
			continue
		}
		row, listed := rows[kind]
		n := 0
		err := f.db.Scan(kind, func(key, _ []byte) error {
			n++
			switch {
			case !listed:
				t.Errorf("kind %#02x (%s, key %q) is not a row of store/state.go's key layout", kind, store.KindName(kind), key)
			case row.fixed != "" && string(key) != row.fixed:
				t.Errorf("kind %#02x (%s) written under the key %q, the key layout says %q", kind, store.KindName(kind), key, row.fixed)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if listed && n == 0 {
			t.Errorf("kind %#02x (%s) is a row of the key layout, but the fixture wrote none: make it write one", kind, store.KindName(kind))
		}
		delete(rows, kind)
	}
	for kind := range rows {
		t.Errorf("the key layout lists kind %#02x, which the state format does not know", kind)
	}
}
