// Package benchenv gates and configures the benchmark tests: they run only
// under KVROUTER_BENCH=1 (make bench-*), take their sizes from the
// environment, and log their seed so a run can be repeated.
package benchenv

import (
	"os"
	"strconv"
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
