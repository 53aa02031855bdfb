// sequences_test.go checks the load tracker rule by rule (semantics.md §6),
// then as a whole against seqModel, a deliberately naive reference that
// recomputes every answer from its list of requests.

package indexer

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

var (
	wkA0 = kvevent.Rank{Worker: 1, DP: 0}
	wkA1 = kvevent.Rank{Worker: 1, DP: 1}
	wkB0 = kvevent.Rank{Worker: 2, DP: 0}
	wkC0 = kvevent.Rank{Worker: 3, DP: 0}
)

const nsPerSec = int64(time.Second)

func mustBook(t testing.TB, s *Sequences, id string, r kvevent.Rank, seq []uint64, isl, cached int, now int64) bool {
	t.Helper()
	ok, err := s.Add(id, r, seq, isl, cached, now)
	if err != nil {
		t.Fatalf("Add(%q): %v", id, err)
	}
	return ok
}

func potentialByRank(s *Sequences, q []uint64) (map[kvevent.Rank]int64, int64) {
	out, idle := s.PotentialDecodeBlocks(nil, q, nil)
	m := make(map[kvevent.Rank]int64, len(out))
	for _, rl := range out {
		m[rl.Rank] = rl.PotentialDecodeBlocks
	}
	return m, idle
}

func TestSharedPrefixBlocksCountOnceInDecodeLoad(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1, 2, 3}, 48, 0, 0)
	mustBook(t, s, "r2", wkA0, []uint64{1, 2, 4, 5}, 64, 32, 0)
	got := s.Load(wkA0)
	want := Load{ActivePrefillTokens: 48 + 32, ActiveDecodeBlocks: 5, ActiveRequests: 2}
	if got != want {
		t.Fatalf("load = %+v, want %+v", got, want)
	}
	s.Free("r1")
	if got, want := s.Load(wkA0), (Load{ActivePrefillTokens: 32, ActiveDecodeBlocks: 4, ActiveRequests: 1}); got != want {
		t.Fatalf("load after freeing r1 = %+v, want %+v", got, want)
	}
}

func TestRepeatedAddOfLiveIDDoesNotDoubleCount(t *testing.T) {
	s := NewSequences()
	if !mustBook(t, s, "r1", wkA0, []uint64{1, 2}, 32, 0, 0) {
		t.Fatal("first Add refused")
	}
	// Same id, even with other arguments: the first booking stands.
	if mustBook(t, s, "r1", wkB0, []uint64{1, 2, 3}, 99, 0, 5) {
		t.Fatal("repeated Add of a live id booked again")
	}
	if got, want := s.Load(wkA0), (Load{32, 2, 1}); got != want {
		t.Fatalf("load = %+v, want %+v", got, want)
	}
	if got := s.Load(wkB0); got != (Load{}) {
		t.Fatalf("rank B load = %+v, want none", got)
	}
}

func TestRetriedAddAfterFreeDoesNotResurrectBooking(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1, 2}, 32, 0, 10*nsPerSec)
	if !s.Free("r1") {
		t.Fatal("Free of a live id returned false")
	}
	if mustBook(t, s, "r1", wkA0, []uint64{1, 2}, 32, 0, 10*nsPerSec) {
		t.Fatal("retried Add after Free booked the request again")
	}
	if got := s.Load(wkA0); got != (Load{}) {
		t.Fatalf("load = %+v, want none", got)
	}
	// Still refused by the tombstone after a sweep that leaves it.
	s.Expire(300*nsPerSec, DefaultBookingMaxAge)
	if mustBook(t, s, "r1", wkA0, []uint64{1, 2}, 32, 0, 10*nsPerSec) {
		t.Fatal("retried Add booked after a sweep that kept the tombstone")
	}
	if live, freed := s.Count(); live != 0 || freed != 1 {
		t.Fatalf("count = %d live, %d freed; want 0, 1", live, freed)
	}
}

// TestFreedIDBooksAgainOnceItsTombstoneIsSwept: an id is single-use only
// while its tombstone stands, the max age from its booking; swept, it is
// unknown again, and an Add books it (stamped no earlier than the sweep).
func TestFreedIDBooksAgainOnceItsTombstoneIsSwept(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1}, 16, 0, 10*nsPerSec)
	s.Free("r1")
	if !s.Freed("r1") || s.Freed("r2") {
		t.Fatal("Freed does not tell the tombstone of r1 from the unknown r2")
	}
	s.Expire(400*nsPerSec, DefaultBookingMaxAge) // cutoff 100 s: the tombstone goes
	if _, freed := s.Count(); freed != 0 || s.Freed("r1") {
		t.Fatalf("tombstone older than the max age was not swept (%d left)", freed)
	}
	if !mustBook(t, s, "r1", wkA0, []uint64{1}, 16, 0, 10*nsPerSec) {
		t.Fatal("an Add of an id whose tombstone was swept was refused")
	}
	if b, _ := s.Get("r1"); b.CreatedAt != 400*nsPerSec {
		t.Fatalf("booked at %d, want the sweep's time %d", b.CreatedAt, 400*nsPerSec)
	}
}

// TestAddBeforeSweepFromClockAheadIsStampedAtTheSweep: a leader whose clock
// ran ahead by more than the max age swept; the next leader's clock is
// right. A booking of a fresh id it stamps is booked (it was refused, with
// no error, as for an id freed before), as created at the sweep's time,
// and the sweeps expire it the max age after that.
func TestAddBeforeSweepFromClockAheadIsStampedAtTheSweep(t *testing.T) {
	const now = 1_000 * nsPerSec
	ahead := now + int64(10*time.Minute)
	s := NewSequences()
	s.Expire(ahead, 5*time.Minute)
	ok, err := s.Add("fresh-id-never-used", wkA0, []uint64{1}, 16, 0, now)
	if err != nil || !ok {
		t.Fatalf("Add of a fresh id after a sweep from a clock ahead = %v, %v; want booked", ok, err)
	}
	if b, _ := s.Get("fresh-id-never-used"); b.CreatedAt != ahead {
		t.Fatalf("booked at %d, want the sweep's time %d", b.CreatedAt, ahead)
	}
	if n := s.Expire(ahead+int64(5*time.Minute), 5*time.Minute); n != 0 {
		t.Fatal("a booking stamped at the sweep expired within the max age of it")
	}
	if n := s.Expire(ahead+int64(5*time.Minute)+1, 5*time.Minute); n != 1 {
		t.Fatal("a booking stamped at the sweep outlived the max age")
	}
}

