// Command kvsim replays request traces through simulated inference workers
// and routing policies, and reports what each policy wins.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
)

func main() {
	app := &cli.App{
		Name:     "kvsim",
		Usage:    "replay request traces against simulated workers and routing policies",
		Commands: []*cli.Command{replayCommand()},
		ExitErrHandler: func(c *cli.Context, err error) {
			if err == nil {
				return
			}
			fmt.Fprintf(c.App.ErrWriter, "kvsim: %v\n", err)
			var ec cli.ExitCoder
			if errors.As(err, &ec) {
				os.Exit(ec.ExitCode())
			}
			os.Exit(1)
		},
	}
	if err := app.Run(os.Args); err != nil {
		os.Exit(1)
	}
}

func replayCommand() *cli.Command {
	return &cli.Command{
		Name:  "replay",
		Usage: "replay a Mooncake-format trace; print hit rate and load imbalance per policy",
		Description: `Example:
   kvsim replay --trace ../shared/traces/mooncake_synthetic_trace.jsonl --workers 8`,
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "trace", Usage: "Mooncake JSONL trace `FILE`", Required: true, EnvVars: []string{"KVSIM_TRACE"}},
			&cli.IntFlag{Name: "workers", Value: 8, Usage: "simulated workers"},
			&cli.IntFlag{Name: "block-size", Value: 16, Usage: "engine tokens per KV block"},
			&cli.IntFlag{Name: "capacity-tokens", Value: 1_000_000, Usage: "KV cache capacity per worker, in tokens"},
			&cli.Float64Flag{Name: "speed", Value: 1, Usage: "arrival-speed multiplier"},
			&cli.StringFlag{Name: "policies", Value: "router,round_robin", Usage: "comma-separated: router, round_robin (empty for none)"},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "seed of randomised policies"},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", Usage: "table or bench (BENCH lines)"},
			&cli.IntFlag{Name: "limit", Usage: "replay only the first N requests (0 = all)"},
			&cli.BoolFlag{Name: "live", Usage: "route through a running cluster (--endpoints) instead of in-process policies"},
			&cli.StringFlag{Name: "endpoints", Value: "127.0.0.1:7080", EnvVars: []string{"KVCTL_ENDPOINTS"}, Usage: "cluster HTTP endpoints for --live"},
		},
		Action: func(c *cli.Context) error {
			if c.Int("workers") <= 0 || c.Int("block-size") <= 0 || c.Float64("speed") <= 0 {
				return cli.Exit("workers, block-size and speed must be positive", 2)
			}
			reqs, err := sim.LoadTrace(c.String("trace"))
			if err != nil {
				return err
			}
			if n := c.Int("limit"); n > 0 && n < len(reqs) {
				reqs = reqs[:n]
			}
			cfg := sim.Config{Workers: c.Int("workers"), BlockSize: c.Int("block-size"),
				CapacityTokens: c.Int("capacity-tokens"), Speed: c.Float64("speed")}
			pr := sim.Prepare(reqs, cfg.BlockSize)
			var results []sim.Result
			if c.Bool("live") {
				r, err := replayLive(c, pr, cfg)
				if err != nil {
					return err
				}
				results = append(results, r)
			}
			for _, name := range strings.Split(c.String("policies"), ",") {
				if strings.TrimSpace(name) == "" {
					continue
				}
				p, err := policyByName(strings.TrimSpace(name), cfg, c.Uint64("seed"))
				if err != nil {
					return cli.Exit(err.Error(), 2)
				}
				r, err := sim.Replay(pr, cfg, p)
				if err != nil {
					return err
				}
				results = append(results, r)
			}
			return printResults(c.App.Writer, c.String("output"), c.String("trace"), cfg, len(reqs), results)
		},
	}
}

// replayLive replays through a running cluster, with a progress bar on a
// terminal.
func replayLive(c *cli.Context, pr *sim.Prepared, cfg sim.Config) (sim.Result, error) {
	cl, err := client.New(strings.Split(c.String("endpoints"), ","), client.Options{})
	if err != nil {
		return sim.Result{}, cli.Exit(err.Error(), 2)
	}
	defer cl.Close()
	p := &sim.Remote{Client: cl, Workers: cfg.Workers, BlockSize: cfg.BlockSize, CapacityBlocks: int64(cfg.CapacityTokens / cfg.BlockSize)}
	ctx, cancel := context.WithTimeout(c.Context, 30*time.Second)
	defer cancel()
	if err := p.Setup(ctx); err != nil {
		return sim.Result{}, err
	}
	var bar *progressbar.ProgressBar
	if f, ok := c.App.Writer.(*os.File); ok && isatty(f) {
		bar = progressbar.NewOptions(len(pr.Reqs), progressbar.OptionSetWriter(os.Stderr),
			progressbar.OptionSetDescription("live replay"), progressbar.OptionShowCount(), progressbar.OptionClearOnFinish())
		cfg.Progress = func(done, _ int) { _ = bar.Set(done) }
	}
	start := time.Now()
	r, err := sim.Replay(pr, cfg, p)
	if bar != nil {
		_ = bar.Finish()
	}
	fmt.Fprintf(c.App.ErrWriter, "live replay: %d requests, %d API calls in %v\n", r.Requests, p.Calls, time.Since(start).Round(time.Millisecond))
	return r, err
}

func isatty(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func policyByName(name string, cfg sim.Config, seed uint64) (sim.Policy, error) {
	switch name {
	case "router":
		return sim.NewRouter(cfg.Workers, cfg.BlockSize, indexer.DefaultParams(), seed), nil
	case "round_robin":
		return &sim.RoundRobin{Workers: cfg.Workers}, nil
	}
	return nil, fmt.Errorf("unknown policy %q (want router or round_robin)", name)
}

func printResults(w io.Writer, format, trace string, cfg sim.Config, n int, rs []sim.Result) error {
	short := trace
	if i := strings.LastIndex(short, "/"); i >= 0 {
		short = short[i+1:]
	}
	short = strings.TrimSuffix(short, ".jsonl")
	short = strings.TrimPrefix(short, "mooncake_")
	short = strings.TrimSuffix(strings.TrimSuffix(short, "_trace"), "_trace_first1000")
	if format == "bench" {
		for _, r := range rs {
			fmt.Fprintf(w, "BENCH sim.%s.%s hit_rate=%.4f imbalance=%.3f ttft_mean_ms=%.1f ttft_p99_ms=%.1f rejected=%d\n",
				short, r.Policy, r.HitRate, r.Imbalance, r.TTFTMeanMs, r.TTFTP99Ms, r.Errors)
		}
		return nil
	}
	fmt.Fprintf(w, "trace %s: %d requests, %d workers × %d tokens of KV, block size %d, speed %gx\n\n",
		trace, n, cfg.Workers, cfg.CapacityTokens, cfg.BlockSize, cfg.Speed)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\thit rate\timbalance\tTTFT mean ms\tTTFT p99 ms\tevicted blocks\terrors\t")
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%.1f %%\t%.3f\t%.1f\t%.1f\t%d\t%d\t\n", r.Policy, 100*r.HitRate, r.Imbalance, r.TTFTMeanMs, r.TTFTP99Ms, r.Evicted, r.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range rs {
		if r.FirstError != "" {
			fmt.Fprintf(w, "%s: %d errors; the first: %s\n", r.Policy, r.Errors, r.FirstError)
		}
	}
	return nil
}
