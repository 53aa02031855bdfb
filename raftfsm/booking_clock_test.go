package raftfsm

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/store"
)

// sweepAhead applies the expiry sweep that a leader whose clock ran ahead
// by skew would have proposed, and returns its stamp.
func sweepAhead(t *testing.T, n *Node, skew time.Duration) int64 {
	t.Helper()
	ahead := time.Now().Add(skew).UnixNano()
	if _, err := n.apply(ctx(t), encodeExpire(ahead, int64(5*time.Minute))); err != nil {
		t.Fatal(err)
	}
	return ahead
}

// TestRouteBooksFreshIDAfterSweepFromClockAhead: a leader whose clock ran
// ahead (by more than the bookings' max age) swept, then leadership went
// to a node with a correct clock. A route booking a request id never used
// still books it (stamped at the sweep's time, so it expires as usual
// later), where it answered booked:false, without an error, as for an id
// freed before.
func TestRouteBooksFreshIDAfterSweepFromClockAhead(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	ahead := sweepAhead(t, n, 10*time.Minute)
	res, err := n.Route(ctx(t), RouteQuery{ISL: 8, Book: true, RequestID: "fresh-id-never-used"})
	if err != nil {
		t.Fatalf("route: %v", err)
	}
	live, freed := n.fsm.Sequences().Count()
	if !res.Booked {
		t.Fatalf("a fresh request id was not booked (tracker live=%d freed=%d)", live, freed)
	}
	b, ok := n.fsm.Sequences().Get("fresh-id-never-used")
	if !ok || b.CreatedAt != ahead {
		t.Fatalf("booking %+v (live %v): want it stamped at the sweep's time %d", b, ok, ahead)
	}
	// Freed, the id books nothing again while its tombstone stands.
	if err := n.Free(ctx(t), "fresh-id-never-used"); err != nil {
		t.Fatal(err)
	}
	res, err = n.Route(ctx(t), RouteQuery{ISL: 8, Book: true, RequestID: "fresh-id-never-used"})
	if err != nil || res.Booked {
		t.Fatalf("route of the freed id: booked %v, %v; want not booked, no error", res.Booked, err)
	}
}

// TestReserveFreshIDAfterSweepFromClockAhead: Reserve (the compatible
// API's POST /selection/reservations) of an id never used books it after a
// sweep from a clock ahead, and ErrBookingFreed (409 "already used and
// freed") is kept for an id that was.
func TestReserveFreshIDAfterSweepFromClockAhead(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	sweepAhead(t, n, 10*time.Minute)
	b := Booking{ID: "fresh", Rank: r1, SeqHashes: []uint64{1}, ISL: 8}
	if err := n.Reserve(ctx(t), b); err != nil {
		t.Fatalf("reserve of a fresh id after the sweep: %v", err)
	}
	if err := n.Free(ctx(t), "fresh"); err != nil {
		t.Fatal(err)
	}
	if err := n.Reserve(ctx(t), b); !errors.Is(err, ErrBookingFreed) {
		t.Fatalf("reserve of a freed id: %v, want ErrBookingFreed", err)
	}
}

// TestSweepClockSurvivesReopenAndSnapshot: the latest sweep's time, which
// a booking stamped before it is moved up to, is kept in the state
// database and in snapshots, so that a restarted or restored replica
// stamps the next such booking as the others do (and the digest, which
// covers it, agrees).
func TestSweepClockSurvivesReopenAndSnapshot(t *testing.T) {
	const sweep = int64(1_000 * time.Hour)
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	applyFixture(t, f, &w)
	f.ApplyBatch([]*raft.Log{w.next(encodeExpire(sweep, int64(5*time.Minute)))})
	if _, ok := f.Sequences().Get("q1"); ok {
		t.Fatal("the sweep left a booking older than the max age")
	}
	d := f.Digest()
	snap := snapshotBytes(t, f)
	f.Close()

	book := func(what string, f *FSM, w *logWriter) {
		t.Helper()
		f.ApplyBatch([]*raft.Log{w.next(encodeBook(7, []bookOp{{kind: bookAdd, b: Booking{ID: "late", Rank: r1, SeqHashes: []uint64{1}, ISL: 8}}}))})
		b, ok := f.Sequences().Get("late")
		if !ok || b.CreatedAt != sweep {
			t.Fatalf("%s: booking stamped 7 after a sweep at %d: %+v (live %v), want it stamped at the sweep", what, sweep, b, ok)
		}
	}
	g := openTestFSM(t, dir)
	if g.Digest() != d {
		t.Fatalf("reopened: digest %#x, want %#x", g.Digest(), d)
	}
	gw := w
	book("reopened", g, &gw)
	gd := g.Digest()
	g.Close()

	h := openTestFSM(t, filepath.Join(t.TempDir(), "restored"))
	defer h.Close()
	if err := h.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
		t.Fatal(err)
	}
	if h.Digest() != d {
		t.Fatalf("restored: digest %#x, want %#x", h.Digest(), d)
	}
	hw := w
	book("restored", h, &hw)
	if h.Digest() != gd {
		t.Fatal("the reopened and the restored replica diverged on the same entry")
	}
}

