package enginesub

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

// DefaultReplayTimeout bounds a replay when Config.ReplayTimeout is zero.
const DefaultReplayTimeout = 3 * time.Second

// heartbeatMisses is how many heartbeat intervals a connection may stay
// silent, after a PING, before it is dropped and remade.
const heartbeatMisses = 3

// maxHeartbeat bounds Config.Heartbeat: libzmq carries the time-to-live it
// asks the engine to keep (heartbeatMisses intervals) in deciseconds, in 16
// bits.
const maxHeartbeat = 30 * time.Minute

// TCP keepalive on the event socket, in seconds: the kernel's probes find
// an engine host that died without closing the connection (a crash, a
// partition: no FIN or RST ever comes, and a PUB socket is otherwise
// silent while the engine has no events) within about 25 s, and keep a
// firewall's or a NAT's state of an idle connection alive. The kernel
// answers them however far behind the subscriber is, unlike ZMTP
// heartbeats (Config.Heartbeat).
const (
	keepaliveIdle  = 10
	keepaliveIntvl = 5
	keepaliveCount = 3
)

// DefaultMaxMessage is Config.MaxMessage when it is zero: 256 MiB, ample
// for an engine's batch. The largest a real one gets is a step that evicts
// much of the cache at once, about 9 bytes a block: a batch that removes 16
// million blocks is under 150 MB.
const DefaultMaxMessage = 256 << 20

// pollInterval is how long a receive waits before Run looks at its context
// again: the longest Run takes to notice a cancellation.
const pollInterval = 50 * time.Millisecond

// Config configures a Subscriber for one data-parallel rank of one worker.
type Config struct {
	// Endpoint is the engine's event endpoint, "tcp://host:port" (or
	// ipc://path, inproc://name; see CheckEndpoint). Required.
	Endpoint string
	// Bind makes the subscriber bind Endpoint (for engines that connect
	// their publisher); otherwise it connects. A bound port of 0 or "*" is
	// chosen by the system: LocalEndpoint tells which.
	Bind bool
	// Topic filters messages by the prefix of their topic frame; "" takes
	// every message.
	Topic string
	// ReplayEndpoint is the engine's replay ROUTER endpoint, or "" when it
	// has none: then every gap resyncs the rank. New refuses one of a shape
	// libzmq cannot connect to, and Run one libzmq refuses: each gap would
	// otherwise fail its replay and resync.
	ReplayEndpoint string
	// ReplayTimeout bounds how long a replay waits for the engine: for its
	// first reply, then between replies (not the whole replay, whose
	// batches the sink may take a while to apply); zero means
	// DefaultReplayTimeout. A replay that runs out resyncs the rank.
	ReplayTimeout time.Duration
	// RecvHWM is the SUB socket's receive high-water mark, in messages: how
	// many batches may wait while a replay runs before the socket drops some
	// (which a later gap then shows). Zero keeps libzmq's default (1000).
	RecvHWM int
	// Heartbeat, when above zero, is how often the SUB socket sends a ZMTP
	// heartbeat (PING) on each of its connections; a connection that then
	// stays silent for 3 intervals is dropped and, in connect mode,
	// remade, and the engine is asked to drop it after 3 intervals without
	// a PING (ZMTP's time-to-live). Zero (the default) sends none: TCP
	// keepalive finds a dead engine host instead (keepaliveIdle). At most
	// 30 minutes. Off by default because libzmq (4.3.4 included) reads no
	// PING or PONG while the subscriber's queue is full (RecvHWM): a
	// subscriber back-pressured for 3 intervals drops a healthy connection
	// and loses what its buffers held, and the reconnect can abort the
	// process (libzmq issues 3937 and 4767: "Assertion failed:
	// _input_stopped").
	Heartbeat time.Duration
	// MaxMessage bounds, in bytes, each frame the event and replay sockets
	// take (libzmq's ZMQ_MAXMSGSIZE). A larger one is refused before it is
	// read whole, and the connection that sent it dropped: a peer that
	// connects to a bound endpoint cannot exhaust the agent's memory with
	// one message. A real batch over the bound is lost, so its gap
	// resyncs the rank. Zero means DefaultMaxMessage.
	MaxMessage int64
	// Rank is the rank followed; it names the rank in Sink calls, events
	// and metrics. A batch whose data_parallel_rank is not Rank.DP is left
	// out (engine.ReasonOtherDPRank): an engine publishing several dp ranks
	// on one endpoint is followed for Rank.DP only.
	Rank kvevent.Rank
	// Decoder configures the payload decoder; its Rank is replaced by Rank.
	// Decoder.BlockSize is required.
	Decoder engine.Config
	// Resume, when set, is the sequence expected first: a subscriber that
	// takes over from another (the router's agentless subscriber after a
	// failover) continues where its predecessor stopped. A first batch above
	// it is a gap (replayed, or resynced), one below it a new epoch (the
	// engine restarted since). Nil: the first batch is accepted whatever its
	// sequence.
	Resume *uint64
	// Sink receives the events. Required.
	Sink Sink
	// Logger, when nil, is slog.Default().
	Logger *slog.Logger
	// SkipLog, shared by the subscribers of one worker, logs each reason
	// the decoder leaves events out for once per worker (semantics.md §1:
	// a worker registered with the wrong block size warns once, not once
	// per dp rank). Nil: the subscriber keeps one of its own; NewGroup
	// gives its subscribers one they share.
	SkipLog *SkipLog
	// Registerer, when set, registers the kvagent_subscriber_* metrics
	// (and kvagent_engine_seq_gaps_total), labelled by worker and dp_rank.
	// Subscribers may share one.
	Registerer prometheus.Registerer
}

