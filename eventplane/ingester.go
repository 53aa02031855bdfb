package eventplane

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/kvrouter/kvrouter/internal/promreg"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/semaphore"
)

// Default subjects (docs/events.md). A dump subject is its events
// subject + ".dump".
const (
	DefaultSubject     = "kvrouter.events"
	DefaultDumpSubject = DefaultSubject + ".dump"
	queueGroup         = "kvrouter-ingest"
)

// defaultMaxRequestEvents is IngesterConfig.MaxRequestEvents's default: no
// events request of more events applies. A publisher renumbering past a
// router's cursor leaves that many ids free above it (Publisher.sendDump).
const defaultMaxRequestEvents = 65536

// CheckSubject says what is wrong with subject as the subject of event
// requests (the flags --events-subject), or returns nil: NATS tokens
// separated by dots, none empty, no wildcard and no white space, and
// neither it nor its dump subject (subject + ".dump") the heartbeat
// subject: the leader's ingester holds a queue subscription of one group
// on each, and NATS would hand some event requests to the heartbeat
// handler, which answers them as heartbeats.
func CheckSubject(subject string) error {
	if subject == "" {
		return errors.New("empty (the default is " + DefaultSubject + ")")
	}
	if err := checkLiteral(subject); err != nil {
		return err
	}
	return checkDistinct(subject, subject+".dump", DefaultHeartbeatSubject)
}

// checkLiteral says what keeps subject from being one literal NATS
// subject, or returns nil: tokens separated by dots, none empty, no
// wildcard and no white space. A subscription to a wildcard takes the
// messages of every subject it matches: "kvrouter.>" as the events
// subject would hand heartbeats to the events handler, and distinct
// strings would not say the subscriptions are.
func checkLiteral(subject string) error {
	if strings.ContainsAny(subject, " \t\r\n*>") {
		return fmt.Errorf("%q holds white space or a wildcard (* or >)", subject)
	}
	for _, tok := range strings.Split(subject, ".") {
		if tok == "" {
			return fmt.Errorf("%q has an empty token (a leading, trailing or double dot)", subject)
		}
	}
	return nil
}

// checkDistinct says which of an ingester's subjects are the same, or
// returns nil: each needs a subscription of its own.
func checkDistinct(events, dump, heartbeat string) error {
	switch heartbeat {
	case events:
		return fmt.Errorf("%q is the heartbeat subject: its event requests would be answered as heartbeats", events)
	case dump:
		return fmt.Errorf("%q has the heartbeat subject as its dump subject (%q): dumps would be answered as heartbeats", events, dump)
	}
	if events == dump {
		return fmt.Errorf("%q is both the events and the dump subject", events)
	}
	return nil
}

// Target is what the ingester commits to: a raftfsm.Node. It may also
// list the ranks of unregistered workers (unregisteredLister) and say
// whether its state is caught up with its leadership (leaderChecker).
// IngestEvents and ReplaceRankFenced propose one Raft entry each, unless
// their error says none was (proposed).
type Target interface {
	IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error)
	// ReplaceRankFenced commits a rank dump sent by publisher incarnation
	// incarnation (0: unfenced); a dump below the rank's cursor fails with
	// a *raftfsm.StaleDumpError.
	ReplaceRankFenced(ctx context.Context, r kvevent.Rank, cursor, incarnation uint64, stored []kvevent.Event) error
	IsLeader() bool
	// WorkerTable and DeregisterWorker serve worker leases (lease.go).
	WorkerTable() map[uint64]raftfsm.WorkerInfo
	DeregisterWorker(ctx context.Context, id uint64) error
}

// unregisteredLister is what a Target may also do (a raftfsm.Node does):
// list the ranks it holds state of that no registration lists (of a
// worker not registered, or not listed by its worker's registration), in
// rank order, so that the lease sweep removes them (lease.go). A Target
// without it has no such ranks removed.
type unregisteredLister interface {
	UnregisteredRanks() []kvevent.Rank
}

// leaderChecker is what a Target may also do (a raftfsm.Node does): say
// whether it leads with a state that holds every entry committed before
// its term (raftfsm.Node.CheckLeader fails until the new leader's
// post-election Barrier has applied them). A Target without it is taken
// to hold them once it leads.
type leaderChecker interface {
	CheckLeader() error
}

var _ leaderChecker = (*raftfsm.Node)(nil)

// termLeader is what a Target may also do (a raftfsm.Node does): say
// whether it leads and in which Raft term, read together
// (raftfsm.Node.LeaderTerm). A node that steps down and is elected again
// between two polls of the ingester leads on as far as IsLeader says: the
// term tells the new leadership from the old one. A Target without it
// leads in term 0: a re-election between two polls goes unseen.
type termLeader interface {
	LeaderTerm() (term uint64, leads bool)
}

