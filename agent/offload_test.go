package agent

import (
	"context"
	"errors"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
	"github.com/kvrouter/kvrouter/raftfsm"
)

var _ pool.Sink = (*Agent)(nil)

const blockBytes = 256 // bytes per KV block in these tests

func seed(t testing.TB) uint64 { return testseed.Seed(t) }

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// forgetRank makes the router lose rank's state, as a router that lost
// it would: a dump of nothing at the rank's cursor. The cursor may move
// between its read and the dump's apply (an agent's events still in
// flight: stopping an agent does not wait for the router to apply what
// it sent, and a CI run failed on "stale rank dump: the rank is at event
// 3"), so a stale dump is tried again at the rank's new cursor.
func forgetRank(t testing.TB, r *router) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		err := r.node.ReplaceRank(context.Background(), rank, r.node.Cursor(rank), nil)
		if err == nil {
			return
		}
		if !errors.Is(err, raftfsm.ErrStaleDump) || time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
}

// tierBlocks is how many blocks the router's index holds for rank in tier.
func tierBlocks(r *router, tier kvevent.Tier) int64 {
	for _, rs := range r.node.FSM().Index().RankStats() {
		if rs.Rank == rank {
			return rs.Blocks[tier]
		}
	}
	return 0
}

// tieredMatch is rank's match of the local hashes in the router's tiered
// view.
func tieredMatch(r *router, locals []uint64) [kvevent.NumTiers]uint32 {
	var m indexer.Matches
	r.node.FindMatches(locals, indexer.ViewTiered, &m)
	for _, rm := range m.Ranks {
		if rm.Rank == rank {
			return rm.Blocks
		}
	}
	return [kvevent.NumTiers]uint32{}
}

// caughtUp waits until the router has applied every event the agent
// published so far (a count alone can look right while it lags: a STORE
// and a REMOVE keep it steady).
func caughtUp(t *testing.T, r *router, a *Agent) {
	t.Helper()
	_, last := a.Publisher().Cursor(rank)
	waitFor(t, "the router to apply the agent's events", func() bool { return r.node.Cursor(rank) >= last })
}

// offloadRig is the offload side of one agent: the host backend, rank 7/0's
// pools publishing through the agent, the engine API on a socket, and the
// engine's simulated G1 region registered with it.
type offloadRig struct {
	t    *testing.T
	rng  *rand.Rand
	be   *backend.Host
	host *pool.HostPool
	disk *pool.DiskPool
	srv  *engineapi.Server
	c    *engineapi.Client
	g1   []byte
	next uint64
}

type offloadConfig struct {
	hostCap, diskCap int
	diskDir          string
	filter           manager.FilterConfig
}

func startOffload(t *testing.T, a *Agent, oc offloadConfig) *offloadRig {
	t.Helper()
	be, err := backend.NewHost()
	must(t, err)
	o := &offloadRig{t: t, rng: rand.New(rand.NewPCG(seed(t), 1)), be: be, next: 1 << 20}
	pc := pool.Config{Rank: rank, BlockSize: blockBytes, Sink: a, Logger: quiet}
	if oc.hostCap > 0 {
		pc.Capacity = oc.hostCap
		o.host, err = pool.NewHost(be, pc)
		must(t, err)
	}
	if oc.diskCap > 0 {
		pc.Capacity = oc.diskCap
		o.disk, err = pool.OpenDisk(oc.diskDir, pc, pool.DiskOptions{})
		must(t, err)
		// What kvagent does on start: the reopened pool's blocks go into
		// the rank's dump.
		evs, _ := o.disk.Dump()
		must(t, a.Restore(rank, evs))
	}
	sockDir, err := os.MkdirTemp("", "agent")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	o.srv, err = engineapi.Listen(engineapi.Config{Socket: filepath.Join(sockDir, "s"), Backend: be,
		Ranks:   []engineapi.RankPools{{Rank: rank, Host: o.host, Disk: o.disk}},
		Manager: manager.Config{Filter: oc.filter}, Checker: a, Logger: quiet})
	must(t, err)
	o.c = engineapi.NewClient(o.srv.Socket())

	const g1Blocks = 64
	f, err := os.Create(filepath.Join(t.TempDir(), "g1"))
	must(t, err)
	defer f.Close()
	must(t, f.Truncate(g1Blocks*blockBytes))
	o.g1, err = unix.Mmap(int(f.Fd()), 0, g1Blocks*blockBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	must(t, err)
	_, err = o.c.Register(context.Background(), engineapi.RegisterRequest{ShmPath: f.Name(),
		BlockSizeBytes: blockBytes, NumBlocks: g1Blocks})
	must(t, err)
	t.Cleanup(o.stop)
	return o
}

// stop closes everything in kvagent's order: server, pools, backend.
func (o *offloadRig) stop() {
	if o.srv == nil {
		return
	}
	o.c.Close()
	must(o.t, o.srv.Close())
	if o.host != nil {
		must(o.t, o.host.Close())
	}
	if o.disk != nil {
		must(o.t, o.disk.Close())
	}
	must(o.t, o.be.Close())
	unix.Munmap(o.g1)
	o.srv = nil
}

// offload plays the engine computing blocks into G1 blocks ids and
// offloading them: one chain when chain is set, else independent blocks
// (each the first of its sequence). It waits until the copies are done and
// returns the blocks' hashes and local hashes.
func (o *offloadRig) offload(chain bool, ids ...int) (hashes, locals []uint64) {
	o.t.Helper()
	req := engineapi.OffloadRequest{}
	var parent uint64
	for _, id := range ids {
		o.next++
		for j := range blockBytes {
			o.g1[id*blockBytes+j] = byte(o.rng.Uint32())
		}
		h, l := o.next, o.next^0x5eed
		req.Blocks = append(req.Blocks, engineapi.OffloadBlock{G1Block: id, Hash: engineapi.Hash(h),
			Parent: engineapi.Hash(parent), Local: engineapi.Hash(l), Priority: 1})
		hashes, locals = append(hashes, h), append(locals, l)
		if chain {
			parent = h
		}
	}
	res, err := o.c.Offload(context.Background(), req)
	must(o.t, err)
	if res.Queued != len(ids) {
		o.t.Fatalf("offload queued %d of %d", res.Queued, len(ids))
	}
	o.idle()
	return hashes, locals
}

func (o *offloadRig) idle() {
	o.t.Helper()
	waitFor(o.t, "the offload manager to go idle", func() bool {
		st, err := o.c.Stats(context.Background())
		must(o.t, err)
		rs, _ := st.Rank(0)
		return rs.Idle()
	})
}

// TestG2EvictionsReachTheRouterIndex: a G2 pool of 4 blocks gets 12 through
// the engine API; each eviction's REMOVE reaches the router, whose index
// holds exactly the pool's last 4 blocks in the host tier. A dump of the
// rank (what heals a gap) holds them too.
func TestG2EvictionsReachTheRouterIndex(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	o := startOffload(t, a, offloadConfig{hostCap: 4})
	var rounds [][]uint64
	for round := range 3 {
		_, locals := o.offload(false, 4*round, 4*round+1, 4*round+2, 4*round+3)
		rounds = append(rounds, locals)
	}
	if st := o.host.Stats(); st.Used != 4 || st.Evictions != 8 {
		t.Fatalf("host pool: %d used, %d evictions; want 4, 8", st.Used, st.Evictions)
	}
	caughtUp(t, r, a)
	if n := tierBlocks(r, kvevent.TierHostPinned); n != 4 {
		t.Fatalf("the router holds %d blocks in the host tier, want the pool's 4", n)
	}
	for i, locals := range rounds {
		for _, l := range locals {
			want := uint32(0)
			if i == 2 {
				want = 1
			}
			if got := tieredMatch(r, []uint64{l})[kvevent.TierHostPinned]; got != want {
				t.Fatalf("round %d block %#x: router holds %d in the host tier, want %d", i, l, got, want)
			}
		}
	}

	// The router loses the rank; the agent's dump brings the G2 blocks back.
	forgetRank(t, r)
	waitFor(t, "the router to forget the rank", func() bool { return tierBlocks(r, kvevent.TierHostPinned) == 0 })
	a.Publisher().Resync(rank)
	waitFor(t, "the dump to restore the G2 blocks", func() bool { return tierBlocks(r, kvevent.TierHostPinned) == 4 })
}

// TestG3SurvivesAgentRestart: blocks written through to disk stay there
// when the agent stops; a new agent on the same directory republishes
// them in its first dump, so the router (which lost them meanwhile) holds
// them again in the disk tier, as a chain it can match.
func TestG3SurvivesAgentRestart(t *testing.T) {
	r := startRouter(t)
	dir := t.TempDir()
	a, stop := startAgent(t, r)
	o := startOffload(t, a, offloadConfig{hostCap: 8, diskCap: 64, diskDir: dir, filter: manager.FilterConfig{Always: true}})
	hashes, locals := o.offload(true, 0, 1, 2, 3, 4, 5)
	waitFor(t, "the chain on disk", func() bool { return o.disk.Stats().Used == len(hashes) })
	o.idle()
	waitFor(t, "the router to see the chain on disk", func() bool { return tierBlocks(r, kvevent.TierDisk) == 6 })
	o.stop()
	stop()

	forgetRank(t, r)
	waitFor(t, "the router to forget the rank", func() bool { return tierBlocks(r, kvevent.TierDisk) == 0 })

	ctx := context.Background()

	var o2 *offloadRig
	startAgentThen(t, r, Config{}, func(b *Agent) {
		o2 = startOffload(t, b, offloadConfig{hostCap: 8, diskCap: 64, diskDir: dir})
	})
	waitFor(t, "the new agent's dump to carry the disk tier", func() bool {
		return tieredMatch(r, locals)[kvevent.TierDisk] == 6
	})
	look, err := o2.c.Lookup(ctx, engineapi.LookupRequest{Hashes: []engineapi.Hash{engineapi.Hash(hashes[0]), engineapi.Hash(hashes[5])}})
	must(t, err)
	if look.Prefix != 2 || look.Tiers[1][0] != "disk" {
		t.Fatalf("lookup after the restart: %+v", look)
	}
}

// offloadedRank starts a router and an agent with a G2 pool on rank: the
// engine holds blocks 1..4 on the GPU, and 1..3 were offloaded to G2.
func offloadedRank(t *testing.T) (*router, *Agent, *pool.HostPool) {
	t.Helper()
	r := startRouter(t)
	a, _ := startAgent(t, r)
	host := hostPoolOn(t, a)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4)}))
	for h := uint64(1); h <= 3; h++ {
		must(t, host.Register(pool.Block{Hash: h, Parent: h - 1, Local: 1000 + h}, make([]byte, blockBytes)))
	}
	waitFor(t, "device and host blocks on the router", func() bool {
		return tierBlocks(r, kvevent.TierDevice) == 4 && tierBlocks(r, kvevent.TierHostPinned) == 3
	})
	return r, a, host
}

