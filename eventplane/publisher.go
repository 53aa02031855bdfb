package eventplane

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// DumpFunc returns a rank's whole state as Stored events (each a chain
// from the root or from a parent stored by an earlier event of the dump)
// and the id of the last event that state reflects. It is called without
// any publisher lock held, so it may take the owner's own lock, the same
// one the owner holds around Publish: that is how the state and the id
// agree. PublishWait under that lock does not wait for a dump, of its
// rank or another: the send loop builds dumps inline, so while it is in
// a DumpFunc no ack makes room for any rank. A full rank that needs a
// dump drops its oldest events, which the dump covers; and while a
// DumpFunc runs, a full rank PublishWait is called for drops its oldest
// events and asks for a dump of its own, rather than wait for room only
// the loop makes (kvagent_events_resyncs_total{reason="wait"}).
type DumpFunc func(r kvevent.Rank) (stored []kvevent.Event, through uint64)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	Conn *nats.Conn
	// Subject is where event requests go (default DefaultSubject): the
	// routers' --events-subject. DumpSubject is where dumps go, by default
	// Subject + ".dump" (DefaultDumpSubject with the default Subject), as
	// kvrouter derives it from --events-subject.
	Subject     string
	DumpSubject string
	// BufferEvents bounds each rank's replay buffer (unacknowledged
	// events), default 65536.
	BufferEvents int
	// DropOldest, when set, makes a full buffer drop its oldest events
	// instead of refusing new ones: the router then reports a gap, and the
	// rank heals with a dump. Off, Publish returns ErrFull (PublishWait
	// waits for room), except for a rank that waits for a dump, which
	// drops its oldest events all the same (the dump covers them).
	DropOldest bool
	// Dump reads the rank's whole state for a full dump. It is required
	// whenever the router may ask for one: its cursor fell behind the
	// buffer (DropOldest, a restored router), or another incarnation's
	// dump fenced the rank. Without it such a rank's events are stuck:
	// logged and retried, never applied.
	Dump DumpFunc
	// MaxRequestEvents and MaxRequestBytes bound one request (defaults
	// 8192 events, 1 MiB — NATS's default max payload).
	MaxRequestEvents int
	MaxRequestBytes  int
	// RequestTimeout is how long a request waits for the router's reply
	// (default 2s). The router answers only once the request's entry
	// commits, which may take up to its CommitTimeout (IngesterConfig,
	// 5s by default) after the linger and the wait for an entry slot: a
	// request that times out is resent with twice the timeout, up to
	// MaxRequestTimeout (default 16s, never below RequestTimeout); it
	// halves back towards RequestTimeout after each reply that came
	// within a quarter of it, and stays up while replies are slow. A
	// MaxRequestTimeout below the router's commit time loses every reply
	// of a slow commit: the same events are resent and committed again
	// (as duplicates) for ever, never acknowledged.
	RequestTimeout    time.Duration
	MaxRequestTimeout time.Duration
	// RouterResyncEvery bounds how often a rank is dumped because the
	// router asked (an ack's Resync: it dropped stores whose parent never
	// came). Default 5m. The owner's copy of the rank usually dropped the
	// same stores, so such a dump mostly clears the flag rather than
	// brings the blocks back; it must not run on every ack. An ack that is
	// Fenced as well (another incarnation dumped the rank) is not held
	// back: it dumps the rank at once.
	RouterResyncEvery time.Duration
	MinBackoff        time.Duration // default 5ms
	MaxBackoff        time.Duration // default 500ms
	// Incarnation is the id every request and dump of this publisher
	// carries (docs/events.md). 0, the default, draws a random non-zero
	// one, as every publisher should: two publishers that send the same
	// rank must never share one. Tests set it.
	Incarnation uint64
	// Registerer, when set, registers the kvagent_events_* metrics;
	// NewPublisher fails, registering none, when it cannot (one of them
	// is registered already).
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