var _ termLeader = (*raftfsm.Node)(nil)

// leaderTerm says whether the node leads, and in which term (termLeader).
func (in *Ingester) leaderTerm() (term uint64, leads bool) {
	if l, ok := in.cfg.Node.(termLeader); ok {
		return l.LeaderTerm()
	}
	return 0, in.cfg.Node.IsLeader()
}

// caughtUp reports whether the node's state may judge what the leader
// answers from it, not through Raft: heartbeats, and the lease and grace
// sweeps, read the worker table, which misses the registrations (and
// removals) still in the tail of the terms before until the Barrier. An
// entry the ingester commits needs no such wait: Raft applies it after
// that tail.
func (in *Ingester) caughtUp() bool {
	c, ok := in.cfg.Node.(leaderChecker)
	return !ok || c.CheckLeader() == nil
}

// IngesterConfig configures an Ingester. Its three subjects must be
// literal (no wildcard: checkLiteral) and distinct; NewIngester refuses
// them otherwise.
type IngesterConfig struct {
	Conn        *nats.Conn // a connection to this node's NATS server
	Node        Target
	Subject     string // default DefaultSubject
	DumpSubject string // default Subject + ".dump" (DefaultDumpSubject with the default Subject)
	// HeartbeatSubject carries agents' heartbeats (default
	// DefaultHeartbeatSubject); LeaseSweep is how often the leader looks
	// for expired worker leases (default 250ms).
	HeartbeatSubject string
	LeaseSweep       time.Duration
	// UnregisteredGrace is how long the ranks of a worker that is not
	// registered may keep state (events or dumps sent before its
	// registration, after its removal, or by a worker that never
	// registers) before the leader removes them (default 2m; lease.go).
	UnregisteredGrace time.Duration
	// Linger is how long the first request of an entry waits for more
	// (default 1ms); MaxEntryEvents and MaxEntryBytes end it early
	// (defaults 16384 events, 4 MiB of encoded requests).
	Linger         time.Duration
	MaxEntryEvents int
	MaxEntryBytes  int
	MaxInFlight    int // entries being committed at once, default 4
	// MaxRequestEvents refuses, as invalid, an events request of more
	// events (default 65536; a publisher sends at most its own
	// MaxRequestEvents, default 8192, which must not be larger).
	// MaxQueuedEvents bounds the events decoded and waiting for an entry
	// (default 262144), and MaxQueuedBytes the memory their requests
	// hold, body and decoded events (requestSize; default 64 MiB): past
	// either the subscription takes no more requests, which wait in NATS,
	// within its pending limit, or are dropped there for their publishers
	// to resend. A decoded event takes about 100 bytes however few it was
	// sent in (2 at least), but one stored event may carry any number of
	// blocks (16 bytes each, on the wire and decoded): the event bound
	// alone let 4096 requests of one event each, up to the NATS server's
	// max_payload apiece, queue. A request larger than MaxQueuedBytes
	// waits for an empty queue and then goes alone. The queue is not all
	// the leader holds of requests: the callback waiting for room holds
	// the request it decoded, and the batcher the group it packs (which
	// waits for a commit slot) and MaxInFlight entries committing, each up
	// to MaxEntryEvents or MaxEntryBytes plus the request that passes it.
	MaxRequestEvents int
	MaxQueuedEvents  int
	MaxQueuedBytes   int
	// CommitTimeout bounds each entry's commit (default 5s). A request is
	// answered after its entry commits: publishers must wait longer
	// (PublisherConfig.MaxRequestTimeout, 16s by default), or the replies
	// of commits that slow are lost and their events resent for ever.
	CommitTimeout time.Duration
	PollInterval  time.Duration // how often leadership is checked, default 20ms
	Registerer    prometheus.Registerer
	Logger        *slog.Logger
}

