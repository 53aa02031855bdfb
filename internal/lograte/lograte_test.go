package lograte

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// clock is a Limiter's clock the test moves.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) read() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func newLimiter() (*Limiter, *clock) {
	c := &clock{now: time.Unix(1_700_000_000, 0)}
	return New(time.Minute, c.read), c
}

// TestOneLinePerKindPerInterval: of a kind's lines, the first is logged,
// the rest of its interval counted, and the first after the interval
// logged with the count; another kind is not held back by the first.
func TestOneLinePerKindPerInterval(t *testing.T) {
	l, c := newLimiter()
	if ok, n := l.Allow("a"); !ok || n != 0 {
		t.Fatalf("first line of a: %v, %d skipped; want logged, 0", ok, n)
	}
	for i := range 99 {
		c.add(100 * time.Millisecond)
		if ok, _ := l.Allow("a"); ok {
			t.Fatalf("line %d of a, %v after the first: logged, want counted", i+2, time.Duration(i+1)*100*time.Millisecond)
		}
	}
	if ok, n := l.Allow("b"); !ok || n != 0 {
		t.Fatalf("first line of b while a is held back: %v, %d; want logged, 0", ok, n)
	}
	c.add(time.Minute)
	if ok, n := l.Allow("a"); !ok || n != 99 {
		t.Fatalf("a line of a an interval later: %v, %d skipped; want logged, 99", ok, n)
	}
	if ok, _ := l.Allow("a"); ok {
		t.Fatal("the line right after: logged, want counted (a new interval began)")
	}
	c.add(time.Minute)
	if ok, n := l.Allow("a"); !ok || n != 1 {
		t.Fatalf("after the second interval: %v, %d; want logged, 1", ok, n)
	}
}

// TestKindsAreBounded: an outsider who makes every line a new kind grows
// the limiter to maxKinds and no further, and the lines past it share one
// kind, logged once per interval; kinds quiet for an interval make room.
func TestKindsAreBounded(t *testing.T) {
	l, c := newLimiter()
	logged := 0
	for i := range 10 * maxKinds {
		if ok, _ := l.Allow(fmt.Sprintf("line %d", i)); ok {
			logged++
		}
	}
	if len(l.kinds) > maxKinds+1 {
		t.Fatalf("%d kinds kept after %d distinct lines, want at most %d", len(l.kinds), 10*maxKinds, maxKinds+1)
	}
	if logged != maxKinds+1 {
		t.Fatalf("%d of %d distinct lines logged in one interval, want %d (each kept kind's first, then one overflow line)",
			logged, 10*maxKinds, maxKinds+1)
	}
	c.add(time.Minute)
	if ok, _ := l.Allow("new after a quiet interval"); !ok {
		t.Fatal("a new kind after an interval in which the kept ones were quiet: counted, want logged (the quiet kinds make room)")
	}
}

// TestCheckSaysALineOverflowed: a line held back in the overflow kind is
// said to be, for its caller to log it at Debug rather than drop it; a
// line of a kept kind is not.
func TestCheckSaysALineOverflowed(t *testing.T) {
	l, _ := newLimiter()
	for i := range maxKinds {
		if _, _, over := l.Check(fmt.Sprintf("line %d", i)); over {
			t.Fatalf("line %d, of a kind kept: overflowed, want not", i)
		}
	}
	if ok, _, over := l.Check("the first past maxKinds"); !ok || !over {
		t.Fatalf("the first line past maxKinds: logged %v, overflowed %v; want logged, overflowed", ok, over)
	}
	if ok, _, over := l.Check("a fault's first line"); ok || !over {
		t.Fatalf("the next new kind: logged %v, overflowed %v; want held back, overflowed (for Debug)", ok, over)
	}
	if ok, _, over := l.Check("line 3"); ok || over {
		t.Fatalf("a kept kind's second line: logged %v, overflowed %v; want held back, not overflowed", ok, over)
	}
}

func TestKindTakesOutNumbers(t *testing.T) {
	a := Kind("Error trying to connect to route (attempt 5): dial tcp 127.0.0.1:4001: connection refused")
	b := Kind("Error trying to connect to route (attempt 12): dial tcp 127.0.0.1:5002: connection refused")
	if a != b {
		t.Fatalf("Kind of two lines differing only in numbers:\n%q\n%q\nwant equal", a, b)
	}
	if Kind("no numbers") != "no numbers" {
		t.Fatalf("Kind(%q) = %q, want it unchanged", "no numbers", Kind("no numbers"))
	}
}

func TestConcurrentUse(t *testing.T) {
	l, _ := newLimiter()
	var wg sync.WaitGroup
	var mu sync.Mutex
	logged := 0
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				if ok, _ := l.Allow("k"); ok {
					mu.Lock()
					logged++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if logged != 1 {
		t.Fatalf("8 goroutines x 1000 lines of one kind in one interval: %d logged, want 1", logged)
	}
}

// TestLeftOutSaysHowMany: a line logged after others of its kind were
// left out says how many; the first of its kind says nothing.
func TestLeftOutSaysHowMany(t *testing.T) {
	if a := LeftOut(0, time.Minute); a != nil {
		t.Fatalf("none left out: %v, want no attribute", a)
	}
	a := LeftOut(41, time.Minute)
	if len(a) != 2 || a[0] != "left_out" || a[1] != "41 more like it since the last one logged (at most one per 1m0s)" {
		t.Fatalf("41 left out: %v", a)
	}
}
