package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// Deadlines of the harness's waits. They are generous: a loopback election
// takes well under a second, but a loaded CI machine with two cores runs
// the race-instrumented test process beside three daemons.
const (
	readyTimeout    = 30 * time.Second
	leaderTimeout   = 20 * time.Second
	convergeTimeout = 30 * time.Second
	stopTimeout     = 10 * time.Second
	pollEvery       = 20 * time.Millisecond
	callTimeout     = 2 * time.Second // one status or readiness call
)

// node is one kvrouter process of a test cluster and what it needs to be
// started again on the same data directory and addresses.
type node struct {
	id       string
	raftAddr string
	httpAddr string
	dir      string // --data-dir
	logPath  string // every run's stdout and stderr, appended
	// natsAddr is the embedded NATS server's client port; natsClusterAddr
	// its route port, when the cluster runs with NATS (startClusterNATS).
	natsAddr, natsClusterAddr string
	cl                        *client.Client
	// join, when set, is the --join address the node starts with instead
	// of --peers (a node added to a running cluster).
	join string

	p       *proc // the current run; nil before the first start
	stopped bool  // the test stopped or killed it: its exit is no failure
	paused  bool
	// removed: the test removed it from the cluster (kvctl members
	// remove) and stopped it. It is no member, so kvctl's --endpoints
	// leaves it out, as an operator's would.
	removed bool
}

// proc is one run of a node's process.
type proc struct {
	cmd       *exec.Cmd
	logOffset int64         // where this run's output starts in the log file
	done      chan struct{} // closed once the process has exited
	err       error         // cmd.Wait's answer; read it after done
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// up reports whether the node's process runs (it may be paused).
func (n *node) up() bool { return n.p != nil && !n.p.exited() }

// serving reports whether the node should run and is not paused: whether
// it must answer. A serving node whose process has exited crashed
// (statusAll fails the test then).
func (n *node) serving() bool { return n.p != nil && !n.stopped && !n.paused }

// cluster is a named builder of real-process kvrouter clusters on loopback.
// Every node's output goes to a log file, dumped into the test log when the
// test fails; every process is killed when the test ends, however it ends.
type cluster struct {
	t     *testing.T
	base  string
	nodes []*node
	cl    *client.Client // every node's endpoint, in node order
	// prepare, when set, runs before the nodes' first start, and again
	// after a port conflict made startCluster begin anew in wiped
	// directories (an offline seed, for one).
	prepare func(c *cluster)
	// nats gives every node's embedded NATS fixed ports and routes them
	// into one NATS cluster, for agents to publish to.
	nats bool
	// peersOf, when set, is node n's --peers value in place of peers():
	// the partition tests give each node the addresses of its own proxies.
	peersOf func(n *node) string
	// sec, when set, is the token and TLS every node runs with, and every
	// client and kvctl run uses (startClusterSecure).
	sec *secure
}

// startCluster starts an n-node cluster bootstrapped with --peers and
// waits until every node is ready.
func startCluster(t *testing.T, n int) *cluster {
	t.Helper()
	return startClusterWith(t, n, nil)
}

// startClusterWith is startCluster with a prepare step run on the empty
// data directories before the first start.
func startClusterWith(t *testing.T, n int, prepare func(c *cluster)) *cluster {
	t.Helper()
	c := newCluster(t, n)
	c.prepare = prepare
	c.bootstrap()
	return c
}

// startClusterNATS is startCluster with the nodes' embedded NATS servers
// on known ports, routed into one NATS cluster (agents publish there).
func startClusterNATS(t *testing.T, n int) *cluster {
	t.Helper()
	c := newCluster(t, n)
	c.nats = true
	c.assignPorts()
	c.bootstrap()
	return c
}

// natsURLs is every node's NATS client URL, comma-separated.
func (c *cluster) natsURLs() string {
	var us []string
	for _, n := range c.nodes {
		us = append(us, "nats://"+n.natsAddr)
	}
	return strings.Join(us, ",")
}

// newCluster lays out an n-node cluster (ports, data directories, log
// files) without starting it.
func newCluster(t *testing.T, n int) *cluster {
	t.Helper()
	c := &cluster{t: t, base: t.TempDir()}
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		c.nodes = append(c.nodes, &node{
			id:      id,
			dir:     filepath.Join(c.base, id),
			logPath: filepath.Join(c.base, id+".log"),
		})
	}
	c.assignPorts()
	// Cleanups run last-registered first: kill the processes, then dump
	// their logs (complete by then), then t.TempDir removes everything.
	t.Cleanup(c.dumpLogsIfFailed)
	t.Cleanup(c.killAll)
	return c
}

