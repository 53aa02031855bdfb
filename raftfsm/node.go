package raftfsm

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a Node. Timeouts default to LAN values that give
// failover well under a second on loopback.
type Config struct {
	// ID is this node's Raft server id. A data directory records it at its
	// first start, and refuses another once it holds Raft state
	// (ErrWrongNode).
	ID string
	// RaftAddr is where this node's Raft transport listens (host:port), as
	// peers dial it. A node that its cluster's configuration lists at
	// another address is refused a start (ErrRaftAddrChanged), but for a
	// member moved here that has not yet replayed its addition
	// (checkRaftAddr).
	RaftAddr string
	HTTPAddr string // where this node's HTTP API listens, as peers should dial it
	DataDir  string // raft/, fsm/ and snapshots/ live here

	// DataDirLock, when set, is DataDir's lock (LockDataDir), which the
	// node takes over (its Close releases it) instead of locking DataDir.
	DataDirLock *DataDirLock

	// Peers, when set, bootstraps a new cluster of these voters (this node
	// among them) if the data directory holds no Raft state yet. Leave it
	// empty to join an existing cluster (an operator or kvrouter --join
	// asks the leader to add this node). A directory whose latest
	// configuration is this node alone starts with no peers only if this
	// node joined that cluster rather than bootstrapping it alone
	// (checkJoinAlone); such a node asks no cluster to add it
	// (OnlyMember).
	Peers []Member
	// DefaultPeers marks Peers as the caller's default rather than peers
	// an operator gave (kvrouter's single-node cluster when neither
	// --peers nor --join is given). They bootstrap an empty data
	// directory as any Peers do; a directory with Raft state, or a seeded
	// one, keeps its own configuration without a word: comparing them
	// (checkSeedPeers, warnIgnoredPeers) would refuse or warn of --peers
	// the operator never gave, at every restart of a member of a larger
	// cluster started without --peers.
	DefaultPeers bool

	HeartbeatTimeout   time.Duration // default 200ms
	ElectionTimeout    time.Duration // default 200ms
	LeaderLeaseTimeout time.Duration // default: the heartbeat timeout
	CommitTimeout      time.Duration // default 5ms
	ApplyTimeout       time.Duration // default 5s, when the context has no deadline
	SnapshotThreshold  uint64        // entries between snapshots, default 8192
	SnapshotInterval   time.Duration // how often to check, default 30s
	TrailingLogs       uint64        // entries kept after a snapshot, default 10240
	// MemberAddTimeout bounds AddMember, whatever its context (default
	// 30 s, a forward's deadline: the same add through a follower ends
	// there). An add holds the membership lock while it waits for the
	// new node, and one asked of the leader with no deadline (curl
	// without --max-time: the API passes the request's context) of a
	// node that never answers held it for ever: every other add,
	// removal and restore queued behind it.
	MemberAddTimeout time.Duration
	// SnapshotBytes also takes a snapshot once the entries applied since
	// the last one hold this many bytes (default 256 MiB; negative: never).
	// Entry counts alone let the log grow without bound when entries are
	// large (an events entry carries up to a few hundred KB), and every
	// start reads the whole log after the last snapshot (Raft looks for
	// configuration entries in it, and replays it).
	SnapshotBytes int64

	ExpiryInterval time.Duration // leader's booking/orphan sweep, default 10s
	// CheckInterval is how often the leader proposes a replica digest
	// check (check.go), default 30s.
	CheckInterval time.Duration
	// BookingMaxAge is how old a booking never freed may grow before the
	// expiry sweep frees it, and how long a freed id stays used (default
	// indexer.DefaultBookingMaxAge). Only the leader's counts: each sweep
	// it proposes carries its value, which every replica applies.
	BookingMaxAge time.Duration
	// SilentAfter is how long a registered rank may send nothing before
	// Workers reports it silent (default 60s).
	SilentAfter time.Duration
	// MaxRanks bounds the dp ranks of all registered workers together
	// (default DefaultMaxRanks): each is a route candidate, scored by
	// every route, listed by GET /v1/workers and held in every replica's
	// memory, so that 200 workers of 4096 ranks each took a router from
	// 46 MB to 1 GB and a route to 17.7 s. Only the leader's counts: it
	// refuses a registration past it (ErrTooManyRanks) before proposing.
	MaxRanks int
	// ClusterName, when set, names the cluster at its bootstrap, or at
	// the first start of a seeded directory: its id (greeting.go) is
	// derived from the name instead of the peers. Give every node the
	// same; nodes that reach each other at other addresses than their
	// peers' own (a proxy per link) need it, as their --peers differ. A
	// directory with an id keeps it.
	ClusterName string

	Index  indexer.Config
	Logger *slog.Logger
	// Transport replaces the TCP transport (in-process tests).
	Transport raft.Transport

	// applyGate, for tests: when set, every FSM.ApplyBatch first takes a
	// value from it (a closed channel lets every apply through).
	applyGate chan struct{}
	// readyLogRead, for tests: called for every log entry that a
	// readiness check reads.
	readyLogRead func()
	// beforeRestore, for tests: RestoreSnapshot calls it just before it
	// hands the stream to Raft.
	beforeRestore func()
	// diskFree, for tests: the free bytes of a directory's file system,
	// in place of diskFree.
	diskFree func(dir string) (uint64, error)
	// beforeLogWrite, for tests: Raft's writes of entries to this node's
	// log store call it first, with the entries; it may hold the write
	// (on a leader, Raft's main goroutine with it).
	beforeLogWrite func([]*raft.Log)
	// beforeForcedCompaction, for tests: compactForFollower calls it
	// before it compacts the log (it may hold the compaction).
	beforeForcedCompaction func()
	// beforeBarrier, for tests: onLeadership calls it before it asks for
	// the term's Barrier (it may hold the set-up, leaderLoop with it).
	beforeBarrier func()
	// keepHaltedLeadership, for tests: a leader whose state machine is
	// halted keeps its leadership (handOffIfHalted does nothing), so that
	// a test can see what it answers meanwhile.
	keepHaltedLeadership bool
}

