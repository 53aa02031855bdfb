// Command kvrouter runs one node of the kvrouter cluster: a Raft member that
// keeps the replicated KV-block index and serves the HTTP API (route,
// workers, events, cluster, snapshots, metrics).
//
// With no flags it starts a working single-node cluster with its data in
// ./data and says where it listens.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/compat"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/internal/listenaddr"
	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/internal/natswatch"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/urfave/cli/v2"
)

func main() {
	if err := newApp().Run(os.Args); err != nil {
		fmt.Fprintf(os.Stderr, "kvrouter: %v\n", err)
		var ec cli.ExitCoder
		if errors.As(err, &ec) {
			os.Exit(ec.ExitCode())
		}
		os.Exit(1)
	}
}

// newApp is the command: its flags, and run.
func newApp() *cli.App {
	return &cli.App{
		Name:  "kvrouter",
		Usage: "a node of the KV-cache-aware router cluster",
		Description: `Examples:
   kvrouter                                   # single-node cluster in ./data
   kvrouter --node-id n1 --raft-addr 127.0.0.1:7001 --http-addr 127.0.0.1:7081 --data-dir data/n1 \
            --peers n1=127.0.0.1:7001=127.0.0.1:7081,n2=127.0.0.1:7002=127.0.0.1:7082,n3=127.0.0.1:7003=127.0.0.1:7083 \
            --nats-addr 127.0.0.1:4221 --nats-cluster-addr 127.0.0.1:6221 --nats-routes 127.0.0.1:6222,127.0.0.1:6223
   kvrouter --node-id n4 --raft-addr 127.0.0.1:7004 --http-addr 127.0.0.1:7084 --data-dir data/n4 --join 127.0.0.1:7081,127.0.0.1:7082,127.0.0.1:7083 \
            --nats-addr 127.0.0.1:4224 --nats-cluster-addr 127.0.0.1:6224 --nats-routes 127.0.0.1:6221,127.0.0.1:6222,127.0.0.1:6223`,
		Flags: clihelp.EnvAfterArgs([]cli.Flag{
			&cli.StringFlag{Name: "node-id", Value: "node1", EnvVars: []string{"KVROUTER_NODE_ID"}, Usage: "this node's Raft id (the embedded NATS server's name too, which takes no space)"},
			&cli.StringFlag{Name: "raft-addr", Value: "127.0.0.1:7000", EnvVars: []string{"KVROUTER_RAFT_ADDR"}, Usage: "Raft listen address (host:port, as peers dial it: not a wildcard such as 0.0.0.0, nor port 0)"},
			&cli.StringFlag{Name: "http-addr", Value: "127.0.0.1:7080", EnvVars: []string{"KVROUTER_HTTP_ADDR"}, Usage: "HTTP API listen address (host:port; 0.0.0.0 or [::] for every interface, then give --http-advertise in a cluster)"},
			&cli.StringFlag{Name: "http-advertise", EnvVars: []string{"KVROUTER_HTTP_ADVERTISE"}, Usage: "HTTP address the other nodes reach this node at, which the cluster's member table lists and followers forward writes to (host:port: not a wildcard, nor port 0; default: --http-addr)"},
			&cli.StringFlag{Name: "selection-addr", EnvVars: []string{"KVROUTER_SELECTION_ADDR"}, Usage: "also serve the selection and reservation API at the root of this address (it is always under /selection on --http-addr; docs/compat.md)"},
			&cli.StringFlag{Name: "data-dir", Value: "data", EnvVars: []string{"KVROUTER_DATA_DIR"}, Usage: "where the Raft log, snapshots and state live"},
			&cli.StringFlag{Name: "peers", EnvVars: []string{"KVROUTER_PEERS"}, Usage: "bootstrap a new cluster of these voters: id=raftaddr=httpaddr,... (default: this node alone, unless --join)"},
			&cli.StringFlag{Name: "cluster-name", EnvVars: []string{"KVROUTER_CLUSTER_NAME"}, Usage: "name the new cluster at its bootstrap (give every node the same): its id, which Raft connections carry, is derived from the name instead of --peers; a data directory with an id keeps it"},
			&cli.StringFlag{Name: "join", EnvVars: []string{"KVROUTER_JOIN"}, Usage: "HTTP addresses of members of an existing cluster to join, host:port,... (asked in turn; ignored, with a warning, by a node that is the only member of the cluster its data directory holds)"},
			&cli.DurationFlag{Name: "heartbeat-timeout", Value: 200 * time.Millisecond, EnvVars: []string{"KVROUTER_HEARTBEAT_TIMEOUT"}, Usage: "Raft heartbeat timeout"},
			&cli.DurationFlag{Name: "election-timeout", Value: 200 * time.Millisecond, EnvVars: []string{"KVROUTER_ELECTION_TIMEOUT"}, Usage: "Raft election timeout"},
			&cli.DurationFlag{Name: "leader-lease-timeout", EnvVars: []string{"KVROUTER_LEADER_LEASE_TIMEOUT"}, Usage: "Raft leader lease", DefaultText: "the heartbeat timeout"},
			&cli.Uint64Flag{Name: "snapshot-threshold", Value: 8192, EnvVars: []string{"KVROUTER_SNAPSHOT_THRESHOLD"}, Usage: "log entries between snapshots"},
			&cli.Int64Flag{Name: "snapshot-bytes", Value: 256 << 20, EnvVars: []string{"KVROUTER_SNAPSHOT_BYTES"}, Usage: "also snapshot once the entries applied since the last snapshot hold this many bytes (negative: never)"},
			&cli.DurationFlag{Name: "booking-max-age", Value: indexer.DefaultBookingMaxAge, EnvVars: []string{"KVROUTER_BOOKING_MAX_AGE"}, Usage: "a booked request never freed stops counting as load this long after it was booked, and a freed request id may be booked again (1s to 24h); the leader's sweep applies its own value, so give every node the same"},
			&cli.DurationFlag{Name: "silent-after", Value: time.Minute, EnvVars: []string{"KVROUTER_SILENT_AFTER"}, Usage: "report a registered rank silent after this long without events (kvctl workers)"},
			&cli.StringFlag{Name: "nats-addr", Value: "127.0.0.1:4222", EnvVars: []string{"KVROUTER_NATS_ADDR"}, Usage: "embedded NATS server's client listen address (agents publish events here; not with --nats-url)"},
			&cli.StringFlag{Name: "nats-cluster-addr", EnvVars: []string{"KVROUTER_NATS_CLUSTER_ADDR"}, Usage: "embedded NATS server's route listen address; set it on every node to form one NATS cluster (not with --nats-url)"},
			&cli.StringFlag{Name: "nats-routes", EnvVars: []string{"KVROUTER_NATS_ROUTES"}, Usage: "other nodes' NATS route addresses, host:port,... (with --nats-cluster-addr; not with --nats-url)"},
			&cli.StringFlag{Name: "nats-url", EnvVars: []string{"KVROUTER_NATS_URL"}, Usage: "use this external NATS (nats://[user:password@]host:port,...) instead of the embedded server; logs and messages show no password"},
			&cli.StringFlag{Name: "nats-user", EnvVars: []string{"KVROUTER_NATS_USER"}, Usage: "NATS user (required of clients, and of the servers routing to --nats-cluster-addr, by the embedded server, whose route dials send it; sent to an external one)"},
			&cli.StringFlag{Name: "nats-password", EnvVars: []string{"KVROUTER_NATS_PASSWORD"}, Usage: "NATS password of --nats-user (not with a --nats-url that carries user information)"},
			&cli.StringFlag{Name: "nats-creds", EnvVars: []string{"KVROUTER_NATS_CREDS"}, Usage: "NATS credentials file for an external NATS (--nats-url only)"},
			&cli.StringFlag{Name: "nats-tls-cert", EnvVars: []string{"KVROUTER_NATS_TLS_CERT"}, Usage: "PEM certificate: the embedded server serves TLS with it; with --nats-url, this node's client certificate"},
			&cli.StringFlag{Name: "nats-tls-key", EnvVars: []string{"KVROUTER_NATS_TLS_KEY"}, Usage: "PEM key of --nats-tls-cert"},
			&cli.StringFlag{Name: "nats-tls-ca", EnvVars: []string{"KVROUTER_NATS_TLS_CA"}, Usage: "PEM CA: the embedded server requires client certificates it signed (with --nats-tls-cert and --nats-tls-key); with --nats-url, the CA of the server's certificate"},
			&cli.StringFlag{Name: "events-subject", Value: eventplane.DefaultSubject, EnvVars: []string{"KVROUTER_EVENTS_SUBJECT"}, Usage: "subject of event requests (the dump subject is <subject>.dump; not " + eventplane.DefaultHeartbeatSubject + ", the heartbeat subject)"},
			&cli.DurationFlag{Name: "events-linger", Value: time.Millisecond, EnvVars: []string{"KVROUTER_EVENTS_LINGER"}, Usage: "how long the leader waits to pack more event requests into one Raft entry"},
			&cli.DurationFlag{Name: "nats-handover-after", Value: 10 * time.Second, EnvVars: []string{"KVROUTER_NATS_HANDOVER_AFTER"}, Usage: "a leader whose NATS connection stays down this long hands the leadership to a voter that is ready and connected to NATS (only the leader ingests the agents' events); 0: never"},
			&cli.DurationFlag{Name: "unregistered-grace", Value: 2 * time.Minute, EnvVars: []string{"KVROUTER_UNREGISTERED_GRACE"}, Usage: "the leader removes the ranks of a worker that is not registered (its agent publishes before registering, after its removal, or never registers) once it stays so for this long"},
			&cli.Int64Flag{Name: "max-body-bytes", Value: api.DefaultMaxBodyBytes, EnvVars: []string{"KVROUTER_MAX_BODY_BYTES"}, Usage: "largest JSON request body (413 above it)"},
			&cli.IntFlag{Name: "max-ranks", Value: raftfsm.DefaultMaxRanks, EnvVars: []string{"KVROUTER_MAX_RANKS"}, Usage: "most dp ranks of all registered workers together; the leader refuses a registration past it (507 insufficient_storage), but one adding no rank; give every node the same"},
			&cli.Int64Flag{Name: "max-snapshot-bytes", EnvVars: []string{"KVROUTER_MAX_SNAPSHOT_BYTES"}, Usage: "largest snapshot upload to restore (413 above it; 0: no limit)"},
			&cli.StringFlag{Name: "token", EnvVars: []string{"KVROUTER_TOKEN"}, Usage: "bearer token every HTTP request must carry (but GET /healthz, /readyz, /metrics); the same on every node (default: none asked)"},
			&cli.StringFlag{Name: "token-file", EnvVars: []string{"KVROUTER_TOKEN_FILE"}, Usage: "read --token from this file"},
			&cli.StringFlag{Name: "tls-cert", EnvVars: []string{"KVROUTER_TLS_CERT"}, Usage: "PEM certificate: serve the HTTP API (and --selection-addr) over TLS with it; then every node must"},
			&cli.StringFlag{Name: "tls-key", EnvVars: []string{"KVROUTER_TLS_KEY"}, Usage: "PEM key of --tls-cert"},
			&cli.StringFlag{Name: "tls-ca", EnvVars: []string{"KVROUTER_TLS_CA"}, Usage: "PEM CA of the other nodes' HTTP certificates, trusted when forwarding to the leader and joining (default: the system's roots)"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"KVROUTER_LOG_LEVEL"}, Usage: "debug, info, warn or error"},
		}),
		// The variables of the flags the command line leaves unset: a
		// flag given outranks its variable, even one that does not parse.
		Before: clihelp.ApplyEnv,
		Action: run,
		// A flag that does not parse is a usage error: exit 2, as for the
		// flags run checks itself, one line naming the flag (--flag) and
		// saying what to do.
		OnUsageError: func(c *cli.Context, err error, _ bool) error {
			return cli.Exit(clihelp.UsageError(err, c.App.Flags, "kvrouter --help"), 2)
		},
	}
}

