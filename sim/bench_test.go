package sim

import (
	"bytes"
	"fmt"
	"github.com/kvrouter/kvrouter/internal/benchenv"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
)

// The routing-quality benchmark (benchmarks.md, "routing quality"): both
// traces, cache-only and timed, every policy side by side in one run. It
// prints BENCH lines and rewrites the generated part of docs/sim.md (below
// its marker) with the tables, and docs/sim/*.png with the plots.
//
//	KVROUTER_BENCH=1 go test -run TestBenchSim -v ./sim/
const (
	docPath   = "../docs/sim.md"
	plotDir   = "../docs/sim"
	docMarker = "<!-- generated below by TestBenchSim; do not edit -->"
)

// loadedLadder is the arrival speeds tried, in order, for the loaded
// comparison; loadFactor is how much slower than unloaded round-robin's
// mean TTFT must be there.
var loadedLadder = []float64{1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20}

const loadFactor = 5

func TestBenchSim(t *testing.T) {
	benchenv.Skip(t, "bench-sim")
	if err := os.MkdirAll(plotDir, 0o755); err != nil {
		t.Fatal(err)
	}
	var doc bytes.Buffer
	start := time.Now()
	fmt.Fprintf(&doc, "Generated %s on %d cores (%s/%s); simulated time, so the figures do not depend on the machine.\n",
		time.Now().UTC().Format("2006-01-02"), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	for _, file := range []string{"mooncake_synthetic_trace.jsonl", "mooncake_arxiv_trace_first1000.jsonl"} {
		reqs := loadTrace(t, file)
		label := TraceLabel(file)
		fmt.Fprintf(&doc, "\n## %s (`%s`, %d requests)\n", label, file, len(reqs))
		benchCache(t, &doc, label, reqs)
		pr, speed := benchTimed(t, &doc, label, reqs)
		if label == "synthetic" {
			benchTimedSweep(t, &doc, pr, speed)
			benchOffload(t, &doc, pr, speed)
		}
	}
	benchCacheSweep(t, &doc)
	fmt.Fprintf(&doc, "\nThe whole benchmark took %v of wall time.\n", time.Since(start).Round(time.Second))
	writeGenerated(t, doc.String())
}

func benchCache(t *testing.T, doc *bytes.Buffer, label string, reqs []Request) {
	pr := prepare(t, reqs, TraceBlockTokens)
	names := append(append([]string(nil), PolicyNames...), "ceiling")
	rs, err := RunSuite(pr, SuiteConfig{Mode: ModeCache, Policies: names, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		fmt.Println(BenchLine(label, r))
	}
	png := label + "_cache_hit_rate.png"
	if err := PlotHitRate(filepath.Join(plotDir, png), label+": cache-only hit rate", rs); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(doc, "\n### Cache-only (8 workers × 2,048 blocks of 512 tokens)\n\n")
	if err := WriteTable(doc, rs); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(doc, "\n![cache-only hit rate per policy](sim/%s)\n", png)
}

func benchTimed(t *testing.T, doc *bytes.Buffer, label string, reqs []Request) (*Prepared, float64) {
	pr := prepare(t, reqs, 64)
	cfg := TimedConfig{Workers: 8}
	unloaded, err := Unloaded(pr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	speed, rrLoaded, ok, err := LoadedSpeed(pr, cfg, unloaded.TTFTMeanMs, loadFactor, loadedLadder)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		speed = loadedLadder[len(loadedLadder)-1]
	}
	cfg.Speed = speed
	names := []string{"router", "round_robin", "random", "least_loaded", "longest_prefix", "ceiling"}
	rs, err := RunSuite(pr, SuiteConfig{Mode: ModeTimed, Policies: names, Timed: cfg, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	by := map[string]Result{}
	for _, r := range rs {
		by[r.Policy] = r
		fmt.Println(BenchLine(label, r))
	}
	router := by["router"]
	vsLeast := by["least_loaded"].TTFTMeanMs / router.TTFTMeanMs
	vsRandom := by["random"].TTFTMeanMs / router.TTFTMeanMs
	met := ok && vsLeast >= 1.7 && vsRandom >= 6 && router.Rejected == 0
	fmt.Printf("BENCH sim_targets.%s model=timed speed=%g rr_unloaded_ttft_ms=%.1f rr_ttft_ratio=%.2f least_loaded_over_router=%.2f random_over_router=%.2f router_rejected=%d met=%t\n",
		label, speed, unloaded.TTFTMeanMs, rrLoaded.TTFTMeanMs/unloaded.TTFTMeanMs, vsLeast, vsRandom, router.Rejected, met)

	ttftPNG, hitPNG := label+"_timed_ttft.png", label+"_timed_hit_rate.png"
	title := fmt.Sprintf("%s at %gx arrival speed", label, speed)
	if err := PlotTTFT(filepath.Join(plotDir, ttftPNG), "TTFT: "+title, rs); err != nil {
		t.Fatal(err)
	}
	if err := PlotHitRate(filepath.Join(plotDir, hitPNG), "hit rate: "+title, rs); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(doc, "\n### Timed (8 workers × 16,384 blocks of 64 tokens, open loop at %gx)\n\n", speed)
	fmt.Fprintf(doc, "Round-robin's unloaded mean TTFT (one request at a time) is %.0f ms; at %gx it is %.0f ms (%.1f×), the first speed of %v where it is at least %d×%s.\n\n",
		unloaded.TTFTMeanMs, speed, rrLoaded.TTFTMeanMs, rrLoaded.TTFTMeanMs/unloaded.TTFTMeanMs, loadedLadder, loadFactor,
		map[bool]string{true: "", false: " (none was: the last one is shown)"}[ok])
	if err := WriteTable(doc, rs); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(doc, "\nTargets: least_loaded's mean TTFT / the router's = %.2f (want ≥ 1.7), random's / the router's = %.2f (want ≥ 6), router rejected %d (want 0): **%s**.\n",
		vsLeast, vsRandom, router.Rejected, map[bool]string{true: "met", false: "not met"}[met])
	fmt.Fprintf(doc, "\n![TTFT distribution per policy](sim/%s)\n\n![hit rate per policy](sim/%s)\n", ttftPNG, hitPNG)
	return pr, speed
}

// benchTimedSweep replays the router with other overlap credits at the
// loaded speed: how much of the cache the default weights leave unused.
func benchTimedSweep(t *testing.T, doc *bytes.Buffer, pr *Prepared, speed float64) {
	fmt.Fprintf(doc, "\n### Router overlap credit, timed at %gx\n\n", speed)
	doc.WriteString("| overlap_score_credit | hit rate | TTFT mean ms | TTFT p99 ms | imbalance |\n|---:|---:|---:|---:|---:|\n")
	for _, c := range []float64{1, 2, 4, 8} {
		params := indexer.DefaultParams()
		params.OverlapScoreCredit = c
		r, err := RunTimed(pr, TimedConfig{Workers: 8, Speed: speed}, NewRouter(8, 64, params, 1))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("BENCH sim_sweep.synthetic.router_credit_%g model=timed hit_rate=%.4f ttft_mean_ms=%.1f ttft_p99_ms=%.1f imbalance=%.3f rejected=%d speed=%g\n",
			c, r.HitRate, r.TTFTMeanMs, r.TTFTP99Ms, r.Imbalance, r.Rejected, speed)
		fmt.Fprintf(doc, "| %g | %.1f %% | %.0f | %.0f | %.3f |\n", c, 100*r.HitRate, r.TTFTMeanMs, r.TTFTP99Ms, r.Imbalance)
	}
}

// offloadTiers are the tier configurations benchOffload compares, per
// worker (G1 is 16,384 blocks): none, a G2 as large as G1, and that G2
// with a G3 four times as large behind it (the offload manager's default
// filter: a block reaches G3 on its second sighting).
//
// suffix names the configuration in its BENCH lines
// ("sim_offload.synthetic.router_g2"), so that every line of a run has a
// name of its own; the configuration without tiers prints none (its
// figures are the timed replay's "sim.synthetic.<policy>").
var offloadTiers = []struct {
	label  string
	suffix string
	cfg    OffloadConfig
}{
	{"none", "", OffloadConfig{}},
	{"G2 16,384", "g2", OffloadConfig{HostBlocks: 16384}},
	{"G2 16,384 + G3 65,536", "g2_g3", OffloadConfig{HostBlocks: 16384, DiskBlocks: 65536}},
}

// benchOffload replays router, round_robin and least_loaded at the loaded
// speed without and with offload tiers (sim/offload.go): where the prompt
// tokens came from (G1, G2, G3) and what it does to TTFT.
//
//	KVROUTER_BENCH=1 go test -count=1 -run TestBenchSim -v ./sim/
//
// rewrites the table with the rest; one configuration alone:
//
//	go run ./cmd/kvsim replay --trace traces/mooncake_synthetic_trace.jsonl --speed 5 \
//	    --policies router,round_robin,least_loaded --offload-host-blocks 16384 --offload-disk-blocks 65536
func benchOffload(t *testing.T, doc *bytes.Buffer, pr *Prepared, speed float64) {
	fmt.Fprintf(doc, "\n### Offload tiers, timed at %gx\n\n", speed)
	doc.WriteString("G1 hit: prompt tokens found in the worker's KV cache; G2 / G3 hit: loaded from the host pool / the disk pool at transfer cost (20 / 5 GB/s, 8 MiB per 64-token block) instead of prefill. Per worker, G1 is 16,384 blocks.\n\n")
	doc.WriteString("| policy | tiers per worker | G1 hit | G2 hit | G3 hit | TTFT mean ms | TTFT p99 ms | imbalance | G1→G2 blocks | G3 writes | loaded G2 / G3 blocks | wall s |\n")
	doc.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, name := range []string{"router", "round_robin", "least_loaded"} {
		for _, tier := range offloadTiers {
			cfg := TimedConfig{Workers: 8, Speed: speed, Engine: EngineConfig{Offload: tier.cfg}}
			start := time.Now()
			rs, err := RunSuite(pr, SuiteConfig{Mode: ModeTimed, Policies: []string{name}, Timed: cfg, Seed: 1})
			if err != nil {
				t.Fatal(err)
			}
			r := rs[0]
			wall := time.Since(start).Seconds()
			if tier.suffix != "" {
				named := r
				named.Policy = name + "_" + tier.suffix
				fmt.Println(BenchLine("synthetic", named))
			}
			moved := "–"
			written, loaded := "–", "–"
			if st := r.Offload; st != nil {
				moved = fmt.Sprint(st.Offloaded)
				loaded = fmt.Sprintf("%d / %d", st.LoadedHost, st.LoadedDisk)
				if tier.cfg.DiskBlocks > 0 {
					written = fmt.Sprint(st.DiskWritten)
				}
			}
			fmt.Fprintf(doc, "| %s | %s | %.1f %% | %.1f %% | %.1f %% | %.0f | %.0f | %.3f | %s | %s | %s | %.0f |\n",
				name, tier.label, 100*r.HitRate, 100*r.share(r.HostTokens), 100*r.share(r.DiskTokens),
				r.TTFTMeanMs, r.TTFTP99Ms, r.Imbalance, moved, written, loaded, wall)
		}
	}
}

// benchCacheSweep is the tuning behind CacheModeRouterParams: the router's
// hit rate and imbalance in cache-only mode on the synthetic trace over a
// grid of overlap credit × prefill load scale.
func benchCacheSweep(t *testing.T, doc *bytes.Buffer) {
	pr := prepare(t, loadTrace(t, "mooncake_synthetic_trace.jsonl"), TraceBlockTokens)
	credits := []float64{1, 10, 30, 40, 50, 60, 80}
	scales := []float64{1, 10, 30, 100}
	fmt.Fprintf(doc, "\n## Router tuning for cache-only mode (synthetic trace)\n\n")
	fmt.Fprintf(doc, "Hit rate / imbalance of the router booking whole prompts as load, per overlap_score_credit (rows) and prefill_load_scale (columns). The cluster defaults (credit 1, scale 1, booking only the uncached tokens) are on the line above the table; ✓ marks the cells that meet ≥ 55 %% at ≤ 1.05.\n\n")
	p := NewRouter(8, TraceBlockTokens, indexer.DefaultParams(), 1)
	r, err := RunCacheOnly(pr, CacheConfig{}, p)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(doc, "defaults: %.1f %% / %.3f\n\n", 100*r.HitRate, r.Imbalance)
	var hdr strings.Builder
	hdr.WriteString("| credit \\ scale |")
	for _, s := range scales {
		fmt.Fprintf(&hdr, " %g |", s)
	}
	hdr.WriteString("\n|---|" + strings.Repeat("---:|", len(scales)) + "\n")
	doc.WriteString(hdr.String())
	for _, c := range credits {
		fmt.Fprintf(doc, "| %g |", c)
		for _, s := range scales {
			params := CacheModeRouterParams()
			params.OverlapScoreCredit, params.PrefillLoadScale = c, s
			p := NewRouter(8, TraceBlockTokens, params, 1)
			p.BookWholePrompt = true
			r, err := RunCacheOnly(pr, CacheConfig{}, p)
			if err != nil {
				t.Fatal(err)
			}
			mark := ""
			if r.HitRate >= 0.55 && r.Imbalance <= 1.05 {
				mark = " ✓"
			}
			fmt.Fprintf(doc, " %.1f %% / %.3f%s |", 100*r.HitRate, r.Imbalance, mark)
		}
		doc.WriteString("\n")
	}
}

func writeGenerated(t *testing.T, gen string) {
	old, err := os.ReadFile(docPath)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	head := string(old)
	if i := strings.Index(head, docMarker); i >= 0 {
		head = head[:i]
	} else if head == "" {
		head = "# The simulated fleet: figures\n\n"
	} else {
		head += "\n"
	}
	if err := os.WriteFile(docPath, []byte(head+docMarker+"\n\n"+gen), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s and %s/*.png", docPath, plotDir)
}