func (c *PublisherConfig) defaults() {
	if c.Subject == "" {
		c.Subject = DefaultSubject
	}
	if c.DumpSubject == "" {
		c.DumpSubject = c.Subject + ".dump"
	}
	if c.BufferEvents <= 0 {
		c.BufferEvents = 65536
	}
	if c.MaxRequestEvents <= 0 {
		c.MaxRequestEvents = 8192
	}
	if c.MaxRequestBytes <= 0 {
		c.MaxRequestBytes = 1 << 20
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = 2 * time.Second
	}
	if c.MaxRequestTimeout <= 0 {
		c.MaxRequestTimeout = 16 * time.Second
	}
	c.MaxRequestTimeout = max(c.MaxRequestTimeout, c.RequestTimeout)
	if c.RouterResyncEvery <= 0 {
		c.RouterResyncEvery = 5 * time.Minute
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = 5 * time.Millisecond
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 500 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	// Neither 0 (unfenced) nor raftfsm.PositionalIncarnation (the
	// compatible API's, which routers refuse from a publisher).
	for c.Incarnation == 0 || c.Incarnation == raftfsm.PositionalIncarnation {
		c.Incarnation = rand.Uint64() // the runtime's ChaCha8, seeded from the OS
	}
}

// A Publisher sends a node agent's events to the router cluster. Per rank
// it assigns consecutive event ids from 1, keeps every event not yet
// acknowledged in a bounded replay buffer, and sends the buffers' heads by
// NATS request to whichever node leads (the leader alone subscribes), one
// request in flight at a time: events published while a request is out
// ride in the next one, so batches grow with the commit latency. A request
// that fails, times out or meets no responder is resent after a backoff;
// duplicates are harmless (the router skips ids at or below its cursor).
// Every request and dump carries the publisher's incarnation
// (PublisherConfig.Incarnation), drawn at random when it is built.
type Publisher struct {
	cfg PublisherConfig
	m   publisherMetrics
	// tooLarge limits the lines of dumps larger than the NATS server
	// takes, per rank (dumpTooLarge).
	tooLarge *lograte.Limiter

	mu    sync.Mutex
	ranks map[kvevent.Rank]*rankBuf
	order []kvevent.Rank // round-robin order for fairness within a request
	rr    int
	room  chan struct{} // closed (and replaced) when buffers shrink, or a dump starts
	// dumping says the loop is inside the DumpFunc, which may wait for
	// the lock a PublishWait caller holds (publish).
	dumping bool

	kick      chan struct{}
	stop      chan struct{}
	closeOnce sync.Once
	done      chan struct{}
	// ctx ends at Close: a request waiting for its reply (up to
	// MaxRequestTimeout) does not hold the close back.
	ctx    context.Context
	cancel context.CancelFunc
	rng    *rand.Rand
	// timeout is the next request's timeout, in nanoseconds: RequestTimeout,
	// doubled after each timeout up to MaxRequestTimeout, halved back
	// after a quick reply (request). Only the loop goroutine writes it.
	timeout atomic.Int64
}

// rankBuf holds a rank's unacknowledged events: ids start..next-1 live in
// evs[head:] (start may be past acked+1 after DropOldest).
type rankBuf struct {
	next  uint64 // the id the next published event gets
	acked uint64 // the router's cursor, as last acknowledged
	// sent is the highest id a request carried or a committed dump
	// reported (its through), moved as the ids by each renumbering: no
	// cursor of ours is past it. An ack's cursor past it (below next)
	// was taken for the acknowledgement of buffered events no request
	// had carried, which were trimmed unsent and read as delivered by
	// Flush (from the event-plane review).
	sent     uint64
	evs      []kvevent.Event
	head     int
	needDump bool
	// dumps counts the dumps of the rank the router took (Synced).
	dumps uint64
	// dumpAsks counts the times a dump was asked for (askDump): a dump
	// built before the last ask does not answer it (sendDump).
	dumpAsks uint64
	// routerAsked is when the router's Resync last made this rank dump;
	// routerDue, when set, is when an ask held back within
	// RouterResyncEvery makes it dump (nextDump), unless an ack without
	// the flag, a heartbeat's answer without it (RouterStopsAsking) or a
	// dump comes first.
	routerAsked, routerDue time.Time
	// moves records the renumberings since the last dump went through
	// (sendDump), oldest first, so that a dump's through reported in an
	// earlier numbering is moved as the ids were (translate). renumbers
	// counts them.
	moves     []renumbering
	renumbers int
	// renumbered is how far the ids moved in all, never reset: Flush
	// moves an id it waits for as the renumberings since moved it.
	renumbered uint64
	// A dump that failed is retried after its own backoff, so that the
	// other ranks' events go on meanwhile (a dump too large for the
	// server, say, would otherwise hold every rank of the agent).
	dumpBackoff time.Duration
	dumpRetryAt time.Time
	// The router refuses the rank's batches (RankAck.Unregistered: its
	// worker does not list it): its events are kept and sent again after
	// their own backoff, with the other ranks' going on meanwhile, until
	// a registration lists the rank. unregistered says the refusal was
	// logged; an ack that takes the rank again clears it.
	unregistered   bool
	refusedBackoff time.Duration
	refusedRetryAt time.Time
	// marks records when events were published: one per Publish call, by
	// its first id, in id order; marks[mhead:] are live. A request tells
	// the leader when the oldest event of each of its rank batches was
	// published (headerPublished), which the leader turns into
	// kvrouter_events_lag_seconds.
	marks []publishMark
	mhead int
}

// A publishMark says that the events from id on were published at at
// (unix microseconds), up to the next mark's id.
type publishMark struct {
	id, at uint64
}

func (b *rankBuf) liveMarks() []publishMark { return b.marks[b.mhead:] }

// markAfter returns the index in liveMarks of the first mark above id.
func (b *rankBuf) markAfter(id uint64) int {
	i, _ := slices.BinarySearchFunc(b.liveMarks(), id, func(m publishMark, id uint64) int { return cmp.Compare(m.id, id+1) })
	return i
}

// publishedAt returns when the event with id was published: the time of
// the last mark at or below id (0 when no mark is).
func (b *rankBuf) publishedAt(id uint64) uint64 {
	i := b.markAfter(id)
	if i == 0 {
		return 0
	}
	return b.liveMarks()[i-1].at
}

// askDump marks the rank as needing a dump.
func (b *rankBuf) askDump() {
	b.needDump = true
	b.dumpAsks++
}

// askDump marks b as needing a dump, and wakes the PublishWait callers:
// a full rank that waits for a dump takes events again (publish). p.mu is
// held.
func (p *Publisher) askDump(b *rankBuf) {
	b.askDump()
	p.wakeRoom()
}

// wakeRoom wakes the PublishWait callers to try again; p.mu is held.
func (p *Publisher) wakeRoom() {
	close(p.room)
	p.room = make(chan struct{})
}

func (b *rankBuf) pending() []kvevent.Event { return b.evs[b.head:] }

// trim drops events with ids <= id.
func (b *rankBuf) trim(id uint64) int {
	p := b.pending()
	k := 0
	for k < len(p) && p[k].EventID <= id {
		k++
	}
	clear(p[:k]) // let the GC have the block slices
	b.head += k
	if b.head > 1024 && b.head > len(b.evs)/2 {
		b.evs = append(b.evs[:0], b.evs[b.head:]...)
		b.head = 0
	}
	b.trimMarks()
	return k
}

// A renumbering moved the ids below floor (the next id Publish would have
// returned before it: every id it had returned is below, every one it
// returns after is at or above floor+shift) up by shift.
type renumbering struct {
	floor, shift uint64
}

// maxMoves bounds rankBuf.moves. Renumberings come one per refused dump,
// and past a few (a second writer of the rank) on a backoff: a fight that
// goes on must not grow the list for ever. Past the bound the two oldest
// merge (mergeMoves).
const maxMoves = 32

// renumber moves the buffered events' ids, their marks and the next id up
// by shift, records the renumbering in moves, and adds shift to how far
// the rank has moved in all.
func (b *rankBuf) renumber(shift uint64) {
	b.moves = append(b.moves, renumbering{floor: b.next, shift: shift})
	if len(b.moves) > maxMoves {
		b.mergeMoves()
	}
	pend := b.pending()
	for i := range pend {
		pend[i].EventID += shift
	}
	live := b.liveMarks()
	for i := range live {
		live[i].id += shift
	}
	b.next += shift
	b.sent += shift
	b.renumbered += shift
}

// mergeMoves makes the two oldest renumberings one, at the oldest one's
// floor: an id from before both still moves by both, and one Publish
// returned between them is moved by neither, too low, so that the dump
// reporting it is followed by events it already holds (applied again,
// rather than lost). Only an owner that reports a through maxMoves
// renumberings old meets it.
func (b *rankBuf) mergeMoves() {
	b.moves[1] = renumbering{floor: b.moves[0].floor, shift: b.moves[0].shift + b.moves[1].shift}
	b.moves = append(b.moves[:0], b.moves[1:]...)
}

// translate moves id, as an owner reports it (a dump's through), into the
// current numbering: each renumbering since the last dump, in turn, moves
// it when it is below that one's floor. After a renumbering the id is
// below the next one's floor exactly when it was below this one's, so an
// id Publish returned before the first renumbering moves by every shift,
// and one it returned between two of them by the later ones only. Moving
// every id below the last floor by the sum of the shifts moved one
// returned between two renumberings too far up, past events published
// after the dump was built, which were then dropped as covered by it
// (from the event-plane review).
func translate(moves []renumbering, id uint64) uint64 {
	for _, m := range moves {
		if id < m.floor {
			id += m.shift
		}
	}
	return id
}

// trimMarks drops the marks of events no longer buffered, keeping the one
// that covers the first event still buffered. Like the events, dropped
// marks are compacted away only once they are most of the slice, so that
// a full buffer dropping its oldest event per Publish (DropOldest) costs
// no copy of every mark.
func (b *rankBuf) trimMarks() {
	p := b.pending()
	if len(p) == 0 {
		b.marks, b.mhead = b.marks[:0], 0
		return
	}
	if i := b.markAfter(p[0].EventID); i > 1 {
		b.mhead += i - 1
	}
	if b.mhead > 1024 && b.mhead > len(b.marks)/2 {
		b.marks = append(b.marks[:0], b.marks[b.mhead:]...)
		b.mhead = 0
	}
}

type publisherMetrics struct {
	published, acked, full, dropped, dumps, requests, retries, unregistered, tooLarge prometheus.Counter
	resends                                                                           *prometheus.CounterVec
	buffered                                                                          prometheus.Gauge
}

func newPublisherMetrics(reg prometheus.Registerer) (publisherMetrics, error) {
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	m := publisherMetrics{
		published: c("kvagent_events_published_total", "Events given ids and buffered for the router."),
		acked:     c("kvagent_events_acked_total", "Events acknowledged by the router and dropped from the replay buffer."),
		full:      c("kvagent_events_publish_full_total", "Publish calls refused because a rank's replay buffer was full (a PublishWait call counts once, however long it waits)."),
		dropped:   c("kvagent_events_dropped_total", "Unacknowledged events dropped from a full buffer (DropOldest, a rank waiting for a dump, or PublishWait while the publisher builds a dump); the rank resyncs with a dump. It also counts events dropped while a request holding them was out, which that request's ack may then cover (no resync)."),
		dumps:     c("kvagent_events_dumps_total", "Rank dumps committed by the router."),
		requests:  c("kvagent_events_requests_total", "Event requests sent to the router."),
		retries:   c("kvagent_events_request_retries_total", "Event requests that failed (timeout, no leader, error, or an ack that moved no rank forward) and were resent."),
		unregistered: c("kvagent_events_unregistered_total",
			"Rank batches and dumps the router refused because their worker does not list the rank (a Positional worker's unregistered dp rank); the events are kept, and they and the dump resent with backoff."),
		tooLarge: c("kvagent_events_dumps_too_large_total",
			"Rank dumps the NATS connection refused because they were larger than the server's max_payload; the dump is retried with backoff, and refused the same way until the rank holds fewer blocks."),
		resends: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvagent_events_resyncs_total",
			Help: "Gaps reported by the router, by how they heal (replay from the buffer, dump), and dumps the router asked for (router: it dropped events it could not place; fenced: another publisher incarnation dumped the rank since) or its refusal of one event forced (refused), and dumps of a full rank PublishWait was called for while the publisher built a dump (wait)."}, []string{"reason"}),
		buffered: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvagent_events_buffered",
			Help: "Events in the replay buffers, unacknowledged."}),
	}
	// The labelled series show zero before their first resync: a panel or
	// an alert over them reads 0 on a fresh agent, not "no data".
	for _, why := range []string{"replay", "dump", "router", "fenced", "refused", "wait"} {
		m.resends.WithLabelValues(why)
	}
	if reg == nil {
		return m, nil
	}
	cs := []prometheus.Collector{m.published, m.acked, m.full, m.dropped, m.dumps, m.requests, m.retries, m.unregistered, m.tooLarge, m.resends, m.buffered}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return m, fmt.Errorf("eventplane: register publisher metrics: %w", err)
		}
	}
	return m, nil
}