// assignPorts gives every node a fresh Raft, HTTP and NATS client port
// (and a NATS cluster port when the nodes' NATS servers are routed), and
// new clients. Every listener has a port of its own, kept across restarts:
// a listener on a port the OS picks could take a port of a node that is
// down (a kill of all three: n1's NATS took n3's Raft port, and n3 never
// started again).
func (c *cluster) assignPorts() {
	c.t.Helper()
	per := 3
	if c.nats {
		per = 4
	}
	ports := freePorts(c.t, per*len(c.nodes))
	var endpoints []string
	for i, n := range c.nodes {
		n.raftAddr, n.httpAddr, n.natsAddr = ports[per*i], ports[per*i+1], ports[per*i+2]
		if c.nats {
			n.natsClusterAddr = ports[per*i+3]
		}
		if n.cl != nil {
			n.cl.Close()
		}
		n.cl = c.newClient(n.httpAddr)
		endpoints = append(endpoints, n.httpAddr)
	}
	if c.cl != nil {
		c.cl.Close()
	}
	c.cl = c.newClient(endpoints...)
}

// newClient is a client of endpoints with the cluster's token and TLS.
func (c *cluster) newClient(endpoints ...string) *client.Client {
	c.t.Helper()
	if c.sec == nil {
		return newClient(c.t, endpoints...)
	}
	return c.sec.client(c.t, c.sec.token, endpoints...)
}

func newClient(t *testing.T, endpoints ...string) *client.Client {
	t.Helper()
	cl, err := client.New(endpoints, client.Options{UserAgent: "kvrouter-e2e"})
	if err != nil {
		t.Fatalf("client of %v: %v", endpoints, err)
	}
	return cl
}

// freePorts returns n distinct free loopback ports, drawn at random
// below Linux's ephemeral range (32768-60999, where the kernel picks a
// port 0 from) and listened on at once, then closed. Another process may
// take a port before a node binds it; the cluster starts anew on other
// ports then (bootstrap).
//
// Below the ephemeral range, so that no port of another package's test
// (running beside this one: go test -p) lands on a node's: a port
// another test's in-process node had, freed when that node stopped and
// handed to a node here by the kernel, had its old cluster's leader,
// still running, replicate its own log to the node here (its retries
// reach a follower's address within a tenth of a second), and the
// cluster here never converged.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	var out []string
	for tries := 0; len(out) < n; tries++ {
		if tries > 1000 {
			t.Fatalf("found %d free ports of %d in 20000-32767 in 1000 tries", len(out), n)
		}
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", 20000+rand.IntN(12768)))
		if err != nil {
			continue // taken
		}
		lns = append(lns, ln)
		out = append(out, ln.Addr().String())
	}
	return out
}

// peers is the --peers value: id=raftaddr=httpaddr for every node.
func (c *cluster) peers() string {
	var ps []string
	for _, n := range c.nodes {
		ps = append(ps, n.id+"="+n.raftAddr+"="+n.httpAddr)
	}
	return strings.Join(ps, ",")
}

// endpoints is the --endpoints value of kvctl: every member's HTTP
// address (a node the test removed from the cluster is none).
func (c *cluster) endpoints() string {
	var es []string
	for _, n := range c.members() {
		es = append(es, n.httpAddr)
	}
	return strings.Join(es, ",")
}

// members is every node but those the test removed from the cluster.
func (c *cluster) members() []*node {
	var out []*node
	for _, n := range c.nodes {
		if !n.removed {
			out = append(out, n)
		}
	}
	return out
}

// errPortInUse is a node that could not bind one of its ports.
var errPortInUse = errors.New("port in use")

