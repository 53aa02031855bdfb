package manager

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// Status is what became of one block of an Onboard.
type Status uint8

const (
	// Loaded: the block's bytes are in its G1 block.
	Loaded Status = iota + 1
	// NotFound: neither G2 nor G3 holds the block.
	NotFound
	// TimedOut: the deadline passed before the block's copy finished.
	TimedOut
	// Canceled: the context was canceled, or the Manager closed, first.
	Canceled
	// Failed: a read or copy failed (BlockResult.Err says why).
	Failed
)

var statusNames = [...]string{"", "loaded", "not_found", "timeout", "canceled", "error"}

// String is the status's metric label.
func (s Status) String() string {
	if int(s) < len(statusNames) && s != 0 {
		return statusNames[s]
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// BlockResult is the outcome for one block of an Onboard.
type BlockResult struct {
	Status Status
	// From is the tier the block was found in (TierHostPinned or TierDisk);
	// meaningless for NotFound.
	From kvevent.Tier
	// Err is the cause of a Failed block.
	Err error
}

// Result is what Onboard did: Blocks[i] is the outcome for hashes[i].
type Result struct {
	Blocks []BlockResult
	// Settled is closed once no copy started by this Onboard can still
	// write into G1. It is closed when Onboard returns, except after a
	// timeout or cancellation hit a copy into G1 that was already running
	// (the copy cannot be recalled): the engine must not write into a block
	// that is not Loaded, nor free it for reuse, before Settled is closed.
	// A disk read abandoned at the deadline writes nothing into G1, so it
	// does not hold Settled open; its worker keeps the G3 pins until the
	// read ends.
	Settled <-chan struct{}
}

// Loaded counts the blocks loaded.
func (r Result) Loaded() int {
	n := 0
	for _, b := range r.Blocks {
		if b.Status == Loaded {
			n++
		}
	}
	return n
}

// Prefix counts the leading blocks loaded: the part of a sequence the
// engine need not recompute.
func (r Result) Prefix() int {
	for i, b := range r.Blocks {
		if b.Status != Loaded {
			return i
		}
	}
	return len(r.Blocks)
}

// An onboardOp is one Onboard call's shared state: remaining counts its
// chunks not yet settled; the last to settle closes settled. deadline is
// the call's: a worker that takes a chunk after it starts no copy (the
// Onboard call may not have woken to take the chunk back yet).
type onboardOp struct {
	remaining atomic.Int32
	settled   chan struct{}
	deadline  time.Time
}

// expired reports whether op's deadline has passed; the zero deadline
// (a chunk queued with no Onboard call waiting) never does.
func (op *onboardOp) expired() bool {
	return !op.deadline.IsZero() && !time.Now().Before(op.deadline)
}

func (op *onboardOp) finish() {
	if op.remaining.Add(-1) == 0 {
		close(op.settled)
	}
}

// Chunk states. A chunk moves queued → running → writing → done, or is
// taken off that path by whoever wins a compare-and-swap:
//
//	queued  → canceled   by the Onboard call at its deadline (or Close): it
//	                     releases the pins; no worker touches the chunk.
//	                     Or by the worker that took it past the deadline,
//	                     before the Onboard call woke: the worker releases
//	                     the pins and counts the chunk settled
//	running → abandoned  by the Onboard call at its deadline, while a
//	                     Disk2H worker reads from disk: the Onboard call
//	                     counts the chunk settled (nothing will be written
//	                     into G1); the worker releases the pins once its
//	                     read ends. Or by the worker, its read ended past
//	                     the deadline: it releases and counts the chunk
//	                     settled
//	writing              the copy into G1 is queued: it cannot be recalled;
//	                     the worker finishes and releases
//
// So at most one side owns the pins at any time, and a deadline stops every
// write into G1 that has not started yet.
const (
	chQueued int32 = iota
	chRunning
	chWriting
	chDone
	chCanceled
	chAbandoned
)

// A chunk is up to BatchSize blocks of one Onboard from one source tier,
// copied by one worker as one batch.
type chunk struct {
	state  atomic.Int32
	op     *onboardOp
	from   kvevent.Tier
	idx    []int // positions in the Onboard's arguments
	hashes []uint64
	dst    []backend.Ptr
	src    []backend.Ptr // G2 slots (from TierHostPinned)
	errs   []error       // per block, written by the worker before done; nil: loaded
}

// Onboard copies blocks back into G1: the block hashes[i] into G1 block
// g1Blocks[i], from G2 (H2D) or, when only G3 holds it, from G3 through a
// staging buffer (Disk2H, then H2D). The bytes loaded are exactly the bytes
// stored. Each source block is pinned (Acquire) from the moment it is found
// until its copy has finished, so it cannot be evicted under the copy.
//
// Onboard waits until every block is settled or until the deadline: the
// context's, even one later than OnboardTimeout, or OnboardTimeout from now
// when the context has none. It then returns, per block, Loaded, or why not
// (NotFound, TimedOut, Canceled, Failed), so that the engine recomputes the
// rest; copies not yet started are dropped. See Result.Settled for the one case where a copy may still
// land in G1 after Onboard returned.
//
// Onboard counts as a Free of every destination block (its old contents are
// gone), and as a sighting of every block found, which may promote a G2
// block to G3. It fails, doing nothing, with ErrInvalid when the slices
// differ in length, a hash is zero or a G1 block is named twice, with
// ErrBadBlock for an id out of range, and with ErrClosed after Refuse or
// Close.
func (m *Manager) Onboard(ctx context.Context, hashes []uint64, g1Blocks []int) (Result, error) {
	start := time.Now()
	if err := m.checkOnboard(hashes, g1Blocks); err != nil {
		return Result{}, fmt.Errorf("onboard: %w", err)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = start.Add(m.cfg.OnboardTimeout)
	}
	m.mu.Lock()
	if m.refused {
		m.mu.Unlock()
		return Result{}, fmt.Errorf("onboard: %w", ErrClosed)
	}
	for _, id := range g1Blocks {
		m.freeLocked(id)
	}
	m.mu.Unlock()

	res := Result{Blocks: make([]BlockResult, len(hashes))}
	op := &onboardOp{settled: make(chan struct{}), deadline: deadline}
	res.Settled = op.settled
	chunks, seen := m.pin(op, res.Blocks, hashes, g1Blocks)
	m.see(seen)

	if len(chunks) == 0 {
		close(op.settled)
		m.finishOnboard(res, nil, start)
		return res, nil
	}
	op.remaining.Store(int32(len(chunks)))
	if op.expired() {
		// Past the deadline already (it was, or pin waited on the disk
		// pool's lock across a Pebble delete): queue nothing, so no copy
		// into G1 starts; settle takes every chunk back as TimedOut.
		late := m.settle(chunks, res.Blocks, TimedOut)
		m.finishOnboard(res, late, start)
		return res, nil
	}
	m.mu.Lock()
	if m.refused {
		m.mu.Unlock()
		for _, ch := range chunks {
			ch.state.Store(chCanceled)
			m.releaseChunk(ch)
			op.finish()
		}
		return Result{}, fmt.Errorf("onboard: %w", ErrClosed)
	}
	for _, ch := range chunks {
		l := m.lanes[m.chunkPath(ch)]
		l.chunks = append(l.chunks, ch)
		l.depth += len(ch.hashes)
		l.cond.Signal()
	}
	m.mu.Unlock()

	why := TimedOut
	timer := time.NewTimer(time.Until(deadline))
	select {
	case <-op.settled:
	case <-timer.C:
	case <-ctx.Done():
		if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			why = Canceled
		}
	case <-m.closing:
		why = Canceled
	}
	timer.Stop()
	late := m.settle(chunks, res.Blocks, why)
	m.finishOnboard(res, late, start)
	return res, nil
}

func (m *Manager) checkOnboard(hashes []uint64, g1Blocks []int) error {
	if len(hashes) != len(g1Blocks) {
		return fmt.Errorf("%w: %d hashes, %d G1 blocks", ErrInvalid, len(hashes), len(g1Blocks))
	}
	seen := make(map[int]struct{}, len(g1Blocks))
	for i, id := range g1Blocks {
		if err := m.g1.Check(id); err != nil {
			return err
		}
		if _, dup := seen[id]; dup {
			return fmt.Errorf("%w: G1 block %d named twice", ErrInvalid, id)
		}
		seen[id] = struct{}{}
		if hashes[i] == 0 {
			return fmt.Errorf("%w: zero hash for G1 block %d", ErrInvalid, id)
		}
	}
	return nil
}

// pin finds and pins each block, G2 first, and cuts the found ones into
// chunks per source. It fills in the results of the blocks not found, and
// returns the hashes found (for the filter).
func (m *Manager) pin(op *onboardOp, out []BlockResult, hashes []uint64, g1Blocks []int) ([]*chunk, []uint64) {
	var (
		chunks           []*chunk
		fromHost, onDisk *chunk
		seen             []uint64
		// A disk pool that has shut itself down holds nothing (it dropped
		// its blocks) and answers every Acquire with ErrClosed: each block
		// not in G2 is NotFound then, as without G3, not Failed. Asked once
		// per call; one that shuts down after is caught below.
		diskUp = m.diskUp()
	)
	add := func(cur **chunk, from kvevent.Tier, i int, src backend.Ptr) {
		if *cur == nil || len((*cur).hashes) == m.cfg.BatchSize {
			*cur = &chunk{op: op, from: from}
			chunks = append(chunks, *cur)
		}
		ch := *cur
		ch.idx = append(ch.idx, i)
		ch.hashes = append(ch.hashes, hashes[i])
		ch.dst = append(ch.dst, m.g1.at(g1Blocks[i]))
		ch.src = append(ch.src, src)
		ch.errs = append(ch.errs, nil)
	}
	for i, h := range hashes {
		out[i].From = kvevent.TierHostPinned
		if m.host != nil {
			s, err := m.host.Acquire(h)
			if err == nil {
				add(&fromHost, kvevent.TierHostPinned, i, s.Ptr)
				seen = append(seen, h)
				continue
			}
			if !errors.Is(err, pool.ErrNotFound) {
				out[i] = BlockResult{Status: Failed, From: kvevent.TierHostPinned, Err: err}
				continue
			}
		}
		out[i].From = kvevent.TierDisk
		if diskUp {
			err := m.disk.Acquire(h)
			if err == nil {
				add(&onDisk, kvevent.TierDisk, i, 0)
				seen = append(seen, h)
				continue
			}
			if !errors.Is(err, pool.ErrNotFound) && m.diskUp() {
				out[i] = BlockResult{Status: Failed, From: kvevent.TierDisk, Err: err}
				continue
			}
		}
		out[i] = BlockResult{Status: NotFound}
	}
	return chunks, seen
}

// see counts sightings of onboarded blocks and promotes the G2 blocks that
// pass the filter (the G3 ones are on disk already).
func (m *Manager) see(hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	var ps []promotion
	m.mu.Lock()
	for _, h := range hashes {
		n := m.filter.See(h, nil)
		if m.disk == nil || m.host == nil || !m.filter.Hot(n) {
			continue
		}
		if p, ok := m.filter.Meta(h); ok {
			ps = append(ps, p)
		} else {
			m.log.Debug("onboard: cannot promote a block whose parent is unknown", "hash", h)
		}
	}
	m.mu.Unlock()
	m.promote(ps)
}

// settle decides each chunk's outcome once Onboard stops waiting: results
// of the chunks done, why for the others, after taking back every chunk not
// yet writing into G1. It returns the number of blocks whose copy into G1
// may still land.
func (m *Manager) settle(chunks []*chunk, out []BlockResult, why Status) []int {
	var late []int
	for _, ch := range chunks {
		st := ch.state.Load()
		if st != chDone {
			if ch.state.CompareAndSwap(chQueued, chCanceled) {
				m.unqueue(ch)
				m.releaseChunk(ch)
				ch.op.finish()
			} else if ch.state.CompareAndSwap(chRunning, chAbandoned) {
				// The worker is still reading from disk; it will write
				// nothing into G1, so the chunk is settled now. The
				// worker keeps the pins until its read ends.
				ch.op.finish()
			}
			st = ch.state.Load()
		}
		for j, i := range ch.idx {
			switch {
			case st != chDone:
				out[i].Status = why
				if st == chWriting {
					late = append(late, i)
				}
			case ch.errs[j] != nil:
				out[i].Status, out[i].Err = Failed, ch.errs[j]
			default:
				out[i].Status = Loaded
			}
		}
	}
	return late
}

func (m *Manager) chunkPath(ch *chunk) Path {
	if ch.from == kvevent.TierDisk {
		return Disk2H
	}
	return H2D
}

// unqueue takes a canceled chunk out of its lane, unless a worker or Close
// took it already. Whoever takes a chunk out adjusts the depth.
func (m *Manager) unqueue(ch *chunk) {
	m.mu.Lock()
	defer m.mu.Unlock()
	l := m.lanes[m.chunkPath(ch)]
	for i, c := range l.chunks {
		if c == ch {
			l.chunks = append(l.chunks[:i], l.chunks[i+1:]...)
			l.depth -= len(ch.hashes)
			return
		}
	}
}

// finishOnboard counts an Onboard's outcome.
func (m *Manager) finishOnboard(res Result, late []int, start time.Time) {
	m.mu.Lock()
	s := &m.stats.Onboard
	s.Calls++
	s.LateWrites += uint64(len(late))
	for _, b := range res.Blocks {
		switch b.Status {
		case Loaded:
			if b.From == kvevent.TierDisk {
				s.FromDisk++
			} else {
				s.FromHost++
			}
		case NotFound:
			s.NotFound++
		case TimedOut:
			s.TimedOut++
		case Canceled:
			s.Canceled++
		case Failed:
			s.Failed++
		}
	}
	m.mu.Unlock()
	m.metrics.onboardSeconds.Observe(time.Since(start).Seconds())
}

// releaseChunk drops the pins of a chunk's blocks.
func (m *Manager) releaseChunk(ch *chunk) {
	for _, h := range ch.hashes {
		var err error
		if ch.from == kvevent.TierDisk {
			err = m.disk.Release(h)
		} else {
			err = m.host.Release(h)
		}
		if err != nil && !errors.Is(err, pool.ErrClosed) {
			m.log.Warn("onboard: releasing a pinned block", "tier", ch.from, "hash", h, "err", err)
		}
	}
}

// runChunks is an onboarding worker: it takes chunks in arrival order
// until Close.
func (m *Manager) runChunks(l *lane, c *copier) {
	defer m.wg.Done()
	for {
		ch := m.takeChunk(l)
		if ch == nil {
			return
		}
		if l.path == H2D {
			m.h2d(c, ch)
		} else {
			m.disk2h(c, ch)
		}
		m.mu.Lock()
		l.inflight -= len(ch.hashes)
		m.mu.Unlock()
	}
}

func (m *Manager) takeChunk(l *lane) *chunk {
	m.mu.Lock()
	defer m.mu.Unlock()
	for {
		for !m.closed && len(l.chunks) == 0 {
			l.cond.Wait()
		}
		if m.closed {
			return nil
		}
		ch := l.chunks[0]
		l.chunks[0] = nil
		l.chunks = l.chunks[1:]
		l.depth -= len(ch.hashes)
		if ch.state.Load() == chCanceled {
			continue // its Onboard took it back and released it
		}
		l.inflight += len(ch.hashes)
		return ch
	}
}

// h2d copies a chunk of G2 blocks into G1.
func (m *Manager) h2d(c *copier, ch *chunk) {
	if ch.op.expired() {
		m.cancelExpired(ch)
		return
	}
	if !ch.state.CompareAndSwap(chQueued, chWriting) {
		return // canceled: its Onboard released the pins
	}
	copies := make([]backend.Copy, len(ch.hashes))
	for i := range copies {
		copies[i] = backend.Copy{Dst: ch.dst[i], Src: ch.src[i], N: m.bs}
	}
	start := time.Now()
	err := c.run(copies)
	d := time.Since(start)
	var o outcome
	if err != nil {
		o.failed = len(copies)
		m.log.Warn("onboard: G2→G1 copy failed", "blocks", len(copies), "err", err)
	} else {
		o.blocks = len(copies)
	}
	for i := range ch.errs {
		ch.errs[i] = err
	}
	m.releaseChunk(ch)
	m.account(H2D, o, d)
	ch.state.Store(chDone)
	ch.op.finish()
}

// cancelExpired takes back a chunk a worker took past its Onboard's
// deadline, unless the Onboard call did first: no copy into G1 starts
// after the deadline, even when the call has not woken yet to cancel it.
func (m *Manager) cancelExpired(ch *chunk) {
	if ch.state.CompareAndSwap(chQueued, chCanceled) {
		m.releaseChunk(ch)
		ch.op.finish()
	}
}

// disk2h reads a chunk of G3 blocks into the staging buffer, then, unless
// its Onboard gave up meanwhile, copies them into G1.
func (m *Manager) disk2h(c *copier, ch *chunk) {
	if ch.op.expired() {
		m.cancelExpired(ch)
		return
	}
	if !ch.state.CompareAndSwap(chQueued, chRunning) {
		return // canceled: its Onboard released the pins
	}
	var read outcome
	start := time.Now()
	for i, h := range ch.hashes {
		_, buf := c.slot(i, m.bs)
		// pin acquired the block (its hit and its use): read it under
		// that reference.
		if err := m.disk.ReadHeld(h, buf); err != nil {
			// A block found damaged (ErrCorrupt) is hidden by the pool
			// now and dropped, with its REMOVE, when releaseChunk lets
			// go of it: nothing more to do here.
			ch.errs[i] = err
			read.failed++
			m.log.Warn("onboard: reading a block from disk failed", "hash", h, "err", err)
		} else {
			read.blocks++
		}
	}
	m.account(Disk2H, read, time.Since(start))
	if ch.op.expired() && ch.state.CompareAndSwap(chRunning, chAbandoned) {
		// The read ended past the deadline, before the Onboard call
		// woke to abandon the chunk: write nothing into G1.
		m.releaseChunk(ch)
		ch.op.finish()
		return
	}
	if !ch.state.CompareAndSwap(chRunning, chWriting) {
		// Abandoned at the deadline: nothing was written into G1, and
		// the Onboard call counted the chunk settled already.
		m.releaseChunk(ch)
		return
	}
	copies := make([]backend.Copy, 0, len(ch.hashes))
	which := make([]int, 0, len(ch.hashes))
	for i := range ch.hashes {
		if ch.errs[i] == nil {
			src, _ := c.slot(i, m.bs)
			copies = append(copies, backend.Copy{Dst: ch.dst[i], Src: src, N: m.bs})
			which = append(which, i)
		}
	}
	var o outcome
	var d time.Duration
	if len(copies) > 0 {
		start := time.Now()
		err := c.run(copies)
		d = time.Since(start)
		if err != nil {
			o.failed = len(copies)
			for _, i := range which {
				ch.errs[i] = err
			}
			m.log.Warn("onboard: staging→G1 copy failed", "blocks", len(copies), "err", err)
		} else {
			o.blocks = len(copies)
		}
	}
	m.releaseChunk(ch)
	m.account(H2D, o, d)
	ch.state.Store(chDone)
	ch.op.finish()
}
