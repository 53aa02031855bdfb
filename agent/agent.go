// Package agent is the node agent's event path: it follows an engine's KV
// event stream, one subscriber per dp rank (enginesub), keeps a mirror of
// what each rank holds (an indexer.Index of this worker alone), and
// publishes every change to the router cluster (eventplane.Publisher).
//
// Invariants:
//
//   - The mirror and the publisher's event ids move together, under one
//     lock: a dump of the mirror (what the publisher sends when the router
//     lost track of a rank) reflects exactly the events up to the id it
//     names, so the router resumes from the right cursor.
//   - On start every rank is resynced with a dump before any of its events
//     go out: the router may hold a previous incarnation's state and
//     cursor, and the new numbering must not be taken for duplicates.
//   - Once the leader has answered a heartbeat saying it does not know the
//     worker, or the heartbeats have failed for longer than its lease,
//     every rank is resynced when it knows it again, whoever registered it
//     (liveness): the removal, or the leader's grace for an unregistered
//     worker, may have taken the ranks' state off the router, and an idle
//     rank sends nothing that would show the router the gap. A removal no
//     answer reports (the worker removed and registered again between two
//     heartbeats) shows in the leader's answer too, which names the ranks
//     it holds no state of: each that the router had taken a dump of is
//     resynced (resyncLost). A router of an earlier build names none.
//     An answer that names them (an empty list too) is trusted over a
//     run of failed heartbeats, which may have reached the leader with
//     only their answers lost: it resyncs what it names, not every rank.
//   - When the engine restarts (a new epoch) or its stream lost batches that
//     cannot be replayed, the rank is cleared, on the router too: a block
//     the router may still route to must be one the engine reported and
//     did not take back. Blocks the engine stored during a loss reappear
//     when it stores or offloads them again. The blocks of the agent's own
//     offload pools (Publish) are not the engine's to lose: they stay in
//     the mirror and go back to the router with a dump of the rank.
//   - The offload pools publish through the agent (Publish), under the
//     same lock as the engine's batches, so the mirror holds their G2 and
//     G3 blocks too and a dump after a gap keeps them. A G3 pool reopened
//     on start gives its state to Restore, and the rank's dump carries it.
//   - A pool's block never moves what the engine reported: a pool STORE
//     that names a hash the mirror holds as another block (another content
//     hash or parent), or a block the mirror holds under another hash, is
//     not published (indexer.CheckStore; the router would take it for the
//     engine reusing the hash and drop the engine's own residency). The
//     engine API asks the same of an offload request first (CheckOffload).
//   - The mirror and the router hold a rank's block under one engine hash,
//     the newest stored, in every tier. A pool's block is held only under
//     the hash the pool names it by, the one its REMOVE names: when the
//     engine stores a block a pool holds under another hash (another
//     cache_salt or extra_keys), the pool's tiers of it are removed under
//     the engine's hash (withdrawRenamedLocked), as a pool's copy stored
//     after the engine's block is not published. Renamed with them, the
//     pool's REMOVE would miss it, and the router route to a block neither
//     holds.
//   - A pool block whose parent the mirror does not hold waits in the
//     rank's parked set, outside the mirror and the router, until a store
//     of its parent (the engine's or a pool's) makes the mirror hold it (a
//     store held as an orphan does not); a pool's REMOVE of it takes it
//     out of the set, which the pools' capacity thus bounds. It would
//     otherwise be left out of every dump, or held as an orphan that
//     expires, and never be sent again: nothing stores it while the pool
//     holds it. A batch's cost does not grow with the set: only the
//     hashes it stores, and those of the held orphans its apply adopts,
//     are looked up in it (releaseLocked). A remove that takes a rank's
//     last copy of a block parks the pool blocks below it the same way,
//     under its hash, and takes them off the router in the same publish
//     (parkCutLocked): no lookup reaches them, and a dump, which leaves
//     out what no lookup reaches, would take them off the router while
//     the mirror kept them. The engine's own blocks below it are taken off
//     too, not parked. A store that reuses a block's engine hash for
//     another block takes the old one in every tier, and does the same;
//     a block parked so waits for its parent's content hash under its
//     engine hash, which a store of the new block does not bring back.
//     So the mirror holds no block of a rank below one
//     the rank does not hold, and a dump carries all it holds.
//   - The engine path never blocks on the router: the publisher drops its
//     oldest events when its buffer is full (DropOldest), and the rank heals
//     with a dump once the router reports the gap. A batch larger than the
//     buffer (which the publisher refuses whole) is checked whole, then
//     published in parts of at most the buffer's size, in order.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an Agent.
type Config struct {
	Worker  uint64 // the worker id the router knows this engine by
	DPStart uint32 // the first dp rank this agent follows
	DPRanks int    // how many, from DPStart (default 1)

	// Endpoint and ReplayEndpoint are dp rank 0's ZMQ endpoints; rank r's
	// port is offset by r (wire.md). ReplayEndpoint may be empty.
	Endpoint       string
	ReplayEndpoint string
	Bind           bool   // bind the SUB socket (the engine connects)
	Topic          string // topic prefix filter
	BlockSize      int    // the engine's block size in tokens (required)
	// NoLearnGroupKinds turns off the engine decoder's learning of each KV
	// cache group's kind (engine.Config.LearnGroupKinds, on by default):
	// an event without a kv_cache_spec_kind, every BlockRemoved, is then
	// the main attention group's only when its group_idx is 0 or absent,
	// as wire.md says. Learning files it by the kind its group's stores
	// named instead, which a hybrid model whose full-attention group is
	// not group 0 needs: by the wire rule, its full-attention removes are
	// left out (the router routes to blocks the engine evicted) and its
	// group 0's removes go through (the router drops blocks full
	// attention holds).
	NoLearnGroupKinds bool

	Conn *nats.Conn // the router cluster's NATS
	// Publisher tunes the publisher; Conn, Dump, DropOldest, Registerer and
	// Logger are set by the agent.
	Publisher eventplane.PublisherConfig

	// Registration, when Registrar is set, is registered on start and
	// again whenever the leader answers a heartbeat saying the worker is
	// unknown (its lease expired while the agent was cut off). Its ID and
	// DPRanks are set from Worker, DPStart and DPRanks (what the caller
	// put there is replaced: a registration replaces the worker's dp ranks,
	// so one agent per worker id). Its BlockSize is BlockSize's: 0 takes
	// it, another is ErrConfig. Its Salt, the engine's additional salt, is
	// in every block's content hash (engine.SaltedSeed), registered or not.
	Registration raftfsm.WorkerInfo
	Registrar    Registrar
	// RegistrationHint, when set, says what the operator is to fix for a
	// registration's error ("" when it knows nothing to say): the
	// refusal's stop names it instead of "fix the registration", and a
	// retried failure's warning carries it (hint). kvagent names its
	// flags there (--router-token, --router-tls-ca).
	RegistrationHint func(error) string
	// HeartbeatInterval is how often the agent tells the leader its worker
	// is alive (default 1s); HeartbeatSubject where (default
	// eventplane.DefaultHeartbeatSubject). Give Registration a LeaseMs of a
	// few intervals.
	HeartbeatInterval time.Duration
	HeartbeatSubject  string

	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Registrar registers a worker with the router cluster: *client.Client.
// The agent takes an error wrapping raftfsm.ErrInvalid, or a *client.Error
// of a status 4xx but 408 and 429, as the router refusing the registration
// for good (ErrRegistrationRefused); it retries any other.
type Registrar interface {
	RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error
}

// Agent follows one worker's engine ranks and publishes their events.
type Agent struct {
	cfg   Config
	log   *slog.Logger
	pub   *eventplane.Publisher
	group *enginesub.Group
	ranks []kvevent.Rank

	mu     sync.Mutex // held around a publish and its mirror apply, and by Dump
	mirror *indexer.Index
	// offloaded[r] has the bit of every tier an offload pool of rank r
	// published or restored blocks in: what a clear keeps. Guarded by mu.
	offloaded map[kvevent.Rank]kvevent.Mask
	// parked[r] holds rank r's pool blocks waiting for their parent (see
	// the package invariants). Guarded by mu.
	parked map[kvevent.Rank]*parking
	// releaseLookups counts the parents releaseLocked looked up: its work,
	// which tests bound (they may not time it). Guarded by mu.
	releaseLookups uint64
	// cutLookups counts the cut blocks parkCutLocked looked up: its work,
	// which tests bound as well. Guarded by mu.
	cutLookups uint64

	resets     *prometheus.CounterVec
	pubErrs    prometheus.Counter
	mismatches *prometheus.CounterVec
	parkedN    prometheus.Gauge
}

var _ enginesub.Sink = (*Agent)(nil)

var (
	// ErrConfig marks a Config that New refuses.
	ErrConfig = errors.New("agent: invalid config")
	// ErrRegistrationRefused is what Run returns, wrapping the router's
	// answer, when the router refused the worker's registration as
	// invalid: it would refuse it again, and the agent does not retry.
	ErrRegistrationRefused = errors.New("the router refuses the worker's registration")
)

// New checks cfg and returns an Agent; Run starts it.
func New(cfg Config) (*Agent, error) {
	if cfg.DPRanks == 0 {
		cfg.DPRanks = 1
	}
	switch {
	case cfg.BlockSize <= 0:
		return nil, fmt.Errorf("%w: block size %d", ErrConfig, cfg.BlockSize)
	case cfg.Conn == nil:
		return nil, fmt.Errorf("%w: no NATS connection", ErrConfig)
	case cfg.DPRanks < 0:
		return nil, fmt.Errorf("%w: %d dp ranks", ErrConfig, cfg.DPRanks)
	case cfg.Registration.BlockSize != 0 && cfg.Registration.BlockSize != cfg.BlockSize:
		return nil, fmt.Errorf("%w: Registration.BlockSize %d and BlockSize %d: the router would score with another block size than the agent hashes with",
			ErrConfig, cfg.Registration.BlockSize, cfg.BlockSize)
	}
	cfg.Registration.BlockSize = cfg.BlockSize
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.HeartbeatInterval <= 0 {
		cfg.HeartbeatInterval = time.Second
	}
	if cfg.HeartbeatSubject == "" {
		cfg.HeartbeatSubject = eventplane.DefaultHeartbeatSubject
	}
	a := &Agent{cfg: cfg, log: cfg.Logger, mirror: indexer.New(indexer.Config{}), offloaded: map[kvevent.Rank]kvevent.Mask{},
		parked: map[kvevent.Rank]*parking{}}
	if cfg.Registerer == nil {
		cfg.Registerer = prometheus.NewRegistry()
	}
	// What New registers, the agent's metrics, the publisher's and the
	// subscribers', it takes back when it fails: a New with the config
	// fixed, on the same Registerer, would find them registered.
	reg := &undoRegisterer{Registerer: cfg.Registerer}
	a.resets = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvagent_rank_clears_total",
		Help: "Ranks cleared on the router: the engine restarted (engine_restart) or reset its cache (engine_cleared, on ranks with offload pools), or its stream lost batches."}, []string{"reason"})
	// The labelled series show zero before their first clear: a panel or
	// an alert over them reads 0 on a fresh agent, not "no data".
	for _, why := range []string{"engine_restart", "engine_cleared", string(enginesub.ReasonGap), string(enginesub.ReasonOverrun),
		string(enginesub.ReasonReplayFailed), string(enginesub.ReasonSinkError), string(enginesub.ReasonBadPayload)} {
		a.resets.WithLabelValues(why)
	}
	a.pubErrs = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvagent_publish_errors_total",
		Help: "Engine batches, offload pools' event batches and rank clears that the agent could not publish (an engine batch's rank is then resynced)."})
	a.mismatches = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvagent_offload_mismatches_total",
		Help: "Offloaded blocks refused because they contradict what the engine reported (a hash it holds as another block, or a block it holds under another hash): " +
			"in an engine API offload request (request, answered bad_request), or in a pool's STORE (pool, not published); " +
			"and pools' copies withdrawn from the router because the engine stored their block under another hash (engine)."}, []string{"where"})
	// Every place shows zero before its first mismatch: a panel or an
	// alert over them reads 0 on a healthy agent, not "no data".
	for _, where := range []string{"request", "pool", "engine"} {
		a.mismatches.WithLabelValues(where)
	}
	a.parkedN = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvagent_offload_parked_blocks",
		Help: "Offload pool blocks waiting for their parent to be stored before they are published."})
	for _, c := range []prometheus.Collector{a.resets, a.pubErrs, a.mismatches, a.parkedN} {
		if err := reg.Register(c); err != nil {
			reg.undo()
			return nil, fmt.Errorf("agent metrics: %w", err)
		}
	}
	pc := cfg.Publisher
	pc.Conn, pc.Dump, pc.DropOldest, pc.Registerer, pc.Logger = cfg.Conn, a.dump, true, reg, cfg.Logger
	pub, err := eventplane.NewPublisher(pc)
	if err != nil {
		reg.undo()
		return nil, err
	}
	g, err := enginesub.NewGroup(enginesub.Config{Endpoint: cfg.Endpoint, ReplayEndpoint: cfg.ReplayEndpoint,
		Bind: cfg.Bind, Topic: cfg.Topic, Rank: kvevent.Rank{Worker: cfg.Worker, DP: cfg.DPStart},
		Decoder: engine.Config{BlockSize: cfg.BlockSize, Seed: engine.SaltedSeed(cfg.Registration.Salt),
			LearnGroupKinds: !cfg.NoLearnGroupKinds},
		Sink: a, Logger: cfg.Logger, Registerer: reg}, cfg.DPRanks)
	if err != nil {
		pub.Close()
		reg.undo()
		return nil, err
	}
	a.pub, a.group = pub, g
	dps := make([]uint32, 0, len(g.Subscribers())) // not the caller's
	for _, s := range g.Subscribers() {
		a.ranks = append(a.ranks, s.Rank())
		dps = append(dps, s.Rank().DP)
	}
	a.cfg.Registration.ID, a.cfg.Registration.DPRanks = cfg.Worker, dps
	return a, nil
}