// bootstrap starts every node for the first time and waits until all are
// ready. When a node finds a port taken (another process grabbed it after
// freePorts), the whole cluster starts again on new ports in wiped
// directories: its first start has bootstrapped Raft with the old
// addresses, which later --peers would not change.
func (c *cluster) bootstrap() {
	c.t.Helper()
	for attempt := 1; ; attempt++ {
		if c.prepare != nil {
			c.prepare(c)
		}
		var all []int
		for i := range c.nodes {
			c.start(i)
			all = append(all, i)
		}
		err := c.awaitReadyAll(all)
		if err == nil {
			return
		}
		if !errors.Is(err, errPortInUse) || attempt == 3 {
			c.t.Fatal(err)
		}
		c.t.Logf("%v; starting the cluster again on other ports", err)
		c.killAll()
		for _, n := range c.nodes {
			if err := os.RemoveAll(n.dir); err != nil {
				c.t.Fatal(err)
			}
		}
		c.assignPorts()
	}
}

// start starts node i's process on its data directory and addresses. The
// same command line serves every start: --peers bootstraps only an empty
// data directory.
func (c *cluster) start(i int) {
	c.t.Helper()
	n := c.nodes[i]
	if n.up() {
		c.t.Fatalf("start %s: it runs already", n.id)
	}
	peers := c.peers()
	if c.peersOf != nil {
		peers = c.peersOf(n)
	}
	args := []string{
		"--node-id", n.id, "--raft-addr", n.raftAddr, "--http-addr", n.httpAddr,
		"--data-dir", n.dir, "--log-level", "warn",
	}
	if n.join != "" {
		args = append(args, "--join", n.join)
	} else {
		args = append(args, "--peers", peers)
	}
	if c.peersOf != nil {
		// The nodes' --peers differ (each reaches the others through its
		// own proxies): one name gives them one cluster id.
		args = append(args, "--cluster-name", c.base) // one per cluster
	}
	if c.sec != nil {
		args = append(args, c.sec.nodeArgs()...)
	}
	if c.nats {
		var routes []string
		for _, o := range c.nodes {
			if o != n {
				routes = append(routes, o.natsClusterAddr)
			}
		}
		args = append(args, "--nats-addr", n.natsAddr, "--nats-cluster-addr", n.natsClusterAddr,
			"--nats-routes", strings.Join(routes, ","))
	} else {
		// Each node's embedded NATS on its own: these tests drive events
		// over HTTP.
		args = append(args, "--nats-addr", n.natsAddr)
	}
	f, err := os.OpenFile(n.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		c.t.Fatal(err)
	}
	defer f.Close() // the child has its own copy of the descriptor
	off, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		c.t.Fatal(err)
	}
	fmt.Fprintf(f, "=== e2e %s: kvrouter %s\n", time.Now().Format("15:04:05.000"), strings.Join(args, " "))
	cmd := exec.Command(kvrouterBin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = childEnv()
	cmd.SysProcAttr = sysProcAttr()
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s: %v", n.id, err)
	}
	p := &proc{cmd: cmd, logOffset: off, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	n.p, n.stopped, n.paused = p, false, false
}

// childEnv is the test's environment without the variables that the
// daemons and kvctl read as flag defaults (benchenv.ChildEnv): a
// KVROUTER_JOIN or KVCTL_OUTPUT in the shell that runs the tests must not
// change what the tests start or parse.
func childEnv() []string { return benchenv.ChildEnv() }

// signal sends sig to node i's process.
func (c *cluster) signal(i int, sig syscall.Signal) {
	c.t.Helper()
	n := c.nodes[i]
	if !n.up() {
		c.t.Fatalf("signal %v to %s: it does not run", sig, n.id)
	}
	if err := n.p.cmd.Process.Signal(sig); err != nil {
		c.t.Fatalf("signal %v to %s: %v", sig, n.id, err)
	}
}

// kill9 kills node i with SIGKILL, as a crash does, and waits for it to go.
func (c *cluster) kill9(i int) {
	c.t.Helper()
	c.nodes[i].stopped = true
	c.signal(i, syscall.SIGKILL)
	c.waitExit(i)
}

// killLeader kills the leader with SIGKILL, as a crash does, and returns
// its position and the term it led in: the leader frozen by freezeLeader,
// so that the kill cannot hit a node that lost an election since it was
// found.
func (c *cluster) killLeader() (int, uint64) {
	c.t.Helper()
	at, term := c.freezeLeader()
	c.kill9(at)
	return at, term
}