func TestSweepClockNeverMovesBack(t *testing.T) {
	s := NewSequences()
	s.Expire(1000*nsPerSec, 100*time.Second)
	s.Expire(500*nsPerSec, 100*time.Second) // a stale leader's sweep: the clock stays
	if !mustBook(t, s, "r1", wkA0, nil, 1, 0, 800*nsPerSec) {
		t.Fatal("Add below the clock refused")
	}
	if b, _ := s.Get("r1"); b.CreatedAt != 1000*nsPerSec {
		t.Fatalf("booked at %d, want the latest sweep's time %d", b.CreatedAt, 1000*nsPerSec)
	}
}

func TestPrefillTokensFloorAtZero(t *testing.T) {
	cases := []struct {
		name        string
		isl, cached int
		want        int64
	}{
		{"nothing cached", 100, 0, 100},
		{"part cached", 100, 64, 36},
		{"all cached", 64, 64, 0},
		{"cached over isl", 10, 64, 0},
		{"empty prompt", 0, 0, 0},
	}
	for _, c := range cases {
		s := NewSequences()
		mustBook(t, s, "r", wkA0, nil, c.isl, c.cached, 0)
		if got := s.Load(wkA0).ActivePrefillTokens; got != c.want {
			t.Errorf("%s: prefill tokens = %d, want %d", c.name, got, c.want)
		}
	}
}

func TestPrefillDoneSubtractsPrefillOnce(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{7}, 100, 20, 0)
	mustBook(t, s, "r2", wkA0, []uint64{8}, 50, 0, 0)
	if !s.PrefillDone("r1") {
		t.Fatal("PrefillDone of a live id returned false")
	}
	if s.PrefillDone("r1") {
		t.Fatal("repeated PrefillDone returned true")
	}
	if got, want := s.Load(wkA0), (Load{50, 2, 2}); got != want {
		t.Fatalf("load = %+v, want %+v", got, want)
	}
	// Freeing a request past prefill must not subtract its prefill again.
	s.Free("r1")
	if got, want := s.Load(wkA0), (Load{50, 1, 1}); got != want {
		t.Fatalf("load after free = %+v, want %+v", got, want)
	}
}

func TestCallsOnUnknownOrFreedIDAreNoOps(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1}, 16, 0, 0)
	s.Free("r1")
	d := s.Digest()
	for _, c := range []struct {
		name string
		call func() bool
	}{
		{"PrefillDone unknown", func() bool { return s.PrefillDone("nope") }},
		{"Free unknown", func() bool { return s.Free("nope") }},
		{"PrefillDone freed", func() bool { return s.PrefillDone("r1") }},
		{"Free freed", func() bool { return s.Free("r1") }},
	} {
		if c.call() {
			t.Errorf("%s returned true", c.name)
		}
	}
	if s.Digest() != d {
		t.Fatal("no-op calls changed the state digest")
	}
}

func TestAddRejectsInvalidInputWithoutBooking(t *testing.T) {
	cases := []struct {
		name        string
		id          string
		isl, cached int
	}{
		{"empty id", "", 16, 0},
		{"negative isl", "r", -1, 0},
		{"negative cached", "r", 16, -5},
	}
	for _, c := range cases {
		s := NewSequences()
		ok, err := s.Add(c.id, wkA0, []uint64{1}, c.isl, c.cached, 0)
		if ok || !errors.Is(err, ErrInvalidBooking) {
			t.Errorf("%s: Add = %v, %v; want false, ErrInvalidBooking", c.name, ok, err)
		}
		if live, _ := s.Count(); live != 0 {
			t.Errorf("%s: invalid Add booked", c.name)
		}
	}
}

func TestExpireFreesOnlyBookingsOlderThanMaxAge(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "old", wkA0, []uint64{1}, 16, 0, 0)
	mustBook(t, s, "edge", wkA0, []uint64{2}, 16, 0, 100*nsPerSec)
	mustBook(t, s, "new", wkB0, []uint64{3}, 16, 0, 150*nsPerSec)
	// At 400 s with the default 300 s: "old" is 400 s old, "edge" exactly
	// 300 s (not older), "new" 250 s.
	if n := s.Expire(400*nsPerSec, 0); n != 1 {
		t.Fatalf("expired %d, want 1", n)
	}
	got := []string{}
	for _, b := range s.Bookings() {
		got = append(got, b.ID)
	}
	if want := []string{"edge", "new"}; !slices.Equal(got, want) {
		t.Fatalf("live after expire = %v, want %v", got, want)
	}
	// An expired request is gone for good: its late Free is a no-op.
	if s.Free("old") {
		t.Fatal("Free of an expired id returned true")
	}
}

func TestExpireNearMinInt64DoesNotWrap(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r", wkA0, []uint64{1}, 16, 0, math.MinInt64)
	if n := s.Expire(math.MinInt64+5, time.Hour); n != 0 {
		t.Fatalf("expired %d bookings with a cutoff that wrapped", n)
	}
}

func TestRemoveRankAndWorkerDropOnlyTheirBookings(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "a0", wkA0, []uint64{1, 2}, 16, 0, 0)
	mustBook(t, s, "a1", wkA1, []uint64{1, 2}, 16, 0, 0)
	mustBook(t, s, "b", wkB0, []uint64{1, 2}, 16, 0, 0)
	if n := s.RemoveRank(wkA1); n != 1 {
		t.Fatalf("RemoveRank dropped %d, want 1", n)
	}
	if n := s.RemoveRank(wkC0); n != 0 {
		t.Fatalf("RemoveRank of an idle rank dropped %d", n)
	}
	if n := s.RemoveWorker(wkA0.Worker); n != 1 {
		t.Fatalf("RemoveWorker dropped %d, want 1", n)
	}
	if got, want := s.Load(wkB0), (Load{16, 2, 1}); got != want {
		t.Fatalf("rank B load = %+v, want %+v", got, want)
	}
	if mustBook(t, s, "a0", wkA0, []uint64{1, 2}, 16, 0, 0) {
		t.Fatal("retried Add after RemoveWorker booked on the removed rank")
	}
}

func TestPotentialDecodeBlocksCountsOnlyBlocksTheRankLacks(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "a", wkA0, []uint64{1, 2, 3}, 48, 0, 0)
	mustBook(t, s, "b", wkB0, []uint64{9}, 16, 0, 0)
	mustBook(t, s, "b2", wkB0, []uint64{1}, 16, 0, 0)
	// The query repeats block 2: one block, counted once.
	got, idle := potentialByRank(s, []uint64{1, 2, 2, 4})
	want := map[kvevent.Rank]int64{
		wkA0: 3 + 1, // holds 1, 2; lacks 4
		wkB0: 2 + 2, // holds 1; lacks 2, 4
	}
	if !reflect.DeepEqual(got, want) || idle != 3 {
		t.Fatalf("potential = %v, idle %d; want %v, idle 3", got, idle, want)
	}
}

