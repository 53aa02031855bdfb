package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/kvevent"
)

// chaosRounds is how many faults the chaos soak injects unless
// KVROUTER_CHAOS_ROUNDS says otherwise: a round takes about a second (a
// kill, a partition or a one-way cut) to six (a pause, which the
// publishers wait out a call timeout on, or a restore), so the default
// runs about a minute and a half on a two-core machine, under -race.
const chaosRounds = 30

// ackedPerFault is how many requests the publishers must get acknowledged
// while a fault lasts: the majority serves writes through it, not only
// after it, and the node the fault hit has that much to catch up on.
const ackedPerFault = 50

// A chaosFault is one kind of fault the soak injects; each round picks one.
type chaosFault int

// There is no round of two faults at once: with three nodes any two of
// these would leave no majority, and the round's rule is that the
// majority writes on through the fault. A restore round's kill is its
// one fault: the restore goes through the majority, the way an operator
// restores while a node is down.
//
// The restore round is a run's last, and its only one: the partition
// proxies route each node's Raft traffic by that node's own --peers
// (raftHub), and a restore hands every node the leader's Raft
// configuration, the leader's view of the proxies. After it a node other
// than the leader would dial its peers through the leader's links, and
// would not start again (it is listed at a proxy's address, not its
// --raft-addr): no partition, cut or restart can follow.
const (
	faultKill      chaosFault = iota // SIGKILL a random node, then restart it
	faultPartition                   // cut a random node off from the others, then heal
	faultPause                       // SIGSTOP the leader past the election timeout, then SIGCONT
	faultOneWay                      // cut one directed raft link of the leader's, then heal
	faultRestore                     // SIGKILL a random node, save and restore a snapshot through the others, restart it
	numFaults
)

func (f chaosFault) String() string {
	return [...]string{"kill -9", "partition", "pause", "one-way cut", "restore"}[f]
}

// drawFault is round's fault: a restore for the run's last round (see
// faultRestore), else one of the other kinds, each as likely.
func drawFault(rng *rand.Rand, round, rounds int) chaosFault {
	if round == rounds {
		return faultRestore
	}
	return chaosFault(rng.IntN(int(faultRestore)))
}

// publishGate lets the soak stop the publishers between two requests, so
// that every node can reach the same applied index while nobody writes:
// each publisher's request holds the read side until it is acknowledged,
// and the check between rounds takes the write side.
type publishGate struct{ mu sync.RWMutex }

// quiesced runs f once no publisher has a request in flight, and lets them
// go on after it, however f ends (a t.Fatal in f included). The wait for
// the publishers has the stream's deadline: a request that can never be
// acknowledged fails the test instead of hanging it.
func (g *publishGate) quiesced(c *cluster, s *stream, f func()) {
	c.t.Helper()
	locked, release := make(chan struct{}), make(chan struct{})
	// The lock is taken in a goroutine of the stream, so that a test that
	// fails before it is taken leaves nothing behind: it takes it later,
	// sees the release and lets go at once.
	s.wg.Go(func() {
		g.mu.Lock()
		close(locked)
		<-release
		g.mu.Unlock()
	})
	defer close(release)
	s.until(c, "every publisher's request in flight acknowledged", func() (bool, string) {
		select {
		case <-locked:
			return true, ""
		default:
			return false, "a request in flight"
		}
	})
	f()
}

// chaosRoundsFromEnv is KVROUTER_CHAOS_ROUNDS, or chaosRounds when unset.
func chaosRoundsFromEnv(t *testing.T) int {
	t.Helper()
	v := os.Getenv("KVROUTER_CHAOS_ROUNDS")
	if v == "" {
		return chaosRounds
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("KVROUTER_CHAOS_ROUNDS=%q: want a number of rounds > 0", v)
	}
	return n
}

// appliedCounts is node i's count of events applied
// (kvrouter_events_applied_total{outcome="applied"}) and the time its
// last snapshot restore took (kvrouter_restore_duration_seconds), "" when
// its state machine has restored none since its process started: a
// follower that fell behind the leader's log is sent the leader's
// snapshot instead of the entries, and the restored state's events are
// not counted.
func (c *cluster) appliedCounts(i int) (applied float64, restore string) {
	c.t.Helper()
	ss := scrape(c.t, "http://"+c.nodes[i].httpAddr+"/metrics")
	for _, s := range ss {
		if s.name == "kvrouter_restore_duration_seconds" {
			restore = strconv.FormatFloat(s.value, 'g', -1, 64)
		}
	}
	return ss.sum("kvrouter_events_applied_total", "outcome", "applied"), restore
}

