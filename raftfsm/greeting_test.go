package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/kvevent"
)

// greetAsNone makes tr, NewTransport's, greet as a node of no cluster,
// and take every greeting: for a transport no Node is given.
func greetAsNone(t *testing.T, tr *raft.NetworkTransport) {
	t.Helper()
	s, ok := layers.Load(tr.LocalAddr())
	if !ok {
		t.Fatal("not a transport of NewTransport")
	}
	s.(*streamLayer).setIdentity(&identity{})
}

func servers(kv ...string) []raft.Server {
	var s []raft.Server
	for i := 0; i+1 < len(kv); i += 2 {
		s = append(s, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(kv[i]), Address: raft.ServerAddress(kv[i+1])})
	}
	return s
}

// TestDerivedClusterIDsNameTheFirstConfiguration: nodes given the same
// --peers in any order derive the same id; another id or address of any
// member, another.
func TestDerivedClusterIDsNameTheFirstConfiguration(t *testing.T) {
	base := deriveClusterID(servers("n1", "10.0.0.1:7000", "n2", "10.0.0.2:7000", "n3", "10.0.0.3:7000"))
	if base.IsZero() {
		t.Fatal("derived a zero id")
	}
	if got := deriveClusterID(servers("n3", "10.0.0.3:7000", "n1", "10.0.0.1:7000", "n2", "10.0.0.2:7000")); got != base {
		t.Fatalf("peers in another order derive %s, want %s", got, base)
	}
	for name, other := range map[string][]raft.Server{
		"an address":  servers("n1", "10.0.0.1:7000", "n2", "10.0.0.2:7000", "n3", "10.0.0.3:7001"),
		"an id":       servers("n1", "10.0.0.1:7000", "n2", "10.0.0.2:7000", "n4", "10.0.0.3:7000"),
		"a member":    servers("n1", "10.0.0.1:7000", "n2", "10.0.0.2:7000"),
		"an id split": servers("n1", "10.0.0.1:7000\x00n2", "n2", "10.0.0.2:7000", "n3", "10.0.0.3:7000"),
	} {
		if got := deriveClusterID(other); got == base {
			t.Errorf("another %s derives the same id %s", name, got)
		}
	}
}

// TestGreetingVerdicts: which greetings an acceptor takes, and when it
// takes the greeter's id.
func TestGreetingVerdicts(t *testing.T) {
	x, y := ClusterID{1}, ClusterID{2}
	listed := func(id, addr string) bool { return id == "n1" && SameRaftAddr(addr, "127.0.0.1:7001") }
	n1 := func(id ClusterID, settled bool) greeting {
		return greeting{id: id, settled: settled, self: "n1", addr: "127.0.0.1:7001"}
	}
	stranger := greeting{id: y, settled: true, self: "n1", addr: "127.0.0.1:9001"}
	for _, tc := range []struct {
		name        string
		me          identity
		g           greeting
		take, adopt bool
	}{
		{"same cluster", identity{id: x}, n1(x, true), true, false},
		{"same cluster, both provisional", identity{id: x, provisional: true, listed: listed}, n1(x, false), true, false},
		{"another cluster", identity{id: x}, n1(y, true), false, false},
		{"another cluster to a provisional node, unlisted", identity{id: x, provisional: true, listed: listed}, stranger, false, false},
		{"another cluster's provisional node to a provisional node", identity{id: x, provisional: true, listed: listed}, n1(y, false), false, false},
		{"a listed settled member to a provisional node (a wiped member)", identity{id: x, provisional: true, listed: listed}, n1(y, true), true, true},
		{"a listed settled member of no cluster to a provisional node", identity{id: x, provisional: true, listed: listed}, n1(ClusterID{}, true), true, true},
		{"no cluster's node to a settled node", identity{id: x}, n1(ClusterID{}, true), false, false},
		{"a node of no cluster (an older directory) takes anyone", identity{}, n1(y, true), true, false},
		{"a joiner takes a settled cluster's id", identity{provisional: true, joiner: true}, stranger, true, true},
		{"a joiner refuses a provisional node", identity{provisional: true, joiner: true}, n1(y, false), false, false},
		{"a joiner that took an id refuses another", identity{id: x, provisional: true, joiner: true}, stranger, false, false},
	} {
		take, adopt := tc.me.verdict(tc.g)
		if take != tc.take || adopt != tc.adopt {
			t.Errorf("%s: verdict (take %v, adopt %v), want (%v, %v)", tc.name, take, adopt, tc.take, tc.adopt)
		}
	}
}

