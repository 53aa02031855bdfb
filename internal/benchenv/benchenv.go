// Package benchenv gates and configures the benchmark tests: they run only
// under KVROUTER_BENCH=1 (make bench-*), take their sizes from the
// environment, and log their seed so a run can be repeated.
package benchenv

import (
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// Skip skips t unless KVROUTER_BENCH is set; target names the make target.
func Skip(t testing.TB, target string) {
	t.Helper()
	if os.Getenv("KVROUTER_BENCH") == "" {
		t.Skip("set KVROUTER_BENCH=1 (make " + target + ")")
	}
}

// Int returns the positive integer in environment variable name, or def.
func Int(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// Seed returns KVROUTER_BENCH_SEED when set, else def, and logs it.
func Seed(t testing.TB, def uint64) uint64 {
	t.Helper()
	seed := def
	if v, err := strconv.ParseUint(os.Getenv("KVROUTER_BENCH_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d", seed)
	return seed
}

// ChildEnv is the environment for a kvrouter, kvctl or kvagent process a
// benchmark or an end-to-end test starts: this process's, less every
// KVROUTER_*, KVCTL_* and KVAGENT_* variable. Those binaries' flags read
// them, so an inherited variable (the shell's KVROUTER_ELECTION_TIMEOUT)
// would change a setting that the test reports as the one it passed.
func ChildEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "KVROUTER_") || strings.HasPrefix(kv, "KVCTL_") || strings.HasPrefix(kv, "KVAGENT_") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

// ABBA runs a and b reps times each, in the order A B B A A B B A …, and
// returns each side's results in its own run order. Measured one after the
// other, the second side always runs with the first's garbage and live
// data on the heap (a 2M-entry index is a lot for the collector to scan)
// and the first always into a cleaner one; that order alone moved the
// indexer's apply ratio by 1.3–2x. Alternating gives both sides each
// position equally often. Each side drops what the other built and calls
// Settle just before its clock starts.
func ABBA(reps int, a, b func() float64) (as, bs []float64) {
	for i := 0; i < 2*reps; i++ {
		// Pairs AB, BA, AB, …: position i runs A when i%4 is 0 or 3.
		if m := i % 4; m == 0 || m == 3 {
			as = append(as, a())
		} else {
			bs = append(bs, b())
		}
	}
	return as, bs
}

// Settle collects garbage twice (the second collection frees what the
// first's finalizers released), so that a timing that starts next does not
// pay for collecting what the run before it left.
func Settle() {
	runtime.GC()
	runtime.GC()
}

// Best is the largest of xs (the best rate: noise on a shared machine only
// ever slows a run down), 0 for none.
func Best(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return slices.Max(xs)
}

// Median is the median of xs (the mean of the two middle ones for an even
// count), 0 for none; xs is left as it was.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// UpperBound returns ceiling, or ref when ref is larger, and whether it
// took ref. A ceiling is a rate that does less work than the figure it
// bounds (or than ref, a reference doing strictly more work); measured
// below ref, it was slowed by the machine, and a ratio against it would
// overstate the figure.
func UpperBound(ceiling, ref float64) (float64, bool) {
	if ref > ceiling {
		return ref, true
	}
	return ceiling, false
}
