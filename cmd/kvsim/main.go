// Command kvsim replays request traces through simulated inference workers
// and routing policies, and reports what each policy wins.
//
// Exit codes: 0 success, 1 error (an interrupted replay included), 2 bad
// usage; an error is one line on stderr.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/kvrouter/kvrouter/sim/enginepub"
	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"
)

// main runs kvsim until it is done or interrupted: Ctrl-C (or SIGTERM)
// cancels the run's context, the replay stops at its next step, its
// workers close (their G3 directories are removed), and kvsim exits 1
// with "kvsim: interrupted", as kvctl does. The first signal gives SIGINT
// and SIGTERM back their default action: a second Ctrl-C kills kvsim at
// once, whatever the first one's cleanup still waits for.
func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		<-ctx.Done()
		stop()
	}()
	code := runContext(ctx, os.Args, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

// run runs kvsim with args (args[0] is the program name) and returns its
// exit code: a usage error (a cli.Exit with code 2: a bad flag, a missing
// --trace, an unknown command) exits 2, any other error 1, each reported
// as one line on stderr.
func run(args []string, stdout, stderr io.Writer) int {
	return runContext(context.Background(), args, stdout, stderr)
}

// runContext is run, stopped when ctx is done: an interrupted run exits 1
// with "kvsim: interrupted".
func runContext(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	app := newApp()
	app.Writer, app.ErrWriter = stdout, stderr
	err := app.RunContext(ctx, args)
	if err == nil {
		return exitOK
	}
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		// What the replay did before it stopped, and what a stopped
		// live replay may have left on its cluster, follow.
		fmt.Fprintln(stderr, "kvsim: interrupted: "+oneLine(err.Error()))
		return exitError
	}
	fmt.Fprintln(stderr, "kvsim: "+oneLine(err.Error()))
	var ec cli.ExitCoder
	if errors.As(err, &ec) && ec.ExitCode() == exitUsage {
		return exitUsage
	}
	return exitError
}

// usagef is a command line kvsim cannot run as written: exit 2.
func usagef(format string, args ...any) error {
	return cli.Exit(fmt.Sprintf(format, args...), exitUsage)
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

func newApp() *cli.App {
	return &cli.App{
		Name:        "kvsim",
		Usage:       "replay request traces against simulated workers and routing policies",
		HideVersion: true,
		Commands:    []*cli.Command{replayCommand()},
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return usagef("%s", clihelp.UsageError(err, c.App.Flags, "kvsim --help"))
		},
		Action: func(c *cli.Context) error {
			if c.Args().Present() {
				return usagef("unknown command %q; kvsim --help lists the commands", c.Args().First())
			}
			_ = cli.ShowAppHelp(c)
			return usagef("a command is needed; kvsim --help lists them")
		},
		ExitErrHandler: func(*cli.Context, error) {}, // run decides the exit code, never os.Exit
	}
}