// undoRegisterer is a Registerer that remembers the collectors registered
// through it, so that undo can take them back (a New that fails).
type undoRegisterer struct {
	prometheus.Registerer
	done []prometheus.Collector
}

func (u *undoRegisterer) Register(c prometheus.Collector) error {
	if err := u.Registerer.Register(c); err != nil {
		return err
	}
	u.done = append(u.done, c)
	return nil
}

// MustRegister is Register's, panicking on an error as the interface
// says. Nothing New calls uses it.
func (u *undoRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := u.Register(c); err != nil {
			panic(err)
		}
	}
}

// undo unregisters every collector registered through u.
func (u *undoRegisterer) undo() {
	for _, c := range u.done {
		u.Registerer.Unregister(c)
	}
	u.done = nil
}

// Ranks returns the ranks the agent follows.
func (a *Agent) Ranks() []kvevent.Rank { return a.ranks }

// Publisher returns the agent's publisher (status, tests).
func (a *Agent) Publisher() *eventplane.Publisher { return a.pub }

// Subscribers returns the agent's engine subscribers (status, tests).
func (a *Agent) Subscribers() []*enginesub.Subscriber { return a.group.Subscribers() }

// Run resyncs every rank and follows the engine until ctx ends. It returns
// nil when ctx is cancelled, and an error wrapping ErrRegistrationRefused
// and the router's answer when the router refused the registration.
//
// The worker is registered, and heartbeats sent, only once every
// subscriber has opened its socket: a subscriber that cannot (a bind to
// an address in use) ends Run before the router takes the worker for
// followed.
func (a *Agent) Run(ctx context.Context) error {
	a.resyncAll()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	ran := make(chan error, 1)
	go func() { ran <- a.group.Run(ctx) }()
	for _, s := range a.group.Subscribers() {
		select {
		case <-s.Ready():
		case err := <-ran:
			return err
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		a.heartbeats(ctx, cancel)
	}()
	err := <-ran
	cancel(nil)
	<-done
	if cause := context.Cause(ctx); errors.Is(cause, ErrRegistrationRefused) {
		return errors.Join(cause, err)
	}
	return err
}

// heartbeats tells the leader every HeartbeatInterval that the worker is
// alive, and has it registered (when a Registrar is set) at the start and
// whenever the leader does not know it, and resyncs every rank once the
// worker is known again after the leader said it was not, or after the
// heartbeats failed for longer than its lease (liveness); and each rank
// the leader's answer says it holds no state of, once the router had
// taken a dump of it (resyncLost). A heartbeat asks for those ranks
// (eventplane.HeartbeatRequest) unless the NATS server takes no headers.
// Without a Registrar, each time the leader says so is logged at Warn.
// Registration runs beside the heartbeats, not between them: a try
// against a slow or unreachable HTTP API takes seconds, and heartbeats
// held back meanwhile let the lease of a live worker run out. It returns
// when ctx ends; a registration the router refuses ends it, through stop.
func (a *Agent) heartbeats(ctx context.Context, stop context.CancelCauseFunc) {
	var kick chan struct{}
	var lv liveness
	if a.cfg.Registrar != nil {
		kick = make(chan struct{}, 1)
		kick <- struct{}{}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := a.registrations(ctx, kick, &lv); err != nil {
				stop(err)
			}
		}()
		defer wg.Wait()
	}
	t := time.NewTicker(a.cfg.HeartbeatInterval)
	defer t.Stop()
	req := eventplane.HeartbeatRequest(a.cfg.HeartbeatSubject, []uint64{a.cfg.Worker})
	plain := &nats.Msg{Subject: req.Subject, Data: req.Data}
	synced := make([]uint64, len(a.ranks))
	warned, unreadable, resyncUnreadable := false, false, false
	var failing heartbeatFailures
	for {
		for i, r := range a.ranks {
			synced[i] = a.pub.Synced(r)
		}
		m := req
		if !a.cfg.Conn.HeadersSupported() {
			m = plain // a NATS server before 2.2 refuses headers
		}
		sent := lv.beats.Add(1)
		hctx, cancel := context.WithTimeout(ctx, a.cfg.HeartbeatInterval)
		msg, err := a.cfg.Conn.RequestMsgWithContext(hctx, m)
		cancel()
		if ctx.Err() == nil && a.noteHeartbeat(&failing, err, time.Now()) {
			lv.lapsed()
		}
		if err == nil {
			ans, err := eventplane.DecodeHeartbeatAnswer(msg)
			if err == nil && ans.Unreadable != nil && !unreadable {
				unreadable = true // a router of a later build answers so each time
				a.log.Warn("cannot read every rank the router names as holding no state of; they are skipped, and the answer is taken all the same",
					"worker", a.cfg.Worker, "err", ans.Unreadable)
			}
			if err == nil && ans.ResyncUnreadable != nil && !resyncUnreadable {
				resyncUnreadable = true // likewise, warned once apart from the other header
				a.log.Warn("cannot read every rank the router names as needing a resync; they are skipped, and the answer is taken all the same",
					"worker", a.cfg.Worker, "err", ans.ResyncUnreadable)
			}
			switch {
			case err != nil: // nothing learned
				a.log.Debug("unreadable heartbeat answer", "worker", a.cfg.Worker, "err", err)
			case len(ans.Unknown) > 0:
				if lv.heardUnknown(sent) && kick != nil {
					kick <- struct{}{}
				} else if kick == nil && !warned {
					warned = true // until the worker is known again: each removal is logged
					a.log.Warn("the router does not know this worker and the agent has no router address to register it", "worker", a.cfg.Worker)
				}
			default:
				warned = false
				if lv.heardKnown(ans.Named) {
					a.log.Info("the router knows the worker again: every rank is resynced", "worker", a.cfg.Worker)
					a.resyncAll()
				}
				a.resyncLost(ans.Stateless, synced)
				a.resyncAsked(ans)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// liveness is what the heartbeats and the registrations know of the
// worker on the router.
//
// Once the leader has answered a heartbeat saying it does not know the
// worker, the ranks' state may be gone from the router: the removal of a
// registered worker (its lease ran out, an operator removed it) takes it
// at once, and the leader removes an unregistered worker's ranks after
// its unregistered grace, which a first registration that keeps failing
// outlasts. A run of failed heartbeats that has lasted the worker's lease
// says as much (lapsed): the leader has removed the worker, or will, and
// whoever registers it may do so again before a heartbeat gets through,
// whose answer then knows it. But the heartbeats may have reached the
// leader all along, and only their answers failed: an answer that names
// the ranks the leader holds no state of (eventplane.HeartbeatAnswer's
// Named, even none) says what was lost, and resyncLost resyncs those
// alone; only an answer that names nothing (a router of an earlier
// build, or ranks the agent cannot read) leaves the lapse to resync
// every rank. Run's dumps at start are no help then, and
// an idle rank sends nothing that would show the router a gap. So every
// rank is resynced once the worker is known again, whoever registered
// it: when the agent's registration goes through (registered), or a
// heartbeat is answered without the worker's id (heardKnown; without a
// Registrar, something else registers the worker). Once per such turn
// from unknown to known: the first of the two clears unknown.
type liveness struct {
	beats atomic.Int64 // heartbeats sent: a heartbeat's number is the count once it is sent

	mu sync.Mutex
	// registeredAt is the number of the first heartbeat sent after the
	// last registration went through, 0 while one is asked for or under
	// way. An answer "unknown" to a heartbeat numbered below it is stale:
	// the registration since answers it.
	registeredAt int64
	// unknown is set by an answer "unknown" that is not stale, and
	// lapse by a run of failed heartbeats that has lasted the lease; both
	// are cleared when the ranks are resynced, and lapse by an answer
	// that names the ranks without state as well.
	unknown, lapse bool
}

// heardUnknown records the leader's answer that it does not know the
// worker, to heartbeat sent. It returns whether a registration is to be
// asked for: the worker was registered and is unknown to a heartbeat
// sent since, so it was removed (while one is under way, it answers
// this).
func (l *liveness) heardUnknown(sent int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if sent < l.registeredAt {
		return false
	}
	l.unknown = true
	if l.registeredAt == 0 {
		return false
	}
	l.registeredAt = 0
	return true
}

// lapsed records a run of failed heartbeats that has lasted the worker's
// lease: the leader has removed the worker, or will, as if it had
// answered that it does not know it. No registration is asked for: the
// leader is out of reach, and one that does not hear the worker's
// heartbeats would remove it again; its next answer says whether it knows
// the worker.
func (l *liveness) lapsed() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lapse = true
}

// heardKnown records the leader's answer that it knows the worker; named
// says whether it names the ranks the leader holds no state of. It
// returns whether every rank is to be resynced: an answer said the
// worker was unknown since they last were, or the heartbeats lapsed and
// this answer does not say what the router lost. Heartbeats go one at a
// time, so this answer came after any that heardUnknown recorded.
func (l *liveness) heardKnown(named bool) (resync bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	resync = l.unknown || l.lapse && !named
	l.unknown, l.lapse = false, false
	return resync
}

// registered records a registration that went through. It returns
// whether the ranks are to be resynced: a heartbeat's answer said the
// worker was unknown since they last were.
func (l *liveness) registered() (resync bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.registeredAt = l.beats.Load() + 1
	resync = l.unknown || l.lapse
	l.unknown, l.lapse = false, false
	return resync
}

// heartbeatFailures is what heartbeats remembers of a run of failed
// heartbeats.
type heartbeatFailures struct {
	since  time.Time // the first failure of the run; zero while they go through
	warned time.Time // the last warning of the run; zero before the first
}

// noteHeartbeat logs what a run of failed heartbeats means, once it has
// lasted the worker's lease (or, without a lease, 10 heartbeat intervals):
// the leader has removed the worker, or will. It warns again each lease
// while the run goes on, and says at Info when a heartbeat goes through
// after a warning. Each failure is logged at Debug. It returns whether it
// warned that the lease has run out (never without a lease).
func (a *Agent) noteHeartbeat(f *heartbeatFailures, err error, now time.Time) (lapsed bool) {
	if err == nil {
		if !f.warned.IsZero() {
			a.log.Info("heartbeats answered again", "worker", a.cfg.Worker, "after", now.Sub(f.since).Round(time.Millisecond))
		}
		*f = heartbeatFailures{}
		return false
	}
	a.log.Debug("heartbeat failed", "worker", a.cfg.Worker, "err", err)
	if f.since.IsZero() {
		f.since = now
	}
	lease := time.Duration(a.cfg.Registration.LeaseMs) * time.Millisecond
	period := lease
	if period <= 0 {
		period = 10 * a.cfg.HeartbeatInterval
	}
	if now.Sub(f.since) < period || !f.warned.IsZero() && now.Sub(f.warned) < period {
		return false
	}
	f.warned = now
	msg := "heartbeats have failed for longer than the worker's lease: the router has removed the worker, or will, and routes nothing to it; " +
		"check that NATS (--nats-url) and the routers are up and reachable"
	if lease <= 0 {
		msg = "heartbeats have failed for 10 heartbeat intervals: the router may not hear of this worker; check that NATS (--nats-url) and the routers are up and reachable"
	}
	a.log.Warn(msg, "worker", a.cfg.Worker, "for", now.Sub(f.since).Round(time.Millisecond), "lease", lease, "err", err)
	return lease > 0
}

// registrations registers the worker each time kick asks, retrying with
// backoff until it succeeds. A registration after a heartbeat's answer
// said the worker was unknown (a removal: the lease ran out, an operator
// removed the worker; or a first registration that went through only
// after the leader's unregistered grace) may follow the ranks' state
// leaving the router: every rank is resynced (liveness), so that the
// router holds what the engine does again without waiting for the
// engine's next event to show a gap. It returns nil when ctx ends, and an
// error wrapping ErrRegistrationRefused when the router refused the
// registration as invalid (refused): a retry would be refused too.
func (a *Agent) registrations(ctx context.Context, kick <-chan struct{}, lv *liveness) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
		}
		backoff := 100 * time.Millisecond
		for {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := a.cfg.Registrar.RegisterWorker(rctx, a.cfg.Registration)
			cancel()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				// The agent stops (its own context, not the try's
				// bound): nothing failed that a retry would be for.
				return nil
			}
			hint := ""
			if a.cfg.RegistrationHint != nil {
				hint = a.cfg.RegistrationHint(err)
			}
			if refused(err) && errors.Is(err, api.ErrConflict) {
				// The registration breaks a rule of the compatible APIs'
				// namespace of its model (docs/compat.md): the cause is
				// another worker, which the router's message names. A
				// namespace that held two block sizes before the rules
				// (an upgrade) lets its workers re-register while they
				// are registered, not once a lapsed lease removed them.
				a.log.Error("the router refuses the worker's registration: it conflicts with another worker of its model's namespace "+
					"(one block size per namespace; an id not registered through the compatible APIs); stopping. "+
					"Fix, then restart the agent: give --block-size the namespace's block size (or another --model), "+
					"or remove the conflicting worker the error names (DELETE /v1/workers/{id}, "+
					"DELETE /selection/workers/{id} or POST /unregister)",
					"worker", a.cfg.Worker, "model", a.cfg.Registration.Model, "block_size", a.cfg.BlockSize, "err", err)
				return fmt.Errorf("%w (worker %d conflicts with another worker of model %q: fix --block-size or --model, or remove that worker): %w",
					ErrRegistrationRefused, a.cfg.Worker, a.cfg.Registration.Model, err)
			}
			if refused(err) {
				fix := hint
				if fix == "" {
					fix = "fix the registration"
				}
				a.log.Error("the router refuses the worker's registration; stopping (a retry would be refused too: "+fix+")",
					"worker", a.cfg.Worker, "err", err)
				return fmt.Errorf("%w (worker %d; a retry would be refused too: %s): %w", ErrRegistrationRefused, a.cfg.Worker, fix, err)
			}
			if hint != "" {
				a.log.Warn("registering the worker failed; retrying", "worker", a.cfg.Worker, "err", err, "hint", hint)
			} else {
				a.log.Warn("registering the worker failed; retrying", "worker", a.cfg.Worker, "err", err)
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff/2 + rand.N(backoff/2+1)):
			}
			backoff = min(2*backoff, 5*time.Second)
		}
		resync := lv.registered()
		a.log.Info("worker registered", "worker", a.cfg.Worker, "lease", time.Duration(a.cfg.Registration.LeaseMs)*time.Millisecond,
			"resync", resync)
		if resync {
			a.resyncAll()
		}
	}
}

