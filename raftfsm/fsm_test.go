package raftfsm

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/hugepage"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
)

func openTestFSM(t testing.TB, dir string) *FSM {
	t.Helper()
	f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

type logWriter struct {
	index uint64
}

func (w *logWriter) next(data []byte) *raft.Log {
	w.index++
	return &raft.Log{Index: w.index, Term: 1, Type: raft.LogCommand, Data: data}
}

func chainEvents(r kvevent.Rank, first uint64, n int, base uint64) []kvevent.Event {
	var evs []kvevent.Event
	for i := 0; i < n; i++ {
		ev := kvevent.Event{Rank: r, EventID: first + uint64(i), Kind: kvevent.KindStored,
			Blocks: []kvevent.Block{{EngineHash: base + uint64(i), LocalHash: 1000 + base + uint64(i)}}}
		if i > 0 {
			ev.HasParent, ev.Parent = true, base+uint64(i-1)
		}
		evs = append(evs, ev)
	}
	return evs
}

var (
	r1 = kvevent.Rank{Worker: 1}
	r2 = kvevent.Rank{Worker: 2, DP: 1}
)

// applyFixture drives a FSM through every command type and returns the
// entries it applied. The last is an event batch (see
// TestRestartDoesNotDoubleApplyReplayedEntries).
func applyFixture(t testing.TB, f *FSM, w *logWriter) []*raft.Log {
	t.Helper()
	logs := []*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, Capacity: [4]int64{100, 0, 0, 0}})),
		w.next(encodeRegister(1, &WorkerInfo{ID: 2, DPRanks: []uint32{0, 1}, BlockSize: 16})),
		w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 5, 10)}, {Rank: r2, Events: chainEvents(r2, 1, 3, 10)}})),
		{Index: w.index + 1, Term: 1, Type: raft.LogNoop},
		w.next(encodeBook(3, []bookOp{{kind: bookAdd, b: Booking{ID: "q1", Rank: r1, SeqHashes: []uint64{1, 2}, ISL: 64, CachedTokens: 16}},
			{kind: bookAdd, b: Booking{ID: "q2", Rank: r2, SeqHashes: []uint64{3}, ISL: 32}}})),
		w.next(encodeBook(4, []bookOp{{kind: bookPrefillDone, b: Booking{ID: "q1"}}, {kind: bookFree, b: Booking{ID: "q2"}},
			{kind: bookOutput, b: Booking{ID: "q1", SeqHashes: []uint64{99}}}, {kind: bookDecay, b: Booking{ID: "q1", Discount: indexer.DecayScale / 4}}})),
		w.next(encodeSettings(5, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered})),
		w.next(encodeMember(5, &Member{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2"})),
		w.next(encodeEvents(6, []RankBatch{{Rank: r1, Events: []kvevent.Event{{Rank: r1, EventID: 6, Kind: kvevent.KindRemoved, Removed: []uint64{14}}}}})),
	}
	logs[3].Index = logs[2].Index + 1
	w.index = logs[3].Index
	for i := 4; i < len(logs); i++ {
		logs[i].Index = logs[i-1].Index + 1
	}
	w.index = logs[len(logs)-1].Index
	f.ApplyBatch(logs[:4])
	f.ApplyBatch(logs[4:])
	return logs
}

func TestFSMStateSurvivesReopen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	digest, applied := f.Digest(), f.applied.Load()
	if f.Cursor(r1) != 6 || f.Index().Stats().Entries != 7 || len(f.Workers()) != 2 {
		t.Fatalf("cursor %d entries %d workers %d", f.Cursor(r1), f.Index().Stats().Entries, len(f.Workers()))
	}
	if err := f.db.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()

	g := openTestFSM(t, dir)
	defer g.Close()
	if g.Digest() != digest || g.applied.Load() != applied {
		t.Fatalf("after reopen: digest %#x applied %d, want %#x %d", g.Digest(), g.applied.Load(), digest, applied)
	}
	if g.Settings().View != indexer.ViewTiered || g.Members()["n1"].HTTPAddr != "127.0.0.1:2" {
		t.Fatalf("settings/members not restored: %+v %+v", g.Settings(), g.Members())
	}
	if l := g.Sequences().Load(r1); l.ActiveRequests != 1 || l.ActivePrefillTokens != 0 {
		t.Fatalf("bookings not restored: %+v", l)
	}
}

// TestRestartDoesNotDoubleApplyReplayedEntries: after a restart Raft
// re-delivers every entry after its last snapshot (here: all), up to and
// including the one at the state's applied index, and the FSM skips them
// all: each answers nil (ApplyBatch's answer for a skipped entry) and
// the state and the event counts stay as they were. Most of the
// fixture's commands apply a second time as a retry would, changing
// nothing; its last, at the applied index, is an event batch, which
// applied again answers its event as a duplicate and counts it
// (events_total{outcome="duplicate"}): the skip's bound (at or below the
// applied index, not below it) is pinned there.
func TestRestartDoesNotDoubleApplyReplayedEntries(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	logs := applyFixture(t, f, &w)
	digest := f.Digest()
	f.Close()

	f = openTestFSM(t, dir)
	defer f.Close()
	last := logs[len(logs)-1]
	if applied, _ := f.Applied(); applied != last.Index {
		t.Fatalf("after the restart the state is at %d, want the fixture's last entry %d", applied, last.Index)
	}
	dups := func() uint64 { return f.events[kvevent.KindRemoved][kvevent.TierDevice][outcomeDuplicate].Load() }
	before := dups()
	for i, out := range f.ApplyBatch(logs) {
		if out != nil {
			t.Errorf("re-delivered entry %d answered %+v, want nil: applied again", logs[i].Index, out)
		}
	}
	if f.Digest() != digest {
		t.Error("re-delivered entries changed the state")
	}
	if got := dups(); got != before {
		t.Errorf("re-delivered entries counted %d duplicate events, want none", got-before)
	}
}

// TestASnapshotTakenDuringTheReplayIsTheStateOfItsIndex: after a restart
// the state database may be ahead of Raft's last snapshot (a group
// committed after it, at G). Raft re-delivers the entries after its
// snapshot and the FSM skips them up to G; a Raft snapshot taken
// meanwhile, once Raft handed over X < G, is labelled X by Raft, but
// FSM.Snapshot streamed the state at G. A follower that installs it takes
// X as its applied index and applies X+1..G a second time over a state
// that holds them: a booking added and then expired by a sweep came back
// live (Add stamps it at the sweep clock, and the sweep at that clock
// leaves it). The snapshot is refused until Raft has handed over G.
func TestASnapshotTakenDuringTheReplayIsTheStateOfItsIndex(t *testing.T) {
	const maxAge = int64(time.Second)
	t0 := int64(10 * time.Second)
	logs := []*raft.Log{
		{Index: 1, Term: 1, Type: raft.LogCommand, Data: encodeRegister(t0, &WorkerInfo{ID: 1, BlockSize: 16})},
		{Index: 2, Term: 1, Type: raft.LogCommand, Data: encodeBook(t0, []bookOp{{kind: bookAdd, b: Booking{ID: "q1", Rank: r1, SeqHashes: []uint64{1, 2}, ISL: 64}}})},
		{Index: 3, Term: 1, Type: raft.LogCommand, Data: encodeExpire(t0+3*maxAge, maxAge)},
	}
	dir := filepath.Join(t.TempDir(), "fsm")
	src := openTestFSM(t, dir)
	src.ApplyBatch(logs)
	src.Close() // the group commits: the state database is at G = 3
	// The restart: Raft's last snapshot is older (none here); it
	// re-delivers entry 1, which the FSM skips, and takes a snapshot,
	// which it would label 1.
	src = openTestFSM(t, dir)
	defer src.Close()
	src.ApplyBatch(logs[:1])
	if s, err := src.Snapshot(); !errors.Is(err, ErrReplaying) {
		if err == nil {
			s.Release()
		}
		t.Fatalf("a snapshot that Raft labels 1 of the state at 3 answered %v, want ErrReplaying", err)
	}
	// Raft tries again once it handed over the rest: the label is the
	// state's index. A follower installs it and applies what comes after.
	src.ApplyBatch(logs[1:])
	const raftLabel = 3
	snap := snapshotBytes(t, src)
	dst := openTestFSM(t, filepath.Join(t.TempDir(), "dst"))
	defer dst.Close()
	if err := dst.Restore(raftSnapshotStream(snap, raftLabel, 1)); err != nil {
		t.Fatal(err)
	}
	dst.ApplyBatch(logs[raftLabel:])
	sl, sf := src.seqs.Count()
	dl, df := dst.seqs.Count()
	if dst.Digest() != src.Digest() || sl != dl || sf != df {
		t.Errorf("the follower diverged: digest %#x, live/freed bookings %d/%d; the node it installed from: %#x, %d/%d",
			dst.Digest(), dl, df, src.Digest(), sl, sf)
	}
}

// TestASnapshotRightAfterARestoreIsTaken: Raft labels its next snapshot
// with the restored snapshot's index until it hands over an entry, and
// FSM.Snapshot refuses while the state is past the last index Raft
// handed over (ErrReplaying). A restore leaves the state at the
// snapshot's index, so it counts as handed over: were it not, every
// snapshot after an install or a user restore (compactForFollower's
// included) was refused until the next entry came.
func TestASnapshotRightAfterARestoreIsTaken(t *testing.T) {
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	defer src.Close()
	var w logWriter
	applyFixture(t, src, &w)
	index, _ := src.Applied()
	snap := snapshotBytes(t, src)
	dst := openTestFSM(t, filepath.Join(t.TempDir(), "dst"))
	defer dst.Close()
	if err := dst.Restore(raftSnapshotStream(snap, index, 1)); err != nil {
		t.Fatal(err)
	}
	s, err := dst.Snapshot()
	if err != nil {
		t.Fatalf("a snapshot right after the restore of one at %d: %v", index, err)
	}
	s.Release()
}

func TestEventBatchesGoThroughTheCursor(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	evs := chainEvents(r1, 1, 6, 10)
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: evs[:3]}})),
		w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: evs[1:4]}})),                          // overlaps: 2 dups
		w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: append([]kvevent.Event{}, evs[5])}})), // gap
	})
	a := res[0].([]RankAck)[0]
	b := res[1].([]RankAck)[0]
	c := res[2].([]RankAck)[0]
	if a.Applied != 3 || a.Cursor != 3 || b.Dups != 2 || b.Applied != 1 || b.Cursor != 4 || !c.Gap || c.Applied != 0 || c.Cursor != 4 {
		t.Fatalf("acks %+v %+v %+v", a, b, c)
	}
	if n := f.Index().Stats().Entries; n != 4 {
		t.Fatalf("entries %d, want 4: nothing past the gap applies", n)
	}
	// Nothing past the gap is held either: an event applied there (whose
	// parent, event 5's block, the index never saw) waits as an orphan
	// and leaves the entries as they were. The state is that of an FSM
	// fed only the events before the gap.
	if st := f.Index().Stats(); st.OrphanEvents != 0 || st.NeedResync != 0 {
		t.Fatalf("%d orphan events, %d ranks needing a resync: the event past the gap reached the index", st.OrphanEvents, st.NeedResync)
	}
	g := openTestFSM(t, filepath.Join(t.TempDir(), "before-gap"))
	defer g.Close()
	var gw logWriter
	g.ApplyBatch([]*raft.Log{gw.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: evs[:4]}}))})
	if g.Cursor(r1) != 4 || f.Digest() != g.Digest() {
		t.Fatalf("digest %x, an FSM fed only the events before the gap %x (its cursor %d): the event past the gap changed the state",
			f.Digest(), g.Digest(), g.Cursor(r1))
	}
}

