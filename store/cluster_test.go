package store

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"maps"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/internal/testlog"
)

// counterFSM is the smallest state machine that still catches a store bug:
// commands carry an id; the FSM counts distinct ids (so a client may retry a
// command whose outcome it did not learn) and folds every applied command, in
// log order, into a digest that differs if any replica applies a different
// sequence.
type counterFSM struct {
	mu     sync.Mutex
	seen   map[uint64]bool
	sum    uint64
	digest uint64
}

func newCounterFSM() *counterFSM { return &counterFSM{seen: map[uint64]bool{}} }

func (f *counterFSM) Apply(l *raft.Log) any {
	if len(l.Data) != 8 {
		return fmt.Errorf("command is %d bytes, want 8", len(l.Data))
	}
	id := binary.BigEndian.Uint64(l.Data)
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.seen[id] {
		f.seen[id] = true
		f.sum += id
	}
	h := fnv.New64a()
	_ = binary.Write(h, binary.BigEndian, [2]uint64{f.digest, id})
	f.digest = h.Sum64()
	return nil
}

type counterState struct {
	Count, Sum, Digest uint64
}

func (f *counterFSM) state() counterState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return counterState{uint64(len(f.seen)), f.sum, f.digest}
}

func (f *counterFSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var b []byte
	b = binary.BigEndian.AppendUint64(b, f.digest)
	for _, id := range slices.Sorted(maps.Keys(f.seen)) {
		b = binary.BigEndian.AppendUint64(b, id)
	}
	return counterSnapshot(b), nil
}

func (f *counterFSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return err
	}
	if len(b) < 8 || len(b)%8 != 0 {
		return fmt.Errorf("counter snapshot is %d bytes", len(b))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.digest = binary.BigEndian.Uint64(b)
	f.seen, f.sum = map[uint64]bool{}, 0
	for b = b[8:]; len(b) > 0; b = b[8:] {
		id := binary.BigEndian.Uint64(b)
		f.seen[id] = true
		f.sum += id
	}
	return nil
}

type counterSnapshot []byte

func (s counterSnapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(s); err != nil {
		_ = sink.Cancel()
		return err
	}
	return sink.Close()
}

func (counterSnapshot) Release() {}

type raftTestNode struct {
	id    raft.ServerID
	addr  raft.ServerAddress
	dir   string
	store *LogStore
	trans *raft.InmemTransport
	fsm   *counterFSM
	raft  *raft.Raft
}

type raftTestCluster struct {
	t     *testing.T
	nodes []*raftTestNode
	logs  testlog.Buffer
}

const clusterTrailingLogs = 20

func (c *raftTestCluster) config(n *raftTestNode) *raft.Config {
	conf := raft.DefaultConfig()
	conf.LocalID = n.id
	conf.HeartbeatTimeout = 100 * time.Millisecond
	conf.ElectionTimeout = 100 * time.Millisecond
	conf.LeaderLeaseTimeout = 50 * time.Millisecond
	conf.CommitTimeout = 5 * time.Millisecond
	// Snapshots happen when the test asks for them, never on a timer.
	conf.SnapshotThreshold = 1 << 40
	conf.SnapshotInterval = time.Hour
	conf.TrailingLogs = clusterTrailingLogs
	conf.LogOutput = &c.logs
	conf.LogLevel = "WARN"
	return conf
}

func newRaftTestCluster(t *testing.T, size int) *raftTestCluster {
	c := &raftTestCluster{t: t}
	t.Cleanup(func() {
		for _, n := range c.nodes {
			if n.raft != nil {
				c.stop(n)
			}
		}
		if t.Failed() {
			t.Logf("raft log:\n%s", c.logs.String())
		}
	})
	var servers []raft.Server
	for i := range size {
		n := &raftTestNode{id: raft.ServerID("node" + strconv.Itoa(i)), dir: t.TempDir()}
		n.addr = raft.ServerAddress(n.id)
		c.nodes = append(c.nodes, n)
		servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: n.id, Address: n.addr})
	}
	for _, n := range c.nodes {
		c.start(n, &raft.Configuration{Servers: servers})
	}
	return c
}