// resyncLost resyncs the ranks of stateless (a heartbeat's answer: the
// leader holds no state of them) that the router had taken a dump of when
// the heartbeat was sent (synced, Publisher.Synced of each of a.ranks
// then), with no dump of them asked for or taken since: the router has
// lost their state since (an operator removed the worker and registered
// it again between two heartbeats, which no answer says is unknown), and
// an idle rank sends nothing that would show it the gap. A rank with a
// dump asked for or taken since is left to that dump, and one with none
// taken yet to the dump Run asked for at the start.
func (a *Agent) resyncLost(stateless []kvevent.Rank, synced []uint64) {
	var lost []kvevent.Rank
	for _, r := range stateless {
		i := int64(r.DP) - int64(a.cfg.DPStart) // a.ranks are DPStart on, in order
		if i < 0 || i >= int64(len(a.ranks)) || a.ranks[i] != r || synced[i] == 0 || a.pub.Synced(r) != synced[i] {
			continue
		}
		a.pub.Resync(r)
		lost = append(lost, r)
	}
	if len(lost) > 0 {
		a.log.Info("the router holds no state of ranks it had taken a dump of (the worker was removed and registered again): resyncing them",
			"worker", a.cfg.Worker, "ranks", len(lost), "first", lost[0])
	}
}