// entryApplyAllocs is the allocations of FSM.ApplyBatch per entry of
// perEntry events of one rank, stores and removes of one block in turn,
// the stores malformed (an engine hash twice) when malformed is set.
func entryApplyAllocs(t *testing.T, perEntry int, malformed bool) float64 {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16}))})
	id := uint64(0)
	logs := make([]*raft.Log, 110) // AllocsPerRun's warm-up run and 100 more
	for i := range logs {
		evs := make([]kvevent.Event, 0, perEntry)
		for range perEntry / 2 {
			id++
			st := kvevent.Event{Rank: r1, EventID: id, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 5, LocalHash: 7}}}
			if malformed { // an engine hash twice in the chain
				st.Blocks = append(st.Blocks, kvevent.Block{EngineHash: 5, LocalHash: 9})
			}
			id++
			evs = append(evs, st, kvevent.Event{Rank: r1, EventID: id, Kind: kvevent.KindRemoved, Removed: []uint64{5}})
		}
		logs[i] = w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: evs}}))
	}
	f.ApplyBatch(logs[:1]) // the rank's cursor and state
	i := 1
	n := testing.AllocsPerRun(100, func() {
		ack := f.ApplyBatch(logs[i : i+1])[0].([]RankAck)[0]
		if ack.Applied != perEntry {
			t.Fatalf("entry %d: %+v, want %d events applied", i, ack, perEntry)
		}
		i++
	})
	return n
}

// TestAnEntrysEventsCostTheApplyNoAllocation pins the hot-path rule of
// the developers' guide ("no per-event allocation you can avoid") on the
// replicated apply (FSM.ApplyBatch, applyRankBatch, the index's apply):
// an entry of 256 events allocates what one of 64 does. No test measured
// the apply's allocations: one more per event passed every test.
func TestAnEntrysEventsCostTheApplyNoAllocation(t *testing.T) {
	short, long := entryApplyAllocs(t, 64, false), entryApplyAllocs(t, 256, false)
	t.Logf("an entry of 64 events: %.0f allocations; of 256: %.0f", short, long)
	if long > short+2 {
		t.Fatalf("an entry of 256 events allocated %.0f times, of 64 events %.0f: %.2f per event", long, short, (long-short)/192)
	}
}

// TestMalformedEventsCostTheApplyNoAllocation: a malformed event of an
// entry consumes its id and is counted, and its error is not kept, so an
// entry of malformed events allocates what one of as many valid ones
// does. The apply went through indexer.Index.Apply, whose error wraps
// Validate's in fmt.Errorf: about 7 allocations per malformed event,
// formatted and dropped on every node, for as many events as a faulty
// publisher sends.
func TestMalformedEventsCostTheApplyNoAllocation(t *testing.T) {
	const perEntry = 64
	valid, bad := entryApplyAllocs(t, perEntry, false), entryApplyAllocs(t, perEntry, true)
	t.Logf("an entry of %d events: %.0f allocations; with %d of them malformed: %.0f", perEntry, valid, perEntry/2, bad)
	if bad > valid+2 {
		t.Fatalf("an entry with %d malformed events allocated %.0f times, %.1f per malformed event more than an entry of valid ones (%.0f)",
			perEntry/2, bad, (bad-valid)/(perEntry/2), valid)
	}
}

// TestABatchThatAppliesNothingCreatesNoCursor: a rank's first batch that
// begins past a gap applies nothing and leaves the rank without a cursor,
// in memory and in the state database, as one never sent: HasCursor
// reporting one would say the rank holds state it does not, and hide it
// from a heartbeat answer's ranks without state, whose publisher resyncs
// them.
func TestABatchThatAppliesNothingCreatesNoCursor(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	defer func() { f.Close() }()
	var w logWriter
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: r1.Worker, DPRanks: []uint32{r1.DP}, BlockSize: 16})),
		w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: chainEvents(r1, 3, 2, 10)}})),
	})
	if a := res[1].([]RankAck)[0]; !a.Gap || a.Applied != 0 || a.Cursor != 0 {
		t.Fatalf("a first batch beginning at id 3: ack %+v, want a gap at cursor 0", a)
	}
	if f.HasCursor(r1) {
		t.Fatalf("rank %v holds a cursor (%d) after a batch that applied nothing", r1, f.Cursor(r1))
	}
	f.Close()
	f = openTestFSM(t, dir)
	if f.HasCursor(r1) {
		t.Fatalf("rank %v holds a cursor (%d) after a reopen: the batch that applied nothing saved one", r1, f.Cursor(r1))
	}
}

// TestADeregistrationForgetsTheRegistrationTime: RegisteredAt answers 0
// for a worker once deregistered, as for one never registered: the time
// is kept for the registered workers only, and a worker's next
// registration sets its own.
func TestADeregistrationForgetsTheRegistrationTime(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(5, &WorkerInfo{ID: 3, BlockSize: 16}))})
	if got := f.RegisteredAt(3); got != 5 {
		t.Fatalf("RegisteredAt(3) after its registration at 5: %d", got)
	}
	f.ApplyBatch([]*raft.Log{w.next(encodeDeregister(6, 3))})
	if got := f.RegisteredAt(3); got != 0 {
		t.Fatalf("RegisteredAt(3) after its deregistration: %d, want 0", got)
	}
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(7, &WorkerInfo{ID: 3, BlockSize: 16}))})
	if got := f.RegisteredAt(3); got != 7 {
		t.Fatalf("RegisteredAt(3) after registering again at 7: %d", got)
	}
}

func TestUndecodableEntryChangesNothing(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	d := f.Digest()
	good := encodeEvents(9, []RankBatch{{Rank: r1, Events: chainEvents(r1, 7, 2, 50)}})
	// Ids that would key state records past what the state database's
	// group handles hold (maxKeyID).
	longID := strings.Repeat("x", maxKeyID+1)
	longBooking := encodeBook(9, []bookOp{{kind: bookAdd, b: Booking{ID: longID, Rank: r1, SeqHashes: []uint64{1}, ISL: 16}}})
	longMember := encodeMember(9, &Member{ID: longID, RaftAddr: "a", HTTPAddr: "b"})
	// {9}, a version above the highest this build reads, comes last: it
	// is a later build's entry, at which the FSM halts
	// (TestTheFSMHaltsAtAnEntryOfALaterBuild).
	for _, data := range [][]byte{nil, {commandVersion, 99}, good[:len(good)-3], append(bytes.Clone(good), 0), longBooking, longMember, {9}} {
		res := f.ApplyBatch([]*raft.Log{w.next(data)})
		if err, ok := res[0].(error); !ok || !errors.Is(err, ErrBadCommand) {
			t.Fatalf("entry %x: response %v, want ErrBadCommand", data, res[0])
		}
	}
	if f.Digest() != d {
		t.Fatal("an undecodable entry changed the state")
	}
}

func snapshotBytes(t testing.TB, f *FSM) []byte {
	t.Helper()
	s, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	return streamOf(t, s.(*fsmSnapshot).view)
}

// TestReleaseClosesTheSnapshotsView: Raft calls Release after Persist
// (or instead of it), and Release closes the view the snapshot streams:
// a view left open holds its Pebble snapshot, which keeps every version
// of the state it reads from compaction for as long as the node runs.
func TestReleaseClosesTheSnapshotsView(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	s, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	view := s.(*fsmSnapshot).view
	streamOf(t, view)
	s.Release()
	if _, _, err := view.Applied(); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("the view after Release reads applied with %v, want %v: its Pebble snapshot is still open", err, store.ErrClosed)
	}
}

// viewBytes returns the stream of a user's save (FSM.view: the open group
// laid over the database, not committed).
func viewBytes(t *testing.T, f *FSM) []byte {
	t.Helper()
	v, _, err := f.view()
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	return streamOf(t, v)
}

// streamOf returns the snapshot stream of a view.
func streamOf(t testing.TB, v *store.StateSnapshot) []byte {
	t.Helper()
	var buf bytes.Buffer
	if _, err := writeSnapshot(&buf, v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// fixtureSnapshot returns an FSM holding applyFixture's state (closed at
// the test's end) and a snapshot stream of it.
func fixtureSnapshot(t *testing.T) (*FSM, []byte) {
	t.Helper()
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	t.Cleanup(func() { f.Close() })
	var w logWriter
	applyFixture(t, f, &w)
	return f, snapshotBytes(t, f)
}

// fixtureSnapshotFile is fixtureSnapshot with the stream written to a file
// (good.snap in a temporary directory), whose path it returns.
func fixtureSnapshotFile(t *testing.T) (*FSM, string) {
	t.Helper()
	f, snap := fixtureSnapshot(t)
	path := filepath.Join(t.TempDir(), "good.snap")
	if err := os.WriteFile(path, snap, 0o644); err != nil {
		t.Fatal(err)
	}
	return f, path
}

// restoredFSM restores snap into a fresh FSM (closed at the test's end)
// and checks that it has the digest want.
func restoredFSM(t *testing.T, snap []byte, want uint64) *FSM {
	t.Helper()
	g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	t.Cleanup(func() { g.Close() })
	if err := g.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	if g.Digest() != want {
		t.Fatalf("restored digest %#x, want %#x", g.Digest(), want)
	}
	return g
}

func TestSnapshotRestoreRoundTrip(t *testing.T) {
	f, snap := fixtureSnapshot(t)
	info, err := InspectSnapshot(bytes.NewReader(snap))
	if err != nil || info.Index != f.applied.Load() || info.Records["residencies"] != 7 {
		t.Fatalf("inspect: %+v %v", info, err)
	}

	g := restoredFSM(t, snap, f.Digest())
	// Every entry Raft delivers after a restore must apply, whatever index
	// the stream was taken at.
	if g.applied.Load() != 0 {
		t.Fatalf("applied after restore = %d, want 0", g.applied.Load())
	}
	var gw logWriter
	g.ApplyBatch([]*raft.Log{gw.next(encodeRegister(1, &WorkerInfo{ID: 3, BlockSize: 16}))})
	if len(g.Workers()) != 3 {
		t.Fatal("the first entry after a restore was skipped")
	}
	if _, err := os.Stat(g.dir + ".old"); !os.IsNotExist(err) {
		t.Fatal("the old state directory was left behind")
	}
}

// TestRestoreBesideAnOpenSnapshot: Raft may install a leader's snapshot
// (Restore, on the FSM goroutine) while this node's own snapshot is open
// for persisting, and Raft holds that one until the install is done. The
// restore goes on: the state becomes the leader's, and the open
// snapshot's persist fails with ErrClosed, which Raft logs. It used to
// fail the restore ("leaked snapshots") and leave the FSM without a
// database, and the persist then panicked on the closed database.
func TestRestoreBesideAnOpenSnapshot(t *testing.T) {
	leader, stream := fixtureSnapshot(t)
	f, own := openBigSnapshot(t, 5_000)
	if err := f.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatalf("restore beside an open snapshot: %v", err)
	}
	if f.Digest() != leader.Digest() {
		t.Fatalf("restored digest %#x, want the leader's %#x", f.Digest(), leader.Digest())
	}
	if _, err := writeSnapshot(io.Discard, own.(*fsmSnapshot).view); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("persisting the snapshot of the replaced state: %v, want store.ErrClosed", err)
	}
	// The restored state takes applies and snapshots as ever.
	var w logWriter
	w.index = 1 << 20
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 9, BlockSize: 16}))})
	restoredFSM(t, snapshotBytes(t, f), f.Digest())
}

// TestSaveLaysTheGroupOverTheDatabase: a user's save (Node.SaveSnapshot
// through FSM.view) streams the open group laid over the database without
// committing it: no table is added, the stream is byte for byte the one
// Raft's snapshot writes after committing the group, and a view taken
// before more applies streams the state it was taken at.
func TestSaveLaysTheGroupOverTheDatabase(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	tables := func() []string {
		ts, err := filepath.Glob(filepath.Join(f.dir, "*.sst"))
		if err != nil {
			t.Fatal(err)
		}
		return ts
	}
	before := tables()
	if f.batch == nil || f.batch.Len() == 0 {
		t.Fatal("the fixture left no open group: the test needs one")
	}
	saved := viewBytes(t, f)
	if after := tables(); !slices.Equal(before, after) {
		t.Fatalf("the save committed the group: tables %v, then %v", before, after)
	}
	v, _, err := f.view()
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	digest := f.Digest()
	f.ApplyBatch([]*raft.Log{w.next(encodeEvents(7, []RankBatch{{Rank: r2, Events: chainEvents(r2, 4, 2, 50)}}))})
	if f.Digest() == digest {
		t.Fatal("the later apply changed nothing: the test needs it to")
	}
	if !bytes.Equal(streamOf(t, v), saved) {
		t.Fatal("a view streams writes applied after it was taken")
	}
	restoredFSM(t, saved, digest)

	// Raft's snapshot of the same state, group committed, is the same stream.
	g := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer g.Close()
	var gw logWriter
	applyFixture(t, g, &gw)
	if snap := snapshotBytes(t, g); !bytes.Equal(snap, saved) {
		t.Fatal("the save's stream differs from Raft's snapshot of the same state")
	}
}

