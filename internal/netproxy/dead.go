package netproxy

import (
	"context"
	"net"

	"sync/atomic"
	"syscall"
)

// DeadAfterFirst is a dial function for an http.Transport (DialContext)
// whose connections to target (every address when target is "") die on
// Kill, the node with them: the first dial to target connects, and once
// Kill is called its connection's writes fail having written nothing
// (EPIPE) and every later dial to target is refused. Other addresses are
// dialed as usual. It is how a test gets a kept-alive connection to a
// node that went away.
type DeadAfterFirst struct {
	target string
	dead   atomic.Bool
	used   atomic.Bool
}

// NewDeadAfterFirst returns a DeadAfterFirst for target.
func NewDeadAfterFirst(target string) *DeadAfterFirst { return &DeadAfterFirst{target: target} }

// Kill makes target's connection and later dials fail.
func (d *DeadAfterFirst) Kill() { d.dead.Store(true) }

// DialContext dials as described on DeadAfterFirst.
func (d *DeadAfterFirst) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var dialer net.Dialer
	if d.target != "" && addr != d.target {
		return dialer.DialContext(ctx, network, addr)
	}
	if d.dead.Load() || d.used.Swap(true) {
		return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
	}
	conn, err := dialer.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &deadConn{Conn: conn, dead: &d.dead}, nil
}

// deadConn fails every write once dead, having written nothing.
type deadConn struct {
	net.Conn
	dead *atomic.Bool
}

func (c *deadConn) Write(b []byte) (int, error) {
	if c.dead.Load() {
		return 0, &net.OpError{Op: "write", Net: "tcp", Err: syscall.EPIPE}
	}
	return c.Conn.Write(b)
}