// resyncAsked has the ranks of a heartbeat's answer ans that the leader
// flags as needing a resync (ans.Resync) dumped, held back as an ack's
// Resync is (eventplane.Publisher.RouterAsksResync): an operator restored
// the router cluster from a snapshot, older than what the engine holds,
// or the router dropped events it could not place. An idle rank gets no
// acks, and would never be resynced otherwise. An answer that names the
// flagged ranks (ans.ResyncNamed) voids a held-back ask of the agent's
// ranks it leaves out (eventplane.Publisher.RouterStopsAsking).
func (a *Agent) resyncAsked(ans eventplane.HeartbeatAnswer) {
	var dumped []kvevent.Rank
	var flagged []bool // by index in a.ranks
	if ans.ResyncNamed {
		flagged = make([]bool, len(a.ranks))
	}
	for _, r := range ans.Resync {
		i := int64(r.DP) - int64(a.cfg.DPStart) // a.ranks are DPStart on, in order
		if i < 0 || i >= int64(len(a.ranks)) || a.ranks[i] != r {
			continue
		}
		if flagged != nil {
			flagged[i] = true
		}
		if a.pub.RouterAsksResync(r) {
			dumped = append(dumped, r)
		}
	}
	for i, f := range flagged {
		if !f {
			a.pub.RouterStopsAsking(a.ranks[i])
		}
	}
	if len(dumped) > 0 {
		a.log.Info("the router flags ranks as needing a resync (restored from a snapshot, or it dropped events it could not place): resyncing them",
			"worker", a.cfg.Worker, "ranks", len(dumped), "first", dumped[0])
	}
}

