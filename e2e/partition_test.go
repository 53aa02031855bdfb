package e2e

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/internal/netproxy"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// raftHub is the partition hub of a real-process cluster: the Raft traffic
// of every directed pair of nodes goes through a loopback proxy of its own,
// links[i][j] for the connections node i dials to node j, so that the test
// can cut any link, or isolate a node completely, and heal it again. HTTP
// is not routed through it: the test's client is outside the partition and
// reaches every node directly.
//
// The routing is each node's own --peers: in node i's list every other
// node j has the raft address links[i][j].Addr(), and node i its own
// listening address. hashicorp/raft dials a peer at the address its own
// latest configuration gives, and bootstrapping writes each node's list
// as that node's configuration (entry 1 of its own log; replication
// checks only an entry's term, so the lists may differ). Leader
// addresses are what each node's transport says it listens on, carried in
// every RPC's header, so status and forwarding still name real addresses.
// What does carry a node's view of the others is the Raft configuration
// (GET /v1/cluster/members, kvctl members) and the member table's raft
// addresses, which each new leader records from its own list: there the
// addresses are proxies. A membership change or an InstallSnapshot would
// hand every node the leader's view; these tests make neither, but for
// the chaos soak's restore round, which is its last for that reason
// (faultRestore).
type raftHub struct {
	c     *cluster
	links [][]*netproxy.Proxy // links[i][j]: i reaches j through it; nil when i == j
}

// startPartitionedCluster starts an n-node cluster whose Raft traffic goes
// through a raftHub, and waits until every node is ready and the leader's
// links to its followers have carried traffic.
func startPartitionedCluster(t *testing.T, n int) (*cluster, *raftHub) {
	t.Helper()
	c := newCluster(t, n)
	h := &raftHub{c: c}
	// prepare runs again when a port conflict makes bootstrap start anew on
	// other raft ports: the proxies then point at the new ones.
	c.prepare = func(*cluster) { h.build() }
	c.peersOf = h.peersOf
	t.Cleanup(h.close)
	c.bootstrap()
	lead := c.leader()
	c.waitFor(leaderTimeout, "the leader's Raft traffic through its proxies", func() (bool, string) {
		var why []string
		for j, p := range h.links[lead] {
			if p != nil && p.Stats().Forwarded == 0 {
				why = append(why, h.linkName(lead, j)+" carried nothing")
			}
		}
		return len(why) == 0, strings.Join(why, "; ")
	})
	return c, h
}

// build (re)creates every link's proxy, to the nodes' current raft ports.
func (h *raftHub) build() {
	h.c.t.Helper()
	h.close()
	n := len(h.c.nodes)
	h.links = make([][]*netproxy.Proxy, n)
	var layout []string
	for i := range n {
		h.links[i] = make([]*netproxy.Proxy, n)
		for j, to := range h.c.nodes {
			if i == j {
				continue
			}
			p, err := netproxy.New(to.raftAddr)
			if err != nil {
				h.c.t.Fatal(err)
			}
			h.links[i][j] = p
			layout = append(layout, fmt.Sprintf("%s via %s", h.linkName(i, j), p.Addr()))
		}
	}
	h.c.t.Logf("raft links: %s", strings.Join(layout, ", "))
}

// peersOf is node n's --peers: itself at its own raft address, every other
// node at the proxy of n's link to it.
func (h *raftHub) peersOf(n *node) string {
	i := h.index(n)
	var ps []string
	for j, o := range h.c.nodes {
		addr := o.raftAddr
		if j != i {
			addr = h.links[i][j].Addr()
		}
		ps = append(ps, o.id+"="+addr+"="+o.httpAddr)
	}
	return strings.Join(ps, ",")
}

func (h *raftHub) index(n *node) int {
	for i, o := range h.c.nodes {
		if o == n {
			return i
		}
	}
	h.c.t.Fatalf("node %s is not in the cluster", n.id)
	return -1
}

func (h *raftHub) linkName(i, j int) string {
	return h.c.nodes[i].id + "->" + h.c.nodes[j].id
}

// isolate cuts node i off from every other node, both directions: every
// live Raft connection to or from it breaks, and no new one gets through.
func (h *raftHub) isolate(i int) {
	for j := range h.links {
		if j != i {
			h.links[i][j].Cut()
			h.links[j][i].Cut()
		}
	}
	h.c.t.Logf("isolated %s", h.c.nodes[i].id)
}

