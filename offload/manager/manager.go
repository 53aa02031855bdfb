package manager

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

var (
	// ErrInvalid means an argument can never be valid: a bad Config, a zero
	// hash, mismatched slices, a G1 block named twice in one Onboard.
	ErrInvalid = errors.New("invalid argument")
	// ErrBadBlock means a G1 block id is outside the region.
	ErrBadBlock = errors.New("G1 block id out of range")
	// ErrClosed means the Manager was closed.
	ErrClosed = errors.New("offload manager closed")
)

// Path is a direction blocks are copied in. Each path that the Config
// allows has its own workers.
type Path uint8

const (
	// D2H copies G1 → G2: the write-through of blocks with a priority.
	D2H Path = iota
	// D2Disk copies G1 → G3 through a host staging buffer, when there is
	// no G2 pool; only blocks the frequency filter passes.
	D2Disk
	// H2Disk copies G2 → G3: the promotion of blocks seen often enough.
	H2Disk
	// H2D copies G2 → G1: onboarding (also the second hop of a G3 block,
	// from the staging buffer, with or without a G2 pool).
	H2D
	// Disk2H reads G3 → a host staging buffer, the first hop of onboarding
	// a block only G3 holds.
	Disk2H
	// NumPaths is the number of paths.
	NumPaths
)

var (
	pathNames = [NumPaths]string{"d2h", "d2disk", "h2disk", "h2d", "disk2h"}
	pathEnds  = [NumPaths][2]kvevent.Tier{
		{kvevent.TierDevice, kvevent.TierHostPinned},
		{kvevent.TierDevice, kvevent.TierDisk},
		{kvevent.TierHostPinned, kvevent.TierDisk},
		{kvevent.TierHostPinned, kvevent.TierDevice},
		{kvevent.TierDisk, kvevent.TierHostPinned},
	}
)

func (p Path) String() string {
	if p < NumPaths {
		return pathNames[p]
	}
	return fmt.Sprintf("path(%d)", uint8(p))
}

// From is the tier the path copies from.
func (p Path) From() kvevent.Tier { return pathEnds[p][0] }

// To is the tier the path copies to (TierHostPinned for Disk2H's staging).
func (p Path) To() kvevent.Tier { return pathEnds[p][1] }

// NoPriority marks an OffloadRequest whose block is not to be written
// through. Any negative Priority means the same.
const NoPriority = -1

// An OffloadRequest asks for one G1 block to be copied to G2 (or to G3 when
// there is no G2).
type OffloadRequest struct {
	// G1Block is the block's id in the G1 region; it must hold the block's
	// final bytes (the engine has finished writing it).
	G1Block int
	// Hash is the block's sequence hash (never 0), Parent the previous
	// block's (0 for the first block of a sequence), Local its content
	// hash; they go into the STORE events as pool.Block does.
	Hash, Parent, Local uint64
	// Priority orders the queue, higher first. A negative priority
	// (NoPriority) means the block is not written through.
	Priority int
}

// OffloadResult counts what Offload did with a batch of requests.
type OffloadResult struct {
	// Queued counts the requests queued for a copy.
	Queued int
	// Shed counts the tasks a full queue dropped during the call: requests
	// of this call whose priority was below everything queued, or older
	// queued tasks of the lowest priority that made room for this call's.
	Shed int
	// Invalid counts the requests refused: a G1 block id out of range, a
	// zero hash, a block that is its own parent. They change nothing.
	Invalid int
	// NoPriority counts the requests without a priority (not written). Such
	// a request for a G1 block that carries a different hash still drops
	// that block's old task (a reuse without a Free).
	NoPriority int
	// Duplicate counts requests for a block already offloaded from the same
	// G1 block since it was last freed (nothing to do): its task is still
	// queued or running, or its copy stored it, or (without G2) the filter
	// found it cold. A task that was shed, or whose copy stored nothing
	// (no room in the pool, a failed copy or write), leaves no duplicate:
	// asking again queues it again.
	Duplicate int
	// Cold counts, without a G2 pool, the requests the frequency filter
	// did not pass: not yet seen often enough to be written to disk.
	Cold int
	// NoDisk counts, without a G2 pool, the requests that passed the
	// filter but were not queued because the disk pool has shut down (see
	// Stats.DiskDown).
	NoDisk int
}