func (c *Config) defaults() {
	d := func(v *time.Duration, def time.Duration) {
		if *v <= 0 {
			*v = def
		}
	}
	d(&c.HeartbeatTimeout, 200*time.Millisecond)
	d(&c.SilentAfter, time.Minute)
	d(&c.ElectionTimeout, 200*time.Millisecond)
	// A lease as long as the heartbeat: a shorter one made leaders step
	// down under sustained ingest on a busy 2-core machine.
	d(&c.LeaderLeaseTimeout, c.HeartbeatTimeout)
	d(&c.CommitTimeout, 5*time.Millisecond)
	d(&c.ApplyTimeout, 5*time.Second)
	d(&c.MemberAddTimeout, 30*time.Second)
	d(&c.SnapshotInterval, 30*time.Second)
	d(&c.ExpiryInterval, 10*time.Second)
	d(&c.CheckInterval, 30*time.Second)
	d(&c.BookingMaxAge, indexer.DefaultBookingMaxAge)
	if c.MaxRanks <= 0 {
		c.MaxRanks = DefaultMaxRanks
	}
	if c.SnapshotThreshold == 0 {
		c.SnapshotThreshold = 8192
	}
	if c.TrailingLogs == 0 {
		c.TrailingLogs = 10240
	}
	if c.SnapshotBytes == 0 {
		c.SnapshotBytes = 256 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Node is one kvrouter cluster member: a Raft server over the Pebble log
// store, the router FSM, and the operations the HTTP API serves. Reads are
// answered from the local state; writes go through Raft on the leader and
// return a *NotLeaderError on a follower (the API forwards them).
type Node struct {
	cfg     Config
	logger  *slog.Logger
	raft    *raft.Raft
	fsm     *FSM
	logs    *store.LogStore
	dirLock *os.File // the data directory's lock (lockDataDir)
	snaps   raft.SnapshotStore
	trans   raft.Transport
	stream  *streamLayer // trans's, when a TCP transport (nil: an in-memory one): its greetings, its inbound counts (Collector)
	watch   *commitWatch // Raft's view of trans (checkReady)

	logStalls store.WriteStalls // the log store's write stalls
	// lookupSeconds times the index lookups of routes and FindMatches.
	lookupSeconds prometheus.Histogram

	ready atomic.Bool
	// unapplied is an index the readiness checks found to hold a
	// committed entry the FSM applies (0: none yet): while the FSM has not
	// applied it, the node is not ready, and polling need not read the
	// log again (fsmHasApplied).
	unapplied atomic.Uint64
	// wasMember is set once a latest configuration of this node named it
	// (Status, noteMembership); memberRecorded once the stable store holds
	// that (wasMemberKey), so that it survives a restart. Only a node that
	// has been a member reports itself removed.
	wasMember      atomic.Bool
	memberRecorded bool // noteMembership only
	// joinAddr is the Raft address this directory joined its cluster at
	// (joinAddrKey) while the node has not yet caught up with its
	// addition there, "" otherwise: startRaft and noteJoined only.
	joinAddr string
	// bootHeld is set while this directory, bootstrapped from --peers on
	// no Raft state, has not yet caught up (bootHoldKey): startRaft and
	// noteBootCaughtUp only.
	bootHeld bool
	// clusterID is the cluster's id (greeting.go; zero: none), as
	// recorded (clusterIDKey) or taken from a greeter since.
	clusterID atomic.Pointer[ClusterID]
	// snapshotting is set while a snapshot by applied bytes runs.
	snapshotting atomic.Bool
	lastAssert   time.Time // leaderLoop only
	lastHandOff  time.Time // leaderLoop only: handOffIfHalted's last transfer
	// transfers counts the leadership transfers this node started that
	// Raft has not answered yet (leadershipTransfer): no send to a
	// follower is held meanwhile (keepSending).
	transfers atomic.Int64
	// lastTransfer is when the last of them started (UnixNano): for
	// transferGrace after it no send is held either (keepSending).
	lastTransfer atomic.Int64
	// compacting is set while a compaction for a follower runs
	// (compactForFollower); compactedAt is when the last one began
	// (leaderLoop only), forcedCompactions counts those that compacted.
	compacting        atomic.Bool
	compactedAt       time.Time
	forcedCompactions atomic.Uint64
	// selfRefusedTerm is the last term whose leader (this node) logged
	// that it does not list itself at its HTTP address (selfUnlisted):
	// leaderLoop only.
	selfRefusedTerm uint64
	// pendingTerm is the last term whose leadership set-up began
	// (onLeadership): the pending bookings are that term's, or none.
	// leaderLoop only.
	pendingTerm uint64
	// ledTerm is the term whose leadership set-up (onLeadership) finished
	// on this node: the barrier passed and the member entries went out.
	ledTerm atomic.Uint64
	started time.Time // when NewNode ran: silence is counted from here
	// For the metrics: leaders this node has seen take over
	// (countLeaders), and the seconds from NewNode to ready.
	leaderChanges atomic.Uint64
	readySeconds  atomic.Uint64 // float64 bits; 0 until ready
	leaders       chan raft.Observation
	leaderObs     *raft.Observer

	// workersMu orders this node's worker-table writes (WorkersMutex).
	workersMu sync.Mutex
	// blockSizeMu is held by RegisterWorker of a worker without a model
	// from its check (checkBlockSize) until its apply returns, so that a
	// registration is judged with every earlier one through this node
	// applied: two of different block sizes sent together both passed.
	// Callers may hold workersMu, so it is a lock of its own.
	blockSizeMu sync.Mutex
	// ranksMu guards ranksPending: the dp ranks that registrations in
	// flight add to the published table's, counted against MaxRanks
	// until their entries apply (reserveRanks).
	ranksMu      sync.Mutex
	ranksPending int
	// memberOps orders this node's membership changes and restores.
	memberOps memberLock

	rngMu sync.Mutex
	rng   *rand.Rand

	closeOnce  func() error // Close
	shutMu     sync.Mutex
	shutFuture raft.Future   // Raft's shutdown, once begun (shutdownRaft)
	raftDown   chan struct{} // closed when it begins
	stop       chan struct{}
	wg         sync.WaitGroup

	// restoreMu orders a restore's hand-over to Raft (RestoreSnapshot)
	// with Close: closing is set once Close began, and no restore is handed
	// to Raft after it; restoring, while Raft holds a restore, is closed
	// when Raft's Restore returns, and Close waits for it before it shuts
	// Raft down (waitRestore).
	restoreMu sync.Mutex
	closing   bool
	restoring chan struct{}
	// closeWaitsRestore is set while Close waits for a restore (tests).
	closeWaitsRestore atomic.Bool
}

// NewNode opens the node's storage, rebuilds its state and starts Raft.
func NewNode(cfg Config) (*Node, error) {
	cfg.defaults()
	if cfg.ID == "" || cfg.DataDir == "" {
		return nil, fmt.Errorf("%w: a node needs an id and a data directory", ErrInvalid)
	}
	n := &Node{cfg: cfg, logger: cfg.Logger.With("node", cfg.ID), stop: make(chan struct{}), raftDown: make(chan struct{}), started: time.Now(),
		rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0x6b76726f75746572)),
		lookupSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_index_lookup_duration_seconds",
			Help:    "Time one index lookup (a route's, or a compatible API query's) took.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12)})} // 1µs .. 4s
	n.closeOnce = sync.OnceValue(n.close)
	n.memberOps.ch = make(chan struct{}, 1)
	if err := os.MkdirAll(cfg.DataDir, dataDirMode); err != nil {
		return nil, err
	}
	warnIfDataDirOpen(n.logger, cfg.DataDir)
	var err error
	if n.dirLock, err = lockOrTake(cfg.DataDir, cfg.DataDirLock); err != nil {
		return nil, err
	}
	// A restore's spool (RestoreSnapshot) left by a crash: nothing reads
	// it again, and it may be as large as the state.
	n.removeRestoreSpools()
	// A Raft snapshot a kill left part-written (snapshots/NAME.tmp/): Raft
	// never removes it, and it may be as large as the state. Removed
	// before the snapshot store opens, under the directory's lock.
	// A failed removal only costs the disk space: Raft ignores them.
	removed, err := removePartialSnapshots(cfg.DataDir)
	for _, p := range removed {
		n.logger.Info("removed a partial Raft snapshot a kill left", "path", p)
	}
	if err != nil {
		n.logger.Warn("removing a partial Raft snapshot a kill left failed", "err", err)
	}
	ok := false
	defer func() {
		if !ok {
			n.abortStart()
		}
	}()
	if n.fsm, err = openFSM(FSMConfig{Dir: filepath.Join(cfg.DataDir, "fsm"), Logger: n.logger, Index: cfg.Index}); err != nil {
		return nil, err
	}
	n.fsm.applyGate = cfg.applyGate
	n.fsm.holdAfterLoad = true // until ready: the log tail replays first
	// The state's rebuild, the long part of a start, runs beside opening
	// the Raft log (its WAL replayed) and starting Raft (which reads the
	// whole log tail after the last snapshot, and may win an election
	// meanwhile). Raft's calls into the FSM wait until the state is loaded
	// and caught up with the newest snapshot (FSM.release), so Raft
	// applies nothing to a state still loading.
	loaded := make(chan error, 1)
	go func() { loaded <- n.fsm.loadState() }()
	err = n.startRaft()
	if lerr := <-loaded; lerr != nil {
		err = lerr // the state's error first: Raft's may follow from it
	}
	if err == nil {
		err = n.catchUpFromSnapshot()
	}
	n.fsm.release(err)
	if err != nil {
		return nil, err
	}
	n.wg.Add(2)
	go n.leaderLoop()
	go n.countLeaders()
	ok = true
	return n, nil
}

// countLeaders counts the leaders Raft reports taking over (a leader
// observation names one each time the leader changes, the same node
// re-elected after an election too) until the node stops.
func (n *Node) countLeaders() {
	defer n.wg.Done()
	defer n.raft.DeregisterObserver(n.leaderObs)
	for {
		select {
		case <-n.stop:
			return
		case o := <-n.leaders:
			if lo, ok := o.Data.(raft.LeaderObservation); ok && lo.LeaderID != "" {
				n.leaderChanges.Add(1)
			}
		}
	}
}

// raftMaxAppendEntries is Raft's MaxAppendEntries: the most entries one
// AppendEntries carries, and the most applies a leader takes into one
// commit beyond the first.
const raftMaxAppendEntries = 256

// startRaft opens the Raft log and snapshot stores and starts Raft,
// bootstrapping a new cluster from cfg.Peers. The FSM it is given holds
// Raft's calls until it is released.
func (n *Node) startRaft() error {
	cfg := n.cfg
	var err error
	if n.logs, err = store.OpenLogStore(filepath.Join(cfg.DataDir, "raft"), store.LogStoreOptions{Logger: n.logger, Stalls: &n.logStalls}); err != nil {
		return err
	}
	snaps, err := openSnapshotStore(cfg.DataDir, n.logger)
	if err != nil {
		return fmt.Errorf("open snapshot store: %w", err)
	}
	n.snaps = snaps
	// The FSM marks its own snapshots in the store, apart from installs
	// and user restores (snapshotStore).
	n.fsm.snaps = snaps
	n.fsm.configAt = n.configEntry

	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.ID)
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	rc.SnapshotThreshold = cfg.SnapshotThreshold
	rc.SnapshotInterval = cfg.SnapshotInterval
	rc.TrailingLogs = cfg.TrailingLogs
	// No buffered apply channel (BatchApplyCh): Raft's shutdown leaves the
	// futures still in that buffer unanswered, and their writers waiting
	// for good (a crash test's client hung). Unbuffered, an apply is taken
	// by the leader, refused by a follower, or refused at shutdown; the
	// leader still gathers every apply waiting to send into one commit.
	rc.BatchApplyCh = false
	rc.MaxAppendEntries = raftMaxAppendEntries
	// The FSM rebuilds itself from its own database and catchUpFromSnapshot
	// restores it when it is behind; Raft must not restore it again.
	rc.NoSnapshotRestoreOnStart = true
	// A leader that removes itself shuts its Raft down through the node
	// (RemoveMember), not inside Raft: Close must wait for a shutdown's
	// goroutines (the FSM's among them) before it closes the storage, and
	// only the first Shutdown call's future waits for them.
	rc.ShutdownOnRemove = false
	rc.Logger = hclogAdapter(n.logger)

	n.trans = cfg.Transport
	if n.trans == nil {
		addr, err := net.ResolveTCPAddr("tcp", cfg.RaftAddr)
		if err != nil {
			return fmt.Errorf("raft address %q: %w", cfg.RaftAddr, err)
		}
		t, stream, err := newTransport(cfg.RaftAddr, addr, 10*time.Second, n.logger)
		if err != nil {
			return fmt.Errorf("raft transport on %s: %w", cfg.RaftAddr, err)
		}
		n.trans, n.stream = t, stream
	} else if s, ok := layers.Load(n.trans.LocalAddr()); ok {
		n.stream = s.(*streamLayer)
	}
	if err := n.refuseStateWithoutItsLog(); err != nil {
		return err
	}
	// A new node of a new cluster writes the first configuration into its
	// stores before Raft starts. Bootstrapping through the running Raft
	// instead left a window in which a leader's snapshot could reach Raft
	// first: Raft's main goroutine then waited for the FSM's restore, which
	// waits for the start to finish, which waited for the bootstrap.
	has, err := raft.HasExistingState(n.logs, n.logs, n.snaps)
	if err != nil {
		return err
	}
	// Raft state of another node is refused before Raft starts: started
	// as another id, the node would be a second member under that id.
	recorded, err := n.recordedNodeID()
	if err != nil {
		return err
	}
	if has && recorded != "" && recorded != cfg.ID {
		return refuseStart(ErrWrongNode, "data directory %s belongs to node %s; started with --node-id %s: give --node-id %s, or start on an empty directory",
			cfg.DataDir, recorded, cfg.ID, recorded)
	}
	seeded, err := n.seededConfiguration()
	if err != nil {
		return err
	}
	if seeded != nil && len(cfg.Peers) > 0 && !cfg.DefaultPeers {
		if err := n.checkSeedPeers(seeded.Configuration.Servers, cfg.Peers); err != nil {
			return err
		}
	}
	var servers []raft.Server
	for _, p := range cfg.Peers {
		servers = append(servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
	}
	// How the directory got its Raft state, recorded at its first start
	// (a seeded one's too), before anything else is written.
	// And its cluster's id (greeting.go), derived from its first
	// configuration where this start gives one.
	switch {
	case !has && len(servers) > 0:
		if err = n.recordOrigin(n.originOf(servers)); err == nil {
			err = n.recordDerivedClusterID(n.newClusterID(servers))
		}
	case !has:
		if err = n.recordOrigin(originJoin); err == nil {
			err = n.setJoinAddr(n.raftAddr())
		}
	case seeded != nil:
		if err = n.recordOrigin(n.originOf(seeded.Configuration.Servers)); err == nil {
			err = n.recordSeedClusterID(seeded.Configuration.Servers)
		}
	}
	if err != nil {
		return err
	}
	if n.joinAddr, err = n.recordedJoinAddr(); err != nil {
		return err
	}
	if !has && len(servers) > 0 {
		// Recorded before the bootstrap: a start cut off after it, with
		// Raft state, still holds its votes.
		if err := n.setBootHeld(true); err != nil {
			return err
		}
		err := raft.BootstrapCluster(rc, n.logs, n.logs, n.snaps, n.trans, raft.Configuration{Servers: servers})
		if err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
			return fmt.Errorf("bootstrap: %w", err)
		}
	}
	if err := n.dropDetachedLog(); err != nil {
		return err
	}
	var watched raft.Transport
	watched, n.watch = watchCommits(n.trans, n.cfg.ID, n.logger)
	// A directory started empty to join votes only once caught up
	// (commitWatch.votesHeld): it may be a wiped voter's, whose log lost
	// what the voter acknowledged. Until noteJoined, so across a restart
	// before the node was ready, when its log may still lack it.
	// So does a directory bootstrapped from --peers (bootHoldKey): it may
	// be a wiped voter's too, started again with its usual command line.
	// It votes meanwhile only for a candidate whose log holds nothing
	// past the bootstrap, a fresh cluster's first election.
	if n.bootHeld, err = n.recordedBootHeld(); err != nil {
		return err
	}
	if n.bootHeld && n.joinAddr == "" {
		n.watch.bootIndex.Store(bootstrapIndex)
	}
	n.watch.votesHeld.Store(n.joinAddr != "" || n.bootHeld)
	if err := n.greetAsRecorded(); err != nil {
		return err
	}
	var logs raft.LogStore = n.logs
	if cfg.beforeLogWrite != nil {
		logs = hookedLogs{LogStore: n.logs, before: cfg.beforeLogWrite}
	}
	if n.raft, err = raft.NewRaft(rc, n.fsm, logs, n.logs, n.snaps, watched); err != nil {
		return fmt.Errorf("start raft: %w", err)
	}
	// Raft has read its configuration: a directory of an older build,
	// which recorded no id, is checked against it; then the id is
	// recorded. A directory without Raft state holds no member's state
	// yet (a join that never got in): it takes the id it is given.
	if has && recorded == "" {
		if err := n.checkUnrecordedID(); err != nil {
			return err
		}
	}
	if err := n.checkRaftAddr(); err != nil {
		return err
	}
	if has && len(cfg.Peers) > 0 && !cfg.DefaultPeers {
		n.warnIgnoredPeers(cfg.Peers)
	}
	if recorded != cfg.ID {
		if err := n.logs.Set(nodeIDKey, []byte(cfg.ID)); err != nil {
			return fmt.Errorf("record the node id of %s: %w", cfg.DataDir, err)
		}
	}
	// Raft has read its configuration from the log and snapshots. A node
	// told to join (no peers) must not hold a cluster of its own: its
	// state would pass for the cluster's (commitWatch). The last member
	// of a cluster it joined may start so (checkJoinAlone).
	if len(n.cfg.Peers) == 0 && n.alone() {
		if err := n.checkJoinAlone(); err != nil {
			return err
		}
	}
	if err := n.loadMembership(); err != nil {
		return err
	}
	n.watch.setAlone(n.alone, n.held)
	n.watch.setKeepSending(n.keepSending, n.stop)
	// Watched from the start: the first leader may win before NewNode
	// returns; countLeaders reads what this buffers meanwhile.
	n.leaders = make(chan raft.Observation, 64)
	n.leaderObs = raft.NewObserver(n.leaders, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	n.raft.RegisterObserver(n.leaderObs)
	return nil
}

// held returns the last index this node's state holds, Raft's applied
// index or its last snapshot's, and the current term (commitWatch's
// refuseFromStart, on the rare AppendEntries with no previous entry).
func (n *Node) held() (index, term uint64) {
	snap, _ := strconv.ParseUint(n.raft.Stats()["last_snapshot_index"], 10, 64)
	return max(n.raft.AppliedIndex(), snap), n.raft.CurrentTerm()
}

// alone reports whether the node's latest configuration (committed or
// not) is this node alone (commitWatch.setAlone). It allocates a future
// and reads an atomic: cheap enough for every RPC a leader sends.
func (n *Node) alone() bool {
	s := n.raft.GetConfiguration().Configuration().Servers
	return len(s) == 1 && string(s[0].ID) == n.cfg.ID
}

// keepSending reports whether a request of term to follower id is still
// to be sent (commitWatch.holdUnanswered): the node runs, leads in term,
// id is in its latest configuration, and no leadership transfer of this
// node's is under way. It reads atomics and allocates a future, no wait
// on Raft's main loop.
func (n *Node) keepSending(id raft.ServerID, term uint64) bool {
	select {
	case <-n.stop:
		return false
	default:
	}
	if n.transfers.Load() > 0 || time.Since(time.Unix(0, n.lastTransfer.Load())) < transferGrace {
		return false
	}
	if n.raft.State() != raft.Leader || n.raft.CurrentTerm() != term {
		return false
	}
	return slices.ContainsFunc(n.raft.GetConfiguration().Configuration().Servers, func(sv raft.Server) bool { return sv.ID == id })
}

// leadershipTransfer starts Raft's leadership transfer to id at addr
// (id "": to Raft's pick) and returns its future, counted in n.transfers
// until Raft answers it. hashicorp/raft v1.8.0 hands the target's
// replication goroutine the transfer's request through a channel of one
// and, for a second transfer while the first's request is unread, blocks
// on that send out of reach of its timeout; the leader refuses every
// write until that transfer ends (leadershipTransferInProgress). A
// goroutine held for a follower that does not answer reads nothing, so
// no send is held while a transfer runs: the hold ends within holdPoll
// (TestTwoTransfersToAHeldFollowerLeaveTheLeaderTakingWrites).
func (n *Node) leadershipTransfer(id raft.ServerID, addr raft.ServerAddress) raft.Future {
	n.transfers.Add(1)
	n.lastTransfer.Store(time.Now().UnixNano())
	if n.watch != nil {
		n.watch.transferStarting()
	}
	var f raft.Future
	if id == "" {
		f = n.raft.LeadershipTransfer()
	} else {
		f = n.raft.LeadershipTransferToServer(id, addr)
	}
	t := &transferFuture{done: make(chan struct{})}
	// Raft answers every transfer (a node that no longer leads drains
	// them: runFollower), as await's goroutines rely on too.
	go func() {
		t.err = f.Error()
		n.transfers.Add(-1)
		close(t.done)
	}()
	return t
}

// transferGrace is how long after a leadership transfer's start no send
// is held (keepSending). Raft answers a transfer at its timeout while the
// request it handed the replication goroutine may still wait in its
// channel of one; a goroutine released by the transfer (kicked) may take
// another case of its loop first and be held again, the request unread,
// and the next transfer's send blocks on it, writes refused: CI caught
// TestTransfersToAFollowerThatDropsSYNsLeaveTheLeaderTakingWrites so.
// Unheld for a while, the goroutine reads the channel within a few turns
// of its loop; Raft's own backoff applies meanwhile.
const transferGrace = 30 * time.Second

// transferFuture is a leadership transfer's future, answered once Raft
// answered it and n.transfers no longer counts it. Its Error may be
// called by several goroutines, unlike Raft's.
type transferFuture struct {
	done chan struct{}
	err  error
}

func (t *transferFuture) Error() error {
	<-t.done
	return t.err
}

// OnlyMember reports whether this node's latest Raft configuration is
// this node alone: the node holds a cluster of its own (it bootstrapped
// it alone, or it is the last member of a cluster it joined or
// bootstrapped with others), whose only copy of the state is its data
// directory. Such a node must not ask another cluster to add it: that
// cluster would gain a voter that never votes, as this node follows no
// other cluster's leader (commitWatch). kvrouter ignores its --join.
func (n *Node) OnlyMember() bool { return n.alone() }

// namesSelf reports whether the configuration has this node among its
// servers.
func (n *Node) namesSelf(servers []raft.Server) bool {
	return slices.ContainsFunc(servers, func(sv raft.Server) bool { return string(sv.ID) == n.cfg.ID })
}

// loadMembership reads at start whether this node has been a member
// (wasMemberKey), and records it if its latest configuration names it.
func (n *Node) loadMembership() error {
	v, err := n.logs.GetUint64(wasMemberKey)
	if err != nil {
		return fmt.Errorf("read whether this node has been a member: %w", err)
	}
	if v != 0 {
		n.wasMember.Store(true)
		n.memberRecorded = true
	}
	n.noteMembership()
	return nil
}

// noteMembership records, once, that this node has been a member, when
// its latest configuration names it or Status saw one that did. Only a
// node that has been a member reports itself removed (Status): a node
// joining replays the leader's log, whose older configurations do not
// name it yet. Run at start and by leaderLoop, never at once.
func (n *Node) noteMembership() {
	if n.memberRecorded {
		return
	}
	if !n.wasMember.Load() {
		cf := n.raft.GetConfiguration()
		if cf.Error() != nil || !n.namesSelf(cf.Configuration().Servers) {
			return
		}
		n.wasMember.Store(true)
	}
	if err := n.logs.SetUint64(wasMemberKey, 1); err != nil {
		n.logger.Warn("recording that this node is a member failed; retrying", "err", err)
		return
	}
	n.memberRecorded = true
}

// removed reports whether this node has been removed from its cluster
// (Status.Removed): once a member, and while its latest configuration
// leaves it out and no leader replicates to it. A node joining, or added
// back on an empty directory, replays configurations from before it was
// added (noteMembership, unreplicated).
func (n *Node) removed() bool {
	cf := n.raft.GetConfiguration()
	if cf.Error() != nil {
		return false
	}
	servers := cf.Configuration().Servers
	if n.namesSelf(servers) {
		n.wasMember.Store(true) // recorded by leaderLoop
	}
	return n.wasMember.Load() && len(servers) > 0 && !n.namesSelf(servers) && n.unreplicated()
}

// unreplicated reports whether no leader replicates to this node: its
// Raft is shut down (a leader that removed itself), or it knows no leader
// and has heard from none for removedAfter (counted from its start when
// it has heard from none since).
// A leader replicates only to the servers of its own latest
// configuration, and a node it catches up hears from it at least every
// heartbeat, so a node whose own latest configuration leaves it out while
// a leader replicates to it only lacks the entry that adds it. Read after
// the configuration: a leader's AppendEntries names its sender before the
// entries it carries change the configuration.
func (n *Node) unreplicated() bool {
	if n.raftShutDown() {
		return true
	}
	if _, id := n.raft.LeaderWithID(); id != "" {
		return false
	}
	lc := n.raft.LastContact()
	if lc.IsZero() {
		// None yet since the start: a node just started (a member added
		// back and restarted while it replays its removal) has had no
		// time to hear from a leader.
		lc = n.started
	}
	return time.Since(lc) > n.removedAfter()
}

// removedAfter is how long a node left out of its latest configuration
// goes without a leader's contact before it reports itself removed
// (Status): two election timeouts, and at least two heartbeat timeouts
// (a follower forgets its leader after one to two without contact).
func (n *Node) removedAfter() time.Duration {
	return 2 * max(n.cfg.ElectionTimeout, n.cfg.HeartbeatTimeout)
}

// abortStart undoes a NewNode that failed: Raft stops (the FSM was
// released with the error, so nothing waits on it), the transport and
// the storage close.
func (n *Node) abortStart() {
	if n.fsm != nil {
		n.fsm.release(ErrShutdown)
	}
	if n.raft != nil {
		_ = n.shutdownRaft().Error()
	}
	if n.watch != nil {
		n.watch.close()
	}
	if c, ok := n.trans.(io.Closer); ok {
		c.Close()
	}
	n.closeStorage()
}

// Keys of the stable store (beside Raft's own) that the node keeps.
var (
	// originKey holds how the data directory got its Raft state
	// (originAlone, originPeers, originJoin), written at its first start.
	// Directories first started by older builds have none.
	originKey = []byte("kvrouter_origin")
	// wasMemberKey holds 1 once a latest configuration of this node named
	// it (loadMembership, noteMembership).
	wasMemberKey = []byte("kvrouter_was_member")
	// nodeIDKey holds the id of the node whose Raft state the directory
	// holds, written at its first start (startRaft): a start with Raft
	// state under another id is refused (ErrWrongNode). Directories first
	// started by older builds have none until a start records it.
	nodeIDKey = []byte("kvrouter_node_id")
	// joinAddrKey holds the Raft address a directory started to join
	// (with no peers, on no Raft state) joined at, until the node has
	// caught up with its addition there (noteJoined): empty then, and in
	// every other directory. checkRaftAddr lets it start at that address
	// meanwhile.
	joinAddrKey = []byte("kvrouter_join_addr")
	// bootHoldKey holds 1 from the start that bootstraps a directory from
	// --peers (on no Raft state) until the node is ready (noteBootCaughtUp):
	// empty then, and in every other directory. Its votes are held
	// meanwhile (commitWatch.bootIndex).
	bootHoldKey = []byte("kvrouter_bootstrap_votes_held")
	// clusterIDKey holds the cluster's id (greeting.go), 16 bytes,
	// written at the directory's first start where it is derived, or when
	// the node takes a greeter's. A directory of a build before it has
	// none, and greets as a node of no cluster.
	clusterIDKey = []byte("kvrouter_cluster_id")
	// clusterIDProvisionalKey holds 1 from the first start that derives
	// the directory's id until a connection confirms it, or the node,
	// caught up, is its cluster's only member (greeting.go): empty then.
	clusterIDProvisionalKey = []byte("kvrouter_cluster_id_provisional")
)

// recordedClusterID returns the directory's cluster id (clusterIDKey),
// zero when it has none.
func (n *Node) recordedClusterID() (ClusterID, error) {
	var id ClusterID
	v, err := n.logs.Get(clusterIDKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return id, fmt.Errorf("read the cluster id of %s: %w", n.cfg.DataDir, err)
	}
	if len(v) != 0 && len(v) != len(id) {
		return id, fmt.Errorf("read the cluster id of %s: %d bytes, want %d", n.cfg.DataDir, len(v), len(id))
	}
	copy(id[:], v)
	return id, nil
}

// recordClusterID records id as the directory's cluster id.
func (n *Node) recordClusterID(id ClusterID) error {
	if err := n.logs.Set(clusterIDKey, id[:]); err != nil {
		return fmt.Errorf("record the cluster id of %s: %w", n.cfg.DataDir, err)
	}
	n.clusterID.Store(&id)
	return nil
}

// recordSeedClusterID records the id derived from a seed's configuration
// as the directory's cluster id, unless it has one: a seeded directory
// starts seeded until its log has an entry.
func (n *Node) recordSeedClusterID(servers []raft.Server) error {
	id, err := n.recordedClusterID()
	if err != nil || !id.IsZero() {
		return err
	}
	return n.recordDerivedClusterID(n.newClusterID(servers))
}

// recordDerivedClusterID records id, derived at the directory's first
// start, as its cluster id, provisional until confirmed.
func (n *Node) recordDerivedClusterID(id ClusterID) error {
	if err := n.logs.Set(clusterIDProvisionalKey, []byte{1}); err != nil {
		return fmt.Errorf("record the cluster id of %s: %w", n.cfg.DataDir, err)
	}
	return n.recordClusterID(id)
}

// setClusterIDProvisional records whether the directory's id waits for
// a connection to confirm it (clusterIDProvisionalKey).
func (n *Node) setClusterIDProvisional(provisional bool) error {
	var v []byte
	if provisional {
		v = []byte{1}
	}
	return n.logs.Set(clusterIDProvisionalKey, v)
}

// newClusterID returns the id of a new cluster whose first configuration
// is servers: derived from Config.ClusterName when set, else from servers.
func (n *Node) newClusterID(servers []raft.Server) ClusterID {
	if n.cfg.ClusterName != "" {
		return namedClusterID(n.cfg.ClusterName)
	}
	return deriveClusterID(servers)
}

// greetAsRecorded gives the stream layer, where Raft has one, the
// identity the directory records (greeting.go): provisional while the
// directory has not caught up since its bootstrap from --peers or since
// it started to join. Before Raft starts: the layer holds dials and
// greetings until then.
func (n *Node) greetAsRecorded() error {
	id, err := n.recordedClusterID()
	if err != nil {
		return err
	}
	n.clusterID.Store(&id)
	if n.stream == nil {
		return nil
	}
	v, err := n.logs.Get(clusterIDProvisionalKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return fmt.Errorf("read whether the cluster id of %s is confirmed: %w", n.cfg.DataDir, err)
	}
	n.stream.setIdentity(&identity{
		id: id, self: n.cfg.ID, addr: n.raftAddr(),
		provisional: len(v) > 0 && !id.IsZero() || n.joinAddr != "", joiner: n.joinAddr != "",
		listed: n.listedPeer, adopted: n.takeClusterID, confirmed: n.clusterIDConfirmed,
	})
	return nil
}

// clusterIDConfirmed records that a connection confirmed the directory's
// provisional cluster id (streamLayer.confirm).
func (n *Node) clusterIDConfirmed() {
	if err := n.setClusterIDProvisional(false); err != nil {
		n.logger.Warn("recording that the cluster id is confirmed failed; the next start waits for a connection to confirm it again", "err", err)
	}
}

// confirmClusterIDAlone confirms a provisional cluster id once the node,
// caught up, is its cluster's only member, which no member greets
// (streamLayer.confirm): a joiner takes only a settled id.
func (n *Node) confirmClusterIDAlone() {
	if n.stream == nil || !n.ready.Load() {
		return
	}
	if me := n.stream.ident.Load(); me == nil || !me.provisional || me.joiner {
		return
	}
	if n.alone() {
		n.stream.confirm()
	}
}

// listedPeer reports whether --peers list a server id at addr.
func (n *Node) listedPeer(id, addr string) bool {
	return slices.ContainsFunc(n.cfg.Peers, func(p Member) bool { return p.ID == id && SameRaftAddr(p.RaftAddr, addr) })
}

// takeClusterID records id, taken from a greeter while the directory's
// was provisional (greeting.go).
func (n *Node) takeClusterID(id ClusterID) {
	var was ClusterID
	if old := n.clusterID.Load(); old != nil {
		was = *old
	}
	err := n.recordClusterID(id)
	if err == nil {
		err = n.setClusterIDProvisional(false)
	}
	if err != nil {
		n.logger.Warn("recording the cluster id taken from the cluster that reached this node failed; it holds for this run", "err", err)
		n.clusterID.Store(&id)
	}
	n.logger.Info("took the cluster id of the cluster that reached this node", "cluster", id.String(), "was", was.String())
}

// bootstrapIndex is the index of the entry raft.BootstrapCluster writes,
// the last of a bootstrapped log that no leader has written to.
const bootstrapIndex = 1

// recordedBootHeld reports whether the directory was bootstrapped from
// --peers and the node has not caught up since (bootHoldKey).
func (n *Node) recordedBootHeld() (bool, error) {
	v, err := n.logs.Get(bootHoldKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return false, fmt.Errorf("read whether %s holds its votes since its bootstrap: %w", n.cfg.DataDir, err)
	}
	return len(v) > 0, nil
}

// setBootHeld records whether the directory holds its votes since its
// bootstrap (bootHoldKey).
func (n *Node) setBootHeld(held bool) error {
	var v []byte
	if held {
		v = []byte{1}
	}
	if err := n.logs.Set(bootHoldKey, v); err != nil {
		return fmt.Errorf("record whether %s holds its votes since its bootstrap: %w", n.cfg.DataDir, err)
	}
	n.bootHeld = held
	return nil
}

// noteBootCaughtUp forgets that the directory holds its votes since its
// bootstrap once the node is ready: its state holds what its leader had
// committed when it first heard from it, so its log does. Until then a
// restart holds them again. Run by leaderLoop only.
func (n *Node) noteBootCaughtUp() {
	if !n.bootHeld || !n.ready.Load() {
		return
	}
	if err := n.setBootHeld(false); err != nil {
		n.logger.Warn("forgetting that this node holds its votes since its bootstrap failed; retrying", "err", err)
	}
}

// recordedJoinAddr returns the address the directory records it joined
// at and has not yet seen itself at (joinAddrKey), "" when none.
func (n *Node) recordedJoinAddr() (string, error) {
	v, err := n.logs.Get(joinAddrKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return "", fmt.Errorf("read the Raft address %s joined at: %w", n.cfg.DataDir, err)
	}
	return string(v), nil
}

// setJoinAddr records addr as the address the directory joined at, ""
// once the node has seen itself there.
func (n *Node) setJoinAddr(addr string) error {
	if err := n.logs.Set(joinAddrKey, []byte(addr)); err != nil {
		return fmt.Errorf("record the Raft address %s joined at: %w", n.cfg.DataDir, err)
	}
	n.joinAddr = addr
	return nil
}

// noteJoined forgets the address the directory joined at once the node
// has caught up with its addition: it is ready and its latest
// configuration lists it there. From then on checkRaftAddr's usual rule
// applies. Run by leaderLoop only.
//
// A configuration that lists the node at that address is not enough
// alone: a member moved A -> B -> back to A replays the log from the
// bootstrap configuration, which lists it at A long before the entry
// that adds it back there (and before the ones that moved it to B).
// Readiness settles it: a ready node has applied what its leader had
// committed when it first heard from it after its start (checkReady),
// which includes the removal that preceded the addition (a member is
// removed before it is added at a new address), so its latest
// configuration is that removal's or a later one, and one of those that
// lists it at the address it joined at is its addition or follows it.
func (n *Node) noteJoined() {
	if n.joinAddr == "" || !n.ready.Load() {
		return
	}
	cf := n.raft.GetConfiguration()
	if cf.Error() != nil {
		return
	}
	for _, s := range cf.Configuration().Servers {
		if string(s.ID) == n.cfg.ID && SameRaftAddr(string(s.Address), n.joinAddr) {
			if err := n.setJoinAddr(""); err != nil {
				n.logger.Warn("forgetting the Raft address this node joined at failed; retrying", "err", err)
				return
			}
			if n.stream != nil {
				n.stream.settleJoiner()
			}
			return
		}
	}
}

// recordedNodeID returns the node id the directory recorded (nodeIDKey),
// "" when it has none.
func (n *Node) recordedNodeID() (string, error) {
	v, err := n.logs.Get(nodeIDKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return "", fmt.Errorf("read the node id %s recorded: %w", n.cfg.DataDir, err)
	}
	return string(v), nil
}

// raftAddr is the address peers dial this node at: Config.RaftAddr, or
// the transport's own when none is given (a transport of tests).
func (n *Node) raftAddr() string {
	if n.cfg.RaftAddr != "" {
		return n.cfg.RaftAddr
	}
	return string(n.trans.LocalAddr())
}

// checkRaftAddr refuses to start a node that its latest configuration
// lists at another address than its own (raftAddr): its peers would dial
// it there, and it would stay a candidate for good. A member moves by
// being removed and added at the new address, on an empty directory
// started to join (docs/operations.md, "Remove a node").
//
// Such a directory replays the cluster's log from its start (or an older
// snapshot), whose configurations list the member at its old address
// until the entry that adds it at the new one: stopped or crashed before
// that entry, its latest configuration still says the old address. So a
// directory started to join records the address it joined at
// (joinAddrKey), and may start at that address, whatever its
// configuration says, until it has caught up with the entry that adds it
// there (noteJoined: ready, and listed there); from then on, this rule
// applies. (Its peers dial it at that address: the cluster added it
// there.) A node just started is not ready, so the record stands here.
func (n *Node) checkRaftAddr() error {
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return fmt.Errorf("read the Raft configuration: %w", err)
	}
	addr := n.raftAddr()
	servers := cf.Configuration().Servers
	for _, s := range servers {
		if string(s.ID) == n.cfg.ID && !SameRaftAddr(string(s.Address), addr) {
			if n.joinAddr != "" && SameRaftAddr(addr, n.joinAddr) {
				n.logger.Info("this node joined at its --raft-addr and is still catching up: its configuration lists it at its old address until it replays its addition",
					"raft_addr", addr, "listed_at", s.Address)
				return nil
			}
			if onlyVoter(servers, n.cfg.ID) {
				// kvctl members remove refuses the last voter: it moves
				// by its state, into a new cluster at the new address.
				return refuseStart(ErrRaftAddrChanged, "this node is %s at %s in its cluster's configuration; --raft-addr is %s: "+
					"start it with --raft-addr %s. It is its cluster's only voter, which cannot be removed; to move it to %s, "+
					"copy its state into a new cluster there: with it running at %s, kvctl snapshot save FILE; then "+
					"kvctl snapshot restore FILE --data-dir NEWDIR --node-id %s --peers %s=%s=%s, and start it on NEWDIR "+
					"(docs/operations.md, Move the only voter)",
					n.cfg.ID, s.Address, addr, s.Address, addr, s.Address, n.cfg.ID, n.cfg.ID, addr, n.cfg.HTTPAddr)
			}
			return refuseStart(ErrRaftAddrChanged, "this node is %s at %s in its cluster's configuration; --raft-addr is %s: "+
				"start it with --raft-addr %s. To move a member, remove it (kvctl members remove %s) and add it at the new address: "+
				"start it there with --join on an empty data directory (docs/operations.md, Remove a node)",
				n.cfg.ID, s.Address, addr, s.Address, n.cfg.ID)
		}
	}
	return nil
}