// cut cuts the one directed link from node i to node j: i can no longer
// open or use a connection to j, while j's connections to i still work.
// A connection carries its dialer's requests and the answers to them, so
// this is a one-way cut of who can call whom, not of bytes: every Raft
// RPC i sends j fails (j's answers to them included), every RPC j sends i
// gets through and is answered.
func (h *raftHub) cut(i, j int) {
	h.links[i][j].Cut()
	h.c.t.Logf("cut %s", h.linkName(i, j))
}

// heal lets every link carry traffic again.
func (h *raftHub) heal() {
	for _, row := range h.links {
		for _, p := range row {
			if p != nil {
				p.Heal()
			}
		}
	}
	h.c.t.Logf("healed every link")
}

// close stops every proxy; the test's cleanup.
func (h *raftHub) close() {
	for _, row := range h.links {
		for _, p := range row {
			if p != nil {
				p.Close()
			}
		}
	}
	h.links = nil
}

// others is every node position but i.
func (c *cluster) others(i int) []int {
	var out []int
	for j := range c.nodes {
		if j != i {
			out = append(out, j)
		}
	}
	return out
}

// leaderAmong waits until the nodes at idx answer and agree on a leader,
// one of them, and returns its position: the leader of a majority while
// the other nodes are cut off and may think otherwise.
func (c *cluster) leaderAmong(idx []int) int {
	c.t.Helper()
	var got int
	c.waitFor(leaderTimeout, "a leader the nodes of the majority agree on", func() (bool, string) {
		sts := c.statusAll()
		lead := -1
		for _, i := range idx {
			st := sts[i]
			if st == nil {
				return false, describe(sts)
			}
			if st.State == "Leader" && (lead < 0 || st.Term > sts[lead].Term) {
				lead = i
			}
		}
		if lead < 0 {
			return false, describe(sts)
		}
		for _, i := range idx {
			if sts[i].LeaderID != c.nodes[lead].id || sts[i].Term != sts[lead].Term {
				return false, describe(sts)
			}
		}
		got = lead
		return true, ""
	})
	return got
}

// status asks node i alone for its status; nil when it does not answer.
func (c *cluster) status(i int) *raftfsm.NodeStatus {
	c.t.Helper()
	return c.statusAll()[i]
}

// term is node i's current term; the test fails when it does not answer.
func (c *cluster) term(i int) uint64 {
	c.t.Helper()
	st := c.status(i)
	if st == nil {
		c.t.Fatalf("%s does not answer: %s", c.nodes[i].id, describe(c.statusAll()))
	}
	return st.Term
}

// leaderWithTerm is c.leader and the term it leads in, both from one
// status answer of the node: read one after the other, an election between
// the two (a loaded machine misses heartbeats) gave a node that no longer
// leads and the term of the leader elected meanwhile.
func (c *cluster) leaderWithTerm() (int, uint64) {
	c.t.Helper()
	var at int
	var term uint64
	c.waitFor(leaderTimeout, "the leader's own status to say it leads", func() (bool, string) {
		at = c.leader()
		st := c.status(at)
		if st == nil {
			return false, c.nodes[at].id + " does not answer"
		}
		term = st.Term
		return st.State == "Leader", c.nodes[at].id + " is " + st.State
	})
	return at, term
}

