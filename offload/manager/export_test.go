package manager

import (
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
)

// SetBatchHook makes each offload worker call f with its path and the
// batch's size after it takes a batch and before it runs it (nil: no
// call). A test holds a worker there to change the world under a batch
// already taken (the disk pool shutting down, say) and a batch queued
// behind it.
func (m *Manager) SetBatchHook(f func(Path, int)) {
	if f == nil {
		m.testHookBatch.Store(nil)
		return
	}
	m.testHookBatch.Store(&f)
}

// SetH2DiskPutHook makes each H2Disk worker call f with the hashes of the
// G2 blocks it has pinned, right before it writes their bytes to G3 (nil:
// no call). A test holds the write there and fills G2 under it.
func (m *Manager) SetH2DiskPutHook(f func([]uint64)) {
	if f == nil {
		m.testHookH2DiskPut.Store(nil)
		return
	}
	m.testHookH2DiskPut.Store(&f)
}

// QueueOnboardChunk pins the blocks hashes in the pool of tier from (G2:
// TierHostPinned, G3: TierDisk) and queues one chunk copying them into G1
// blocks g1 (H2D, or Disk2H through the staging buffer), as Onboard does,
// but with no Onboard call waiting on it: what Close finds when it wins the
// race with an Onboard's own settle for a chunk still queued, a window too
// narrow to hit on purpose. deadline is the Onboard's (zero: none): one
// already past is what a worker finds when it takes the chunk before the
// call woke at its deadline to take it back. The channel returned is closed
// once the chunk is settled (the Onboard's Result.Settled).
func (m *Manager) QueueOnboardChunk(from kvevent.Tier, hashes []uint64, g1 []int, deadline time.Time) (<-chan struct{}, error) {
	op := &onboardOp{settled: make(chan struct{}), deadline: deadline}
	op.remaining.Store(1)
	ch := &chunk{op: op, from: from}
	for i, h := range hashes {
		var src backend.Ptr
		if from == kvevent.TierDisk {
			if err := m.disk.Acquire(h); err != nil {
				return nil, err
			}
		} else {
			s, err := m.host.Acquire(h)
			if err != nil {
				return nil, err
			}
			src = s.Ptr
		}
		ch.idx = append(ch.idx, i)
		ch.hashes = append(ch.hashes, h)
		ch.dst = append(ch.dst, m.g1.at(g1[i]))
		ch.src = append(ch.src, src)
		ch.errs = append(ch.errs, nil)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	l := m.lanes[m.chunkPath(ch)]
	l.chunks = append(l.chunks, ch)
	l.depth += len(ch.hashes)
	l.cond.Signal()
	return op.settled, nil
}
