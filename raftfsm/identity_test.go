package raftfsm

import (
	"errors"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/store"
)

// wantRefused checks that err is a start refused as kind, whose text says
// each of wants and does not begin with a sentinel's words.
func wantRefused(t *testing.T, what string, err error, kind error, wants ...string) {
	t.Helper()
	if !errors.Is(err, ErrStartRefused) || !errors.Is(err, kind) {
		t.Fatalf("%s: %v, want a start refused (%v)", what, err, kind)
	}
	for _, w := range wants {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("%s: %q, want it to say %q", what, err, w)
		}
	}
	if strings.HasPrefix(err.Error(), ErrInvalid.Error()) || strings.HasPrefix(err.Error(), ErrStartRefused.Error()) {
		t.Fatalf("%s: %q begins with a sentinel's words", what, err)
	}
}

// clearRecordedID leaves dir as a build that recorded no node id would.
func clearRecordedID(t *testing.T, dir string) {
	t.Helper()
	logs, err := store.OpenLogStore(filepath.Join(dir, "raft"), store.LogStoreOptions{Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	if err := logs.Set(nodeIDKey, nil); err != nil {
		t.Fatal(err)
	}
}

// TestADataDirectoryRefusesAnotherNodeID: a data directory holding Raft
// state is refused a start under another node id (ErrWrongNode), and
// keeps its own. From a review: n3's directory restarted as n2 gave the
// cluster two members named n2, and once a real member failed the
// impostor won elections alone and failed its barrier every term (2 of 3
// up, no leader). A directory of an older build, with no record, is
// refused when its configuration lists another id at this address, and
// records the id once it starts.
func TestADataDirectoryRefusesAnotherNodeID(t *testing.T) {
	c := newInmemCluster(t, 3)
	cfg3 := c.nodes[2].cfg
	if err := c.nodes[2].Close(); err != nil {
		t.Fatal(err)
	}
	as := func(id string) Config {
		cfg := cfg3
		cfg.ID, cfg.HTTPAddr = id, "http-"+id
		_, cfg.Transport = raft.NewInmemTransport(raft.ServerAddress(cfg3.RaftAddr)) // cut off from the cluster
		return cfg
	}
	_, err := NewNode(as("n2"))
	wantRefused(t, "n3's directory started as n2", err, ErrWrongNode,
		"data directory "+cfg3.DataDir+" belongs to node n3", "started with --node-id n2", "give --node-id n3, or start on an empty directory")

	// An older build's directory: its configuration lists n3 at this
	// address.
	clearRecordedID(t, cfg3.DataDir)
	for _, id := range []string{"n2", "n9"} {
		_, err = NewNode(as(id))
		wantRefused(t, "an older build's n3 directory started as "+id, err, ErrWrongNode,
			"holds the Raft state of node n3", "lists n3 at "+cfg3.RaftAddr, "give --node-id n3")
	}
	n3, err := NewNode(as("n3"))
	if err != nil {
		t.Fatalf("an older build's n3 directory started as n3: %v", err)
	}
	c.nodes[2] = n3
	if err := n3.Close(); err != nil {
		t.Fatal(err)
	}
	// It recorded n3: now refused at any address.
	other := as("n2")
	other.RaftAddr = "inmem-elsewhere"
	_, other.Transport = raft.NewInmemTransport(raft.ServerAddress(other.RaftAddr))
	_, err = NewNode(other)
	wantRefused(t, "n3's directory started as n2 at another address", err, ErrWrongNode, "belongs to node n3")
}

// TestASingleNodeRestartedAsAnotherIDIsRefused: a node alone restarted
// under another id is refused, at its address or another. From a review:
// it started, and said it was removed from the cluster (it never was).
// A directory without Raft state (a join that never got in) takes the id
// it is started with.
func TestASingleNodeRestartedAsAnotherIDIsRefused(t *testing.T) {
	_, tr := raft.NewInmemTransport("inmem-node1")
	self := Member{ID: "node1", RaftAddr: string(tr.LocalAddr()), HTTPAddr: "http-node1"}
	cfg := Config{ID: self.ID, RaftAddr: self.RaftAddr, HTTPAddr: self.HTTPAddr, DataDir: filepath.Join(t.TempDir(), "node1"),
		Peers: []Member{self}, Transport: tr, Logger: quiet}
	n, err := NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "node1 to lead", func() bool { return n.IsLeader() && n.ledThisTerm() })
	n.Close()
	for _, addr := range []string{self.RaftAddr, "inmem-node2"} {
		again := cfg
		again.ID, again.RaftAddr = "node2", addr
		again.Peers = []Member{{ID: "node2", RaftAddr: addr, HTTPAddr: self.HTTPAddr}}
		_, again.Transport = raft.NewInmemTransport(raft.ServerAddress(addr))
		_, err := NewNode(again)
		wantRefused(t, "node1's directory started as node2 at "+addr, err, ErrWrongNode, "belongs to node node1", "give --node-id node1")
	}
	_, cfg.Transport = raft.NewInmemTransport(raft.ServerAddress(self.RaftAddr))
	if n, err = NewNode(cfg); err != nil {
		t.Fatalf("node1's directory started as node1: %v", err)
	}
	n.Close()

	// No Raft state: the id it is given.
	join := Config{ID: "n4", RaftAddr: "inmem-n4", HTTPAddr: "http-n4", DataDir: filepath.Join(t.TempDir(), "n4"), Logger: quiet}
	_, join.Transport = raft.NewInmemTransport("inmem-n4")
	if n, err = NewNode(join); err != nil {
		t.Fatal(err)
	}
	n.Close()
	join.ID = "n5"
	_, join.Transport = raft.NewInmemTransport("inmem-n4")
	if n, err = NewNode(join); err != nil {
		t.Fatalf("a directory without Raft state started as another id: %v", err)
	}
	n.Close()
}

// TestARestartAtAnotherRaftAddressIsRefused: a member restarted with
// another Raft address than its cluster's configuration lists is refused
// (ErrRaftAddrChanged), saying how to move a member. From a review: it
// started, its peers dialled the old address, and it stayed a candidate
// for good without a hint. Another HTTP address alone is taken.
func TestARestartAtAnotherRaftAddressIsRefused(t *testing.T) {
	c := newInmemCluster(t, 3)
	cfg3 := c.nodes[2].cfg
	if err := c.nodes[2].Close(); err != nil {
		t.Fatal(err)
	}
	moved := cfg3
	moved.RaftAddr = "inmem-n3-moved"
	_, moved.Transport = raft.NewInmemTransport(raft.ServerAddress(moved.RaftAddr))
	_, err := NewNode(moved)
	wantRefused(t, "n3 started at another raft address", err, ErrRaftAddrChanged,
		"this node is n3 at "+cfg3.RaftAddr+" in its cluster's configuration; --raft-addr is inmem-n3-moved",
		"start it with --raft-addr "+cfg3.RaftAddr, "To move a member, remove it (kvctl members remove n3)")

	again := cfg3
	again.HTTPAddr = "http-n3-moved"
	_, again.Transport = raft.NewInmemTransport(raft.ServerAddress(cfg3.RaftAddr))
	n3, err := NewNode(again)
	if err != nil {
		t.Fatalf("n3 started at another HTTP address: %v", err)
	}
	c.nodes[2] = n3
}

// upToIndex passes on the RPCs of an in-memory transport, but refuses
// every AppendEntries whose first entry is above limit: the node receives
// the leader's log as far as the test lets it, batch by batch
// (MaxAppendEntries, 256), as a node stopped (or crashed) part-way through
// its catch-up has. A limit of 1 passes the first batch only; noLimit,
// everything. Its Close (the node's) ends its goroutine.
type upToIndex struct {
	*raft.InmemTransport
	ch    chan raft.RPC
	limit atomic.Uint64
	done  chan struct{}
	once  sync.Once
}

// noLimit is an upToIndex limit that passes every AppendEntries.
const noLimit = math.MaxUint64

func newUpToIndex(addr string, limit uint64) *upToIndex {
	_, tr := raft.NewInmemTransport(raft.ServerAddress(addr))
	f := &upToIndex{InmemTransport: tr, ch: make(chan raft.RPC), done: make(chan struct{})}
	f.limit.Store(limit)
	go func() {
		for {
			var rpc raft.RPC
			select {
			case <-f.done:
				return
			case rpc = <-tr.Consumer():
			}
			if ae, ok := rpc.Command.(*raft.AppendEntriesRequest); ok && len(ae.Entries) > 0 && ae.Entries[0].Index > f.limit.Load() {
				rpc.Respond(&raft.AppendEntriesResponse{Term: ae.Term, LastLog: ae.PrevLogEntry, Success: false}, nil)
				continue
			}
			select {
			case f.ch <- rpc:
			case <-f.done:
				return
			}
		}
	}()
	return f
}

func (f *upToIndex) Consumer() <-chan raft.RPC { return f.ch }

func (f *upToIndex) Close() error {
	f.once.Do(func() { close(f.done) })
	return f.InmemTransport.Close()
}

// connect connects f both ways with the transports of the cluster's
// nodes but skip.
func (f *upToIndex) connect(c *inmemCluster, skip int) {
	for i, o := range c.trans {
		if i != skip {
			o.Connect(f.LocalAddr(), f.InmemTransport)
			f.Connect(o.LocalAddr(), o)
		}
	}
}

// TestAMovedMemberRestartedDuringCatchUpStarts: a member moved to another
// Raft address the documented way (removed, then started at the new
// address to join, on an empty directory) and stopped part-way through
// its catch-up starts again at the new address, although its latest
// configuration (the log's first entries) lists it at the old one; at
// another address it is refused. Once it has seen itself at the new
// address the usual rule applies. From a review: it was refused every
// later start (ErrRaftAddrChanged), told to start at the old address,
// where no peer dials it.
//
// Its cluster and the moved member run with Raft timeouts of a second
// (steadyTimeouts): its point is the restart's address check, and under
// load a leader missed its 200 ms lease during the 400 barriers of the
// set-up ("leadership lost while committing log").
func TestAMovedMemberRestartedDuringCatchUpStarts(t *testing.T) {
	c := newInmemClusterTuned(t, 3, steadyTimeouts)
	li, l := c.leaderExcept(-1)
	m := (li + 1) % 3 // the member to move, a follower
	id := c.nodes[m].cfg.ID
	// More than one AppendEntries batch of log before the move.
	for i := 0; i < 400; i++ {
		if err := l.raft.Barrier(5 * time.Second).Error(); err != nil {
			t.Fatal(err)
		}
	}
	old := c.nodes[m].cfg.RaftAddr
	if err := c.nodes[m].Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveMember(ctx(t), id); err != nil {
		t.Fatal(err)
	}
	newAddr := old + "b"
	tr := newUpToIndex(newAddr, 1)
	tr.connect(c, m)
	cfg := Config{ID: id, RaftAddr: newAddr, HTTPAddr: "http-" + id, DataDir: filepath.Join(t.TempDir(), id+"b"), Transport: tr, Logger: quiet}
	steadyTimeouts(&cfg)
	n, err := NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	addNotCaughtUp(t, l, id, newAddr, cfg.HTTPAddr, time.Second)
	waitFor(t, 10*time.Second, id+" to receive the first batch of the log", func() bool { return n.raft.LastIndex() >= 200 })
	t.Logf("%s stopped at last index %d of the leader's %d", id, n.raft.LastIndex(), l.raft.LastIndex())
	if err := n.Close(); err != nil { // stopped part-way through its catch-up
		t.Fatal(err)
	}

	// At a third address it is refused: the exception is the address it
	// joined at.
	third := cfg
	third.RaftAddr = old + "c"
	third.Transport = newUpToIndex(third.RaftAddr, 1)
	_, err = NewNode(third)
	wantRefused(t, id+" restarted during its catch-up at a third address", err, ErrRaftAddrChanged, "this node is "+id+" at "+old)

	again := newUpToIndex(newAddr, noLimit)
	again.connect(c, m)
	cfg.Transport = again
	if n, err = NewNode(cfg); err != nil {
		t.Fatalf("%s restarted during its catch-up at the address the cluster lists it at (%s): %v", id, newAddr, err)
	}
	closed := false
	defer func() {
		if !closed {
			n.Close()
		}
	}()
	waitFor(t, 10*time.Second, id+" to see itself at "+newAddr, func() bool {
		for _, s := range n.raft.GetConfiguration().Configuration().Servers {
			if string(s.ID) == id && string(s.Address) == newAddr {
				return true
			}
		}
		return false
	})
	// It forgets the address it joined at once it has seen itself there
	// (leaderLoop's tick): a later move is refused as usual.
	waitFor(t, 10*time.Second, id+" to forget the address it joined at", func() bool {
		v, err := n.logs.Get(joinAddrKey)
		return err == nil && len(v) == 0
	})
	closed = true
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	back := cfg
	back.RaftAddr = old
	back.Transport = newUpToIndex(old, noLimit)
	_, err = NewNode(back)
	wantRefused(t, id+" caught up and restarted at its old address", err, ErrRaftAddrChanged, "this node is "+id+" at "+newAddr)
}

// TestAMemberMovedBackRestartedDuringCatchUpStarts: a member moved
// A -> B -> back to A (the documented way each time) and stopped during
// its second catch-up starts again at A. Its log's first entries (the
// bootstrap configuration) list it at A, the address it joined at, long
// before the entry that adds it there; the next batch lists it at B. From
// a review: the record of the address it joined at was forgotten on the
// first batch (it "saw itself at A"), and the restart at A was refused
// (ErrRaftAddrChanged), told to use B, which the cluster no longer dials.
//
// Its cluster and the moved member run with Raft timeouts of a second
// (steadyTimeouts), as TestAMovedMemberRestartedDuringCatchUpStarts's do.
func TestAMemberMovedBackRestartedDuringCatchUpStarts(t *testing.T) {
	c := newInmemClusterTuned(t, 3, steadyTimeouts)
	li, l := c.leaderExcept(-1)
	m := (li + 1) % 3 // the member to move, a follower
	id := c.nodes[m].cfg.ID
	barriers := func(k int) {
		t.Helper()
		for i := 0; i < k; i++ {
			if err := l.raft.Barrier(5 * time.Second).Error(); err != nil {
				t.Fatal(err)
			}
		}
	}
	barriers(300) // more than one AppendEntries batch of log before each move
	a := c.nodes[m].cfg.RaftAddr
	if err := c.nodes[m].Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveMember(ctx(t), id); err != nil {
		t.Fatal(err)
	}
	// Moved to B, and caught up there.
	b := a + "b"
	trB := newUpToIndex(b, noLimit)
	trB.connect(c, m)
	cfgB := Config{ID: id, RaftAddr: b, HTTPAddr: "http-" + id, DataDir: filepath.Join(t.TempDir(), id+"b"), Transport: trB, Logger: quiet}
	steadyTimeouts(&cfgB)
	nb, err := NewNode(cfgB)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.AddMember(ctx(t), id, b, cfgB.HTTPAddr); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, id+" to catch up at "+b, func() bool { return nb.raft.LastIndex() >= l.raft.LastIndex() })
	addedAtB := l.raft.LastIndex()
	barriers(300)
	if err := nb.Close(); err != nil {
		t.Fatal(err)
	}
	if err := l.RemoveMember(ctx(t), id); err != nil {
		t.Fatal(err)
	}

	// Moved back to A, on an empty directory, one batch at a time.
	trA := newUpToIndex(a, 1)
	trA.connect(c, m)
	cfgA := Config{ID: id, RaftAddr: a, HTTPAddr: "http-" + id, DataDir: filepath.Join(t.TempDir(), id+"a"), Transport: trA, Logger: quiet}
	steadyTimeouts(&cfgA)
	na, err := NewNode(cfgA)
	if err != nil {
		t.Fatal(err)
	}
	addNotCaughtUp(t, l, id, a, cfgA.HTTPAddr, time.Second)
	waitFor(t, 10*time.Second, id+" to receive the first batch of the log", func() bool { return na.raft.LastIndex() >= 200 })
	// leaderLoop's tick that finds the node in its latest configuration
	// (the bootstrap one, at A) records it a member (wasMember), then runs
	// noteJoined: the record must outlive that tick and a few more.
	waitFor(t, 10*time.Second, id+" to see itself in the bootstrap configuration", na.wasMember.Load)
	for deadline := time.Now().Add(100 * time.Millisecond); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if v, err := na.logs.Get(joinAddrKey); err != nil || string(v) != a {
			t.Fatalf("%s at last index %d of the leader's %d (added at %s after it): join record %q (%v), want %q kept",
				id, na.raft.LastIndex(), l.raft.LastIndex(), a, v, err, a)
		}
	}
	trA.limit.Store(na.raft.LastIndex() + 1)
	waitFor(t, 10*time.Second, id+" to receive the batch that lists it at "+b, func() bool { return na.raft.LastIndex() >= addedAtB })
	t.Logf("%s stopped at last index %d (added at %s at ~%d) of the leader's %d", id, na.raft.LastIndex(), b, addedAtB, l.raft.LastIndex())
	if err := na.Close(); err != nil {
		t.Fatal(err)
	}

	again := cfgA
	tr := newUpToIndex(a, noLimit)
	tr.connect(c, m)
	again.Transport = tr
	n, err := NewNode(again)
	if err != nil {
		t.Fatalf("%s restarted during its catch-up at %s, where the cluster lists it: %v", id, a, err)
	}
	defer n.Close()
	// Caught up, it forgets the address it joined at.
	waitFor(t, 10*time.Second, id+" to forget the address it joined at", func() bool {
		v, err := n.logs.Get(joinAddrKey)
		return err == nil && len(v) == 0
	})
}

