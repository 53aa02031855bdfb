package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// transferLeader runs kvctl leader transfer, --to the voter named when to
// is set, and returns the leader kvctl names; the test fails unless it
// exits 0. Every other call reads the JSON, the others the table line an
// operator reads.
func (c *cluster) transferLeader(to string, asJSON bool) string {
	c.t.Helper()
	args := []string{"leader", "transfer"}
	if to != "" {
		args = append(args, "--to", to)
	}
	if asJSON {
		args = append(args, "-o", "json")
	}
	res := c.kvctl(args...)
	if res.code != 0 || res.stderr != "" {
		c.t.Fatalf("%v\nwant exit 0 and nothing on stderr", res)
	}
	if !asJSON {
		got, ok := strings.CutPrefix(strings.TrimSpace(res.stdout), "leadership transferred to ")
		if !ok || strings.ContainsAny(got, " \n") {
			c.t.Fatalf("%v\nwant one line, leadership transferred to ID", res)
		}
		return got
	}
	var out struct {
		Leader string `json:"leader"`
	}
	if err := json.Unmarshal([]byte(res.stdout), &out); err != nil || out.Leader == "" {
		c.t.Fatalf("%v\nwant {\"leader\": ID}: %v", res, err)
	}
	return out.Leader
}

// ledAfterTransfer waits until the serving nodes agree on a leader after
// kvctl leader transfer moved the lead, held in term from, to node to
// (kvctl exited 0: it saw to take over), and fails the test unless to
// leads in a later term, or another node leads in a term after the
// transfer's. The transfer's election is term from+1 (TimeoutNow starts
// it at once); on Raft's 200 ms lease a loaded machine can hold another
// election before the nodes are asked, and its leader, in a later term,
// is no transfer gone astray. A node other than to leading in term
// from+1 is one.
func (c *cluster) ledAfterTransfer(to int, from uint64) {
	c.t.Helper()
	if to < 0 {
		c.t.Fatalf("after the transfer from the leader of term %d: kvctl named no node of the cluster", from)
	}
	lead, term := c.leaderWithTerm()
	if term <= from || lead != to && term <= from+1 {
		c.t.Fatalf("after the transfer to %s, from the leader of term %d: %s leads in term %d",
			c.nodes[to].id, from, c.nodes[lead].id, term)
	}
	if lead != to {
		c.t.Logf("after the transfer to %s, from the leader of term %d: an election made %s leader in term %d",
			c.nodes[to].id, from, c.nodes[lead].id, term)
	}
}

// TestLeadershipTransfersUnderTheStream is fault scenario 12, leadership
// transfer under load: two publishers stream event batches through every
// node (retrying what was not acknowledged, on the next node) while an
// operator moves the leadership four times with kvctl leader transfer,
// twice --to a named follower and twice to any voter. Each transfer is
// answered (exit 0, naming the new leader, the named one when there is
// one, in a later term), every node agrees on it, and the publishers get
// requests acknowledged after each. Afterwards every node holds exactly
// what was acknowledged, at one applied index with one digest, each
// event applied once.
func TestLeadershipTransfersUnderTheStream(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	pubs, all := registeredPublishers(t, c.cl, seed)

	s := newStream(t, ctxT(t, 2*convergeTimeout))
	s.publish(c, pubs)
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the first transfer")

	var took []string
	for k := range 4 {
		old, oldTerm := c.leaderWithTerm()
		to := ""
		if k%2 == 0 {
			// Each follower in turn, across the two named transfers.
			to = c.nodes[c.others(old)[k/2]].id
		}
		atTransfer := s.acked.Load()
		start := time.Now()
		got := c.transferLeader(to, k < 2)
		took = append(took, fmt.Sprintf("%s to %s (asked --to %q) in %v", c.nodes[old].id, got, to,
			time.Since(start).Round(time.Millisecond)))
		switch {
		case got == c.nodes[old].id:
			t.Fatalf("transfer %d: kvctl names %s, the leader that handed over, as the new one", k+1, got)
		case to != "" && got != to:
			t.Fatalf("transfer %d: kvctl names %s, asked --to %s", k+1, got, to)
		}
		c.ledAfterTransfer(slices.IndexFunc(c.nodes, func(n *node) bool { return n.id == got }), oldTerm)
		s.ackedAtLeast(c, atTransfer+20, fmt.Sprintf("20 requests acknowledged after transfer %d", k+1))
	}
	s.wait(t)

	retries, dups := totals(pubs)
	t.Logf("transfers: %s; %d requests acknowledged in all; %d requests retried, %d events acknowledged as duplicates",
		strings.Join(took, ", "), s.acked.Load(), retries, dups)
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	// No node restarted, and none was sent a snapshot: each applied every
	// acknowledged event once.
	c.appliedOnce(all)
}