// resyncAll has every rank dumped to the router.
func (a *Agent) resyncAll() {
	for _, r := range a.ranks {
		a.pub.Resync(r)
	}
}

// refused reports whether err is the router refusing a registration for
// good: raftfsm.ErrInvalid (from a Node, or the HTTP API's reason invalid),
// or any other answer 4xx of the HTTP API but 408 (a timeout) and 429 (a
// rate limit), which a retry may get past.
func refused(err error) bool {
	var ae *client.Error
	if errors.As(err, &ae) {
		c := ae.StatusCode
		return c >= 400 && c < 500 && c != http.StatusRequestTimeout && c != http.StatusTooManyRequests
	}
	return errors.Is(err, raftfsm.ErrInvalid)
}

// Flush waits until the router acknowledged every event published so far,
// or ctx ends; call it after Run returned (and the offload side closed),
// before Close.
func (a *Agent) Flush(ctx context.Context) error { return a.pub.Flush(ctx) }

// Close stops the publisher; call it after Run returned. Unacknowledged
// events are dropped: the next incarnation resyncs every rank.
func (a *Agent) Close() error { return a.pub.Close() }

// Events publishes one engine batch of rank r and applies it to the
// mirror (enginesub.Sink). A batch with an invalid event is refused whole;
// one larger than the publisher's buffer goes out in parts (publishLocked).
//
// An engine's clear (vLLM's AllBlocksCleared, on a prefix-cache reset)
// empties the engine's own cache, not the agent's offload pools: on a
// rank with pools it is done as the agent's own clears are (clearLocked),
// which keeps the pools' blocks here and on the router. Published as it
// came, it would drop them from both for good: nothing stores them again
// while the pools hold them.
func (a *Agent) Events(r kvevent.Rank, _ uint64, evs []kvevent.Event) error {
	if len(evs) == 0 {
		return nil
	}
	cp := cloneEvents(evs, r)
	if err := validate(cp); err != nil {
		a.pubErrs.Inc()
		return fmt.Errorf("publish rank %v: %w", r, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for len(cp) > 0 {
		part := cp
		i := -1
		if a.offloaded[r] != 0 {
			i = slices.IndexFunc(cp, func(e kvevent.Event) bool { return e.Kind == kvevent.KindCleared })
		}
		if i >= 0 {
			part = cp[:i]
		}
		if len(part) > 0 {
			if _, err := a.publishLocked(r, part, false); err != nil {
				a.pubErrs.Inc()
				return fmt.Errorf("publish rank %v: %w", r, err)
			}
		}
		if i < 0 {
			return nil
		}
		a.clearLocked(r, "engine_cleared")
		cp = cp[i+1:]
	}
	return nil
}

// Reset clears rank r: its engine restarted with an empty cache.
func (a *Agent) Reset(r kvevent.Rank) { a.clear(r, "engine_restart") }

// Resync clears rank r: its engine's stream lost batches for good.
func (a *Agent) Resync(r kvevent.Rank, reason enginesub.Reason) { a.clear(r, string(reason)) }

// clear drops what the engine reported of rank r, here and on the router.
// The blocks of the agent's offload pools survive: the mirror gets them
// back at once, and a resync sends the router the rank's dump, which
// replaces its state after the clear (a dump, not events, because a pool
// may hold more blocks than the replay buffer).
func (a *Agent) clear(r kvevent.Rank, reason string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.clearLocked(r, reason)
}

// clearLocked is clear with a.mu held.
func (a *Agent) clearLocked(r kvevent.Rank, reason string) {
	a.resets.WithLabelValues(reason).Inc()
	level := slog.LevelWarn
	if reason == "engine_cleared" {
		level = slog.LevelInfo // the engine was asked to reset its cache
	}
	a.log.Log(context.Background(), level, "clearing the rank on the router", "rank", r, "reason", reason)
	keep, park := a.offloadedLocked(r)
	a.mirror.RemoveRank(r)
	ev := []kvevent.Event{{Rank: r, Kind: kvevent.KindCleared}}
	if _, err := a.pub.Publish(r, ev); err != nil {
		// The publisher is closing; the next incarnation resyncs anyway.
		a.pubErrs.Inc()
		a.log.Error("publishing a clear failed", "rank", r, "err", err)
	}
	for _, ev := range park {
		a.parkLocked(r, ev)
	}
	if len(keep) > 0 {
		a.mirror.ApplyBatch(keep, time.Now().UnixNano())
		a.pub.Resync(r)
	}
}

// offloadedLocked returns, from the mirror, the blocks of rank r held in
// the tiers of its offload pools, as stored events, parents first: keep,
// what a clear keeps in the mirror and sends the router. A block whose
// parent is held only in another tier (the engine's) would be unreachable
// after the clear: those go into park, each as a store under its parent's
// engine hash, to wait until the engine stores the parent again. The
// mirror holds no block below one the rank does not hold (a remove of its
// last copy parks what was below it: parkCutLocked), so every pool block
// is in one or the other. The caller holds a.mu.
func (a *Agent) offloadedLocked(r kvevent.Rank) (keep, park []kvevent.Event) {
	tiers := a.offloaded[r]
	if tiers == 0 {
		return nil, nil
	}
	a.mirror.ExpireOrphans(time.Now().UnixNano())
	d, err := a.mirror.DumpRank(r)
	if err != nil {
		return nil, nil
	}
	ehOf := make(map[uint64]uint64, len(d.Entries)) // node → engine hash, every tier
	for _, e := range d.Entries {
		ehOf[e.Seq] = e.EngineHash
	}
	full := d.Entries
	kept := make([]indexer.DumpEntry, 0, len(full))
	for _, e := range full {
		if e.Mask &= tiers; e.Mask != 0 {
			kept = append(kept, e)
		}
	}
	d.Entries = kept
	keep = d.StoredEvents()
	sent := make(map[uint64]bool, len(keep))
	for _, ev := range keep {
		sent[ev.Blocks[0].EngineHash] = true
	}
	// A block left out of keep is parked under its parent's engine hash,
	// which the dump names when the rank held the parent in any tier (a
	// parked block's children are parked under it in turn).
	pos := make(map[uint64]int, len(kept))
	for i, e := range kept {
		pos[e.Seq] = i
	}
	for _, n := range d.Nodes {
		i, ok := pos[n.Seq]
		if !ok || sent[kept[i].EngineHash] || n.Root {
			continue
		}
		parent, ok := ehOf[n.Parent]
		if !ok {
			continue // none: parkCutLocked parked it when its parent went
		}
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if kept[i].Mask.Has(t) {
				park = append(park, kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: t, HasParent: true, Parent: parent,
					Blocks: []kvevent.Block{{EngineHash: kept[i].EngineHash, LocalHash: n.Local}}})
			}
		}
	}
	for _, o := range d.Orphans {
		if tiers.Has(o.Tier) {
			keep = append(keep, orphanEvent(r, o))
		}
	}
	return keep, park
}