func (c *IngesterConfig) defaults() {
	if c.Subject == "" {
		c.Subject = DefaultSubject
	}
	if c.DumpSubject == "" {
		c.DumpSubject = c.Subject + ".dump"
	}
	if c.HeartbeatSubject == "" {
		c.HeartbeatSubject = DefaultHeartbeatSubject
	}
	if c.LeaseSweep <= 0 {
		c.LeaseSweep = 250 * time.Millisecond
	}
	if c.UnregisteredGrace <= 0 {
		c.UnregisteredGrace = 2 * time.Minute
	}
	if c.Linger <= 0 {
		c.Linger = time.Millisecond
	}
	if c.MaxEntryEvents <= 0 {
		c.MaxEntryEvents = 16384
	}
	if c.MaxEntryBytes <= 0 {
		c.MaxEntryBytes = 4 << 20
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 4
	}
	if c.MaxRequestEvents <= 0 {
		c.MaxRequestEvents = defaultMaxRequestEvents
	}
	if c.MaxQueuedEvents <= 0 {
		c.MaxQueuedEvents = 1 << 18
	}
	// A request the cap lets through must fit the queue whole.
	c.MaxQueuedEvents = max(c.MaxQueuedEvents, c.MaxRequestEvents)
	if c.MaxQueuedBytes <= 0 {
		c.MaxQueuedBytes = defaultMaxQueuedBytes
	}
	if c.CommitTimeout <= 0 {
		c.CommitTimeout = 5 * time.Second
	}
	if c.PollInterval <= 0 {
		c.PollInterval = 20 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// An Ingester turns event requests into Raft entries while its node leads.
// It runs on every node; it holds subscriptions only while the node leads,
// so that requests go to the one node that can commit them.
type Ingester struct {
	cfg IngesterConfig
	m   ingesterMetrics

	leases leases

	reqs        chan request
	queued      *semaphore.Weighted // events decoded and not yet taken by the batcher (MaxQueuedEvents)
	queuedBytes *semaphore.Weighted // their requests' size (MaxQueuedBytes; request.size)
	sem         chan struct{}
	stop        chan struct{}
	closeOnce   sync.Once
	ctx         context.Context // canceled by Close: ends waits for queue room
	cancel      context.CancelFunc
	wg          sync.WaitGroup // the loops
	cwg         sync.WaitGroup // commits in flight

	// The subscriptions' callbacks run on NATS's goroutines, and a
	// drained subscription still delivers what it holds after Close has
	// dropped it: hwg counts the callbacks running, which Close waits
	// for, and a callback that starts once Close has begun does nothing.
	hmu     sync.Mutex
	closing bool
	hwg     sync.WaitGroup

	// labelled holds the worker ids with events_received series, so that
	// a worker's series go when it leaves the table (dropLeftWorkers):
	// the label is bounded by the fleet, not by every worker there was.
	labelMu  sync.Mutex
	labelled map[uint64]string // its label
	// terms counts the terms this node ended leading (endTerm), under
	// labelMu: a commit of an earlier term sets no lag after the reset.
	terms uint64
}

// dropLeftWorkers deletes the received-events series of workers no longer
// in table.
func (in *Ingester) dropLeftWorkers(table map[uint64]raftfsm.WorkerInfo) {
	in.labelMu.Lock()
	defer in.labelMu.Unlock()
	for id, w := range in.labelled {
		if _, ok := table[id]; !ok {
			in.m.received.DeletePartialMatch(prometheus.Labels{"worker": w})
			in.m.lag.DeleteLabelValues(w)
			delete(in.labelled, id)
		}
	}
}

// hasLabelled says whether any worker has events_received series.
func (in *Ingester) hasLabelled() bool {
	in.labelMu.Lock()
	defer in.labelMu.Unlock()
	return len(in.labelled) > 0
}

// enter starts a subscription callback: false once Close has begun.
// A true answer must be followed by leave.
func (in *Ingester) enter() bool {
	in.hmu.Lock()
	defer in.hmu.Unlock()
	if in.closing {
		return false
	}
	in.hwg.Add(1)
	return true
}

func (in *Ingester) leave() { in.hwg.Done() }

// closed reports whether Close has begun: a callback then answers nothing
// (its publisher times out and resends to the next leader).
func (in *Ingester) closed() bool {
	select {
	case <-in.stop:
		return true
	default:
		return false
	}
}

type request struct {
	msg     *nats.Msg
	batches []raftfsm.RankBatch
	events  int
	size    int64 // what it holds of queuedBytes: requestSize, at most MaxQueuedBytes
	// published holds, per batch, when its first event was published
	// (unix microseconds, 0 unknown; headerPublished), or nothing.
	published []uint64
	// ackFlags are the ack flags its publisher reads (headerAckFlags).
	ackFlags byte
}

type ingesterMetrics struct {
	requests *prometheus.CounterVec // outcome
	entries  prometheus.Counter
	received *prometheus.CounterVec // worker, op, tier
	lag      *prometheus.GaugeVec   // worker
	rejected *prometheus.CounterVec // reason
	gaps     prometheus.Counter
	resyncs  *prometheus.CounterVec // reason
	subs     prometheus.Gauge

	heartbeats          prometheus.Counter
	malformedHeartbeats prometheus.Counter
	expired             prometheus.Counter
	leasesHeld          prometheus.Gauge
	unregRemoved        prometheus.Counter
}

func newIngesterMetrics(reg prometheus.Registerer, log *slog.Logger) ingesterMetrics {
	m := ingesterMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_requests_total",
			Help: "Event requests answered by this node's ingester (a message without a reply subject is not), by outcome (acked, not_leader, invalid, error, stale: a dump below the rank's cursor, answered with the cursor; unregistered: a dump of a rank its Positional worker does not list, applied nothing)."}, []string{"outcome"}),
		entries: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_events_entries_total",
			Help: "Raft entries proposed by the ingester (each packs one or more event requests, or one dump); a group refused before Raft took it (not leading, its deadline passed) is not counted."}),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_received_total",
			Help: "Events received by the leader's ingester, by worker (its id when registered, else other), op and tier."}, []string{"worker", "op", "tier"}),
		lag: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvrouter_events_lag_seconds",
			Help: "On the leader, by registered worker: how long before its last commit the oldest of its events in that Raft entry was handed to its agent's publisher (agent clocks count)."}, []string{"worker"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_requests_rejected_total",
			Help: "Event requests the ingester rejected, by reason (malformed: undecodable, refused before Raft; stale_dump: a dump below the rank's cursor, which the state machine refused, answered with the cursor)."}, []string{"reason"}),
		gaps: prometheus.NewCounter(raftfsm.GapsCounterOpts()), // the API's too
		resyncs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_events_resyncs_total",
			Help: "Rank dumps the leader's ingester committed, by reason (always dump: the agent does not tell the router why it dumped)."}, []string{"reason"}),
		subs: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_events_ingesting",
			Help: "1 while this node's ingester holds the event subscriptions (it leads)."}),
		heartbeats: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_worker_heartbeats_total",
			Help: "Worker heartbeats received by the leader (one per worker id)."}),
		malformedHeartbeats: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_worker_heartbeats_malformed_total",
			Help: "Heartbeat messages the leader could not decode (answered invalid; in no kvrouter_events_* family)."}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_worker_leases_expired_total",
			Help: "Workers removed because the leader heard no heartbeat for their lease."}),
		leasesHeld: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_worker_leases_held",
			Help: "1 on the leader while its NATS connection is down: it hears no heartbeat, and no worker's lease runs out (each starts afresh once the connection is back)."}),
		unregRemoved: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_unregistered_ranks_removed_total",
			Help: "Ranks whose state the leader removed because no registration listed them for the unregistered grace (events or dumps of a worker removed or never registered, or of a rank its worker's registration does not list)."}),
	}
	if reg == nil {
		return m
	}
	// An ingester made again on the same Registerer (a node restarted
	// in-process) goes on with the families of the one before, whose
	// counters so keep counting up, instead of panicking.
	m.requests = register(reg, log, m.requests)
	m.entries = register(reg, log, m.entries)
	m.received = register(reg, log, m.received)
	m.lag = register(reg, log, m.lag)
	m.rejected = register(reg, log, m.rejected)
	m.gaps = register(reg, log, m.gaps)
	m.resyncs = register(reg, log, m.resyncs)
	m.subs = register(reg, log, m.subs)
	m.heartbeats = register(reg, log, m.heartbeats)
	m.malformedHeartbeats = register(reg, log, m.malformedHeartbeats)
	m.expired = register(reg, log, m.expired)
	m.leasesHeld = register(reg, log, m.leasesHeld)
	m.unregRemoved = register(reg, log, m.unregRemoved)
	return m
}

