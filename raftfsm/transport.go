package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/lograte"
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
//
// Its Close closes every connection it dialed or accepted, in use or
// not, with its listener, and ends its dials under way (streamLayer):
// Node.Close uses that to end a Raft shutdown that waits on a hung peer.
//
// A peer that sent part of a request and then nothing for
// stallTimeouts times timeout loses its connection (streamConn.Read), and
// so does one that connected and sent nothing at all for as long. The
// connections it accepts are capped, per remote host and in all
// (maxInboundPerHost, maxInbound): one over a cap is closed at once.
//
// Its connections open with a greeting that names the node's cluster
// (greeting.go): its dials, and its answers to the greetings of the
// connections it accepts, wait until a Node is given the transport
// (Config.Transport) and says which cluster it is of.
func NewTransport(bind string, advertise net.Addr, timeout time.Duration, logger *slog.Logger) (*raft.NetworkTransport, error) {
	t, s, err := newTransport(bind, advertise, timeout, logger)
	if err != nil {
		return nil, err
	}
	s.owner = t.LocalAddr()
	layers.Store(s.owner, s)
	return t, nil
}

// layers maps the address of each transport NewTransport returned, until
// it closes, to its stream layer: a Node given one (Config.Transport), or
// a wrapper of one (the tests'), sets the layer's identity and counts its
// connections. One listener holds an address at a time.
var layers sync.Map // raft.ServerAddress → *streamLayer

// newTransport is NewTransport that also returns its stream layer, whose
// counts of the inbound connections it closed the node exports
// (Collector).
func newTransport(bind string, advertise net.Addr, timeout time.Duration, logger *slog.Logger) (*raft.NetworkTransport, *streamLayer, error) {
	ln, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, nil, err
	}
	s := newStreamLayer(ln, advertise)
	s.stall = stallTimeouts * timeout
	s.logger = logger.With("component", "raft-transport")
	// The checks hashicorp's TCP transport makes of the address it
	// advertises: peers dial it.
	addr, ok := s.Addr().(*net.TCPAddr)
	if !ok {
		ln.Close()
		return nil, nil, fmt.Errorf("raft transport: %v is not a TCP address", s.Addr())
	}
	if addr.IP == nil || addr.IP.IsUnspecified() {
		ln.Close()
		return nil, nil, fmt.Errorf("raft transport: %v is not an address peers can dial", addr)
	}
	return raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream:          s,
		MaxPool:         4,
		Timeout:         timeout,
		MaxRPCsInFlight: 1,
		Logger:          hclogAdapter(logger),
	}), s, nil
}

// streamLayer is hashicorp/raft's TCP stream layer (TCPStreamLayer) that
// also keeps the connections it dialed and accepted, and closes them all
// when it closes (the transport's Close), and every one it gets after.
//
// raft v1.8.0's NetworkTransport.Close closes only the listener, and
// CloseStreams only the pooled outbound connections that are idle. A
// connection in use stays open: a follower's Raft reading a snapshot
// from a leader that hung part-way waited on it for ever (now for the
// stall, below, at most), and a leader sending its snapshot to a hung follower
// waited for the send's deadline, the transport's timeout for every
// 256 KiB of it (tens of minutes for a state of tens of MB). Raft's
// shutdown waits for those goroutines, so Node.Close did too. Closed
// under them, their reads and writes fail and the goroutines end.
//
// A dial under way when it closes ends too (ctx): to a peer that drops
// SYNs (a host gone, a partition), it ran to the transport's timeout,
// and Raft's shutdown, waiting for the goroutine that dialed (a vote, a
// heartbeat), kept Node.Close that long past its grace.
//
// And a connection it accepted fails a request that stalls part-way
// (stall; see streamConn.Read): raft v1.8.0 reads an InstallSnapshot's
// data in its main goroutine, with no deadline, so a follower taking a
// snapshot from a leader that hung part-way (SIGSTOP, a paused VM: its
// kernel still acknowledges, so no keepalive ends the connection)
// answered nothing else, a vote included, for as long as the leader
// stayed hung, and a 3-node cluster so left had no leader at all.
//
// It also bounds what a stranger that reaches the port can hold. raft
// v1.8.0 gives every accepted connection a goroutine and a 256 KiB read
// buffer before it reads a byte, and reads with no deadline, so a client
// that connected and sent nothing (a port scanner, a client that waits, a
// slowloris) held all three for as long as it liked, a thousand of them
// 250 MiB. A connection that sends nothing within stall of its accept is
// closed (streamConn.Read), and the connections held at once are capped
// per remote host and in all (Accept).
type streamLayer struct {
	ln        net.Listener
	advertise net.Addr
	stall     time.Duration   // how long an accepted connection may send nothing part-way through a request; 0: for ever
	ctx       context.Context // canceled by Close: ends the dials under way
	cancel    context.CancelFunc

	logger *slog.Logger
	rate   *lograte.Limiter // the lines about inbound connections closed (note)

	overCap atomic.Uint64 // inbound connections closed at once: over a cap
	silent  atomic.Uint64 // inbound connections closed for sending nothing within stall of their accept
	foreign atomic.Uint64 // inbound connections refused: another cluster's (greeting.go)
	plain   atomic.Uint64 // dials made again without a greeting: to a build before greetings

	// ident is what the layer greets with and checks greetings against
	// (greeting.go); identSet is closed once it is set: until then dials
	// and greetings wait (a node sets it before its Raft starts).
	ident     atomic.Pointer[identity]
	identSet  chan struct{}
	identOnce sync.Once
	owner     raft.ServerAddress // NewTransport's: dropped from layers at Close

	mu       sync.Mutex
	conns    map[*streamConn]struct{}
	inbound  map[string]int // the accepted connections held, per remote host
	inboundN int            // the accepted connections held
	closed   bool
}

// The caps on the inbound connections a stream layer holds at once
// (Accept). Each holds a goroutine, a file descriptor and raft's 256 KiB
// read buffer.
const (
	// maxInboundPerHost caps one remote host's. A peer holds at most the
	// transport's MaxPool (4) idle connections to this node, and one more
	// per RPC it has in flight past those (an AppendEntries, a heartbeat,
	// a vote, a snapshot, a TimeoutNow; no pipeline: MaxRPCsInFlight 1):
	// ten at the most. Several nodes may share a host's address (a host
	// that runs more than one, a NAT, the tests' clusters on 127.0.0.1):
	// 64 is room for six such peers at their busiest.
	maxInboundPerHost = 64
	// maxInbound caps them all: 64 MiB of read buffers at the most, and
	// more than a cluster of twenty-five members holds at its busiest.
	maxInbound = 256
)

// inboundLogEvery is how often a line about the inbound connections a
// stream layer closed (over a cap, silent) is logged at most, per kind:
// a port scan closes them at its own rate.
const inboundLogEvery = time.Minute

