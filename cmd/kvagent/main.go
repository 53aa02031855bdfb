// Command kvagent is the node agent: it follows an inference engine's KV
// event stream over ZMQ, one subscriber per data-parallel rank, and
// publishes every change to the kvrouter cluster over NATS, keeping the
// worker registered with heartbeats (docs/events.md). With
// --offload-socket it also offloads the engine's KV blocks to pinned host
// memory (G2) and disk (G3) through an API on a Unix socket, and publishes
// those tiers too (docs/offload.md).
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/agent"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/internal/listenaddr"
	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/internal/natswatch"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/nvml"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/urfave/cli/v2"
)

func main() {
	if err := app().Run(os.Args); err != nil {
		fmt.Fprintln(os.Stderr, "kvagent:", err)
		os.Exit(1)
	}
}

func app() *cli.App {
	return &cli.App{
		Name:  "kvagent",
		Usage: "follow an engine's KV events and publish them to the kvrouter cluster",
		Description: `Example: an engine with two dp ranks publishing on ports 5557 and 5558:

   kvagent --worker-id 1 --block-size 16 --dp-size 2 \
     --engine-endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5567 \
     --nats-url nats://127.0.0.1:4221,nats://127.0.0.1:4222 --router 127.0.0.1:7181

   With offloading of 2 MiB blocks to 20 GiB of host memory and 400 GiB of disk per rank:

   kvagent ... --offload-socket /run/kvagent/offload.sock --block-bytes 2097152 \
     --host-blocks 10240 --disk-dir /var/lib/kvagent/g3 --disk-blocks 204800`,
		// The flags' KVAGENT_* variables are read after the command line,
		// for the flags it left unset (clihelp.ApplyEnv): a flag given
		// outranks its variable, even one that does not parse.
		Flags: clihelp.EnvAfterArgs(append([]cli.Flag{
			&cli.Uint64Flag{Name: "worker-id", EnvVars: []string{"KVAGENT_WORKER_ID"}, Usage: "the worker id the router knows this engine by (required); one agent per worker id: " +
				"its registration replaces the worker's dp ranks, so an engine whose dp ranks run on several hosts needs one worker id per host's agent"},
			&cli.IntFlag{Name: "block-size", EnvVars: []string{"KVAGENT_BLOCK_SIZE"}, Usage: "the engine's KV block size in tokens (required)"},
			&cli.StringFlag{Name: "engine-endpoint", Value: "tcp://127.0.0.1:5557", EnvVars: []string{"KVAGENT_ENGINE_ENDPOINT"}, Usage: "dp rank 0's ZMQ event endpoint; rank r uses port + r"},
			&cli.StringFlag{Name: "replay-endpoint", EnvVars: []string{"KVAGENT_REPLAY_ENDPOINT"}, Usage: "dp rank 0's ZMQ replay endpoint (ROUTER); rank r uses port + r"},
			&cli.BoolFlag{Name: "bind", EnvVars: []string{"KVAGENT_BIND"}, Usage: "bind the event endpoint (the engine connects) instead of connecting to it"},
			&cli.StringFlag{Name: "topic", EnvVars: []string{"KVAGENT_TOPIC"}, Usage: "topic prefix to subscribe to"},
			&cli.BoolFlag{Name: "learn-group-kinds", Value: true, EnvVars: []string{"KVAGENT_LEARN_GROUP_KINDS"}, Usage: "file an engine event without a kv_cache_spec_kind " +
				"(every BlockRemoved) by the kind its group_idx's stores named, so that a hybrid model whose full-attention group is not group 0 has its removes " +
				"followed; false: by wire.md's rule, group 0 (or none) being the main attention group"},
			&cli.UintFlag{Name: "dp-start", EnvVars: []string{"KVAGENT_DP_START"}, Usage: "the first dp rank to follow; the agent registers the worker with its own ranks, which replaces " +
				"the worker's dp ranks: an engine whose ranks run on several hosts needs one --worker-id per host's agent"},
			&cli.IntFlag{Name: "dp-size", Value: 1, EnvVars: []string{"KVAGENT_DP_SIZE"}, Usage: "how many dp ranks to follow"},
			&cli.StringFlag{Name: "nats-url", Value: "nats://127.0.0.1:4222", EnvVars: []string{"KVAGENT_NATS_URL"}, Usage: "the router cluster's NATS (url,url,...: any node's embedded server)"},
			&cli.StringFlag{Name: "nats-user", EnvVars: []string{"KVAGENT_NATS_USER"}, Usage: "NATS user"},
			&cli.StringFlag{Name: "nats-password", EnvVars: []string{"KVAGENT_NATS_PASSWORD"}, Usage: "NATS password"},
			&cli.StringFlag{Name: "nats-creds", EnvVars: []string{"KVAGENT_NATS_CREDS"}, Usage: "NATS credentials file"},
			&cli.StringFlag{Name: "nats-tls-ca", EnvVars: []string{"KVAGENT_NATS_TLS_CA"}, Usage: "PEM CA of the NATS servers' certificates (turns TLS on)"},
			&cli.StringFlag{Name: "nats-tls-cert", EnvVars: []string{"KVAGENT_NATS_TLS_CERT"}, Usage: "PEM client certificate, for servers that require one"},
			&cli.StringFlag{Name: "nats-tls-key", EnvVars: []string{"KVAGENT_NATS_TLS_KEY"}, Usage: "PEM key of --nats-tls-cert"},
			&cli.StringFlag{Name: "events-subject", Value: eventplane.DefaultSubject, EnvVars: []string{"KVAGENT_EVENTS_SUBJECT"}, Usage: "subject of event requests: the routers' --events-subject (dumps go on <subject>.dump; not " + eventplane.DefaultHeartbeatSubject + ")"},
			&cli.StringFlag{Name: "router", EnvVars: []string{"KVAGENT_ROUTER"}, Usage: "router HTTP addresses (host:port,...) to register the worker with; empty: register it elsewhere"},
			&cli.StringFlag{Name: "router-token", EnvVars: []string{"KVAGENT_ROUTER_TOKEN"}, Usage: "the router cluster's bearer token, when its nodes ask for one (kvrouter --token)"},
			&cli.StringFlag{Name: "router-token-file", EnvVars: []string{"KVAGENT_ROUTER_TOKEN_FILE"}, Usage: "read --router-token from this file"},
			&cli.StringFlag{Name: "router-tls-ca", EnvVars: []string{"KVAGENT_ROUTER_TLS_CA"}, Usage: "PEM CA of the router nodes' HTTP certificates: reach --router over TLS, trusting it"},
			&cli.StringFlag{Name: "endpoint", EnvVars: []string{"KVAGENT_ENDPOINT"}, Usage: "where the router should send this worker's requests (registered as is)"},
			&cli.StringFlag{Name: "salt", EnvVars: []string{"KVAGENT_SALT"}, Usage: "the engine's additional salt, in every block hash it makes: the agent hashes its blocks with it too (and registers it), and a route finds them only with cache_salt set to it"},
			&cli.StringFlag{Name: "model", EnvVars: []string{"KVAGENT_MODEL"}, Usage: "the model this worker serves (registered as is)"},
			&cli.Int64Flag{Name: "capacity-device", EnvVars: []string{"KVAGENT_CAPACITY_DEVICE"}, Usage: "KV capacity in blocks on the GPU (0 = unknown; at most 2^40)"},
			&cli.Int64Flag{Name: "capacity-host", EnvVars: []string{"KVAGENT_CAPACITY_HOST"}, Usage: "KV capacity in blocks in host memory"},
			&cli.Int64Flag{Name: "capacity-disk", EnvVars: []string{"KVAGENT_CAPACITY_DISK"}, Usage: "KV capacity in blocks on disk"},
			&cli.DurationFlag{Name: "heartbeat-interval", Value: time.Second, EnvVars: []string{"KVAGENT_HEARTBEAT_INTERVAL"}, Usage: "how often to tell the leader the worker is alive"},
			&cli.DurationFlag{Name: "lease", Value: 10 * time.Second, EnvVars: []string{"KVAGENT_LEASE"}, Usage: "the worker's lease: the leader removes it after this long without a heartbeat (0: never)"},
			&cli.StringFlag{Name: "metrics-addr", Value: "127.0.0.1:9464", EnvVars: []string{"KVAGENT_METRICS_ADDR"}, Usage: "where /metrics is served (empty: nowhere)"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"KVAGENT_LOG_LEVEL"}, Usage: "debug, info, warn or error"},
		}, offloadCLIFlags()...)),
		Before: clihelp.ApplyEnv,
		Action: run,
		// A flag that does not parse is a usage error (exit 2): one line
		// naming the flag as typed, what it takes and where the help is.
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return cli.Exit(clihelp.UsageError(err, c.App.Flags, "kvagent --help"), 2)
		},
	}
}