// register registers c on reg and returns it, or the collector of the
// same family registered before, which it reuses (promreg.Register). On
// another error (a family of that name with other labels or help) it
// logs, and returns c, which counts but is not exported.
func register[C prometheus.Collector](reg prometheus.Registerer, log *slog.Logger, c C) C {
	c, err := promreg.Register(reg, c)
	if err != nil {
		log.Warn("eventplane: ingester metric not registered", "err", err)
	}
	return c
}

// NewIngester starts an ingester; it subscribes as soon as its node leads.
func NewIngester(cfg IngesterConfig) (*Ingester, error) {
	if cfg.Conn == nil || cfg.Node == nil {
		return nil, errors.New("eventplane: an ingester needs a NATS connection and a node")
	}
	cfg.defaults()
	for _, sub := range []struct{ name, subject string }{
		{"subject", cfg.Subject}, {"dump subject", cfg.DumpSubject}, {"heartbeat subject", cfg.HeartbeatSubject},
	} {
		if err := checkLiteral(sub.subject); err != nil {
			return nil, fmt.Errorf("eventplane: ingester %s: %w", sub.name, err)
		}
	}
	// Literal subjects that differ are subscriptions that share no message.
	if err := checkDistinct(cfg.Subject, cfg.DumpSubject, cfg.HeartbeatSubject); err != nil {
		return nil, fmt.Errorf("eventplane: ingester subjects: %w", err)
	}
	in := newIngester(cfg)
	in.wg.Add(2)
	go in.leadership()
	go in.batcher()
	return in, nil
}

