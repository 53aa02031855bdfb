package testwatch

import "go.uber.org/goleak"

// NodeIgnores are the goroutines that outlive a closed node by design,
// for goleak in the packages whose tests run nodes (raftfsm.Node, its
// Pebble databases and Raft transport) in-process:
// goleak.VerifyTestMain(m, testwatch.NodeIgnores()...).
func NodeIgnores() []goleak.Option {
	return []goleak.Option{
		// raftfsm.Node.await's waiter on a future Raft dropped at shutdown.
		goleak.IgnoreAnyFunction("github.com/kvrouter/kvrouter/raftfsm.awaitFuture"),
		// Pebble's background goroutines that outlive a closed DB.
		goleak.IgnoreTopFunction("github.com/cockroachdb/pebble/v2/internal/cache.(*shard).releaseLoop"),
		goleak.IgnoreAnyFunction("github.com/cockroachdb/pebble/v2.(*tableCacheShard).releaseLoop"),
		// raft's NetworkTransport does not track the connections it
		// accepted: Close stops the listener, and each handleConn goroutine
		// ends only when its peer closes the connection, which can be just
		// after the last test returns.
		goleak.IgnoreAnyFunction("github.com/hashicorp/raft.(*NetworkTransport).handleConn"),
	}
}
