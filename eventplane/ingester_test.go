package eventplane

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// fakeTarget is a leader that commits nothing: it records what it is
// given, and its IngestEvents waits while hold is set (until release).
type fakeTarget struct {
	mu       sync.Mutex
	workers  map[uint64]raftfsm.WorkerInfo
	removed  []uint64
	failNext int // DeregisterWorker fails this many more times
	deregs   int // DeregisterWorker calls
	ingested []raftfsm.RankBatch
	dumps    []uint64 // the incarnation of each dump
	calls    int
	hold     chan struct{} // nil: IngestEvents returns at once

	workersMu        sync.Mutex // the node's worker-table lock (raftfsm.Node.WorkersMutex)
	unlockedRemovals int        // removals made without it held
}

func (t *fakeTarget) WorkersMutex() *sync.Mutex { return &t.workersMu }

func newFakeTarget() *fakeTarget { return &fakeTarget{workers: map[uint64]raftfsm.WorkerInfo{}} }

func (t *fakeTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	t.mu.Lock()
	t.calls++
	hold := t.hold
	t.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ingested = append(t.ingested, bs...)
	acks := make([]raftfsm.RankAck, len(bs))
	for i, b := range bs { // every batch applies
		acks[i] = raftfsm.RankAck{Rank: b.Rank, Cursor: b.Events[len(b.Events)-1].EventID, Applied: len(b.Events)}
	}
	return acks, nil
}

func (t *fakeTarget) ReplaceRankFenced(_ context.Context, _ kvevent.Rank, _, incarnation uint64, _ []kvevent.Event) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dumps = append(t.dumps, incarnation)
	return nil
}

func (t *fakeTarget) IsLeader() bool { return true }

func (t *fakeTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[uint64]raftfsm.WorkerInfo, len(t.workers))
	for k, v := range t.workers {
		out[k] = v
	}
	return out
}

func (t *fakeTarget) DeregisterWorker(_ context.Context, id uint64) error {
	held := !t.workersMu.TryLock()
	if !held {
		t.workersMu.Unlock()
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if !held {
		t.unlockedRemovals++
	}
	t.deregs++
	if t.failNext > 0 {
		t.failNext--
		return errors.New("no quorum")
	}
	if _, ok := t.workers[id]; !ok {
		return raftfsm.ErrUnknownWorker
	}
	delete(t.workers, id)
	t.removed = append(t.removed, id)
	return nil
}

func (t *fakeTarget) register(id uint64, lease time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.workers[id] = raftfsm.WorkerInfo{ID: id, LeaseMs: lease.Milliseconds()}
}

func (t *fakeTarget) removedIDs() []uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.removed)
}

// sweep runs one lease sweep at now and waits for the removals it starts.
func sweep(in *Ingester, now time.Time) {
	in.sweepLeases(now)
	in.cwg.Wait()
}

// sightedBy returns an ingester of tg with the given unregistered grace,
// leading since t0 (returned) in term 0, whose first sweep at t0 has seen
// what tg holds.
func sightedBy(tg Target, grace time.Duration) (*Ingester, time.Time) {
	in := newIngester(IngesterConfig{Node: tg, UnregisteredGrace: grace, Logger: quiet})
	t0 := time.Now()
	in.leases.lead(t0, 0)
	sweep(in, t0)
	return in, t0
}

// TestLeaseStartsWhenTheLeaderFirstSeesTheWorker: a worker registered long
// after the election gets a whole lease before its first heartbeat is due
// (its lease used to run from the election, so the next sweep removed it);
// heartbeats extend it; silence past it removes it.
func TestLeaseStartsWhenTheLeaderFirstSeesTheWorker(t *testing.T) {
	tg := newFakeTarget()
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	t0 := time.Now()
	in.leases.lead(t0, 0)
	sweep(in, t0.Add(time.Minute)) // nothing registered yet

	const lease = 10 * time.Second
	tg.register(7, lease)
	t1 := t0.Add(time.Minute + 250*time.Millisecond) // the next sweep
	sweep(in, t1)
	sweep(in, t1.Add(lease-time.Millisecond))
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("worker removed %v within a lease of its registration, before any heartbeat was due", r)
	}
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, []uint64{7})})
	sweep(in, time.Now().Add(lease-time.Millisecond))
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("worker removed %v within a lease of its heartbeat", r)
	}
	sweep(in, time.Now().Add(lease+time.Second))
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{7}) {
		t.Fatalf("removed %v, want [7] after a lease of silence", r)
	}
	if _, ok := in.leases.seen[7]; ok {
		t.Fatal("a removed worker's heartbeat time is kept")
	}
	// The removal was made under the node's worker-table lock, so that a
	// compatible API's read-modify-write cannot bring the worker back.
	if tg.unlockedRemovals != 0 {
		t.Fatalf("%d lease removals made without the node's worker-table lock", tg.unlockedRemovals)
	}
}

// TestNewLeaderGivesEveryWorkerALease: the workers in the table at an
// election get a lease from it, whatever their last heartbeat to the old
// leader.
func TestNewLeaderGivesEveryWorkerALease(t *testing.T) {
	tg := newFakeTarget()
	tg.register(1, time.Second)
	tg.register(2, 0) // no lease: stays
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	t0 := time.Now()
	in.leases.lead(t0, 0)
	sweep(in, t0)
	sweep(in, t0.Add(time.Second))
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("removed %v within a lease of the election", r)
	}
	sweep(in, t0.Add(time.Second+time.Millisecond))
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{1}) {
		t.Fatalf("removed %v, want [1]", r)
	}
}

// TestHeartbeatsOfUnknownWorkersAreNotKept: the leader remembers only
// registered workers, so a heartbeat naming many ids no worker has does
// not grow its memory, and a worker deregistered some other way is
// forgotten at the next sweep. Unknown ids are answered as unknown.
func TestHeartbeatsOfUnknownWorkersAreNotKept(t *testing.T) {
	tg := newFakeTarget()
	tg.register(5, time.Minute)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	in.leases.lead(time.Now(), 0)
	ids := make([]uint64, maxHeartbeatIDs-1) // the most one heartbeat carries, with 5
	for i := range ids {
		ids[i] = uint64(i) + 1000
	}
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, append(ids, 5))})
	if n := len(in.leases.seen); n != 1 {
		t.Fatalf("the leader keeps %d heartbeat times, want 1 (the registered worker)", n)
	}
	tg.mu.Lock()
	delete(tg.workers, 5) // deregistered through the API
	tg.mu.Unlock()
	sweep(in, time.Now())
	if n := len(in.leases.seen); n != 0 {
		t.Fatalf("the leader keeps %d heartbeat times after the worker left, want 0", n)
	}
}

// TestHeartbeatsCountEachWorkerIDOnce: kvrouter_worker_heartbeats_total
// counts one per worker id of each heartbeat (docs/operations.md), known
// or not, however often the id comes in it. From a review: it counted
// every id of the body, repeats included.
func TestHeartbeatsCountEachWorkerIDOnce(t *testing.T) {
	tg := newFakeTarget()
	tg.register(5, time.Minute)
	tg.register(6, time.Minute)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	in.leases.lead(time.Now(), 0)
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, []uint64{5, 99, 5, 6, 99, 5})})
	if n := val(in.m.heartbeats); n != 3 {
		t.Fatalf("kvrouter_worker_heartbeats_total = %v after a heartbeat of ids 5, 6 and 99, want 3", n)
	}
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, []uint64{6})})
	if n := val(in.m.heartbeats); n != 4 {
		t.Fatalf("kvrouter_worker_heartbeats_total = %v after another of id 6, want 4", n)
	}
}

// TestAHeartbeatOfTooManyIDsIsRefusedUnread: a heartbeat of more than
// maxHeartbeatIDs ids is malformed, counted as such and none of its ids
// heard; one of maxHeartbeatIDs is read. From a review: heartbeats of up
// to the payload limit (1 Mi ids) were each read, tens of ms apiece,
// and a stream of them from anyone on NATS filled the heartbeat
// subscription's pending buffer: nats.go dropped live workers'
// heartbeats (a few of a hundred within 5 s).
func TestAHeartbeatOfTooManyIDsIsRefusedUnread(t *testing.T) {
	tg := newFakeTarget()
	tg.register(5, time.Minute)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	in.leases.lead(time.Now(), 0)
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, slices.Repeat([]uint64{5}, maxHeartbeatIDs+1))})
	if n, bad := val(in.m.heartbeats), val(in.m.malformedHeartbeats); n != 0 || bad != 1 {
		t.Fatalf("a heartbeat of %d ids: kvrouter_worker_heartbeats_total %v, _malformed_total %v; want 0 and 1", maxHeartbeatIDs+1, n, bad)
	}
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, slices.Repeat([]uint64{5}, maxHeartbeatIDs))})
	if n, bad := val(in.m.heartbeats), val(in.m.malformedHeartbeats); n != 1 || bad != 1 {
		t.Fatalf("a heartbeat of %d ids: kvrouter_worker_heartbeats_total %v, _malformed_total %v; want 1 and 1", maxHeartbeatIDs, n, bad)
	}
}

// TestFailedRemovalIsRetriedAtTheNextSweep: a removal that fails (no
// quorum) is tried again at the next sweep, not a lease later.
func TestFailedRemovalIsRetriedAtTheNextSweep(t *testing.T) {
	tg := newFakeTarget()
	tg.register(3, time.Second)
	tg.failNext = 1
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	t0 := time.Now()
	in.leases.lead(t0, 0)
	sweep(in, t0)
	sweep(in, t0.Add(2*time.Second)) // expired; the removal fails
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("removed %v through a failing target", r)
	}
	sweep(in, t0.Add(2*time.Second+250*time.Millisecond))
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{3}) {
		t.Fatalf("removed %v at the sweep after a failed removal, want [3]", r)
	}
}

// TestHeartbeatWhileAnExpiryWaitsKeepsTheWorker: a sweep finds worker 7's
// lease run out and starts its removal, which waits for the worker-table
// lock (a registration holds it); meanwhile the worker's heartbeat comes,
// and is answered "known". The removal then leaves the worker alone, as
// it does worker 8, registered anew without a lease meanwhile; worker 9,
// silent, is removed. From a review: the removal went ahead unchecked.
func TestHeartbeatWhileAnExpiryWaitsKeepsTheWorker(t *testing.T) {
	tg := newFakeTarget()
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	const lease = 10 * time.Second
	for _, id := range []uint64{7, 8, 9} {
		tg.register(id, lease)
	}
	now := time.Now()
	t0 := now.Add(-lease - time.Second)
	in.leases.lead(t0, 0)
	sweep(in, t0) // first seen

	tg.workersMu.Lock()
	in.sweepLeases(now) // all three expired: their removals wait for the lock
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, []uint64{7})})
	tg.register(8, 0) // under the lock, as a registration through the node
	tg.workersMu.Unlock()
	in.cwg.Wait()
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{9}) {
		t.Fatalf("workers %v removed, want [9]: 7's heartbeat came and 8 registered anew while the removals waited", r)
	}
	if got := val(in.m.expired); got != 1 {
		t.Fatalf("kvrouter_worker_leases_expired_total = %v, want 1", got)
	}
	sweep(in, now) // judged anew: 7 heard within its lease, 8 leaseless
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{9}) {
		t.Fatalf("workers %v removed at the next sweep, want [9] still", r)
	}
	if len(in.leases.expiry) != 0 {
		t.Fatalf("%d removals still marked in flight", len(in.leases.expiry))
	}
}

