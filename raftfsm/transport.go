package raftfsm

import (
	"log/slog"
	"net"
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