// onlyVoter reports whether id is the only voter of servers.
func onlyVoter(servers []raft.Server, id string) bool {
	voters := 0
	self := false
	for _, s := range servers {
		if s.Suffrage == raft.Voter {
			voters++
			self = self || string(s.ID) == id
		}
	}
	return voters == 1 && self
}

// SameRaftAddr reports whether a and b are one Raft address: equal as
// text, or both IP:port with equal IPs and ports once parsed
// (netip.ParseAddrPort: [0:0::1]:7000 is [::1]:7000, an IPv4-mapped IPv6
// address its IPv4 one, a port's leading zeros dropped). A hostname is
// compared as text: localhost is not 127.0.0.1, nor Node1 node1, as
// resolving it would make the check depend on the resolver at start. A
// node's start judges its --raft-addr against its configuration by it,
// and kvctl status a node's address against the leader's configuration.
func SameRaftAddr(a, b string) bool {
	if a == b {
		return true
	}
	pa, err := netip.ParseAddrPort(a)
	if err != nil {
		return false
	}
	pb, err := netip.ParseAddrPort(b)
	if err != nil {
		return false
	}
	return pa.Addr().Unmap() == pb.Addr().Unmap() && pa.Port() == pb.Port()
}

// checkUnrecordedID refuses to start a directory with Raft state but no
// recorded node id (an older build's) as an id that its latest
// configuration contradicts: one that lists another id at this node's
// address is another node's directory. (One that lists neither this id
// nor this address cannot tell, and is taken.)
func (n *Node) checkUnrecordedID() error {
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return fmt.Errorf("read the Raft configuration: %w", err)
	}
	addr := n.raftAddr()
	for _, s := range cf.Configuration().Servers {
		if SameRaftAddr(string(s.Address), addr) && string(s.ID) != n.cfg.ID {
			return refuseStart(ErrWrongNode, "data directory %s holds the Raft state of node %s (its cluster's configuration lists %s at %s, "+
				"this node's --raft-addr); started with --node-id %s: give --node-id %s, or start on an empty directory",
				n.cfg.DataDir, s.ID, s.ID, addr, n.cfg.ID, s.ID)
		}
	}
	return nil
}

// The origins of a data directory's Raft state (originKey).
const (
	originAlone = "alone" // bootstrapped (or seeded) with this node as its only member
	originPeers = "peers" // bootstrapped (or seeded) with other peers too
	originJoin  = "join"  // started with no peers: its state came from a cluster it joined
)

// originOf is the origin of a directory bootstrapped or seeded with the
// configuration servers.
func (n *Node) originOf(servers []raft.Server) string {
	if len(servers) == 1 && string(servers[0].ID) == n.cfg.ID {
		return originAlone
	}
	return originPeers
}

// recordOrigin writes the directory's origin into the stable store.
func (n *Node) recordOrigin(origin string) error {
	if err := n.logs.Set(originKey, []byte(origin)); err != nil {
		return fmt.Errorf("record how %s started: %w", n.cfg.DataDir, err)
	}
	return nil
}

// checkJoinAlone refuses (ErrStartRefused) a start to join (no peers) on a directory whose
// latest configuration is this node alone when it was bootstrapped (or
// seeded) that way: it holds a cluster of its own, and joined to another
// cluster it would refuse that cluster's leader (commitWatch). A node that
// joined a cluster and became its last member, the others removed, starts:
// it runs the cluster it holds. A directory first started by an older
// build has no record of how it started, and is refused too: it may hold
// a cluster of its own.
func (n *Node) checkJoinAlone() error {
	origin, err := n.logs.Get(originKey)
	if err != nil && !errors.Is(err, store.ErrKeyNotFound) {
		return fmt.Errorf("read how %s started: %w", n.cfg.DataDir, err)
	}
	const what = "To run that cluster, start this node without --join. To join another cluster instead, give that cluster up: " +
		"move this data directory aside (it holds that cluster's state, and this node is its only member) and start with an empty one"
	switch string(origin) {
	case originJoin, originPeers:
		return nil
	case originAlone:
		return refuseStart(nil, "%s holds a cluster that this node bootstrapped alone (started without --join, with no other --peers), "+
			"and this node is its only member, so it cannot join another cluster. %s", n.cfg.DataDir, what)
	}
	return refuseStart(nil, "%s holds a cluster in which this node is the only member, and an older build, which did not record "+
		"whether this node bootstrapped that cluster alone or joined it and became its last member, started it: it may be a "+
		"cluster of its own, which cannot join another one. %s", n.cfg.DataDir, what)
}

// seededConfiguration returns the seed snapshot of a seeded directory not
// yet started (SeedDataDir: a Raft snapshot at the seed's index and term,
// or at an earlier build's, and an empty log), nil for any other
// directory.
func (n *Node) seededConfiguration() (*raft.SnapshotMeta, error) {
	last, err := n.logs.LastIndex()
	if err != nil || last != 0 {
		return nil, err
	}
	list, err := n.snaps.List()
	if err != nil || len(list) != 1 || !isSeed(list[0].Index, list[0].Term) {
		return nil, err
	}
	return list[0], nil
}

// warnIgnoredPeers logs at Warn when --peers, given to a directory that
// already holds Raft state, differs from the configuration Raft read from
// it. Raft bootstraps only an empty directory, so such --peers are
// ignored: an operator who edited them for a restart would otherwise
// believe the membership changed. Matching --peers (the usual command
// line, kept for restarts) log nothing.
func (n *Node) warnIgnoredPeers(peers []Member) {
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		n.logger.Warn("--peers are ignored on a data directory with Raft state, and its configuration could not be read to compare them", "err", err)
		return
	}
	servers := cf.Configuration().Servers
	same := len(servers) == len(peers)
	stored := make([]string, 0, len(servers))
	for _, s := range servers {
		name := string(s.ID) + "=" + string(s.Address)
		if s.Suffrage != raft.Voter {
			name += " (nonvoter)"
		}
		stored = append(stored, name)
		i := slices.IndexFunc(peers, func(p Member) bool { return p.ID == string(s.ID) })
		if i < 0 || s.Suffrage != raft.Voter || !SameRaftAddr(peers[i].RaftAddr, string(s.Address)) {
			same = false
		}
	}
	if same {
		return
	}
	given := make([]string, 0, len(peers))
	for _, p := range peers {
		given = append(given, p.ID+"="+p.RaftAddr)
	}
	n.logger.Warn("--peers differ from the Raft configuration stored in the data directory and are ignored: --peers bootstraps only an empty data directory; "+
		"change the membership with kvctl members add/remove",
		"data_dir", n.cfg.DataDir, "peers", strings.Join(given, ","), "configuration", strings.Join(stored, ","))
}

// checkSeedPeers refuses (ErrStartRefused) --peers that differ from the configuration of a
// seeded directory not yet started (seededConfiguration). Its
// configuration is the seed's, and the start's --peers would otherwise be
// ignored without a word: a node that never elects, or one that dials
// addresses the operator did not give.
func (n *Node) checkSeedPeers(seeded []raft.Server, peers []Member) error {
	want := map[raft.ServerID]raft.ServerAddress{}
	for _, p := range peers {
		want[raft.ServerID(p.ID)] = raft.ServerAddress(p.RaftAddr)
	}
	same := len(seeded) == len(want)
	var names []string
	for _, s := range seeded {
		names = append(names, string(s.ID)+"="+string(s.Address))
		if want[s.ID] != s.Address {
			same = false
		}
	}
	if !same {
		return refuseStart(nil, "%s was seeded for the peers %s, and --peers names others: start it with the seeded peers, or seed a new directory with these (kvctl snapshot restore --data-dir)",
			n.cfg.DataDir, strings.Join(names, ","))
	}
	return nil
}

// dropDetachedLog deletes the Raft log when it does not continue the
// newest snapshot (at S): it begins above S+1, or it ends below S. Raft
// installs a snapshot (a leader's, or a user restore) and only then clears
// the log (removeOldLogs: the log store is monotonic), and the entries
// appended after it start at S+1; a kill in between (the FSM's restore,
// seconds for a large state) leaves the log of the node's previous base
// beside the snapshot. Entries at or below a snapshot add nothing to the
// state; Raft would have deleted them.
//
// A log that begins after a gap: Raft reads the log from S+1 on at start
// and panics at the first entry missing ("log not found"), so such a node
// panicked at every start (a deposed leader's entries after its own user
// restore at R > S+1, say). Those entries are no commit's. A leader's log
// begins at most one past its newest snapshot (Raft compacts no further),
// and it sends a snapshot only to a follower that needs an entry before
// its log begins: one whose entries above the snapshot did not match the
// leader's at any index the leader probed. An entry matching the leader's
// would, by log matching (an entry's index and term fix the log up to
// it), have matched every entry below it too; so each of the follower's
// entries there is absent from the leader's log, and every committed entry
// is in it (leader completeness). Dropped, the node takes whatever the
// leader has after S again, as after a whole install.
//
// A log that ends below S: for a user restore that is a trap. Raft
// numbers the restore one past the log's last index, S, and writes no
// entry there. A leader killed before a follower took the restore comes
// back with the restore at S and the log up to S-1, while the others have
// elected a leader that wrote its own entry at S. That leader's entries
// from S on match the log up to S-1, so the node appended them, skipped
// the one at S as applied (the restore's index) and applied the rest on
// the restored state: the replicas diverged for good, each at the same
// applied index and ready. With the log gone, the new leader's entries
// match nothing below S, the node refuses them from the log's start, and
// the leader sends it its snapshot (compactForFollower): the node drops
// the restore for the cluster's state, as one not killed does
// (TestARestoreNoFollowerTookIsDroppedAfterTheLeaderRestarts,
// TestARestoreALeaderWasKilledInIsDroppedAfterItsRestart).
//
// A log that holds S or S+1 is left to Raft, which truncates what
// conflicts with the leader's entries.
func (n *Node) dropDetachedLog() error {
	list, err := n.snaps.List()
	if err != nil || len(list) == 0 {
		return err
	}
	newest := list[0]
	first, err := n.logs.FirstIndex()
	if err != nil {
		return fmt.Errorf("read the Raft log's first index: %w", err)
	}
	last, err := n.logs.LastIndex()
	if err != nil {
		return fmt.Errorf("read the Raft log's last index: %w", err)
	}
	var why string
	switch {
	case last == 0:
		return nil
	case first > newest.Index+1:
		why = "begins after a gap above the newest snapshot (Raft cannot start on it)"
	case last < newest.Index:
		why = "ends below the newest snapshot"
	default:
		return nil
	}
	var firstLog, lastLog raft.Log
	_ = n.logs.GetLog(first, &firstLog) // for the warning only
	_ = n.logs.GetLog(last, &lastLog)
	n.logger.Warn("the Raft log "+why+"; deleting it, as Raft would have (the node stopped during a snapshot's install)",
		"first", first, "first_term", firstLog.Term, "last", last, "last_term", lastLog.Term,
		"snapshot", newest.Index, "snapshot_term", newest.Term)
	if err := n.logs.DeleteRange(first, last); err != nil {
		return fmt.Errorf("delete the Raft log %d..%d, which %s at %d: %w", first, last, why, newest.Index, err)
	}
	return nil
}

// refuseStateWithoutItsLog refuses (ErrStartRefused) a state database
// applied past the Raft log's last entry when Raft holds no snapshot: its
// raft/ and snapshots/ were lost, or wiped to start the node afresh, or
// raft/ was replaced by an older or damaged copy, and fsm/ stayed. fsm/
// carries no cluster identity: started on it, Raft goes on from its log's
// end (or begins a new log, bootstrapping it or taking a leader's) and
// the FSM skips every entry up to the old applied index, those writes
// acknowledged and never applied, over a state no log leads to. Without
// a snapshot, a state never gets past the log legitimately: Raft
// compacts its log only below a snapshot, and the FSM applies only
// entries the log holds, synced. Checked before Raft's stores are written
// (a bootstrap, the recorded origin), so that the directory is left as it
// was found.
//
// A state past the log's last entry is not refused when Raft holds a
// snapshot: catchUpFromSnapshot checks the state against it (a deposed
// leader's user restore at R, in no log: Raft removes the log for it,
// that then installs a new leader's snapshot below R, killed while the FSM
// loads it, holds the state at R, an empty log and that snapshot alone,
// and catchUpFromSnapshot restores the snapshot: stateOfSnapshotsHistory,
// the log holds no entry at R).
//
// It refuses too (ErrCorrupt) a state database that holds records but no
// applied index, when Raft holds no snapshot: every group the FSM commits
// carries the applied index, so the record was lost (damage, or removed
// by hand), and Raft would hand over the whole log, which the FSM would
// apply a second time over a state that holds it (not idempotent: a
// booking added and then expired by a sweep comes back). With a snapshot
// (a seeded directory's state has no applied index), catchUpFromSnapshot
// restores it over the state.
func (n *Node) refuseStateWithoutItsLog() error {
	applied, _, err := n.fsm.storedApplied()
	if err != nil {
		return err
	}
	list, err := n.snaps.List()
	if err != nil {
		return fmt.Errorf("list Raft snapshots: %w", err)
	}
	if len(list) > 0 {
		return nil
	}
	if applied == 0 {
		has, err := n.fsm.db.HasRecords()
		if err != nil || !has {
			return err
		}
		return refuseStart(store.ErrCorrupt, "%s holds a state without its applied index, and %s holds no Raft snapshot to restore over it: "+
			"%s is damaged (its applied record lost or removed), and the Raft log would be applied over the state a second time; "+
			"remove %s to start the node without a state, which it takes from the Raft log, or from the cluster (docs/operations.md, \"Layout of a node's data directory\")",
			n.fsm.dir, n.cfg.DataDir, n.fsm.dir, n.fsm.dir)
	}
	last, err := n.logs.LastIndex()
	if err != nil {
		return fmt.Errorf("read the Raft log's last index: %w", err)
	}
	if applied <= last {
		return nil
	}
	return refuseStart(nil, "%s holds a state applied at index %d, past the Raft log (last index %d), and %s holds no Raft snapshot: "+
		"its raft/ and snapshots/ were lost, wiped or replaced, and the log would go on over a state it does not lead to; put back the raft/ and snapshots/ it came with, "+
		"or remove %s to start the node without a state (docs/operations.md, \"Layout of a node's data directory\")",
		n.fsm.dir, applied, last, n.cfg.DataDir, n.fsm.dir)
}

// catchUpFromSnapshot restores the FSM from the newest Raft snapshot when
// its own database is behind it (lost unsynced writes, a wiped fsm/
// directory) or of another history than it. Raft itself never restores at
// start (NoSnapshotRestoreOnStart).
func (n *Node) catchUpFromSnapshot() error {
	list, err := n.snaps.List()
	if err != nil || len(list) == 0 {
		return err
	}
	newest := list[0]
	// Raft starts from this snapshot (restoreSnapshot takes the first of
	// List) and hands over only the entries after it: a snapshot Raft
	// takes is labelled past it, whatever it restores or keeps here.
	n.fsm.handed.Store(newest.Index)
	applied, appliedTerm := n.fsm.Applied()
	if applied >= newest.Index {
		current, unplaced, why := n.stateOfSnapshotsHistory(applied, appliedTerm, newest.Index, newest.Term)
		if current {
			n.logger.Info("state is at or after the newest snapshot; keeping it", "applied", applied, "applied_term", appliedTerm,
				"snapshot", newest.Index, "snapshot_term", newest.Term)
			return nil
		}
		if unplaced {
			// A start cannot refuse (a member is caught up by its
			// leader), but the state it drops may be the newer committed
			// one (refuseUnplacedState, where the offline save refuses).
			n.logger.Warn("restoring the newest Raft snapshot over a state applied past it that the Raft log holds no entry for: "+
				"the entries applied after the snapshot are dropped from this node's state, and come back only from a leader that holds them; "+
				"if raft/ was lost and no other member holds them, committed writes are lost (docs/operations.md, \"Layout of a node's data directory\")",
				"applied", applied, "applied_term", appliedTerm, "snapshot", newest.Index, "snapshot_term", newest.Term,
				"dropped_from", newest.Index+1, "dropped_to", applied)
		}
		return n.restoreNewest(newest, "state is of another history than the newest snapshot ("+why+"); restoring the snapshot", applied, appliedTerm)
	}
	// Raft snapshots at its own applied index, which counts the no-op and
	// barrier entries the FSM never sees: a state whose last command
	// comes before such entries is not behind at all. The log still holds
	// the entries just below a snapshot (TrailingLogs).
	// Only when the log's entry at the snapshot's index is the snapshot's
	// own: a crash between Raft's install of a leader's snapshot and the
	// end of its restore leaves the log's older entries in place, and
	// uncommitted ones of a deposed leader there may be no-ops as well.
	if held, own := n.logAtSnapshot(newest); held && own {
		if last, err := n.lastFSMEntry(newest.Index, applied); err == nil && last == 0 {
			n.logger.Info("the newest snapshot adds no command to the state; not restoring it", "applied", applied, "applied_term", appliedTerm,
				"snapshot", newest.Index, "snapshot_term", newest.Term)
			return nil
		}
	}
	return n.restoreNewest(newest, "state is behind the newest snapshot; restoring it", applied, appliedTerm)
}

// logAtSnapshot reports whether the Raft log holds an entry at the
// snapshot's index (held), and whether that entry is the snapshot's own,
// of its term (own). A log that holds another term's entry there does not
// continue the snapshot: a crash between Raft's install of a leader's
// snapshot and removeOldLogs leaves the node's older entries, a deposed
// leader's uncommitted ones among them, beside it; by log matching, none
// of its entries after that index are of the snapshot's history either.
func (n *Node) logAtSnapshot(snap *raft.SnapshotMeta) (held, own bool) {
	var at raft.Log
	if n.logs.GetLog(snap.Index, &at) != nil {
		return false, false
	}
	return true, at.Term == snap.Term
}

// stateOfSnapshotsHistory reports whether a state applied at (applied,
// appliedTerm), at or after the newest snapshot's (index, term), is of
// the snapshot's history, and if not, why; unplaced when it is past the
// snapshot, of a term at least its, and the log holds no entry at
// applied: then nothing tells an uncommitted restore's state from the
// newer committed one whose log was lost.
//
// Both the state and the snapshot name one entry of a log, and Raft's log
// matching gives that an entry's index and term fix the whole log up to
// it: two logs holding an entry of one index and term hold the same
// entries up to it. A log's terms never fall.
//   - At the snapshot's index, the state is the snapshot's entry only if
//     it has the snapshot's term; a lower one (a cut-off leader's user
//     restore, applied without a commit, which a new leader's snapshot of
//     a later term then replaced) is another entry. (A higher one is not
//     seen: the user restore's own snapshot would be the newest, Raft
//     lists the highest term first.)
//   - After the snapshot's index, an entry of the snapshot's history has
//     a term at least the snapshot's; and the state is kept only if this
//     node's log holds its entry, with its term. The log continues the
//     snapshot (Raft appends after an entry only when that entry matches
//     the leader's, and the snapshot is the base of the log after it), so
//     by log matching the state's prefix is the snapshot's. A user
//     restore is in no log (Raft leaves a hole at its index), so a cut-off
//     leader's restore above a new leader's snapshot of an older entry's
//     term (a term check alone passes) is caught here, as is a log whose
//     entry at that index is another leader's.
func (n *Node) stateOfSnapshotsHistory(applied, appliedTerm, index, term uint64) (current, unplaced bool, why string) {
	if appliedTerm < term {
		return false, false, fmt.Sprintf("applied term %d below the snapshot's %d", appliedTerm, term)
	}
	if applied == index {
		return true, false, ""
	}
	var at raft.Log
	if err := n.logs.GetLog(applied, &at); err != nil {
		return false, errors.Is(err, raft.ErrLogNotFound), fmt.Sprintf("the log holds no entry at the applied index: %v", err)
	}
	if at.Term != appliedTerm {
		return false, false, fmt.Sprintf("the log's entry at the applied index is of term %d", at.Term)
	}
	return true, false, ""
}

// restoreNewest replaces the FSM's state with the newest snapshot's, and
// logs why (msg) with the state's and the snapshot's index and term.
func (n *Node) restoreNewest(newest *raft.SnapshotMeta, msg string, applied, appliedTerm uint64) error {
	_, rc, err := n.snaps.Open(newest.ID)
	if err != nil {
		return fmt.Errorf("open snapshot %s: %w", newest.ID, err)
	}
	n.logger.Info(msg, "applied", applied, "applied_term", appliedTerm, "snapshot", newest.Index, "snapshot_term", newest.Term)
	defer rc.Close()
	// The stream's own applied index is dropped (restoreFrom: a user's
	// stream may come from another cluster's log). This stream is Raft's
	// own snapshot at newest.Index, and Raft applies only the entries
	// after it: the state takes that index, and records it, so that a
	// restart before the next command does not restore the snapshot again.
	return n.fsm.restoreFrom(rc, newest.Index, newest.Term) // not Restore: that waits for the FSM's release, which waits for this
}

func (n *Node) closeStorage() {
	if n.fsm != nil {
		n.fsm.Close()
	}
	if n.logs != nil {
		n.logs.Close()
	}
	if n.dirLock != nil {
		n.dirLock.Close() // releases the lock
	}
}

// removeRestoreSpools removes the restore spools (RestoreSnapshot's
// restore-*.snap) in the data directory, at the start (a crash's) and at
// Close (an upload cut under the closing node's): nothing reads them
// again, and one may be as large as the state. A file a running restore
// still writes goes from the directory at once and from the disk once
// the restore closes it.
func (n *Node) removeRestoreSpools() {
	spools, err := filepath.Glob(filepath.Join(n.cfg.DataDir, "restore-*.snap"))
	if err != nil {
		return
	}
	for _, p := range spools {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			n.logger.Warn("removing a restore's leftover spool failed", "path", p, "err", err)
		}
	}
}

