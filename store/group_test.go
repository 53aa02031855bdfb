package store

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"testing"
	"unsafe"

	"pgregory.net/rapid"

	"github.com/kvrouter/kvrouter/internal/hugepage"
)

// TestGroupMatchesModel: groups of random writes — sets and deletes, a key
// written several times in one group, keys that share their first 16
// bytes and differ after, keys that are prefixes of others, keys of few
// byte values that collide at every byte position — committed
// as tables, against a map. After every commit the database holds exactly
// the model's records, and after a reopen too. Before some commits a
// view of the uncommitted group (StateBatch.View) holds the model's
// records, and still holds them after later groups are written and
// committed.
func TestGroupMatchesModel(t *testing.T) {
	smallViewReads(t, 16)
	dir := t.TempDir()
	runs := 0
	rapid.Check(t, func(rt *rapid.T) {
		runs++
		path := filepath.Join(dir, fmt.Sprint(runs))
		s, err := OpenState(path, StateOptions{Logger: logStoreTestLogger(t)})
		if err != nil {
			rt.Fatal(err)
		}
		defer func() { s.Close() }()
		// Opaque records of the booking kind: the key space mixes short
		// keys, prefixes of each other, and long keys equal in their
		// first 16 bytes.
		keys := []string{"", "a", "a\x00", "ab", "0123456789abcdef", "0123456789abcdef0", "0123456789abcdef1", "0123456789abcdef10", "0123456789abcdeg"}
		model := map[string]string{}
		var applied uint64
		type heldView struct {
			v       *StateSnapshot
			model   map[string]string
			applied uint64
		}
		var views []heldView
		defer func() {
			for _, h := range views {
				h.v.Close()
			}
		}()
		b := s.NewBatch()
		groups := rapid.IntRange(1, 6).Draw(rt, "groups")
		for g := 0; g < groups; g++ {
			n := rapid.IntRange(0, 30).Draw(rt, "writes")
			for i := 0; i < n; i++ {
				k := rapid.SampledFrom(keys).Draw(rt, "key")
				if rapid.Bool().Draw(rt, "random key") {
					// Few byte values, so that keys collide and share
					// prefixes at every position the sort looks at.
					k = string(rapid.SliceOfN(rapid.SampledFrom([]byte{0, 1, 0x80, 0xff}), 0, 24).Draw(rt, "key bytes"))
				}
				kind := rapid.SampledFrom(groupTestKinds).Draw(rt, "kind")
				if rapid.IntRange(0, 3).Draw(rt, "op") == 0 {
					b.Delete(kind, []byte(k))
					delete(model, string(kind)+k)
				} else {
					v := fmt.Sprintf("v%d.%d", g, i)
					b.Put(kind, []byte(k), []byte(v))
					model[string(kind)+k] = v
				}
			}
			if rapid.Bool().Draw(rt, "set applied") {
				applied++
				b.SetApplied(applied, 1)
			}
			if rapid.Bool().Draw(rt, "view") {
				h := heldView{v: b.View(), model: maps.Clone(model), applied: applied}
				views = append(views, h)
				checkViewModel(rt, h.v, h.model, h.applied)
				// A write after the view, in the same group: in the
				// database once committed, never in the view (the final
				// check of every view finds it out).
				v := fmt.Sprintf("after view %d", len(views))
				b.Put(KindBooking, []byte("after the view"), []byte(v))
				model[string(KindBooking)+"after the view"] = v
			}
			if err := b.Commit(); err != nil {
				rt.Fatal(err)
			}
			checkGroupModel(rt, s, model)
		}
		for _, h := range views {
			checkViewModel(rt, h.v, h.model, h.applied)
		}
		s.Close()
		if s, err = OpenState(path, StateOptions{Logger: logStoreTestLogger(t)}); err != nil {
			rt.Fatal(err)
		}
		checkGroupModel(rt, s, model)
	})
}

// groupTestKinds: writes of several kinds, so that the sort's pass on the
// kind byte has several buckets.
var groupTestKinds = []byte{KindBooking, KindTomb, KindMember}

func checkGroupModel(rt *rapid.T, s *StateDB, model map[string]string) {
	got := map[string]string{}
	for _, kind := range groupTestKinds {
		var last []byte
		if err := s.Scan(kind, func(k, v []byte) error {
			if last != nil && bytes.Compare(k, last) <= 0 {
				rt.Fatalf("scan out of order: %q after %q", k, last)
			}
			last = append(last[:0], k...)
			got[string(kind)+string(k)] = string(v)
			return nil
		}); err != nil {
			rt.Fatal(err)
		}
	}
	if len(got) != len(model) {
		rt.Fatalf("database holds %v, model %v", got, model)
	}
	for k, v := range model {
		if got[k] != v {
			rt.Fatalf("key %q: database %q, model %q (database %v)", k, got[k], v, got)
		}
	}
}

