package raftfsm

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/store"
)

// startedState is what startOtherHistory leaves: a stopped one-node
// cluster whose own state is at (applied, term) with digest own, and the
// digest of another history's state (other, in otherDir) that a test
// writes as a Raft snapshot into the node's directory.
type startedState struct {
	c             *testCluster
	applied, term uint64
	last          uint64 // the log's last index at the stop
	own, other    uint64
	otherDir      string
	marker        string // a file in fsm/: a restore removes it
}

// startOtherHistory runs a one-node cluster through a few commands and
// stops it, and builds another history's state beside it.
func startOtherHistory(t *testing.T) *startedState {
	t.Helper()
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return c.leader().CheckLeader() == nil })
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	for k := 0; k < 3; k++ {
		ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, uint64(k*5+1), 5, uint64(1000*k))}})
	}
	n := c.nodes[0]
	if err := n.raft.Barrier(10 * time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	s := &startedState{c: c, own: n.fsm.Digest(), last: n.raft.LastIndex()}
	s.applied, s.term = n.fsm.Applied()
	s.otherDir = filepath.Join(t.TempDir(), "other")
	g := openTestFSM(t, s.otherDir)
	var w logWriter
	applyFixture(t, g, &w)
	s.other = g.Digest()
	g.Close()
	if s.other == s.own {
		t.Fatal("the test needs two different states")
	}
	c.stop(0)
	s.marker = filepath.Join(c.dirs[0], "fsm", "marker")
	if err := os.WriteFile(s.marker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return s
}

// editLog opens node 0's Raft log while the node is stopped.
func (s *startedState) editLog(t *testing.T, edit func(*store.LogStore)) {
	t.Helper()
	ls, err := store.OpenLogStore(filepath.Join(s.c.dirs[0], "raft"), store.LogStoreOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	edit(ls)
	if err := ls.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestStartRestoresTheNewestSnapshotOverAStateOfAnotherHistory: the start
// keeps the FSM's state only when it is of the newest snapshot's history.
// A crash between Raft's save of a leader's snapshot (InstallSnapshot)
// and the FSM's swap leaves the older state beside it; when that state
// is a cut-off leader's user restore (applied at R without a commit) and
// the new leader's snapshot is at S <= R of a higher term, comparing
// indexes alone kept the restore: Raft then applied S+1.. and the FSM
// skipped each up to R, a silent divergence reported ready.
//
// From a review: the start kept a state at (6, term 2) over the newest
// snapshot at (6, term 3).
func TestStartRestoresTheNewestSnapshotOverAStateOfAnotherHistory(t *testing.T) {
	for _, tc := range []struct {
		name string
		// snapshot places the newest snapshot against the state's (a, ta)
		// and the log's last index; edit changes the log, if at all.
		snapshot func(s *startedState) (index, term uint64)
		edit     func(t *testing.T, s *startedState, ls *store.LogStore)
		kept     bool
	}{
		{name: "at the state's index, of a higher term",
			snapshot: func(s *startedState) (uint64, uint64) { return s.applied, s.term + 1 }},
		{name: "below the state's index, of a higher term",
			snapshot: func(s *startedState) (uint64, uint64) { return s.applied - 2, s.term + 1 },
			// The log's entries of the state's history go (the install
			// compacted them), but the state's own one stays.
			edit: func(t *testing.T, s *startedState, ls *store.LogStore) {
				if err := ls.SetUint64([]byte("CurrentTerm"), s.term+1); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "below the state's index, of its term, with the state's entry not in the log",
			snapshot: func(s *startedState) (uint64, uint64) { return s.applied - 2, s.term },
			edit: func(t *testing.T, s *startedState, ls *store.LogStore) {
				if err := ls.DeleteRange(s.applied, s.last); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "below the state's index, of its term, with another term at the state's index in the log",
			snapshot: func(s *startedState) (uint64, uint64) { return s.applied - 2, s.term },
			edit: func(t *testing.T, s *startedState, ls *store.LogStore) {
				if err := ls.DeleteRange(s.applied, s.last); err != nil {
					t.Fatal(err)
				}
				if err := ls.StoreLog(&raft.Log{Index: s.applied, Term: s.term + 1, Type: raft.LogNoop}); err != nil {
					t.Fatal(err)
				}
				if err := ls.SetUint64([]byte("CurrentTerm"), s.term+1); err != nil {
					t.Fatal(err)
				}
			}},
		{name: "below the state's index, of its term, with the state's entry in the log", kept: true,
			snapshot: func(s *startedState) (uint64, uint64) { return s.applied - 2, s.term }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startOtherHistory(t)
			index, term := tc.snapshot(s)
			if err := seedRaftSnapshotAt(s.c.dirs[0], s.otherDir, s.c.peers(), index, term); err != nil {
				t.Fatal(err)
			}
			if tc.edit != nil {
				s.editLog(t, func(ls *store.LogStore) { tc.edit(t, s, ls) })
			}
			// Raft's applies after the start wait, so that the state read
			// is the one the start left.
			gate := make(chan struct{})
			defer close(gate)
			s.c.tune = func(cfg *Config) {
				cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
				cfg.applyGate = gate
			}
			s.c.start(0)
			n := s.c.nodes[0]
			i, it := n.fsm.Applied()
			want, wantName := s.other, "the snapshot's"
			if tc.kept {
				want, wantName = s.own, "its own"
			}
			if got := n.fsm.Digest(); got != want {
				t.Fatalf("state applied (%d, term %d) before the start, newest snapshot (%d, term %d): the start left the state at (%d, term %d) (own digest %v), want %s",
					s.applied, s.term, index, term, i, it, got == s.own, wantName)
			}
			if _, err := os.Stat(s.marker); (err == nil) != tc.kept {
				t.Fatalf("fsm/marker after the start: %v; want it kept %v", err, tc.kept)
			}
		})
	}
}

// TestStartDropsTheLogAfterAGapAboveTheNewestSnapshot: Raft reads its log
// from the newest snapshot's next index at start and panics at a missing
// entry. A crash between Raft's save of an installed snapshot at S and
// the FSM's swap can leave the log holding only a deposed leader's
// entries far above S (its own snapshot had compacted those below): every
// start panicked. The start now drops those entries, which no commit can
// hold, and the node comes up on the snapshot.
//
// From a review: the log held entries 111..112 of term 2 and the newest
// snapshot was at 13, term 3; NewRaft panicked ("log not found").
func TestStartDropsTheLogAfterAGapAboveTheNewestSnapshot(t *testing.T) {
	s := startOtherHistory(t)
	const snapAt = 3
	if s.last < snapAt+3 {
		t.Fatalf("the log ends at %d: the test needs entries above %d", s.last, snapAt+2)
	}
	if err := seedRaftSnapshotAt(s.c.dirs[0], s.otherDir, s.c.peers(), snapAt, s.term+1); err != nil {
		t.Fatal(err)
	}
	var first uint64
	s.editLog(t, func(ls *store.LogStore) {
		if err := ls.SetUint64([]byte("CurrentTerm"), s.term+1); err != nil {
			t.Fatal(err)
		}
		var err error
		if first, err = ls.FirstIndex(); err != nil {
			t.Fatal(err)
		}
		if err := ls.DeleteRange(first, snapAt+1); err != nil {
			t.Fatal(err)
		}
	})
	s.c.start(0)
	n := s.c.nodes[0]
	if err := n.WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if got := n.fsm.Digest(); got != s.other {
		t.Fatalf("after the start: own digest %v, want the snapshot's", got == s.own)
	}
	// What the node's own term wrote after the snapshot follows it.
	var l raft.Log
	if err := n.logs.GetLog(snapAt+2, &l); err == nil && l.Term <= s.term {
		t.Fatalf("the log still holds entry %d of term %d, from before the gap", snapAt+2, l.Term)
	}
}

// TestStartRemovesAKilledPersistsPartialSnapshot: a process killed while
// Raft persists a snapshot leaves snapshots/NAME.tmp/, as large as the
// state. Raft lists it as no snapshot and never removes it; the start
// does (SeedDataDir removes them the same way).
//
// From a review: snapshots/3-17-1700000000000.tmp was still there after
// the start.
func TestStartRemovesAKilledPersistsPartialSnapshot(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	waitFor(t, 10*time.Second, "a leader", func() bool { return c.leader() != nil })
	c.crash(0)
	tmp := filepath.Join(c.dirs[0], "snapshots", "3-17-1700000000000.tmp")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "state.bin"), make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	c.start(0)
	if err := c.nodes[0].WaitReady(ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); err == nil {
		t.Fatalf("%s is still there after the start", tmp)
	}
}

// TestStartRefusesAStateWithoutItsRaftLog: fsm/ holds no cluster
// identity, and the start checks the state against Raft's only through
// the newest snapshot (catchUpFromSnapshot). A data directory whose raft/
// and snapshots/ are gone (lost, or wiped to start the node afresh) but
// whose fsm/ stayed started a new log over the old state: the old
// workers were served, and the FSM skipped every entry of the new log up
// to the old applied index, so the new cluster's first writes were
// acknowledged and never applied. So did one whose snapshots/ were gone
// and whose raft/ held only the log's first entries (an older or damaged
// copy): the node went on from the log's end. The start now refuses a
// state past the log's last entry when there is no snapshot, naming
// fsm/; without fsm/ the node starts afresh.
//
// From reviews: worker 100, registered on the new log, was never
// applied; the node served workers 1..8. (The second case came back with
// a first version of the check that refused only an empty log.)
func TestStartRefusesAStateWithoutItsRaftLog(t *testing.T) {
	for name, damage := range map[string]func(t *testing.T, dir string){
		"raft/ and snapshots/ wiped": func(t *testing.T, dir string) {
			for _, sub := range []string{"raft", "snapshots"} {
				if err := os.RemoveAll(filepath.Join(dir, sub)); err != nil {
					t.Fatal(err)
				}
			}
		},
		"snapshots/ wiped, the log cut to its first entry": func(t *testing.T, dir string) {
			if err := os.RemoveAll(filepath.Join(dir, "snapshots")); err != nil {
				t.Fatal(err)
			}
			ls, err := store.OpenLogStore(filepath.Join(dir, "raft"), store.LogStoreOptions{Logger: quiet})
			if err != nil {
				t.Fatal(err)
			}
			last, err := ls.LastIndex()
			if err != nil {
				t.Fatal(err)
			}
			if err := ls.DeleteRange(2, last); err != nil { // the bootstrap configuration alone
				t.Fatal(err)
			}
			if err := ls.Close(); err != nil {
				t.Fatal(err)
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			c := newTestCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
			waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return c.leader().CheckLeader() == nil })
			for id := uint64(1); id <= 8; id++ {
				if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 16}); err != nil {
					t.Fatal(err)
				}
			}
			c.stop(0)
			damage(t, c.dirs[0])
			fsmDir := filepath.Join(c.dirs[0], "fsm")
			n, err := c.newNode(0, c.transport(c.addrs[0]))
			if err == nil {
				ws := n.fsm.Workers()
				n.Close()
				t.Fatalf("a node whose state is past its Raft log, with no snapshot, started on its old state (%d workers)", len(ws))
			}
			wantRefused(t, "a start on a state without its Raft log", err, ErrStartRefused, fsmDir)

			if err := os.RemoveAll(fsmDir); err != nil {
				t.Fatal(err)
			}
			if name == "raft/ and snapshots/ wiped" {
				c.start(0)
				waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return c.leader().CheckLeader() == nil })
				if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 100, BlockSize: 16}); err != nil {
					t.Fatal(err)
				}
				if ws := c.nodes[0].fsm.Workers(); len(ws) != 1 {
					t.Fatalf("the node started afresh serves %d workers, want worker 100 alone", len(ws))
				}
			}
		})
	}
}