// Close stops the node: Raft shuts down, then storage closes. A second
// Close, at once or later, waits for the first and returns its result.
//
// A user restore that Raft holds (RestoreSnapshot) is waited for first,
// however long its install takes: Raft panics when it shuts down under
// one. A restore not yet handed to Raft is refused (ErrShutdown and
// ErrNotProposed, nothing installed).
func (n *Node) Close() error { return n.closeOnce() }

// close is Close, run once: a second Close waits for the first and returns
// its result.
func (n *Node) close() error {
	n.restoreMu.Lock()
	n.closing = true
	restoring := n.restoring
	n.restoreMu.Unlock()
	close(n.stop)
	n.waitRestore(restoring)
	err := n.waitRaftShutdown(n.shutdownRaft())
	n.wg.Wait()
	if n.watch != nil {
		n.watch.close()
	}
	// No restore can reach Raft from here (beginRestore refuses it once
	// closing is set, and the one Raft held has returned): a spool left is
	// an upload cut under the closing node, whose handler may not get to
	// remove it before the process exits. Removed before the directory's
	// lock goes.
	n.removeRestoreSpools()
	// Close also the pooled outbound connections of a transport that is
	// not NewTransport's (a raft.NetworkTransport given in Config): its
	// Close, which Raft's shutdown called, stops only its listener, and
	// each peer's reader of such a connection would otherwise wait on it
	// for ever. NewTransport's Close closed them all (streamLayer).
	if nt, ok := n.trans.(*raft.NetworkTransport); ok {
		nt.CloseStreams()
	}
	if c, ok := n.trans.(io.Closer); ok {
		c.Close()
	}
	n.closeStorage()
	return err
}

// raftShutdownGrace is how long Close lets Raft shut down on its own
// before it closes the transport's connections under it
// (waitRaftShutdown).
const raftShutdownGrace = time.Second

// waitRaftShutdown waits for f, Raft's shutdown, and returns its error.
// Raft's shutdown waits for all its goroutines, and one may wait on a
// hung peer (a stopped process, a host gone without a FIN): a follower
// reading the snapshot of a leader that hung part-way, until the
// transport's stall (streamConn; for ever in earlier builds);
// a leader sending its snapshot to a hung follower, with a deadline of
// the transport's timeout for every 256 KiB of it; a leader's RPCs to
// stopped followers, up to the timeout (10 s) each. Close, and so a
// SIGTERM, waited for them (for ever, or minutes). After
// raftShutdownGrace the transport closes, and with it every connection
// it dialed or accepted, and every dial under way (streamLayer): those
// reads, writes and dials fail and the goroutines end. Nothing
// acknowledged is lost: Raft answers a peer only once its log is synced,
// and a snapshot cut part-way is dropped. The wait for Raft's goroutines
// stays whole, so the storage closes only once none runs: that includes
// Raft's FSM and snapshot goroutines, which closing the transport cannot
// cut (the FSM's Restore of a leader's snapshot being installed, a long
// apply, a local snapshot being written), and Close waits for them.
func (n *Node) waitRaftShutdown(f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	grace := time.NewTimer(raftShutdownGrace)
	defer grace.Stop()
	select {
	case err := <-done:
		return err
	case <-grace.C:
	}
	n.logger.Warn("closing: Raft's shutdown still waits (on a peer that does not answer, or a snapshot in flight); closing its transport's connections", "waited", raftShutdownGrace)
	if c, ok := n.trans.(io.Closer); ok {
		c.Close()
	}
	return <-done
}

// restoreCloseLog is how often Close, waiting for a restore, says so.
const restoreCloseLog = 10 * time.Second

// waitRestore waits until restoring (nil: no restore) is closed: Raft's
// Restore returned. Raft's user restore panics, taking the process down,
// when Raft shuts down from the moment it takes the restore until the FSM
// has installed it (it waits for the install with the shutdown as its
// other case, and takes an unfinished install for a failed one). So Close
// waits for the whole call rather than shut Raft down under it: the copy
// into Raft's snapshot store and the install run on this node's disk
// (Raft's shutdown would wait for the install too), and the no-op entry
// after them commits, or fails when the leadership is lost, within the
// leader's lease. The wait has no deadline: cutting it short would be that
// panic. A process killed meanwhile (a second SIGTERM) starts again with
// the old state or the restored one: a restore in Raft's snapshot store is
// installed at the next start (catchUpFromSnapshot), and a half-done swap
// of the state directory is finished or rolled back (cleanupRestore).
func (n *Node) waitRestore(restoring <-chan struct{}) {
	if restoring == nil {
		return
	}
	n.closeWaitsRestore.Store(true)
	defer n.closeWaitsRestore.Store(false)
	start := time.Now()
	n.logger.Warn("closing: waiting for the snapshot restore Raft is installing to finish first (shutting Raft down under it would crash the process)")
	tick := time.NewTicker(restoreCloseLog)
	defer tick.Stop()
	for {
		select {
		case <-restoring:
			n.logger.Info("closing: the snapshot restore finished", "waited", time.Since(start).Round(time.Millisecond))
			return
		case <-tick.C:
			n.logger.Warn("closing: still waiting for the snapshot restore Raft is installing", "waited", time.Since(start).Round(time.Second))
		}
	}
}

// beginRestore records a restore about to be handed to Raft, for Close to
// wait for; end, called once Raft's Restore returned, ends it. Once Close
// began it refuses: Raft would refuse the restore too, or take it and
// crash under Close.
func (n *Node) beginRestore() (end func(), err error) {
	n.restoreMu.Lock()
	defer n.restoreMu.Unlock()
	if n.closing {
		return nil, errRestoreAtClose()
	}
	done := make(chan struct{})
	n.restoring = done
	return func() {
		n.restoreMu.Lock()
		n.restoring = nil
		n.restoreMu.Unlock()
		close(done)
	}, nil
}

// closingErr is errRestoreAtClose once Close began, nil before: a
// restore checks it between its steps, so that it neither checks nor
// writes a stream for a node that is closing.
func (n *Node) closingErr() error {
	n.restoreMu.Lock()
	defer n.restoreMu.Unlock()
	if n.closing {
		return errRestoreAtClose()
	}
	return nil
}

// errRestoreAtClose is a restore's answer when the node closes before it
// is handed to Raft. It is ErrNotProposed too, which the API answers 503
// no_leader: as ErrShutdown alone (503 shutting_down), a client could not
// tell it from an older node's answer of a restore it closed with in its
// log (before HeaderMaybeApplied), and stopped there, outcome unknown,
// instead of trying the next node.
func errRestoreAtClose() error {
	return fmt.Errorf("restore: nothing was installed: %w: %w (the node is closing); retry", ErrNotProposed, ErrShutdown)
}

// shutdownRaft shuts Raft down once and returns that shutdown's future,
// to every caller: Raft gives a later Shutdown call a future that waits for
// nothing.
func (n *Node) shutdownRaft() raft.Future {
	n.shutMu.Lock()
	defer n.shutMu.Unlock()
	if n.shutFuture == nil {
		n.shutFuture = n.raft.Shutdown()
		close(n.raftDown)
	}
	return n.shutFuture
}

// raftShutDown reports whether Raft's shutdown has begun. It reads this
// node's own record (raftDown) first: Raft's State is not enough. A leader
// that removed itself is answered when the removal commits, and Raft's
// leader loop sets its state to Follower only after that: a Shutdown that
// RemoveMember began in between was overwritten, and State read Follower
// for good, though Raft had stopped.
func (n *Node) raftShutDown() bool {
	select {
	case <-n.raftDown:
		return true
	default:
		return n.raft.State() == raft.Shutdown
	}
}

// FSM exposes the state machine (tests, tools).
func (n *Node) FSM() *FSM { return n.fsm }

// Raft exposes the Raft server (tests, tools).
func (n *Node) Raft() *raft.Raft { return n.raft }

// leaderLoop does the leader's chores: after winning an election it waits
// for a Barrier (so everything committed by earlier leaders is applied
// before it serves anything that depends on it), records the members' HTTP
// addresses, and runs the replicated expiry sweep and the replica digest
// checks.
func (n *Node) leaderLoop() {
	defer n.wg.Done()
	tick := time.NewTicker(n.cfg.ExpiryInterval)
	defer tick.Stop()
	check := time.NewTicker(n.cfg.CheckInterval)
	defer check.Stop()
	ready := time.NewTicker(20 * time.Millisecond)
	defer ready.Stop()
	leader := false
	for {
		select {
		case <-n.stop:
			return
		case isLeader := <-n.raft.LeaderCh():
			leader = isLeader
			if leader {
				n.watch.behind.Store(false) // its state is the cluster's now
				n.onLeadership()
			} else {
				// Its pending bookings may never apply: decide from
				// what does (pendingBooks).
				n.fsm.pending.clear()
			}
		case <-tick.C:
			if leader {
				now := time.Now().UnixNano()
				n.raft.Apply(encodeExpire(now, int64(n.cfg.BookingMaxAge)), n.cfg.ApplyTimeout)
			}
		case <-check.C:
			if leader && n.ledThisTerm() {
				n.proposeCheck()
			}
		case peer := <-n.watch.fromStart:
			if leader {
				n.compactForFollower(peer)
			}
		case <-ready.C:
			if leader && !n.ledThisTerm() && n.raft.State() == raft.Leader {
				n.onLeadership() // the Barrier failed: try again
			}
			n.unready()
			n.checkReady()
			if time.Since(n.started) > collectorHoldMax {
				n.fsm.endLoadHold() // not ready for long: collect as usual
			}
			n.maybeSnapshot()
			n.noteMembership()
			n.noteJoined()
			n.noteBootCaughtUp()
			n.confirmClusterIDAlone()
			if leader {
				n.assertSelf()
				n.handOffIfHalted()
			}
		}
	}
}

// handOffIfHalted hands the leadership on (a Raft leadership transfer)
// while this leader's state machine is halted at an entry of a later build
// (FSM.Halted): it answers no write it commits and serves nothing that
// needs its state, and an upgraded node can (docs/operations.md,
// "Upgrade"). A halted node's log is complete, so an election may pick
// it again: it tries once an election timeout, for as long as it leads.
func (n *Node) handOffIfHalted() {
	h := n.fsm.Halted()
	if h == nil || n.cfg.keepHaltedLeadership || time.Since(n.lastHandOff) < n.cfg.ElectionTimeout {
		return
	}
	n.lastHandOff = time.Now()
	if n.alone() {
		return // no one to hand it to (and no transfer's error to log each time)
	}
	n.logger.Warn("leading with the state machine halted: handing the leadership on", "halt", h.Error())
	f := n.leadershipTransfer("", "")
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		if err := f.Error(); err != nil {
			n.logger.Warn("handing the halted leader's leadership on", "err", err)
		}
	}()
}

// maybeSnapshot starts a snapshot, in the background, once the entries
// applied since the last one hold Config.SnapshotBytes.
func (n *Node) maybeSnapshot() {
	if n.cfg.SnapshotBytes < 0 || n.fsm.BytesSinceSnapshot() < n.cfg.SnapshotBytes || !n.snapshotting.CompareAndSwap(false, true) {
		return
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer n.snapshotting.Store(false)
		if err := n.await(context.Background(), n.raft.Snapshot()); err != nil && !errors.Is(err, raft.ErrNothingNewToSnapshot) && !errors.Is(err, raft.ErrRaftShutdown) {
			n.logger.Warn("snapshot by applied bytes failed", "err", err)
		}
	}()
}

// forcedCompactionEvery is how often at most a leader compacts its whole
// log for a follower (compactForFollower).
const forcedCompactionEvery = 10 * time.Second

// compactForFollower compacts the leader's whole log, in the background,
// because peer refused it from its start (refusedFromStart), or from the
// snapshot it has just taken from this leader (refusedAfterInstall: a
// snapshot past peer's last log index ends that; one at it or still
// below it is refused again, and the next compaction waits for
// forcedCompactionEvery). In the first case peer holds a user restore
// that no other node took (Raft's user restore is no log entry: the
// leader installs it, deletes its log and numbers the restore after its
// last index; cut off before a follower took it, it kept it while the
// others elected a leader that wrote on). hashicorp/raft v1.8.0
// then walks peer's next index down to 1, every AppendEntries refused,
// and retries from 1 for good: it sends a snapshot only when its own log
// lacks an entry the follower needs. With the log compacted up to a new
// snapshot, it sends that snapshot, and peer drops the restore for the
// cluster's state (the restore had answered MaybeApplied).
//
// A snapshot with TrailingLogs 0 (Raft's reloadable configuration, put
// back after it) is the only way to compact that Raft offers. Every
// follower behind the leader then takes a snapshot too, so at most one
// compaction runs, and at most one begins every forcedCompactionEvery: a
// follower answers no AppendEntries from the start once the leader's
// log no longer starts at 1, so the next compaction follows only one
// that failed. leaderLoop only.
func (n *Node) compactForFollower(peer raft.ServerID) {
	if time.Since(n.compactedAt) < forcedCompactionEvery || !n.compacting.CompareAndSwap(false, true) {
		return
	}
	n.compactedAt = time.Now()
	n.logger.Warn("a follower's log cannot take this leader's from its start, or from the snapshot it has just taken (it holds a snapshot restore no other node took, or entries past that snapshot): "+
		"compacting the log, so that it gets this leader's newest snapshot", "follower", peer)
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer n.compacting.Store(false)
		if n.cfg.beforeForcedCompaction != nil {
			n.cfg.beforeForcedCompaction()
		}
		if err := n.compactLog(); err != nil {
			if !errors.Is(err, raft.ErrRaftShutdown) {
				n.logger.Warn("compacting the log for a follower failed; trying again on its next refusal", "follower", peer, "err", err)
			}
			return
		}
		n.forcedCompactions.Add(1)
		first, _ := n.logs.FirstIndex()
		n.logger.Info("compacted the log for a follower", "follower", peer, "first_index", first)
	}()
}

// compactLog takes a snapshot and compacts the log up to it.
func (n *Node) compactLog() error {
	rc := n.raft.ReloadableConfig()
	keep := rc.TrailingLogs
	rc.TrailingLogs = 0
	if err := n.raft.ReloadConfig(rc); err != nil {
		return fmt.Errorf("keep no trailing logs: %w", err)
	}
	defer func() {
		rc.TrailingLogs = keep
		if err := n.raft.ReloadConfig(rc); err != nil {
			n.logger.Error("put back the trailing logs after a compaction", "trailing_logs", keep, "err", err)
		}
	}()
	if err := n.await(context.Background(), n.raft.Snapshot()); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	return nil
}

// onLeadership sets up a term's leadership: a Barrier, so that the FSM
// holds every entry committed before the term (CheckLeader refuses until
// it passed), then the member entries. leaderLoop runs it again while it
// has not finished for the current term (a failed Barrier).
func (n *Node) onLeadership() {
	term := n.raft.CurrentTerm() // the term the Barrier covers
	if term != n.pendingTerm {
		// An earlier term's pending bookings may never apply. The false
		// of LeaderCh clears them (leaderLoop), but LeaderCh holds one
		// value, which a newer one replaces unread: a step-down and a
		// re-election while leaderLoop was busy read as one true.
		n.fsm.pending.clear()
		n.pendingTerm = term
	}
	if n.cfg.beforeBarrier != nil {
		n.cfg.beforeBarrier()
	}
	if err := n.await(context.Background(), n.raft.Barrier(n.cfg.ApplyTimeout)); err != nil {
		if !errors.Is(err, raft.ErrRaftShutdown) {
			n.logger.Warn("barrier after election failed; retrying", "err", err)
		}
		return
	}
	n.checkBootstrap()
	// The member table gets this node's own entry as it runs now, and the
	// entry of each bootstrap peer that it lacks while that peer is still
	// a voter: the first leader of a new cluster records them all. A peer's
	// existing entry is never rewritten from the flags (they are those of
	// the bootstrap; a member that joined or moved since has its own
	// entry), nor is a removed member brought back. Entries of servers no
	// longer in the configuration go: a leader that removed itself stepped
	// down before it could remove its own entry (RemoveMember), and a
	// snapshot restored from another cluster by an older build brought
	// that cluster's table (RestoreSnapshot now installs this cluster's).
	members := n.fsm.Members()
	var servers map[string]raft.ServerAddress // none: no peer's entry
	cf := n.raft.GetConfiguration()
	if cf.Error() == nil {
		servers = serverAddrs(cf.Configuration())
	}
	want := n.setUpEntries(term, members, servers)
	var gone []string
	if cf.Error() == nil {
		for id := range members {
			if _, listed := servers[id]; !listed && id != n.cfg.ID {
				gone = append(gone, id)
			}
		}
		// A server with no entry and no peer flags to give one: an add
		// that ended between its non-voter's entry and its member entry.
		// The configuration holds its raft address and not its HTTP one,
		// which only its add gives: an entry without one would list it
		// no better than none (members list shows "-" either way), so the
		// leader says what to do instead.
		for _, srv := range cf.Configuration().Servers {
			id := string(srv.ID)
			if _, known := members[id]; known || id == n.cfg.ID || slices.ContainsFunc(want, func(m Member) bool { return m.ID == id }) {
				continue
			}
			n.logger.Warn("member table: a server of the configuration has no member entry, so no HTTP address "+
				"(an add that ended before its member entry, or one just begun): add it again with its addresses (kvctl members add), or remove it",
				"member", id, "raft_addr", srv.Address, "suffrage", srv.Suffrage.String())
		}
	}
	for _, m := range want {
		if cur, ok := members[m.ID]; !ok || cur.HTTPAddr != m.HTTPAddr || cur.RaftAddr != m.RaftAddr {
			n.raft.Apply(encodeMember(time.Now().UnixNano(), &m), n.cfg.ApplyTimeout)
		}
	}
	slices.Sort(gone)
	for _, id := range gone {
		n.logger.Info("member table: removing the entry of a server not in the configuration", "member", id)
		n.raft.Apply(encodeMemberGone(time.Now().UnixNano(), id), n.cfg.ApplyTimeout)
	}
	n.ledTerm.Store(term)
	n.logger.Info("leading", "term", term)
}

// setUpEntries returns the member entries the leadership set-up of term
// records (onLeadership) where members, the table, lacks them or holds
// them otherwise: this node's own as it runs (unless selfUnlisted), and
// that of each bootstrap peer with no entry that is a server of the
// configuration (servers, raft addresses by id) at its flags' raft
// address. A peer listed at another raft address than its flags' moved
// since the bootstrap (removed and added back there, the add ended
// before its member entry): the flags' addresses are its old ones, and
// onLeadership warns instead.
func (n *Node) setUpEntries(term uint64, members map[string]Member, servers map[string]raft.ServerAddress) []Member {
	var want []Member
	if !n.selfUnlisted(term) {
		want = append(want, Member{ID: n.cfg.ID, RaftAddr: n.cfg.RaftAddr, HTTPAddr: n.cfg.HTTPAddr})
	}
	for _, p := range n.cfg.Peers {
		at, listed := servers[p.ID]
		if _, known := members[p.ID]; !known && p.ID != n.cfg.ID && p.HTTPAddr != "" && listed && SameRaftAddr(string(at), p.RaftAddr) {
			want = append(want, p)
		}
	}
	return want
}

// serverAddrs returns the raft address of each server of cf, by id.
func serverAddrs(cf raft.Configuration) map[string]raft.ServerAddress {
	servers := make(map[string]raft.ServerAddress, len(cf.Servers))
	for _, srv := range cf.Servers {
		servers[string(srv.ID)] = srv.Address
	}
	return servers
}

// checkBootstrap runs at a leadership set-up, after the Barrier. While
// the cluster's configuration is still the one its nodes bootstrapped
// (the entry at bootstrapIndex), each node's is its own --peers: Raft
// takes two bootstrap entries for the same entry whatever they list
// (check.go, "Configuration checks"). So the leader proposes a check
// carrying its bootstrap entry, which each replica compares with its own.
// Raft does not say at which index its configuration was written
// (GetConfiguration's Index is 0), so the leader proposes it while its
// log holds the bootstrap entry and its configuration is that entry's. A
// lone node proposes none: no other node bootstrapped with it.
//
// The leader does not write its configuration again for every node to
// take: that would end a node's own view of its peers' addresses, which
// the real-process partition tests give each node (a proxy per link),
// and would make a wrong list the cluster's as readily as a right one.
// The operator makes them one (docs/operations.md).
func (n *Node) checkBootstrap() {
	if first, err := n.logs.FirstIndex(); err != nil || first != bootstrapIndex {
		return
	}
	boot, ok := n.configEntry(bootstrapIndex)
	cf := n.raft.GetConfiguration()
	if !ok || len(boot) < 2 || cf.Error() != nil || serverList(boot) != serverList(cf.Configuration().Servers) {
		return
	}
	last := n.fsm.LastCheck()
	n.raft.Apply(encodeConfigCheck(now(), last.Index, last.Digest, bootstrapIndex, boot), n.cfg.ApplyTimeout)
}

// configEntry returns the servers of the configuration entry at index of
// this node's log; false when there is none there or it cannot be read
// (FSM.configAt).
func (n *Node) configEntry(index uint64) (servers []raft.Server, ok bool) {
	var l raft.Log
	if err := n.logs.GetLog(index, &l); err != nil || l.Type != raft.LogConfiguration {
		return nil, false
	}
	// raft.DecodeConfiguration panics on bytes it cannot decode.
	defer func() {
		if recover() != nil {
			servers, ok = nil, false
		}
	}()
	return raft.DecodeConfiguration(l.Data).Servers, true
}

// ledThisTerm reports whether this term's leadership set-up finished.
func (n *Node) ledThisTerm() bool { return n.ledTerm.Load() == n.raft.CurrentTerm() }

// assertSelf re-records the leader's own member entry when the table does
// not hold it as this node runs: a snapshot restored from another cluster
// by an older build brought that cluster's member table, and followers
// forward writes to the HTTP address the table gives for the leader.
func (n *Node) assertSelf() {
	m, ok := n.fsm.Members()[n.cfg.ID]
	// Listed as it runs, at an address the others can dial or with no
	// others (alone: only then, as that costs a read of the
	// configuration).
	if ok && m.HTTPAddr == n.cfg.HTTPAddr && m.RaftAddr == n.cfg.RaftAddr && (undialableHTTPAddr(m.HTTPAddr) == nil || n.alone()) {
		return
	}
	if time.Since(n.lastAssert) < time.Second {
		return // one in flight; do not flood the log
	}
	if n.selfUnlisted(n.raft.CurrentTerm()) {
		// An entry the others cannot dial goes (one that a lone node wrote,
		// before a member was added by an older build): followers would
		// forward writes there, to themselves. One that they can dial (an
		// older address of this node) stays.
		if ok && undialableHTTPAddr(m.HTTPAddr) != nil {
			n.lastAssert = time.Now()
			n.logger.Warn("member table: removing this leader's own entry, at an HTTP address the other members cannot dial", "http_addr", m.HTTPAddr)
			n.raft.Apply(encodeMemberGone(now(), n.cfg.ID), n.cfg.ApplyTimeout)
		}
		return
	}
	n.lastAssert = time.Now()
	self := Member{ID: n.cfg.ID, RaftAddr: n.cfg.RaftAddr, HTTPAddr: n.cfg.HTTPAddr}
	n.raft.Apply(encodeMember(now(), &self), n.cfg.ApplyTimeout)
}