// TestGreetingsRoundTrip: a greeting reads back as written, in one piece
// or byte by byte, and what follows it is kept.
func TestGreetingsRoundTrip(t *testing.T) {
	me := &identity{id: ClusterID{7, 7}, self: "node-1", addr: "10.1.2.3:7000", provisional: true}
	b := appendGreeting(nil, me)
	want := greeting{id: me.id, settled: false, self: me.self, addr: me.addr}
	for split := 1; split <= len(b); split++ {
		g, rest, err := readGreeting(b[:split], bytes.NewReader(append(b[split:len(b):len(b)], 0xaa)))
		if err != nil {
			t.Fatalf("split at %d: %v", split, err)
		}
		if g != want || len(rest) != 0 {
			t.Fatalf("split at %d: %+v rest %x, want %+v", split, g, rest, want)
		}
	}
	g, rest, err := readGreeting(append(b, 1, 2), bytes.NewReader(nil))
	if err != nil || g != want || !bytes.Equal(rest, []byte{1, 2}) {
		t.Fatalf("with bytes after: %+v rest %x %v", g, rest, err)
	}
	if _, _, err := readGreeting(b[:len(b)-1], bytes.NewReader(nil)); !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		t.Fatalf("truncated: %v, want an EOF", err)
	}
	bad := append([]byte(nil), b...)
	bad[4] = 9
	if _, _, err := readGreeting(bad, bytes.NewReader(nil)); !errors.Is(err, errBadGreeting) {
		t.Fatalf("version 9: %v, want errBadGreeting", err)
	}
}

// FuzzReadGreeting: any bytes give a greeting or an error, never a panic,
// and a greeting read writes back as the bytes it was read from.
func FuzzReadGreeting(f *testing.F) {
	f.Add(appendGreeting(nil, &identity{id: ClusterID{1}, self: "n1", addr: "127.0.0.1:1"}))
	f.Add(appendGreeting(nil, &identity{provisional: true}))
	f.Add([]byte{0xc7, 'k', 'v', 'r', 1, 0})
	f.Add([]byte{0xc7, 'k', 'v', 'r', 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		split := len(b) / 2
		g, rest, err := readGreeting(b[:split], bytes.NewReader(b[split:]))
		if err != nil {
			return
		}
		back := appendGreeting(nil, &identity{id: g.id, self: g.self, addr: g.addr, provisional: !g.settled})
		if !bytes.HasPrefix(b, back) || b[5] != back[5] || len(rest) > split {
			t.Fatalf("read %+v from %x; writes back as %x", g, b, back)
		}
	})
}

// greetPair returns a stream layer listening on loopback with identity
// id, and one to dial it from with identity from.
func greetPair(t *testing.T, id, from *identity) (acceptor, dialer *streamLayer) {
	t.Helper()
	mk := func(me *identity) *streamLayer {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		s := newStreamLayer(ln, nil)
		s.setIdentity(me)
		t.Cleanup(func() { s.Close() })
		return s
	}
	return mk(id), mk(from)
}

// greetedRead accepts one connection on s and reads from it what raft
// would: the greeting's verdict comes before any byte.
func greetedRead(s *streamLayer) <-chan []byte {
	got := make(chan []byte, 1)
	go func() {
		c, err := s.Accept()
		if err != nil {
			got <- nil
			return
		}
		defer c.Close()
		b := make([]byte, 64)
		n, _ := c.Read(b)
		got <- b[:n]
	}()
	return got
}