// TestEngineResetKeepsOffloadedBlocksOnTheRouter: when the engine restarts
// or its stream loses batches, the rank's engine blocks are cleared on the
// router, but the agent's own G2 blocks stay: the pool still holds them.
func TestEngineResetKeepsOffloadedBlocksOnTheRouter(t *testing.T) {
	r, a, host := offloadedRank(t)
	a.Reset(rank)
	waitFor(t, "the reset to clear only the engine's blocks", func() bool {
		return tierBlocks(r, kvevent.TierDevice) == 0 && tierBlocks(r, kvevent.TierHostPinned) == 3 && matched(r, 4) == 3
	})
	// The pool still publishes into the cleared rank: an eviction lands.
	must(t, host.Register(pool.Block{Hash: 9, Local: 1009}, make([]byte, blockBytes)))
	waitFor(t, "a new G2 block after the reset", func() bool { return tierBlocks(r, kvevent.TierHostPinned) == 4 })
}

// TestEngineClearKeepsOffloadedBlocks: an engine's AllBlocksCleared (a
// prefix-cache reset) empties the engine's tier only, here and on the
// router; the G2 pool's blocks stay in both (a dump of the rank is built
// from the agent's copy), and what the engine stores after the clear, in
// the same batch, lands.
func TestEngineClearKeepsOffloadedBlocks(t *testing.T) {
	r, a, host := offloadedRank(t)
	must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindCleared}, storedChain(0, 20, 21)}))
	waitFor(t, "the engine's clear to drop only its own blocks", func() bool {
		return tierBlocks(r, kvevent.TierDevice) == 2 && tierBlocks(r, kvevent.TierHostPinned) == 3 && matched(r, 4) == 3
	})
	caughtUp(t, r, a)
	if st := host.Stats(); st.Used != 3 {
		t.Fatalf("host pool holds %d blocks, want 3", st.Used)
	}
	evs, _ := a.dump(rank)
	var dev, hostBlocks int
	for _, e := range evs {
		switch e.Tier {
		case kvevent.TierDevice:
			dev += len(e.Blocks)
		case kvevent.TierHostPinned:
			hostBlocks += len(e.Blocks)
		}
	}
	if dev != 2 || hostBlocks != 3 {
		t.Fatalf("the agent's copy of the rank holds %d device and %d host blocks after the clear, want 2 and 3", dev, hostBlocks)
	}
}

// TestPublishRefusesARankTheAgentDoesNotFollow: a pool configured for the
// wrong rank gets an error (counted by the pool), not a silent publish.
func TestPublishRefusesARankTheAgentDoesNotFollow(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	other := kvevent.Rank{Worker: 8}
	if _, err := a.Publish(other, []kvevent.Event{storedChain(0, 1)}); err == nil {
		t.Fatal("Publish accepted a rank the agent does not follow")
	}
	if err := a.Restore(rank, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{1}}}); err == nil {
		t.Fatal("Restore accepted a remove")
	}
}

// hostPoolOn gives a an 8-block G2 pool on the host backend.
func hostPoolOn(t *testing.T, a *Agent) *pool.HostPool {
	t.Helper()
	be, err := backend.NewHost()
	must(t, err)
	t.Cleanup(func() { be.Close() })
	host, err := pool.NewHost(be, pool.Config{Rank: rank, Capacity: 8, BlockSize: blockBytes, Sink: a, Logger: quiet})
	must(t, err)
	t.Cleanup(func() { host.Close() })
	return host
}

