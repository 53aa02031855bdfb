// Package netproxy is a loopback TCP proxy that tests put on the path
// between two processes so that they can partition them: one Proxy is one
// directed link, the connections one side dials to reach the other.
//
// A Proxy listens on 127.0.0.1 at a port of its own and forwards every
// connection it accepts to its target, bytes both ways, half-closes
// passed on. Its invariants:
//
//   - While cut, nothing crosses it: Cut closes every live forwarded
//     connection (both of its sockets, so both ends see the connection
//     break), and every connection accepted until Heal is closed at once,
//     before anything is read from it and without dialing the target. A
//     connection whose dial to the target was under way when Cut came is
//     closed too, the target side as soon as the dial returns.
//   - The listening port stays the Proxy's own from New to Close, cut or
//     not: no other process can take it during a partition, and a healed
//     proxy is reached at the same address.
//   - Close stops everything and returns once every goroutine the Proxy
//     started has ended; dials to the target are bounded by a deadline and
//     canceled by Close.
//
// A Proxy can also be made lossy (SetFaults): every chunk it forwards, in
// either direction, waits a jittered delay first, and with a given
// probability the chunk is dropped and its connection reset instead (both
// sockets closed with an RST, so both ends see ECONNRESET or a broken
// pipe). TCP cannot lose bytes inside a stream, so that is what loss is
// here: the connection dies with what was in flight, and the dialing side
// (Raft's transport) dials anew and sends again, as it would when a lossy
// network made its connection time out. Every chunk of a connection that
// lives is forwarded whole and in order; a delay never reorders, since
// each direction forwards its chunks one after the other. The draws come
// from a random source seeded by the caller, shared by every connection
// of the proxy: which chunk of which connection meets a given draw
// depends on timing, the distribution does not.
//
// It is a test fixture, not a production proxy: no limits, no metrics
// beyond three counters, loopback only.
package netproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"time"
)

// DialTimeout bounds one dial of the target.
const DialTimeout = 5 * time.Second

// Proxy forwards the connections it accepts to one target address.
type Proxy struct {
	target string
	ln     net.Listener
	ctx    context.Context // canceled by Close: aborts dials under way
	cancel context.CancelFunc

	mu        sync.Mutex
	cut       bool
	closed    bool
	links     map[*link]struct{} // live forwarded connections, dialing ones included
	forwarded uint64
	refused   uint64
	reset     uint64
	faults    Faults     // zero: forward as is
	rng       *rand.Rand // the faults' draws; nil while there are none

	wg sync.WaitGroup // the accept loop and every link's goroutines
}

// link is one forwarded connection: the accepted socket and, once the dial
// returned, the socket to the target.
type link struct {
	client net.Conn
	up     net.Conn // nil while dialing
	gone   bool     // closed by Cut or Close; guarded by Proxy.mu
}

// close closes both sockets; the caller holds Proxy.mu.
func (l *link) close() {
	l.gone = true
	l.client.Close()
	if l.up != nil {
		l.up.Close()
	}
}

// reset closes both sockets with an RST rather than a FIN (SO_LINGER 0),
// as a connection a lossy network killed ends; the caller holds Proxy.mu.
func (l *link) reset() {
	for _, c := range []net.Conn{l.client, l.up} {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
	}
	l.close()
}

// Stats counts the connections a Proxy accepted.
type Stats struct {
	Forwarded uint64 // accepted while healed and handed on to the target
	Refused   uint64 // accepted while cut (or closing) and closed at once
	Reset     uint64 // forwarded and then reset by the faults (SetFaults)
}

// Faults make a Proxy lossy; the zero value forwards every chunk at once.
type Faults struct {
	// Delay and Jitter: every chunk waits Delay plus a duration drawn
	// uniformly from [0, Jitter) before it is forwarded.
	Delay, Jitter time.Duration
	// ResetProb is the probability, drawn per chunk, that the chunk is
	// dropped and its connection reset: 0.5 loses about half the traffic.
	ResetProb float64
	// Seed seeds the draws.
	Seed uint64
}

func (f Faults) String() string {
	return fmt.Sprintf("delay %v + jitter [0, %v), reset probability %v per chunk, seed %d", f.Delay, f.Jitter, f.ResetProb, f.Seed)
}

