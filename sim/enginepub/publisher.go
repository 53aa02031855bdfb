// Package enginepub is the publishing side of an inference engine's KV
// event wire (shared/design/wire.md), for the simulated workers of a live
// replay (kvsim replay --live --zmq-base-port): what a node agent
// (kvagent) subscribes to, over real libzmq (github.com/pebbe/zmq4).
//
// A Publisher binds one socket per engine rank and sends each batch as
// the 3-frame message [topic, seq (8 bytes, big-endian), payload], with
// sequence numbers from 0, +1 per batch. Its socket is an XPUB — a PUB
// that also reports subscriptions — so that a caller can wait until a
// subscriber is there before publishing (WaitSubscribed): PUB drops what
// it sends before a subscription arrives. With a replay endpoint, a ROUTER
// serves the last Config.Buffer batches to a subscriber that missed some:
// a request [delimiter "", start seq] is answered with every kept batch
// from that sequence on as [topic, seq, payload], then the end marker (a
// sequence of eight 0xff bytes, an empty payload). The ROUTER is
// mandatory (ZMQ_ROUTER_MANDATORY): past its send high-water mark it waits
// for the subscriber to read instead of dropping, so a replay of the whole
// buffer arrives whole; a subscriber that went away, or reads nothing for
// replayStall, has its replay abandoned.
//
// Invariants:
//   - Sequence numbers are consecutive from 0; a batch the socket could not
//     take (an error from Publish) consumes no sequence number.
//   - Every batch Publish accepted is kept for replay until Config.Buffer
//     later ones push it out; a replay returns kept batches in sequence
//     order, and a request below the oldest one starts at the oldest (the
//     subscriber sees the overrun).
//   - A replay arrives whole and in order, end marker included, or stops
//     short with no end marker (its subscriber went away or stalled): it
//     never has a hole.
//   - The XPUB socket is used under a mutex; the ROUTER only by the replay
//     goroutine, which Close stops before it returns.
package enginepub

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// Defaults of Config.
const (
	DefaultBuffer  = 10_000  // batches kept for replay, as vLLM's default
	DefaultSendHWM = 100_000 // messages queued per subscriber before PUB drops
	DefaultLinger  = 2 * time.Second
)

// pollInterval bounds how long a receive blocks before the loop looks at
// its context or stop channel again.
const pollInterval = 50 * time.Millisecond

// replayStall is how long a replay waits for its subscriber to take the
// next message (its queue full) before the replay is abandoned.
const replayStall = 10 * time.Second

// endSeq is the sequence frame of the marker that ends a replay.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Config configures a Publisher.
type Config struct {
	// Endpoint is bound, e.g. "tcp://127.0.0.1:5600" ("tcp://127.0.0.1:*"
	// lets the system choose the port: Endpoint() tells which). Required.
	Endpoint string
	// ReplayEndpoint, when set, is bound by a ROUTER serving replays.
	ReplayEndpoint string
	// Topic is the first frame of every message (default empty).
	Topic string
	// Buffer is how many of the last batches are kept for replay (default
	// DefaultBuffer; negative: none are kept).
	Buffer int
	// SendHWM is the socket's send high-water mark in messages (default
	// DefaultSendHWM); past it, PUB drops, as an engine's does.
	SendHWM int
	// Linger is how long Close lets queued messages go out (default
	// DefaultLinger).
	Linger time.Duration
}

// A Publisher publishes one engine rank's batches.
type Publisher struct {
	cfg    Config
	topic  []byte
	local  string
	replay string

	zctx *zmq.Context // the publisher's own: Close terminates it
	mu   sync.Mutex   // the XPUB socket, seq, subs, closed
	pub  *zmq.Socket
	seq  uint64
	subs int
	shut bool

	bufMu sync.Mutex
	kept  []kept // a ring in sequence order from head
	head  int

	stop chan struct{}
	done chan struct{}
}

type kept struct {
	seq     uint64
	payload []byte
}

