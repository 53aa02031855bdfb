package manager

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// A copier is one worker's backend resources: a stream and an event of its
// own (copies of different workers run concurrently, a worker's own in
// order), and for the paths that pass through host memory outside G2, a
// staging buffer of BatchSize blocks.
type copier struct {
	be    backend.Backend
	s     backend.Stream
	e     backend.Event
	stage backend.HostBuffer
}

func newCopier(be backend.Backend, stream, stage bool, stageBytes int) (*copier, error) {
	c := &copier{be: be}
	var err error
	if stream {
		if c.s, err = be.NewStream(); err == nil {
			c.e, err = be.NewEvent()
		}
	}
	if err == nil && stage {
		c.stage, err = be.AllocHost(stageBytes)
	}
	if err != nil {
		return nil, errors.Join(err, c.close())
	}
	return c, nil
}

// run queues copies as one batch, records the event after them and waits
// for it. When it returns, no copy of the batch is running, even on an
// error, so the buffers may be reused or given back.
func (c *copier) run(copies []backend.Copy) error {
	if err := c.be.CopyBatchAsync(c.s, copies); err != nil {
		return err // a failed batch leaves no copy of it running
	}
	err := c.be.Record(c.e, c.s)
	if err == nil {
		err = c.be.Synchronize(c.e)
	}
	if err != nil {
		return errors.Join(err, c.be.SynchronizeStream(c.s))
	}
	return nil
}

// slot returns staging slot i: its address and the host's view of it.
func (c *copier) slot(i, bs int) (backend.Ptr, []byte) {
	return c.stage.At(i * bs), c.stage.Bytes()[i*bs : (i+1)*bs : (i+1)*bs]
}

func (c *copier) close() error {
	var errs []error
	if c.e != nil {
		errs = append(errs, c.be.DestroyEvent(c.e))
	}
	if c.s != nil {
		errs = append(errs, c.be.DestroyStream(c.s))
	}
	if c.stage.Len() > 0 {
		errs = append(errs, c.be.FreeHost(c.stage))
	}
	return errors.Join(errs...)
}

// outcome is what one batch did, added to its path's stats at the end.
type outcome struct {
	skipped, exists, full, failed, blocks int
	// lost are the offload tasks whose copy stored nothing (full or
	// failed): their G1 blocks' hashes are forgotten (see forgetLocked).
	lost []*task
}

func (m *Manager) account(p Path, o outcome, d time.Duration) {
	m.mu.Lock()
	s := &m.stats.Paths[p]
	s.Skipped += uint64(o.skipped)
	s.Exists += uint64(o.exists)
	s.Full += uint64(o.full)
	s.Failed += uint64(o.failed)
	s.Blocks += uint64(o.blocks)
	s.Bytes += uint64(o.blocks) * uint64(m.bs)
	for _, t := range o.lost {
		m.forgetLocked(t)
	}
	m.mu.Unlock()
	if h := m.metrics.copySeconds[p]; h != nil && d > 0 {
		h.Observe(d.Seconds())
	}
}

// runTasks is an offload worker: it takes up to BatchSize tasks at a time,
// best first, until Close.
func (m *Manager) runTasks(l *lane, c *copier) {
	defer m.wg.Done()
	for {
		ts := m.takeTasks(l)
		if ts == nil {
			return
		}
		if f := m.testHookBatch.Load(); f != nil {
			(*f)(l.path, len(ts))
		}
		switch l.path {
		case D2H:
			m.d2h(c, ts)
		case D2Disk:
			m.d2disk(c, ts)
		case H2Disk:
			m.h2disk(ts)
		}
		m.mu.Lock()
		l.inflight -= len(ts)
		m.mu.Unlock()
	}
}

// takeTasks waits for tasks and takes a batch; nil means the manager is
// closing.
func (m *Manager) takeTasks(l *lane) []*task {
	m.mu.Lock()
	defer m.mu.Unlock()
	for !m.closed && l.q.len() == 0 {
		l.cond.Wait()
	}
	if m.closed {
		return nil
	}
	ts := make([]*task, min(l.q.len(), m.cfg.BatchSize))
	for i := range ts {
		ts[i] = l.q.pop()
		m.untrackLocked(ts[i])
	}
	l.inflight += len(ts)
	return ts
}