// dumpsCommitted is kvagent_events_dumps_total.
func dumpsCommitted(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	fams, err := reg.Gather()
	must(t, err)
	for _, f := range fams {
		if f.GetName() == "kvagent_events_dumps_total" {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return 0
}

// TestDumpKeepsHeldPoolBlocks: a pool block whose copy finished before
// its parent's (two copy workers, or the parent's task queued later)
// waits in the agent until the parent comes (it is parked: neither the
// mirror nor the router holds it), so that a dump meanwhile does not lose
// it: the router gets it when the parent lands. From a review: the dump
// left held stores out, and the router never learned of a block the pool
// held.
func TestDumpKeepsHeldPoolBlocks(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	waitFor(t, "the start dump", func() bool { return dumpsCommitted(t, reg) >= 1 })
	host := hostPoolOn(t, a)
	// The child's copy finishes first.
	must(t, host.Register(pool.Block{Hash: 2, Parent: 1, Local: 1002}, make([]byte, blockBytes)))
	caughtUp(t, r, a)
	// The router loses track of the rank (a gap): the agent's dump heals it.
	n := dumpsCommitted(t, reg)
	a.Publisher().Resync(rank)
	waitFor(t, "the dump committed", func() bool { return dumpsCommitted(t, reg) > n })
	// The parent's copy finishes.
	must(t, host.Register(pool.Block{Hash: 1, Local: 1001}, make([]byte, blockBytes)))
	caughtUp(t, r, a)
	evs, _ := a.dump(rank)
	mirror := 0
	for _, e := range evs {
		mirror += len(e.Blocks)
	}
	if got := tierBlocks(r, kvevent.TierHostPinned); got != 2 || mirror != 2 {
		t.Fatalf("after the dump: the router holds %d G2 blocks, the agent's mirror %d; the pool holds %d (want 2 everywhere)",
			got, mirror, host.Stats().Used)
	}
}

// TestClearKeepsHeldPoolBlocks: an engine clear keeps the pools' blocks,
// those held for their parent too. From a review: they were dropped with
// the device tier, and the pool's block was never reported once its
// parent landed.
func TestClearKeepsHeldPoolBlocks(t *testing.T) {
	r, a, host := offloadedRank(t) // device 1..4, host 1..3
	must(t, host.Register(pool.Block{Hash: 12, Parent: 11, Local: 1012}, make([]byte, blockBytes)))
	a.Reset(rank)
	must(t, host.Register(pool.Block{Hash: 11, Local: 1011}, make([]byte, blockBytes)))
	caughtUp(t, r, a)
	waitFor(t, "the dump after the clear", func() bool {
		acked, last := a.Publisher().Cursor(rank)
		return acked == last
	})
	if got := tierBlocks(r, kvevent.TierHostPinned); got != 5 {
		t.Fatalf("the router holds %d G2 blocks, the pool %d (want 5)", got, host.Stats().Used)
	}
}

// metric is the value of the counter or gauge name in reg whose labels
// include labels (name, value pairs); 0 when there is none.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	must(t, err)
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	next:
		for _, m := range f.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, l := range m.GetLabel() {
					found = found || l.GetName() == labels[i] && l.GetValue() == labels[i+1]
				}
				if !found {
					continue next
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue()
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestPoolStoreThatContradictsTheEngineIsNotPublished: the engine holds
// 1..6 on the GPU; a pool stores block 4 under another content hash, 5
// under another parent, and 6's content under another hash. Published,
// each would make the router take the engine's hash as reused (or its
// block as renamed) and forget what the GPU holds. None is published; a
// pool store that agrees with the engine is. From a review: the engine
// API took an offload without "local" (0), and the router dropped the
// engine's block 4 in every tier.
func TestPoolStoreThatContradictsTheEngineIsNotPublished(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	host := hostPoolOn(t, a)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4, 5, 6)}))
	for _, b := range []pool.Block{{Hash: 4, Parent: 3, Local: 0}, {Hash: 5, Parent: 3, Local: 1005}, {Hash: 99, Parent: 5, Local: 1006}} {
		must(t, host.Register(b, make([]byte, blockBytes)))
	}
	caughtUp(t, r, a)
	if d, h, m := tierBlocks(r, kvevent.TierDevice), tierBlocks(r, kvevent.TierHostPinned), matched(r, 6); d != 6 || h != 0 || m != 6 {
		t.Fatalf("after pool stores that contradict the engine: the router holds %d device and %d host blocks and matches %d of 6; want 6, 0, 6", d, h, m)
	}
	if n := metric(t, reg, "kvagent_offload_mismatches_total", "where", "pool"); n != 3 {
		t.Fatalf("kvagent_offload_mismatches_total{where=pool} = %v, want 3", n)
	}
	must(t, host.Register(pool.Block{Hash: 6, Parent: 5, Local: 1006}, make([]byte, blockBytes)))
	caughtUp(t, r, a)
	if d, h := tierBlocks(r, kvevent.TierDevice), tierBlocks(r, kvevent.TierHostPinned); d != 6 || h != 1 {
		t.Fatalf("after a pool store that agrees: %d device and %d host blocks, want 6 and 1", d, h)
	}
}

// TestOffloadRequestThatContradictsTheEngineIsRefused: through the engine
// API, an offload naming a block the engine reported with another content
// hash or parent is a bad_request and queues nothing; one that agrees,
// and one of a hash the agent has not heard of yet (the engine's STORE
// may still be on its way), are queued (and so is one of a block the
// engine reported under another hash:
// TestOffloadOfAnUnknownHashWithHeldContentIsAccepted).
func TestOffloadRequestThatContradictsTheEngineIsRefused(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	o := startOffload(t, a, offloadConfig{hostCap: 8})
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2)}))
	ctx := context.Background()
	for _, b := range []engineapi.OffloadBlock{
		{G1Block: 1, Hash: 2, Parent: 1, Local: 0, Priority: 1},
		{G1Block: 1, Hash: 2, Parent: 0, Local: 1002, Priority: 1},
	} {
		good := engineapi.OffloadBlock{G1Block: 0, Hash: 1, Local: 1001, Priority: 1}
		_, err := o.c.Offload(ctx, engineapi.OffloadRequest{Blocks: []engineapi.OffloadBlock{good, b}})
		if !errors.Is(err, engineapi.ErrBadRequest) || !strings.Contains(err.Error(), "blocks[1]") {
			t.Fatalf("offload of %+v: %v; want a bad_request naming blocks[1]", b, err)
		}
	}
	if n := metric(t, reg, "kvagent_offload_mismatches_total", "where", "request"); n != 2 {
		t.Fatalf("kvagent_offload_mismatches_total{where=request} = %v, want 2", n)
	}
	o.idle()
	if st := o.host.Stats(); st.Used != 0 {
		t.Fatalf("refused offloads stored %d blocks", st.Used)
	}
	res, err := o.c.Offload(ctx, engineapi.OffloadRequest{Blocks: []engineapi.OffloadBlock{
		{G1Block: 0, Hash: 2, Parent: 1, Local: 1002, Priority: 1},
		{G1Block: 1, Hash: 50, Parent: 2, Local: 1050, Priority: 1},
	}})
	must(t, err)
	if res.Queued != 2 {
		t.Fatalf("offload of blocks that agree with the engine: %+v", res)
	}
}