// newIngester returns an ingester with its loops not started.
func newIngester(cfg IngesterConfig) *Ingester {
	cfg.defaults()
	in := &Ingester{cfg: cfg, m: newIngesterMetrics(cfg.Registerer, cfg.Logger),
		reqs: make(chan request, 4096), queued: semaphore.NewWeighted(int64(cfg.MaxQueuedEvents)),
		queuedBytes: semaphore.NewWeighted(int64(cfg.MaxQueuedBytes)), sem: make(chan struct{}, cfg.MaxInFlight),
		stop: make(chan struct{})}
	in.ctx, in.cancel = context.WithCancel(context.Background())
	return in
}

// Close unsubscribes, waits for the entries in flight to finish (each is
// bounded by CommitTimeout) and stops. Requests not yet answered get no
// reply: their publishers time out and resend. It may be called more than
// once, from several goroutines: each call returns once the ingester stopped.
func (in *Ingester) Close() error {
	// Once, not a check of stop then a close: two Closes at once (a
	// signal handler and a deferred one) both closed it, and panicked.
	// A second Close waits here until the first is done.
	in.closeOnce.Do(func() {
		in.hmu.Lock()
		in.closing = true
		in.hmu.Unlock()
		close(in.stop)
		in.cancel()
		in.wg.Wait()
		in.hwg.Wait()
		in.cwg.Wait()
		// The families outlive the ingester (the next one on the
		// Registerer reuses them), but it alone knows which workers it
		// labelled: their series go now, or a worker that left after
		// the next one started would stay exported for good.
		in.dropLeftWorkers(nil)
	})
	return nil
}

// leadership holds the subscriptions exactly while the node leads. Polling
// the leadership and its term (atomic loads: leaderTerm) keeps raftfsm's
// leadership loop untouched; a poll interval of 20ms is small next to an
// election, but a step-down and a re-election may both fit in one (two
// leadership transfers): the term changed, and the new term starts its
// leases, graces and lag afresh as after a step-down the poll saw.
func (in *Ingester) leadership() {
	defer in.wg.Done()
	var subs []*nats.Subscription
	var led uint64 // the term the subscriptions were taken, or the leases last started, in
	drop := func() {
		for _, s := range subs {
			// Drain lets the requests already delivered reach the batcher;
			// a stepped-down node answers them "not leader".
			if err := s.Drain(); err != nil {
				s.Unsubscribe()
			}
		}
		if subs != nil {
			in.cfg.Logger.Info("event ingestion stopped")
		}
		subs = nil
		in.m.subs.Set(0)
		in.endTerm()
	}
	defer drop()
	t := time.NewTicker(in.cfg.PollInterval)
	defer t.Stop()
	var lastSweep time.Time
	for {
		term, leads := in.leaderTerm()
		switch {
		case leads && subs != nil && term != led:
			// Stepped down and elected again since the last poll: what
			// a step-down ends (the old term's leases, graces, removals
			// in flight and lag) ends here, and the new term begins as
			// a lead does. The subscriptions go on: the node leads.
			in.endTerm()
			in.leases.lead(time.Now(), term)
			led = term
			in.cfg.Logger.Info("event ingestion goes on in a new term", "term", term)
		case leads && subs == nil:
			in.leases.lead(time.Now(), term)
			led = term
			s1, err1 := in.cfg.Conn.QueueSubscribe(in.cfg.Subject, queueGroup, in.onEvents)
			s2, err2 := in.cfg.Conn.QueueSubscribe(in.cfg.DumpSubject, queueGroup, in.onDump)
			s3, err3 := in.cfg.Conn.QueueSubscribe(in.cfg.HeartbeatSubject, queueGroup, in.onHeartbeat)
			if err := errors.Join(err1, err2, err3); err != nil {
				in.cfg.Logger.Warn("subscribe to events", "err", err)
				for _, s := range []*nats.Subscription{s1, s2, s3} {
					if s != nil {
						s.Unsubscribe()
					}
				}
				in.leases.stepDown()
				break
			}
			for _, s := range []*nats.Subscription{s1, s2} {
				s.SetPendingLimits(pendingMsgs, pendingBytes)
			}
			if subscribed != nil {
				subscribed(s1, s2, s3)
			}
			subs = []*nats.Subscription{s1, s2, s3}
			in.m.subs.Set(1)
			in.cfg.Logger.Info("event ingestion started", "subject", in.cfg.Subject)
		case !leads && subs != nil:
			drop()
		}
		if time.Since(lastSweep) >= in.cfg.LeaseSweep {
			switch {
			case subs != nil && in.caughtUp():
				lastSweep = time.Now()
				in.sweepLeases(lastSweep)
			case subs != nil:
				// Elected, with a state that may still lack entries of
				// the terms before (caughtUp): a worker registered there
				// would read as unregistered. The sweep waits, at each
				// poll, for the Barrier.
			default:
				lastSweep = time.Now()
				if in.hasLabelled() {
					// A node that led keeps its received-events series;
					// those of workers that left since go here.
					in.dropLeftWorkers(in.cfg.Node.WorkerTable())
				}
			}
		}
		select {
		case <-in.stop:
			return
		case <-t.C:
		}
	}
}

