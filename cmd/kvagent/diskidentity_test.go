package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// TestDiskPoolOfAnotherDeploymentIsNotRestored: a G3 pool records what
// wrote it (worker id, model, salt, block size in tokens). An agent started
// on the same --disk-dir with another model, salt or worker id drops the
// old blocks instead of republishing them as KV of its own engine; one
// started with the same flags restores them. From a review: the pool
// recorded only its format and block size in bytes, so another model of
// the same block size, or another --salt, had the old blocks restored and
// advertised, and they could be onboarded as its KV.
func TestDiskPoolOfAnotherDeploymentIsNotRestored(t *testing.T) {
	sockDir, err := os.MkdirTemp("", "kvagent")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(sockDir)
	diskDir := t.TempDir()
	rank := kvevent.Rank{Worker: 1, DP: 0}
	base := []string{"--offload-socket", filepath.Join(sockDir, "s"), "--backend", "host", "--block-bytes", "64",
		"--disk-dir", diskDir, "--disk-blocks", "16", "--block-size", "16"}
	// start runs the agent's offload side with base and args, and returns
	// how many blocks it restored.
	start := func(args ...string) (*offload, int) {
		t.Helper()
		var oc offloadConfig
		a := app()
		a.Action = func(c *cli.Context) error { oc, err = offloadConfigFrom(c); return err }
		a.ExitErrHandler = func(*cli.Context, error) {}
		if err := a.Run(append(append([]string{"kvagent"}, base...), args...)); err != nil {
			t.Fatalf("flags %v: %v", args, err)
		}
		f := newFakeAgent()
		o, err := startOffload(oc, []kvevent.Rank{rank}, f, prometheus.NewRegistry(), quiet)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, ev := range f.restored[rank] {
			n += len(ev.Blocks)
		}
		return o, n
	}
	fill := func(o *offload) {
		t.Helper()
		for h := uint64(1); h <= 3; h++ {
			if err := o.disks[0].Register(pool.Block{Hash: h, Parent: h - 1, Local: 100 + h}, make([]byte, 64)); err != nil {
				t.Fatal(err)
			}
		}
	}
	stop := func(o *offload) {
		t.Helper()
		if err := o.Close(); err != nil {
			t.Fatal(err)
		}
	}

	first := []string{"--worker-id", "1", "--model", "llama", "--salt", "s1"}
	o, _ := start(first...)
	fill(o)
	stop(o)
	o, n := start(first...)
	stop(o)
	if n != 3 {
		t.Fatalf("restarted with the same flags: restored %d blocks, want 3", n)
	}
	for _, other := range [][]string{
		{"--worker-id", "1", "--model", "llama", "--salt", "s2"},
		{"--worker-id", "1", "--model", "qwen", "--salt", "s1"},
		{"--worker-id", "2", "--model", "llama", "--salt", "s1"},
		{"--worker-id", "1", "--model", "llama", "--salt", "s1", "--block-size", "32"},
	} {
		o, n = start(other...)
		if n != 0 {
			o.Close()
			t.Fatalf("started with %v on a pool written with %v: restored %d blocks, want none", other, first, n)
		}
		fill(o) // for the next start, which runs under first's flags again
		stop(o)
		o, n = start(first...)
		if n != 0 {
			o.Close()
			t.Fatalf("started with %v on a pool written with %v: restored %d blocks, want none", first, other, n)
		}
		fill(o)
		stop(o)
	}
}