// TestRestoreBuildsWhatTheDirectoryHolds: Restore builds the in-memory
// state from the stream while it writes the new directory; that state
// must be the one a start would load from the directory (FSM.load).
func TestRestoreBuildsWhatTheDirectoryHolds(t *testing.T) {
	f, snap := fixtureSnapshot(t)

	dir := filepath.Join(t.TempDir(), "fsm")
	g := openTestFSM(t, dir)
	if err := g.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	type state struct {
		Digest   uint64
		Applied  uint64
		Stats    indexer.Stats
		Cursors  [2]uint64
		Workers  map[uint64]WorkerInfo
		Members  map[string]Member
		Settings Settings
		Dumps    []indexer.RankDump
		Live     int
	}
	of := func(f *FSM) state {
		st := state{Digest: f.Digest(), Applied: f.applied.Load(), Stats: f.Index().Stats(),
			Cursors: [2]uint64{f.Cursor(r1), f.Cursor(r2)}, Workers: f.Workers(), Members: f.Members(), Settings: f.Settings()}
		for _, r := range []kvevent.Rank{r1, r2} {
			d, err := f.Index().DumpRank(r)
			if err != nil {
				t.Fatal(err)
			}
			st.Dumps = append(st.Dumps, d)
		}
		st.Live, _ = f.Sequences().Count()
		return st
	}
	built := of(g)
	g.Close()
	h := openTestFSM(t, dir)
	defer h.Close()
	if loaded := of(h); !reflect.DeepEqual(built, loaded) {
		t.Fatalf("restore built\n%+v\nthe directory loads\n%+v", built, loaded)
	}
	if built.Digest != f.Digest() || len(built.Members) != 1 || built.Settings.View != indexer.ViewTiered || built.Live != 1 {
		t.Fatalf("restored state %+v does not match the source", built)
	}
}

func TestCorruptSnapshotIsRefusedAndStateKept(t *testing.T) {
	_, snap := fixtureSnapshot(t)

	dir := filepath.Join(t.TempDir(), "fsm")
	g := openTestFSM(t, dir)
	defer g.Close()
	var gw logWriter
	g.ApplyBatch([]*raft.Log{gw.next(encodeRegister(1, &WorkerInfo{ID: 77, BlockSize: 16}))})
	before := g.Digest()
	// A refused restore leaves no fsm.restore/ behind: the next restore
	// would remove it, but until then it holds up to a whole state's
	// records on the disk.
	noRestoreDir := func(name string) {
		t.Helper()
		if _, err := os.Stat(dir + ".restore"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: %s after the refused restore: %v, want it gone", name, filepath.Base(dir)+".restore", err)
		}
	}
	flipped := bytes.Clone(snap)
	flipped[len(flipped)/2] ^= 0x40
	// Well formed, with a good checksum, but a tree node's value cannot be
	// decoded: refused before the swap, like a corrupt stream.
	badNode := buildStream(snapshotVersion, []rec{{k: append([]byte{store.KindNode}, make([]byte, 8)...), v: []byte{1, 2, 3}}},
		map[byte]uint64{}, map[byte]uint64{store.KindNode: 1})
	if err := g.Restore(nopCloser{bytes.NewReader(badNode)}); !errors.Is(err, ErrBadSnapshot) {
		t.Errorf("undecodable record: restore err %v, want ErrBadSnapshot", err)
	}
	noRestoreDir("undecodable record")
	// A tree node after a residency: out of key order, refused (and the
	// tree being linked from the residency on is not raced by the node).
	node := rec{k: append([]byte{store.KindNode}, make([]byte, 8)...), v: make([]byte, 17)}
	entry := rec{k: append([]byte{store.KindEntry}, make([]byte, 20)...), v: make([]byte, 13)}
	disordered := buildStream(snapshotVersion, []rec{entry, node}, map[byte]uint64{}, map[byte]uint64{store.KindNode: 1, store.KindEntry: 1})
	if err := g.Restore(nopCloser{bytes.NewReader(disordered)}); !errors.Is(err, ErrBadSnapshot) {
		t.Errorf("records out of order: restore err %v, want ErrBadSnapshot", err)
	}
	noRestoreDir("records out of order")
	// Records that decode but do not make a consistent state (a residency
	// of a tree node the stream lacks): refused before the swap too, and
	// the node does not fail (openTestFSM's OnFatal fails the test).
	orphanEntry := rec{k: append([]byte{store.KindEntry}, make([]byte, 20)...), v: []byte{0, 0, 0, 0, 0, 0, 0, 5, 1, 0, 0, 0, 1}}
	inconsistent := buildStream(snapshotVersion, []rec{orphanEntry}, map[byte]uint64{}, map[byte]uint64{store.KindEntry: 1})
	if err := g.Restore(nopCloser{bytes.NewReader(inconsistent)}); !errors.Is(err, ErrBadSnapshot) {
		t.Errorf("inconsistent records: restore err %v, want ErrBadSnapshot", err)
	}
	noRestoreDir("inconsistent records")
	for name, b := range map[string][]byte{
		"truncated":   snap[:len(snap)-10],
		"bit flipped": flipped,
		"empty":       nil,
		"not ours":    []byte("hello world, this is not a snapshot at all"),
		"trailing":    append(bytes.Clone(snap), 1),
	} {
		if _, err := InspectSnapshot(bytes.NewReader(b)); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("%s: inspect err %v, want ErrBadSnapshot", name, err)
		}
		if err := g.Restore(nopCloser{bytes.NewReader(b)}); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("%s: restore err %v, want ErrBadSnapshot", name, err)
		}
		noRestoreDir(name)
	}
	if g.Digest() != before || len(g.Workers()) != 1 {
		t.Fatal("a refused snapshot changed the state")
	}
}

func TestInterruptedRestoreSwapRollsBack(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	d := f.Digest()
	f.db.Sync()
	f.Close()
	// Crash after the first rename of the swap: dir moved to dir.old, the
	// new state still in dir.restore.
	if err := os.Rename(dir, dir+".old"); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(dir+".restore", 0o755)
	g := openTestFSM(t, dir)
	defer g.Close()
	if g.Digest() != d {
		t.Fatal("the interrupted swap was not rolled back")
	}
}

// TestARestoreSyncsEachStepOfItsSwap: a restore syncs the directory it
// loaded (fsm.restore) before the swap, and the parent after each of the
// swap's renames (fsm → fsm.old, fsm.restore → fsm), before the next
// step, so that a power loss leaves the swap at a step cleanupRestore
// finishes or rolls back, and, once Restore returned (Raft then drops
// the entries the snapshot holds), the restored state in place. No other
// test fails with any of these syncs gone: a rename not synced is lost
// only in a power loss. The test records, at each sync, which of the
// three directories exist.
func TestARestoreSyncsEachStepOfItsSwap(t *testing.T) {
	_, snap := fixtureSnapshot(t)
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	defer f.Close()
	exists := func(p string) bool {
		_, err := os.Stat(p)
		return err == nil
	}
	var got []string
	orig := syncDir
	t.Cleanup(func() { syncDir = orig })
	syncDir = func(d string) error {
		got = append(got, fmt.Sprintf("sync %s with fsm %v, fsm.old %v, fsm.restore %v",
			filepath.Base(d), exists(dir), exists(dir+".old"), exists(dir+".restore")))
		return orig(d)
	}
	if err := f.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	parent := filepath.Base(filepath.Dir(dir))
	want := []string{
		"sync fsm.restore with fsm true, fsm.old false, fsm.restore true",
		"sync " + parent + " with fsm false, fsm.old true, fsm.restore true",
		"sync " + parent + " with fsm true, fsm.old true, fsm.restore false",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("the restore's syncs:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// TestACompletedRestoreSwapIsKept: a crash after the second rename of
// the swap leaves the restored state in dir and the old one in dir.old;
// the open keeps the restored one and removes the old. Nothing tested it:
// rolling the old state back there left every test green, a node's start
// then restoring its newest snapshot again (catchUpFromSnapshot), a
// second restore as long as the first.
func TestACompletedRestoreSwapIsKept(t *testing.T) {
	base := t.TempDir()
	// Built apart (an open of dir removes dir.restore), then renamed into
	// place as the swap does.
	dir, restored := filepath.Join(base, "fsm"), filepath.Join(base, "restored")
	f := openTestFSM(t, restored)
	var w logWriter
	applyFixture(t, f, &w)
	want := f.Digest()
	f.Close()
	f = openTestFSM(t, dir)
	f.ApplyBatch([]*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand, Data: encodeRegister(1, &WorkerInfo{ID: 7, BlockSize: 16})}})
	if f.Digest() == want {
		t.Fatal("the test needs two different states")
	}
	f.Close()
	// The swap's two renames, then the crash before dir.old is removed.
	if err := os.Rename(dir, dir+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(restored, dir); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, dir)
	defer g.Close()
	if g.Digest() != want {
		t.Fatal("the completed swap was rolled back: the open holds the state from before the restore")
	}
	if _, err := os.Stat(dir + ".old"); !os.IsNotExist(err) {
		t.Fatalf("%s.old after the open: %v, want it removed", dir, err)
	}
}

// TestAStatusDuringARestoreReadsTheOldPairOrTheNew: AppliedDigest reads
// the applied index and the digest of the state at that index as one
// (TestStatusDigestMatchesItsAppliedIndex), and a restore (Raft's
// InstallSnapshot on a follower) replaces both: a status read meanwhile
// pairs the old index and digest or the new ones, never the old index
// with a half-installed state, nor index 0 with the new state. The reader
// races the restore; it fails only on a pair that is neither.
func TestAStatusDuringARestoreReadsTheOldPairOrTheNew(t *testing.T) {
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	var w logWriter
	applyFixture(t, src, &w)
	newDigest := src.Digest()
	snap := snapshotBytes(t, src)
	src.Close()
	const snapIndex = 1000

	f := openTestFSM(t, filepath.Join(t.TempDir(), "dst"))
	defer f.Close()
	f.ApplyBatch([]*raft.Log{
		{Index: 1, Term: 1, Type: raft.LogCommand, Data: encodeRegister(1, &WorkerInfo{ID: 7, BlockSize: 16})},
		{Index: 2, Term: 1, Type: raft.LogCommand, Data: encodeRegister(1, &WorkerInfo{ID: 8, BlockSize: 16})},
	})
	oldIndex, oldDigest := f.AppliedDigest()

	var stop atomic.Bool
	var wg sync.WaitGroup
	bad := map[string]int{} // the reader's alone until wg.Wait
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			i, d := f.AppliedDigest()
			if (i != oldIndex || d != oldDigest) && (i != snapIndex || d != newDigest) {
				bad[fmt.Sprintf("applied %d with digest %#x (old %d/%#x, new %d/%#x)", i, d, oldIndex, oldDigest, uint64(snapIndex), newDigest)]++
			}
		}
	}()
	err := f.Restore(raftSnapshotStream(snap, snapIndex, 2))
	stop.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	if i, d := f.AppliedDigest(); i != snapIndex || d != newDigest {
		t.Fatalf("after the restore: applied %d with digest %#x, want %d with %#x", i, d, uint64(snapIndex), newDigest)
	}
	for k, n := range bad {
		t.Errorf("a status read %d times: %s", n, k)
	}
}