func replayCommand() *cli.Command {
	return &cli.Command{
		Name:  "replay",
		Usage: "replay a Mooncake-format trace through simulated workers; report per policy",
		Description: `Modes:
   timed  discrete-event replay through simulated vLLM-like workers (scheduler, KV
          capacity, prefill/decode timing): hit rate, TTFT, TPOT, latency,
          throughput, imbalance, rejected and queued requests (default)
   cache  time-free: each worker an LRU cache, count the cached prefix, insert
   v1     the first model: no queue, TTFT from the prefill model (--live uses it)

Examples:
   kvsim replay --trace traces/mooncake_synthetic_trace.jsonl --speed 6
   kvsim replay --mode cache --trace traces/mooncake_synthetic_trace.jsonl
   kvsim replay --trace traces/mooncake_arxiv_trace_first1000.jsonl --concurrency 64 -o bench`,
		// The variables (KVSIM_TRACE, kvctl's KVCTL_*) are read after the
		// command line, for the flags it left out (clihelp.ApplyEnv), so
		// that onCommandLine can tell a flag from its variable.
		Flags: clihelp.EnvAfterArgs([]cli.Flag{
			// Required, but checked by runReplay: urfave/cli's own check
			// printed the help and no error.
			&cli.StringFlag{Name: "trace", Usage: "Mooncake JSONL trace `FILE` (required)", EnvVars: []string{"KVSIM_TRACE"}},
			&cli.StringFlag{Name: "mode", Value: "timed", Usage: "timed, cache or v1 (--live implies v1)"},
			&cli.IntFlag{Name: "workers", Value: 8, Usage: "simulated workers; at most 1024"},
			&cli.IntFlag{Name: "block-size", Usage: "engine tokens per KV block; the router uses the same; at most 65536", DefaultText: "timed 64, cache 512, v1 16"},
			&cli.IntFlag{Name: "capacity-blocks", Usage: "KV capacity per worker in blocks; at most 16777216", DefaultText: "timed 16384, cache 2048"},
			&cli.IntFlag{Name: "capacity-tokens", Value: 1_000_000, Usage: "v1: KV cache capacity per worker, in tokens; at most 68719476736"},
			&cli.IntFlag{Name: "max-batched-tokens", Value: 8192, Usage: "timed: token budget of one forward pass; at most 16777216"},
			&cli.IntFlag{Name: "max-seqs", Value: 256, Usage: "timed: running requests per worker at most (1 to 1048576)"},
			&cli.IntFlag{Name: "max-waiting", Value: 4096, Usage: "timed: a worker with this many waiting requests rejects more (-1: unbounded); at most 16777216"},
			&cli.Float64Flag{Name: "engine-speed", Value: 1, Usage: "timed: worker speed factor (pass times are divided by it); 0.001 to 1000"},
			&cli.Float64Flag{Name: "speed", Value: 1, Usage: "arrival-speed multiplier (open loop)"},
			&cli.IntFlag{Name: "concurrency", Usage: "timed: closed loop with this many requests in flight (0: open loop on the trace's timestamps); at most 16777216"},
			&cli.IntFlag{Name: "offload-host-blocks", Usage: "timed: G2 offload tier per worker, in blocks (a host-memory pool of the real offload code; 0: none); at most 16777216"},
			&cli.IntFlag{Name: "offload-disk-blocks", Usage: "timed: G3 offload tier per worker, in blocks (a Pebble pool in a temporary directory; 0: none); at most 16777216"},
			&cli.IntFlag{Name: "offload-block-bytes", Value: 1024, Usage: "timed, offload: bytes a simulated block holds in G1/G2/G3 (synthetic; timing uses the real KV size); at most 1048576"},
			&cli.Float64Flag{Name: "offload-host-gbps", Value: 20, Usage: "timed, offload: G2 → G1 (host → GPU) bandwidth, GB/s; 0.001 to 1000000"},
			&cli.Float64Flag{Name: "offload-disk-gbps", Value: 5, Usage: "timed, offload: G3 → G1 (disk → GPU) bandwidth, GB/s; 0.001 to 1000000"},
			&cli.IntFlag{Name: "offload-disk-threshold", Value: 2, Usage: "timed, offload: sightings before a block is written to G3 (the offload manager's filter; 1: every block); at most 1048576"},
			&cli.StringFlag{Name: "offload-dir", Usage: "timed, offload: parent `DIR` of the G3 databases (default: the system's temporary directory)"},
			&cli.Float64Flag{Name: "kv-bytes-per-token", Value: sim.DefaultKVBytesPerToken, Usage: "timed: the model's KV bytes per token, which sizes a block's transfer between tiers; 1 to 16777216 (16 MiB)"},
			&cli.StringFlag{Name: "policies", Usage: "comma-separated: " + strings.Join(sim.PolicyNames, ", ") + ", ceiling (default: every policy and the ceiling, timed without greedy_balanced; v1: router,round_robin; empty for none)"},
			&cli.Uint64Flag{Name: "seed", Value: 1, Usage: "seed of randomised policies"},
			&cli.Float64Flag{Name: "overlap-credit", Usage: "router: overlap_score_credit; --live: sent with every route as an override", DefaultText: "timed 1, cache 50"},
			&cli.Float64Flag{Name: "prefill-load-scale", Usage: "router, least_loaded: prefill_load_scale; --live: sent with every route as an override", DefaultText: "timed 1, cache 30"},
			&cli.Float64Flag{Name: "decode-request-weight", Usage: "router, least_loaded: decode_active_request_weight (default 0); --live: sent with every route as an override"},
			&cli.StringFlag{Name: "output", Aliases: []string{"o"}, Value: "table", Usage: "table, markdown or bench (BENCH lines)"},
			&cli.StringFlag{Name: "plots", Usage: "write hit_rate.png (and ttft.png for timed and v1 replays) into `DIR`"},
			&cli.IntFlag{Name: "limit", Usage: "replay only the first N requests (0 = all)"},
			&cli.BoolFlag{Name: "live", Usage: "route through a running cluster (--endpoints) instead of in-process policies (v1 model)"},
			&cli.StringFlag{Name: "endpoints", Value: "127.0.0.1:7080", EnvVars: []string{"KVCTL_ENDPOINTS"}, Usage: "cluster HTTP endpoints for --live"},
			&cli.StringFlag{Name: "token", EnvVars: []string{"KVCTL_TOKEN"}, Usage: "--live: the cluster's bearer token, when its nodes ask for one"},
			&cli.StringFlag{Name: "token-file", EnvVars: []string{"KVCTL_TOKEN_FILE"}, Usage: "--live: read --token from this file"},
			&cli.StringFlag{Name: "tls-ca", EnvVars: []string{"KVCTL_TLS_CA"}, Usage: "--live: PEM CA of the nodes' certificates: reach host:port endpoints over TLS, trusting it"},
			&cli.IntFlag{Name: "zmq-base-port", Usage: "--live: simulated worker i publishes its KV events on the engine wire at tcp://ZMQ-HOST:(PORT+i), for a kvagent per worker (worker id i+1) to bring them to the cluster and register the worker; 0: kvsim registers the workers and sends their events through the cluster's API"},
			&cli.IntFlag{Name: "zmq-replay-base-port", Usage: "with --zmq-base-port: worker i also serves replays of its last batches on a ROUTER at tcp://ZMQ-HOST:(PORT+i) (0: none)"},
			&cli.StringFlag{Name: "zmq-host", Value: "127.0.0.1", Usage: "with --zmq-base-port: the address the workers' sockets bind"},
			&cli.DurationFlag{Name: "agent-wait", Value: time.Minute, Usage: "with --zmq-base-port: how long to wait for every worker's agent to subscribe and register it"},
		}),
		Before: clihelp.ApplyEnv,
		Action: runReplay,
		// A flag that does not parse is a usage error (exit 2): one line
		// naming the flag as typed, what it takes and where the help is.
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return usagef("%s", clihelp.UsageError(err, c.Command.Flags, "kvsim replay --help"))
		},
	}
}

// liveCallTimeout bounds each call of a --live replay to the cluster.
const liveCallTimeout = 10 * time.Second

// liveClientOptions reads --token, --token-file and --tls-ca, which only
// a --live replay uses: given on the command line without --live, or with a
// file it cannot use, they are usage errors (exit 2), before the trace is
// read. Without --live their environment variables (kvctl's KVCTL_TOKEN,
// KVCTL_TOKEN_FILE, KVCTL_TLS_CA) are ignored.
func liveClientOptions(c *cli.Context) (client.Options, error) {
	opts := client.Options{UserAgent: "kvsim"}
	if !c.Bool("live") {
		for _, f := range []string{"token", "token-file", "tls-ca"} {
			if onCommandLine(c, f) {
				return opts, cli.Exit(fmt.Sprintf("--%s needs --live: it is how kvsim reaches a running cluster", f), 2)
			}
		}
		return opts, nil
	}
	// Each try of a node is bounded, as kvctl's and kvagent's are, so that
	// one that accepts connections and never answers costs a try's share
	// of a call's liveCallTimeout and the next node is tried: unbounded,
	// a hung first endpoint took every call whole and the replay ended
	// with "the cluster stopped answering" while the others were up.
	perTry := max(2*time.Second, liveCallTimeout/time.Duration(len(strings.Split(c.String("endpoints"), ","))))
	opts.DialTimeout, opts.HeaderTimeout = perTry, perTry
	// Either token flag given outranks both variables, as kvctl's: a
	// kvctl user's KVCTL_TOKEN does not stand against --token-file.
	token, file, given := clihelp.TokenArgs(c, "KVCTL_TOKEN", "KVCTL_TOKEN_FILE")
	var err error
	if opts.Token, err = client.Token(token, file); err != nil {
		names := "--token, --token-file"
		if !given {
			names = "KVCTL_TOKEN, KVCTL_TOKEN_FILE"
		}
		return opts, cli.Exit(names+": "+err.Error(), 2)
	}
	if ca := c.String("tls-ca"); ca != "" {
		if opts.TLS, err = client.TLSConfig(ca); err != nil {
			return opts, cli.Exit("--tls-ca: "+err.Error(), 2)
		}
		opts.Scheme = "https"
	}
	return opts, nil
}