// New binds the sockets of cfg. Close releases them.
func New(cfg Config) (_ *Publisher, err error) {
	if cfg.Endpoint == "" {
		return nil, errors.New("enginepub: no endpoint")
	}
	if cfg.Buffer == 0 {
		cfg.Buffer = DefaultBuffer
	}
	if cfg.SendHWM <= 0 {
		cfg.SendHWM = DefaultSendHWM
	}
	if cfg.Linger <= 0 {
		cfg.Linger = DefaultLinger
	}
	p := &Publisher{cfg: cfg, topic: []byte(cfg.Topic), stop: make(chan struct{}), done: make(chan struct{})}
	if p.zctx, err = zmq.NewContext(); err != nil {
		return nil, fmt.Errorf("enginepub: new context: %w", err)
	}
	p.pub, err = p.zctx.NewSocket(zmq.XPUB)
	if err != nil {
		_ = p.zctx.Term()
		return nil, fmt.Errorf("enginepub: new socket: %w", err)
	}
	defer func() {
		if err != nil {
			_ = p.pub.SetLinger(0)
			p.pub.Close()
			_ = p.zctx.Term()
		}
	}()
	if err := errors.Join(p.pub.SetLinger(cfg.Linger), p.pub.SetSndhwm(cfg.SendHWM),
		p.pub.SetXpubVerbose(1), p.pub.SetRcvtimeo(pollInterval)); err != nil {
		return nil, fmt.Errorf("enginepub: socket options: %w", err)
	}
	if err := p.pub.Bind(cfg.Endpoint); err != nil {
		return nil, fmt.Errorf("enginepub: bind %s: %w", cfg.Endpoint, err)
	}
	if p.local, err = p.pub.GetLastEndpoint(); err != nil {
		return nil, fmt.Errorf("enginepub: bound endpoint: %w", err)
	}
	if cfg.ReplayEndpoint == "" {
		close(p.done)
		return p, nil
	}
	r, err := p.zctx.NewSocket(zmq.ROUTER)
	if err != nil {
		return nil, fmt.Errorf("enginepub: new replay socket: %w", err)
	}
	// Mandatory: a message the subscriber's full queue cannot take fails
	// (EAGAIN after the send timeout) instead of being dropped, and one to
	// a subscriber that went away fails with EHOSTUNREACH.
	if err := errors.Join(r.SetLinger(0), r.SetRcvtimeo(pollInterval), r.SetSndtimeo(pollInterval),
		r.SetRouterMandatory(1)); err != nil {
		r.Close()
		return nil, fmt.Errorf("enginepub: replay socket options: %w", err)
	}
	if err := r.Bind(cfg.ReplayEndpoint); err != nil {
		r.Close()
		return nil, fmt.Errorf("enginepub: bind %s: %w", cfg.ReplayEndpoint, err)
	}
	if p.replay, err = r.GetLastEndpoint(); err != nil {
		r.Close()
		return nil, fmt.Errorf("enginepub: bound replay endpoint: %w", err)
	}
	go p.serveReplays(r)
	return p, nil
}

// Endpoint returns the bound event endpoint (with the port chosen).
func (p *Publisher) Endpoint() string { return p.local }

// ReplayEndpoint returns the bound replay endpoint, or "" when none.
func (p *Publisher) ReplayEndpoint() string { return p.replay }

// WaitSubscribed waits until at least n subscribers are subscribed (any
// topic), or ctx ends.
func (p *Publisher) WaitSubscribed(ctx context.Context, n int) error {
	for {
		p.mu.Lock()
		if p.shut {
			p.mu.Unlock()
			return errors.New("enginepub: closed")
		}
		if p.subs >= n {
			p.mu.Unlock()
			return nil
		}
		err := p.readSubscription()
		subs := p.subs
		p.mu.Unlock()
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil && subs < n {
			return fmt.Errorf("enginepub: %s: %d of %d subscribers: %w", p.local, subs, n, err)
		}
	}
}

// Subscribers returns how many subscriptions WaitSubscribed has seen (less
// the unsubscriptions).
func (p *Publisher) Subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.subs
}

// readSubscription reads one subscription message, waiting at most
// pollInterval; p.mu is held.
func (p *Publisher) readSubscription() error {
	msg, err := p.pub.RecvBytes(0)
	if err != nil {
		if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
			return nil
		}
		return fmt.Errorf("enginepub: read subscriptions: %w", err)
	}
	if len(msg) > 0 {
		switch msg[0] {
		case 1:
			p.subs++
		case 0:
			p.subs--
		}
	}
	return nil
}