// TestARestoreRecordsTheSnapshotsIndexWithTheSwap: the restored state
// and the Raft snapshot's index it takes reach fsm/ in one step, the
// directory swap, so that nothing written after the swap can fail on its
// own. The index was committed after the swap, in a group of its own: a
// failure there (a disk error) was returned to Raft as a failed restore
// over a state already replaced, without onFatal, and Raft, taking the
// restore as not done, could hand over again entries the snapshot holds,
// to a state whose applied index read 0; a crash before that commit
// restarted on the snapshot's state at index 0.
func TestARestoreRecordsTheSnapshotsIndexWithTheSwap(t *testing.T) {
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	var w logWriter
	applyFixture(t, src, &w)
	newDigest := src.Digest()
	snap := snapshotBytes(t, src)
	src.Close()

	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	defer f.Close()
	f.ApplyBatch([]*raft.Log{{Index: 5, Term: 1, Type: raft.LogCommand, Data: encodeRegister(1, &WorkerInfo{ID: 7, BlockSize: 16})}})
	// What a start finds after a crash right after the swap.
	crashed := filepath.Join(t.TempDir(), "crashed")
	f.afterSwap = func() {
		if err := os.CopyFS(crashed, os.DirFS(dir)); err != nil {
			t.Error(err)
		}
	}
	if err := f.Restore(raftSnapshotStream(snap, 1000, 2)); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, crashed)
	defer g.Close()
	if i, term := g.Applied(); i != 1000 || term != 2 || g.Digest() != newDigest {
		t.Fatalf("the swapped-in directory holds applied %d (term %d), snapshot's state %v; want 1000 (term 2) with the snapshot's state",
			i, term, g.Digest() == newDigest)
	}
}

// TestRestoreTakesTheIndexOfTheSnapshotRaftJustSaved: Restore labels the
// state with the snapshot Raft opened for it, not with the store's first
// (FileSnapshotStore lists by term first). A deposed leader that ran a
// user restore holds it at (R, its term T); when the new leader sends it
// a snapshot at S < R whose entry is of an older term, Raft saves it at
// (S, older term) and calls Restore. The FSM took (R, T) for it, and
// skipped every entry up to R that Raft delivered after S. The store here
// reaps by term, as an earlier build's did (the node's reaps the
// restore: TestAWrittenSnapshotIsKeptOverOnesOfALaterTerm).
func TestRestoreTakesTheIndexOfTheSnapshotRaftJustSaved(t *testing.T) {
	src := openTestFSM(t, filepath.Join(t.TempDir(), "src"))
	var w logWriter
	applyFixture(t, src, &w)
	stream := snapshotBytes(t, src)
	src.Close()

	dataDir := t.TempDir()
	byTerm, err := raft.NewFileSnapshotStoreWithLogger(dataDir, 2, hclogAdapter(quiet))
	if err != nil {
		t.Fatal(err)
	}
	saveRaftSnapshot(t, byTerm, stream, 100, 5)      // the deposed leader's user restore, at its term
	id := saveRaftSnapshot(t, byTerm, stream, 90, 4) // the new leader's snapshot Raft installs now

	snaps, err := openSnapshotStore(dataDir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	f := openTestFSM(t, filepath.Join(dataDir, "fsm"))
	defer f.Close()
	_, rc, err := snaps.Open(id) // as Raft's runFSM does, then Restore
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Restore(raftWrapped{rc}); err != nil {
		t.Fatal(err)
	}
	if i, tm := f.Applied(); i != 90 || tm != 4 {
		t.Errorf("Raft installed the snapshot at (90, 4); the FSM labels its state (%d, %d) and will skip the entries up to %d", i, tm, i)
	}
}

// saveRaftSnapshot writes stream into snaps as the Raft snapshot at
// (index, term), and returns its id.
func saveRaftSnapshot(t *testing.T, snaps raft.SnapshotStore, stream []byte, index, term uint64) string {
	t.Helper()
	_, trans := raft.NewInmemTransport("")
	defer trans.Close()
	sink, err := snaps.Create(raft.SnapshotVersionMax, index, term, raft.Configuration{}, 1, trans)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Write(stream); err != nil {
		t.Fatal(err)
	}
	if err := sink.Close(); err != nil {
		t.Fatal(err)
	}
	return sink.ID()
}

type nopCloser struct{ *bytes.Reader }

func (nopCloser) Close() error { return nil }

// raftSnapshotStream is snap as Raft hands a node's FSM.Restore the Raft
// snapshot at (index, term): opened by snapshotStore.Open, in Raft's
// wrapper.
func raftSnapshotStream(snap []byte, index, term uint64) io.ReadCloser {
	return raftWrapped{&openedSnapshot{ReadCloser: nopCloser{bytes.NewReader(snap)}, meta: raft.SnapshotMeta{Index: index, Term: term}}}
}

// raftWrapped stands for hashicorp/raft's countingReadCloser.
type raftWrapped struct{ io.ReadCloser }

func (w raftWrapped) WrappedReadCloser() io.ReadCloser { return w.ReadCloser }

func FuzzDecodeCommand(f *testing.F) {
	f.Add(encodeEvents(1, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 3, 10)}}))
	f.Add(encodeBook(3, []bookOp{{kind: bookAdd, b: Booking{ID: "q1", Rank: r1, SeqHashes: []uint64{1, 2}, ISL: 64}}}))
	f.Add(encodeRegister(1, &WorkerInfo{ID: 1, DPRanks: []uint32{0, 3}, BlockSize: 16, Endpoint: "x"}))
	f.Add(encodeSettings(1, &Settings{Params: indexer.DefaultParams()}))
	f.Add(encodeRemoveRanks(1, []kvevent.Rank{r1, r2}))
	f.Add(encodeReplace(1, r2, 9, 0, chainEvents(r2, 1, 2, 5)))
	f.Add(encodeReplace(1, r1, 9, 0xfeedface, chainEvents(r1, 1, 2, 5)))
	f.Add(encodeEvents(1, []RankBatch{{Rank: r1, Incarnation: 0xfeedface, Events: chainEvents(r1, 1, 3, 10)},
		{Rank: r2, Incarnation: 1, Events: chainEvents(r2, 1, 1, 10)}}))
	for _, h := range []string{v1EventsHex, v1ReplaceHex} { // the version before incarnations
		b, err := hex.DecodeString(h)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, Capacity: [4]int64{math.MaxInt64, 1, 0, 0}}))
	f.Add(encodeCheck(1, 3, 0xfeed))
	f.Add(encodeConfigCheck(1, 3, 0xfeed, 1, []raft.Server{{Suffrage: raft.Voter, ID: "n1", Address: "127.0.0.1:7000"},
		{Suffrage: raft.Nonvoter, ID: "n2", Address: "127.0.0.1:7001"}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := decodeCommand(b)
		if err != nil {
			return
		}
		// What decodes encodes to bytes that decode to the same command:
		// an entry's meaning survives the encoders (a field one side
		// leaves out or reads in another order would not).
		again, err := decodeCommand(encodeCommand(t, &c))
		if err != nil {
			t.Fatalf("%#v encoded decodes with %v", c, err)
		}
		if got, want := commandText(&again), commandText(&c); got != want {
			t.Fatalf("decode, encode, decode gave\n%s\nwant\n%s", got, want)
		}
		// Whatever decodes must apply without harm, to an empty state and
		// to one that holds ranks, workers, bookings and settings (a
		// registration of an absurd capacity panicked only on evicting),
		// and apply alike on two replicas of that state: the same digest.
		fsm := openFuzzFSM(t)
		var w logWriter
		fsm.ApplyBatch([]*raft.Log{w.next(b)})
		var digests [2]uint64
		for i := range digests {
			fsm = openFuzzFSM(t)
			w = logWriter{}
			applyFixture(t, fsm, &w)
			fsm.ApplyBatch([]*raft.Log{w.next(b)})
			digests[i] = fsm.Digest()
		}
		if digests[0] != digests[1] {
			t.Fatalf("the entry applied to two replicas of one state: digests %#x and %#x", digests[0], digests[1])
		}
	})
}

// encodeCommand encodes c with the encoder of its type, as the node writes
// such an entry.
func encodeCommand(t testing.TB, c *command) []byte {
	switch c.typ {
	case cmdEvents:
		return encodeEvents(c.now, c.batches)
	case cmdReplace:
		return encodeReplace(c.now, c.rank, c.cursor, c.incarnation, c.stored)
	case cmdRegister:
		return encodeRegister(c.now, &c.worker)
	case cmdDeregister:
		return encodeDeregister(c.now, c.workerID)
	case cmdRemoveRanks:
		return encodeRemoveRanks(c.now, c.ranks)
	case cmdBook:
		return encodeBook(c.now, slices.Collect(c.books.all()))
	case cmdExpire:
		return encodeExpire(c.now, c.maxAgeNs)
	case cmdSettings:
		return encodeSettings(c.now, &c.settings)
	case cmdMember:
		return encodeMember(c.now, &c.member)
	case cmdMemberGone:
		return encodeMemberGone(c.now, c.member.ID)
	case cmdCheck:
		if len(c.config) > 0 {
			return encodeConfigCheck(c.now, c.checkIndex, c.checkDigest, c.configIndex, c.config)
		}
		return encodeCheck(c.now, c.checkIndex, c.checkDigest)
	}
	t.Fatalf("no encoder of command type %d", c.typ)
	return nil
}

// commandText is c as text to compare: its booking operations decoded (the
// bytes they came in may encode a value at more length than the encoder
// does), floats as fmt writes them, so that a NaN weight equals itself.
func commandText(c *command) string {
	ops := slices.Collect(c.books.all())
	cc := *c
	cc.books = bookOps{}
	return fmt.Sprintf("%#v %#v", cc, ops)
}

func openFuzzFSM(t *testing.T) *FSM {
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, OnFatal: func(err error) { t.Fatal(err) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestRegistrationDroppingARankClearsIt: a worker registered again with
// fewer dp ranks loses the dropped rank's index state, bookings and
// cursor, so that a later registration of the rank starts clean (its
// engine's events from id 1 apply); the kept rank is untouched.
func TestRegistrationDroppingARankClearsIt(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	r0, r1 := kvevent.Rank{Worker: 2, DP: 0}, kvevent.Rank{Worker: 2, DP: 1}
	f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 2, DPRanks: []uint32{0, 1}, BlockSize: 16})),
		w.next(encodeEvents(2, []RankBatch{{Rank: r0, Events: chainEvents(r0, 1, 3, 10)}, {Rank: r1, Events: chainEvents(r1, 1, 4, 20)}})),
		w.next(encodeBook(3, []bookOp{{kind: bookAdd, b: Booking{ID: "q", Rank: r1, SeqHashes: []uint64{7}, ISL: 16}}})),
		w.next(encodeRegister(4, &WorkerInfo{ID: 2, DPRanks: []uint32{0}, BlockSize: 16})),
	})
	if f.Cursor(r1) != 0 || f.Sequences().Load(r1).ActiveRequests != 0 {
		t.Fatalf("dropped rank kept cursor %d, load %+v", f.Cursor(r1), f.Sequences().Load(r1))
	}
	for _, rs := range f.Index().RankStats() {
		if rs.Rank == r1 && rs.Blocks != [kvevent.NumTiers]int64{} {
			t.Fatalf("dropped rank kept blocks %v", rs.Blocks)
		}
	}
	if f.Cursor(r0) != 3 {
		t.Fatalf("kept rank's cursor %d, want 3", f.Cursor(r0))
	}
	// Registered again, the rank takes events from id 1.
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(5, &WorkerInfo{ID: 2, DPRanks: []uint32{0, 1}, BlockSize: 16})),
		w.next(encodeEvents(6, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 2, 30)}})),
	})
	if ack := res[1].([]RankAck)[0]; ack.Applied != 2 || f.Cursor(r1) != 2 {
		t.Fatalf("after registering again: ack %+v cursor %d", ack, f.Cursor(r1))
	}
}

