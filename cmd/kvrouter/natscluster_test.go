package main

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestAJoinedAndARestartedNodeJoinTheNATSCluster: a node started with
// --join and the embedded NATS flags (--nats-cluster-addr, --nats-routes
// to the first node, --nats-user and --nats-password as every node has)
// joins the NATS cluster, and so does the node restarted on its data
// directory (without --join, as docs/operations.md allows): a message
// published through its NATS reaches a subscriber on the first node's.
// The first node routes to no one, so the route is the joining node's
// dial, which sends the credentials the route port asks for. From a
// review: with --nats-routes dropped under --join, or the cluster
// address and routes under a data directory that holds a cluster, every
// test passed.
func TestAJoinedAndARestartedNodeJoinTheNATSCluster(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	creds := []string{"--nats-user", "alice", "--nats-password", "s3cret", "--log-level", "error"}
	var h1, nats1, cluster1 string
	leader := startNode(t, ctx, func() []string {
		h1, nats1, cluster1 = freeAddr(t), freeAddr(t), freeAddr(t)
		return append([]string{"--node-id", "n1", "--data-dir", t.TempDir(), "--raft-addr", freeAddr(t), "--http-addr", h1,
			"--nats-addr", nats1, "--nats-cluster-addr", cluster1}, creds...)
	}, func() bool { return answersReady(h1) })
	defer func() { cancel(); <-leader }()

	var h2, r2, dir2, nats2, cluster2 string
	n2 := func() []string {
		return append([]string{"--node-id", "n2", "--data-dir", dir2, "--raft-addr", r2, "--http-addr", h2,
			"--nats-addr", nats2, "--nats-cluster-addr", cluster2, "--nats-routes", cluster1}, creds...)
	}
	ctx2, cancel2 := context.WithCancel(ctx)
	defer cancel2()
	joined := startNode(t, ctx2, func() []string {
		h2, r2, dir2, nats2, cluster2 = freeAddr(t), freeAddr(t), t.TempDir(), freeAddr(t), freeAddr(t)
		return append(n2(), "--join", h1)
	}, func() bool { return answersReady(h2) })
	natsCrosses(t, joined, nats2, nats1, "n2, started with --join")
	cancel2()
	if err := <-joined; err != nil {
		t.Fatalf("n2's first run: %v", err)
	}

	ctx3, cancel3 := context.WithCancel(ctx)
	defer cancel3()
	restarted, err := runUntilReady(t, ctx3, append([]string{"kvrouter"}, n2()...), func() bool { return answersReady(h2) })
	if err != nil {
		t.Fatalf("n2 restarted on its data directory: %v", err)
	}
	natsCrosses(t, restarted, nats2, nats1, "n2, restarted on its data directory")
	cancel3()
	if err := <-restarted; err != nil {
		t.Errorf("n2's second run: %v", err)
	}
}

// natsCrosses fails the test unless a message published through the
// embedded NATS at from reaches a subscriber on the one at to within
// 5 s; done is the publishing node's (pollRunning).
func natsCrosses(t *testing.T, done chan error, from, to, what string) {
	t.Helper()
	connect := func(addr string) *nats.Conn {
		nc, err := nats.Connect("nats://"+addr, nats.UserInfo("alice", "s3cret"))
		if err != nil {
			t.Fatalf("connect to the NATS at %s: %v", addr, err)
		}
		return nc
	}
	sub, pub := connect(to), connect(from)
	defer sub.Close()
	defer pub.Close()
	got := make(chan struct{}, 1)
	if _, err := sub.Subscribe("test.natscluster", func(*nats.Msg) {
		select {
		case got <- struct{}{}:
		default:
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := sub.Flush(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	pollRunning(t, done, what+": a message through its NATS to reach a subscriber on n1's", func() bool {
		if time.Now().After(deadline) {
			t.Fatalf("%s: a message published through its NATS (%s) reached no subscriber on n1's (%s) in 5 s: it is not in the NATS cluster", what, from, to)
		}
		if err := pub.Publish("test.natscluster", []byte("x")); err != nil {
			t.Fatal(err)
		}
		pub.Flush()
		select {
		case <-got:
			return true
		case <-time.After(50 * time.Millisecond):
			return false
		}
	})
}