// freezeLeader freezes the leader (SIGSTOP) and returns its position and
// the term it led in, for a fault to be applied to it (a kill, a full
// disk) before it is resumed. A leader found and then faulted may have
// lost an election in between (Raft's 200 ms lease on a loaded machine),
// and the fault would hit a follower: so it is frozen first, and kept
// frozen only if the others still follow it (frozenLeading). Else it is
// let go on, and the leader of the moment is tried.
func (c *cluster) freezeLeader() (int, uint64) {
	c.t.Helper()
	var at int
	var term uint64
	c.waitFor(leaderTimeout, "the leader frozen while the others still follow it", func() (bool, string) {
		at, term = c.leaderWithTerm()
		return c.frozenLeading(at, term)
	})
	return at, term
}

// freezeAsLeader is freezeLeader for node i, which the test picked (its
// probe writes to it): it returns the term i leads in, frozen. While
// another node leads, the lead is moved back to i (kvctl leader transfer
// --to), and i is tried again.
func (c *cluster) freezeAsLeader(i int) uint64 {
	c.t.Helper()
	var term uint64
	c.waitFor(leaderTimeout, c.nodes[i].id+" frozen while it leads and the others still follow it", func() (bool, string) {
		var lead int
		lead, term = c.leaderWithTerm()
		if lead != i {
			res := c.kvctl("leader", "transfer", "--to", c.nodes[i].id)
			c.t.Logf("%s leads in term %d, where %s was found leading: moved back (kvctl exit %d: %s)",
				c.nodes[lead].id, term, c.nodes[i].id, res.code, strings.TrimSpace(res.stdout+res.stderr))
			return false, c.nodes[lead].id + " leads"
		}
		return c.frozenLeading(i, term)
	})
	return term
}

// frozenLeading freezes node i, found leading in term, and reports
// whether every other serving node, asked after the freeze, still follows
// it in that term: none of them having moved to a later term, no node can
// have been elected after it, and a frozen leader does nothing to lose
// its lead. Else it lets i go on, and says what the others follow.
func (c *cluster) frozenLeading(i int, term uint64) (bool, string) {
	c.t.Helper()
	c.pause(i)
	sts := c.statusAll()
	for j, st := range sts {
		if j != i && c.nodes[j].serving() && (st == nil || st.LeaderID != c.nodes[i].id || st.Term != term) {
			c.resume(i)
			return false, fmt.Sprintf("%s led in term %d; after its freeze: %s", c.nodes[i].id, term, describe(sts))
		}
	}
	return true, ""
}

// kill9All kills every running node at once: every SIGKILL is sent before
// the first exit is awaited.
func (c *cluster) kill9All() {
	c.t.Helper()
	for i, n := range c.nodes {
		if n.up() {
			n.stopped = true
			c.signal(i, syscall.SIGKILL)
		}
	}
	for i, n := range c.nodes {
		if n.p != nil {
			c.waitExit(i)
		}
	}
}

// stop stops node i as an operator does (SIGTERM) and waits until it has
// closed its storage and exited.
func (c *cluster) stop(i int) {
	c.t.Helper()
	n := c.nodes[i]
	n.stopped = true
	c.signal(i, syscall.SIGTERM)
	select {
	case <-n.p.done:
	case <-time.After(stopTimeout):
		n.p.cmd.Process.Kill()
		<-n.p.done
		c.t.Fatalf("%s did not exit within %v of SIGTERM", n.id, stopTimeout)
	}
	if n.p.err != nil {
		c.t.Fatalf("%s exited with %v after SIGTERM; see its log", n.id, n.p.err)
	}
}

// stopAll stops every running node.
func (c *cluster) stopAll() {
	c.t.Helper()
	for i, n := range c.nodes {
		if n.up() {
			c.stop(i)
		}
	}
}

func (c *cluster) waitExit(i int) {
	c.t.Helper()
	n := c.nodes[i]
	select {
	case <-n.p.done:
	case <-time.After(stopTimeout):
		c.t.Fatalf("%s did not exit within %v of SIGKILL", n.id, stopTimeout)
	}
	n.paused = false
}

// pause stops node i with SIGSTOP: it keeps its sockets but answers
// nothing, as a process stalled by the machine does.
func (c *cluster) pause(i int) {
	c.t.Helper()
	c.signal(i, syscall.SIGSTOP)
	c.nodes[i].paused = true
}