// layOutJoiner adds a node that is not started yet and will join the
// running cluster with --join (node.join, set when it starts), and returns
// its position. The stream's writers read c.nodes, so every node a test
// adds is laid out before the stream starts; they pass over one that does
// not run yet, as over a stopped one.
func (c *cluster) layOutJoiner(id string) int {
	c.t.Helper()
	ports := freePorts(c.t, 3)
	n := &node{id: id, raftAddr: ports[0], httpAddr: ports[1], natsAddr: ports[2],
		dir: filepath.Join(c.base, id), logPath: filepath.Join(c.base, id+".log")}
	n.cl = c.newClient(n.httpAddr)
	c.nodes = append(c.nodes, n)
	return len(c.nodes) - 1
}

// join starts node i with --join naming members' HTTP addresses, as
// docs/operations.md "Add a node" does, and waits until kvctl members list
// shows it a voter and it is ready (it has applied what the leader had
// committed when it first heard from it).
func (c *cluster) join(i int, members []int) {
	c.t.Helper()
	n := c.nodes[i]
	var addrs []string
	for _, m := range members {
		addrs = append(addrs, c.nodes[m].httpAddr)
	}
	n.join = strings.Join(addrs, ",")
	c.start(i)
	c.waitFor(readyTimeout, "kvctl members list to show "+n.id+" a voter", func() (bool, string) {
		if again, why := c.restartIfPortTaken(i); again {
			return false, why
		}
		res := c.kvctl("members", "list", "-o", "json")
		if res.code != 0 {
			return false, res.String()
		}
		var ms []raftfsm.Member
		if err := json.Unmarshal([]byte(res.stdout), &ms); err != nil {
			c.t.Fatalf("kvctl members list -o json: %v\n%s", err, res.stdout)
		}
		k := slices.IndexFunc(ms, func(m raftfsm.Member) bool { return m.ID == n.id })
		return k >= 0 && ms[k].Voter, strings.TrimSpace(res.stdout)
	})
	c.waitReady(i)
	c.t.Logf("%s joined through %s", n.id, n.join)
}

// removeMember runs kvctl members remove ID; the test fails unless it
// exits 0 saying so.
func (c *cluster) removeMember(i int) {
	c.t.Helper()
	id := c.nodes[i].id
	res := c.kvctl("members", "remove", id)
	if res.code != 0 || res.stderr != "" || res.stdout != "removed member "+id+"\n" {
		c.t.Fatalf("%v\nwant exit 0 and removed member %s", res, id)
	}
	c.t.Logf("removed %s", id)
}

