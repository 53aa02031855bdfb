package testclock

import (
	"testing"
	"time"
)

// TestWallSteppedMovesTheWallReadingAlone: a stepped reading's wall time
// is d away, in either direction, while the monotonic clock sees no time
// between the two readings (Sub compares monotonic readings when both
// carry one), and a comparison by wall time alone (Round(0)) sees the step.
func TestWallSteppedMovesTheWallReadingAlone(t *testing.T) {
	now := time.Now()
	for _, d := range []time.Duration{-time.Hour, time.Second, 24 * time.Hour} {
		s := WallStepped(t, now, d)
		if got := s.Round(0).Sub(now.Round(0)); got != d {
			t.Errorf("step %v: wall readings %v apart, want %v", d, got, d)
		}
		if got := s.Sub(now); got != 0 {
			t.Errorf("step %v: monotonic readings %v apart, want 0", d, got)
		}
	}
}
