package raftfsm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/store"
)

// divergedByARestore registers workers 1 and 2 (every node holds both),
// then cuts the leader off just as it hands Raft a user restore of the
// state with worker 1 alone: the leader installs it, no follower gets it
// (Raft's user restore is no log entry). The followers elect a new
// leader that keeps worker 2 and registers worker 3. It returns the old
// leader's index, cut off still.
func divergedByARestore(t *testing.T, c *inmemCluster) int {
	t.Helper()
	li, l := c.leaderExcept(-1)
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 5, 7)}}); err != nil {
		t.Fatal(err)
	}
	var snap bytes.Buffer
	if _, err := l.SaveSnapshot(ctx(t), &snap); err != nil {
		t.Fatal(err)
	}
	restored := l.fsm.Digest()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	waitEveryNodeHolds(t, c, 2)
	l.cfg.beforeRestore = func() { c.isolate(li) }
	_, err := l.RestoreSnapshot(ctx(t), bytes.NewReader(snap.Bytes()))
	t.Logf("restore on the cut-off leader answered: %v", err)
	if l.fsm.Digest() != restored {
		t.Fatalf("the old leader did not install the restore (digest %016x, want %016x)", l.fsm.Digest(), restored)
	}
	_, nl := c.leaderExcept(li)
	if err := nl.RegisterWorker(ctx(t), WorkerInfo{ID: 3, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	return li
}

// waitConverged waits until every node applied the leader's last index
// with the leader's digest, and holds workers 2 and 3: the state the
// other nodes wrote on, not the restore.
func waitConverged(t *testing.T, c *inmemCluster) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, nl := c.leaderExcept(-1)
		want, d := nl.raft.LastIndex(), nl.fsm.Digest()
		ok := true
		for _, nd := range c.nodes {
			_, w2 := nd.fsm.Workers()[2]
			_, w3 := nd.fsm.Workers()[3]
			if nd.raft.AppliedIndex() < want || nd.fsm.Digest() != d || !w2 || !w3 {
				ok = false
			}
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			var b strings.Builder
			for _, nd := range c.nodes {
				_, w2 := nd.fsm.Workers()[2]
				_, w3 := nd.fsm.Workers()[3]
				fmt.Fprintf(&b, "\n  %s: leader=%v applied=%d last=%d commit=%d digest=%016x worker2=%v worker3=%v ready=%v",
					nd.cfg.ID, nd.IsLeader(), nd.raft.AppliedIndex(), nd.raft.LastIndex(), nd.raft.CommitIndex(), nd.fsm.Digest(), w2, w3,
					nd.Status().Ready)
			}
			t.Fatalf("replicas never converged on the state the others wrote on:%s", b.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestARestoreNoFollowerTookIsDroppedOnceTheLeaderIsBack: the old
// leader, holding a user restore that no follower took, comes back to a
// cluster that wrote on without it. Its log cannot take the new leader's
// from its start, and hashicorp/raft retried that for good: the node
// stayed on the restored state, applying nothing, and answered ready.
// Now it is not ready while so, the new leader compacts its log, sends
// it its snapshot, and all three end on the state the others wrote on
// (the restore had answered MaybeApplied).
func TestARestoreNoFollowerTookIsDroppedOnceTheLeaderIsBack(t *testing.T) {
	held, release := make(chan struct{}), make(chan struct{})
	var once bool
	c := newInmemClusterTuned(t, 3, func(cfg *Config) {
		cfg.beforeForcedCompaction = func() {
			if !once {
				once = true // compactions run one at a time, on the leader only
				close(held)
				<-release
			}
		}
	})
	li := divergedByARestore(t, c)
	old := c.nodes[li]
	c.heal()
	select {
	case <-held:
	case <-time.After(20 * time.Second):
		t.Fatal("no leader compacted its log for the old leader")
	}
	if st := old.Status(); st.Ready || st.LeaderID == "" {
		close(release)
		t.Fatalf("the old leader, whose log its leader (%q) cannot replicate to, answers ready=%v", st.LeaderID, st.Ready)
	}
	close(release)
	waitConverged(t, c)
	waitFor(t, 10*time.Second, "the old leader to be ready again", func() bool { return old.Status().Ready })
	// compactForFollower counts a compaction once compactLog put the
	// trailing logs back, after the snapshot the old leader took and
	// converged on: polled, as the count may come just after.
	waitFor(t, 10*time.Second, "kvrouter_raft_forced_compactions_total over the nodes to reach 1", func() bool {
		forced := 0.0
		for _, nd := range c.nodes {
			forced += gather(t, NewCollector(nd))["kvrouter_raft_forced_compactions_total{}"].GetCounter().GetValue()
		}
		return forced >= 1
	})
	// The compaction kept no trailing entries for its snapshot only: the
	// node that ran it keeps the configured number again (counted once
	// compactLog put it back), or every later snapshot would drop the
	// whole log and send each lagging follower a snapshot.
	for _, nd := range c.nodes {
		if nd.forcedCompactions.Load() == 0 {
			continue
		}
		if got := nd.raft.ReloadableConfig().TrailingLogs; got != nd.cfg.TrailingLogs {
			t.Fatalf("%s keeps %d trailing log entries after its forced compaction, want the configured %d", nd.cfg.ID, got, nd.cfg.TrailingLogs)
		}
	}
}

// TestARestoreNoFollowerTookIsDroppedAfterTheLeaderRestarts: as above,
// but the old leader is stopped while cut off and started again on its
// directory once the others wrote on.
func TestARestoreNoFollowerTookIsDroppedAfterTheLeaderRestarts(t *testing.T) {
	c := newInmemCluster(t, 3)
	li := divergedByARestore(t, c)
	c.nodes[li].Close()
	restartConverges(t, c, li)
}

// restartConverges starts node li again on its directory (stopped, cut
// off by divergedByARestore), heals the cluster, and waits until every
// node holds the state the others wrote on and the restarted one is
// ready.
func restartConverges(t *testing.T, c *inmemCluster, li int) {
	t.Helper()
	cfg := c.nodes[li].cfg
	cfg.beforeRestore = nil
	_, tr := raft.NewInmemTransport(raft.ServerAddress(cfg.RaftAddr))
	c.trans[li] = tr
	cfg.Transport = tr
	c.heal()
	restarted, err := NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.nodes[li] = restarted
	waitConverged(t, c)
	waitFor(t, 10*time.Second, "the restarted node to be ready", func() bool { return restarted.Status().Ready })
}

// TestARestoreALeaderWasKilledInIsDroppedAfterItsRestart: as above, but
// the old leader stops where a kill -9 during the restore leaves it:
// Raft installed the restore (its snapshot at R, the FSM's state) and had
// not yet removed the log, which ends below R (the entries it held, put
// back into its log store here). The others wrote their own entry at R
// and on. The restarted node took them as continuing its log up to R-1,
// skipped the one at R as applied and applied the rest on the restored
// state: every node at one applied index, ready, its digest another
// (found killing the leader of real processes during kvctl snapshot
// restore, e2e's TestKillLeaderDuringAnOnlineRestoreKeepsOneState).
func TestARestoreALeaderWasKilledInIsDroppedAfterItsRestart(t *testing.T) {
	c := newInmemCluster(t, 3)
	li := divergedByARestore(t, c)
	old := c.nodes[li]
	list, err := old.snaps.List()
	if err != nil || len(list) == 0 {
		t.Fatalf("the old leader's snapshots: %v, %v; want the restore's", list, err)
	}
	at := list[0].Index
	// The log the old leader held before the restore: the entries below
	// at that another node holds (the same, by log matching).
	other := c.nodes[(li+1)%3]
	first, err := other.logs.FirstIndex()
	if err != nil {
		t.Fatal(err)
	}
	var kept []*raft.Log
	for i := first; i < at; i++ {
		var e raft.Log
		if err := other.logs.GetLog(i, &e); err != nil {
			t.Fatalf("entry %d of %s's log: %v", i, other.cfg.ID, err)
		}
		kept = append(kept, &e)
	}
	if len(kept) == 0 {
		t.Fatalf("%s's log holds no entry below the restore at %d (it starts at %d)", other.cfg.ID, at, first)
	}
	old.Close()
	logs, err := store.OpenLogStore(filepath.Join(old.cfg.DataDir, "raft"), store.LogStoreOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	// Raft appended a no-op after the restore, once it had removed the
	// log (api.go's Restore): not there yet at the kill.
	if last, err := logs.LastIndex(); err != nil {
		t.Fatal(err)
	} else if last >= at {
		if err := logs.DeleteRange(at, last); err != nil {
			t.Fatal(err)
		}
	}
	if err := logs.StoreLogs(kept); err != nil {
		t.Fatal(err)
	}
	if err := logs.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("the old leader stops with its restore at %d and its log %d..%d", at, kept[0].Index, kept[len(kept)-1].Index)
	restartConverges(t, c, li)
}

// TestADeposedLeadersRestoreOverAnOlderTermSnapshotConverges: the
// cluster form of TestRestoreTakesTheIndexOfTheSnapshotRaftJustSaved.
// Every node holds a snapshot of term T1; leadership moves to L (term
// T2), which registers worker 2 and is cut off while it runs a user
// restore (its snapshot: (R, T2)). The others elect a leader that
// registers worker 3; its log begins after its snapshot of term T1, which
// it sends L once healed. L's FSM labelled that state (R, T2), the first
// in the store by term, and skipped the entries up to R (worker 2's
// registration among them): it lacked workers and answered ready.
func TestADeposedLeadersRestoreOverAnOlderTermSnapshotConverges(t *testing.T) {
	c := newInmemClusterTuned(t, 3, func(cfg *Config) {
		cfg.SnapshotBytes = -1
		cfg.ExpiryInterval, cfg.CheckInterval = time.Hour, time.Hour
	})
	xi, x := c.leaderExcept(-1)
	if err := x.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	var snap bytes.Buffer
	if _, err := x.SaveSnapshot(ctx(t), &snap); err != nil {
		t.Fatal(err)
	}
	waitEveryNodeHolds(t, c, 1)
	for _, nd := range c.nodes {
		if err := nd.compactLog(); err != nil {
			t.Fatal(err)
		}
	}
	li := (xi + 1) % 3
	l := c.nodes[li]
	// L leads from a transfer, asked again while another node takes the
	// lead from it before it registers worker 2 (seen in a CI run beside
	// other jobs: "not the leader; the leader is n2").
	for deadline := time.Now().Add(30 * time.Second); ; {
		if _, cur := c.leaderExcept(-1); cur != l {
			if err := cur.TransferLeadership(ctx(t), l.cfg.ID); err != nil && !errors.Is(err, ErrNotLeader) && !errors.Is(err, ErrNoLeader) {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "the new leader", func() bool { return l.IsLeader() && l.CheckLeader() == nil })
		}
		err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16})
		if err == nil {
			break
		}
		if !errors.Is(err, ErrNotLeader) && !errors.Is(err, ErrNoLeader) || time.Now().After(deadline) {
			t.Fatal(err)
		}
		t.Logf("register worker 2 on %s: %v", l.cfg.ID, err)
	}
	waitEveryNodeHolds(t, c, 2)
	l.cfg.beforeRestore = func() { c.isolate(li) }
	_, err := l.RestoreSnapshot(ctx(t), bytes.NewReader(snap.Bytes()))
	t.Logf("restore on the cut-off leader answered: %v", err)
	_, nl := c.leaderExcept(li)
	if err := nl.RegisterWorker(ctx(t), WorkerInfo{ID: 3, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	c.heal()
	waitConverged(t, c)
}

// TestAStateThatHoldsEntriesRefusesTheLogFromItsStart: a follower whose
// state holds entries (applied, or in a snapshot) refuses an
// AppendEntries that sends the leader's log from its start, at the
// leader's term, and is behind; Raft took one when its log was empty (a
// restart after a restore no other node took) and applied the entries
// above its applied index on top of the restored state. An empty node,
// a stale leader and a probe with a previous entry go to Raft.
func TestAStateThatHoldsEntriesRefusesTheLogFromItsStart(t *testing.T) {
	fromStart := raft.AppendEntriesRequest{Term: 3, Entries: []*raft.Log{{Index: 1, Term: 1}, {Index: 2, Term: 1}}}
	probe := fromStart
	probe.PrevLogEntry, probe.PrevLogTerm = 11, 3
	for _, tc := range []struct {
		name       string
		held, term uint64
		args       raft.AppendEntriesRequest
		refused    bool
	}{
		{"a state that holds entries", 11, 3, fromStart, true},
		{"an empty node", 0, 3, fromStart, false},
		{"a stale leader", 11, 4, fromStart, false},
		{"a probe with a previous entry", 11, 3, probe, false},
	} {
		_, a := raft.NewInmemTransport("inmem-n1")
		_, b := raft.NewInmemTransport("inmem-n2")
		b.Connect(a.LocalAddr(), a)
		tr, w := watchCommits(a, "n1", quiet)
		w.setAlone(func() bool { return false }, func() (uint64, uint64) { return tc.held, tc.term })
		args := tc.args
		args.RPCHeader = raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("n2")}
		var resp raft.AppendEntriesResponse
		done := make(chan error, 1)
		go func() { done <- b.AppendEntries("n1", a.LocalAddr(), &args, &resp) }()
		refused := false
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			refused = true
			if resp.Success || resp.Term != args.Term || string(resp.ID) != "n1" {
				t.Errorf("%s: refused with %+v, want a failure at term %d from n1", tc.name, resp, args.Term)
			}
		case rpc := <-tr.Consumer():
			rpc.Respond(&raft.AppendEntriesResponse{Term: args.Term, Success: true}, nil)
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		if refused != tc.refused || w.behind.Load() != tc.refused {
			t.Errorf("%s: refused %v, behind %v; want %v", tc.name, refused, w.behind.Load(), tc.refused)
		}
		w.close()
	}
}

// TestAJoinerThatRefusedARetriedFirstBatchIsReadyAfterALeaderChange: a
// joiner slower to store its first batch than the transport's timeout
// gets it again from the log's start, which it refuses (it holds entries
// by then) and is behind. The leader changes before its forced
// compaction sends a snapshot: the new leader's probes match the
// joiner's log, no snapshot ever comes, and the matching append must
// make it ready. From the second review of the restore fix.
func TestAJoinerThatRefusedARetriedFirstBatchIsReadyAfterALeaderChange(t *testing.T) {
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	c := newInmemClusterTuned(t, 3, func(cfg *Config) {
		cfg.beforeForcedCompaction = func() {
			once.Do(func() { close(held); <-release })
		}
	})
	li, l := c.leaderExcept(-1)
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 5, 7)}}); err != nil {
		t.Fatal(err)
	}

	// The joiner, whose first log write (the leader's log from index 1)
	// takes longer than the in-memory transport's 500 ms timeout.
	_, tr := raft.NewInmemTransport("inmem-n4")
	c.trans = append(c.trans, tr)
	c.heal()
	var slowed atomic.Bool
	cfg4 := Config{ID: "n4", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "http-n4",
		DataDir: filepath.Join(t.TempDir(), "n4"), Transport: tr, Logger: quiet,
		beforeLogWrite: func(logs []*raft.Log) {
			if len(logs) > 0 && logs[0].Index == 1 && slowed.CompareAndSwap(false, true) {
				time.Sleep(2 * time.Second) // a slow disk
			}
		}}
	n4, err := NewNode(cfg4)
	if err != nil {
		t.Fatal(err)
	}
	c.nodes = append(c.nodes, n4)
	addDone := make(chan error, 1)
	go func() {
		actx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		addDone <- l.AddMember(actx, "n4", cfg4.RaftAddr, cfg4.HTTPAddr)
	}()
	waitFor(t, 15*time.Second, "n4 to refuse the resent log from its start (behind)", n4.watch.behind.Load)
	select {
	case <-held:
	case <-time.After(15 * time.Second):
		close(release)
		t.Fatal("the leader never began a forced compaction")
	}
	// The leadership moves (an election, a transfer) before the snapshot
	// went out.
	other := c.nodes[(li+1)%3].cfg.ID
	terr := moveLeadership(t, l, other)
	close(release)
	if terr != nil {
		t.Fatalf("transfer to %s: %v", other, terr)
	}
	<-addDone
	// Finish the add on the new leader (a retried add resumes), asked
	// again while the leadership still moves: the node found leading can
	// lose it before it answers (seen under -race, 1 run in 20: "add n4
	// again on n2: no leader").
	var nl *Node
	for deadline := time.Now().Add(30 * time.Second); ; {
		_, nl = c.leaderExcept(3)
		err := nl.AddMember(ctx(t), "n4", cfg4.RaftAddr, cfg4.HTTPAddr)
		if err == nil {
			break
		}
		if !errors.Is(err, ErrNotLeader) && !errors.Is(err, ErrNoLeader) || time.Now().After(deadline) {
			t.Fatalf("add n4 again on %s: %v", nl.cfg.ID, err)
		}
		t.Logf("add n4 again on %s: %v", nl.cfg.ID, err)
	}
	waitFor(t, 10*time.Second, "n4 to apply the leader's log with its digest", func() bool {
		return n4.raft.AppliedIndex() >= nl.raft.LastIndex() && n4.fsm.Digest() == nl.fsm.Digest()
	})
	deadline := time.Now().Add(20 * time.Second)
	for !n4.Status().Ready {
		if time.Now().After(deadline) {
			st := n4.Status()
			t.Fatalf("n4 holds the cluster's state (applied %d, digest %s = leader %s's) but is not ready 20 s on: behind=%v, leader %q, snapshot index %d",
				st.AppliedIndex, st.Digest, nl.cfg.ID, n4.watch.behind.Load(), st.LeaderID, st.SnapshotIndex)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestASeededNodeInAnUnseededMajorityKeepsTheSeed: docs/operations.md
// ("Backup and restore"): where the unseeded nodes of a seeded cluster are
// a majority, "a seeded node in the minority keeps the seed's state ...:
// its digest differs from the others' and kvctl status warns, the sign to
// look for". Now the unseeded leader's log from its start is refused by
// the seeded node (its state holds the seed's index 2), the leader
// compacts and sends its (empty) snapshot, and the seeded node drops the
// seed: every digest agrees and the sign is gone.

// waitEveryNodeHolds waits until every node of c holds worker id.
func waitEveryNodeHolds(t *testing.T, c *inmemCluster, id uint64) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("every node to hold worker %d", id), func() bool {
		for _, nd := range c.nodes {
			if _, ok := nd.fsm.Workers()[id]; !ok {
				return false
			}
		}
		return true
	})
}