// leaveRemoved checks node i, just removed from the cluster, as
// docs/operations.md "Remove a node" describes it: its process stays up,
// is not ready (/readyz 503) and refuses writes (503 no_leader), and once
// it has seen its removal it reports itself removed: kvctl status shows
// READY removed with a warning to stop it. Then it is stopped as the docs
// say, and is no member from then on (left out of kvctl's --endpoints).
//
// A removed follower sees its removal only if the entry that removes it
// reached it before the leader stopped replicating to it, which is not
// always so (raftfsm's TestReadyNeedsALeaderAndMembership): one that did
// not still counts itself a voter and stands for election again and
// again, a Candidate that knows no leader, whose pre-votes the members
// refuse (it is not in their configuration). That is taken as removed
// too, and logged; a node that has seen its removal never campaigns.
// Asked alone, kvctl status shows it READY no, without the warning; beside
// the members, READY removed with it, as for a node that saw its removal.
func (c *cluster) leaveRemoved(i int, seed uint64) {
	c.t.Helper()
	n := c.nodes[i]
	var sawRemoval bool
	c.waitFor(leaderTimeout, n.id+" to be not ready, and removed or a candidate refused", func() (bool, string) {
		st := c.status(i)
		if st == nil {
			return false, "no answer"
		}
		sawRemoval = st.Removed
		return !st.Ready && st.LeaderID == "" && (st.Removed || st.State == "Candidate"),
			describe([]*raftfsm.NodeStatus{st}) + fmt.Sprintf(" removed %v", st.Removed)
	})
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	r, err := n.cl.Ready(ctx)
	cancel()
	if err != nil || r.Ready {
		c.t.Fatalf("%s removed: readyz %+v, %v; want not ready", n.id, r, err)
	}
	res := runKvctl(c.t, "--endpoints", n.httpAddr, "status")
	warned := strings.Contains(res.stderr, "was removed from the cluster")
	if res.code != 0 || strings.Contains(res.stdout, " removed") != sawRemoval || warned != sawRemoval {
		c.t.Fatalf("%v\nwant exit 0, and READY removed with the warning to stop it only if it reports itself removed (%v)", res, sawRemoval)
	}
	// Beside the members, kvctl status shows it READY removed with the
	// warning whether it saw its removal or not (the leader's
	// configuration leaves it out), and members list with it first in
	// --endpoints reads a member's view, not its own. While no leader
	// answers (an election after the leader's own removal) kvctl claims
	// nothing, and reads its view with a warning: polled.
	eps := []string{n.httpAddr}
	for _, m := range c.nodes {
		if m.serving() && m != n {
			eps = append(eps, m.httpAddr)
		}
	}
	c.waitFor(leaderTimeout, "kvctl status to show "+n.id+" READY removed with the warning", func() (bool, string) {
		res := runKvctl(c.t, "--endpoints", strings.Join(eps, ","), "status")
		for _, l := range strings.Split(res.stdout, "\n") {
			if f := strings.Fields(l); len(f) > 1 && f[1] == n.id {
				return res.code == 0 && slices.Contains(f, "removed") &&
					strings.Contains(res.stderr, n.id+" ("+n.httpAddr+") was removed from the cluster"), res.String()
			}
		}
		return false, res.String()
	})
	c.waitFor(leaderTimeout, "kvctl members list with "+n.id+" first to leave it out", func() (bool, string) {
		res := runKvctl(c.t, "--endpoints", strings.Join(eps, ","), "members", "list", "-o", "json")
		var ms []raftfsm.Member
		if res.code != 0 || json.Unmarshal([]byte(res.stdout), &ms) != nil {
			return false, res.String()
		}
		return res.stderr == "" && !slices.ContainsFunc(ms, func(m raftfsm.Member) bool { return m.ID == n.id }), res.String()
	})
	// A write sent to it is refused. Its events (ids from 1 of a rank
	// registered) are duplicates anyway, should it take and forward it.
	// It has a call's time of its own: the kvctl runs and polls above
	// can outlast one (a timeout is no refusal).
	req := newPublisher(seed, testRanks[0]).request()
	ctx, cancel = context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	if _, err := n.cl.IngestEvents(ctx, req); !isRefusal(err) {
		c.t.Fatalf("%s removed: a write sent to it answered %v; want 503 no_leader", n.id, err)
	}
	c.stop(i)
	n.removed = true
	if sawRemoval {
		c.t.Logf("%s reported itself removed and refused a write; stopped it", n.id)
	} else {
		c.t.Logf("%s did not see its removal: a candidate the members refuse, not ready, refusing writes; kvctl status showed READY no, no warning, asked alone, and READY removed with the warning beside the members; stopped it", n.id)
	}
}

// removedLeading waits until node i, just removed with kvctl members
// remove, reports itself removed or stands for election, and reports
// whether it led when it was removed: a leader removing itself stops its
// Raft (Shutdown) before kvctl is answered, a follower's goes on.
func (c *cluster) removedLeading(i int) bool {
	c.t.Helper()
	var led bool
	c.waitFor(leaderTimeout, c.nodes[i].id+" to report itself removed, or to stand for election", func() (bool, string) {
		st := c.status(i)
		if st == nil {
			return false, "no answer"
		}
		led = st.State == "Shutdown"
		return led || st.Removed || st.State == "Candidate", describe([]*raftfsm.NodeStatus{st}) + fmt.Sprintf(" removed %v", st.Removed)
	})
	return led
}

