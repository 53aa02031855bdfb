package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// The cluster benchmarks of this package (make bench-cluster; the process
// and HTTP ones live in ../benchcluster). Each is a test gated by
// KVROUTER_BENCH that prints "BENCH cluster.<figure> k=v ..." lines, every
// figure next to a baseline measured in the same run and their ratio: the
// machines are shared and noisy, so nothing here asserts a timing.
//
// Workload (seeded; KVROUTER_BENCH_SEED overrides the seed): ranks publish
// chains of Stored events of 8 blocks each, device tier. A rank stores
// sequences made of one of 100 family prefixes shared by every rank
// (16–128 blocks, so ranks share radix-tree nodes) and a private suffix
// (8–64 blocks); once a rank holds a family's prefix, its later sequences
// of that family store only their suffix, parented on the prefix, as an
// engine with a prefix cache does. Engine hashes are unique per rank.
//
// Knobs (environment, all optional):
//
//	KVROUTER_BENCH_SEED             the workload seed
//	KVROUTER_BENCH_INGEST_SECONDS   cap of the ingest window (default 20)
//	KVROUTER_BENCH_PUBLISHERS       concurrent publishers (default 4)
//	KVROUTER_BENCH_INGEST_CALLS     calls generated ahead per publisher (default 60, 491,520 block events)
//	KVROUTER_BENCH_BLOCKS           blocks held by the restart and snapshot state (default 5000000, the
//	                                target figure: about 50 s of setup and 100 s per test on 2 cores;
//	                                1000000 for a quick run)
//	KVROUTER_BENCH_LOG              non-empty: the nodes log warnings (Raft's too) to stderr
//	KVROUTER_BENCH_RAFT_TIMEOUT     heartbeat and election timeout, lease half of it (default: Config's defaults)
//	KVROUTER_BENCH_REPS             cluster.ingest's passes per baseline after the warm-up (default 2)

const (
	bcRanksPerCall  = 64 // ranks per IngestEvents call (one Raft entry)
	bcEventsPerRank = 16 // Stored events per rank batch
	bcBlocksPerEv   = 8  // blocks per Stored event
	bcBlocksPerCall = bcRanksPerCall * bcEventsPerRank * bcBlocksPerEv
	bcFamilies      = 100
	bcDefaultBlocks = 5_000_000 // restart and snapshot state
)

// bcRank is one publishing rank's generator state.
type bcRank struct {
	rank      kvevent.Rank
	salt      uint64
	nextID    uint64
	held      []bool // per family: this rank holds its prefix
	queue     []kvevent.Block
	hasParent bool
	parent    uint64
}

// bcGen generates the event stream of a set of ranks (one publisher).
type bcGen struct {
	rng      *rand.Rand
	families [][]uint64 // local hashes of each family's prefix
	ranks    []*bcRank
	fresh    uint64
}

// bcFamilySet returns the family prefixes of a seed: the same for every
// publisher of a run, so that ranks of different publishers share them.
func bcFamilySet(seed uint64) [][]uint64 {
	rng := rand.New(rand.NewPCG(seed, 0xfa111e5))
	fams := make([][]uint64, bcFamilies)
	next := uint64(1)
	for f := range fams {
		n := bcBlocksPerEv * (2 + rng.IntN(15)) // 16..128 blocks
		for i := 0; i < n; i++ {
			fams[f] = append(fams[f], mix(next^0x5eedfa))
			next++
		}
	}
	return fams
}

func newBCGen(seed uint64, stream uint64, fams [][]uint64, ranks []kvevent.Rank) *bcGen {
	g := &bcGen{rng: rand.New(rand.NewPCG(seed, stream)), families: fams}
	for _, r := range ranks {
		g.ranks = append(g.ranks, &bcRank{rank: r, salt: mix(r.Worker<<32 ^ uint64(r.DP) ^ 0x7a1), nextID: 1,
			held: make([]bool, len(fams))})
	}
	return g
}

func (g *bcGen) newSeq(r *bcRank) {
	f := g.rng.IntN(len(g.families))
	fam := g.families[f]
	eng := func(local uint64) uint64 { return mix(r.salt ^ local) } // unique per rank and content
	suffix := bcBlocksPerEv * (1 + g.rng.IntN(8))                   // 8..64 blocks
	q := make([]kvevent.Block, 0, len(fam)+suffix)
	if r.held[f] {
		r.hasParent, r.parent = true, eng(fam[len(fam)-1])
	} else {
		r.hasParent, r.parent = false, 0
		for _, h := range fam {
			q = append(q, kvevent.Block{EngineHash: eng(h), LocalHash: h})
		}
		r.held[f] = true
	}
	for i := 0; i < suffix; i++ {
		g.fresh++
		h := mix(r.salt ^ mix(g.fresh))
		q = append(q, kvevent.Block{EngineHash: eng(h), LocalHash: h})
	}
	r.queue = q
}

