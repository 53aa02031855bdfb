package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
)

// oneEventBatch is a batch of one event of its own rank (worker 1, DP k):
// each batch's write is visible on its own as that rank's cursor.
func oneEventBatch(k uint32) []RankBatch {
	r := kvevent.Rank{Worker: 1, DP: k}
	return []RankBatch{{Rank: r, Events: chainEvents(r, 1, 1, 1_000_000+uint64(k)*10)}}
}

// digestAt is one (applied index, digest) pair read on the leader.
type digestAt struct{ index, digest uint64 }

// TestASaveUnderIngestIsOnePointInTime: a `kvctl snapshot save` while
// event batches are ingested streams the state at one applied index: the
// stream's index and records come from one view, so a bare FSM restored
// from it has the digest the leader had at that index (one of the two
// digests recorded around it, as the batch applied between two reads may
// fall on either side of the index). It pins FSM.view holding dbMu while
// it takes the view: without it (the Lock and its Unlock taken out) the
// view reads the group batch while the FSM goroutine applies into it, a
// DATA RACE under -race.
func TestASaveUnderIngestIsOnePointInTime(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		seen []digestAt
	)
	record := func() {
		i, d := l.fsm.AppliedDigest()
		mu.Lock()
		seen = append(seen, digestAt{i, d})
		mu.Unlock()
	}
	record()
	stop := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		for k := uint32(1); ; k++ {
			select {
			case <-stop:
				done <- nil
				return
			default:
			}
			if _, err := l.IngestEvents(ctx(t), oneEventBatch(k)); err != nil {
				done <- err
				return
			}
			record()
		}
	}()
	var saves []bytes.Buffer
	for s := 0; s < 5; s++ {
		waitFor(t, 10*time.Second, "more ingest", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(seen) > 20*(s+1)
		})
		var buf bytes.Buffer
		if _, err := l.SaveSnapshot(ctx(t), &buf); err != nil {
			t.Fatal(err)
		}
		saves = append(saves, buf)
	}
	close(stop)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	record()
	for s, buf := range saves {
		info, err := InspectSnapshot(bytes.NewReader(buf.Bytes()))
		if err != nil {
			t.Fatal(err)
		}
		f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
		if err := f.Restore(nopCloser{bytes.NewReader(buf.Bytes())}); err != nil {
			t.Fatal(err)
		}
		got := f.Digest()
		f.Close()
		var want []uint64
		for i := range seen {
			if seen[i].index <= info.Index && (i+1 == len(seen) || seen[i+1].index >= info.Index) {
				want = append(want, seen[i].digest)
				if i+1 < len(seen) {
					want = append(want, seen[i+1].digest)
				}
			}
		}
		ok := false
		for _, w := range want {
			ok = ok || w == got
		}
		if !ok {
			t.Fatalf("save %d at index %d: digest %x, want one of %x (the leader's around that index)", s, info.Index, got, want)
		}
	}
}

// TestWritesAcknowledgedAfterARestoreAreKept: an online restore while
// ingestion goes on. A write that began after the restore answered
// success and was acknowledged is in the state of every node afterwards
// (operations.md: only writes before, or in flight during, the restore
// are lost); every ingest error meanwhile is a retryable one. It pins
// that the restore's swap ends every write before it (a later entry is
// never applied to the state the restore replaced) and that writes
// answer no internal error meanwhile.
func TestWritesAcknowledgedAfterARestoreAreKept(t *testing.T) {
	c := newTestCluster(t, 3, slowRestoreTimeouts)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	var snap bytes.Buffer
	if _, err := l.SaveSnapshot(ctx(t), &snap); err != nil {
		t.Fatal(err)
	}
	var restored atomic.Bool // the restore answered success
	type acked struct {
		k            uint32
		afterRestore bool // begun once the restore had answered
	}
	var (
		mu   sync.Mutex
		oks  []acked
		next atomic.Uint32
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				k := next.Add(1)
				afterRestore := restored.Load()
				n := c.leaderNow()
				if n == nil {
					continue
				}
				wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				acks, err := n.IngestEvents(wctx, oneEventBatch(k))
				cancel()
				switch {
				case err == nil:
					if acks[0].Applied == 1 {
						mu.Lock()
						oks = append(oks, acked{k, afterRestore})
						mu.Unlock()
					}
				case errors.Is(err, ErrNotLeader), errors.Is(err, ErrNoLeader), errors.Is(err, context.DeadlineExceeded):
				default:
					errs <- err
					return
				}
			}
		}()
	}
	waitFor(t, 10*time.Second, "writes before the restore", func() bool { return next.Load() > 30 })
	restoreRetrying(t, c, snap.Bytes())
	restored.Store(true)
	after := next.Load()
	waitFor(t, 20*time.Second, "writes after the restore", func() bool { return next.Load() > after+30 })
	close(stop)
	wg.Wait()
	select {
	case err := <-errs:
		t.Fatalf("a write during the restore answered a non-retryable error: %v", err)
	default:
	}
	c.converged()
	checked := 0
	defer func() { t.Logf("%d writes acknowledged, %d of them begun after the restore", len(oks), checked) }()
	for _, a := range oks {
		if !a.afterRestore {
			continue
		}
		checked++
		r := kvevent.Rank{Worker: 1, DP: a.k}
		for _, n := range c.nodes {
			if n.fsm.Cursor(r) != 1 {
				t.Fatalf("%s: the write of rank %v, begun and acknowledged after the restore answered, is missing (cursor %d)", n.cfg.ID, r, n.fsm.Cursor(r))
			}
		}
	}
}

