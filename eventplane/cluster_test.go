package eventplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m, testwatch.NodeIgnores()...), testwatch.NodeIgnores()...)
}

var quiet = slog.New(slog.DiscardHandler)

// testCluster is 3 raftfsm nodes on loopback TCP, each with its embedded
// NATS server (clustered) and its ingester, as cmd/kvrouter wires them.
type testCluster struct {
	t     *testing.T
	nodes []*raftfsm.Node
	nats  []*server.Server
	conns []*nats.Conn
	ings  []*Ingester
}

func newTestCluster(t *testing.T, n int) *testCluster {
	t.Helper()
	return newTestClusterWith(t, n, IngesterConfig{})
}

// newTestClusterWith is newTestCluster whose ingesters have icfg's
// settings (its Conn, Node and Logger are each node's).
func newTestClusterWith(t *testing.T, n int, icfg IngesterConfig) *testCluster {
	t.Helper()
	c := &testCluster{t: t}
	base := t.TempDir()
	t.Cleanup(c.close)
	// NATS first: server 0 listens for routes, the others route to it.
	var seed string
	for i := 0; i < n; i++ {
		cfg := ServerConfig{Name: fmt.Sprintf("n%d", i+1), Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0"}
		if seed != "" {
			cfg.Routes = []string{seed}
		}
		s, err := StartServer(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if seed == "" {
			seed = s.ClusterAddr().String()
		}
		c.nats = append(c.nats, s)
	}
	waitFor(t, 10*time.Second, "nats routes", func() bool {
		for _, s := range c.nats {
			if s.NumRoutes() < n-1 {
				return false
			}
		}
		return true
	})
	trs := make([]*raft.NetworkTransport, n)
	var peers []raftfsm.Member
	for i := 0; i < n; i++ {
		tr, err := raftfsm.NewTransport("127.0.0.1:0", nil, 2*time.Second, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		trs[i] = tr
		peers = append(peers, raftfsm.Member{ID: fmt.Sprintf("n%d", i+1), RaftAddr: string(tr.LocalAddr()), HTTPAddr: fmt.Sprintf("http-n%d", i+1)})
	}
	for i := 0; i < n; i++ {
		node, err := raftfsm.NewNode(raftfsm.Config{ID: peers[i].ID, RaftAddr: peers[i].RaftAddr, HTTPAddr: peers[i].HTTPAddr,
			DataDir: filepath.Join(base, peers[i].ID), Peers: peers, Transport: trs[i], Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, node)
		nc, err := nats.Connect("", nats.InProcessServer(c.nats[i]), nats.NoReconnect())
		if err != nil {
			t.Fatal(err)
		}
		c.conns = append(c.conns, nc)
		icfg.Conn, icfg.Node, icfg.Logger = nc, node, quiet
		in, err := NewIngester(icfg)
		if err != nil {
			t.Fatal(err)
		}
		c.ings = append(c.ings, in)
	}
	return c
}

// stop closes node i as a crash of the whole process would: its ingester,
// its Raft node and its NATS server.
func (c *testCluster) stop(i int) {
	if c.nodes[i] == nil {
		return
	}
	c.ings[i].Close()
	c.nodes[i].Close()
	c.conns[i].Close()
	c.nats[i].Shutdown()
	c.nats[i].WaitForShutdown()
	c.nodes[i] = nil
}

func (c *testCluster) close() {
	for i := range c.nodes {
		c.stop(i)
	}
}

func (c *testCluster) leader() int {
	c.t.Helper()
	l := -1
	waitFor(c.t, 10*time.Second, "a leader", func() bool {
		for i, n := range c.nodes {
			if n != nil && n.IsLeader() {
				l = i
				return true
			}
		}
		return false
	})
	return l
}

// converged waits until every running node has applied the same index and
// reports the same digest, and returns the leader's node.
func (c *testCluster) converged() *raftfsm.Node {
	c.t.Helper()
	var l *raftfsm.Node
	waitFor(c.t, 15*time.Second, "replicas to converge", func() bool {
		l = c.nodes[c.leader()]
		want := l.Raft().LastIndex()
		st := l.Status()
		for _, n := range c.nodes {
			if n == nil {
				continue
			}
			s := n.Status()
			if n.Raft().AppliedIndex() < want || s.Digest != st.Digest || s.AppliedIndex != st.AppliedIndex {
				return false
			}
		}
		return true
	})
	return l
}

func (c *testCluster) url(i int) string { return c.nats[i].ClientURL() }

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var _ = errors.Is
