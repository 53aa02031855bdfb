package manager

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
