package benchenv

import (
	"runtime"
	"slices"
	"strings"
	"testing"
)

// TestABBAOrder: the two sides take turns first, A B B A A B B A …, so that
// neither always runs first (into a clean heap) or always second (after the
// other's garbage), and each side's results come back in its own run order.
func TestABBAOrder(t *testing.T) {
	var order []string
	n := 0.0
	side := func(name string) func() float64 {
		return func() float64 {
			order = append(order, name)
			n++
			return n
		}
	}
	as, bs := ABBA(3, side("A"), side("B"))
	if want := []string{"A", "B", "B", "A", "A", "B"}; !slices.Equal(order, want) {
		t.Fatalf("order %v, want %v", order, want)
	}
	if want := []float64{1, 4, 5}; !slices.Equal(as, want) {
		t.Errorf("A's results %v, want %v", as, want)
	}
	if want := []float64{2, 3, 6}; !slices.Equal(bs, want) {
		t.Errorf("B's results %v, want %v", bs, want)
	}
}

// TestSettleCollects: Settle runs a collection, so a side that calls it
// before its clock starts does not pay for the garbage of the run before.
func TestSettleCollects(t *testing.T) {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	Settle()
	runtime.ReadMemStats(&after)
	if after.NumGC <= before.NumGC {
		t.Fatalf("NumGC %d -> %d: Settle collected nothing", before.NumGC, after.NumGC)
	}
}

func TestBestAndMedian(t *testing.T) {
	xs := []float64{3, 1, 2, 5}
	if got := Best(xs); got != 5 {
		t.Errorf("Best %v = %v, want 5", xs, got)
	}
	if got := Median(xs); got != 2.5 {
		t.Errorf("Median %v = %v, want 2.5", xs, got)
	}
	if got := Median([]float64{3, 1, 2}); got != 2 {
		t.Errorf("Median of 3 = %v, want 2", got)
	}
	if !slices.Equal(xs, []float64{3, 1, 2, 5}) {
		t.Errorf("Median reordered its argument: %v", xs)
	}
	if Best(nil) != 0 || Median(nil) != 0 {
		t.Error("Best and Median of nothing must be 0")
	}
}

// TestUpperBound: a ceiling measured below a figure that does strictly
// more work is no ceiling; UpperBound raises it and says so.
func TestUpperBound(t *testing.T) {
	if c, raised := UpperBound(2e6, 1e6); c != 2e6 || raised {
		t.Errorf("UpperBound(2e6, 1e6) = %v, %v; want 2e6, false", c, raised)
	}
	if c, raised := UpperBound(1.18e6, 2.19e6); c != 2.19e6 || !raised {
		t.Errorf("UpperBound(1.18e6, 2.19e6) = %v, %v; want 2.19e6, true", c, raised)
	}
}

// TestChildEnvDropsTheDaemonsVariables: a child kvrouter, kvctl or kvagent
// gets none of the KVROUTER_*, KVCTL_* and KVAGENT_* variables this process
// has (their flags read them), and every other variable as it is.
func TestChildEnvDropsTheDaemonsVariables(t *testing.T) {
	t.Setenv("KVROUTER_ELECTION_TIMEOUT", "9s")
	t.Setenv("KVCTL_ENDPOINTS", "http://x:1")
	t.Setenv("KVAGENT_ROUTER", "http://y:2")
	t.Setenv("BENCHENV_KEPT", "kvrouter_not_a_prefix")
	env := ChildEnv()
	for _, kv := range env {
		for _, p := range []string{"KVROUTER_", "KVCTL_", "KVAGENT_"} {
			if strings.HasPrefix(kv, p) {
				t.Errorf("ChildEnv kept %s", kv)
			}
		}
	}
	if !slices.Contains(env, "BENCHENV_KEPT=kvrouter_not_a_prefix") {
		t.Errorf("ChildEnv dropped BENCHENV_KEPT: %v", env)
	}
}

// TestIntTakesPositiveIntegersOnly: a size or count from the environment
// is used only when it is a positive integer; 0, a negative, a non-number
// or an unset variable give the default.
func TestIntTakesPositiveIntegersOnly(t *testing.T) {
	const name = "KVROUTER_BENCH_TEST_INT"
	for _, c := range []struct {
		v    string
		want int
	}{{"12", 12}, {"1", 1}, {"0", 7}, {"-3", 7}, {"x", 7}, {"", 7}} {
		t.Setenv(name, c.v)
		if got := Int(name, 7); got != c.want {
			t.Errorf("Int with %s=%q = %d, want %d", name, c.v, got, c.want)
		}
	}
}

// TestSeedReadsTheEnvironment: KVROUTER_BENCH_SEED repeats a run's seed
// (each benchmark logs the one it used); unset or not a number, the
// benchmark's own default.
func TestSeedReadsTheEnvironment(t *testing.T) {
	t.Setenv("KVROUTER_BENCH_SEED", "12345")
	if got := Seed(t, 99); got != 12345 {
		t.Errorf("Seed with KVROUTER_BENCH_SEED=12345 = %d, want 12345", got)
	}
	t.Setenv("KVROUTER_BENCH_SEED", "")
	if got := Seed(t, 99); got != 99 {
		t.Errorf("Seed with KVROUTER_BENCH_SEED unset = %d, want the default 99", got)
	}
	t.Setenv("KVROUTER_BENCH_SEED", "-1")
	if got := Seed(t, 99); got != 99 {
		t.Errorf("Seed with KVROUTER_BENCH_SEED=-1 = %d, want the default 99", got)
	}
}
