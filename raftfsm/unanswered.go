package raftfsm

import (
	"context"
	"errors"
	"io"
	"net"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/lograte"
)

// A leader holds back from Raft the failure of a send to a follower that
// does not answer, in its transport (commitWatch.AppendEntries), until
// the follower is back.
//
// hashicorp/raft v1.8.0 backs off a follower's replication after every
// failed AppendEntries: 10 ms, doubled from the third failure on, to
// 10.24 s from the twelfth, and only a success brings it back to
// nothing. A follower down 10 s (a kill -9 and a restart, an upgrade)
// ran the count to 11, and once it was back it waited up to 5 s for its
// next entry; down 20 s or more, up to 10.24 s, on top of its own start.
// That wait is the restarted node's time to ready (it must hold the
// leader's commit index: checkReady), and the cluster's time without its
// spare node: a second one lost meanwhile is a lost quorum.
//
// So an AppendEntries that is not a heartbeat and fails for want of an
// answer (unanswered: the dial refused, the connection lost, a timeout)
// is returned to Raft only once the follower may take the next one: its
// address takes a TCP connection again (takesConnections, every
// holdPoll), or it answered an RPC sent after the failure (a heartbeat,
// which Raft goes on sending from its own goroutine; an answer counts
// when it names the follower: commitWatch.answeredBy). Or once the wait
// is moot: the node no longer leads in the request's term, the follower
// left the configuration, the node closes (keepSending). Raft counts one
// failure per outage, waits its first backoff step (10 ms), and builds a
// new request. An InstallSnapshot whose dial failed is held the same
// way. A follower whose process hangs (its kernel takes connections) is
// released at once, and Raft backs off from it as it did.
//
// The request is not sent again: it is as old as the outage, and a
// follower of hashicorp/raft commits up to the leader commit index a
// request carries, capped at its own last index, not at the request's
// last entry (Raft's rule): an old request whose commit index was
// brought up to date committed a restarted follower's stale entries past
// its end, uncommitted entries of a deposed leader, and its state
// diverged (TestIngestIsLinearizable caught it). Sent unchanged, its
// commit index is the one of the outage's start, which a restarted
// follower would take for the point it must reach to be ready
// (commitWatch.first). Raft's new request has neither flaw.
//
// Holding the replication goroutine is safe: Raft waits for it at its
// shutdown, when it stops replicating to a follower, and when it steps
// down, each of which ends the hold within holdPoll (and a probe, which
// the node's close cuts); and a leadership transfer hands it a request
// through a channel of one, which a second transfer blocks on while the
// first's is unread, the leader refusing writes meanwhile: no send is
// held while a transfer of the node's runs (Node.leadershipTransfer), and
// a transfer's start ends the hold of every request sent before it
// (kicked), which a transfer shorter than a probe or than the request's
// own dial would otherwise pass unseen.
// Nothing else of the leader waits for it. A held InstallSnapshot keeps
// the leader's snapshot open (its disk space, were it reaped) until the
// hold ends.
const (
	// holdPoll is how often a hold checks whether it is to end.
	holdPoll = 50 * time.Millisecond

	// holdLogEvery is how often the line about a follower that does not
	// answer is logged at most, per follower.
	holdLogEvery = time.Minute
)

// probeTimeout bounds a dial of the follower's address (a host that
// drops SYNs), and so how long a hold may outlast its end but for the
// node's close, which ends the dial (a variable for the tests).
var probeTimeout = time.Second

// unanswered reports whether err is a failure to reach the peer, or to
// get its answer (a connection refused, reset or closed, a timeout), as
// opposed to an answer that is an error or cannot be read. A read's
// failure comes from hashicorp/go-msgpack's decoder, whose error gives
// its cause through Cause, not Unwrap (v2.1.5): followed too.
func unanswered(err error) bool {
	for range 8 { // a cause's chain is short; a cycle ends here
		var ne net.Error
		if errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return true
		}
		var c interface{ Cause() error }
		if !errors.As(err, &c) {
			return false
		}
		if err = c.Cause(); err == nil {
			return false
		}
	}
	return false
}

