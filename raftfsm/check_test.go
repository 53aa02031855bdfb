package raftfsm

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/testlog"
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
//
// Its cluster runs with Raft timeouts of a second (steadyTimeouts): the
// diverged follower must stay one. Elected (a leader that missed its
// 200 ms lease under load), it proposes checks of its own digest, which
// it matches and the others do not: the test timed out waiting for it
// to find a mismatch (as it does after a transfer to it right after the
// divergence).
func TestClusterDigestChecks(t *testing.T) {
	c := newTestCluster(t, 3, func(cfg *Config) {
		steadyTimeouts(cfg)
		cfg.CheckInterval = 20 * time.Millisecond
	})
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
	for _, n := range c.nodes {
		if _, m := n.fsm.DigestChecks(); m != 0 {
			t.Fatalf("%s: %d mismatches on equal replicas", n.cfg.ID, m)
		}
	}
	follower := c.nodes[c.followerOf(c.leader())]
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

// TestConfigCheckComparesTheEntryAtItsIndex: a check carrying the
// leader's configuration compares it with the entry at the same index of
// each replica's log: equal ids, suffrages and addresses as dialled
// match; another server, a missing one or another suffrage is a
// mismatch, counted; a log without the entry compares nothing. The
// digest part of the check works as before.
func TestConfigCheckComparesTheEntryAtItsIndex(t *testing.T) {
	voters := func(ids ...string) []raft.Server {
		var out []raft.Server
		for i, id := range ids {
			out = append(out, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(id), Address: raft.ServerAddress(fmt.Sprintf("127.0.0.1:%d", 7000+i))})
		}
		return out
	}
	leader := voters("n1", "n2", "n3")
	written := voters("n1", "n2", "n3")
	written[2].Address = "127.0.0.1:07002" // the same address, written otherwise
	nonvoter := voters("n1", "n2", "n3")
	nonvoter[2].Suffrage = raft.Nonvoter
	for _, tc := range []struct {
		name          string
		own           []raft.Server // nil: no entry at the index
		compared, ok  bool
		wantMismatchs uint64
	}{
		{"the same list", voters("n1", "n2", "n3"), true, true, 0},
		{"the same addresses, written otherwise", written, true, true, 0},
		{"a fourth voter", voters("n1", "n2", "n3", "n4"), true, false, 1},
		{"one voter fewer", voters("n1", "n2"), true, false, 1},
		{"another suffrage", nonvoter, true, false, 1},
		{"no entry at the index", nil, false, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := openTestFSM(t, t.TempDir())
			defer f.Close()
			var logs testlog.Buffer
			f.logger = slog.New(slog.NewTextHandler(&logs, nil))
			f.configAt = func(index uint64) ([]raft.Server, bool) {
				if index != 1 || tc.own == nil {
					return nil, false
				}
				return tc.own, true
			}
			var w logWriter
			r, _ := f.ApplyBatch([]*raft.Log{w.next(encodeConfigCheck(5, 0, 0, 1, leader))})[0].(CheckResult)
			if r.ConfigCompared != tc.compared || r.ConfigMatch != tc.ok {
				t.Fatalf("check result %+v, want compared %v, match %v", r, tc.compared, tc.ok)
			}
			if got := f.ConfigMismatches(); got != tc.wantMismatchs {
				t.Fatalf("%d configuration mismatches counted, want %d", got, tc.wantMismatchs)
			}
			lines := logs.Lines("different --peers")
			if tc.wantMismatchs == 0 && len(lines) > 0 {
				t.Fatalf("an error logged without a mismatch: %q", lines)
			}
			if tc.wantMismatchs > 0 && (len(lines) != 1 || !strings.Contains(lines[0], "127.0.0.1:7000,n2@127.0.0.1:7001")) {
				t.Fatalf("the mismatch logged as %q, want one error naming both lists", lines)
			}
			if f.LastCheck().Index == 0 {
				t.Fatal("the check's digest was not noted")
			}
		})
	}
}

// TestConfigCheckEncoding: a configuration check decodes to what was
// encoded; a plain check carries none; a configuration of no servers, of
// an unknown suffrage or cut short is refused as malformed.
func TestConfigCheckEncoding(t *testing.T) {
	servers := []raft.Server{
		{Suffrage: raft.Voter, ID: "n1", Address: "127.0.0.1:7000"},
		{Suffrage: raft.Nonvoter, ID: "n2", Address: "host-2:7000"},
	}
	c, err := decodeCommand(encodeConfigCheck(9, 4, 0xabc, 1, servers))
	if err != nil {
		t.Fatal(err)
	}
	if c.typ != cmdCheck || c.checkIndex != 4 || c.checkDigest != 0xabc || c.configIndex != 1 || !slices.Equal(c.config, servers) {
		t.Fatalf("decoded %+v", c)
	}
	if c, err := decodeCommand(encodeCheck(9, 4, 0xabc)); err != nil || c.configIndex != 0 || c.config != nil {
		t.Fatalf("a plain check decoded as %+v, %v", c, err)
	}
	bad := encodeConfigCheck(9, 4, 0xabc, 1, servers)
	bad[len(bad)-1] = 7 // the last server's suffrage
	full := encodeConfigCheck(9, 4, 0xabc, 1, servers)
	for name, b := range map[string][]byte{
		"no servers":      encodeConfigCheck(9, 4, 0xabc, 1, nil),
		"index 0":         encodeConfigCheck(9, 4, 0xabc, 0, servers),
		"a bad suffrage":  bad,
		"cut short":       full[:len(full)-3],
		"a trailing byte": append(slices.Clone(full), 0),
	} {
		if _, err := decodeCommand(b); !errors.Is(err, ErrBadCommand) {
			t.Errorf("%s: decoded with %v, want ErrBadCommand", name, err)
		}
	}
}

