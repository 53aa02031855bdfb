package eventplane

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// Only the leader ingests the agents' events, answers their heartbeats and
// runs the lease sweep (Ingester). A leader whose NATS connection is down
// (an external NATS it cannot reach, its credentials refused) keeps
// leading, since Raft knows nothing of NATS: the whole fleet's events wait
// in the agents' replay buffers, and the index stands still, while the
// other nodes could ingest them. The Handover moves the leadership off
// such a node:
//
//   - It acts only while this node leads and its connection has stayed
//     down for After without a break: a connection that comes back in
//     time (nats.go reconnects every 2 s) costs no election.
//   - It hands over only to a voter that answers, within Timeout, that it
//     is ready and connected to NATS (PeerConnected: its /readyz), so that
//     two nodes without NATS never pass the leadership back and forth, and
//     a cluster whose NATS is down for every node keeps its leader.
//   - Having tried (handed over, or found no voter to take it), it waits
//     After again before it tries again.

// HandoverTarget is what the Handover moves the leadership of: a
// raftfsm.Node.
type HandoverTarget interface {
	// IsLeader reports whether this node leads now.
	IsLeader() bool
	// Members lists the cluster's members, each with its HTTP address
	// and whether it is a voter and the leader.
	Members(ctx context.Context) ([]raftfsm.Member, error)
	// TransferLeadership hands the leadership to the voter toID and
	// returns once it took it, or with an error (this node still leads,
	// or the outcome is unknown).
	TransferLeadership(ctx context.Context, toID string) error
}

// HandoverConfig configures a Handover.
type HandoverConfig struct {
	Node HandoverTarget
	// Connected reports whether this node's NATS connection is up
	// (nats.Conn.IsConnected).
	Connected func() bool
	// PeerConnected asks member m whether it is ready and connected to
	// NATS (kvrouter asks its /readyz). An error counts as no.
	PeerConnected func(ctx context.Context, m raftfsm.Member) (bool, error)
	// After is how long the connection must stay down while this node
	// leads before it hands over, and the wait between two tries
	// (default 10s).
	After time.Duration
	// Timeout bounds each question to a member and the transfer
	// (default 2s).
	Timeout time.Duration
	// PollInterval is how often the connection and the leadership are
	// checked (default 100ms).
	PollInterval time.Duration
	Registerer   prometheus.Registerer
	Logger       *slog.Logger
}

func (c *HandoverConfig) defaults() {
	if c.After <= 0 {
		c.After = 10 * time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = 2 * time.Second
	}
	if c.PollInterval <= 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Outcomes of a handover try, the label of kvrouter_nats_handovers_total.
const (
	handoverTransferred = "transferred"  // a connected voter took the leadership
	handoverNoCandidate = "no_candidate" // no other voter answered ready and connected
	handoverFailed      = "failed"       // the members could not be listed, or the transfer failed; this node may still lead
)

// A Handover watches this node's NATS connection while it leads and hands
// the leadership to a voter connected to NATS when the connection stays
// down (see above).
type Handover struct {
	cfg   HandoverConfig
	tries *prometheus.CounterVec // outcome

	stop      chan struct{}
	closeOnce sync.Once
	ctx       context.Context // canceled by Close: ends a try in progress
	cancel    context.CancelFunc
	done      chan struct{}

	// Owned by the loop (run): downSince is when this node, leading,
	// found its connection down after finding it up or not leading (zero
	// while up or not leading); nextTry is when a try is due.
	downSince, nextTry time.Time
}

// NewHandover starts a Handover.
func NewHandover(cfg HandoverConfig) (*Handover, error) {
	h, err := newHandover(cfg)
	if err != nil {
		return nil, err
	}
	go h.run()
	return h, nil
}

// newHandover returns a Handover with its loop not started.
func newHandover(cfg HandoverConfig) (*Handover, error) {
	if cfg.Node == nil || cfg.Connected == nil || cfg.PeerConnected == nil {
		return nil, errors.New("eventplane: a handover needs a node, its NATS connection's state and a way to ask the other members")
	}
	cfg.defaults()
	h := &Handover{cfg: cfg, stop: make(chan struct{}), done: make(chan struct{}),
		tries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_nats_handovers_total",
			Help: "Tries of the leader, its NATS connection down for --nats-handover-after, to hand the leadership to a voter connected to NATS, by outcome (transferred; no_candidate: no other voter answered ready and connected, so it kept leading; failed: the members could not be listed, or the transfer failed)."},
			[]string{"outcome"})}
	if cfg.Registerer != nil {
		h.tries = register(cfg.Registerer, cfg.Logger, h.tries)
	}
	h.ctx, h.cancel = context.WithCancel(context.Background())
	return h, nil
}