// TestARegisteredWorkersUnlistedRankIsListedUntilRemoved: a registered
// (non-Positional) worker's rank that its registration does not list
// takes events (a re-registration adding it may commit after the agent's
// first events), and is listed as unregistered, for the leader's sweep to
// remove. A registration listing it before the removal applies keeps its
// state (the removal is stale), and the removal takes only the ranks no
// registration lists. From a review: such a rank was in no sweep's list
// and had no capacity, so anyone publishing it grew it without bound
// while the worker stayed registered.
func TestARegisteredWorkersUnlistedRankIsListedUntilRemoved(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	listed, late, stray := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 5}, kvevent.Rank{Worker: 1, DP: 9}
	f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}})),
		w.next(encodeEvents(2, []RankBatch{
			{Rank: listed, Events: chainEvents(listed, 1, 2, 10)},
			{Rank: late, Events: chainEvents(late, 1, 2, 20)},
			{Rank: stray, Events: chainEvents(stray, 1, 50, 30)},
		})),
	})
	if f.Cursor(stray) != 50 || f.Cursor(late) != 2 {
		t.Fatalf("setup: cursors %d and %d of the unlisted ranks, want 50 and 2", f.Cursor(stray), f.Cursor(late))
	}
	if got, want := f.UnregisteredRanks(), []kvevent.Rank{late, stray}; !slices.Equal(got, want) {
		t.Fatalf("unregistered ranks %v, want %v: worker 1 lists only dp 0", got, want)
	}
	// The registration adding dp 5 commits after its first events, and
	// after the leader decided to remove both ranks.
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(3, &WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0, 5}})),
		w.next(encodeRemoveRanks(4, []kvevent.Rank{stray, late, stray})),
	})
	if n, _ := res[1].(int); n != 1 {
		t.Fatalf("the removal answered %v, want 1 rank removed", res[1])
	}
	if f.Cursor(stray) != 0 || f.LastHeard(stray) != 0 {
		t.Fatalf("the unlisted rank kept cursor %d, heard %d", f.Cursor(stray), f.LastHeard(stray))
	}
	if _, err := f.Index().DumpRank(stray); !errors.Is(err, indexer.ErrUnknownRank) {
		t.Fatalf("the unlisted rank: %v, want no state", err)
	}
	if f.Cursor(late) != 2 || f.Cursor(listed) != 2 {
		t.Fatalf("listed ranks' cursors %d and %d, want 2 and 2: a registration listing them keeps them", f.Cursor(listed), f.Cursor(late))
	}
	if got := f.UnregisteredRanks(); len(got) != 0 {
		t.Fatalf("unregistered ranks %v after the removal, want none", got)
	}
	if _, ok := f.Workers()[1]; !ok {
		t.Fatal("the removal of a rank removed its worker")
	}
}

// TestRemoveRanksCountsOnlyRanksItRemoved: the removal of unlisted ranks
// answers how many ranks' state it removed, and the leader adds that to
// kvrouter_unregistered_ranks_removed_total ("ranks whose state the
// leader removed"). A rank whose state went between the leader's listing
// and the entry's apply (its worker's lease ran out and the
// deregistration committed first, or a Positional re-registration dropped
// it) has nothing to remove, and is not counted. From a review: every
// unlisted rank of the entry was counted.
func TestRemoveRanksCountsOnlyRanksItRemoved(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	stray := kvevent.Rank{Worker: 1, DP: 9}
	f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}})),
		w.next(encodeEvents(2, []RankBatch{{Rank: stray, Events: chainEvents(stray, 1, 5, 30)}})),
	})
	if got := f.UnregisteredRanks(); len(got) != 1 {
		t.Fatalf("setup: unregistered ranks %v, want [%v]", got, stray)
	}
	// The leader listed stray and decided its removal; the worker's
	// deregistration (lease expiry) commits first and takes the rank.
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeDeregister(3, 1)),
		w.next(encodeRemoveRanks(4, []kvevent.Rank{stray})),
	})
	if f.HasCursor(stray) {
		t.Fatal("setup: the deregistration left the rank's cursor")
	}
	if n, _ := res[1].(int); n != 0 {
		t.Fatalf("the removal answered %d ranks removed, want 0: the rank held no state when it applied", n)
	}
}

// TestDeregistrationAnswersTheRanksItRemoved: a deregistration answers
// how many of the worker's ranks' state it removed (index state or a
// cursor, as the removal of unlisted ranks counts them), for a worker not
// registered too, inside its ErrUnknownWorker, and the leader's sweep of
// unregistered workers adds that to
// kvrouter_unregistered_ranks_removed_total (eventplane). A second
// removal of the id, after another took the ranks (an operator's DELETE
// /v1/workers/{id}), answers ErrUnknownWorker and 0. From a review: the
// sweep counted the ranks it listed, whatever its entry removed.
func TestDeregistrationAnswersTheRanksItRemoved(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	listed, evented := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 3}
	dumped, gapped := kvevent.Rank{Worker: 5}, kvevent.Rank{Worker: 5, DP: 2}
	f.ApplyBatch([]*raft.Log{
		// dp 0 has index state (its capacity) and no cursor, dp 3 both.
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, DPRanks: []uint32{0}, Capacity: [kvevent.NumTiers]int64{100}})),
		w.next(encodeEvents(2, []RankBatch{{Rank: evented, Events: chainEvents(evented, 1, 2, 10)}})),
		w.next(encodeReplace(3, dumped, 7, 0, chainEvents(dumped, 0, 2, 20))),
		// Heard of only (past a gap): nothing stored, nothing counted.
		w.next(encodeEvents(4, []RankBatch{{Rank: gapped, Events: chainEvents(gapped, 3, 1, 30)}})),
	})
	if got, want := f.UnregisteredRanks(), []kvevent.Rank{evented, dumped, gapped}; !slices.Equal(got, want) {
		t.Fatalf("setup: unregistered ranks %v, want %v", got, want)
	}
	if got := f.Index().WorkerRanks(nil, 1); !slices.Equal(got, []kvevent.Rank{listed, evented}) {
		t.Fatalf("setup: worker 1's ranks in the index %v, want [%v %v]", got, listed, evented)
	}
	res := f.ApplyBatch([]*raft.Log{
		w.next(encodeDeregister(5, 5)),
		w.next(encodeDeregister(6, 5)),
		w.next(encodeDeregister(7, 1)),
	})
	removed := func(res interface{}) (int, error) {
		var uw *unknownWorkerError
		if err, _ := res.(error); errors.As(err, &uw) {
			return uw.removed, err
		}
		n, _ := res.(int)
		return n, nil
	}
	for i, want := range []struct {
		n       int
		unknown bool
	}{{1, true}, {0, true}, {2, false}} {
		n, err := removed(res[i])
		if n != want.n || errors.Is(err, ErrUnknownWorker) != want.unknown {
			t.Fatalf("deregistration %d answered %v (%d ranks removed), want %d ranks, unknown worker %v", i, res[i], n, want.n, want.unknown)
		}
	}
	if err, _ := res[0].(error); err == nil || err.Error() != "deregister 5: unknown worker" {
		t.Fatalf("deregistering an unknown worker: %v, want the error it answered before (the API's 404 detail)", res[0])
	}
	if got := f.UnregisteredRanks(); len(got) != 0 {
		t.Fatalf("unregistered ranks %v after the removals, want none", got)
	}
}

// TestUnregisteredRanksAreListedUntilTheirWorkerIsRemoved: events and
// dumps apply for a worker that is not registered, and its ranks are
// listed as unregistered (the leader's sweep removes them, eventplane);
// a deregistration of the unknown worker takes them all, a rank heard
// of only through a batch that began past a gap included.
func TestUnregisteredRanksAreListedUntilTheirWorkerIsRemoved(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	kept, dumped, gapped, other := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 5}, kvevent.Rank{Worker: 5, DP: 2}, kvevent.Rank{Worker: 6}
	f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16})),
		w.next(encodeEvents(2, []RankBatch{{Rank: kept, Events: chainEvents(kept, 1, 2, 10)}})),
		w.next(encodeReplace(3, dumped, 7, 0, chainEvents(dumped, 0, 2, 20))),
		w.next(encodeEvents(4, []RankBatch{{Rank: gapped, Events: chainEvents(gapped, 3, 1, 30)}, {Rank: other, Events: chainEvents(other, 1, 1, 40)}})),
	})
	if got, want := f.UnregisteredRanks(), []kvevent.Rank{dumped, gapped, other}; !slices.Equal(got, want) {
		t.Fatalf("unregistered ranks %v, want %v", got, want)
	}
	res := f.ApplyBatch([]*raft.Log{w.next(encodeDeregister(5, 5))})
	if err, _ := res[0].(error); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("deregistering an unknown worker: %v, want ErrUnknownWorker", res[0])
	}
	if got, want := f.UnregisteredRanks(), []kvevent.Rank{other}; !slices.Equal(got, want) {
		t.Fatalf("unregistered ranks after removing worker 5: %v, want %v", got, want)
	}
	if f.Cursor(dumped) != 0 || f.LastHeard(dumped) != 0 || f.LastHeard(gapped) != 0 {
		t.Fatalf("worker 5 kept cursor %d, heard %d and %d", f.Cursor(dumped), f.LastHeard(dumped), f.LastHeard(gapped))
	}
	if _, err := f.Index().DumpRank(dumped); !errors.Is(err, indexer.ErrUnknownRank) {
		t.Fatalf("worker 5's dumped rank: %v, want no state", err)
	}
	if f.Cursor(kept) != 2 {
		t.Fatalf("registered worker's cursor %d, want 2", f.Cursor(kept))
	}
}

// TestGroupCommitHoldsOneAppliedIndex: the FSM commits its changes in
// groups (FSMConfig.GroupBytes, here 1 MiB), and whatever the state database holds at any
// moment is the state of one applied index: its residency records are
// exactly the index's entries when that index was applied. Full groups
// commit on their own goroutine while applies go on (commitAsync), one at
// a time and in order. A snapshot commits the open group, and a reopen
// after Close loads the same state.
func TestGroupCommitHoldsOneAppliedIndex(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	cfg := FSMConfig{Dir: dir, Logger: quiet, GroupBytes: 1 << 20, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }}
	f, err := OpenFSM(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { f.Close() }()
	var w logWriter
	entriesAt := map[uint64]int64{0: 0} // applied index → index entries then
	commits := 0
	lastDB := uint64(0)
	const perEntry = 2000
	for k := 0; k < 100; k++ {
		r := kvevent.Rank{Worker: uint64(k%7 + 1)}
		evs := chainEvents(r, uint64(k/7*perEntry+1), perEntry, uint64(k)<<32)
		f.ApplyBatch([]*raft.Log{w.next(encodeEvents(int64(k), []RankBatch{{Rank: r, Events: evs}}))})
		entriesAt[w.index] = f.Index().Stats().Entries
		dbApplied, _, err := f.db.Applied()
		if err != nil {
			t.Fatal(err)
		}
		if dbApplied == lastDB {
			continue
		}
		commits++
		lastDB = dbApplied
		var n int64
		if err := f.db.Scan(store.KindEntry, func(_, _ []byte) error { n++; return nil }); err != nil {
			t.Fatal(err)
		}
		if want, ok := entriesAt[dbApplied]; !ok || n != want {
			t.Fatalf("state database at applied %d holds %d residencies, the index held %d then (known %v)", dbApplied, n, want, ok)
		}
	}
	if commits == 0 || lastDB == w.index {
		t.Fatalf("%d group commits, database at %d of %d: want groups committed between applies", commits, lastDB, w.index)
	}
	if _, err := f.Snapshot(); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := f.db.Applied(); got != w.index {
		t.Fatalf("after Snapshot the database is at %d, want %d", got, w.index)
	}
	// More groups, the last one open at Close.
	for k := 100; k < 130; k++ {
		r := kvevent.Rank{Worker: uint64(k%7 + 1)}
		evs := chainEvents(r, uint64(k/7*perEntry+1), perEntry, uint64(k)<<32)
		f.ApplyBatch([]*raft.Log{w.next(encodeEvents(int64(k), []RankBatch{{Rank: r, Events: evs}}))})
	}
	digest := f.Digest()
	f.Close()
	if f, err = OpenFSM(cfg); err != nil {
		t.Fatal(err)
	}
	if f.Digest() != digest || f.applied.Load() != w.index {
		t.Fatalf("reopened at %d with digest %#x, want %d and %#x", f.applied.Load(), f.Digest(), w.index, digest)
	}
}

