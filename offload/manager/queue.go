package manager

import (
	"container/heap"

	"github.com/kvrouter/kvrouter/offload/pool"
)

// A task is one queued copy of one block.
//
// The queue holds weak references: a task names its source, it does not
// own it. For G1→G2 and G1→G3 the source is a G1 block id with the block's
// generation when the task was queued (see Manager.Free); for G2→G3 it is
// the block's hash, which may have left G2 by the time the task runs. The
// worker that runs a task checks the reference then, and skips the task
// when it is stale, rather than the queue keeping the source alive: a
// queued offload must never hold the engine's memory or a G2 slot.
type task struct {
	prio int
	seq  uint64 // arrival order, from the queue
	pos  [2]int // index in the best (0) and worst (1) heaps; -1 when not queued

	g1    int    // source G1 block id; -1 for H2Disk
	gen   uint64 // generation of g1 when queued
	block pool.Block
}

// taskQueue is a bounded double-ended priority queue of tasks.
//
// pop takes the best task: the highest priority, and the oldest among equal
// priorities (FIFO within a priority). When a push overfills the queue, the
// worst task is shed: the lowest priority, and the oldest among those. The
// oldest goes rather than the newest because an old task's G1 block is the
// likeliest to have been freed already (its copy would be skipped anyway)
// and a recently computed block the likeliest to be reused. The new task
// itself is shed only when its priority is lower than every queued one.
//
// Two binary heaps over the same tasks, each task knowing its index in
// both, make push, pop, shed and remove O(log n).
type taskQueue struct {
	capacity int
	seq      uint64
	best     taskHeap // pos[0]; the next task on top
	worst    taskHeap // pos[1]; the task to shed on top
}

// newTask returns a task that is in no queue.
func newTask(prio, g1 int, gen uint64, b pool.Block) *task {
	return &task{prio: prio, pos: [2]int{-1, -1}, g1: g1, gen: gen, block: b}
}

func newTaskQueue(capacity int) *taskQueue {
	return &taskQueue{capacity: capacity, best: taskHeap{slot: 0, less: better}, worst: taskHeap{slot: 1, less: worse}}
}

func (q *taskQueue) len() int { return len(q.best.ts) }

// push queues t and, when that overfills the queue, sheds and returns the
// worst task (possibly t itself); otherwise it returns nil.
func (q *taskQueue) push(t *task) (shed *task) {
	q.seq++
	t.seq = q.seq
	heap.Push(&q.best, t)
	heap.Push(&q.worst, t)
	if q.len() <= q.capacity {
		return nil
	}
	shed = q.worst.ts[0]
	q.remove(shed)
	return shed
}

// pop removes and returns the best task, or nil when the queue is empty.
func (q *taskQueue) pop() *task {
	if q.len() == 0 {
		return nil
	}
	t := q.best.ts[0]
	q.remove(t)
	return t
}

// remove takes t out of the queue; it reports false when t is not queued.
func (q *taskQueue) remove(t *task) bool {
	if t.pos[0] < 0 {
		return false
	}
	heap.Remove(&q.best, t.pos[0])
	heap.Remove(&q.worst, t.pos[1])
	return true
}

// taskHeap is one of the queue's two views of its tasks, a heap whose
// top is the task before every other by less; the task's pos[slot] is its
// place in this heap (-1 when out of it), for heap.Remove.
type taskHeap struct {
	ts   []*task
	slot int
	less func(a, b *task) bool
}

// better: highest priority, then oldest — the best heap's order.
func better(a, b *task) bool { return a.prio > b.prio || a.prio == b.prio && a.seq < b.seq }

// worse: lowest priority, then oldest — the order of the task to shed.
func worse(a, b *task) bool { return a.prio < b.prio || a.prio == b.prio && a.seq < b.seq }

func (h *taskHeap) Len() int           { return len(h.ts) }
func (h *taskHeap) Less(i, j int) bool { return h.less(h.ts[i], h.ts[j]) }
func (h *taskHeap) Swap(i, j int) {
	h.ts[i], h.ts[j] = h.ts[j], h.ts[i]
	h.ts[i].pos[h.slot], h.ts[j].pos[h.slot] = i, j
}
func (h *taskHeap) Push(x any) {
	t := x.(*task)
	t.pos[h.slot] = len(h.ts)
	h.ts = append(h.ts, t)
}
func (h *taskHeap) Pop() any {
	t := h.ts[len(h.ts)-1]
	h.ts[len(h.ts)-1] = nil
	h.ts = h.ts[:len(h.ts)-1]
	t.pos[h.slot] = -1
	return t
}