func run(c *cli.Context) (err error) {
	// A value refused (exit 2) that came from a KVAGENT_* variable is
	// named as it: the command line does not hold the flag.
	defer func() { err = clihelp.FromEnv(c, err) }()
	// Signals are caught from the start: one during a slow start (pinned
	// memory, a disk pool opening) still closes what was opened. The app's
	// context ending (a test's) stops the agent as a signal does. Once a
	// signal came, the next one kills the process as a signal does by
	// default (AfterFunc), as kvrouter's does: a start that hangs (a
	// backend that never opens, a pinned allocation of many GiB) can
	// still be stopped.
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop)
	if err := checkFlags(c); err != nil {
		return err
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
		return cli.Exit(fmt.Sprintf("--log-level %q: want debug, info, warn or error", c.String("log-level")), 2)
	}
	logger := slog.New(slog.NewTextHandler(c.App.ErrWriter, &slog.HandlerOptions{Level: level}))
	oc, err := offloadConfigFrom(c)
	if err != nil {
		return cli.Exit(err.Error(), 2) // the offload flags, as the others: a usage error
	}
	sec, err := routerSecurity(c)
	if err != nil {
		return err
	}
	if err := serve(ctx, stop, c, logger, oc, sec); err != nil {
		return err
	}
	// Once serve's deferred closes have run: the offload side, the flush
	// of the last events, the publisher, NATS.
	logger.Info("kvagent stopped")
	return nil
}

