package eventplane

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/nats-io/nats.go"
)

// DefaultHeartbeatSubject is where agents send their workers' heartbeats.
const DefaultHeartbeatSubject = "kvrouter.heartbeat"

// A heartbeat is a NATS request whose body is the worker ids it vouches
// for, 8 bytes little-endian each. The leader answers with the ids among
// them that are not registered (same encoding): the agent registers those
// again (a lease that expired while the agent was cut off, or a cluster
// restored from an older snapshot).

// AppendHeartbeat appends the heartbeat body of ids to dst.
func AppendHeartbeat(dst []byte, ids []uint64) []byte {
	for _, id := range ids {
		dst = binary.LittleEndian.AppendUint64(dst, id)
	}
	return dst
}

// DecodeHeartbeat reads a heartbeat body (or its answer).
func DecodeHeartbeat(b []byte) ([]uint64, error) {
	if len(b)%8 != 0 {
		return nil, fmt.Errorf("%w: heartbeat of %d bytes is not a list of 8-byte ids", ErrMalformed, len(b))
	}
	ids := make([]uint64, len(b)/8)
	for i := range ids {
		ids[i] = binary.LittleEndian.Uint64(b[8*i:])
	}
	return ids, nil
}

// A heartbeat request may carry the NATS header headerHeartbeatAsk with
// the value heartbeatAskRanks (HeartbeatRequest). The leader then names,
// in the header headerRanksWithoutState of its answer, every registered
// rank of the heartbeat's known workers that it holds no cursor of
// (raftfsm.FSM.HasCursor): "worker/dp", space-separated, each worker's
// ranks once however often its id comes, and an empty
// header when there is none, so that an agent can tell a router that
// lost nothing from one that names nothing (of an earlier build, or past
// maxHeartbeatRanks); an agent trusts such an answer over a run of
// failed heartbeats (kvagent), whose answers may only have been late.
// Such a rank holds nothing its publisher sent:
// nothing reached the router yet, or the router lost it since. An
// operator's removal of the worker and its registration again between
// two heartbeats takes its ranks' state, and no answer ever says the
// worker is unknown; an agent that had a rank's dump taken before the
// heartbeat resyncs the rank (kvagent), which an idle rank would
// otherwise never show the router. The body stays as above both ways:
// a router of an earlier build reads the body only and answers without
// headers, and a request without the header (an agent of an earlier
// build) gets an answer without headers, so agents and routers upgrade
// in any order.
//
// Beside it, in the header headerRanksNeedingResync, the leader names those
// of the ranks it holds state of that it flags as needing a resync
// (indexer's NeedsResync: an operator's restore from a snapshot flags every
// rank, an orphan dropped flags its rank), in the same format, and empty
// when there is none; the agent has such a rank dumped, held back as an
// ack's Resync is (PublisherConfig.RouterResyncEvery), which an idle rank,
// sending no events and so getting no acks, would otherwise never be.
// An agent of an earlier build ignores it.
const (
	headerHeartbeatAsk       = "Kvrouter-Heartbeat-Ask"
	heartbeatAskRanks        = "ranks-without-state"
	headerRanksWithoutState  = "Kvrouter-Ranks-Without-State"
	headerRanksNeedingResync = "Kvrouter-Ranks-Needing-Resync"
)

// maxHeartbeatRanks bounds the ranks the leader looks at to answer one
// heartbeat's ask: past it, it answers as if not asked (no header, not
// even an empty one), which tells the agent nothing, and it stops
// collecting the workers there (onHeartbeat). Anyone on NATS may send a
// heartbeat of many registered ids, or of one repeated; one worker's dp
// ranks, what an agent asks about, always fit.
const maxHeartbeatRanks = limits.MaxDPRanks

// maxHeartbeatIDs bounds the ids of one heartbeat: a longer one is
// refused as malformed, unread. An agent's heartbeat vouches for its one
// worker. Anyone on NATS may send heartbeats up to the payload limit
// (8 MiB, 1 Mi ids), each of which took the leader tens of milliseconds
// to read: a stream of them filled the heartbeat subscription's pending
// buffer faster than it drained, and nats.go dropped the heartbeats that
// came meanwhile, live workers' among them (a few in a hundred in a
// test), leases that could run out. Refused unread, they cost about their
// copy.
const maxHeartbeatIDs = maxHeartbeatRanks

// HeartbeatRequest returns the heartbeat request of ids on subject,
// asking for the ranks without state (headerHeartbeatAsk). A connection to
// a NATS server without headers (before 2.2: nats.Conn.HeadersSupported)
// refuses it: send it there with no Header, as a plain heartbeat.
func HeartbeatRequest(subject string, ids []uint64) *nats.Msg {
	return &nats.Msg{Subject: subject, Data: AppendHeartbeat(nil, ids),
		Header: nats.Header{headerHeartbeatAsk: []string{heartbeatAskRanks}}}
}