// resume lets a paused node go on (SIGCONT).
func (c *cluster) resume(i int) {
	c.t.Helper()
	c.signal(i, syscall.SIGCONT)
	c.nodes[i].paused = false
}

// restart starts a node that was killed or stopped again, on the same data
// directory and addresses, and waits until it is ready.
func (c *cluster) restart(i int) {
	c.t.Helper()
	c.start(i)
	c.waitReady(i)
}

// killAll kills whatever still runs; it is the cluster's cleanup, so it
// reports nothing and never fails.
func (c *cluster) killAll() {
	for _, n := range c.nodes {
		if n.up() {
			n.p.cmd.Process.Kill()
		}
	}
	for _, n := range c.nodes {
		if n.p != nil {
			<-n.p.done
		}
		n.paused = false
		if n.cl != nil {
			n.cl.Close()
		}
	}
	if c.cl != nil {
		c.cl.Close()
	}
}

// waitReady waits until node i answers GET /readyz with 200: a leader is
// known and the node has applied everything committed. A restart that
// finds its port taken is tried again on the same port until the deadline.
func (c *cluster) waitReady(i int) {
	c.t.Helper()
	deadline := time.Now().Add(readyTimeout)
	for {
		err := c.awaitReady(i)
		if err == nil {
			return
		}
		if !errors.Is(err, errPortInUse) || time.Now().After(deadline) {
			c.t.Fatal(err)
		}
		c.t.Logf("%v; starting it again", err)
		time.Sleep(100 * time.Millisecond) // let whoever holds the port let go of it
		c.start(i)
	}
}

// restartIfPortTaken is for a wait on node i, started to join a running
// cluster (--join), that polls something other than its readiness: its
// ports were free when picked (freePorts), and another process may have
// taken one since. kvrouter binds them all before it joins, so it exits
// unjoined, and it is started again on the same ports, as waitReady does;
// a node that exited for another reason fails the test. It reports
// whether it started the node again, and why.
func (c *cluster) restartIfPortTaken(i int) (bool, string) {
	c.t.Helper()
	n := c.nodes[i]
	if !n.p.exited() {
		return false, ""
	}
	out := c.runLog(i)
	if !strings.Contains(out, "address already in use") {
		c.t.Fatalf("%s exited before it joined (%v): %s", n.id, n.p.err, exitLine(out))
	}
	why := fmt.Sprintf("%s: %v: %s", n.id, errPortInUse, lastLine(out))
	c.t.Logf("%s; starting it again", why)
	time.Sleep(100 * time.Millisecond) // let whoever holds the port let go of it
	c.start(i)
	return true, why
}

// awaitReady polls node i's readiness until it is ready (nil), its process
// exits (errPortInUse when it could not bind), or readyTimeout passes.
func (c *cluster) awaitReady(i int) error { return c.awaitReadyAll([]int{i}) }

// awaitReadyAll polls the readiness of the nodes at idx until all are
// ready (nil), one of them exits (errPortInUse when it could not bind), or
// readyTimeout passes. It watches them all at once: a node that cannot
// start keeps the others from ever being ready.
func (c *cluster) awaitReadyAll(idx []int) error {
	deadline := time.Now().Add(readyTimeout)
	ready := map[int]bool{}
	last := map[int]string{}
	for {
		for _, i := range idx {
			n := c.nodes[i]
			if ready[i] {
				continue
			}
			if n.p.exited() {
				out := c.runLog(i)
				if strings.Contains(out, "address already in use") {
					return fmt.Errorf("%s: %w: %s", n.id, errPortInUse, lastLine(out))
				}
				return fmt.Errorf("%s exited before it was ready (%v): %s", n.id, n.p.err, exitLine(out))
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			r, err := n.cl.Ready(ctx)
			cancel()
			switch {
			case err != nil:
				last[i] = err.Error()
			case r.Ready:
				ready[i] = true
			default:
				last[i] = r.Error
			}
		}
		if len(ready) == len(idx) {
			return nil
		}
		if time.Now().After(deadline) {
			var why []string
			for _, i := range idx {
				if !ready[i] {
					why = append(why, c.nodes[i].id+": "+last[i])
				}
			}
			return fmt.Errorf("not ready after %v: %s", readyTimeout, strings.Join(why, "; "))
		}
		time.Sleep(pollEvery)
	}
}

// waitAllReady waits until every running node is ready.
func (c *cluster) waitAllReady() {
	c.t.Helper()
	for i, n := range c.nodes {
		if n.serving() {
			c.waitReady(i)
		}
	}
}

// runLog returns what node i's current run has written.
func (c *cluster) runLog(i int) string {
	n := c.nodes[i]
	b, err := os.ReadFile(n.logPath)
	if err != nil || n.p == nil || n.p.logOffset > int64(len(b)) {
		return ""
	}
	return string(b[n.p.logOffset:])
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// exitLine is what a node's log says of why it stopped: its last Error
// line, or "panic:" line, where it has one (a node that panics ends its
// log with a stack trace, whose last line says nothing), else its last
// line.
func exitLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], "level=ERROR") || strings.HasPrefix(lines[i], "panic:") {
			return lines[i]
		}
	}
	return lines[len(lines)-1]
}

