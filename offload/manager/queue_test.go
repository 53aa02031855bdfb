package manager

import (
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/kvrouter/kvrouter/offload/pool"
)

// queueModel is the naive reference for taskQueue: tasks in arrival order,
// every choice a scan. Best is the highest priority, oldest first; the task
// shed when over capacity is the lowest priority, oldest first.
type queueModel struct {
	capacity int
	ts       []*task // arrival order
}

func (m *queueModel) pick(better func(a, b *task) bool) int {
	best := -1
	for i, t := range m.ts {
		if best < 0 || better(t, m.ts[best]) {
			best = i
		}
	}
	return best
}

func (m *queueModel) take(i int) *task {
	t := m.ts[i]
	m.ts = slices.Delete(m.ts, i, i+1)
	return t
}

// push appends t and returns the task shed, or nil. Scanning in arrival
// order with a strict comparison finds the oldest among equals.
func (m *queueModel) push(t *task) *task {
	m.ts = append(m.ts, t)
	if len(m.ts) <= m.capacity {
		return nil
	}
	return m.take(m.pick(func(a, b *task) bool { return a.prio < b.prio }))
}

func (m *queueModel) pop() *task {
	if len(m.ts) == 0 {
		return nil
	}
	return m.take(m.pick(func(a, b *task) bool { return a.prio > b.prio }))
}

func TestQueueMatchesSortedModelIncludingShedding(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		capacity := rapid.IntRange(1, 8).Draw(t, "capacity")
		q := newTaskQueue(capacity)
		model := &queueModel{capacity: capacity}
		var gone []*task // popped, shed or removed
		id := 0
		name := func(x *task) int {
			if x == nil {
				return -1
			}
			return x.g1
		}
		t.Repeat(map[string]func(*rapid.T){
			"push": func(t *rapid.T) {
				prio := rapid.IntRange(-1, 3).Draw(t, "prio")
				id++
				x := newTask(prio, id, 0, pool.Block{Hash: uint64(id)})
				got, want := q.push(x), model.push(x)
				if got != want {
					t.Fatalf("push task %d (priority %d) shed task %d, model sheds %d", id, prio, name(got), name(want))
				}
				if got != nil {
					gone = append(gone, got)
				}
			},
			"pop": func(t *rapid.T) {
				got, want := q.pop(), model.pop()
				if got != want {
					t.Fatalf("pop returned task %d, model returns %d", name(got), name(want))
				}
				if got != nil {
					gone = append(gone, got)
				}
			},
			"remove": func(t *rapid.T) {
				if len(model.ts) == 0 {
					t.Skip("nothing queued")
				}
				i := rapid.IntRange(0, len(model.ts)-1).Draw(t, "index")
				x := model.take(i)
				if !q.remove(x) {
					t.Fatalf("remove of queued task %d reported it not queued", x.g1)
				}
				gone = append(gone, x)
			},
			"remove gone": func(t *rapid.T) {
				if len(gone) == 0 {
					t.Skip("nothing gone")
				}
				x := rapid.SampledFrom(gone).Draw(t, "task")
				if q.remove(x) {
					t.Fatalf("remove of task %d, no longer queued, reported it removed", x.g1)
				}
			},
			"": func(t *rapid.T) {
				if q.len() != len(model.ts) {
					t.Fatalf("queue holds %d tasks, model %d", q.len(), len(model.ts))
				}
				if q.len() > capacity {
					t.Fatalf("queue holds %d tasks, capacity %d", q.len(), capacity)
				}
			},
		})
		// Draining gives the model's order.
		for range len(model.ts) + 1 {
			if got, want := q.pop(), model.pop(); got != want {
				t.Fatalf("drain: pop returned task %d, model returns %d", name(got), name(want))
			}
		}
	})
}

func TestQueueShedsOldestOfLowestPriorityAndRefusesLowerNewcomer(t *testing.T) {
	q := newTaskQueue(3)
	a, b, c := newTask(1, 1, 0, pool.Block{}), newTask(1, 2, 0, pool.Block{}), newTask(5, 3, 0, pool.Block{})
	for _, x := range []*task{a, b, c} {
		if shed := q.push(x); shed != nil {
			t.Fatalf("push into a queue with room shed task %d", shed.g1)
		}
	}
	if shed := q.push(newTask(1, 4, 0, pool.Block{})); shed != a {
		t.Fatalf("a full queue shed %v, want the oldest task of the lowest priority (1)", shed)
	}
	low := newTask(0, 5, 0, pool.Block{})
	if shed := q.push(low); shed != low {
		t.Fatalf("a full queue shed %v, want the newcomer whose priority is below everything queued", shed)
	}
	var order []int
	for x := q.pop(); x != nil; x = q.pop() {
		order = append(order, x.g1)
	}
	if want := []int{3, 2, 4}; !slices.Equal(order, want) {
		t.Fatalf("pop order %v, want %v (priority, then arrival)", order, want)
	}
}