// TestClearParksPoolBlocksBelowADeviceParent: the engine holds 1..4 on
// the GPU, and only 4 (and 5, below it) went to G2. The engine resets its
// prefix cache: 4's parent is nowhere but on the GPU, so no lookup could
// reach 4 and 5, and they wait in the agent until the engine computes 1..3
// again, when they go to the router. From a review: the clear dropped them
// from the agent's mirror, the dump from the router, and re-offloading 4
// only revived it in the pool: the router never knew G2 held it.
func TestClearParksPoolBlocksBelowADeviceParent(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	host := hostPoolOn(t, a)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4, 5)}))
	must(t, host.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
	must(t, host.Register(pool.Block{Hash: 5, Parent: 4, Local: 1005}, make([]byte, blockBytes)))
	waitFor(t, "device and host blocks on the router", func() bool {
		return tierBlocks(r, kvevent.TierDevice) == 5 && tierBlocks(r, kvevent.TierHostPinned) == 2
	})
	must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindCleared}}))
	caughtUp(t, r, a)
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 2 {
		t.Fatalf("after the clear %v pool blocks wait for their parent, want 2", n)
	}
	must(t, a.Events(rank, 2, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	caughtUp(t, r, a)
	if h, m := tierBlocks(r, kvevent.TierHostPinned), matched(r, 5); h != 2 || m != 5 {
		t.Fatalf("G2 holds 4 and 5, the engine 1..3 again: the router holds %d G2 blocks (want 2) and matches %d of 5 (want 5)", h, m)
	}
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 0 {
		t.Fatalf("%v pool blocks still wait for their parent", n)
	}
	// The router loses the rank: the dump has them too.
	forgetRank(t, r)
	waitFor(t, "the router to forget the rank", func() bool { return tierBlocks(r, kvevent.TierHostPinned) == 0 })
	a.Publisher().Resync(rank)
	waitFor(t, "the dump", func() bool { return tierBlocks(r, kvevent.TierHostPinned) == 2 && matched(r, 5) == 5 })
}

// TestEvictionAboveADeepPoolChainLooksUpEachBlockOnce: the engine evicts
// the parent of a chain of n G2 blocks; the agent parks all n and takes
// them off the router, looking up each cut block once. Its removes of the
// chain, parents first, cut nothing off again: each block's parent went
// before it. From a review: each of those removes reported the rest of
// the chain as cut again, n(n-1)/2 lookups under the agent's lock (n=4000
// took 10.8 s); and with them gone, only the parked check of a cut
// block's parent (gone in parkCutLocked) takes the chain below its first
// block back.
func TestEvictionAboveADeepPoolChainLooksUpEachBlockOnce(t *testing.T) {
	const n = 1000
	r := startRouter(t)
	a, _ := startAgent(t, r)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1)}))
	hs := make([]uint64, n)
	for i := range hs {
		hs[i] = uint64(2 + i)
	}
	x := storedChain(1, hs...)
	x.Tier = kvevent.TierHostPinned
	_, err := a.Publish(rank, []kvevent.Event{x})
	must(t, err)
	a.mu.Lock()
	before := a.cutLookups
	a.mu.Unlock()
	must(t, a.Events(rank, 1, []kvevent.Event{{Rank: rank, Kind: kvevent.KindRemoved, Removed: []uint64{1}}}))
	caughtUp(t, r, a)
	a.mu.Lock()
	lookups := a.cutLookups - before
	np := 0
	if p := a.parked[rank]; p != nil {
		np = len(p.blocks)
	}
	a.mu.Unlock()
	if lookups != n {
		t.Errorf("the eviction looked up %d cut blocks, want %d", lookups, n)
	}
	if np != n {
		t.Errorf("%d of the chain's %d blocks are parked", np, n)
	}
	if h := tierBlocks(r, kvevent.TierHostPinned); h != 0 {
		t.Errorf("the router still holds %d G2 blocks of the cut chain", h)
	}
}

// remapAboveAPoolBlock starts a router and an agent whose engine stored
// 1, 2 and whose G2 pool stored 3 below 2; then the engine (batch 1)
// reuses engine hash 2 for another block, reuse. It returns the router,
// the agent and reuse.
func remapAboveAPoolBlock(t *testing.T) (*router, *Agent, kvevent.Event) {
	t.Helper()
	r := startRouter(t)
	a, _ := startAgent(t, r)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2)}))
	x := storedChain(2, 3)
	x.Tier = kvevent.TierHostPinned
	_, err := a.Publish(rank, []kvevent.Event{x})
	must(t, err)
	reuse := kvevent.Event{Rank: rank, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 2, LocalHash: 77777}}}
	must(t, a.Events(rank, 1, []kvevent.Event{reuse}))
	return r, a, reuse
}

// TestRemapParksThePoolBlocksBelowTheOldBlock: the engine reuses engine
// hash 2 for another block, so its old block goes in every tier, and the
// pool's 3 below it is parked and taken off the router, as for a remove of
// 2; it is not let go when 2 is stored as the new block again, and it
// goes back to the router, and stays there through a dump, when the engine
// stores the old 2 again. From a review: the remap parked nothing, the
// mirror kept 3 where no lookup reached it, a dump took it off the router,
// and the engine storing 1, 2 again never brought it back.
func TestRemapParksThePoolBlocksBelowTheOldBlock(t *testing.T) {
	r, a, reuse := remapAboveAPoolBlock(t)
	must(t, a.Events(rank, 2, []kvevent.Event{reuse})) // the new 2 again: 3 is not its child
	caughtUp(t, r, a)
	if np := parkedBlocks(a); np != 1 {
		t.Fatalf("after the remap %d pool blocks are parked, want 1", np)
	}
	if h := tierBlocks(r, kvevent.TierHostPinned); h != 0 {
		t.Fatalf("after the remap the router holds %d G2 blocks, want 0", h)
	}
	must(t, a.Events(rank, 3, []kvevent.Event{storedChain(0, 1, 2)}))
	caughtUp(t, r, a)
	if np := parkedBlocks(a); np != 0 {
		t.Fatalf("with the old 2 stored again %d pool blocks are parked, want 0", np)
	}
	waitFor(t, "the router to match the engine's 1, 2 and the pool's 3", func() bool { return matched(r, 3) == 3 })
	resyncAndWait(t, a)
	if m := matched(r, 3); m != 3 {
		t.Fatalf("after the dump the router matches %d of 3", m)
	}
}

// TestRemapThenResetKeepsThePoolBlockParked: as above, with a reset of
// the rank after the remap: the pool's 3 waits, parked, through it, and
// goes to the router when the engine stores 1, 2 again. From a review:
// the reset found no parent hash for 3 in the mirror and dropped it.
func TestRemapThenResetKeepsThePoolBlockParked(t *testing.T) {
	r, a, _ := remapAboveAPoolBlock(t)
	a.Reset(rank)
	if np := parkedBlocks(a); np != 1 {
		t.Fatalf("after the remap and the reset %d pool blocks are parked, want 1", np)
	}
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2)}))
	caughtUp(t, r, a)
	waitFor(t, "the router to match the engine's 1, 2 and the pool's 3", func() bool { return matched(r, 3) == 3 })
}

// parkedBlocks is how many pool blocks of the rank are parked.
func parkedBlocks(a *Agent) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if p := a.parked[rank]; p != nil {
		return len(p.blocks)
	}
	return 0
}