// newStreamLayer returns a stream layer on ln that tells peers advertise
// (nil: ln's address).
func newStreamLayer(ln net.Listener, advertise net.Addr) *streamLayer {
	ctx, cancel := context.WithCancel(context.Background())
	return &streamLayer{ln: ln, advertise: advertise, ctx: ctx, cancel: cancel,
		logger: slog.New(slog.DiscardHandler), rate: lograte.New(inboundLogEvery, nil),
		conns: map[*streamConn]struct{}{}, inbound: map[string]int{}, identSet: make(chan struct{})}
}

// setIdentity makes id what s greets with and checks greetings against,
// from now on: connections taken before keep the verdict they had.
func (s *streamLayer) setIdentity(id *identity) {
	s.ident.Store(id)
	s.identOnce.Do(func() { close(s.identSet) })
}

// identity returns what s greets with, once set; it fails once s closed.
func (s *streamLayer) identity() (*identity, error) {
	select {
	case <-s.identSet:
		return s.ident.Load(), nil
	case <-s.ctx.Done():
		return nil, fmt.Errorf("raft transport: %w", net.ErrClosed)
	}
}

// settleJoiner settles a joiner's identity, the id it took or none
// (greeting.go): the node caught up with the cluster it joined.
func (s *streamLayer) settleJoiner() {
	for {
		cur := s.ident.Load()
		if cur == nil || !cur.joiner {
			return
		}
		next := *cur
		next.provisional, next.joiner = false, false
		if s.ident.CompareAndSwap(cur, &next) {
			return
		}
	}
}

// confirm settles s's provisional id (not a joiner's): a connection
// confirmed it, or the node is its cluster's only member (greeting.go).
func (s *streamLayer) confirm() {
	for {
		cur := s.ident.Load()
		if cur == nil || !cur.provisional || cur.joiner || cur.id.IsZero() {
			return
		}
		next := *cur
		next.provisional = false
		if s.ident.CompareAndSwap(cur, &next) {
			if cur.confirmed != nil {
				cur.confirmed()
			}
			return
		}
	}
}

// Dial implements raft.StreamLayer. The connection opens with the
// greeting (greeting.go), within timeout; one that a build before
// greetings closed unanswered is dialed again without one. A refusal is
// an ErrForeignCluster. A node of no cluster id (a directory of a build
// before them) greets no one, as that build did not.
func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	id, err := s.identity()
	if err != nil {
		return nil, err
	}
	c, err := s.dial(address, timeout)
	if err != nil || id.id.IsZero() {
		return c, err
	}
	switch confirmed, err := greetDial(c, string(address), id, timeout); {
	case err == nil:
		if confirmed {
			s.confirm()
		}
		return c, nil
	case errors.Is(err, errUngreeted):
		c.Close()
		s.plain.Add(1)
		s.note("ungreeted", "a peer closed the connection without answering the greeting: a build without cluster ids; dialing it again without one",
			"raft_addr", string(address))
		return s.dial(address, timeout)
	default:
		c.Close()
		if errors.Is(err, ErrForeignCluster) {
			s.noteAt(slog.LevelError, "foreign-dial", err.Error(), "raft_addr", string(address))
		}
		return nil, err
	}
}

// dial returns a tracked connection to address.
func (s *streamLayer) dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	c, err := (&net.Dialer{Timeout: timeout}).DialContext(s.ctx, "tcp", string(address))
	if err != nil {
		return nil, err
	}
	return s.track(c)
}

// takeGreeting answers the greeting of accepted connection c, whose
// first n bytes read are in p, and returns what Read returns: the bytes
// that followed the greeting, or the read of the request that follows.
// A refused or malformed greeting fails c (io.EOF for a refusal, logged
// here: raft logs nothing for it).
func (s *streamLayer) takeGreeting(c *streamConn, p []byte, n int) (int, error) {
	fail := func(err error) (int, error) {
		c.failed.Store(&err)
		return 0, err
	}
	if _, err := s.identity(); err != nil {
		return fail(err)
	}
	g, rest, err := readGreeting(p[:n], c.Conn)
	if err != nil {
		if errors.Is(err, errBadGreeting) {
			// Answered, so that the dialer does not take the close for
			// an older build's and dial again without a greeting.
			c.Conn.Write(append([]byte{greetUnreadable, greetingVersion}, make([]byte, replyLen-2)...))
		}
		return fail(fmt.Errorf("raft transport: read the greeting of %v: %w", c.RemoteAddr(), err))
	}
	me := s.ident.Load() // as of now: another greeting may have changed it while this one was read
	take, adopt := me.verdict(g)
	for adopt {
		next := *me
		next.id, next.provisional, next.joiner = g.id, false, false
		if s.ident.CompareAndSwap(me, &next) {
			if me.adopted != nil {
				me.adopted(g.id)
			}
			me = &next
			break
		}
		// Another greeting changed the identity meanwhile: judge again.
		me = s.ident.Load()
		take, adopt = me.verdict(g)
	}
	var reply [replyLen]byte
	reply[0] = greetTaken
	if !take {
		reply[0] = greetRefused
	}
	copy(reply[1:], me.id[:])
	if _, err := c.Conn.Write(reply[:]); err != nil {
		return fail(fmt.Errorf("raft transport: answer the greeting of %v: %w", c.RemoteAddr(), err))
	}
	if take && g.id == me.id && !me.id.IsZero() {
		s.confirm()
	}
	if !take {
		s.foreign.Add(1)
		s.noteAt(slog.LevelError, "foreign-accept", "refused a Raft connection from another cluster's node: a raft address that cluster lists reaches this node "+
			"(remove it from that cluster, or fix its address there); a wiped member of this node's cluster started with --peers "+
			"that do not list its leader at its address joins again with --join",
			"remote", c.RemoteAddr().String(), "from", g.self, "from_raft_addr", g.addr, "from_cluster", g.id.String(),
			"cluster", me.id.String(), "settled", !me.provisional)
		return fail(io.EOF)
	}
	if len(rest) > 0 {
		return copy(p, rest), nil
	}
	return c.Read(p)
}

// Accept implements net.Listener. A connection over a cap
// (maxInboundPerHost, maxInbound) is closed at once, counted and noted,
// and Accept takes the next: it returns no error for it, which raft's
// accept loop would answer by waiting, up to a second, before it
// accepted again, a real peer's connection among them.
func (s *streamLayer) Accept() (net.Conn, error) {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			return nil, err
		}
		sc, err := s.accepted(c)
		if errors.Is(err, errOverCap) {
			// Answered as a greeting is (greetBusy), so that a dialer of
			// this build does not take the close for an older build's and
			// dial again without a greeting; an older build's RPC fails
			// on the byte as it would on the close.
			c.SetWriteDeadline(time.Now().Add(time.Second))
			c.Write([]byte{greetBusy})
			c.Close()
			s.note("over-cap", "closed an inbound Raft connection at once: too many held (a peer holds ten at most; a port scan or a flood holds more)",
				"remote", c.RemoteAddr().String(), "error", err)
			continue
		}
		return sc, err
	}
}