// dumpLogsIfFailed writes the tail of every node's log into the test log
// when the test failed.
func (c *cluster) dumpLogsIfFailed() {
	if !c.t.Failed() {
		return
	}
	const keep = 32 << 10
	for _, n := range c.nodes {
		b, err := os.ReadFile(n.logPath)
		if err != nil {
			c.t.Logf("--- %s: no log: %v", n.id, err)
			continue
		}
		if len(b) > keep {
			b = append([]byte("[...]\n"), b[len(b)-keep:]...)
		}
		c.t.Logf("--- %s log (cluster in %s; raft %s, http %s) ---\n%s", n.id, c.base, n.raftAddr, n.httpAddr, b)
	}
}

// statusAll asks every serving node for its own status, concurrently. A
// node that was stopped, is paused or does not answer has a nil entry. A
// node that exited without the test stopping it fails the test: a crash
// must not pass for a node that is merely not counted.
func (c *cluster) statusAll() []*raftfsm.NodeStatus {
	c.t.Helper()
	for i, n := range c.nodes {
		if n.serving() && n.p.exited() {
			c.t.Fatalf("%s exited unexpectedly (%v): %s", n.id, n.p.err, exitLine(c.runLog(i)))
		}
	}
	out := make([]*raftfsm.NodeStatus, len(c.nodes))
	var wg sync.WaitGroup
	for i, n := range c.nodes {
		if !n.serving() {
			continue
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			if st, err := n.cl.Status(ctx); err == nil {
				out[i] = st
			}
		})
	}
	wg.Wait()
	return out
}

// leader waits until the serving nodes agree on a leader, one of them,
// and returns its position.
func (c *cluster) leader() int {
	c.t.Helper()
	var got int
	c.waitFor(leaderTimeout, "a leader every serving node agrees on", func() (bool, string) {
		sts := c.statusAll()
		lead := -1
		for i, st := range sts {
			if st != nil && st.State == "Leader" && (lead < 0 || st.Term > sts[lead].Term) {
				lead = i
			}
		}
		if lead < 0 {
			return false, describe(sts)
		}
		for _, st := range sts {
			if st != nil && (st.LeaderID != c.nodes[lead].id || st.Term != sts[lead].Term) {
				return false, describe(sts)
			}
		}
		got = lead
		return true, ""
	})
	return got
}

// converged waits until every serving node answers, is ready, follows the
// same leader, and reports the same state digest at the same applied
// index, and returns that index and digest.
func (c *cluster) converged() (applied uint64, digest string) {
	c.t.Helper()
	c.waitFor(convergeTimeout, "every node at the same applied index with the same digest", func() (bool, string) {
		sts := c.statusAll()
		var first *raftfsm.NodeStatus
		for i, n := range c.nodes {
			if !n.serving() {
				continue
			}
			st := sts[i]
			if st == nil || !st.Ready || st.LeaderID == "" {
				return false, describe(sts)
			}
			if first == nil {
				first = st
				continue
			}
			if st.AppliedIndex != first.AppliedIndex || st.Digest != first.Digest ||
				st.LeaderID != first.LeaderID || st.CommitIndex != first.CommitIndex {
				return false, describe(sts)
			}
		}
		if first == nil {
			return false, "no node serves"
		}
		applied, digest = first.AppliedIndex, first.Digest
		return true, ""
	})
	return applied, digest
}