// TestEvictAndRecomputeKeepsPoolBlock: the control of the test above,
// without a clear: the engine evicts 1..4 and computes 1..3 again; the
// router kept 4's G2 copy all along.
func TestEvictAndRecomputeKeepsPoolBlock(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	host := hostPoolOn(t, a)
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4)}))
	must(t, host.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
	must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{4, 3, 2, 1}}}))
	must(t, a.Events(rank, 2, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	caughtUp(t, r, a)
	if h, m := tierBlocks(r, kvevent.TierHostPinned), matched(r, 4); h != 1 || m != 4 {
		t.Fatalf("router holds %d G2 blocks, matches %d of 4", h, m)
	}
}

// TestEvictedParkedBlockIsNotPublished: a parked pool block that the pool
// evicts before its parent comes back is forgotten: the engine computing
// its parent again publishes nothing of it.
func TestEvictedParkedBlockIsNotPublished(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	host := hostPoolOn(t, a) // 8 blocks
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4)}))
	must(t, host.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
	must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindCleared}}))
	for h := uint64(100); h < 108; h++ { // evicts 4, the oldest
		must(t, host.Register(pool.Block{Hash: h, Local: 1000 + h}, make([]byte, blockBytes)))
	}
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 0 {
		t.Fatalf("%v pool blocks wait for their parent after the pool evicted the only one", n)
	}
	must(t, a.Events(rank, 2, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	caughtUp(t, r, a)
	if h, m := tierBlocks(r, kvevent.TierHostPinned), matched(r, 4); h != 8 || m != 3 {
		t.Fatalf("the router holds %d G2 blocks (want the pool's 8) and matches %d of 4 (want 3)", h, m)
	}
}

// TestReopenedG3BlockWaitsForItsParent: G3 holds block 4, whose parent 3
// it never held. On start the agent parks it (it is no orphan: it would
// expire before the engine serves again), and publishes it once the
// engine stores 1..3. From a review: it was held as an orphan, expired
// after 2s, and never sent again.
func TestReopenedG3BlockWaitsForItsParent(t *testing.T) {
	r := startRouter(t)
	dir := t.TempDir()
	pc := pool.Config{Rank: rank, Capacity: 8, BlockSize: blockBytes, Logger: quiet}
	d, err := pool.OpenDisk(dir, pc, pool.DiskOptions{})
	must(t, err)
	must(t, d.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
	must(t, d.Close())

	reg := prometheus.NewRegistry()
	var disk *pool.DiskPool
	a, _ := startAgentThen(t, r, Config{Registerer: reg}, func(a *Agent) {
		pc.Sink = a
		disk, err = pool.OpenDisk(dir, pc, pool.DiskOptions{})
		must(t, err)
		evs, _ := disk.Dump()
		must(t, a.Restore(rank, evs))
	})
	t.Cleanup(func() { disk.Close() })
	a.mu.Lock()
	dump, _ := a.mirror.DumpRank(rank)
	a.mu.Unlock()
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 1 || len(dump.Orphans) != 0 {
		t.Fatalf("after the restore: %v blocks parked, %d orphans held; want 1 and 0", n, len(dump.Orphans))
	}
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3)}))
	caughtUp(t, r, a)
	if g3, m := tierBlocks(r, kvevent.TierDisk), matched(r, 4); g3 != 1 || m != 4 {
		t.Fatalf("G3 holds block 4 (pool: %d blocks), the engine 1..3: the router holds %d G3 blocks, matches %d of 4", disk.Stats().Used, g3, m)
	}
}

// TestParkedBlockWaitsForAnOrphanParent: the pool's 4 waits for 3. The
// engine's store of 3 names a parent (2) the mirror does not hold (its
// store was lost: a gap), so the mirror holds 3 as an orphan, and 4 must
// wait on: let go under 3, it would be an orphan too, on the mirror and
// the router, that expires after 2s, and once the engine computes 1..3
// again nothing would publish it. The control half stores 1..3 without
// the orphan store first. From a review: 4 was let go at the orphan store
// of 3 and the router never learned that G2 held it.
func TestParkedBlockWaitsForAnOrphanParent(t *testing.T) {
	for _, orphanFirst := range []bool{false, true} {
		t.Run(map[bool]string{false: "control", true: "orphan_parent"}[orphanFirst], func(t *testing.T) {
			r := startRouter(t)
			reg := prometheus.NewRegistry()
			a, _ := startAgentWith(t, r, Config{Registerer: reg})
			host := hostPoolOn(t, a)
			must(t, host.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
			if orphanFirst {
				must(t, a.Events(rank, 0, []kvevent.Event{storedChain(2, 3)}))
				a.mu.Lock()
				held := a.mirror.Holds(rank, 4)
				a.mu.Unlock()
				if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 1 || held {
					t.Fatalf("after the engine's orphan store of 3: %v blocks parked (want 1), the mirror holds 4: %v (want false)", n, held)
				}
				waitFor(t, "the orphan to age out", func() bool {
					evs, _ := a.dump(rank)
					return len(evs) == 0
				})
				must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{3}}}))
			}
			must(t, a.Events(rank, 2, []kvevent.Event{storedChain(0, 1, 2, 3)}))
			caughtUp(t, r, a)
			waitFor(t, "acked", func() bool { acked, last := a.Publisher().Cursor(rank); return acked == last })
			if h, m := tierBlocks(r, kvevent.TierHostPinned), matched(r, 4); h != 1 || m != 4 {
				t.Fatalf("the engine holds 1..3, G2 holds 4 (pool: %d blocks): the router holds %d G2 blocks (want 1), matches %d of 4 (want 4)",
					host.Stats().Used, h, m)
			}
			if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 0 {
				t.Fatalf("%v pool blocks still wait for their parent", n)
			}
		})
	}
}

// TestParkedBlockFollowsAnAdoptedParent: the engine's store of 3 comes
// before that of its parent 2 (the mirror holds 3 as an orphan); the pool
// offloads 4 under 3, which waits for it. The engine then stores 1, 2:
// the mirror applies the held 3 with them, and 4 goes out under it. The
// same when it is a pool's store that resolves the engine's orphan. From
// a review: only the hashes of the batch let parked blocks go, so 4 stayed
// parked while the mirror held its parent, unknown to the router.
func TestParkedBlockFollowsAnAdoptedParent(t *testing.T) {
	for _, poolResolves := range []bool{false, true} {
		t.Run(map[bool]string{false: "engine_store", true: "pool_store"}[poolResolves], func(t *testing.T) {
			r := startRouter(t)
			reg := prometheus.NewRegistry()
			a, _ := startAgentWith(t, r, Config{Registerer: reg})
			host := hostPoolOn(t, a)
			must(t, a.Events(rank, 0, []kvevent.Event{storedChain(2, 3)})) // an orphan: 2 is not known
			must(t, host.Register(pool.Block{Hash: 4, Parent: 3, Local: 1004}, make([]byte, blockBytes)))
			if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != 1 {
				t.Fatalf("%v pool blocks wait for the orphan 3, want 1", n)
			}
			wantDevice, wantHost := int64(3), int64(1)
			if poolResolves {
				must(t, a.Events(rank, 1, []kvevent.Event{storedChain(0, 1)}))
				must(t, host.Register(pool.Block{Hash: 2, Parent: 1, Local: 1002}, make([]byte, blockBytes)))
				wantDevice, wantHost = 2, 2
			} else {
				must(t, a.Events(rank, 1, []kvevent.Event{storedChain(0, 1, 2)}))
			}
			caughtUp(t, r, a)
			if d := tierBlocks(r, kvevent.TierDevice); d != wantDevice {
				t.Fatalf("the router holds %d device blocks, want %d (the orphan 3 applied)", d, wantDevice)
			}
			parked := metric(t, reg, "kvagent_offload_parked_blocks")
			if h, m := tierBlocks(r, kvevent.TierHostPinned), matched(r, 4); h != wantHost || m != 4 || parked != 0 {
				t.Fatalf("the mirror holds 1..3, the pool 4 under 3: the router holds %d G2 blocks (want %d), matches %d of 4 (want 4); %v blocks still parked (want 0)",
					h, wantHost, m, parked)
			}
		})
	}
}

