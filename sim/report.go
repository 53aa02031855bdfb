package sim

import (
	"fmt"
	"image/color"
	"io"
	"math"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// TraceLabel is the short name of a trace file in reports and BENCH lines:
// "synthetic" for mooncake_synthetic_trace.jsonl, "arxiv" for
// mooncake_arxiv_trace_first1000.jsonl, else the file's base name without
// extension. Only those two file names get the short labels: another
// trace whose name merely contains "synthetic" or "arxiv" would print
// BENCH lines that pass for the shared traces'.
func TraceLabel(path string) string {
	base := strings.TrimSuffix(filepath.Base(path), ".jsonl")
	switch base {
	case "mooncake_synthetic_trace":
		return "synthetic"
	case "mooncake_arxiv_trace_first1000":
		return "arxiv"
	}
	return base
}

// BenchLine is the BENCH line of one policy's result (benchmarks.md):
// timed and v1 replays as "sim.<trace>.<policy>", cache-only ones as
// "sim_cache.<trace>.<policy>", each ending with the seed of the
// randomised policies (seed=, Result.Seed). A timed or v1 replay's load
// comes before the seed: speed=<arrival speed> open loop, concurrency=<in
// flight> closed loop (which ignores the speed). The ceiling has only a
// hit rate: no seed changes it. Every line names its model after the name
// (model=timed, v1 or cache, Result.Mode): a v1 replay and a timed one
// share the area, and their figures differ. A policy that served no
// request has no ttft_mean_ms and ttft_p99_ms.
func BenchLine(trace string, r Result) string {
	area := "sim"
	if r.Mode == "cache" {
		area = "sim_cache"
	}
	model := "model=" + r.Mode
	// A closed loop's speed=1 would read as an open-loop replay at 1x
	// with the same figures: the line names the load it ran under.
	load := fmt.Sprintf("speed=%g", r.Speed)
	if r.Concurrency > 0 {
		load = fmt.Sprintf("concurrency=%d", r.Concurrency)
	}
	// A policy that served no request has no latency: its line leaves
	// the latency fields out rather than print 0 ms, the best figure.
	ttft := ""
	if r.Requests > 0 {
		ttft = fmt.Sprintf(" ttft_mean_ms=%.1f ttft_p99_ms=%.1f", r.TTFTMeanMs, r.TTFTP99Ms)
	}
	if r.Offload != nil {
		// With offload tiers: its own area, and the G2/G3 shares.
		return fmt.Sprintf("BENCH sim_offload.%s.%s %s hit_rate=%.4f g2_hit_rate=%.4f g3_hit_rate=%.4f%s imbalance=%.3f rejected=%d served=%.4f %s seed=%d",
			trace, r.Policy, model, r.HitRate, r.share(r.HostTokens), r.share(r.DiskTokens), ttft, r.Imbalance, r.Rejected, r.Served(), load, r.Seed)
	}
	if r.HitOnly {
		return fmt.Sprintf("BENCH %s.%s.%s %s hit_rate=%.4f", area, trace, r.Policy, model, r.HitRate)
	}
	if r.Mode == "cache" {
		return fmt.Sprintf("BENCH %s.%s.%s %s hit_rate=%.4f imbalance=%.3f rejected=%d served=%.4f seed=%d", area, trace, r.Policy, model, r.HitRate, r.Imbalance, r.Rejected, r.Served(), r.Seed)
	}
	return fmt.Sprintf("BENCH %s.%s.%s %s hit_rate=%.4f%s imbalance=%.3f rejected=%d served=%.4f %s seed=%d",
		area, trace, r.Policy, model, r.HitRate, ttft, r.Imbalance, r.Rejected, r.Served(), load, r.Seed)
}

// share is tokens as a fraction of the prompt tokens.
func (r *Result) share(tokens int64) float64 {
	if r.PromptTokens == 0 {
		return 0
	}
	return float64(tokens) / float64(r.PromptTokens)
}

// WriteTable writes rs (one replay's results) as a markdown table: hit
// rate and imbalance for every mode, the latency, throughput and queue
// columns of timed replays, TTFT for v1 ("–" where a figure does not
// apply, and for the latencies of a policy that served no request). The hit rate counts rejected requests as misses; "served" is
// the share of the requests that a worker took. The columns follow the
// results' modes; WriteModeTable takes them from the replay's
// configuration instead, which an empty rs needs.
func WriteTable(w io.Writer, rs []Result) error {
	mode := ModeCache
	switch {
	case slices.ContainsFunc(rs, func(r Result) bool { return r.Mode == "v1" }):
		mode = "v1"
	case slices.ContainsFunc(rs, func(r Result) bool { return r.Mode == ModeTimed }):
		mode = ModeTimed
	}
	return WriteModeTable(w, mode, slices.ContainsFunc(rs, func(r Result) bool { return r.Offload != nil }), rs)
}

// WriteModeTable writes rs as WriteTable does, with the columns of mode
// ("timed", "cache" or "v1") and, timed, of the offload tiers when tiers
// is set, whatever rs holds: a replay of no policies still shows its
// header.
func WriteModeTable(w io.Writer, mode string, tiers bool, rs []Result) error {
	timed := mode == ModeTimed
	var b strings.Builder
	if mode == "v1" {
		// The v1 model has no queue: TTFT and the cache figures only.
		b.WriteString("| policy | hit rate | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | imbalance | errors |\n|---|---:|---:|---:|---:|---:|---:|\n")
		for _, r := range rs {
			if r.HitOnly {
				fmt.Fprintf(&b, "| %s | %.1f %% | – | – | – | – | – |\n", r.Policy, 100*r.HitRate)
				continue
			}
			if r.Requests == 0 {
				fmt.Fprintf(&b, "| %s | %.1f %% | – | – | – | %.3f | %d |\n", r.Policy, 100*r.HitRate, r.Imbalance, r.Errors)
				continue
			}
			fmt.Fprintf(&b, "| %s | %.1f %% | %.0f | %.0f | %.0f | %.3f | %d |\n", r.Policy, 100*r.HitRate, r.TTFTMeanMs, r.TTFTP50Ms, r.TTFTP99Ms, r.Imbalance, r.Errors)
		}
		_, err := io.WriteString(w, b.String())
		return err
	}
	// With offload tiers, the hit rate is G1's and a column gives G2 + G3's.
	tierHead, tierSep := "", ""
	if tiers {
		tierHead, tierSep = " G2 / G3 hit |", "---:|"
	}
	if timed {
		b.WriteString("| policy | hit rate |" + tierHead + " TTFT mean ms | TTFT p50 ms | TTFT p99 ms | TPOT ms | E2E mean ms | E2E p99 ms | output tok/s | imbalance | rejected | served | queued | preempted |\n")
		b.WriteString("|---|---:|" + tierSep + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	} else {
		b.WriteString("| policy | hit rate | imbalance | rejected | served |\n|---|---:|---:|---:|---:|\n")
	}
	for _, r := range rs {
		hit := fmt.Sprintf("%.1f %%", 100*r.HitRate)
		if tiers {
			switch {
			case r.Offload != nil:
				hit += fmt.Sprintf(" | %.1f %% / %.1f %%", 100*r.share(r.HostTokens), 100*r.share(r.DiskTokens))
			default:
				hit += " | –"
			}
		}
		switch {
		case r.HitOnly && timed:
			fmt.Fprintf(&b, "| %s | %s | – | – | – | – | – | – | – | – | – | – | – | – |\n", r.Policy, hit)
		case r.HitOnly:
			fmt.Fprintf(&b, "| %s | %s | – | – | – |\n", r.Policy, hit)
		case timed && r.Requests == 0:
			// Served nothing: no latency, rather than 0 ms.
			fmt.Fprintf(&b, "| %s | %s | – | – | – | – | – | – | %.0f | %.3f | %d | %.1f %% | %d | %d |\n",
				r.Policy, hit, r.OutputTokensPerS, r.Imbalance, r.Rejected, 100*r.Served(), r.Queued, r.Preemptions)
		case timed:
			fmt.Fprintf(&b, "| %s | %s | %.0f | %.0f | %.0f | %.1f | %.0f | %.0f | %.0f | %.3f | %d | %.1f %% | %d | %d |\n",
				r.Policy, hit, r.TTFTMeanMs, r.TTFTP50Ms, r.TTFTP99Ms, r.TPOTMeanMs, r.E2EMeanMs, r.E2EP99Ms,
				r.OutputTokensPerS, r.Imbalance, r.Rejected, 100*r.Served(), r.Queued, r.Preemptions)
		default:
			fmt.Fprintf(&b, "| %s | %s | %.3f | %d | %.1f %% |\n", r.Policy, hit, r.Imbalance, r.Rejected, 100*r.Served())
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

var palette = []color.Color{
	color.RGBA{0x1f, 0x77, 0xb4, 0xff}, color.RGBA{0xff, 0x7f, 0x0e, 0xff}, color.RGBA{0x2c, 0xa0, 0x2c, 0xff},
	color.RGBA{0xd6, 0x27, 0x28, 0xff}, color.RGBA{0x94, 0x67, 0xbd, 0xff}, color.RGBA{0x8c, 0x56, 0x4b, 0xff},
	color.RGBA{0xe3, 0x77, 0xc2, 0xff},
}

// PlotTTFT writes a PNG of each timed result's TTFT distribution: the
// empirical CDF, TTFT on a log axis.
func PlotTTFT(path, title string, rs []Result) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "time to first token (ms, log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Add(plotter.NewGrid())
	i := 0
	for _, r := range rs {
		if len(r.TTFTMs) == 0 {
			continue
		}
		xs := slices.Clone(r.TTFTMs)
		slices.Sort(xs)
		// At most ~500 points: the curve, not every request.
		step := max(1, len(xs)/500)
		var pts plotter.XYs
		for j := 0; j < len(xs); j += step {
			pts = append(pts, plotter.XY{X: math.Max(xs[j], 1), Y: float64(j+1) / float64(len(xs))})
		}
		pts = append(pts, plotter.XY{X: math.Max(xs[len(xs)-1], 1), Y: 1})
		l, err := plotter.NewLine(pts)
		if err != nil {
			return fmt.Errorf("plot %s: %w", r.Policy, err)
		}
		l.Color = palette[i%len(palette)]
		l.Width = vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(r.Policy, l)
		i++
	}
	p.Legend.Top, p.Legend.Left = false, false
	p.Legend.YOffs = vg.Points(20)
	return p.Save(7*vg.Inch, 4.5*vg.Inch, path)
}

// PlotHitRate writes a PNG bar chart of each result's hit rate.
func PlotHitRate(path, title string, rs []Result) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = "prompt tokens served from cache (%)"
	p.Y.Min, p.Y.Max = 0, 100
	p.Add(plotter.NewGrid())
	vals := make(plotter.Values, len(rs))
	names := make([]string, len(rs))
	for i, r := range rs {
		vals[i] = 100 * r.HitRate
		names[i] = r.Policy
	}
	bars, err := plotter.NewBarChart(vals, vg.Points(28))
	if err != nil {
		return fmt.Errorf("plot hit rates: %w", err)
	}
	bars.Color = palette[0]
	bars.LineStyle.Width = 0
	p.Add(bars)
	p.NominalX(names...)
	labels, err := plotter.NewLabels(plotter.XYLabels{XYs: barTops(vals), Labels: pctLabels(vals)})
	if err == nil {
		p.Add(labels)
	}
	return p.Save(7*vg.Inch, 4*vg.Inch, path)
}

func barTops(vals plotter.Values) plotter.XYs {
	xys := make(plotter.XYs, len(vals))
	for i, v := range vals {
		xys[i] = plotter.XY{X: float64(i) - 0.2, Y: v + 2}
	}
	return xys
}

func pctLabels(vals plotter.Values) []string {
	out := make([]string, len(vals))
	for i, v := range vals {
		out[i] = fmt.Sprintf("%.1f", v)
	}
	return out
}