// A HeartbeatAnswer is the leader's answer to a heartbeat
// (DecodeHeartbeatAnswer).
type HeartbeatAnswer struct {
	// Unknown holds the ids the leader does not know (the body).
	Unknown []uint64
	// Stateless holds the ranks of the others that it holds no state of
	// (headerRanksWithoutState), as far as they could be read.
	Stateless []kvevent.Rank
	// Resync holds the ranks the leader holds state of and flags as
	// needing a resync (headerRanksNeedingResync), as far as they could
	// be read; none without the header.
	Resync []kvevent.Rank
	// ResyncNamed says whether the answer says which of the ranks the
	// router flags: it carries headerRanksNeedingResync, empty or not,
	// and every rank of it could be read. A rank of the heartbeat's
	// workers it then leaves out is not flagged, as of the answer: a
	// held-back ask of it is void (Publisher.RouterStopsAsking).
	ResyncNamed bool
	// Named says whether the answer says what the router lost: it
	// carries the header, empty or not, and every rank of it could be
	// read. Without the header (a router of an earlier build, a
	// heartbeat that did not ask, or one past maxHeartbeatRanks) the
	// answer says nothing of the ranks' state.
	Named bool
	// Unreadable is an error wrapping ErrMalformed that names the first
	// rank of headerRanksWithoutState that could not be read (a format of
	// a later build), nil when there is none. The ranks that could be
	// read are in Stateless all the same, and the body decides liveness.
	Unreadable error
	// ResyncUnreadable is the same of headerRanksNeedingResync: it names
	// the first rank of that header that could not be read, nil when
	// there is none. The ranks that could be read are in Resync all the
	// same; it leaves Named and Unreadable alone, which say what the
	// router lost, not what it asks to have resynced.
	ResyncUnreadable error
}

// DecodeHeartbeatAnswer reads the leader's answer to a heartbeat. Its
// error is the body's only: a rank of a header that cannot be read is
// skipped (HeartbeatAnswer.Unreadable for headerRanksWithoutState,
// HeartbeatAnswer.ResyncUnreadable for headerRanksNeedingResync), so
// that a header of a later format never hides the body, which every
// build reads the same way.
func DecodeHeartbeatAnswer(m *nats.Msg) (HeartbeatAnswer, error) {
	var a HeartbeatAnswer
	var err error
	a.Unknown, err = DecodeHeartbeat(m.Data)
	if err != nil {
		return HeartbeatAnswer{}, err
	}
	if v := m.Header.Values(headerRanksNeedingResync); len(v) > 0 {
		a.Resync = readRanks(v[0], headerRanksNeedingResync, &a.ResyncUnreadable)
		a.ResyncNamed = a.ResyncUnreadable == nil
	}
	if v := m.Header.Values(headerRanksWithoutState); len(v) > 0 {
		a.Stateless = readRanks(v[0], headerRanksWithoutState, &a.Unreadable)
		a.Named = a.Unreadable == nil
	}
	return a, nil
}

// readRanks reads the ranks of a heartbeat answer's header h, whose value
// is v, skipping any it cannot read; the first of those sets *unreadable,
// unless it is set already.
func readRanks(v, h string, unreadable *error) []kvevent.Rank {
	var out []kvevent.Rank
	for f := range strings.FieldsSeq(v) {
		w, dp, _ := strings.Cut(f, "/")
		id, err1 := strconv.ParseUint(w, 10, 64)
		d, err2 := strconv.ParseUint(dp, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			if *unreadable == nil {
				*unreadable = fmt.Errorf("%w: rank %q in the heartbeat answer's %s: %w", ErrMalformed, f, h, err)
			}
			continue
		}
		out = append(out, kvevent.Rank{Worker: id, DP: uint32(d)})
	}
	return out
}

// cursorHolder is what a Target may also do (a raftfsm.Node does): say
// whether it holds a cursor of a rank. A Target without it names no
// ranks in its heartbeat answers.
type cursorHolder interface {
	HasCursor(r kvevent.Rank) bool
}

var _ cursorHolder = (*raftfsm.Node)(nil)

// resyncTeller is what a Target may also do (a raftfsm.Node does): say
// whether it flags a rank as needing a resync. A Target without it sends
// no headerRanksNeedingResync.
type resyncTeller interface {
	RankNeedsResync(r kvevent.Rank) bool
}

var _ resyncTeller = (*raftfsm.Node)(nil)

// ranksWithoutState returns the headerRanksWithoutState value of the
// answer to a heartbeat that asked, whose known workers are ws: their
// registered ranks the node holds no cursor of, "" when there is none;
// and the headerRanksNeedingResync value, of those it holds a cursor of
// that it flags as needing a resync (rok false, for no such header, when
// the node cannot tell). ok is false, for an answer without either
// header, when the node cannot tell (no cursorHolder) or the workers have
// more than maxHeartbeatRanks ranks.
func (in *Ingester) ranksWithoutState(ws []raftfsm.WorkerInfo) (v string, ok bool, resync string, rok bool) {
	c, ok := in.cfg.Node.(cursorHolder)
	if !ok {
		return "", false, "", false
	}
	rt, rok := in.cfg.Node.(resyncTeller)
	n := 0
	for _, w := range ws {
		n += max(len(w.DPRanks), 1)
	}
	if n > maxHeartbeatRanks {
		return "", false, "", false
	}
	var b, rb []byte
	add := func(b []byte, r kvevent.Rank) []byte {
		if len(b) > 0 {
			b = append(b, ' ')
		}
		b = strconv.AppendUint(b, r.Worker, 10)
		b = append(b, '/')
		return strconv.AppendUint(b, uint64(r.DP), 10)
	}
	for _, w := range ws {
		dps := w.DPRanks
		if len(dps) == 0 {
			dps = []uint32{0} // as registered (raftfsm)
		}
		for _, dp := range dps {
			r := kvevent.Rank{Worker: w.ID, DP: dp}
			switch {
			case !c.HasCursor(r):
				b = add(b, r)
			case rok && rt.RankNeedsResync(r):
				rb = add(rb, r)
			}
		}
	}
	return string(b), true, string(rb), rok
}