// TestOldHorizonRecordRestoresAsSweepClock: a state database or snapshot of
// an earlier build holds the expiry horizon (the latest sweep's time less
// its max age), not the sweep's time. It restores as the sweep clock, a
// lower bound of it, so a booking stamped below it is moved up to it; a
// sweep whose time is later sets the clock.
func TestOldHorizonRecordRestoresAsSweepClock(t *testing.T) {
	const horizon = int64(500 * time.Hour)
	var e enc
	e.sv(horizon)
	stream := buildStream(3, []rec{{k: []byte{store.KindLoadMeta, 'l'}, v: e.b}}, nil, map[byte]uint64{store.KindLoadMeta: 1})
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	if err := f.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatal(err)
	}
	var w logWriter
	w.index = 50 // past the stream's applied index, 42
	f.ApplyBatch([]*raft.Log{
		w.next(encodeRegister(1, &WorkerInfo{ID: 1, BlockSize: 16})),
		w.next(encodeBook(7, []bookOp{{kind: bookAdd, b: Booking{ID: "q", Rank: r1, ISL: 8}}})),
	})
	if b, ok := f.Sequences().Get("q"); !ok || b.CreatedAt != horizon {
		t.Fatalf("booking %+v (live %v), want it stamped at the old horizon %d", b, ok, horizon)
	}
}

// TestUpgradeAfterClockAheadSweepAgreesPastJumpPlusMaxAge pins what
// docs/operations.md (Upgrade, builds after c686b0a) says of a sweep by an
// older build's leader whose clock ran ahead by J (here 2 h, over the max
// age M): a node that applied it on the older build holds its horizon,
// tAhead-M, read as the sweeps' clock after the upgrade; a node that
// applied the same entry on this build holds tAhead. With every node on
// this build and the leaders' clocks right, the two disagree (digest, and
// a booking's stamp, hence the sweep that expires it) until the sweeps'
// time passes tAhead+M, about J+M after the upgrade, not M. From a review:
// the docs said up to the max age after the last node is upgraded.
func TestUpgradeAfterClockAheadSweepAgreesPastJumpPlusMaxAge(t *testing.T) {
	const M = int64(5 * time.Minute)
	const real0 = int64(1_000 * time.Hour) // the right clock at the upgrade
	tAhead := real0 + int64(2*time.Hour)
	// a: the older build's state, the horizon under 'l'.
	var e enc
	e.sv(tAhead - M)
	stream := buildStream(3, []rec{{k: []byte{store.KindLoadMeta, 'l'}, v: e.b}}, nil, map[byte]uint64{store.KindLoadMeta: 1})
	a := openTestFSM(t, filepath.Join(t.TempDir(), "a"))
	defer a.Close()
	if err := a.Restore(nopCloser{bytes.NewReader(stream)}); err != nil {
		t.Fatal(err)
	}
	// b: applies the same sweep entry on this build (it caught up after
	// its own upgrade).
	b := openTestFSM(t, filepath.Join(t.TempDir(), "b"))
	defer b.Close()
	bw := logWriter{index: 41}
	b.ApplyBatch([]*raft.Log{bw.next(encodeExpire(tAhead, M))})

	// From here both apply the same entries.
	w := logWriter{index: 50}
	apply := func(data []byte) {
		la := w.next(data)
		lb := *la
		a.ApplyBatch([]*raft.Log{la})
		b.ApplyBatch([]*raft.Log{&lb})
	}
	apply(encodeRegister(real0, &WorkerInfo{ID: 1, BlockSize: 16}))
	apply(encodeBook(real0, []bookOp{{kind: bookAdd, b: Booking{ID: "x", Rank: r1, ISL: 8}}}))
	xa, _ := a.Sequences().Get("x")
	xb, _ := b.Sequences().Get("x")
	if xa.CreatedAt != tAhead-M || xb.CreatedAt != tAhead {
		t.Fatalf("x stamped at %d and %d, want the two clocks %d and %d", xa.CreatedAt, xb.CreatedAt, tAhead-M, tAhead)
	}
	// An hour after the upgrade (12 max ages) and just before tAhead the
	// sweeps' clocks still differ, and so do the digests.
	apply(encodeExpire(real0+int64(time.Hour), M))
	apply(encodeExpire(tAhead-1, M))
	if a.Digest() == b.Digest() {
		t.Errorf("digests equal before a sweep passed tAhead: %#x", a.Digest())
	}
	// Past tAhead the clocks agree, not the booking stamped at them: a
	// expires it at a sweep past tAhead, b only past tAhead+M.
	apply(encodeExpire(tAhead+M/2, M))
	_, liveA := a.Sequences().Get("x")
	_, liveB := b.Sequences().Get("x")
	if liveA || !liveB || a.Digest() == b.Digest() {
		t.Errorf("sweep at tAhead+M/2: x live on a %v, on b %v (want false, true); digests %#x %#x", liveA, liveB, a.Digest(), b.Digest())
	}
	// Past tAhead+M they agree.
	apply(encodeExpire(tAhead+M+1, M))
	_, liveB = b.Sequences().Get("x")
	if liveB || a.Digest() != b.Digest() {
		t.Errorf("sweep past tAhead+M: x live on b %v; digests %#x %#x, want them equal", liveB, a.Digest(), b.Digest())
	}
}