// strayTarget is a fakeTarget that also lists the ranks it holds state of
// that no registration lists (raftfsm.Node.UnregisteredRanks; a
// registration without dp ranks lists dp 0); a deregistration takes the
// worker's ranks off the list, and a rank removal the ranks it removes.
type strayTarget struct {
	*fakeTarget
	stray   []kvevent.Rank // in rank order
	strayed []uint64       // the workers whose ranks a deregistration took
	dropped []kvevent.Rank // the ranks rank removals took
}

// listed says whether a registration lists r. t.mu is held.
func (t *strayTarget) listed(r kvevent.Rank) bool {
	w, ok := t.workers[r.Worker]
	return ok && (slices.Contains(w.DPRanks, r.DP) || len(w.DPRanks) == 0 && r.DP == 0)
}

func (t *strayTarget) UnregisteredRanks() []kvevent.Rank {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []kvevent.Rank
	for _, r := range t.stray {
		if !t.listed(r) {
			out = append(out, r)
		}
	}
	return out
}

func (t *strayTarget) RemoveUnregisteredRanks(_ context.Context, ranks []kvevent.Rank) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := len(t.stray)
	t.stray = slices.DeleteFunc(t.stray, func(r kvevent.Rank) bool {
		if slices.Contains(ranks, r) && !t.listed(r) {
			t.dropped = append(t.dropped, r)
			return true
		}
		return false
	})
	return n - len(t.stray), nil
}

func (t *strayTarget) droppedRanks() []kvevent.Rank {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.dropped)
}

func (t *strayTarget) DeregisterWorker(ctx context.Context, id uint64) error {
	_, err := t.DeregisterWorkerRanks(ctx, id)
	return err
}

// DeregisterWorkerRanks answers how many ranks of the list it took, as
// raftfsm.Node's does (with ErrUnknownWorker too).
func (t *strayTarget) DeregisterWorkerRanks(ctx context.Context, id uint64) (int, error) {
	t.mu.Lock()
	n := len(t.stray)
	t.stray = slices.DeleteFunc(t.stray, func(r kvevent.Rank) bool { return r.Worker == id })
	took := n - len(t.stray)
	if took > 0 {
		t.strayed = append(t.strayed, id)
	}
	t.mu.Unlock()
	return took, t.fakeTarget.DeregisterWorker(ctx, id)
}

func (t *strayTarget) strayedIDs() []uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.strayed)
}

// TestUnregisteredWorkersRanksAreRemovedAfterTheGrace: the ranks of a
// worker that is not registered (its agent publishes after its removal,
// or never registered) are removed once it stays so for the grace from
// the leader's first sighting; a worker that registers meanwhile keeps
// its ranks. From the event-plane review: such ranks were never removed.
func TestUnregisteredWorkersRanksAreRemovedAfterTheGrace(t *testing.T) {
	tg := &strayTarget{fakeTarget: newFakeTarget(),
		stray: []kvevent.Rank{{Worker: 7, DP: 0}, {Worker: 7, DP: 1}, {Worker: 8, DP: 0}}}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	sweep(in, t0.Add(grace))
	if r := tg.strayedIDs(); len(r) != 0 {
		t.Fatalf("ranks of workers %v removed within the grace", r)
	}
	tg.register(8, 0) // registers in time: keeps its rank
	sweep(in, t0.Add(grace+time.Millisecond))
	if r := tg.strayedIDs(); !slices.Equal(r, []uint64{7}) {
		t.Fatalf("ranks of workers %v removed past the grace, want [7]", r)
	}
	if got := val(in.m.unregRemoved); got != 2 {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v, want 2 (worker 7's ranks)", got)
	}
	if tg.unlockedRemovals != 0 {
		t.Fatalf("%d removals made without the node's worker-table lock", tg.unlockedRemovals)
	}
	if n := len(in.leases.unreg); n != 0 {
		t.Fatalf("the leader remembers %d unregistered workers, want none", n)
	}

	// Worker 7's agent sends on, and dumps its rank anew: a new grace.
	tg.mu.Lock()
	tg.stray = append(tg.stray, kvevent.Rank{Worker: 7})
	tg.mu.Unlock()
	t1 := t0.Add(time.Minute)
	sweep(in, t1)
	sweep(in, t1.Add(grace))
	if r := tg.strayedIDs(); len(r) != 1 {
		t.Fatalf("ranks of workers %v removed, want [7] once: the rank that came back has a grace of its own", r)
	}
	sweep(in, t1.Add(grace+time.Millisecond))
	if r := tg.strayedIDs(); !slices.Equal(r, []uint64{7, 7}) {
		t.Fatalf("ranks of workers %v removed, want [7 7]", r)
	}
}

// removedFirstTarget is a strayTarget where another removal of the
// worker (an operator's DELETE /v1/workers/{id}, which for a worker not
// registered takes its ranks and answers unknown) commits just before the
// ingester's own deregistration: the ingester's entry removes nothing.
type removedFirstTarget struct{ *strayTarget }

func (t *removedFirstTarget) DeregisterWorkerRanks(ctx context.Context, id uint64) (int, error) {
	t.mu.Lock()
	t.stray = slices.DeleteFunc(t.stray, func(r kvevent.Rank) bool { return r.Worker == id })
	t.mu.Unlock()
	return t.strayTarget.DeregisterWorkerRanks(ctx, id)
}

// TestStrayRemovalCountsOnlyRanksItRemoved: kvrouter_unregistered_ranks_removed_total
// is "ranks the leader removed" (docs/operations.md): the removal of an
// unregistered worker's ranks counts what its entry removed, as the
// unlisted ranks' removal does (TestRemoveRanksCountsOnlyRanksItRemoved).
// Another removal that took the ranks first leaves it nothing to count,
// though its entry answers ErrUnknownWorker all the same. From a review:
// it counted the ranks the sweep listed.
func TestStrayRemovalCountsOnlyRanksItRemoved(t *testing.T) {
	tg := &removedFirstTarget{&strayTarget{fakeTarget: newFakeTarget(),
		stray: []kvevent.Rank{{Worker: 7, DP: 0}, {Worker: 7, DP: 1}}}}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	sweep(in, t0.Add(grace+time.Millisecond))
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("setup: workers %v removed, want none (7 is not registered)", r)
	}
	if n := len(in.leases.unreg) + len(in.leases.strays); n != 0 {
		t.Fatalf("the leader remembers %d unregistered workers or removals in flight, want none: the removal was made", n)
	}
	if got := val(in.m.unregRemoved); got != 0 {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v, want 0: another removal took worker 7's ranks before the leader's entry applied, which removed nothing", got)
	}
}

// TestRegisteredWorkersUnlistedRanksAreRemovedAfterTheGrace: the ranks
// of a registered worker that its registration does not list (anyone may
// publish them) are removed rank by rank once listed for the grace from
// the leader's first sighting, the worker staying registered; a rank that
// a registration lists meanwhile (events ahead of the re-registration
// adding it) keeps its state. From a review: such ranks were never
// removed while their worker stayed registered.
func TestRegisteredWorkersUnlistedRanksAreRemovedAfterTheGrace(t *testing.T) {
	listed, late, stray := kvevent.Rank{Worker: 1}, kvevent.Rank{Worker: 1, DP: 5}, kvevent.Rank{Worker: 1, DP: 9}
	tg := &strayTarget{fakeTarget: newFakeTarget(), stray: []kvevent.Rank{listed, late, stray}}
	tg.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0}}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	sweep(in, t0.Add(grace))
	if r := tg.droppedRanks(); len(r) != 0 {
		t.Fatalf("ranks %v removed within the grace", r)
	}
	tg.mu.Lock() // the re-registration adding dp 5 commits in time
	tg.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0, 5}}
	tg.mu.Unlock()
	sweep(in, t0.Add(grace+time.Millisecond))
	if r := tg.droppedRanks(); !slices.Equal(r, []kvevent.Rank{stray}) {
		t.Fatalf("ranks %v removed past the grace, want [%v]", r, stray)
	}
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("workers %v removed: a rank's removal must leave its registered worker", r)
	}
	if got := val(in.m.unregRemoved); got != 1 {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v, want 1", got)
	}
	if n := len(in.leases.unlisted); n != 0 || in.leases.unlistedRun {
		t.Fatalf("the leader remembers %d unlisted ranks (a removal in flight: %v), want none", n, in.leases.unlistedRun)
	}

	// The rank's publisher sends on: a new grace.
	tg.mu.Lock()
	tg.stray = append(tg.stray, stray)
	tg.mu.Unlock()
	t1 := t0.Add(time.Minute)
	sweep(in, t1)
	sweep(in, t1.Add(grace))
	if r := tg.droppedRanks(); len(r) != 1 {
		t.Fatalf("ranks %v removed, want [%v] once: the rank that came back has a grace of its own", r, stray)
	}
	sweep(in, t1.Add(grace+time.Millisecond))
	if r := tg.droppedRanks(); !slices.Equal(r, []kvevent.Rank{stray, stray}) {
		t.Fatalf("ranks %v removed, want [%v %v]", r, stray, stray)
	}
}

// gatedRemover is a strayTarget whose rank removals wait for gate.
type gatedRemover struct {
	*strayTarget
	gate chan struct{}
}

func (g *gatedRemover) RemoveUnregisteredRanks(ctx context.Context, ranks []kvevent.Rank) (int, error) {
	<-g.gate
	return g.strayTarget.RemoveUnregisteredRanks(ctx, ranks)
}

// TestUnlistedRankListedDuringARemovalGetsAFreshGrace: a registered
// worker's unlisted rank c is first seen at t0+grace/2. While a removal
// of another rank is in flight, a sweep finds c listed (a re-registration
// adds it), and a later registration drops it again: c gets a new grace
// from the sweep after. From a review: the sweeps during a run neither
// forgot c's old sighting nor noted new ones (dueUnlisted returned at
// once while a removal was in flight), so c was removed at t0+1.5*grace,
// less than a grace after it became unlisted again; the unregistered-
// worker path forgets regardless of its run.
func TestUnlistedRankListedDuringARemovalGetsAFreshGrace(t *testing.T) {
	a, c := kvevent.Rank{Worker: 1, DP: 5}, kvevent.Rank{Worker: 1, DP: 7}
	st := &strayTarget{fakeTarget: newFakeTarget(), stray: []kvevent.Rank{a}}
	st.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0}}
	tg := &gatedRemover{strayTarget: st, gate: make(chan struct{})}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	st.mu.Lock()
	st.stray = []kvevent.Rank{a, c}
	st.mu.Unlock()
	sweep(in, t0.Add(grace/2)) // c first seen

	in.sweepLeases(t0.Add(grace + time.Millisecond)) // a's removal, waiting
	st.mu.Lock()
	st.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0, 7}} // c listed
	st.mu.Unlock()
	in.sweepLeases(t0.Add(grace + 2*time.Millisecond)) // sees c listed
	st.mu.Lock()
	st.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0}} // c unlisted again
	st.mu.Unlock()
	close(tg.gate)
	in.cwg.Wait()
	if got := st.droppedRanks(); !slices.Equal(got, []kvevent.Rank{a}) {
		t.Fatalf("setup: ranks %v removed, want [%v]", got, a)
	}

	sweep(in, t0.Add(grace/2+grace+time.Millisecond))
	if got := st.droppedRanks(); slices.Contains(got, c) {
		t.Fatalf("rank %v removed at t0+1.5*grace, though a sweep at t0+grace found it listed: its grace ran from its old sighting (removed %v)", c, got)
	}
}