// TestOffloadOfAnUnknownHashWithHeldContentIsAccepted: two requests with
// the same tokens and different extra_keys (an image, a per-request
// cache_salt) get different engine hashes and the same content hash
// (kvevent/engine's doc); so do the blocks of an engine restarted with
// another hash seed. The engine reported 51 (content 1001, the first
// block); an offload of 1 (content 1001, the first block), a hash the
// agent has not heard of, is accepted. Its copy is not published while
// the mirror holds the block as 51 (the router holds a rank's block under
// one engine hash: it would take 1 for a new name of the engine's block,
// and the engine's REMOVE of 51 would no longer resolve), and its child
// waits for 1. From a review: CheckOffload refused it, and with it the
// whole request.
func TestOffloadOfAnUnknownHashWithHeldContentIsAccepted(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	o := startOffload(t, a, offloadConfig{hostCap: 8})
	must(t, a.Events(rank, 0, []kvevent.Event{{Kind: kvevent.KindStored,
		Blocks: []kvevent.Block{{EngineHash: 51, LocalHash: 1001}}}}))
	if err := a.CheckOffload(rank, 0, kvevent.Block{EngineHash: 1, LocalHash: 1001}); err != nil {
		t.Fatalf("CheckOffload of a hash the agent has not heard of: %v", err)
	}
	res, err := o.c.Offload(context.Background(), engineapi.OffloadRequest{Blocks: []engineapi.OffloadBlock{
		{G1Block: 0, Hash: 1, Local: 1001, Priority: 1},
		{G1Block: 1, Hash: 2, Parent: 1, Local: 1002, Priority: 1},
	}})
	if err != nil {
		t.Fatalf("offload of blocks the agent has not heard of: %v", err)
	}
	if res.Queued != 2 {
		t.Fatalf("offload of blocks the agent has not heard of: %+v, want 2 queued", res)
	}
	if n := metric(t, reg, "kvagent_offload_mismatches_total", "where", "request"); n != 0 {
		t.Fatalf("kvagent_offload_mismatches_total{where=request} = %v, want 0", n)
	}
	o.idle()
	caughtUp(t, r, a)
	pooled, onRouter := o.host.Stats().Used, tierBlocks(r, kvevent.TierHostPinned)
	refused, parked := metric(t, reg, "kvagent_offload_mismatches_total", "where", "pool"), metric(t, reg, "kvagent_offload_parked_blocks")
	if pooled != 2 || onRouter != 0 || refused != 1 || parked != 1 {
		t.Fatalf("while the mirror holds 51: the pool holds %d blocks (want 2), the router %d G2 blocks (want 0); %v pool stores refused (want 1), %v parked (want 1: 2 waits for 1)",
			pooled, onRouter, refused, parked)
	}
	// The engine reports 1 (the mirror's newest name of the block): 2 goes
	// out under it. 1's own copy stays unknown to the router (docs/offload.md).
	must(t, a.Events(rank, 1, []kvevent.Event{storedChain(0, 1)}))
	caughtUp(t, r, a)
	if h, m, n := tierBlocks(r, kvevent.TierHostPinned), matched(r, 2), metric(t, reg, "kvagent_offload_parked_blocks"); h != 1 || m != 2 || n != 0 {
		t.Fatalf("once the engine reported 1: the router holds %d G2 blocks (want 1) and matches %d of 2 (want 2); %v parked (want 0)", h, m, n)
	}
}

// parkUnderMissingParents parks k single-block G2 stores, each under its
// own parent the mirror does not hold (the blocks of a reopened G3 pool
// after the engine restarted with another hash seed look like this).
func parkUnderMissingParents(t *testing.T, a *Agent, k int) {
	t.Helper()
	const batch = 1000
	for i := 0; i < k; i += batch {
		evs := make([]kvevent.Event, 0, batch)
		for j := i; j < i+batch && j < k; j++ {
			evs = append(evs, kvevent.Event{Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, HasParent: true,
				Parent: 1<<40 + uint64(j), Blocks: []kvevent.Block{{EngineHash: 1<<41 + uint64(j), LocalHash: 1<<45 + uint64(j)}}})
		}
		if _, err := a.Publish(rank, evs); err != nil {
			t.Fatal(err)
		}
	}
}

// releaseLookups is how many parents releaseLocked has looked up so far.
func releaseLookups(a *Agent) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.releaseLookups
}

// TestAdoptionLooksUpOnlyTheAdoptedParents: with many pool blocks parked
// under parents the mirror does not hold, an engine batch that makes the
// mirror adopt a held orphan looks up only the adopted blocks that parked
// blocks wait for, and a parked block under one of them goes out. From a
// review: every such batch sorted and looked up every parent any parked
// block waits for (200,000 parked: 218 ms per batch, under the agent's
// lock, on the engine's event path).
func TestAdoptionLooksUpOnlyTheAdoptedParents(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	const K = 2000
	parkUnderMissingParents(t, a, K)
	// One more waits for 1<<42, which the engine stores as an orphan.
	_, err := a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, HasParent: true,
		Parent: 1 << 42, Blocks: []kvevent.Block{{EngineHash: 1 << 44, LocalHash: 1 << 46}}}})
	must(t, err)
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != K+1 {
		t.Fatalf("parked %v, want %d", n, K+1)
	}
	const rounds = 5
	for i := uint64(0); i < rounds; i++ {
		must(t, a.Events(rank, 0, []kvevent.Event{storedChain(1<<43+i, 1<<42+i)})) // held: 1<<43+i is unknown
		before := releaseLookups(a)
		must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1<<43+i)})) // adopts it
		want := uint64(0)
		if i == 0 {
			want = 1 // 1<<42, which a parked block waits for
		}
		if n := releaseLookups(a) - before; n != want {
			t.Fatalf("round %d: an engine batch that adopts one orphan looked up %d parents of parked blocks, want %d (%d wait)", i, n, want, K+1)
		}
	}
	caughtUp(t, r, a)
	if h, n := tierBlocks(r, kvevent.TierHostPinned), metric(t, reg, "kvagent_offload_parked_blocks"); h != 1 || n != K {
		t.Fatalf("the mirror adopted 1<<42: the router holds %d G2 blocks (want 1, its parked child), %v still parked (want %d)", h, n, K)
	}
}