// TestMembershipChangesUnderTheStream is fault scenario 13 as an operator
// does it with kvctl, under a stream of event batches through every node
// (retrying what was not acknowledged, on the next node):
// docs/operations.md's procedures, followed step by step. A follower is
// removed (kvctl members remove), reports itself removed, refuses writes
// and is stopped; a fresh node n4 is started with --join naming the
// original members (the removed one among them, down) and becomes a voter
// and ready; kvctl members add of it again succeeds at once, as for a
// running voter; then the leader itself is removed directly: it steps
// down, the others elect a new leader in a later term, and it reports
// itself removed and is stopped. A second fresh node, n5, joins the two
// left, so the cluster ends at three voters, an odd number as the docs
// advise. The publishers are acknowledged after every step. Afterwards
// the three members hold exactly what was acknowledged, at one applied
// index with one digest; kvctl members list and kvctl status show those
// three; the member that ran throughout applied each acknowledged event
// once, and so did the new ones unless they were sent a snapshot.
func TestMembershipChangesUnderTheStream(t *testing.T) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	n4, n5 := c.layOutJoiner("n4"), c.layOutJoiner("n5")
	// Spares replace a follower removed in the leader's stead (below);
	// no member until one joins.
	spares := []int{c.layOutJoiner("n6"), c.layOutJoiner("n7")}
	for _, i := range spares {
		c.nodes[i].removed = true
	}
	pubs, all := registeredPublishers(t, c.cl, seed)

	s := newStream(t, ctxT(t, 3*convergeTimeout))
	s.publish(c, pubs)
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the first change")

	original := []int{0, 1, 2}
	lead := c.leader()
	follower := c.others(lead)[0]
	at := s.acked.Load()
	c.removeMember(follower)
	c.leaveRemoved(follower, seed)
	s.ackedAtLeast(c, at+20, "20 requests acknowledged after the follower's removal")

	at = s.acked.Load()
	c.join(n4, original)
	// Adding a running voter again with its addresses succeeds at once
	// (docs/kvctl.md, members add).
	j := c.nodes[n4]
	if res := c.kvctl("members", "add", j.id, j.raftAddr, j.httpAddr); res.code != 0 ||
		!strings.HasPrefix(res.stdout, "added member "+j.id) {
		t.Fatalf("%v\nwant exit 0: %s is a running voter", res, j.id)
	}
	s.ackedAtLeast(c, at+20, "20 requests acknowledged after n4 joined")

	// The leader's removal. kvctl removes the node found leading at
	// whichever node leads when it runs: an election in between (Raft's
	// 200 ms lease on a loaded machine) made it remove a follower, and the
	// test passed without a leader's removal. A leader that removes itself
	// stops its Raft before kvctl is answered (raftfsm's RemoveMember), so
	// the node removed reports Shutdown if it led; one that reports itself
	// removed otherwise, or stands for election, was a follower. It is left
	// as the first one was, a spare joins in its place, and the removal of
	// the leader of the moment is tried again.
	var oldTerm uint64
	var alsoRemoved, joined []int
	for try := 0; ; try++ {
		lead, oldTerm = c.leaderWithTerm()
		at = s.acked.Load()
		c.removeMember(lead)
		if c.removedLeading(lead) {
			break
		}
		if try == len(spares) {
			t.Fatalf("%s, found leading in term %d, was a follower when kvctl removed it, as %d before it were: an election came between each time",
				c.nodes[lead].id, oldTerm, try)
		}
		t.Logf("%s, found leading in term %d, was a follower when kvctl removed it: an election came between; %s joins in its place, and the leader's removal is tried again",
			c.nodes[lead].id, oldTerm, c.nodes[spares[try]].id)
		c.leaveRemoved(lead, seed)
		alsoRemoved = append(alsoRemoved, lead)
		var members []int
		for i, n := range c.nodes {
			if n.serving() && !n.removed {
				members = append(members, i)
			}
		}
		c.nodes[spares[try]].removed = false
		c.join(spares[try], members)
		joined = append(joined, spares[try])
	}
	var left []int
	for i, n := range c.nodes {
		if n.serving() && i != lead {
			left = append(left, i)
		}
	}
	newLead := c.leaderAmong(left)
	if term := c.term(newLead); term <= oldTerm {
		t.Fatalf("%s leads in term %d after the removal of %s, which led in term %d",
			c.nodes[newLead].id, term, c.nodes[lead].id, oldTerm)
	}
	c.leaveRemoved(lead, seed)
	s.ackedAtLeast(c, at+20, "20 requests acknowledged after the leader's removal")

	at = s.acked.Load()
	c.join(n5, left)
	s.ackedAtLeast(c, at+20, "20 requests acknowledged after n5 joined")
	s.wait(t)

	retries, dups := totals(pubs)
	final := c.leader()
	t.Logf("removed %s (a follower) and %s (the leader), added n4 and n5; leader %s; %d requests acknowledged in all; %d requests retried, %d events acknowledged as duplicates",
		c.nodes[follower].id, c.nodes[lead].id, c.nodes[final].id, s.acked.Load(), retries, dups)
	for k, i := range alsoRemoved {
		t.Logf("also removed %s, a follower when removed in the leader's stead, and added %s", c.nodes[i].id, c.nodes[joined[k]].id)
	}
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	if ok, seen := c.membersAre(convergeTimeout); !ok {
		t.Fatalf("kvctl members list: %s; want the three members at their addresses", seen)
	}
	var ranThroughout []int
	for _, i := range original {
		if i != follower && i != lead && !slices.Contains(alsoRemoved, i) {
			ranThroughout = append(ranThroughout, i)
		}
	}
	c.appliedOnceAt(all, ranThroughout)
	// A joined node replays the log from its first entry unless the
	// leader sent it a snapshot, whose events are not counted.
	for _, i := range append([]int{n4, n5}, joined...) {
		if applied, restore := c.appliedCounts(i); restore != "" {
			t.Logf("%s was sent a snapshot (restored in %ss): its count of events applied is not checked", c.nodes[i].id, restore)
		} else if applied != float64(ackedEvents(all)) {
			t.Fatalf("%s applied %v events; %d were acknowledged, each to be applied once", c.nodes[i].id, applied, ackedEvents(all))
		}
	}
}