// orphanEvent is a held store as the event that held it.
func orphanEvent(r kvevent.Rank, o indexer.DumpOrphan) kvevent.Event {
	return kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: o.Tier, HasParent: true, Parent: o.Parent, Blocks: o.Blocks}
}

// Publish publishes a batch of events of one of rank r's offload pools
// and applies it to the mirror, under the lock Events takes, so a dump of
// the rank includes the pools' blocks (pool.Sink: the pools call it with
// their own lock held, so the lock order is pool → agent → publisher; the
// agent never calls a pool). It returns the id of the rank's last event.
// A batch larger than the publisher's buffer goes out in parts, as in
// Events. It refuses a rank the agent does not follow and a batch with an
// invalid event (publishing none of it), and fails once the publisher is
// closed; the pool counts the error and goes on.
//
// A stored block is not published when it contradicts what the engine
// reported (kvagent_offload_mismatches_total{where="pool"}): the router
// would drop the engine's residency for it. The pool keeps it, unknown to
// the router, until it evicts it (whose REMOVE changes nothing). A stored
// block whose parent the mirror does not hold is parked until the parent
// is stored (the package invariants); a REMOVE of a parked block unparks
// it and is not published.
func (a *Agent) Publish(r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	if !a.follows(r) {
		return 0, fmt.Errorf("offload pool events of rank %v: the agent does not follow it", r)
	}
	if len(evs) == 0 {
		_, last := a.pub.Cursor(r)
		return last, nil
	}
	cp := cloneEvents(evs, r)
	if err := validate(cp); err != nil {
		a.pubErrs.Inc()
		return 0, fmt.Errorf("publish offload events of rank %v: %w", r, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	// Events other than stores go out together; each store is checked
	// against the mirror as it stands once what came before it applied.
	var run []kvevent.Event
	flush := func() error {
		if len(run) == 0 {
			return nil
		}
		_, err := a.publishLocked(r, run, true)
		run = nil
		return err
	}
	for _, ev := range cp {
		if ev.Kind == kvevent.KindRemoved {
			if ev.Removed = a.unparkLocked(r, ev.Tier, ev.Removed); len(ev.Removed) == 0 {
				continue
			}
		}
		if ev.Kind != kvevent.KindStored {
			run = append(run, ev)
			continue
		}
		if err := flush(); err != nil {
			a.pubErrs.Inc()
			return 0, fmt.Errorf("publish offload events of rank %v: %w", r, err)
		}
		if err := a.storePoolLocked(r, ev, true); err != nil {
			a.pubErrs.Inc()
			return 0, fmt.Errorf("publish offload events of rank %v: %w", r, err)
		}
	}
	if err := flush(); err != nil {
		a.pubErrs.Inc()
		return 0, fmt.Errorf("publish offload events of rank %v: %w", r, err)
	}
	_, last := a.pub.Cursor(r)
	return last, nil
}

// storePoolLocked takes a pool's stored chain ev of rank r: the blocks
// that contradict what the engine reported are dropped (counted and
// logged), those whose parent the mirror does not hold parked, and the
// rest published and applied (publish set), or applied without an event
// (Restore, whose blocks go out in the rank's dump). The caller holds
// a.mu.
func (a *Agent) storePoolLocked(r kvevent.Rank, ev kvevent.Event, publish bool) error {
	emit := func(blocks []kvevent.Block) error {
		st := ev
		st.Blocks = blocks
		if publish {
			_, err := a.publishLocked(r, []kvevent.Event{st}, true)
			return err
		}
		a.markOffloadedLocked(r, []kvevent.Event{st})
		a.mirror.TryApply(&st, time.Now().UnixNano())
		return nil
	}
	for len(ev.Blocks) > 0 {
		if ev.HasParent && !a.mirror.Holds(r, ev.Parent) {
			a.parkLocked(r, ev)
			return nil
		}
		i, conflict := a.mirror.CheckStore(r, ev.HasParent, ev.Parent, ev.Blocks)
		if conflict == nil {
			return emit(ev.Blocks)
		}
		if i > 0 {
			if err := emit(ev.Blocks[:i]); err != nil {
				return err
			}
		}
		a.mismatches.WithLabelValues("pool").Inc()
		a.log.Warn("an offload pool's block contradicts what the engine reported: not published (the router would drop the engine's block for it)",
			"rank", r, "tier", ev.Tier, "err", conflict)
		ev.HasParent, ev.Parent, ev.Blocks = true, ev.Blocks[i].EngineHash, ev.Blocks[i+1:]
	}
	return nil
}

// CheckOffload checks a block an engine asks rank r's pools to offload
// (engineapi.Checker) against what the engine reported: parent is its
// parent's engine hash (0 for the first block of a sequence), b its engine
// and content hashes. It refuses, with an error wrapping
// indexer.ErrConflict, an engine hash the mirror holds as another block
// (another content hash, or under another parent): the request names
// something else than what the engine reported, and stored in a pool it
// would make the router drop what the engine holds. A hash the mirror does
// not know passes, even when the mirror holds its block under another
// engine hash (indexer.ErrRenames): the engine's STORE of it may still be
// on its way (events and offloads travel apart), and one content has
// several engine hashes (extra_keys such as an image or a per-request
// cache salt, an engine restarted with another hash seed). Publish checks
// the copy again when it is stored. Counted in
// kvagent_offload_mismatches_total{where="request"}.
func (a *Agent) CheckOffload(r kvevent.Rank, parent uint64, b kvevent.Block) error {
	_, err := a.mirror.CheckStore(r, parent != 0, parent, []kvevent.Block{b})
	if err == nil || errors.Is(err, indexer.ErrRenames) {
		return nil
	}
	a.mismatches.WithLabelValues("request").Inc()
	return fmt.Errorf("offload of engine hash %#x: %w", b.EngineHash, err)
}

// validate checks every event of a batch before any of it is published:
// one published in parts must not go out in part.
func validate(evs []kvevent.Event) error {
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			return fmt.Errorf("event %d of %d: %w", i, len(evs), err)
		}
	}
	return nil
}

// publishLocked publishes evs of rank r, valid, and applies them to the
// mirror (marking the tiers of their stores as an offload pool's when
// offload is set). A batch larger than the publisher's buffer, which it
// would refuse whole (eventplane.ErrTooLarge), goes out in parts of at
// most the buffer's size, in order, with consecutive ids: a vLLM step that
// evicts more blocks than that sends as many removes in one batch. Each
// part is applied to the mirror once the publisher took it, so that the
// mirror and the ids move together if a later part fails (the publisher
// closed). The blocks below one whose last copy a part removed are taken
// back, the pools' parked (parkCutLocked), and the parked pool blocks
// whose parent a part stored follow it (releaseLocked). It returns the id of the last event. The caller holds
// a.mu.
func (a *Agent) publishLocked(r kvevent.Rank, evs []kvevent.Event, offload bool) (uint64, error) {
	for part := range slices.Chunk(evs, a.pub.BufferEvents()) {
		if _, err := a.pub.Publish(r, part); err != nil {
			return 0, err
		}
		if offload {
			a.markOffloadedLocked(r, part)
		}
		rep := a.applyLocked(r, part)
		if err := a.parkCutLocked(r, rep.Cut); err != nil {
			return 0, err
		}
		if err := a.releaseLocked(r, part, rep.Adopted); err != nil {
			return 0, err
		}
		if !offload {
			if err := a.withdrawRenamedLocked(r, rep.Renamed); err != nil {
				return 0, err
			}
		}
	}
	_, last := a.pub.Cursor(r)
	return last, nil
}