// parsePeers parses --peers (raftfsm.ParsePeers, which checks each Raft
// address as checkAddr does --raft-addr: kvctl snapshot restore parses
// its --peers the same way). Its error names the flag first, as kvctl's
// does: ParsePeers's names only the entry, and a usage error that names
// no flag can say neither which flag to fix nor, when KVROUTER_PEERS gave
// it, that the variable did (clihelp.FromEnv).
func parsePeers(s string) ([]raftfsm.Member, error) {
	peers, err := raftfsm.ParsePeers(s)
	if err != nil {
		return nil, fmt.Errorf("--peers: %w", err)
	}
	return peers, nil
}

// checkPeers checks that this node is one of the bootstrap peers, as it
// runs (httpAddr: the address it advertises): a node left out would wait forever for a configuration naming it,
// and one listed at other addresses would be dialed where it is not.
func checkPeers(peers []raftfsm.Member, id, raftAddr, httpAddr string) error {
	for _, p := range peers {
		if p.ID != id {
			continue
		}
		if p.RaftAddr != raftAddr || p.HTTPAddr != httpAddr {
			return fmt.Errorf("--peers lists %s at %s (raft) and %s (http), but it runs at --raft-addr %s and advertises %s (--http-advertise, default --http-addr)",
				id, p.RaftAddr, p.HTTPAddr, raftAddr, httpAddr)
		}
		return nil
	}
	return fmt.Errorf("--peers does not list this node (--node-id %s)", id)
}