// The events' and dumps' subscriptions hold up to pendingBytes of
// messages, however many, while the callback waits for room in the queue
// (MaxQueuedEvents, MaxQueuedBytes); past it nats.go drops what comes, and
// reports a slow consumer to the connection's error handler
// (natswatch.ErrorHandler: kvrouter_nats_slow_consumer_total), and the
// publishers resend what got no reply. The count is not bounded: the
// bytes bound the memory, and nats.go's default (500,000 messages or 64
// MiB)
// would drop a burst of small requests far below it. The heartbeats keep
// the default.
const (
	pendingMsgs  = -1 // no bound on the count: the bytes bound it
	pendingBytes = 256 << 20
)

// subscribed, when set (by tests), is called with the events', dumps' and
// heartbeats' subscriptions once they are made and their limits set.
var subscribed func(events, dumps, heartbeats *nats.Subscription)

// endTerm ends what the leader keeps of its term, at a step-down or at a
// new term of its own: the lag gauge (measured by the leader only; a
// commit of the term before sets none after: observeLag), and the leases
// and graces, whose removals in flight stop (leases.stepDown).
func (in *Ingester) endTerm() {
	in.labelMu.Lock()
	in.terms++
	in.m.lag.Reset()
	in.labelMu.Unlock()
	in.leases.stepDown()
	in.m.leasesHeld.Set(0) // a follower holds no lease; a new term starts hearing afresh
}

// reply answers m and counts it in kvrouter_events_requests_total. A
// message without a reply subject (a publish, not a request) gets no
// answer and is not counted: the family counts the requests answered, and
// a publish counted acked read as a publisher that got its ack.
func (in *Ingester) reply(m *nats.Msg, b []byte, outcome string) {
	if m.Reply == "" {
		return
	}
	in.m.requests.WithLabelValues(outcome).Inc()
	_ = m.Respond(b)
}

func (in *Ingester) replyErr(m *nats.Msg, err error) {
	code, outcome := uint8(codeInternal), "error"
	switch {
	case errors.Is(err, raftfsm.ErrNotLeader), errors.Is(err, raftfsm.ErrNoLeader), errors.Is(err, raftfsm.ErrShutdown):
		code, outcome = codeNotLeader, "not_leader"
	case errors.Is(err, ErrMalformed), errors.Is(err, raftfsm.ErrInvalid):
		code, outcome = codeInvalid, "invalid"
	}
	in.reply(m, appendError(nil, code, err.Error()), outcome)
}

// defaultMaxQueuedBytes is IngesterConfig.MaxQueuedBytes's default: room
// for the default MaxQueuedEvents of events of one block (about 130 bytes
// each, body and decoded: 32 MiB) with room to spare, so that it bounds
// only requests of large events; and for a few of the largest requests
// the embedded NATS server takes (8 MiB, requestSize about twice that).
const defaultMaxQueuedBytes = 64 << 20

// The sizes of the decoded forms (decodeEventsHeld counts them).
const (
	sizeBatch = int(unsafe.Sizeof(raftfsm.RankBatch{}))
	sizeEvent = int(unsafe.Sizeof(kvevent.Event{}))
)

// requestSize is the memory an events request holds while queued: its
// body, which the reply keeps, and the held bytes of its decoded batches,
// events and their blocks and removed hashes (decodeEventsHeld).
func requestSize(body []byte, held int) int { return len(body) + held }