// leases is the leader's view of its leased workers: when each was last
// heard of. It is not replicated: a lease runs from the latest of the
// worker's last heartbeat, its last registration (registeredAt, ordered by
// when this term first saw it: registrationSeen, regs) and the
// first time this leader saw the worker in its table (a sweep, or a
// heartbeat). So a new leader grants every
// worker a grace of one lease from its first sweep, which waits for its
// post-election Barrier (Ingester.caughtUp), and a failover never
// expires a worker that kept sending heartbeats; and a worker registered
// during the term gets a whole lease before its first heartbeat is due,
// however long the leader has led.
//
// seen holds registered workers only: a heartbeat naming an id the table
// lacks is answered "unknown" and not remembered, and a sweep forgets the
// workers gone from the table, so the map is bounded by the table (not by
// what clients send).
//
// unreg holds, per worker that is not registered and whose ranks the
// node holds state of (raftfsm.FSM.UnregisteredRanks), when this leader
// first saw it so (at its first sweep, for those it inherits): like a
// lease, a grace never runs from before the election. It is bounded by
// those ranks, which the sweep forgets once they are gone. unlisted does
// the same per rank for the ranks of registered workers that their
// registration does not list (removed rank by rank, not with their
// worker).
//
// deaf and reconnects are what the sweeps saw of the leader's NATS
// connection this term (hearing): heartbeats reach the leader through it
// only, so silence while it is down says nothing of the workers.
type leases struct {
	mu     sync.Mutex
	gen    uint64               // bumped by lead, restart and stepDown: what a term's removals check they still belong to
	term   uint64               // the Raft term lead started them for (Ingester.leaderTerm; 0 from a Target that does not tell)
	since  time.Time            // when this node became leader; zero when it does not lead
	seen   map[uint64]time.Time // per registered worker: its last heartbeat, or when first seen, this term
	regs   map[uint64]regSeen   // per registered worker: its latest registration stamp, and when this term first saw it
	expiry map[uint64]bool      // removals in flight
	unreg  map[uint64]time.Time // per unregistered worker with rank state: when first seen so, this term
	strays map[uint64]bool      // removals of unregistered workers' ranks in flight

	unlisted    map[kvevent.Rank]time.Time // per registered worker's rank it does not list, with state: when first seen so, this term
	unlistedRun bool                       // a removal of such ranks is in flight

	deaf       bool   // a sweep found the NATS connection down, and none since found it back
	reconnects uint64 // the connection's reconnects at the last sweep that found it up
	counted    bool   // reconnects was read this term
}

func (l *leases) lead(now time.Time, term uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.restart()
	l.since, l.term = now, term
	l.deaf, l.reconnects, l.counted = false, 0, false
}

// restart starts every lease and grace afresh, as a new term does: each
// runs from the next sweep's first sighting. The removals in flight are
// the old generation's, and change nothing of the new one (current).
// l.mu is held.
func (l *leases) restart() {
	l.gen++
	l.seen, l.expiry, l.regs = map[uint64]time.Time{}, map[uint64]bool{}, map[uint64]regSeen{}
	l.unreg, l.strays = map[uint64]time.Time{}, map[uint64]bool{}
	l.unlisted, l.unlistedRun = map[kvevent.Rank]time.Time{}, false
}

func (l *leases) stepDown() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gen++
	l.since, l.term, l.seen, l.expiry, l.regs = time.Time{}, 0, nil, nil, nil
	l.unreg, l.strays = nil, nil
	l.unlisted, l.unlistedRun = nil, false
	l.deaf, l.reconnects, l.counted = false, 0, false
}

// current says whether gen, read with a sweep's decisions, is still the
// leases' generation and the node still leads in the term they started
// for (leaderTerm): no step-down (nor a re-election after one) came
// since. A removal decided in one term waits for the worker-table lock
// and for its commit (up to CommitTimeout); a step-down and an election
// may both fit in that wait, and the new term's maps are its own: its
// leases and graces start at its own first sweep, after its Barrier. The
// poll that starts them (Ingester.leadership) may come up to PollInterval
// after that Barrier, and the generation alone said "current" until then.
//
// The node's leadership is read before the generation: a step-down and a
// re-election while it is read (a Target may take its time) bump the
// generation, which is then read stale.
func (in *Ingester) current(gen uint64) bool {
	term, leads := in.leaderTerm()
	in.leases.mu.Lock()
	same, led := in.leases.gen == gen, in.leases.term
	in.leases.mu.Unlock()
	return same && leads && term == led
}

// leaseOf returns a lease of ms milliseconds as a time.Duration, the
// longest one for a lease too long for it: time.Duration(ms) times a
// millisecond overflowed past about 292 years (to a negative duration
// for MaxInt64), and the worker was removed at the first sweep. The API
// and raftfsm.Node.RegisterWorker refuse a lease past
// raftfsm.MaxLeaseMs, but a log or snapshot from before may hold one.
// A time.Time's Sub saturates too, so such a lease never expires.
func leaseOf(ms int64) time.Duration {
	if ms > math.MaxInt64/int64(time.Millisecond) {
		return math.MaxInt64
	}
	return time.Duration(ms) * time.Millisecond
}