func run(c *cli.Context) (err error) {
	// A refused value that came from a variable is named as the variable.
	defer func() { err = clihelp.FromEnv(c, err) }()
	if c.NArg() > 0 {
		return cli.Exit(fmt.Sprintf("unexpected argument %q: kvrouter takes flags only (see --help)", c.Args().First()), 2)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
		return cli.Exit(fmt.Sprintf("--log-level %q: want debug, info, warn or error", c.String("log-level")), 2)
	}
	if n := c.Int64("max-body-bytes"); n <= 0 {
		return cli.Exit(fmt.Sprintf("--max-body-bytes %d: want > 0", n), 2)
	}
	if n := c.Int("max-ranks"); n <= 0 {
		return cli.Exit(fmt.Sprintf("--max-ranks %d: want > 0", n), 2)
	}
	if n := c.Int64("max-snapshot-bytes"); n < 0 {
		return cli.Exit(fmt.Sprintf("--max-snapshot-bytes %d: want >= 0 (0: no limit)", n), 2)
	}
	if err := eventplane.CheckSubject(c.String("events-subject")); err != nil {
		return cli.Exit(fmt.Sprintf("--events-subject: %v", err), 2)
	}
	if err := checkDurations(c); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	sec, err := loadSecurity(c)
	if err != nil {
		return cli.Exit(err.Error(), 2)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	slog.SetDefault(logger)
	if sec.token != "" && sec.serverTLS == nil {
		logger.Warn("the API asks for a token, and sends it in clear text: give --tls-cert and --tls-key too")
	}

	id, raftAddr, httpAddr := c.String("node-id"), c.String("raft-addr"), c.String("http-addr")
	// Refused here, before the data directory's lock touches anything: an
	// empty --data-dir would lock (and leave a LOCK file in) the working
	// directory.
	if strings.TrimSpace(id) == "" {
		return cli.Exit("--node-id is empty: give this node's id (unique in its cluster)", 2)
	}
	// An id the members API refuses could not join (the join asks the API
	// to add it), nor be removed or made leader through it.
	if why := limits.ID(id); why != "" {
		return cli.Exit(fmt.Sprintf("--node-id %s: give an id of at most %d bytes of UTF-8 with no control character, as the members API takes", why, limits.MaxIDLen), 2)
	}
	if strings.TrimSpace(c.String("data-dir")) == "" {
		return cli.Exit("--data-dir is empty: give the directory that holds this node's state", 2)
	}
	if err := checkAddrs(c); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if u := c.String("nats-url"); u != "" {
		if err := eventplane.CheckNATSURLs(u); err != nil {
			return cli.Exit(fmt.Sprintf("--nats-url %q: %v", eventplane.RedactURLs(u), err), 2)
		}
	}
	if _, err := natsRoutes(c.String("nats-routes")); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if err := checkNATSFlags(c); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if err := checkNATSFiles(c); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	peers, err := parsePeers(c.String("peers"))
	if err != nil {
		return cli.Exit(err.Error(), 2)
	}
	via, err := parseJoin(c.String("join"))
	if err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if err := checkJoinScheme(via, sec.scheme()); err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if len(peers) > 0 && len(via) > 0 {
		return cli.Exit("--peers bootstraps a new cluster and --join joins an existing one: give one of them", 2)
	}
	listenAddr := httpAddr
	// From here httpAddr is the advertised address: what the member table
	// lists, --peers must give and a join asks the cluster to add.
	httpAddr, err = httpAdvertise(listenAddr, c.String("http-advertise"), len(peers) > 0 || len(via) > 0)
	if err != nil {
		return cli.Exit(err.Error(), 2)
	}
	if len(via) > 0 {
		if via, err = joinOthers(via, c.String("join"), listenAddr, httpAddr); err != nil {
			return cli.Exit(err.Error(), 2)
		}
	}
	defaultPeers := false
	switch {
	case len(peers) > 0:
		if err := checkPeers(peers, id, raftAddr, httpAddr); err != nil {
			return cli.Exit(err.Error(), 2)
		}
	case len(via) == 0:
		// The single-node default bootstraps only an empty directory: on
		// one with Raft state (a member of a larger cluster restarted
		// without --peers) or a seeded one, the node neither compares it
		// with the stored configuration nor warns of it (DefaultPeers).
		peers = []raftfsm.Member{{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr}}
		defaultPeers = true
	}
	// The node runs until SIGINT or SIGTERM, or until the app's context
	// ends (tests run the app with one). The signals are taken from here,
	// before anything is opened: one that comes while the state loads
	// (seconds for millions of blocks, /healthz answering already) is a
	// shutdown like any other, not the default exit (143) that would leave
	// Pebble and the embedded NATS server unclosed. NewNode cannot be
	// interrupted: it finishes loading, and the node then shuts down at
	// once, the wait below finding ctx done. Once a signal came, the next
	// one kills the process as a signal does by default (AfterFunc): a
	// start or a shutdown that hangs can still be stopped.
	ctx, stop := signal.NotifyContext(c.Context, os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stop)
	// A connection to an external NATS that nats.go closes for good (the
	// server refused the credentials twice in a row), or whose --nats-creds
	// file went bad, stops the node with an error (natswatch.ErrClosed,
	// natswatch.ErrCreds), so that its supervisor restarts it:
	// it would run on, looking healthy, with an ingester and a heartbeat
	// answerer that hear nothing, and the workers' leases would run out.
	ctx, lost := context.WithCancelCause(ctx)
	defer lost(nil)
	// The data directory's lock before anything listens: a second kvrouter
	// on it (the same command line started twice) says the directory is
	// held, not that a port is in use. The node takes the lock over.
	dirLock, err := raftfsm.LockDataDir(c.String("data-dir"))
	if err != nil {
		return err
	}
	defer dirLock.Close() // a no-op once the node took it
	// Listen first, so that a port in use is a clear error before Raft
	// starts, and answer at once: while the state loads (seconds for
	// millions of blocks) /healthz is 200 and everything else a 503
	// not_ready, rather than connections that hang.
	ln, err := sec.listen(listenAddr)
	if err != nil {
		return fmt.Errorf("http listen on %s: %w", listenAddr, err)
	}
	var handler atomic.Pointer[http.Handler]
	handler.Store(&startingHandler)
	current := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*handler.Load()).ServeHTTP(w, r) })
	// Counted from the first connection, registered with the others once
	// the node is up.
	handshakes := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_http_tls_handshake_errors_total",
		Help: "Connections to the node's HTTP ports (--http-addr, --selection-addr) whose TLS handshake failed: plain-HTTP clients, port scans, TCP health checks, clients that distrust the certificate. Logged at most once a minute."})
	hsFlight := &inFlight{}
	hs := newHTTPServer(hsFlight.wrap(current), httpErrorLog(logger, ln.Addr().String(), handshakes))
	servers := []servedPort{{hs, ln.Addr().String(), hsFlight}}
	closeServers := func() {
		for _, s := range servers {
			s.srv.Close()
		}
	}
	serveErr := make(chan error, 2)
	go func() { serveErr <- hs.Serve(ln) }()
	// The other listeners too, before Raft starts: a node that cannot
	// serve events should not take part in an election first. The
	// selection API's is served at once too, through the same handler
	// swap: 503 not_ready while the state loads, not connections that
	// hang.
	if a := c.String("selection-addr"); a != "" {
		sln, err := sec.listen(a)
		if err != nil {
			closeServers()
			return fmt.Errorf("selection API listen on %s: %w", a, err)
		}
		sFlight := &inFlight{}
		shs := newHTTPServer(sFlight.wrap(compat.SelectionHandler(current)), httpErrorLog(logger, sln.Addr().String(), handshakes))
		servers = append(servers, servedPort{shs, sln.Addr().String(), sFlight})
		go func() { serveErr <- shs.Serve(sln) }()
		logger.Info("selection API listening", "http", sec.scheme()+"://"+sln.Addr().String())
	}
	if serving != nil {
		serving(servers)
	}
	// Counted from the connection's start, registered with the others
	// once the node is up.
	slowConsumers := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_nats_slow_consumer_total",
		Help: "Reports of a subscription of the node's NATS connection (events, dumps, heartbeats) falling behind, messages dropped for it: nats.go reports again each time the subscription has taken a message since, so one that stays behind counts about once per message it takes."})
	// The embedded server's refusals of credentials, logged at most once
	// a minute: the count is here.
	authFailures := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_nats_authentication_failures_total",
		Help: "Clients and routes the embedded NATS server refused for their credentials (--nats-user, --nats-password); logged at most once every 50 s. 0 with --nats-url."})
	nc, closeNATS, err := startNATS(c, id, logger, lost, slowConsumers, authFailures)
	if err != nil {
		closeServers()
		return err
	}
	cfg := nodeConfig(c, peers, httpAddr, logger)
	cfg.DataDirLock = dirLock
	cfg.DefaultPeers = defaultPeers
	if beforeLoad != nil {
		beforeLoad()
	}
	node, err := raftfsm.NewNode(cfg)
	if err != nil {
		closeNATS()
		closeServers()
		return err
	}
	if ctx.Err() != nil && c.Context.Err() == nil && natswatch.Ended(ctx) == nil {
		logger.Info("a signal came while the state loaded: the node stops once started")
	}
	// A directory that holds a cluster starts as it is, without --peers or
	// --join: its configuration, read now, tells whether other members
	// forward writes to this node's advertised address. Nothing can have
	// changed it yet (the API still answers not_ready), and the node does
	// not list itself at an address they cannot dial anyway
	// (raftfsm.Node.selfUnlisted): this makes the mistake a usage error
	// rather than a log line.
	members := len(node.Raft().GetConfiguration().Configuration().Servers)
	if members > 1 {
		if _, err := httpAdvertise(listenAddr, c.String("http-advertise"), true); err != nil {
			node.Close()
			closeNATS()
			closeServers()
			return cli.Exit(fmt.Sprintf("%v (this node's cluster has %d members)", err, members), 2)
		}
	}
	// The same configuration tells whether this node has others to route
	// NATS to: a member restarted without --peers or --join has.
	if (len(peers) > 1 || len(via) > 0 || members > 1) && c.String("nats-url") == "" && c.String("nats-cluster-addr") == "" {
		logger.Warn("the embedded NATS server is not clustered with the other nodes': an agent connected to this node reaches the leader's event ingester only while this node leads; give --nats-cluster-addr and --nats-routes (docs/events.md)")
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		raftfsm.NewCollector(node), buildInfo(), slowConsumers, authFailures, handshakes, natsConnectedGauge(nc))
	subject := c.String("events-subject")
	ing, err := eventplane.NewIngester(eventplane.IngesterConfig{Conn: nc, Node: node, Subject: subject, DumpSubject: subject + ".dump",
		Linger: c.Duration("events-linger"), UnregisteredGrace: c.Duration("unregistered-grace"), Registerer: reg, Logger: logger})
	if err != nil {
		node.Close()
		closeNATS()
		closeServers()
		return err
	}
	forwardTransport := sec.transport()
	defer forwardTransport.CloseIdleConnections()
	var handover *eventplane.Handover
	if d := c.Duration("nats-handover-after"); d > 0 {
		handover, err = eventplane.NewHandover(eventplane.HandoverConfig{Node: node, Connected: nc.IsConnected, After: d,
			PeerConnected: peerReadyWithNATS(forwardTransport, sec.scheme()), Registerer: reg, Logger: logger})
		if err != nil {
			ing.Close()
			node.Close()
			closeNATS()
			closeServers()
			return err
		}
	}
	srv := api.NewServer(node, api.Options{Logger: logger, Registerer: reg, Gatherer: reg,
		MaxBodyBytes: c.Int64("max-body-bytes"), MaxSnapshotBytes: c.Int64("max-snapshot-bytes"),
		Token: sec.token, ForwardTransport: forwardTransport, ForwardScheme: sec.scheme(), NATSConnected: nc.IsConnected,
		BodyTimeout: bodyTimeout})
	// The standard KV-indexer API at the root, beside /v1 (docs/compat.md).
	compat.NewIndexer(node, logger).Routes(srv, "")
	// The selection and reservation API under /selection: its GET /workers
	// is not the indexer API's.
	compat.NewSelection(node, logger).Routes(srv, compat.SelectionPrefix)
	// Engines registered through POST /register are followed by the leader.
	agentless := compat.NewAgentless(node, compat.AgentlessConfig{Registerer: reg, Logger: logger})
	var serving http.Handler = srv
	handler.Store(&serving) // the node loaded its state: both ports answer from here
	logger.Info("kvrouter listening", "http", sec.scheme()+"://"+ln.Addr().String(), "http_advertise", httpAddr, "raft", raftAddr, "data_dir", c.String("data-dir"))
	if err := raftfsm.CheckHTTPAddr(httpAddr); err != nil {
		// Only a node alone in its cluster gets here (a clustered one was
		// refused above): nobody forwards to it yet.
		logger.Warn("this node advertises an HTTP address other nodes cannot dial: harmless while it is its cluster's only member; "+
			"restart it with --http-advertise before adding a member, which would forward writes to that address", "http_advertise", httpAddr, "err", err)
	}

	var runErr error
	if len(via) > 0 {
		if err := joinCluster(ctx, logger, node, sec, via, id, raftAddr, httpAddr); err != nil && ctx.Err() == nil {
			runErr = fmt.Errorf("join via %s: %w", strings.Join(via, ","), err) // refused: stop rather than idle outside the cluster
		}
	}
	if runErr == nil {
		select {
		case <-ctx.Done():
		case err := <-serveErr:
			logger.Error("http server stopped", "err", err)
			runErr = fmt.Errorf("http server: %w", err)
		}
	}
	if err := natswatch.Ended(ctx); runErr == nil && err != nil {
		runErr = err
	}
	// From here a second signal kills the process at once, as a signal
	// does by default: a shutdown that hangs can still be stopped. (Once
	// a signal came, AfterFunc above did so already.)
	stop()
	logger.Info("shutting down")
	// Users of the node stop before it closes: the HTTP servers (their
	// requests drained for up to 5 s), the followers of agentless engines,
	// the event ingester (in-flight entries answered); then the node, then
	// NATS. The servers shut down together, under one deadline: each
	// Shutdown closes its listeners first and then waits for its
	// requests, so shut down in turn, a later port (--selection-addr)
	// kept taking new requests through the earlier ones' drain, and got
	// what was left of the deadline, none when a drain used it up.
	//
	// A drain the deadline cuts leaves its requests running: Shutdown
	// returns without them. Closed under them, the node would refuse what
	// they still ask, and a restore upload would leave its spool
	// (restore-*.snap, up to --max-snapshot-bytes) in the data directory,
	// its handler never reaching the deferred remove before the process
	// exits. So such a server is closed, which cuts its connections, and
	// its handlers, whose reads and writes then fail, are waited for a
	// little longer (cutWait) before the node closes.
	sctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	var drained sync.WaitGroup
	for _, s := range servers {
		drained.Go(func() { s.drain(sctx, cutWait, logger) })
	}
	drained.Wait()
	srv.Close()
	agentless.Close()
	if handover != nil {
		handover.Close()
	}
	ing.Close()
	if usersClosed != nil {
		usersClosed(node, nc)
	}
	err = node.Close()
	closeNATS()
	return cmp.Or(runErr, err)
}