// NewPublisher starts a publisher's send loop.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	cfg.defaults()
	if cfg.Conn == nil {
		return nil, errors.New("eventplane: a publisher needs a NATS connection")
	}
	m, err := newPublisherMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	p := &Publisher{cfg: cfg, m: m, tooLarge: lograte.New(tooLargeLogEvery, nil), ranks: map[kvevent.Rank]*rankBuf{},
		room: make(chan struct{}), kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
		rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))}
	p.timeout.Store(int64(cfg.RequestTimeout))
	p.ctx, p.cancel = context.WithCancel(context.Background())
	go p.loop()
	return p, nil
}

// Incarnation returns the incarnation this publisher's requests and dumps
// carry (PublisherConfig.Incarnation, or the one drawn for it).
func (p *Publisher) Incarnation() uint64 { return p.cfg.Incarnation }

// Close stops the send loop. Unacknowledged events are lost with the
// publisher (an agent restart resyncs its ranks with dumps). It may be
// called more than once, from several goroutines: each call returns once
// the loop stopped. The loop may be inside the Dump callback, which Close
// waits for: never call Close holding a lock that callback takes (the one
// an owner holds around Publish, DumpFunc), or Close and the loop wait
// for each other for ever (agent.Agent's Close holds none).
func (p *Publisher) Close() error {
	// Once, not a check of stop then a close: two Closes at once both
	// closed it, and panicked. Every Close waits for the loop's end.
	p.closeOnce.Do(func() { close(p.stop) })
	p.cancel()
	<-p.done
	return nil
}

func (p *Publisher) buf(r kvevent.Rank) *rankBuf {
	b := p.ranks[r]
	if b == nil {
		b = &rankBuf{next: 1}
		p.ranks[r] = b
		p.order = append(p.order, r)
	}
	return b
}

// Publish assigns the next ids of rank r to evs (in order), buffers them
// and returns the last id. The events must be valid (kvevent.Event.Validate)
// and must not be modified afterwards (their slices are shared). When the
// rank's buffer has no room it returns ErrFull and takes nothing, unless
// DropOldest is set or the rank waits for a dump (its oldest events, which
// the dump covers, are then dropped: kvagent_events_dropped_total); a batch of more events than the buffer holds at all
// (BufferEvents) it refuses with ErrTooLarge (an ErrFull), DropOldest or
// not.
func (p *Publisher) Publish(r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	last, room, err := p.publish(r, evs, false)
	if room != nil {
		p.m.full.Inc()
	}
	return last, err
}

// PublishWait is Publish that waits for room while the buffer is full, until
// ctx ends. A batch larger than the buffer, for which room never comes, it
// refuses at once with ErrTooLarge. It never waits while the send loop
// is in the Dump callback, so it may be called under the lock Dump takes
// (DumpFunc): a rank that waits for a dump makes room by dropping its
// oldest events, which the dump covers (Publish); and while a dump is
// built, for any rank, a full rank drops its oldest events as with
// DropOldest and asks for a dump of its own
// (kvagent_events_resyncs_total{reason="wait"}). A call refused for a full
// buffer counts once in kvagent_events_publish_full_total, however often
// it wakes to try again.
func (p *Publisher) PublishWait(ctx context.Context, r kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	for counted := false; ; counted = true {
		last, room, err := p.publish(r, evs, true)
		if room == nil {
			// Taken, or refused for good (ErrTooLarge, an invalid event,
			// ErrClosed): only a full buffer gives a room to wait for.
			return last, err
		}
		if !counted {
			// Every ack of any rank wakes the call: counted at each
			// wakeup, one call read as twenty refusals (from a review).
			p.m.full.Inc()
		}
		select {
		case <-room:
		case <-ctx.Done():
			return 0, fmt.Errorf("%w: %w", ErrFull, ctx.Err())
		case <-p.stop:
			return 0, ErrClosed
		}
	}
}