// A Subscriber follows one engine rank's KV event stream and gives its
// batches to a Sink; see the package comment for what it promises. Make one
// with New and call Run once.
type Subscriber struct {
	cfg   Config
	core  *core
	m     *metrics
	ran   atomic.Bool
	ready chan struct{}
	local atomic.Pointer[string]
}

// New checks cfg and returns a Subscriber. It opens no socket: Run does.
func New(cfg Config) (*Subscriber, error) {
	switch {
	case cfg.Endpoint == "":
		return nil, fmt.Errorf("%w: no endpoint", ErrConfig)
	case endpointProblem(cfg.Endpoint, cfg.Bind) != "":
		return nil, fmt.Errorf("%w: endpoint %q: %s", ErrConfig, cfg.Endpoint, endpointProblem(cfg.Endpoint, cfg.Bind))
	case cfg.ReplayEndpoint != "" && endpointProblem(cfg.ReplayEndpoint, false) != "":
		return nil, fmt.Errorf("%w: replay endpoint %q: %s", ErrConfig, cfg.ReplayEndpoint, endpointProblem(cfg.ReplayEndpoint, false))
	case cfg.Sink == nil:
		return nil, fmt.Errorf("%w: no sink", ErrConfig)
	case cfg.ReplayTimeout < 0:
		return nil, fmt.Errorf("%w: replay timeout %v", ErrConfig, cfg.ReplayTimeout)
	case cfg.RecvHWM < 0:
		return nil, fmt.Errorf("%w: receive high-water mark %d", ErrConfig, cfg.RecvHWM)
	case cfg.Heartbeat < 0 || cfg.Heartbeat > maxHeartbeat || cfg.Heartbeat > 0 && cfg.Heartbeat < time.Millisecond:
		return nil, fmt.Errorf("%w: heartbeat %v: not within 1ms to %v", ErrConfig, cfg.Heartbeat, maxHeartbeat)
	case cfg.MaxMessage < 0:
		return nil, fmt.Errorf("%w: max message %d", ErrConfig, cfg.MaxMessage)
	}
	if cfg.ReplayTimeout == 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	if cfg.MaxMessage == 0 {
		cfg.MaxMessage = DefaultMaxMessage
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Decoder.Rank = cfg.Rank
	dec, err := engine.NewDecoder(cfg.Decoder)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	if cfg.SkipLog == nil {
		cfg.SkipLog = new(SkipLog)
	}
	s := &Subscriber{cfg: cfg, m: m, ready: make(chan struct{})}
	s.core = &core{rank: cfg.Rank, sink: cfg.Sink, dec: dec, log: cfg.Logger,
		m: m.forRank(cfg.Rank.Worker, cfg.Rank.DP), resume: cfg.Resume, skipLog: cfg.SkipLog, bind: cfg.Bind}
	if cfg.ReplayEndpoint != "" {
		s.core.replay = s.replay
	}
	return s, nil
}

// ForgetMetrics deletes the rank's metric series from the Registerer's
// families, for a rank no longer followed (its series would stay exported
// with their last values). Call it once Run has returned, and before a
// new Subscriber of the rank is made: that one's series are the same.
func (s *Subscriber) ForgetMetrics() { s.m.forget(s.cfg.Rank.Worker, s.cfg.Rank.DP) }

// Rank returns the rank the subscriber follows.
func (s *Subscriber) Rank() kvevent.Rank { return s.cfg.Rank }

// Stats returns the subscriber's counters. It may be called at any time,
// from any goroutine.
func (s *Subscriber) Stats() Stats { return s.core.Stats() }

// Ready is closed once Run has opened its socket: bound it, or started
// connecting (a connection is made in the background, and remade after the
// engine restarts). It is never closed when Run fails to open the socket.
func (s *Subscriber) Ready() <-chan struct{} { return s.ready }

// LocalEndpoint returns, once Ready, the endpoint the socket was bound to
// (with the port the system chose) or connected to; "" before.
func (s *Subscriber) LocalEndpoint() string {
	if p := s.local.Load(); p != nil {
		return *p
	}
	return ""
}

// Run receives the engine's messages until ctx is cancelled, then closes
// its sockets and returns nil. It returns an error when the socket cannot
// be opened or fails. Run may be called once.
func (s *Subscriber) Run(ctx context.Context) error {
	if !s.ran.CompareAndSwap(false, true) {
		return ErrRunning
	}
	if err := s.checkReplayEndpoint(); err != nil {
		return err
	}
	sock, err := s.open()
	if err != nil {
		return err
	}
	defer sock.Close()
	close(s.ready)
	if err := s.core.catchUp(ctx); err != nil {
		return nil // ctx ended during the replay
	}
	s.cfg.Logger.Debug("engine subscriber started", "rank", s.cfg.Rank, "endpoint", s.LocalEndpoint(), "bind", s.cfg.Bind)
	for ctx.Err() == nil {
		frames, err := sock.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
				continue // the receive timeout: look at ctx again
			}
			return fmt.Errorf("enginesub: receive from %s: %w", s.cfg.Endpoint, err)
		}
		if err := s.core.live(ctx, frames); err != nil && ctx.Err() == nil {
			return err
		}
	}
	return nil
}

