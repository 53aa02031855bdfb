package e2e

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// secure is the token and TLS certificate a cluster runs with: one
// self-signed certificate for 127.0.0.1, every node's and its own CA.
type secure struct {
	token             string
	certFile, keyFile string
	tokenFile         string
}

func newSecure(t *testing.T) *secure {
	t.Helper()
	dir := t.TempDir()
	s := &secure{token: "e2e-" + rand.Text(), tokenFile: filepath.Join(dir, "token")}
	s.certFile, s.keyFile = apitest.WriteSelfSigned(t, dir)
	if err := os.WriteFile(s.tokenFile, []byte(s.token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return s
}

// nodeArgs are the flags every node of the cluster runs with.
func (s *secure) nodeArgs() []string {
	return []string{"--token-file", s.tokenFile, "--tls-cert", s.certFile, "--tls-key", s.keyFile, "--tls-ca", s.certFile}
}

// client is a client of endpoints over TLS, with token.
func (s *secure) client(t *testing.T, token string, endpoints ...string) *client.Client {
	t.Helper()
	cfg, err := client.TLSConfig(s.certFile)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := client.New(endpoints, client.Options{UserAgent: "kvrouter-e2e", Token: token, Scheme: "https", TLS: cfg})
	if err != nil {
		t.Fatalf("client of %v: %v", endpoints, err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// startClusterSecure is startCluster with every node serving its API over
// TLS and asking for a token.
func startClusterSecure(t *testing.T, n int) *cluster {
	t.Helper()
	c := newCluster(t, n)
	c.sec = newSecure(t)
	c.assignPorts() // clients with the token and TLS
	c.bootstrap()
	return c
}

// TestTokenAndTLS runs a cluster whose nodes serve TLS and ask for a
// token: clients with both are served, a follower forwards a write to the
// leader over TLS with the client's token, a node joins through --join,
// and kvctl without the token, or with another, is refused and says what
// to do. The probes answer without a token.
func TestTokenAndTLS(t *testing.T) {
	c := startClusterSecure(t, 3)
	leader := c.leader()
	follower := (leader + 1) % len(c.nodes)

	if r := c.kvctl("status"); r.code != 0 || strings.Count(r.stdout, "\n") < 4 {
		t.Fatalf("kvctl status with the token and CA: %v", r)
	}
	// A registration sent to a follower only: it forwards it. A write
	// waits on a leader and its commit: an election (a loaded machine
	// misses heartbeats), or a leader slower than a call's time, answers
	// 503 no_leader, an unknown outcome or a timeout, and the
	// registration, an upsert, is sent again; anything else fails.
	w := raftfsm.WorkerInfo{ID: 42, DPRanks: []uint32{0}, BlockSize: 16, Model: "m"}
	c.waitFor(leaderTimeout, "a registration through the follower "+c.nodes[follower].id, func() (bool, string) {
		err := c.nodes[follower].cl.RegisterWorker(ctxT(t, callTimeout), w)
		if err != nil && !isRefusal(err) && !errors.Is(err, client.ErrOutcomeUnknown) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("register through the follower %s: %v", c.nodes[follower].id, err)
		}
		return err == nil, fmt.Sprint(err)
	})
	c.waitFor(readyTimeout, "the worker on every node", func() (bool, string) {
		for _, n := range c.nodes {
			ws, err := n.cl.Workers(ctxT(t, callTimeout))
			if err != nil || !slices.ContainsFunc(ws, func(w api.Worker) bool { return w.WorkerID == 42 }) {
				return false, n.id + " lacks worker 42"
			}
		}
		return true, ""
	})

	// kvctl without the token, or with another: exit 1, one line saying so.
	for _, args := range [][]string{
		{"--endpoints", c.endpoints(), "--tls-ca", c.sec.certFile, "workers"},
		{"--endpoints", c.endpoints(), "--tls-ca", c.sec.certFile, "--token", "not-it", "workers"},
	} {
		r := runKvctl(t, args...)
		if r.code != 1 || !strings.Contains(r.stderr, "--token") || strings.Count(strings.TrimSpace(r.stderr), "\n") != 0 {
			t.Fatalf("kvctl without the cluster's token: %v; want exit 1 and one line naming --token", r)
		}
		t.Logf("kvctl %s: %s", strings.Join(args[4:], " "), strings.TrimSpace(r.stderr))
	}
	// With another CA, the nodes' certificate is not trusted.
	other := newSecure(t)
	if r := runKvctl(t, "--endpoints", c.endpoints(), "--token", c.sec.token, "--timeout", "5s", "--tls-ca", other.certFile, "workers"); r.code != 1 || !strings.Contains(r.stderr, "not trusted") {
		t.Fatalf("kvctl trusting another CA: %v; want exit 1 saying the certificate is not trusted", r)
	}
	// A client without the token is refused by the node that answers; its
	// probes are not.
	bare := c.sec.client(t, "", c.nodes[follower].httpAddr)
	if _, err := bare.Workers(ctxT(t, callTimeout)); !errors.Is(err, client.ErrUnauthorized) {
		t.Fatalf("workers without the token: %v, want ErrUnauthorized", err)
	}
	// Ready unless an election is on (a loaded machine): polled.
	c.waitFor(leaderTimeout, "readyz without the token to answer ready", func() (bool, string) {
		r, err := bare.Ready(ctxT(t, callTimeout))
		if errors.Is(err, client.ErrUnauthorized) {
			t.Fatalf("readyz without the token: %v", err)
		}
		return err == nil && r.Ready, fmt.Sprintf("%+v, %v", r, err)
	})
	// Plain HTTP to a TLS node is no API.
	plain := newClient(t, c.nodes[leader].httpAddr)
	defer plain.Close()
	if _, err := plain.Status(ctxT(t, callTimeout)); err == nil {
		t.Fatal("plain HTTP to a node that serves TLS was answered")
	}

	// A fourth node joins through a member's address: over TLS, with the
	// token.
	ports := freePorts(t, 3)
	n4 := &node{id: "n4", raftAddr: ports[0], httpAddr: ports[1], natsAddr: ports[2], dir: filepath.Join(c.base, "n4"),
		logPath: filepath.Join(c.base, "n4.log"), join: c.nodes[follower].httpAddr}
	n4.cl = c.newClient(n4.httpAddr)
	c.nodes = append(c.nodes, n4)
	c.start(3)
	c.waitFor(readyTimeout, "n4 a voter", func() (bool, string) {
		if again, why := c.restartIfPortTaken(3); again {
			return false, why
		}
		ms, err := c.cl.Members(ctxT(t, callTimeout))
		if err != nil {
			return false, err.Error()
		}
		for _, m := range ms {
			if m.ID == "n4" && m.Voter {
				return true, ""
			}
		}
		return false, fmt.Sprintf("members %+v", ms)
	})
	c.waitReady(3)
	if ws, err := n4.cl.Workers(ctxT(t, callTimeout)); err != nil || !slices.ContainsFunc(ws, func(w api.Worker) bool { return w.WorkerID == 42 }) {
		t.Fatalf("n4's workers: %+v, %v; want worker 42", ws, err)
	}
}