// TestStrayWorkersAreRemovedByOneRunAtATime: past the grace, the ranks of
// many unregistered workers (anyone may publish for any worker id) are
// removed by one goroutine per sweep, at most maxStrayRemovals workers a
// run, in worker order, and no run starts while one is in flight. From a
// review: one sweep started a goroutine per stray worker, 20000 for 20000.
func TestStrayWorkersAreRemovedByOneRunAtATime(t *testing.T) {
	const n = 3*maxStrayRemovals + 10
	tg := &strayTarget{fakeTarget: newFakeTarget()}
	for i := range n {
		tg.stray = append(tg.stray, kvevent.Rank{Worker: uint64(1000 + i)})
	}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	base := runtime.NumGoroutine()
	tg.workersMu.Lock() // a registration holds the table lock: the run waits
	now := t0.Add(grace + time.Millisecond)
	in.sweepLeases(now)
	in.sweepLeases(now) // a run is in flight: starts none
	started := runtime.NumGoroutine() - base
	tg.workersMu.Unlock()
	in.cwg.Wait()
	if started > 1 {
		t.Errorf("two sweeps started %d goroutines for %d stray workers, want one", started, n)
	}
	got := tg.strayedIDs()
	if len(got) != maxStrayRemovals {
		t.Fatalf("one run removed %d stray workers, want %d", len(got), maxStrayRemovals)
	}
	if !slices.IsSorted(got) || got[0] != 1000 {
		t.Fatalf("a run removed workers %v..., want them in order from 1000", got[:4])
	}
	runs := 1
	for len(got) < n && runs < 10 {
		sweep(in, now)
		runs++
		got = tg.strayedIDs()
	}
	if len(got) != n || runs != 4 {
		t.Fatalf("%d runs removed %d of %d stray workers, want all in 4", runs, len(got), n)
	}
	if got := val(in.m.unregRemoved); got != n {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v, want %d", got, n)
	}
	if len(in.leases.strays) != 0 || len(in.leases.unreg) != 0 {
		t.Fatalf("the leader still marks %d removals in flight and %d strays", len(in.leases.strays), len(in.leases.unreg))
	}
}

// sizedRemover is a strayTarget that records how many ranks each rank
// removal names (each is one Raft entry on a node).
type sizedRemover struct {
	*strayTarget
	sizes []int // under fakeTarget.mu
}

func (t *sizedRemover) RemoveUnregisteredRanks(ctx context.Context, ranks []kvevent.Rank) (int, error) {
	t.mu.Lock()
	t.sizes = append(t.sizes, len(ranks))
	t.mu.Unlock()
	return t.strayTarget.RemoveUnregisteredRanks(ctx, ranks)
}

// TestUnlistedRanksAreRemovedAtMostMaxStrayRemovalsAnEntry: past the
// grace, the unlisted ranks of a registered worker (anyone may publish
// any dp rank of it) are removed by one entry per sweep of at most
// maxStrayRemovals ranks, in rank order, the rest by the sweeps after.
func TestUnlistedRanksAreRemovedAtMostMaxStrayRemovalsAnEntry(t *testing.T) {
	const n = 2*maxStrayRemovals + 10
	tg := &sizedRemover{strayTarget: &strayTarget{fakeTarget: newFakeTarget()}}
	tg.workers[1] = raftfsm.WorkerInfo{ID: 1, DPRanks: []uint32{0}}
	for i := range n {
		tg.stray = append(tg.stray, kvevent.Rank{Worker: 1, DP: uint32(1 + i)})
	}
	const grace = 10 * time.Second
	in, t0 := sightedBy(tg, grace)
	now := t0.Add(grace + time.Millisecond)
	sweep(in, now)
	got := tg.droppedRanks()
	if len(got) != maxStrayRemovals {
		t.Fatalf("one sweep removed %d unlisted ranks, want %d", len(got), maxStrayRemovals)
	}
	if !slices.IsSortedFunc(got, kvevent.Rank.Compare) || got[0].DP != 1 {
		t.Fatalf("a removal took ranks %v..., want them in order from 1/1", got[:4])
	}
	for range 2 {
		sweep(in, now)
	}
	if got := tg.droppedRanks(); len(got) != n {
		t.Fatalf("three sweeps removed %d of %d unlisted ranks, want all", len(got), n)
	}
	tg.mu.Lock()
	sizes := slices.Clone(tg.sizes)
	tg.mu.Unlock()
	if !slices.Equal(sizes, []int{maxStrayRemovals, maxStrayRemovals, 10}) {
		t.Fatalf("removals of %v ranks, want %d, %d and 10", sizes, maxStrayRemovals, maxStrayRemovals)
	}
	if got := val(in.m.unregRemoved); got != n {
		t.Fatalf("kvrouter_unregistered_ranks_removed_total = %v, want %d", got, n)
	}
}

// clearedEvents returns an events request of n cleared events of rank r,
// numbered from first.
func clearedEvents(r kvevent.Rank, first uint64, n int) *nats.Msg {
	evs := make([]kvevent.Event, n)
	for i := range evs {
		evs[i] = kvevent.Event{Rank: r, EventID: first + uint64(i), Kind: kvevent.KindCleared}
	}
	return &nats.Msg{Data: appendEvents(nil, []raftfsm.RankBatch{{Rank: r, Events: evs}})}
}

// asRequest gives m a reply subject, as a publisher's request has: the
// ingester counts only the messages it answers (its answer, the message
// bound to no subscription, goes nowhere).
func asRequest(m *nats.Msg) *nats.Msg {
	m.Reply = "_INBOX.test"
	return m
}

// TestDecodedEventsWaitingAreBounded: with the commits stalled, requests
// queue until MaxQueuedEvents events wait; the next request's callback
// then waits for room (leaving further requests in NATS) and goes on once
// the commits do. A request over MaxRequestEvents is refused undecoded.
func TestDecodedEventsWaitingAreBounded(t *testing.T) {
	tg := newFakeTarget()
	tg.hold = make(chan struct{})
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet, MaxInFlight: 1,
		MaxEntryEvents: 4, MaxRequestEvents: 4, MaxQueuedEvents: 8})
	in.wg.Add(1)
	go in.batcher()
	defer in.Close()
	r := kvevent.Rank{Worker: 1}

	in.onEvents(clearedEvents(r, 1, 5)) // over the cap
	var m dto.Metric
	if err := in.m.rejected.WithLabelValues("malformed").Write(&m); err != nil || m.GetCounter().GetValue() != 1 {
		n := m.GetCounter().GetValue()
		t.Fatalf("%v requests rejected, want the one over the cap", n)
	}

	in.onEvents(clearedEvents(r, 1, 4)) // A: committing, held
	waitFor(t, 10*time.Second, "the first entry's commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return tg.calls == 1
	})
	in.onEvents(clearedEvents(r, 5, 4)) // B: the batcher holds it, waiting for the commit slot
	waitFor(t, 10*time.Second, "the batcher to take the second request", func() bool { return len(in.reqs) == 0 })
	in.onEvents(clearedEvents(r, 9, 4))  // C: queued
	in.onEvents(clearedEvents(r, 13, 4)) // D: queued; the queue is full
	if in.queued.TryAcquire(1) {
		t.Fatalf("room in the queue with %d requests of 8 events waiting", len(in.reqs))
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		in.onEvents(clearedEvents(r, 17, 4)) // E: waits for room
	}()
	close(tg.hold)
	<-done
	waitFor(t, 10*time.Second, "every queued request to commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		n := 0
		for _, b := range tg.ingested {
			n += len(b.Events)
		}
		return n == 20
	})
}

// TestAnEntryClosesAtEitherBound: with a linger far longer than the
// test, an entry closes only at MaxEntryEvents or at MaxEntryBytes of
// request bodies: six requests of 4 events, queued before the batcher
// starts, make three entries of two requests under either bound.
// From a review: nothing tested the bytes bound; without it every test
// passed.
func TestAnEntryClosesAtEitherBound(t *testing.T) {
	r := kvevent.Rank{Worker: 1}
	body := len(clearedEvents(r, 1, 4).Data)
	for _, c := range []struct {
		name string
		cfg  IngesterConfig
	}{
		{"events", IngesterConfig{MaxEntryEvents: 8, MaxEntryBytes: 1 << 20}},
		{"bytes", IngesterConfig{MaxEntryEvents: 1 << 20, MaxEntryBytes: 2 * body}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tg := newFakeTarget()
			cfg := c.cfg
			cfg.Node, cfg.Logger, cfg.Linger, cfg.MaxInFlight = tg, quiet, time.Hour, 8
			in := newIngester(cfg)
			for i := range 6 {
				in.onEvents(clearedEvents(r, uint64(1+4*i), 4))
			}
			in.wg.Add(1)
			go in.batcher()
			defer in.Close()
			waitFor(t, 10*time.Second, "three entries to commit every request", func() bool {
				tg.mu.Lock()
				defer tg.mu.Unlock()
				return len(tg.ingested) == 6
			})
			tg.mu.Lock()
			defer tg.mu.Unlock()
			if tg.calls != 3 {
				t.Fatalf("%d entries for 6 requests, want 3", tg.calls)
			}
		})
	}
}

// lostTarget fails every entry as a leader that lost its leadership with
// the entry in its log does, and records the entries.
type lostTarget struct {
	*fakeTarget
	mu      sync.Mutex
	entries [][]raftfsm.RankBatch
}

func (l *lostTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	l.mu.Lock()
	l.entries = append(l.entries, bs)
	l.mu.Unlock()
	return nil, &raftfsm.NotLeaderError{MaybeApplied: true}
}

// TestAFailedEntryFailsEveryRequestInIt: the requests of several
// publishers packed into one entry that fails (its leader lost its
// leadership) are each answered not_leader (resend), none acknowledged and
// none left unanswered (its publisher would wait out its request timeout
// and resend only then). From a review: commit answering only the group's
// first request left every test green.
func TestAFailedEntryFailsEveryRequestInIt(t *testing.T) {
	const n = 3 // requests of 2 events, one per worker
	tg := &lostTarget{fakeTarget: newFakeTarget()}
	// The entry closes when it holds all n requests (its event bound), not
	// when a linger ends: which requests share it is then certain.
	in, _ := startPlaneWith(t, tg, IngesterConfig{Linger: time.Hour, MaxEntryEvents: 2 * n}, PublisherConfig{})
	nc := connect(t, in.cfg.Conn.ConnectedUrl())
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := clearedEvents(kvevent.Rank{Worker: uint64(i + 1)}, 1, 2)
			reply, err := nc.Request(in.cfg.Subject, m.Data, 5*time.Second)
			if err != nil {
				errs[i] = err // unanswered
				return
			}
			if _, _, err := decodeReply(reply.Data); err != nil {
				errs[i] = err
				return
			}
			errs[i] = errors.New("acknowledged")
		}()
	}
	wg.Wait()
	tg.mu.Lock()
	entries := len(tg.entries)
	tg.mu.Unlock()
	if entries != 1 {
		t.Fatalf("the %d requests went in %d entries, want one", n, entries)
	}
	for i, err := range errs {
		var re *ReplyError
		if !errors.As(err, &re) || re.Code != codeNotLeader {
			t.Errorf("request %d of an entry whose leader lost its leadership: %v; want a not_leader reply", i, err)
		}
	}
	if got, acked := val(in.m.requests.WithLabelValues("not_leader")), val(in.m.requests.WithLabelValues("acked")); got != n || acked != 0 {
		t.Errorf("requests counted not_leader %v and acked %v, want %d and 0", got, acked, n)
	}
}