// dialFailed reports whether err is the failure of a dial: nothing was
// sent.
func dialFailed(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// isHeartbeat reports whether args is a Raft heartbeat: hashicorp/raft
// v1.8.0 sets only its term, leader and header (Raft.heartbeat), where
// replication always names the previous entry or the commit index
// (setupAppendEntries), but for a leader of an empty log.
func isHeartbeat(args *raft.AppendEntriesRequest) bool {
	return len(args.Entries) == 0 && args.PrevLogEntry == 0 && args.LeaderCommitIndex == 0
}

// setKeepSending gives the watch the node's test that a request of term
// to follower id is still to be sent (it leads in term, id is a member),
// and the node's stop, closed when it begins to close (it ends a probe
// under way): until it is called no failure is held.
func (w *commitWatch) setKeepSending(keep func(id raft.ServerID, term uint64) bool, stop <-chan struct{}) {
	w.halt = stop
	w.keep.Store(&keep)
}

// answeredSince reports whether follower id answered an RPC after t, as
// itself (the contact commitWatch notes of every answer: answeredBy).
func (w *commitWatch) answeredSince(id raft.ServerID, t time.Time) bool {
	return w.contact(id).at.After(t)
}

// holdUnanswered returns err, the failure of a request of term to
// follower id at target (what names the RPC in the log) to be answered,
// once the follower has answered an RPC sent after it or target takes a
// connection, or keepSending ends for term, or a transfer started since
// the request was sent (kick), or the node closes.
//
// kick is w.kicked() as the request was sent: a transfer started since
// (kicked closed it) ends the hold. Taken at the hold's start instead, a
// transfer that started and ended during the request (a dial to a host
// that drops SYNs lasts the transport's timeout) went unseen, and its
// next one's send blocked on the request it left.
func (w *commitWatch) holdUnanswered(id raft.ServerID, target raft.ServerAddress, term uint64, what string, err error, kick <-chan struct{}) error {
	keep := w.keep.Load()
	if keep == nil {
		return err
	}
	failed := time.Now()
	w.holds.Add(1)
	w.holding.Add(1)
	defer w.holding.Add(-1)
	if ok, skipped := w.holdRate.Allow(string(id)); ok {
		w.logger.Warn("a follower does not answer: its replication waits until it answers or its raft address takes connections again, while this node leads and it is a member",
			append([]any{"peer", id, "raft_addr", target, "rpc", what, "error", err}, lograte.LeftOut(skipped, holdLogEvery)...)...)
	}
	// A probe of a host that drops SYNs waits probeTimeout: the node's
	// close ends it at once (Raft's shutdown waits for this goroutine).
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-ctx.Done():
		case <-w.halt:
			cancel()
		case <-kick:
			cancel()
		}
	}()
	t := time.NewTicker(holdPoll)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-w.stop:
			return err
		case <-kick:
		}
		select {
		case <-kick:
			// A transfer started since the hold began, running or
			// over: Raft may have left its request in the channel of
			// one, which the next transfer's send blocks on.
			w.logger.Debug("stopped waiting for a follower: a leadership transfer started", "peer", id, "rpc", what, "error", err)
			return err
		default:
		}
		if !(*keep)(id, term) {
			w.logger.Debug("stopped waiting for a follower: this node no longer leads in the request's term, or it left",
				"peer", id, "rpc", what, "error", err)
			return err
		}
		msg := "a follower answers again"
		answered := w.answeredSince(id, failed)
		if !answered && takesConnections(ctx, target) {
			answered, msg = true, "a follower's raft address takes connections again"
		}
		if answered {
			if ok, skipped := w.holdRate.Allow(string(id) + "\x00back"); ok {
				w.logger.Info(msg, append([]any{"peer", id, "raft_addr", target,
					"after", time.Since(failed).Round(time.Millisecond)}, lograte.LeftOut(skipped, holdLogEvery)...)...)
			}
			return err
		}
	}
}

// takesConnections reports whether target accepts a TCP connection now,
// within probeTimeout (or ctx); the connection is closed at once (the
// follower's transport reads its end and closes it, logging nothing).
func takesConnections(ctx context.Context, target raft.ServerAddress) bool {
	c, err := (&net.Dialer{Timeout: probeTimeout}).DialContext(ctx, "tcp", string(target))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

// kicked returns the channel the next transfer's start closes. It reads
// an atomic: every AppendEntries reads it.
func (w *commitWatch) kicked() <-chan struct{} {
	if p := w.kick.Load(); p != nil {
		return *p
	}
	c := make(chan struct{})
	if w.kick.CompareAndSwap(nil, &c) {
		return c
	}
	return *w.kick.Load()
}

// transferStarting ends every hold of a request sent before it, its
// probe cut: a leadership transfer of the node starts
// (Node.leadershipTransfer). A transfer shorter than a probe (an
// election timeout of 200 ms, a probe of up to probeTimeout to a host
// that drops SYNs), or than the request's own dial, went unseen by
// keepSending, and Raft's request it left in the replication goroutine's
// channel blocked the next transfer's send, the leader refusing writes
// until the follower was back.
func (w *commitWatch) transferStarting() {
	c := make(chan struct{})
	if old := w.kick.Swap(&c); old != nil {
		close(*old)
	}
}