// onHeartbeat records a heartbeat and answers the ids the cluster does not
// know, and, when the heartbeat asks, the ranks of the others that it
// holds no state of (ranksWithoutState). A leader whose state may still
// lack entries of the terms before its own (caughtUp) answers nothing: a
// worker whose registration is among them would read "unknown", and its
// agent would register again and dump every rank (at every failover); a
// rank whose dump is among them would read as one without state. The
// agent's request times out, and it sends the next heartbeat when due;
// the new leader's leases start at its first sweep, which waits as well,
// so no lease runs out meanwhile. An error answer would not do: the agent
// reads any answer as a list of ids.
func (in *Ingester) onHeartbeat(m *nats.Msg) {
	if !in.enter() {
		return
	}
	defer in.leave()
	if !in.caughtUp() {
		return
	}
	ids, err := []uint64(nil), error(nil)
	if n := len(m.Data) / 8; n > maxHeartbeatIDs {
		err = fmt.Errorf("%w: heartbeat of %d ids, more than %d", ErrMalformed, n, maxHeartbeatIDs)
	} else {
		ids, err = DecodeHeartbeat(m.Data)
	}
	if err != nil {
		// A heartbeat, not an event request: counted as one, and answered
		// outside the event requests' families (reply).
		in.m.malformedHeartbeats.Inc()
		if m.Reply != "" {
			_ = m.Respond(appendError(nil, codeInvalid, err.Error()))
		}
		return
	}
	now := time.Now()
	table := in.cfg.Node.WorkerTable()
	ask := m.Header.Get(headerHeartbeatAsk) == heartbeatAskRanks
	var unknown []uint64
	// known holds each known worker once (listed, its ranks are named
	// once), and only while their ranks are within maxHeartbeatRanks:
	// past it the answer names none (ranksWithoutState), so collecting
	// stops there. Anyone on NATS may send a body of one registered id
	// repeated up to the payload limit (8 MiB, 1 Mi ids): a copy of the
	// record per id cost about 1 GB, held under the leases' lock for
	// seconds; now it costs a few records and a map of at most
	// maxHeartbeatRanks+1 ids.
	var known []raftfsm.WorkerInfo
	var listed map[uint64]struct{}
	ranks := 0
	in.leases.mu.Lock()
	for _, id := range ids {
		w, ok := table[id]
		if !ok {
			unknown = append(unknown, id)
			continue
		}
		if _, dup := listed[id]; ask && !dup && ranks <= maxHeartbeatRanks {
			if listed == nil {
				listed = make(map[uint64]struct{})
			}
			listed[id] = struct{}{}
			known = append(known, w)
			ranks += max(len(w.DPRanks), 1) // as ranksWithoutState counts
		}
		if in.leases.seen != nil {
			in.leases.seen[id] = now
		}
	}
	in.leases.mu.Unlock()
	// One per worker id, however often it comes (ids is not used past
	// here): a body of one id repeated would count it a million times.
	slices.Sort(ids)
	in.m.heartbeats.Add(float64(len(slices.Compact(ids))))
	if m.Reply == "" {
		return
	}
	// Each unknown id once, sorted: an id repeated up to the payload
	// limit would make an answer longer than the heartbeat, too long to
	// send (and unsent, the agent would only time out).
	slices.Sort(unknown)
	unknown = slices.Compact(unknown)
	answer := &nats.Msg{Data: AppendHeartbeat(nil, unknown)}
	if ask {
		if v, ok, rv, rok := in.ranksWithoutState(known); ok {
			answer.Header = nats.Header{headerRanksWithoutState: []string{v}}
			if rok {
				answer.Header[headerRanksNeedingResync] = []string{rv}
			}
		}
	}
	_ = m.RespondMsg(answer)
}