// publish is Publish; when the rank's buffer is full it also returns the
// channel that is closed when buffers shrink or a dump starts (nil for
// every other outcome). wait says PublishWait calls it, and may wait.
func (p *Publisher) publish(r kvevent.Rank, evs []kvevent.Event, wait bool) (uint64, <-chan struct{}, error) {
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			return 0, nil, fmt.Errorf("event %d: %w", i, err)
		}
	}
	if len(evs) > p.cfg.BufferEvents {
		return 0, nil, fmt.Errorf("%w: %d events, and a rank's buffer holds %d (BufferEvents): publish them in smaller batches",
			ErrTooLarge, len(evs), p.cfg.BufferEvents)
	}
	p.mu.Lock()
	select {
	case <-p.stop:
		p.mu.Unlock()
		return 0, nil, ErrClosed
	default:
	}
	b := p.buf(r)
	if over := len(b.pending()) + len(evs) - p.cfg.BufferEvents; over > 0 {
		// A rank that waits for a dump makes room only when the dump
		// commits, and the owner's Dump may need the lock its owner holds
		// around this call (DumpFunc): waiting for that room under the
		// lock (PublishWait) never ended. Its buffered events need not
		// wait, though: the dump, built after this call returns, holds
		// what they did, and drops them. So such a rank drops its oldest
		// events, as DropOldest does; one the dump does not cover after
		// all (a dump built before this call, still out) shows as a gap,
		// and the rank dumps again.
		//
		// Nor may PublishWait wait for any rank while the loop is in a
		// DumpFunc (of another rank): only the loop makes room, and it
		// may be waiting there for the lock this caller holds; the
		// caller then waited for the loop and the loop for the caller,
		// and nothing went out for any rank until the caller's context
		// ended (from a review). A caller that holds no such lock cannot
		// be told from one that does, so every such call makes room as
		// DropOldest does, and the rank dumps, which covers the dropped
		// events.
		if !p.cfg.DropOldest && !(b.needDump && p.cfg.Dump != nil) {
			if !wait || !p.dumping {
				room := p.room
				p.mu.Unlock()
				return 0, room, ErrFull
			}
			p.m.resends.WithLabelValues("wait").Inc()
			p.askDump(b)
		}
		// The dropped ids are gone: the router will report a gap at the
		// first of them, and the rank resyncs with a dump.
		k := b.trim(b.pending()[over-1].EventID)
		p.m.dropped.Add(float64(k))
		p.m.buffered.Sub(float64(k))
	}
	if len(evs) > 0 {
		b.marks = append(b.marks, publishMark{id: b.next, at: uint64(time.Now().UnixMicro())})
	}
	for _, ev := range evs {
		ev.Rank, ev.EventID = r, b.next
		b.next++
		b.evs = append(b.evs, ev)
	}
	last := b.next - 1
	p.mu.Unlock()
	p.m.published.Add(float64(len(evs)))
	p.m.buffered.Add(float64(len(evs)))
	select {
	case p.kick <- struct{}{}:
	default:
	}
	return last, nil, nil
}

// Resync has rank r's state replaced on the router by a dump (the Dump
// callback) before any more of its events go out: what an owner calls
// when it starts (the router may hold a previous incarnation's state and
// cursor) or when it learns that its own view of the rank was lost.
// Events published meanwhile wait in the buffer; those the dump covers are
// dropped from it once the dump is acknowledged.
func (p *Publisher) Resync(r kvevent.Rank) {
	p.mu.Lock()
	p.askDump(p.buf(r))
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// RouterAsksResync is the router flagging rank r as needing a resync
// outside an ack (a heartbeat's answer: an idle rank gets no acks). It is
// held back as an ack's Resync is (RouterResyncEvery): the dump goes at
// once unless the router asked for one within the interval, and then at
// its end. It returns whether it asked for the dump now.
func (p *Publisher) RouterAsksResync(r kvevent.Rank) (asked bool) {
	p.mu.Lock()
	asked = p.routerAsks(p.buf(r))
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
	return asked
}

// RouterStopsAsking is the router no longer flagging rank r as needing a
// resync (a heartbeat's answer that names the flagged ranks and leaves r
// out): an ask of r held back within RouterResyncEvery is void, as an
// ack without the flag voids it. Without it an idle rank, whose answers
// named it until the dump asked for them was applied, was dumped once
// more at the interval's end for nothing. A flag set again later is
// asked again by the next answer or ack that carries it.
func (p *Publisher) RouterStopsAsking(r kvevent.Rank) {
	p.mu.Lock()
	if b := p.ranks[r]; b != nil {
		b.routerDue = time.Time{}
	}
	p.mu.Unlock()
}

// routerAsks has b's rank dumped for the router's ask (an ack's Resync,
// RouterAsksResync), at most once per RouterResyncEvery, and returns
// whether it asked for the dump now. Call with p.mu held.
func (p *Publisher) routerAsks(b *rankBuf) (asked bool) {
	switch {
	case b.needDump:
	case time.Since(b.routerAsked) >= p.cfg.RouterResyncEvery:
		// The router dropped events of this rank it could not place
		// (orphans past its bounds), or was restored from a snapshot: a
		// dump replaces the rank with the owner's copy
		// (RouterResyncEvery).
		p.m.resends.WithLabelValues("router").Inc()
		b.routerAsked, b.routerDue = time.Now(), time.Time{}
		p.askDump(b)
		return true
	case b.routerDue.IsZero():
		// Asked again within the interval: the dump waits for its end,
		// also when the rank sends nothing more meanwhile.
		b.routerDue = b.routerAsked.Add(p.cfg.RouterResyncEvery)
	}
	return false
}

// Synced returns how many dumps of rank r the router has taken, or 0
// while one is asked for, and before the first: a count read, not 0,
// before and after an owner learns something of the router's state of r
// says that no dump of r was asked for or taken between. (kvagent resyncs
// a rank the leader holds no state of, by a heartbeat's answer, only when
// a dump of it was taken before the heartbeat, and none asked for since.)
func (p *Publisher) Synced(r kvevent.Rank) uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b := p.ranks[r]; b != nil && !b.needDump {
		return b.dumps
	}
	return 0
}