// peerReadyWithNATS asks a member's /readyz, through rt (the transport
// that forwards writes to the leader: this node's TLS), whether it is
// ready and connected to NATS: the Handover's question before it hands
// the leadership to that member. A member of a build whose /readyz does
// not say (no nats field) is taken as not connected.
func peerReadyWithNATS(rt http.RoundTripper, scheme string) func(context.Context, raftfsm.Member) (bool, error) {
	hc := &http.Client{Transport: rt}
	return func(ctx context.Context, m raftfsm.Member) (bool, error) {
		cl, err := client.New([]string{m.HTTPAddr}, client.Options{HTTPClient: hc, Scheme: scheme, UserAgent: "kvrouter-handover"})
		if err != nil {
			return false, err
		}
		r, err := cl.Ready(ctx)
		if err != nil {
			return false, err
		}
		return r.Ready && r.NATS == "connected", nil
	}
}

// serving, when set (by tests), is called with the node's HTTP servers
// once they all serve, before NATS starts: a test checks their settings.
var serving func([]servedPort)

// beforeLoad, when set (by tests), runs right before the node loads its
// state: a test holds the load there.
var beforeLoad func()

// usersClosed, when set (by tests), runs at shutdown once the node's
// users (the HTTP servers, the agentless followers, the event ingester)
// closed, before the node and NATS close: a test checks the order there.
var usersClosed func(*raftfsm.Node, *nats.Conn)

// drainTimeout is how long the HTTP servers' requests in flight have, all
// ports together, once a shutdown begins; cutWait is how long the
// handlers of the requests the deadline cut (their connections closed)
// have after it to return before the node closes under them.
const (
	drainTimeout = 5 * time.Second
	cutWait      = 2 * time.Second
)

// Every HTTP server of the node (--http-addr, --selection-addr) gives a
// connection headerTimeout to send its request's header, and closes a
// keep-alive connection idle for idleTimeout (docs/api.md). It sets no
// read or write timeout: a body's 30 s bound is the API server's
// (api.Options.BodyTimeout, set for every request with a body, read or
// not), and a snapshot upload or download has none.
const (
	headerTimeout = 10 * time.Second
	idleTimeout   = 2 * time.Minute
)

// newHTTPServer returns the server of one of the node's ports, serving h,
// its own lines (a failed TLS handshake, a handler's panic) logged to
// errorLog (httpErrorLog).
func newHTTPServer(h http.Handler, errorLog *log.Logger) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout, ErrorLog: errorLog}
}

// httpLogEvery is how often a line of one kind from net/http is logged at
// most: with TLS, every connection whose handshake fails is one, at the
// rate of whoever connects.
const httpLogEvery = time.Minute

