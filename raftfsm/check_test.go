package raftfsm

import (
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestDigestCheckFindsADivergedReplica: two replicas apply the same
// entries; one's state is changed outside the log before a check entry.
// The next check, carrying the healthy replica's digest at that entry,
// finds the mismatch on the diverged replica only.
func TestDigestCheckFindsADivergedReplica(t *testing.T) {
	a, b := openTestFSM(t, t.TempDir()), openTestFSM(t, t.TempDir())
	defer a.Close()
	defer b.Close()
	wa, wb := &logWriter{}, &logWriter{}
	applyFixture(t, a, wa)
	applyFixture(t, b, wb)
	both := func(data []byte) (CheckResult, CheckResult) {
		ra := a.ApplyBatch([]*raft.Log{wa.next(data)})[0]
		rb := b.ApplyBatch([]*raft.Log{wb.next(data)})[0]
		ca, _ := ra.(CheckResult)
		cb, _ := rb.(CheckResult)
		return ca, cb
	}

	// The first check has nothing to compare; both note their digests.
	if ra, rb := both(encodeCheck(7, 0, 0)); ra.Compared || rb.Compared {
		t.Fatalf("the first check compared: %+v %+v", ra, rb)
	}
	if a.LastCheck() != b.LastCheck() || a.LastCheck().Index == 0 {
		t.Fatalf("replicas noted %+v and %+v", a.LastCheck(), b.LastCheck())
	}
	last := a.LastCheck()
	if ra, rb := both(encodeCheck(8, last.Index, last.Digest)); !ra.Match || !rb.Match {
		t.Fatalf("equal replicas: %+v %+v", ra, rb)
	}

	// b diverges: a cursor changed in memory only, as a bug would.
	b.curMu.Lock()
	b.cursors.Set(kvevent.Rank{Worker: 999}, rankCursor{id: 5})
	b.curMu.Unlock()
	both(encodeEvents(9, []RankBatch{{Rank: r1, Events: chainEvents(r1, 7, 2, 500)}}))
	if ra, rb := both(encodeCheck(10, a.LastCheck().Index, a.LastCheck().Digest)); !ra.Match || !rb.Match {
		t.Fatalf("the check before the divergence was noted: %+v %+v", ra, rb)
	}
	last = a.LastCheck()
	ra, rb := both(encodeCheck(11, last.Index, last.Digest))
	if !ra.Match || !rb.Compared || rb.Match {
		t.Fatalf("after b diverged: a %+v, b %+v", ra, rb)
	}
	if c, m := a.DigestChecks(); c != 3 || m != 0 {
		t.Fatalf("a: %d compared, %d mismatched", c, m)
	}
	if c, m := b.DigestChecks(); c != 3 || m != 1 {
		t.Fatalf("b: %d compared, %d mismatched", c, m)
	}

	// A digest of another index than the replica's last check compares
	// nothing (a check proposed before the last one was applied).
	if ra, _ := both(encodeCheck(12, last.Index, last.Digest)); ra.Compared {
		t.Fatalf("a stale check compared: %+v", ra)
	}
}

// TestClusterDigestChecks: the leader proposes checks on its own; every
// replica compares and matches, and a follower whose state is changed
// outside the log counts a mismatch while the others do not.
func TestClusterDigestChecks(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) { cfg.CheckInterval = 20 * time.Millisecond })
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 4, 10)}})
	waitFor(t, 20*time.Second, "every replica to compare a check", func() bool {
		for _, n := range c.nodes {
			if compared, _ := n.fsm.DigestChecks(); compared == 0 {
				return false
			}
		}
		return true
	})
	var follower *Node
	for _, n := range c.nodes {
		if _, m := n.fsm.DigestChecks(); m != 0 {
			t.Fatalf("%s: %d mismatches on equal replicas", n.cfg.ID, m)
		}
		if n != c.leader() {
			follower = n
		}
	}
	follower.fsm.curMu.Lock()
	follower.fsm.cursors.Set(kvevent.Rank{Worker: 999}, rankCursor{id: 5})
	follower.fsm.curMu.Unlock()
	waitFor(t, 20*time.Second, "the diverged follower to find it", func() bool {
		_, m := follower.fsm.DigestChecks()
		return m > 0
	})
	for _, n := range c.nodes {
		if _, m := n.fsm.DigestChecks(); n != follower && m != 0 {
			t.Fatalf("%s: %d mismatches, but only %s diverged", n.cfg.ID, m, follower.cfg.ID)
		}
	}
	m := gather(t, NewCollector(follower))
	if v := m["kvrouter_state_digest_mismatch_total{}"].GetCounter().GetValue(); v == 0 {
		t.Fatal("kvrouter_state_digest_mismatch_total is 0 on the diverged follower")
	}
}

// TestEventOutcomesAreCounted: the events of event batches count by op,
// tier and outcome: applied, duplicate (at or below the cursor), gap (after
// a gap in the batch: not applied) and malformed (consumes its id).
func TestEventOutcomesAreCounted(t *testing.T) {
	f := openTestFSM(t, t.TempDir())
	defer f.Close()
	w := &logWriter{}
	host := kvevent.TierHostPinned
	st := func(id, h uint64) kvevent.Event {
		return kvevent.Event{Rank: r1, EventID: id, Kind: kvevent.KindStored, Tier: host, Blocks: []kvevent.Block{{EngineHash: h, LocalHash: h + 1}}}
	}
	f.ApplyBatch([]*raft.Log{w.next(encodeEvents(1, []RankBatch{{Rank: r1, Events: []kvevent.Event{st(1, 10), st(2, 20)}}}))})
	f.ApplyBatch([]*raft.Log{w.next(encodeEvents(2, []RankBatch{{Rank: r1, Events: []kvevent.Event{
		st(2, 20), // a duplicate
		st(3, 30), // applied
		{Rank: r1, EventID: 4, Kind: kvevent.KindRemoved, Tier: host, Removed: []uint64{10}}, // applied
		st(6, 60), // past a gap
		st(7, 70), // after it
	}}}))})
	count := func(k kvevent.Kind, o int) uint64 { return f.events[k][host][o].Load() }
	if got := count(kvevent.KindStored, outcomeApplied); got != 3 {
		t.Errorf("stores applied %d, want 3", got)
	}
	if got := count(kvevent.KindRemoved, outcomeApplied); got != 1 {
		t.Errorf("removes applied %d, want 1", got)
	}
	if got := count(kvevent.KindStored, outcomeDuplicate); got != 1 {
		t.Errorf("duplicates %d, want 1", got)
	}
	if got := count(kvevent.KindStored, outcomeGap); got != 2 {
		t.Errorf("events after the gap %d, want 2", got)
	}
}