// TestOpenRefusesAStateWithARecordOfAnUnknownKind: the state database
// keeps no format version, and the start (FSM.load) read only the kinds
// it knows: a record of another kind (a later build's, after a
// downgrade, or damage) was skipped without a word, and the node served
// without what it held and left it out of its snapshots. The open now
// refuses the directory, naming the kind, as a snapshot stream's reader
// refuses an unknown kind (store.ValidKind).
//
// From a review: a state with a record of kind 0x0c opened.
func TestOpenRefusesAStateWithARecordOfAnUnknownKind(t *testing.T) {
	for _, kind := range []byte{0x00, 0x0c, 0xff} {
		t.Run(fmt.Sprintf("kind %#02x", kind), func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "fsm")
			f := openTestFSM(t, dir)
			f.ApplyBatch([]*raft.Log{{Index: 1, Term: 1, Type: raft.LogCommand, Data: encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16})}})
			f.batch.Put(kind, []byte("new"), []byte("v")) // a kind this build does not know
			f.Close()
			g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
			if err == nil {
				g.Close()
				t.Fatalf("a state database with a record of kind %#02x opened", kind)
			}
			if want := fmt.Sprintf("kind %#02x", kind); !errors.Is(err, store.ErrUnsupportedVersion) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), dir) {
				t.Fatalf("open: %v; want store.ErrUnsupportedVersion naming %s and %q", err, dir, want)
			}
		})
	}
}

