package eventplane

import (
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testclock"
)

// TestRegistrationAfterTheLeadersClockSteppedBackKeepsTheWorker: as
// TestRegistrationWhileAnExpiryWaitsKeepsTheWorker, with the leader's wall
// clock stepped back (an NTP correction) between its first sighting of
// worker 7 and the registration. The registration, stamped by that clock,
// is the worker's latest sign of life ("a lease runs from the latest of
// the worker's last heartbeat, its last registration ... and the first
// time this leader saw the worker", docs/events.md), and the worker
// stays. The sighting is a local reading (monotonic and wall), the
// registration a wall stamp: compared by wall time, the step made the
// registration older than the sighting, and the worker was removed right
// after its registration succeeded (its ranks' state and bookings with
// it).
func TestRegistrationAfterTheLeadersClockSteppedBackKeepsTheWorker(t *testing.T) {
	tg := newTermTarget()
	const lease = 10 * time.Second
	const step = time.Hour
	t0 := time.Now().Add(-lease - time.Second)
	tg.register(7, lease)
	in := newIngester(IngesterConfig{Node: tg, Logger: quiet})
	in.leases.lead(t0, 0)
	sweep(in, t0) // first seen, before the step
	// The leader's clock is stepped back an hour; a lease later (by the
	// monotonic clock) the sweep finds 7 silent.
	now := testclock.WallStepped(t, time.Now(), -step)
	tg.workersMu.Lock()
	in.sweepLeases(now) // expired: the removal waits for the lock
	waitLocking(t, tg)
	// 7's agent registers it again, under the lock; the leader stamps the
	// registration with its clock, as it reads after the step.
	tg.reregister(7, lease, testclock.WallStepped(t, time.Now(), -step))
	tg.workersMu.Unlock()
	in.cwg.Wait()
	if r := tg.removedIDs(); len(r) != 0 {
		t.Fatalf("workers %v removed, want none: 7 registered again (stamped by the leader's clock, stepped back %v) while its removal waited",
			slices.Clone(r), step)
	}
}
