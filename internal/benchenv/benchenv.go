// Package benchenv gates and configures the benchmark tests: they run only
// under KVROUTER_BENCH=1 (make bench-*), take their sizes from the
// environment, and log their seed so a run can be repeated.
package benchenv

import (
	"os"
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