// TestStartAfterAKillDuringAnInstallOverAUserRestore: a deposed leader's
// user restore at (R, T2) is in no log (Raft removes the whole log and
// numbers the restore R = last+1). Healed, it installs the new leader's
// snapshot at (S < R, T1 < T2): the snapshot store's sink Close reaps
// (R, T2), listed above it, before Raft opens the new one for the FSM.
// Killed while the FSM loads the stream (before its swap), the node holds
// fsm/ at R, an empty log and the snapshot at S alone. The start restores
// the snapshot at S (stateOfSnapshotsHistory: the log holds no entry at
// R); refuseStateWithoutItsLog refused it, for good, as if raft/ and
// snapshots/ had been wiped. It now refuses only a state beside neither a
// log entry nor a snapshot.
func TestStartAfterAKillDuringAnInstallOverAUserRestore(t *testing.T) {
	s := startOtherHistory(t)
	snapTerm := max(s.term-1, 1)
	if err := seedRaftSnapshotAt(s.c.dirs[0], s.otherDir, s.c.peers(), s.applied-2, snapTerm); err != nil {
		t.Fatal(err)
	}
	s.editLog(t, func(ls *store.LogStore) {
		first, err := ls.FirstIndex()
		if err != nil {
			t.Fatal(err)
		}
		last, err := ls.LastIndex()
		if err != nil {
			t.Fatal(err)
		}
		if err := ls.DeleteRange(first, last); err != nil {
			t.Fatal(err)
		}
	})
	gate := make(chan struct{})
	defer close(gate)
	s.c.tune = func(cfg *Config) {
		cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
		cfg.applyGate = gate
	}
	n, err := s.c.newNode(0, s.c.transport(s.c.addrs[0]))
	if err != nil {
		t.Fatalf("state at (%d, term %d), the log empty (a user restore's), the newest snapshot the leader's at (%d, term %d): start refused: %v (ErrStartRefused: %v)",
			s.applied, s.term, s.applied-2, snapTerm, err, errors.Is(err, ErrStartRefused))
	}
	s.c.nodes[0] = n
	if got := n.fsm.Digest(); got != s.other {
		t.Fatalf("the start kept the user restore's state over the snapshot (own digest %v)", got == s.own)
	}
	if _, err := os.Stat(s.marker); err == nil {
		t.Fatal("fsm/ was not restored")
	}
}