// open makes the SUB socket, binds or connects it, and records where.
func (s *Subscriber) open() (_ *socket, err error) {
	sock, err := newSocket(zmq.SUB)
	if err != nil {
		return nil, fmt.Errorf("enginesub: new socket: %w", err)
	}
	defer func() {
		if err != nil {
			sock.Close()
		}
	}()
	set := func(what string, err error) error {
		if err != nil {
			return fmt.Errorf("enginesub: set %s: %w", what, err)
		}
		return nil
	}
	if err := errors.Join(
		set("linger", sock.SetLinger(0)),
		set("receive timeout", sock.SetRcvtimeo(pollInterval)),
		set("subscription", sock.SetSubscribe(s.cfg.Topic)),
		set("max message size", sock.SetMaxmsgsize(s.cfg.MaxMessage)),
		set("TCP keepalive", sock.SetTcpKeepalive(1)),
		set("TCP keepalive idle", sock.SetTcpKeepaliveIdle(keepaliveIdle)),
		set("TCP keepalive interval", sock.SetTcpKeepaliveIntvl(keepaliveIntvl)),
		set("TCP keepalive count", sock.SetTcpKeepaliveCnt(keepaliveCount)),
	); err != nil {
		return nil, err
	}
	if hb := s.cfg.Heartbeat; hb > 0 {
		if err := errors.Join(
			set("heartbeat interval", sock.SetHeartbeatIvl(hb)),
			set("heartbeat timeout", sock.SetHeartbeatTimeout(heartbeatMisses*hb)),
			set("heartbeat time-to-live", sock.SetHeartbeatTtl(heartbeatMisses*hb)),
		); err != nil {
			return nil, err
		}
	}
	if s.cfg.RecvHWM > 0 {
		if err := set("receive high-water mark", sock.SetRcvhwm(s.cfg.RecvHWM)); err != nil {
			return nil, err
		}
	}
	local := s.cfg.Endpoint
	if s.cfg.Bind {
		if err := sock.Bind(s.cfg.Endpoint); err != nil {
			return nil, fmt.Errorf("enginesub: bind %s: %w", s.cfg.Endpoint, err)
		}
		if ep, err := sock.GetLastEndpoint(); err == nil {
			local = ep
		}
	} else if err := sock.Connect(s.cfg.Endpoint); err != nil {
		return nil, fmt.Errorf("enginesub: connect %s: %w", s.cfg.Endpoint, err)
	}
	s.local.Store(&local)
	return sock, nil
}