// errOverCap means an inbound connection was closed at once: its host,
// or all hosts, held as many as the stream layer takes.
var errOverCap = errors.New("raft transport: too many inbound connections")

// remoteHost returns the host of c's remote address: what
// maxInboundPerHost counts by.
func remoteHost(c net.Conn) string {
	a := c.RemoteAddr().String()
	if h, _, err := net.SplitHostPort(a); err == nil {
		return h
	}
	return a
}

// track returns c, kept until it closes; once the layer closed, it closes
// c and fails: a dial that was under way when the transport closed.
func (s *streamLayer) track(c net.Conn) (net.Conn, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, fmt.Errorf("raft transport: %w", net.ErrClosed)
	}
	sc := &streamConn{Conn: c, s: s}
	s.conns[sc] = struct{}{}
	return sc, nil
}

// accepted returns c, tracked and counted against the caps, that fails a
// request stalled for s.stall and closes when it sends nothing for
// s.stall after its accept. Over a cap it closes c and fails
// (errOverCap).
func (s *streamLayer) accepted(c net.Conn) (net.Conn, error) {
	host := remoteHost(c)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		c.Close()
		return nil, fmt.Errorf("raft transport: %w", net.ErrClosed)
	}
	if s.inbound[host] >= maxInboundPerHost || s.inboundN >= maxInbound {
		// Counted before the close (Accept's): whoever sees the close
		// sees the count.
		s.overCap.Add(1)
		return nil, fmt.Errorf("%w: %d from %s, %d in all (at most %d and %d)",
			errOverCap, s.inbound[host], host, s.inboundN, maxInboundPerHost, maxInbound)
	}
	sc := &streamConn{Conn: c, s: s, host: host, stall: s.stall}
	if sc.stall > 0 {
		// A peer sends its request as soon as its dial returns, and
		// raft's first read comes at once: the deadline runs from here.
		if err := c.SetReadDeadline(time.Now().Add(sc.stall)); err != nil {
			c.Close()
			return nil, fmt.Errorf("raft transport: %w", err)
		}
		sc.armed = true
	}
	s.conns[sc] = struct{}{}
	s.inbound[host]++
	s.inboundN++
	return sc, nil
}

// note logs a line about a connection of kind (one closed, refused or
// dialed again) at Warn, as noteAt.
func (s *streamLayer) note(kind, msg string, args ...any) {
	s.noteAt(slog.LevelWarn, kind, msg, args...)
}

// noteAt logs a line about a connection of kind at level, at most once
// per inboundLogEvery with how many were left out, every one at Debug.
func (s *streamLayer) noteAt(level slog.Level, kind, msg string, args ...any) {
	ok, skipped := s.rate.Allow(kind)
	if !ok {
		s.logger.Debug(msg, args...)
		return
	}
	s.logger.Log(context.Background(), level, msg, append(args, lograte.LeftOut(skipped, inboundLogEvery)...)...)
}

// forget drops c from the connections s holds, and from its counts.
func (s *streamLayer) forget(c *streamConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.conns[c]; !ok {
		return // closed before, or by the layer's Close
	}
	delete(s.conns, c)
	if c.host == "" {
		return // dialed
	}
	if s.inbound[c.host]--; s.inbound[c.host] <= 0 {
		delete(s.inbound, c.host)
	}
	s.inboundN--
}

// inboundClosed returns how many inbound connections s closed at once,
// over a cap, and for sending nothing within its stall of their accept.
func (s *streamLayer) inboundClosed() (overCap, silent uint64) {
	return s.overCap.Load(), s.silent.Load()
}

// Close implements net.Listener: the listener closes, every connection
// dialed or accepted, and every dial under way.
func (s *streamLayer) Close() error {
	s.cancel()
	if s.owner != "" {
		layers.CompareAndDelete(s.owner, s)
	}
	s.mu.Lock()
	s.closed = true
	conns := s.conns
	s.conns = map[*streamConn]struct{}{}
	s.inbound, s.inboundN = map[string]int{}, 0
	s.mu.Unlock()
	err := s.ln.Close()
	for c := range conns {
		c.Conn.Close()
	}
	return err
}

// Addr implements net.Listener: the address peers dial (advertise, when
// given).
func (s *streamLayer) Addr() net.Addr {
	if s.advertise != nil {
		return s.advertise
	}
	return s.ln.Addr()
}

// stallTimeouts is how many transport timeouts a peer may send nothing
// part-way through a request before its connection fails: 30 s with a
// node's 10 s. A sender gives up on any other request after one timeout,
// so only a snapshot's stream, whose sender's deadline grows with its
// size, runs longer; its sender copies a local file and stops for no
// more than the network does. A few timeouts is no longer than a
// cluster may well go without a leader.
const stallTimeouts = 3

// errStalled means a peer sent part of a request, then nothing for the
// stream layer's stall: the request is lost, and the connection with it.
var errStalled = errors.New("raft transport: the peer stopped part-way through a request")

// streamConn is a connection of a streamLayer: its Close forgets it.
//
// An accepted one (stall > 0) also bounds a request's stall. Raft's
// transport answers one request at a time on a connection: it reads a
// request, writes the answer, reads the next. So between an answer
// written and the first byte of the next request, the connection may
// wait for ever: a pooled connection its sender has no use for yet
// (a read deadline there would close connections the sender's pool
// still holds, and fail the next RPC sent on one). Once a request's
// first bytes came, each read must bring more within stall. One that
// does not fails, and every later read of the connection with it (the
// stream cannot be resynchronised part-way through a request), so Raft
// gives up on the snapshot, answers it with the error, and the
// transport closes the connection.
//
// Before its first byte an accepted connection may wait stall, from its
// accept, and no longer: a real peer dials only to send a request at
// once (hashicorp/raft v1.8.0's genericRPC and InstallSnapshot write
// theirs right after the dial; a pipeline, which dials and may then wait
// for entries, is never made: MaxRPCsInFlight 1), so a connection silent
// that long is no peer's. Its read then fails with io.EOF, which raft
// takes for a connection its client closed and logs nothing of (the
// stream layer counts and notes it): a port scan would otherwise make
// raft log an error per connection.
type streamConn struct {
	net.Conn
	s    *streamLayer
	host string // the remote host of an accepted connection (the caps); "": dialed

	stall     time.Duration // 0: reads wait for ever (a dialed connection)
	inRequest atomic.Bool   // data came since the last answer written
	started   bool          // a byte came; only the reading goroutine uses it
	armed     bool          // a read deadline is set; only the reading goroutine uses it
	greeted   bool          // an accepted one's first byte was looked at (greeting.go); only the reading goroutine uses it
	failed    atomic.Pointer[error]
}