// onEvents decodes a request and hands it to the batcher. It runs on the
// subscription's goroutine, so decoding is off the batcher's path; it
// waits there while the queue holds MaxQueuedEvents or MaxQueuedBytes.
func (in *Ingester) onEvents(m *nats.Msg) {
	if !in.enter() {
		return
	}
	defer in.leave()
	batches, held, err := decodeEventsHeld(m.Data, in.cfg.MaxRequestEvents)
	if err != nil {
		in.m.rejected.WithLabelValues("malformed").Inc()
		in.replyErr(m, err)
		return
	}
	n := 0
	workers := in.cfg.Node.WorkerTable()
	for i := range batches {
		n += len(batches[i].Events)
		in.countReceived(&batches[i], workers)
	}
	// A request larger than the whole bound takes all of it: it waits for
	// an empty queue rather than for ever.
	size := min(int64(requestSize(m.Data, held)), int64(in.cfg.MaxQueuedBytes))
	if err := in.queued.Acquire(in.ctx, int64(n)); err != nil {
		return // closing: unanswered, its publisher resends
	}
	if err := in.queuedBytes.Acquire(in.ctx, size); err != nil {
		in.queued.Release(int64(n))
		return
	}
	var published []uint64
	if v := m.Header.Get(headerPublished); v != "" {
		published, _ = parsePublished(v, len(batches), make([]uint64, 0, len(batches)))
	}
	ackFlags := parseAckFlags(m.Header.Get(headerAckFlags))
	select {
	case in.reqs <- request{msg: m, batches: batches, events: n, size: size, published: published, ackFlags: ackFlags}:
	case <-in.stop:
		in.release(n, size)
	}
}

// release gives back what a request held of the queue's bounds.
func (in *Ingester) release(events int, size int64) {
	in.queued.Release(int64(events))
	in.queuedBytes.Release(size)
}

// countReceived counts a rank batch's events in
// kvrouter_events_received_total{worker,op,tier}, once per series. The
// worker label is the worker's id when it is registered, else "other":
// anyone may publish, and the fleet bounds the registered ids.
func (in *Ingester) countReceived(b *raftfsm.RankBatch, workers map[uint64]raftfsm.WorkerInfo) {
	var counts [kvevent.KindCleared + 1][kvevent.NumTiers]int
	for j := range b.Events {
		ev := &b.Events[j]
		if ev.Kind <= kvevent.KindCleared && ev.Tier < kvevent.NumTiers { // checked by the decoder
			counts[ev.Kind][ev.Tier]++
		}
	}
	worker := "other"
	if _, ok := workers[b.Rank.Worker]; ok {
		in.labelMu.Lock()
		if in.labelled == nil {
			in.labelled = map[uint64]string{}
		}
		if worker, ok = in.labelled[b.Rank.Worker]; !ok {
			worker = strconv.FormatUint(b.Rank.Worker, 10) // once per worker, not per batch
			in.labelled[b.Rank.Worker] = worker
		}
		in.labelMu.Unlock()
	}
	for k := kvevent.KindStored; k <= kvevent.KindCleared; k++ {
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			if c := counts[k][t]; c > 0 {
				in.m.received.WithLabelValues(worker, k.String(), t.String()).Add(float64(c))
			}
		}
	}
}

// observeLag sets kvrouter_events_lag_seconds of the registered workers
// whose batches committed at now: the age of each one's oldest event in
// group. A publisher's clock that runs ahead reads as no lag. A group
// whose commit began before this node last stopped leading (term) sets
// nothing: the step-down cleared the gauge, which only a leader keeps.
func (in *Ingester) observeLag(group []request, term uint64, now time.Time) {
	type age struct{ worker, oldest uint64 }
	var ages []age // few workers per entry: a linear search beats a map
	in.labelMu.Lock()
	defer in.labelMu.Unlock()
	if term != in.terms {
		return
	}
	for _, r := range group {
		for i, t := range r.published {
			w := r.batches[i].Rank.Worker
			if _, ok := in.labelled[w]; !ok || t == 0 {
				continue
			}
			j := slices.IndexFunc(ages, func(a age) bool { return a.worker == w })
			switch {
			case j < 0:
				ages = append(ages, age{w, t})
			case t < ages[j].oldest:
				ages[j].oldest = t
			}
		}
	}
	us := uint64(now.UnixMicro())
	for _, a := range ages {
		lag := 0.0
		if a.oldest < us {
			lag = float64(us-a.oldest) / 1e6
		}
		in.m.lag.WithLabelValues(strconv.FormatUint(a.worker, 10)).Set(lag)
	}
}

// proposed says whether a Target's write that returned err proposed its
// entry (kvrouter_events_entries_total): it did unless err says it was
// refused before Raft took it: invalid, not proposed (its deadline
// passed first), or not the leader without the entry in the log (a node
// that no longer leads answers its drained subscription's requests so).
// An entry proposed and then lost (a lost leadership) counts.
func proposed(err error) bool {
	var nle *raftfsm.NotLeaderError
	switch {
	case err == nil:
		return true
	case errors.As(err, &nle):
		return nle.MaybeApplied
	case errors.Is(err, raftfsm.ErrNotProposed), errors.Is(err, raftfsm.ErrInvalid):
		return false
	}
	return true
}