// unregTarget is a fakeTarget that answers every batch unregistered
// and asked to resync.
type unregTarget struct{ *fakeTarget }

func (u unregTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	acks, err := u.fakeTarget.IngestEvents(ctx, bs)
	for i := range acks {
		acks[i] = raftfsm.RankAck{Rank: acks[i].Rank, Unregistered: true, Resync: true}
	}
	return acks, err
}

// TestAcksCarryOnlyTheFlagsTheirRequestAnnounced: of two requests in one
// entry, the one that announces the ack flags it reads beyond the base
// (headerAckFlags) gets its ack's unregistered flag, and the one without
// the header (a publisher of an earlier build, which refuses a reply with
// a flag it does not know: docs/events.md) gets the base flags alone. From
// a review: an ingester that masked every reply with ackFlagsKnown left
// every test green.
func TestAcksCarryOnlyTheFlagsTheirRequestAnnounced(t *testing.T) {
	tg := unregTarget{newFakeTarget()}
	// The entry closes when it holds both requests (its event bound), not
	// when a linger ends: both are in one commit.
	in, _ := startPlaneWith(t, tg, IngesterConfig{Linger: time.Hour, MaxEntryEvents: 4}, PublisherConfig{})
	nc := connect(t, in.cfg.Conn.ConnectedUrl())
	flags := make([]byte, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, announce := range []bool{false, true} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := &nats.Msg{Subject: in.cfg.Subject, Data: clearedEvents(kvevent.Rank{Worker: uint64(i + 1)}, 1, 2).Data}
			if announce {
				m.Header = nats.Header{headerAckFlags: []string{ackFlagsHeader}}
			}
			reply, err := nc.RequestMsg(m, 10*time.Second)
			if err != nil {
				errs[i] = err
				return
			}
			flags[i] = reply.Data[len(reply.Data)-1] // the one ack's flags
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	tg.mu.Lock()
	calls := tg.calls
	tg.mu.Unlock()
	if calls != 1 {
		t.Fatalf("the two requests went in %d entries, want one", calls)
	}
	if want := byte(ackResync); flags[0] != want {
		t.Errorf("the request without %s: ack flags %#x, want %#x (the base flags only)", headerAckFlags, flags[0], want)
	}
	if want := byte(ackResync | ackUnregistered); flags[1] != want {
		t.Errorf("the request announcing its flags (%s: %s): ack flags %#x, want %#x", headerAckFlags, ackFlagsHeader, flags[1], want)
	}
}

// TestAPublishWithoutAReplyIsNotCountedAnswered: a message on the events
// subject without a reply subject (a publish, not a request) is committed
// but answered nothing, and kvrouter_events_requests_total, the requests
// answered, does not count it; a request beside it is counted acked. From
// a review: reply() counted the publish acked too, and a malformed one
// invalid.
func TestAPublishWithoutAReplyIsNotCountedAnswered(t *testing.T) {
	tg := newFakeTarget()
	in, _ := startPlane(t, tg)
	nc := connect(t, in.cfg.Conn.ConnectedUrl())
	if err := nc.Publish(in.cfg.Subject, clearedEvents(kvevent.Rank{Worker: 1}, 1, 2).Data); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Request(in.cfg.Subject, clearedEvents(kvevent.Rank{Worker: 2}, 1, 2).Data, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	in.onEvents(&nats.Msg{Data: []byte{0xff}}) // malformed, without a reply subject
	waitFor(t, 10*time.Second, "both ranks' events to commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return len(tg.ingested) == 2
	})
	in.Close() // waits for the commits, which count after IngestEvents returns
	if n := val(in.m.rejected.WithLabelValues("malformed")); n != 1 {
		t.Errorf("kvrouter_events_requests_rejected_total{reason=\"malformed\"} = %v, want 1", n)
	}
	for outcome, want := range map[string]float64{"acked": 1, "invalid": 0} {
		if n := val(in.m.requests.WithLabelValues(outcome)); n != want {
			t.Errorf("kvrouter_events_requests_total{outcome=%q} = %v, want %v: one request, one publish and one malformed publish", outcome, n, want)
		}
	}
}

// gapTarget acknowledges every batch with a gap.
type gapTarget struct{ *fakeTarget }

func (t *gapTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	acks, err := t.fakeTarget.IngestEvents(ctx, bs)
	for i := range acks {
		acks[i].Gap = true
	}
	return acks, err
}

// TestUnansweredPublishCountsNoGap: kvrouter_events_gaps_total counts
// rank batches acknowledged with a gap (docs/operations.md), and a publish
// without a reply subject is acknowledged nothing (nor counted in
// kvrouter_events_requests_total): of a publish and a request whose
// batches both met a gap, only the request's counts. From a review: the
// commit counted the publish's gap too.
func TestUnansweredPublishCountsNoGap(t *testing.T) {
	tg := &gapTarget{newFakeTarget()}
	in, _ := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{})
	nc := connect(t, in.cfg.Conn.ConnectedUrl())
	if err := nc.Publish(in.cfg.Subject, clearedEvents(kvevent.Rank{Worker: 1}, 5, 2).Data); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Request(in.cfg.Subject, clearedEvents(kvevent.Rank{Worker: 2}, 5, 2).Data, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "both ranks' batches to commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return len(tg.ingested) == 2
	})
	in.Close() // waits for the commits, which count after IngestEvents returns
	if n := val(in.m.requests.WithLabelValues("acked")); n != 1 {
		t.Fatalf("setup: kvrouter_events_requests_total{outcome=\"acked\"} = %v, want 1 (the request)", n)
	}
	if n := val(in.m.gaps); n != 1 {
		t.Fatalf("kvrouter_events_gaps_total = %v, want 1: the publish's batch was acknowledged to nobody", n)
	}
}

// follower is a fakeTarget that does not lead.
type follower struct{ *fakeTarget }

func (follower) IsLeader() bool { return false }

// TestEventsSubjectMustNotBeTheHeartbeatSubject: an events subject (the
// flags --events-subject, through CheckSubject) or an ingester's events or
// dump subject that is the heartbeat subject is refused. From a review:
// CheckSubject took kvrouter.heartbeat, and the ingester then held two
// queue subscriptions of one group on it: NATS handed about half the event
// requests to the heartbeat handler.
func TestEventsSubjectMustNotBeTheHeartbeatSubject(t *testing.T) {
	for _, ok := range []string{DefaultSubject, "site1.events", DefaultHeartbeatSubject + ".events", "kvrouter"} {
		if err := CheckSubject(ok); err != nil {
			t.Errorf("CheckSubject(%q): %v, want nil", ok, err)
		}
	}
	if err := CheckSubject(DefaultHeartbeatSubject); err == nil || !strings.Contains(err.Error(), "heartbeat") {
		t.Errorf("CheckSubject(%q): %v, want an error naming the heartbeat subject", DefaultHeartbeatSubject, err)
	}
	for _, cfg := range []IngesterConfig{
		{Subject: DefaultHeartbeatSubject},
		{DumpSubject: DefaultHeartbeatSubject},
		{Subject: "a.b", DumpSubject: "a.b"},
		{HeartbeatSubject: DefaultSubject},
	} {
		// A follower: an ingester it took would not subscribe.
		cfg.Conn, cfg.Node, cfg.Logger = &nats.Conn{}, follower{newFakeTarget()}, quiet
		if in, err := NewIngester(cfg); err == nil {
			in.Close()
			t.Errorf("NewIngester with subjects %q, %q, %q: no error", cfg.Subject, cfg.DumpSubject, cfg.HeartbeatSubject)
		}
	}
}

// TestIngesterSubjectsMustBeLiteral: NewIngester refuses a subject that
// holds a wildcard, white space or an empty token, whichever of its three
// it is, naming the subject. From a review: it compared the subjects as
// strings only, so Subject "kvrouter.>" (which takes the heartbeat
// subject's messages too) started an ingester.
func TestIngesterSubjectsMustBeLiteral(t *testing.T) {
	for _, cfg := range []IngesterConfig{
		{Subject: "kvrouter.>"},
		{Subject: "kvrouter.*"},
		{Subject: ">"},
		{Subject: "a b"},
		{Subject: "a..b"},
		{Subject: "events."},
		{DumpSubject: "kvrouter.events.*"},
		{HeartbeatSubject: "kvrouter.>"},
		{HeartbeatSubject: "*.heartbeat"},
	} {
		cfg.Conn, cfg.Node, cfg.Logger = &nats.Conn{}, follower{newFakeTarget()}, quiet
		in, err := NewIngester(cfg)
		if err == nil {
			in.Close()
			t.Errorf("NewIngester with subjects %q, %q, %q: no error", cfg.Subject, cfg.DumpSubject, cfg.HeartbeatSubject)
			continue
		}
		if bad := cfg.Subject + cfg.DumpSubject + cfg.HeartbeatSubject; !strings.Contains(err.Error(), strconv.Quote(bad)) {
			t.Errorf("NewIngester with subject %q: %v, want an error naming it", bad, err)
		}
	}
	cfg := IngesterConfig{Subject: "site1.events", HeartbeatSubject: "site1.heartbeat",
		Conn: &nats.Conn{}, Node: follower{newFakeTarget()}, Logger: quiet}
	in, err := NewIngester(cfg)
	if err != nil {
		t.Fatalf("NewIngester with subjects site1.events, site1.heartbeat: %v", err)
	}
	in.Close()
}

// bigStore returns an events request of one stored event of rank r, id
// id, with nblocks blocks (16 bytes each on the wire).
func bigStore(r kvevent.Rank, id uint64, nblocks int) *nats.Msg {
	bl := make([]kvevent.Block, nblocks)
	for i := range bl {
		bl[i] = kvevent.Block{EngineHash: id<<32 | uint64(i) + 1, LocalHash: uint64(i)}
	}
	ev := kvevent.Event{Rank: r, EventID: id, Kind: kvevent.KindStored, Blocks: bl}
	return &nats.Msg{Data: appendEvents(nil, []raftfsm.RankBatch{{Rank: r, Events: []kvevent.Event{ev}}})}
}