// TestStreamLayersOfOneClusterConnect and
// TestStreamLayersOfTwoClustersRefuseEachOther: over loopback, a
// connection between two nodes of one cluster carries raft's bytes
// untouched; between two clusters it fails on both sides before raft
// reads a byte, with ErrForeignCluster to the dialer, and the acceptor
// counts it.
func TestStreamLayersOfOneClusterConnect(t *testing.T) {
	x := ClusterID{1}
	a, d := greetPair(t, &identity{id: x, self: "n2", addr: "127.0.0.1:2"}, &identity{id: x, self: "n1", addr: "127.0.0.1:1"})
	got := greetedRead(a)
	c, err := d.Dial(raft.ServerAddress(a.Addr().String()), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{0, 'r', 'p', 'c'}); err != nil {
		t.Fatal(err)
	}
	if b := <-got; !bytes.Equal(b, []byte{0, 'r', 'p', 'c'}) {
		t.Fatalf("raft read %q, want the RPC's bytes", b)
	}
	if a.foreign.Load() != 0 {
		t.Fatal("a connection of the same cluster counted as another's")
	}
}

func TestStreamLayersOfTwoClustersRefuseEachOther(t *testing.T) {
	a, d := greetPair(t, &identity{id: ClusterID{1}, self: "n3", addr: "127.0.0.1:3"}, &identity{id: ClusterID{2}, self: "n1", addr: "127.0.0.1:1"})
	got := greetedRead(a)
	_, err := d.Dial(raft.ServerAddress(a.Addr().String()), 2*time.Second)
	if !errors.Is(err, ErrForeignCluster) {
		t.Fatalf("dial: %v, want ErrForeignCluster", err)
	}
	if b := <-got; len(b) != 0 {
		t.Fatalf("raft read %q from another cluster's connection", b)
	}
	if a.foreign.Load() != 1 {
		t.Fatalf("the acceptor counted %d connections of another cluster, want 1", a.foreign.Load())
	}
	if unanswered(err) {
		t.Fatalf("a refusal is held as an unanswered request: %v", err)
	}
}

// TestAJoinersStreamLayerTakesTheFirstSettledClustersID: a joiner's
// layer takes the id of the first settled greeter, records it, and then
// refuses another cluster's node.
func TestAJoinersStreamLayerTakesTheFirstSettledClustersID(t *testing.T) {
	var recorded []ClusterID
	joiner := &identity{self: "n4", addr: "127.0.0.1:4", provisional: true, joiner: true,
		adopted: func(id ClusterID) { recorded = append(recorded, id) }}
	x := ClusterID{1}
	a, d := greetPair(t, joiner, &identity{id: x, self: "n1", addr: "127.0.0.1:1"})
	got := greetedRead(a)
	c, err := d.Dial(raft.ServerAddress(a.Addr().String()), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte{1})
	<-got
	c.Close()
	if me := a.ident.Load(); me.id != x || me.provisional || len(recorded) != 1 || recorded[0] != x {
		t.Fatalf("joiner holds %s (provisional %v), recorded %v; want %s", me.id, me.provisional, recorded, x)
	}
	d.setIdentity(&identity{id: ClusterID{2}, self: "m1", addr: "127.0.0.1:9"})
	got = greetedRead(a)
	if _, err := d.Dial(raft.ServerAddress(a.Addr().String()), 2*time.Second); !errors.Is(err, ErrForeignCluster) {
		t.Fatalf("another cluster after the joiner took an id: %v, want ErrForeignCluster", err)
	}
	<-got
}