// Cursor returns the router's cursor of r as last acknowledged, and the id
// of the last event published (tests, status).
func (p *Publisher) Cursor(r kvevent.Rank) (acked, last uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b := p.ranks[r]; b != nil {
		return b.acked, b.next - 1
	}
	return 0, 0
}

// BufferEvents returns how many events a rank's buffer holds
// (PublisherConfig.BufferEvents, or its default): the largest batch Publish
// takes. A caller with a larger one publishes it in parts of at most this.
func (p *Publisher) BufferEvents() int { return p.cfg.BufferEvents }

// Pending returns the number of unacknowledged events.
func (p *Publisher) Pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, b := range p.ranks {
		n += len(b.pending())
	}
	return n
}

// Flush waits until every event published so far is acknowledged (a
// clean shutdown's last step before Close), or ctx ends, or the publisher
// closes (ErrClosed). Events published during the call need not be: for
// each rank, it waits until the router's cursor, as an ack or a dump set
// it, reaches the last id published before the call, moved as the
// renumberings since moved it (sendDump). Events dropped from a full
// buffer (DropOldest) count once a dump covers them.
func (p *Publisher) Flush(ctx context.Context) error {
	type goal struct {
		r          kvevent.Rank
		last       uint64 // the last id published before the call
		renumbered uint64 // the rank's renumbered then
	}
	var goals []goal
	p.mu.Lock()
	for r, b := range p.ranks {
		if b.acked < b.next-1 {
			goals = append(goals, goal{r, b.next - 1, b.renumbered})
		}
	}
	p.mu.Unlock()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		var behind uint64
		p.mu.Lock()
		goals = slices.DeleteFunc(goals, func(g goal) bool {
			b := p.ranks[g.r] // ranks are never dropped
			want := g.last + (b.renumbered - g.renumbered)
			behind += want - min(b.acked, want)
			return b.acked >= want
		})
		p.mu.Unlock()
		if len(goals) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d events of %d ranks, published before the flush, not acknowledged: %w", behind, len(goals), ctx.Err())
		case <-p.stop:
			return ErrClosed
		case <-t.C:
		}
	}
}

// requestTimeout is how long the next request waits for its reply.
func (p *Publisher) requestTimeout() time.Duration { return time.Duration(p.timeout.Load()) }

// refusedFor is how long a request size the router refused stays the
// publisher's bound (a router upgraded meanwhile may take more).
const refusedFor = time.Minute

// loop sends requests, one at a time, until Close.
func (p *Publisher) loop() {
	defer close(p.done)
	backoff := time.Duration(0)
	// Events in the next request: halved when a request is refused as it
	// is, doubled back on success up to ceiling, which stays below a
	// refused size for refusedFor.
	limit, ceiling := p.cfg.MaxRequestEvents, p.cfg.MaxRequestEvents
	var ceilingUntil time.Time
	var scratch, hdr []byte
	var published []uint64
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		if backoff > 0 {
			// Full jitter keeps many agents from retrying in step after a
			// leader change.
			d := p.jitter(backoff)
			select {
			case <-p.stop:
				return
			case <-time.After(d):
			}
		}
		ok := true
		r, found, retryAt := p.nextDump(time.Now())
		if found {
			p.dumpDone(r, p.sendDump(r))
			continue
		}
		var batches []raftfsm.RankBatch
		var n int
		var refusedAt time.Time
		if batches, published, n, refusedAt = p.nextRequest(published, limit, time.Now()); n > 0 {
			scratch = appendEvents(scratch[:0], batches)
			hdr = appendPublished(hdr[:0], published)
			var refused bool
			ok, refused = p.sendEvents(batches, scratch, hdr)
			switch {
			case ok:
				if time.Now().After(ceilingUntil) {
					ceiling = p.cfg.MaxRequestEvents
				}
				limit = min(2*limit, ceiling)
			case refused && n > 1:
				// Refused as it is (a router whose cap is below ours, a
				// message larger than the server takes): it would be
				// refused again for ever, with every rank in it. Send
				// half, and no more than that for a while: one bad event
				// among many ranks' is alone in a request after a few
				// refusals (refusedAlone), however the others go.
				limit = max(1, n/2)
				ceiling, ceilingUntil = limit, time.Now().Add(refusedFor)
			case refused:
				// One event, refused alone: the owner's dump replaces it.
				// The refusals were its own, not the requests' size: the
				// other ranks go back to full requests.
				p.refusedAlone(batches[0].Rank)
				limit, ceiling = p.cfg.MaxRequestEvents, p.cfg.MaxRequestEvents
			}
		} else {
			backoff = 0
			if retryAt.IsZero() || !refusedAt.IsZero() && refusedAt.Before(retryAt) {
				retryAt = refusedAt
			}
			var retry *time.Timer
			var retryC <-chan time.Time
			if !retryAt.IsZero() {
				retry = time.NewTimer(time.Until(retryAt))
				retryC = retry.C
			}
			select {
			case <-p.stop:
				return
			case <-p.kick:
			case <-retryC:
			}
			if retry != nil {
				retry.Stop()
			}
			continue
		}
		if ok {
			backoff = 0
		} else if p.ctx.Err() != nil {
			return // Close cancelled the request: nothing is resent
		} else {
			p.m.retries.Inc()
			backoff = min(max(2*backoff, p.cfg.MinBackoff), p.cfg.MaxBackoff)
		}
	}
}

// nextDump returns a rank whose dump is due at now, or, when none is, the
// earliest time one will be (zero when no rank needs a dump). A router's
// held-back resync ask whose time has come becomes a dump ask here.
func (p *Publisher) nextDump(now time.Time) (kvevent.Rank, bool, time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var earliest time.Time
	for _, r := range p.order {
		b := p.ranks[r]
		if !b.needDump && !b.routerDue.IsZero() {
			if !b.routerDue.After(now) {
				p.m.resends.WithLabelValues("router").Inc()
				b.routerAsked, b.routerDue = now, time.Time{}
				p.askDump(b)
			} else if earliest.IsZero() || b.routerDue.Before(earliest) {
				earliest = b.routerDue
			}
		}
		if !b.needDump {
			continue
		}
		// A rank the router refuses (unregistered) waits out that
		// backoff too: its dump is refused as its events are.
		due := b.dumpRetryAt
		if b.refusedRetryAt.After(due) {
			due = b.refusedRetryAt
		}
		if !due.After(now) {
			return r, true, time.Time{}
		}
		if earliest.IsZero() || due.Before(earliest) {
			earliest = due
		}
	}
	return kvevent.Rank{}, false, earliest
}

// jitter returns a wait of half of d to d ("full jitter" over the upper
// half), so that many agents do not retry in step. Only the loop
// goroutine calls it (p.rng is not locked).
func (p *Publisher) jitter(d time.Duration) time.Duration {
	return d/2 + time.Duration(p.rng.Int64N(int64(d/2)+1))
}