// start opens the node's store and snapshot store on its directories and
// starts raft on them; bootstrap is only for the very first start.
func (c *raftTestCluster) start(n *raftTestNode, bootstrap *raft.Configuration) {
	t := c.t
	t.Helper()
	var err error
	n.store, err = OpenLogStore(filepath.Join(n.dir, "raft"), LogStoreOptions{Logger: logStoreTestLogger(t)})
	if err != nil {
		t.Fatalf("%s: open store: %v", n.id, err)
	}
	snaps, err := raft.NewFileSnapshotStore(filepath.Join(n.dir, "snapshots"), 2, &c.logs)
	if err != nil {
		t.Fatalf("%s: snapshot store: %v", n.id, err)
	}
	_, n.trans = raft.NewInmemTransport(n.addr)
	for _, o := range c.nodes {
		if o != n && o.raft != nil {
			n.trans.Connect(o.addr, o.trans)
			o.trans.Connect(n.addr, n.trans)
		}
	}
	conf := c.config(n)
	if bootstrap != nil {
		if err := raft.BootstrapCluster(conf, n.store, n.store, snaps, n.trans, *bootstrap); err != nil {
			t.Fatalf("%s: bootstrap: %v", n.id, err)
		}
	}
	n.fsm = newCounterFSM()
	n.raft, err = raft.NewRaft(conf, n.fsm, n.store, n.store, snaps, n.trans)
	if err != nil {
		t.Fatalf("%s: start raft: %v", n.id, err)
	}
}

// stop shuts raft down, cuts the node off from its peers and closes its
// store, leaving its directories as a clean shutdown would.
func (c *raftTestCluster) stop(n *raftTestNode) {
	if err := n.raft.Shutdown().Error(); err != nil {
		c.t.Errorf("%s: shutdown: %v", n.id, err)
	}
	n.raft = nil
	for _, o := range c.nodes {
		if o != n && o.trans != nil {
			o.trans.Disconnect(n.addr)
		}
	}
	if err := n.store.Close(); err != nil {
		c.t.Errorf("%s: close store: %v", n.id, err)
	}
}

func waitForLogStore(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond) // poll interval
	}
}

func (c *raftTestCluster) leader() *raftTestNode {
	for _, n := range c.nodes {
		if n.raft != nil && n.raft.State() == raft.Leader {
			return n
		}
	}
	return nil
}

func (c *raftTestCluster) waitLeader() *raftTestNode {
	c.t.Helper()
	var l *raftTestNode
	waitForLogStore(c.t, 20*time.Second, "a leader", func() bool { l = c.leader(); return l != nil })
	return l
}

// apply commits commands lo..hi. They are pipelined to the leader (so raft
// groups them into StoreLogs batches); any whose outcome is unknown (the
// leader changed) is retried, which the FSM's id set makes safe.
func (c *raftTestCluster) apply(lo, hi uint64) {
	t := c.t
	t.Helper()
	pending := map[uint64]bool{}
	for id := lo; id <= hi; id++ {
		pending[id] = true
	}
	deadline := time.Now().Add(30 * time.Second)
	for len(pending) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d commands still not committed", len(pending))
		}
		l := c.waitLeader()
		futures := map[uint64]raft.ApplyFuture{}
		for id := range pending {
			futures[id] = l.raft.Apply(binary.BigEndian.AppendUint64(nil, id), 5*time.Second)
		}
		for id, f := range futures {
			if err := f.Error(); err == nil {
				delete(pending, id)
			} else {
				t.Logf("command %d: %v (will retry)", id, err)
			}
		}
	}
}

// waitAgree waits until every running node's FSM holds want commands and all
// digests are equal.
func (c *raftTestCluster) waitAgree(want uint64) counterState {
	c.t.Helper()
	var states map[raft.ServerID]counterState
	agreed := func() bool {
		states = map[raft.ServerID]counterState{}
		var first *counterState
		for _, n := range c.nodes {
			if n.raft == nil {
				continue
			}
			s := n.fsm.state()
			states[n.id] = s
			if s.Count != want || (first != nil && s != *first) {
				return false
			}
			first = &s
		}
		return true
	}
	deadline := time.Now().Add(20 * time.Second)
	for !agreed() {
		if time.Now().After(deadline) {
			c.t.Fatalf("FSMs never agreed on %d commands: %+v", want, states)
		}
		time.Sleep(5 * time.Millisecond)
	}
	for _, s := range states {
		return s
	}
	return counterState{}
}

