package e2e

import (
	"encoding/json"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestKillLeaderUnderIngestLosesNothingAcknowledged is fault scenario 1
// (and 18): two publishers stream event batches through the client, which
// goes to any node (a follower forwards to the leader); the leader is
// killed with SIGKILL mid-stream; the publishers retry what was not
// acknowledged, with the same event ids. Afterwards a new leader serves,
// the index equals a model of the acknowledged events, every cursor is the
// last acknowledged id (nothing lost), every survivor counts each
// acknowledged event applied once and a request sent again, the latest
// included, all duplicates (nothing counted twice), and the killed node,
// restarted, converges to the same digest.
func TestKillLeaderUnderIngestLosesNothingAcknowledged(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	pubs, all := registeredPublishers(t, c.cl, seed)

	const perPublisher = 100 // acknowledged requests each
	var acked atomic.Int64
	var failed atomic.Bool
	errs := make([]error, len(pubs))
	ctx := ctxT(t, 90*time.Second)
	var wg sync.WaitGroup
	for i, p := range pubs {
		wg.Go(func() {
			for range perPublisher {
				if _, errs[i] = p.publishNext(ctx, c.cl); errs[i] != nil {
					failed.Store(true)
					return
				}
				acked.Add(1)
			}
		})
	}
	// Kill the leader once a third of the stream is acknowledged, while
	// both publishers have requests in flight.
	c.waitFor(30*time.Second, "a third of the stream acknowledged", func() (bool, string) {
		return acked.Load() >= perPublisher*int64(len(pubs))/3 || failed.Load(), ""
	})
	old, oldTerm := c.killLeader()
	killedAt := acked.Load()

	// kvctl status names the dead node and fails, with one line saying so.
	res := c.kvctl("status")
	if res.code != 1 || !strings.Contains(res.stdout, "UNREACHABLE") || !oneErrorLine(res.stderr) ||
		!strings.Contains(res.stderr, "1 of 3 endpoints did not answer") {
		t.Fatalf("%v\nwant exit 1, the dead node's row UNREACHABLE, one line on stderr", res)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("publisher %d: %v", i, err)
		}
	}
	retries, dups := totals(pubs)
	t.Logf("killed leader %s after %d acknowledged requests; %d requests retried, %d events acknowledged as duplicates",
		c.nodes[old].id, killedAt, retries, dups)
	if retries == 0 {
		t.Fatal("no request failed across the kill: the publishers did not stream through the failover")
	}

	// The survivors elect one of them (c.leader asks only the serving
	// nodes, so never names the killed one), in a later term than the
	// killed leader's.
	lead := c.leader()
	if term := c.term(lead); term <= oldTerm {
		t.Fatalf("the survivors' leader %s is in term %d, the killed leader %s led in term %d",
			c.nodes[lead].id, term, c.nodes[old].id, oldTerm)
	}
	c.converged()
	c.checkAll(all)

	// kvctl shows the same cursors: what an operator would look at.
	res = c.kvctl("workers", "-o", "json")
	if res.code != 0 {
		t.Fatalf("%v", res)
	}
	var ws []api.Worker
	if err := json.Unmarshal([]byte(res.stdout), &ws); err != nil {
		t.Fatalf("kvctl workers -o json: %v\n%s", err, res.stdout)
	}
	if err := all.checkWorkers(ws); err != nil {
		t.Fatalf("kvctl workers: %v", err)
	}

	// Nothing counted twice: every survivor applied each acknowledged event
	// once, retries across the kill included (checkAcks takes a retried
	// batch's events as applied or duplicates, whichever they were).
	c.appliedOnce(all)

	// A publisher that never got its acknowledgement sends the request
	// again: its batches are the ranks' latest (a retry across a failover),
	// or an old one's (a retry that came very late). The cursors drop every
	// event of them as a duplicate, and the survivors count none applied.
	for _, p := range pubs {
		for _, req := range [][]raftfsm.RankBatch{p.acked[len(p.acked)-1], p.acked[0]} {
			acks, _, err := publish(ctxT(t, 30*time.Second), c.cl, req)
			if err != nil {
				t.Fatal(err)
			}
			for i, a := range acks {
				if a.Applied != 0 || a.Dups != len(req[i].Events) || a.Cursor != all.ranks[req[i].Rank].cursor {
					t.Fatalf("re-sent batch of rank %v (event ids %d..%d) acknowledged as %+v, want all %d events duplicates at cursor %d",
						req[i].Rank, req[i].Events[0].EventID, req[i].Events[len(req[i].Events)-1].EventID, a,
						len(req[i].Events), all.ranks[req[i].Rank].cursor)
				}
			}
		}
	}
	c.converged()
	c.appliedOnce(all)

	// The killed node comes back, replays its log and catches up.
	c.restart(old)
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
}