// publishAny is publishNext for a client outside the partition that, after
// an error, sends the request again to the next node, starting at node
// *at and leaving *at at the node that acknowledged it. It goes through
// one single-node client per node, rather than a client with every
// endpoint (which also moves on from a node answering 503 no_leader), so
// that the test decides which node each request reaches first: the cut-off
// one included.
func (c *cluster) publishAny(ctx context.Context, p *publisher, at *int) error {
	req := p.request()
	var acks []raftfsm.RankAck
	tries, err := retry(ctx, func(ctx context.Context) error {
		var err error
		acks, err = c.nodes[*at].cl.IngestEvents(ctx, req)
		if isRefusal(err) {
			if p.refused == nil {
				p.refused = map[int]int{}
			}
			p.refused[*at]++
		}
		if err != nil {
			*at = (*at + 1) % len(c.nodes)
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := checkAcks(req, acks); err != nil {
		return err
	}
	p.model.apply(req)
	p.acked = append(p.acked, req)
	p.retries += tries - 1
	for _, a := range acks {
		p.dups += a.Dups
	}
	return nil
}

// stream runs writers concurrently, each a loop of steps (one request at
// a time, acknowledged before the next), until wait stops them or a step
// fails. When the test ends, however it ends, the stream's context is
// canceled and its goroutines are waited for.
type stream struct {
	ctx      context.Context
	stop     chan struct{}
	stopOnce sync.Once
	wg       sync.WaitGroup
	acked    atomic.Int64 // requests the publishers' steps got acknowledged
	bad      atomic.Bool  // a step failed: stop waiting for the stream
	mu       sync.Mutex
	errs     []error
}

func newStream(t *testing.T, ctx context.Context) *stream {
	ctx, cancel := context.WithCancel(ctx)
	s := &stream{ctx: ctx, stop: make(chan struct{})}
	t.Cleanup(func() {
		s.halt()
		cancel()
		s.wg.Wait()
	})
	return s
}

// loop runs step until the stream stops or step fails.
func (s *stream) loop(step func(ctx context.Context) error) {
	s.wg.Go(func() {
		for {
			select {
			case <-s.stop:
				return
			default:
			}
			if err := step(s.ctx); err != nil {
				s.mu.Lock()
				s.errs = append(s.errs, err)
				s.mu.Unlock()
				s.bad.Store(true)
				return
			}
		}
	})
}

// publish streams pubs, each through publishAny, counting what they get
// acknowledged in acked.
func (s *stream) publish(c *cluster, pubs []*publisher) {
	for i, p := range pubs {
		at := i % len(c.nodes)
		s.loop(func(ctx context.Context) error {
			if err := c.publishAny(ctx, p, &at); err != nil {
				return fmt.Errorf("publisher %d: %w", i, err)
			}
			s.acked.Add(1)
			return nil
		})
	}
}

// until waits for cond as c.waitFor does, and fails the test as soon as a
// step of the stream failed.
func (s *stream) until(c *cluster, what string, cond func() (bool, string)) {
	c.t.Helper()
	c.waitFor(convergeTimeout, what, func() (bool, string) {
		if s.bad.Load() {
			s.wait(c.t)
		}
		return cond()
	})
}

// ackedAtLeast waits until the publishers have n acknowledged requests.
func (s *stream) ackedAtLeast(c *cluster, n int64, what string) {
	c.t.Helper()
	s.until(c, what, func() (bool, string) {
		got := s.acked.Load()
		return got >= n, fmt.Sprintf("%d of %d requests acknowledged", got, n)
	})
}

func (s *stream) halt() { s.stopOnce.Do(func() { close(s.stop) }) }

// wait stops the stream once every writer has its current request
// acknowledged, and fails the test on a step's error.
func (s *stream) wait(t *testing.T) {
	t.Helper()
	s.halt()
	s.wg.Wait()
	if len(s.errs) > 0 {
		t.Fatal(s.errs[0])
	}
}

// probeRank is the rank of the probe: a writer that sends its requests to
// one node only, the one the test cuts off.
var probeRank = kvevent.Rank{Worker: 3, DP: 0}

// probeTally counts the answers to a probe's writes (stream.probe) sent
// while during is set: refusals (503 no_leader, isRefusal),
// acknowledgements, and anything else (a timeout, an outcome unknown),
// which proves no refusal: a node that hangs must not pass for one that
// refuses. ok counts every write acknowledged, during or not.
type probeTally struct {
	during                    atomic.Bool
	refused, acked, other, ok atomic.Int64
}

// probe streams probe's requests to the node of cl alone, one at a time,
// each retried until acknowledged, until the stream stops, and returns
// once its first write is acknowledged. Only a write sent while during
// is set counts in the tally's during counts: one sent before may have
// committed, and its answer come after.
func (s *stream) probe(c *cluster, cl *client.Client, probe *publisher) *probeTally {
	pt := &probeTally{}
	s.loop(func(ctx context.Context) error {
		req := probe.request()
		var acks []raftfsm.RankAck
		_, err := retry(ctx, func(ctx context.Context) error {
			during := pt.during.Load()
			var err error
			acks, err = cl.IngestEvents(ctx, req)
			if during {
				switch {
				case err == nil:
					pt.acked.Add(1)
				case isRefusal(err):
					pt.refused.Add(1)
				default:
					pt.other.Add(1)
				}
			}
			return err
		})
		if err == nil {
			err = checkAcks(req, acks)
		}
		if err != nil {
			return fmt.Errorf("probe: %w", err)
		}
		probe.model.apply(req)
		probe.acked = append(probe.acked, req)
		pt.ok.Add(1)
		return nil
	})
	s.until(c, "the probe's first acknowledged write", func() (bool, string) {
		return pt.ok.Load() > 0, "none yet"
	})
	return pt
}

// isRefusal reports whether err is a node's answer that it took no write:
// 503 no_leader (api.ReasonNoLeader: it does not lead and knows no leader
// to forward to), and not one that may have applied (ErrOutcomeUnknown).
// A timeout, the probe's own included, is not one.
func isRefusal(err error) bool {
	var ae *client.Error
	return errors.As(err, &ae) && !errors.Is(err, client.ErrOutcomeUnknown) &&
		ae.StatusCode == http.StatusServiceUnavailable && ae.Reason == api.ReasonNoLeader
}

// TestPartitionedLeaderLosesNothingAcknowledged cuts the leader off from
// both followers while two publishers stream event batches through every
// node (retrying what was not acknowledged, on the next node) and a probe
// writes to the old leader only. The majority elects a new leader and
// keeps acknowledging; the old leader steps down and refuses the probe's
// writes, and whatever it did answer 2xx must be in the final index. After
// the heal it follows the new leader, and every node holds exactly what
// was acknowledged, at one applied index with one digest.
func TestPartitionedLeaderLosesNothingAcknowledged(t *testing.T) {
	seed := testSeed(t)
	c, h := startPartitionedCluster(t, 3)
	probe := newPublisher(seed, probeRank)
	pubs, all := registeredPublishers(t, c.cl, seed, probe)

	s := newStream(t, ctxT(t, 2*convergeTimeout))
	s.publish(c, pubs)
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the partition")

	old := c.leader()

	// The probe writes only to the old leader, one request at a time until
	// it is acknowledged, from before the cut (so that one is in flight,
	// appended to the old leader's log once it goes on, when the cut
	// comes) to after the heal (when the old leader, a follower again,
	// forwards it). Its answers to the writes sent while the old leader is
	// isolated are counted (probeTally).
	pt := s.probe(c, c.nodes[old].cl, probe)

	// It is cut off while frozen (freezeAsLeader), leading: found and then
	// cut, it may have lost an election in between (Raft's 200 ms lease on
	// a loaded machine), and the test would cut a follower off and pass
	// without a partitioned leader.
	oldTerm := c.freezeAsLeader(old)
	h.isolate(old)
	c.resume(old)
	pt.during.Store(true)
	atCut := s.acked.Load()

	lead := c.leaderAmong(c.others(old))
	if term := c.term(lead); term <= oldTerm {
		t.Fatalf("the majority's leader %s is in term %d, the old leader %s led in term %d",
			c.nodes[lead].id, term, c.nodes[old].id, oldTerm)
	}
	s.ackedAtLeast(c, atCut+30, "the majority to acknowledge 30 requests during the partition")
	c.waitFor(leaderTimeout, "the isolated old leader to step down", func() (bool, string) {
		st := c.status(old)
		if st == nil {
			return false, "no answer"
		}
		return st.State != "Leader", st.State
	})
	s.until(c, "the isolated old leader to refuse a probe write", func() (bool, string) {
		return pt.refused.Load() > 0, fmt.Sprintf("no refusal yet; %d other errors", pt.other.Load())
	})
	// The cut is real: the old leader has not applied what the majority did.
	sts := c.statusAll()
	if sts[old] == nil || sts[lead] == nil || sts[old].AppliedIndex >= sts[lead].AppliedIndex {
		t.Fatalf("during the partition: %s", describe(sts))
	}
	t.Logf("during the partition: %s", describe(sts))

	pt.during.Store(false)
	h.heal()
	atHeal, probeAtHeal := s.acked.Load(), pt.ok.Load()
	s.ackedAtLeast(c, atHeal+10, "10 requests acknowledged after the heal")
	s.until(c, "a probe write acknowledged through the healed old leader", func() (bool, string) {
		return pt.ok.Load() > probeAtHeal, "none yet"
	})
	s.wait(t)

	retries, dups := totals(pubs)
	t.Logf("isolated leader %s (term %d) after %d acknowledged requests; new leader %s; %d acknowledged during the partition, %d in all; "+
		"%d requests retried, %d events acknowledged as duplicates; the probe: %d writes acknowledged, %d refused, %d acknowledged and %d failed otherwise by the isolated node",
		c.nodes[old].id, oldTerm, atCut, c.nodes[lead].id, atHeal-atCut, s.acked.Load(), retries, dups,
		pt.ok.Load(), pt.refused.Load(), pt.acked.Load(), pt.other.Load())

	// The old leader rejoins as a follower: it cannot win an election, its
	// log ends in an older term than the majority's.
	now := c.leader()
	if now == old {
		t.Fatalf("the old leader %s leads again after the heal", c.nodes[old].id)
	}
	if st := c.status(old); st == nil || st.State != "Follower" {
		t.Fatalf("the old leader after the heal: %s", describe(c.statusAll()))
	}
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	// Requests retried across the cut are acknowledged in part as
	// duplicates: each event still applied once, on every node (none
	// restarted or restored a snapshot, so their counts hold).
	c.appliedOnce(all)
}

// TestPartitionedFollowerCatchesUp cuts a follower off, keeps writing
// through every node (the client retries on the next node when the cut
// one refuses; once the follower has lost its leader every write goes to
// it first, and it must refuse them all), and heals: the follower, which stood for election while
// cut off, follows the leader again and catches up to the same digest at
// the same applied index, holding everything acknowledged.
func TestPartitionedFollowerCatchesUp(t *testing.T) {
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(seed, 0x6375742d666f6c6c))
	c, h := startPartitionedCluster(t, 3)
	p := newPublisher(seed, testRanks...)
	registerWorkers(t, c.cl, p.model)
	ctx := ctxT(t, 2*convergeTimeout)
	at := 0
	for range 20 {
		if err := c.publishAny(ctx, p, &at); err != nil {
			t.Fatal(err)
		}
	}
	c.converged()

	lead := c.leader()
	fs := c.others(lead)
	f := fs[rng.IntN(len(fs))]
	h.isolate(f)
	for range 40 {
		if err := c.publishAny(ctx, p, &at); err != nil {
			t.Fatal(err)
		}
	}
	// The follower notices: it hears no leader and stands for election,
	// which nobody can hear. Then the majority writes on.
	c.waitFor(leaderTimeout, "the isolated follower to lose its leader", func() (bool, string) {
		st := c.status(f)
		if st == nil {
			return false, "no answer"
		}
		return st.LeaderID == "", st.State + " following " + st.LeaderID
	})
	// Every write of this round goes to the cut follower first: it has no
	// leader to forward to, so it refuses each one (503 no_leader, not a
	// timeout or any other error: isRefusal) and the client moves on to
	// the majority.
	before := p.refused[f]
	for range 20 {
		at = f
		if err := c.publishAny(ctx, p, &at); err != nil {
			t.Fatal(err)
		}
	}
	if refused := p.refused[f] - before; refused < 20 {
		t.Fatalf("the cut follower %s was sent 20 requests first and refused %d of them (503 no_leader); want all refused", c.nodes[f].id, refused)
	}
	// The cut is real: the follower has not applied what the majority did.
	maj := c.leaderAmong(c.others(f))
	sts := c.statusAll()
	if sts[f] == nil || sts[maj] == nil || sts[f].AppliedIndex >= sts[maj].AppliedIndex || sts[f].Digest == sts[maj].Digest {
		t.Fatalf("during the partition: %s", describe(sts))
	}
	t.Logf("during the partition: %s", describe(sts))

	h.heal()
	c.leader()
	c.converged()
	c.checkAll(p.model)
	c.statusAgrees()
	// Each event applied once on every node, the one that caught up
	// included (no node restarted or restored a snapshot).
	c.appliedOnce(p.model)
	t.Logf("isolated follower %s caught up; %d requests retried", c.nodes[f].id, p.retries)
}