// describe is a one-line summary of statuses for a timeout message.
func describe(sts []*raftfsm.NodeStatus) string {
	var parts []string
	for i, st := range sts {
		if st == nil {
			parts = append(parts, fmt.Sprintf("#%d: no answer", i))
			continue
		}
		parts = append(parts, fmt.Sprintf("%s: %s term %d leader %q commit %d applied %d digest %s ready %v",
			st.ID, st.State, st.Term, st.LeaderID, st.CommitIndex, st.AppliedIndex, st.Digest, st.Ready))
	}
	return strings.Join(parts, "; ")
}

// waitFor polls cond until it holds; on timeout the test fails with what
// cond last said about the state it saw.
func (c *cluster) waitFor(timeout time.Duration, what string, cond func() (bool, string)) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("timed out after %v waiting for %s; last seen: %s", timeout, what, why)
		}
		time.Sleep(pollEvery)
	}
}

// statusAgrees checks kvctl status as an operator reads it once the
// cluster has settled: exit 0, no divergence warning, and every node's row
// at the same applied index with the same digest. kvctl asks the nodes one
// after the other, so a write landing in between (the leader's periodic
// expiry sweep) can make one run see two applied indexes: it is run again
// until the rows agree.
func (c *cluster) statusAgrees() {
	c.t.Helper()
	c.waitFor(convergeTimeout, "kvctl status to show every node at the same applied index and digest", func() (bool, string) {
		res := c.kvctl("status", "-o", "json")
		if res.code != 0 || res.stderr != "" {
			c.t.Fatalf("%v", res)
		}
		var rows []struct {
			Endpoint string              `json:"endpoint"`
			Status   *raftfsm.NodeStatus `json:"status"`
			Error    string              `json:"error"`
		}
		if err := json.Unmarshal([]byte(res.stdout), &rows); err != nil {
			c.t.Fatalf("kvctl status -o json: %v\n%s", err, res.stdout)
		}
		if len(rows) != len(c.members()) {
			c.t.Fatalf("kvctl status -o json: %d rows for %d endpoints\n%s", len(rows), len(c.members()), res.stdout)
		}
		sts := make([]*raftfsm.NodeStatus, len(rows))
		for i, r := range rows {
			sts[i] = r.Status
		}
		for _, st := range sts {
			if st == nil || st.AppliedIndex != sts[0].AppliedIndex || st.Digest != sts[0].Digest {
				return false, describe(sts)
			}
		}
		return true, ""
	})
}

// cliResult is what one kvctl run did.
type cliResult struct {
	args           []string
	stdout, stderr string
	code           int
}

func (r cliResult) String() string {
	return fmt.Sprintf("kvctl %s: exit %d\nstdout:\n%s\nstderr:\n%s", strings.Join(r.args, " "), r.code, r.stdout, r.stderr)
}

// kvctl runs kvctl against this cluster (--endpoints every node).
func (c *cluster) kvctl(args ...string) cliResult {
	c.t.Helper()
	return c.kvctlVia(c.endpoints(), args...)
}

// kvctlVia runs kvctl against this cluster through endpoints alone (a
// comma-separated list of HTTP addresses): the nodes of a majority, say,
// while another is down.
func (c *cluster) kvctlVia(endpoints string, args ...string) cliResult {
	c.t.Helper()
	pre := []string{"--endpoints", endpoints}
	if c.sec != nil {
		pre = append(pre, "--token", c.sec.token, "--tls-ca", c.sec.certFile)
	}
	return runKvctl(c.t, append(pre, args...)...)
}

// runKvctl runs the kvctl binary with args and returns its output and exit
// code; stdout and stderr are pipes, as in a script.
func runKvctl(t *testing.T, args ...string) cliResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, kvctlBin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.Env = childEnv()
	err := cmd.Run()
	res := cliResult{args: args, stdout: stdout.String(), stderr: stderr.String()}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee) && ee.Exited():
		res.code = ee.ExitCode()
	default:
		t.Fatalf("kvctl %s: %v\nstderr: %s", strings.Join(args, " "), err, res.stderr)
	}
	return res
}

// ctxT is a context for one step of a test, canceled when the test ends.
func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