// checkViewModel checks that a view holds the model's records, in key
// order, and the applied index (0: none).
func checkViewModel(rt *rapid.T, v *StateSnapshot, model map[string]string, applied uint64) {
	got := map[string]string{}
	var last []byte
	sawApplied := false
	if err := v.Each(func(k, val []byte) error {
		if last != nil && bytes.Compare(k, last) <= 0 {
			rt.Fatalf("view out of order: %q after %q", k, last)
		}
		last = append(last[:0], k...)
		if k[0] == KindApplied {
			sawApplied = true
			return nil
		}
		got[string(k)] = string(val)
		return nil
	}); err != nil {
		rt.Fatal(err)
	}
	if !maps.Equal(got, model) {
		rt.Fatalf("view holds %v, model %v", got, model)
	}
	idx, _, err := v.Applied()
	if err != nil || idx != applied || sawApplied != (applied != 0) {
		rt.Fatalf("view's applied index %d (record seen: %v, err %v), want %d", idx, sawApplied, err, applied)
	}
}

// TestGroupLeavesNoTables: a committed group's table is linked into the
// database under Pebble's name; no group file stays behind, and one left
// by a crash before its ingest is removed at open, as is a bulk load's.
func TestGroupLeavesNoTables(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	s, err := OpenState(dir, StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := s.NewBatch()
	b.PutCursor(1, 0, 7, 0)
	b.SetApplied(3, 1)
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	if ms, _ := filepath.Glob(filepath.Join(dir, "group-*")); len(ms) != 0 {
		t.Fatalf("group tables left: %v", ms)
	}
	s.Close()
	// A group table a crash left before its ingest, and a bulk load's
	// table left between its ingest and its removal.
	for _, name := range []string{"group-000009.sst", "load-000002.sst"} {
		if err := writeFile(filepath.Join(dir, name), []byte("half written")); err != nil {
			t.Fatal(err)
		}
	}
	s, err = OpenState(dir, StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, glob := range []string{"group-*", "load-*"} {
		if ms, _ := filepath.Glob(filepath.Join(dir, glob)); len(ms) != 0 {
			t.Fatalf("stale table kept: %v", ms)
		}
	}
	if idx, _, err := s.Applied(); err != nil || idx != 3 {
		t.Fatalf("applied %d %v, want 3", idx, err)
	}
}

// smallViewReads makes a view's reads (StateSnapshot.Each) cut a small
// view into many parts and chunks of about n bytes, until the test ends.
func smallViewReads(t *testing.T, n int) {
	chunk, part, parts := viewChunkBytes, viewPartBytes, viewMaxParts
	t.Cleanup(func() { viewChunkBytes, viewPartBytes, viewMaxParts = chunk, part, parts })
	viewChunkBytes, viewPartBytes, viewMaxParts = n, uint64(n), 16
}

func writeFile(path string, b []byte) error { return os.WriteFile(path, b, 0o644) }

// TestCloseClosesOpenViews: closing the database under open views (Raft
// persisting a snapshot while it installs a leader's, which closes the
// database to swap it in; Raft holds that view until the install is done,
// so Close cannot wait for it) closes them too: the database closes
// cleanly (Pebble refuses to close under an open snapshot, "leaked
// snapshots"), and a view's reads fail with ErrClosed, in the middle of an
// Each as well, instead of panicking on a closed database.
func TestCloseClosesOpenViews(t *testing.T) {
	smallViewReads(t, 64)
	for _, name := range []string{"snapshot", "group view"} {
		s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		b := s.NewBatch()
		for i := range 100 {
			b.Put(KindBooking, fmt.Appendf(nil, "committed %03d", i), []byte("v"))
		}
		if err := b.Commit(); err != nil {
			t.Fatal(err)
		}
		b.Put(KindBooking, []byte("in the group"), []byte("v"))
		v, idle := s.Snapshot(), s.Snapshot()
		if name == "group view" {
			v = b.View()
		}
		read := 0
		err = v.Each(func(_, _ []byte) error {
			read++
			if read == 1 {
				if err := s.Close(); err != nil {
					t.Fatalf("%s: close under open views: %v", name, err)
				}
			}
			return nil
		})
		if !errors.Is(err, ErrClosed) || read == 0 || read >= 100 {
			t.Fatalf("%s: Each across the close read %d records and returned %v, want ErrClosed part way", name, read, err)
		}
		if _, _, err := idle.Applied(); !errors.Is(err, ErrClosed) {
			t.Fatalf("%s: Applied on a view of a closed database: %v, want ErrClosed", name, err)
		}
		for _, w := range []*StateSnapshot{v, idle} {
			if err := w.Close(); err != nil {
				t.Fatalf("%s: closing a view after its database: %v", name, err)
			}
		}
		b.Close()
	}
}

// TestAppliedOfAClosedGroupViewFails: a group view whose overlay holds the
// applied record answers Applied with ErrClosed once it is closed, or its
// database is (a restore swaps the database under Raft's snapshot views),
// as its Each does: an answer from the overlay would pass for the state of
// a view that can no longer be read.
func TestAppliedOfAClosedGroupViewFails(t *testing.T) {
	for _, closer := range []string{"view", "database"} {
		s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		b := s.NewBatch()
		b.SetApplied(5, 1)
		v := b.View()
		if i, term, err := v.Applied(); err != nil || i != 5 || term != 1 {
			t.Fatalf("Applied on the open view = (%d, %d, %v), want (5, 1, nil)", i, term, err)
		}
		if closer == "view" {
			err = v.Close()
		} else {
			err = s.Close()
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := v.Each(func(_, _ []byte) error { return nil }); !errors.Is(err, ErrClosed) {
			t.Fatalf("closed %s: Each = %v, want ErrClosed", closer, err)
		}
		if i, term, err := v.Applied(); !errors.Is(err, ErrClosed) {
			t.Fatalf("closed %s: Applied = (%d, %d, %v), want ErrClosed", closer, i, term, err)
		}
		b.Close()
		v.Close()
		s.Close()
	}
}

// TestStateMethodsAfterCloseReturnErrClosed: after Close (a restore closes
// the database to swap it) the database's methods fail with ErrClosed, as
// the log store's do, instead of panicking on the closed Pebble handle; a
// group committed then and a bulk load leave no table behind. HasRecords
// and UnknownRecord, a start's checks, are among them: their ErrClosed was
// unpinned (the s.db == nil guard of UnknownRecord deletable with every
// store test passing).
func TestStateMethodsAfterCloseReturnErrClosed(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	s, err := OpenState(dir, StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := s.NewBatch()
	b.SetApplied(5, 1)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	none := func(_, _ []byte) error { return nil }
	calls := map[string]func() error{
		"Applied":   func() error { _, _, err := s.Applied(); return err },
		"Scan":      func() error { return s.Scan(KindBooking, none) },
		"ScanRange": func() error { return s.ScanRange(KindBooking, []byte("a"), []byte("b"), none) },
		"HasRecords": func() error {
			has, err := s.HasRecords()
			if has {
				return fmt.Errorf("HasRecords true, %v", err)
			}
			return err
		},
		"UnknownRecord": func() error {
			key, err := s.UnknownRecord()
			if key != nil {
				return fmt.Errorf("UnknownRecord %q, %v", key, err)
			}
			return err
		},
		"Sync":   s.Sync,
		"Commit": b.Commit,
		"SortedLoader.Set": func() error {
			return s.NewSortedLoader().Set([]byte{KindBooking, 'k'}, []byte("v"))
		},
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, ErrClosed) {
			t.Errorf("%s after Close = %v, want ErrClosed", name, err)
		}
	}
	if err := s.Close(); err != nil {
		t.Errorf("a second Close = %v, want nil", err)
	}
	for _, glob := range []string{"group-*", "load-*"} {
		if ms, _ := filepath.Glob(filepath.Join(dir, glob)); len(ms) != 0 {
			t.Errorf("%v left in the closed database's directory", ms)
		}
	}
	b.Close()
}

// TestStateCloseWhileMethodsRun: a Close racing the database's methods
// waits for the ones running and fails the later ones with ErrClosed; each
// call either sees the open database or ErrClosed, never a half-closed one
// (under -race, the unguarded handle is a reported race).
func TestStateCloseWhileMethodsRun(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	b := s.NewBatch()
	b.SetApplied(5, 1)
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	b.Close()
	none := func(_, _ []byte) error { return nil }
	calls := []func() error{
		func() error { _, _, err := s.Applied(); return err },
		func() error { return s.Scan(KindApplied, none) },
		s.Sync,
	}
	started := make(chan struct{}, len(calls))
	errs := make(chan error, len(calls))
	for _, call := range calls {
		go func() {
			for i := 0; ; i++ {
				err := call()
				if i == 0 {
					started <- struct{}{}
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	for range calls {
		<-started
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	for range calls {
		if err := <-errs; !errors.Is(err, ErrClosed) {
			t.Errorf("a call across Close = %v, want nil until ErrClosed", err)
		}
	}
}

// TestReserveGrowsOnceToTheGroupSize: a group that outgrows its first MiB
// grows straight to the reserved size (no doublings past it, each a copy
// into fresh pages), and one that stays small allocates no more than it
// holds.
func TestReserveGrowsOnceToTheGroupSize(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const reserved = 8 << 20
	small, big := s.NewBatch(), s.NewBatch()
	small.Reserve(reserved)
	big.Reserve(reserved)
	for i := range 1000 {
		small.PutCursor(uint64(i), 0, 1, 0)
	}
	if cap(small.arena) >= reserveFrom {
		t.Fatalf("a small group's arena has room for %d bytes", cap(small.arena))
	}
	var arenas, opss []int
	for i := 0; big.Len() < reserved*9/10; i++ {
		big.PutCursor(uint64(i), 0, 1, 0)
		if n := cap(big.arena); len(arenas) == 0 || arenas[len(arenas)-1] != n {
			arenas = append(arenas, n)
		}
		if n := cap(big.ops); len(opss) == 0 || opss[len(opss)-1] != n {
			opss = append(opss, n)
		}
	}
	if last := arenas[len(arenas)-1]; last < reserved || arenas[len(arenas)-2] >= reserveFrom*2 {
		t.Fatalf("arena capacities %v: want a doubling up to about %d, then one step to %d", arenas, reserveFrom, reserved)
	}
	if last := opss[len(opss)-1]; last < reserved/24 {
		t.Fatalf("ops capacities %v: want room for an op per 24 reserved bytes at the end", opss)
	}
	// The grown buffers are advised for huge pages while the group lives
	// (its buffers are kept from commit to commit), and no longer once it
	// is closed.
	if hugepage.Held() == 0 {
		t.Fatal("a group grown to its reserved size advised none of its buffers")
	}
	big.SetApplied(1, 1)
	if err := big.Commit(); err != nil {
		t.Fatal(err)
	}
	if hugepage.Held() == 0 {
		t.Fatal("the commit dropped the group's advice: its buffers are kept")
	}
	groups := hugepage.Held()
	big.Close()
	small.Close()
	// The commit's sort and gather buffer is the database's, kept for
	// the next commit until the database closes.
	if h := hugepage.Held(); h == 0 || h >= groups {
		t.Fatalf("%d bytes advised after the groups closed (%d before): want the database's commit scratch only", h, groups)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if h := hugepage.Held(); h != 0 {
		t.Fatalf("%d bytes still advised after Close", h)
	}
}

// TestGroupCommitAfterCloseFailsEvenEmpty: Close's contract (a group's
// Commit then fails with ErrClosed) holds for a group with nothing in it.
func TestGroupCommitAfterCloseFailsEvenEmpty(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	empty, full := s.NewBatch(), s.NewBatch()
	if err := empty.Commit(); err != nil {
		t.Fatalf("an empty group on an open database: %v", err)
	}
	full.SetApplied(3, 1)
	s.Close()
	for name, b := range map[string]*StateBatch{"empty": empty, "full": full} {
		if err := b.Commit(); !errors.Is(err, ErrClosed) {
			t.Errorf("Commit of the %s group after Close = %v, want ErrClosed", name, err)
		}
	}
}

// TestGroupsShareTheCommitScratch: the groups of one database sort and
// gather in one scratch (commitScratch), the FSM's two groups committing
// and viewing from different goroutines. Two groups of disjoint keys
// commit at once, round after round, with views taken of each meanwhile:
// every view holds its group's writes and the database ends with all of
// them (under -race, the scratch's lock is checked too). A smaller group
// committing after a larger one finds the scratch large enough and leaves
// it as it was.
func TestGroupsShareTheCommitScratch(t *testing.T) {
	s, err := OpenState(filepath.Join(t.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const rounds = 8
	groups := [2]*StateBatch{s.NewBatch(), s.NewBatch()}
	model := map[string]string{}
	for r := 0; r < rounds; r++ {
		var written [2]map[string]string
		for g, b := range groups {
			written[g] = map[string]string{}
			for i := 0; i < 2000*(g+1); i++ {
				k := fmt.Sprintf("group %d round %d write %d", g, r, i)
				v := fmt.Sprintf("%d", i)
				b.Put(KindBooking, []byte(k), []byte(v))
				written[g][string(KindBooking)+k] = v
			}
		}
		errs := make(chan error, 2)
		for g, b := range groups {
			go func() {
				v := b.View()
				defer v.Close()
				got := map[string]string{}
				if err := v.Each(func(k, val []byte) error {
					if k[0] == KindBooking && bytes.Contains(k, fmt.Appendf(nil, "group %d round %d ", g, r)) {
						got[string(k)] = string(val)
					}
					return nil
				}); err != nil {
					errs <- err
					return
				}
				if !maps.Equal(got, written[g]) {
					errs <- fmt.Errorf("round %d: group %d's view holds %d of its %d writes", r, g, len(got), len(written[g]))
					return
				}
				errs <- b.Commit()
			}()
		}
		for range groups {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		for g := range written {
			maps.Copy(model, written[g])
		}
	}
	got := map[string]string{}
	if err := s.Scan(KindBooking, func(k, v []byte) error {
		got[string(KindBooking)+string(k)] = string(v)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, model) {
		t.Fatalf("the database holds %d records, want the %d both groups wrote", len(got), len(model))
	}

	// A group larger than any before grows the scratch; a smaller one
	// after it finds the scratch large enough.
	before := cap(s.scratch.buf)
	for i := 0; i < 20000; i++ {
		groups[1].Put(KindBooking, fmt.Appendf(nil, "large %d", i), []byte("a value of some length"))
	}
	// The commit sizes the scratch once, for the larger of its sort and
	// its gather: a scratch sized for the sort alone leaves the gather
	// to grow plain memory of its own.
	need := max(len(groups[1].ops)*opBytes, groups[1].gatherBytes())
	if err := groups[1].Commit(); err != nil {
		t.Fatal(err)
	}
	large := cap(s.scratch.buf)
	if large <= before || large*8 < need {
		t.Fatalf("a group larger than any before left the scratch at %d words (%d before), want room for %d bytes", large, before, need)
	}
	for i := 0; i < 3000; i++ {
		groups[0].Put(KindBooking, fmt.Appendf(nil, "small %d", i), []byte("v"))
	}
	if err := groups[0].Commit(); err != nil {
		t.Fatal(err)
	}
	if c := cap(s.scratch.buf); c != large {
		t.Fatalf("a smaller group's commit changed the scratch from %d to %d words", large, c)
	}
}

// TestCommitScratchTakesRoomAndOutlivesNoClose: take gives at least the
// bytes asked, 8-byte aligned and with room for the ops asked; a take
// of the scratch's own size does not grow it; and after release, takes
// still give usable memory that is not advised (no advice outlives the
// database's Close).
func TestCommitScratchTakesRoomAndOutlivesNoClose(t *testing.T) {
	var c commitScratch
	c.mu.Lock()
	for _, n := range []int{1, 7, 8, 24, 1000, 3 << 20, 5 << 20} {
		b := c.take(n)
		if len(b) < n || uintptr(unsafe.Pointer(unsafe.SliceData(b)))%8 != 0 {
			t.Fatalf("take(%d): %d bytes at %p", n, len(b), unsafe.SliceData(b))
		}
		ops := opsIn(b, n/opBytes)
		for i := range ops {
			ops[i] = groupOp{k0: uint64(i), off: uint32(i)}
		}
		if k := len(ops) - 1; k >= 0 && (ops[k].k0 != uint64(k) || ops[k].off != uint32(k)) {
			t.Fatalf("take(%d): the last op reads back %+v", n, ops[k])
		}
	}
	grown := cap(c.buf)
	if c.take(grown * 8); cap(c.buf) != grown {
		t.Fatalf("a take of the scratch's own size grew it from %d to %d words", grown, cap(c.buf))
	}
	if hugepage.Held() == 0 {
		t.Fatal("a scratch of 5 MiB is not advised for huge pages")
	}
	c.mu.Unlock()
	c.release()
	if h := hugepage.Held(); h != 0 {
		t.Fatalf("%d bytes still advised after release", h)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if b := c.take(5 << 20); len(b) < 5<<20 {
		t.Fatalf("a take after release gave %d bytes", len(b))
	}
	if h := hugepage.Held(); h != 0 || c.buf != nil {
		t.Fatalf("a take after release advised %d bytes or kept %d words", h, cap(c.buf))
	}
}