func (g *bcGen) event(r *bcRank) kvevent.Event {
	if len(r.queue) == 0 {
		g.newSeq(r)
	}
	n := min(bcBlocksPerEv, len(r.queue))
	blocks := r.queue[:n:n]
	r.queue = r.queue[n:]
	ev := kvevent.Event{Rank: r.rank, EventID: r.nextID, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
		HasParent: r.hasParent, Parent: r.parent, Blocks: blocks}
	r.nextID++
	r.hasParent, r.parent = true, blocks[n-1].EngineHash
	return ev
}

// call returns the next IngestEvents call: one batch per rank.
func (g *bcGen) call() []RankBatch {
	out := make([]RankBatch, len(g.ranks))
	for i, r := range g.ranks {
		out[i].Rank = r.rank
		out[i].Events = make([]kvevent.Event, bcEventsPerRank)
		for j := range out[i].Events {
			out[i].Events[j] = g.event(r)
		}
	}
	return out
}

// bcPublisherRanks returns publisher p's ranks: 32 workers of 2 dp ranks.
func bcPublisherRanks(p int) []kvevent.Rank {
	out := make([]kvevent.Rank, 0, bcRanksPerCall)
	for i := 0; i < bcRanksPerCall; i++ {
		out = append(out, kvevent.Rank{Worker: uint64(p*bcRanksPerCall/2 + i/2 + 1), DP: uint32(i % 2)})
	}
	return out
}

func bcBlocks(calls [][]RankBatch) int64 {
	var n int64
	for _, c := range calls {
		for _, b := range c {
			for _, ev := range b.Events {
				n += int64(len(ev.Blocks))
			}
		}
	}
	return n
}

// bcNewCluster is newTestCluster plus a teardown that closes the raft
// transports' pooled connections once every node is closed. Node.Close
// closes its NetworkTransport, which stops the listener but neither closes
// the pooled outbound connections nor the accepted inbound ones, so each
// peer's handleConn goroutine stays blocked reading until the process
// ends (and TestMain's goleak check fails the package). CloseStreams on
// every transport after the nodes are down lets them all see EOF.
func bcNewCluster(t *testing.T, n int, tune func(*Config)) *testCluster {
	t.Helper()
	var mu sync.Mutex
	var trs []*raft.NetworkTransport
	// Registered before newTestCluster's own cleanup, so it runs after it.
	t.Cleanup(func() {
		mu.Lock()
		defer mu.Unlock()
		for _, tr := range trs {
			tr.CloseStreams()
		}
	})
	return newTestCluster(t, n, func(cfg *Config) {
		if tune != nil {
			tune(cfg)
		}
		if d, err := time.ParseDuration(os.Getenv("KVROUTER_BENCH_RAFT_TIMEOUT")); err == nil && d > 0 {
			cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = d, d, d/2
		}
		if os.Getenv("KVROUTER_BENCH_LOG") != "" {
			cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		}
		if tr, ok := cfg.Transport.(*raft.NetworkTransport); ok {
			mu.Lock()
			trs = append(trs, tr)
			mu.Unlock()
		}
	})
}