// httpErrorLog is the ErrorLog of the node's port at addr: logger's,
// rate-limited, its failed TLS handshakes counted in handshakes
// (lograte.HTTPServerLog). Without one, net/http logged a line per
// failed handshake, through the default logger at Info.
func httpErrorLog(logger *slog.Logger, addr string, handshakes prometheus.Counter) *log.Logger {
	return lograte.HTTPServerLog(logger.With("addr", addr), httpLogEvery, handshakes)
}

// A servedPort is one of the node's HTTP servers, the address it listens
// at, and its handlers running.
type servedPort struct {
	srv    *http.Server
	addr   string
	flight *inFlight
}

// drain shuts s down: its listener closes and its requests in flight
// have until sctx ends. Those still running then are cut (their
// connections closed) and have up to wait more to return, a warning
// saying how many were cut and how many still ran after the wait.
func (s servedPort) drain(sctx context.Context, wait time.Duration, logger *slog.Logger) {
	err := s.srv.Shutdown(sctx)
	if err == nil {
		return
	}
	cut := s.flight.running()
	s.srv.Close()
	wctx, wcancel := context.WithTimeout(context.Background(), wait)
	defer wcancel()
	left := s.flight.wait(wctx)
	logger.Warn("the HTTP port's drain did not finish: its requests still running were cut (their connections closed)",
		"addr", s.addr, "cut", cut, "still_running_after_cut", left, "drain", drainTimeout, "err", err)
}

// inFlight counts the handlers of a server that are running, so that a
// shutdown whose drain ran out of time can wait for those it cut:
// http.Server.Shutdown stops waiting for them at its deadline, and Close
// does not wait at all.
type inFlight struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed while n is 0; nil before the first request
}

// wrap is h, counted.
func (f *inFlight) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		if f.n++; f.n == 1 {
			f.idle = make(chan struct{})
		}
		f.mu.Unlock()
		defer func() {
			f.mu.Lock()
			if f.n--; f.n == 0 {
				close(f.idle)
			}
			f.mu.Unlock()
		}()
		h.ServeHTTP(w, r)
	})
}

// running is how many handlers run now.
func (f *inFlight) running() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// wait waits until no handler runs, or until ctx ends, and returns how
// many still run.
func (f *inFlight) wait(ctx context.Context) int {
	for {
		f.mu.Lock()
		n, idle := f.n, f.idle
		f.mu.Unlock()
		if n == 0 {
			return 0
		}
		select {
		case <-idle:
		case <-ctx.Done():
			return f.running()
		}
	}
}

// The bounds of --booking-max-age. Below a second every booking would be
// swept at the leader's next sweep (every 10 s), however long its request
// runs; over a day, a request never freed would count as load, and every
// freed id would be kept, for longer than any request runs.
const (
	minBookingMaxAge = time.Second
	maxBookingMaxAge = 24 * time.Hour
)

// nodeConfig is the node's configuration from the flags (checked by run),
// with the bootstrap peers (none when joining) and the advertised HTTP
// address (httpAdvertise).
func nodeConfig(c *cli.Context, peers []raftfsm.Member, httpAdvertised string, logger *slog.Logger) raftfsm.Config {
	return raftfsm.Config{
		ID: c.String("node-id"), RaftAddr: c.String("raft-addr"), HTTPAddr: httpAdvertised, DataDir: c.String("data-dir"), Peers: peers,
		HeartbeatTimeout: c.Duration("heartbeat-timeout"), ElectionTimeout: c.Duration("election-timeout"),
		LeaderLeaseTimeout: c.Duration("leader-lease-timeout"),
		SnapshotThreshold:  c.Uint64("snapshot-threshold"), SnapshotBytes: c.Int64("snapshot-bytes"), SilentAfter: c.Duration("silent-after"), BookingMaxAge: c.Duration("booking-max-age"),
		MaxRanks: c.Int("max-ranks"), ClusterName: c.String("cluster-name"), Logger: logger,
	}
}

// parseJoin parses --join: members' HTTP addresses, host:port (or
// http(s)://host:port, as the client takes them), comma-separated; empty
// entries are skipped. A --join that lists no address (" , ") is refused:
// taken for none, the node would bootstrap a cluster of its own.
func parseJoin(s string) ([]string, error) {
	if s == "" {
		return nil, nil
	}
	var via []string
	for _, e := range strings.Split(s, ",") {
		if e = strings.TrimSpace(e); e != "" {
			via = append(via, e)
		}
	}
	if len(via) == 0 {
		return nil, fmt.Errorf("--join %q lists no address: want host:port,... (members' --http-addr)", s)
	}
	// The join client's own check: an entry taken here and refused by the
	// client would fail only once the node locked its directory and
	// started listening (exit 1, not a usage error). Its error, and the
	// list shown, hide the password of an entry with user information.
	if err := client.CheckEndpoints(via); err != nil {
		return nil, fmt.Errorf("--join %q: %v (a member's --http-addr, or a comma-separated list of them)", client.RedactEndpoints(s), err)
	}
	return via, nil
}

// joinOthers returns the entries of via (--join, given as join) that are
// not this node's own HTTP address (listen, its --http-addr, or
// advertised, the address it advertises; raftfsm.SameRaftAddr: as
// dialled, a hostname as text), and refuses a --join that lists only
// those: the node would ask itself to add it, which answers no_leader,
// every second for ever. A list that names this node among others (one
// configuration for every node) is taken, the node not asking itself.
func joinOthers(via []string, join, listen, advertised string) ([]string, error) {
	var others []string
	for _, e := range via {
		if !isSelf(e, listen, advertised) {
			others = append(others, e)
		}
	}
	if len(others) == 0 {
		return nil, fmt.Errorf("--join %q lists only this node's own address (--http-addr %s, advertised as %s): "+
			"give the addresses of members of the cluster to join (their --http-addr), or leave --join out to start a cluster of this node",
			client.RedactEndpoints(join), listen, advertised)
	}
	return others, nil
}

// isSelf reports whether the --join entry e (host:port, or a URL as the
// join client takes them) is listen or advertised, or reaches listen on
// this machine: its port, and a loopback host (localhost included) where
// listen's host is a loopback or a wildcard, or an address of one of this
// machine's interfaces where listen is a wildcard (0.0.0.0:P is reached
// at 127.0.0.1:P and at the host's own addresses). Another host on the
// same port, the usual cluster, is not this node.
func isSelf(e, listen, advertised string) bool {
	if _, rest, ok := strings.Cut(e, "://"); ok {
		e = rest
	}
	e = strings.TrimSuffix(e, "/")
	if i := strings.LastIndex(e, "@"); i >= 0 {
		e = e[i+1:]
	}
	if raftfsm.SameRaftAddr(e, listen) || raftfsm.SameRaftAddr(e, advertised) {
		return true
	}
	he, hl, ok := listenaddr.SamePort(e, listen)
	if !ok {
		return false
	}
	il, okL := listenaddr.IP(hl)
	wildcard := hl == "" || (okL && il.IsUnspecified())
	ie, okE := listenaddr.IP(he)
	if strings.EqualFold(strings.TrimSuffix(he, "."), "localhost") {
		ie, okE = netip.AddrFrom4([4]byte{127, 0, 0, 1}), true
	}
	switch {
	case !okE:
		return false // a hostname: compared as text above
	case ie.IsLoopback():
		return wildcard || (okL && il.IsLoopback())
	case wildcard:
		return isLocalAddr(ie)
	}
	return false
}

// isLocalAddr reports whether ip is an address of one of this machine's
// interfaces; false when they cannot be listed.
func isLocalAddr(ip netip.Addr) bool {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if p, ok := a.(*net.IPNet); ok {
			if la, ok := netip.AddrFromSlice(p.IP); ok && la.Unmap() == ip {
				return true
			}
		}
	}
	return false
}