// TestASnapshotRightAfterAStartIsTaken: Raft starts from its newest
// snapshot and labels its next snapshot with that snapshot's index until
// it hands over an entry; FSM.Snapshot refuses while the state is past
// the last index Raft handed over (ErrReplaying). The start counts the
// snapshot as handed over, whether it restored it (fsm/ wiped) or kept a
// state at or before it: were it not, every snapshot was refused until
// the next entry came.
func TestASnapshotRightAfterAStartIsTaken(t *testing.T) {
	for _, wipe := range []bool{false, true} {
		t.Run(fmt.Sprintf("fsm wiped %v", wipe), func(t *testing.T) {
			c := newTestCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
			waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return c.leader().CheckLeader() == nil })
			for id := uint64(1); id <= 3; id++ {
				if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 16}); err != nil {
					t.Fatal(err)
				}
			}
			if err := c.nodes[0].compactLog(); err != nil {
				t.Fatal(err)
			}
			c.stop(0)
			if wipe {
				if err := os.RemoveAll(filepath.Join(c.dirs[0], "fsm")); err != nil {
					t.Fatal(err)
				}
			}
			// Raft's applies after the start wait: the snapshot is
			// taken before Raft hands over any entry.
			gate := make(chan struct{})
			defer close(gate)
			c.tune = func(cfg *Config) {
				cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
				cfg.applyGate = gate
			}
			c.start(0)
			n := c.nodes[0]
			applied, _ := n.fsm.Applied()
			if applied == 0 {
				t.Fatal("the start left no state")
			}
			s, err := n.fsm.Snapshot()
			if err != nil {
				t.Fatalf("a snapshot right after the start (state at %d): %v", applied, err)
			}
			s.Release()
		})
	}
}

