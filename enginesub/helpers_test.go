package enginesub

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

var quiet = slog.New(slog.DiscardHandler)

// call is one call a sink received.
type call struct {
	kind   string // "ev", "reset", "resync", or "replay" (a test replay's request)
	rank   kvevent.Rank
	seq    uint64
	reason Reason
	events []kvevent.Event // copied
	failed bool            // Events returned an error
}

func (c call) String() string {
	switch c.kind {
	case "ev":
		if c.failed {
			return fmt.Sprintf("ev%d!", c.seq)
		}
		return fmt.Sprintf("ev%d", c.seq)
	case "resync":
		return "resync:" + string(c.reason)
	case "replay":
		return fmt.Sprintf("replay:%d", c.seq)
	}
	return c.kind
}

// recSink records every call, copying the events.
type recSink struct {
	mu    sync.Mutex
	calls []call
	fail  func(seq uint64) bool // Events fails when it says so
}

func (s *recSink) Events(r kvevent.Rank, seq uint64, evs []kvevent.Event) error {
	c := call{kind: "ev", rank: r, seq: seq}
	for _, e := range evs {
		e.Blocks = slices.Clone(e.Blocks)
		e.Removed = slices.Clone(e.Removed)
		c.events = append(c.events, e)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil && s.fail(seq) {
		c.failed = true
		s.calls = append(s.calls, c)
		return fmt.Errorf("sink refuses batch %d", seq)
	}
	s.calls = append(s.calls, c)
	return nil
}

func (s *recSink) Reset(r kvevent.Rank) { s.add(call{kind: "reset", rank: r}) }

func (s *recSink) Resync(r kvevent.Rank, reason Reason) {
	s.add(call{kind: "resync", rank: r, reason: reason})
}

func (s *recSink) add(c call) {
	s.mu.Lock()
	s.calls = append(s.calls, c)
	s.mu.Unlock()
}

// of returns the calls about rank r (all when r is nil).
func (s *recSink) of(r *kvevent.Rank) []call {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []call
	for _, c := range s.calls {
		if r == nil || c.rank == *r || c.kind == "replay" {
			out = append(out, c)
		}
	}
	return out
}

func trace(calls []call) string {
	s := make([]string, len(calls))
	for i, c := range calls {
		s[i] = c.String()
	}
	return strings.Join(s, " ")
}

// waitFor polls cond until it holds, failing the test after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// waitCalls waits until the sink has received len(want) calls about rank
// r, then checks they are want: the same trace and, where want has events,
// the same events.
func waitCalls(t testing.TB, s *recSink, r *kvevent.Rank, want []call) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%d sink calls (want %s; have %s)", len(want), trace(want), trace(s.of(r))),
		func() bool { return len(s.of(r)) >= len(want) })
	got := s.of(r)
	if trace(got) != trace(want) {
		t.Fatalf("sink calls:\n got %s\nwant %s", trace(got), trace(want))
	}
	for i := range want {
		if want[i].events != nil && !eventsEqual(got[i].events, want[i].events) {
			t.Fatalf("call %d (%v) events:\n got %s\nwant %s", i, want[i], fmtEvents(got[i].events), fmtEvents(want[i].events))
		}
	}
}

func eventsEqual(a, b []kvevent.Event) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := a[i], b[i]
		if x.Rank != y.Rank || x.EventID != y.EventID || x.Tier != y.Tier || x.Kind != y.Kind ||
			x.HasParent != y.HasParent || x.Parent != y.Parent ||
			!slices.Equal(x.Blocks, y.Blocks) || !slices.Equal(x.Removed, y.Removed) {
			return false
		}
	}
	return true
}

func fmtEvents(es []kvevent.Event) string {
	var b strings.Builder
	b.WriteString("[")
	for i, e := range es {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "{%v %v %v", e.Rank, e.Kind, e.Tier)
		if e.HasParent {
			fmt.Fprintf(&b, " parent=%#x", e.Parent)
		}
		for _, bl := range e.Blocks {
			fmt.Fprintf(&b, " %#x:%#x", bl.EngineHash, bl.LocalHash)
		}
		for _, h := range e.Removed {
			fmt.Fprintf(&b, " -%#x", h)
		}
		b.WriteString("}")
	}
	b.WriteString("]")
	return b.String()
}

// Hand-made msgpack, for the tests that run without Python.

// removedPayload is the batch [ts, [["BlockRemoved", [hash]]], dp]: one
// remove of one device block. Its ts grows with the hash's low bits (the
// batch's sequence, for hashOf), below 2.5: a later batch was published
// later, and a restarted engine's (restarted) later still.
func removedPayload(hash uint64, dp uint32) []byte {
	b := []byte{0x93, 0xcb}
	b = binary.BigEndian.AppendUint64(b, math.Float64bits(1.5+float64(hash%4096)/4096))
	b = append(b, 0x91, 0x92, 0xac)
	b = append(b, "BlockRemoved"...)
	b = append(b, 0x91, 0xcf)
	b = binary.BigEndian.AppendUint64(b, hash)
	b = append(b, 0xce)
	return binary.BigEndian.AppendUint32(b, dp)
}

// hashOf is the block hash removed by the test batch of sequence seq.
func hashOf(seq uint64) uint64 { return 0xab000000 + seq }