func TestFreeingOneOfManyHoldersKeepsTheOthers(t *testing.T) {
	// Holders of one block are kept in a list with swap-removal: drop the
	// first, a middle and the last holder in turn.
	for drop := range 4 {
		s := NewSequences()
		ranks := []kvevent.Rank{wkA0, wkA1, wkB0, wkC0}
		for i, r := range ranks {
			mustBook(t, s, fmt.Sprint(i), r, []uint64{7, uint64(i)}, 1, 0, 0)
		}
		s.Free(fmt.Sprint(drop))
		if err := s.st.check(); err != nil {
			t.Fatalf("drop holder %d: %v", drop, err)
		}
		got, _ := potentialByRank(s, []uint64{7})
		for i, r := range ranks {
			if want := int64(2); i != drop && got[r] != want {
				t.Fatalf("drop holder %d: rank %v potential %d, want %d", drop, r, got[r], want)
			}
		}
	}
}

func TestRanksAreListedInRankOrderAfterSlotReuse(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "c", wkC0, nil, 1, 0, 0)
	mustBook(t, s, "a", wkA0, nil, 1, 0, 0)
	s.Free("a") // releases rank A's slot
	mustBook(t, s, "b", wkB0, nil, 1, 0, 0)
	mustBook(t, s, "a1", wkA1, nil, 1, 0, 0)
	var got []kvevent.Rank
	for _, rl := range s.Loads(nil) {
		got = append(got, rl.Rank)
	}
	if want := []kvevent.Rank{wkA1, wkB0, wkC0}; !slices.Equal(got, want) {
		t.Fatalf("ranks = %v, want %v", got, want)
	}
}

// TestReleasedSlotsAreReused: a rank's slot is released with its last live
// booking and taken by the next rank booked, so the slots number at most
// the ranks with live bookings at once, however many times one rank
// comes and goes and however many ranks come and go over the tracker's
// life: a request at a time on one rank, ten thousand times, holds one
// slot; ranks of three thousand workers that come and go, four live at
// most at once (each booked before the oldest of the three before it
// goes, by Free, Expire and RemoveWorker in turn), hold four.
func TestReleasedSlotsAreReused(t *testing.T) {
	s := NewSequences()
	for i := range 10_000 {
		id := fmt.Sprint("a", i)
		mustBook(t, s, id, wkA0, []uint64{uint64(i), 7}, 16, 0, 0)
		s.Free(id)
	}
	if got := len(s.st.slots); got != 1 {
		t.Fatalf("%d slots after 10000 bookings freed one by one on one rank, want 1", got)
	}

	s = NewSequences()
	const atOnce = 3 // between two bookings; one more while a rank is booked
	for w := range 3_000 {
		r := kvevent.Rank{Worker: uint64(100 + w), DP: uint32(w % 2)}
		mustBook(t, s, fmt.Sprint("w", w), r, []uint64{uint64(w)}, 16, 0, int64(w))
		if w < atOnce {
			continue
		}
		gone := kvevent.Rank{Worker: uint64(100 + w - atOnce), DP: uint32((w - atOnce) % 2)}
		switch w % 3 {
		case 0:
			s.Free(fmt.Sprint("w", w-atOnce))
		case 1:
			s.Expire(int64(w-atOnce+2), 1) // older than 1 ns at w-atOnce+2: the booking of w-atOnce alone
		case 2:
			s.RemoveWorker(gone.Worker)
		}
		if got := s.Load(gone); got != (Load{}) {
			t.Fatalf("rank %v still loaded (%+v) after its booking went", gone, got)
		}
		if got := len(s.st.slots); got > atOnce+1 {
			t.Fatalf("%d slots after %d ranks came and went with %d live at most at once, want %d at most",
				got, w-atOnce+1, atOnce+1, atOnce+1)
		}
	}
	if err := s.st.check(); err != nil {
		t.Fatal(err)
	}
}

func TestPotentialDecodeBlocksDoesNotAllocate(t *testing.T) {
	s := NewSequences()
	for i := range 64 {
		r := kvevent.Rank{Worker: uint64(i)}
		seq := make([]uint64, 128)
		for j := range seq {
			seq[j] = uint64(j%(i+1)) + uint64(i)*1000
		}
		mustBook(t, s, fmt.Sprint(i), r, seq, 2048, 0, 0)
		if i%2 == 0 { // decaying ranks take their discount back on the shared blocks
			s.SetDecay(fmt.Sprint(i), DecayScale/3)
		}
	}
	q := make([]uint64, 128)
	for j := range q {
		q[j] = uint64(j)
	}
	var sc PotentialScratch
	dst := make([]RankLoad, 0, 64)
	allocs := testing.AllocsPerRun(100, func() {
		dst, _ = s.PotentialDecodeBlocks(dst[:0], q, &sc)
	})
	if allocs != 0 {
		t.Fatalf("PotentialDecodeBlocks allocates %v times per call", allocs)
	}
}

func TestRestoreRejectsBadSnapshotAndKeepsState(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "keep", wkA0, []uint64{1}, 16, 0, 0)
	before := s.Digest()
	bad := []SequencesSnapshot{
		{Bookings: []Booking{{ID: "x", Rank: wkB0}, {ID: "x", Rank: wkC0}}},
		{Bookings: []Booking{{ID: "x"}}, Freed: []FreedBooking{{ID: "x"}}},
		{Bookings: []Booking{{ID: "", ISL: 1}}},
		{Bookings: []Booking{{ID: "y", ISL: -1}}},
		{Freed: []FreedBooking{{ID: ""}}},
	}
	for i, snap := range bad {
		if err := s.Restore(snap); !errors.Is(err, ErrInvalidBooking) {
			t.Errorf("snapshot %d: Restore error = %v, want ErrInvalidBooking", i, err)
		}
	}
	if s.Digest() != before || s.Load(wkA0) != (Load{16, 1, 1}) {
		t.Fatal("a refused Restore changed the state")
	}
}

func TestDigestDoesNotDependOnOperationOrder(t *testing.T) {
	a, b := NewSequences(), NewSequences()
	mustBook(t, a, "r1", wkA0, []uint64{1, 2}, 32, 0, 1)
	mustBook(t, a, "r2", wkB0, []uint64{1}, 16, 0, 2)
	mustBook(t, a, "r3", wkB0, []uint64{3}, 16, 0, 3)
	a.PrefillDone("r1")
	a.Free("r3")

	mustBook(t, b, "r3", wkB0, []uint64{3}, 16, 0, 3)
	b.Free("r3")
	mustBook(t, b, "r2", wkB0, []uint64{1}, 16, 0, 2)
	mustBook(t, b, "r1", wkA0, []uint64{1, 2}, 32, 0, 1)
	b.PrefillDone("r1")
	if a.Digest() != b.Digest() {
		t.Fatal("equal states built in another order have different digests")
	}
	b.PrefillDone("r2")
	if a.Digest() == b.Digest() {
		t.Fatal("a prefill flag does not change the digest")
	}
}