// bcLeaderOf returns the node that leads now, waiting up to timeout; nil
// if none. Safe off the test goroutine.
func bcLeaderOf(c *testCluster, timeout time.Duration) *Node {
	deadline := time.Now().Add(timeout)
	for {
		for _, n := range c.nodes {
			if n != nil && n.IsLeader() {
				return n
			}
		}
		if time.Now().After(deadline) {
			return nil
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// bcIngest sends one call to the leader, retrying across leadership
// changes as a publisher does (every command is safe to retry), and
// counts each retry in leaderMoves.
func bcIngest(c *testCluster, call []RankBatch, leaderMoves *atomic.Int64) error {
	deadline := time.Now().Add(60 * time.Second)
	for {
		l := bcLeaderOf(c, 10*time.Second)
		if l == nil {
			return errors.New("no leader for 10s")
		}
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		acks, err := l.IngestEvents(cctx, call)
		cancel()
		if err == nil {
			for i, a := range acks {
				if a.Gap || a.Applied+a.Dups != len(call[i].Events) {
					return fmt.Errorf("rank %v: ack %+v for %d events", call[i].Rank, a, len(call[i].Events))
				}
			}
			return nil
		}
		if !errors.Is(err, ErrNotLeader) && !errors.Is(err, ErrNoLeader) || time.Now().After(deadline) {
			return err
		}
		leaderMoves.Add(1)
	}
}

// TestBenchClusterIngest: block events per second committed through a
// 3-node cluster on loopback TCP, fsync on (the log store syncs every
// write), many events per entry, several publishers in flight, each
// waiting for its ack (commit + apply on the leader). Ceiling: the same
// events applied to a bare in-memory indexer.Index, single writer, in the
// same run (index_block_events_per_s; ceiling_block_events_per_s is the
// larger of it and the FSM's, see ceiling_from). Also reported:
// fsm_block_events_per_s, the same entries through one FSM without Raft.
// Both baselines are the best of KVROUTER_BENCH_REPS alternating passes
// (default 2) after a warm-up. The three replicas share this machine's cores, so
// the cluster figure is bounded by three FSMs' apply work on them.
// KVROUTER_BENCH_PROFILE=file writes a CPU profile of the ingest window.
func TestBenchClusterIngest(t *testing.T) {
	benchenv.Skip(t, "bench-cluster")
	seed := benchenv.Seed(t, 20261201)
	publishers := benchenv.Int("KVROUTER_BENCH_PUBLISHERS", 4)
	window := time.Duration(benchenv.Int("KVROUTER_BENCH_INGEST_SECONDS", 20)) * time.Second
	// Enough calls that the window, not the workload, ends the run on a
	// fast machine: generated ahead so that generation is not measured.
	callsPer := benchenv.Int("KVROUTER_BENCH_INGEST_CALLS", 60)

	fams := bcFamilySet(seed)
	calls := make([][][]RankBatch, publishers)
	var entryBytes int64
	for p := range calls {
		g := newBCGen(seed, uint64(p+1), fams, bcPublisherRanks(p))
		for k := 0; k < callsPer; k++ {
			calls[p] = append(calls[p], g.call())
		}
		entryBytes += int64(len(encodeEvents(1, calls[p][0])))
	}
	entryBytes /= int64(publishers)

	c := bcNewCluster(t, 3, func(cfg *Config) { cfg.ExpiryInterval = time.Hour })
	c.leader()
	c.converged()

	var (
		acked       = make([]int, publishers) // calls acknowledged, per publisher
		leaderMoves atomic.Int64
		wg          sync.WaitGroup
		errMu       sync.Mutex
		firstErr    error
	)
	stopProfile := bcProfile(t)
	user0, sys0, flt0, cpuErr := bcCPUSeconds()
	start := time.Now()
	deadline := start.Add(window)
	for p := 0; p < publishers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			for k := range calls[p] {
				if time.Now().After(deadline) {
					return
				}
				if err := bcIngest(c, calls[p][k], &leaderMoves); err != nil {
					errMu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("publisher %d call %d: %w", p, k, err)
					}
					errMu.Unlock()
					return
				}
				acked[p]++
			}
		}(p)
	}
	wg.Wait()
	elapsed := time.Since(start)
	user1, sys1, flt1, cpuErr1 := bcCPUSeconds()
	var mem runtime.MemStats
	runtime.ReadMemStats(&mem)
	stopProfile()
	if firstErr != nil {
		t.Fatal(firstErr)
	}
	// How busy the window kept the machine and what its kernel time was:
	// the three replicas grow their state from empty, and on a virtual
	// machine the first touch of fresh memory is dear.
	cores, sysShare, faults := "na", "na", "na"
	if cpuErr == nil && cpuErr1 == nil && user1+sys1 > user0+sys0 {
		cpu := user1 + sys1 - user0 - sys0
		cores = fmt.Sprintf("%.2f", cpu/elapsed.Seconds())
		sysShare = fmt.Sprintf("%.2f", (sys1-sys0)/cpu)
		faults = strconv.FormatUint(flt1-flt0, 10)
	}
	var ackedCalls int
	var ackedBlocks int64
	for p := range calls {
		ackedCalls += acked[p]
		ackedBlocks += bcBlocks(calls[p][:acked[p]])
	}
	rate := float64(ackedBlocks) / elapsed.Seconds()
	entries := float64(ackedCalls) / elapsed.Seconds()

	// Every replica holds what was acknowledged; then the cluster stops, so
	// that its background work (compactions, heartbeats) and its heap are
	// gone before the baselines run.
	c.converged()
	got := c.leader().IndexStats()
	gotDigest := c.leader().fsm.Index().Digest()
	electionMs := c.nodes[0].cfg.ElectionTimeout.Milliseconds()
	c.close()
	runtime.GC()

	// Two baselines, from the acknowledged calls, publishers interleaved
	// call by call: the ceiling, the calls applied to a bare in-memory
	// index by one writer; and between it and the cluster a reference, the
	// same calls through one FSM without Raft, one entry per call and 4
	// entries per ApplyBatch (decode, the same index apply, journal,
	// Pebble batch), which the cluster pays on each of its three replicas,
	// here sharing the machine's cores. The reference does strictly more
	// than the ceiling, yet measured after it (the ceiling first, into a
	// heap the cluster had just left) it came out faster in six runs. So
	// the encoded entries are made first and stay live for both; each pass
	// keeps nothing of the one before and collects garbage before its
	// clock; one pass of each is a discarded warm-up; then the two
	// alternate A B B A and each keeps its best pass. Should the reference
	// still beat the ceiling, the ceiling is raised to it (ceiling_from=fsm):
	// a ratio against a ceiling that is not an upper bound overstates.
	var logs []*raft.Log
	for k := 0; k < callsPer; k++ {
		for p := range calls {
			if k < acked[p] {
				logs = append(logs, &raft.Log{Index: uint64(len(logs) + 1), Term: 1, Type: raft.LogCommand, Data: encodeEvents(1, calls[p][k])})
			}
		}
	}
	reps := benchenv.Int("KVROUTER_BENCH_REPS", 2)
	fsmDir := t.TempDir()
	var bareDigest uint64
	var bareEntries, fsmPasses int64
	ceilPass := func() float64 {
		ix := indexer.New(indexer.Config{})
		benchenv.Settle()
		cstart := time.Now()
		for k := 0; k < callsPer; k++ {
			for p := range calls {
				if k >= acked[p] {
					continue
				}
				for _, b := range calls[p][k] {
					for j := range b.Events {
						_ = ix.Apply(&b.Events[j], 1)
					}
				}
			}
		}
		r := float64(ackedBlocks) / time.Since(cstart).Seconds()
		bareEntries, bareDigest = ix.Stats().Entries, ix.Digest()
		return r
	}
	fsmPass := func() float64 {
		fsmPasses++
		dir := filepath.Join(fsmDir, fmt.Sprint(fsmPasses))
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		benchenv.Settle()
		fstart := time.Now()
		for i := 0; i < len(logs); i += 4 {
			f.ApplyBatch(logs[i:min(i+4, len(logs))])
		}
		r := float64(ackedBlocks) / time.Since(fstart).Seconds()
		fsmEntries := f.Index().Stats().Entries
		f.Close()
		if err := os.RemoveAll(dir); err != nil {
			t.Fatal(err)
		}
		if fsmEntries != ackedBlocks {
			t.Errorf("the reference FSM holds %d entries, want %d", fsmEntries, ackedBlocks)
		}
		return r
	}
	warmCeil, warmFSM := ceilPass(), fsmPass()
	ceilings, fsmRates := benchenv.ABBA(reps, ceilPass, fsmPass)
	bare, fsmRate := benchenv.Best(ceilings), benchenv.Best(fsmRates)
	ceiling, raised := benchenv.UpperBound(bare, fsmRate)
	ceilingFrom := "index"
	if raised {
		ceilingFrom = "fsm"
		t.Logf("warning: the FSM reference (%.3g/s) beat the bare index (%.3g/s), which does less; the ceiling is the FSM's", fsmRate, bare)
	}
	t.Logf("baseline passes (block events/s): warm-up index %.3g, FSM %.3g; index %.3g; FSM %.3g", warmCeil, warmFSM, ceilings, fsmRates)
	if got.Entries != bareEntries || got.Entries != ackedBlocks {
		t.Errorf("replicated index holds %d entries, the bare index %d, acknowledged %d", got.Entries, bareEntries, ackedBlocks)
	}
	if gotDigest != bareDigest {
		t.Logf("note: index digests differ (replicated %#x, bare %#x)", gotDigest, bareDigest)
	}

	t.Logf("%d publishers x %d ranks x %d events x %d blocks per call; %d calls in %v; %d leader changes seen; tree nodes %d",
		publishers, bcRanksPerCall, bcEventsPerRank, bcBlocksPerEv, ackedCalls, elapsed.Round(time.Millisecond), leaderMoves.Load(), got.Nodes)
	fmt.Printf("BENCH cluster.ingest block_events_per_s=%.3g ceiling_block_events_per_s=%.3g ratio=%.3f fsm_block_events_per_s=%.3g index_block_events_per_s=%.3g ceiling_from=%s reps=%d entries_per_s=%.1f entry_bytes=%d events_per_entry=%d publishers=%d block_events=%d retries=%d election_timeout_ms=%d cpu_cores=%s sys_share=%s faults=%s heap_mb=%d seed=%d\n",
		rate, ceiling, rate/ceiling, fsmRate, bare, ceilingFrom, reps, entries, entryBytes, bcRanksPerCall*bcEventsPerRank, publishers, ackedBlocks, leaderMoves.Load(),
		electionMs, cores, sysShare, faults, mem.HeapAlloc>>20, seed)
}

