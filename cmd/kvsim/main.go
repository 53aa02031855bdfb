// Command kvsim replays request traces through simulated inference workers
// and routing policies, and reports what each policy wins.
package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/sim"
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
			&cli.StringFlag{Name: "policies", Value: "router,round_robin", Usage: "comma-separated: router, round_robin"},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "seed of randomised policies"},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", Usage: "table or bench (BENCH lines)"},
		},
		Action: func(c *cli.Context) error {
			if c.Int("workers") <= 0 || c.Int("block-size") <= 0 || c.Float64("speed") <= 0 {
				return cli.Exit("workers, block-size and speed must be positive", 2)
			}
			reqs, err := sim.LoadTrace(c.String("trace"))
			if err != nil {
				return err
			}
			cfg := sim.Config{Workers: c.Int("workers"), BlockSize: c.Int("block-size"),
				CapacityTokens: c.Int("capacity-tokens"), Speed: c.Float64("speed")}
			pr := sim.Prepare(reqs, cfg.BlockSize)
			var results []sim.Result
			for _, name := range strings.Split(c.String("policies"), ",") {
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
	return tw.Flush()
}