// TestNodesStartedWithDifferentPeersAreTold: Raft takes the bootstrap
// entries of nodes started with different --peers for the same entry, and
// the nodes ran with different configurations for good (one counting
// quorums among four voters, the others among three) without a word. Now
// the first leader proposes a check carrying its bootstrap entry, and
// exactly the nodes whose own entry differs from it count a mismatch. In
// the first case a follower's list has a fourth voter: n1 and n2 elect a
// leader before it starts. In the second the odd node starts with the
// others and campaigns first (its election timeout is short), so it
// likely leads: then n1 and n2 count the mismatch. Whoever leads, the
// counts follow from the lists.
func TestNodesStartedWithDifferentPeersAreTold(t *testing.T) {
	n4 := Member{ID: "n4", RaftAddr: "127.0.0.1:1", HTTPAddr: "http-n4"}
	for _, tc := range []struct {
		name      string
		staggered bool // n3 starts once n1 and n2 have a leader
	}{
		{"a follower's list differs", true},
		{"the campaigning node's list differs", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, trs := newUnstartedCluster(t, 3, func(cfg *Config) {
				cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = time.Second, time.Second, 500*time.Millisecond
				if cfg.ID == "n3" {
					cfg.Peers = append(slices.Clone(cfg.Peers), n4)
					if !tc.staggered {
						cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 50*time.Millisecond, 50*time.Millisecond, 50*time.Millisecond
					}
				}
			})
			c.startOn(0, trs[0])
			c.startOn(1, trs[1])
			if tc.staggered {
				c.leader()
			}
			c.startOn(2, trs[2])
			l := c.leader()
			t.Logf("%s leads", l.cfg.ID)
			// Each leader elected while the configuration is the bootstrap
			// entry proposes a check, and under load there may be several
			// (a leader with 50 ms timeouts loses its lease and another
			// takes over): a node counts one mismatch per check whose list
			// differs from its own. So the counts are read against the
			// checks in the log, not against the last leader's list alone:
			// until every node has applied every check the newest leader's
			// log holds up to the highest index any node applied.
			odd := 0
			boots := make([][]raft.Server, len(c.nodes))
			for i, n := range c.nodes {
				boot, ok := n.configEntry(bootstrapIndex)
				if !ok {
					t.Fatalf("%s's log holds no bootstrap entry", n.cfg.ID)
				}
				boots[i] = boot
				if leaders, _ := l.configEntry(bootstrapIndex); serverList(boot) != serverList(leaders) {
					odd++
				}
			}
			if odd == 0 {
				t.Fatal("every node's bootstrap entry equals the leader's: n3's list was not its own")
			}
			var state string
			counted := func() bool {
				leader := c.leaderNow()
				if leader == nil {
					return false
				}
				var upTo uint64
				for _, n := range c.nodes {
					upTo = max(upTo, n.fsm.LastCheck().Index)
				}
				checks, ok := configChecks(leader, upTo)
				if !ok || len(checks) == 0 {
					state = "no configuration check in the leader's log yet"
					return false
				}
				for i, n := range c.nodes {
					var want uint64
					for _, servers := range checks {
						if a, b := configDiff(boots[i], servers); len(a)+len(b) > 0 {
							want++
						}
					}
					if got := n.fsm.ConfigMismatches(); got != want {
						state = fmt.Sprintf("%s bootstrapped with %s, %d configuration checks up to index %d: %d mismatches counted, want %d",
							n.cfg.ID, serverList(boots[i]), len(checks), upTo, got, want)
						return false
					}
				}
				state = fmt.Sprintf("%d configuration checks up to index %d, counted as the lists say", len(checks), upTo)
				return true
			}
			deadline := time.Now().Add(20 * time.Second)
			for !counted() {
				if time.Now().After(deadline) {
					t.Fatalf("timed out after 20s waiting for every node to count the configuration checks it applied: %s", state)
				}
				time.Sleep(5 * time.Millisecond)
			}
			t.Log(state)
			// Each node exports its count (a later check may land between
			// the reads, so the sample lies between the count before and
			// after the scrape).
			for _, n := range c.nodes {
				before := n.fsm.ConfigMismatches()
				s, ok := gather(t, NewCollector(n))["kvrouter_configuration_mismatch_total{}"]
				after := n.fsm.ConfigMismatches()
				if !ok {
					t.Fatalf("%s exports no kvrouter_configuration_mismatch_total", n.cfg.ID)
				}
				if got := s.GetCounter().GetValue(); got < float64(before) || got > float64(after) {
					t.Errorf("%s: kvrouter_configuration_mismatch_total = %v, want its %d mismatches counted", n.cfg.ID, got, before)
				}
			}
		})
	}
}

// configChecks returns the lists the configuration checks in n's log up to
// index upTo carry, in log order, or false if n's log does not reach upTo
// (a deposed leader that has not heard yet).
func configChecks(n *Node, upTo uint64) ([][]raft.Server, bool) {
	first, err := n.logs.FirstIndex()
	if err != nil {
		return nil, false
	}
	var out [][]raft.Server
	for i := max(first, 1); i <= upTo; i++ {
		var l raft.Log
		if err := n.logs.GetLog(i, &l); err != nil {
			return nil, false
		}
		if l.Type != raft.LogCommand {
			continue
		}
		if c, err := decodeCommand(l.Data); err == nil && c.typ == cmdCheck && c.configIndex != 0 {
			out = append(out, c.config)
		}
	}
	return out, true
}