// TestTwoRestoresAtOnceLeaveOneOfThem: two online restores sent to the
// leader at once are taken one after the other (or one refused with a
// retryable error): every node ends up at one of the two states, the same
// one, never a mix. It pins that restores are serialized (Raft's user
// restore, the FSM's swap under dbMu) and answer only retryable refusals.
func TestTwoRestoresAtOnceLeaveOneOfThem(t *testing.T) {
	c := newTestCluster(t, 3, slowRestoreTimeouts)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 10, 7)}})
	dA := c.converged()
	var a, b bytes.Buffer
	if _, err := c.leader().SaveSnapshot(ctx(t), &a); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 11, 10, 17)}})
	dB := c.converged()
	if _, err := c.leader().SaveSnapshot(ctx(t), &b); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 21, 10, 27)}})
	c.converged()
	l = c.leader()
	res := make(chan error, 2)
	for _, s := range [][]byte{a.Bytes(), b.Bytes()} {
		go func() {
			_, err := l.RestoreSnapshot(ctx(t), bytes.NewReader(s))
			res <- err
		}()
	}
	for i := 0; i < 2; i++ {
		if err := <-res; err != nil && !errors.Is(err, ErrNoLeader) && !errors.Is(err, ErrNotLeader) {
			t.Fatalf("restore: %v", err)
		} else {
			t.Logf("restore: %v", err)
		}
	}
	d := c.converged()
	if d != dA && d != dB {
		t.Fatalf("after two restores at once, the digest is %x: neither restored state (%x, %x)", d, dA, dB)
	}
}

// TestAFollowerDownDuringARestoreTakesTheRestoredState: a follower that
// was stopped while a restore was installed comes back to the restored
// state, not its own older one, and writes after it apply on it too. It
// pins the leader sending the returning follower its snapshot of the
// restored state rather than the entries after its own older state.
func TestAFollowerDownDuringARestoreTakesTheRestoredState(t *testing.T) {
	c := newTestCluster(t, 3, slowRestoreTimeouts)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 10, 7)}})
	saved := c.converged()
	var snap bytes.Buffer
	if _, err := c.leader().SaveSnapshot(ctx(t), &snap); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 11, 10, 17)}})
	c.converged()
	down := c.followerOf(c.leader())
	c.stop(down)
	restoreRetrying(t, c, snap.Bytes())
	for k := uint32(1); k <= 5; k++ {
		ingestRetrying(t, c, oneEventBatch(k))
	}
	c.start(down)
	d := c.converged()
	if d == saved {
		t.Fatal("the writes after the restore are missing")
	}
	for k := uint32(1); k <= 5; k++ {
		if got := c.nodes[down].fsm.Cursor(kvevent.Rank{Worker: 1, DP: k}); got != 1 {
			t.Fatalf("the returned follower lacks the write %d after the restore (cursor %d)", k, got)
		}
	}
	if got := c.nodes[down].fsm.Cursor(r1); got != 10 {
		t.Fatalf("the returned follower's cursor of r1 is %d, want the restored 10", got)
	}
}