func TestRestoredReplicaRefusesRetryAfterFreeLikeTheOthers(t *testing.T) {
	leader := NewSequences()
	mustBook(t, leader, "r1", wkA0, []uint64{1}, 16, 0, 100*nsPerSec)
	mustBook(t, leader, "old", wkB0, []uint64{2}, 16, 0, 0)
	leader.Free("r1")
	leader.Expire(350*nsPerSec, DefaultBookingMaxAge) // cutoff 50 s: "old" goes
	follower := NewSequences()
	if err := follower.Restore(leader.Snapshot()); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Sequences{leader, follower} {
		if mustBook(t, s, "r1", wkA0, []uint64{1}, 16, 0, 100*nsPerSec) {
			t.Fatal("retry after Free booked on a node (tombstone lost in the snapshot)")
		}
		if !mustBook(t, s, "old", wkB0, []uint64{2}, 16, 0, 0) {
			t.Fatal("an Add of an expired id was refused")
		}
		if b, _ := s.Get("old"); b.CreatedAt != 350*nsPerSec {
			t.Fatalf("booked at %d, want the sweep's time (clock lost in the snapshot?)", b.CreatedAt)
		}
	}
	if leader.Digest() != follower.Digest() {
		t.Fatal("leader and restored follower diverged")
	}
}

func TestDigestSeesTombstonesAndSweepClock(t *testing.T) {
	a, b := NewSequences(), NewSequences()
	mustBook(t, a, "r1", wkA0, nil, 1, 0, 100*nsPerSec)
	a.Free("r1")
	if a.Digest() == b.Digest() {
		t.Fatal("a tombstone does not change the digest: replicas could disagree on a retried Add")
	}
	c, d := NewSequences(), NewSequences()
	c.Expire(10*nsPerSec, time.Second)
	if c.Digest() == d.Digest() {
		t.Fatal("a sweep does not change the digest")
	}
	d.Expire(20*nsPerSec, time.Second)
	if c.Digest() == d.Digest() {
		t.Fatal("the sweeps' clock does not change the digest: replicas could stamp a booking differently")
	}
}

func TestConcurrentQueriesDuringMutationsAreRaceFree(t *testing.T) {
	s := NewSequences()
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var sc PotentialScratch
			var dst []RankLoad
			q := []uint64{1, 2, 3, uint64(g)}
			for {
				select {
				case <-stop:
					return
				default:
				}
				dst, _ = s.PotentialDecodeBlocks(dst[:0], q, &sc)
				_ = s.Load(wkA0)
				_ = s.Digest()
			}
		}()
	}
	for i := range 2000 {
		id := fmt.Sprint(i)
		r := kvevent.Rank{Worker: uint64(i % 7)}
		mustBook(t, s, id, r, []uint64{1, 2, uint64(i)}, 64, 0, int64(i))
		if i%3 == 0 {
			s.PrefillDone(id)
		}
		if i%2 == 0 {
			s.Free(fmt.Sprint(i / 2))
		}
		if i%100 == 0 {
			s.Expire(int64(i), 50)
		}
	}
	close(stop)
	wg.Wait()
	if err := s.st.check(); err != nil {
		t.Fatal(err)
	}
}