// Restore adds an offload pool's stored blocks (its Dump) to rank r's
// mirror without publishing them as events, and has the rank resynced:
// the router gets them in the rank's next dump, which Run sends first
// when Restore is called before it. This is how a G3 pool reopened on
// start republishes its blocks as part of a full dump of its rank. Every
// event must be a valid KindStored; otherwise nothing is applied.
func (a *Agent) Restore(r kvevent.Rank, stored []kvevent.Event) error {
	if !a.follows(r) {
		return fmt.Errorf("restore offloaded blocks of rank %v: the agent does not follow it", r)
	}
	cp := cloneEvents(stored, r)
	for i := range cp {
		if err := cp[i].Validate(); err != nil || cp[i].Kind != kvevent.KindStored {
			return fmt.Errorf("restore offloaded blocks of rank %v: event %d is not a valid store (%v)", r, i, err)
		}
	}
	a.mu.Lock()
	for _, ev := range cp {
		// A chain whose parent is not in the pool (nor, at the start, anywhere
		// else) is parked until the engine stores that parent: held as an
		// orphan, it would expire before the engine serves again.
		_ = a.storePoolLocked(r, ev, false) // fails only when publishing
	}
	a.mu.Unlock()
	a.pub.Resync(r)
	return nil
}

// parking is one rank's parked pool blocks: blocks an offload pool holds
// whose parent the mirror did not hold when they were stored, restored or
// kept through a clear, or whose parent a remove took (parkCutLocked). Published then, they would be left out of every
// dump (no lookup reaches them from the root), or held as orphans that
// expire; and nothing stores them again while the pool holds them. They
// wait here, outside the mirror and the router, for a store of their
// parent (releaseLocked), or for the pool's REMOVE (unparkLocked): the
// pools' capacity bounds them, not a TTL.
type parking struct {
	blocks   map[parkKey]parked
	byParent map[uint64][]parkKey
}

// parkKey names a parked block: a pool's tier and the block's engine hash.
type parkKey struct {
	tier kvevent.Tier
	hash uint64
}

// parked is what a store of a parked block needs. A block a remove or a
// remap cut off also has its parent's content hash (byLocal set): a store
// that reuses the parent's engine hash for another block, the cause of a
// remap, stores a block that is not its parent, and does not let it go.
type parked struct {
	parent, local uint64
	parentLocal   uint64
	byLocal       bool
}

// parkLocked parks the chain ev of rank r: its first block waits for
// ev.Parent, each other block for the one before it. The caller holds a.mu.
func (a *Agent) parkLocked(r kvevent.Rank, ev kvevent.Event) {
	a.parkUnderLocked(r, ev, 0, false)
}

// parkUnderLocked is parkLocked, and, with byLocal, has the chain's first
// block wait for a block of content hash parentLocal under ev.Parent (and
// each other for the one before it, whose content hash ev has).
func (a *Agent) parkUnderLocked(r kvevent.Rank, ev kvevent.Event, parentLocal uint64, byLocal bool) {
	p := a.parked[r]
	if p == nil {
		p = &parking{blocks: map[parkKey]parked{}, byParent: map[uint64][]parkKey{}}
		a.parked[r] = p
	}
	a.offloaded[r] |= ev.Tier.Bit() // a clear keeps what the pool's tier holds
	parent := ev.Parent
	for _, b := range ev.Blocks {
		k := parkKey{ev.Tier, b.EngineHash}
		if old, ok := p.blocks[k]; ok { // stored again: the newest wins
			p.unlink(k, old.parent)
		} else {
			a.parkedN.Inc()
		}
		p.blocks[k] = parked{parent: parent, local: b.LocalHash, parentLocal: parentLocal, byLocal: byLocal}
		p.byParent[parent] = append(p.byParent[parent], k)
		parent, parentLocal = b.EngineHash, b.LocalHash
	}
}

// unlink drops k from the blocks waiting for parent.
func (p *parking) unlink(k parkKey, parent uint64) {
	kids := p.byParent[parent]
	if i := slices.Index(kids, k); i >= 0 {
		kids = slices.Delete(kids, i, i+1)
	}
	if len(kids) == 0 {
		delete(p.byParent, parent)
	} else {
		p.byParent[parent] = kids
	}
}

// unparkLocked drops the hashes of a pool's REMOVE in tier t from rank r's
// parked blocks and returns the others, those the mirror may hold (in
// hashes' array). The caller holds a.mu.
func (a *Agent) unparkLocked(r kvevent.Rank, t kvevent.Tier, hashes []uint64) []uint64 {
	p := a.parked[r]
	if p == nil || len(p.blocks) == 0 {
		return hashes
	}
	return slices.DeleteFunc(hashes, func(h uint64) bool {
		k := parkKey{t, h}
		b, ok := p.blocks[k]
		if ok {
			delete(p.blocks, k)
			p.unlink(k, b.parent)
			a.parkedN.Dec()
		}
		return ok
	})
}

// applyLocked applies evs of rank r to the mirror and returns what the
// apply did beyond them (indexer.ApplyReport): the blocks of the stores
// the mirror held as orphans and applied with them (their parent
// arrived), any of which may be a parent parked blocks of r wait for;
// the blocks a store renamed; and the blocks below one whose last copy a
// remove took. The report costs nothing for a batch that adopts, renames
// and cuts off nothing (a remove of a block with no children looks at
// none). The caller holds a.mu.
func (a *Agent) applyLocked(r kvevent.Rank, evs []kvevent.Event) indexer.ApplyReport {
	var rep indexer.ApplyReport
	a.mirror.ApplyBatchReport(evs, time.Now().UnixNano(), &rep)
	return rep
}

// withdrawRenamedLocked takes back, here and on the router, the offload
// pools' copies of rank r's blocks an engine batch renamed (renames, in
// the order the mirror applied them): the mirror, like the router, holds
// a rank's block under one engine hash, the newest, in every tier, so a
// pool's copy stored under the old name would now be held under the
// engine's, and the pool's REMOVE of it, which names the old, would no
// longer take it back. Its tiers are removed under the block's name once
// the batch applied (a later rename in the batch moves it again; one back
// to the pool's name withdraws nothing). This is what a copy stored after
// the engine's block gets (storePoolLocked does not publish it): the
// router routes to the engine's block, and not to the pool's copy once
// the engine evicted it. Counted in
// kvagent_offload_mismatches_total{where="engine"}. The caller holds a.mu.
func (a *Agent) withdrawRenamedLocked(r kvevent.Rank, renames []indexer.Rename) error {
	pools := a.offloaded[r]
	if len(renames) == 0 || pools == 0 {
		return nil
	}
	var byTier [kvevent.NumTiers][]uint64
	n := 0
	moved := map[uint64]bool{} // names given by the batch's earlier renames
	for i, rn := range renames {
		if rn.Rank != r {
			continue
		}
		cont := moved[rn.Old] // a block this batch renamed before: done there
		moved[rn.New] = true
		tiers := rn.Tiers & pools
		if cont || tiers == 0 {
			continue
		}
		name := rn.New
		for _, later := range renames[i+1:] {
			if later.Rank == r && later.Old == name {
				name = later.New
			}
		}
		if name == rn.Old {
			continue
		}
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if tiers.Has(t) {
				byTier[t] = append(byTier[t], name)
			}
		}
		n++
		a.log.Debug("the engine stored an offload pool's block under another hash: the pool's copy is withdrawn from the router",
			"rank", r, "pool_hash", rn.Old, "engine_hash", name, "tier_mask", tiers)
	}
	if n == 0 {
		return nil
	}
	a.mismatches.WithLabelValues("engine").Add(float64(n))
	var evs []kvevent.Event
	for t, hs := range byTier {
		if len(hs) > 0 {
			evs = append(evs, kvevent.Event{Rank: r, Kind: kvevent.KindRemoved, Tier: kvevent.Tier(t), Removed: hs})
		}
	}
	_, err := a.publishLocked(r, evs, false) // removes: they rename nothing
	return err
}

