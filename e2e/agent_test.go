package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/kvevent"
)

const agentBlockSize = 4

// agentProc is a running kvagent process.
type agentProc struct {
	cmd     *exec.Cmd
	done    chan struct{}
	err     error // cmd.Wait's answer, set before done is closed
	killed  bool  // the test killed it (kill9): no clean exit to check
	logPath string
	// logOffset is where this agent's output starts in logPath, which
	// the agents of one cluster share.
	logOffset int64
}

// startAgent runs kvagent for worker 1 against the engine publisher pub and
// the cluster's NATS, registering through the cluster's HTTP API.
func startAgent(t *testing.T, c *cluster, pub *pypub.Pub, extra ...string) *agentProc {
	t.Helper()
	a := &agentProc{done: make(chan struct{}), logPath: filepath.Join(c.base, "kvagent.log")}
	args := []string{"--worker-id", "1", "--block-size", fmt.Sprint(agentBlockSize),
		"--engine-endpoint", pub.Pub, "--nats-url", c.natsURLs(), "--router", c.endpoints(),
		"--heartbeat-interval", "200ms", "--lease", "30s", "--metrics-addr", "", "--log-level", "info"}
	if pub.Replay != "" {
		args = append(args, "--replay-endpoint", pub.Replay)
	}
	args = append(args, extra...)
	f, err := os.OpenFile(a.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if a.logOffset, err = f.Seek(0, io.SeekEnd); err != nil {
		t.Fatal(err)
	}
	a.cmd = exec.Command(kvagentBin, args...)
	a.cmd.Stdout, a.cmd.Stderr = f, f
	a.cmd.Env = childEnv()
	a.cmd.SysProcAttr = sysProcAttr()
	if err := a.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		a.err = a.cmd.Wait()
		close(a.done)
	}()
	t.Cleanup(func() {
		defer func() {
			if t.Failed() {
				if b, err := os.ReadFile(a.logPath); err == nil {
					t.Logf("kvagent log:\n%s", b)
				}
			}
		}()
		select {
		case <-a.done:
			// It exited before the test ended: only a kill9 may end it.
			if !a.killed {
				t.Errorf("kvagent exited before the test ended: %v", a.err)
			}
			return
		default:
		}
		// A SIGTERM is a clean shutdown: the agent exits 0 within
		// stopTimeout, or the test fails.
		if err := a.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Errorf("SIGTERM kvagent: %v", err)
		}
		select {
		case <-a.done:
			if a.err != nil {
				t.Errorf("kvagent after SIGTERM: %v, want exit status 0", a.err)
			}
		case <-time.After(stopTimeout):
			t.Errorf("kvagent still running %v after SIGTERM; killing it", stopTimeout)
			if err := a.cmd.Process.Kill(); err != nil {
				t.Errorf("SIGKILL kvagent: %v", err)
			}
			<-a.done
		}
	})
	return a
}

// kill9 kills the agent with SIGKILL and waits for it to exit.
func (a *agentProc) kill9(t *testing.T) {
	t.Helper()
	a.killed = true
	if err := a.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatalf("SIGKILL kvagent: %v", err)
	}
	<-a.done
}

// engineGen makes an engine's event stream for the python publisher:
// independent chains stored on the GPU, offloaded whole to CPU, and
// trimmed at their GPU tail. model holds what each tier should hold.
type engineGen struct {
	rng    *rand.Rand
	n      uint64
	chains [][]uint64          // engine hashes, root first
	tokens map[uint64][]uint32 // a block's tokens
	parent map[uint64]uint64
	gpuLen []int // how much of each chain the GPU holds (a prefix)
	model  [kvevent.NumTiers]map[uint64]bool
	// view is the cluster's scoring view, which the route overlaps that
	// waitModel checks are counted in (the default, or what the test set).
	view indexer.View
	// salt is the engine's additional salt (kvagent --salt, or the
	// registration's additional_salt): waitModel's routes carry it as
	// cache_salt, and must find nothing without it.
	salt string
}

func newEngineGen(seed uint64) *engineGen {
	g := &engineGen{rng: rand.New(rand.NewPCG(seed, 99)), tokens: map[uint64][]uint32{}, parent: map[uint64]uint64{}}
	for i := range g.model {
		g.model[i] = map[uint64]bool{}
	}
	return g
}