// TestDigestSeesRegistrationsAndSettings: replicas that disagree on a
// worker's ranks, capacities beyond the device's or positional ids, or on
// the settings report different digests; the member table, each
// cluster's own, does not count (a state restored into another cluster
// has the saved state's digest). From a review: a registration counted
// only its block size, rank count and device capacity, and the settings
// not at all.
func TestDigestSeesRegistrationsAndSettings(t *testing.T) {
	apply := func(cmds ...[]byte) uint64 {
		f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
		defer f.Close()
		var w logWriter
		var logs []*raft.Log
		for _, c := range cmds {
			logs = append(logs, w.next(c))
		}
		f.ApplyBatch(logs)
		return f.Digest()
	}
	worker := func(change func(*WorkerInfo)) []byte {
		w := WorkerInfo{ID: 1, DPRanks: []uint32{0, 1}, BlockSize: 16, Capacity: [4]int64{8, 1}}
		change(&w)
		return encodeRegister(1, &w)
	}
	base := apply(worker(func(*WorkerInfo) {}))
	for name, d := range map[string]uint64{
		"other ranks":       apply(worker(func(w *WorkerInfo) { w.DPRanks = []uint32{0, 2} })),
		"other G2 capacity": apply(worker(func(w *WorkerInfo) { w.Capacity[1] = 2 })),
		"positional":        apply(worker(func(w *WorkerInfo) { w.Positional = true })),
		"settings":          apply(worker(func(*WorkerInfo) {}), encodeSettings(2, &Settings{Params: indexer.Params{Temperature: 5}})),
	} {
		if d == base {
			t.Errorf("%s: the same digest %#x", name, d)
		}
	}
	if d := apply(worker(func(*WorkerInfo) {}), encodeMember(2, &Member{ID: "x", RaftAddr: "h:1", HTTPAddr: "h:2"})); d != base {
		t.Errorf("a member changed the digest: %#x, want %#x", d, base)
	}
	if again := apply(worker(func(*WorkerInfo) {})); again != base {
		t.Fatalf("the same log gave digests %#x and %#x", base, again)
	}
}

// TestCloseReleasesTheHugePageAdvice: the write groups' buffers and the
// tree's slabs, advised for huge pages while the FSM runs, are released
// when it closes (internal/hugepage: memory dropped while advised may be
// refilled by the kernel once the runtime returns it).
func TestCloseReleasesTheHugePageAdvice(t *testing.T) {
	base := hugepage.Held()
	f := openTestFSM(t, t.TempDir())
	w := &logWriter{}
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16}))})
	const per, calls = 1000, 200 // a tree past 64Ki nodes, groups past a few MiB
	var logs []*raft.Log
	for i := range calls {
		logs = append(logs, w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: chainEvents(r1, uint64(i*per+1), per, uint64(i*per+10))}})))
	}
	for len(logs) > 0 {
		n := min(16, len(logs))
		f.ApplyBatch(logs[:n])
		logs = logs[n:]
	}
	if hugepage.Held() == base {
		t.Fatal("nothing was advised: the test needs a larger state")
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if h := hugepage.Held() - base; h != 0 {
		t.Fatalf("%d bytes still advised after the FSM closed", h)
	}
	if st := f.Index().Stats(); st.Entries != per*calls {
		t.Fatalf("the closed FSM's index holds %d entries, want %d", st.Entries, per*calls)
	}
}

// TestIncarnationSurvivesReopenAndSnapshot: the publisher incarnation a
// dump leaves on its rank is kept beside the cursor in the state database
// and in snapshots, so a restart and a restore (a follower that installs
// the leader's snapshot) keep fencing the rank as the others do; and the
// digest covers it, so replicas that disagree on it are told apart.
func TestIncarnationSurvivesReopenAndSnapshot(t *testing.T) {
	const inc = 0xfeedface_0bad_cafe
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	f.ApplyBatch([]*raft.Log{w.next(encodeReplace(7, r1, 20, inc, chainEvents(r1, 1, 2, 300)))})
	if f.Cursor(r1) != 20 || f.Incarnation(r1) != inc || f.Incarnation(r2) != 0 {
		t.Fatalf("after the dump: cursor %d incarnation %#x (r2's %#x), want 20, %#x, 0", f.Cursor(r1), f.Incarnation(r1), f.Incarnation(r2), uint64(inc))
	}
	d := f.Digest()
	snap := snapshotBytes(t, f)
	info, err := InspectSnapshot(bytes.NewReader(snap))
	if err != nil || info.FormatVersion != snapshotVersion {
		t.Fatalf("snapshot format %d (%v), want %d", info.FormatVersion, err, snapshotVersion)
	}
	f.Close()

	g := openTestFSM(t, dir)
	if g.Cursor(r1) != 20 || g.Incarnation(r1) != inc || g.Digest() != d {
		t.Fatalf("reopened: cursor %d incarnation %#x digest %#x, want 20, %#x, %#x", g.Cursor(r1), g.Incarnation(r1), g.Digest(), uint64(inc), d)
	}
	g.Close()

	h := openTestFSM(t, filepath.Join(t.TempDir(), "restored"))
	defer h.Close()
	if err := h.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	if h.Cursor(r1) != 20 || h.Incarnation(r1) != inc || h.Digest() != d {
		t.Fatalf("restored: cursor %d incarnation %#x digest %#x, want 20, %#x, %#x", h.Cursor(r1), h.Incarnation(r1), h.Digest(), uint64(inc), d)
	}

	// The same state but for the incarnation digests differently.
	other := openTestFSM(t, filepath.Join(t.TempDir(), "other"))
	defer other.Close()
	var ow logWriter
	applyFixture(t, other, &ow)
	other.ApplyBatch([]*raft.Log{ow.next(encodeReplace(7, r1, 20, inc+1, chainEvents(r1, 1, 2, 300)))})
	if other.Digest() == d {
		t.Fatal("two states that differ in a rank's incarnation only have the same digest")
	}
}

// TestVersion2SnapshotRestoresUnfenced: a snapshot of the format before
// incarnations (version 2, every cursor record 8 bytes) restores, every
// rank with incarnation 0, and its cursors as they were.
func TestVersion2SnapshotRestoresUnfenced(t *testing.T) {
	cursor := func(r kvevent.Rank, id uint64) rec {
		k := binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64([]byte{store.KindCursor}, r.Worker), r.DP)
		return rec{k, binary.BigEndian.AppendUint64(nil, id)}
	}
	stream := buildStream(2, []rec{cursor(r1, 17), cursor(r2, 4)}, nil, map[byte]uint64{store.KindCursor: 2})
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	if err := f.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatal(err)
	}
	check := func(what string, f *FSM) {
		t.Helper()
		if f.Cursor(r1) != 17 || f.Cursor(r2) != 4 || f.Incarnation(r1) != 0 || f.Incarnation(r2) != 0 {
			t.Fatalf("%s: cursors %d %d, incarnations %d %d; want 17 4 0 0", what, f.Cursor(r1), f.Cursor(r2), f.Incarnation(r1), f.Incarnation(r2))
		}
	}
	check("restored", f)
	f.Close()
	g := openTestFSM(t, dir)
	defer g.Close()
	check("reopened", g)
}

// TestEventBatchFenceRule: the rule table of the publisher-incarnation
// fence. An event batch of incarnation I for a rank whose last dump was of
// incarnation S applies as any batch when I is 0 (unfenced: the HTTP API,
// agents of earlier builds), when S is 0 (no dump, or an unfenced one)
// and when I == S; when both are non-zero and differ it applies nothing,
// and its ack says so (Fenced and Resync, Applied 0, the rank's cursor).
func TestEventBatchFenceRule(t *testing.T) {
	const a, b = 0xa, 0xb
	for _, tc := range []struct {
		name     string
		dumpInc  uint64 // S: the incarnation of the rank's dump (no dump when noDump)
		noDump   bool
		batchInc uint64 // I
		fenced   bool
	}{
		{"unfenced batch, fenced rank", b, false, 0, false},
		{"fenced batch, unfenced dump", 0, false, a, false},
		{"fenced batch, rank never dumped", 0, true, a, false},
		{"unfenced batch, rank never dumped", 0, true, 0, false},
		{"the dump's incarnation", b, false, b, false},
		{"another incarnation", b, false, a, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
			defer f.Close()
			var w logWriter
			// The rank holds events 1..3, then (unless noDump) a dump at 3
			// of incarnation S replaces them with its own chain.
			f.ApplyBatch([]*raft.Log{w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 3, 10)}}))})
			if !tc.noDump {
				f.ApplyBatch([]*raft.Log{w.next(encodeReplace(2, r1, 3, tc.dumpInc, chainEvents(r1, 1, 3, 40)))})
			}
			before, entries := f.Digest(), f.Index().Stats().Entries
			// Event 3 again (a duplicate), then a new chain of two.
			evs := append(chainEvents(r1, 3, 1, 60), chainEvents(r1, 4, 2, 70)...)
			res := f.ApplyBatch([]*raft.Log{w.next(encodeEvents(3, []RankBatch{{Rank: r1, Incarnation: tc.batchInc, Events: evs}}))})
			ack := res[0].([]RankAck)[0]
			if tc.fenced {
				if ack != (RankAck{Rank: r1, Cursor: 3, Resync: true, Fenced: true}) {
					t.Fatalf("ack %+v, want nothing applied, no duplicate, cursor 3, Resync and Fenced", ack)
				}
				if f.Digest() != before || f.Cursor(r1) != 3 || f.Incarnation(r1) != tc.dumpInc {
					t.Fatalf("a fenced batch changed the state: cursor %d incarnation %#x", f.Cursor(r1), f.Incarnation(r1))
				}
				return
			}
			// Event 3 is a duplicate, 4 and 5 apply (one block each).
			if ack != (RankAck{Rank: r1, Cursor: 5, Applied: 2, Dups: 1}) {
				t.Fatalf("ack %+v, want 2 applied, 1 duplicate, cursor 5", ack)
			}
			if got := f.Index().Stats().Entries; got != entries+2 || f.Cursor(r1) != 5 || f.Incarnation(r1) != tc.dumpInc {
				t.Fatalf("entries %d (from %d), cursor %d, incarnation %#x; want 2 more entries, cursor 5, incarnation %#x unchanged",
					got, entries, f.Cursor(r1), f.Incarnation(r1), tc.dumpInc)
			}
		})
	}
}

// TestDeadIncarnationRequestAfterAcceptedDump: an agent's new incarnation
// (B) dumps a rank and the router takes the dump (the rank had no state;
// or B published past the router's cursor before its dump), then the dead
// incarnation's (A) last request, still in flight at the leader, commits.
// A's events must apply nothing, and B's events with the same ids must
// apply. Before the fence A's request applied on top of B's state, and
// B's events were acknowledged as duplicates and never applied.
func TestDeadIncarnationRequestAfterAcceptedDump(t *testing.T) {
	const a, b = 0xdead, 0xb0b
	for _, tc := range []struct {
		name      string
		aBefore   int    // events of A's that applied before B's dump (A dumped first: S = A)
		dumpAt    uint64 // B's dump's cursor
		lateFirst uint64 // the first id of A's late request
		lateN     int    // and its events
	}{
		{"the rank had no state", 0, 0, 1, 10},
		// A's request starts at its acknowledged cursor + 1 and runs past
		// B's dump: before the fence 51..60 were duplicates, and 61..70
		// applied on top of B's state.
		{"B published past the cursor before its dump", 50, 60, 51, 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
			defer f.Close()
			var w logWriter
			if tc.aBefore > 0 {
				f.ApplyBatch([]*raft.Log{w.next(encodeReplace(1, r1, 0, a, nil)),
					w.next(encodeEvents(2, []RankBatch{{Rank: r1, Incarnation: a, Events: chainEvents(r1, 1, tc.aBefore, 1000)}}))})
			}
			// B's dump: its chain of 5 blocks, as of id dumpAt.
			bState := chainEvents(r1, 1, 5, 5000)
			if res := f.ApplyBatch([]*raft.Log{w.next(encodeReplace(3, r1, tc.dumpAt, b, bState))}); res[0].(RankAck).Cursor != tc.dumpAt {
				t.Fatalf("B's dump: %+v, want it taken", res[0])
			}
			// A's late request: events B will number the same.
			late := f.ApplyBatch([]*raft.Log{w.next(encodeEvents(4, []RankBatch{{Rank: r1, Incarnation: a, Events: chainEvents(r1, tc.lateFirst, tc.lateN, 9000)}}))})
			if ack := late[0].([]RankAck)[0]; ack.Applied != 0 || ack.Dups != 0 || !ack.Fenced || !ack.Resync || ack.Cursor != tc.dumpAt {
				t.Fatalf("A's late request: ack %+v, want nothing applied, Fenced and Resync, cursor %d", ack, tc.dumpAt)
			}
			// A fenced request is not the rank being heard: its sender is
			// another incarnation, dead or about to be (silent ranks).
			if got := f.LastHeard(r1); got != 3 {
				t.Fatalf("after A's fenced request the rank was last heard at %d, want 3 (B's dump)", got)
			}
			// B's next events, with the ids A's request held.
			res := f.ApplyBatch([]*raft.Log{w.next(encodeEvents(5, []RankBatch{{Rank: r1, Incarnation: b, Events: chainEvents(r1, tc.dumpAt+1, 10, 7000)}}))})
			if ack := res[0].([]RankAck)[0]; ack.Applied != 10 || ack.Dups != 0 || ack.Fenced || ack.Cursor != tc.dumpAt+10 {
				t.Fatalf("B's events: ack %+v, want all 10 applied, cursor %d", ack, tc.dumpAt+10)
			}
			// The index holds B's dump and B's events, nothing of A's.
			var m indexer.Matches
			holds := func(evs []kvevent.Event) bool {
				local := make([]uint64, len(evs))
				for i := range evs {
					local[i] = evs[i].Blocks[0].LocalHash
				}
				f.Index().FindMatchesByTier(local, indexer.ViewTiered, false, &m)
				return len(m.Ranks) == 1 && m.Ranks[0].Rank == r1 && int(m.Ranks[0].Blocks[kvevent.TierDevice]) == len(evs)
			}
			if !holds(bState) || !holds(chainEvents(r1, tc.dumpAt+1, 10, 7000)) {
				t.Fatal("the index lacks B's dump or B's events")
			}
			if n := f.Index().Stats().Entries; n != 15 {
				t.Fatalf("the index holds %d entries, want B's 15 (5 dumped, 10 published): A's events applied", n)
			}
		})
	}
}