// Read implements net.Conn: see streamConn for the stall.
// An accepted one's first bytes are a greeting (greeting.go), answered
// before raft reads what follows, or an RPC of a build before greetings.
func (c *streamConn) Read(p []byte) (int, error) {
	if err := c.failed.Load(); err != nil {
		return 0, *err
	}
	n, err := c.read(p)
	if n > 0 && c.host != "" && !c.greeted {
		c.greeted = true
		if p[0] == greetingMagic[0] {
			return c.s.takeGreeting(c, p, n)
		}
		// An RPC of a build before greetings: taken unchecked.
	}
	return n, err
}

// read reads p, bounding a request's stall (streamConn).
func (c *streamConn) read(p []byte) (int, error) {
	if c.stall <= 0 {
		return c.Conn.Read(p)
	}
	mid, started := c.inRequest.Load(), c.started
	switch {
	case mid:
		if err := c.Conn.SetReadDeadline(time.Now().Add(c.stall)); err != nil {
			return 0, err
		}
		c.armed = true
	case !started:
		// the deadline set at its accept (streamLayer.accepted) stands
	case c.armed:
		if err := c.Conn.SetReadDeadline(time.Time{}); err != nil {
			return 0, err
		}
		c.armed = false
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.inRequest.Store(true)
		c.started = true
	}
	if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
		switch {
		case mid:
			err = fmt.Errorf("%w: nothing from %v for %v: %w", errStalled, c.RemoteAddr(), c.stall, err)
			c.failed.Store(&err)
		case !started:
			c.s.silent.Add(1)
			c.s.note("silent", "closed an inbound Raft connection that sent nothing: a peer sends its request as soon as it connects (a port scan or a client that connects and waits does not)",
				"remote", c.RemoteAddr().String(), "after", c.stall)
			err = io.EOF // raft logs an error for any other (streamConn)
			c.failed.Store(&err)
		}
	}
	return n, err
}

// Write implements net.Conn: an answer ends the request it answers.
func (c *streamConn) Write(p []byte) (int, error) {
	c.inRequest.Store(false)
	return c.Conn.Write(p)
}