func (g *engineGen) stored(hashes []uint64, medium string) pypub.EvSpec {
	spec := pypub.EvSpec{Type: "BlockStored", Hashes: hashes, BlockSize: agentBlockSize, Medium: medium, Map: g.rng.IntN(2) == 0}
	if p, ok := g.parent[hashes[0]]; ok {
		spec.Parent = &p
	}
	for _, h := range hashes {
		spec.Tokens = append(spec.Tokens, g.tokens[h]...)
	}
	return spec
}

// blocks makes n fresh blocks on the GPU, the first a child of parent
// (0: a root).
func (g *engineGen) blocks(parent uint64, n int) []uint64 {
	var hs []uint64
	for range n {
		g.n++
		h := 1<<40 | g.n
		toks := make([]uint32, agentBlockSize)
		for j := range toks {
			toks[j] = g.rng.Uint32N(50000)
		}
		g.tokens[h] = toks
		if parent != 0 {
			g.parent[h] = parent
		}
		parent = h
		hs = append(hs, h)
		g.model[kvevent.TierDevice][h] = true
	}
	return hs
}

// newChain stores a fresh chain of n blocks on the GPU.
func (g *engineGen) newChain(n int) pypub.EvSpec {
	hs := g.blocks(0, n)
	g.chains = append(g.chains, hs)
	g.gpuLen = append(g.gpuLen, n)
	return g.stored(hs, "GPU")
}

// extend stores n more blocks at the end of chain ci, which the GPU holds
// whole: an event whose first block's parent_block_hash is an earlier
// event's block.
func (g *engineGen) extend(ci, n int) pypub.EvSpec {
	ch := g.chains[ci]
	hs := g.blocks(ch[len(ch)-1], n)
	g.chains[ci] = append(ch, hs...)
	g.gpuLen[ci] = len(g.chains[ci])
	return g.stored(hs, "GPU")
}

// prompt is chain ci's tokens.
func (g *engineGen) prompt(ci int) []uint32 {
	var p []uint32
	for _, h := range g.chains[ci] {
		p = append(p, g.tokens[h]...)
	}
	return p
}

// wantOverlap is what a route of chain ci's prompt should find on the
// worker's rank, per tier, in g.view: the dedup view counts the prefix held
// in any tier as device blocks; the tiered view walks the device prefix,
// then the host blocks after it.
func (g *engineGen) wantOverlap(ci int) [kvevent.NumTiers]int64 {
	var o [kvevent.NumTiers]int64
	dev, host := g.model[kvevent.TierDevice], g.model[kvevent.TierHostPinned]
	tier := kvevent.TierDevice
	for _, h := range g.chains[ci] {
		switch {
		case g.view == indexer.ViewDedup && (dev[h] || host[h]):
		case tier == kvevent.TierDevice && dev[h]:
		case host[h]:
			tier = kvevent.TierHostPinned
		default:
			return o
		}
		o[tier]++
	}
	return o
}

// next returns the next event.
func (g *engineGen) next() pypub.EvSpec {
	k := g.rng.IntN(100)
	if len(g.chains) == 0 || k < 50 {
		return g.newChain(1 + g.rng.IntN(4))
	}
	ci := g.rng.IntN(len(g.chains))
	ch := g.chains[ci]
	if k < 60 {
		if g.gpuLen[ci] < len(ch) {
			return g.newChain(1)
		}
		return g.extend(ci, 1+g.rng.IntN(3))
	}
	if k < 80 {
		for _, h := range ch {
			g.model[kvevent.TierHostPinned][h] = true
		}
		return g.stored(ch, "CPU")
	}
	if g.gpuLen[ci] == 0 {
		return g.newChain(1)
	}
	return g.evict(ci)
}

// evict removes chain ci's last block held on the GPU (which holds some of
// it) from the GPU.
func (g *engineGen) evict(ci int) pypub.EvSpec {
	g.gpuLen[ci]--
	tail := g.chains[ci][g.gpuLen[ci]]
	delete(g.model[kvevent.TierDevice], tail)
	return pypub.EvSpec{Type: "BlockRemoved", Hashes: []uint64{tail}, Medium: "GPU"}
}