// d2h copies G1 blocks into G2 slots. Each task's generation is checked
// twice: before its slot is reserved (a block freed while queued costs no
// copy) and after the copy has finished, before the STORE. The second check
// is the one the guarantee rests on: the copy reads G1 asynchronously, and
// only once it is complete does "the block was not freed until now" imply
// "the bytes read were the block's bytes at Offload" (Free comes before the
// engine writes). A block freed during its copy is aborted: its slot goes
// back, no STORE.
func (m *Manager) d2h(c *copier, ts []*task) {
	var (
		o       outcome
		d       time.Duration
		rs      = make([]pool.Reservation, 0, len(ts))
		copies  = make([]backend.Copy, 0, len(ts))
		copied  = make([]*task, 0, len(ts))
		present []*task // in G2 now, for promotion
	)
	for _, t := range ts {
		if !m.current(t) {
			o.skipped++
			continue
		}
		r, err := m.host.Reserve(t.block)
		switch {
		case err == nil:
			rs = append(rs, r)
			copies = append(copies, backend.Copy{Dst: r.Ptr, Src: m.g1.at(t.g1), N: m.bs})
			copied = append(copied, t)
		case errors.Is(err, pool.ErrBusy):
			// Another worker is writing the same hash (from another G1
			// block). Its copy may yet store nothing, so this block's hash
			// is forgotten: asked again, it is queued again (and revived,
			// if that copy stored it).
			o.exists++
			o.lost = append(o.lost, t)
		case errors.Is(err, pool.ErrExists): // revived
			o.exists++
			present = append(present, t)
		case errors.Is(err, pool.ErrFull):
			o.full++
			o.lost = append(o.lost, t)
		default:
			o.failed++
			o.lost = append(o.lost, t)
			m.log.Warn("offload: reserving a G2 slot failed", "hash", t.block.Hash, "err", err)
		}
	}
	if len(rs) > 0 {
		start := time.Now()
		err := c.run(copies)
		d = time.Since(start)
		if err != nil {
			m.host.Abort(rs...)
			o.failed += len(rs)
			o.lost = append(o.lost, copied...)
			m.log.Warn("offload: G1→G2 copy failed", "blocks", len(rs), "err", err)
		} else {
			commit := rs[:0:0]
			var stale []pool.Reservation
			for i, t := range copied {
				if m.current(t) {
					commit = append(commit, rs[i])
					present = append(present, t)
				} else {
					stale = append(stale, rs[i])
				}
			}
			if len(stale) > 0 {
				m.host.Abort(stale...)
				o.skipped += len(stale)
			}
			if err := m.host.Commit(commit...); err != nil {
				o.failed += len(commit)
				o.lost = append(o.lost, present[len(present)-len(commit):]...)
				present = present[:len(present)-len(commit)]
			} else {
				o.blocks += len(commit)
			}
		}
	}
	m.account(D2H, o, d)
	m.promoteHot(present)
}

// d2disk copies G1 blocks through the staging buffer into G3, with the same
// two generation checks as d2h. A block G3 holds already is not copied but
// revived there (used now), as d2h's Reserve revives one G2 holds.
func (m *Manager) d2disk(c *copier, ts []*task) {
	var (
		o      outcome
		d      time.Duration
		live   = make([]*task, 0, len(ts))
		hashes = make([]uint64, 0, len(ts))
	)
	if !m.diskUp() { // queued before the disk pool shut down: no copy
		o.failed, o.lost = len(ts), ts
		m.account(D2Disk, o, 0)
		return
	}
	for _, t := range ts {
		if !m.current(t) {
			o.skipped++
			continue
		}
		live = append(live, t)
		hashes = append(hashes, t.block.Hash)
	}
	// Blocks G3 holds already are not copied; Revive counts this as their
	// use there, as G2's Reserve does, so the LRU does not take them for
	// cold ones.
	onDisk := m.disk.Revive(hashes, nil)
	// While the disk is full, the pool refuses every Put at once: the
	// blocks are not copied out of G1 for nothing.
	if err := m.disk.FlushFailed(); err != nil {
		n := 0
		for i, t := range live {
			if onDisk[i] {
				o.exists++
				continue
			}
			o.lost = append(o.lost, t)
			n++
		}
		if n > 0 {
			o.failed += n
			m.failedDiskWrite(n, fmt.Errorf("disk pool refuses writes until a flush succeeds: the last one failed: %w", err))
		}
		m.account(D2Disk, o, 0)
		return
	}
	copies := make([]backend.Copy, 0, len(live))
	copied := make([]*task, 0, len(live))
	for i, t := range live {
		if onDisk[i] {
			o.exists++
			continue
		}
		dst, _ := c.slot(len(copies), m.bs)
		copies = append(copies, backend.Copy{Dst: dst, Src: m.g1.at(t.g1), N: m.bs})
		copied = append(copied, t)
	}
	if len(copies) > 0 {
		start := time.Now()
		if err := c.run(copies); err != nil {
			o.failed += len(copies)
			o.lost = append(o.lost, copied...)
			m.log.Warn("offload: G1→staging copy failed", "blocks", len(copies), "err", err)
		} else {
			blocks := make([]pool.Block, 0, len(copied))
			data := make([][]byte, 0, len(copied))
			put := make([]*task, 0, len(copied))
			for i, t := range copied {
				if !m.current(t) {
					o.skipped++
					continue
				}
				_, b := c.slot(i, m.bs)
				blocks = append(blocks, t.block)
				data = append(data, b)
				put = append(put, t)
			}
			if n, _ := o.put(m.disk, blocks, data, m); n < len(put) {
				// Put stopped early, or skipped blocks held or being
				// written by another worker, whose write may store
				// nothing: the blocks G3 does not hold now were not
				// stored (or were evicted since, just as well).
				hs := make([]uint64, len(put))
				for i, t := range put {
					hs[i] = t.block.Hash
				}
				for i, held := range m.disk.Lookup(hs, nil) {
					if !held {
						o.lost = append(o.lost, put[i])
					}
				}
			}
		}
		d = time.Since(start)
	}
	m.account(D2Disk, o, d)
}