// TestReleaseThatAdoptsLooksUpEachParentOnce: one engine store lets N
// parked pool blocks go, and the apply of each adopts an engine orphan
// held under it, while K other pool blocks wait for parents the mirror
// does not hold. The release looks each parent up once, not the K others
// at each adoption. From a review: each of the N adoptions queued every
// waited-for parent again (60 x 200,000 lookups: 4.6 s under the agent's
// lock).
func TestReleaseThatAdoptsLooksUpEachParentOnce(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	const K = 2000
	parkUnderMissingParents(t, a, K)
	const N = 60 // under the mirror's 64 held stores
	const R = 1 << 44
	var evs []kvevent.Event
	for j := uint64(0); j < N; j++ {
		evs = append(evs, kvevent.Event{Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, HasParent: true, Parent: R,
			Blocks: []kvevent.Block{{EngineHash: 1<<47 + j, LocalHash: 1<<48 + j}}})
	}
	_, err := a.Publish(rank, evs)
	must(t, err)
	for j := uint64(0); j < N; j++ { // the engine's child of each, held as an orphan
		must(t, a.Events(rank, 0, []kvevent.Event{{Kind: kvevent.KindStored, HasParent: true, Parent: 1<<47 + j,
			Blocks: []kvevent.Block{{EngineHash: 1<<49 + j, LocalHash: 1<<50 + j}}}}))
	}
	before := releaseLookups(a)
	must(t, a.Events(rank, 0, []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: R, LocalHash: 1 << 51}}}}))
	// R is the only parent the store and the adopted orphans name that
	// parked blocks wait for.
	if n := releaseLookups(a) - before; n != 1 {
		t.Fatalf("one engine store letting %d parked blocks go, each adopting an orphan, looked up %d parents (want 1; %d others wait)", N, n, K)
	}
	caughtUp(t, r, a)
	if n := metric(t, reg, "kvagent_offload_parked_blocks"); n != K {
		t.Fatalf("parked %v after the release, want %d", n, K)
	}
	if h, d := tierBlocks(r, kvevent.TierHostPinned), tierBlocks(r, kvevent.TierDevice); h != N || d != 1+N {
		t.Fatalf("the router holds %d G2 blocks (want %d) and %d device blocks (want %d: R and the adopted orphans)", h, N, d, 1+N)
	}
}

// TestEngineRenameWithdrawsThePoolsCopy: G2 holds engine hash 1 (content
// 1001), published; the engine then stores the same content under 51
// (another cache_salt or extra_keys). The mirror and the router hold a
// rank's block under one engine hash, the newest, so the block became 51
// with its G2 bit, and the pool's REMOVE of 1 no longer named it. The
// agent withdraws the pool's copy at the rename, as it does not publish a
// copy stored after the engine's block (docs/offload.md): the router
// holds 1001 in the engine's tier alone, and nothing once the engine
// removes 51. From a review: the router held 1001 in G2 for good after
// the pool evicted 1 and the engine 51 (a clear keeps pool tiers, a dump
// copies the mirror).
func TestEngineRenameWithdrawsThePoolsCopy(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	_, err := a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned,
		Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 1001}}}})
	must(t, err)
	must(t, a.Events(rank, 0, []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 51, LocalHash: 1001}}}}))
	caughtUp(t, r, a)
	if g2, d := tierBlocks(r, kvevent.TierHostPinned), tierBlocks(r, kvevent.TierDevice); g2 != 0 || d != 1 {
		t.Fatalf("the engine stored 1001 as 51 after G2 published it as 1: the router holds %d G2 and %d device blocks (want 0, 1)", g2, d)
	}
	if n := metric(t, reg, "kvagent_offload_mismatches_total", "where", "engine"); n != 1 {
		t.Fatalf("kvagent_offload_mismatches_total{where=engine} = %v, want 1", n)
	}
	_, err = a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindRemoved, Tier: kvevent.TierHostPinned, Removed: []uint64{1}}})
	must(t, err)
	must(t, a.Events(rank, 1, []kvevent.Event{{Kind: kvevent.KindRemoved, Removed: []uint64{51}}}))
	caughtUp(t, r, a)
	if g2, d := tierBlocks(r, kvevent.TierHostPinned), tierBlocks(r, kvevent.TierDevice); g2 != 0 || d != 0 {
		t.Fatalf("the pool evicted 1 and the engine 51: the router still holds %d G2 and %d device blocks (want 0, 0)", g2, d)
	}
	evs, _ := a.dump(rank)
	if len(evs) != 0 {
		t.Fatalf("the mirror's dump still holds %+v", evs)
	}
}

// TestEngineRenamesInOneBatch: a batch that renames a pool's block twice
// withdraws the copy under the last name; one that renames it back to the
// pool's name withdraws nothing, and the pool's REMOVE then takes it back.
func TestEngineRenamesInOneBatch(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	a, _ := startAgentWith(t, r, Config{Registerer: reg})
	_, err := a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned,
		Blocks: []kvevent.Block{{EngineHash: 2, LocalHash: 1002}, {EngineHash: 3, LocalHash: 1003}}}})
	must(t, err)
	must(t, a.Events(rank, 0, []kvevent.Event{
		{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 52, LocalHash: 1002}}},
		{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 62, LocalHash: 1002}}}, // 52 renamed again
		{Kind: kvevent.KindStored, HasParent: true, Parent: 62, Blocks: []kvevent.Block{{EngineHash: 53, LocalHash: 1003}}},
		{Kind: kvevent.KindStored, HasParent: true, Parent: 62, Blocks: []kvevent.Block{{EngineHash: 3, LocalHash: 1003}}}, // back to the pool's name
	}))
	caughtUp(t, r, a)
	if g2, n := tierBlocks(r, kvevent.TierHostPinned), metric(t, reg, "kvagent_offload_mismatches_total", "where", "engine"); g2 != 1 || n != 1 {
		t.Fatalf("the router holds %d G2 blocks (want 1: 3, under the pool's name again); %v copies withdrawn (want 1: 2, last named 62)", g2, n)
	}
	_, err = a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindRemoved, Tier: kvevent.TierHostPinned, Removed: []uint64{2, 3}}})
	must(t, err)
	caughtUp(t, r, a)
	if g2, d := tierBlocks(r, kvevent.TierHostPinned), tierBlocks(r, kvevent.TierDevice); g2 != 0 || d != 2 {
		t.Fatalf("the pool evicted 2 and 3: the router holds %d G2 blocks (want 0) and %d device blocks (want 2)", g2, d)
	}
}