// sweepLeases removes, through Raft, every leased worker not heard of for
// its lease, and the ranks of every worker that stayed unregistered for
// UnregisteredGrace (sweepUnregistered). It runs on the leader only, and
// removes nothing while the leader cannot hear NATS (hearing).
func (in *Ingester) sweepLeases(now time.Time) {
	table := in.cfg.Node.WorkerTable()
	in.dropLeftWorkers(table)
	if !in.hearing() {
		return
	}
	in.sweepUnregistered(now, table)
	var expired []raftfsm.WorkerInfo
	in.leases.mu.Lock()
	if in.leases.since.IsZero() {
		in.leases.mu.Unlock()
		return
	}
	gen := in.leases.gen
	for id := range in.leases.seen {
		if _, ok := table[id]; !ok && !in.leases.expiry[id] {
			delete(in.leases.seen, id) // deregistered some other way
			delete(in.leases.regs, id)
		}
	}
	for id, w := range table {
		if w.LeaseMs <= 0 || in.leases.expiry[id] {
			continue
		}
		last, ok := in.leases.seen[id]
		if !ok {
			// First seen now: registered since the last sweep (or the
			// election), its lease starts here, and so does its
			// registration.
			in.leases.seen[id] = now
			in.registrationSeen(id, in.registeredAt(id, now), now)
			continue
		}
		if reg := in.registrationSeen(id, in.registeredAt(id, now), now); reg.After(last) {
			last = reg // registered again since: a sign of life
		}
		if now.Sub(last) > leaseOf(w.LeaseMs) {
			in.leases.expiry[id] = true
			expired = append(expired, w)
		}
	}
	in.leases.mu.Unlock()
	for _, w := range expired {
		in.cwg.Add(1)
		go func() {
			defer in.cwg.Done()
			// The removal waits for the worker-table lock, which a
			// registration may hold for a while: a heartbeat accepted
			// (and answered "known") meanwhile, or a registration
			// meanwhile (leaseHolds), keeps the worker. The next sweep judges
			// it anew. So does a step-down meanwhile, even one followed
			// by a re-election: the new term's heartbeats are its own,
			// and it grants the worker a whole lease from its first
			// sweep; and so does a node not caught up (CheckLeader).
			// A worker removed meanwhile (an operator's DELETE
			// /v1/workers/{id}) is left to that removal (gone): a
			// deregistration of its id would be a Raft entry of its
			// own, which removes the state the id gained since (ranks
			// of an agent still publishing, before their unregistered
			// grace), and no lease of this leader's removed it.
			gone := false
			removed, _, kept, err := in.deregister(w.ID, func(table map[uint64]raftfsm.WorkerInfo) bool {
				if !in.current(gen) || !in.caughtUp() {
					return true
				}
				if _, ok := table[w.ID]; !ok {
					gone = true
					return true
				}
				return in.leaseHolds(w.ID, now, table)
			})
			// A removal that does not take the lock (through another
			// node's API) may still come between the check and the
			// commit: the entry then removed nothing of the worker's.
			gone = gone || errors.Is(err, raftfsm.ErrUnknownWorker)
			in.leases.mu.Lock()
			if in.leases.gen == gen {
				delete(in.leases.expiry, w.ID)
				if removed || gone {
					// A registration from now on starts a new lease. After
					// a failure the old heartbeat stays: the next sweep
					// retries at once.
					delete(in.leases.seen, w.ID)
					delete(in.leases.regs, w.ID)
				}
			}
			in.leases.mu.Unlock()
			switch {
			case gone:
				in.cfg.Logger.Debug("worker whose lease expired was removed meanwhile; nothing to do", "worker", w.ID)
			case kept:
			case removed:
				in.m.expired.Inc()
				in.cfg.Logger.Warn("worker lease expired; removed", "worker", w.ID,
					"lease", leaseOf(w.LeaseMs))
			default:
				in.cfg.Logger.Warn("removing a worker whose lease expired failed; retrying", "worker", w.ID, "err", err)
			}
		}()
	}
}

// hearing says whether the leader's NATS connection is up, so that the
// heartbeats sent to the cluster reach it. While it is down (the leader's
// NATS server is gone, or an external --nats-url is cut off from the
// leader alone), the agents' heartbeats go on to the other servers and no
// further: their silence here is the leader's deafness, not the workers'
// death, and removing every leased worker (its ranks' state and bookings
// with it) would turn one node's NATS trouble into a routing outage. So
// no lease runs out and no grace is acted on while it is down (logged
// once per outage; kvrouter_worker_leases_held), and once it is back,
// every lease and grace starts afresh (leases.restart), as at a new term:
// the heartbeats lost meanwhile are the connection's, not the workers'.
// A reconnection between two sweeps, which no sweep saw down, restarts
// them too (the connection's count of reconnects moved). An ingester
// without a connection (tests) always hears.
//
// It cannot see a connection that is up to a server that no longer gets
// the agents' subjects (an embedded server that lost its routes, the
// leader's side of a partitioned NATS cluster), nor one down before
// nats.go notices (a silent network drop: its pings, minutes by default).
func (in *Ingester) hearing() bool {
	nc := in.cfg.Conn
	if nc == nil {
		return true
	}
	// The count before the status: a reconnection in between is seen by
	// the next sweep's count, and restarts the leases once more.
	n := nc.Stats().Reconnects
	up := nc.IsConnected()
	l := &in.leases
	l.mu.Lock()
	if l.since.IsZero() {
		l.mu.Unlock()
		return false
	}
	wasDeaf, moved := l.deaf, l.counted && n != l.reconnects
	if !up {
		l.deaf = true
		l.mu.Unlock()
		if !wasDeaf {
			in.m.leasesHeld.Set(1)
			in.cfg.Logger.Warn("the leader's NATS connection is down: it cannot hear heartbeats, so it holds every worker's lease until it is back",
				"status", nc.Status().String())
		}
		return false
	}
	if wasDeaf || moved {
		l.restart()
	}
	l.deaf, l.reconnects, l.counted = false, n, true
	l.mu.Unlock()
	if wasDeaf || moved {
		in.m.leasesHeld.Set(0)
		in.cfg.Logger.Info("the leader's NATS connection is back; every worker's lease starts afresh",
			"connected", RedactURLs(nc.ConnectedUrl()))
	}
	return true
}

