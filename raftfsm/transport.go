package raftfsm

import (
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// NewTransport returns the TCP transport a node's Raft runs on: it listens
// on bind, tells peers advertise (nil: bind), pools 4 connections per peer
// and gives up on an RPC after timeout.
//
// Replication is not pipelined (MaxRPCsInFlight 1: one AppendEntries in
// flight per follower, each sent when the previous one is answered). Raft
// v1.8.0's pipeline can deadlock: when a follower refuses an entry (a
// stale term, a log that does not match), the pipeline's decoder
// stops reading answers while the sender may still queue one more
// request; the two wait on each other for good, the follower gets no
// further entry (heartbeats still flow, so no election heals it), and
// Raft's shutdown waits for the stuck sender for ever. It hung a test on
// CI after a leadership transfer. HashiCorp's own measurements found the
// pipeline of little use, and harmful with batched entries, which is how
// this cluster replicates events.
func NewTransport(bind string, advertise net.Addr, timeout time.Duration, logger *slog.Logger) (*raft.NetworkTransport, error) {
	return raft.NewTCPTransportWithConfig(bind, advertise, &raft.NetworkTransportConfig{
		MaxPool:         4,
		Timeout:         timeout,
		MaxRPCsInFlight: 1,
		Logger:          hclogAdapter(logger),
	})
}

// commitWatch passes a transport's RPCs on to Raft and notes the first
// commit index a leader sends this node (in an AppendEntries request).
//
// A follower's own commit index is no measure of being caught up: Raft
// sets it to the leader's commit index capped at the follower's last log
// index, so a follower that restarted far behind, applying the entries
// of each batch as it arrives, has applied "everything committed" between
// batches while it lacks most of the cluster's state. The leader's commit
// index as first heard after the start is a point the node must reach
// before it is ready (checkReady). The leader sends it at least every
// CommitTimeout, entries or not.
type commitWatch struct {
	raft.Transport
	out    chan raft.RPC
	stop   chan struct{}
	done   chan struct{}
	first  atomic.Uint64 // the first leader commit index heard; 0: none yet
	closed sync.Once
}

// watchCommits wraps t; close stops its goroutine. The wrapper is a
// raft.WithPreVote when t is.
func watchCommits(t raft.Transport) (raft.Transport, *commitWatch) {
	w := &commitWatch{Transport: t, out: make(chan raft.RPC), stop: make(chan struct{}), done: make(chan struct{})}
	go w.run(t.Consumer())
	if pv, ok := t.(raft.WithPreVote); ok {
		return &commitWatchPreVote{commitWatch: w, pv: pv}, w
	}
	return w, w
}

func (w *commitWatch) run(in <-chan raft.RPC) {
	defer close(w.done)
	for {
		select {
		case rpc := <-in:
			if ae, ok := rpc.Command.(*raft.AppendEntriesRequest); ok && ae.LeaderCommitIndex > 0 {
				w.first.CompareAndSwap(0, ae.LeaderCommitIndex)
			}
			select {
			case w.out <- rpc:
			case <-w.stop:
				return
			}
		case <-w.stop:
			return
		}
	}
}

// Consumer implements raft.Transport: the RPCs, after the watch.
func (w *commitWatch) Consumer() <-chan raft.RPC { return w.out }

// Close implements raft.WithClose: Raft's shutdown closes the transport
// it was given, as it did before the watch.
func (w *commitWatch) Close() error {
	if c, ok := w.Transport.(raft.WithClose); ok {
		return c.Close()
	}
	return nil
}

// leaderCommit returns the first commit index a leader sent, 0 before one.
func (w *commitWatch) leaderCommit() uint64 { return w.first.Load() }

// close stops the watch's goroutine (once Raft no longer reads RPCs).
func (w *commitWatch) close() {
	w.closed.Do(func() { close(w.stop) })
	<-w.done
}

type commitWatchPreVote struct {
	*commitWatch
	pv raft.WithPreVote
}

// RequestPreVote implements raft.WithPreVote.
func (w *commitWatchPreVote) RequestPreVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestPreVoteRequest, resp *raft.RequestPreVoteResponse) error {
	return w.pv.RequestPreVote(id, target, args, resp)
}