// check verifies every internal invariant of the file comment by recomputing
// the derived structures from byID.
func (st *seqState) check() error {
	type key struct {
		h    uint64
		rank kvevent.Rank
	}
	refs := map[key]int32{}
	holder := map[key]*booking{} // the last booking seen holding h on rank
	loads := map[kvevent.Rank]Load{}
	var digest uint64
	live, freed, dirty := 0, 0, 0
	for id, b := range st.byID {
		if id != b.id {
			return fmt.Errorf("byID[%q] holds %q", id, b.id)
		}
		if b.dirtyAt == 0 {
			digest += b.entryHash()
		} else if b.freed || int(b.dirtyAt) > len(st.dirty) || st.dirty[b.dirtyAt-1] != b {
			return fmt.Errorf("booking %q: dirtyAt %d, freed %v, not at its place in dirty (%d)", b.id, b.dirtyAt, b.freed, len(st.dirty))
		} else {
			dirty++
		}
		if b.held != nil {
			for _, h := range b.seq {
				if _, ok := b.held[h]; !ok {
					return fmt.Errorf("booking %q holds %d, its held set lacks it", b.id, h)
				}
			}
			if len(b.held) > len(b.seq) {
				return fmt.Errorf("booking %q: held lists %d hashes, seq %d", b.id, len(b.held), len(b.seq))
			}
		}
		if b.freed {
			freed++
			continue
		}
		live++
		l := loads[b.rank]
		l.ActiveRequests++
		if !b.prefillDone {
			l.ActivePrefillTokens += b.prefill
		}
		for _, h := range b.seq {
			if refs[key{h, b.rank}] == 0 {
				l.ActiveDecodeBlocks++
			}
			refs[key{h, b.rank}]++
			holder[key{h, b.rank}] = b
		}
		loads[b.rank] = l
		if (b.discount != 0) != (st.discounted[b.ord] == b) {
			return fmt.Errorf("booking %q discount %d, in discounted %v", b.id, b.discount, st.discounted[b.ord] == b)
		}
	}
	discounts := map[kvevent.Rank]int64{}
	for k, n := range refs {
		if n == 1 {
			discounts[k.rank] += int64(holder[k].discount)
		}
	}
	alone := 0
	for h, hs := range st.alone {
		if len(hs) == 0 {
			return fmt.Errorf("alone[%#x] is empty", h)
		}
		seen := map[int32]bool{}
		for _, a := range hs {
			k := key{h, st.slots[a.slot].rank}
			if seen[a.slot] || refs[k] != 1 || holder[k].discount != a.discount || a.discount == 0 {
				return fmt.Errorf("alone[%#x] lists slot %d (rank %v) with discount %d wrongly", h, a.slot, k.rank, a.discount)
			}
			seen[a.slot] = true
			alone++
		}
	}
	wantAlone := 0
	for k, n := range refs {
		if n == 1 && holder[k].discount != 0 {
			wantAlone++
		}
	}
	if alone != wantAlone {
		return fmt.Errorf("alone lists %d holds, decaying bookings hold %d blocks alone", alone, wantAlone)
	}
	for ord, b := range st.discounted {
		if b.ord != ord || b.freed || st.byID[b.id] != b {
			return fmt.Errorf("discounted[%d] holds %q (ord %d, freed %v)", ord, b.id, b.ord, b.freed)
		}
	}
	if live != st.live || freed != st.freed {
		return fmt.Errorf("counts %d/%d, recomputed %d/%d", st.live, st.freed, live, freed)
	}
	if dirty != len(st.dirty) {
		return fmt.Errorf("%d dirty bookings, %d listed", dirty, len(st.dirty))
	}
	if digest != st.digest {
		return fmt.Errorf("digest sum %#x, recomputed %#x", st.digest, digest)
	}
	n := 0
	for h, e := range st.blocks {
		all := append([]int32{e.first}, e.rest...)
		seen := map[int32]bool{}
		for _, sl := range all {
			rank := st.slots[sl].rank
			if seen[sl] || refs[key{h, rank}] == 0 {
				return fmt.Errorf("block %#x lists rank %v (slot %d) wrongly", h, rank, sl)
			}
			seen[sl] = true
			n++
		}
	}
	if n != len(refs) {
		return fmt.Errorf("%d block holders, recomputed %d", n, len(refs))
	}
	for _, sl := range st.order {
		rs := st.slots[sl]
		if len(rs.refs) != int(rs.load.ActiveDecodeBlocks) {
			return fmt.Errorf("rank %v: %d refs, %d decode blocks", rs.rank, len(rs.refs), rs.load.ActiveDecodeBlocks)
		}
		for h, c := range rs.refs {
			if c.n <= 0 || refs[key{h, rs.rank}] != c.n {
				return fmt.Errorf("rank %v block %#x: refs %d, recomputed %d", rs.rank, h, c.n, refs[key{h, rs.rank}])
			}
			if c.n == 1 && c.ords != holder[key{h, rs.rank}].ord {
				return fmt.Errorf("rank %v block %#x: ords %d, holder's ord %d", rs.rank, h, c.ords, holder[key{h, rs.rank}].ord)
			}
		}
		if rs.discount != discounts[rs.rank] {
			return fmt.Errorf("rank %v: discount %d, recomputed %d", rs.rank, rs.discount, discounts[rs.rank])
		}
		if int64(len(rs.live)) != rs.load.ActiveRequests {
			return fmt.Errorf("rank %v: %d listed bookings, %d requests", rs.rank, len(rs.live), rs.load.ActiveRequests)
		}
		for i, b := range rs.live {
			if b.freed || b.rank != rs.rank || b.slot != sl || int(b.pos) != i || st.byID[b.id] != b {
				return fmt.Errorf("rank %v: live[%d] is %q (rank %v, slot %d, pos %d, freed %v)", rs.rank, i, b.id, b.rank, b.slot, b.pos, b.freed)
			}
		}
	}
	for _, sl := range st.freeSlots {
		if len(st.slots[sl].refs) != 0 || len(st.slots[sl].live) != 0 {
			return fmt.Errorf("released slot %d still holds %d refs, %d bookings", sl, len(st.slots[sl].refs), len(st.slots[sl].live))
		}
	}
	if len(st.order) != len(loads) || len(st.slotOf) != len(loads) {
		return fmt.Errorf("%d ordered slots, %d slotOf, %d ranks with bookings", len(st.order), len(st.slotOf), len(loads))
	}
	for i, sl := range st.order {
		rs := st.slots[sl]
		if st.slotOf[rs.rank] != sl || loads[rs.rank] != rs.load {
			return fmt.Errorf("slot %d rank %v load %+v, recomputed %+v", sl, rs.rank, rs.load, loads[rs.rank])
		}
		if i > 0 && st.slots[st.order[i-1]].rank.Compare(rs.rank) >= 0 {
			return fmt.Errorf("order not sorted at %d", i)
		}
	}
	if len(st.expiry) != len(st.byID) {
		return fmt.Errorf("expiry heap holds %d, byID %d", len(st.expiry), len(st.byID))
	}
	for i, b := range st.expiry {
		if st.byID[b.id] != b {
			return fmt.Errorf("expiry heap holds %q, not in byID", b.id)
		}
		if i > 0 && expiryLess(b, st.expiry[(i-1)/2]) {
			return fmt.Errorf("expiry heap order broken at %d", i)
		}
	}
	return nil
}

// ---- the naive reference model ----

type seqModelReq struct {
	Booking
	freed bool
}

type seqModel struct {
	reqs  map[string]*seqModelReq
	swept bool
	clock int64 // the latest sweep's now
}

func newSeqModel() *seqModel { return &seqModel{reqs: map[string]*seqModelReq{}} }

func (m *seqModel) add(id string, r kvevent.Rank, seq []uint64, isl, cached int, now int64) (bool, bool) {
	if id == "" || isl < 0 || cached < 0 {
		return false, false
	}
	if _, ok := m.reqs[id]; ok {
		return false, true
	}
	if m.swept && now < m.clock {
		now = m.clock
	}
	m.reqs[id] = &seqModelReq{Booking: Booking{ID: id, Rank: r, SeqHashes: slices.Clone(seq), ISL: isl, CachedTokens: cached, CreatedAt: now}}
	return true, true
}

func (m *seqModel) prefillDone(id string) bool {
	q, ok := m.reqs[id]
	if !ok || q.freed || q.PrefillDone {
		return false
	}
	q.PrefillDone = true
	return true
}

func (m *seqModel) outputBlock(id string, h uint64) bool {
	q, ok := m.reqs[id]
	if !ok || q.freed || slices.Contains(q.SeqHashes, h) {
		return false
	}
	q.SeqHashes = append(q.SeqHashes, h)
	return true
}

func (m *seqModel) setDecay(id string, weight uint32) bool {
	q, ok := m.reqs[id]
	d := DecayScale - min(weight, DecayScale)
	if !ok || q.freed || q.Discount == d {
		return false
	}
	q.Discount = d
	return true
}

func (m *seqModel) free(id string) bool {
	q, ok := m.reqs[id]
	if !ok || q.freed {
		return false
	}
	q.freed, q.PrefillDone, q.SeqHashes, q.Discount = true, false, nil, 0
	return true
}

func (m *seqModel) expire(now int64, age time.Duration) int {
	if age <= 0 {
		age = DefaultBookingMaxAge
	}
	cutoff := now - int64(age)
	if !m.swept || now > m.clock {
		m.swept, m.clock = true, now
	}
	n := 0
	for id, q := range m.reqs {
		if q.CreatedAt < cutoff {
			if !q.freed {
				n++
			}
			delete(m.reqs, id)
		}
	}
	return n
}

func (m *seqModel) remove(match func(kvevent.Rank) bool) int {
	n := 0
	for id, q := range m.reqs {
		if !q.freed && match(q.Rank) {
			m.free(id)
			n++
		}
	}
	return n
}