// dumpDone sets the rank's next dump try after one that went (ok) or
// failed: at once, or after the rank's own backoff, with full jitter.
func (p *Publisher) dumpDone(r kvevent.Rank, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.ranks[r]
	if ok {
		b.dumpBackoff, b.dumpRetryAt = 0, time.Time{}
		return
	}
	if p.ctx.Err() != nil {
		return // Close cancelled the dump: it is not resent
	}
	p.m.retries.Inc()
	b.dumpBackoff = min(max(2*b.dumpBackoff, p.cfg.MinBackoff), p.cfg.MaxBackoff)
	b.dumpRetryAt = time.Now().Add(p.jitter(b.dumpBackoff))
}

// nextRequest takes the heads of the ranks' buffers, round robin, up to
// the request bounds. The events are copied (structs only), so the buffers
// may change while the request is out. A rank the router refused
// (unregistered) waits out its backoff: refusedAt is the earliest such
// rank's next try (zero when none waits).
func (p *Publisher) nextRequest(published []uint64, maxEvents int, now time.Time) (_ []raftfsm.RankBatch, _ []uint64, _ int, refusedAt time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []raftfsm.RankBatch
	published = published[:0]
	n, size := 0, 16
	for i := 0; i < len(p.order) && n < maxEvents && size < p.cfg.MaxRequestBytes; i++ {
		r := p.order[(p.rr+i)%len(p.order)]
		b := p.ranks[r]
		pend := b.pending()
		if len(pend) == 0 || b.needDump {
			continue
		}
		if b.refusedRetryAt.After(now) {
			if refusedAt.IsZero() || b.refusedRetryAt.Before(refusedAt) {
				refusedAt = b.refusedRetryAt
			}
			continue
		}
		k := 0
		size += 32 // rank, incarnation, first id, count
		for k < len(pend) && n < maxEvents {
			s := eventSize(&pend[k])
			if size+s > p.cfg.MaxRequestBytes && (n > 0 || k > 0) {
				break
			}
			size += s
			k++
			n++
		}
		if k > 0 {
			out = append(out, raftfsm.RankBatch{Rank: r, Incarnation: p.cfg.Incarnation, Events: slices.Clone(pend[:k])})
			published = append(published, b.publishedAt(pend[0].EventID))
			b.sent = max(b.sent, pend[k-1].EventID)
		}
	}
	if len(p.order) > 0 {
		p.rr = (p.rr + 1) % len(p.order)
	}
	return out, published, n, refusedAt
}

// request sends data on subject and decodes the reply, which must be of
// type want or an error (decodeAnswer); published, when not empty (an
// events request), goes in the headerPublished header. Every
// request says which ack flags this publisher reads (headerAckFlags): the
// unregistered answer to a dump goes by it too (codeUnregistered).
func (p *Publisher) request(subject string, want byte, data, published []byte) (acks []raftfsm.RankAck, cursor uint64, err error) {
	p.m.requests.Inc()
	m := &nats.Msg{Subject: subject, Data: data}
	if p.cfg.Conn.HeadersSupported() {
		// A server without header support (before NATS 2.2) refuses a
		// message with any: neither the metric nor the Unregistered flag
		// is worth the events (a refused rank then reads as an ack that
		// moved nothing, or a dump refused as invalid, which back off all
		// the same: sendEvents, dumpDone).
		m.Header = nats.Header{headerAckFlags: []string{ackFlagsHeader}}
		if len(published) > 0 {
			m.Header[headerPublished] = []string{string(published)}
		}
	}
	timeout := p.requestTimeout()
	ctx, cancel := context.WithTimeout(p.ctx, timeout)
	defer cancel()
	start := time.Now()
	msg, err := p.cfg.Conn.RequestMsgWithContext(ctx, m)
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout) {
		// The router may have committed the request and answered after
		// we stopped waiting (a commit slower than the timeout): the
		// resend waits longer, or its reply would be lost the same way.
		next := min(2*timeout, p.cfg.MaxRequestTimeout)
		p.timeout.Store(int64(next))
		return nil, 0, fmt.Errorf("no reply within %v (the next try waits %v): %w", timeout, next, err)
	}
	if err != nil {
		return nil, 0, err
	}
	acks, cursor, err = decodeAnswer(msg.Data, want)
	if err == nil && time.Since(start) < timeout/4 {
		// A reply well within the timeout: it comes down again, halving,
		// to RequestTimeout. A reset at every reply had every request of
		// a router whose commits stay slow time out once, and commit
		// twice.
		p.timeout.Store(int64(max(timeout/2, p.cfg.RequestTimeout)))
	}
	return acks, cursor, err
}