// TestTheOnlyVoterRestartedAtAnotherRaftAddress: a cluster's only voter
// restarted at another Raft address is refused, and told how to move it:
// the advice for a member (remove it, add it at the new address) is
// impossible for the last voter. The same IP literal spelled otherwise
// ([0:0::1] for [::1]) is its address; a hostname is compared as text.
// From a review: the refusal told the operator to remove it with kvctl
// members remove, which refuses the last voter.
func TestTheOnlyVoterRestartedAtAnotherRaftAddress(t *testing.T) {
	const addr = "[::1]:7000"
	_, tr := raft.NewInmemTransport(addr)
	self := Member{ID: "n1", RaftAddr: addr, HTTPAddr: "http-n1"}
	cfg := Config{ID: self.ID, RaftAddr: self.RaftAddr, HTTPAddr: self.HTTPAddr, DataDir: filepath.Join(t.TempDir(), "n1"),
		Peers: []Member{self}, Transport: tr, Logger: quiet}
	n, err := NewNode(cfg)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "n1 to lead", func() bool { return n.IsLeader() && n.ledThisTerm() })
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	for _, other := range []string{"[::1]:7001", "localhost:7000", "127.0.0.1:7000"} {
		moved := cfg
		moved.RaftAddr = other
		moved.HTTPAddr = "http-n1-moved"
		_, moved.Transport = raft.NewInmemTransport(raft.ServerAddress(other))
		_, err := NewNode(moved)
		wantRefused(t, "the only voter restarted at "+other, err, ErrRaftAddrChanged,
			"this node is n1 at "+addr+" in its cluster's configuration; --raft-addr is "+other, "start it with --raft-addr "+addr,
			"its cluster's only voter", "kvctl snapshot save FILE", "kvctl snapshot restore FILE --data-dir NEWDIR --node-id n1 --peers n1="+other+"=http-n1-moved")
		if strings.Contains(err.Error(), "members remove") {
			t.Fatalf("the only voter restarted at %s: %q, want no advice to remove it", other, err)
		}
	}
	for _, same := range []string{"[0:0::1]:7000", "[0:0:0:0:0:0:0:1]:07000"} {
		again := cfg
		again.RaftAddr = same
		_, again.Transport = raft.NewInmemTransport(raft.ServerAddress(same))
		if n, err = NewNode(again); err != nil {
			t.Fatalf("n1 restarted at %s, its address %s spelled otherwise: %v", same, addr, err)
		}
		if err := n.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSameRaftAddr: equal IP literals with equal ports are one address;
// hostnames compare as text.
func TestSameRaftAddr(t *testing.T) {
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{"127.0.0.1:7000", "127.0.0.1:7000", true},
		{"[::1]:7000", "[0:0::1]:7000", true},
		{"[::1]:7000", "[::1]:07000", true},
		{"[::ffff:127.0.0.1]:7000", "127.0.0.1:7000", true},
		{"[fe80::1%eth0]:7000", "[fe80::1%eth0]:7000", true},
		{"[fe80::1%eth0]:7000", "[fe80::1%eth1]:7000", false},
		{"[::1]:7000", "[::1]:7001", false},
		{"localhost:7000", "127.0.0.1:7000", false},
		{"Node1:7000", "node1:7000", false},
		{"inmem-n1", "inmem-n1", true},
	} {
		if got := SameRaftAddr(c.a, c.b); got != c.same {
			t.Errorf("SameRaftAddr(%q, %q) = %v, want %v", c.a, c.b, got, c.same)
		}
	}
}