// onDump commits a rank dump. Dumps are rare and large: each is its own
// entry.
func (in *Ingester) onDump(m *nats.Msg) {
	if !in.enter() {
		return
	}
	defer in.leave()
	d, err := decodeDump(m.Data)
	if err != nil {
		in.m.rejected.WithLabelValues("malformed").Inc()
		in.replyErr(m, err)
		return
	}
	ctx, cancel := context.WithTimeout(in.ctx, in.cfg.CommitTimeout)
	defer cancel()
	err = in.cfg.Node.ReplaceRankFenced(ctx, d.rank, d.cursor, d.incarnation, d.stored)
	if proposed(err) {
		in.m.entries.Inc()
	}
	if in.closed() {
		return // unanswered, as Close says: its publisher resends
	}
	if err != nil {
		if errors.Is(err, raftfsm.ErrUnregisteredRank) {
			// Refused as the rank's events are. A publisher that reads the
			// unregistered ack flag reads this answer too, and backs the
			// rank off as it does its events; another (an earlier build)
			// gets an invalid request, which it retries after its dump
			// backoff. Either way no publisher resends at once.
			code := uint8(codeInvalid)
			if parseAckFlags(m.Header.Get(headerAckFlags))&ackUnregistered != 0 {
				code = codeUnregistered
			}
			in.reply(m, appendError(nil, code, err.Error()), "unregistered")
			return
		}
		var stale *raftfsm.StaleDumpError
		if errors.As(err, &stale) {
			// The publisher numbers anew (it restarted): tell it where the
			// rank is, so that it renumbers past it and dumps again.
			in.m.rejected.WithLabelValues("stale_dump").Inc()
			in.reply(m, appendDumpOK(nil, stale.Cursor), "stale")
			return
		}
		in.replyErr(m, err)
		return
	}
	in.m.resyncs.WithLabelValues("dump").Inc()
	in.reply(m, appendDumpOK(nil, d.cursor), "acked")
}

// batcher packs requests into entries. The first request of an entry
// starts the linger; the entry closes when the linger ends or it is full.
// Commits run concurrently (up to MaxInFlight): Raft orders them, and
// since a publisher has one request in flight, two entries never carry
// the same publisher's consecutive events out of order — and if they did
// (a resend racing the original), the cursor turns the late one into
// duplicates or a gap, which the publisher heals.
func (in *Ingester) batcher() {
	defer in.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		var group []request
		var events, bytes int
		select {
		case <-in.stop:
			return
		case r := <-in.reqs:
			in.release(r.events, r.size)
			group, events, bytes = append(group, r), r.events, len(r.msg.Data)
		}
		timer.Reset(in.cfg.Linger)
	collect:
		for events < in.cfg.MaxEntryEvents && bytes < in.cfg.MaxEntryBytes {
			select {
			case <-in.stop:
				break collect
			case r := <-in.reqs:
				in.release(r.events, r.size)
				group = append(group, r)
				events += r.events
				bytes += len(r.msg.Data)
			case <-timer.C:
				break collect
			}
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		select {
		case in.sem <- struct{}{}:
		case <-in.stop:
			return
		}
		in.cwg.Add(1)
		go in.commit(group)
	}
}

func (in *Ingester) commit(group []request) {
	defer in.cwg.Done()
	defer func() { <-in.sem }()
	n := 0
	for _, r := range group {
		n += len(r.batches)
	}
	all := make([]raftfsm.RankBatch, 0, n)
	for _, r := range group {
		all = append(all, r.batches...)
	}
	in.labelMu.Lock()
	term := in.terms
	in.labelMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), in.cfg.CommitTimeout)
	defer cancel()
	acks, err := in.cfg.Node.IngestEvents(ctx, all)
	if proposed(err) {
		in.m.entries.Inc()
	}
	if err == nil && len(acks) != len(all) {
		err = errors.New("ingest returned a wrong number of acks")
	}
	if err != nil {
		for _, r := range group {
			in.replyErr(r.msg, err)
		}
		return
	}
	in.observeLag(group, term, time.Now())
	var buf []byte
	for _, r := range group {
		mine := acks[:len(r.batches)]
		acks = acks[len(r.batches):]
		for _, a := range mine {
			// Acknowledged only when answered: a publish (no reply
			// subject) gets no answer, and no count (reply).
			if a.Gap && r.msg.Reply != "" {
				in.m.gaps.Inc()
			}
		}
		buf = appendAcks(buf[:0], mine, r.ackFlags)
		in.reply(r.msg, buf, "acked")
	}
}