// parkCutLocked takes back, here and on the router, the blocks of rank r
// that a remove of a block above them (or a store that reused its engine
// hash for another block) left unreachable (cuts, parents
// first, as the mirror reported them), those the part applied still
// leaves so (a store of the removed block in the same part makes them
// reachable again): no lookup reaches them, and a dump, which leaves
// them out, would take them off the router while the mirror kept them,
// never to be sent again. The tiers of the offload pools' blocks are
// parked under their parent's engine hash, and go back to the router
// when it is stored again (releaseLocked), as the blocks a clear parks
// do; the engine's own are dropped, as a dump drops them. Each tier goes
// in one REMOVE, published after the part. The caller holds a.mu.
func (a *Agent) parkCutLocked(r kvevent.Rank, cuts []indexer.Cut) error {
	if len(cuts) == 0 {
		return nil
	}
	pools := a.offloaded[r]
	var byTier [kvevent.NumTiers][]uint64
	gone := map[uint64]bool{} // blocks taken back here
	for _, c := range cuts {
		if c.Rank != r {
			continue
		}
		a.cutLookups++
		tiers, parentHeld := a.mirror.HeldUnder(r, c.EngineHash)
		if tiers == 0 || parentHeld && !gone[c.Parent] {
			continue // removed since, or reachable again
		}
		gone[c.EngineHash] = true
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if !tiers.Has(t) {
				continue
			}
			byTier[t] = append(byTier[t], c.EngineHash)
			if pools.Has(t) {
				a.parkUnderLocked(r, kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: t, HasParent: true, Parent: c.Parent,
					Blocks: []kvevent.Block{{EngineHash: c.EngineHash, LocalHash: c.Local}}}, c.ParentLocal, true)
			}
		}
	}
	var evs []kvevent.Event
	for t, hs := range byTier {
		if len(hs) > 0 {
			evs = append(evs, kvevent.Event{Rank: r, Kind: kvevent.KindRemoved, Tier: kvevent.Tier(t), Removed: hs})
		}
	}
	if len(evs) == 0 {
		return nil
	}
	// These removes cut nothing off in turn: each block's parent was cut
	// off or taken back before it (the mirror reports no cut below a block
	// whose parent the rank does not hold), which is why the blocks below
	// the first are taken back here, through gone, and not left for the
	// cuts of these removes.
	_, err := a.publishLocked(r, evs, false)
	return err
}

// releaseLocked publishes and applies rank r's parked blocks whose parent
// evs (applied to the mirror) stored or the apply adopted (adopted: the
// blocks of held orphans it applied), then those waiting for them, and so
// on, one event each: a parked block is checked against the mirror as a
// pool's store is (storePoolLocked), and one that contradicts what the
// engine reported since it was parked is dropped. Only a parent the
// mirror now holds lets its blocks go: a store that named a parent the
// mirror does not know is held as an orphan, and blocks let go under it
// would be orphans too, on the router as well, dropped when it expires,
// and no longer parked for its next store. A block parked by a cut waits
// for its parent's content hash too: after a store that reused the
// parent's engine hash for another block, a store of that block does not
// let it go, and it waits on for its own parent. Only the hashes a store named
// or an apply adopted are looked up, each once it is found in the parked
// set: a parent no store reached is never looked at, however many blocks
// wait for one (a reopened G3 pool whose engine restarted with another
// hash seed parks them all). The caller holds a.mu.
func (a *Agent) releaseLocked(r kvevent.Rank, evs []kvevent.Event, adopted []uint64) error {
	p := a.parked[r]
	if p == nil || len(p.byParent) == 0 {
		return nil
	}
	var queue []uint64
	waitedFor := func(hs ...uint64) {
		for _, h := range hs {
			if len(p.byParent[h]) > 0 {
				queue = append(queue, h)
			}
		}
	}
	for i := range evs {
		if evs[i].Kind != kvevent.KindStored {
			continue
		}
		for _, b := range evs[i].Blocks {
			waitedFor(b.EngineHash)
		}
	}
	waitedFor(adopted...)
	for len(queue) > 0 {
		parent := queue[0]
		queue = queue[1:]
		kids := p.byParent[parent]
		if len(kids) == 0 {
			continue // queued twice, and let go the first time
		}
		a.releaseLookups++
		local, ok := a.mirror.HeldAs(r, parent)
		if !ok {
			continue // a held orphan: its blocks wait on
		}
		delete(p.byParent, parent)
		var other []parkKey // waiting for another block named parent
		for _, k := range kids {
			b := p.blocks[k]
			if b.byLocal && b.parentLocal != local {
				other = append(other, k)
				continue
			}
			delete(p.blocks, k)
			a.parkedN.Dec()
			ev := kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: k.tier, HasParent: true, Parent: parent,
				Blocks: []kvevent.Block{{EngineHash: k.hash, LocalHash: b.local}}}
			if _, err := a.mirror.CheckStore(r, true, parent, ev.Blocks); err != nil {
				a.mismatches.WithLabelValues("pool").Inc()
				a.log.Warn("a parked offload pool block contradicts what the engine reported since: dropped", "rank", r, "tier", k.tier, "err", err)
				continue
			}
			evs := []kvevent.Event{ev}
			if _, err := a.pub.Publish(r, evs); err != nil {
				return err
			}
			waitedFor(k.hash)
			waitedFor(a.applyLocked(r, evs).Adopted...)
		}
		if len(other) > 0 {
			p.byParent[parent] = append(p.byParent[parent], other...)
		}
	}
	return nil
}

func (a *Agent) markOffloadedLocked(r kvevent.Rank, evs []kvevent.Event) {
	for i := range evs {
		if evs[i].Kind == kvevent.KindStored {
			a.offloaded[r] |= evs[i].Tier.Bit()
		}
	}
}

func (a *Agent) follows(r kvevent.Rank) bool {
	for _, x := range a.ranks {
		if x == r {
			return true
		}
	}
	return false
}

// dump is the publisher's Dump callback: the mirror's state of r and the
// id of the last event it reflects.
func (a *Agent) dump(r kvevent.Rank) ([]kvevent.Event, uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	_, last := a.pub.Cursor(r)
	// Held stores past their age go first: the router would hold them
	// again, drop them and ask for another dump.
	a.mirror.ExpireOrphans(time.Now().UnixNano())
	d, err := a.mirror.DumpRank(r)
	if err != nil { // the mirror holds nothing of r
		return nil, last
	}
	evs := d.StoredEvents()
	for _, o := range d.Orphans {
		evs = append(evs, orphanEvent(r, o))
	}
	return evs, last
}

// cloneEvents copies evs (valid only during a Sink call) for the publisher,
// which keeps them: one backing array for all their blocks and hashes.
func cloneEvents(evs []kvevent.Event, r kvevent.Rank) []kvevent.Event {
	nb, nh := 0, 0
	for i := range evs {
		nb += len(evs[i].Blocks)
		nh += len(evs[i].Removed)
	}
	blocks := make([]kvevent.Block, 0, nb)
	hashes := make([]uint64, 0, nh)
	out := make([]kvevent.Event, len(evs))
	for i := range evs {
		e := evs[i]
		e.Rank = r
		if len(e.Blocks) > 0 {
			blocks = append(blocks, e.Blocks...)
			e.Blocks = blocks[len(blocks)-len(e.Blocks) : len(blocks) : len(blocks)]
		}
		if len(e.Removed) > 0 {
			hashes = append(hashes, e.Removed...)
			e.Removed = hashes[len(hashes)-len(e.Removed) : len(hashes) : len(hashes)]
		}
		out[i] = e
	}
	return out
}