// Config configures a Manager.
type Config struct {
	// Rank is the engine rank whose G1 region this is; it labels metrics.
	Rank kvevent.Rank
	// Backend copies the blocks; G1, Host and Disk's staging all live in it.
	Backend backend.Backend
	// G1 is the engine's KV cache region (see MapRegion).
	G1 Region
	// Host is the G2 pool, or nil: then offloads go straight to Disk
	// (D2Disk) and onboarding from Disk goes through a staging buffer.
	Host *pool.HostPool
	// Disk is the G3 pool, or nil: then nothing is written to disk. Host
	// and Disk must not both be nil; their block size must be G1's.
	Disk *pool.DiskPool
	// QueueCapacity bounds each offload queue (D2H or D2Disk, and H2Disk),
	// in blocks; default 4096.
	QueueCapacity int
	// Workers is the number of copy workers per path; default 2.
	Workers int
	// BatchSize is the most blocks one worker copies at once; default 16.
	BatchSize int
	// Filter decides which blocks go to G3.
	Filter FilterConfig
	// OnboardTimeout bounds every Onboard whose context has no deadline
	// (a context deadline is kept, even a later one); default 1s.
	OnboardTimeout time.Duration
	// Registerer, when set, gets the manager's metrics (kvagent_offload_*),
	// labelled with Rank. Close unregisters them.
	Registerer prometheus.Registerer
	// Logger; nil is slog.Default().
	Logger *slog.Logger
}

const (
	defaultQueueCapacity  = 4096
	defaultWorkers        = 2
	defaultBatchSize      = 16
	defaultOnboardTimeout = time.Second
)