// loads recomputes every rank's load and block set from scratch: a block
// counts 1 - d/DecayScale when one booking alone holds it (once), d that
// booking's discount, and 1 otherwise; the sum is rounded half up.
func (m *seqModel) loads() (map[kvevent.Rank]Load, map[kvevent.Rank]map[uint64]bool) {
	loads := map[kvevent.Rank]Load{}
	held := map[kvevent.Rank]map[uint64]bool{}
	type key struct {
		r kvevent.Rank
		h uint64
	}
	count := map[key]int{}
	holder := map[key]*seqModelReq{}
	for _, q := range m.reqs {
		if q.freed {
			continue
		}
		l := loads[q.Rank]
		l.ActiveRequests++
		if !q.PrefillDone {
			l.ActivePrefillTokens += int64(max(q.ISL-q.CachedTokens, 0))
		}
		if held[q.Rank] == nil {
			held[q.Rank] = map[uint64]bool{}
		}
		for _, h := range q.SeqHashes {
			held[q.Rank][h] = true
			count[key{q.Rank, h}]++
			holder[key{q.Rank, h}] = q
		}
		loads[q.Rank] = l
	}
	for r, set := range held {
		ppm := int64(0)
		for h := range set {
			ppm += DecayScale
			if count[key{r, h}] == 1 {
				ppm -= int64(holder[key{r, h}].Discount)
			}
		}
		l := loads[r]
		l.ActiveDecodeBlocks = (ppm + DecayScale/2) / DecayScale
		loads[r] = l
	}
	return loads, held
}

// potential is the definition: for every rank with a live booking, the
// decode blocks it holds once the query is booked on it too (what
// PotentialDecodeBlocks promises), read off a copy of the model with the
// query booked; and |set(query)| for any other.
func (m *seqModel) potential(query []uint64) ([]RankLoad, int64) {
	loads, _ := m.loads()
	qset := map[uint64]bool{}
	for _, h := range query {
		qset[h] = true
	}
	var out []RankLoad
	for r, l := range loads {
		booked := &seqModel{reqs: maps.Clone(m.reqs)}
		booked.reqs["\x00query"] = &seqModelReq{Booking: Booking{ID: "\x00query", Rank: r, SeqHashes: query}}
		after, _ := booked.loads()
		out = append(out, RankLoad{Rank: r, Load: l, PotentialDecodeBlocks: after[r].ActiveDecodeBlocks})
	}
	slices.SortFunc(out, func(a, b RankLoad) int { return a.Rank.Compare(b.Rank) })
	return out, int64(len(qset))
}

func (m *seqModel) snapshot() SequencesSnapshot {
	snap := SequencesSnapshot{Bookings: []Booking{}, Freed: []FreedBooking{}, Swept: m.swept, Clock: m.clock}
	for _, q := range m.reqs {
		if q.freed {
			snap.Freed = append(snap.Freed, FreedBooking{ID: q.ID, CreatedAt: q.CreatedAt})
		} else {
			b := q.Booking
			b.SeqHashes = slices.Clone(b.SeqHashes)
			if b.SeqHashes == nil {
				b.SeqHashes = []uint64{}
			}
			snap.Bookings = append(snap.Bookings, b)
		}
	}
	slices.SortFunc(snap.Bookings, func(a, b Booking) int { return cmp.Compare(a.ID, b.ID) })
	slices.SortFunc(snap.Freed, func(a, b FreedBooking) int { return cmp.Compare(a.ID, b.ID) })
	return snap
}

// normaliseSnap makes nil and empty hash slices compare equal.
func normaliseSnap(snap SequencesSnapshot) SequencesSnapshot {
	for i := range snap.Bookings {
		if snap.Bookings[i].SeqHashes == nil {
			snap.Bookings[i].SeqHashes = []uint64{}
		}
	}
	if snap.Bookings == nil {
		snap.Bookings = []Booking{}
	}
	if snap.Freed == nil {
		snap.Freed = []FreedBooking{}
	}
	if !snap.Swept {
		snap.Clock = 0
	}
	return snap
}

// rebuildSeqs builds a Sequences with the same logical state as snap by
// operations only, in reverse id order, so that its digest can be compared
// with one built by another history.
func rebuildSeqs(t *rapid.T, snap SequencesSnapshot) *Sequences {
	s := NewSequences()
	for i := len(snap.Freed) - 1; i >= 0; i-- {
		f := snap.Freed[i]
		if ok, err := s.Add(f.ID, wkC0, []uint64{42}, 1, 0, f.CreatedAt); !ok || err != nil {
			t.Fatalf("rebuildSeqs add %q: %v %v", f.ID, ok, err)
		}
		s.Free(f.ID)
	}
	for i := len(snap.Bookings) - 1; i >= 0; i-- {
		b := snap.Bookings[i]
		if ok, err := s.Add(b.ID, b.Rank, b.SeqHashes, b.ISL, b.CachedTokens, b.CreatedAt); !ok || err != nil {
			t.Fatalf("rebuildSeqs add %q: %v %v", b.ID, ok, err)
		}
		if b.PrefillDone {
			s.PrefillDone(b.ID)
		}
		if b.Discount != 0 {
			s.SetDecay(b.ID, DecayScale-b.Discount)
		}
	}
	if snap.Swept {
		// A sweep at the clock whose cutoff is the oldest entry's creation
		// time, so that it sweeps nothing.
		oldest := snap.Clock - 1
		for _, b := range snap.Bookings {
			oldest = min(oldest, b.CreatedAt)
		}
		for _, f := range snap.Freed {
			oldest = min(oldest, f.CreatedAt)
		}
		s.Expire(snap.Clock, time.Duration(snap.Clock-oldest))
	}
	return s
}

var (
	seqModelRanks = []kvevent.Rank{wkA0, wkA1, wkB0, wkC0}
	seqModelIDs   = []string{"q0", "q1", "q2", "q3", "q4", "q5", "q6", "q7", "q8"}
)

// genSeqHashes draws sequence hashes from a small domain, so that requests share
// blocks and sometimes repeat one.
func genSeqHashes() *rapid.Generator[[]uint64] {
	return rapid.SliceOfN(rapid.Uint64Range(0, 12), 0, 8)
}

// loadPropertyRounds is how many times each property test runs rapid.Check
// (each with a fresh seed): once in CI, many times under make test-long.
func loadPropertyRounds() int {
	if os.Getenv("KVROUTER_LONG") != "" {
		return 50
	}
	return 1
}

func TestSequencesMatchNaiveModel(t *testing.T) {
	for range loadPropertyRounds() {
		checkSequencesMatchNaiveModel(t)
	}
}