// sweepUnregistered removes, through Raft, the ranks of the workers that
// are not registered and have stayed so, with state on this node, for
// UnregisteredGrace since this leader first saw them so. Events and dumps
// apply whether or not their worker is registered (a registration may
// commit after an agent's first events), so an agent that goes on
// publishing after its worker was removed (its first batch meets a gap,
// and it dumps the rank anew), or one that never registers, would leave
// ranks that nothing else removes. The removal is a DeregisterWorker of
// the worker, which takes an unknown worker's ranks too; a worker that
// registers before it is not removed.
//
// The ranks of a registered worker that its registration does not list
// take events and dumps too (a re-registration adding the rank may commit
// after the agent's first events), and have no capacity: they are removed
// rank by rank after the same grace (removeUnlisted), unless a
// registration lists them by the time the removal applies.
func (in *Ingester) sweepUnregistered(now time.Time, table map[uint64]raftfsm.WorkerInfo) {
	l, ok := in.cfg.Node.(unregisteredLister)
	if !ok {
		return
	}
	ranks := l.UnregisteredRanks() // in rank order: a worker's ranks are adjacent
	type stray struct {
		id    uint64
		ranks int
	}
	var due []stray
	var unlisted []kvevent.Rank // in rank order
	in.leases.mu.Lock()
	if in.leases.since.IsZero() {
		in.leases.mu.Unlock()
		return
	}
	gen := in.leases.gen
	for id := range in.leases.unreg {
		_, still := slices.BinarySearchFunc(ranks, id, func(r kvevent.Rank, id uint64) int { return cmp.Compare(r.Worker, id) })
		if !still && !in.leases.strays[id] {
			delete(in.leases.unreg, id) // registered, or removed
		}
	}
	for i := 0; i < len(ranks); {
		id, n := ranks[i].Worker, 1
		for i+n < len(ranks) && ranks[i+n].Worker == id {
			n++
		}
		i += n
		if _, registered := table[id]; registered {
			// Registered, and the listing has ranks of it: ranks its
			// registration does not list (or it left after the table was
			// read: the next sweep sees it first as unregistered, and the
			// removal of a rank its worker no longer has takes it too).
			delete(in.leases.unreg, id)
			unlisted = append(unlisted, ranks[i-n:i]...)
			continue
		}
		if in.leases.strays[id] {
			continue // its removal is in flight
		}
		first, ok := in.leases.unreg[id]
		if !ok {
			in.leases.unreg[id] = now
			continue
		}
		if now.Sub(first) > in.cfg.UnregisteredGrace {
			due = append(due, stray{id, n})
		}
	}
	// One removal run at a time, of at most maxStrayRemovals workers (in
	// rank order): anyone on NATS may publish for any worker id, so the
	// strays are as many as publishers make them, and a goroutine (and a
	// Raft entry at once) each was unbounded. The rest wait for the runs
	// of the sweeps after.
	dueRanks := in.dueUnlisted(now, unlisted)
	running := len(in.leases.strays) > 0
	if running || len(due) == 0 {
		in.leases.mu.Unlock()
		in.removeUnlisted(gen, dueRanks)
		return
	}
	left := len(due) - min(len(due), maxStrayRemovals)
	due = due[:len(due)-left]
	for _, w := range due {
		in.leases.strays[w.id] = true
	}
	in.leases.mu.Unlock()
	in.removeUnlisted(gen, dueRanks)
	if left > 0 {
		in.cfg.Logger.Warn("workers not registered for the unregistered grace; removing their ranks' state in parts",
			"removing", len(due), "left", left, "grace", in.cfg.UnregisteredGrace)
	}
	in.cwg.Add(1)
	go func() {
		defer in.cwg.Done()
		for i, w := range due {
			if in.closed() || !in.cfg.Node.IsLeader() || !in.removeStray(gen, w.id, w.ranks) {
				// The next leader's sweeps see them, or this node's next
				// term's, whose grace starts at its own first sighting.
				// Only this term's marks are this run's to clear: a
				// step-down dropped them (leases.stepDown), and a new
				// term's maps are its own.
				in.leases.mu.Lock()
				if in.leases.gen == gen {
					for _, w := range due[i:] {
						delete(in.leases.strays, w.id)
					}
				}
				in.leases.mu.Unlock()
				return
			}
		}
	}()
}

// maxStrayRemovals bounds the unregistered workers one removal run of
// sweepUnregistered removes (each is a Raft entry, and a run holds the
// sweep's next run back until it ends), and the registered workers'
// unlisted ranks one entry of removeUnlisted removes.
const maxStrayRemovals = 256

// rankRemover is what a Target may also do (a raftfsm.Node does): remove
// through Raft the state of ranks that no registration lists when the
// entry applies, returning how many it removed. A Target without it has
// the ranks of unregistered workers removed only.
type rankRemover interface {
	RemoveUnregisteredRanks(ctx context.Context, ranks []kvevent.Rank) (int, error)
}

var _ rankRemover = (*raftfsm.Node)(nil)