// checkJoinScheme refuses a --join entry whose scheme (http:// or
// https://, in any case) is not scheme, the one this node serves: the
// nodes of a cluster all serve TLS or none does, and a follower forwards
// to its leader with its own scheme, so such a node joins no cluster it
// works with. Taken, it locked its data directory, listened, and asked
// the members over the other scheme for ever while they did not answer.
// An entry without a scheme is asked with the node's own.
func checkJoinScheme(via []string, scheme string) error {
	for _, e := range via {
		s, _, ok := strings.Cut(e, "://")
		if !ok || strings.EqualFold(s, scheme) {
			continue
		}
		if scheme == "https" {
			return fmt.Errorf("--join %q: this node serves TLS (--tls-cert), and the nodes of a cluster all serve TLS or none does: "+
				"give the members' https:// addresses, or start this node without --tls-cert as its members run", client.RedactEndpoint(e))
		}
		return fmt.Errorf("--join %q: this node serves plain HTTP (no --tls-cert), and the nodes of a cluster all serve TLS or none does: "+
			"give this node --tls-cert, --tls-key and --tls-ca as its members have, or the members' http:// addresses", client.RedactEndpoint(e))
	}
	return nil
}

// checkAddrs refuses the address flags that cannot be listened on
// (host:port, the port a number or a service name, as net.Listen takes
// them; for --nats-addr and --nats-cluster-addr a number only, as the
// embedded server takes them: eventplane.CheckServerAddr), and a --raft-addr that peers cannot dial (no host, a wildcard
// such as 0.0.0.0, or port 0, which listens on a port the kernel picks:
// it is the address the cluster's configuration lists this node at), with
// a message that names the flag: a usage error (exit
// 2) before the data directory's lock, NATS and the state are touched;
// and two of them on one address (listenaddr.Same), which cannot both
// listen. The NATS addresses are checked only for the embedded server (no
// --nats-url).
func checkAddrs(c *cli.Context) error {
	flags := []string{"raft-addr", "http-addr"}
	if c.String("selection-addr") != "" {
		flags = append(flags, "selection-addr")
	}
	if c.String("nats-url") == "" {
		flags = append(flags, "nats-addr")
		if c.String("nats-cluster-addr") != "" {
			flags = append(flags, "nats-cluster-addr")
		}
	}
	for _, f := range flags {
		if err := checkAddr(f, c.String(f)); err != nil {
			return err
		}
	}
	// Two listeners on one address: the second's listen would fail only
	// once the data directory was locked and its stores made (exit 1,
	// "address already in use"), where the flags alone say it cannot run.
	for i, a := range flags {
		for _, b := range flags[i+1:] {
			if listenaddr.Same(c.String(a), c.String(b)) {
				return fmt.Errorf("--%s %q and --%s %q: the same address, on which only one can listen: give each its own port",
					a, c.String(a), b, c.String(b))
			}
		}
	}
	return nil
}

// checkNATSFlags refuses the NATS flags that the node would ignore, or that
// would not do what they say, given with the others (docs/events.md): a
// usage error (exit 2) naming the flag, before the data directory is
// touched. From a review: the embedded server ran without TLS with
// --nats-tls-ca alone, and let every client in with --nats-password alone;
// --nats-creds and, with --nats-url, the embedded server's flags were
// dropped without a word; and so were --nats-user and --nats-password with
// a --nats-url that carries user information, which nats.go sends instead
// of them (a user alone, as a token); and a --node-id with a space
// failed the embedded server's start, which takes it for its name, once
// the data directory was locked. run checked --nats-url and
// --nats-routes before.
func checkNATSFlags(c *cli.Context) error {
	user, password := c.String("nats-user"), c.String("nats-password")
	cert, key, ca := c.String("nats-tls-cert"), c.String("nats-tls-key"), c.String("nats-tls-ca")
	if (cert == "") != (key == "") {
		return errors.New("--nats-tls-cert and --nats-tls-key go together: give both, or neither")
	}
	if urls := c.String("nats-url"); urls != "" {
		// An empty value configures nothing (a template that renders
		// KVROUTER_NATS_ROUTES empty): only a value is refused, as the
		// embedded server's checks read them. --nats-addr has a default,
		// which only a value given explicitly replaces.
		routes, _ := natsRoutes(c.String("nats-routes"))
		for _, f := range []struct {
			name string
			set  bool
		}{
			{"nats-addr", c.IsSet("nats-addr") && c.String("nats-addr") != ""},
			{"nats-cluster-addr", c.String("nats-cluster-addr") != ""},
			{"nats-routes", len(routes) > 0},
		} {
			if f.set {
				return fmt.Errorf("--%s configures the embedded NATS server, which --nats-url replaces: give one or the other", f.name)
			}
		}
		return eventplane.ClientOptions{User: user, Password: password, TLSCA: ca, TLSCert: cert, TLSKey: key}.Check(urls)
	}
	routes, _ := natsRoutes(c.String("nats-routes"))
	// The embedded server is named after the node (--node-id), and
	// refuses a name that limits.ID takes: one with a space.
	if err := eventplane.CheckServerName(c.String("node-id")); err != nil {
		return fmt.Errorf("--node-id %q: %w; give an id without one, or use an external NATS (--nats-url)", c.String("node-id"), err)
	}
	switch {
	case password != "" && user == "":
		return errors.New("--nats-password needs --nats-user: the embedded server asks its clients for credentials only when it has a user " +
			"(with a password alone, it lets every client in)")
	case user != "" && password == "":
		// nats-server compares the client's password with an empty one:
		// the user name alone, which is no secret, would let a client in.
		return errors.New("--nats-user needs --nats-password: the embedded server given a user and no password lets in any client " +
			"that names the user")
	case ca != "" && cert == "":
		return errors.New("--nats-tls-ca makes the embedded server require client certificates that CA signed, over TLS: " +
			"it needs --nats-tls-cert and --nats-tls-key, the server's certificate")
	case c.String("nats-creds") != "":
		return errors.New("--nats-creds is a credentials file for an external NATS (--nats-url): " +
			"the embedded server asks its clients for --nats-user and --nats-password")
	case len(routes) > 0 && c.String("nats-cluster-addr") == "":
		return errors.New("--nats-routes needs --nats-cluster-addr: the embedded server routes to the other nodes' only when it listens for routes itself")
	}
	return nil
}

// checkAddr says what is wrong with the value of the address flag named
// flag (checkAddrs), nil when nothing is. --raft-addr is checked by
// raftfsm.CheckRaftAddr, as every --peers entry's Raft address is
// (raftfsm.ParsePeers, here and in kvctl's offline seed).
func checkAddr(flag, addr string) error {
	if flag == "raft-addr" {
		if err := raftfsm.CheckRaftAddr(addr); err != nil {
			return fmt.Errorf("--raft-addr %w", err)
		}
		// CheckRaftAddr takes port 0 (a lone node at host:0 runs: nobody
		// dials it), but --raft-addr is what the configuration lists this
		// node at, and a port the kernel picks is one no peer can dial.
		if _, port, _ := net.SplitHostPort(addr); port != "" {
			if p, err := net.LookupPort("tcp", port); err == nil && p == 0 {
				return fmt.Errorf("--raft-addr %q: port 0 listens on a port the kernel picks, and peers cannot dial it: "+
					"give this node's own address, as its peers dial it (host:port, a port from 1 to 65535)", addr)
			}
		}
		return nil
	}
	if flag == "nats-addr" || flag == "nats-cluster-addr" {
		// The embedded server's own parse: a port number only.
		if err := eventplane.CheckServerAddr(addr); err != nil {
			return fmt.Errorf("--%s %q: %v: want host:port, the port a number from 0 to 65535 (0: one the kernel picks)", flag, addr, err)
		}
		return nil
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--%s %q: %v: want host:port", flag, addr, err)
	}
	if _, err := net.LookupPort("tcp", port); err != nil {
		return fmt.Errorf("--%s %q: port %q: want a number from 0 to 65535", flag, addr, port)
	}
	return nil // port 0 listens on a port the kernel picks, which the log shows
}

