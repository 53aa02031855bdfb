package compat

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// The agentless mode: for an instance registered through POST /register,
// the cluster's leader subscribes to the engine's event endpoint itself
// (the subscriber kvagent uses) and commits each batch through Raft. Its
// event ids are positions in the engine's stream, so that the replicated
// cursor says where the stream was: a new leader resumes there through the
// engine's replay socket, and resyncs the rank when it cannot.
//
// A position packs, from the top bit down:
//
//	epoch    20 bits  bumped when the engine restarts or history is lost
//	sequence 32 bits  the engine batch's sequence number
//	index    12 bits  the event's place in its batch, from 1; 0 marks a
//	                  clear that starts an epoch (next expected batch: 0)
//
// Positions only go up within a rank; the rank's registration is
// Positional, so the holes between batches are no gaps.
const (
	positionIndexBits = 12
	positionSeqBits   = 32
	maxBatchEvents    = 1<<positionIndexBits - 1
)

// Position returns the event id of event idx (from 1; 0 for a clear) of
// engine batch seq in epoch.
func Position(epoch uint32, seq uint64, idx int) uint64 {
	return uint64(epoch)<<(positionSeqBits+positionIndexBits) | seq<<positionIndexBits | uint64(idx)
}

// SplitPosition undoes Position.
func SplitPosition(id uint64) (epoch uint32, seq uint64, idx int) {
	return uint32(id >> (positionSeqBits + positionIndexBits)), id >> positionIndexBits & (1<<positionSeqBits - 1),
		int(id & (1<<positionIndexBits - 1))
}

// resumeAt returns where a subscriber taking over a rank at cursor goes
// on: the epoch, and the engine sequence it expects first (nil: accept the
// first batch whatever its sequence, for a rank never heard of).
func resumeAt(cursor uint64) (uint32, *uint64) {
	if cursor == 0 {
		return 0, nil
	}
	epoch, seq, idx := SplitPosition(cursor)
	next := seq + 1
	if idx == 0 { // a clear: the epoch's first batch is next
		next = 0
	}
	return epoch, &next
}

// AgentlessTarget is the node the agentless subscribers commit to:
// *raftfsm.Node.
type AgentlessTarget interface {
	// CheckLeader returns nil on a leader whose state holds every entry
	// committed before its term (the cursors subscribers resume from).
	CheckLeader() error
	WorkerTable() map[uint64]raftfsm.WorkerInfo
	Cursor(r kvevent.Rank) uint64
	IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error)
}

var _ AgentlessTarget = (*raftfsm.Node)(nil)

// AgentlessConfig configures Agentless.
type AgentlessConfig struct {
	Poll          time.Duration // how often leadership and registrations are checked (default 200ms)
	CommitTimeout time.Duration // per batch (default 5s)
	ReplayTimeout time.Duration // enginesub's (default its own)
	Registerer    prometheus.Registerer
	Logger        *slog.Logger

	// NoLearnGroupKinds turns off the engine decoders' learning of each KV
	// cache group's kind (engine.Config.LearnGroupKinds, on by default):
	// an event without a kv_cache_spec_kind, every BlockRemoved, is then
	// the main attention group's only when its group_idx is 0 or absent,
	// as wire.md says, which misfiles the removes of a hybrid model whose
	// full-attention group is not group 0 (kvagent --learn-group-kinds).
	NoLearnGroupKinds bool
}

// Agentless runs, while its node leads, one engine subscriber per dp rank
// of every Positional worker that registered an event endpoint.
type Agentless struct {
	b   AgentlessTarget
	cfg AgentlessConfig
	log *slog.Logger

	mu   sync.Mutex
	subs map[kvevent.Rank]*agentlessSub
	// retry holds, per wanted rank whose subscriber stopped by itself (its
	// Run returned: libzmq refused the endpoint, a receive failed) or
	// could not be made, when reconcile may start it again.
	retry map[kvevent.Rank]agentlessRetry
	// skipLogs is each followed worker's log of the reasons its engine's
	// events were left out for, shared by its ranks' subscribers: each
	// reason is logged once per worker (semantics.md §1).
	skipLogs map[uint64]*enginesub.SkipLog
	// exported holds, per rank a subscriber was made for, the last one
	// made: the rank's series (kvagent_subscriber_*,
	// kvagent_engine_seq_gaps_total) stay exported until reconcile finds
	// the rank not wanted and forgets them, whether its subscriber still
	// ran, stopped by itself and waited in retry, or could not be made
	// again.
	exported map[kvevent.Rank]*enginesub.Subscriber

	stop chan struct{}
	done chan struct{}
}

