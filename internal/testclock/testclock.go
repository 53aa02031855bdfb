// Package testclock builds, for tests, the time.Time readings a process
// gets after its wall clock is stepped (an NTP correction, an operator's
// date -s): the wall reading moved, the monotonic one not.
package testclock

import (
	"testing"
	"time"
	"unsafe"
)

// WallStepped returns at as this process's clock reads it had the wall
// clock been stepped by d (whole seconds) before at was read: the same
// monotonic reading, a wall reading d away, which is what time.Now gives
// after a step. Go offers no way to build such a value, so it moves the
// seconds field of the wall word (time.Time's layout: wall, ext, loc;
// with a monotonic reading, the seconds since 1885 sit above the 30 bits
// of nanoseconds), and checks that it did just that: a Go release that
// changes the layout fails the check rather than the test passing on a
// value it did not mean. at must carry a monotonic reading (time.Now's).
func WallStepped(t testing.TB, at time.Time, d time.Duration) time.Time {
	t.Helper()
	if d%time.Second != 0 {
		t.Fatalf("WallStepped: step %v is not whole seconds", d)
	}
	p := (*struct {
		wall uint64
		ext  int64
		loc  *time.Location
	})(unsafe.Pointer(&at))
	orig := at
	if p.wall>>63 == 0 {
		t.Fatal("WallStepped: the time carries no monotonic reading")
	}
	p.wall += uint64(int64(d/time.Second) << 30)
	if !at.Round(0).Equal(orig.Round(0).Add(d)) || at.Sub(orig) != 0 {
		t.Fatalf("WallStepped: got wall %v (monotonic offset %v), want wall %v, same monotonic reading",
			at.Round(0), at.Sub(orig), orig.Round(0).Add(d))
	}
	return at
}