// onceSince is where the soak's applied-once check of a node restarted
// from: the node's count of events applied and the acknowledged events
// at a check after its restart, and its snapshot restore then.
type onceSince struct {
	applied float64
	events  int64
	restore string
	round   int
}

// TestChaosSoakLosesNothingAcknowledged is the chaos soak of make
// test-long: two publishers stream event batches through a three-node
// cluster (each request sent again, on the next node, until acknowledged)
// and a router routes through the nodes in turn, while a fault loop,
// driven by a seeded random source, injects one fault a round: a random
// node killed with SIGKILL and restarted, a random node cut off from the
// others through the partition proxies and healed, the leader stopped with
// SIGSTOP until the others elect a new one and resumed, or one directed
// raft link of the leader's cut (leader to a follower, or a follower to
// the leader) and healed; the last round (faultRestore) is an online
// restore with a member down: a random node killed with SIGKILL, then, the
// publishers held still from the save to the restore's end, kvctl snapshot
// save and kvctl snapshot restore of the file through the other two nodes'
// endpoints, and the killed node restarted, to catch up on the restored
// state by the leader's snapshot or its log; the two live nodes, then the
// restarted one, must hold it, every rank flagged for a resync, before any
// write (a restore that installed nothing shows there). The publishers hold still so
// that the state saved is the state acknowledged: the restore rolls
// nothing back, and the model only flags every rank as needing a resync,
// as the restore does. During every fault the majority keeps acknowledging
// writes (a restore round's until the publishers are held still for the
// save). After every round the cluster has one leader and, once the
// publishers hold still (each with its request in flight acknowledged),
// every node the same digest at the same applied index and exactly what
// was acknowledged, and each node applied every acknowledged event exactly
// once: one whose process has run since the start (never killed; a pause
// or a cut keeps it) and that restored no snapshot counts every one, a
// restarted one, or one that restored a snapshot (every node after a
// restore round), those acknowledged since the first check after its
// restart or restore; so at the end.
//
// A one-way cut is of who can call whom: a raft connection carries its
// dialer's requests and the answers to them, so with the leader's link to
// a follower cut the follower hears no heartbeat and stands for election,
// which the leader and the other follower refuse while they hear their
// leader (hashicorp/raft's leader stickiness, pre-vote included): the
// leader writes on with the other follower, and the cut one, a
// candidate with no leader, refuses writes. With a follower's link to
// the leader cut nothing changes while the leader leads: a follower
// calls nobody, the leader's heartbeats and entries reach it and are
// answered on the leader's own connections; only an election needs the
// cut direction. So the leader then hands its leadership to the cut
// follower (a leadership transfer, asked again until it takes): the new
// leader cannot reach the old one, which hears no heartbeat and loses its
// leader, and the new leader writes on with the third node.
//
// Errors during a fault are expected: only acknowledged requests are in
// the model, and a request sent again carries the same event ids, so
// whatever part of it applied before the error comes back as duplicates.
func TestChaosSoakLosesNothingAcknowledged(t *testing.T) {
	if os.Getenv("KVROUTER_LONG") == "" {
		t.Skip("chaos soak: runs under KVROUTER_LONG=1 (make test-long)")
	}
	rounds := chaosRoundsFromEnv(t)
	seed := seedOf()
	t.Logf("seed %d, %d rounds; KVROUTER_LONG=1 KVROUTER_CHAOS_ROUNDS=%d go test ./e2e/ -run '^%s$' -seed %d replays the faults and the event streams",
		seed, rounds, rounds, t.Name(), seed)
	rng := rand.New(rand.NewPCG(seed, 0x6368616f73)) // "chaos"
	start := time.Now()

	c, h := startPartitionedCluster(t, 3)
	pubs, all := registeredPublishers(t, c.cl, seed)
	registered := map[kvevent.Rank]bool{}
	for r := range all.ranks {
		registered[r] = true
	}

	// Budget of the whole stream: a request that no node acknowledges
	// within it fails the test (stream.until notices).
	s := newStream(t, ctxT(t, time.Duration(rounds)*(leaderTimeout+2*convergeTimeout)+2*time.Minute))
	var gate publishGate
	for i, p := range pubs {
		at := i % len(c.nodes)
		s.loop(func(ctx context.Context) error {
			gate.mu.RLock()
			defer gate.mu.RUnlock()
			if err := c.publishAny(ctx, p, &at); err != nil {
				return fmt.Errorf("publisher %d: %w", i, err)
			}
			s.acked.Add(1)
			return nil
		})
	}

	// The router asks each node in turn to route a prompt nobody holds,
	// through one client per node: a node that is down, cut off or paused
	// fails its calls, which count but are no error. A node that answers
	// must name only registered ranks as candidates.
	var routed, routeErrs atomic.Int64
	routeRNG := rand.New(rand.NewPCG(seed, 0x726f757465)) // "route"; only the router's goroutine draws from it
	next := 0
	s.loop(func(ctx context.Context) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond): // a client's pace, not a wait for a condition
		}
		n := c.nodes[next]
		next = (next + 1) % len(c.nodes)
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		defer cancel()
		res, err := n.cl.Route(cctx, api.RouteRequest{BlockHashes: []uint64{routeRNG.Uint64(), routeRNG.Uint64()}})
		if err != nil {
			routeErrs.Add(1)
			return nil
		}
		for _, cand := range res.Candidates {
			if !registered[kvevent.Rank{Worker: cand.WorkerID, DP: cand.DPRank}] {
				return fmt.Errorf("router: %s named rank %d/%d, which no worker registered, as a candidate", n.id, cand.WorkerID, cand.DPRank)
			}
		}
		routed.Add(1)
		return nil
	})
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the first fault")

	// Nothing applied twice. once holds the nodes whose process has run
	// since the cluster started (a pause or a cut keeps it): their count
	// of events applied is every acknowledged event, each once
	// (appliedOnceAt). A kill takes a node out of it for good: the count
	// restarts, and the restarted node replays only the log after its
	// last snapshot. So does a snapshot restore, which installs events
	// without counting them (with --snapshot-threshold at 8192 entries and
	// 10240 kept after a snapshot a round's lag never calls for one, but
	// the check must not fail a node for it if it does), and a restore
	// round's, which every node installs. Such a node is
	// checked from the first check after (since): what it counted since
	// then must be what was acknowledged since then.
	once := map[int]bool{}
	for i := range c.nodes {
		once[i] = true
	}
	since := map[int]*onceSince{}
	checkOnce := func(round int) (checked int) {
		events := ackedEvents(all)
		var idx []int
		for i, n := range c.nodes {
			got, restore := c.appliedCounts(i)
			if once[i] && restore != "" {
				t.Logf("%s restored a snapshot (in %ss): its count of events applied no longer covers every event", n.id, restore)
				once[i] = false
			}
			if once[i] {
				idx = append(idx, i)
				continue
			}
			b := since[i]
			if b == nil || b.restore != restore {
				since[i] = &onceSince{applied: got, events: events, restore: restore, round: round}
				continue
			}
			if got-b.applied != float64(events-b.events) {
				t.Fatalf("%s applied %v events since the check of round %d; %d were acknowledged since, each to be applied once",
					n.id, got-b.applied, b.round, events-b.events)
			}
			checked++
		}
		c.appliedOnceAt(all, idx)
		return checked + len(idx)
	}

	var faults [numFaults]int
	leaderCuts := 0 // one-way cuts of the leader's link to a follower
	for round := 1; round <= rounds; round++ {
		f := drawFault(rng, round, rounds)
		faults[f]++
		began, ackedBefore, routedBefore := time.Now(), s.acked.Load(), routed.Load()
		lead := c.leader()
		var victim int
		what := ""
		switch f {
		case faultKill:
			victim = rng.IntN(len(c.nodes))
			once[victim] = false
			delete(since, victim)
			c.kill9(victim)
			c.leaderAmong(c.others(victim))
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged with %s down", ackedPerFault, c.nodes[victim].id))
			c.restart(victim)
		case faultPartition:
			victim = rng.IntN(len(c.nodes))
			h.isolate(victim)
			c.leaderAmong(c.others(victim))
			// The cut is long enough to matter: the node noticed it, a
			// leader stepped down, a follower lost its leader.
			c.waitFor(leaderTimeout, c.nodes[victim].id+" to notice it is cut off", func() (bool, string) {
				st := c.status(victim)
				if st == nil {
					return false, "no answer"
				}
				return st.State != "Leader" && st.LeaderID == "", st.State + " following " + st.LeaderID
			})
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged with %s cut off", ackedPerFault, c.nodes[victim].id))
			h.heal()
		case faultPause:
			victim = lead
			c.pause(victim)
			// The majority elects one of its own: the pause lasts past the
			// election timeout.
			c.leaderAmong(c.others(victim))
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged with %s paused", ackedPerFault, c.nodes[victim].id))
			c.resume(victim)
		case faultOneWay:
			fs := c.others(lead)
			victim = fs[rng.IntN(len(fs))]
			from, to, dir := lead, victim, "leader→follower"
			if rng.IntN(2) == 1 {
				from, to, dir = victim, lead, "follower→leader"
			}
			link := h.links[from][to]
			before := link.Stats()
			h.cut(from, to)
			if from == lead {
				leaderCuts++
				// The follower hears no heartbeat and loses its leader;
				// the leader keeps the other follower, which refuses
				// the cut one's votes while it hears its leader.
				c.waitFor(leaderTimeout, c.nodes[victim].id+" to lose its leader through the cut", func() (bool, string) {
					st := c.status(victim)
					if st == nil {
						return false, "no answer"
					}
					return st.LeaderID == "", st.State + " following " + st.LeaderID
				})
				c.leaderAmong(c.others(victim))
			} else {
				// Raft dials this direction only in an election: the
				// leader opens every connection its replication needs,
				// and the follower's answers ride back on them. So the
				// leader hands its leadership to the cut follower, which
				// then leads without reaching its old leader: that one
				// hears no heartbeat and loses its leader, and the other
				// follower makes the majority. (A transfer that fails,
				// say the follower's campaign ran past its timeout, is
				// asked for again.)
				c.waitFor(leaderTimeout, c.nodes[victim].id+" to lead, handed leadership across the cut", func() (bool, string) {
					st := c.status(victim)
					if st != nil && st.State == "Leader" {
						return true, ""
					}
					// Asked of whichever node leads now: the old leader, or
					// one a failed transfer left leading.
					at := -1
					sts := c.statusAll()
					for i, st := range sts {
						if st != nil && st.State == "Leader" && (at < 0 || st.Term > sts[at].Term) {
							at = i
						}
					}
					if at < 0 {
						return false, "no leader to ask"
					}
					ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
					defer cancel()
					if err := c.nodes[at].cl.TransferLeader(ctx, c.nodes[victim].id); err != nil {
						return false, "transfer asked of " + c.nodes[at].id + ": " + err.Error()
					}
					return false, "transfer asked of " + c.nodes[at].id
				})
				c.waitFor(leaderTimeout, c.nodes[lead].id+" to lose its leader through the cut", func() (bool, string) {
					st := c.status(lead)
					if st == nil {
						return false, "no answer"
					}
					return st.State != "Leader" && st.LeaderID == "", st.State + " following " + st.LeaderID
				})
				if got := c.leaderAmong(c.others(lead)); got != victim {
					t.Fatalf("after the handoff across the cut %s leads, want %s", c.nodes[got].id, c.nodes[victim].id)
				}
			}
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged with %s cut", ackedPerFault, h.linkName(from, to)))
			// What the cut did, for the log: the connections the link
			// refused, and how the node the cut kept from its leader (the
			// follower, or after a handoff the old leader) saw it.
			lost := victim
			if from != lead {
				lost = lead
			}
			after, seen := link.Stats(), "no answer"
			if st := c.status(lost); st != nil {
				seen = st.State + " following " + strconv.Quote(st.LeaderID)
			}
			what = fmt.Sprintf("%s (%s; cut=%v, %d connections refused, %s at the end)",
				h.linkName(from, to), dir, link.IsCut(), after.Refused-before.Refused, c.nodes[lost].id+" "+seen)
			h.heal()
		case faultRestore:
			victim = rng.IntN(len(c.nodes))
			role := "follower"
			if victim == lead {
				role = "leader"
			}
			once[victim] = false
			delete(since, victim)
			c.kill9(victim)
			majority := c.others(victim)
			c.leaderAmong(majority)
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged with %s down", ackedPerFault, c.nodes[victim].id))
			var eps, ids []string
			for _, i := range majority {
				eps = append(eps, c.nodes[i].httpAddr)
				ids = append(ids, c.nodes[i].id)
			}
			via := strings.Join(eps, ",")
			gate.quiesced(c, s, func() {
				// Nothing is written from here to the restore's end, so the
				// state saved is the state acknowledged: the leader applies a
				// request before it acknowledges it, and the save streams
				// the leader's state.
				acked, _ := c.converged()
				snap := c.saveSnapshotVia(via, t.TempDir())
				if snap.index < acked {
					t.Fatalf("round %d: kvctl snapshot save saved the state at index %d, behind the index %d the nodes had applied with the publishers held still: it is not the state acknowledged",
						round, snap.index, acked)
				}
				res := c.kvctlVia(via, "snapshot", "restore", snap.path)
				want := "restored " + snap.path + " to the cluster (index " + strconv.FormatUint(snap.index, 10) + ","
				if res.code != 0 || !strings.HasPrefix(res.stdout, want) {
					t.Fatalf("round %d: restore with %s down: %v\nwant exit 0 and stdout starting %q", round, c.nodes[victim].id, res, want)
				}
				all.restored() // every rank flagged for a resync
				// Each live node installed the restore: the file is the
				// live state, so only the restore's resync flags, on every
				// rank, tell the two apart, and the writes after the round
				// clear them rank by rank (an agent's dump); a restore that
				// installed nothing passed a round whose writes cleared
				// every rank. Checked here, before any write, on the two
				// live nodes, and on the killed one once restarted.
				c.converged()
				c.checkAll(all)
				// Every node installs the restored state, whose events it
				// does not count: each node's applied-once check starts
				// again at the round's check.
				for i := range c.nodes {
					once[i] = false
					delete(since, i)
				}
				c.restart(victim)
				c.converged()
				c.checkAll(all)
				what = fmt.Sprintf("a cluster with %s (%s) down: saved at index %d and restored through %s, %s restarted after it",
					c.nodes[victim].id, role, snap.index, strings.Join(ids, " and "), c.nodes[victim].id)
			})
			// Writes on the restored state, which every node (the restarted
			// one included) must hold at the round's check: the cursors go
			// on from the restored ones.
			s.ackedAtLeast(c, s.acked.Load()+ackedPerFault, fmt.Sprintf("%d requests acknowledged after the restore", ackedPerFault))
		}
		c.leader()
		var applied uint64
		var checked int
		gate.quiesced(c, s, func() {
			applied, _ = c.converged()
			c.checkAll(all)
			checked = checkOnce(round)
		})
		if what == "" {
			role := "follower"
			if victim == lead {
				role = "leader"
			}
			what = fmt.Sprintf("%s (%s)", c.nodes[victim].id, role)
		}
		t.Logf("round %d/%d: %s of %s in %v; %d requests acknowledged, %d routes answered; every node at applied index %d, %d applied each event once",
			round, rounds, f, what, time.Since(began).Round(time.Millisecond),
			s.acked.Load()-ackedBefore, routed.Load()-routedBefore, applied, checked)
	}

	s.wait(t)
	c.leader()
	applied, digest := c.converged()
	c.checkAll(all)
	c.statusAgrees()
	checked := checkOnce(rounds + 1)

	retries, dups := totals(pubs)
	var kinds []string
	for f, n := range faults {
		kind := fmt.Sprintf("%d %s", n, chaosFault(f))
		if chaosFault(f) == faultOneWay {
			kind += fmt.Sprintf(" (%d leader→follower, %d follower→leader with leadership handed across)", leaderCuts, n-leaderCuts)
		}
		kinds = append(kinds, kind)
	}
	var never []string
	for i, n := range c.nodes {
		if once[i] {
			never = append(never, n.id)
		}
	}
	if len(never) == 0 {
		never = append(never, "none")
	}
	t.Logf("%d rounds (%s) in %v: %d requests acknowledged, %d retried, %d events acknowledged as duplicates; "+
		"%d routes answered, %d failed; every node holds what was acknowledged, digest %s at applied index %d; "+
		"%d nodes applied each event once, of them since the start: %s",
		rounds, strings.Join(kinds, ", "), time.Since(start).Round(time.Second), s.acked.Load(), retries, dups,
		routed.Load(), routeErrs.Load(), digest, applied, checked, strings.Join(never, ", "))
	if routed.Load() == 0 {
		t.Fatal("no route answered during the soak: the router did not run beside the faults")
	}
}