// TestADumpAcksOnlyTheEventsTheIndexTook: a dump's ack counts the events
// applied (RankAck.Applied), as an event batch's does. The index skips a
// dump's remove, its store without blocks and its block that is its own
// parent (ReplaceRankFenced refuses them, a log of another writer may
// hold them; a store of a tier this build does not know halts the FSM
// instead: TestAnEventKindOrTierOfALaterBuildHaltsTheFSM) and counts them
// malformed, once: events_rejected_total adds the FSM's own count of
// undecodable entries, which they are not.
func TestADumpAcksOnlyTheEventsTheIndexTook(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	stored := []kvevent.Event{
		{Rank: r1, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 11}}},
		{Rank: r1, Kind: kvevent.KindRemoved, Removed: []uint64{1}},
		{Rank: r1, Kind: kvevent.KindStored},
		{Rank: r1, Kind: kvevent.KindStored, HasParent: true, Parent: 2, Blocks: []kvevent.Block{{EngineHash: 2, LocalHash: 12}}},
		{Rank: r1, Kind: kvevent.KindStored, HasParent: true, Parent: 1, Blocks: []kvevent.Block{{EngineHash: 3, LocalHash: 13}}},
	}
	var w logWriter
	ack, ok := f.ApplyBatch([]*raft.Log{w.next(encodeReplace(1, r1, 5, 0, stored))})[0].(RankAck)
	if !ok || ack.Applied != 2 || ack.Cursor != 5 {
		t.Fatalf("dump ack %+v (a RankAck: %v), want 2 events applied, cursor 5", ack, ok)
	}
	st := f.Index().Stats()
	if st.Entries != 2 || st.Counters.Malformed != 3 || f.malformed.Load() != 0 {
		t.Fatalf("the index holds %d entries and counted %d malformed, the FSM %d undecodable; want 2, 3 and 0",
			st.Entries, st.Counters.Malformed, f.malformed.Load())
	}
}

// TestExpirySweepDropsOrphansPastTheTTL: a store whose parent the rank
// does not hold waits in the orphan buffer; the replicated expiry sweep
// (cmdExpire, by the leader's time in the entry) drops it once held past
// OrphanTTL, and the rank asks for a resync, as every replica does at the
// same entry.
func TestExpirySweepDropsOrphansPastTheTTL(t *testing.T) {
	const ttl = time.Second
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, Index: indexer.Config{OrphanTTL: ttl},
		OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const t0 = int64(1000)
	orphan := kvevent.Event{Rank: r1, EventID: 1, Kind: kvevent.KindStored, HasParent: true, Parent: 999,
		Blocks: []kvevent.Block{{EngineHash: 5, LocalHash: 15}}}
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeRegister(t0, &WorkerInfo{ID: 1, BlockSize: 16})),
		w.next(encodeEvents(t0, []RankBatch{{Rank: r1, Events: []kvevent.Event{orphan}}}))})
	if st := f.Index().Stats(); st.OrphanEvents != 1 || f.Index().RankNeedsResync(r1) {
		t.Fatalf("after the store: %d orphans held (resync asked: %v), want 1 held, no resync", st.OrphanEvents, f.Index().RankNeedsResync(r1))
	}
	// Within the TTL the sweep keeps it: its parent may still come.
	f.ApplyBatch([]*raft.Log{w.next(encodeExpire(t0+int64(ttl), 0))})
	if st := f.Index().Stats(); st.OrphanEvents != 1 {
		t.Fatalf("a sweep at the TTL dropped the orphan (%d held)", st.OrphanEvents)
	}
	held := f.Digest()
	f.ApplyBatch([]*raft.Log{w.next(encodeExpire(t0+int64(ttl)+1, 0))})
	if st := f.Index().Stats(); st.OrphanEvents != 0 || st.OrphanBlocks != 0 || !f.Index().RankNeedsResync(r1) {
		t.Fatalf("after a sweep past the TTL: %d orphans of %d blocks held (resync asked: %v), want none, and a resync",
			st.OrphanEvents, st.OrphanBlocks, f.Index().RankNeedsResync(r1))
	}
	if f.Digest() == held {
		t.Fatal("the digest did not change when the sweep dropped the orphan")
	}
}

// TestRemovedMemberStaysGoneAfterReopen: a member's removal is written to
// the state database as the member's addition is, so that a restart does
// not bring the member back. The digest leaves the member table out (each
// node's own join history fills it), so no digest check would see it.
func TestRemovedMemberStaysGoneAfterReopen(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	defer f.Close()
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeMember(1, &Member{ID: "n1", RaftAddr: "127.0.0.1:1", HTTPAddr: "127.0.0.1:2", Voter: true})),
		w.next(encodeMember(1, &Member{ID: "n2", RaftAddr: "127.0.0.1:3", HTTPAddr: "127.0.0.1:4", Voter: true}))})
	f.ApplyBatch([]*raft.Log{w.next(encodeMemberGone(2, "n1"))})
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	g := openTestFSM(t, dir)
	defer g.Close()
	if ms := g.Members(); len(ms) != 1 || ms["n2"].ID != "n2" {
		t.Fatalf("members after reopen %v, want n2 alone", ms)
	}
}

// TestAnEntryOfALaterBuildIsNotPassedOverForGood pins that a node does not
// record as applied an entry that a later build wrote and it cannot read.
// docs/operations.md ("Upgrade") upgrades the leader last, "after `kvctl
// leader transfer`": from the transfer until the old leader is stopped,
// an upgraded leader writes entries of a later format (a later command
// version; a command type this build does not know, as cmdCheck and
// cmdRemoveRanks were to the builds before them, both written in
// version 1) while the old leader, now a follower, still runs the older
// build. ApplyBatch skipped each such entry and moved the applied index
// past it, which the close commits, so the upgraded build that node is
// restarted on never applies it: an acknowledged write (a registration,
// with the 2026-11-30 worker encoding) is missing from that replica for
// good, and from the cluster's answers once it leads. (Checked by hand
// with one node of a 3-node cluster made to refuse registrations as an
// older build: after the documented order and its restart on the new
// build it held no worker, the others one, and the digests differed.)
func TestAnEntryOfALaterBuildIsNotPassedOverForGood(t *testing.T) {
	reg := encodeRegister(5, &WorkerInfo{ID: 7, DPRanks: []uint32{0}, BlockSize: 16})
	laterVersion := bytes.Clone(reg)
	laterVersion[0] = commandVersion + 1
	var laterType enc
	encodeHeader(&laterType, cmdRemoveRanks+1, 5)
	laterType.uv(0)
	for _, tc := range []struct {
		name string
		data []byte
	}{{"a later command version", laterVersion}, {"a later command type", laterType.b}} {
		data := tc.data
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "fsm")
			f := openTestFSM(t, dir)
			var w logWriter
			f.ApplyBatch([]*raft.Log{w.next(reg)})
			f.ApplyBatch([]*raft.Log{w.next(data)})
			applied, _ := f.Applied()
			f.Close()
			g := openTestFSM(t, dir)
			reopened, _ := g.Applied()
			g.Close()
			if applied != 1 || reopened != 1 {
				t.Fatalf("applied index %d, %d after a reopen, past the entry at 2 that this build cannot read; want 1: "+
					"an upgraded build restarted on this state never applies it", applied, reopened)
			}
		})
	}
}

// TestTheFSMHaltsAtAnEntryOfALaterBuild: at an entry of a later build
// (a registration in a version above the highest this build reads) the
// FSM halts: it answers that entry and every one after it, in the batch
// and in the next, with the halt (ErrLaterBuild, naming the entry), moves
// its applied index past none of them (in memory, in the group its Close
// commits), refuses a snapshot, and logs once. The entries before it in
// the batch apply. Reopened, on the build that reads the entry (here:
// the entry as that build reads it, in version 1), it applies that entry
// and the ones after it. A garbled entry is still skipped.
func TestTheFSMHaltsAtAnEntryOfALaterBuild(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	var logs bytes.Buffer
	f, err := OpenFSM(FSMConfig{Dir: dir, Logger: slog.New(slog.NewTextHandler(&logs, nil)), OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	reg := func(id uint64) []byte {
		return encodeRegister(5, &WorkerInfo{ID: id, DPRanks: []uint32{0}, BlockSize: 16})
	}
	later := reg(8)
	later[0] = commandVersion + 1
	var w logWriter
	res := f.ApplyBatch([]*raft.Log{w.next(reg(7)), w.next([]byte{commandVersion}), w.next(later), w.next(reg(9)),
		{Index: 5, Term: 1, Type: raft.LogNoop}})
	if res[0] != nil || !errors.Is(res[1].(error), ErrBadCommand) || errors.Is(res[1].(error), ErrLaterBuild) {
		t.Fatalf("the registration before it and the garbled entry: %v, %v; want nil and ErrBadCommand", res[0], res[1])
	}
	for i, r := range res[2:] {
		var h *ApplyHalt
		if err, ok := r.(error); !ok || !errors.Is(err, ErrLaterBuild) || !errors.As(err, &h) || h.Index != 3 {
			t.Fatalf("entry %d: %v, want the halt at entry 3 (ErrLaterBuild)", i+3, r)
		}
	}
	res = f.ApplyBatch([]*raft.Log{w.next(reg(10))})
	if err, ok := res[0].(error); !ok || !errors.Is(err, ErrLaterBuild) {
		t.Fatalf("an entry of the next batch: %v, want the halt", res[0])
	}
	if h := f.Halted(); h == nil || h.Index != 3 || h.Term != 1 || !strings.Contains(h.Error(), "upgrade this node") {
		t.Fatalf("Halted: %v, want entry 3 of term 1, saying to upgrade", h)
	}
	if applied, _ := f.Applied(); applied != 2 {
		t.Fatalf("applied index %d while halted at 3, want 2", applied)
	}
	if ws := f.Workers(); len(ws) != 1 {
		t.Fatalf("workers %v, want 7 alone", ws)
	}
	if s, err := f.Snapshot(); err == nil || !errors.Is(err, ErrLaterBuild) {
		if s != nil {
			s.Release()
		}
		t.Fatalf("a snapshot while halted: %v, want it refused, naming the halt", err)
	}
	if n := strings.Count(logs.String(), "apply halted"); n != 1 || !strings.Contains(logs.String(), "level=ERROR") {
		t.Fatalf("logged the halt %d times, want once at Error:\n%s", n, logs.String())
	}
	f.Close()

	g := openTestFSM(t, dir)
	defer g.Close()
	if applied, _ := g.Applied(); applied != 2 || g.Halted() != nil {
		t.Fatalf("reopened at %d, halted %v; want 2, not halted", applied, g.Halted())
	}
	w = logWriter{index: 2}
	res = g.ApplyBatch([]*raft.Log{w.next(reg(8)), w.next(reg(9)), w.next(nil), w.next(reg(10))})
	if applied, _ := g.Applied(); applied != 6 || len(g.Workers()) != 4 {
		t.Fatalf("after the upgrade: applied index %d, workers %v (%v); want 6 and 7 to 10", applied, g.Workers(), res)
	}
}

// TestBytesSinceSnapshotCountsTheLogTailAcrossARestart pins the byte bound
// on the log (docs/operations.md "Snapshots and the log": a snapshot once
// "the entries applied since the last snapshot hold 256 MiB", which
// "bounds the log a restart has to read"): the entries after the last
// snapshot that the state already holds at a restart are still in the log,
// and Raft re-delivers them; the FSM skips them as applied, but they count
// towards the bound, as they did before the restart. Otherwise every
// restart starts the count over while the log keeps them, and a node
// restarted more often than it reaches the bound never snapshots by bytes.
func TestBytesSinceSnapshotCountsTheLogTailAcrossARestart(t *testing.T) {
	dir := t.TempDir()
	f := openTestFSM(t, dir)
	var w logWriter
	var logs []*raft.Log
	var bytes int64
	for i := uint64(0); i < 20; i++ {
		l := w.next(encodeEvents(100, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1+10*i, 10, 1+10*i)}}))
		logs = append(logs, l)
		bytes += int64(len(l.Data))
	}
	f.ApplyBatch(logs)
	if got := f.BytesSinceSnapshot(); got != bytes {
		t.Fatalf("before the restart: %d bytes since the snapshot, want %d", got, bytes)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	f = openTestFSM(t, dir)
	defer f.Close()
	// No snapshot was taken: Raft re-delivers the whole log, which the
	// state already holds.
	f.ApplyBatch(logs)
	if idx, _ := f.Applied(); idx != w.index {
		t.Fatalf("applied %d after the replay, want %d", idx, w.index)
	}
	if got := f.BytesSinceSnapshot(); got != bytes {
		t.Fatalf("after a restart and the log's replay: %d bytes since the snapshot, want %d (the log still holds them all)", got, bytes)
	}
}