// Close stops the Handover, ending a try in progress, and returns once it
// stopped. It may be called more than once.
func (h *Handover) Close() error {
	h.closeOnce.Do(func() {
		close(h.stop)
		h.cancel()
	})
	<-h.done
	return nil
}

func (h *Handover) run() {
	defer close(h.done)
	t := time.NewTicker(h.cfg.PollInterval)
	defer t.Stop()
	for {
		if down, ok := h.due(time.Now()); ok {
			h.try(down)
			h.tried(time.Now())
		}
		select {
		case <-h.stop:
			return
		case <-t.C:
		}
	}
}

// due reports, at now, whether a try is due, and for how long the
// connection has been down while this node led.
func (h *Handover) due(now time.Time) (time.Duration, bool) {
	switch {
	case !h.cfg.Node.IsLeader() || h.cfg.Connected():
		h.downSince, h.nextTry = time.Time{}, time.Time{}
	case h.downSince.IsZero():
		h.downSince, h.nextTry = now, now.Add(h.cfg.After)
	case !now.Before(h.nextTry):
		return now.Sub(h.downSince), true
	}
	return 0, false
}

// tried notes a try that ended at now: the next waits After.
func (h *Handover) tried(now time.Time) { h.nextTry = now.Add(h.cfg.After) }

// try asks the other voters whether they are connected and hands the
// leadership to the first that is, in member id order. It returns the
// outcome (for tests): "" for a try that Close ended, whose questions
// failed for that, not for the members, and which counts and logs
// nothing.
func (h *Handover) try(down time.Duration) string {
	log := h.cfg.Logger.With("nats_down_for", down.Round(time.Millisecond).String())
	ctx, cancel := context.WithTimeout(h.ctx, h.cfg.Timeout)
	members, err := h.cfg.Node.Members(ctx)
	cancel()
	if h.ctx.Err() != nil {
		return ""
	}
	if err != nil {
		h.tries.WithLabelValues(handoverFailed).Inc()
		log.Warn("no NATS connection: cannot list the members to hand the leadership to", "err", err)
		return handoverFailed
	}
	members = slices.DeleteFunc(slices.Clone(members), func(m raftfsm.Member) bool {
		return !m.Voter || m.Leader || m.HTTPAddr == ""
	})
	slices.SortFunc(members, func(a, b raftfsm.Member) int { return strings.Compare(a.ID, b.ID) })
	var asked []string
	for _, m := range members {
		ctx, cancel := context.WithTimeout(h.ctx, h.cfg.Timeout)
		ok, err := h.cfg.PeerConnected(ctx, m)
		cancel()
		if h.ctx.Err() != nil {
			return ""
		}
		switch {
		case err != nil:
			asked = append(asked, m.ID+": "+err.Error())
			continue
		case !ok:
			asked = append(asked, m.ID+": not ready or not connected")
			continue
		}
		// The connection may have come back, or the leadership gone,
		// while the others were asked.
		if h.cfg.Connected() || !h.cfg.Node.IsLeader() {
			return ""
		}
		ctx, cancel = context.WithTimeout(h.ctx, h.cfg.Timeout)
		err = h.cfg.Node.TransferLeadership(ctx, m.ID)
		cancel()
		if err != nil && h.ctx.Err() != nil && h.cfg.Node.IsLeader() {
			return "" // Close ended the transfer
		}
		if err != nil && !h.cfg.Node.IsLeader() {
			// A transfer whose answer did not come in time (its context
			// ended, the TimeoutNow's answer was lost) may still have
			// taken: this node no longer leads.
			h.tries.WithLabelValues(handoverTransferred).Inc()
			log.Warn("no NATS connection: handed the leadership over (the transfer's own answer was an error)", "to", m.ID, "err", err)
			return handoverTransferred
		}
		if err != nil {
			h.tries.WithLabelValues(handoverFailed).Inc()
			log.Warn("no NATS connection: handing the leadership over failed; trying again later", "to", m.ID, "err", err)
			return handoverFailed
		}
		h.tries.WithLabelValues(handoverTransferred).Inc()
		log.Warn("no NATS connection: handed the leadership to a node connected to NATS, which ingests the agents' events", "to", m.ID)
		return handoverTransferred
	}
	h.tries.WithLabelValues(handoverNoCandidate).Inc()
	log.Warn("no NATS connection, and no other voter is ready and connected to NATS: keeping the leadership (no agent's events are ingested until a connection is back)",
		"members", strings.Join(asked, "; "))
	return handoverNoCandidate
}
