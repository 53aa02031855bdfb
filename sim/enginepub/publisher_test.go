package enginepub

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

func newPub(t *testing.T, cfg Config) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:*"
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func socket(t *testing.T, typ zmq.Type) *zmq.Socket {
	t.Helper()
	s, err := zmq.NewSocket(typ)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	if err := s.SetRcvtimeo(100 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// recv receives one message, polling until the deadline.
func recv(t *testing.T, s *zmq.Socket, deadline time.Time) [][]byte {
	t.Helper()
	for time.Now().Before(deadline) {
		m, err := s.RecvMessageBytes(0)
		if err == nil {
			return m
		}
		if zmq.AsErrno(err) != zmq.Errno(syscall.EAGAIN) {
			t.Fatal(err)
		}
	}
	t.Fatal("no message before the deadline")
	return nil
}

func seqOf(b []byte) uint64 { return binary.BigEndian.Uint64(b) }

// A subscriber receives every batch as [topic, seq, payload] with
// consecutive sequence numbers from 0, once WaitSubscribed saw it.
func TestPublishesThreeFramesInSequence(t *testing.T) {
	p := newPub(t, Config{Topic: "kv"})
	sub := socket(t, zmq.SUB)
	if err := sub.SetSubscribe(""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Connect(p.Endpoint()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitSubscribed(ctx, 1); err != nil {
		t.Fatal(err)
	}
	if p.Subscribers() != 1 {
		t.Fatalf("%d subscribers", p.Subscribers())
	}
	deadline := time.Now().Add(10 * time.Second)
	for i := range 5 {
		payload := []byte(fmt.Sprintf("batch %d", i))
		if seq, err := p.Publish(payload); err != nil || seq != uint64(i) {
			t.Fatalf("publish %d: seq %d, %v", i, seq, err)
		}
		m := recv(t, sub, deadline)
		if len(m) != 3 || string(m[0]) != "kv" || len(m[1]) != 8 || seqOf(m[1]) != uint64(i) || !bytes.Equal(m[2], payload) {
			t.Fatalf("message %d: %q", i, m)
		}
	}
	if p.Seq() != 5 {
		t.Fatalf("next seq %d", p.Seq())
	}
}

// A replay returns the kept batches from the sequence asked for, then the
// end marker; a request below what the buffer still holds starts at its
// oldest batch (the overrun a subscriber detects); a malformed request gets
// no answer.
func TestReplayServesTheBoundedBuffer(t *testing.T) {
	p := newPub(t, Config{ReplayEndpoint: "tcp://127.0.0.1:*", Buffer: 4})
	for i := range 10 {
		if _, err := p.Publish([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	d := replayDealer(t, p)
	ask := func(from uint64) []uint64 {
		t.Helper()
		var sf [8]byte
		binary.BigEndian.PutUint64(sf[:], from)
		if _, err := d.SendMessage([]byte{}, sf[:]); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(10 * time.Second)
		var got []uint64
		for {
			m := recv(t, d, deadline)
			if len(m) != 4 || len(m[0]) != 0 || len(m[2]) != 8 {
				t.Fatalf("reply %q: want [\"\", topic, seq, payload]", m)
			}
			s := seqOf(m[2])
			if s == ^uint64(0) {
				if len(m[3]) != 0 {
					t.Fatalf("end marker with a payload %q", m[3])
				}
				return got
			}
			if !bytes.Equal(m[3], []byte{byte(s)}) {
				t.Fatalf("batch %d: payload %q", s, m[3])
			}
			got = append(got, s)
		}
	}
	if got := ask(7); fmt.Sprint(got) != "[7 8 9]" {
		t.Fatalf("replay from 7: %v", got)
	}
	if got := ask(2); fmt.Sprint(got) != "[6 7 8 9]" {
		t.Fatalf("replay from 2 (overrun): %v", got)
	}
	if got := ask(10); len(got) != 0 {
		t.Fatalf("replay from 10: %v", got)
	}
	// One frame too many: refused without an answer; the next good request
	// is still served.
	if _, err := d.SendMessage([]byte{}, []byte{0, 0, 0, 0, 0, 0, 0, 9}, []byte("x")); err != nil {
		t.Fatal(err)
	}
	if got := ask(9); fmt.Sprint(got) != "[9]" {
		t.Fatalf("replay from 9 after a bad request: %v", got)
	}
}

// replayAll asks d for a replay from seq 0 and reads it until the end
// marker or the deadline: the sequences received, the holes among them and
// whether the end marker came.
func replayAll(t *testing.T, d *zmq.Socket, deadline time.Time) (got int, holes []string, ended bool) {
	t.Helper()
	if _, err := d.SendMessage([]byte{}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	next := uint64(0)
	for time.Now().Before(deadline) {
		m, err := d.RecvMessageBytes(0)
		if err != nil {
			if zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN) {
				continue
			}
			t.Fatal(err)
		}
		if len(m) != 4 { // [delimiter, topic, seq, payload]
			t.Fatalf("reply of %d frames", len(m))
		}
		if bytes.Equal(m[2], endSeq) {
			return got, holes, true
		}
		if s := seqOf(m[2]); s != next {
			holes = append(holes, fmt.Sprintf("%d..%d", next, s-1))
			next = s
		}
		next++
		got++
	}
	return got, holes, false
}

// A replay of more batches than the ROUTER's send high-water mark (1,000
// messages) arrives whole, in sequence, with its end marker: the socket
// dropped what overflowed, so a replay of the last 10,000 batches had holes
// and the subscriber resynced the rank.
func TestLongReplayArrivesWholeWithItsEndMarker(t *testing.T) {
	p := newPub(t, Config{ReplayEndpoint: "tcp://127.0.0.1:*"})
	const n = 5000
	payload := bytes.Repeat([]byte{7}, 2048) // a batch of a few stored blocks
	publishN(t, p, n, payload)
	d := replayDealer(t, p)
	got, holes, ended := replayAll(t, d, time.Now().Add(30*time.Second))
	if got != n || len(holes) > 0 || !ended {
		t.Fatalf("replay of %d kept batches: received %d, missing %v, end marker received: %v", n, got, holes, ended)
	}
}

// A subscriber that asks for a long replay and goes away before reading it
// does not hold up the replay socket: the next subscriber's replay arrives
// whole.
func TestReplayToAGoneSubscriberDoesNotBlockTheNext(t *testing.T) {
	p := newPub(t, Config{ReplayEndpoint: "tcp://127.0.0.1:*"})
	const n = 5000
	payload := bytes.Repeat([]byte{7}, 2048)
	publishN(t, p, n, payload)
	gone := replayDealer(t, p)
	if _, err := gone.SendMessage([]byte{}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	// Read one answer, so the request surely arrived, then go.
	if m := recv(t, gone, time.Now().Add(10*time.Second)); len(m) != 4 {
		t.Fatalf("reply of %d frames", len(m))
	}
	if err := gone.Close(); err != nil {
		t.Fatal(err)
	}
	d := replayDealer(t, p)
	got, holes, ended := replayAll(t, d, time.Now().Add(60*time.Second))
	if got != n || len(holes) > 0 || !ended {
		t.Fatalf("replay after a gone subscriber's: received %d of %d, missing %v, end marker received: %v", got, n, holes, ended)
	}
}

// Close does not wait on a replay whose subscriber reads nothing more (its
// queue full, the replay waiting for room).
func TestCloseDoesNotWaitOnAStalledReplay(t *testing.T) {
	p := newPub(t, Config{ReplayEndpoint: "tcp://127.0.0.1:*"})
	payload := bytes.Repeat([]byte{7}, 32<<10) // 64 MiB in all: more than the queues and TCP hold
	publishN(t, p, 2000, payload)
	d := replayDealer(t, p)
	if _, err := d.SendMessage([]byte{}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	if m := recv(t, d, time.Now().Add(10*time.Second)); len(m) != 4 {
		t.Fatalf("reply of %d frames", len(m))
	}
	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Close still waits on the stalled replay")
	}
}

func TestWaitSubscribedEndsWithItsContext(t *testing.T) {
	p := newPub(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := p.WaitSubscribed(ctx, 1); err == nil {
		t.Fatal("no subscriber, yet WaitSubscribed returned nil")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish([]byte("late")); err == nil {
		t.Fatal("publish after Close succeeded")
	}
}

func TestNewRefusesABusyEndpoint(t *testing.T) {
	p := newPub(t, Config{})
	if _, err := New(Config{Endpoint: p.Endpoint()}); err == nil {
		t.Fatal("bound the same endpoint twice")
	}
	if _, err := New(Config{}); err == nil {
		t.Fatal("no endpoint accepted")
	}
}

// publishN publishes payload n times.
func publishN(t *testing.T, p *Publisher, n int, payload []byte) {
	t.Helper()
	for range n {
		if _, err := p.Publish(payload); err != nil {
			t.Fatal(err)
		}
	}
}

// replayDealer returns a DEALER socket connected to p's replay endpoint.
func replayDealer(t *testing.T, p *Publisher) *zmq.Socket {
	t.Helper()
	d := socket(t, zmq.DEALER)
	if err := d.Connect(p.ReplayEndpoint()); err != nil {
		t.Fatal(err)
	}
	return d
}