func checkSequencesMatchNaiveModel(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s, m := NewSequences(), newSeqModel()
		clock := int64(0)
		type addArgs struct {
			id          string
			r           kvevent.Rank
			seq         []uint64
			isl, cached int
			now         int64
		}
		var history []addArgs
		var sc PotentialScratch // reused across checks, as slots come and go
		doAdd := func(t *rapid.T, a addArgs) {
			got, err := s.Add(a.id, a.r, a.seq, a.isl, a.cached, a.now)
			want, valid := m.add(a.id, a.r, a.seq, a.isl, a.cached, a.now)
			if valid != (err == nil) || got != want {
				t.Fatalf("Add(%q, now=%d) = %v, %v; model %v (valid %v)", a.id, a.now, got, err, want, valid)
			}
			history = append(history, a)
		}
		add := func(t *rapid.T) {
			clock += rapid.Int64Range(0, 60).Draw(t, "dt") * nsPerSec
			doAdd(t, addArgs{
				id:     rapid.SampledFrom(seqModelIDs).Draw(t, "id"),
				r:      rapid.SampledFrom(seqModelRanks).Draw(t, "rank"),
				seq:    genSeqHashes().Draw(t, "seq"),
				isl:    rapid.IntRange(-2, 200).Draw(t, "isl"),
				cached: rapid.IntRange(-2, 200).Draw(t, "cached"),
				now:    clock - rapid.Int64Range(0, 30).Draw(t, "lag")*nsPerSec,
			})
		}
		setDecay := func(t *rapid.T) {
			id := rapid.SampledFrom(seqModelIDs).Draw(t, "id")
			// Weights on a coarse grid (so that a repeat happens) and
			// beyond the scale (which counts as the scale).
			w := uint32(rapid.IntRange(0, 5).Draw(t, "weight")) * DecayScale / 4
			if got, want := s.SetDecay(id, w), m.setDecay(id, w); got != want {
				t.Fatalf("SetDecay(%q, %d) = %v, model %v", id, w, got, want)
			}
		}
		actions := map[string]func(*rapid.T){
			// Adds weigh three times the other actions, so that states grow
			// enough for blocks to gather several holders.
			"add": add, "add2": add, "add3": add,
			"retryAdd": func(t *rapid.T) {
				if len(history) == 0 {
					return
				}
				doAdd(t, rapid.SampledFrom(history).Draw(t, "retry"))
			},
			"prefillDone": func(t *rapid.T) {
				id := rapid.SampledFrom(seqModelIDs).Draw(t, "id")
				if got, want := s.PrefillDone(id), m.prefillDone(id); got != want {
					t.Fatalf("PrefillDone(%q) = %v, model %v", id, got, want)
				}
			},
			"outputBlock": func(t *rapid.T) {
				id := rapid.SampledFrom(seqModelIDs).Draw(t, "id")
				h := rapid.Uint64Range(0, 14).Draw(t, "hash")
				if got, want := s.AddOutputBlock(id, h), m.outputBlock(id, h); got != want {
					t.Fatalf("AddOutputBlock(%q, %d) = %v, model %v", id, h, got, want)
				}
				b, ok := s.Get(id)
				q, live := m.reqs[id]
				live = live && !q.freed
				if ok != live || (ok && !slices.Equal(b.SeqHashes, q.SeqHashes)) {
					t.Fatalf("Get(%q) = %+v %v, model %+v live %v", id, b, ok, q, live)
				}
			},
			"setDecay": setDecay, "setDecay2": setDecay,
			"free": func(t *rapid.T) {
				id := rapid.SampledFrom(seqModelIDs).Draw(t, "id")
				if got, want := s.Free(id), m.free(id); got != want {
					t.Fatalf("Free(%q) = %v, model %v", id, got, want)
				}
			},
			"expire": func(t *rapid.T) {
				clock += rapid.Int64Range(0, 120).Draw(t, "dt") * nsPerSec
				now := clock - rapid.Int64Range(0, 60).Draw(t, "skew")*nsPerSec
				age := time.Duration(rapid.Int64Range(-1, 200).Draw(t, "age")) * time.Second
				if got, want := s.Expire(now, age), m.expire(now, age); got != want {
					t.Fatalf("Expire(%d, %v) = %d, model %d", now, age, got, want)
				}
			},
			"removeRank": func(t *rapid.T) {
				r := rapid.SampledFrom(seqModelRanks).Draw(t, "rank")
				if got, want := s.RemoveRank(r), m.remove(func(x kvevent.Rank) bool { return x == r }); got != want {
					t.Fatalf("RemoveRank(%v) = %d, model %d", r, got, want)
				}
			},
			"removeWorker": func(t *rapid.T) {
				w := rapid.SampledFrom(seqModelRanks).Draw(t, "rank").Worker
				if got, want := s.RemoveWorker(w), m.remove(func(x kvevent.Rank) bool { return x.Worker == w }); got != want {
					t.Fatalf("RemoveWorker(%d) = %d, model %d", w, got, want)
				}
			},
			"": func(t *rapid.T) {
				if err := s.st.check(); err != nil {
					t.Fatal(err)
				}
				wantLoads, _ := m.loads()
				for _, r := range seqModelRanks {
					if got := s.Load(r); got != wantLoads[r] {
						t.Fatalf("Load(%v) = %+v, model %+v", r, got, wantLoads[r])
					}
				}
				q := genSeqHashes().Draw(t, "query")
				got, idle := s.PotentialDecodeBlocks(nil, q, &sc)
				want, wantIdle := m.potential(q)
				if !reflect.DeepEqual(got, want) || idle != wantIdle {
					t.Fatalf("PotentialDecodeBlocks(%v) = %+v idle %d, model %+v idle %d", q, got, idle, want, wantIdle)
				}

				for _, id := range seqModelIDs {
					q, ok := m.reqs[id]
					if want := ok && q.freed; s.Freed(id) != want {
						t.Fatalf("Freed(%q) = %v, model %v", id, !want, want)
					}
				}
				snap := normaliseSnap(s.Snapshot())
				if want := m.snapshot(); !reflect.DeepEqual(snap, want) {
					t.Fatalf("Snapshot = %+v, model %+v", snap, want)
				}
				if !reflect.DeepEqual(normaliseSnap(SequencesSnapshot{Bookings: s.Bookings()}).Bookings, snap.Bookings) {
					t.Fatal("Bookings differs from Snapshot().Bookings")
				}
				restored := NewSequences()
				if err := restored.Restore(s.Snapshot()); err != nil {
					t.Fatalf("Restore: %v", err)
				}
				if err := restored.st.check(); err != nil {
					t.Fatalf("after restore: %v", err)
				}
				if !reflect.DeepEqual(normaliseSnap(restored.Snapshot()), snap) || restored.Digest() != s.Digest() {
					t.Fatal("Snapshot → Restore round trip changed the state")
				}
				if rebuilt := rebuildSeqs(t, snap); rebuilt.Digest() != s.Digest() {
					t.Fatal("the same state built by another history has another digest")
				}
			},
		}
		// An explicit loop rather than t.Repeat: histories run up to 150
		// steps (Repeat averages 30), long enough for a block to gather
		// three or four holders and lose one from the middle of its list.
		names := make([]string, 0, len(actions))
		for name := range actions {
			if name != "" {
				names = append(names, name)
			}
		}
		slices.Sort(names)
		for range rapid.SampledFrom([]int{5, 20, 60, 150}).Draw(t, "steps") {
			actions[rapid.SampledFrom(names).Draw(t, "action")](t)
			actions[""](t)
		}
	})
}