// selfUnlisted reports whether this node, leading in term, must not write
// its own member entry: its HTTP address is one the other members cannot
// dial (CheckHTTPAddr: a wildcard host reaches the forwarding follower's
// own host, the follower itself when it listens on that port; port 0 is
// a port the kernel picks) and its configuration has other servers, which
// forward writes to that address. kvrouter refuses such an address at
// start, but only as far as it can tell a clustered node from its flags
// and its directory, and AddMember refuses to give such a lone leader a
// member: this is the guard of last resort. The table keeps what it holds
// for this node if the others can dial it (an older address), else none
// (assertSelf removes an entry they cannot dial: followers then answer 503
// no_leader rather than forward to themselves), and leadership goes on; an error naming --http-advertise is logged once
// a term. A lone node lists itself as it runs: nobody forwards to it. An
// address that is not host:port at all is an in-memory transport's name
// (tests): kvrouter never gives one.
func (n *Node) selfUnlisted(term uint64) bool {
	err := undialableHTTPAddr(n.cfg.HTTPAddr)
	if err == nil || n.alone() {
		return false
	}
	if n.selfRefusedTerm != term {
		n.selfRefusedTerm = term
		n.logger.Error("leading, but not listing this node's HTTP address in the member table: the other members "+
			"forward writes there and cannot reach it; restart this node with --http-advertise, the address they reach it at",
			"term", term, "err", err)
	}
	return true
}

// undialableHTTPAddr says why the other members cannot dial addr, a
// member's HTTP address (CheckHTTPAddr), nil when they can or when addr is
// not host:port at all (an in-memory transport's name in tests, as
// selfUnlisted takes it: kvrouter never gives one).
func undialableHTTPAddr(addr string) error {
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil
	}
	return CheckHTTPAddr(addr)
}

// collectorHoldMax bounds how long a start keeps the collector off while
// the node is not ready (FSM.holdAfterLoad).
const collectorHoldMax = 30 * time.Second

// checkReady latches readiness once a leader is known and the FSM has
// applied every entry committed when it looked. Raft's own applied index
// is no proof of that: Raft moves it when it hands entries to the FSM's
// goroutine, not when they are applied, so a node that restarted after a
// crash, with a log tail to apply again, was reported ready while its
// index still lacked the tail's blocks (about 200k on the 5M restart
// benchmark). Nor is a follower's commit index: it stops at the
// follower's last log entry, so a follower catching up has applied "every
// committed entry" between two of the leader's batches. A follower is
// ready only once its commit index reached the leader's as first heard
// after its start (commitWatch).
func (n *Node) checkReady() {
	if n.ready.Load() {
		return
	}
	// The state is read once for both of its checks below: read twice, a
	// leader stepping down between the reads skipped the follower's
	// leader-commit check as leader, then the leader's Barrier check as
	// follower, and latched a readiness neither check gave it.
	leader := n.raft.State() == raft.Leader
	addr, _ := n.raft.LeaderWithID()
	commit := n.raft.CommitIndex()
	if addr == "" || commit == 0 || n.raft.AppliedIndex() < commit {
		return
	}
	if !leader {
		if lc := n.watch.leaderCommit(); lc == 0 || commit < lc {
			return
		}
	}
	applied, _ := n.fsm.Applied()
	if !n.fsmHasApplied(commit, applied) {
		return
	}
	if leader && !n.ledThisTerm() {
		return // a leader is ready once its Barrier passed (CheckLeader)
	}
	// Before ready: a reader of ready sees it. The first time only: a
	// node removed and added back is ready again later (unready).
	n.readySeconds.CompareAndSwap(0, math.Float64bits(time.Since(n.started).Seconds()))
	n.ready.Store(true)
	n.watch.releaseVotes()
	n.fsm.endLoadHold()
	n.logger.Info("ready", "applied_index", applied)
}

// unready ends readiness once the node reads removed (removed): a node
// removed while running, and added back after the cluster moved on, is
// as far behind as a node started anew, and is ready again only once it
// has applied what the leader had committed when it first heard from it
// after the re-add (checkReady, with the leader commit index forgotten).
// Latched for good, it read ready at its re-add, tens of entries behind.
// The index is forgotten before ready: a checkReady between the two
// (WaitReady's) finds no leader commit and latches nothing. Run by
// leaderLoop only.
func (n *Node) unready() {
	if !n.ready.Load() || !n.removed() {
		return
	}
	n.watch.forgetLeaderCommit()
	n.ready.Store(false)
	n.logger.Info("removed from the cluster: not ready until added back and caught up")
}

// fsmHasApplied reports whether the FSM, at applied, has applied every
// entry up to commit that Raft gives it: commands and configurations. It
// reads the log back from commit, stopping at the first such entry (no-op
// and barrier entries never reach the FSM, so its applied index can stay
// below the commit index for good). Entries up to Raft's last snapshot
// are in the state whatever the FSM's applied index says: a restored
// state's restarts at 0. An entry no longer in the log was compacted into
// a snapshot, which the state includes too.
//
// The entry found is remembered (unapplied): a committed entry never
// changes, so until the FSM has applied it the answer is no without
// reading the log. Readiness is polled every few milliseconds while a
// restarted node replays its log tail, and reading the newest entry on
// every poll (a decode and a copy of up to a megabyte) took about 0.6 s of
// CPU from the replay on the 5M restart benchmark.
func (n *Node) fsmHasApplied(commit, applied uint64) bool {
	floor := applied
	if s, err := strconv.ParseUint(n.raft.Stats()["last_snapshot_index"], 10, 64); err == nil {
		floor = max(floor, s)
	}
	if n.unapplied.Load() > floor {
		return false
	}
	last, err := n.lastFSMEntry(commit, floor)
	switch {
	case err != nil:
		// An entry missing from the log was compacted into a snapshot,
		// which the state holds.
		return errors.Is(err, raft.ErrLogNotFound)
	case last > 0:
		n.unapplied.Store(last)
		return false
	}
	return true
}

// lastFSMEntry reads the log back from top to the first entry above floor
// that Raft gives the FSM (a command or a configuration) and returns its
// index, 0 when there is none, or the error of the first entry it could
// not read (raft.ErrLogNotFound: one missing from the log).
func (n *Node) lastFSMEntry(top, floor uint64) (uint64, error) {
	for idx := top; idx > floor; idx-- {
		if n.cfg.readyLogRead != nil {
			n.cfg.readyLogRead()
		}
		var l raft.Log
		if err := n.logs.GetLog(idx, &l); err != nil {
			return 0, err
		}
		if l.Type == raft.LogCommand || l.Type == raft.LogConfiguration {
			return idx, nil
		}
	}
	return 0, nil
}

// WaitReady blocks until the node is ready or ctx ends.
func (n *Node) WaitReady(ctx context.Context) error {
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for !n.ready.Load() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			n.checkReady()
		}
	}
	return nil
}

// IsLeader reports whether this node leads now.
func (n *Node) IsLeader() bool { return n.raft.State() == raft.Leader }

// LeaderTerm returns the Raft term this node leads in, and false when it
// does not lead. Raft keeps its state and its term apart, so a read of
// one then the other could pair one term's leadership with another term
// (a step-down and a re-election between the two reads): the term is read
// on both sides of the state, and the state counts only when the term did
// not move across it. Raft moves a leader to follower before it takes a
// new term, so a state read as leader between two reads of one term is
// that term's leadership. The term moves at elections only: a retry is
// rare.
func (n *Node) LeaderTerm() (term uint64, leads bool) {
	for {
		term = n.raft.CurrentTerm()
		if n.raft.State() != raft.Leader {
			return 0, false
		}
		if n.raft.CurrentTerm() == term {
			return term, true
		}
	}
}

func (n *Node) notLeader() *NotLeaderError {
	_, id := n.raft.LeaderWithID()
	if id == "" || string(id) == n.cfg.ID {
		// No leader known, or this node still named as the one it stopped
		// being (Raft answers a leader's futures before it forgets its
		// own leadership): no one to forward to yet.
		return &NotLeaderError{}
	}
	return &NotLeaderError{LeaderID: string(id), LeaderHTTP: n.fsm.Members()[string(id)].HTTPAddr}
}

// apply proposes a command on the leader and waits for it to apply. A ctx
// already done proposes nothing: its error (ErrNotProposed, and
// context.Canceled or context.DeadlineExceeded, wrapped) says so, and the
// command did not and will not apply. (A caller that stopped waiting, or a
// subscriber that is stopping, must not have its command committed behind
// its back.) So does a command Raft could not take in time.
func (n *Node) apply(ctx context.Context, data []byte) (interface{}, error) {
	return n.applyHolding(ctx, data, nil)
}

// applyHolding is apply, calling release (when not nil) once the command
// can no longer apply unseen by the caller: at its return when nothing was
// proposed or Raft answered the entry, and otherwise (the caller stopped
// waiting, or the node stopped, while the entry may still commit) when
// Raft answers it, from a goroutine that outlives await's own by nothing.
// A lost leadership answers the entry while it may still commit under the
// next leader, which judges only after its post-election Barrier
// (ledThisTerm): that Barrier commits it first or the new term's log
// drops it.
func (n *Node) applyHolding(ctx context.Context, data []byte, release func()) (interface{}, error) {
	done := func() {
		if release != nil {
			release()
		}
	}
	if n.raft.State() != raft.Leader {
		done()
		return nil, n.notLeader()
	}
	if err := ctx.Err(); err != nil {
		done()
		return nil, fmt.Errorf("raft apply: %w: %w", ErrNotProposed, err)
	}
	timeout := n.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
		if timeout <= 0 {
			done()
			// ctx.Err may still be nil: its timer has not fired yet.
			return nil, fmt.Errorf("raft apply: %w: %w", ErrNotProposed, context.DeadlineExceeded)
		}
	}
	f := n.raft.Apply(data, timeout)
	var wait raft.Future = f
	var shared *sharedFuture
	if release != nil {
		shared = shareFuture(f)
		wait = shared
	}
	if err := n.await(ctx, wait); err != nil {
		if shared != nil {
			go func() {
				<-shared.done
				release()
			}()
		}
		return nil, n.applyError(ctx, err)
	}
	done()
	if err, ok := f.Response().(error); ok && err != nil {
		var h *ApplyHalt
		if errors.As(err, &h) {
			// Committed (Raft answers once the entry is), so the
			// upgraded nodes apply it; this node's state machine, halted,
			// does not. Not a refusal of the write's content: the answer
			// says it may have applied (as a lost leadership's does), and
			// names the halt.
			return nil, &haltedWrite{h}
		}
		return nil, err
	}
	return f.Response(), nil
}

// sharedFuture is a raft.Future that several goroutines may wait on:
// Raft's own takes one Error call at a time (it receives the answer once).
type sharedFuture struct {
	done chan struct{} // closed once err holds Raft's answer
	err  error
}

func shareFuture(f raft.Future) *sharedFuture {
	s := &sharedFuture{done: make(chan struct{})}
	go func() {
		s.err = f.Error()
		close(s.done)
	}()
	return s
}

func (s *sharedFuture) Error() error {
	<-s.done
	return s.err
}

// applyError is the error of apply whose wait for its entry ended in err.
func (n *Node) applyError(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil && errors.Is(err, cerr) {
		// Proposed, not yet applied: it may still commit, and
		// retrying is safe.
		return fmt.Errorf("raft apply: waiting for the entry to apply: %w", err)
	}
	if errors.Is(err, raft.ErrRaftShutdown) {
		return fmt.Errorf("raft apply: %w", n.shutdownMaybeApplied())
	}
	// A lost leadership: the entry may still commit under the next
	// leader (*NotLeaderError with MaybeApplied: the API does not send
	// a write not safe twice on; DESIGN.md's retry safety). An enqueue
	// timeout: nothing was written.
	if errors.Is(err, raft.ErrEnqueueTimeout) {
		return fmt.Errorf("raft apply: %w: %w", ErrNotProposed, n.raftError(err))
	}
	return fmt.Errorf("raft apply: %w", n.raftError(err))
}

// haltedWrite is the error of a write this node committed while its state
// machine is halted (ApplyHalt): a NotLeaderError with MaybeApplied (the
// API then sends a write not safe twice nowhere else, and says so), which
// also wraps the halt.
type haltedWrite struct{ h *ApplyHalt }

func (e *haltedWrite) Error() string {
	return "the write is committed, and this node does not apply it: " + e.h.Error()
}

func (e *haltedWrite) Unwrap() []error {
	return []error{&NotLeaderError{MaybeApplied: true}, e.h}
}

func now() int64 { return time.Now().UnixNano() }

// raftError turns the errors of Raft's futures into the node's, which
// callers (the API's status codes) branch on: a lost or moving leadership
// into *NotLeaderError, Raft's shutdown into ErrShutdown, an enqueue
// timeout and an entry a user restore aborted into context.DeadlineExceeded
// (the API's 503 timeout; apply wraps an enqueue timeout in
// ErrNotProposed, which the API answers 503 no_leader). Any other error is
// returned as it is.
func (n *Node) raftError(err error) error {
	switch {
	case errors.Is(err, raft.ErrLeadershipLost):
		// The entry was in the log: the next leader may commit it.
		nle := n.notLeader()
		nle.MaybeApplied = true
		return nle
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return n.notLeader()
	case errors.Is(err, raft.ErrRaftShutdown):
		return ErrShutdown
	case errors.Is(err, raft.ErrEnqueueTimeout):
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	case errors.Is(err, raft.ErrAbortedByRestore):
		// A user restore replaced the log with the entry in it: it is
		// lost if the restore holds, and commits under the next leader
		// if the restore is lost (this node cut off before a follower
		// took it). A wait that gave up: it may still apply.
		return fmt.Errorf("%w: %w (the entry may still apply if the restore is lost)", context.DeadlineExceeded, err)
	}
	return err
}

// shutdownMaybeApplied is the error of a write handed to Raft (a
// command's or a configuration change's entry, a leadership transfer)
// that Raft shut down before answering: a *NotLeaderError with
// MaybeApplied and Closed, which is ErrShutdown (not ErrNoLeader: the API
// answers it 503 shutting_down). The entry may be in the log,
// committed even (Raft answers a committed entry it could not hand to the
// FSM ErrRaftShutdown, and await gives up on one it never answers): the
// next leader, or this node's next start, may apply it; a transfer's
// target may have been told to take over. A write not safe twice must not
// be sent to another node as if it had not been (the API answers it with
// HeaderMaybeApplied). A shutdown that came before Raft took the write
// reads the same: the node cannot tell the two apart, and the careful
// answer is this one.
func (n *Node) shutdownMaybeApplied() error {
	return fmt.Errorf("%w before raft answered, and the write may still apply", &NotLeaderError{MaybeApplied: true, Closed: true})
}

// awaitGrace is how long await still waits for an answer once Raft shut
// down outside Close: a leader that removed itself (RemoveMember) may still
// be applying another entry.
const awaitGrace = 2 * time.Second

// await waits for a Raft future, for ctx, and for the node's end. Raft
// answers every future it takes but one kind: an entry (a command, a
// Barrier, a configuration change) committed and queued for the FSM when
// Raft shuts down is dropped with the queue (runFSM returns without
// answering it), and its Error() blocks for ever. Waiting on it directly
// hung Close, whose leaderLoop waited on such a Barrier. await returns
// raft.ErrRaftShutdown once Close began, or awaitGrace after Raft shut
// down otherwise (shutdownRaft), unless the future answered first; the
// goroutine blocked on a lost future stays blocked: one per lost future,
// at shutdown only. A future that answers wins over ctx and shutdown.
func (n *Node) await(ctx context.Context, f raft.Future) error {
	done := make(chan error, 1)
	go awaitFuture(f, done)
	answered := func(otherwise error) error {
		select {
		case err := <-done:
			return err
		default:
			return otherwise
		}
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return answered(ctx.Err())
	case <-n.stop:
		return answered(raft.ErrRaftShutdown)
	case <-n.raftDown:
	}
	grace := time.NewTimer(awaitGrace)
	defer grace.Stop()
	select {
	case err := <-done:
		return err
	case <-grace.C:
		return raft.ErrRaftShutdown
	case <-ctx.Done():
		return answered(ctx.Err())
	case <-n.stop:
		return answered(raft.ErrRaftShutdown)
	}
}

// awaitFuture is await's waiter (named: the goroutine leak checks of the
// tests allow it, blocked on a future Raft dropped at shutdown).
func awaitFuture(f raft.Future, done chan<- error) { done <- f.Error() }

// Status returns this node's view of itself.
func (n *Node) Status() NodeStatus {
	applied, digest := n.fsm.AppliedDigest() // one pair: docs/api.md compares digests at one applied index
	s := n.statusAt(applied)
	s.Digest = fmt.Sprintf("%016x", digest)
	return s
}

// statusAt is Status with applied as its AppliedIndex and no Digest. The
// metrics collector reads it with the FSM's Applied: the digest is read
// under the lock ApplyBatch holds for a whole batch, and computed over the
// whole state, which a scrape, exporting no digest, neither waits for nor
// holds the apply path back with.
func (n *Node) statusAt(applied uint64) NodeStatus {
	st := n.raft.Stats()
	u := func(k string) uint64 { v, _ := strconv.ParseUint(st[k], 10, 64); return v }
	addr, id := n.raft.LeaderWithID()
	s := NodeStatus{
		ID: n.cfg.ID, RaftAddr: n.cfg.RaftAddr, HTTPAddr: n.cfg.HTTPAddr,
		State: n.raft.State().String(), Term: u("term"), LastIndex: u("last_log_index"),
		CommitIndex: n.raft.CommitIndex(), AppliedIndex: applied, LeaderID: string(id),
		SnapshotIndex: u("last_snapshot_index"),
		LastContactMs: -1,
	}
	if c := n.clusterID.Load(); c != nil && !c.IsZero() {
		s.ClusterID = c.String()
		if n.stream != nil {
			me := n.stream.ident.Load()
			s.ClusterIDProvisional = me != nil && me.provisional
		}
	}
	// Ready to serve: caught up since the start, or since it was last
	// added back (ready, which stays set until the node reads removed:
	// unready), and now part of a cluster with a known leader. A node cut off from
	// its peers (a candidate), or removed from the cluster (its Raft shut
	// down), answers routes from an index that no longer moves.
	// A follower whose log cannot take the leader's (a restore no other
	// node took) serves a state that is not the cluster's until the
	// leader's snapshot comes (commitWatch.behind).
	// A node whose state machine halted at an entry of a later build
	// serves a state that no longer follows the cluster's.
	h := n.fsm.Halted()
	if h != nil {
		s.ApplyHalted = h.Error()
	}
	s.Ready = n.readyWith(id, h)
	s.Removed = n.removed()
	if id != "" {
		s.LeaderHTTP = n.fsm.Members()[string(id)].HTTPAddr
	}
	_ = addr
	if n.raft.State() == raft.Leader {
		s.LastContactMs = 0
	} else if lc := n.raft.LastContact(); !lc.IsZero() {
		s.LastContactMs = time.Since(lc).Milliseconds()
	}
	return s
}

// readyWith is Status.Ready with id the leader this node knows and h its
// state machine's halt.
func (n *Node) readyWith(id raft.ServerID, h *ApplyHalt) bool {
	return n.ready.Load() && id != "" && !n.raftShutDown() && !n.watch.behind.Load() && h == nil
}

// Readiness returns what a readiness probe asks of this node: Status's
// Ready, State, AppliedIndex, LeaderID, ApplyHalted and Removed, the other
// fields zero. Unlike Status it does not wait for an apply in progress
// (Status pairs the digest with the applied index between two ApplyBatch
// calls; a large rank's dump applies for seconds, and a node catching up
// on a long log tail applies one batch after another): a probe must
// answer within its timeout (Kubernetes': 1 s), or the node is taken for
// down. Neither waits for Raft's main loop: hashicorp/raft (v1.8) answers
// Stats, GetConfiguration and LeaderWithID from state it keeps apart from
// the loop (an earlier comment here said otherwise; older releases sent
// GetConfiguration through the loop).
func (n *Node) Readiness() NodeStatus {
	_, id := n.raft.LeaderWithID()
	applied, _ := n.fsm.Applied()
	s := NodeStatus{ID: n.cfg.ID, RaftAddr: n.cfg.RaftAddr, HTTPAddr: n.cfg.HTTPAddr,
		State: n.raft.State().String(), AppliedIndex: applied, LeaderID: string(id), LastContactMs: -1}
	h := n.fsm.Halted()
	if h != nil {
		s.ApplyHalted = h.Error()
	}
	s.Ready = n.readyWith(id, h)
	// A node a leader replicates to is not removed (unreplicated): only one
	// that hears from none reads its configuration.
	s.Removed = n.unreplicated() && n.removed()
	return s
}

// Members lists the Raft configuration with the members' HTTP addresses.
func (n *Node) Members(ctx context.Context) ([]Member, error) {
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, err
	}
	_, leader := n.raft.LeaderWithID()
	table := n.fsm.Members()
	var out []Member
	for _, s := range f.Configuration().Servers {
		out = append(out, Member{ID: string(s.ID), RaftAddr: string(s.Address), HTTPAddr: table[string(s.ID)].HTTPAddr,
			Voter: s.Suffrage == raft.Voter, Leader: s.ID == leader})
	}
	slices.SortFunc(out, func(a, b Member) int { return cmp.Compare(a.ID, b.ID) })
	return out, nil
}

// Workers lists registrations with each rank's index and load figures.
func (n *Node) Workers() []WorkerStatus { return n.workersAt(time.Now()) }

