package testseed

import "testing"

func TestSeedComesFromTheEnvironment(t *testing.T) {
	t.Setenv(Env, "12345")
	if s := Seed(t); s != 12345 {
		t.Fatalf("seed %d with %s=12345", s, Env)
	}
}