// dueUnlisted notes when this term first saw each of ranks (registered
// workers' ranks their registration does not list, in rank order) so,
// forgets the ranks gone from the listing, and returns those (at most
// maxStrayRemovals, in rank order) listed for longer than
// UnregisteredGrace, marking their removal in flight. It returns none
// while a removal is in flight (the sweeps after see the rest) or when
// the Target cannot remove ranks. in.leases.mu is held.
//
// The forgetting and the noting run while a removal is in flight too, as
// sweepUnregistered's of unregistered workers do: a rank listed by a
// registration in between, and unlisted again by a later one, had kept
// its old sighting and been removed less than a grace after it became
// unlisted again.
func (in *Ingester) dueUnlisted(now time.Time, ranks []kvevent.Rank) []kvevent.Rank {
	if _, ok := in.cfg.Node.(rankRemover); !ok {
		return nil
	}
	for r := range in.leases.unlisted {
		if _, still := slices.BinarySearchFunc(ranks, r, kvevent.Rank.Compare); !still {
			delete(in.leases.unlisted, r) // registered, or removed
		}
	}
	running := in.leases.unlistedRun
	var due []kvevent.Rank
	for _, r := range ranks {
		first, ok := in.leases.unlisted[r]
		if !ok {
			in.leases.unlisted[r] = now
			continue
		}
		if !running && now.Sub(first) > in.cfg.UnregisteredGrace && len(due) < maxStrayRemovals {
			due = append(due, r)
		}
	}
	if running {
		return nil
	}
	in.leases.unlistedRun = len(due) > 0
	return due
}

// removeUnlisted removes, through Raft and in one entry, ranks (from
// dueUnlisted, in generation gen of the leases): each unless a
// registration lists it by the time the entry applies, which is why it
// needs no worker-table lock. It removes nothing when the term that
// decided it ended or the node's state is not caught up with its
// leadership (caughtUp). It does not wait for the removal.
func (in *Ingester) removeUnlisted(gen uint64, ranks []kvevent.Rank) {
	if len(ranks) == 0 {
		return
	}
	rm := in.cfg.Node.(rankRemover) // dueUnlisted returns ranks only then
	in.cwg.Add(1)
	go func() {
		defer in.cwg.Done()
		removed, err := 0, error(nil)
		stale := in.closed() || !in.current(gen) || !in.caughtUp() // current: still leading, in the same term
		if !stale {
			ctx, cancel := context.WithTimeout(context.Background(), in.cfg.CommitTimeout)
			removed, err = rm.RemoveUnregisteredRanks(ctx, ranks)
			cancel()
		}
		in.leases.mu.Lock()
		if in.leases.gen == gen {
			in.leases.unlistedRun = false
			if !stale && err == nil {
				// Removed or listed since: a rank that comes back (its
				// publisher sends on) gets a new grace. After a failure
				// the first sighting stays: the next sweep retries.
				for _, r := range ranks {
					delete(in.leases.unlisted, r)
				}
			}
		}
		in.leases.mu.Unlock()
		switch {
		case stale:
		case err != nil:
			in.cfg.Logger.Warn("removing registered workers' ranks that their registration does not list failed; retrying",
				"ranks", len(ranks), "err", err)
		case removed > 0:
			in.m.unregRemoved.Add(float64(removed))
			in.cfg.Logger.Warn("ranks that their worker's registration does not list took events or dumps for the unregistered grace; their state removed",
				"ranks", removed, "first", ranks[0].String(), "grace", in.cfg.UnregisteredGrace)
		}
	}()
}

// removeStray removes, through Raft, the ranks of unregistered worker id
// (the sweep listed ranks of them), unless it registered since the
// listing, and clears its mark of a removal in flight. It counts the
// ranks the entry removed (none when another removal of the id committed
// first), or, from a Target that does not say, the ranks listed. It
// returns false, and removes nothing, when the run that decided the
// removal (in generation gen of the leases) should stop: the term ended
// (a new one may have begun while the removal waited for the
// worker-table lock), or the node's state is not caught up with its
// leadership (caughtUp: it lost the lead, not yet stepped down).
func (in *Ingester) removeStray(gen, id uint64, ranks int) bool {
	stale := false
	// A worker that registered since the listing keeps its ranks.
	removed, n, registered, err := in.deregister(id, func(table map[uint64]raftfsm.WorkerInfo) bool {
		if !in.current(gen) || !in.caughtUp() {
			stale = true
			return true
		}
		_, ok := table[id]
		return ok
	})
	if stale {
		return false
	}
	in.leases.mu.Lock()
	if in.leases.gen == gen {
		delete(in.leases.strays, id)
		if removed || registered {
			// Its ranks may come back (the agent resends and dumps): a
			// new grace starts then. After a failure the first sighting
			// stays: the next sweep retries.
			delete(in.leases.unreg, id)
		}
	}
	in.leases.mu.Unlock()
	if n < 0 {
		n = ranks // a Target that does not say: the ranks the sweep listed
	}
	switch {
	case registered:
	case removed && n == 0:
		// Another removal of the id (an operator's DELETE
		// /v1/workers/{id}) committed first and took the ranks: this
		// entry removed none, as it answers ErrUnknownWorker all the same.
		in.cfg.Logger.Debug("ranks of a worker not registered were removed meanwhile; nothing to do", "worker", id)
	case removed:
		in.m.unregRemoved.Add(float64(n))
		in.cfg.Logger.Warn("worker not registered for the unregistered grace; its ranks' state removed (its agent publishes without a registration)",
			"worker", id, "ranks", n, "grace", in.cfg.UnregisteredGrace)
	default:
		in.cfg.Logger.Warn("removing the ranks of an unregistered worker failed; retrying", "worker", id, "err", err)
	}
	return true
}