// sendEvents sends one request, of batches, and applies its acks; false
// means resend after a backoff, and refused that the request as it is
// will never go through (the router answered it invalid, or the NATS
// server takes no message that large). A reply whose acks are not one per
// batch, of its rank, in the request's order (docs/events.md) is
// malformed: nothing of it is applied, and the request is resent. A reply whose acks moved no rank forward (nothing
// trimmed, applied or skipped as a duplicate, no cursor moved, no gap, no
// dump asked: a refusal, or a router of an earlier build that refuses a
// rank without saying so) is false too: resent at once, it would be
// answered the same way, one Raft entry each, for ever.
func (p *Publisher) sendEvents(batches []raftfsm.RankBatch, data, published []byte) (ok, refused bool) {
	acks, _, err := p.request(p.cfg.Subject, msgAcks, data, published)
	if err == nil && !acksMatch(acks, batches) {
		// Applied as it came, an ack of a rank the request did not carry
		// moved that rank's cursor and trimmed its buffer all the same
		// (from the event-plane review).
		err = fmt.Errorf("%w: %d acks in answer to %d rank batches, or not of their ranks in their order", ErrMalformed, len(acks), len(batches))
	}
	if err != nil {
		p.logRetry("events", err)
		var re *ReplyError
		return false, errors.As(err, &re) && re.Code == codeInvalid || errors.Is(err, nats.ErrMaxPayload)
	}
	var freed int
	progress := false
	p.mu.Lock()
	for _, a := range acks {
		b := p.ranks[a.Rank]
		if b == nil {
			continue
		}
		if a.Unregistered {
			// The rank's worker does not list it (a Positional worker's
			// dp rank unregistered, or not registered yet): nothing
			// applied, and Cursor means nothing. The events are kept, not
			// dropped: a registration that lists the rank (a worker
			// re-registering with more dp ranks, which may commit after
			// the agent starts) takes them, and until then the buffer's
			// bound holds them back (ErrFull, or DropOldest); dropped,
			// they would be lost without a word to the owner.
			p.refused(a.Rank, b)
			continue
		}
		p.taken(a.Rank, b)
		if a.Fenced {
			// A dump of another incarnation replaced the rank after ours
			// (another live publisher of the rank: a second agent given
			// this worker): nothing of the batch applied, and the cursor
			// is that incarnation's. Keep the events and dump the rank,
			// which makes it ours again; they go after the dump. Not
			// throttled like the router's own resync asks: each ask is
			// one fenced request, which only another dumping publisher
			// brings about.
			if !b.needDump {
				p.m.resends.WithLabelValues("fenced").Inc()
				p.cfg.Logger.Warn("another publisher incarnation dumped the rank since this one did (is a second agent publishing it?); resyncing the rank with a dump",
					"rank", a.Rank, "incarnation", p.cfg.Incarnation, "router_cursor", a.Cursor)
				p.askDump(b)
			}
			progress = true // the rank waits for its dump, not for a resend
			continue
		}
		if a.Cursor > b.sent {
			// The router is ahead of this publisher: its ids were used by
			// an earlier incarnation (an agent restart). What we send now
			// is taken for duplicates. Resync the rank with a dump, which
			// sets the cursor to our numbering. A cursor below next but
			// past every id we sent is no cursor of ours either: taken,
			// it trimmed buffered events no request had carried, as if
			// the router had them.
			p.cfg.Logger.Warn("router cursor ahead of the publisher; resyncing the rank", "rank", a.Rank, "cursor", a.Cursor, "sent", b.sent, "next", b.next)
			p.askDump(b)
			progress = true
			continue
		}
		moved := a.Cursor > b.acked
		b.acked = a.Cursor
		k := b.trim(a.Cursor)
		freed += k
		// A gap is progress: it is resent from the cursor, or the rank
		// dumps. So is a cursor that moved, or events the router took,
		// with nothing left to trim: the request's events were dropped
		// from the buffer while it was out (DropOldest, or a rank waiting
		// for a dump), and the ack is a healthy one. A held-back resync
		// ask alone is not.
		if k > 0 || a.Gap || moved || a.Applied+a.Dups > 0 {
			progress = true
		}
		if !a.Resync {
			b.routerDue = time.Time{}
		} else {
			p.routerAsks(b)
		}
		if a.Gap {
			pend := b.pending()
			if len(pend) > 0 && pend[0].EventID == a.Cursor+1 {
				// The missing range is still buffered: the next request
				// resends it from Cursor+1.
				p.m.resends.WithLabelValues("replay").Inc()
			} else {
				p.m.resends.WithLabelValues("dump").Inc()
				p.askDump(b)
			}
		}
	}
	p.signalRoom(freed)
	p.mu.Unlock()
	if !progress {
		p.cfg.Logger.Debug("the router's acks moved no rank forward; retrying with backoff")
	}
	return progress, false
}

// acksMatch says whether acks answer batches: one ack per batch, of its
// rank, in order.
func acksMatch(acks []raftfsm.RankAck, batches []raftfsm.RankBatch) bool {
	if len(acks) != len(batches) {
		return false
	}
	for i := range acks {
		if acks[i].Rank != batches[i].Rank {
			return false
		}
	}
	return true
}

// refused notes that the router refused rank r as unregistered (an events
// ack's Unregistered, a dump's codeUnregistered): counted, logged once, and
// the rank's events and dump wait out its own backoff (nextRequest,
// nextDump) while the other ranks go on. p.mu is held.
func (p *Publisher) refused(r kvevent.Rank, b *rankBuf) {
	p.m.unregistered.Inc()
	if !b.unregistered {
		b.unregistered = true
		p.cfg.Logger.Warn("the router refuses the rank: its worker does not list it; keeping its events and retrying with backoff",
			"rank", r, "pending", len(b.pending()), "dump_asked", b.needDump)
	}
	b.refusedBackoff = min(max(2*b.refusedBackoff, p.cfg.MinBackoff), p.cfg.MaxBackoff)
	b.refusedRetryAt = time.Now().Add(p.jitter(b.refusedBackoff))
}

// taken notes that the router took rank r's batch or dump: a refusal's
// backoff ends. p.mu is held.
func (p *Publisher) taken(r kvevent.Rank, b *rankBuf) {
	if b.unregistered {
		p.cfg.Logger.Info("the router takes the rank again", "rank", r)
		b.unregistered = false
	}
	b.refusedBackoff, b.refusedRetryAt = 0, time.Time{}
}

// refusedAlone gives up sending rank r's next event, which the router
// refused as a request of its own: the owner's dump (which holds what the
// event did) replaces the rank, and the buffer drops what the dump covers.
func (p *Publisher) refusedAlone(r kvevent.Rank) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b := p.ranks[r]; b != nil {
		p.cfg.Logger.Error("the router refuses one event of a rank however it is sent; resyncing the rank with a dump", "rank", r)
		p.m.resends.WithLabelValues("refused").Inc()
		p.askDump(b)
	}
}

// signalRoom wakes PublishWait callers; p.mu is held.
func (p *Publisher) signalRoom(freed int) {
	if freed == 0 {
		return
	}
	p.m.acked.Add(float64(freed))
	p.m.buffered.Sub(float64(freed))
	p.wakeRoom()
}