// onCommandLine reports whether the string flag name has a value given on
// the command line, not read from the flag's variable (clihelp.ApplyEnv
// records which): urfave/cli's IsSet is true of both.
func onCommandLine(c *cli.Context, name string) bool {
	return c.String(name) != "" && clihelp.FromVariable(c, name) == ""
}

// checkWireFlags checks the --zmq-* flags: they need --live, and every
// worker's port must be a port. A negative --agent-wait is refused even
// where no agent is waited for: docs/sim.md promises a negative value is
// always refused, never ignored.
func checkWireFlags(c *cli.Context) error {
	base, rbase, n := c.Int("zmq-base-port"), c.Int("zmq-replay-base-port"), c.Int("workers")
	switch {
	case c.Duration("agent-wait") < 0:
		return usagef("--agent-wait %v: want a positive duration", c.Duration("agent-wait"))
	case base == 0 && rbase == 0:
		return nil
	case base == 0:
		return cli.Exit("--zmq-replay-base-port needs --zmq-base-port", 2)
	case !c.Bool("live"):
		return cli.Exit("--zmq-base-port needs --live: the engine wires feed a running cluster's agents", 2)
	case base < 0 || rbase < 0 || base+n-1 > 65535 || rbase+n-1 > 65535:
		return cli.Exit(fmt.Sprintf("--zmq-base-port %d / --zmq-replay-base-port %d: %d workers need ports up to 65535", base, rbase, n), 2)
	case rbase > 0 && rbase < base+n && base < rbase+n:
		return cli.Exit(fmt.Sprintf("--zmq-base-port %d and --zmq-replay-base-port %d overlap for %d workers", base, rbase, n), 2)
	case c.Duration("agent-wait") <= 0:
		return usagef("--agent-wait %v: want a positive duration", c.Duration("agent-wait"))
	}
	return nil
}

// checkUnusedFlags refuses each flag given that the replay will not read:
// a replay given one would run without it and pass for what was asked (a
// v1 replay "with 64 blocks per worker" ran with --capacity-tokens'
// 1,000,000 tokens), so it is refused like the offload tiers outside timed
// mode. What each mode reads: timed, the engine's sizing and speed, the
// closed loop, and --speed only in open loop (a closed loop issues the
// next request when one finishes, without the trace's timestamps); cache,
// --capacity-blocks and no time at all; v1, --capacity-tokens and --speed.
// The offload settings size nothing without a tier.
func checkUnusedFlags(c *cli.Context, mode string, offload bool) error {
	if mode != "timed" {
		for _, f := range []string{"concurrency", "engine-speed", "max-seqs", "max-batched-tokens", "max-waiting"} {
			if c.IsSet(f) {
				return usagef("--%s needs --mode timed (a %s replay ignores it)", f, mode)
			}
		}
	}
	switch {
	case mode == "v1" && c.IsSet("capacity-blocks"):
		return usagef("--capacity-blocks: a v1 replay sizes its workers with --capacity-tokens and ignores it")
	case mode == "cache" && c.IsSet("speed"):
		return usagef("--speed: a cache replay has no arrival times (it replays the requests in trace order) and ignores it")
	case c.Int("concurrency") > 0 && c.IsSet("speed"):
		return usagef("--speed with --concurrency %d: a closed loop issues a request when one finishes, without the trace's timestamps, and ignores it", c.Int("concurrency"))
	}
	if !offload {
		for _, f := range []string{"offload-block-bytes", "offload-host-gbps", "offload-disk-gbps", "offload-disk-threshold", "offload-dir", "kv-bytes-per-token"} { // kv-bytes-per-token sizes only a transfer between tiers
			if c.IsSet(f) {
				return usagef("--%s needs an offload tier (--offload-host-blocks or --offload-disk-blocks above 0; a %s replay without one ignores it)", f, mode)
			}
		}
	}
	return nil
}

// modeDefaults are the per-mode defaults of flags left at 0.
var modeDefaults = map[string]struct {
	blockSize, capacityBlocks int
	policies                  string
	credit, scale             float64
}{
	"timed": {64, 16384, "router,round_robin,random,least_loaded,longest_prefix,ceiling", 1, 1},
	"cache": {512, 2048, "router,round_robin,random,least_loaded,longest_prefix,greedy_balanced,ceiling", 50, 30},
	"v1":    {16, 0, "router,round_robin", 1, 1},
}