// httpAdvertise returns the HTTP address the node advertises: the member
// table lists it, and followers forward writes to it while the node leads.
// It is advertise (--http-advertise), or listen (--http-addr) when that is
// empty. One the other nodes cannot dial (raftfsm.CheckHTTPAddr: a
// wildcard reaches the forwarding node's own host, port 0 a port the
// kernel picks) is refused when given as --http-advertise, and when the
// node is clustered (--peers or --join, or, checked again once the node
// opened its directory, a configuration of more than one server); a lone
// node may advertise its --http-addr whatever it is (nobody forwards to
// it; run logs a warning).
// The error names the flag first, for a usage error.
func httpAdvertise(listen, advertise string, clustered bool) (string, error) {
	if advertise != "" {
		if err := raftfsm.CheckHTTPAddr(advertise); err != nil {
			return "", fmt.Errorf("--http-advertise %w", err)
		}
		return advertise, nil
	}
	if clustered {
		if err := raftfsm.CheckHTTPAddr(listen); err != nil {
			return "", fmt.Errorf("--http-addr %w; the other nodes forward writes to this address: "+
				"to listen on it, give --http-advertise, the address they reach this node at", err)
		}
	}
	return listen, nil
}

// checkDurations refuses the timing flags that Raft or the event plane
// would take for their defaults (zero or below) or refuse only once the
// node has started (Raft's own bounds), and a --booking-max-age outside
// [minBookingMaxAge, maxBookingMaxAge], with a message that names the
// flag: a usage error (exit 2), not a failed start.
func checkDurations(c *cli.Context) error {
	const raftMin = 5 * time.Millisecond // raft.ValidateConfig's floor
	hb, el, lease := c.Duration("heartbeat-timeout"), c.Duration("election-timeout"), c.Duration("leader-lease-timeout")
	switch {
	case hb < raftMin:
		return fmt.Errorf("--heartbeat-timeout %v: want at least %v", hb, raftMin)
	case el < hb:
		return fmt.Errorf("--election-timeout %v: want at least --heartbeat-timeout (%v)", el, hb)
	case lease != 0 && (lease < raftMin || lease > hb):
		return fmt.Errorf("--leader-lease-timeout %v: want between %v and --heartbeat-timeout (%v), or 0 for the heartbeat timeout", lease, raftMin, hb)
	}
	for _, name := range []string{"silent-after", "events-linger", "unregistered-grace"} {
		if d := c.Duration(name); d <= 0 {
			return fmt.Errorf("--%s %v: want > 0", name, d)
		}
	}
	if d := c.Duration("nats-handover-after"); d < 0 {
		return fmt.Errorf("--nats-handover-after %v: want > 0, or 0 for never", d)
	}
	if d := c.Duration("booking-max-age"); d < minBookingMaxAge || d > maxBookingMaxAge {
		return fmt.Errorf("--booking-max-age %v: want between %v and %v", d, minBookingMaxAge, maxBookingMaxAge)
	}
	if c.Uint64("snapshot-threshold") == 0 {
		return errors.New("--snapshot-threshold 0: want > 0")
	}
	if c.Int64("snapshot-bytes") == 0 {
		return errors.New("--snapshot-bytes 0: want > 0, or negative for never")
	}
	return nil
}

// startNATS connects to the external NATS (--nats-url, checked by run)
// or starts the embedded server and connects to it in process, and
// returns the connection and what closes it (and the embedded server).
// A subscription that falls behind is logged and counted in slow
// (natswatch.ErrorHandler); the embedded server's refusals of credentials
// in authFailures (nil: not counted). A NATS server not up yet is waited for. The
// external connection is logged as it comes and goes, and lost is called
// when nats.go closes it for good, or when the --nats-creds file holds no
// credentials as it reconnects, which nats.go would retry for ever
// (natswatch). Its log and errors show no password of --nats-url
// (eventplane.RedactURLs).
func startNATS(c *cli.Context, id string, logger *slog.Logger, lost context.CancelCauseFunc, slow, authFailures prometheus.Counter) (*nats.Conn, func(), error) {
	if url := c.String("nats-url"); url != "" {
		w := natswatch.New(logger, lost, natswatch.Texts{Who: "the node",
			Unreachable: "check --nats-url, and that the NATS server is up", Lost: "no event is ingested, and no heartbeat answered,"})
		o := eventplane.ClientOptions{Name: "kvrouter-" + id, User: c.String("nats-user"), Password: c.String("nats-password"),
			Creds: c.String("nats-creds"), TLSCA: c.String("nats-tls-ca"), TLSCert: c.String("nats-tls-cert"), TLSKey: c.String("nats-tls-key"),
			OnCredsError: w.CredsError}
		// A NATS not up yet (started beside the nodes) is waited for, as a
		// lost connection is and as kvagent waits for it: the node starts,
		// hearing nothing until it answers, and the wait is logged (the
		// first try that fails, the connection made). Failing the start
		// made the node's supervisor restart it, its state loaded again,
		// until NATS was up.
		opts := append(o.NATSOptions(), nats.RetryOnFailedConnect(true), w.ErrorHandler(slow))
		nc, err := nats.Connect(url, append(opts, w.Options()...)...)
		if err != nil {
			return nil, nil, fmt.Errorf("connect to nats %s: %w", eventplane.RedactURLs(url), err)
		}
		connected := eventplane.RedactURLs(nc.ConnectedUrl())
		if connected == "" {
			connected = "waiting"
		}
		logger.Info("events over external NATS", "urls", eventplane.RedactURLs(url), "connected", connected)
		// A NATS that never answers (a wrong --nats-url) or stays lost is
		// logged at Error every natswatch.RemindEvery: the node starts,
		// reads ready and may lead while it hears nothing.
		remind, stopRemind := context.WithCancel(context.Background())
		go w.Remind(remind)
		return nc, func() { stopRemind(); w.Closing(); nc.Close() }, nil
	}
	opts := eventplane.ClientOptions{Name: "kvrouter-" + id, User: c.String("nats-user"), Password: c.String("nats-password")}.NATSOptions()
	opts = append(opts, natswatch.ErrorHandler(logger, slow))
	routes, err := natsRoutes(c.String("nats-routes"))
	if err != nil {
		return nil, nil, err
	}
	s, err := eventplane.StartServer(eventplane.ServerConfig{Name: id, Addr: c.String("nats-addr"),
		ClusterAddr: c.String("nats-cluster-addr"), Routes: routes,
		User: c.String("nats-user"), Password: c.String("nats-password"),
		TLSCert: c.String("nats-tls-cert"), TLSKey: c.String("nats-tls-key"), TLSCA: c.String("nats-tls-ca"),
		AuthFailures: authFailures, Logger: logger})
	if err != nil {
		return nil, nil, err
	}
	nc, err := nats.Connect("", append(opts, nats.InProcessServer(s))...)
	if err != nil {
		s.Shutdown()
		return nil, nil, fmt.Errorf("connect to the embedded nats: %w", err)
	}
	logger.Info("embedded NATS listening", "clients", s.ClientURL(), "cluster", c.String("nats-cluster-addr"))
	return nc, func() { nc.Close(); s.Shutdown() }, nil
}

// natsConnectedGauge is kvrouter_nats_connected: 1 while nc is connected
// (to the embedded server, or to --nats-url), 0 while it is not (the
// first connection not made yet, or one lost and being made again), when
// the node, leading, ingests no event and answers no heartbeat.
func natsConnectedGauge(nc *nats.Conn) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvrouter_nats_connected",
		Help: "1 while the node's NATS connection is up, 0 while it is not (the leader then ingests no event and answers no heartbeat)."},
		func() float64 {
			if nc.IsConnected() {
				return 1
			}
			return 0
		})
}