func (c *Config) check() error {
	switch {
	case c.Backend == nil:
		return fmt.Errorf("%w: nil backend", ErrInvalid)
	case c.Host == nil && c.Disk == nil:
		return fmt.Errorf("%w: neither a host nor a disk pool", ErrInvalid)
	case c.QueueCapacity < 0 || c.Workers < 0 || c.BatchSize < 0 || c.OnboardTimeout < 0:
		return fmt.Errorf("%w: queue capacity %d, workers %d, batch size %d, onboard timeout %v",
			ErrInvalid, c.QueueCapacity, c.Workers, c.BatchSize, c.OnboardTimeout)
	}
	if err := c.G1.Validate(); err != nil {
		return err
	}
	if c.Host != nil {
		if bs := c.Host.Stats().BlockSize; bs != c.G1.BlockSize {
			return fmt.Errorf("%w: host pool block size %d, G1 block size %d", ErrInvalid, bs, c.G1.BlockSize)
		}
	}
	if c.Disk != nil {
		if bs := c.Disk.Stats().BlockSize; bs != c.G1.BlockSize {
			return fmt.Errorf("%w: disk pool block size %d, G1 block size %d", ErrInvalid, bs, c.G1.BlockSize)
		}
	}
	if err := c.Filter.check(); err != nil {
		return err
	}
	if c.QueueCapacity == 0 {
		c.QueueCapacity = defaultQueueCapacity
	}
	if c.Workers == 0 {
		c.Workers = defaultWorkers
	}
	if c.BatchSize == 0 {
		c.BatchSize = defaultBatchSize
	}
	// A worker's staging buffer is BatchSize blocks (see newCopier): a
	// product that wrapped would allocate a short buffer that the first
	// batch slices past, a panic in a worker.
	if c.BatchSize > math.MaxInt/c.G1.BlockSize {
		return fmt.Errorf("%w: batch size %d × G1 block size %d bytes overflows", ErrInvalid, c.BatchSize, c.G1.BlockSize)
	}
	if c.OnboardTimeout == 0 {
		c.OnboardTimeout = defaultOnboardTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Manager moves KV blocks between the engine's G1 region and the G2 and G3
// pools: write-through offload, promotion to disk, and onboarding back into
// G1. See the package documentation for what it guarantees.
//
// All methods are safe for concurrent use.
type Manager struct {
	cfg  Config
	be   backend.Backend
	g1   Region
	host *pool.HostPool
	disk *pool.DiskPool
	log  *slog.Logger
	bs   int

	// gens[id] is G1 block id's generation: Free (and Onboard, which
	// overwrites its destinations) bumps it. A task holds the generation
	// it was queued at; see Free for what checking it guarantees.
	gens []atomic.Uint64

	// diskDown is set once the disk pool is seen shut down (see diskUp).
	diskDown atomic.Bool
	// diskWriteLog rate-limits the lines of failed writes to the disk
	// pool (see failedDiskWrite).
	diskWriteLog *lograte.Limiter
	// testHookBatch, nil outside tests (export_test.go sets it), is called
	// by an offload worker between taking a batch and running it: a test
	// holds a worker there to change the world under a batch taken.
	testHookBatch atomic.Pointer[func(Path, int)]
	// testHookH2DiskPut, nil outside tests (export_test.go sets it), is
	// called by an H2Disk worker with the G2 blocks it has pinned, right
	// before their bytes are written to G3: a test holds the write there.
	testHookH2DiskPut atomic.Pointer[func([]uint64)]

	mu        sync.Mutex
	closed    bool
	refused   bool            // by Refuse or Close: Offload and Onboard fail with ErrClosed
	lanes     [NumPaths]*lane // nil for a path the Config does not allow
	g1s       []g1State       // per G1 block, for the current generation
	promoting map[uint64]*task
	filter    *Sightings[promotion]
	stats     Stats // counters; Depth, InFlight and Tracked are filled in by Stats

	closing    chan struct{} // closed by Close
	wg         sync.WaitGroup
	copiers    []*copier
	metrics    *metrics
	unregister func()
}

// g1State is what the manager knows of a G1 block in its current
// generation: the hash last offloaded from it, and its queued task.
type g1State struct {
	hash   uint64
	queued *task
}

// A lane is one path's work: a priority queue of tasks (offload paths) or a
// FIFO of chunks (onboarding paths), and the workers' condition variable.
// Guarded by Manager.mu.
type lane struct {
	path     Path
	cond     sync.Cond
	q        *taskQueue
	chunks   []*chunk
	depth    int // blocks in chunks
	inflight int // blocks taken by workers, not finished
}

// New starts a Manager on the pools and G1 region of cfg, with its workers.
// It fails with ErrInvalid on a bad Config, or with the backend's error when
// it cannot create the workers' streams and staging buffers. The pools,
// the backend and the region stay the caller's: close them after Close.
// It is Prepare and Start.
func New(cfg Config) (*Manager, error) {
	p, err := Prepare(cfg)
	if err != nil {
		return nil, err
	}
	return p.Start()
}

// A Prepared is a Manager that is made and not started: its workers'
// streams, events and staging buffers exist, but no worker runs and its
// metrics are not registered. Start it, once.
type Prepared struct {
	m      *Manager
	starts []start
}

// A start is a worker to start: its lane and its copier.
type start struct {
	l *lane
	c *copier
}

// Prepare does the part of New that can fail for want of resources: it
// checks cfg and creates the workers' streams, events and staging buffers,
// and fails as New does. Start is left with registering the metrics, which
// name the rank, so a caller replacing a rank's manager prepares the new
// one while the old one still runs, and closes the old one (unregistering
// its metrics) only once the new one has all it needs.
func Prepare(cfg Config) (*Prepared, error) {
	if err := cfg.check(); err != nil {
		return nil, fmt.Errorf("new offload manager: %w", err)
	}
	m := &Manager{
		cfg:          cfg,
		diskWriteLog: lograte.New(diskWriteLogEvery, nil),
		be:           cfg.Backend,
		g1:           cfg.G1,
		host:         cfg.Host,
		disk:         cfg.Disk,
		log:          cfg.Logger.With("component", "offload.manager", "rank", cfg.Rank.String()),
		bs:           cfg.G1.BlockSize,
		gens:         make([]atomic.Uint64, cfg.G1.Blocks),
		g1s:          make([]g1State, cfg.G1.Blocks),
		promoting:    make(map[uint64]*task),
		filter:       &Sightings[promotion]{cfg: cfg.Filter, m: make(map[uint64]sighting[promotion])}, // cfg.Filter checked above
		closing:      make(chan struct{}),
	}
	type plan struct {
		path  Path
		queue bool // a task queue (else a chunk FIFO)
		stage bool // workers need a staging buffer
	}
	var plans []plan
	if m.host != nil {
		plans = append(plans, plan{D2H, true, false}, plan{H2D, false, false})
		if m.disk != nil {
			plans = append(plans, plan{H2Disk, true, false})
		}
	} else {
		plans = append(plans, plan{D2Disk, true, true})
	}
	if m.disk != nil {
		plans = append(plans, plan{Disk2H, false, true})
	}
	var starts []start
	for _, p := range plans {
		l := &lane{path: p.path}
		l.cond.L = &m.mu
		if p.queue {
			l.q = newTaskQueue(cfg.QueueCapacity)
		}
		m.lanes[p.path] = l
		for range cfg.Workers {
			c, err := newCopier(m.be, p.path != H2Disk, p.stage, cfg.BatchSize*m.bs)
			if err != nil {
				m.freeCopiers()
				return nil, fmt.Errorf("new offload manager: %s worker: %w", p.path, err)
			}
			m.copiers = append(m.copiers, c)
			starts = append(starts, start{l, c})
		}
	}
	m.metrics = newMetrics(m)
	m.unregister = func() {}
	return &Prepared{m: m, starts: starts}, nil
}

// Start registers the manager's metrics with Config.Registerer and starts
// its workers. It fails only when the metrics cannot be registered (the
// rank's are already, by another manager): then it discards p.
func (p *Prepared) Start() (*Manager, error) {
	m := p.m
	if reg := m.cfg.Registerer; reg != nil {
		if err := reg.Register(m.metrics); err != nil {
			m.freeCopiers()
			return nil, fmt.Errorf("new offload manager: register metrics of rank %s: %w", m.cfg.Rank, err)
		}
		m.unregister = func() { reg.Unregister(m.metrics) }
	}
	for _, s := range p.starts {
		m.wg.Add(1)
		if s.l.q != nil {
			go m.runTasks(s.l, s.c)
		} else {
			go m.runChunks(s.l, s.c)
		}
	}
	return m, nil
}

// Offload queues copies of G1 blocks to G2 (D2H), or, without a G2 pool, to
// G3 (D2Disk) for the blocks the frequency filter passes. It never waits
// for a copy or the disk: it checks the requests, counts each as a sighting
// for the frequency filter, and queues a task per block, shedding the
// lowest-priority task when the queue is full (see OffloadResult); for a
// block seen often enough it also asks the host pool (in memory) whether
// the block is there already, to queue its promotion to G3. A
// request without a priority, or for a block already offloaded from the same
// G1 block in its current generation, is counted and queues nothing
// (see OffloadResult.Duplicate: a shed or failed task does not count), but
// the first still counts as a reuse of its G1 block (below).
//
// A queued task is a weak reference to its G1 block: if the block is freed
// (Free, or Onboard into it) before its copy has finished, the copy is
// skipped or discarded and no STORE is published for it. A valid request
// for a G1 block that still carries a different hash, with or without a
// priority, is taken as the engine having reused the block without a Free:
// the block is freed first (its old task is skipped, a copy of it running
// is discarded). An invalid request changes nothing.
//
// The block's STORE event is published by the pool when its copy has
// finished. Offload fails only with ErrClosed (after Refuse or Close).
func (m *Manager) Offload(reqs []OffloadRequest) (OffloadResult, error) {
	var (
		res    OffloadResult
		hot    []promotion
		path   = D2H
		noDisk bool
	)
	if m.host == nil {
		path = D2Disk
		noDisk = !m.diskUp()
	}
	m.mu.Lock()
	if m.refused {
		m.mu.Unlock()
		return res, fmt.Errorf("offload: %w", ErrClosed)
	}
	l := m.lanes[path]
	ps := &m.stats.Paths[path]
	for _, r := range reqs {
		b := pool.Block{Hash: r.Hash, Parent: r.Parent, Local: r.Local}
		if m.g1.Check(r.G1Block) != nil || r.Hash == 0 || r.Parent == r.Hash {
			res.Invalid++
			continue
		}
		st := &m.g1s[r.G1Block]
		if st.hash != 0 && st.hash != r.Hash {
			// Reused without a Free: whatever was queued or is being
			// copied from this block is of bytes that are gone, whatever
			// this request's priority.
			m.freeLocked(r.G1Block)
		}
		if r.Priority < 0 {
			res.NoPriority++
			continue
		}
		if st.hash == r.Hash {
			res.Duplicate++
			continue
		}
		st.hash = r.Hash
		n := m.filter.See(r.Hash, &promotion{b, r.Priority})
		if path == D2Disk && !m.filter.Hot(n) {
			res.Cold++
			continue
		}
		if noDisk {
			res.NoDisk++
			continue
		}
		if path == D2H && m.disk != nil && m.filter.Hot(n) {
			// Maybe in G2 already (a block seen again): promote now. A
			// block not in G2 yet is promoted when its copy commits.
			hot = append(hot, promotion{b, r.Priority})
		}
		t := newTask(r.Priority, r.G1Block, m.gens[r.G1Block].Load(), b)
		st.queued = t
		shed := l.q.push(t)
		if shed != t {
			res.Queued++
			ps.Queued++
			l.cond.Signal()
		}
		if shed != nil {
			m.shedLocked(shed)
			res.Shed++
			ps.Shed++
		}
	}
	m.stats.Invalid += uint64(res.Invalid)
	m.stats.NoPriority += uint64(res.NoPriority)
	m.stats.Duplicates += uint64(res.Duplicate)
	m.stats.Cold += uint64(res.Cold)
	m.stats.NoDisk += uint64(res.NoDisk)
	m.mu.Unlock()
	m.promote(hot)
	return res, nil
}

// Free tells the manager that the engine freed G1 blocks, or is about to
// write other data into them. It never blocks on a copy. Call it before
// the engine writes into a block again: that is what the guarantee rests
// on.
//
// Guarantee: each block's generation is bumped before Free returns; a
// queued task for it is dropped, and a copy of it already running is
// discarded when it finishes (the G2 reservation is aborted, nothing is
// written to G3, no STORE). A STORE is therefore published only for a copy
// that finished while its G1 block was still in the generation the Offload
// saw, so the bytes stored are the bytes the block held at Offload, provided
// the engine did not write into the block before calling Free. The price:
// a copy that happened to finish just before the Free is discarded too.
//
// Free of an id out of range returns an error wrapping ErrBadBlock; the
// other ids are freed all the same. It also works after Close.
func (m *Manager) Free(g1Blocks ...int) error {
	var errs []error
	m.mu.Lock()
	for _, id := range g1Blocks {
		if err := m.g1.Check(id); err != nil {
			errs = append(errs, err)
			continue
		}
		m.freeLocked(id)
	}
	m.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("free: %w", err)
	}
	return nil
}

// freeLocked starts a new generation of G1 block id and drops its queued
// task. The caller holds m.mu and has checked id.
func (m *Manager) freeLocked(id int) {
	m.gens[id].Add(1)
	st := &m.g1s[id]
	st.hash = 0
	if t := st.queued; t != nil {
		st.queued = nil
		for _, p := range []Path{D2H, D2Disk} {
			if l := m.lanes[p]; l != nil && l.q.remove(t) {
				m.stats.Paths[p].Skipped++
			}
		}
	}
}

// untrackLocked forgets a task that left its queue (popped or shed).
func (m *Manager) untrackLocked(t *task) {
	if t.g1 >= 0 {
		if st := &m.g1s[t.g1]; st.queued == t {
			st.queued = nil
		}
		return
	}
	if m.promoting[t.block.Hash] == t {
		delete(m.promoting, t.block.Hash)
	}
}

// shedLocked forgets a task a full queue dropped. Its G1 block no longer
// has a task for the hash: a later Offload of the block is not a duplicate.
func (m *Manager) shedLocked(t *task) {
	m.untrackLocked(t)
	m.forgetLocked(t)
}

// forgetLocked clears the hash of t's G1 block, if it is still t's (same
// generation, same hash, no other task queued), so that a later Offload of
// the block queues a copy again rather than counting a duplicate: t was
// shed, or its copy stored nothing (the pool had no room, or it failed).
// A G1 block's hash is set only by the Offload that queues its task, and
// cleared only by Free or by that task, so in one generation at most one
// task can own it. The caller holds m.mu.
func (m *Manager) forgetLocked(t *task) {
	if t.g1 < 0 || !m.current(t) {
		return
	}
	if st := &m.g1s[t.g1]; st.hash == t.block.Hash && st.queued == nil {
		st.hash = 0
	}
}

// current reports whether t's G1 block is still in the generation t was
// queued at.
func (m *Manager) current(t *task) bool { return m.gens[t.g1].Load() == t.gen }

// A promotion is a block to copy G2 → G3 and its priority in the queue.
type promotion struct {
	block pool.Block
	prio  int
}

// promote queues H2Disk tasks for the blocks that are in G2 and have no
// task queued yet. It looks only at G2, without m.mu: Offload calls it, and
// the disk pool's lock may be held across a Pebble write (an eviction's
// delete), which can stall; the H2Disk worker skips blocks already in G3
// (reviving them there: used now).
func (m *Manager) promote(ps []promotion) {
	if len(ps) == 0 || m.host == nil || m.disk == nil || !m.diskUp() {
		return
	}
	hs := make([]uint64, len(ps))
	for i, p := range ps {
		hs[i] = p.block.Hash
	}
	inHost := m.host.Lookup(hs, nil)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	l := m.lanes[H2Disk]
	st := &m.stats.Paths[H2Disk]
	for i, p := range ps {
		h := p.block.Hash
		if !inHost[i] || m.promoting[h] != nil {
			continue
		}
		t := newTask(p.prio, -1, 0, p.block)
		m.promoting[h] = t
		shed := l.q.push(t)
		if shed != t {
			st.Queued++
			l.cond.Signal()
		}
		if shed != nil {
			m.shedLocked(shed)
			st.Shed++
		}
	}
}

// diskUp reports whether there is a disk pool that takes writes. A disk
// pool that has shut itself down (damage met by one of Pebble's background
// jobs, see pool.DiskPool.Err) stays down until it is opened again, which
// takes a restart of the agent: from the first call that sees it, the
// manager logs it once and queues nothing more for G3 (Offload counts
// NoDisk without G2; promotions to G3 stop), and a worker drops the tasks
// queued before (Failed) without copying them. Onboarding from G3 finds
// nothing there (the pool dropped its blocks): pin does not ask the dead
// pool, whose Acquire fails with ErrClosed, so a block not in G2 is
// NotFound, not Failed. Reads no lock a Pebble write holds: Offload calls
// it.
func (m *Manager) diskUp() bool {
	if m.disk == nil || m.diskDown.Load() {
		return false
	}
	err := m.disk.Err()
	if err == nil {
		return true
	}
	if m.diskDown.CompareAndSwap(false, true) {
		m.log.Error("offload: the disk pool has shut down; nothing more is offloaded to disk (G3) until the agent "+
			"restarts, G2 goes on", "err", err)
	}
	return false
}

// promoteHot promotes the blocks among ts that the filter passes.
func (m *Manager) promoteHot(ts []*task) {
	if len(ts) == 0 || m.disk == nil {
		return
	}
	var ps []promotion
	m.mu.Lock()
	for _, t := range ts {
		if m.filter.Hot(m.filter.Count(t.block.Hash)) {
			ps = append(ps, promotion{t.block, t.prio})
		}
	}
	m.mu.Unlock()
	m.promote(ps)
}

// Lookup returns, per hash, the tiers that hold the block now: bit
// kvevent.TierHostPinned for G2, kvevent.TierDisk for G3. A block still
// being written counts as not held. It does not pin anything (a block may
// be evicted right after), and it is not a sighting for the filter. It
// takes each pool's lock, which the disk pool may hold across an
// eviction's Pebble delete: unlike Offload, it can wait on a stalled disk.
func (m *Manager) Lookup(hashes []uint64) []kvevent.Mask {
	out := make([]kvevent.Mask, len(hashes))
	if m.host != nil {
		for i, ok := range m.host.Lookup(hashes, nil) {
			if ok {
				out[i] |= kvevent.TierHostPinned.Bit()
			}
		}
	}
	if m.disk != nil {
		for i, ok := range m.disk.Lookup(hashes, nil) {
			if ok {
				out[i] |= kvevent.TierDisk.Bit()
			}
		}
	}
	return out
}

// PathStats counts one path's work, in blocks.
type PathStats struct {
	// Depth is the number of blocks waiting in the path's queue now, and
	// InFlight those a worker took and has not finished.
	Depth, InFlight int
	// Queued counts blocks accepted into the queue, Shed those a full queue
	// dropped.
	Queued, Shed uint64
	// Skipped counts blocks whose weak reference went stale before or
	// during their copy: the G1 block was freed or reused, or the G2 block
	// was evicted. Nothing is stored for them.
	Skipped uint64
	// Exists counts blocks not copied because the destination already
	// held them (they count as used now there, in its eviction order) or
	// another copy was writing them there (that copy may yet
	// store nothing: the block's hash is then forgotten, so it is queued
	// again when asked again). Full counts those it had no room for,
	// Failed those whose copy, read or write failed.
	Exists, Full, Failed uint64
	// Blocks and Bytes count what was copied.
	Blocks, Bytes uint64
}

// OnboardStats counts Onboard's work.
type OnboardStats struct {
	Calls uint64
	// FromHost and FromDisk count the blocks loaded into G1, by source.
	FromHost, FromDisk uint64
	// Blocks not loaded, by reason (see Status).
	NotFound, TimedOut, Canceled, Failed uint64
	// LateWrites counts timed-out or canceled blocks whose copy into G1
	// was already running: written after Onboard returned, before Settled.
	LateWrites uint64
}

// Stats is a snapshot of a Manager's counters.
type Stats struct {
	// Paths is indexed by Path; a path the Config does not allow stays
	// zero. H2D is allowed with either pool: without G2 it counts the
	// second hop of an onboard from G3 (staging buffer → G1).
	Paths [NumPaths]PathStats
	// Offload requests: Invalid refused, NoPriority not written through,
	// Duplicates already offloaded, Cold (without G2) below the filter's
	// threshold, NoDisk (without G2) not queued because the disk pool is
	// down.
	Invalid, NoPriority, Duplicates, Cold, NoDisk uint64
	// DiskDown is set once the disk pool has shut itself down (damage:
	// see pool.DiskPool.Err). Nothing more is offloaded to it.
	DiskDown bool
	// Tracked is the number of hashes the frequency filter counts.
	Tracked int
	Onboard OnboardStats
}

// Stats returns the manager's counters.
func (m *Manager) Stats() Stats {
	down := m.disk != nil && !m.diskUp()
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.DiskDown = down
	for p, l := range m.lanes {
		if l == nil {
			continue
		}
		if l.q != nil {
			s.Paths[p].Depth = l.q.len()
		} else {
			s.Paths[p].Depth = l.depth
		}
		s.Paths[p].InFlight = l.inflight
	}
	s.Tracked = m.filter.Len()
	return s
}

// Refuse makes every later Offload and Onboard fail with ErrClosed, as
// after Close, while the copies queued and running go on until Close. The
// engine API calls it before it frees every G1 block of a region it is
// leaving: an Offload or Onboard that reached the Manager between that
// Free and Close would otherwise queue a copy of (or into) blocks already
// counted as freed, and a STORE of the old region could follow.
func (m *Manager) Refuse() {
	m.mu.Lock()
	m.refused = true
	m.mu.Unlock()
}

// Close stops the workers: tasks still queued are dropped, copies in flight
// finish first (their STOREs are published), queued onboarding work is
// canceled (its Onboard calls return at once). It then releases the
// workers' streams and staging buffers and unregisters the metrics. Every
// later call but Free, Lookup and Stats fails with ErrClosed; a second
// Close returns nil. Close waits for a stalled copy, however long.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed, m.refused = true, true
	close(m.closing)
	var chunks []*chunk
	for _, l := range m.lanes {
		if l == nil {
			continue
		}
		l.cond.Broadcast()
		if l.q != nil {
			for t := l.q.pop(); t != nil; t = l.q.pop() {
				m.untrackLocked(t)
			}
		}
	}
	m.mu.Unlock()
	m.wg.Wait()

	// The workers are gone: nothing takes chunks any more.
	m.mu.Lock()
	for _, l := range m.lanes {
		if l != nil && l.q == nil {
			chunks = append(chunks, l.chunks...)
			l.chunks, l.depth = nil, 0
		}
	}
	m.mu.Unlock()
	for _, ch := range chunks {
		if ch.state.CompareAndSwap(chQueued, chCanceled) {
			m.releaseChunk(ch)
			ch.op.finish()
		}
	}
	err := m.freeCopiers()
	m.unregister()
	if err != nil {
		return fmt.Errorf("close offload manager: %w", err)
	}
	return nil
}

func (m *Manager) freeCopiers() error {
	var errs []error
	for _, c := range m.copiers {
		errs = append(errs, c.close())
	}
	m.copiers = nil
	return errors.Join(errs...)
}