// TestKillAllThreeAndRestartKeepsState is fault scenario 4: every node is
// killed with SIGKILL at once, with state that was applied but, in the FSM
// database, not necessarily synced. After a restart of all three the
// cluster has the same digest, the same index and the same cursors: an old
// batch sent again is acknowledged as duplicates, and the next one applies.
func TestKillAllThreeAndRestartKeepsState(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	p := newPublisher(seed, testRanks...)
	registerWorkers(t, c.cl, p.model)
	if err := p.publishN(ctxT(t, 60*time.Second), c.cl, 50); err != nil {
		t.Fatal(err)
	}
	applied, digest := c.converged()
	c.checkAll(p.model)
	before, err := c.nodes[0].cl.IndexStats(ctxT(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}

	c.kill9All()
	for i := range c.nodes {
		c.start(i)
	}
	c.waitAllReady()
	c.leader()
	applied2, digest2 := c.converged()
	if digest2 != digest || applied2 < applied {
		t.Fatalf("after restarting all three: digest %s at applied index %d, before the kill %s at %d",
			digest2, applied2, digest, applied)
	}
	c.checkAll(p.model)
	for i, n := range c.nodes {
		after, err := n.cl.IndexStats(ctxT(t, 10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		if indexState(after) != indexState(before) {
			t.Fatalf("%s index after the restart %+v, before %+v", c.nodes[i].id, indexState(after), indexState(before))
		}
	}

	// The cursors survived: an old batch is all duplicates ...
	old := p.acked[len(p.acked)/2]
	acks, _, err := publish(ctxT(t, 30*time.Second), c.cl, old)
	if err != nil {
		t.Fatal(err)
	}
	for i, a := range acks {
		if a.Applied != 0 || a.Dups != len(old[i].Events) || a.Cursor != p.model.ranks[old[i].Rank].cursor {
			t.Fatalf("old batch of rank %v acknowledged as %+v after the restart, want %d duplicates at cursor %d",
				old[i].Rank, a, len(old[i].Events), p.model.ranks[old[i].Rank].cursor)
		}
	}
	// ... and the stream goes on where it was.
	acks, err = p.publishNext(ctxT(t, 30*time.Second), c.cl)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range acks {
		if a.Dups != 0 {
			t.Fatalf("next batch of rank %v after the restart acknowledged as %+v, want no duplicates", a.Rank, a)
		}
	}
	c.converged()
	c.checkAll(p.model)
	c.statusAgrees()
}

// TestLeaderPausedPastElectionTimeout is fault scenario 11: the leader is
// stopped with SIGSTOP (it keeps its sockets, answers nothing) for longer
// than the election timeout. The other two elect a leader and serve
// writes; once resumed, the old leader steps down, follows and converges.
func TestLeaderPausedPastElectionTimeout(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	p := newPublisher(seed, testRanks...)
	registerWorkers(t, c.cl, p.model)
	if err := p.publishN(ctxT(t, 60*time.Second), c.cl, 20); err != nil {
		t.Fatal(err)
	}
	c.converged()

	old, oldTerm := c.leaderWithTerm()
	c.pause(old)
	// The other two elect one of them (c.leader asks only the serving
	// nodes: a paused one cannot answer) in a later term than the paused
	// leader's; the paused node's own view is checked once it is resumed.
	lead, leadTerm := c.leaderWithTerm()
	if leadTerm <= oldTerm {
		t.Fatalf("the serving nodes' leader %s is in term %d, the paused leader %s led in term %d",
			c.nodes[lead].id, leadTerm, c.nodes[old].id, oldTerm)
	}
	// Writes go to the two serving nodes: a paused node's sockets accept
	// connections and never answer, which a client can only time out on.
	var live []string
	for i, n := range c.nodes {
		if i != old {
			live = append(live, n.httpAddr)
		}
	}
	cl := newClient(t, live...)
	defer cl.Close()
	if err := p.publishN(ctxT(t, 60*time.Second), cl, 20); err != nil {
		t.Fatal(err)
	}
	c.converged()
	c.checkAll(p.model)

	// The resumed node follows the leader the serving nodes agree on:
	// lead, or one elected since (c.leader below tells them apart).
	c.resume(old)
	c.waitFor(leaderTimeout, c.nodes[old].id+" to follow the others' leader", func() (bool, string) {
		sts := c.statusAll()
		st, now := sts[old], sts[c.leader()]
		if st == nil || now == nil {
			return false, describe(sts)
		}
		return st.State == "Follower" && st.LeaderID == now.ID,
			st.State + " following " + st.LeaderID + "; the leader is " + now.ID
	})
	// Another leader now is one elected after lead's term (a loaded
	// machine misses heartbeats, and the resumed node, caught up, may win):
	// what must not be is a leader in lead's term or before, the resumed
	// node's stale lead among them.
	if got := c.leader(); got != lead {
		if term := c.term(got); term <= leadTerm {
			t.Fatalf("leader after the resume is %s in term %d, want %s (term %d) or one elected later",
				c.nodes[got].id, term, c.nodes[lead].id, leadTerm)
		}
		t.Logf("%s was elected after the resume, after %s's term %d", c.nodes[got].id, c.nodes[lead].id, leadTerm)
	}
	c.converged()
	c.checkAll(p.model)
	c.statusAgrees()
}