// sendDump replaces the rank's state on the router with the owner's dump,
// then drops what the dump covers from the buffer. False means the dump
// failed (dumpDone backs it off); a dump the router refuses as
// unregistered is true, and waits out the rank's refusal backoff instead.
func (p *Publisher) sendDump(r kvevent.Rank) bool {
	if p.cfg.Dump == nil {
		p.cfg.Logger.Error("a rank needs a dump and the publisher has no Dump callback; its events are stuck", "rank", r)
		return false
	}
	// A dump answers the asks made before it is built: one made while it
	// is built or sent (an engine reset as the agent's first dump goes
	// out) may have changed the owner's state after it, and needs another.
	//
	// The Dump callback may wait for the lock its owner holds around
	// PublishWait: dumping has every PublishWait make room rather than
	// wait (publish), and the ones waiting already are woken to do so.
	p.mu.Lock()
	asks, moves := p.ranks[r].dumpAsks, slices.Clone(p.ranks[r].moves)
	p.dumping = true
	p.wakeRoom()
	p.mu.Unlock()
	stored, through := p.cfg.Dump(r)
	p.mu.Lock()
	p.dumping = false
	p.mu.Unlock()
	// The owner may report an id Publish returned before a renumbering
	// (kvagent reads Cursor, which is past it): move it as the ids moved,
	// or the router would find the dump stale again, for ever.
	through = translate(moves, through)
	for i := range stored {
		stored[i].Rank = r
	}
	req := dumpRequest{rank: r, incarnation: p.cfg.Incarnation, cursor: through, stored: stored}
	data := appendDump(nil, &req)
	_, cursor, err := p.request(p.cfg.DumpSubject, msgDumpOK, data, nil)
	var re *ReplyError
	if errors.As(err, &re) && re.Code == codeUnregistered {
		// The rank's worker does not list it: nothing applied. Not a
		// failed dump but a refusal, as of the rank's events: the dump
		// stays asked for and waits out the rank's refusal backoff
		// (nextDump), while the other ranks go on.
		p.mu.Lock()
		p.refused(r, p.ranks[r])
		p.mu.Unlock()
		return true
	}
	if err == nil && cursor < through {
		// The router answers a dump it committed with the dump's cursor,
		// and a stale one with its own, above (the renumbering below): a
		// cursor under the dump's says neither. Taken for a commit, the
		// rank read synced and its buffer was trimmed through a dump the
		// router may never have taken; it is malformed, and the dump is
		// resent after its backoff.
		err = fmt.Errorf("%w: dump of rank %v answered at cursor %d, below its own %d", ErrMalformed, r, cursor, through)
	}
	if errors.Is(err, nats.ErrMaxPayload) {
		p.dumpTooLarge(r, len(data))
		return false
	}
	if err != nil {
		p.logRetry("dump", err)
		return false
	}
	p.mu.Lock()
	b := p.ranks[r]
	if cursor > through {
		// The router is past this numbering (an earlier incarnation used
		// these ids) and kept its state. Renumber the unacknowledged events
		// past its cursor and dump again: the next dump's through is then
		// at or above it.
		//
		// The shift also takes every id past the last one Publish returned
		// (next-1), which may be past the router's cursor when the owner
		// published while this dump was out: the owner may report the
		// next dump's through in either numbering, and an old id must not
		// read as a new one. Shifted by cursor-through alone, an old id at
		// or above the cursor was taken as new, too low by the shift: the
		// events between it and its translation were sent again after the
		// dump that held them, and applied twice (from the event-plane
		// review).
		//
		// And the new numbering starts renumberHeadroom ids further up:
		// a dead incarnation's last request may still be on its way to
		// the router (lingering in the leader's batcher, waiting for an
		// entry slot, in a slow commit, pending in NATS) and commit after
		// the next dump. A request of an incarnation of this build is
		// fenced once that dump commits (it carries another incarnation
		// than the dump's), but an agent of an earlier build sends none:
		// had that dump set the cursor to the router's, such a request
		// would apply on top of the new state, and this incarnation's
		// events with the same ids would be taken for duplicates,
		// acknowledged and never applied (from the event-plane review).
		// A request starts at its publisher's acknowledged cursor + 1
		// (after a dump too), a cursor the router had, so at most
		// cursor + 1 (a rank's cursor never moves back while it holds
		// state), and applies no more events than renumberHeadroom; so
		// do its resends. Every id it can apply is at or below cursor +
		// renumberHeadroom, at or below the next dump's through: a
		// duplicate once that dump commits. With no
		// event published meanwhile (through = next-1), through+shift is
		// cursor + renumberHeadroom.
		top := max(cursor, b.next-1)
		headroom := p.renumberHeadroom()
		if top > math.MaxUint64/2 {
			// No numbering fits past it: the router's cursor is nothing a
			// publisher ever set (2^63 events). Say so, and retry.
			p.mu.Unlock()
			p.cfg.Logger.Error("router cursor too large to renumber past; retrying the dump with backoff",
				"rank", r, "cursor", cursor, "through", through)
			return false
		}
		b.renumber(top + headroom - through)
		b.renumbers++
		n := b.renumbers
		p.mu.Unlock()
		if n > 3 {
			// Each renumbering should have let the next dump through;
			// back off rather than spin.
			p.cfg.Logger.Error("router cursor still ahead of the rank's dumps after renumbering; retrying with backoff",
				"rank", r, "cursor", cursor, "through", through, "renumbers", n)
			return false
		}
		p.cfg.Logger.Info("router cursor ahead of the publisher; renumbering past it", "rank", r, "cursor", cursor, "through", through)
		return true
	}
	p.m.dumps.Inc()
	p.taken(r, b)
	// The owner's numbering and the publisher's agree from here: a
	// later renumbering starts its own translation.
	b.renumbers, b.moves = 0, nil
	b.routerDue = time.Time{} // the dump answers a held-back ask too
	if through >= b.next {
		b.next = through + 1
	}
	b.acked = through
	b.sent = max(b.sent, through)
	b.dumps++
	if b.dumpAsks == asks {
		b.needDump = false
	}
	p.signalRoom(b.trim(through))
	p.mu.Unlock()
	return true
}

// renumberHeadroom is how many ids a renumbering leaves free past the
// router's cursor (sendDump): the most events one request of an earlier
// incarnation can apply, the larger of this publisher's own cap and the
// leader's (IngesterConfig.MaxRequestEvents, which refuses any request
// of more; kvrouter runs with its default). An earlier incarnation runs
// the same configuration, or is held to the leader's cap.
func (p *Publisher) renumberHeadroom() uint64 {
	return uint64(max(p.cfg.MaxRequestEvents, defaultMaxRequestEvents))
}

// tooLargeLogEvery is how often a rank's dump refused as larger than the
// NATS server's max_payload is logged at most: it is retried every
// MaxBackoff and refused the same way until the rank holds fewer blocks,
// which an Error line per retry (2 a second) did not make sooner.
const tooLargeLogEvery = time.Minute

// dumpTooLarge counts and logs rank r's dump, of size bytes, refused as
// larger than the NATS server takes: at most once per tooLargeLogEvery per
// rank, with the retries refused since its last line.
func (p *Publisher) dumpTooLarge(r kvevent.Rank, size int) {
	p.m.tooLarge.Inc()
	ok, skipped := p.tooLarge.Allow(r.String())
	if !ok {
		return
	}
	p.cfg.Logger.Error("request larger than the NATS server takes; retrying", "what", "dump", "rank", r,
		"bytes", size, "max_payload", p.cfg.Conn.MaxPayload(), "refused_since", skipped,
		"fix", "the rank holds more blocks than one dump message carries: size kvagent's --disk-blocks (or --host-blocks) below it, or use a NATS server with a larger max_payload (kvrouter --nats-url)")
}

func (p *Publisher) logRetry(what string, err error) {
	var re *ReplyError
	if errors.As(err, &re) && re.Code == codeInvalid {
		p.cfg.Logger.Error("router rejected a request as invalid; retrying", "what", what, "err", err)
		return
	}
	if errors.Is(err, nats.ErrMaxPayload) {
		// It will fail the same way every time (a dump of a rank larger
		// than the server takes, docs/offload.md): say so.
		p.cfg.Logger.Error("request larger than the NATS server takes; retrying", "what", what, "err", err)
		return
	}
	if errors.Is(err, ErrMalformed) {
		// Not a reply this request can have had from a router of any
		// build (acks of other ranks, say): say so, it is resent each time.
		p.cfg.Logger.Warn("router's reply malformed; retrying", "what", what, "err", err)
		return
	}
	p.cfg.Logger.Debug("request failed; retrying", "what", what, "err", err)
}