// TestFreedIDBooksAgainAfterMaxAge: a freed request id books nothing while
// its tombstone stands, and once the sweep has passed the max age of its
// booking it is forgotten and books again (what docs/api.md says; it said
// a freed id never books again).
func TestFreedIDBooksAgainAfterMaxAge(t *testing.T) {
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.BookingMaxAge = 200 * time.Millisecond
		cfg.ExpiryInterval = 50 * time.Millisecond
	})
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	q := RouteQuery{ISL: 8, Book: true, RequestID: "r1"}
	before := time.Now() // at or before the booking's stamp
	if res, err := n.Route(ctx(t), q); err != nil || !res.Booked {
		t.Fatalf("first route: booked %v, %v", res.Booked, err)
	}
	if err := n.Free(ctx(t), "r1"); err != nil {
		t.Fatal(err)
	}
	res, err := n.Route(ctx(t), q)
	if err != nil {
		t.Fatalf("route of the freed id: %v", err)
	}
	// Within the max age of the booking no sweep can have removed the
	// tombstone (a sweep is stamped no later than it is proposed); a
	// slow machine may be past it, and then the answer may be either.
	if time.Since(before) < 200*time.Millisecond && res.Booked {
		t.Fatal("a freed id whose tombstone stands was booked again")
	}
	if res.Booked {
		return // swept already: booked again, as checked below
	}
	waitFor(t, 10*time.Second, "the tombstone of r1 to be swept", func() bool { return !n.fsm.Sequences().Freed("r1") })
	res, err = n.Route(ctx(t), q)
	if err != nil || !res.Booked {
		t.Fatalf("route of r1 after its tombstone was swept: booked %v, %v; want booked", res.Booked, err)
	}
}

// TestTheLeadersSweepFreesABookingOnlyPastTheMaxAge: the leader's expiry
// sweep, run every few milliseconds here, leaves a live booking younger
// than BookingMaxAge and frees one older. It is judged by the sweeps' own
// stamps, not by the test's clock, so that a slow machine cannot fail it:
// in each consistent look at the tracker (its snapshot), a booking is
// live exactly while the latest sweep is stamped at most BookingMaxAge
// after it.
func TestTheLeadersSweepFreesABookingOnlyPastTheMaxAge(t *testing.T) {
	const maxAge = time.Second
	c := newTestCluster(t, 1, func(cfg *Config) {
		cfg.BookingMaxAge = maxAge
		cfg.ExpiryInterval = 10 * time.Millisecond
	})
	n := c.leader()
	if err := n.RegisterWorker(ctx(t), WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	created := map[string]int64{}
	book := func(id string) {
		t.Helper()
		if res, err := n.Route(ctx(t), RouteQuery{ISL: 8, Book: true, RequestID: id}); err != nil || !res.Booked {
			t.Fatalf("route of %s: booked %v, %v", id, res.Booked, err)
		}
		b, ok := n.fsm.Sequences().Get(id)
		if !ok {
			t.Fatalf("%s booked but not in the tracker", id)
		}
		created[id] = b.CreatedAt
	}
	// look checks the bookings against the latest sweep's stamp and
	// returns that stamp's age of each booking and which are live.
	look := func() (age map[string]time.Duration, live map[string]bool) {
		t.Helper()
		s := n.fsm.Sequences().Snapshot()
		age, live = map[string]time.Duration{}, map[string]bool{}
		for _, b := range s.Bookings {
			live[b.ID] = true
		}
		for id, at := range created {
			age[id] = time.Duration(s.Clock - at)
			if !s.Swept {
				age[id] = 0
			}
			switch {
			case !live[id] && age[id] <= maxAge:
				t.Fatalf("%s freed, the latest sweep stamped %v after its booking, within the max age %v", id, age[id], maxAge)
			case live[id] && age[id] > maxAge:
				t.Fatalf("%s live, the latest sweep stamped %v after its booking, past the max age %v", id, age[id], maxAge)
			}
		}
		return age, live
	}
	book("old")
	waitFor(t, 10*time.Second, "the sweeps to pass half the max age of old", func() bool {
		age, _ := look()
		return age["old"] > maxAge/2
	})
	book("young")
	waitFor(t, 10*time.Second, "old to be freed", func() bool {
		_, live := look()
		return !live["old"]
	})
	waitFor(t, 10*time.Second, "young to be freed", func() bool {
		_, live := look()
		return !live["young"]
	})
}
