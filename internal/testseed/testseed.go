// Package testseed gives tests a random seed they log, and that the
// environment variable KVROUTER_TEST_SEED replays: a failure's log line
// names the seed, and running the test again with it set draws the same
// values.
package testseed

import (
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
)

// Env is the variable that fixes the seed.
const Env = "KVROUTER_TEST_SEED"

// Seed returns KVROUTER_TEST_SEED when it is set (a test fails on a value
// that is not a decimal uint64), else a random seed, and logs it.
func Seed(t testing.TB) uint64 {
	t.Helper()
	s := rand.Uint64()
	if v := os.Getenv(Env); v != "" {
		var err error
		if s, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("%s=%q: %v", Env, v, err)
		}
	}
	t.Logf("seed %d (%s=%d replays it)", s, Env, s)
	return s
}