func runReplay(c *cli.Context) (err error) {
	// A value refused (exit 2) that came from a variable (KVSIM_TRACE,
	// kvctl's KVCTL_*) is named as it: the command line does not hold
	// the flag.
	defer func() { err = clihelp.FromEnv(c, err) }()
	if c.NArg() > 0 {
		return usagef("replay takes no arguments (got %q); see kvsim replay --help", c.Args().First())
	}
	if c.String("trace") == "" {
		return usagef("replay needs --trace FILE (or KVSIM_TRACE); see kvsim replay --help")
	}
	switch c.String("output") {
	case "table", "markdown", "bench":
	default:
		return usagef("-o %q: want table, markdown or bench", c.String("output"))
	}
	mode := c.String("mode")
	if c.Bool("live") {
		if c.IsSet("mode") && mode != "v1" {
			return cli.Exit("--live replays with the v1 model: drop --mode or use --mode v1", 2)
		}
		mode = "v1"
	}
	def, ok := modeDefaults[mode]
	if !ok {
		return cli.Exit(fmt.Sprintf("unknown mode %q (want timed, cache or v1)", mode), 2)
	}
	if c.Int("workers") <= 0 || c.Int("block-size") < 0 || !positive(c.Float64("speed")) || !positive(c.Float64("engine-speed")) || c.Int("concurrency") < 0 {
		return cli.Exit("workers, speed and engine-speed must be positive (and finite); block-size and concurrency not negative", 2)
	}
	// A value out of range is refused, not replaced by the default: 0
	// takes the default where the flag says so, nothing else does.
	switch {
	case c.Int("max-seqs") < 1 || c.Int("max-batched-tokens") < 1:
		return usagef("--max-seqs %d, --max-batched-tokens %d: want at least 1", c.Int("max-seqs"), c.Int("max-batched-tokens"))
	case c.Int("max-waiting") < -1:
		return usagef("--max-waiting %d: want -1 (unbounded), 0 (the default, 4096) or more", c.Int("max-waiting"))
	case c.Int("capacity-blocks") < 0:
		return usagef("--capacity-blocks %d: want 0 (the mode's default) or more", c.Int("capacity-blocks"))
	case c.Int("limit") < 0:
		return usagef("--limit %d: want 0 (every request) or more", c.Int("limit"))
	}
	if err := checkLimits(c); err != nil {
		return err
	}
	if err := checkWireFlags(c); err != nil {
		return err
	}
	if _, err := liveClientOptions(c); err != nil {
		return err
	}
	offload := sim.OffloadConfig{HostBlocks: c.Int("offload-host-blocks"), DiskBlocks: c.Int("offload-disk-blocks"),
		BlockBytes: c.Int("offload-block-bytes"), HostGBps: c.Float64("offload-host-gbps"), DiskGBps: c.Float64("offload-disk-gbps"),
		DiskThreshold: c.Int("offload-disk-threshold"), Dir: c.String("offload-dir")}
	switch {
	case offload.HostBlocks < 0 || offload.DiskBlocks < 0:
		return cli.Exit("--offload-host-blocks and --offload-disk-blocks must not be negative", 2)
	case offload.Enabled() && mode != "timed":
		return cli.Exit("offload tiers need --mode timed", 2)
	case offload.BlockBytes <= 0 || !positive(offload.HostGBps) || !positive(offload.DiskGBps) || offload.DiskThreshold <= 0 || !positive(c.Float64("kv-bytes-per-token")):
		return cli.Exit("--offload-block-bytes, --offload-host-gbps, --offload-disk-gbps, --offload-disk-threshold and --kv-bytes-per-token must be positive", 2)
	}
	if err := checkRanges(c); err != nil {
		return err
	}
	if err := checkUnusedFlags(c, mode, offload.Enabled()); err != nil {
		return err
	}
	timing := sim.DefaultTiming()
	timing.KVBytesPerToken = c.Float64("kv-bytes-per-token")
	bs := c.Int("block-size")
	if bs == 0 {
		bs = def.blockSize
	}
	if mode == "v1" && c.Int("capacity-tokens") < bs {
		return usagef("--capacity-tokens %d: want at least one block (%d tokens)", c.Int("capacity-tokens"), bs)
	}
	// Only v1 uses it, but a negative value is refused in every mode
	// (docs/sim.md), as --agent-wait is without --live: taken, it read as
	// a value the replay used.
	if c.Int("capacity-tokens") < 0 {
		return usagef("--capacity-tokens %d: want > 0 (used by --mode v1 only)", c.Int("capacity-tokens"))
	}
	capBlocks := c.Int("capacity-blocks")
	if capBlocks == 0 {
		capBlocks = def.capacityBlocks
	}
	if offload.Enabled() {
		// The offload tiers hold G1 and G2 of every worker in memory,
		// allocated when the workers open.
		bb := (offload.BlockBytes + 7) &^ 7 // as sim rounds it
		if mem := int64(c.Int("workers")) * int64(capBlocks+offload.HostBlocks) * int64(bb); mem > maxOffloadMemory {
			return usagef("--workers %d × (--capacity-blocks %d + --offload-host-blocks %d) × --offload-block-bytes %d: %d GiB of G1 and G2 in memory, want at most %d GiB",
				c.Int("workers"), capBlocks, offload.HostBlocks, bb, mem>>30, int64(maxOffloadMemory)>>30)
		}
	}
	policies := def.policies
	if c.IsSet("policies") {
		policies = c.String("policies")
	}
	var names []string
	for _, n := range strings.Split(policies, ",") {
		if n = strings.TrimSpace(n); n != "" {
			// A policy named twice would replay twice, its two BENCH
			// lines under one name.
			if slices.Contains(names, n) {
				return usagef("--policies %q: %s named twice", policies, n)
			}
			names = append(names, n)
		}
	}
	params := indexer.DefaultParams()
	params.OverlapScoreCredit, params.PrefillLoadScale = def.credit, def.scale
	if c.IsSet("overlap-credit") {
		params.OverlapScoreCredit = c.Float64("overlap-credit")
	}
	if c.IsSet("prefill-load-scale") {
		params.PrefillLoadScale = c.Float64("prefill-load-scale")
	}
	params.DecodeActiveRequestWeight = c.Float64("decode-request-weight")
	// Each flag checked alone, so that the refusal names the flag typed,
	// not the scoring parameter it sets (decode_active_request_weight).
	for _, f := range []string{"overlap-credit", "prefill-load-scale", "decode-request-weight"} {
		if !c.IsSet(f) {
			continue
		}
		one := indexer.DefaultParams()
		switch f {
		case "overlap-credit":
			one.OverlapScoreCredit = c.Float64(f)
		case "prefill-load-scale":
			one.PrefillLoadScale = c.Float64(f)
		default:
			one.DecodeActiveRequestWeight = c.Float64(f)
		}
		if err := one.Validate(); err != nil {
			return usagef("--%s %v: want 0 to %g (the router's bound on a scoring weight); see kvsim replay --help", f, c.Float64(f), indexer.MaxWeight)
		}
	}
	if err := params.Validate(); err != nil {
		return cli.Exit(err.Error(), 2)
	}

	reqs, err := sim.LoadTrace(c.String("trace"))
	if err != nil {
		// An error (exit 1), not bad usage, but it says where the path
		// came from: a KVSIM_TRACE left set in the environment is easy to
		// overlook.
		return errors.New(clihelp.FromEnvNote(c.App, c.Command.Flags, "--trace: "+err.Error()))
	}
	if n := c.Int("limit"); n > 0 && n < len(reqs) {
		reqs = reqs[:n]
	}
	pr, err := sim.Prepare(reqs, bs)
	if err != nil {
		return err
	}
	trace := sim.TraceLabel(c.String("trace"))

	var results []sim.Result
	var header string
	switch mode {
	case "v1":
		cfg := sim.Config{Workers: c.Int("workers"), BlockSize: bs, CapacityTokens: c.Int("capacity-tokens"), Speed: c.Float64("speed")}
		header = fmt.Sprintf("trace %s: %d requests, v1 model, %d workers × %d tokens of KV, block size %d, speed %gx, seed %d",
			c.String("trace"), len(reqs), cfg.Workers, cfg.CapacityTokens, bs, cfg.Speed, c.Uint64("seed"))
		// Every policy is built before the live replay touches the
		// cluster: an unknown name is a usage error, found first.
		policies := make([]sim.Policy, len(names))
		for i, name := range names {
			if name == "ceiling" {
				continue
			}
			if policies[i], err = v1Policy(name, cfg, params, c.Uint64("seed")); err != nil {
				return cli.Exit(err.Error(), 2)
			}
		}
		if c.Bool("live") {
			r, err := replayLive(c, pr, cfg, weightOverrides(c, params))
			if err != nil {
				return withBookingsLeft(err, r)
			}
			r.Seed = c.Uint64("seed")
			results = append(results, r)
		}
		for i, name := range names {
			if name == "ceiling" {
				results = append(results, sim.Ceiling(pr, "v1"))
				continue
			}
			r, err := sim.ReplayContext(c.Context, pr, cfg, policies[i])
			if err != nil {
				return err
			}
			r.Seed = c.Uint64("seed")
			results = append(results, r)
		}
	default:
		suite := sim.SuiteConfig{Mode: mode, Policies: names, Seed: c.Uint64("seed"), RouterParams: &params,
			Timed: sim.TimedConfig{Workers: c.Int("workers"), Speed: c.Float64("speed"), Concurrency: c.Int("concurrency"),
				Engine: sim.EngineConfig{NumGPUBlocks: capBlocks, BlockSize: bs, MaxNumBatchedTokens: c.Int("max-batched-tokens"),
					MaxNumSeqs: c.Int("max-seqs"), MaxWaiting: c.Int("max-waiting"), Speed: c.Float64("engine-speed"),
					Timing: timing, Offload: offload}},
			Cache: sim.CacheConfig{Workers: c.Int("workers"), CapacityBlocks: capBlocks, BlockSize: bs},
		}
		if mode == "cache" {
			header = fmt.Sprintf("trace %s: %d requests, cache-only, %d workers × %d blocks of %d tokens, seed %d",
				c.String("trace"), len(reqs), c.Int("workers"), capBlocks, bs, suite.Seed)
		} else {
			load := fmt.Sprintf("arrival speed %gx", c.Float64("speed"))
			if c.Int("concurrency") > 0 {
				load = fmt.Sprintf("closed loop, %d in flight", c.Int("concurrency"))
			}
			header = fmt.Sprintf("trace %s: %d requests, timed, %d workers × %d blocks of %d tokens, %s, seed %d",
				c.String("trace"), len(reqs), c.Int("workers"), capBlocks, bs, load, suite.Seed)
			if offload.Enabled() {
				header += fmt.Sprintf("; offload tiers G2 %d, G3 %d blocks per worker (G3 filter %d), %.0f / %.0f GB/s to G1, %.0f KiB of KV per token",
					offload.HostBlocks, offload.DiskBlocks, offload.DiskThreshold, offload.HostGBps, offload.DiskGBps, timing.KVBytesPerToken/1024)
			}
		}
		for _, n := range names {
			if _, err := sim.NewSuitePolicy(n, suite); err != nil && n != "ceiling" {
				return cli.Exit(err.Error(), 2)
			}
		}
		if c.String("output") != "bench" {
			suite.Progress = func(p string) { fmt.Fprintf(c.App.ErrWriter, "replaying %s...\n", p) }
		}
		results, err = sim.RunSuiteContext(c.Context, pr, suite)
		if err != nil {
			return err
		}
	}
	if dir := c.String("plots"); dir != "" {
		if err := writePlots(c.App.ErrWriter, dir, trace+" ("+mode+")", results); err != nil {
			return err
		}
	}
	if err := printResults(c.App.Writer, c.String("output"), trace, header, mode, offload.Enabled(), results); err != nil {
		return err
	}
	for _, r := range results {
		if err := bookingsLeft(r); err != nil {
			return err
		}
	}
	return nil
}