func (c *streamConn) Close() error {
	c.s.forget(c)
	return c.Conn.Close()
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
//
// It also keeps a node that is a cluster of its own from following
// another cluster's leader (setAlone): while the node's configuration is
// itself alone, an AppendEntries, InstallSnapshot or TimeoutNow from
// another server is refused. Such a node was bootstrapped alone (kvrouter
// without --peers or --join) and then added to another cluster (kvctl
// members add): its log's entries, or the applied index of its state,
// would pass for the cluster's, and it would serve a state of its own
// under the cluster's applied index. No RPC passes before the node has
// said whether it is alone.
//
// It refuses an RPC that names this node as its sender: this node's own,
// come back through a member's raft address that reaches it (an alias
// the add's check could not prove: NAT, a name that resolves differently
// now). Taken, a leader's own AppendEntries made it step down, win the
// next election and step down again, for good.
//
// And it notes the answers to the node's own RPCs (contacts): a leader's
// membership changes need to know which followers answer. An answer
// counts only when it comes from the server it was sent to: its header
// names that server's id (answeredBy). An answer to InstallSnapshot,
// which raft v1.8.0 sends without a header, counts for nothing
// (InstallSnapshot).
//
// And it watches for a state that cannot take the leader's log from its
// start (refusedFromStart), on both sides: a follower refuses it
// (refuseFromStart) and notes that its state is not the leader's
// (behind) until a snapshot comes, and a leader that is refused so says
// which follower (fromStart); Node compacts its log then, so that Raft
// sends that follower its snapshot (compactForFollower).
//
// And it refuses votes (RequestVote, RequestPreVote) while the node
// started on an empty directory to join has not caught up (votesHeld).
// Raft's safety rests on a voter keeping the log it acknowledged: a
// voter wiped without being removed and started again with --join comes
// back under its id with an empty log, still a voter in the leader's
// configuration, and Raft grants a vote to any candidate whose log is at
// least as long as its own, so to every one. With the leader down, its
// vote and a lagging voter's elected the lagging one, and the entries
// the wiped voter had acknowledged (committed by the leader on its
// answer) were lost. Refused until the node's log holds what the leader
// had committed when it first heard from it (holdsThrough: an
// AppendEntries or InstallSnapshot it took reaches that index; or the
// node is ready, Node.checkReady), which includes every entry it had
// acknowledged before the wipe, its vote cannot elect a leader that
// lacks them. Its log, not its state: a joiner is promoted to voter once
// its log matches the leader's, whether or not its state has applied it,
// and one that refused until ready, its leader dead for good, could
// never be ready (that needs a leader) and held a 4-voter cluster
// without one for ever. The price is availability, not state, and only
// while the node's log lacks what the leader had committed: should the
// leader die then, and the other voters need its vote for a quorum,
// there is no leader until the old leader (or another voter that holds
// the entries) returns. That is a wiped voter whose acknowledged entries
// no live voter but the dead leader holds, or a node that has heard no
// leader since its start; a joiner promoted once its log matched the
// leader's holds no vote. A joiner added as a non-voter is asked for no
// vote at all.
//
// A node that bootstrapped an empty directory from --peers holds its
// votes too: a wiped voter started again with its usual command line
// bootstraps a one-entry log. It lets through a candidate whose log ends
// at the bootstrap entry (bootIndex), so that a fresh cluster, all of
// whose nodes hold their votes, elects its first leader; a longer log
// proves a cluster ran, whose commits this node may lack.
type commitWatch struct {
	raft.Transport
	out    chan raft.RPC
	stop   chan struct{}
	done   chan struct{}
	first  atomic.Uint64 // the first leader commit index heard; 0: none yet
	closed sync.Once

	self     string                      // this node's server id
	alone    atomic.Pointer[func() bool] // whether the node's latest configuration is itself alone; nil until setAlone
	aloneSet chan struct{}               // closed by setAlone
	refused  atomic.Uint64               // RPCs refused while alone
	logger   *slog.Logger

	refusedOwn atomic.Uint64 // RPCs refused as this node's own (admit)
	strangers  atomic.Uint64 // answers not from the server asked (answeredBy)

	contactMu sync.Mutex
	contacts  map[raft.ServerID]peerContact // what this node last heard from each peer it sent an RPC
	installed map[raft.ServerID]uint64      // the index of the snapshot each peer last took from this node; under contactMu

	// fromStart gets a follower that refused this node's log from its
	// start (a leader's; refusedFromStart), or from the snapshot it has
	// just taken from this node (refusedAfterInstall). Sent without
	// waiting: one waiting is enough.
	fromStart chan raft.ServerID
	// behind is set while this node, a follower, refused its leader's
	// log from its start and took no snapshot since (refuseFromStart).
	behind  atomic.Bool
	answers sync.WaitGroup // watchAnswer's goroutines
	// held returns the last index this node's state holds (applied, or
	// in its last snapshot) and its current term; nil until setAlone.
	held func() (index, term uint64)
	// votesHeld is set while this node, started on an empty directory to
	// join (Node.joinAddr), has not yet taken the leader's log through
	// the leader commit index first heard (holdsThrough; or is ready,
	// Node.checkReady): it refuses votes meanwhile (refuseVote).
	// refusedVotes counts those.
	votesHeld    atomic.Bool
	refusedVotes atomic.Uint64
	// keep tells whether a request of a term to a follower is still to
	// be sent (holdUnanswered); nil until setKeepSending: no failure is
	// held.
	keep atomic.Pointer[func(id raft.ServerID, term uint64) bool]
	halt <-chan struct{} // the node's stop; set with keep
	// kick is closed, and replaced, when the node starts a leadership
	// transfer (transferStarting): a hold of a request sent before it
	// ends, its probe cut.
	kick     atomic.Pointer[chan struct{}]
	holdRate *lograte.Limiter // the lines about followers that do not answer, per follower
	// holds counts the failures held until the follower answered
	// (holdUnanswered); failedAppends the AppendEntries other than
	// heartbeats whose failure reached Raft (each one a step of its
	// backoff).
	holds, failedAppends atomic.Uint64
	failedHeartbeats     atomic.Uint64 // heartbeats that failed (tests)
	holding              atomic.Int64  // failures held now
	// bootIndex is the last index of the log this node bootstrapped
	// (bootstrapIndex), 0 when it did not: while votes are held, a
	// candidate whose log ends there is still granted a vote (Raft
	// decides it), the first election of a fresh cluster, whose nodes
	// all bootstrapped and hold their votes. A longer log proves a leader
	// wrote to it, so a cluster ran, whose commits this node may lack.
	bootIndex atomic.Uint64
}

// peerContact is what a node last heard from a peer in answer to its own
// RPCs (a leader's AppendEntries and heartbeats, a candidate's votes).
// Raft keeps a leader's contact with each follower to itself; membership
// changes need it to tell which voters answer (Node.answering).
type peerContact struct {
	at time.Time // the last answer to any RPC
	// matched is the index through which the peer's log is the leader's,
	// as its last answer to an AppendEntries that carried entries or a
	// previous entry proved (matchedBy); 0 after such an answer failed.
	// Heartbeats leave it: a follower answers one without looking at its
	// log, with its own last index, which may be a divergent tail or
	// another cluster's log.
	matched   uint64
	matchedAt time.Time // when an answer last proved matched
}

// watchCommits wraps t; close stops its goroutine. The wrapper is a
// raft.WithPreVote when t is.
func watchCommits(t raft.Transport, self string, logger *slog.Logger) (raft.Transport, *commitWatch) {
	w := &commitWatch{Transport: t, out: make(chan raft.RPC), stop: make(chan struct{}), done: make(chan struct{}),
		self: self, aloneSet: make(chan struct{}), logger: logger, fromStart: make(chan raft.ServerID, 1),
		holdRate: lograte.New(holdLogEvery, nil)}
	go w.run(t.Consumer())
	if pv, ok := t.(raft.WithPreVote); ok {
		return &commitWatchPreVote{commitWatch: w, pv: pv}, w
	}
	return w, w
}

func (w *commitWatch) run(in <-chan raft.RPC) {
	defer close(w.done)
	select {
	case <-w.aloneSet:
	case <-w.stop:
		return
	}
	for {
		select {
		case rpc := <-in:
			if !w.admit(rpc) {
				continue
			}
			switch c := rpc.Command.(type) {
			case *raft.AppendEntriesRequest:
				if c.LeaderCommitIndex > 0 {
					w.first.CompareAndSwap(0, c.LeaderCommitIndex)
				}
				if w.refuseFromStart(rpc, c) {
					continue
				}
				// A leader whose log matches this node's at an entry it
				// holds leads to this node's state: the refusal that set
				// behind was of a resent first batch (a joiner slower
				// than the transport's timeout), and a leader elected
				// since will never send the snapshot that would clear
				// it. A node that holds a restore no other node took
				// matches no such entry (the restore replaced its log).
				behind := c.PrevLogEntry > 0 && w.behind.Load()
				// An answer that succeeded says this node's log is the
				// leader's through the request's last entry: votes held
				// end once that holds the leader's commit (holdsThrough).
				// Heartbeats (no previous entry, no entries) prove
				// nothing; the leader sends one that does at least every
				// CommitTimeout.
				last := lastEntry(c)
				held := last > 0 && w.votesHeld.Load()
				if behind || held {
					rpc = w.watchAnswer(rpc, func(resp any) {
						ae, ok := resp.(*raft.AppendEntriesResponse)
						if !ok || !ae.Success {
							return
						}
						if behind {
							w.setBehind(false, string(c.ID))
						}
						if held {
							w.holdsThrough(last)
						}
					})
				}
			case *raft.RequestVoteRequest:
				if w.refuseVote(rpc, c.ID, c.LastLogIndex) {
					continue
				}
			case *raft.RequestPreVoteRequest:
				if w.refuseVote(rpc, c.ID, c.LastLogIndex) {
					continue
				}
			case *raft.InstallSnapshotRequest:
				if !w.behind.Load() && !w.votesHeld.Load() {
					break
				}
				rpc = w.watchAnswer(rpc, func(resp any) {
					if is, ok := resp.(*raft.InstallSnapshotResponse); ok && is.Success {
						w.setBehind(false, string(c.ID))
						w.holdsThrough(c.LastLogIndex) // the snapshot stands for the log through its index
					}
				})
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

// refusedFromStart reports whether a follower answered args, an
// AppendEntries of the leader's log from its first entry (no previous
// entry to match), with resp, a refusal at the leader's term: its state
// is not one the leader's log leads to (refuseFromStart). hashicorp/raft
// v1.8.0 retries from the start for good, and sends a snapshot only when
// its own log lacks an entry it needs: never while the leader's log
// still starts at index 1.
func refusedFromStart(args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) bool {
	return args.PrevLogEntry == 0 && len(args.Entries) > 0 && resp != nil && !resp.Success && resp.Term == args.Term
}

// refuseFromStart answers args, rpc's AppendEntries, with a refusal at
// its term when it sends the leader's log from its start (no previous
// entry) to a node whose state holds entries (held). A leader sends that
// only after its probes found no entry it shares with this node's log or
// last snapshot; a follower whose state the leader's log leads to shares
// its last applied entry, or its snapshot's, and the probes stop there.
// So the state is another: a user restore (Raft's Restore, which is no
// log entry) installed on a leader cut off before any follower took it,
// kept after the others elected a leader that wrote on. Raft refused the
// entries while its log still named indexes it no longer holds, and
// after a restart with an empty log it took them, and applied those above
// its applied index on top of the restored state: a silent divergence.
// Refused here, the node is behind until the leader's snapshot comes
// (InstallSnapshot, watched in run), and the leader sends it once told
// (fromStart). A refusal a consistent node would not give costs a
// snapshot, nothing else.
func (w *commitWatch) refuseFromStart(rpc raft.RPC, args *raft.AppendEntriesRequest) bool {
	if args.PrevLogEntry != 0 || len(args.Entries) == 0 {
		return false
	}
	held, term := w.held()
	if held == 0 || args.Term < term {
		return false // an empty node's first entries; a stale leader, which Raft refuses
	}
	w.setBehind(true, string(args.ID))
	rpc.Respond(&raft.AppendEntriesResponse{
		RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(w.self),
			Addr: w.Transport.EncodePeer(raft.ServerID(w.self), w.Transport.LocalAddr())},
		Term: args.Term, LastLog: held,
	}, nil)
	return true
}

// refuseVote answers rpc, a RequestVote or RequestPreVote from
// candidate, whose log ends at lastLog, with a vote not granted while
// votes are held (votesHeld), and reports whether it did. A node that
// bootstrapped lets through a candidate whose log holds nothing past the
// bootstrap (bootIndex). The answer carries the node's current term, as
// Raft's own refusal does: a candidate counts it as a vote against, and
// steps down only for a newer term than its own.
func (w *commitWatch) refuseVote(rpc raft.RPC, candidate []byte, lastLog uint64) bool {
	if !w.votesHeld.Load() {
		return false
	}
	boot := w.bootIndex.Load()
	if boot > 0 && lastLog <= boot {
		return false // a fresh cluster's first election
	}
	if w.refusedVotes.Add(1) == 1 {
		if boot > 0 {
			w.logger.Warn("refusing votes until caught up after bootstrapping: this node bootstrapped an empty data directory from --peers "+
				"and may lack entries a voter under its id acknowledged before (a wiped voter); a candidate whose log is past the bootstrap "+
				"proves that cluster ran, and this node votes for one once its log holds what the leader had committed",
				"candidate", string(candidate), "candidate_last_index", lastLog, "bootstrap_index", boot)
		} else {
			w.logger.Warn("refusing votes until caught up after joining: this node started on an empty data directory "+
				"and may lack entries a voter under its id acknowledged before (a wiped voter); it votes again once its log holds what the leader had committed",
				"candidate", string(candidate))
		}
	}
	_, term := w.held()
	h := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(w.self),
		Addr: w.Transport.EncodePeer(raft.ServerID(w.self), w.Transport.LocalAddr())}
	switch rpc.Command.(type) {
	case *raft.RequestVoteRequest:
		rpc.Respond(&raft.RequestVoteResponse{RPCHeader: h, Term: term}, nil)
	default:
		rpc.Respond(&raft.RequestPreVoteResponse{RPCHeader: h, Term: term}, nil)
	}
	return true
}

// releaseVotes ends the refusal of votes (votesHeld): the node's log
// holds what the leader had committed when it first heard from it
// (holdsThrough), or its state does (Node.checkReady).
func (w *commitWatch) releaseVotes() {
	if w.votesHeld.Swap(false) && w.refusedVotes.Load() > 0 {
		msg := "caught up after joining: voting again"
		if w.bootIndex.Load() > 0 {
			msg = "caught up after bootstrapping: voting again"
		}
		w.logger.Info(msg, "refused_votes", w.refusedVotes.Load())
	}
}

// holdsThrough notes that this node's log is a leader's through index
// (an AppendEntries it took, or the snapshot it installed), and ends the
// refusal of votes once that covers the leader commit index first heard:
// every entry a voter under this node's id acknowledged before a wipe
// was committed counting its answer, so it is at or below that index.
// Readiness (its state applied it too) is more than a vote needs, and
// needs a leader: a joiner promoted before it was ready, whose leader
// then died for good, refused every candidate for ever.
func (w *commitWatch) holdsThrough(index uint64) {
	if first := w.first.Load(); first > 0 && index >= first {
		w.releaseVotes()
	}
}

// lastEntry returns the index of args' last entry, or of its previous
// entry when it carries none: the index through which a follower that
// takes it holds the leader's log. 0 for a heartbeat, which proves
// nothing.
func lastEntry(args *raft.AppendEntriesRequest) uint64 {
	if n := len(args.Entries); n > 0 {
		return args.Entries[n-1].Index
	}
	return args.PrevLogEntry
}

// watchAnswer returns rpc with its answer passed to seen (its Response;
// not an error) before it goes back to the sender: a goroutine each, for
// the InstallSnapshot a node that is behind waits for.
func (w *commitWatch) watchAnswer(rpc raft.RPC, seen func(resp any)) raft.RPC {
	orig, answer := rpc.RespChan, make(chan raft.RPCResponse, 1)
	rpc.RespChan = answer
	w.answers.Add(1)
	go func() {
		defer w.answers.Done()
		select {
		case r := <-answer:
			if r.Error == nil {
				seen(r.Response)
			}
			orig <- r // the transports' answer channels hold one
		case <-w.stop:
		}
	}()
	return rpc
}

// setBehind notes whether this node, a follower, refused leader's log
// from its start (refuseFromStart), and logs a change.
func (w *commitWatch) setBehind(behind bool, leader string) {
	if w.behind.Swap(behind) == behind {
		return
	}
	if behind {
		w.logger.Warn("this node's log cannot take the leader's from its start: its state is not the cluster's "+
			"(a snapshot restore installed here that no other node took, or an offline seed its peers lack); not ready until the leader sends its snapshot",
			"leader", leader)
	} else {
		w.logger.Info("took the leader's snapshot, or its log matched this node's: the state is the cluster's", "leader", leader)
	}
}

// admit reports whether the node may take rpc, and answers it with an
// error when not: this node's own (ownRPC), or another cluster's leader's
// while the node is alone (foreign).
func (w *commitWatch) admit(rpc raft.RPC) bool {
	if ownRPC(rpc, w.self) {
		if k := w.refusedOwn.Add(1); k&(k-1) == 0 {
			w.logger.Error("refusing an RPC this node sent itself: a member's raft address reaches this node; "+
				"remove that member (kvctl members list, kvctl members remove)", "refused", k)
		}
		refuseRPC(rpc, fmt.Errorf("%w: server %s received its own RPC: the raft address it was sent to reaches its sender", ErrInvalid, w.self))
		return false
	}
	if from, ok := w.foreign(rpc); ok {
		w.refuse(rpc, from)
		return false
	}
	return true
}

// ownRPC reports whether rpc names self as its sender. Raft sends no RPC
// to its own server: one that does came back through another member's
// address.
func ownRPC(rpc raft.RPC, self string) bool {
	h, ok := rpc.Command.(raft.WithRPCHeader)
	return ok && string(h.GetRPCHeader().ID) == self
}

// refuse answers rpc, from another cluster's leader, with an error.
func (w *commitWatch) refuse(rpc raft.RPC, from string) {
	if k := w.refused.Add(1); k&(k-1) == 0 { // the 1st, 2nd, 4th, 8th, ... refusal
		w.logger.Error("refusing a leader's RPC: this node is a cluster of its own; "+
			"remove it from the other cluster, or wipe its data directory and start it with --join",
			"from", from, "refused", k)
	}
	refuseRPC(rpc, fmt.Errorf("%w: server %s is a cluster of its own and follows no other leader", ErrInvalid, w.self))
}

// refuseRPC answers rpc with err and the empty response of its kind,
// never a nil one: hashicorp/raft v1.8.0's in-memory pipeline takes an
// append's answer for an *AppendEntriesResponse before it looks at the
// error, and panics on nil (the tests' clusters run on it). The network
// transport sends the error alone either way: its sender reads the error
// first and returns it.
func refuseRPC(rpc raft.RPC, err error) {
	var resp any
	switch rpc.Command.(type) {
	case *raft.AppendEntriesRequest:
		resp = &raft.AppendEntriesResponse{}
	case *raft.RequestVoteRequest:
		resp = &raft.RequestVoteResponse{}
	case *raft.RequestPreVoteRequest:
		resp = &raft.RequestPreVoteResponse{}
	case *raft.InstallSnapshotRequest:
		resp = &raft.InstallSnapshotResponse{}
	case *raft.TimeoutNowRequest:
		resp = &raft.TimeoutNowResponse{}
	}
	rpc.Respond(resp, err)
}

// setAlone gives the watch the node's test of being alone, asked on every
// RPC that a leader sends, and what its state holds (refuseFromStart),
// and lets RPCs through. Call it once.
func (w *commitWatch) setAlone(alone func() bool, held func() (index, term uint64)) {
	w.held = held
	w.alone.Store(&alone)
	close(w.aloneSet)
}

// SetHeartbeatHandler implements raft.Transport. A heartbeat (an
// AppendEntries without entries) takes a fast path around the consumer
// channel, on the transport's connection goroutines, and makes a node
// follow its sender as surely as any other AppendEntries: the watch
// checks it the same way. One that comes before the node said whether it
// is alone is refused (the leader sends another).
func (w *commitWatch) SetHeartbeatHandler(cb func(rpc raft.RPC)) {
	if cb == nil {
		w.Transport.SetHeartbeatHandler(nil)
		return
	}
	w.Transport.SetHeartbeatHandler(func(rpc raft.RPC) {
		if w.alone.Load() == nil {
			refuseRPC(rpc, fmt.Errorf("%w: server %s is starting", ErrNoLeader, w.self))
			return
		}
		if !w.admit(rpc) {
			return
		}
		cb(rpc)
	})
}

// foreign reports whether rpc comes from another server that would lead
// this node while it is alone, and which.
func (w *commitWatch) foreign(rpc raft.RPC) (string, bool) {
	var h raft.RPCHeader
	switch c := rpc.Command.(type) {
	case *raft.AppendEntriesRequest:
		h = c.RPCHeader
	case *raft.InstallSnapshotRequest:
		h = c.RPCHeader
	case *raft.TimeoutNowRequest:
		h = c.RPCHeader
	default:
		return "", false
	}
	return string(h.ID), string(h.ID) != w.self && (*w.alone.Load())()
}

// answeredBy reports whether an answer with header h, to an RPC sent to
// peer at target, comes from peer: h names peer's id, as hashicorp/raft
// v1.8.0 (which every build of this module ran) sets it in its answers
// to AppendEntries, RequestVote and RequestPreVote (getRPCHeader); not
// in its answer to InstallSnapshot, which has no header at all and which
// InstallSnapshot does not bring here. Another id is another server at
// peer's address: a member reached under another spelling, another
// cluster's node; no id, a server that does not say. Neither counts as
// peer's answer, contact nor match: a new member whose address answers
// as another is never promoted, and stays a non-voter that the operator
// sees (this log, members list).
func (w *commitWatch) answeredBy(peer raft.ServerID, target raft.ServerAddress, h raft.RPCHeader) bool {
	if string(h.ID) == string(peer) {
		return true
	}
	if k := w.strangers.Add(1); k&(k-1) == 0 { // the 1st, 2nd, 4th, 8th, ...
		w.logger.Warn("a peer's raft address is answered by another server: its answers do not count as the peer's "+
			"(check its raft address; a member added at another's address stays a non-voter: remove it)",
			"peer", peer, "raft_addr", target, "answered_by", string(h.ID), "count", k)
	}
	return false
}

// heard notes an answer from peer. When it answered an RPC that tests
// its log (proves), success says whether its log is the leader's through
// index m.
func (w *commitWatch) heard(peer raft.ServerID, proves, success bool, m uint64) {
	w.contactMu.Lock()
	defer w.contactMu.Unlock()
	if w.contacts == nil {
		w.contacts = map[raft.ServerID]peerContact{}
	}
	c := w.contacts[peer]
	c.at = time.Now()
	if proves {
		c.matched = 0
		if success {
			c.matched, c.matchedAt = m, c.at
		}
	}
	w.contacts[peer] = c
}

// refusedAfterInstall reports whether peer answered args, an
// AppendEntries after the snapshot it last took from this node (the
// entries that follow it), with resp, a refusal at the leader's term
// naming a last index at or above the snapshot's. hashicorp/raft v1.8.0
// leaves a follower's last log index and term as they were when it
// installs a snapshot at or below that index (a deposed leader's entries,
// or its user restore's index), though it clears the log: the follower
// then looks the snapshot's index up in its empty log, or, the snapshot
// exactly at its stale last index, finds that entry's older term there
// and answers LastLog equal to the snapshot's index; it refuses, and the
// leader sends the same snapshot again, for good, the follower's applied
// index stuck at the snapshot's. Only a snapshot past the follower's last
// index ends it (compactForFollower).
func (w *commitWatch) refusedAfterInstall(peer raft.ServerID, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) bool {
	if resp.Success || resp.Term != args.Term || args.PrevLogEntry == 0 || resp.LastLog < args.PrevLogEntry {
		return false
	}
	w.contactMu.Lock()
	defer w.contactMu.Unlock()
	return w.installed[peer] == args.PrevLogEntry
}

// heardAppend notes peer's answer resp to an AppendEntries args, and
// passes on a peer that refused the log from its start, or from the
// snapshot it has just taken (fromStart).
func (w *commitWatch) heardAppend(peer raft.ServerID, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) {
	m, proves := matchedBy(args)
	w.heard(peer, proves, resp.Success, m)
	if refusedFromStart(args, resp) || w.refusedAfterInstall(peer, args, resp) {
		select {
		case w.fromStart <- peer:
		default:
		}
	}
}

// matchedBy returns the index through which a follower that answers args
// with success holds the leader's log: the previous entry, whose term it
// checked, and the entries, which replace whatever of its own conflicted
// (Raft's log matching). ok is false for a heartbeat (neither), which a
// follower answers without looking at its log.
func matchedBy(args *raft.AppendEntriesRequest) (m uint64, ok bool) {
	if args.PrevLogEntry == 0 && len(args.Entries) == 0 {
		return 0, false
	}
	return args.PrevLogEntry + uint64(len(args.Entries)), true
}

// contact returns what this node last heard from peer (zero: nothing).
func (w *commitWatch) contact(peer raft.ServerID) peerContact {
	w.contactMu.Lock()
	defer w.contactMu.Unlock()
	return w.contacts[peer]
}

// AppendEntries implements raft.Transport, noting the answer. Heartbeats
// come this way, at least every tenth of a heartbeat timeout, and so does
// all replication (MaxRPCsInFlight 1: no pipeline). The failure of one
// that is not a heartbeat, for want of an answer, is held until the
// follower answers again (unanswered.go).
func (w *commitWatch) AppendEntries(id raft.ServerID, target raft.ServerAddress, args *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	kick := w.kicked()
	err := w.Transport.AppendEntries(id, target, args, resp)
	switch {
	case err == nil:
	case isHeartbeat(args):
		w.failedHeartbeats.Add(1)
	default:
		if unanswered(err) {
			err = w.holdUnanswered(id, target, args.Term, "AppendEntries", err, kick)
		}
		w.failedAppends.Add(1)
	}
	if err == nil && w.answeredBy(id, target, resp.RPCHeader) {
		w.heardAppend(id, args, resp)
	}
	return err
}

// AppendEntriesPipeline implements raft.Transport: the pipeline's answers
// are noted as AppendEntries' are (watchedPipeline).
func (w *commitWatch) AppendEntriesPipeline(id raft.ServerID, target raft.ServerAddress) (raft.AppendPipeline, error) {
	p, err := w.Transport.AppendEntriesPipeline(id, target)
	if err != nil {
		return nil, err
	}
	wp := &watchedPipeline{AppendPipeline: p, w: w, id: id, target: target, out: make(chan raft.AppendFuture), stop: make(chan struct{}), done: make(chan struct{})}
	go wp.run()
	return wp, nil
}

// watchedPipeline passes a pipeline's answered futures on to Raft after
// noting them: without it a follower's matched index would stop at the
// end of its catch-up, and a later add of it (a retried join after
// another configuration change) would wait for a match that never comes.
type watchedPipeline struct {
	raft.AppendPipeline
	w      *commitWatch
	id     raft.ServerID
	target raft.ServerAddress
	out    chan raft.AppendFuture
	stop   chan struct{}
	done   chan struct{}
	closed sync.Once
}

func (p *watchedPipeline) run() {
	defer close(p.done)
	in := p.AppendPipeline.Consumer()
	for {
		select {
		case f := <-in:
			// answered: the futures come done
			if f.Error() == nil && p.w.answeredBy(p.id, p.target, f.Response().RPCHeader) {
				p.w.heardAppend(p.id, f.Request(), f.Response())
			}
			select {
			case p.out <- f:
			case <-p.stop:
				return
			}
		case <-p.stop:
			return
		}
	}
}

// Consumer implements raft.AppendPipeline: the answers, after the watch.
func (p *watchedPipeline) Consumer() <-chan raft.AppendFuture { return p.out }

// Close implements raft.AppendPipeline. Raft closes a pipeline once it no
// longer reads its Consumer.
func (p *watchedPipeline) Close() error {
	err := p.AppendPipeline.Close()
	p.closed.Do(func() { close(p.stop) })
	<-p.done
	return err
}

// InstallSnapshot implements raft.Transport, noting the answer: a
// follower that installed the snapshot holds the leader's log through
// its last index. The failure of its dial is held until the follower
// answers again (unanswered.go).
//
// hashicorp/raft v1.8.0 answers InstallSnapshot without an RPC header
// (Raft.installSnapshot builds its response with a term and a result
// only), so an answer without an id is what every follower sends: it
// proves nothing either way, and is noted neither as the peer's (no
// contact, no match) nor as another server's (no stranger, no warning).
// Taken as another server's, it made the leader tell the operator to
// remove a healthy node on every catch-up by snapshot. The match follows
// from the next AppendEntries, which tests the log at the
// snapshot's last index and carries the follower's id. An answer that
// names another server is still a stranger's.
func (w *commitWatch) InstallSnapshot(id raft.ServerID, target raft.ServerAddress, args *raft.InstallSnapshotRequest, resp *raft.InstallSnapshotResponse, data io.Reader) error {
	kick := w.kicked()
	err := w.Transport.InstallSnapshot(id, target, args, resp, data)
	if err != nil && dialFailed(err) {
		err = w.holdUnanswered(id, target, args.Term, "InstallSnapshot", err, kick)
	}
	if err == nil && len(resp.ID) > 0 && w.answeredBy(id, target, resp.RPCHeader) {
		w.heard(id, true, resp.Success, args.LastLogIndex)
	}
	if err == nil && resp.Success { // headerless: a hint only (refusedAfterInstall)
		w.contactMu.Lock()
		if w.installed == nil {
			w.installed = map[raft.ServerID]uint64{}
		}
		w.installed[id] = args.LastLogIndex
		w.contactMu.Unlock()
	}
	return err
}

// RequestVote implements raft.Transport, noting the answer.
func (w *commitWatch) RequestVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestVoteRequest, resp *raft.RequestVoteResponse) error {
	err := w.Transport.RequestVote(id, target, args, resp)
	if err == nil && w.answeredBy(id, target, resp.RPCHeader) {
		w.heard(id, false, false, 0)
	}
	return err
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

// forgetLeaderCommit forgets the leader commit index heard: the next one
// a leader sends is the first again (Node.unready).
func (w *commitWatch) forgetLeaderCommit() { w.first.Store(0) }

// close stops the watch's goroutines (once Raft no longer reads RPCs).
func (w *commitWatch) close() {
	w.closed.Do(func() { close(w.stop) })
	<-w.done
	w.answers.Wait()
}

type commitWatchPreVote struct {
	*commitWatch
	pv raft.WithPreVote
}

// RequestPreVote implements raft.WithPreVote, noting the answer.
func (w *commitWatchPreVote) RequestPreVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestPreVoteRequest, resp *raft.RequestPreVoteResponse) error {
	err := w.pv.RequestPreVote(id, target, args, resp)
	if err == nil && w.answeredBy(id, target, resp.RPCHeader) {
		w.heard(id, false, false, 0)
	}
	return err
}