// failingSink is a Raft snapshot sink whose writes fail (a full disk).
type failingSink struct{ cancelled bool }

func (s *failingSink) Write(p []byte) (int, error) { return 0, errors.New("no space left on device") }
func (s *failingSink) Close() error                { return nil }
func (s *failingSink) ID() string                  { return "failing" }
func (s *failingSink) Cancel() error               { s.cancelled = true; return nil }

// TestAFailedSnapshotKeepsTheBytesSinceTheLastOne pins the byte bound on
// the log (docs/operations.md "Snapshots and the log": a snapshot once
// "the entries applied since the last snapshot hold 256 MiB"): a Raft
// snapshot whose Persist fails is no snapshot (Raft compacts nothing),
// so the entries since the last one still count, and the next apply
// past the bound asks for a snapshot again. Resetting the count when
// the FSM's Snapshot is taken, before its Persist, left the log to grow
// another SnapshotBytes after every failure.
func TestAFailedSnapshotKeepsTheBytesSinceTheLastOne(t *testing.T) {
	f := openTestFSM(t, t.TempDir())
	defer f.Close()
	var w logWriter
	applyFixture(t, f, &w)
	before := f.BytesSinceSnapshot()
	if before == 0 {
		t.Fatal("the fixture counted no bytes")
	}
	s, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	sink := &failingSink{}
	if err := s.Persist(sink); err == nil {
		t.Fatal("a persist into a failing sink succeeded")
	}
	s.Release()
	if !sink.cancelled {
		t.Fatal("the failed persist did not cancel its sink")
	}
	if got := f.BytesSinceSnapshot(); got != before {
		t.Fatalf("after a failed snapshot: %d bytes since the last snapshot, want %d (no snapshot was taken)", got, before)
	}
}

// TestARestoreStartsTheBytesSinceTheSnapshotOver pins the byte bound on
// the log (docs/operations.md "Snapshots and the log": a snapshot once
// "the entries applied since the last snapshot hold 256 MiB"): after a
// restore (a user's, a leader's snapshot installed, a start's) the state
// is the snapshot's, and Raft's log starts after it, so the count starts
// over at 0. Otherwise the entries applied before the restore, which the
// restored state no longer holds, counted towards the next snapshot, and
// the node snapshotted by bytes early.
func TestARestoreStartsTheBytesSinceTheSnapshotOver(t *testing.T) {
	f, snap := fixtureSnapshot(t)
	if f.BytesSinceSnapshot() == 0 {
		t.Fatal("the fixture counted no bytes")
	}
	if err := f.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	if got := f.BytesSinceSnapshot(); got != 0 {
		t.Fatalf("after a restore: %d bytes since the snapshot, want 0 (the state is the snapshot)", got)
	}
	var w logWriter
	w.index, _ = f.Applied()
	l := w.next(encodeEvents(100, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1000, 10, 1000)}}))
	f.ApplyBatch([]*raft.Log{l})
	if got, want := f.BytesSinceSnapshot(), int64(len(l.Data)); got != want {
		t.Fatalf("an entry applied after the restore: %d bytes since the snapshot, want %d", got, want)
	}
}

// TestADamagedAppliedRecordIsRefusedNamingTheStateDirectory: a start on a
// state database whose applied record does not decode is refused (the
// state cannot be placed in the log), with an error that names the state
// directory, as a damaged record of any other kind is ("rebuild ... from
// DIR"), so that an operator knows which directory to remove (the node
// then takes its state from its Raft snapshots and log).
func TestADamagedAppliedRecordIsRefusedNamingTheStateDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	db, err := store.OpenState(dir, store.StateOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	b := db.NewBatch()
	b.Put(store.KindApplied, []byte{'a'}, []byte{1, 2, 3}) // 3 bytes, not 16
	if err := b.Commit(); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { t.Errorf("fatal: %v", err) }})
	if err == nil {
		g.Close()
		t.Fatal("opened a state whose applied record is damaged")
	}
	if !errors.Is(err, store.ErrCorrupt) || !strings.Contains(err.Error(), dir) {
		t.Fatalf("open of a state with a damaged applied record: %q; want ErrCorrupt naming %s", err, dir)
	}
}

// TestAStartRemovesAHalfDoneRestore pins docs/operations.md (Layout:
// "Half-done restores (fsm.restore/, fsm.old/) are finished or rolled back
// at start"): a restore killed while it loaded the new state into
// fsm.restore/, before the swap or after its first rename, leaves that
// directory, as large as the state; the next start removes it and keeps
// the state before the restore.
func TestAStartRemovesAHalfDoneRestore(t *testing.T) {
	for _, swapped := range []bool{false, true} {
		dir := filepath.Join(t.TempDir(), "fsm")
		f := openTestFSM(t, dir)
		var w logWriter
		applyFixture(t, f, &w)
		d := f.Digest()
		if err := f.Close(); err != nil {
			t.Fatal(err)
		}
		if swapped { // killed after the swap's first rename: fsm → fsm.old
			if err := os.Rename(dir, dir+".old"); err != nil {
				t.Fatal(err)
			}
		}
		half := dir + ".restore"
		if err := os.MkdirAll(half, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(half, "000001.sst"), []byte("half"), 0o644); err != nil {
			t.Fatal(err)
		}
		g := openTestFSM(t, dir)
		if _, err := os.Stat(half); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("swap begun %v: %s after the start: %v, want it removed", swapped, filepath.Base(half), err)
		}
		if _, err := os.Stat(dir + ".old"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("swap begun %v: fsm.old after the start: %v, want it gone", swapped, err)
		}
		if got := g.Digest(); got != d {
			t.Errorf("swap begun %v: digest %x after the start, want %x (the state before the restore)", swapped, got, d)
		}
		if err := g.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSettingsNoBuildWritesAreSkippedAsGarbled: a committed settings
// entry of a NaN, infinite or negative weight (a hand-crafted or buggy
// writer's: every SetSettings refuses them) is skipped as a garbled entry
// is: answered ErrBadCommand (not a later build's halt), counted
// malformed and logged, the applied index past it and the settings before
// it kept, so that routes go on instead of each failing as Select refuses
// the settings. Weights over indexer.MaxWeight, which older builds wrote,
// still apply.
func TestSettingsNoBuildWritesAreSkippedAsGarbled(t *testing.T) {
	var logs bytes.Buffer
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: slog.New(slog.NewTextHandler(&logs, nil)), OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var w logWriter
	good := Settings{Params: indexer.DefaultParams(), View: indexer.ViewDedup}
	good.Params.Temperature = 0.5
	if res := f.ApplyBatch([]*raft.Log{w.next(encodeSettings(5, &good))}); res[0] != nil {
		t.Fatalf("valid settings: %v", res[0])
	}
	for i, set := range []func(*indexer.Params){
		func(p *indexer.Params) { p.Temperature = math.NaN() },
		func(p *indexer.Params) { p.PrefillLoadScale = math.Inf(1) },
		func(p *indexer.Params) { p.OverlapScoreCredit = -1 },
		func(p *indexer.Params) { p.BusyPrefillTokens = -5 },
	} {
		bad := good
		set(&bad.Params)
		l := w.next(encodeSettings(6, &bad))
		res := f.ApplyBatch([]*raft.Log{l})
		if err, ok := res[0].(error); !ok || !errors.Is(err, ErrBadCommand) || errors.Is(err, ErrLaterBuild) {
			t.Fatalf("settings %+v: response %v, want ErrBadCommand (skipped, not a halt)", bad.Params, res[0])
		}
		if got := f.Settings(); got != good {
			t.Fatalf("settings %+v applied: the FSM holds %+v, want %+v kept", bad.Params, got, good)
		}
		if applied, _ := f.Applied(); applied != l.Index || f.Halted() != nil {
			t.Fatalf("after the skipped entry %d: applied %d, halted %v", l.Index, applied, f.Halted())
		}
		if got := f.malformed.Load(); got != uint64(i+1) {
			t.Fatalf("malformed count %d after %d skipped settings entries", got, i+1)
		}
	}
	if !strings.Contains(logs.String(), "settings no build writes") {
		t.Fatalf("the skip is not logged with its reason: %s", logs.String())
	}
	old := good
	old.Params.PrefillLoadScale = 1e15 // over MaxWeight: an older build wrote it
	if res := f.ApplyBatch([]*raft.Log{w.next(encodeSettings(7, &old))}); res[0] != nil || f.Settings() != old {
		t.Fatalf("settings an older build wrote (prefill_load_scale 1e15): %v, holds %+v", res[0], f.Settings())
	}
}

// TestARestoreResetsTheSettings: a restore replaces the settings with
// the stream's (docs/api.md: a restore replaces "the registrations and
// the settings"), the defaults when the stream holds none (a state whose
// settings were never put writes no settings record) or holds the
// defaults: a cluster's own settings are not kept because the stream's
// are the defaults. They stay so after a restart.
func TestARestoreResetsTheSettings(t *testing.T) {
	defaults := Settings{Params: indexer.DefaultParams()}
	none := openTestFSM(t, filepath.Join(t.TempDir(), "none"))
	defer none.Close()
	var nw logWriter
	none.ApplyBatch([]*raft.Log{nw.next(encodeRegister(5, &WorkerInfo{ID: 3, BlockSize: 16}))})
	put := openTestFSM(t, filepath.Join(t.TempDir(), "put"))
	defer put.Close()
	var pw logWriter
	put.ApplyBatch([]*raft.Log{pw.next(encodeSettings(5, &defaults))})
	for name, snap := range map[string][]byte{
		"a stream without settings":    snapshotBytes(t, none),
		"a stream of default settings": snapshotBytes(t, put),
	} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "fsm")
			f := openTestFSM(t, dir)
			var w logWriter
			if res := f.ApplyBatch([]*raft.Log{w.next(encodeSettings(5, &settingsFixture))}); res[0] != nil || f.Settings() != settingsFixture {
				t.Fatalf("the cluster's own settings: %v, holds %+v", res[0], f.Settings())
			}
			if err := f.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
				t.Fatal(err)
			}
			if got := f.Settings(); got != defaults {
				t.Fatalf("after the restore the FSM holds the settings %+v, want the defaults %+v", got, defaults)
			}
			f.Close()
			f = openTestFSM(t, dir)
			defer f.Close()
			if got := f.Settings(); got != defaults {
				t.Fatalf("restarted after the restore, the FSM holds the settings %+v, want the defaults", got)
			}
		})
	}
}