// bookingsLeft is the error that says r's bookings may remain on the
// cluster, and how long until they expire; nil when none may.
func bookingsLeft(r sim.Result) error {
	if r.Unfreed == 0 {
		return nil
	}
	return fmt.Errorf("%s: %d bookings may remain on the cluster (a free failed twice, or a route failed and so did its free, or a free after a stop or after the cluster stopped answering failed or was not tried; the first error of the replay: %s): "+
		"they count as load on their workers until the cluster's booking expiry frees them, %v after they were made "+
		"(kvrouter --booking-max-age, if the cluster runs its default; the leader sweeps every 10 s): wait that long before another live replay or a measurement on this cluster",
		r.Policy, r.Unfreed, r.FirstError, indexer.DefaultBookingMaxAge)
}

// withBookingsLeft is err, the error that stopped a live replay, followed
// by what bookingsLeft says of r: a replay stopped by a wire error frees
// what it booked while stopping, and those frees may fail too.
func withBookingsLeft(err error, r sim.Result) error {
	if left := bookingsLeft(r); left != nil {
		return fmt.Errorf("%w; %v", err, left)
	}
	return err
}

// writePlots writes hit_rate.png, and ttft.png when a result has TTFT
// figures (timed and v1); without, it says so on errw. With no result
// (--policies "") it writes nothing, not even dir, and says so.
func writePlots(errw io.Writer, dir, title string, rs []sim.Result) error {
	if len(rs) == 0 {
		fmt.Fprintf(errw, "kvsim: --plots: no policy replayed (--policies is empty): no plot written into %s\n", dir)
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := sim.PlotHitRate(filepath.Join(dir, "hit_rate.png"), "hit rate per policy: "+title, rs); err != nil {
		return err
	}
	for _, r := range rs {
		if len(r.TTFTMs) > 0 {
			return sim.PlotTTFT(filepath.Join(dir, "ttft.png"), "TTFT distribution: "+title, rs)
		}
	}
	fmt.Fprintf(errw, "kvsim: --plots: no TTFT figures in this replay (%s): wrote %s, no ttft.png\n",
		noTTFTCause(rs), filepath.Join(dir, "hit_rate.png"))
	return nil
}

// noTTFTCause says why rs (not empty) have no TTFT to plot: a cache-only
// replay has none, nor has the ceiling; a timed or v1 policy has none when
// it served no request.
func noTTFTCause(rs []sim.Result) string {
	if rs[0].Mode == sim.ModeCache {
		return "cache-only mode has none"
	}
	if !slices.ContainsFunc(rs, func(r sim.Result) bool { return !r.HitOnly }) {
		return "the ceiling has none, and no policy was replayed"
	}
	return "no policy served a request: every one was rejected"
}

// weightOverrides returns the router weights given on the command line,
// as params has them, for the live router's route requests: it then scores
// with the weights of the in-process router it is compared with. A weight
// not given is left to the cluster's settings; nil when none is given.
func weightOverrides(c *cli.Context, params indexer.Params) *indexer.Overrides {
	var o indexer.Overrides
	set := false
	for _, w := range []struct {
		flag string
		dst  **float64
		v    float64
	}{
		{"overlap-credit", &o.OverlapScoreCredit, params.OverlapScoreCredit},
		{"prefill-load-scale", &o.PrefillLoadScale, params.PrefillLoadScale},
		{"decode-request-weight", &o.DecodeActiveRequestWeight, params.DecodeActiveRequestWeight},
	} {
		if c.IsSet(w.flag) {
			*w.dst = &w.v
			set = true
		}
	}
	if !set {
		return nil
	}
	return &o
}

// replayLive replays through a running cluster, with a progress bar on a
// terminal. With --zmq-base-port the workers publish their events on
// their engine wires and node agents bring them to the cluster.
func replayLive(c *cli.Context, pr *sim.Prepared, cfg sim.Config, overrides *indexer.Overrides) (sim.Result, error) {
	opts, err := liveClientOptions(c)
	if err != nil {
		return sim.Result{}, err
	}
	cl, err := client.New(strings.Split(c.String("endpoints"), ","), opts)
	if err != nil {
		return sim.Result{}, cli.Exit("--endpoints: "+err.Error(), 2)
	}
	defer cl.Close()
	if clear := cl.ClearText(); opts.Token != "" && len(clear) > 0 {
		fmt.Fprintf(c.App.ErrWriter, "kvsim: warning: the token goes to %s in clear text: give --tls-ca, or https:// endpoints\n", strings.Join(clear, ", "))
	}
	// Stop: a Ctrl-C cancels the call in flight, and the frees of the
	// requests in flight give up after a few seconds, or the first that
	// fails (a cluster that stopped answering held kvsim for minutes). A
	// cluster that stops answering with no one to press Ctrl-C ends the
	// replay the same way, after a few calls in a row got no answer
	// (sim.ErrNoAnswer).
	p := &sim.Remote{Client: cl, Timeout: liveCallTimeout, Workers: cfg.Workers, BlockSize: cfg.BlockSize, CapacityBlocks: int64(cfg.CapacityTokens / cfg.BlockSize),
		Stop: c.Context, Overrides: overrides}
	var policy sim.Policy = p
	var fleet *sim.WireFleet
	setupWait := 30 * time.Second
	if base := c.Int("zmq-base-port"); base > 0 {
		pubs, err := openWires(c, cfg.Workers)
		if err != nil {
			return sim.Result{}, err
		}
		defer closeWires(pubs)
		ctx, cancel := context.WithTimeout(c.Context, c.Duration("agent-wait"))
		defer cancel()
		fmt.Fprintf(c.App.ErrWriter, "simulated workers 1..%d publish their KV events on %s..%s; waiting for their kvagents...\n",
			cfg.Workers, pubs[0].Endpoint(), pubs[len(pubs)-1].Endpoint())
		bps := make([]sim.BatchPublisher, len(pubs))
		for i, pub := range pubs {
			if err := pub.WaitSubscribed(ctx, 1); err != nil {
				return sim.Result{}, fmt.Errorf("worker %d: no kvagent subscribed to %s: %w", i+1, pub.Endpoint(), err)
			}
			bps[i] = pub
		}
		p.Agents = true
		setupWait = time.Until(deadlineOf(ctx))
		fleet = &sim.WireFleet{BlockSize: cfg.BlockSize, Pubs: bps}
		policy = sim.WithWire(p, fleet)
	}
	ctx, cancel := context.WithTimeout(c.Context, setupWait)
	defer cancel()
	if err := p.Setup(ctx); err != nil {
		return sim.Result{}, err
	}
	if fleet != nil {
		// The workers start empty: say so on their wires, and wait until the
		// cluster dropped what it held of them (an earlier run's blocks,
		// from agents that outlived it, or from the cluster's own data).
		if err := fleet.ClearAll(); err != nil {
			return sim.Result{}, err
		}
		if err := p.AwaitEmpty(ctx); err != nil {
			return sim.Result{}, err
		}
	}
	var bar *progressbar.ProgressBar
	counted := &countingPolicy{Policy: policy}
	policy = counted
	if f, ok := c.App.Writer.(*os.File); ok && isatty(f) {
		bar = progressbar.NewOptions(len(pr.Reqs), progressbar.OptionSetWriter(os.Stderr),
			progressbar.OptionSetDescription("live replay"), progressbar.OptionShowCount(), progressbar.OptionClearOnFinish())
		// Deferred after cl.Close, so run before it: the summary's last
		// call is over when the client is closed.
		summary, stopSummary := liveSummary(c.Context, cl, counted, time.Second)
		defer stopSummary()
		cfg.Progress = func(done, _ int) {
			if d, ok := summary.Load().(string); ok {
				bar.Describe(d)
			}
			_ = bar.Set(done)
		}
	}
	start := time.Now()
	r, err := sim.ReplayContext(c.Context, pr, cfg, policy)
	if fleet != nil {
		if ferr := fleet.Flush(); err == nil {
			err = ferr
		}
	}
	if bar != nil {
		_ = bar.Finish()
	}
	took := time.Since(start).Round(time.Millisecond)
	if fleet != nil {
		fmt.Fprintf(c.App.ErrWriter, "live replay: %d requests, %d API calls, %d engine batches (%d events, %d blocks stored) over ZMQ in %v\n",
			r.Requests, p.Calls, fleet.Batches, fleet.Events, fleet.Blocks, took)
	} else {
		fmt.Fprintf(c.App.ErrWriter, "live replay: %d requests, %d API calls in %v\n", r.Requests, p.Calls, took)
	}
	// What the cluster's index believed at each decision against what the
	// chosen worker held: a gap is events not applied yet (or lost).
	fmt.Fprintf(c.App.ErrWriter, "live replay: the cluster predicted %d cached prompt tokens on the chosen workers; they held %d\n",
		r.PredictedCachedTokens, r.CachedTokens)
	return r, err
}

// countingPolicy counts what the live router predicted: the prompt tokens
// routed and those it expected cached, for the live summary.
type countingPolicy struct {
	sim.Policy
	prompt, cached atomic.Int64
}

// LifecycleFailures are the live policy's (sim.LifecycleReporter).
func (p *countingPolicy) LifecycleFailures() sim.LifecycleFailures {
	if lr, ok := p.Policy.(sim.LifecycleReporter); ok {
		return lr.LifecycleFailures()
	}
	return sim.LifecycleFailures{}
}

func (p *countingPolicy) Route(q *sim.RouteQuery, now int64) (int, int, error) {
	w, cached, err := p.Policy.Route(q, now)
	if err == nil {
		p.prompt.Add(int64(q.ISL))
		p.cached.Add(int64(cached))
	}
	return w, cached, err
}

// summarySource is what the live summary asks the cluster: a
// *client.Client.
type summarySource interface {
	Status(ctx context.Context) (*raftfsm.NodeStatus, error)
	Workers(ctx context.Context) ([]api.Worker, error)
}

// liveSummary refreshes, every interval until ctx ends or stop is called,
// a line for the progress bar: the live router's predicted hit rate so
// far, the leader, and each worker's requests in flight as the cluster
// books them. stop ends it and returns once it made its last call, so
// that cl can be closed then.
func liveSummary(ctx context.Context, cl summarySource, p *countingPolicy, every time.Duration) (line *atomic.Value, stop func()) {
	var v atomic.Value
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			cctx, cancelCall := context.WithTimeout(ctx, time.Second)
			line := "live replay"
			if prompt := p.prompt.Load(); prompt > 0 {
				line += fmt.Sprintf(" · hit %.1f%%", 100*float64(p.cached.Load())/float64(prompt))
			}
			if st, err := cl.Status(cctx); err == nil && st.LeaderID != "" {
				line += " · leader " + st.LeaderID
			}
			if ws, err := cl.Workers(cctx); err == nil {
				var load []string
				for _, w := range ws {
					var n int64
					for _, r := range w.Ranks {
						n += r.Load.ActiveRequests
					}
					load = append(load, strconv.FormatInt(n, 10))
				}
				line += " · in flight " + strings.Join(load, "/")
			}
			cancelCall()
			v.Store(line)
		}
	}()
	return &v, func() {
		cancel()
		<-done
	}
}