// New starts a proxy on 127.0.0.1 at a port the kernel picks, forwarding
// to target (host:port).
func New(target string) (*Proxy, error) {
	if _, _, err := net.SplitHostPort(target); err != nil {
		return nil, fmt.Errorf("netproxy: target %q: %w", target, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("netproxy: listen: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{target: target, ln: ln, ctx: ctx, cancel: cancel, links: map[*link]struct{}{}}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr is where the proxy listens (host:port): what the dialing side must
// be told the target's address is.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// Cut partitions the link: it closes every live forwarded connection and
// makes the proxy close every new one at once, until Heal.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	p.dropLinks()
}

// Heal lets new connections through again. Connections cut before stay
// closed: the dialing side dials anew, as it would after a real partition.
func (p *Proxy) Heal() {
	p.mu.Lock()
	p.cut = false
	p.mu.Unlock()
}

// IsCut reports whether the link is cut.
func (p *Proxy) IsCut() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return Stats{Forwarded: p.forwarded, Refused: p.refused, Reset: p.reset}
}

// SetFaults makes the proxy lossy as f says, from its next chunk on, live
// connections included; SetFaults(Faults{}) makes it forward as is again.
// A Cut still closes everything, faults or not.
func (p *Proxy) SetFaults(f Faults) error {
	if f.Delay < 0 || f.Jitter < 0 || !(f.ResetProb >= 0 && f.ResetProb <= 1) {
		return fmt.Errorf("netproxy: faults %v: want durations >= 0 and a probability in [0, 1]", f)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.faults = f
	p.rng = nil
	if f != (Faults{Seed: f.Seed}) {
		p.rng = rand.New(rand.NewPCG(f.Seed, 0x6e657470726f7879))
	}
	return nil
}

// draw is what the faults do to the next chunk of l: how long it waits,
// and whether it is dropped and l reset instead (the reset done already).
func (p *Proxy) draw(l *link) (wait time.Duration, dropped bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.rng == nil {
		return 0, false
	}
	if p.faults.ResetProb > 0 && p.rng.Float64() < p.faults.ResetProb {
		if !l.gone {
			l.reset()
			delete(p.links, l)
			p.reset++
		}
		return 0, true
	}
	wait = p.faults.Delay
	if p.faults.Jitter > 0 {
		wait += time.Duration(p.rng.Int64N(int64(p.faults.Jitter)))
	}
	return wait, false
}

// Close stops the proxy: the listener, every connection, every dial. It
// returns once every goroutine of the proxy has ended. Calling it again
// does nothing.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.wg.Wait()
		return nil
	}
	p.closed = true
	err := p.ln.Close()
	p.dropLinks()
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
	return err
}

// dropLinks closes every live link; the caller holds p.mu.
func (p *Proxy) dropLinks() {
	for l := range p.links {
		l.close()
		delete(p.links, l)
	}
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient failure (out of descriptors): go on, but do not
			// spin on it. Close ends the loop through ErrClosed.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		if p.cut || p.closed {
			p.refused++
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.forwarded++
		l := &link{client: c}
		p.links[l] = struct{}{}
		p.wg.Add(1) // under mu and before closed is set: Close waits for it
		p.mu.Unlock()
		go p.serve(l)
	}
}

// serve dials the target for link l and copies bytes both ways until both
// directions have ended or the link is closed.
func (p *Proxy) serve(l *link) {
	defer p.wg.Done()
	ctx, cancel := context.WithTimeout(p.ctx, DialTimeout)
	var d net.Dialer
	up, err := d.DialContext(ctx, "tcp", p.target)
	cancel()
	p.mu.Lock()
	if err != nil || l.gone {
		// The target cannot be reached, or Cut or Close came during the
		// dial: the client sees its connection closed.
		if up != nil {
			up.Close()
		}
		if !l.gone {
			l.close()
			delete(p.links, l)
		}
		p.mu.Unlock()
		return
	}
	l.up = up
	p.mu.Unlock()

	var copies sync.WaitGroup
	copies.Add(2)
	go func() { defer copies.Done(); p.pipe(l, up, l.client) }()
	go func() { defer copies.Done(); p.pipe(l, l.client, up) }()
	copies.Wait()
	p.mu.Lock()
	if !l.gone {
		l.close()
		delete(p.links, l)
	}
	p.mu.Unlock()
}

// pipe copies src to dst, a chunk (one read) at a time, each put through
// the faults. At src's end of stream it passes the half-close on (dst's
// write side) and returns, leaving the other direction to run; on an
// error, the whole link is closed, which ends the other direction too.
func (p *Proxy) pipe(l *link, dst, src net.Conn) {
	err := p.copyChunks(l, dst, src)
	if err == nil {
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && cw.CloseWrite() == nil {
			return
		}
	}
	p.mu.Lock()
	if !l.gone {
		l.close()
		delete(p.links, l)
	}
	p.mu.Unlock()
}

// copyChunks copies src to dst until src's end of stream (nil) or an
// error, a dropped chunk's reset included.
func (p *Proxy) copyChunks(l *link, dst, src net.Conn) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			wait, dropped := p.draw(l)
			if dropped {
				return errors.New("netproxy: chunk dropped, connection reset")
			}
			if wait > 0 {
				// A Cut or Close during the wait closes dst: the write
				// below fails, and nothing crosses a cut link.
				t := time.NewTimer(wait)
				select {
				case <-t.C:
				case <-p.ctx.Done():
					t.Stop()
					return p.ctx.Err()
				}
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