// The --metrics-addr server gives a connection metricsHeaderTimeout to
// send its request's header, and closes a keep-alive connection idle for
// metricsIdleTimeout, as kvrouter's ports do.
const (
	metricsHeaderTimeout = 10 * time.Second
	metricsIdleTimeout   = 2 * time.Minute
)

// metricsLogEvery is how often a line of one kind from the --metrics-addr
// server's net/http is logged at most.
const metricsLogEvery = time.Minute

// newMetricsServer returns the --metrics-addr server, serving h, its own
// lines (an accept error, a handler's panic) logged to logger,
// rate-limited, as kvrouter's ports' (lograte.HTTPServerLog; it serves no
// TLS, so no handshake fails to count). Without an ErrorLog, net/http
// logged them through the default logger, past --log-level. Nothing it
// serves reads a body: a request that declares one has its connection
// closed after the answer (a read deadline already past), instead of
// net/http draining the body first, with no deadline, on bytes a client
// may never send (the server sets no read timeout), holding the
// connection for as long as the client likes.
func newMetricsServer(h http.Handler, logger *slog.Logger) *http.Server {
	closing := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength != 0 {
			// Connection: close alone is not enough: net/http's
			// finishRequest still reads up to 256 KiB of the body
			// before it closes. A read deadline already past makes
			// that read fail at once (the answer, a write, is not
			// affected); its error, a writer that is not net/http's,
			// leaves Connection: close to do what it can.
			w.Header().Set("Connection", "close")
			_ = http.NewResponseController(w).SetReadDeadline(time.Now())
		}
		h.ServeHTTP(w, r)
	})
	return &http.Server{Handler: closing, ReadHeaderTimeout: metricsHeaderTimeout, IdleTimeout: metricsIdleTimeout,
		ErrorLog: lograte.HTTPServerLog(logger, metricsLogEvery, nil)}
}

// metricsServing, when set (by tests), is called with the --metrics-addr
// server before it serves: a test checks its settings.
var metricsServing func(*http.Server)

