package indexer

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"
)

// heldJournal is a SeqJournal whose first Booked call waits until release
// is closed (a flush caught part-way), recording every call in order.
type heldJournal struct {
	entered chan struct{} // closed at the first Booked call
	release chan struct{}
	calls   []string
}

func newHeldJournal() *heldJournal {
	return &heldJournal{entered: make(chan struct{}), release: make(chan struct{})}
}

func (j *heldJournal) Booked(b Booking) {
	j.calls = append(j.calls, "booked "+b.ID)
	if len(j.calls) == 1 {
		close(j.entered)
		<-j.release
	}
}
func (j *heldJournal) Freed(f FreedBooking) { j.calls = append(j.calls, "freed "+f.ID) }
func (j *heldJournal) Gone(id string)       { j.calls = append(j.calls, "gone "+id) }
func (j *heldJournal) Clock(int64)          {}

// waitFor fails the test if ch is not closed within a minute (a hang, not
// a timing: what it waits for takes microseconds).
func waitFor(t *testing.T, ch <-chan struct{}, what string) bool {
	t.Helper()
	select {
	case <-ch:
		return true
	case <-time.After(time.Minute):
		t.Errorf("timed out after a minute waiting for %s", what)
		return false
	}
}

// TestQueriesGoOnWhileTheJournalFlushes: a route's queries of the load
// tracker are answered while FlushJournal reports the bookings changed in
// the group (up to 16 MB of records, tens of milliseconds or more), not
// held behind it; the flush still reports each booking as it stands, and
// a mutation made after it is reported after it.
func TestQueriesGoOnWhileTheJournalFlushes(t *testing.T) {
	s := NewSequences()
	j := newHeldJournal()
	s.SetJournal(j)
	mustBook(t, s, "r1", wkA0, []uint64{1, 2, 3}, 48, 0, 0)
	mustBook(t, s, "r2", wkA0, []uint64{1, 2, 4}, 48, 0, 0)
	flushed := make(chan struct{})
	go func() {
		defer close(flushed)
		s.FlushJournal()
	}()
	defer func() {
		close(j.release)
		<-flushed
	}()
	if !waitFor(t, j.entered, "the flush to report its first booking") {
		return
	}
	answered := make(chan struct{})
	var load Load
	var ranks []RankLoad
	go func() {
		defer close(answered)
		load = s.Load(wkA0)
		ranks, _ = s.PotentialDecodeBlocks(nil, []uint64{1, 2, 5}, nil)
	}()
	if !waitFor(t, answered, "the queries of a route while the journal flushes (held behind the flush)") {
		return
	}
	if want := (Load{ActivePrefillTokens: 96, ActiveDecodeBlocks: 4, ActiveRequests: 2}); load != want || len(ranks) != 1 {
		t.Fatalf("during the flush: load %+v, ranks %+v; want %+v on one rank", load, ranks, want)
	}
	close(j.release)
	<-flushed
	j.release = make(chan struct{}) // for the deferred close
	s.Free("r2")
	s.FlushJournal()
	if want := []string{"booked r1", "booked r2", "freed r2"}; !slices.Equal(j.calls, want) {
		t.Fatalf("journal calls %q, want %q", j.calls, want)
	}
}

// TestDigestSettlesUnderTheReadLock: a Digest that must rehash the
// bookings changed by output blocks (tens of thousands of them take a
// tenth of a second or more) runs beside route queries, under the read
// lock: here one query holds it all along, and the Digest still ends.
func TestDigestSettlesUnderTheReadLock(t *testing.T) {
	s := NewSequences()
	mustBook(t, s, "r1", wkA0, []uint64{1, 2, 3}, 48, 0, 0)
	s.AddOutputBlock("r1", 4)
	want := NewSequences()
	mustBook(t, want, "r1", wkA0, []uint64{1, 2, 3, 4}, 48, 0, 0)
	s.mu.RLock() // a query in progress
	done := make(chan struct{})
	var got uint64
	go func() {
		defer close(done)
		got = s.Digest()
	}()
	ok := waitFor(t, done, "a Digest with a booking to settle while a query holds the read lock")
	s.mu.RUnlock()
	if !ok {
		<-done
		return
	}
	if w := want.Digest(); got != w {
		t.Fatalf("digest %016x after an output block, want %016x (the same booking added whole)", got, w)
	}
}

// countingJournal counts the calls it gets; not safe for concurrent use,
// so the race detector sees any two calls that overlap.
type countingJournal struct{ booked, freed, gone int }

func (j *countingJournal) Booked(Booking)     { j.booked++ }
func (j *countingJournal) Freed(FreedBooking) { j.freed++ }
func (j *countingJournal) Gone(string)        { j.gone++ }
func (j *countingJournal) Clock(int64)        {}

// TestFlushesAndDigestsBesideMutationsAreRaceFree: FlushJournal and Digest,
// which change state under the read lock, two goroutines each, beside
// the mutations and queries: run with -race, no two journal calls overlap
// and nothing they change is read unordered; the digest ends as a fresh
// tracker's of the same bookings.
func TestFlushesAndDigestsBesideMutationsAreRaceFree(t *testing.T) {
	s := NewSequences()
	j := &countingJournal{}
	s.SetJournal(j)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				switch g {
				case 0, 1:
					s.FlushJournal()
				case 2, 3:
					_ = s.Digest()
				default:
					_ = s.Load(wkA0)
					_, _ = s.Get("7")
				}
			}
		}()
	}
	for i := range 1000 {
		id := fmt.Sprint(i)
		mustBook(t, s, id, wkA0, []uint64{1, 2, uint64(i)}, 64, 0, int64(i))
		s.AddOutputBlock(id, uint64(1<<40+i))
		if i%2 == 0 {
			s.Free(fmt.Sprint(i / 2))
		}
	}
	close(stop)
	wg.Wait()
	s.FlushJournal()
	if j.booked < 500 || j.freed != 500 {
		t.Fatalf("journal told of %d bookings and %d frees, want at least 500 and 500", j.booked, j.freed)
	}
	if err := s.st.check(); err != nil {
		t.Fatal(err)
	}
}