// publishBatches publishes n batches of 1–3 events from seq on.
func publishBatches(pub *pypub.Pub, g *engineGen, seq *uint64, n int) {
	publishBatchesLive(pub, g, seq, n, true)
}

// publishBatchesLive is publishBatches with the batches sent live, or,
// with live false, only kept in the publisher's replay buffer: batches the
// engine's PUB socket dropped.
func publishBatchesLive(pub *pypub.Pub, g *engineGen, seq *uint64, n int, live bool) {
	for range n {
		var evs []pypub.EvSpec
		for range 1 + g.rng.IntN(3) {
			evs = append(evs, g.next())
		}
		pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: *seq, Form: "array", Events: evs, Live: live})
		*seq++
	}
}

// rankBlocks returns worker id's rank 0's blocks per tier from one node.
func rankBlocks(ctx context.Context, n *node, id uint64) (api.TierBlocks, bool) {
	ws, err := n.cl.Workers(ctx)
	if err != nil {
		return api.TierBlocks{}, false
	}
	for _, w := range ws {
		if w.WorkerID == id {
			for _, r := range w.Ranks {
				if r.DPRank == 0 {
					return r.Blocks, true
				}
			}
		}
	}
	return api.TierBlocks{}, false
}

// waitModel waits until every serving node's index holds exactly the
// model's blocks per tier for worker 1, a route of every chain's prompt
// finds the overlap per tier that the model says on every node, and the
// nodes' digests agree.
func waitModel(c *cluster, g *engineGen) { waitModelOf(c, g, 1) }