// TestGreetingsAcrossBuilds: a node of this build and one of a build
// before greetings (hashicorp/raft's own TCP transport, as those builds
// ran) answer each other's RPCs both ways: the greeting that the older
// build closes unanswered is dialed again without one, and the older
// build's RPC, without a greeting, is taken.
func TestGreetingsAcrossBuilds(t *testing.T) {
	ours, err := NewTransport("127.0.0.1:0", nil, 2*time.Second, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer ours.Close()
	s, _ := layers.Load(ours.LocalAddr())
	s.(*streamLayer).setIdentity(&identity{id: ClusterID{1}, self: "new", addr: string(ours.LocalAddr())})
	old, err := raft.NewTCPTransport("127.0.0.1:0", nil, 2, 2*time.Second, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	done := make(chan struct{})
	defer close(done)
	answer := func(tr raft.Transport) {
		go func() {
			for {
				select {
				case rpc := <-tr.Consumer():
					rpc.Respond(&raft.RequestVoteResponse{RPCHeader: raft.RPCHeader{ID: []byte("answerer")}, Term: 9, Granted: true}, nil)
				case <-done:
					return
				}
			}
		}()
	}
	answer(ours)
	answer(old)
	for _, dir := range []struct {
		name     string
		from, to raft.Transport
	}{{"this build to an older one", ours, old}, {"an older build to this one", old, ours}} {
		var resp raft.RequestVoteResponse
		req := &raft.RequestVoteRequest{RPCHeader: raft.RPCHeader{ID: []byte("asker"), Addr: []byte(dir.from.LocalAddr())}, Term: 9}
		if err := dir.from.RequestVote("x", dir.to.LocalAddr(), req, &resp); err != nil || !resp.Granted || resp.Term != 9 {
			t.Fatalf("%s: %+v, %v", dir.name, resp, err)
		}
	}
	if n := s.(*streamLayer).plain.Load(); n == 0 {
		t.Fatal("no dial to the older build was made again without a greeting")
	}
}

// TestAnotherClustersLeaderCannotTakeANodeOver: cluster A loses a
// follower, and a node of cluster B starts at its raft address (a port
// reused). A's leader, replicating to that address, is refused at every
// connection: the B node keeps B's state and id, B converges, A keeps
// taking writes, and the B node counts the refusals. Before greetings
// A's leader replicated its log into the B node (a CI run: 3,806 entries
// into a node whose cluster had 21).
func TestAnotherClustersLeaderCannotTakeANodeOver(t *testing.T) {
	a := newTestCluster(t, 3, nil)
	la := a.leader()
	if err := la.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	gone := a.followerOf(la)
	reused := a.addrs[gone]
	a.stop(gone)

	b, trs := newUnstartedCluster(t, 3, nil)
	trs[2].Close()
	trs[2] = b.transport(reused)
	b.addrs[2] = reused
	for i := range trs {
		b.startOn(i, trs[i])
	}
	lb := b.leader()
	if err := lb.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	rb := kvevent.Rank{Worker: 2}
	for k := uint64(0); k < 10; k++ {
		ingestRetrying(t, a, []RankBatch{{Rank: r1, Events: chainEvents(r1, k*5+1, 5, 1000*k)}})
		ingestRetrying(t, b, []RankBatch{{Rank: rb, Events: chainEvents(rb, k*3+1, 3, 5000+1000*k)}})
	}
	b.converged()
	a.converged()
	victim := b.nodes[2]
	waitFor(t, 10*time.Second, "the B node to refuse A's leader", func() bool { return victim.stream.foreign.Load() > 0 })
	if got, want := victim.Status().ClusterID, lb.Status().ClusterID; got != want || got == "" || got == la.Status().ClusterID {
		t.Fatalf("the B node is of cluster %q, B of %q, A of %q", got, want, la.Status().ClusterID)
	}
	if w := victim.fsm.Workers(); len(w) != 1 || w[2].ID != 2 {
		t.Fatalf("the B node holds workers %+v, want B's alone", w)
	}
	if victim.fsm.Cursor(r1) != 0 || victim.fsm.Cursor(rb) != 30 {
		t.Fatalf("the B node's cursors: A's rank %d, B's rank %d; want 0 and 30", victim.fsm.Cursor(r1), victim.fsm.Cursor(rb))
	}
	if !la.IsLeader() {
		t.Fatal("A's leader lost its leadership")
	}
}

// TestAJoinerTakesItsClustersID: a node started empty to join takes the
// id of the cluster that adds it, keeps it across a restart, and shows
// it (Status).
func TestAJoinerTakesItsClustersID(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	l := c.leader()
	want := l.Status().ClusterID
	if want == "" || want != deriveClusterID(peerServers(c.peers())).String() {
		t.Fatalf("the cluster's id %q, want the one its --peers derive", want)
	}
	dir := t.TempDir()
	tr := c.transport("127.0.0.1:0")
	addr := string(tr.LocalAddr())
	start := func(tr *raft.NetworkTransport) *Node {
		n, err := NewNode(Config{ID: "n4", RaftAddr: addr, HTTPAddr: "http-n4", DataDir: dir, Transport: tr, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	n4 := start(tr)
	defer func() { n4.Close() }()
	if got := n4.Status().ClusterID; got != "" {
		t.Fatalf("a joiner before it is added is of cluster %q, want none", got)
	}
	if err := l.AddMember(ctx(t), "n4", addr, "http-n4"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n4 to be ready", func() bool { return n4.Status().Ready })
	if got := n4.Status().ClusterID; got != want {
		t.Fatalf("the joiner is of cluster %q, want %q", got, want)
	}
	n4.Close()
	n4 = start(c.transport(addr))
	if got := n4.Status().ClusterID; got != want {
		t.Fatalf("the joiner restarted is of cluster %q, want %q", got, want)
	}
}

// TestAWipedMemberStartedWithOtherPeersTakesItsClustersID: a member
// wiped and started again with --peers that spell a member's address
// otherwise derives another id, and takes its cluster's from the leader,
// which its --peers list: it catches up, and keeps the cluster's id.
func TestAWipedMemberStartedWithOtherPeersTakesItsClustersID(t *testing.T) {
	c := newTestCluster(t, 3, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	ingestRetrying(t, c, []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 5, 100)}})
	want := l.Status().ClusterID
	w := c.followerOf(l)
	c.stop(w)
	if err := os.RemoveAll(c.dirs[w]); err != nil {
		t.Fatal(err)
	}
	peers := c.peers()
	for i := range peers {
		if i != w { // the same address, spelled as an IPv4-mapped IPv6 one
			ap := netip.MustParseAddrPort(peers[i].RaftAddr)
			peers[i].RaftAddr = netip.AddrPortFrom(netip.AddrFrom16(ap.Addr().As16()), ap.Port()).String()
		}
	}
	if got := deriveClusterID(peerServers(peers)).String(); got == want {
		t.Fatalf("the spelled --peers derive the cluster's id %s", got)
	}
	tune := c.tune
	c.tune = func(cfg *Config) {
		if tune != nil {
			tune(cfg)
		}
		if cfg.ID == c.id(w) {
			cfg.Peers = peers
		}
	}
	c.start(w)
	c.converged()
	if got := c.nodes[w].Status().ClusterID; got != want {
		t.Fatalf("the wiped member is of cluster %q, want %q", got, want)
	}
	if got := c.nodes[w].fsm.Cursor(r1); got != 5 {
		t.Fatalf("the wiped member's cursor %d, want 5", got)
	}
}

func peerServers(peers []Member) []raft.Server {
	var s []raft.Server
	for _, p := range peers {
		s = append(s, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
	}
	return s
}

// answerGreeting answers, as a node of the dialer's cluster, the
// greeting a connection accepted from a node opens with: for a test's
// stand-in of a node that takes it.
func answerGreeting(c net.Conn) error {
	g, rest, err := readGreeting(nil, c)
	if err != nil {
		return err
	}
	if len(rest) > 0 {
		return fmt.Errorf("%d bytes after the greeting", len(rest))
	}
	reply := append([]byte{greetTaken}, g.id[:]...)
	_, err = c.Write(reply)
	return err
}