// openWires binds each worker's engine wire.
func openWires(c *cli.Context, n int) ([]*enginepub.Publisher, error) {
	base, rbase, host := c.Int("zmq-base-port"), c.Int("zmq-replay-base-port"), c.String("zmq-host")
	var pubs []*enginepub.Publisher
	for i := 0; i < n; i++ {
		pc := enginepub.Config{Endpoint: fmt.Sprintf("tcp://%s:%d", host, base+i)}
		if rbase > 0 {
			pc.ReplayEndpoint = fmt.Sprintf("tcp://%s:%d", host, rbase+i)
		}
		pub, err := enginepub.New(pc)
		if err != nil {
			closeWires(pubs)
			return nil, fmt.Errorf("worker %d: %w", i+1, err)
		}
		pubs = append(pubs, pub)
	}
	return pubs, nil
}

// closeWires closes the workers' sockets and lets their last batches go
// out (for at most their linger).
func closeWires(pubs []*enginepub.Publisher) {
	var wg sync.WaitGroup
	for _, p := range pubs {
		wg.Go(func() { _ = p.Close() })
	}
	wg.Wait()
}

func deadlineOf(ctx context.Context) time.Time {
	d, _ := ctx.Deadline()
	return d
}

// Upper bounds of the sizing flags (their --help says each): far above
// any fleet or engine the simulator models, and low enough that kvsim
// refuses a value it cannot allocate the state of (per worker, per
// block) with a usage error rather than a makeslice panic or an
// exhausted memory. maxOffloadMemory bounds what the offload tiers hold
// in memory: G1 and G2 of every worker.
var intLimits = []struct {
	flag string
	most int
}{
	{"workers", 1024},
	{"block-size", 1 << 16},
	{"capacity-blocks", 1 << 24},
	{"capacity-tokens", 1 << 36},
	{"max-batched-tokens", 1 << 24},
	{"max-seqs", 1 << 20},
	{"max-waiting", 1 << 24},
	{"concurrency", 1 << 24},
	{"offload-host-blocks", 1 << 24},
	{"offload-disk-blocks", 1 << 24},
	{"offload-block-bytes", 1 << 20},
	{"offload-disk-threshold", 1 << 20},
}