// waitModelOf is waitModel for worker id.
func waitModelOf(c *cluster, g *engineGen, id uint64) {
	c.t.Helper()
	want := api.TierBlocks{Device: int64(len(g.model[kvevent.TierDevice])), Host: int64(len(g.model[kvevent.TierHostPinned]))}
	c.waitFor(convergeTimeout, fmt.Sprintf("every node's index to hold %+v", want), func() (bool, string) {
		for i, n := range c.nodes {
			if !n.serving() {
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			got, ok := rankBlocks(ctx, n, id)
			cancel()
			if !ok || got != want {
				return false, fmt.Sprintf("node %d holds %+v", i, got)
			}
		}
		return true, ""
	})
	// The counts agree; the blocks must be the model's too, chained as the
	// engine chained them.
	c.waitFor(convergeTimeout, "every chain's route overlap to be the model's", func() (bool, string) {
		for i, n := range c.nodes {
			if !n.serving() {
				continue
			}
			for ci := range g.chains {
				ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
				res, err := n.cl.Route(ctx, api.RouteRequest{TokenIDs: g.prompt(ci), CacheSalt: g.salt})
				var unsalted *api.RouteResponse
				if err == nil && g.salt != "" {
					unsalted, err = n.cl.Route(ctx, api.RouteRequest{TokenIDs: g.prompt(ci)})
				}
				cancel()
				if err != nil {
					return false, fmt.Sprintf("node %d: route chain %d: %v", i, ci, err)
				}
				if want, got := g.wantOverlap(ci), overlapOf(res, id); got != want {
					return false, fmt.Sprintf("node %d: chain %d of %d blocks overlaps %v, want %v", i, ci, len(g.chains[ci]), got, want)
				}
				if got := overlapOf(unsalted, id); got != ([kvevent.NumTiers]int64{}) {
					return false, fmt.Sprintf("node %d: chain %d, routed without the engine's salt, overlaps %v, want nothing", i, ci, got)
				}
			}
		}
		return true, ""
	})
	c.converged()
}

// overlapOf is the overlap per tier of worker id's rank 0 in res (none when
// res is nil or does not name it).
func overlapOf(res *api.RouteResponse, id uint64) [kvevent.NumTiers]int64 {
	if res != nil {
		for _, cand := range res.Candidates {
			if cand.WorkerID == id && cand.DPRank == 0 {
				return cand.Overlap.Array()
			}
		}
	}
	return [kvevent.NumTiers]int64{}
}

// TestAgentEndToEnd: a Python engine publisher over real libzmq → kvagent
// → NATS → a 3-node cluster. The worker registers itself, the route API
// shows the overlap per tier, and after a kill -9 of the leader while the
// engine streams, every node's index equals a model of everything
// published, with equal digests.
func TestAgentEndToEnd(t *testing.T) {
	pypub.Require(t)
	seed := testSeed(t)
	c := startClusterNATS(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Retried: on a loaded machine the first leader may step down before
	// it answers (503 no_leader); the settings are the same each time.
	c.waitFor(readyTimeout, "the tiered view to be set", func() (bool, string) {
		err := c.cl.SetSettings(ctx, indexer.DefaultParams(), indexer.ViewTiered)
		return err == nil, fmt.Sprint(err)
	})
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*", ReplayShape: 3})
	startAgent(t, c, pub)
	pub.WaitSub()
	c.waitFor(readyTimeout, "the agent to register worker 1", func() (bool, string) {
		ws, err := c.cl.Workers(ctx)
		return err == nil && len(ws) == 1 && ws[0].WorkerID == 1 && ws[0].LeaseMs == 30000, fmt.Sprint(ws, err)
	})

	// A chain of 3 on the GPU, offloaded whole to CPU, its GPU tail
	// dropped: the route sees 2 blocks on the device and 1 on the host.
	g := newEngineGen(seed)
	g.view = indexer.ViewTiered
	var seq uint64
	chain := g.newChain(3)
	pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: seq, Form: "map", Events: []pypub.EvSpec{chain}, Live: true})
	seq++
	hs := g.chains[0]
	g.gpuLen[0] = 2
	delete(g.model[kvevent.TierDevice], hs[2])
	for _, h := range hs {
		g.model[kvevent.TierHostPinned][h] = true
	}
	pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: seq, Form: "array", Events: []pypub.EvSpec{g.stored(hs, "CPU"),
		{Type: "BlockRemoved", Hashes: []uint64{hs[2]}, Medium: "GPU"}}, Live: true})
	seq++
	var prompt []uint32
	for _, h := range hs {
		prompt = append(prompt, g.tokens[h]...)
	}
	c.waitFor(convergeTimeout, "the route to see 2 blocks on the device and 1 on the host", func() (bool, string) {
		res, err := c.cl.Route(ctx, api.RouteRequest{TokenIDs: prompt})
		if err != nil || len(res.Candidates) != 1 {
			return false, fmt.Sprint(res, err)
		}
		o := res.Candidates[0].Overlap
		return o.Device == 2 && o.Host == 1 && o.Disk == 0, fmt.Sprintf("%+v", o)
	})

	// Stream, kill -9 the leader a third of the way in, stream on.
	publishBatches(pub, g, &seq, 100)
	c.killLeader()
	publishBatches(pub, g, &seq, 200)
	waitModel(c, g)

	// The killed node comes back and catches up to the same state.
	for i, n := range c.nodes {
		if !n.up() {
			c.restart(i)
		}
	}
	waitModel(c, g)

	// docs/grafana/kvrouter.json queries only what a node exports.
	var addrs []string
	for _, n := range c.nodes {
		addrs = append(addrs, n.httpAddr)
	}
	checkDashboardRouterNames(t, addrs)
}

// TestAgentRestartResyncs: the agent is killed, and the engine restarts
// with an empty cache under a new agent. The new agent's event ids start
// over below the router's cursor; its resync on start replaces the rank, so
// that what it publishes afterwards is applied, not dropped as duplicates,
// and nothing of the old incarnation stays in the index. The engine salts
// its block hashes (kvagent --salt): routes find its blocks with that
// cache_salt only.
func TestAgentRestartResyncs(t *testing.T) {
	pypub.Require(t)
	seed := testSeed(t)
	c := startClusterNATS(t, 3)
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*"})
	a := startAgent(t, c, pub, "--salt", "tenant-a")
	pub.WaitSub()
	g := newEngineGen(seed)
	g.salt = "tenant-a"
	var seq uint64
	publishBatches(pub, g, &seq, 50)
	waitModel(c, g)

	a.kill9(t)
	// The engine restarts too (its cache empties) and a new agent follows it.
	pub.Close()
	pub = pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*"})
	startAgent(t, c, pub, "--salt", "tenant-a")
	pub.WaitSub()
	g = newEngineGen(seed + 1)
	g.salt = "tenant-a"
	seq = 0
	publishBatches(pub, g, &seq, 30)
	waitModel(c, g)
}