// leaseHolds says, at now (the sweep's), whether worker id's lease holds
// after all (under the worker-table lock, table read under it): heard of
// (a heartbeat, or a registration: registeredAt) since the sweep found it
// expired, or registered anew without a lease. Its lease, whatever it is
// now, is judged from the latest of those: an agent that registered again
// with the same lease while the removal waited keeps its worker. The
// worker is in table (sweepLeases leaves one removed meanwhile alone).
func (in *Ingester) leaseHolds(id uint64, now time.Time, table map[uint64]raftfsm.WorkerInfo) bool {
	w := table[id]
	if w.LeaseMs <= 0 {
		return true
	}
	// Bound by the clock now, not the sweep's: the registration may have
	// come after the sweep, while the removal waited for the lock.
	at := time.Now()
	stamp := in.registeredAt(id, at)
	in.leases.mu.Lock()
	last, heard := in.leases.seen[id]
	reg := in.registrationSeen(id, stamp, at)
	in.leases.mu.Unlock()
	if !reg.IsZero() && (!heard || reg.After(last)) {
		last, heard = reg, true
	}
	return heard && now.Sub(last) <= leaseOf(w.LeaseMs)
}

// regSeen is a registration stamp (unix ns of the proposing leader's
// clock) and when this leader first saw it, by its own clock.
type regSeen struct {
	ns int64
	at time.Time
}

// registrationSeen returns when this term first saw worker id's
// registration stamped reg (registeredAt), noting now for a stamp it had
// not seen; the zero time for none. The leases order a registration by
// that sighting, a reading of this leader's clock as their heartbeats
// and sightings are, and not by its stamp: a wall time, which compared
// with those readings (by wall time, Go dropping their monotonic reading
// in the comparison) a wall-clock step moves. Stepped back (an NTP
// correction), a registration made after the sweep that found its worker
// silent read as older than the worker's last sighting, and the worker
// was removed right after it registered again. A registration is seen at
// the first sweep after it, or by a removal that waits for the lock: a
// lease runs at most a sweep longer than from the registration itself.
// l.mu is held.
func (in *Ingester) registrationSeen(id uint64, reg, now time.Time) time.Time {
	if reg.IsZero() || in.leases.regs == nil {
		return time.Time{}
	}
	ns := reg.UnixNano()
	if r, ok := in.leases.regs[id]; ok && r.ns == ns {
		return r.at
	}
	in.leases.regs[id] = regSeen{ns: ns, at: now}
	return now
}

// registrationClock is what a Target may also do (a raftfsm.Node does):
// say when a worker last registered (unix ns of the proposing leader's
// clock; 0: not known). A Target without it has leases renewed by
// heartbeats only.
type registrationClock interface {
	RegisteredAt(id uint64) int64
}

var _ registrationClock = (*raftfsm.Node)(nil)

// registeredAt returns when worker id last registered, or the zero time
// when not known or stamped after bound: a leader before this one, its
// clock ahead, proposed it, and it counts only once this clock reaches it
// (else that leader's skew would keep a silent worker as long).
func (in *Ingester) registeredAt(id uint64, bound time.Time) time.Time {
	c, ok := in.cfg.Node.(registrationClock)
	if !ok {
		return time.Time{}
	}
	ns := c.RegisteredAt(id)
	if ns == 0 {
		return time.Time{}
	}
	if t := time.Unix(0, ns); !t.After(bound) {
		return t
	}
	return time.Time{}
}

// deregister removes worker id through Raft, under the node's worker-table
// lock when it has one (raftfsm.Node.WorkersMutex), which registrations
// through the node take too: a compatible API's read-modify-write must
// not bring the worker back. keep, called under that lock with the table
// read under it, may leave the worker alone (kept): it registered again,
// or its lease was renewed, while the removal waited for the lock.
// removed is true when the worker is gone (ErrUnknownWorker included: a
// caller that removes a worker of the table tells the two apart). ranks
// is how many of the worker's ranks' state the entry removed, or -1 when
// the Target does not say (workerRankRemover).
func (in *Ingester) deregister(id uint64, keep func(table map[uint64]raftfsm.WorkerInfo) bool) (removed bool, ranks int, kept bool, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), in.cfg.CommitTimeout)
	defer cancel()
	unlock := raftfsm.LockWorkers(in.cfg.Node)
	defer unlock()
	if keep(in.cfg.Node.WorkerTable()) {
		return false, 0, true, nil
	}
	if rm, ok := in.cfg.Node.(workerRankRemover); ok {
		ranks, err = rm.DeregisterWorkerRanks(ctx, id)
	} else {
		ranks, err = -1, in.cfg.Node.DeregisterWorker(ctx, id)
	}
	return err == nil || errors.Is(err, raftfsm.ErrUnknownWorker), ranks, false, err
}

// workerRankRemover is what a Target may also do (a raftfsm.Node does):
// deregister a worker through Raft, returning how many of its ranks'
// state the entry removed, with ErrUnknownWorker too (another removal of
// the id may have committed first and taken them). A Target without it
// has a removal of an unregistered worker count the ranks the sweep
// listed.
type workerRankRemover interface {
	DeregisterWorkerRanks(ctx context.Context, id uint64) (int, error)
}

var _ workerRankRemover = (*raftfsm.Node)(nil)