const maxOffloadMemory = 64 << 30

// checkLimits refuses a sizing flag past its bound in intLimits (a usage
// error, exit 2); the lower bounds are checked before it.
func checkLimits(c *cli.Context) error {
	for _, l := range intLimits {
		if v := c.Int(l.flag); v > l.most {
			return usagef("--%s %d: want at most %d", l.flag, v, l.most)
		}
	}
	return nil
}

// Ranges of the flags that scale a pass time: past them a pass time
// overflowed the simulated clock or was NaN (a block's size in bytes
// overflowed to +Inf), and the replay reported passes of 1 ns. The
// engine now fails such a replay (sim.ErrBadConfig); these bounds make it
// a usage error first, with room to spare: a 1,000× slower engine and a
// 16 MiB-per-token model (a 405B model in 16-bit has 0.5 MiB) keep every
// pass of the shared traces far inside the clock.
var floatRanges = []struct {
	flag   string
	lo, hi float64
}{
	{"engine-speed", 1e-3, 1e3},
	{"kv-bytes-per-token", 1, 1 << 24},
	{"offload-host-gbps", 1e-3, 1e6},
	{"offload-disk-gbps", 1e-3, 1e6},
}

// checkRanges refuses a value of floatRanges' flags out of its range (a
// usage error, exit 2).
func checkRanges(c *cli.Context) error {
	for _, r := range floatRanges {
		if v := c.Float64(r.flag); !(v >= r.lo && v <= r.hi) { // NaN too
			return usagef("--%s %g: want %g to %g", r.flag, v, r.lo, r.hi)
		}
	}
	return nil
}