// checkNoHoles reads every entry between the node's FirstIndex and LastIndex.
func checkNoHoles(t *testing.T, n *raftTestNode) (first, last uint64) {
	t.Helper()
	first, _ = n.store.FirstIndex()
	last, _ = n.store.LastIndex()
	for i := first; i <= last && last != 0; i++ {
		var l raft.Log
		if err := n.store.GetLog(i, &l); err != nil {
			t.Fatalf("%s: GetLog(%d) in [%d, %d]: %v", n.id, i, first, last, err)
		}
	}
	return first, last
}

func snapshotIndex(t *testing.T, n *raftTestNode) uint64 {
	t.Helper()
	v, err := strconv.ParseUint(n.raft.Stats()["last_snapshot_index"], 10, 64)
	if err != nil {
		t.Fatalf("%s: last_snapshot_index: %v", n.id, err)
	}
	return v
}

// TestRaftClusterOnLogStore runs a real three-node hashicorp/raft cluster on
// this store: replication, snapshot with log compaction, and a follower that
// restarts on its own directories after the leader compacted past it, so it
// must catch up by snapshot install (which, the store being monotonic,
// clears its old log) and then by log replication.
func TestRaftClusterOnLogStore(t *testing.T) {
	c := newRaftTestCluster(t, 3)
	leader := c.waitLeader()

	c.apply(1, 300)
	want := c.waitAgree(300)
	t.Logf("300 commands applied on every node, digest %x", want.Digest)

	// Snapshot every node; each compacts its log from the head down to
	// TrailingLogs entries behind its last index.
	for _, n := range c.nodes {
		before, _ := n.store.FirstIndex()
		if err := n.raft.Snapshot().Error(); err != nil {
			t.Fatalf("%s: snapshot: %v", n.id, err)
		}
		first, last := checkNoHoles(t, n)
		if first <= before || last-first+1 < clusterTrailingLogs {
			t.Fatalf("%s: after snapshot log is [%d, %d], was from %d: want compaction keeping >= %d entries",
				n.id, first, last, before, clusterTrailingLogs)
		}
		mustMiss(t, n.store, first-1)
	}

	// Take a follower down; the others commit more and compact past its log.
	var down *raftTestNode
	for _, n := range c.nodes {
		if n != leader {
			down = n
			break
		}
	}
	_, downLast := checkNoHoles(t, down)
	c.stop(down)
	c.apply(301, 500)
	c.waitAgree(500)
	// Both running nodes snapshot and compact past the stopped follower's
	// log, not the leader alone: under load the leader can miss a
	// heartbeat and the other be elected, and a leader whose log still
	// held the follower's next entry would catch it up by replication,
	// with no snapshot to install.
	leaderSnap := uint64(math.MaxUint64) // the least of their snapshots: whichever leads sends its own
	for _, n := range c.nodes {
		if n.raft == nil {
			continue
		}
		if err := n.raft.Snapshot().Error(); err != nil {
			t.Fatalf("%s: snapshot: %v", n.id, err)
		}
		leaderSnap = min(leaderSnap, snapshotIndex(t, n))
		if first, _ := n.store.FirstIndex(); first <= downLast+1 {
			t.Fatalf("%s: log starts at %d, not past the stopped follower's last index %d", n.id, first, downLast)
		}
	}

	// Restart it on the same directories: it restores its own snapshot,
	// replays its log, then installs the leader's snapshot and catches up.
	c.start(down, nil)
	final := c.waitAgree(500)
	// The FSM is restored before raft records the installed snapshot.
	waitForLogStore(t, 20*time.Second, "the restarted follower to install the leader's snapshot", func() bool {
		return snapshotIndex(t, down) >= leaderSnap
	})
	// And it keeps up with new writes, in a log that starts after its old
	// one: installing the snapshot removed every stale entry, leaving no gap.
	c.apply(501, 520)
	c.waitAgree(520)
	waitForLogStore(t, 20*time.Second, "the restarted follower's log to end where the leader's does", func() bool {
		l, _ := c.waitLeader().store.LastIndex()
		d, _ := down.store.LastIndex()
		return l == d
	})
	first, last := checkNoHoles(t, down)
	if first <= downLast {
		t.Fatalf("restarted follower's log is [%d, %d]: entries up to %d from before the snapshot install remain", first, last, downLast)
	}
	t.Logf("stats of the restarted follower: %v", down.raft.Stats())
	t.Logf("restarted follower: log [%d, %d] (was up to %d before the restart), digest %x", first, last, downLast, final.Digest)
}