type agentlessSub struct {
	endpoint, replay string
	blockSize        int
	salt             string // the instance's additional_salt: in every content hash
	term             uint64 // the Raft term it started in (termOf)
	started          time.Time
	sub              *enginesub.Subscriber
	cancel           context.CancelFunc
	done             chan struct{}
}

// sameRegistration reports whether s and w follow the same registration.
func (s *agentlessSub) sameRegistration(w *agentlessSub) bool {
	return w.endpoint == s.endpoint && w.replay == s.replay && w.blockSize == s.blockSize && w.salt == s.salt
}

// stopped reports whether the subscriber's Run has returned.
func (s *agentlessSub) stopped() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// agentlessRetry is when a rank's subscriber, which stopped by itself
// following reg, may start again, and the backoff that set it.
type agentlessRetry struct {
	reg     agentlessSub // the registration it followed (endpoints, block size, salt)
	at      time.Time
	backoff time.Duration
}

// maxRestartBackoff bounds the wait before a subscriber that stopped by
// itself starts again; one that ran this long before it stopped starts
// again at the next poll.
const maxRestartBackoff = 30 * time.Second

// NewAgentless starts the agentless mode of b; Close stops it.
func NewAgentless(b AgentlessTarget, cfg AgentlessConfig) *Agentless {
	if cfg.Poll <= 0 {
		cfg.Poll = 200 * time.Millisecond
	}
	if cfg.CommitTimeout <= 0 {
		cfg.CommitTimeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	a := &Agentless{b: b, cfg: cfg, log: cfg.Logger, subs: map[kvevent.Rank]*agentlessSub{},
		retry: map[kvevent.Rank]agentlessRetry{}, skipLogs: map[uint64]*enginesub.SkipLog{},
		stop: make(chan struct{}), done: make(chan struct{})}
	go a.loop()
	return a
}

// Close stops every subscriber and the loop.
func (a *Agentless) Close() error {
	select {
	case <-a.stop:
	default:
		close(a.stop)
	}
	<-a.done
	return nil
}

// Ranks returns the ranks followed now (tests, status): those whose
// subscriber runs. A rank whose subscriber stopped by itself, waiting to
// be started again, is not one.
func (a *Agentless) Ranks() []kvevent.Rank {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]kvevent.Rank, 0, len(a.subs))
	for r, s := range a.subs {
		if !s.stopped() {
			out = append(out, r)
		}
	}
	return out
}

func (a *Agentless) loop() {
	defer close(a.done)
	defer a.reconcile(nil, 0)
	t := time.NewTicker(a.cfg.Poll)
	defer t.Stop()
	for {
		// The term is read before leadership is checked, so that it is
		// never later than the term the subscribers started now resume
		// in: a node that lost leadership and won it back between the two
		// reads restarts them at the next poll. (Read after, the new
		// term could stamp subscribers of the old one, and keep them.)
		term := termOf(a.b)
		if a.b.CheckLeader() == nil {
			a.reconcile(a.b.WorkerTable(), term)
		} else {
			a.reconcile(nil, term)
		}
		select {
		case <-a.stop:
			return
		case <-t.C:
		}
	}
}

// raftNode is how termOf reads a target's term: *raftfsm.Node's Raft.
type raftNode interface{ Raft() *raft.Raft }

var _ raftNode = (*raftfsm.Node)(nil)

// termOf returns b's Raft term, or 0 when b does not tell it.
func termOf(b AgentlessTarget) uint64 {
	if n, ok := b.(raftNode); ok {
		return n.Raft().CurrentTerm()
	}
	return 0
}