// TestStartOnAStateWithoutItsAppliedIndexIsRefusedOrRepaired: every group
// the FSM commits carries the applied index (DESIGN.md "Durability"), and
// the start compares it with the Raft snapshots and log to place the
// state (replication.md: "entries at or below the applied index
// skipped"; refuseStateWithoutItsLog, catchUpFromSnapshot). A state
// database that holds records but no applied index (damage, or a record
// removed by hand) cannot be placed: with no Raft snapshot to restore,
// Raft re-delivers the whole log and the FSM applies every entry a second
// time over the state that already holds it, which is not idempotent (a
// booking added, then expired by a sweep, comes back as a tombstone the
// replicas lack). The start must refuse such a state, naming fsm/, or
// end with the state the log leads to; it may not start on a silently
// different one.
func TestStartOnAStateWithoutItsAppliedIndexIsRefusedOrRepaired(t *testing.T) {
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour })
	waitFor(t, 10*time.Second, "the leadership set-up", func() bool { return c.leader().CheckLeader() == nil })
	for _, d := range [][]byte{
		encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16, Capacity: [4]int64{100}}),
		encodeBook(100, []bookOp{{kind: bookAdd, b: Booking{ID: "q1", Rank: r1, SeqHashes: []uint64{1, 2}, ISL: 64}}}),
		encodeExpire(200, 50),
	} {
		if _, err := c.leader().apply(ctx(t), d); err != nil {
			t.Fatal(err)
		}
	}
	applied, _ := c.nodes[0].fsm.Applied()
	want := c.nodes[0].fsm.Digest()
	c.stop(0)
	fsmDir := filepath.Join(c.dirs[0], "fsm")
	if list, _ := os.ReadDir(filepath.Join(c.dirs[0], "snapshots")); len(list) != 0 {
		t.Fatalf("the test needs a node with no Raft snapshot; it has %d", len(list))
	}
	db, err := store.OpenState(fsmDir, store.StateOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	g := db.NewBatch()
	g.Delete(store.KindApplied, []byte{'a'}) // the damage: the records stay, their index goes
	if err := g.Commit(); err != nil {
		t.Fatal(err)
	}
	g.Close()
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	n, err := c.newNode(0, c.transport(c.addrs[0]))
	if err != nil {
		wantRefused(t, "a start on a state without its applied index", err, ErrStartRefused, fsmDir)
		return
	}
	defer n.Close()
	waitFor(t, 10*time.Second, "the log's replay", func() bool { idx, _ := n.fsm.Applied(); return idx >= applied })
	if got := n.fsm.Digest(); got != want {
		t.Fatalf("started on a state with records and no applied index, and replayed the log over it: digest %x, want %x (the state the log leads to)\n%s", got, want, fullState(n.fsm))
	}
}

// TestStartWarnsOfTheStateItRestoresTheSnapshotOver: fsm/ applied past
// the newest Raft snapshot, and raft/ lost (the log holds no entry at the
// applied index). The start restores the snapshot over the state, as
// for a deposed leader's user restore, and cannot refuse (a member is
// caught up by its leader); but the state may be the newer committed one
// (the offline save refuses it: ErrUnplacedState), so the start warns,
// naming both indexes and terms and what it drops. It said nothing.
func TestStartWarnsOfTheStateItRestoresTheSnapshotOver(t *testing.T) {
	c, p := pastSnapshotWithoutLog(t)
	snapIndex, snapTerm, applied, appliedTerm := p.snapIndex, p.snapTerm, p.applied, p.appliedTerm
	var logs testlog.Buffer
	c.tune = func(cfg *Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	c.start(0)
	if got, _ := c.nodes[0].fsm.Applied(); got != snapIndex {
		t.Fatalf("the start kept the state applied at %d; want the snapshot's at %d restored over it", got, snapIndex)
	}
	lines := logs.Lines("restoring the newest Raft snapshot over a state applied past it")
	if len(lines) != 1 {
		t.Fatalf("warnings of the state the start restored the snapshot over: %d, want 1: %q", len(lines), logs.String())
	}
	for _, want := range []string{
		fmt.Sprintf("applied=%d applied_term=%d", applied, appliedTerm),
		fmt.Sprintf("snapshot=%d snapshot_term=%d", snapIndex, snapTerm),
		fmt.Sprintf("dropped_from=%d dropped_to=%d", snapIndex+1, applied),
	} {
		if !strings.Contains(lines[0], want) {
			t.Errorf("the warning %q does not say %q", lines[0], want)
		}
	}
}
