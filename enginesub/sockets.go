package enginesub

import (
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvrouter/kvrouter/internal/limits"
)

// socketsPerSubscriber is the most sockets one Subscriber holds at once:
// its SUB socket and one replay DEALER (a replay's, or the one Run's
// endpoint check opens before the SUB socket).
const socketsPerSubscriber = 2

// MaxSockets is the libzmq socket limit (ZMQ_MAX_SOCKETS) of the context
// every Subscriber's sockets come from: ZMQ_SOCKET_LIMIT, 65,535, the most
// libzmq's documentation says zmq_ctx_set takes, room for 32,767
// subscribers (socketsPerSubscriber each), seven workers of
// limits.MaxDPRanks ranks and more. libzmq's default, 1023 in all, stopped
// kvagent --dp-size 4096 (and the router's agentless mode) past its 1023rd
// rank with a bare "too many open files". A socket slot costs libzmq a
// pointer and an index until it is used, under 1 MB for them all; what
// bounds the subscribers in practice is the open files limit (OpenFiles).
const MaxSockets = 65535

// Every worker kvagent (or the router) takes has room.
var _ [MaxSockets - socketsPerSubscriber*limits.MaxDPRanks]struct{}

// filesPerSubscriber is the most file descriptors one Subscriber holds at
// once: each of its sockets' mailbox (an eventfd) and TCP connection.
const filesPerSubscriber = 2 * socketsPerSubscriber

// baseFiles covers what a process opens besides its subscribers: libzmq's
// I/O and reaper threads, Go's runtime, listeners, Pebble's files, logs.
const baseFiles = 256

// zctx is the context of every socket here. Its own, not libzmq's default:
// ZMQ_MAX_SOCKETS takes effect only if set before the context's first
// socket (libzmq sizes its socket slots then and ignores later settings),
// and any other user of the default context in the process (a test's PUB
// socket) could come first.
var zctx = sync.OnceValues(func() (*zmq.Context, error) {
	ctx, err := zmq.NewContext()
	if err != nil {
		return nil, fmt.Errorf("enginesub: new libzmq context: %w", err)
	}
	if err := ctx.SetMaxSockets(MaxSockets); err != nil {
		return nil, fmt.Errorf("enginesub: set the libzmq socket limit to %d: %w", MaxSockets, err)
	}
	return ctx, nil
})

// openSockets counts the sockets newSocket made that are not closed yet,
// to tell which limit a refused socket met.
var openSockets atomic.Int64

// A socket is a libzmq socket that newSocket counted.
type socket struct {
	*zmq.Socket
	closed bool
}

// Close closes the socket, once.
func (s *socket) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	openSockets.Add(-1)
	return s.Socket.Close()
}

// newSocket makes a socket on zctx. A refusal for want of room says which
// limit was met instead of libzmq's bare "too many open files" (EMFILE,
// its answer for both).
func newSocket(typ zmq.Type) (*socket, error) {
	ctx, err := zctx()
	if err != nil {
		return nil, err
	}
	s, err := ctx.NewSocket(typ)
	if err != nil {
		if zmq.AsErrno(err) == zmq.Errno(syscall.EMFILE) {
			return nil, limitError(err, int(openSockets.Load()))
		}
		return nil, err
	}
	openSockets.Add(1)
	return &socket{Socket: s}, nil
}

// limitError names the limit a socket refused with EMFILE met, open
// sockets being open already.
func limitError(err error, open int) error {
	if open >= MaxSockets {
		return fmt.Errorf("%w: the libzmq socket limit of %d is reached (%d open)", err, MaxSockets, open)
	}
	var lim syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
		return fmt.Errorf("%w: the open files limit %d is reached (%d sockets open; raise it: ulimit -n, systemd's LimitNOFILE)", err, lim.Cur, open)
	}
	return fmt.Errorf("%w: the open files limit is reached (%d sockets open)", err, open)
}

// OpenFiles returns nil when the process's open files limit (RLIMIT_NOFILE,
// whose soft limit Go raises to the hard one at its start on Linux) covers
// subscribers Subscribers at their most, and an ErrOpenFiles saying what
// is needed otherwise.
func OpenFiles(subscribers int) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return nil // nothing to go on: the sockets' own errors say it
	}
	need := uint64(subscribers)*filesPerSubscriber + baseFiles
	if lim.Cur < need {
		return fmt.Errorf("%w: the open files limit %d is below the %d that %d subscribers may need (raise it: ulimit -n, systemd's LimitNOFILE)",
			ErrOpenFiles, lim.Cur, need, subscribers)
	}
	return nil
}