// workersAt is Workers with each rank's silence judged at now (tests judge
// it at a chosen instant: a registration's or a restore's).
func (n *Node) workersAt(now time.Time) []WorkerStatus {
	ws := n.fsm.Workers()
	stats := map[kvevent.Rank]indexer.RankStats{}
	for _, rs := range n.fsm.Index().RankStats() {
		stats[rs.Rank] = rs
	}
	out := make([]WorkerStatus, 0, len(ws))
	params := n.fsm.Settings().Params
	// Every reading of the judgement is a wall time: the stamps are
	// (time.Unix), so now is stripped of its monotonic reading, and
	// this node's start is read as now's wall time less the time
	// since the start by the monotonic clock. Compared by wall time
	// as it read at the start, a wall-clock step (NTP) since would
	// move the start against every stamp: stepped back, the start
	// reads later than the rank's latest events, and a rank that
	// publishes would be reported silent until the clock caught up.
	wall, started := now.Round(0), now.Round(0).Add(-now.Sub(n.started))
	for _, w := range ws {
		s := WorkerStatus{Info: w}
		for _, dp := range w.DPRanks {
			r := kvevent.Rank{Worker: w.ID, DP: dp}
			st := stats[r]
			// Silence counts from the rank's last events, its worker's
			// registration, this node's start or its last restore, the
			// latest (stampAt).
			heard := n.fsm.LastHeard(r)
			since := started
			for _, ns := range []int64{heard, n.fsm.RegisteredAt(w.ID), n.fsm.RestoredAt()} {
				if t, ok := n.stampAt(ns, wall); ok && t.After(since) {
					since = t
				}
			}
			load := n.fsm.Sequences().Load(r)
			s.Ranks = append(s.Ranks, RankStatus{DPRank: dp, Blocks: st.Blocks, Cursor: n.fsm.Cursor(r),
				NeedsResync: st.NeedsResync, Load: load, LastHeard: heard,
				Silent: wall.Sub(since) > n.cfg.SilentAfter, Busy: params.BusyOf(load, w.Capacity[kvevent.TierDevice]) != 0})
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b WorkerStatus) int { return cmp.Compare(a.Info.ID, b.Info.ID) })
	return out
}

// stampAt returns the time a silence judged at now counts from for stamp
// ns (unix ns; ok false for 0, or a stamp that does not count yet). The
// last-heard and registration stamps are the proposing leader's clock: a
// stamp ahead of this clock, taken as it is, would hide the rank's
// silence for the skew (an hour for a leader an hour ahead). One ahead by
// up to SilentAfter counts as now, so that nodes whose clocks are a little
// apart do not report a rank that publishes silent (the report comes at
// most SilentAfter late); one further ahead counts only once this clock
// reaches it, as the lease sweep's registration stamp does (eventplane).
func (n *Node) stampAt(ns int64, now time.Time) (time.Time, bool) {
	if ns <= 0 {
		return time.Time{}, false
	}
	t := time.Unix(0, ns)
	switch ahead := t.Sub(now); {
	case ahead <= 0:
		return t, true
	case ahead <= n.cfg.SilentAfter:
		return now, true
	}
	return time.Time{}, false
}

// IndexStats returns the local index's figures.
func (n *Node) IndexStats() indexer.Stats { return n.fsm.Index().Stats() }

// IngestEvents commits per-rank event batches and returns what each did.
func (n *Node) IngestEvents(ctx context.Context, batches []RankBatch) ([]RankAck, error) {
	if len(batches) == 0 {
		return nil, nil
	}
	for i := range batches {
		for j := range batches[i].Events {
			ev := &batches[i].Events[j]
			ev.Rank = batches[i].Rank
			if err := ev.Validate(); err != nil {
				return nil, fmt.Errorf("%w: batch %d event %d: %v", ErrInvalid, i, j, err)
			}
		}
	}
	res, err := n.apply(ctx, encodeEvents(now(), batches))
	if err != nil {
		return nil, err
	}
	return res.([]RankAck), nil
}

// ReplaceRank replaces a rank's state with a full dump of Stored events,
// and sets its cursor (a resync). It is an unfenced dump:
// ReplaceRankFenced with incarnation 0.
func (n *Node) ReplaceRank(ctx context.Context, r kvevent.Rank, cursor uint64, stored []kvevent.Event) error {
	return n.ReplaceRankFenced(ctx, r, cursor, 0, stored)
}

// ReplaceRankFenced is ReplaceRank by publisher incarnation incarnation (0:
// unfenced), which the rank keeps with its cursor (docs/events.md). A dump
// older than the rank's cursor changes nothing, its incarnation included,
// and fails with a *StaleDumpError. A dump of a rank that its Positional
// worker does not list changes nothing either, and fails with
// ErrUnregisteredRank.
func (n *Node) ReplaceRankFenced(ctx context.Context, r kvevent.Rank, cursor, incarnation uint64, stored []kvevent.Event) error {
	for i := range stored {
		stored[i].Rank = r
		if stored[i].Kind != kvevent.KindStored {
			return fmt.Errorf("%w: a rank dump holds only stored events", ErrInvalid)
		}
		if err := stored[i].Validate(); err != nil {
			return fmt.Errorf("%w: dump event %d: %v", ErrInvalid, i, err)
		}
	}
	res, err := n.apply(ctx, encodeReplace(now(), r, cursor, incarnation, stored))
	if err != nil {
		return err
	}
	switch ack, _ := res.(RankAck); {
	case ack.Unregistered:
		return fmt.Errorf("dump of rank %v: %w", r, ErrUnregisteredRank)
	case ack.Cursor > cursor:
		return &StaleDumpError{Cursor: ack.Cursor}
	}
	return nil
}

// RegisterWorker registers (or re-registers) a worker. A registration
// replaces the worker's: the dp ranks the previous one had and this one
// does not leave the worker, and their index state is removed. For a /v1
// worker that was registered (its lease live) that is logged at Warn: it
// is what two agents given one worker id for different dp ranges do to
// each other. It refuses (ErrInvalid) what the /v1 handler refuses of the
// block size, capacity, lease and dp ranks (none listed twice), and
// (ErrBlockSizeConflict) a worker without a model of another block size
// than the cluster's (checkBlockSize). On the leader, it refuses
// (ErrTooManyRanks) one that would take the cluster's registered dp ranks
// past Config.MaxRanks (reserveRanks).
func (n *Node) RegisterWorker(ctx context.Context, w WorkerInfo) error {
	if withoutModel(w) {
		n.blockSizeMu.Lock()
		defer n.blockSizeMu.Unlock()
	}
	if w.BlockSize <= 0 || w.BlockSize > MaxBlockSize {
		return fmt.Errorf("%w: block size %d", ErrInvalid, w.BlockSize)
	}
	for t, c := range w.Capacity {
		if c < 0 || c > MaxCapacity {
			return fmt.Errorf("%w: capacity %d blocks in tier %v (want 0, unknown, to %d)", ErrInvalid, c, kvevent.Tier(t), int64(MaxCapacity))
		}
	}
	if w.LeaseMs < 0 || w.LeaseMs > MaxLeaseMs {
		return fmt.Errorf("%w: lease %d ms (want 0, no lease, to %d, a year)", ErrInvalid, w.LeaseMs, int64(MaxLeaseMs))
	}
	// The /v1 handler's check (api's workerInfo), for every other caller:
	// a rank listed twice would be two route candidates of one rank.
	if msg := limits.DPRanks(w.DPRanks); msg != "" {
		return fmt.Errorf("%w: %s", ErrInvalid, msg)
	}
	// A leader that has not yet applied the entries of the terms before
	// its own (ledThisTerm) judges after a Barrier: its table lacks
	// registrations that committed. The worker's previous entry is read
	// after it too: read before, it could be one its predecessor replaced
	// (a block size changed since, or none yet), and checkBlockSize, which
	// does not judge an entry that keeps the block size, let a change
	// through unjudged. Leadership is decided once, here, and passed to
	// both checks: asked again in each, a node elected after this check
	// judged as a leader without the Barrier. One elected after it
	// judges nothing, as a follower, and proposes unjudged, as one
	// elected between the checks and the apply always could: Raft's
	// Apply takes no term to hold to.
	leader := n.IsLeader()
	if leader && !n.ledThisTerm() {
		if err := n.await(ctx, n.raft.Barrier(n.cfg.ApplyTimeout)); err != nil {
			return fmt.Errorf("barrier before judging worker %d's registration: %w", w.ID, n.raftError(err))
		}
	}
	prev, known := n.fsm.Workers()[w.ID]
	if err := n.checkBlockSize(leader, &w, &prev, known); err != nil {
		return err
	}
	release, err := n.reserveRanks(leader, &w)
	if err != nil {
		return err
	}
	// Released when the entry can no longer apply unseen, not when this
	// call stops waiting (applyHolding).
	_, err = n.applyHolding(ctx, encodeRegister(now(), &w), release)
	if err == nil && known {
		n.warnDroppedRanks(&prev, &w)
	}
	return err
}

// DefaultMaxRanks is Config.MaxRanks when it is zero: 16 workers of
// limits.MaxDPRanks ranks, or 8,192 of 8. A route over them all scores
// each; the answer lists at most api's candidate bound of them.
const DefaultMaxRanks = 65536

// reserveRanks refuses (ErrTooManyRanks), on the leader, a registration
// that would take the registered dp ranks past MaxRanks, counting those
// of the registrations still in flight, and otherwise counts its added
// ranks as in flight until release. A registration that adds none (a
// re-registration with as many ranks or fewer) is always let through: an
// agent restarting must get its worker back. A follower's apply answers
// ErrNotLeader, so only the leader judges, as it alone knows what is in
// flight. A rank counted in flight and, its entry applied, in the table
// too until release makes the bound stricter for that moment, never
// looser. Release comes when Raft answers the entry (applyHolding), not
// when the caller stops waiting: an entry whose caller's context ended
// still commits, and its room, released then, was taken by another. A
// leader that has not yet applied the entries of the terms before its
// own judges after RegisterWorker's Barrier: its table lacked
// registrations its predecessor acknowledged, and those its predecessor
// had in flight, which the Barrier commits or the new term's log drops.
// leader is RegisterWorker's decision, the one its Barrier followed.
func (n *Node) reserveRanks(leader bool, w *WorkerInfo) (release func(), err error) {
	if !leader {
		return func() {}, nil
	}
	n.ranksMu.Lock()
	defer n.ranksMu.Unlock()
	// The worker's ranks as of now, under ranksMu: another registration
	// of the worker may have applied since RegisterWorker read them.
	add := max(len(w.DPRanks), 1) // none listed means rank 0
	if prev, known := n.fsm.Workers()[w.ID]; known {
		add -= len(prev.DPRanks)
	}
	if add <= 0 {
		return func() {}, nil
	}
	have := n.fsm.RankCount() + n.ranksPending
	if have+add > n.cfg.MaxRanks {
		return nil, fmt.Errorf("%w: worker %d's registration adds %d dp ranks to the %d registered (or being registered): at most %d (kvrouter --max-ranks)",
			ErrTooManyRanks, w.ID, add, have, n.cfg.MaxRanks)
	}
	n.ranksPending += add
	return func() {
		n.ranksMu.Lock()
		n.ranksPending -= add
		n.ranksMu.Unlock()
	}, nil
}

// checkBlockSize refuses (ErrBlockSizeConflict) a /v1 worker without a
// model whose block size differs from the one /v1 routes hash with, as
// the other workers without a model set it (the smallest id's:
// blockSizeOf): semantics.md §1 makes it one per model, the same for every
// worker, and a route would leave the worker out (servesBlockSize), or,
// were its id the smallest, every other worker. A worker with a model is
// judged by its namespace's rules (compat's CheckWorkers), which let
// models of different block sizes share the cluster, and its block size
// does not bind the workers without one. A registration that changes
// neither the worker's block size nor its model is not judged, as compat's
// rules do not judge it, so that a worker registered before the rule held
// registers again (kvagent at its start) while it is registered. It
// judges the table on the leader alone (a follower's apply answers
// ErrNotLeader), under blockSizeMu, and after the Barrier of a new
// leader (both RegisterWorker's), with prev, the worker's entry (known),
// read after that Barrier, and leader, RegisterWorker's decision, the one
// its Barrier followed.
func (n *Node) checkBlockSize(leader bool, w, prev *WorkerInfo, known bool) error {
	if !withoutModel(*w) || !leader {
		return nil
	}
	if known && prev.BlockSize == w.BlockSize && withoutModel(*prev) {
		return nil
	}
	view := n.fsm.published()
	// A model worker's block size (no worker without a model has one)
	// binds w to nothing.
	bs, from, ok := view.blockSize, view.blockSizeFrom, view.hasBlockSize && view.blockSizePlain
	if ok && from == w.ID {
		// The block size is w's own registration's: the others' without
		// a model is what is left without it.
		bs, from, ok = DefaultBlockSize, 0, false
		for id, o := range view.workers {
			if id != w.ID && withoutModel(o) && o.BlockSize > 0 && (!ok || id < from) {
				bs, from, ok = o.BlockSize, id, true
			}
		}
	}
	if ok && bs != w.BlockSize {
		return fmt.Errorf("%w: worker %d registers block size %d, and the cluster routes with block size %d (worker %d's): "+
			"one block size per model, the same for every worker (register it with %d, or remove the workers of %d first)",
			ErrBlockSizeConflict, w.ID, w.BlockSize, bs, from, bs, bs)
	}
	return nil
}

// warnDroppedRanks logs, at Warn, the dp ranks of prev, a registered /v1
// worker's registration, that next, its new one, drops. The compatible
// APIs' workers (a tenant) are left out: their /unregister of one dp rank
// is such a registration, on purpose.
func (n *Node) warnDroppedRanks(prev, next *WorkerInfo) {
	if prev.Tenant != "" {
		return
	}
	ranksOf := func(w *WorkerInfo) []uint32 {
		if len(w.DPRanks) == 0 {
			return []uint32{0} // as the FSM registers it
		}
		return w.DPRanks
	}
	kept := slices.Sorted(slices.Values(ranksOf(next)))
	var dropped []uint32
	for _, dp := range ranksOf(prev) {
		if _, ok := slices.BinarySearch(kept, dp); !ok {
			dropped = append(dropped, dp)
		}
	}
	if len(dropped) == 0 {
		return
	}
	slices.Sort(dropped)
	n.logger.Warn("a registration of a registered worker drops dp ranks it had: their index state is removed "+
		"(a registration replaces the worker's dp ranks; an engine's ranks on several hosts need one worker id per host's agent)",
		"worker", next.ID, "dropped", dropped, "ranks", kept)
}

// DeregisterWorker removes a worker and everything the index holds of it.
func (n *Node) DeregisterWorker(ctx context.Context, id uint64) error {
	_, err := n.apply(ctx, encodeDeregister(now(), id))
	return err
}

// DeregisterWorkerRanks deregisters worker id as DeregisterWorker does,
// and returns how many of its ranks' state the entry removed, with
// ErrUnknownWorker too: a worker not registered may hold ranks (its
// agent publishes without a registration; the leader's sweep removes
// them, eventplane), and another removal of the id committed first
// leaves none. The count is this node's apply's answer (the proposing
// leader's), in no replica's stored state.
func (n *Node) DeregisterWorkerRanks(ctx context.Context, id uint64) (int, error) {
	res, err := n.apply(ctx, encodeDeregister(now(), id))
	if uw := (*unknownWorkerError)(nil); errors.As(err, &uw) {
		return uw.removed, err
	}
	if err != nil {
		return 0, err
	}
	removed, _ := res.(int)
	return removed, nil
}

// PrefillDone marks a booked request past its prefill.
func (n *Node) PrefillDone(ctx context.Context, id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty request id", ErrInvalid)
	}
	_, err := n.apply(ctx, encodeBook(now(), []bookOp{{kind: bookPrefillDone, b: Booking{ID: id}}}))
	return err
}

// Free ends a booked request.
func (n *Node) Free(ctx context.Context, id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty request id", ErrInvalid)
	}
	_, err := n.apply(ctx, encodeBook(now(), []bookOp{{kind: bookFree, b: Booking{ID: id}}}))
	return err
}

// Settings returns the cluster's scoring settings, as this node's state
// holds them.
func (n *Node) Settings() Settings { return n.fsm.Settings() }

// SetSettings replaces the cluster's scoring settings. A weight over
// indexer.MaxWeight is taken only when it equals the one this node's
// state holds now for that field (an older build stored it): the
// settings read back put back set the same settings.
func (n *Node) SetSettings(ctx context.Context, s Settings) error {
	if err := s.Params.ValidateKeeping(n.fsm.Settings().Params); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if s.View != indexer.ViewDedup && s.View != indexer.ViewTiered {
		return fmt.Errorf("%w: view %d", ErrInvalid, s.View)
	}
	_, err := n.apply(ctx, encodeSettings(now(), &s))
	return err
}

// AddMember adds a voter and records its HTTP address. A new member is
// added as a non-voter first and made a voter once it answers with the
// log up to its addition (catchUpNonvoter), so that an address where
// nothing runs never becomes a voter; when the voters that answer now are
// not a quorum (this leader lost it, and steps down), the add answers
// ErrNoLeader: retry. Refused (ErrInvalid) are a raft address no peer can
// dial (a wildcard host, port 0), an HTTP address followers could not
// forward writes to (CheckHTTPAddr) or that reaches another member's
// (httpAddrAlias), and a raft address that reaches a member's under
// another spelling (ErrRaftAddrInUse, raftAddrAlias): the leader would
// replicate to that member as to the new one. Adding a voter again at its address refreshes
// its member entry and answers once its log has caught up with the
// leader's (awaitVoterLog): at once for a voter that kept its data. It
// gives up after Config.MemberAddTimeout, whatever ctx: the waits above
// hold the membership lock (memberOps).
func (n *Node) AddMember(ctx context.Context, id, raftAddr, httpAddr string) error {
	ctx, cancel := context.WithTimeout(ctx, n.cfg.MemberAddTimeout)
	defer cancel()
	if id == "" || raftAddr == "" {
		return fmt.Errorf("%w: a member needs an id and a raft address", ErrInvalid)
	}
	if err := checkMemberRaftAddr(raftAddr); err != nil {
		return fmt.Errorf("add %s: %w", id, err)
	}
	if err := checkMemberHTTPAddr(httpAddr); err != nil {
		return fmt.Errorf("add %s: %w", id, err)
	}
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	if err := n.memberOps.lock(ctx, n.stop); err != nil {
		return fmt.Errorf("add %s: waiting for a membership change or restore in progress: %w", id, err)
	}
	defer n.memberOps.unlock()
	// The leadership may have moved while this add waited for another
	// change: what follows reads what only a leader hears (which voters
	// answer it). On a follower, which hears from none, the add was
	// refused as ErrInvalid naming healthy members down, a 400 that a
	// --join takes as final.
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	// Raft's AddVoter moves a voter whose id it knows to the new address:
	// one mistyped add would cut a live member off. Moving a member is a
	// remove and an add; adding it again as it is only refreshes its
	// member entry. "As it is" is its address as SameRaftAddr reads it,
	// as the member's own start check does (127.0.0.1:07000 is
	// 127.0.0.1:7000): a joined member restarted with its --join and its
	// address so spelled asks to be added again. The configuration keeps
	// the address as it lists it.
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return err
	}
	var cur *raft.Server // id's entry, when it is a server already
	for _, s := range cf.Configuration().Servers {
		switch {
		case string(s.ID) == id && !SameRaftAddr(string(s.Address), raftAddr):
			return fmt.Errorf("%w: member %q is at %s, not %s (to move it, remove it first)", ErrInvalid, id, s.Address, raftAddr)
		case string(s.ID) != id && SameRaftAddr(string(s.Address), raftAddr):
			return fmt.Errorf("%w: %s is member %q's raft address", ErrRaftAddrInUse, raftAddr, s.ID)
		case string(s.ID) == id:
			cur = &s
			raftAddr = string(s.Address)
		}
	}
	// Another member's HTTP address (a copied command line): followers
	// would forward writes meant for id's node, once it leads, to that
	// member, and the member list would show two members at one address.
	// Compared as raft addresses are (SameRaftAddr); id's own entry is
	// what the add refreshes.
	members := n.fsm.Members()
	for mid, m := range members {
		if mid != id && m.HTTPAddr != "" && SameRaftAddr(m.HTTPAddr, httpAddr) {
			return fmt.Errorf("%w: add %s: %s is member %q's HTTP address: give the new node's own (its --http-advertise)", ErrInvalid, id, httpAddr, mid)
		}
	}
	// Or the same address spelled another way (localhost for 127.0.0.1,
	// a name of a member's IP), as the raft address's check below reads
	// it (raftAddrAlias).
	if mid, ok := httpAddrAlias(ctx, members, id, httpAddr); ok {
		return fmt.Errorf("%w: add %s: %s reaches member %q's HTTP address %s: give the new node's own (its --http-advertise)",
			ErrInvalid, id, httpAddr, mid, members[mid].HTTPAddr)
	}
	// A new server forwards writes to this leader at its member entry: at
	// an address it cannot dial (a lone node's wildcard --http-addr) it
	// would forward them to itself, and the leader cannot list itself
	// there once it is not alone (selfUnlisted), so the cluster would take
	// no write through a follower. An existing server's add (a refresh of
	// its entry) changes nothing of that.
	if cur == nil {
		if err := undialableHTTPAddr(n.cfg.HTTPAddr); err != nil {
			return fmt.Errorf("%w: add %s: this leader's HTTP address %v; the new member would forward writes there: "+
				"restart this node with --http-advertise, the address the other nodes reach it at, and add %s again",
				ErrInvalid, id, err, id)
		}
	}
	// The same address spelled another way (localhost for 127.0.0.1, a
	// name of a member's IP): the leader would replicate to that member as
	// to id. To itself, it receives its own AppendEntries and steps down,
	// for good; to a follower, whose answers make id a voter, two votes of
	// one process. A non-voter added so by an older build is refused its promotion too
	// (its answers, another's, would not promote it anyway: answeredBy).
	if cur == nil || cur.Suffrage != raft.Voter {
		if s, ok := raftAddrAlias(ctx, cf.Configuration().Servers, id, raftAddr); ok {
			hint := "give the new node's own raft address"
			if cur != nil {
				hint = fmt.Sprintf("remove the non-voter %s (kvctl members remove %s) and add it at its own raft address", id, id)
			}
			return fmt.Errorf("%w: %s reaches member %q's raft address %s: %s",
				ErrRaftAddrInUse, raftAddr, s.ID, s.Address, hint)
		}
	}
	if cur != nil && cur.Suffrage == raft.Voter {
		// A voter already: the add changes no configuration and refreshes
		// its member entry. It answers once the voter's log has caught up
		// (awaitVoterLog): a voter restarted on its data matches at the
		// next AppendEntries, while one wiped and started again with
		// --join at its address has an empty log, and "joined" would tell
		// its operator a lie.
		if _, err := n.apply(ctx, encodeMember(now(), &Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr})); err != nil {
			return err
		}
		if id == n.cfg.ID {
			return nil // this leader: its log is the cluster's
		}
		return n.awaitVoterLog(ctx, id, raftAddr)
	}
	// A new voter counts in the quorum at once. Where the answering
	// voters are not a quorum of the new configuration without it,
	// that configuration can commit nothing (not even its own entry)
	// and the leader steps down for good (3 voters with one down, a
	// fourth added at a mistyped address); where they are, a voter
	// that never answers still takes the cluster's one spare failure
	// (4 voters, 3 up: one more failure and no quorum). So the new
	// node must answer first: it joins as a non-voter, catches up, and
	// then votes.
	others, down, _, err := n.answeringNow(ctx, cf.Configuration().Servers, id, "")
	if err != nil {
		return fmt.Errorf("add %s: %w", id, err)
	}
	if n.raft.State() != raft.Leader {
		return n.notLeader() // lost during the wait: its followers' silence says nothing
	}
	// Voters that are a quorum of the configuration now are one of the
	// new configuration too, the new node counted (catchUpNonvoter waits
	// for its answers), so the add fails here only where this leader has
	// lost its quorum: both followers of 3 cut off, and it leads on for
	// up to a lease. That is the cluster's state, not the request's
	// fault: it answers as a cluster without a leader (503, retried by a
	// --join), where ErrInvalid's 400 made a --join stop the node.
	need := (len(others)+len(down)+1)/2 + 1
	if len(others)+1 < need {
		return fmt.Errorf("%w: add %s: only %d of the %d voters %s this leader (%s down), not a quorum: it can commit nothing until they are back, and steps down",
			ErrNoLeader, id, len(others), len(others)+len(down), agree(len(others), "answers", "answer"), strings.Join(down, ", "))
	}
	if err := n.catchUpNonvoter(ctx, cur, id, raftAddr, httpAddr, need, len(others)+len(down)+1); err != nil {
		return err
	}
	if err := n.await(ctx, n.raft.AddVoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, n.cfg.ApplyTimeout)); err != nil {
		return fmt.Errorf("add voter %s: %w", id, n.raftError(err))
	}
	_, err = n.apply(ctx, encodeMember(now(), &Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr}))
	return err
}