// TestQueuedRequestBytesAreBounded: with the commits stalled, requests of
// one stored event of 65000 blocks (1 MiB) each queue until their size
// reaches MaxQueuedBytes; the next one's callback then waits for room,
// and goes on once the commits do. From a review: the queue counted only
// events, so 48 such requests (98 MiB) queued without push-back, and 4096
// of the NATS server's largest could (64 GiB).
func TestQueuedRequestBytesAreBounded(t *testing.T) {
	if got := newIngester(IngesterConfig{Node: newFakeTarget()}).cfg.MaxQueuedBytes; got != defaultMaxQueuedBytes {
		t.Fatalf("MaxQueuedBytes defaults to %d, want %d", got, defaultMaxQueuedBytes)
	}
	tg := newFakeTarget()
	tg.hold = make(chan struct{})
	const maxBytes = 8 << 20
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet, MaxInFlight: 1, MaxQueuedBytes: maxBytes})
	in.wg.Add(1)
	go in.batcher()
	defer in.Close()
	r := kvevent.Rank{Worker: 1}
	const reqs, blocks = 48, 65000
	msgs := make([]*nats.Msg, reqs)
	for i := range msgs {
		msgs[i] = bigStore(r, uint64(i+1), blocks)
	}
	_, held, err := decodeEventsHeld(msgs[0].Data, in.cfg.MaxRequestEvents)
	if err != nil {
		t.Fatal(err)
	}
	size := requestSize(msgs[0].Data, held)
	if size < 2*16*blocks {
		t.Fatalf("a request of %d blocks sizes %d bytes: its body and decoded blocks alone take %d", blocks, size, 2*16*blocks)
	}

	var sent atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, m := range msgs {
			in.onEvents(m)
			sent.Add(1)
		}
	}()
	// A waiter in Acquire makes TryAcquire fail whatever room is left
	// (the semaphore serves waiters in order): the sender waits for room.
	waitFor(t, 30*time.Second, "the queue to push back", func() bool {
		select {
		case <-done:
			t.Fatalf("all %d requests of %d bytes queued with the commits stalled: no push-back", reqs, size)
		default:
		}
		if in.queuedBytes.TryAcquire(1) {
			in.queuedBytes.Release(1)
			return false
		}
		return true
	})
	queued := len(in.reqs)
	t.Logf("pushed back after %d requests of %d bytes: %d queued, the rest in the held commit and the group waiting for it", sent.Load(), size, queued)
	if queued*size > maxBytes {
		t.Errorf("%d requests of %d bytes queued, over MaxQueuedBytes %d", queued, size, maxBytes)
	}
	// The commit and the group waiting for its slot hold at most an
	// entry (MaxEntryBytes of bodies) and a request more each.
	if limit := maxBytes/size + 2*(in.cfg.MaxEntryBytes/len(msgs[0].Data)+1); int(sent.Load()) > limit {
		t.Errorf("%d requests taken with the commits stalled, want at most %d", sent.Load(), limit)
	}

	close(tg.hold)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the sender still waits for room after the commits went on")
	}
	waitFor(t, 30*time.Second, "every request to commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return len(tg.ingested) == reqs
	})
}

// TestARequestLargerThanTheQueueGoesAlone: a request whose size passes
// MaxQueuedBytes takes the whole bound rather than waiting for ever.
func TestARequestLargerThanTheQueueGoesAlone(t *testing.T) {
	tg := newFakeTarget()
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet, MaxQueuedBytes: 1 << 10})
	in.wg.Add(1)
	go in.batcher()
	defer in.Close()
	r := kvevent.Rank{Worker: 1}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 3 {
			in.onEvents(bigStore(r, uint64(i+1), 1000))
		}
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("a request larger than MaxQueuedBytes waits for ever")
	}
	waitFor(t, 30*time.Second, "every request to commit", func() bool {
		tg.mu.Lock()
		defer tg.mu.Unlock()
		return len(tg.ingested) == 3
	})
}

// TestReceivedEventsAreCountedPerWorker: received events count by worker
// (a registered one's id, anyone else's as other), op and tier.
func TestReceivedEventsAreCountedPerWorker(t *testing.T) {
	tg := newFakeTarget()
	tg.register(7, 0)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	defer in.Close()
	known, stranger := kvevent.Rank{Worker: 7}, kvevent.Rank{Worker: 99}
	stored := kvevent.Event{Rank: known, EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned,
		Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}
	removed := kvevent.Event{Rank: known, EventID: 2, Kind: kvevent.KindRemoved, Tier: kvevent.TierHostPinned, Removed: []uint64{1}}
	in.onEvents(&nats.Msg{Data: appendEvents(nil, []raftfsm.RankBatch{{Rank: known, Events: []kvevent.Event{stored, removed}}})})
	in.onEvents(clearedEvents(known, 3, 2))
	in.onEvents(clearedEvents(stranger, 1, 3))
	count := func(worker, op, tier string) float64 {
		var m dto.Metric
		if err := in.m.received.WithLabelValues(worker, op, tier).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetCounter().GetValue()
	}
	for _, c := range []struct {
		worker, op, tier string
		want             float64
	}{
		{"7", "store", "host", 1}, {"7", "remove", "host", 1}, {"7", "clear", "device", 2}, {"other", "clear", "device", 3},
	} {
		if got := count(c.worker, c.op, c.tier); got != c.want {
			t.Errorf("received{worker=%s,op=%s,tier=%s} = %v, want %v", c.worker, c.op, c.tier, got, c.want)
		}
	}
	// From a review: a worker's series stayed after it left, so they
	// grew with every worker there ever was.
	if receivedSeries(t, in, "7") != 3 {
		t.Fatalf("worker 7 has %d series, want 3", receivedSeries(t, in, "7"))
	}
	in.dropLeftWorkers(map[uint64]raftfsm.WorkerInfo{}) // worker 7 left
	if n := receivedSeries(t, in, "7"); n != 0 {
		t.Fatalf("worker 7 left and still has %d series", n)
	}
}

// TestIngesterMadeAgainOnItsRegistererReusesItsFamilies: an ingester made
// again on the Registerer of a closed one (a node restarted in-process)
// goes on with its families: the counters keep counting up, and the
// closed one's per-worker series are gone, since the new one does not know
// to drop them when their worker leaves. From a review: the families were
// registered with MustRegister and never unregistered, so NewIngester
// panicked.
func TestIngesterMadeAgainOnItsRegistererReusesItsFamilies(t *testing.T) {
	reg := prometheus.NewRegistry()
	tg := newFakeTarget()
	tg.register(7, 0)
	first := newIngester(IngesterConfig{Node: tg, Registerer: reg, Logger: quiet})
	first.m.gaps.Inc()
	first.onEvents(clearedEvents(kvevent.Rank{Worker: 7}, 1, 2))
	first.Close()
	second := func() (in *Ingester) {
		defer func() {
			if p := recover(); p != nil {
				t.Fatalf("a second ingester on the first one's Registerer panicked: %v", p)
			}
		}()
		return newIngester(IngesterConfig{Node: tg, Registerer: reg, Logger: quiet})
	}()
	defer second.Close()
	second.m.gaps.Inc()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	gaps := 0.0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == "kvrouter_events_gaps_total" {
				gaps = m.GetCounter().GetValue()
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == "worker" && l.GetValue() == "7" {
					t.Errorf("%s{worker=\"7\"} of the closed ingester still exported", mf.GetName())
				}
			}
		}
	}
	if gaps != 2 {
		t.Errorf("kvrouter_events_gaps_total = %v after one gap counted by each ingester, want 2", gaps)
	}
}

// ctxDumpTarget's ReplaceRankFenced waits for its context, as a node's commit
// does when the context ends first.
type ctxDumpTarget struct {
	*fakeTarget
	entered  chan struct{}
	returned atomic.Bool
}

func (c *ctxDumpTarget) ReplaceRankFenced(ctx context.Context, _ kvevent.Rank, _, _ uint64, _ []kvevent.Event) error {
	close(c.entered)
	<-ctx.Done()
	c.returned.Store(true)
	return ctx.Err()
}

