package raftfsm

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/benchenv"
)

// TestBenchFSMLoad times the start-up rebuild alone (OpenFSM of a state
// database holding N blocks: the scans and Index.LoadState), which is what
// dominates TestBenchClusterRestart, without paying the cluster's setup on
// every iteration:
//
//	KVROUTER_BENCH=1 KVROUTER_BENCH_BLOCKS=1000000 KVROUTER_LOAD_CACHE=/tmp/load1m \
//	  KVROUTER_LOAD_CPUPROFILE=/tmp/load.prof go test -run TestBenchFSMLoad -v ./raftfsm/
//
// KVROUTER_LOAD_CACHE (optional) names a directory that keeps the built
// state database (and its digest) between runs; KVROUTER_LOAD_CPUPROFILE
// and KVROUTER_LOAD_MEMPROFILE (optional) profile the timed opens only.
// KVROUTER_LOAD_REPS sets how many opens are timed (default 3).
func TestBenchFSMLoad(t *testing.T) {
	benchenv.Skip(t, "bench-cluster")
	blocks := int64(benchenv.Int("KVROUTER_BENCH_BLOCKS", 1_000_000))
	cache := os.Getenv("KVROUTER_LOAD_CACHE")
	if cache == "" {
		cache = t.TempDir()
	}
	dir := filepath.Join(cache, "fsm")
	digestFile := filepath.Join(cache, "digest")
	var digest uint64
	var held int64
	if b, err := os.ReadFile(digestFile); err == nil {
		if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d %d", &digest, &held); err != nil {
			t.Fatalf("%s: %v", digestFile, err)
		}
		t.Logf("reusing the state in %s: %d blocks", dir, held)
	} else {
		seed := benchenv.Seed(t, 20261202)
		c, n := bcBuildState(t, seed, blocks)
		digest, held = c.nodes[0].fsm.Digest(), n
		c.stop(0)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		src := filepath.Join(c.dirs[0], "fsm")
		entries, err := os.ReadDir(src)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			if e.Type().IsRegular() {
				if err := bcCopyFile(filepath.Join(src, e.Name()), filepath.Join(dir, e.Name())); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := os.WriteFile(digestFile, []byte(strconv.FormatUint(digest, 10)+" "+strconv.FormatInt(held, 10)+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// The first open replays the copied WAL into a table; time the later
	// ones, which rebuild the index alone.
	f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	f = nil
	runtime.GC()

	if p := os.Getenv("KVROUTER_LOAD_CPUPROFILE"); p != "" {
		out, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		if err := pprof.StartCPUProfile(out); err != nil {
			t.Fatal(err)
		}
		defer func() { pprof.StopCPUProfile(); out.Close() }()
	}
	var best time.Duration
	for rep := 0; rep < benchenv.Int("KVROUTER_LOAD_REPS", 3); rep++ {
		start := time.Now()
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
		if err != nil {
			t.Fatal(err)
		}
		took := time.Since(start)
		if got := f.Digest(); got != digest || f.Index().Stats().Entries != held {
			t.Fatalf("loaded digest %#x entries %d, want %#x %d", got, f.Index().Stats().Entries, digest, held)
		}
		if rep == 0 {
			// The live heap once the load's temporaries are gone, against
			// the peak the load reached (collector off meanwhile).
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peak := ms.HeapAlloc
			runtime.GC()
			runtime.ReadMemStats(&ms)
			t.Logf("heap after the load %.0f MB, live after a collection %.0f MB", float64(peak)/1e6, float64(ms.HeapAlloc)/1e6)
		}
		if p := os.Getenv("KVROUTER_LOAD_MEMPROFILE"); p != "" && rep == 0 {
			out, err := os.Create(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := pprof.Lookup("allocs").WriteTo(out, 0); err != nil {
				t.Fatal(err)
			}
			out.Close()
		}
		f.Close()
		f = nil
		runtime.GC()
		t.Logf("open %d: %v", rep, took.Round(time.Millisecond))
		if best == 0 || took < best {
			best = took
		}
	}
	fmt.Printf("BENCH fsm.load blocks=%d seconds=%.3f\n", held, best.Seconds())
}