// catchUpNonvoter adds id at raftAddr as a non-voter (unless cur says it is
// one) and waits until it answers with the log up to its addition and,
// with it, need of the voters (voters in all, it included) answer. Until
// then it stays a non-voter, out of every quorum; ctx ending leaves it one
// (a retried add resumes the wait: removing it would restart a slow
// node's catch-up from scratch every time).
func (n *Node) catchUpNonvoter(ctx context.Context, cur *raft.Server, id, raftAddr, httpAddr string, need, voters int) error {
	var from uint64 // the index its log must reach
	if cur == nil {
		f := n.raft.AddNonvoter(raft.ServerID(id), raft.ServerAddress(raftAddr), 0, n.cfg.ApplyTimeout)
		if err := n.await(ctx, f); err != nil {
			return fmt.Errorf("add %s as a non-voter: %w", id, n.raftError(err))
		}
		from = f.Index()
		// Its HTTP address now: members list shows it while it catches up.
		if _, err := n.apply(ctx, encodeMember(now(), &Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr})); err != nil {
			return err
		}
	} else {
		// A retried add. The first may have ended between its two
		// entries (the leadership moved once the non-voter's committed),
		// leaving the member table without the node: members list showed
		// no address for it until an add got it promoted, which a one-off
		// add that times out never does. Its entry comes first now.
		if m, ok := n.fsm.Members()[id]; !ok || m.RaftAddr != raftAddr || m.HTTPAddr != httpAddr {
			if _, err := n.apply(ctx, encodeMember(now(), &Member{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr})); err != nil {
				return err
			}
		}
		// The log up to now, past its latest configuration
		// (which reached it through Raft's pipeline if it caught up
		// since). Raft does not say where that configuration is: its
		// GetConfiguration leaves the future's Index at 0 (v1.8.0).
		from = n.raft.LastIndex()
	}
	// Only answers from now on count: a match proved before a retry may
	// be of a node wiped and restarted since at the same address, which
	// answers heartbeats at once while its log-testing appends wait (a
	// busy node, the leader's replication in backoff). A leader sends a
	// log-testing append to each follower at least every CommitTimeout.
	start := time.Now()
	tick := time.NewTicker(max(n.cfg.HeartbeatTimeout/10, time.Millisecond))
	defer tick.Stop()
	for {
		if n.raft.State() != raft.Leader {
			return n.notLeader()
		}
		c := n.watch.contact(raft.ServerID(id))
		cf := n.raft.GetConfiguration()
		if err := cf.Error(); err != nil {
			return err
		}
		others, _ := n.answering(cf.Configuration().Servers, id)
		notYet := func(err error) error {
			return fmt.Errorf("add %s: %s at %s is a non-voter until it catches up, and has not yet (it votes only then; %d of the %d voters it makes must answer, %d %s); "+
				"check that it runs and that its raft address is right, then add it again, or remove it: %w",
				id, id, raftAddr, need, voters, len(others), agree(len(others), "other does", "others do"), err)
		}
		if c.matched >= from && c.matchedAt.After(start) && time.Since(c.at) <= n.contactWindow() && len(others)+1 >= need {
			// Caught up, by the contact window: confirm with answers
			// heard from now on, the new node's too.
			up, _, alsoUp, err := n.answeringNow(ctx, cf.Configuration().Servers, id, id)
			switch {
			case err != nil && ctx.Err() != nil:
				return notYet(ctx.Err())
			case err != nil:
				return err
			case alsoUp && len(up)+1 >= need:
				return nil
			}
		}
		select {
		case <-tick.C:
		case <-n.stop:
			return ErrShutdown
		case <-ctx.Done():
			return notYet(ctx.Err())
		}
	}
}

// awaitVoterLog waits until the voter id answers an AppendEntries that
// tests its log (commitWatch's match) with the log up to this leader's
// last index now, the answer given after the call. Raft gives no
// follower's match index (hashicorp/raft v1.8.0); the watch does. A
// voter whose log is that of the cluster matches at the next append,
// which a leader sends at least every CommitTimeout; one that lost its
// log (a wiped data directory) matches once the leader has caught it up,
// and the context's end says so (a --join asks again).
func (n *Node) awaitVoterLog(ctx context.Context, id, raftAddr string) error {
	from, start := n.raft.LastIndex(), time.Now()
	tick := time.NewTicker(max(n.cfg.HeartbeatTimeout/10, time.Millisecond))
	defer tick.Stop()
	for {
		if n.raft.State() != raft.Leader {
			return n.notLeader()
		}
		c := n.watch.contact(raft.ServerID(id))
		if c.matched >= from && c.matchedAt.After(start) {
			return nil
		}
		select {
		case <-tick.C:
		case <-n.stop:
			return ErrShutdown
		case <-ctx.Done():
			answers := "it answers the leader: a node whose data directory was lost, started again at its address, still catching up?"
			if time.Since(c.at) > n.contactWindow() {
				answers = "it does not answer the leader: is it up?"
			}
			return fmt.Errorf("add %s: %s at %s is a voter already, and its log has not caught up with the leader's since this add (%s); "+
				"add it again to wait on: %w", id, id, raftAddr, answers, ctx.Err())
		}
	}
}

// contactWindow is how recently a leader must have heard from a follower
// to count it as answering: the leader heartbeats every tenth of a
// heartbeat timeout, so one that answered none for an election timeout is
// down or cut off.
func (n *Node) contactWindow() time.Duration {
	return max(n.cfg.ElectionTimeout, n.cfg.HeartbeatTimeout)
}

// answering splits the voters of servers other than skip into those that
// answer the leader (itself included) and those that do not (down, cut
// off), as ids. Only a leader hears from every follower.
func (n *Node) answering(servers []raft.Server, skip string) (up, down []string) {
	for _, s := range servers {
		if s.Suffrage != raft.Voter || string(s.ID) == skip {
			continue
		}
		if string(s.ID) == n.cfg.ID || time.Since(n.watch.contact(s.ID).at) <= n.contactWindow() {
			up = append(up, string(s.ID))
		} else {
			down = append(down, string(s.ID))
		}
	}
	return up, down
}

// answeringNow splits the voters of servers other than skip as answering
// does, counting as answering only those heard from since the call (this
// node itself always): it waits until all of them answered, or for a
// contact window (bounded by ctx). The leader heartbeats every tenth of a
// heartbeat timeout, so the wait is that short unless one is down. Judged
// by the contact window alone, a member that went down a moment ago still
// counted as up (a replacement added at once made a configuration the
// others could not commit), and a leader elected a moment ago, not yet
// heard from its followers, counted them down (a transfer straight back
// was refused). also, when not "", is one more server (a non-voter) that
// must answer: alsoUp says whether it did.
func (n *Node) answeringNow(ctx context.Context, servers []raft.Server, skip, also string) (up, down []string, alsoUp bool, err error) {
	start := time.Now()
	deadline := start.Add(n.contactWindow())
	tick := time.NewTicker(max(n.cfg.HeartbeatTimeout/10, time.Millisecond))
	defer tick.Stop()
	for {
		up, down = up[:0], down[:0]
		for _, s := range servers {
			if s.Suffrage != raft.Voter || string(s.ID) == skip {
				continue
			}
			if string(s.ID) == n.cfg.ID || n.watch.contact(s.ID).at.After(start) {
				up = append(up, string(s.ID))
			} else {
				down = append(down, string(s.ID))
			}
		}
		alsoUp = also == "" || n.watch.contact(raft.ServerID(also)).at.After(start)
		if len(down) == 0 && alsoUp || !time.Now().Before(deadline) {
			return up, down, alsoUp, nil
		}
		select {
		case <-tick.C:
		case <-n.stop:
			return nil, nil, false, ErrShutdown
		case <-ctx.Done():
			return nil, nil, false, fmt.Errorf("waiting for the voters to answer: %w", ctx.Err())
		}
	}
}

// RemoveMember removes a server from the cluster. A removal after which
// the voters that answer are not a quorum of those left is refused
// (ErrInvalid).
func (n *Node) RemoveMember(ctx context.Context, id string) error {
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	if err := n.memberOps.lock(ctx, n.stop); err != nil {
		return fmt.Errorf("remove %s: waiting for a membership change or restore in progress: %w", id, err)
	}
	defer n.memberOps.unlock()
	// The leadership may have moved while this removal waited for another
	// change (AddMember says why that matters).
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return err
	}
	if !slices.ContainsFunc(cf.Configuration().Servers, func(s raft.Server) bool { return string(s.ID) == id }) {
		if _, ok := n.fsm.Members()[id]; ok {
			// Removed from Raft by an earlier try that did not finish
			// (leadership moved before its member entry went): finish it,
			// so that a retried remove succeeds.
			_, err := n.apply(ctx, encodeMemberGone(now(), id))
			return err
		}
		return fmt.Errorf("%w: no member %q", ErrInvalid, id)
	}
	voters := 0
	for _, s := range cf.Configuration().Servers {
		if s.Suffrage == raft.Voter && string(s.ID) != id {
			voters++
		}
	}
	if voters == 0 {
		return fmt.Errorf("%w: %q is the last voter; a cluster needs one", ErrInvalid, id)
	}
	if slices.ContainsFunc(cf.Configuration().Servers, func(s raft.Server) bool { return string(s.ID) == id && s.Suffrage == raft.Voter }) {
		// The voters left must be able to commit the removal and elect:
		// a quorum of them must answer. Removing a live voter (the leader
		// included) of 3 with one down leaves a live one and a down one,
		// which neither commit nor elect until the down one returns.
		// Removing a down member always passes: it is the way out.
		up, down, _, err := n.answeringNow(ctx, cf.Configuration().Servers, id, "")
		if err != nil {
			return fmt.Errorf("remove %s: %w", id, err)
		}
		if n.raft.State() != raft.Leader {
			return n.notLeader() // lost during the wait: its followers' silence says nothing
		}
		if need := voters/2 + 1; len(up) < need {
			return fmt.Errorf("%w: removing %s leaves %d voters, of which %d must answer to elect and commit, and only %d %s: remove the down members first (%s), or bring them back",
				ErrInvalid, id, voters, need, len(up), agree(len(up), "does", "do"), strings.Join(down, ", "))
		}
	}
	wait := ctx
	if id == n.cfg.ID {
		// A leader removing itself waits for the answer whatever ctx says
		// (Raft answers every configuration change: applied, or leadership
		// lost), so that a removal that commits late still shuts its Raft
		// down below instead of leaving it an idle follower.
		wait = context.WithoutCancel(ctx)
	}
	if err := n.await(wait, n.raft.RemoveServer(raft.ServerID(id), 0, n.cfg.ApplyTimeout)); err != nil {
		if id == n.cfg.ID && errors.Is(err, raft.ErrRaftShutdown) && !n.inConfiguration(id) {
			return nil // removed itself, and Close came before the answer
		}
		if errors.Is(err, raft.ErrRaftShutdown) {
			return fmt.Errorf("remove %s: %w", id, n.shutdownMaybeApplied())
		}
		return fmt.Errorf("remove %s: %w", id, n.raftError(err))
	}
	if id == n.cfg.ID {
		// This node just stepped down; the next leader keeps the table.
		// Its Raft stops, as Raft's ShutdownOnRemove would have stopped it.
		n.shutdownRaft()
		return nil
	}
	_, err := n.apply(ctx, encodeMemberGone(now(), id))
	return err
}

// inConfiguration reports whether id is in the latest Raft configuration
// (readable after Raft's shutdown too).
func (n *Node) inConfiguration(id string) bool {
	cf := n.raft.GetConfiguration()
	return cf.Error() != nil || slices.ContainsFunc(cf.Configuration().Servers, func(s raft.Server) bool { return string(s.ID) == id })
}

// TransferLeadership hands leadership to the voter toID ("" = the voter
// that answers whose log the leader saw match furthest). This node, a non-voter or no member as toID is
// ErrInvalid. It takes no memberOps: a transfer must not queue behind an
// add waiting for a slow catch-up, and a membership change it overtakes
// answers *NotLeaderError (they check leadership after each wait).
func (n *Node) TransferLeadership(ctx context.Context, toID string) error {
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	var f raft.Future
	if toID == n.cfg.ID {
		return fmt.Errorf("%w: %s already leads", ErrInvalid, toID)
	}
	if toID == "" {
		// Raft answers a lone voter's transfer with "cannot find peer":
		// the caller's mistake (a 400), said as such.
		cf := n.raft.GetConfiguration()
		if err := cf.Error(); err != nil {
			return err
		}
		other := slices.ContainsFunc(cf.Configuration().Servers, func(s raft.Server) bool {
			return s.Suffrage == raft.Voter && string(s.ID) != n.cfg.ID
		})
		if !other {
			return fmt.Errorf("%w: no other voter to take over", ErrInvalid)
		}
		up, down, _, err := n.answeringNow(ctx, cf.Configuration().Servers, n.cfg.ID, "")
		if err != nil {
			return fmt.Errorf("leadership transfer: %w", err)
		}
		if len(up) == 0 {
			return fmt.Errorf("leadership transfer: %w: no other voter answers (%s): is one up?", ErrUnreachable, strings.Join(down, ", "))
		}
		// The target is chosen here, among the voters that answer: Raft's
		// own choice (LeadershipTransfer with none) is the first voter with
		// the highest next index in configuration order, answering or not,
		// and on an idle cluster, where all are the same, that is the first
		// follower: one down failed the transfer, naming a node the caller
		// never chose. The one whose log the leader last saw match furthest
		// (commitWatch) takes over, the first in configuration order on a
		// tie.
		var to raft.Server
		var best uint64
		for _, s := range cf.Configuration().Servers {
			if !slices.Contains(up, string(s.ID)) {
				continue
			}
			if m := n.watch.contact(s.ID).matched; to.ID == "" || m > best {
				to, best = s, m
			}
		}
		toID = string(to.ID)
		f = n.leadershipTransfer(to.ID, to.Address)
	} else {
		// The Raft configuration is the authority on where a voter is; the
		// member table only adds HTTP addresses.
		cf := n.raft.GetConfiguration()
		if err := cf.Error(); err != nil {
			return err
		}
		var addr raft.ServerAddress
		ok, voter := false, false
		for _, s := range cf.Configuration().Servers {
			if string(s.ID) == toID {
				addr, ok, voter = s.Address, true, s.Suffrage == raft.Voter
			}
		}
		if !ok {
			return fmt.Errorf("%w: no member %q", ErrInvalid, toID)
		}
		// Raft sends a non-voter its TimeoutNow all the same: this leader
		// steps down, the cluster holds a needless election, and the
		// non-voter, which no quorum counts, does not lead.
		if !voter {
			return fmt.Errorf("%w: %s is not a voter (a member still catching up): only a voter can lead", ErrInvalid, toID)
		}
		// One that does not answer cannot take over: said at once, where
		// Raft would try its TimeoutNow RPC for up to an election timeout.
		_, down, _, err := n.answeringNow(ctx, cf.Configuration().Servers, n.cfg.ID, "")
		if err != nil {
			return fmt.Errorf("leadership transfer: %w", err)
		}
		if slices.Contains(down, toID) {
			return fmt.Errorf("leadership transfer: %w: %s does not answer the leader: is it up?", ErrUnreachable, toID)
		}
		f = n.leadershipTransfer(raft.ServerID(toID), addr)
	}
	if err := n.await(ctx, f); err != nil {
		switch {
		case errors.Is(err, raft.ErrLeadershipTransferInProgress):
			return fmt.Errorf("%w: a leadership transfer is already in progress; retry", ErrNoLeader)
		case err.Error() == "leadership transfer timeout": // raft has no sentinel for it
			return fmt.Errorf("leadership transfer: %w: the target %s did not take over within an election timeout (is it up and caught up?); retry", context.DeadlineExceeded, toID)
		case strings.HasPrefix(err.Error(), "failed to make TimeoutNow RPC"): // nor for this
			// Raft flattens the transport's error into its text (%v):
			// "failed to make TimeoutNow RPC to <id>: <err>". A failed
			// dial sent nothing: the target did not answer, and this node
			// still leads. Any other failure (a write or a read of the
			// answer that broke or timed out) may come after the target
			// took the TimeoutNow: it is a candidate then, and likely
			// wins the election, though this node leads for now. The
			// transfer's outcome is unknown: a 503 timeout, as when the
			// target did not take over in time.
			if rest, ok := strings.CutPrefix(err.Error(), "failed to make TimeoutNow RPC to "+toID+": "); ok && strings.HasPrefix(rest, "dial ") {
				return fmt.Errorf("leadership transfer: %w: %v: is it up?", ErrUnreachable, err)
			}
			return fmt.Errorf("leadership transfer: %w: %v: the target may have taken it and be taking over; check the cluster's leader before sending the transfer again", context.DeadlineExceeded, err)
		case errors.Is(err, raft.ErrRaftShutdown):
			return fmt.Errorf("leadership transfer: %w", n.shutdownMaybeApplied())
		}
		return fmt.Errorf("leadership transfer: %w", n.raftError(err))
	}
	return nil
}

// SaveSnapshot streams the leader's current state. A Barrier first makes
// sure everything committed is applied; the stream is read from one
// consistent view of the state database. A restore (a user's, or a
// leader's snapshot installed on a deposed leader) that replaces the
// state while the save reads it cuts the stream off: ErrStateReplaced,
// to save again; so does the node's Close: ErrSaveShutDown, to save
// again from another node.
func (n *Node) SaveSnapshot(ctx context.Context, w io.Writer) (SnapshotInfo, error) {
	if n.raft.State() != raft.Leader {
		return SnapshotInfo{}, n.notLeader()
	}
	if err := n.await(ctx, n.raft.Barrier(n.cfg.ApplyTimeout)); err != nil {
		return SnapshotInfo{}, fmt.Errorf("barrier: %w", n.raftError(err))
	}
	if h := n.fsm.Halted(); h != nil {
		// The Barrier passed, but the state stops before the entry the
		// FSM halted at: a save would lack what was acknowledged since.
		return SnapshotInfo{}, fmt.Errorf("snapshot save: %w: %w", ErrNoLeader, h)
	}
	view, replaced, err := n.fsm.view()
	if err != nil {
		return SnapshotInfo{}, err
	}
	defer view.Close()
	info, err := writeSnapshot(w, view)
	if err != nil {
		// A restore that closed the database under the view: the stream
		// is cut off, and a save sent again reads the restored state; or
		// the node's Close: another node answers a save sent again.
		return info, n.fsm.cutOff(err, replaced)
	}
	return info, nil
}

// uploadReader is a restore's upload that keeps the error its reader
// gave: a failed io.Copy does not say whether the upload or the spool
// file failed, which are the client's and this node's faults.
type uploadReader struct {
	r   io.Reader
	err error
}

func (u *uploadReader) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	if err != nil && err != io.EOF {
		u.err = err
	}
	return n, err
}

// receiveError says why a restore's upload could not be spooled; nothing
// was installed. An upload that ended before the length it promised (a
// client that went away mid-upload, a Content-Length or chunked body cut
// short) is a truncated snapshot, ErrBadSnapshot, as a stream cut short
// in its records is: the client's fault, not the node's (it was answered
// 500 internal). Another read error while ctx is done is ctx's (the
// client left); any other is kept as it is, so an *http.MaxBytesError
// still reads as too large. A spool file that failed is this node's.
func receiveError(ctx context.Context, readErr, err error) error {
	switch {
	case readErr == nil:
		return spoolError("spool the upload", err)
	case errors.Is(readErr, io.ErrUnexpectedEOF):
		return fmt.Errorf("restore: nothing was installed: %w: the upload was cut off: %v", ErrBadSnapshot, readErr)
	case ctx.Err() != nil:
		return fmt.Errorf("restore: nothing was installed: receive snapshot: %w (%w)", readErr, ctx.Err())
	}
	return fmt.Errorf("restore: nothing was installed: receive snapshot: %w", readErr)
}

// spoolError says why a restore's spool (the upload, or the stream with
// this cluster's member table) could not be made or written; nothing was
// installed. A full disk (ENOSPC, EDQUOT) is ErrInsufficientStorage, as
// checkRestoreSpace's refusal is (the API's 507, to free space and send
// it again): the disk can fill while an upload streams, after any check
// of its free space, and is the operator's to fix, not 500 internal.
func spoolError(what string, err error) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return fmt.Errorf("restore: nothing was installed: %w: %s: %w; free space (or move the data directory to a larger volume) and restore again",
			ErrInsufficientStorage, what, err)
	}
	return fmt.Errorf("restore: nothing was installed: %s: %w", what, err)
}