// bcBuildState fills a single-node cluster's state with about blocks
// blocks through IngestEvents (the real write path), from 4 publishers.
// It returns the cluster and the blocks held.
func bcBuildState(t *testing.T, seed uint64, blocks int64) (*testCluster, int64) {
	t.Helper()
	c := bcNewCluster(t, 1, func(cfg *Config) { cfg.ExpiryInterval = time.Hour })
	c.leader()
	const publishers = 4
	fams := bcFamilySet(seed)
	perPub := (blocks/bcBlocksPerCall + publishers - 1) / publishers
	var wg sync.WaitGroup
	errs := make([]error, publishers)
	var moves atomic.Int64
	start := time.Now()
	for p := 0; p < publishers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			g := newBCGen(seed, uint64(p+1), fams, bcPublisherRanks(p))
			for k := int64(0); k < perPub; k++ {
				if err := bcIngest(c, g.call(), &moves); err != nil {
					errs[p] = err
					return
				}
			}
		}(p)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	held := c.nodes[0].IndexStats().Entries
	t.Logf("state: %d blocks through IngestEvents in %v", held, time.Since(start).Round(time.Millisecond))
	return c, held
}

// bcReadDir reads every regular file under dir sequentially and returns
// the bytes read.
func bcReadDir(t *testing.T, dir string) int64 {
	t.Helper()
	buf := make([]byte, 1<<20)
	var total int64
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		for {
			n, err := f.Read(buf)
			total += int64(n)
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	return total
}

// TestBenchClusterRestart: time for a node holding N blocks to be ready
// again after a crash (testCluster.crash: the FSM's open group is lost,
// as after kill -9), as a whole single-node Node: Pebble stores reopened
// with their WALs replayed, the index rebuilt from the state database,
// Raft's log read and the entries after the last group applied again, an
// election won; against reading the same data directory's files
// sequentially, as the crash left them (bcRestart). Everything runs from
// the page cache, as after a process crash; a cold start after a reboot
// adds the disk's read time. Also reported: open_seconds (NewNode
// returned), and fsm_reopen_seconds, a second OpenFSM of the same
// directory once the node is down again, whose WAL is then short: the
// index rebuild alone. KVROUTER_BENCH_PROFILE=file writes a CPU profile of
// the restart and the reopen alone (-cpuprofile would be mostly the
// state's ingest).
func TestBenchClusterRestart(t *testing.T) {
	benchenv.Skip(t, "bench-cluster")
	seed := benchenv.Seed(t, 20261202)
	c, held := bcBuildState(t, seed, int64(benchenv.Int("KVROUTER_BENCH_BLOCKS", bcDefaultBlocks)))
	r := bcRestart(t, c, held)
	t.Logf("data dir %.1f MB (fsm/ %.1f MB) after the crash; the crash lost a group of %.1f MB; NewNode returned after %v",
		float64(r.readBytes)/1e6, float64(r.fsmBytes)/1e6, float64(r.lostBytes)/1e6, r.opened.Round(time.Millisecond))
	fmt.Printf("BENCH cluster.restart blocks=%d seconds=%.3f read_seconds=%.3f ratio=%.1f open_seconds=%.3f fsm_reopen_seconds=%.3f dir_mb=%.1f seed=%d\n",
		held, r.ready.Seconds(), r.read.Seconds(), r.ready.Seconds()/r.read.Seconds(), r.opened.Seconds(), r.fsmOpen.Seconds(), float64(r.readBytes)/1e6, seed)
}

// TestBenchRestartBaselineReadsTheCrashedDirectory: the restart
// benchmark's baseline reads, and dir_mb reports, the data directory as
// the crash left it, the one the restart starts from. A clean stop and a
// second OpenFSM commit the open group and add tables (at 300k blocks
// 15.7 MB read against the 5.2 MB the restart started from). A small
// state, so that it runs in make test.
func TestBenchRestartBaselineReadsTheCrashedDirectory(t *testing.T) {
	c, held := bcBuildState(t, 20261202, 20_000)
	r := bcRestart(t, c, held)
	if r.readBytes != r.crashBytes {
		t.Fatalf("the restart started from a %d-byte directory; the baseline read %d bytes", r.crashBytes, r.readBytes)
	}
}

// bcRestartRun is what bcRestart measured.
type bcRestartRun struct {
	crashBytes int64         // the data directory's size right after the crash
	readBytes  int64         // read by the baseline
	fsmBytes   int64         // fsm/'s size right after the crash
	lostBytes  int64         // the open group the crash lost
	read       time.Duration // the baseline: the directory read sequentially
	opened     time.Duration // to NewNode's return
	ready      time.Duration // to the restarted node's readiness
	fsmOpen    time.Duration // a second OpenFSM once the node is down again
}

// bcRestart crashes node 0 of c, a single-node cluster holding held
// blocks, times a sequential read of its data directory, then its restart
// to ready, checks it holds the same state, stops it and times a second
// OpenFSM of its directory.
func bcRestart(t *testing.T, c *testCluster, held int64) bcRestartRun {
	t.Helper()
	var r bcRestartRun
	digest := c.nodes[0].fsm.Digest()
	r.lostBytes = int64(c.nodes[0].fsm.groupLen())
	c.crash(0)
	dir := c.dirs[0]
	r.crashBytes = bcDirBytes(t, dir)
	r.fsmBytes = bcDirBytes(t, filepath.Join(dir, "fsm"))
	// The baseline reads the directory now, as the restart will find it:
	// after the restart the clean stop and the second OpenFSM have
	// committed the open group and added tables. Read once untimed first,
	// so that the timed read and the restart both start from the page
	// cache.
	bcReadDir(t, dir)
	start := time.Now()
	r.readBytes = bcReadDir(t, dir)
	r.read = time.Since(start)
	stopProfile := bcProfile(t)
	defer stopProfile()

	start = time.Now()
	c.start(0)
	r.opened = time.Since(start)
	wctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := c.nodes[0].WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	r.ready = time.Since(start)
	if got := c.nodes[0].fsm.Digest(); got != digest || c.nodes[0].IndexStats().Entries != held {
		t.Fatalf("after restart: digest %#x entries %d, want %#x %d", got, c.nodes[0].IndexStats().Entries, digest, held)
	}
	c.stop(0)

	start = time.Now()
	f, err := OpenFSM(FSMConfig{Dir: filepath.Join(dir, "fsm"), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	r.fsmOpen = time.Since(start)
	if f.Index().Stats().Entries != held {
		t.Fatalf("OpenFSM: %d entries, want %d", f.Index().Stats().Entries, held)
	}
	f.Close()
	return r
}

// bcProfile starts a CPU profile into $KVROUTER_BENCH_PROFILE and an
// execution trace into $KVROUTER_BENCH_TRACE, each when set, and returns
// the function that stops them.
func bcProfile(t *testing.T) (stop func()) {
	stopProfile := bcProfileTo(t, os.Getenv("KVROUTER_BENCH_PROFILE"))
	stopTrace := bcRecordTo(t, os.Getenv("KVROUTER_BENCH_TRACE"), trace.Start, trace.Stop)
	return func() {
		stopTrace()
		stopProfile()
	}
}

// bcProfileTo starts a CPU profile into path, unless path is empty, and
// returns the function that stops it.
func bcProfileTo(t *testing.T, path string) (stop func()) {
	return bcRecordTo(t, path, pprof.StartCPUProfile, pprof.StopCPUProfile)
}

// bcRecordTo starts a recording (a CPU profile, an execution trace) into
// path, unless path is empty, and returns the function that stops it and
// closes the file.
func bcRecordTo(t *testing.T, path string, start func(io.Writer) error, end func()) (stop func()) {
	if path == "" {
		return func() {}
	}
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := start(out); err != nil {
		t.Fatal(err)
	}
	return func() {
		end()
		out.Close()
	}
}

func bcDirBytes(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		fi, err := d.Info()
		if err == nil {
			n += fi.Size()
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// bcCopyFile copies src to dst through user space (1 MiB reads and
// writes, like cp without copy offload) and syncs dst.
func bcCopyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for {
		n, rerr := in.Read(buf)
		if n > 0 {
			if _, err := out.Write(buf[:n]); err != nil {
				out.Close()
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			out.Close()
			return rerr
		}
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// TestBenchClusterSnapshot: Node.SaveSnapshot of N blocks into a file
// (synced), FSM.Restore of that file into a fresh FSM (checked, swapped in,
// the index rebuilt), and InspectSnapshot (the checksum pass alone),
// against a plain copy of the same file through user space (synced).
// Then the offline save (SaveDataDir, kvctl snapshot save --data-dir, the
// way out of a lost majority) of the node's data directory, stopped
// cleanly after the online save as an operator stops a survivor, against
// the same copy; its file must hold what the online save's holds.
// KVROUTER_BENCH_PROFILE=file writes a CPU profile of the restore alone
// (KVROUTER_BENCH_TRACE=file an execution trace of it),
// KVROUTER_BENCH_SAVE_PROFILE=file one of the save alone,
// KVROUTER_BENCH_OFFLINE_PROFILE=file one of the offline save alone.
func TestBenchClusterSnapshot(t *testing.T) {
	benchenv.Skip(t, "bench-cluster")
	seed := benchenv.Seed(t, 20261203)
	c, held := bcBuildState(t, seed, int64(benchenv.Int("KVROUTER_BENCH_BLOCKS", bcDefaultBlocks)))
	digest := c.nodes[0].fsm.Digest()
	dir := t.TempDir()
	path := filepath.Join(dir, "state.snap")

	stopSave := bcProfileTo(t, os.Getenv("KVROUTER_BENCH_SAVE_PROFILE"))
	start := time.Now()
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	info, err := c.nodes[0].SaveSnapshot(sctx, out)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	save := time.Since(start)
	stopSave()
	c.stop(0) // free its memory before the restore builds a second index

	start = time.Now()
	if err := bcCopyFile(path, filepath.Join(dir, "copy.snap")); err != nil {
		t.Fatal(err)
	}
	copyT := time.Since(start)

	start = time.Now()
	in, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := InspectSnapshot(in); err != nil {
		t.Fatal(err)
	}
	in.Close()
	inspect := time.Since(start)

	// Two restores of the file into a fresh FSM each. The first takes
	// fresh memory: the cluster's heap (garbage since its stop) is
	// collected and returned to the system first, as a process that
	// restores beside an index of the size it holds, or a new node, must
	// fault its memory in. The second takes the memory the first one
	// left: its state is closed and collected, not returned, as in a
	// process with room in its heap. Which one a restore got moved the
	// single figure of earlier lines between 32 and 141 MB/s (the
	// collector is held during a restore, so nothing freed while it runs
	// is reused).
	runtime.GC()
	debug.FreeOSMemory()
	restore, restoreSys, restoreFaults := bcRestore(t, path, filepath.Join(dir, "fsm"), held, digest, true)
	runtime.GC()
	restoreWarm, _, _ := bcRestore(t, path, filepath.Join(dir, "fsm-warm"), held, digest, false)

	// The restored states are garbage from here: their memory goes back
	// to the system before the offline save (bcOfflineSave), so that the
	// save's peak RSS growth is its own and not hidden in a heap already
	// grown.
	off := bcOfflineSave(t, c.dirs[0], dir, info)

	mb := float64(info.Bytes) / 1e6
	t.Logf("snapshot %.1f MB, records %v; offline save of the %.1f MB data directory: %+v", mb, info.Records, float64(off.dirBytes)/1e6, off.report)
	fmt.Printf("BENCH cluster.snapshot blocks=%d mb=%.1f save_mb_per_s=%.1f restore_mb_per_s=%.1f copy_mb_per_s=%.1f save_ratio=%.3f restore_ratio=%.3f inspect_mb_per_s=%.1f save_seconds=%.2f restore_seconds=%.2f restore_sys_share=%s restore_faults=%s restore_warm_mb_per_s=%.1f restore_warm_seconds=%.2f offline_save_seconds=%.2f offline_save_mb_per_s=%.1f offline_save_ratio=%.3f offline_dir_mb=%.1f offline_rss_growth_mb=%s seed=%d\n",
		held, mb, mb/save.Seconds(), mb/restore.Seconds(), mb/copyT.Seconds(), copyT.Seconds()/save.Seconds(), copyT.Seconds()/restore.Seconds(),
		mb/inspect.Seconds(), save.Seconds(), restore.Seconds(), restoreSys, restoreFaults, mb/restoreWarm.Seconds(), restoreWarm.Seconds(),
		off.took.Seconds(), mb/off.took.Seconds(), copyT.Seconds()/off.took.Seconds(), float64(off.dirBytes)/1e6, off.rssGrowth, seed)
}

// bcRestore restores the snapshot file at path into a fresh FSM in dir,
// timed from the file's opening to the end of FSM.Restore, checks that it
// holds held entries with the given digest, and closes it. With profile,
// KVROUTER_BENCH_PROFILE and KVROUTER_BENCH_TRACE record it. sysShare is
// the part of the process's CPU time during the restore spent in the
// kernel (page faults and the zeroing of fresh pages, file I/O), and
// faults its minor page faults; both "na" where Linux's /proc does not
// give them.
func bcRestore(t *testing.T, path, dir string, held int64, digest uint64, profile bool) (took time.Duration, sysShare, faults string) {
	t.Helper()
	f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	stopProfile := func() {}
	if profile {
		stopProfile = bcProfile(t)
	}
	user0, sys0, flt0, cpuErr := bcCPUSeconds()
	start := time.Now()
	in, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if err := f.Restore(in); err != nil {
		t.Fatal(err)
	}
	took = time.Since(start)
	user1, sys1, flt1, cpuErr1 := bcCPUSeconds()
	stopProfile()
	sysShare, faults = "na", "na"
	if cpuErr == nil && cpuErr1 == nil && user1+sys1 > user0+sys0 {
		sysShare = fmt.Sprintf("%.2f", (sys1-sys0)/(user1+sys1-user0-sys0))
		faults = strconv.FormatUint(flt1-flt0, 10)
	}
	if f.Index().Stats().Entries != held || f.Digest() != digest {
		t.Fatalf("restored %d entries digest %#x, want %d %#x", f.Index().Stats().Entries, f.Digest(), held, digest)
	}
	return took, sysShare, faults
}

// bcCPUSeconds returns the process's user and system CPU time from
// /proc/self/stat (utime and stime, in clock ticks of 1/100 s: Linux's
// USER_HZ), and its minor page faults so far (minflt: a first touch of
// fresh memory, 4 KiB or 2 MiB).
func bcCPUSeconds() (user, sys float64, minflt uint64, err error) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0, 0, 0, err
	}
	// The command name (field 2) may hold spaces: count from after it.
	_, rest, ok := strings.Cut(string(b), ") ")
	if !ok {
		return 0, 0, 0, fmt.Errorf("/proc/self/stat: no command name")
	}
	f := strings.Fields(rest) // f[0] is field 3 (state): minflt is field 10, utime 14, stime 15
	if len(f) < 13 {
		return 0, 0, 0, fmt.Errorf("/proc/self/stat: %d fields", len(f)+2)
	}
	var v [3]uint64
	for i, k := range []int{11, 12, 7} {
		if v[i], err = strconv.ParseUint(f[k], 10, 64); err != nil {
			return 0, 0, 0, fmt.Errorf("/proc/self/stat field %d: %w", k+3, err)
		}
	}
	return float64(v[0]) / 100, float64(v[1]) / 100, v[2], nil
}

// bcOfflineRun is what bcOfflineSave measured.
type bcOfflineRun struct {
	took      time.Duration // SaveDataDir into a synced file
	dirBytes  int64         // the data directory saved
	rssGrowth string        // peak RSS during the save less RSS before it, in MB; "na" where unread
	report    SaveReport
}

// bcOfflineSave times SaveDataDir of dataDir, a cleanly stopped node's
// directory (what an operator saves of a survivor), into a synced file in
// dir, its working copy beside it as kvctl makes it, and checks that the
// file holds the online save's stream byte for byte (index, term,
// counts, size, checksum): a wrong figure fast is worthless.
func bcOfflineSave(t *testing.T, dataDir, dir string, online SnapshotInfo) bcOfflineRun {
	t.Helper()
	r := bcOfflineRun{dirBytes: bcDirBytes(t, dataDir), rssGrowth: "na"}
	path := filepath.Join(dir, "offline.snap")
	// The peak RSS (VmHWM) is reset to the current RSS (clear_refs 5,
	// Linux), so that the peak read after the save is the save's.
	debug.FreeOSMemory()
	rssBefore, rssErr := bcProcStatusKB("VmRSS")
	if rssErr == nil {
		rssErr = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
	}
	stopProfile := bcProfileTo(t, os.Getenv("KVROUTER_BENCH_OFFLINE_PROFILE"))
	start := time.Now()
	out, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	r.report, err = SaveDataDir(ctx, dataDir, out, SaveOptions{TempDir: dir, Logger: quiet})
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
	r.took = time.Since(start)
	stopProfile()
	if rssErr == nil {
		if peak, err := bcProcStatusKB("VmHWM"); err == nil {
			r.rssGrowth = fmt.Sprintf("%.1f", float64(peak-rssBefore)/1024)
		}
	} else {
		t.Logf("peak RSS not measured: %v", rssErr)
	}

	in, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	got, err := InspectSnapshot(in)
	in.Close()
	if err != nil {
		t.Fatalf("the offline save's file: %v", err)
	}
	if got.Index != online.Index || got.Term != online.Term || got.Bytes != online.Bytes || got.SHA256 != online.SHA256 || !maps.Equal(got.Records, online.Records) {
		t.Fatalf("the offline save's file holds %+v; want the online save's %+v", got, online)
	}
	return r
}

// bcProcStatusKB returns a "kB" field of /proc/self/status (VmRSS, VmHWM).
func bcProcStatusKB(field string) (int64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		if !ok || name != field {
			continue
		}
		var kb int64
		if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb); err != nil {
			return 0, fmt.Errorf("%s: %q: %w", field, rest, err)
		}
		return kb, nil
	}
	return 0, fmt.Errorf("no %s in /proc/self/status", field)
}