// reconcile runs a subscriber for each rank that should have one (none
// when table is nil) and stops the others.
//
// A subscriber of an older term is stopped and started again, from the
// rank's cursor: this node lost leadership and won it back between two
// polls, and the leader of the term between may have moved the cursor,
// in the same epoch (the subscriber would commit batches again, dropped
// as duplicates) or into a new one (every later batch dropped, for good;
// positionSink.commit catches that too, but only by clearing the rank).
// Started again, it resumes where that leader left off, through the
// engine's replay socket.
//
// A subscriber whose Run returned by itself (libzmq refused its endpoint,
// a receive failed), or that could not be made, is started again after a
// backoff: one poll, doubled at each failure up to maxRestartBackoff, and
// at once when its registration changes.
func (a *Agentless) reconcile(table map[uint64]raftfsm.WorkerInfo, term uint64) {
	want := map[kvevent.Rank]agentlessSub{}
	for id, w := range table {
		if !w.Positional {
			continue
		}
		for dp, ep := range w.EventEndpoints {
			want[kvevent.Rank{Worker: id, DP: dp}] = agentlessSub{endpoint: ep, replay: w.ReplayEndpoints[dp], blockSize: w.BlockSize, salt: w.Salt}
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	for r, s := range a.subs {
		w, ok := want[r]
		switch {
		case !ok || !s.sameRegistration(&w) || s.term != term:
			s.cancel()
			<-s.done
			delete(a.subs, r)
		case s.stopped():
			delete(a.subs, r)
			a.failed(r, s, now.Sub(s.started))
		}
	}
	for id := range a.skipLogs {
		if _, ok := table[id]; !ok {
			delete(a.skipLogs, id)
		}
	}
	for r, rt := range a.retry {
		if w, ok := want[r]; !ok || !rt.reg.sameRegistration(&w) {
			delete(a.retry, r) // gone, or registered anew: no wait
		}
	}
	// Every subscriber of a rank not wanted has stopped by now.
	for r, sub := range a.exported {
		if _, ok := want[r]; !ok {
			sub.ForgetMetrics() // the rank is not followed any more
			delete(a.exported, r)
		}
	}
	for r, w := range want {
		if _, ok := a.subs[r]; ok {
			continue
		}
		if rt, ok := a.retry[r]; ok && now.Before(rt.at) {
			continue
		}
		w.term = term
		if err := a.start(r, w); err != nil {
			a.log.Warn("agentless: cannot follow the engine", "rank", r, "endpoint", w.endpoint, "err", err)
			a.failed(r, &w, 0)
		}
	}
}

// failed schedules the next start of rank r, whose subscriber of
// registration w stopped by itself after running for ran (0: it could not
// be made); a.mu is held.
func (a *Agentless) failed(r kvevent.Rank, w *agentlessSub, ran time.Duration) {
	backoff := a.cfg.Poll
	if rt, ok := a.retry[r]; ok && ran < maxRestartBackoff {
		backoff = min(2*rt.backoff, maxRestartBackoff)
	}
	reg := agentlessSub{endpoint: w.endpoint, replay: w.replay, blockSize: w.blockSize, salt: w.salt}
	if a.retry == nil {
		a.retry = map[kvevent.Rank]agentlessRetry{}
	}
	a.retry[r] = agentlessRetry{reg: reg, at: time.Now().Add(backoff), backoff: backoff}
	if ran > 0 { // its Run logged why it stopped
		a.log.Info("agentless: the engine's subscriber starts again after a backoff",
			"rank", r, "endpoint", w.endpoint, "ran", ran, "backoff", backoff)
	}
}

// skipLog returns worker id's SkipLog, made on first use (as the map is,
// like retry); a.mu is held.
func (a *Agentless) skipLog(id uint64) *enginesub.SkipLog {
	l := a.skipLogs[id]
	if l == nil {
		if a.skipLogs == nil {
			a.skipLogs = map[uint64]*enginesub.SkipLog{}
		}
		l = new(enginesub.SkipLog)
		a.skipLogs[id] = l
	}
	return l
}

// start subscribes to rank r's engine, resuming at the rank's cursor; a.mu
// is held.
func (a *Agentless) start(r kvevent.Rank, w agentlessSub) error {
	epoch, resume := resumeAt(a.b.Cursor(r))
	ctx, cancel := context.WithCancel(context.Background())
	sink := &positionSink{a: a, rank: r, epoch: epoch, ctx: ctx}
	sub, err := enginesub.New(enginesub.Config{Endpoint: w.endpoint, ReplayEndpoint: w.replay,
		ReplayTimeout: a.cfg.ReplayTimeout, Rank: r, Decoder: engine.Config{BlockSize: w.blockSize, Seed: engine.SaltedSeed(w.salt),
			LearnGroupKinds: !a.cfg.NoLearnGroupKinds},
		Resume: resume, Sink: sink, Logger: a.log, Registerer: a.cfg.Registerer, SkipLog: a.skipLog(r.Worker)})
	if err != nil {
		cancel()
		return err
	}
	if a.exported == nil {
		a.exported = map[kvevent.Rank]*enginesub.Subscriber{}
	}
	a.exported[r] = sub
	w.sub, w.cancel, w.done, w.started = sub, cancel, make(chan struct{}), time.Now()
	go func() {
		defer close(w.done)
		if err := sub.Run(ctx); err != nil {
			a.log.Warn("agentless: subscriber stopped", "rank", r, "err", err)
		}
	}()
	a.subs[r] = &w
	a.log.Info("agentless: following the engine", "rank", r, "endpoint", w.endpoint, "epoch", epoch, "resume", resume)
	return nil
}

// positionSink commits one rank's engine batches with positional ids.
//
// A clear (a new epoch) that does not commit stays due: the next batch
// commits it first, and fails if it cannot, so that no batch after a lost
// one is applied without a clear in between (keeping the old epoch would
// apply it above the loss; taking the new one without its clear too).
type positionSink struct {
	a        *Agentless
	ctx      context.Context // ends when the subscriber stops; nil: never
	rank     kvevent.Rank
	epoch    uint32
	clearDue string // why a clear is due; "" when none
	// pastSeq is set once a batch's sequence was past what a position
	// holds: that batch cleared the rank, and later ones of the epoch are
	// dropped without another clear each (the engine's restart ends it).
	pastSeq bool
	// unregistered is set once a commit found the rank unregistered
	// (errRankUnregistered), which is logged once.
	unregistered bool
}

// maxEpoch is the last epoch a position holds.
const maxEpoch = 1<<(64-positionSeqBits-positionIndexBits) - 1

func (s *positionSink) commit(evs []kvevent.Event) error {
	parent := s.ctx
	if parent == nil {
		parent = context.Background()
	}
	// A subscriber that stops (its rank left, this node stopped leading,
	// its registration changed, or Close) commits nothing more: the next
	// leader's, or the restarted, subscriber resumes from the cursor. And
	// it stops waiting for a commit in flight at once; that one's outcome
	// is then unknown, and the cursor tells it.
	if err := parent.Err(); err != nil {
		return fmt.Errorf("agentless: rank %v: the subscriber is stopping, nothing committed: %w", s.rank, err)
	}
	ctx, cancel := context.WithTimeout(parent, s.a.cfg.CommitTimeout)
	defer cancel()
	// Marked as positions, the batch applies only while the rank's worker
	// is Positional when it commits: a registration that changed under a
	// subscriber still running (unregistered and registered again with
	// agentless false, before the next poll) takes none of its batches,
	// whichever leader commits them.
	acks, err := s.a.b.IngestEvents(ctx, []raftfsm.RankBatch{{Rank: s.rank, Incarnation: raftfsm.PositionalIncarnation, Events: evs}})
	if err != nil {
		return err
	}
	if len(acks) != 1 || acks[0].Gap {
		return fmt.Errorf("agentless: rank %v not applied: %+v", s.rank, acks)
	}
	if acks[0].Unregistered {
		return fmt.Errorf("agentless: rank %v: %w", s.rank, errRankUnregistered)
	}
	// The cursor in a later epoch than these events: another leader's
	// subscriber cleared the rank into it (a replay that failed, while
	// leadership was there and came back before this node's loop saw it
	// go). Every position of this sink's epoch is below that cursor now,
	// dropped as a duplicate with no error, and the rank would follow its
	// engine no more. The sink takes that epoch, with a clear due past it,
	// and fails the batch: the subscriber resyncs, and the next batches
	// apply after the clear.
	if cur, _, _ := SplitPosition(acks[0].Cursor); cur > epochOf(evs) {
		s.epoch = cur
		s.clearDue = fmt.Sprintf("another leader moved the rank to epoch %d", cur)
		return fmt.Errorf("agentless: rank %v: %s, past this subscriber's %d: its batches would all be dropped",
			s.rank, s.clearDue, epochOf(evs))
	}
	return nil
}

// errRankUnregistered: the rank's dp rank was unregistered (its worker's
// other ranks still are), or its worker is not Positional any more, and
// the commit applied nothing
// (raftfsm.RankAck.Unregistered). Nothing was lost that the index should
// have: the rank's state went with its registration. Reconcile stops the
// subscriber at its next poll; meanwhile its batches are dropped.
var errRankUnregistered = errors.New("the rank is not registered any more: batch dropped")

// epochOf is the epoch of a batch's positions (one for all its events).
func epochOf(evs []kvevent.Event) uint32 {
	e, _, _ := SplitPosition(evs[0].EventID)
	return e
}

// Events commits one engine batch (enginesub.Sink). IngestEvents encodes
// the events before it returns, so evs need no copy.
func (s *positionSink) Events(r kvevent.Rank, seq uint64, evs []kvevent.Event) error {
	switch {
	case len(evs) == 0:
		return nil
	case len(evs) > maxBatchEvents:
		return fmt.Errorf("agentless: a batch of %d events is more than a position holds (%d)", len(evs), maxBatchEvents)
	case seq >= 1<<positionSeqBits:
		if s.pastSeq {
			// Dropped until the engine restarts, once the clear is in: a
			// clear that failed is tried again (and its failure resyncs
			// again), or the rank would keep the old epoch's blocks.
			return s.commitClear()
		}
		s.pastSeq = true
		return fmt.Errorf("agentless: engine sequence %d is past what a position holds: the rank stays empty until the engine restarts", seq)
	}
	if err := s.commitClear(); err != nil {
		if errors.Is(err, errRankUnregistered) {
			return s.dropUnregistered()
		}
		return fmt.Errorf("agentless: rank %v: the clear before this batch did not commit: %w", s.rank, err)
	}
	for i := range evs {
		evs[i].Rank = s.rank
		evs[i].EventID = Position(s.epoch, seq, i+1)
	}
	err := s.commit(evs)
	if errors.Is(err, errRankUnregistered) {
		return s.dropUnregistered()
	}
	return err
}

// dropUnregistered takes a batch that the rank's unregistration made
// apply nothing: no error, since no history the rank should hold was lost
// (a resync would only propose clears that apply nothing either), and a
// log line the first time.
func (s *positionSink) dropUnregistered() error {
	if !s.unregistered {
		s.unregistered = true
		s.a.log.Info("agentless: the rank is not registered any more; its engine's batches are dropped until its subscriber stops",
			"rank", s.rank)
	}
	return nil
}

// Reset starts a new epoch with a clear: the engine restarted, empty.
func (s *positionSink) Reset(r kvevent.Rank) {
	s.pastSeq = false
	s.clear("engine restart")
}

// Resync starts a new epoch with a clear: history was lost.
func (s *positionSink) Resync(r kvevent.Rank, reason enginesub.Reason) { s.clear(string(reason)) }

func (s *positionSink) clear(why string) {
	s.clearDue = why
	if s.ctx != nil && s.ctx.Err() != nil {
		// The subscriber is stopping: what looked like a loss is, most
		// likely, a commit it stopped waiting for (committed or not), and
		// its successor resumes from the cursor, through the engine's
		// replay, and clears the rank itself if that history is gone. A
		// clear now would drop the rank's blocks for nothing.
		return
	}
	if err := s.commitClear(); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, errRankUnregistered) {
		// Due still: the next batch tries again first. (Leadership moved,
		// most likely: the next leader resumes from the cursor and meets
		// the same loss again.)
		s.a.log.Warn("agentless: clearing the rank failed", "rank", s.rank, "why", why, "err", err)
	}
}

// commitClear commits the clear that is due, if any, as the next epoch's
// first position; the sink moves to that epoch once it is committed. A
// clear retried after one whose answer was lost counts as a duplicate.
func (s *positionSink) commitClear() error {
	if s.clearDue == "" {
		return nil
	}
	if s.epoch >= maxEpoch {
		// The remedy docs/compat.md gives, unregistering the instance and
		// registering it again, starts the rank anew at cursor 0. Done
		// within one poll, reconcile finds the same registration and keeps
		// this subscriber: the sink starts over from the cursor's epoch
		// here. The cursor is below the sink's epoch only then: the sink
		// takes the cursor's epoch at its start and when another leader
		// moved it, and its own commits only raise the cursor. (A rank
		// stuck here commits nothing, so none of its batches lands in the
		// new registration at the last epoch before this check.)
		if cur, _, _ := SplitPosition(s.a.b.Cursor(s.rank)); cur < s.epoch {
			s.a.log.Info("agentless: the rank was registered anew: its positions start over", "rank", s.rank, "epoch", cur)
			s.epoch = cur
		} else {
			// The next clear's position would wrap to 0, a duplicate of
			// everything: the rank would never apply a batch again, silently.
			return fmt.Errorf("agentless: rank %v has used all %d epochs of its positions: unregister and register the instance again to start over", s.rank, maxEpoch+1)
		}
	}
	next := s.epoch + 1
	ev := []kvevent.Event{{Rank: s.rank, Kind: kvevent.KindCleared, EventID: Position(next, 0, 0)}}
	if err := s.commit(ev); err != nil {
		return err
	}
	s.a.log.Info("agentless: rank cleared", "rank", s.rank, "why", s.clearDue, "epoch", next)
	s.epoch, s.clearDue = next, ""
	return nil
}