// RestoreSnapshot installs a snapshot stream on every node through Raft's
// user restore. The stream is spooled to a file and checked whole first:
// a truncated or corrupted one is refused and the cluster keeps its state.
// An upload that ends before the length it promised is truncated too
// (ErrBadSnapshot; see receiveError). A data directory with less free
// space than the restore needs refuses it before Raft stores it
// (ErrInsufficientStorage, checkRestoreSpace), nothing installed; a load
// that runs out of space all the same stops the node (FSM.userRestore).
//
// What Raft installs is the stream with its member table replaced by this
// cluster's (restoredMembers): the stream may come from another cluster,
// whose members' addresses forwarding and `members list` must not use.
// Nothing is applied after the install: a restore Raft installed answers
// success, and leadership moving during the install, or any other Raft
// error once Raft has read the stream (its one timer, which also bounds
// the no-op after the install, run out by a long install), is a
// *NotLeaderError with MaybeApplied set (it may be in place). Leadership
// that moves before Raft reads the stream (the upload's spool and check
// can take minutes) is a plain *NotLeaderError: nothing was installed,
// and the API forwards it to the new leader. Raft's other refusals before
// it reads the stream install nothing too, and say so, to retry: its timer
// run out before its main goroutine took the restore (ErrNotProposed), a
// membership change's entry not yet committed (ErrNoLeader). A ctx that
// ends before the node hands the rewritten stream to Raft stops the
// restore with ctx's error, nothing installed; from then on ctx no longer
// matters. So with Close: one that begins before the hand-over refuses
// the restore (ErrShutdown and ErrNotProposed, nothing installed: the
// API's 503 no_leader, to retry on another node); once Raft has the stream,
// Close waits until Raft's Restore returns before it shuts Raft down.
func (n *Node) RestoreSnapshot(ctx context.Context, r io.Reader) (SnapshotInfo, error) {
	if n.raft.State() != raft.Leader {
		return SnapshotInfo{}, n.notLeader()
	}
	tmp, err := os.CreateTemp(n.cfg.DataDir, "restore-*.snap")
	if err != nil {
		return SnapshotInfo{}, spoolError("create the spool", err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	upload := &uploadReader{r: r}
	if _, err := io.Copy(tmp, upload); err != nil {
		return SnapshotInfo{}, receiveError(ctx, upload.err, err)
	}
	if err := n.closingErr(); err != nil {
		return SnapshotInfo{}, err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return SnapshotInfo{}, err
	}
	// Checked whole, records and all, before Raft sees it: Raft's user
	// restore panics if the FSM refuses the stream.
	info, err := checkSnapshot(tmp, n.fsm.Index())
	if err != nil {
		return SnapshotInfo{}, err
	}
	// From the member table's read to the install, no membership change
	// made through this node may come between: its entries would be lost
	// under the restored table, or the table would lack a new voter.
	if err := n.memberOps.lock(ctx, n.stop); err != nil {
		if errors.Is(err, ErrShutdown) {
			return SnapshotInfo{}, errRestoreAtClose()
		}
		return SnapshotInfo{}, fmt.Errorf("restore: nothing was installed: waiting for a membership change in progress: %w", err)
	}
	defer n.memberOps.unlock()
	if err := n.closingErr(); err != nil {
		return SnapshotInfo{}, err
	}
	members, err := n.restoredMembers()
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("restore: read the member table: %w", err)
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return SnapshotInfo{}, err
	}
	out, err := os.CreateTemp(n.cfg.DataDir, "restore-*.snap")
	if err != nil {
		return SnapshotInfo{}, spoolError("create the spool", err)
	}
	defer os.Remove(out.Name())
	defer out.Close()
	written, err := replaceMembers(out, tmp, members)
	if err != nil {
		return SnapshotInfo{}, spoolError("put this cluster's member table in the stream", err)
	}
	// The upload is no longer needed: the disk holds one copy less while
	// Raft copies the stream into its snapshot store.
	tmp.Close()
	os.Remove(tmp.Name())
	if _, err := out.Seek(0, io.SeekStart); err != nil {
		return SnapshotInfo{}, err
	}
	if err := ctx.Err(); err != nil {
		return SnapshotInfo{}, fmt.Errorf("restore: nothing was installed: %w", err)
	}
	if err := n.checkRestoreSpace(written.Bytes); err != nil {
		return SnapshotInfo{}, err
	}
	// Index 0: Raft numbers the restore after its own last index. The
	// stream's index is another log's (the FSM does not keep it), and
	// Raft would number the restore after it when larger: a header index
	// of 2^64-1 wrapped to 0, and Raft handed the whole old log back to
	// the FSM over the restored state.
	meta := &raft.SnapshotMeta{Version: raft.SnapshotVersionMax, Index: 0, Term: written.Term, Size: written.Bytes}
	timeout := 10 * n.cfg.ApplyTimeout
	if n.cfg.beforeRestore != nil {
		n.cfg.beforeRestore()
	}
	// Close waits from here until Raft's Restore returns, and a Close that
	// began earlier refuses the restore (beginRestore).
	end, err := n.beginRestore()
	if err != nil {
		return SnapshotInfo{}, err
	}
	taken := &readMark{r: out}
	// FSM.Restore takes a failed load of this stream as fatal: Raft
	// panics on any error of a user restore's, which it has stored by
	// then (FSM.userRestore). Restores are serialized (memberOps).
	n.fsm.userRestore.Store(true)
	err = n.raft.Restore(meta, taken, timeout)
	n.fsm.userRestore.Store(false)
	end()
	if err != nil {
		if !taken.read.Load() && (errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost)) {
			// Raft never read the stream: the leadership moved after the
			// check above (the upload's spool and check can take
			// minutes), and Raft's follower loop refused the restore.
			// Nothing was installed anywhere: a plain NotLeaderError,
			// which the API forwards to the new leader.
			return SnapshotInfo{}, fmt.Errorf("restore: nothing was installed: %w", n.notLeader())
		}
		if errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrNotLeader) {
			// Raft restored this node's state, then lost its leadership
			// before the cluster confirmed the restore (the followers
			// install it meanwhile): it may be in place. A second restore
			// would drop what was applied since; see the cluster first.
			nle := n.notLeader()
			nle.MaybeApplied = true
			return SnapshotInfo{}, fmt.Errorf("%w: leadership moved during the restore (it may be installed): check the cluster's state before restoring again", nle)
		}
		if taken.read.Load() {
			// Raft took the stream: its errors after that (its one timer
			// for the hand-over and for the no-op after the install, run
			// out by a long install; a shutdown) do not say whether the
			// restore is in place. Not a timeout to retry: a second
			// restore would drop what was applied since.
			nle := n.notLeader()
			nle.MaybeApplied = true
			return SnapshotInfo{}, fmt.Errorf("%w: raft took the restore, then answered %v (it may be installed): check the cluster's state before restoring again",
				nle, n.raftError(err))
		}
		if errors.Is(err, raft.ErrEnqueueTimeout) {
			// Raft's main goroutine did not take the restore within its
			// timer (busy, a slow log write): it never read the stream
			// (its timeout after the install, on the no-op, comes with
			// the stream read, above). Nothing was installed: as an apply
			// Raft could not take in time, ErrNotProposed (the API's 503
			// no_leader), not the 503 timeout that says it may still apply.
			return SnapshotInfo{}, fmt.Errorf("restore: nothing was installed: %w: raft did not take the restore within %v: %w; retry", ErrNotProposed, timeout, n.raftError(err))
		}
		if strings.HasPrefix(err.Error(), "cannot restore snapshot now") { // raft has no sentinel for it
			// Raft refused the restore before it read the stream: its
			// latest configuration entry (a membership change, possibly
			// one whose caller gave up waiting) is not yet committed,
			// and a restore cannot carry a configuration that is not.
			// Nothing was installed, and the entry commits once the
			// followers take it: ErrNoLeader (the API's 503 no_leader),
			// to retry, as for a leadership transfer in progress.
			return SnapshotInfo{}, fmt.Errorf("restore: nothing was installed: %w: a membership change is committing, and raft takes a restore only once it has (%v); retry", ErrNoLeader, err)
		}
		return SnapshotInfo{}, fmt.Errorf("raft restore: %w", n.raftError(err))
	}
	return info, nil
}

// The free space a user restore needs beyond the spool it reads:
// restoreSpaceFactor times the stream's size, and restoreSpaceMargin.
// Raft copies the stream into snapshots/ (its size), then the FSM loads
// it into fsm.restore/ beside fsm/ (measured at 0.74 of the stream's size
// for 40k and 200k blocks, plus Pebble's few KiB): counted at the
// stream's size, and once more for the compactions Pebble starts on the
// restored state. The margin covers Pebble's own files, meta.json and
// what the node writes meanwhile.
const (
	restoreSpaceFactor = 3
	restoreSpaceMargin = 16 << 20
)

// checkRestoreSpace refuses a user restore of a stream of streamBytes
// (ErrInsufficientStorage, nothing installed) when the data directory's
// file system has less free space than it needs. Once Raft has stored a
// user restore it cannot take it back: a load that fails then stops the
// node (FSM.Restore). Space can still run out (another writer), but not
// for want of checking. A free space that cannot be read is logged, and
// the restore goes on.
func (n *Node) checkRestoreSpace(streamBytes int64) error {
	free := diskFree
	if n.cfg.diskFree != nil {
		free = n.cfg.diskFree
	}
	avail, err := free(n.cfg.DataDir)
	if err != nil {
		n.logger.Warn("restore: reading the data directory's free space failed; restoring without checking it", "err", err)
		return nil
	}
	if err := restoreSpaceError(n.cfg.DataDir, streamBytes, avail); err != nil {
		return fmt.Errorf("restore: nothing was installed: %w", err)
	}
	return nil
}

// restoreSpaceError is ErrInsufficientStorage, saying what is needed and
// what to do, when avail bytes free in dir are too few for a restore of
// a stream of streamBytes; nil otherwise. A seed (SeedDataDir) writes
// what a user restore does, Raft's snapshot and the state's load.
func restoreSpaceError(dir string, streamBytes int64, avail uint64) error {
	need := restoreSpaceFactor*uint64(max(streamBytes, 0)) + restoreSpaceMargin
	if avail >= need {
		return nil
	}
	return fmt.Errorf("%w: the restore needs %d bytes free in %s (%d times the %d-byte snapshot, for Raft's copy and the state's load, and %d MiB), and %d are free; free space (or move the data directory to a larger volume) and restore again",
		ErrInsufficientStorage, need, dir, restoreSpaceFactor, streamBytes, restoreSpaceMargin>>20, avail)
}

// readMark is a reader that records whether it was read: Raft reads a
// user restore's stream only once it has taken the restore.
type readMark struct {
	r    io.Reader
	read atomic.Bool
}

func (m *readMark) Read(p []byte) (int, error) {
	m.read.Store(true)
	return m.r.Read(p)
}

// hookedLogs is the log store with Config.beforeLogWrite called before
// each write (tests). The store's other methods, and the interfaces Raft
// looks for (MonotonicLogStore), are the store's own.
type hookedLogs struct {
	*store.LogStore
	before func([]*raft.Log)
}

func (h hookedLogs) StoreLog(l *raft.Log) error { return h.StoreLogs([]*raft.Log{l}) }

func (h hookedLogs) StoreLogs(logs []*raft.Log) error {
	h.before(logs)
	return h.LogStore.StoreLogs(logs)
}

// restoredMembers is the member table a restore installs: this cluster's
// entry for each server of its latest Raft configuration, or the
// server's Raft address alone when the table has no entry for it.
// Entries of servers not in the configuration are left out.
func (n *Node) restoredMembers() ([]Member, error) {
	cf := n.raft.GetConfiguration()
	if err := cf.Error(); err != nil {
		return nil, err
	}
	// With the entries the leadership set-up records (onLeadership): a
	// restore right after an election, before they applied (on a new
	// cluster's first leader, none yet), installed a table of the
	// configuration's servers without an HTTP address. The leader wrote
	// its own again (assertSelf), and nothing the other members', listed
	// without one for good: the set-up records only a peer with no entry.
	table := maps.Clone(n.fsm.Members())
	for _, m := range n.setUpEntries(n.raft.CurrentTerm(), table, serverAddrs(cf.Configuration())) {
		table[m.ID] = m
	}
	var out []Member
	for _, s := range cf.Configuration().Servers {
		m, ok := table[string(s.ID)]
		if !ok {
			m = Member{ID: string(s.ID), RaftAddr: string(s.Address)}
		}
		out = append(out, Member{ID: m.ID, RaftAddr: m.RaftAddr, HTTPAddr: m.HTTPAddr})
	}
	return out, nil
}

// memberLock orders the membership changes made through a node
// (AddMember, RemoveMember) and its restores (RestoreSnapshot), which
// replace the member table. It is taken with a context, as a restore may
// hold it for long, and the node's stop channel: a caller waiting for it
// when the node closes gets ErrShutdown.
type memberLock struct {
	ch      chan struct{}
	waiting atomic.Int32 // callers waiting for it (tests)
}

func (l *memberLock) lock(ctx context.Context, stop <-chan struct{}) error {
	select {
	case l.ch <- struct{}{}:
		return nil
	default:
	}
	l.waiting.Add(1)
	defer l.waiting.Add(-1)
	select {
	case l.ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-stop:
		return ErrShutdown
	}
}

func (l *memberLock) unlock() { <-l.ch }

// WorkerTable returns the replicated worker registrations by worker id.
// The map is shared with the FSM: read it, never change it. It never
// blocks.
func (n *Node) WorkerTable() map[uint64]WorkerInfo { return n.fsm.Workers() }

// FindMatches looks a prompt's content hashes up in this node's index (no
// early exit); see indexer.Index.FindMatchesByTier.
func (n *Node) FindMatches(local []uint64, view indexer.View, out *indexer.Matches) {
	start := time.Now()
	n.fsm.Index().FindMatchesByTier(local, view, false, out)
	observeSince(n.lookupSeconds, start)
}

// DumpRank returns a copy of one rank's index state;
// indexer.ErrUnknownRank when the index holds nothing of it.
func (n *Node) DumpRank(r kvevent.Rank) (indexer.RankDump, error) {
	return n.fsm.Index().DumpRank(r)
}

// Reserve books a request on a rank the caller chose, through Raft
// (semantics.md §6). Idempotent by b.ID: an id already live on b.Rank (a
// retry) books nothing more and returns nil. Otherwise nothing is booked
// and the error says why, as it stands when the entry applies: an id live
// on another rank is a *BookedElsewhereError (ErrBookedElsewhere) naming
// it; an id booked and freed (or expired) before, whose tombstone stands
// (BookingMaxAge from its booking), is ErrBookingFreed, as request ids are
// single-use; a rank no registered worker has is indexer.ErrUnknownRank.
// Until its entry applies, the booked routes this leader decides count
// it, as they count each other's (pendingBooks).
func (n *Node) Reserve(ctx context.Context, b Booking) error {
	switch {
	case b.ID == "":
		return fmt.Errorf("%w: empty request id", ErrInvalid)
	case b.ISL <= 0 || b.ISL > MaxISL:
		return fmt.Errorf("%w: request %q: input length %d (want 1 to %d)", ErrInvalid, b.ID, b.ISL, MaxISL)
	case b.CachedTokens < 0 || b.CachedTokens > b.ISL:
		return fmt.Errorf("%w: request %q: %d cached tokens of %d", ErrInvalid, b.ID, b.CachedTokens, b.ISL)
	}
	// Pending until its apply settles it, as a booked route's booking
	// (pendingBooks): the booked routes decided meanwhile count it.
	pending := &n.fsm.pending
	pending.mu.Lock()
	ticket := pending.p.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens)
	pending.mu.Unlock()
	resp, err := n.apply(ctx, encodeBook(now(), []bookOp{{kind: bookAdd, b: b}}))
	pending.drop(b.ID, ticket)
	if err != nil {
		return err
	}
	bo, _ := resp.(bookOutcome)
	switch {
	case bo.left:
		return fmt.Errorf("book %s: %w: %v is not a registered rank", b.ID, indexer.ErrUnknownRank, b.Rank)
	case bo.freed:
		return fmt.Errorf("book %s: %w", b.ID, ErrBookingFreed)
	case !bo.live:
		return fmt.Errorf("%w: book %s: nothing booked: %v", ErrInvalid, b.ID, bo.err)
	case bo.rank != b.Rank:
		return fmt.Errorf("book %s on %v: %w", b.ID, b.Rank, &BookedElsewhereError{ID: b.ID, Rank: bo.rank})
	}
	return nil
}

// NoDecay, as OutputBlock's weight, leaves the request's decay weight as
// it is.
const NoDecay = -1

// OutputBlock records, through Raft, that booked request id produced an
// output block of sequence hash h: it counts as decode load on the
// request's rank until the request is freed. A weight in [0,
// indexer.DecayScale] also sets, in the same entry, how much the blocks
// the request alone holds count (indexer.Sequences.SetDecay); NoDecay
// leaves it. Idempotent by (id, h, weight).
//
// A request that holds indexer.MaxBookingBlocks blocks already takes no
// more: ErrInvalid, proposing nothing, unless it holds h (a resend of the
// call whose block filled it, which changes nothing). Every replica's
// apply refuses such an add too (one proposed before this node had
// applied the last one that filled the booking), changing nothing, and
// takes an h held as it does below the cap: no change.
func (n *Node) OutputBlock(ctx context.Context, id string, h uint64, weight int64) error {
	if id == "" {
		return fmt.Errorf("%w: empty request id", ErrInvalid)
	}
	if weight != NoDecay && (weight < 0 || weight > indexer.DecayScale) {
		return fmt.Errorf("%w: request %q: decay weight %d outside [0, %d]", ErrInvalid, id, weight, indexer.DecayScale)
	}
	// Holds only at the cap: it may build the booking's set of blocks.
	if held, ok := n.fsm.Sequences().Blocks(id); ok && held >= indexer.MaxBookingBlocks && !n.fsm.Sequences().Holds(id, h) {
		return fmt.Errorf("%w: request %q holds %d blocks, the most a booking may hold (%d): it takes no more output blocks",
			ErrInvalid, id, held, indexer.MaxBookingBlocks)
	}
	ops := []bookOp{{kind: bookOutput, b: Booking{ID: id, SeqHashes: []uint64{h}}}}
	if weight != NoDecay {
		ops = append(ops, bookOp{kind: bookDecay, b: Booking{ID: id, Discount: uint32(indexer.DecayScale - weight)}})
	}
	_, err := n.apply(ctx, encodeBook(now(), ops))
	return err
}

// Booking returns live request id's booking from this node's load
// tracker; false when it is unknown or freed.
func (n *Node) Booking(id string) (indexer.Booking, bool) { return n.fsm.Sequences().Get(id) }

// Loads returns every rank's load from this node's load tracker, in rank
// order; ranks without a live booking are left out.
func (n *Node) Loads() []indexer.RankLoad { return n.fsm.Sequences().Loads(nil) }

// PotentialLoads returns, for every rank with a live booking, its load and
// the decode blocks it would hold with a request of sequence hashes seq
// too; idle is that figure for a rank without bookings.
func (n *Node) PotentialLoads(seq []uint64) (loads []indexer.RankLoad, idle int64) {
	var sc indexer.PotentialScratch
	return n.fsm.Sequences().PotentialDecodeBlocks(nil, seq, &sc)
}

// CheckLeader returns nil on a leader whose state holds every entry
// committed before its term, and elsewhere the error a write would return
// (a *NotLeaderError naming the leader when one is known). Handlers that
// validate a write against the replicated state call it first, so that a
// follower's slightly stale state never judges a write: the leader's
// does, after the forward. A new leader whose post-election Barrier has
// not passed answers ErrNoLeader (retry): its state may still lack
// entries its predecessor acknowledged, and a read-modify-write judged on
// it would undo them.
func (n *Node) CheckLeader() error {
	if n.raft.State() != raft.Leader {
		return n.notLeader()
	}
	if !n.ledThisTerm() {
		return fmt.Errorf("%w: this node was just elected and has not yet applied every entry of the terms before its own; retry", ErrNoLeader)
	}
	if h := n.fsm.Halted(); h != nil {
		// Its set-up's Barrier passed (Raft answers it whatever the FSM
		// did), but its state lacks the entry it halted at and every one
		// after it, which its predecessor may have acknowledged.
		return fmt.Errorf("%w: %w", ErrNoLeader, h)
	}
	return nil
}

// RegisteredAt returns when worker id last registered: unix nanos of the
// clock of the leader that proposed the registration, or 0 when not since
// this node started (FSM.RegisteredAt). The lease sweep (eventplane) counts
// a registration as a sign of life.
func (n *Node) RegisteredAt(id uint64) int64 { return n.fsm.RegisteredAt(id) }

// WorkersMutex returns the lock that orders the worker-table writes made
// through this node: the compatible APIs read the table and write it back
// under it, and /v1 registrations and the lease sweep's removals write
// under it too, so that a read-modify-write never undoes a write made
// between its read and its write. Hold it around the write (a Raft
// apply) only, never across a forward to another node.
func (n *Node) WorkersMutex() *sync.Mutex { return &n.workersMu }

// LockWorkers takes b's worker-table lock when b has one (a *Node, or a
// value that wraps one: WorkersMutex) and returns its unlock; for any
// other b it does nothing.
func LockWorkers(b any) (unlock func()) {
	if l, ok := b.(interface{ WorkersMutex() *sync.Mutex }); ok {
		m := l.WorkersMutex()
		m.Lock()
		return m.Unlock
	}
	return func() {}
}

// UnregisteredRanks returns the ranks this node holds state of that no
// registration lists (FSM.UnregisteredRanks): DeregisterWorker of their
// worker removes those of a worker not registered, RemoveUnregisteredRanks
// those of a registered one.
func (n *Node) UnregisteredRanks() []kvevent.Rank { return n.fsm.UnregisteredRanks() }

// RemoveUnregisteredRanks removes through Raft the state of each of ranks
// that no registration lists when the entry applies, and returns how many
// it removed (the others were registered meanwhile, and keep theirs). It
// writes a command type that nodes of builds before it skip as
// undecodable (docs/operations.md, "Upgrade").
func (n *Node) RemoveUnregisteredRanks(ctx context.Context, ranks []kvevent.Rank) (int, error) {
	if len(ranks) == 0 {
		return 0, nil
	}
	res, err := n.apply(ctx, encodeRemoveRanks(now(), ranks))
	if err != nil {
		return 0, err
	}
	removed, _ := res.(int)
	return removed, nil
}

// Cursor returns rank r's last applied event id on this node.
func (n *Node) Cursor(r kvevent.Rank) uint64 { return n.fsm.Cursor(r) }

// HasCursor reports whether this node holds a cursor of rank r
// (FSM.HasCursor).
func (n *Node) HasCursor(r kvevent.Rank) bool { return n.fsm.HasCursor(r) }

// RankNeedsResync reports whether this node flags rank r as needing a
// resync (indexer.Index.RankNeedsResync): an orphan of it was dropped, or
// an operator's restore flagged every rank (replaceMembers).
func (n *Node) RankNeedsResync(r kvevent.Rank) bool { return n.fsm.Index().RankNeedsResync(r) }

// agree is the verb that agrees with a count of n: one for 1, other for
// any other count ("only 1 does", "only 2 do").
func agree(n int, one, other string) string {
	if n == 1 {
		return one
	}
	return other
}