// checkReplayEndpoint connects a DEALER to the replay endpoint once, and
// closes it: an endpoint libzmq refuses (New checks only its shape) fails
// Run at its start, as an event endpoint does, not each gap's replay, which
// would resync the rank every time with only a Warn to show for it.
func (s *Subscriber) checkReplayEndpoint() error {
	if s.cfg.ReplayEndpoint == "" {
		return nil
	}
	d, err := newSocket(zmq.DEALER)
	if err != nil {
		return fmt.Errorf("enginesub: new replay socket: %w", err)
	}
	defer d.Close()
	if err := d.SetLinger(0); err != nil {
		return fmt.Errorf("enginesub: set replay socket linger: %w", err)
	}
	if err := d.Connect(s.cfg.ReplayEndpoint); err != nil {
		return fmt.Errorf("enginesub: replay endpoint: connect %s: %w", s.cfg.ReplayEndpoint, err)
	}
	return nil
}

// replay is the core's replayFunc over ZMQ. Each replay has its own DEALER,
// closed at the end: a reply that comes after a replay gave up can never be
// read as part of the next one.
func (s *Subscriber) replay(ctx context.Context, from uint64, each func(frames [][]byte) bool) error {
	deadline := time.Now().Add(s.cfg.ReplayTimeout)
	d, err := newSocket(zmq.DEALER)
	if err != nil {
		return fmt.Errorf("new replay socket: %w", err)
	}
	defer d.Close()
	// No receive limit: the engine sends a whole replay at once (up to its
	// buffer, 10,000 batches in vLLM), and past libzmq's default of 1,000
	// queued messages its ROUTER drops the rest without a word while the
	// sink is busy, which the replay sees as a hole and resyncs. The
	// engine's buffer bounds what queues here, MaxMessage each message.
	if err := errors.Join(d.SetLinger(0), d.SetSndtimeo(s.cfg.ReplayTimeout), d.SetRcvtimeo(pollInterval), d.SetRcvhwm(0),
		d.SetMaxmsgsize(s.cfg.MaxMessage)); err != nil {
		return fmt.Errorf("set replay socket options: %w", err)
	}
	if err := d.Connect(s.cfg.ReplayEndpoint); err != nil {
		return fmt.Errorf("connect %s: %w", s.cfg.ReplayEndpoint, err)
	}
	req := replayRequest(from)
	if _, err := d.SendMessage(req[0], req[1]); err != nil {
		return fmt.Errorf("ask %s for a replay from %d: %w", s.cfg.ReplayEndpoint, from, err)
	}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w after %v", errReplayTimeout, s.cfg.ReplayTimeout)
		}
		frames, err := d.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
				continue
			}
			return fmt.Errorf("receive replay from %s: %w", s.cfg.ReplayEndpoint, err)
		}
		if !each(frames) {
			return nil
		}
		// The deadline bounds the engine's silence, not the replay: applying
		// a long replay (a sink that commits each batch through Raft) takes
		// as long as it takes while the engine keeps answering.
		deadline = time.Now().Add(s.cfg.ReplayTimeout)
	}
}