// serve starts the agent (and, with oc.Socket, its offload side), runs it
// until ctx ends, calling stop then, and closes what it started before it
// returns. It returns nil when ctx ended.
func serve(ctx context.Context, stop context.CancelFunc, c *cli.Context, logger *slog.Logger, oc offloadConfig, sec routerSec) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), buildInfo())
	// The ports first: one in use fails the start before anything else
	// starts (the offload socket, the worker's registration).
	if addr := c.String("metrics-addr"); addr != "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("--metrics-addr: %w (give each agent a port of its own, or --metrics-addr \"\" for none)", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		hs := newMetricsServer(mux, logger.With("addr", ln.Addr().String()))
		if metricsServing != nil {
			metricsServing(hs)
		}
		go hs.Serve(ln)
		defer hs.Close()
		logger.Info("metrics listening", "addr", "http://"+ln.Addr().String()+"/metrics")
	}
	if c.Bool("bind") {
		if err := checkBind(c.String("engine-endpoint"), uint32(c.Uint("dp-start")), c.Int("dp-size")); err != nil {
			return err
		}
	}
	// GPU inventory and telemetry; a machine without NVML gets a monitor
	// that calls nothing (offload/nvml).
	gpus := nvml.Open(nvml.Config{Logger: logger})
	defer gpus.Close()
	reg.MustRegister(nvml.NewCollector(gpus))

	// A NATS not up yet (the routers start beside the agents) is waited
	// for, as a lost connection is; both are logged.
	// A connection nats.go closes for good (credentials refused twice in
	// a row) ends the agent with an error: an agent that can publish
	// nothing must not run on, looking healthy to its supervisor. So does
	// a creds file gone bad since checkFlags read it, which fails every
	// try, and which nats.go never gives up on (natswatch.ErrCreds).
	// A subscription that falls behind (heartbeat and event answers
	// dropped) is counted and logged (at most once per 10 s), as kvrouter's
	// (natswatch.ErrorHandler), not left to nats.go's line on stderr.
	slowConsumers := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvagent_nats_slow_consumer_total",
		Help: "Reports of a subscription of the agent's NATS connection (heartbeat and event answers) falling behind, messages dropped for it: nats.go reports again each time the subscription has taken a message since, so one that stays behind counts about once per message it takes."})
	reg.MustRegister(slowConsumers)
	ctx, lost := context.WithCancelCause(ctx)
	defer lost(nil)
	nl := natswatch.New(logger, lost, natswatch.Texts{Who: "the agent",
		Unreachable: "check --nats-url, and that the routers' NATS is up", Lost: "events wait, and heartbeats fail,"})
	nc, err := connectNATS(c, nl, slowConsumers)
	if err != nil {
		return fmt.Errorf("connect to nats %s: %w", eventplane.RedactURLs(c.String("nats-url")), err)
	}
	// Deferred before shutdown's: NATS closes after the flush of the last
	// events, whose acks come back over it (TestNATSClosesAfterTheLastFlush).
	defer func() {
		nl.Closing()
		nc.Close()
	}()
	reg.MustRegister(natsConnectedGauge(nc))

	cfg := agentConfig(c, oc)
	cfg.Conn, cfg.Registerer, cfg.Logger = nc, reg, logger
	if r := c.String("router"); r != "" {
		cl, err := newRouterClient(strings.Split(r, ","), sec)
		if err != nil {
			return fmt.Errorf("--router: %w", err)
		}
		if clear := cl.ClearText(); sec.token != "" && len(clear) > 0 {
			logger.Warn("the router token goes in clear text: give --router-tls-ca, or https:// addresses in --router", "to", strings.Join(clear, ","))
		}
		defer cl.Close()
		rg := newRegisteredGauge(cl)
		reg.MustRegister(rg.g)
		cfg.Registrar = rg
		cfg.RegistrationHint = registrationHint
	}
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	// Closed in shutdown's order: the offload side, the flush of the
	// last events, the publisher.
	var off io.Closer
	defer func() {
		shutdown(a, off, logger)
		if shutDown != nil {
			shutDown(nc)
		}
	}()
	if oc.Socket != "" {
		o, err := startOffload(oc, a.Ranks(), a, reg, logger)
		if err != nil {
			return fmt.Errorf("offload: %w", err)
		}
		off = o
	}

	// Said at the start, not only when the Nth rank's socket is refused:
	// a host whose hard limit Go could not raise the soft one past would
	// otherwise follow the first ranks and lose the rest.
	if err := enginesub.OpenFiles(c.Int("dp-size")); err != nil {
		logger.Warn("the ranks past the open files limit will not be followed", "err", err)
	}
	logger.Info("kvagent following the engine", "worker", cfg.Worker, "endpoint", cfg.Endpoint,
		"ranks", c.Int("dp-size"), "nats", eventplane.RedactURLs(c.String("nats-url")))
	err = a.Run(ctx)
	// From here a second signal kills the process at once, as a signal
	// does by default: a shutdown that hangs (a GPU copy that never ends)
	// can still be stopped.
	stop()
	if err := natswatch.Ended(ctx); err != nil {
		return err
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// shutDown, when set (by tests), runs once serve's shutdown has flushed
// the agent's last events and closed its publisher, before NATS closes
// (serve's deferred close, registered before): a test checks the order
// there, the flush needing the connection for its acks.
var shutDown func(*nats.Conn)

// flushCloser is what shutdown closes of the agent: *agent.Agent.
type flushCloser interface {
	Flush(context.Context) error
	Close() error
}

// shutdown closes, once the agent's Run has returned, the offload side
// (off; nil when there is none), then gives the agent's last events 2 s
// to be acknowledged, then closes the agent's publisher, in that order:
// what the pools publish as they close goes out while the publisher is
// still open, and the router is left with what the engine and the G3
// pools held: a G2 pool's close removes every block it held, as its
// memory goes (the worker stays registered, its engine may run on). What
// is still out after the 2 s, the next agent's resync brings back.
func shutdown(a flushCloser, off io.Closer, logger *slog.Logger) {
	if off != nil {
		if err := off.Close(); err != nil {
			logger.Warn("closing the offload side", "err", err)
		}
	}
	fctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := a.Flush(fctx); err != nil {
		logger.Warn("events not acknowledged at shutdown; the next agent resyncs its ranks", "err", err)
	}
	if err := a.Close(); err != nil {
		logger.Warn("closing the publisher", "err", err)
	}
}

// maxCapacityBlocks bounds each tier's capacity the agent registers
// (--capacity-*, and --host-blocks and --disk-blocks, which stand in for
// --capacity-host and --capacity-disk with offload): the router's bound,
// raftfsm.MaxCapacity (2⁴⁰ blocks), which it refuses past.
const maxCapacityBlocks = raftfsm.MaxCapacity

// checkFlags refuses, as usage errors (exit 2), the flags the agent could
// not run with: without them it would retry a registration the router
// refuses for ever, or let its worker's lease run out between heartbeats.
func checkFlags(c *cli.Context) error {
	usage := func(format string, args ...any) error { return cli.Exit(fmt.Sprintf(format, args...), 2) }
	if c.NArg() > 0 {
		return usage("%s", strayArgument(c))
	}
	hb, lease := c.Duration("heartbeat-interval"), c.Duration("lease")
	switch {
	case !c.IsSet("worker-id"):
		return usage("--worker-id is required")
	case eventplane.CheckSubject(c.String("events-subject")) != nil:
		return usage("--events-subject: %v", eventplane.CheckSubject(c.String("events-subject")))
	case c.Int("block-size") <= 0 || c.Int("block-size") > raftfsm.MaxBlockSize:
		return usage("--block-size %d: want the engine's KV block size in tokens, 1 to %d (required)", c.Int("block-size"), raftfsm.MaxBlockSize)
	case c.Int("dp-size") < 1 || c.Int("dp-size") > limits.MaxDPRanks:
		return usage("--dp-size %d: want 1 to %d (the ranks of one worker the router takes)", c.Int("dp-size"), limits.MaxDPRanks)
	case uint64(c.Uint("dp-start")) > math.MaxUint32 || uint64(c.Int("dp-size")) > math.MaxUint32+1-uint64(c.Uint("dp-start")):
		// A rank is 32 bits: past that, --dp-start wrapped to a rank of
		// another worker's dp range.
		return usage("--dp-start %d with --dp-size %d: ranks past %d", c.Uint("dp-start"), c.Int("dp-size"), uint64(math.MaxUint32))
	case hb <= 0:
		return usage("--heartbeat-interval %v: want > 0", hb)
	case lease < 0 || lease > 0 && lease < time.Millisecond || lease > time.Duration(raftfsm.MaxLeaseMs)*time.Millisecond:
		return usage("--lease %v: want 0 (never), or 1ms to a year (%v; the router refuses longer)", lease, time.Duration(raftfsm.MaxLeaseMs)*time.Millisecond)
	case lease > 0 && lease.Truncate(time.Millisecond) <= hb:
		// The registration carries the lease in whole milliseconds
		// (LeaseMs): that truncated lease is the one the leader judges.
		if reg := lease.Truncate(time.Millisecond); reg != lease {
			return usage("--lease %v registers as %v (whole milliseconds), not longer than --heartbeat-interval %v: the worker would be removed between heartbeats", lease, reg, hb)
		}
		return usage("--lease %v is not longer than --heartbeat-interval %v: the worker would be removed between heartbeats", lease, hb)
	}
	if err := eventplane.CheckNATSURLs(c.String("nats-url")); err != nil {
		return usage("--nats-url %q: %v", eventplane.RedactURLs(c.String("nats-url")), err)
	}
	if err := natsOptions(c).Check(c.String("nats-url")); err != nil {
		return usage("%v", err)
	}
	if err := natsOptions(c).CheckFiles(); err != nil {
		return usage("%v", err)
	}
	// The registrations' client, made once NATS is connected, would
	// refuse these endpoints; net.Listen this address, once the flags
	// were taken. A port in use is a failed start (exit 1), found first
	// in serve.
	if r := c.String("router"); r != "" {
		if err := client.CheckEndpoints(strings.Split(r, ",")); err != nil {
			return usage("--router %q: %v", client.RedactEndpoints(r), err)
		}
	}
	if addr := c.String("metrics-addr"); addr != "" && !isHostPort(addr) {
		return usage("--metrics-addr %q: want host:port, the port a number from 0 to 65535 (\"\" for no /metrics)", addr)
	}
	// The router would refuse the registration.
	for _, f := range []string{"salt", "model", "endpoint"} {
		check := limits.Name
		if f == "model" {
			check = limits.PrintableName
		}
		if why := check(c.String(f)); why != "" {
			return usage("--%s %s", f, why)
		}
	}
	// An endpoint libzmq cannot take is refused here for rank 0 as for the
	// others: a bad replay endpoint would otherwise show only at each gap,
	// as a failed replay and a resync.
	for _, f := range []struct {
		name string
		bind bool
	}{{"engine-endpoint", c.Bool("bind")}, {"replay-endpoint", false}} {
		if ep := c.String(f.name); ep != "" || f.name == "engine-endpoint" {
			if err := enginesub.CheckEndpoint(ep, f.bind); err != nil {
				return usage("--%s: %v", f.name, err)
			}
		}
	}
	// Rank r's endpoints are rank 0's, offset by r: the last rank's must
	// exist (the port offset stays a port; an ipc endpoint has none).
	last := uint32(c.Uint("dp-start")) + uint32(c.Int("dp-size")-1)
	for _, f := range []string{"engine-endpoint", "replay-endpoint"} {
		if ep := c.String(f); ep != "" {
			if _, err := enginesub.RankEndpoint(ep, last); err != nil {
				return usage("--%s %s with --dp-start %d and --dp-size %d: rank %d's endpoint is rank 0's with the port offset by %d, "+
					"and this one cannot be (want tcp://host:port, with port + %d at most 65535)", f, ep, c.Uint("dp-start"), c.Int("dp-size"), last, last, last)
			}
		}
	}
	if err := checkMetricsAddrClash(c); err != nil {
		return usage("%v", err)
	}
	for _, f := range []string{"capacity-device", "capacity-host", "capacity-disk"} {
		if n := c.Int64(f); n < 0 || n > maxCapacityBlocks {
			return usage("--%s %d: want the tier's capacity in blocks, 0 (unknown) to %d (2^40)", f, n, int64(maxCapacityBlocks))
		}
	}
	return nil
}

// isHostPort reports whether addr is host:port with a numeric port (the
// host may be empty: every interface), as --metrics-addr needs.
func isHostPort(addr string) bool {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	_, err = strconv.ParseUint(port, 10, 16)
	return err == nil
}

// checkMetricsAddrClash refuses a --metrics-addr on the address of an
// event endpoint the agent binds (--bind: each followed rank's
// --engine-endpoint, rank r's port + r), by the rule kvrouter's listen
// flags follow (listenaddr.Same). Both are the agent's own listeners, so
// the flags alone say the start cannot work; taken, /metrics listened
// and the rank's bind then failed the start (exit 1), as if another
// process held the port. A ZMQ "*" host is 0.0.0.0 (libzmq binds it on
// IPv4 only), a "*" port a free one, which clashes with nothing.
func checkMetricsAddrClash(c *cli.Context) error {
	addr := c.String("metrics-addr")
	if addr == "" || !c.Bool("bind") {
		return nil
	}
	first := uint32(c.Uint("dp-start"))
	for i := range c.Int("dp-size") {
		ep, err := enginesub.RankEndpoint(c.String("engine-endpoint"), first+uint32(i))
		if err != nil {
			return nil // refused above
		}
		hostport, ok := strings.CutPrefix(ep, "tcp://")
		if !ok {
			return nil // ipc or inproc: no TCP port
		}
		if h, p, err := net.SplitHostPort(hostport); err == nil && h == "*" {
			hostport = net.JoinHostPort("0.0.0.0", p)
		}
		if listenaddr.Same(addr, hostport) {
			rank := ""
			if i > 0 || first > 0 {
				rank = fmt.Sprintf(" (rank %d's is %s)", first+uint32(i), ep)
			}
			return fmt.Errorf("--metrics-addr %q and --engine-endpoint %q%s, bound with --bind: the same address, on which only one can listen: give each its own port",
				addr, c.String("engine-endpoint"), rank)
		}
	}
	return nil
}

// checkBind fails when the event endpoint of a rank the agent binds
// (--bind) is a TCP port in use. The subscribers bind only when the agent
// runs, after the offload side has started and with the worker's
// registration under way: a port in use found then is a start half made.
// It checks the endpoints it can listen on as given (an IP address or *,
// and a port) and leaves any other, and any other failure, to the
// subscriber's own bind.
func checkBind(endpoint string, first uint32, ranks int) error {
	for i := range ranks {
		dp := first + uint32(i)
		ep, err := enginesub.RankEndpoint(endpoint, dp)
		if err != nil {
			return nil // checkFlags refused it already
		}
		hostport, ok := strings.CutPrefix(ep, "tcp://")
		if !ok {
			continue
		}
		host, port, err := net.SplitHostPort(hostport)
		if err != nil || port == "*" || port == "0" {
			continue
		}
		network := "tcp"
		if host == "*" {
			// libzmq binds "*" on 0.0.0.0 (IPv4 only, ZMQ_IPV6 unset):
			// probe that, not Go's [::] of both families, which an
			// IPv6-only holder of the port would fail.
			host, network = "0.0.0.0", "tcp4"
		} else if net.ParseIP(host) == nil {
			continue // an interface name, which ZMQ resolves
		}
		ln, err := net.Listen(network, net.JoinHostPort(host, port))
		if errors.Is(err, syscall.EADDRINUSE) {
			return fmt.Errorf("--bind: rank %d's event endpoint %s: %w (does another kvagent, or the engine itself, bind it?)", dp, ep, err)
		}
		if err == nil {
			ln.Close()
		}
	}
	return nil
}

// natsOptions are the agent's NATS client options, from its flags.
func natsOptions(c *cli.Context) eventplane.ClientOptions {
	return eventplane.ClientOptions{Name: fmt.Sprintf("kvagent-%d", c.Uint64("worker-id")),
		User: c.String("nats-user"), Password: c.String("nats-password"), Creds: c.String("nats-creds"),
		TLSCA: c.String("nats-tls-ca"), TLSCert: c.String("nats-tls-cert"), TLSKey: c.String("nats-tls-key")}
}

// strayArgument says what is wrong with the command line's arguments:
// kvagent takes flags only, and the flag parser stops at the first
// argument, ignoring every flag after it. A "true" or "false" there most
// likely followed a boolean flag ("--bind false"), which takes no
// separate value: the message names the form that works.
func strayArgument(c *cli.Context) string {
	arg := c.Args().First()
	msg := fmt.Sprintf("unexpected argument %q: kvagent takes flags only, and the flags after it would be ignored", arg)
	v, err := strconv.ParseBool(arg)
	if err != nil {
		return msg
	}
	var named []string
	for _, f := range c.App.Flags {
		if ef, ok := f.(clihelp.EnvFlag); ok {
			f = ef.Unwrap()
		}
		if bf, ok := f.(*cli.BoolFlag); ok && c.IsSet(bf.Name) && c.Bool(bf.Name) {
			named = append(named, fmt.Sprintf("--%s=%t", bf.Name, v))
		}
	}
	if len(named) == 0 {
		named = []string{fmt.Sprintf("--<flag>=%t", v)}
	}
	return fmt.Sprintf("%s; a boolean flag takes its value after an =: %s", msg, strings.Join(named, " or "))
}

// agentConfig is the agent's configuration as the flags set it, oc the
// offload flags (with offload on, the pools' capacities stand in for a
// --capacity-host or --capacity-disk of 0); run adds the NATS connection,
// the registerer, the logger and the registrar.
func agentConfig(c *cli.Context, oc offloadConfig) agent.Config {
	cfg := agent.Config{
		Worker: c.Uint64("worker-id"), DPStart: uint32(c.Uint("dp-start")), DPRanks: c.Int("dp-size"),
		Endpoint: c.String("engine-endpoint"), ReplayEndpoint: c.String("replay-endpoint"),
		Bind: c.Bool("bind"), Topic: c.String("topic"), BlockSize: c.Int("block-size"), NoLearnGroupKinds: !c.Bool("learn-group-kinds"),
		HeartbeatInterval: c.Duration("heartbeat-interval"), Publisher: publisherConfig(c),
		Registration: raftfsm.WorkerInfo{BlockSize: c.Int("block-size"), Endpoint: c.String("endpoint"),
			Model: c.String("model"), Salt: c.String("salt"), LeaseMs: c.Duration("lease").Milliseconds(),
			Capacity: [4]int64{c.Int64("capacity-device"), c.Int64("capacity-host"), c.Int64("capacity-disk")}},
	}
	if oc.Socket != "" {
		// The router bounds what it keeps of a rank per tier by the
		// registered capacity: let it keep what the pools hold.
		capa := &cfg.Registration.Capacity
		if capa[kvevent.TierHostPinned] == 0 {
			capa[kvevent.TierHostPinned] = int64(oc.HostBlocks)
		}
		if capa[kvevent.TierDisk] == 0 {
			capa[kvevent.TierDisk] = int64(oc.DiskBlocks)
		}
	}
	return cfg
}

// publisherConfig is what the flags set of the agent's publisher: the
// subject of its event requests, the routers' --events-subject; its dumps
// go on <subject>.dump, as the routers take them
// (eventplane.PublisherConfig.DumpSubject's default).
func publisherConfig(c *cli.Context) eventplane.PublisherConfig {
	return eventplane.PublisherConfig{Subject: c.String("events-subject")}
}

// newRouterClient is the client registrations go through. Each try of a
// node is bounded (a connect timeout, and one for the answer's headers) so
// that a node that accepts connections and never answers costs one try's
// share of the registration's 5 s, and the next node is tried: with the
// client's defaults a hung first node took every try whole.
func newRouterClient(endpoints []string, sec routerSec) (*client.Client, error) {
	perTry := max(2*time.Second, 4*time.Second/time.Duration(len(endpoints))) // a write may wait for an election
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.DialContext = (&net.Dialer{Timeout: time.Second, KeepAlive: 30 * time.Second}).DialContext
	tr.TLSHandshakeTimeout = perTry // not the transport's 10 s: a hung node costs one try's share
	tr.ResponseHeaderTimeout = perTry
	scheme := "http"
	if sec.tls != nil {
		tr.TLSClientConfig, scheme = sec.tls, "https"
	}
	return client.New(endpoints, client.Options{HTTPClient: &http.Client{Transport: tr}, UserAgent: "kvagent", Token: sec.token, Scheme: scheme})
}

// registrationHint says what to fix for a registration through --router
// that failed, naming the flag (as kvctl and kvrouter --join say --token
// on a 401, and --tls-ca for a certificate they do not trust), "" when it
// knows nothing to say: agent.Config.RegistrationHint.
func registrationHint(err error) string {
	var ae *client.Error
	switch {
	case errors.Is(err, client.ErrUnauthorized):
		return "give the router cluster's token with --router-token or --router-token-file (or KVAGENT_ROUTER_TOKEN)"
	case errors.Is(err, client.ErrNotAnAnswer):
		// Another service answered the registration with a success no
		// node gives (200 where a node answers 204): retried, as no node
		// took it, with this in each warning.
		return "--router names an address that is not a kvrouter node's HTTP API: check --router"
	case errors.As(err, &ae) && ae.StatusCode == http.StatusBadRequest && ae.Reason == "" &&
		strings.Contains(ae.Message, "HTTP request to an HTTPS server"):
		// Go's TLS server's answer to a clear-text request (kvrouter's
		// refusedJoin reads it the same way).
		return "the router serves TLS: give --router-tls-ca with the CA that signed its nodes' certificates"
	case ae != nil:
		return "" // an answer: its text may be a node's forward to its leader
	}
	if strings.Contains(err.Error(), "server gave HTTP response to HTTPS client") {
		// --router-tls-ca given for a node that serves plain HTTP (Go's
		// transport's text; kvrouter's refusedJoin reads it the same
		// way). Retried, as a certificate refused is: the node may be
		// restarted with TLS while the agent runs (a cluster turning TLS
		// on after its agents were given the CA).
		return "the router node answers plain HTTP: drop --router-tls-ca, or give the node TLS (kvrouter --tls-cert, --tls-key)"
	}
	// The agent's own handshake refused a node's certificate. The agent
	// retries (a transport error: the router's certificate may be
	// reissued while it runs), with this in each warning.
	return client.CertificateHint(err, "--router-tls-ca")
}

// routerSec is how the agent reaches the router's API: its token, and TLS
// when --router-tls-ca is given.
type routerSec struct {
	token string
	tls   *tls.Config
}

// routerSecurity reads --router-token or --router-token-file (either
// given outranks both variables: clihelp.TokenFlagArgs) and
// --router-tls-ca; a file missing or wrong is a usage error (exit 2).
// Without --router it reads none of them, and refuses each given on the
// command line (its variable alone is no error).
func routerSecurity(c *cli.Context) (routerSec, error) {
	var sec routerSec
	var err error
	if c.String("router") == "" {
		// Only the flags given are refused: their variables, set in an
		// environment several agents share (some without --router), are
		// left unread by an agent that registers nowhere.
		for _, f := range []string{"router-token", "router-token-file", "router-tls-ca"} {
			if clihelp.OnCommandLine(c, f) && c.String(f) != "" {
				return sec, cli.Exit(fmt.Sprintf("--%s is for the registrations through --router, and there is no --router", f), 2)
			}
		}
		return sec, nil
	}
	// Either token flag given outranks both variables, as kvctl's: a
	// stale KVAGENT_ROUTER_TOKEN does not stand against
	// --router-token-file given.
	token, file, given := clihelp.TokenFlagArgs(c, "router-token", "router-token-file", "KVAGENT_ROUTER_TOKEN", "KVAGENT_ROUTER_TOKEN_FILE")
	if sec.token, err = client.Token(token, file); err != nil {
		names := "--router-token, --router-token-file"
		if !given {
			names = "KVAGENT_ROUTER_TOKEN, KVAGENT_ROUTER_TOKEN_FILE"
		}
		return sec, cli.Exit(fmt.Sprintf("%s: %v", names, err), 2)
	}
	if ca := c.String("router-tls-ca"); ca != "" {
		if sec.tls, err = client.TLSConfig(ca); err != nil {
			return sec, cli.Exit(fmt.Sprintf("--router-tls-ca: %v", err), 2)
		}
	}
	return sec, nil
}

// connectNATS connects to --nats-url with the flags' options, waiting
// for a NATS not up yet, the connection watched by nl (nl.CredsError the
// creds file's), a subscription that falls behind counted in slow.
func connectNATS(c *cli.Context, nl *natswatch.Watch, slow prometheus.Counter) (*nats.Conn, error) {
	no := natsOptions(c)
	no.OnCredsError = nl.CredsError
	opts := no.NATSOptions()
	opts = append(opts, nats.RetryOnFailedConnect(true))
	opts = append(opts, nl.Options()...)
	opts = append(opts, nl.ErrorHandler(slow))
	return nats.Connect(c.String("nats-url"), opts...)
}

// natsConnectedGauge is kvagent_nats_connected: 1 while nc is connected,
// 0 while it is not (the first connection not made yet, or one lost and
// being made again), when the agent publishes nothing.
func natsConnectedGauge(nc *nats.Conn) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvagent_nats_connected",
		Help: "1 while the agent's NATS connection is up, 0 while it is not (events wait, heartbeats fail)."},
		func() float64 {
			if nc.IsConnected() {
				return 1
			}
			return 0
		})
}

// registeredGauge is the agent's Registrar (--router's client) and
// kvagent_registered: 1 once a registration went through, 0 before and
// after one failed (the agent retries it, and the router routes nothing
// to the worker meanwhile).
type registeredGauge struct {
	agent.Registrar
	g prometheus.Gauge
}

func newRegisteredGauge(r agent.Registrar) *registeredGauge {
	return &registeredGauge{Registrar: r, g: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvagent_registered",
		Help: "1 once the worker's last registration through --router went through, 0 before and after one failed."})}
}

func (r *registeredGauge) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	err := r.Registrar.RegisterWorker(ctx, w)
	if err != nil {
		r.g.Set(0)
	} else {
		r.g.Set(1)
	}
	return err
}

// buildInfo is kvagent_build_info (metrics.md: build facts in a gauge of 1).
func buildInfo() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvagent_build_info", Help: "Build facts; value 1.",
		ConstLabels: prometheus.Labels{"version": version, "go_version": runtime.Version()}})
	g.Set(1)
	return g
}

// version is set at link time (-ldflags "-X main.version=...").
var version = "dev"
