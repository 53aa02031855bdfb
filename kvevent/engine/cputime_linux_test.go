package engine

import (
	"time"

	"golang.org/x/sys/unix"
)

// cpuNow returns the CPU time this process has used. The decode benchmark
// divides by it rather than by wall time, so that its block-events-per-
// second figure is per core and holds on a machine other work is sharing.
// It counts every thread, so the garbage collection the baseline causes is
// charged to the baseline.
func cpuNow() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_PROCESS_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}

const cpuClock = true