// TestCleanStopTakesG2OffTheRouter: kvagent's clean stop closes the
// offload side (the engine API, then the pools), then flushes the
// publisher. The router is then left with what is still there: the
// engine's G1 blocks (the engine may run on) and the G3 pool's blocks
// (on disk, republished by the next agent), not the G2 pool's, whose
// pinned memory the stop freed. From a review: the G2 blocks stayed on
// the router, and were scored, until the worker's lease ran out, or for
// good with a lease of 0.
func TestCleanStopTakesG2OffTheRouter(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	o := startOffload(t, a, offloadConfig{hostCap: 8, diskCap: 64, diskDir: t.TempDir(), filter: manager.FilterConfig{Always: true}})
	must(t, a.Events(rank, 0, []kvevent.Event{storedChain(0, 1, 2, 3, 4)}))
	hashes, locals := o.offload(true, 0, 1, 2, 3, 4, 5)
	waitFor(t, "the chain on disk", func() bool { return o.disk.Stats().Used == len(hashes) })
	o.idle()
	waitFor(t, "the router to hold every tier", func() bool {
		return tierBlocks(r, kvevent.TierDevice) == 4 && tierBlocks(r, kvevent.TierHostPinned) == 6 && tierBlocks(r, kvevent.TierDisk) == 6
	})

	// kvagent's shutdown: the offload side closes, then the last events
	// are flushed (within its 2 s).
	o.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	must(t, a.Flush(ctx))
	caughtUp(t, r, a)
	if g1, g2, g3 := tierBlocks(r, kvevent.TierDevice), tierBlocks(r, kvevent.TierHostPinned), tierBlocks(r, kvevent.TierDisk); g1 != 4 || g2 != 0 || g3 != 6 {
		t.Fatalf("after the stop the router holds %d G1, %d G2 and %d G3 blocks; want the engine's 4, none and the disk's 6", g1, g2, g3)
	}
	if m := tieredMatch(r, locals); m[kvevent.TierHostPinned] != 0 || m[kvevent.TierDisk] != 6 {
		t.Fatalf("after the stop a route matches %v of the offloaded chain; want none in G2, 6 in G3", m)
	}
}

// TestPublishErrorsHelpSaysWhatItCounts pins the help of
// kvagent_publish_errors_total to what the agent counts there
// (docs/operations.md: "engine batches, offload pools' events and clears
// that the agent could not publish"; agent.go increments it for a pool's
// event batch and for a clear as well as for an engine batch). A help
// that names engine batches only sends an operator who sees it move to
// the engine's stream while the failing publishes are the pools'.
func TestPublishErrorsHelpSaysWhatItCounts(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	startAgentWith(t, r, Config{Registerer: reg})
	mfs, err := reg.Gather()
	must(t, err)
	for _, mf := range mfs {
		if mf.GetName() != "kvagent_publish_errors_total" {
			continue
		}
		if h := mf.GetHelp(); !strings.Contains(h, "pool") || !strings.Contains(h, "clear") {
			t.Fatalf("kvagent_publish_errors_total help %q names neither offload pools' events nor clears, which it counts", h)
		}
		return
	}
	t.Fatal("kvagent_publish_errors_total is not registered")
}

// TestParkedBlocksRemovedLeaveNoParentEntry: a pool's blocks parked under
// parents the engine never stores, then evicted by the pool (its REMOVE),
// leave nothing of the rank's parking behind: no block, and no list of
// the blocks waiting for each parent, whether the parent is one the
// mirror lacks, a parked block of the same chain, or a parent a block
// stored again left (the newest store wins). Over an agent's life the
// pool parks and evicts blocks under ever new parents.
func TestParkedBlocksRemovedLeaveNoParentEntry(t *testing.T) {
	r := startRouter(t)
	a, _ := startAgent(t, r)
	const chains = 100
	var removed []uint64
	for i := range uint64(chains) {
		x := storedChain(100_000+i, 2*i+1, 2*i+2) // 2i+2 waits for 2i+1, parked too
		x.Tier = kvevent.TierHostPinned
		_, err := a.Publish(rank, []kvevent.Event{x})
		must(t, err)
		removed = append(removed, 2*i+1, 2*i+2)
	}
	again := storedChain(200_000, 1) // 1 stored again under another parent
	again.Tier = kvevent.TierHostPinned
	_, err := a.Publish(rank, []kvevent.Event{again})
	must(t, err)
	if np := parkedBlocks(a); np != 2*chains {
		t.Fatalf("%d pool blocks parked, want %d", np, 2*chains)
	}
	_, err = a.Publish(rank, []kvevent.Event{{Kind: kvevent.KindRemoved, Tier: kvevent.TierHostPinned, Removed: removed}})
	must(t, err)
	a.mu.Lock()
	defer a.mu.Unlock()
	p := a.parked[rank]
	if p == nil {
		return
	}
	if len(p.blocks) != 0 || len(p.byParent) != 0 {
		t.Fatalf("after the pool evicted every parked block: %d blocks and the lists of %d parents left, want none",
			len(p.blocks), len(p.byParent))
	}
}

// TestRestoreAfterRunResyncsTheRank pins Restore's "has the rank
// resynced" for a pool opened after Run has started (Run's first dump
// already taken): the rank is dumped again, and the router's index then
// holds the pool's blocks in G3. Without the resync the restored blocks
// stayed in the agent's mirror alone, and the router never learned of
// them until some other resync.
func TestRestoreAfterRunResyncsTheRank(t *testing.T) {
	r := startRouter(t)
	dir := t.TempDir()
	pc := pool.Config{Rank: rank, Capacity: 8, BlockSize: blockBytes, Logger: quiet}
	d, err := pool.OpenDisk(dir, pc, pool.DiskOptions{})
	must(t, err)
	for h := uint64(1); h <= 3; h++ {
		must(t, d.Register(pool.Block{Hash: h, Parent: h - 1, Local: 1000 + h}, make([]byte, blockBytes)))
	}
	must(t, d.Close())

	a, _ := startAgent(t, r)
	waitFor(t, "the start dump taken", func() bool { return a.Publisher().Synced(rank) == 1 })
	if g3 := tierBlocks(r, kvevent.TierDisk); g3 != 0 {
		t.Fatalf("before the restore the router holds %d G3 blocks, want 0", g3)
	}

	pc.Sink = a
	disk, err := pool.OpenDisk(dir, pc, pool.DiskOptions{})
	must(t, err)
	t.Cleanup(func() { disk.Close() })
	evs, _ := disk.Dump()
	must(t, a.Restore(rank, evs))
	deadline := time.Now().Add(10 * time.Second)
	for a.Publisher().Synced(rank) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("no dump of the rank taken in 10s after the restore of the pool's %d blocks (dumps taken: %d, the start's alone): the router does not learn of them",
				disk.Stats().Used, a.Publisher().Synced(rank))
		}
		time.Sleep(time.Millisecond)
	}
	caughtUp(t, r, a)
	waitFor(t, "the router to hold the restored blocks", func() bool { return tierBlocks(r, kvevent.TierDisk) == 3 })
	if m := matched(r, 3); m != 3 {
		t.Fatalf("after the restore's dump the router holds 3 G3 blocks but matches %d of 1001..1003, want 3", m)
	}
}

// TestFreshAgentShowsEachMismatchPlaceAtZero: every place an offload
// mismatch is counted (kvagent_offload_mismatches_total{where}) has its
// series from the start, at 0, so a panel or an alert over one reads 0 on
// a healthy agent, not "no data". From a review: the family had no series
// until its first count.
func TestFreshAgentShowsEachMismatchPlaceAtZero(t *testing.T) {
	r := startRouter(t)
	reg := prometheus.NewRegistry()
	startAgentWith(t, r, Config{Registerer: reg})
	fams, err := reg.Gather()
	must(t, err)
	got := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "kvagent_offload_mismatches_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "where" {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	want := map[string]float64{"request": 0, "pool": 0, "engine": 0}
	if !maps.Equal(got, want) {
		t.Fatalf("kvagent_offload_mismatches_total on a fresh agent, by where: %v; want %v", got, want)
	}
}