// TestDigestChangesExactlyWhenStateChanges runs random operations and
// checks that the digest moves exactly when the model's logical state does.
func TestDigestChangesExactlyWhenStateChanges(t *testing.T) {
	for range loadPropertyRounds() {
		checkDigestChangesExactlyWhenStateChanges(t)
	}
}

func checkDigestChangesExactlyWhenStateChanges(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		s := NewSequences()
		prevSnap, prevDigest := normaliseSnap(s.Snapshot()), s.Digest()
		for range rapid.IntRange(1, 40).Draw(t, "steps") {
			id := rapid.SampledFrom(seqModelIDs[:4]).Draw(t, "id")
			switch rapid.IntRange(0, 4).Draw(t, "op") {
			case 0:
				_, _ = s.Add(id, rapid.SampledFrom(seqModelRanks).Draw(t, "rank"), genSeqHashes().Draw(t, "seq"), 16, 0, rapid.Int64Range(0, 5).Draw(t, "now"))
			case 1:
				s.PrefillDone(id)
			case 2:
				s.Free(id)
			case 3:
				s.Expire(rapid.Int64Range(0, 8).Draw(t, "now"), 2)
			case 4:
				s.SetDecay(id, uint32(rapid.IntRange(0, 4).Draw(t, "weight"))*DecayScale/4)
			}
			snap, d := normaliseSnap(s.Snapshot()), s.Digest()
			if changed := !reflect.DeepEqual(snap, prevSnap); changed != (d != prevDigest) {
				t.Fatalf("state changed %v but digest changed %v", changed, d != prevDigest)
			}
			prevSnap, prevDigest = snap, d
		}
	})
}

// TestDecayDiscountsOnlyBlocksHeldAlone follows one block from shared to
// held alone and back: a decaying request's discount applies to the blocks
// only it holds, whatever the order of the other requests' bookings.
func TestDecayDiscountsOnlyBlocksHeldAlone(t *testing.T) {
	s := NewSequences()
	decode := func() int64 { return s.Load(wkA0).ActiveDecodeBlocks }
	mustBook(t, s, "r1", wkA0, []uint64{1, 2, 3, 4}, 64, 0, 0)
	mustBook(t, s, "r2", wkA0, []uint64{1, 2}, 32, 0, 0)
	// r1 alone holds 3 and 4: at weight 1/4 they count 0.5 together.
	if !s.SetDecay("r1", DecayScale/4) {
		t.Fatal("SetDecay changed nothing")
	}
	if got := decode(); got != 3 { // 1 + 1 + 0.25 + 0.25 = 2.5, rounded half up
		t.Fatalf("decode blocks = %d, want 3", got)
	}
	if s.SetDecay("r1", DecayScale/4) {
		t.Fatal("repeating a weight reported a change")
	}
	// r2 goes: 1 and 2 are r1's alone now and take its discount.
	s.Free("r2")
	if got := decode(); got != 1 {
		t.Fatalf("after r2 left, decode blocks = %d, want 1 (4 × 0.25)", got)
	}
	// r3 shares 1 again: it counts whole.
	mustBook(t, s, "r3", wkA0, []uint64{1}, 16, 0, 0)
	if got := decode(); got != 2 { // 1 + 3 × 0.25 = 1.75
		t.Fatalf("after r3 shared block 1, decode blocks = %d, want 2", got)
	}
	// An output block of r1 is r1's alone from the start.
	s.AddOutputBlock("r1", 9)
	if got, want := s.Load(wkA0).ActiveDecodeBlocks, int64(2); got != want { // 1 + 4 × 0.25
		t.Fatalf("after an output block, decode blocks = %d, want %d", got, want)
	}
	if b, _ := s.Get("r1"); b.Discount != DecayScale*3/4 {
		t.Fatalf("r1 discount = %d, want %d", b.Discount, DecayScale*3/4)
	}
	// Weight 0: r1's own blocks count nothing; back to whole: all count.
	s.SetDecay("r1", 0)
	if got := decode(); got != 1 {
		t.Fatalf("at weight 0, decode blocks = %d, want 1 (the shared block)", got)
	}
	s.SetDecay("r1", DecayScale+5) // above the scale counts as whole
	if got := decode(); got != 5 {
		t.Fatalf("back to whole, decode blocks = %d, want 5", got)
	}
	if err := s.st.check(); err != nil {
		t.Fatal(err)
	}
}

// TestPotentialDecodeBlocksOfADecayingRankIsWhatBookingTheRequestMakes:
// a request sharing blocks that one decaying request alone holds makes
// them shared, so once booked they count whole; the potential decode
// blocks ("the decode blocks it would hold if it also took the queried
// request") must count them whole too, not take a whole block off a load
// that counted each at its weight.
func TestPotentialDecodeBlocksOfADecayingRankIsWhatBookingTheRequestMakes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		weight uint32
		query  []uint64
	}{
		{"weight 0, the same blocks", 0, []uint64{1, 2, 3, 4}},
		{"weight 1/4, two of its blocks and a new one", DecayScale / 4, []uint64{3, 4, 9}},
		{"weight 3/4, one of its blocks twice", DecayScale * 3 / 4, []uint64{2, 2}},
		{"whole, the same blocks", DecayScale, []uint64{1, 2, 3, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSequences()
			mustBook(t, s, "r1", wkA0, []uint64{1, 2, 3, 4}, 64, 0, 0)
			s.SetDecay("r1", tc.weight)
			got, _ := potentialByRank(s, tc.query)
			mustBook(t, s, "r2", wkA0, tc.query, 64, 0, 0)
			if want := s.Load(wkA0).ActiveDecodeBlocks; got[wkA0] != want {
				t.Fatalf("potential decode blocks %d, but booking the request makes the rank's decode blocks %d", got[wkA0], want)
			}
		})
	}
}