// TestCloseWaitsForCallbacksAndAnswersNothing: Close ends a dump's commit
// in flight, waits for its callback, and no reply goes out after it. From
// a review: Close returned while the dump still committed on NATS's
// goroutine, which then replied.
func TestCloseWaitsForCallbacksAndAnswersNothing(t *testing.T) {
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	tg := &ctxDumpTarget{fakeTarget: newFakeTarget(), entered: make(chan struct{})}
	in, err := NewIngester(IngesterConfig{Conn: connect(t, s.ClientURL()), Node: tg, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	pc := connect(t, s.ClientURL())
	// The ingester's subscription reaches the server after NewIngester
	// returns: a request sent before has no responders.
	waitFor(t, 10*time.Second, "the server to see the ingester's dump subscription", func() bool {
		return s.GlobalAccount().SubscriptionInterest(DefaultDumpSubject)
	})
	answer := make(chan error, 1)
	go func() {
		data := appendDump(nil, &dumpRequest{rank: kvevent.Rank{Worker: 1}, cursor: 5})
		_, err := pc.Request(DefaultDumpSubject, data, 2*time.Second)
		answer <- err
	}()
	select {
	case <-tg.entered:
	case err := <-answer:
		t.Fatalf("the dump was answered (%v) before its commit began", err)
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for the dump's commit to begin")
	}
	in.Close()
	if !tg.returned.Load() {
		t.Fatal("Close returned before the dump's callback")
	}
	if err := <-answer; !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("the dump in flight at Close: %v, want no answer (a timeout)", err)
	}
}

// lagOf returns kvrouter_events_lag_seconds{worker} and whether the series
// exists.
func lagOf(t *testing.T, in *Ingester, worker string) (float64, bool) {
	t.Helper()
	ch := make(chan prometheus.Metric, 64)
	in.m.lag.Collect(ch)
	close(ch)
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		if l := d.GetLabel(); len(l) == 1 && l[0].GetValue() == worker {
			return d.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// TestEventsLagIsTheOldestPublishedEventsAge: a committed request sets its
// registered workers' kvrouter_events_lag_seconds from its published-times
// header (the oldest of a worker's batches); strangers, unknown times and a
// malformed header set nothing, and a worker's series goes when it leaves.
func TestEventsLagIsTheOldestPublishedEventsAge(t *testing.T) {
	tg := newFakeTarget()
	tg.register(7, 0)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	in.wg.Add(1)
	go in.batcher()
	defer in.Close()
	w7a, w7b, stranger := kvevent.Rank{Worker: 7}, kvevent.Rank{Worker: 7, DP: 1}, kvevent.Rank{Worker: 99}
	batch := func(r kvevent.Rank) raftfsm.RankBatch {
		return raftfsm.RankBatch{Rank: r, Events: []kvevent.Event{{Rank: r, EventID: 1, Kind: kvevent.KindCleared}}}
	}
	request := func(header string, ranks ...kvevent.Rank) {
		var bs []raftfsm.RankBatch
		for _, r := range ranks {
			bs = append(bs, batch(r))
		}
		m := &nats.Msg{Data: appendEvents(nil, bs), Header: nats.Header{}}
		if header != "" {
			m.Header.Set(headerPublished, header)
		}
		tg.mu.Lock()
		before := len(tg.ingested)
		tg.mu.Unlock()
		in.onEvents(m)
		waitFor(t, 10*time.Second, "the request to commit", func() bool {
			tg.mu.Lock()
			defer tg.mu.Unlock()
			return len(tg.ingested) == before+len(bs)
		})
		in.cwg.Wait() // the commit's replies and lag are done once it returns
	}
	start := time.Now()
	us := func(ago time.Duration) string { return strconv.FormatInt(start.Add(-ago).UnixMicro(), 10) }
	in.onEvents(clearedEvents(w7a, 1, 1)) // no header: nothing to measure
	waitFor(t, 10*time.Second, "the first request", func() bool { tg.mu.Lock(); defer tg.mu.Unlock(); return len(tg.ingested) == 1 })
	in.cwg.Wait()
	if _, ok := lagOf(t, in, "7"); ok {
		t.Fatal("a request without published times set a lag")
	}
	request(us(3*time.Second)+","+us(10*time.Second)+","+us(20*time.Second), w7a, w7b, stranger)
	lag, ok := lagOf(t, in, "7")
	if max := time.Since(start) + 10*time.Second; !ok || lag < 10 || lag > max.Seconds() {
		t.Fatalf("worker 7's lag = %v (series %v), want its oldest batch's age, 10 s to %v", lag, ok, max)
	}
	if _, ok := lagOf(t, in, "99"); ok {
		t.Fatal("an unregistered worker has a lag series")
	}
	request("0", w7a) // unknown time: the gauge keeps its value
	request("12,x", w7a, w7b)
	request(us(time.Second), w7a, w7b) // count mismatch
	if again, _ := lagOf(t, in, "7"); again != lag {
		t.Fatalf("worker 7's lag moved to %v on requests without a usable time", again)
	}
	request(us(-time.Hour), w7a) // the publisher's clock runs ahead
	if lag, _ := lagOf(t, in, "7"); lag != 0 {
		t.Fatalf("a time in the future gave a lag of %v, want 0", lag)
	}
	in.dropLeftWorkers(map[uint64]raftfsm.WorkerInfo{})
	if _, ok := lagOf(t, in, "7"); ok {
		t.Fatal("worker 7 left and kept its lag series")
	}
}

// TestPublishMarksFollowTheBuffer: a rank buffer's marks give each event
// the time of the Publish call that took it, and follow trimming and
// renumbering.
func TestPublishMarksFollowTheBuffer(t *testing.T) {
	b := &rankBuf{next: 1}
	add := func(n int, at uint64) {
		b.marks = append(b.marks, publishMark{id: b.next, at: at})
		for range n {
			b.evs = append(b.evs, kvevent.Event{EventID: b.next})
			b.next++
		}
	}
	add(3, 100) // ids 1-3
	add(2, 200) // ids 4-5
	add(1, 300) // id 6
	for id, want := range map[uint64]uint64{0: 0, 1: 100, 3: 100, 4: 200, 5: 200, 6: 300, 9: 300} {
		if got := b.publishedAt(id); got != want {
			t.Errorf("publishedAt(%d) = %d, want %d", id, got, want)
		}
	}
	b.trim(2) // 3 is still buffered: its mark stays
	if len(b.liveMarks()) != 3 || b.publishedAt(3) != 100 {
		t.Fatalf("after trimming to 2: marks %v", b.marks)
	}
	b.trim(4)
	if len(b.liveMarks()) != 2 || b.publishedAt(5) != 200 || b.publishedAt(6) != 300 {
		t.Fatalf("after trimming to 4: marks %v", b.marks)
	}
	b.renumber(10) // as sendDump does: ids 5, 6 become 15, 16
	if b.publishedAt(15) != 200 || b.publishedAt(16) != 300 || b.pending()[0].EventID != 15 || b.next != 17 {
		t.Fatalf("after renumbering: marks %v, events from %d, next %d", b.liveMarks(), b.pending()[0].EventID, b.next)
	}
	b.trim(16)
	if len(b.liveMarks()) != 0 {
		t.Fatalf("an empty buffer kept marks %v", b.marks)
	}
}

// TestDroppedEventsTakeTheirMarks: with DropOldest, a full buffer drops
// its oldest events' marks with them, keeps the mark of the first event
// still buffered, and does not copy every mark on each drop (from a
// review: each Publish into a full buffer moved all of them).
func TestDroppedEventsTakeTheirMarks(t *testing.T) {
	const size = 2048
	p, err := NewPublisher(PublisherConfig{Conn: connectNowhere(t), BufferEvents: size, DropOldest: true, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 1}
	ev := []kvevent.Event{{Kind: kvevent.KindCleared}}
	var at [3]uint64
	for i := range 3 { // ids 1, 2, 3
		before := uint64(time.Now().UnixMicro())
		if _, err := p.Publish(r, ev); err != nil {
			t.Fatal(err)
		}
		at[i] = before
	}
	three := []kvevent.Event{ev[0], ev[0], ev[0]}
	if _, err := p.Publish(r, three); err != nil { // ids 4-6
		t.Fatal(err)
	}
	check := func(what string, wantFirst uint64, wantLive int, from uint64) {
		t.Helper()
		p.mu.Lock()
		defer p.mu.Unlock()
		b := p.ranks[r]
		live := b.liveMarks()
		if first := b.pending()[0].EventID; first != wantFirst || len(live) != wantLive || live[0].id > first || b.publishedAt(first) < from {
			t.Fatalf("%s: first buffered id %d, %d live marks from id %d; want id %d covered by the first of %d, at or after %d",
				what, first, len(live), live[0].id, wantFirst, wantLive, from)
		}
		if len(b.marks) > 2*size+2 {
			t.Fatalf("%s: %d marks held for %d live", what, len(b.marks), len(live))
		}
	}
	check("six events", 1, 4, at[0])
	for range size - 6 {
		if _, err := p.Publish(r, ev); err != nil {
			t.Fatal(err)
		}
	}
	check("a full buffer", 1, size-6+4, at[0])
	if _, err := p.Publish(r, three); err != nil { // drops ids 1-3
		t.Fatal(err)
	}
	check("three dropped", 4, size-6+2, at[2])
	for range 3 * size { // one drop per Publish
		if _, err := p.Publish(r, ev); err != nil {
			t.Fatal(err)
		}
	}
	check("many drops", 3*size+3+1, size, at[2])
}

// startPlane starts a NATS server, an ingester committing to tg and a
// publisher, all stopped at the test's end.
func startPlane(t *testing.T, tg *fakeTarget) (*Ingester, *Publisher) {
	return startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{})
}

// startPlaneWith starts a NATS server, an ingester for node and a
// publisher, with icfg and pcfg (their connections and loggers filled
// in), and waits for the ingester's subscriptions.
func startPlaneWith(t *testing.T, node Target, icfg IngesterConfig, pcfg PublisherConfig) (*Ingester, *Publisher) {
	t.Helper()
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	icfg.Conn, icfg.Node, icfg.Logger = connect(t, s.ClientURL()), node, quiet
	in, err := NewIngester(icfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	waitFor(t, 10*time.Second, "the ingester's subscriptions", func() bool { return ingesting(in) })
	pcfg.Conn, pcfg.Logger = connect(t, s.ClientURL()), quiet
	p, err := NewPublisher(pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return in, p
}

// TestPublisherSendsPublishedTimes: a publisher's requests carry their
// batches' published times, and the leader's lag for the worker lies
// between the time the commit was held and the whole round trip.
func TestPublisherSendsPublishedTimes(t *testing.T) {
	tg := newFakeTarget()
	tg.register(7, 0)
	tg.hold = make(chan struct{})
	in, p := startPlane(t, tg)
	r := kvevent.Rank{Worker: 7}
	before := time.Now()
	if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	published := time.Now()
	waitFor(t, 10*time.Second, "the request's commit", func() bool { tg.mu.Lock(); defer tg.mu.Unlock(); return tg.calls > 0 })
	held := time.Now()
	close(tg.hold)
	waitFor(t, 10*time.Second, "the ack", func() bool { return p.Pending() == 0 })
	lag, ok := lagOf(t, in, "7")
	if low, high := held.Sub(published).Seconds(), time.Since(before).Seconds(); !ok || lag < low || lag > high {
		t.Fatalf("worker 7's lag = %v (series %v), want between %v and %v", lag, ok, low, high)
	}
}

// steppingTarget is a fakeTarget that stops leading once stepped is set.
type steppingTarget struct {
	*fakeTarget
	stepped atomic.Bool
}

func (t *steppingTarget) IsLeader() bool { return !t.stepped.Load() }

// TestAFormerLeaderExportsNoLag: a node that stops leading stops exporting
// kvrouter_events_lag_seconds, which only the leader measures: a former
// leader's last figures would read as a lag that never moves. Its
// kvrouter_events_ingesting drops to 0 (from a review: nothing failed
// with the step-down leaving it at 1).
func TestAFormerLeaderExportsNoLag(t *testing.T) {
	tg := &steppingTarget{fakeTarget: newFakeTarget()}
	tg.register(7, 0)
	in, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{})
	if _, err := p.Publish(kvevent.Rank{Worker: 7}, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the ack", func() bool { return p.Pending() == 0 })
	if _, ok := lagOf(t, in, "7"); !ok {
		t.Fatal("the leader exports no lag for worker 7")
	}
	if !ingesting(in) {
		t.Fatal("kvrouter_events_ingesting is 0 on the leader, want 1")
	}
	tg.stepped.Store(true)
	waitFor(t, 10*time.Second, "the step-down", func() bool { // terms moves with the lag's reset
		in.labelMu.Lock()
		defer in.labelMu.Unlock()
		return in.terms > 0
	})
	if lag, ok := lagOf(t, in, "7"); ok {
		t.Fatalf("a former leader still exports worker 7's lag (%v)", lag)
	}
	if ingesting(in) {
		t.Fatal("kvrouter_events_ingesting is 1 on a former leader, want 0")
	}
}

// TestHeartbeatRenewsTheLease: a heartbeat renews a worker's lease from
// when it arrives: a sweep past a lease from the worker's first sighting,
// within one from its heartbeat, keeps it; past a lease from the
// heartbeat, it goes. (From a review: no test checked the renewal.)
func TestHeartbeatRenewsTheLease(t *testing.T) {
	tg := newFakeTarget()
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	const lease = 10 * time.Second
	tg.register(7, lease)
	t0 := time.Now().Add(-8 * time.Second) // the heartbeat below arrives 8 s after t0
	in.leases.lead(t0, 0)
	sweep(in, t0) // the leader first sees the worker
	in.onHeartbeat(&nats.Msg{Data: AppendHeartbeat(nil, []uint64{7})})
	sweep(in, t0.Add(15*time.Second))
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("worker removed %v 7 s after its heartbeat, within its 10 s lease", r)
	}
	sweep(in, t0.Add(19*time.Second))
	if r := tg.removedIDs(); !slices.Equal(r, []uint64{7}) {
		t.Fatalf("removed %v, want [7] 11 s after its heartbeat", r)
	}
}

// slowTarget commits every entry, taking delay.
type slowTarget struct {
	*fakeTarget
	delay time.Duration
	fast  atomic.Bool // commits at once from now on
}

func (s *slowTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	d := s.delay
	if s.fast.Load() {
		d = 0
	}
	select {
	case <-time.After(d):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return s.fakeTarget.IngestEvents(ctx, bs)
}

// TestCommitSlowerThanTheRequestTimeoutIsAcked: a router whose commits
// take longer than the publisher's RequestTimeout, though well within its
// CommitTimeout, has its events acknowledged: after a timeout the next
// try waits twice as long, and after the reply it is back to
// RequestTimeout. From a review: each resend was committed (again, as
// duplicates) and its reply came after the publisher stopped waiting,
// for ever: never acknowledged, and Flush never finished.
func TestCommitSlowerThanTheRequestTimeoutIsAcked(t *testing.T) {
	tg := &slowTarget{fakeTarget: newFakeTarget(), delay: 600 * time.Millisecond}
	const timeout = 200 * time.Millisecond
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{RequestTimeout: timeout})
	r := kvevent.Rank{Worker: 1}
	if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := p.Flush(ctx)
	tg.mu.Lock()
	commits := len(tg.ingested)
	tg.mu.Unlock()
	if err != nil {
		t.Fatalf("an event committed %d times in commits of 600ms each, with a request timeout of 200ms, is not acknowledged: %v", commits, err)
	}
	// While commits stay slow the timeout stays up: a reset to 200ms at
	// each reply had every later request time out once and commit twice.
	if d := p.requestTimeout(); d < 600*time.Millisecond {
		t.Fatalf("request timeout %v after a reply that took 600ms, want it to stay above", d)
	}
	// Once commits are quick, it comes back down to RequestTimeout.
	tg.fast.Store(true)
	deadline := time.Now().Add(20 * time.Second)
	for p.requestTimeout() != timeout {
		if time.Now().After(deadline) {
			t.Fatalf("request timeout %v after quick replies, want RequestTimeout %v again", p.requestTimeout(), timeout)
		}
		if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
			t.Fatal(err)
		}
		if err := p.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEntriesCountOnlyProposedEntries: kvrouter_events_entries_total
// counts the Raft entries the ingester proposed, and no group of requests
// it did not: on a node that no longer leads (its drained subscription
// hands it requests after a step-down), answered not_leader; on a leader
// whose commit's deadline passed before it proposed the entry, answered
// error. From a review: the counter went up before IngestEvents was
// called, proposed or not.
func TestEntriesCountOnlyProposedEntries(t *testing.T) {
	r := kvevent.Rank{Worker: 9}
	t.Run("not leading", func(t *testing.T) {
		// The node picked follows when picked, but an election (a loaded
		// machine misses heartbeats of 200 ms) may make it the leader
		// before the request reaches its batcher, which then proposes
		// the entry and counts it rightly: a fresh cluster tries again.
		// Whatever it answers is read once answered, so an entry
		// counted before a not_leader answer still fails.
		for attempt := 1; ; attempt++ {
			c := newTestCluster(t, 3)
			f := (c.leader() + 1) % 3
			in := c.ings[f]
			in.onEvents(asRequest(clearedEvents(r, 1, 1))) // as a drained subscription delivers it after a step-down
			outcome := ""
			waitFor(t, 10*time.Second, "an answer to the request", func() bool {
				for _, o := range []string{"not_leader", "acked", "error", "invalid", "stale", "unregistered"} {
					if val(in.m.requests.WithLabelValues(o)) != 0 {
						outcome = o
						return true
					}
				}
				return false
			})
			if outcome == "not_leader" {
				if n := val(in.m.entries); n != 0 {
					t.Fatalf("kvrouter_events_entries_total = %v on a node that proposed no entry", n)
				}
				return
			}
			// Only a leader proposes: answered otherwise without an
			// entry, or in every cluster, is no election's doing.
			if val(in.m.entries) == 0 || attempt == 3 {
				t.Fatalf("a node picked as a follower answered %s, having proposed %v entries (attempt %d), want not_leader", outcome, val(in.m.entries), attempt)
			}
			t.Logf("n%d was elected before it took the request (answered %s); again on a fresh cluster", f+1, outcome)
			c.close()
		}
	})
	t.Run("deadline passed before the proposal", func(t *testing.T) {
		c := newTestClusterWith(t, 1, IngesterConfig{CommitTimeout: time.Nanosecond})
		l := c.leader()
		in, node := c.ings[l], c.nodes[l]
		c.converged()
		in.onEvents(asRequest(clearedEvents(r, 1, 1)))
		waitFor(t, 10*time.Second, "the error answer", func() bool {
			return val(in.m.requests.WithLabelValues("error")) == 1
		})
		// Not the log's length: the leader writes entries of its own
		// meanwhile (its sweeps). The rank's cursor moves only with the
		// entry, which a barrier shows applied had it been proposed.
		if err := node.Raft().Barrier(10 * time.Second).Error(); err != nil {
			t.Fatal(err)
		}
		if got := node.Cursor(r); got != 0 {
			t.Fatalf("the rank's cursor is %d: the entry was proposed", got)
		}
		if n := val(in.m.entries); n != 0 {
			t.Fatalf("kvrouter_events_entries_total = %v, and no entry was proposed", n)
		}
	})
}

// TestDumpEntriesAreCounted: a dump is a Raft entry of its own, which
// kvrouter_events_entries_total counts as it does an entry of events, and
// kvrouter_events_resyncs_total{reason="dump"} counts once committed; a
// dump below the rank's cursor, which the state machine refuses, counts in
// kvrouter_events_requests_rejected_total{reason="stale_dump"} and is
// answered stale. From a review: onDump proposed its entry uncounted; from
// another, no test failed with the resync or the stale dump uncounted.
func TestDumpEntriesAreCounted(t *testing.T) {
	c := newTestCluster(t, 1)
	l := c.leader()
	in, node := c.ings[l], c.nodes[l]
	c.converged()
	before := node.Raft().LastIndex()
	r := kvevent.Rank{Worker: 9}
	stored := []kvevent.Event{{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 1}}}}
	in.onDump(&nats.Msg{Data: appendDump(nil, &dumpRequest{rank: r, cursor: 3, stored: stored})})
	if node.Raft().LastIndex() == before || node.Cursor(r) != 3 {
		t.Fatal("the dump was not committed")
	}
	if n := val(in.m.entries); n != 1 {
		t.Fatalf("kvrouter_events_entries_total = %v after the ingester proposed one entry (a dump)", n)
	}
	if n := val(in.m.resyncs.WithLabelValues("dump")); n != 1 {
		t.Fatalf("kvrouter_events_resyncs_total{reason=\"dump\"} = %v after one dump committed", n)
	}
	in.onDump(asRequest(&nats.Msg{Data: appendDump(nil, &dumpRequest{rank: r, cursor: 2})}))
	if node.Cursor(r) != 3 {
		t.Fatalf("a dump below the rank's cursor 3 applied: cursor %d", node.Cursor(r))
	}
	for _, c := range []struct {
		name string
		c    prometheus.Counter
		want float64
	}{
		{`kvrouter_events_requests_rejected_total{reason="stale_dump"}`, in.m.rejected.WithLabelValues("stale_dump"), 1},
		{`kvrouter_events_requests_total{outcome="stale"}`, in.m.requests.WithLabelValues("stale"), 1},
		{`kvrouter_events_resyncs_total{reason="dump"}`, in.m.resyncs.WithLabelValues("dump"), 1},
	} {
		if n := val(c.c); n != c.want {
			t.Errorf("%s = %v after a stale dump, want %v", c.name, n, c.want)
		}
	}
}

// TestMaxRequestTimeoutAllowsForTheCommitTimeout: by default a
// publisher's requests, once they time out, come to wait longer than the
// ingester's commit may take (CommitTimeout and Linger), and
// MaxRequestTimeout is never below RequestTimeout.
func TestMaxRequestTimeoutAllowsForTheCommitTimeout(t *testing.T) {
	var pc PublisherConfig
	var ic IngesterConfig
	pc.defaults()
	ic.defaults()
	if pc.MaxRequestTimeout <= ic.CommitTimeout+ic.Linger {
		t.Fatalf("default MaxRequestTimeout %v, not above the default CommitTimeout %v plus Linger %v", pc.MaxRequestTimeout, ic.CommitTimeout, ic.Linger)
	}
	pc = PublisherConfig{RequestTimeout: time.Minute}
	pc.defaults()
	if pc.MaxRequestTimeout != time.Minute {
		t.Fatalf("MaxRequestTimeout %v with a RequestTimeout of 1m, want 1m", pc.MaxRequestTimeout)
	}
}

// TestDumpSubjectFollowsTheSubject: a publisher or ingester given an
// events subject alone sends or takes dumps on <subject>.dump, as kvrouter
// derives its dump subject from --events-subject, so that kvagent's
// --events-subject moves both.
func TestDumpSubjectFollowsTheSubject(t *testing.T) {
	for subject, want := range map[string]string{"": DefaultDumpSubject, "site1.events": "site1.events.dump"} {
		pc, ic := PublisherConfig{Subject: subject}, IngesterConfig{Subject: subject}
		pc.defaults()
		ic.defaults()
		if pc.DumpSubject != want || ic.DumpSubject != want {
			t.Errorf("subject %q: dump subjects %q (publisher), %q (ingester), want %q", subject, pc.DumpSubject, ic.DumpSubject, want)
		}
	}
	pc := PublisherConfig{Subject: "a", DumpSubject: "b"}
	pc.defaults()
	if pc.DumpSubject != "b" {
		t.Errorf("dump subject %q given b", pc.DumpSubject)
	}
}

// TestHugeLeaseDoesNotExpireAtOnce: a lease too long for a time.Duration
// (the API refuses one past a year now, but a log or snapshot from before
// may hold one) runs for ever rather than reads as expired. From a
// review: lease_ms = MaxInt64 overflowed to -1ms, and the worker was
// removed at the first sweep after the leader first saw it.
func TestHugeLeaseDoesNotExpireAtOnce(t *testing.T) {
	for _, ms := range []int64{math.MaxInt64, 10_000_000_000_000, raftfsm.MaxLeaseMs} {
		tg := newFakeTarget()
		in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
		tg.mu.Lock()
		tg.workers[7] = raftfsm.WorkerInfo{ID: 7, LeaseMs: ms}
		tg.mu.Unlock()
		t0 := time.Now()
		in.leases.lead(t0, 0)
		sweep(in, t0) // first seen: the lease starts
		sweep(in, t0.Add(time.Second))
		sweep(in, t0.Add(300*24*time.Hour))
		if r := tg.removedIDs(); len(r) != 0 {
			t.Errorf("lease_ms=%d: worker removed %v within its lease", ms, r)
		}
		if ms == raftfsm.MaxLeaseMs {
			sweep(in, t0.Add(366*24*time.Hour))
			if r := tg.removedIDs(); !slices.Equal(r, []uint64{7}) {
				t.Errorf("lease_ms=%d: removed %v, want [7] past its year", ms, r)
			}
		}
	}
}

// TestFlushWaitsOnlyForEventsPublishedBeforeIt: Flush waits for the
// events published before the call, not for a moment when none at all is
// buffered. From a review: with an owner that went on publishing, every
// event published before the call was acknowledged within milliseconds,
// yet Flush waited for an empty buffer until its context ended.
func TestFlushWaitsOnlyForEventsPublishedBeforeIt(t *testing.T) {
	_, p := startPlane(t, newFakeTarget())
	r := kvevent.Rank{Worker: 1}
	ev := []kvevent.Event{{Kind: kvevent.KindCleared}}
	last, err := p.Publish(r, ev)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { // the owner keeps publishing
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			p.Publish(r, ev)
			time.Sleep(50 * time.Microsecond) // pace: the buffer must not fill
		}
	}()
	defer func() { close(stop); <-done }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = p.Flush(ctx)
	acked, _ := p.Cursor(r)
	if err != nil || acked < last {
		t.Fatalf("Flush: %v, with the router's cursor at %d and id %d the last published before the call", err, acked, last)
	}
}

// TestFlushWaitsForTheAcks: Flush returns once the router acknowledged
// every event published, and with ctx's error while nobody answers.
func TestFlushWaitsForTheAcks(t *testing.T) {
	p, err := NewPublisher(PublisherConfig{Conn: connectNowhere(t), Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := kvevent.Rank{Worker: 1}
	if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := p.Flush(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("flush with nobody answering: %v, want the deadline", err)
	}

	_, q := startPlane(t, newFakeTarget())
	for range 3 {
		if _, err := q.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
			t.Fatal(err)
		}
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	if err := q.Flush(ctx2); err != nil || q.Pending() != 0 {
		t.Fatalf("flush: %v, %d pending", err, q.Pending())
	}
}

// barrierTarget is a fakeTarget elected leader whose post-election Barrier
// has not passed until pass: CheckLeader fails as raftfsm.Node's does.
type barrierTarget struct {
	*fakeTarget
	passed atomic.Bool
	checks atomic.Int64 // CheckLeader calls
}

func (t *barrierTarget) CheckLeader() error {
	t.checks.Add(1)
	if !t.passed.Load() {
		return fmt.Errorf("%w: just elected", raftfsm.ErrNoLeader)
	}
	return nil
}

// TestNothingIsJudgedFromTheTableBeforeTheBarrier: a leader whose state
// may still lack entries its predecessor committed (its post-election
// Barrier has not passed: CheckLeader fails) answers no heartbeat, and
// sweeps no lease, until it has them; then it does both. From the
// event-plane review: it answered a worker whose registration was in the
// not-yet-applied tail "unknown", and its agent registered again and
// dumped every rank (a dump storm at each failover).
func TestNothingIsJudgedFromTheTableBeforeTheBarrier(t *testing.T) {
	tg := &barrierTarget{fakeTarget: newFakeTarget()}
	tg.register(8, time.Millisecond) // its lease runs out at the second sweep
	in, _ := startPlaneWith(t, tg, IngesterConfig{LeaseSweep: 5 * time.Millisecond}, PublisherConfig{})
	nc := in.cfg.Conn
	// Worker 7's registration is in the tail this leader has not applied.
	msg, err := nc.Request(DefaultHeartbeatSubject, AppendHeartbeat(nil, []uint64{7}), 500*time.Millisecond)
	if err == nil {
		unknown, _ := DecodeHeartbeat(msg.Data)
		t.Fatalf("a leader whose Barrier has not passed answered a heartbeat of worker 7 (unknown: %v)", unknown)
	}
	if !errors.Is(err, nats.ErrTimeout) {
		t.Fatalf("heartbeat before the Barrier: %v, want no answer (a timeout)", err)
	}
	waitFor(t, 10*time.Second, "sweeps to come due", func() bool {
		return tg.checks.Load() >= 20 || len(tg.removedIDs()) > 0
	})
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("a leader whose Barrier has not passed removed workers %v for their leases", r)
	}

	tg.register(7, 0)
	tg.passed.Store(true)
	for _, c := range []struct {
		ids, unknown []uint64
	}{{[]uint64{7}, nil}, {[]uint64{7, 9}, []uint64{9}}} {
		msg, err := nc.Request(DefaultHeartbeatSubject, AppendHeartbeat(nil, c.ids), 5*time.Second)
		if err != nil {
			t.Fatalf("heartbeat of %v after the Barrier: %v", c.ids, err)
		}
		if unknown, err := DecodeHeartbeat(msg.Data); err != nil || !slices.Equal(unknown, c.unknown) {
			t.Fatalf("heartbeat of %v after the Barrier: unknown %v (%v), want %v", c.ids, unknown, err, c.unknown)
		}
	}
	waitFor(t, 10*time.Second, "the sweep to remove the worker whose lease ran out", func() bool {
		return slices.Equal(tg.removedIDs(), []uint64{8})
	})
}

// TestPublisherSendsItsIncarnation: every rank batch and dump a publisher
// sends carries its incarnation, the one its configuration gives or, by
// default, a random non-zero one of its own.
func TestPublisherSendsItsIncarnation(t *testing.T) {
	tg := newFakeTarget()
	nothing := func(kvevent.Rank) ([]kvevent.Event, uint64) { return nil, 0 }
	_, p := startPlaneWith(t, tg, IngesterConfig{}, PublisherConfig{Incarnation: 77, Dump: nothing})
	if p.Incarnation() != 77 {
		t.Fatalf("Incarnation() = %d, want the configured 77", p.Incarnation())
	}
	r := kvevent.Rank{Worker: 3}
	p.Resync(r)
	for range 3 {
		if _, err := p.Publish(r, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Flush(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	tg.mu.Lock()
	if len(tg.ingested) == 0 || !slices.Equal(tg.dumps, []uint64{77}) {
		t.Fatalf("%d batches, dumps of incarnations %v; want some batches and one dump of 77", len(tg.ingested), tg.dumps)
	}
	for _, b := range tg.ingested {
		if b.Incarnation != 77 {
			t.Fatalf("a batch of incarnation %d, want 77", b.Incarnation)
		}
	}
	tg.mu.Unlock()

	nc := connectNowhere(t)
	var incs []uint64
	for range 2 {
		q, err := NewPublisher(PublisherConfig{Conn: nc, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		incs = append(incs, q.Incarnation())
		q.Close()
	}
	if incs[0] == 0 || incs[1] == 0 || incs[0] == incs[1] {
		t.Fatalf("two publishers drew incarnations %#x and %#x: want two different non-zero ones", incs[0], incs[1])
	}
}

// TestCountingARankBatchAllocatesNothing: the received-events count of a
// rank batch from a registered worker (its series labelled by the worker
// id) allocates nothing once the worker has its series: the id's label
// was formatted again for every batch, on the leader's ingest path.
func TestCountingARankBatchAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates")
	}
	in := &Ingester{m: newIngesterMetrics(prometheus.NewRegistry(), quiet)}
	workers := map[uint64]raftfsm.WorkerInfo{12345: {ID: 12345}} // an id of 100 or more: strconv has the smaller ones' strings
	b := raftfsm.RankBatch{Rank: kvevent.Rank{Worker: 12345}, Events: []kvevent.Event{
		{Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 1}}},
		{Kind: kvevent.KindRemoved, Tier: kvevent.TierHostPinned, Removed: []uint64{1}},
	}}
	in.countReceived(&b, workers) // the series made
	if n := testing.AllocsPerRun(100, func() { in.countReceived(&b, workers) }); n != 0 {
		t.Fatalf("counting a rank batch of a registered worker allocated %.1f times, want 0", n)
	}
	var m dto.Metric
	if err := in.m.received.WithLabelValues("12345", kvevent.KindStored.String(), kvevent.TierDevice.String()).Write(&m); err != nil || m.GetCounter().GetValue() != 102 {
		t.Fatalf("events_received{worker=12345,kind=store,tier=device} = %v (%v), want 102", m.GetCounter().GetValue(), err)
	}
}

// receivedSeries counts worker's kvrouter_events_received_total series.
func receivedSeries(t *testing.T, in *Ingester, worker string) int {
	t.Helper()
	ch := make(chan prometheus.Metric, 64)
	in.m.received.Collect(ch)
	close(ch)
	n := 0
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		for _, l := range d.GetLabel() {
			if l.GetName() == "worker" && l.GetValue() == worker {
				n++
			}
		}
	}
	return n
}

// TestALeftWorkersSeriesGoOnTheSweeps: a worker's
// kvrouter_events_received_total and kvrouter_events_lag_seconds series go
// once it leaves the worker table, at the leader's lease sweep and at a
// former leader's (a follower's) sweep, which keeps the received series
// of the workers still registered. The other tests call dropLeftWorkers
// themselves: with both of the sweeps' calls taken out, they passed.
func TestALeftWorkersSeriesGoOnTheSweeps(t *testing.T) {
	for _, tc := range []struct {
		name     string
		stepDown bool
	}{{"leader", false}, {"follower", true}} {
		t.Run(tc.name, func(t *testing.T) {
			tg := &steppingTarget{fakeTarget: newFakeTarget()}
			tg.register(7, 0)
			tg.register(8, 0)
			in, p := startPlaneWith(t, tg, IngesterConfig{LeaseSweep: 10 * time.Millisecond, PollInterval: 10 * time.Millisecond}, PublisherConfig{})
			for _, w := range []uint64{7, 8} {
				if _, err := p.Publish(kvevent.Rank{Worker: w}, []kvevent.Event{{Kind: kvevent.KindCleared}}); err != nil {
					t.Fatal(err)
				}
			}
			waitFor(t, 10*time.Second, "the acks", func() bool { return p.Pending() == 0 })
			if receivedSeries(t, in, "7") == 0 || receivedSeries(t, in, "8") == 0 {
				t.Fatal("workers 7 and 8 have no received series after their events")
			}
			if _, ok := lagOf(t, in, "7"); !ok {
				t.Fatal("the leader exports no lag for worker 7")
			}
			if tc.stepDown {
				tg.stepped.Store(true)
				waitFor(t, 10*time.Second, "the step-down", func() bool { return !ingesting(in) })
			}
			tg.workersMu.Lock()
			err := tg.DeregisterWorker(ctxT(t), 7)
			tg.workersMu.Unlock()
			if err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "worker 7's received series gone after it left", func() bool { return receivedSeries(t, in, "7") == 0 })
			if lag, ok := lagOf(t, in, "7"); ok {
				t.Fatalf("worker 7 left and its lag is still exported (%v)", lag)
			}
			if receivedSeries(t, in, "8") == 0 {
				t.Fatal("worker 8, still registered, lost its received series")
			}
		})
	}
}

// TestStalledIngestionHoldsMoreThanNATSsDefaultPending: while the
// ingester's callback waits for room (commits stalled), the events
// subscription of a real connection holds past nats.go's default pending
// limits (500,000 messages or 64 MiB, where it drops what comes and
// reports a slow consumer) up to its own, no count and 256 MiB
// (docs/events.md, Delivery): 600,000 small requests and then 70 MiB of
// large ones are all kept, and no slow consumer is reported. With the
// limits' call deleted, 100,125 requests were dropped and one slow
// consumer reported.
func TestStalledIngestionHoldsMoreThanNATSsDefaultPending(t *testing.T) {
	s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Shutdown(); s.WaitForShutdown() }()
	var slow atomic.Int64
	ic, err := nats.Connect(s.ClientURL(), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrSlowConsumer) {
			slow.Add(1)
		}
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer ic.Close()
	subs := make(chan *nats.Subscription, 1)
	subscribed = func(events, _, _ *nats.Subscription) { subs <- events }
	defer func() { subscribed = nil }()
	tg := newFakeTarget()
	tg.hold = make(chan struct{})
	defer close(tg.hold)
	in, err := NewIngester(IngesterConfig{Conn: ic, Node: tg, Logger: quiet, MaxInFlight: 1,
		MaxEntryEvents: 4, MaxRequestEvents: 4, MaxQueuedEvents: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	var sub *nats.Subscription
	select {
	case sub = <-subs:
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for the ingester to subscribe")
	}
	if msgs, bytes, err := sub.PendingLimits(); err != nil || msgs != -1 || bytes != 256<<20 {
		t.Fatalf("the events subscription's pending limits: %d messages, %d bytes (%v); want -1 and 256 MiB", msgs, bytes, err)
	}
	waitFor(t, 10*time.Second, "the server to see the ingester's subscription", func() bool {
		return s.GlobalAccount().SubscriptionInterest(DefaultSubject)
	})

	// Past both defaults: more than 500,000 messages, then more than 64
	// MiB. The large ones need not decode: they are never taken.
	pc := connect(t, s.ClientURL())
	r := kvevent.Rank{Worker: 1}
	const small, large = 600_000, 140
	for i := range small {
		if err := pc.Publish(DefaultSubject, clearedEvents(r, uint64(i+1), 1).Data); err != nil {
			t.Fatal(err)
		}
	}
	big := make([]byte, 512<<10)
	for range large {
		if err := pc.Publish(DefaultSubject, big); err != nil {
			t.Fatal(err)
		}
	}
	n := small + large
	if err := pc.Flush(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "the ingester's connection to receive every request", func() bool {
		return ic.Stats().InMsgs >= uint64(n)
	})
	if dropped, err := sub.Dropped(); err != nil || dropped != 0 || slow.Load() != 0 {
		pending, bytes, _ := sub.Pending()
		t.Fatalf("%d requests sent while the commits stalled: %d dropped (%v), %d slow-consumer reports, %d pending (%d bytes); want none dropped",
			n, dropped, err, slow.Load(), pending, bytes)
	}
}