// h2disk copies G2 blocks into G3. The weak reference is the hash: a block
// evicted from G2 before its turn is skipped; one still there is pinned
// (Acquire) while its bytes are written, so it cannot be evicted and its
// slot reused under the write. A block G3 holds already is not copied but
// revived there (used now).
func (m *Manager) h2disk(ts []*task) {
	var o outcome
	if !m.diskUp() { // queued before the disk pool shut down: no copy
		o.failed = len(ts)
		m.account(H2Disk, o, 0)
		return
	}
	hashes := make([]uint64, len(ts))
	for i, t := range ts {
		hashes[i] = t.block.Hash
	}
	onDisk := m.disk.Revive(hashes, nil) // used now in G3, as in d2disk
	blocks := make([]pool.Block, 0, len(ts))
	data := make([][]byte, 0, len(ts))
	for i, t := range ts {
		if onDisk[i] {
			o.exists++
			continue
		}
		s, err := m.host.Acquire(t.block.Hash)
		switch {
		case err == nil:
			blocks = append(blocks, t.block)
			data = append(data, s.Bytes)
		case errors.Is(err, pool.ErrNotFound):
			o.skipped++
		default:
			o.failed++
		}
	}
	var d time.Duration
	if len(blocks) > 0 {
		if f := m.testHookH2DiskPut.Load(); f != nil {
			hs := make([]uint64, len(blocks))
			for i, b := range blocks {
				hs[i] = b.Hash
			}
			(*f)(hs)
		}
		start := time.Now()
		o.put(m.disk, blocks, data, m)
		d = time.Since(start)
		for _, b := range blocks {
			if err := m.host.Release(b.Hash); err != nil {
				m.log.Warn("offload: releasing a G2 block after its copy to disk", "hash", b.Hash, "err", err)
			}
		}
	}
	m.account(H2Disk, o, d)
}

// put writes blocks to the disk pool and counts the result. It returns
// what Put returned: the blocks it stored, and why it stopped early.
func (o *outcome) put(disk *pool.DiskPool, blocks []pool.Block, data [][]byte, m *Manager) (int, error) {
	if len(blocks) == 0 {
		return 0, nil
	}
	n, held, err := disk.PutCounting(blocks, data)
	// The blocks Put skipped as held or being written are Exists even
	// when it stopped early: only the rest had no room or failed.
	o.blocks += n
	o.exists += held // revived by Put
	switch {
	case err == nil:
	case errors.Is(err, pool.ErrFull):
		o.full += len(blocks) - n - held
	default:
		o.failed += len(blocks) - n - held
		m.failedDiskWrite(len(blocks), err)
	}
	return n, err
}

// diskWriteLogEvery is how often, at most, the manager logs a failed
// write to the disk pool.
const diskWriteLogEvery = 10 * time.Second

// failedDiskWrite logs a write of n blocks to the disk pool that failed
// with err, at most once per diskWriteLogEvery, with how many were left
// out (each failure is counted in the path's Failed all the same). While
// the disk is full every batch fails at once (the pool refuses writes
// until Pebble's retries of a flush succeed): one line per batch was
// millions an hour. A pool shut down is logged once, by diskUp, instead.
func (m *Manager) failedDiskWrite(n int, err error) {
	if !m.diskUp() {
		return
	}
	if ok, skipped := m.diskWriteLog.Allow("disk write failed"); ok {
		m.log.Warn("offload: writing blocks to disk failed",
			append([]any{"blocks", n, "err", err}, lograte.LeftOut(skipped, diskWriteLogEvery)...)...)
	}
}