// Publish sends payload as the next batch and returns its sequence
// number. payload is copied.
func (p *Publisher) Publish(payload []byte) (uint64, error) {
	b := append([]byte(nil), payload...)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.shut {
		return 0, errors.New("enginepub: closed")
	}
	seq := p.seq
	var sf [8]byte
	binary.BigEndian.PutUint64(sf[:], seq)
	if _, err := p.pub.SendMessage(p.topic, sf[:], b); err != nil {
		return 0, fmt.Errorf("enginepub: send batch %d: %w", seq, err)
	}
	p.seq++
	p.keep(seq, b)
	return seq, nil
}

// Seq returns the sequence number the next batch gets.
func (p *Publisher) Seq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

func (p *Publisher) keep(seq uint64, payload []byte) {
	if p.cfg.Buffer < 0 {
		return
	}
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	if len(p.kept) < p.cfg.Buffer {
		p.kept = append(p.kept, kept{seq, payload})
		return
	}
	p.kept[p.head] = kept{seq, payload}
	p.head = (p.head + 1) % len(p.kept)
}

// from returns the kept batches from seq on, in sequence order.
func (p *Publisher) from(seq uint64) []kept {
	p.bufMu.Lock()
	defer p.bufMu.Unlock()
	var out []kept
	for i := range p.kept {
		k := p.kept[(p.head+i)%len(p.kept)]
		if k.seq >= seq {
			out = append(out, k)
		}
	}
	return out
}

// serveReplays answers replay requests on r until Close.
func (p *Publisher) serveReplays(r *zmq.Socket) {
	defer close(p.done)
	defer r.Close()
	for {
		select {
		case <-p.stop:
			return
		default:
		}
		frames, err := r.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
				continue
			}
			return // the context is gone
		}
		// [identity, "", start seq]: the envelope a REQ socket adds; any
		// other request is refused, as the engine does.
		if len(frames) != 3 || len(frames[1]) != 0 || len(frames[2]) != 8 {
			continue
		}
		p.replayTo(r, frames[0], binary.BigEndian.Uint64(frames[2]))
	}
}

// replayTo sends the subscriber id the kept batches from seq on, then the
// end marker. It stops short, with no end marker, when a message cannot be
// sent: the subscriber went away, took nothing for replayStall, or Close
// was called. The subscriber then sees no end and retries or resyncs; a
// replay with a hole would be taken for complete.
func (p *Publisher) replayTo(r *zmq.Socket, id []byte, seq uint64) {
	for _, k := range p.from(seq) {
		var sf [8]byte
		binary.BigEndian.PutUint64(sf[:], k.seq)
		if !p.sendReplay(r, id, sf[:], k.payload) {
			return
		}
	}
	p.sendReplay(r, id, endSeq, []byte{})
}

// sendReplay sends one replay message to the subscriber id, waiting while
// its queue is full, for at most replayStall. It reports whether the
// message was sent. A multipart message fails whole or not at all: a
// mandatory ROUTER refuses on the identity frame, before any is queued.
func (p *Publisher) sendReplay(r *zmq.Socket, id, seq, payload []byte) bool {
	stall := time.Now().Add(replayStall)
	for {
		_, err := r.SendMessage(id, []byte{}, p.topic, seq, payload)
		if err == nil {
			return true
		}
		if zmq.AsErrno(err) != zmq.Errno(syscall.EAGAIN) || time.Now().After(stall) {
			return false // EHOSTUNREACH: gone; or stalled
		}
		select {
		case <-p.stop:
			return false
		default:
		}
	}
}

// Close stops serving replays and closes the sockets, waiting until the
// queued messages went out, for at most Config.Linger (a process that exits
// with messages queued drops them).
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.shut {
		p.mu.Unlock()
		return nil
	}
	p.shut = true
	p.mu.Unlock()
	close(p.stop)
	<-p.done
	p.mu.Lock()
	err := p.pub.Close()
	p.mu.Unlock()
	// Terminating the context waits until the queued messages went out, or
	// the linger ran out.
	return errors.Join(err, p.zctx.Term())
}