// natsRoutes parses --nats-routes: the other nodes' NATS route addresses,
// comma-separated, each checked as the embedded server takes it
// (eventplane.CheckRoutes, whose messages show no route's user
// information); empty entries are skipped. run checks it before
// the data directory is touched: a route nats-server cannot parse (a list
// separated by spaces) crashed the process once its server started.
func natsRoutes(s string) ([]string, error) {
	routes, err := eventplane.CheckRoutes(s)
	if err != nil {
		return nil, fmt.Errorf("--nats-routes %w (other nodes' --nats-cluster-addr, comma-separated)", err)
	}
	return routes, nil
}

// joinCluster asks the members at via (in turn) to add this node (join), unless the
// node is the only member of the cluster its data directory holds
// (raftfsm.Node.OnlyMember: it joined a cluster and the others were
// removed, and it started again with its --join flags). That node is its
// cluster: it must not ask another to add it. Added there, it would follow
// no leader of that cluster, which would gain a voter that never votes (a
// cluster of one could no longer commit), as when the address --join
// names now serves another cluster. The join is skipped with a warning.
func joinCluster(ctx context.Context, logger *slog.Logger, node interface{ OnlyMember() bool }, sec security, via []string, id, raftAddr, httpAddr string) error {
	if node.OnlyMember() {
		logger.Warn("this node is the only member of the cluster it holds; --join ignored: drop --join from its command line "+
			"(docs/operations.md, Remove a node)", "join", strings.Join(via, ","))
		return nil
	}
	return join(ctx, sec, via, id, raftAddr, httpAddr)
}

// join asks the members at via to add this node, each in turn until one
// answers (client.Client), retrying until it is accepted or ctx ends (the
// cluster may be electing). Each try of a member is bounded (a connect
// timeout, and a share of the attempt for the answer's headers), as
// kvagent's registrations are: a member that accepts connections and
// never answers (wedged) costs its share, and the next one is asked,
// where it took every attempt whole and the node never joined.
func join(ctx context.Context, sec security, via []string, id, raftAddr, httpAddr string) error {
	perTry := joinAttempt / time.Duration(len(via))
	tr := sec.transport()
	tr.DialContext = (&net.Dialer{Timeout: min(perTry, time.Second), KeepAlive: 30 * time.Second}).DialContext
	tr.TLSHandshakeTimeout = perTry // not the transport's 10 s: a hung member costs one try's share
	tr.ResponseHeaderTimeout = perTry
	defer tr.CloseIdleConnections()
	accepted := &successFrom{RoundTripper: tr}
	cl, err := client.New(via, client.Options{HTTPClient: &http.Client{Transport: accepted}, Token: sec.token, Scheme: sec.scheme()})
	if err != nil {
		return err
	}
	defer cl.Close()
	for {
		actx, cancel := context.WithTimeout(ctx, joinAttempt)
		err := cl.AddMember(actx, id, raftAddr, httpAddr)
		cancel()
		if err == nil {
			slog.Info("joined the cluster", "via", accepted.last())
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err() // the node is stopping: the join ends, it is not retried
		}
		if errors.Is(err, raftfsm.ErrInvalid) {
			return err // the cluster refused this node as it is (an id taken at another address)
		}
		if why := refusedJoin(err); why != "" {
			return fmt.Errorf("%w; %s", err, why) // no retry would be let in
		}
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, client.ErrOutcomeUnknown) {
			// No answer in time: the leader adds a node as a non-voter
			// and answers once it has caught up, and asking again
			// resumes that wait; or a member is hung (the error names
			// the members that timed out), and the next one is asked.
			slog.Info("join: timed out waiting for an answer (a leader answers once this node has caught up, a non-voter until then); asking again",
				"via", strings.Join(via, ","), "err", err)
		} else {
			slog.Warn("join: retrying", "via", strings.Join(via, ","), "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// successFrom is a transport that records the address of the last
// endpoint that answered a request with a success: join's member that
// accepted it, not every member --join lists (one of them may be down).
type successFrom struct {
	http.RoundTripper
	mu   sync.Mutex
	host string
}

func (s *successFrom) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.RoundTripper.RoundTrip(r)
	if err == nil && resp.StatusCode/100 == 2 {
		s.mu.Lock()
		s.host = r.URL.Host
		s.mu.Unlock()
	}
	return resp, err
}

func (s *successFrom) last() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.host
}

// bodyTimeout is the API server's body timeout (api.Options.BodyTimeout,
// docs/api.md's 30 s); lowered by tests, which wait for it to pass.
var bodyTimeout = api.DefaultBodyTimeout

// joinAttempt bounds each of join's asks, all members together; lowered
// by tests.
var joinAttempt = 10 * time.Second

// refusedJoin says what to do when a join failed for this node's own
// token or TLS settings, which retrying does not change: "" otherwise. An
// answer is read by its status only: its text may be another node's (a
// follower's forward to its leader that failed its own TLS check), which
// a retry through a new leader gets past. Transport errors are this
// node's own dial: a certificate refused is read by its x509 error
// (client.CertificateHint), the rest by their text.
func refusedJoin(err error) string {
	var ae *client.Error
	if errors.As(err, &ae) {
		switch {
		case errors.Is(err, client.ErrUnauthorized):
			return "give this node the cluster's token (--token or --token-file)"
		case ae.StatusCode == http.StatusBadRequest && ae.Reason == "" && strings.Contains(ae.Message, "HTTP request to an HTTPS server"):
			return "the cluster serves TLS: give this node --tls-cert, --tls-key and --tls-ca as its members have"
		}
		return ""
	}
	if why := client.CertificateHint(err, "--tls-ca"); why != "" {
		return why // the member's certificate, which this node's handshake refused
	}
	msg := err.Error()
	switch { // errors that lost the x509 error, by its text
	case strings.Contains(msg, "x509: certificate is valid for"):
		return "the member's certificate does not name the address --join gives: join through the address it names"
	case strings.Contains(msg, "x509:"):
		return "the member's certificate is not trusted: give --tls-ca with the CA that signed it"
	case strings.Contains(msg, "server gave HTTP response to HTTPS client"):
		return "the cluster serves plain HTTP: start this node without --tls-cert, as its members run"
	}
	return ""
}

// startingHandler answers while the node starts (run): alive, not ready.
var startingHandler http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength != 0 {
		// No body is read here: the connection closes after the answer,
		// instead of net/http draining the body first, with no deadline,
		// on bytes a client may never send.
		closeUnread(w)
	}
	w.Header().Set("Content-Type", "application/json")
	if r.URL.Path == "/healthz" {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{"status":"ok"}` + "\n"))
		return
	}
	w.Header().Set("Retry-After", "1")
	const msg = "not ready: starting (loading its state)"
	// The drop-in APIs answer a MessagePack request's every error in
	// MessagePack (docs/compat.md), this one too: their clients cannot
	// decode the JSON below. Their paths are all but the Server's own; on
	// --selection-addr every path is the selection API's.
	if !api.OwnPath(r.URL.Path) && compat.WriteError(w, r, http.StatusServiceUnavailable, msg) {
		return
	}
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = w.Write([]byte(`{"error":"` + msg + `","reason":"` + api.ReasonNotReady + `"}` + "\n"))
})

// closeUnread has the connection of a request whose body is not read closed
// after the answer. Connection: close alone is not enough: net/http's
// finishRequest still reads up to 256 KiB of the body before it closes, with
// no deadline, on bytes a client may never send. A read deadline already
// past makes that read fail at once; the answer, a write, is not affected.
// Its error (http.ErrNotSupported, a writer that is not net/http's) is
// ignored: Connection: close still stands.
func closeUnread(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
	_ = http.NewResponseController(w).SetReadDeadline(time.Now())
}

func buildInfo() prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_build_info", Help: "Build facts; value 1.",
		ConstLabels: prometheus.Labels{"version": version, "go_version": runtime.Version()}})
	g.Set(1)
	return g
}

var version = "dev"