// TestAUserSaveRightAfterAGroupCommitHoldsTheGroup: a user's save
// (FSM.view) taken while a full group commits in the background
// (commitAsync) holds that group's writes: the stream, restored, has the
// digest of the state it says it is at. A view over the database without
// the group still committing and the open group laid over it would carry
// the open group's applied index and lack the committing group's records.
// It pins FSM.view waiting for the committing group (waitCommit): with
// that wait skipped (if false { ... }) a save lacks the group.
func TestAUserSaveRightAfterAGroupCommitHoldsTheGroup(t *testing.T) {
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, GroupBytes: 64,
		OnFatal: func(err error) { t.Fatalf("fatal: %v", err) }})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w := &logWriter{}
	f.Apply(w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16})))
	for k := uint32(1); k <= 40; k++ {
		f.ApplyBatch([]*raft.Log{w.next(encodeEvents(2, oneEventBatch(k)))})
		view, _, err := f.view()
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		info, err := writeSnapshot(&buf, view)
		view.Close()
		if err != nil {
			t.Fatal(err)
		}
		if info.Index != w.index {
			t.Fatalf("save after entry %d: stream at index %d, want %d", k, info.Index, w.index)
		}
		restoredFSM(t, buf.Bytes(), f.Digest())
	}
}

// TestAFollowerCatchesUpThroughASnapshotWhileTheLeaderIngests: a follower
// down past the leader's log retention comes back while the leader keeps
// ingesting (and snapshotting, at a low threshold): it installs a
// snapshot and then applies the entries after it, to the leader's state,
// every acknowledged write included. It pins that a Raft snapshot taken
// while entries apply is the state at its index, no entry lost or
// applied twice across the install.
func TestAFollowerCatchesUpThroughASnapshotWhileTheLeaderIngests(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.TrailingLogs = 5; cfg.SnapshotThreshold = 10 })
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.converged()
	down := c.followerOf(l)
	c.stop(down)
	k := uint32(0)
	for ; k < 60; k++ {
		ingestRetrying(t, c, oneEventBatch(k+1))
	}
	if err := c.leader().raft.Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	c.start(down)
	n := c.nodes[down]
	for ; n.Status().SnapshotIndex == 0 || k < 150; k++ {
		if k > 2000 {
			t.Fatal("the follower installed no snapshot")
		}
		ingestRetrying(t, c, oneEventBatch(k+1))
	}
	c.converged()
	for j := uint32(1); j <= k; j++ {
		if got := n.fsm.Cursor(kvevent.Rank{Worker: 1, DP: j}); got != 1 {
			t.Fatalf("the follower lacks acknowledged write %d (cursor %d)", j, got)
		}
	}
}

// TestAUserSaveBesideRaftSnapshotsIsOnePointInTime: user saves (FSM.view,
// from their own goroutine) while the FSM goroutine applies entries and
// takes a Raft snapshot after each (FSM.Snapshot, which commits the open
// group, as Raft's snapshots and Node.maybeSnapshot run it) each stream
// the state at their index: restored, the digest the FSM had there. It
// pins FSM.Snapshot holding dbMu (RLock): without it (the RLock and its
// RUnlock taken out) its commit of the group sorts and empties the batch
// a save's view is copying, a DATA RACE under -race (and a view that
// lacks the group or holds it twice).
func TestAUserSaveBesideRaftSnapshotsIsOnePointInTime(t *testing.T) {
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	w := &logWriter{}
	f.Apply(w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16})))
	digests := map[uint64]uint64{w.index: f.Digest()} // the FSM goroutine's alone until it is done
	applied := make(chan error, 1)
	go func() { // the FSM goroutine: entries, each followed by a Raft snapshot
		for k := uint32(1); k <= 200; k++ {
			f.ApplyBatch([]*raft.Log{w.next(encodeEvents(2, oneEventBatch(k)))})
			digests[w.index] = f.Digest()
			s, err := f.Snapshot()
			if err != nil {
				applied <- err
				return
			}
			s.Release()
		}
		applied <- nil
	}()
	var saves [][]byte
	for done := false; !done; {
		select {
		case err := <-applied:
			if err != nil {
				t.Fatal(err)
			}
			done = true
		default:
		}
		view, _, err := f.view()
		if err != nil {
			t.Fatal(err)
		}
		saves = append(saves, streamOf(t, view))
		view.Close()
	}
	t.Logf("%d saves beside 200 Raft snapshots", len(saves))
	for i := 0; i < len(saves); i += max(1, len(saves)/20) { // restoring each of hundreds would take long
		info, err := InspectSnapshot(bytes.NewReader(saves[i]))
		if err != nil {
			t.Fatal(err)
		}
		want, ok := digests[info.Index]
		if !ok {
			t.Fatalf("save %d at index %d: an index the FSM never applied to", i, info.Index)
		}
		restoredFSM(t, saves[i], want)
	}
}