func seqFrame(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

// liveMsg is the live message of test batch seq.
func liveMsg(seq uint64) [][]byte {
	return [][]byte{{}, seqFrame(seq), removedPayload(hashOf(seq), 0)}
}

// replyMsg is the replay reply of test batch seq as a DEALER receives it,
// in the [topic, seq, payload] shape, or [seq, payload] when old.
func replyMsg(seq uint64, old bool) [][]byte {
	if old {
		return [][]byte{{}, seqFrame(seq), removedPayload(hashOf(seq), 0)}
	}
	return [][]byte{{}, []byte("kv"), seqFrame(seq), removedPayload(hashOf(seq), 0)}
}

// restartedHash is the block hash removed by batch seq of a restarted
// engine (restartedMsg): above every hashOf.
func restartedHash(seq uint64) uint64 { return 0xcd000000 + seq }

// restartedMsg is the live message, or the replay reply, of batch seq of
// a restarted engine: another hash than liveMsg's, and a later publish
// time than any of the old engine's batches.
func restartedMsg(seq uint64) [][]byte {
	p := removedPayload(restartedHash(seq), 0)
	binary.BigEndian.PutUint64(p[2:10], math.Float64bits(9+float64(seq)/4096))
	return [][]byte{{}, seqFrame(seq), p}
}

// restartedReplay is the replay socket of a restarted engine that has
// published its batches 0 to *top (restartedMsg), all still buffered: it
// records each replay asked for on sink.
func restartedReplay(sink *recSink, top *uint64) replayFunc {
	return func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		sink.add(call{kind: "replay", seq: from})
		for s := from; s <= *top; s++ {
			if !each(restartedMsg(s)) {
				return nil
			}
		}
		each(endMsg)
		return nil
	}
}

// thirdHash is the block hash removed by batch seq of an engine that
// restarted a second time (thirdMsg): neither liveMsg's nor restartedMsg's.
func thirdHash(seq uint64) uint64 { return 0xef000000 + seq }

// thirdMsg is the live message, or the replay reply, of batch seq of an
// engine that restarted after restartedMsg's, published later still.
func thirdMsg(seq uint64) [][]byte {
	p := removedPayload(thirdHash(seq), 0)
	binary.BigEndian.PutUint64(p[2:10], math.Float64bits(30+float64(seq)/4096))
	return [][]byte{{}, seqFrame(seq), p}
}

// heldSince returns the batches the rank holds since the sink's last
// Reset or Resync in calls, each named by its engine (A for liveMsg, B for
// restartedMsg, C for thirdMsg) and its sequence.
func heldSince(calls []call) []string {
	var held []string
	for _, cl := range calls {
		switch cl.kind {
		case "reset", "resync":
			held = held[:0]
		case "ev":
			who := "A"
			switch cl.events[0].Removed[0] {
			case restartedHash(cl.seq):
				who = "B"
			case thirdHash(cl.seq):
				who = "C"
			}
			held = append(held, fmt.Sprintf("%s%d", who, cl.seq))
		}
	}
	return held
}

var endMsg = [][]byte{{}, seqFrame(endSeq), {}}

// removedEvent is the router event of test batch seq.
func removedEvent(r kvevent.Rank, seq uint64) []kvevent.Event {
	return []kvevent.Event{{Rank: r, Kind: kvevent.KindRemoved, Tier: kvevent.TierDevice, Removed: []uint64{hashOf(seq)}}}
}

// newCore returns a subscriber whose core the test drives without sockets.
func newCore(t testing.TB, sink Sink, replay replayFunc) *core {
	t.Helper()
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: sink, Logger: quiet,
		Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	s.core.replay = replay
	return s.core
}

// bg is a context for core calls that never ends.
var bg = context.Background()

// freePorts returns a port p, as a string, such that p to p+n-1 were free
// on the loopback interface a moment ago.
func freePorts(t testing.TB, n int) string {
	t.Helper()
	for range 50 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := l.Addr().(*net.TCPAddr).Port
		ls := []net.Listener{l}
		ok := true
		for i := 1; i < n && ok; i++ {
			li, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if ok = err == nil; ok {
				ls = append(ls, li)
			}
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return strconv.Itoa(base)
		}
	}
	t.Fatalf("no %d consecutive free ports", n)
	return ""
}

// tcpProxy forwards TCP connections between the subscriber and the engine,
// whichever connects. die makes the engine's host vanish the way a crashed
// or partitioned host does: nothing more flows, and no FIN or RST reaches
// the subscriber, whose connection stays open and silent; connections made
// afterwards go to the new target (the engine back, elsewhere). blip cuts
// the connections as a network hiccup does: both peers see them close.
type tcpProxy struct {
	ln     net.Listener
	mu     sync.Mutex
	target string
	open   []net.Conn // pairs: the accepted side, then the dialled one
	wg     sync.WaitGroup
}

func newTCPProxy(t testing.TB, target string) *tcpProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{ln: ln, target: target}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			target := p.target
			p.mu.Unlock()
			u, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.open = append(p.open, c, u)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); io.Copy(u, c) }()
			go func() { defer p.wg.Done(); io.Copy(c, u) }()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		p.mu.Lock()
		for _, c := range p.open {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *tcpProxy) addr() string { return "tcp://" + p.ln.Addr().String() }

// die cuts the engine's side of every connection and leaves the
// subscriber's side open with nothing flowing (a half-open connection);
// later connections go to next.
func (p *tcpProxy) die(next string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = next
	for i := 1; i < len(p.open); i += 2 {
		p.open[i].Close()
	}
}

// blip closes every connection, both sides.
func (p *tcpProxy) blip() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.open {
		c.Close()
	}
	p.open = nil
}

// conns returns how many connections the proxy holds open.
func (p *tcpProxy) conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.open) / 2
}