// positive reports whether x is a positive finite number (NaN is not).
func positive(x float64) bool { return x > 0 && !math.IsInf(x, 1) }

func isatty(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// v1Policy builds a policy for the v1 model.
func v1Policy(name string, cfg sim.Config, params indexer.Params, seed uint64) (sim.Policy, error) {
	return sim.NewPolicy(name, sim.PolicyConfig{Workers: cfg.Workers, BlockSize: cfg.BlockSize,
		Seed: seed, RouterParams: &params})
}

// printResults writes rs in format. The table's columns are the configured
// mode's (and, timed, tiers': the G2/G3 hit columns), not the results':
// with --policies "" there are none, and the empty table still shows which
// replay ran.
func printResults(w io.Writer, format, trace, header, mode string, tiers bool, rs []sim.Result) error {
	switch format {
	case "bench":
		for _, r := range rs {
			fmt.Fprintln(w, sim.BenchLine(trace, r))
		}
		return nil
	case "markdown":
		fmt.Fprintf(w, "%s\n\n", header)
		return sim.WriteModeTable(w, mode, tiers, rs)
	case "table":
	default:
		return cli.Exit(fmt.Sprintf("unknown output %q (want table, markdown or bench)", format), 2)
	}
	fmt.Fprintf(w, "%s\n\n", header)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	timed := mode == "timed"
	if mode == "v1" {
		// The v1 model has no queue: TTFT and the cache figures only.
		fmt.Fprintln(tw, "policy\thit rate\timbalance\tTTFT mean ms\tTTFT p99 ms\tevicted blocks\terrors\t")
		for _, r := range rs {
			if r.HitOnly {
				fmt.Fprintf(tw, "%s\t%.1f %%\t–\t–\t–\t–\t–\t\n", r.Policy, 100*r.HitRate)
				continue
			}
			fmt.Fprintf(tw, "%s\t%.1f %%\t%.3f\t%.1f\t%.1f\t%d\t%d\t\n", r.Policy, 100*r.HitRate, r.Imbalance, r.TTFTMeanMs, r.TTFTP99Ms, r.Evicted, r.Errors)
		}
	} else if timed && tiers {
		fmt.Fprintln(tw, "policy\tG1 hit\tG2 hit\tG3 hit\tTTFT mean ms\tp50\tp99\tTPOT ms\tE2E mean ms\tout tok/s\timbalance\trejected\tserved\tqueued\tpreempted\t")
	} else if timed {
		fmt.Fprintln(tw, "policy\thit rate\tTTFT mean ms\tp50\tp99\tTPOT ms\tE2E mean ms\tout tok/s\timbalance\trejected\tserved\tqueued\tpreempted\t")
	} else {
		fmt.Fprintln(tw, "policy\thit rate\timbalance\tevicted blocks\trejected\tserved\t")
	}
	for _, r := range rs {
		switch {
		case mode == "v1":
		case r.HitOnly:
			fmt.Fprintf(tw, "%s\t%.1f %%\t", r.Policy, 100*r.HitRate)
			if timed && tiers {
				fmt.Fprint(tw, strings.Repeat("–\t", 13))
			} else if timed {
				fmt.Fprint(tw, strings.Repeat("–\t", 11))
			} else {
				fmt.Fprint(tw, strings.Repeat("–\t", 4))
			}
			fmt.Fprintln(tw)
		case timed && tiers:
			fmt.Fprintf(tw, "%s\t%.1f %%\t%.1f %%\t%.1f %%\t%.0f\t%.0f\t%.0f\t%.1f\t%.0f\t%.0f\t%.3f\t%d\t%.1f %%\t%d\t%d\t\n", r.Policy, 100*r.HitRate,
				100*share(r.HostTokens, r.PromptTokens), 100*share(r.DiskTokens, r.PromptTokens),
				r.TTFTMeanMs, r.TTFTP50Ms, r.TTFTP99Ms, r.TPOTMeanMs, r.E2EMeanMs, r.OutputTokensPerS, r.Imbalance, r.Rejected, 100*r.Served(), r.Queued, r.Preemptions)
		case timed:
			fmt.Fprintf(tw, "%s\t%.1f %%\t%.0f\t%.0f\t%.0f\t%.1f\t%.0f\t%.0f\t%.3f\t%d\t%.1f %%\t%d\t%d\t\n", r.Policy, 100*r.HitRate,
				r.TTFTMeanMs, r.TTFTP50Ms, r.TTFTP99Ms, r.TPOTMeanMs, r.E2EMeanMs, r.OutputTokensPerS, r.Imbalance, r.Rejected, 100*r.Served(), r.Queued, r.Preemptions)
		default:
			fmt.Fprintf(tw, "%s\t%.1f %%\t%.3f\t%d\t%d\t%.1f %%\t\n", r.Policy, 100*r.HitRate, r.Imbalance, r.Evicted, r.Rejected, 100*r.Served())
		}
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

func share(n, of int64) float64 {
	if of == 0 {
		return 0
	}
	return float64(n) / float64(of)
}
