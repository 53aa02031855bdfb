package netproxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// waitTimeout bounds every wait of these tests; the conditions they wait
// for hold within milliseconds on loopback.
const waitTimeout = 10 * time.Second

// echoServer is a target that echoes every line back, prefixed with "echo ".
type echoServer struct {
	t        *testing.T
	ln       net.Listener
	accepted atomic.Int64
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
}

func newEchoServer(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &echoServer{t: t, ln: ln, conns: map[net.Conn]struct{}{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			s.mu.Lock()
			s.conns[c] = struct{}{}
			s.mu.Unlock()
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer func() {
					s.mu.Lock()
					delete(s.conns, c)
					s.mu.Unlock()
					c.Close()
				}()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := io.WriteString(c, "echo "+line); err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(s.close)
	return s
}

func (s *echoServer) addr() string { return s.ln.Addr().String() }

// live is how many connections the target holds open.
func (s *echoServer) live() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func (s *echoServer) close() {
	s.ln.Close()
	s.mu.Lock()
	for c := range s.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

func newProxy(t *testing.T, target string) *Proxy {
	t.Helper()
	p, err := New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, waitTimeout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip sends a line and reads the echo.
func roundTrip(c net.Conn, r *bufio.Reader, msg string) (string, error) {
	c.SetDeadline(time.Now().Add(waitTimeout))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, msg+"\n"); err != nil {
		return "", err
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return "", err
	}
	return line[:len(line)-1], nil
}

// broken waits until c's peer closed it: a read returns an error that is
// not the deadline's.
func broken(t *testing.T, c net.Conn, r *bufio.Reader) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(waitTimeout))
	_, err := r.ReadString('\n')
	if err == nil {
		t.Fatal("read a line from a connection that should be closed")
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection still open after %v", waitTimeout)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", waitTimeout, what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestBytesFlowBothWays(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	if p.Target() != s.addr() {
		t.Fatalf("Target() = %s, want %s", p.Target(), s.addr())
	}
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	for i := range 100 {
		msg := fmt.Sprintf("line %d %s", i, string(make([]byte, i*100)))
		got, err := roundTrip(c, r, msg)
		if err != nil {
			t.Fatal(err)
		}
		if got != "echo "+msg {
			t.Fatalf("round trip %d: got %q", i, got[:min(len(got), 40)])
		}
	}
	// A half-close is passed on: the target sees the end of the stream,
	// closes, and the client reads the end of its stream.
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(waitTimeout))
	if b, err := io.ReadAll(r); err != nil || len(b) != 0 {
		t.Fatalf("after the half-close read %q, %v; want the end of the stream", b, err)
	}
	if st := p.Stats(); st.Forwarded != 1 || st.Refused != 0 {
		t.Fatalf("stats %+v, want 1 forwarded", st)
	}
}

func TestCutBreaksLiveConnectionsAndRefusesNew(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	var cs []net.Conn
	var rs []*bufio.Reader
	for i := range 3 {
		c := dial(t, p.Addr())
		r := bufio.NewReader(c)
		if _, err := roundTrip(c, r, fmt.Sprint("hello ", i)); err != nil {
			t.Fatal(err)
		}
		cs, rs = append(cs, c), append(rs, r)
	}
	if n := s.live(); n != 3 {
		t.Fatalf("target holds %d connections, want 3", n)
	}

	p.Cut()
	if !p.IsCut() {
		t.Fatal("IsCut() false after Cut")
	}
	// Both ends of every live connection see it break.
	for i, c := range cs {
		broken(t, c, rs[i])
	}
	waitFor(t, "the target to see its connections closed", func() bool { return s.live() == 0 })

	// A new connection is accepted and closed at once; the target never
	// hears of it.
	before := s.accepted.Load()
	for range 3 {
		c := dial(t, p.Addr())
		r := bufio.NewReader(c)
		io.WriteString(c, "anyone?\n") // may fail: the proxy may have closed it already
		broken(t, c, r)
	}
	if got := s.accepted.Load(); got != before {
		t.Fatalf("the target accepted %d connections during the cut", got-before)
	}
	if st := p.Stats(); st.Forwarded != 3 || st.Refused != 3 {
		t.Fatalf("stats %+v, want 3 forwarded, 3 refused", st)
	}
}

func TestHealRestores(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	p.Cut()
	c := dial(t, p.Addr())
	broken(t, c, bufio.NewReader(c))

	p.Heal()
	if p.IsCut() {
		t.Fatal("IsCut() true after Heal")
	}
	c = dial(t, p.Addr())
	r := bufio.NewReader(c)
	if got, err := roundTrip(c, r, "again"); err != nil || got != "echo again" {
		t.Fatalf("after Heal: %q, %v", got, err)
	}
	// Cut and heal again, with the connection live: it breaks and stays
	// broken, a new one works.
	p.Cut()
	broken(t, c, r)
	p.Heal()
	c = dial(t, p.Addr())
	r = bufio.NewReader(c)
	if got, err := roundTrip(c, r, "once more"); err != nil || got != "echo once more" {
		t.Fatalf("after the second Heal: %q, %v", got, err)
	}
}

func TestUnreachableTargetClosesTheClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close() // nothing listens there now
	p := newProxy(t, dead)
	c := dial(t, p.Addr())
	broken(t, c, bufio.NewReader(c))
}

func TestNewRejectsABadTarget(t *testing.T) {
	if p, err := New("no-port"); err == nil {
		p.Close()
		t.Fatal("New accepted a target without a port")
	}
}

func TestCloseLeaksNothing(t *testing.T) {
	s := newEchoServer(t)
	p, err := New(s.addr())
	if err != nil {
		t.Fatal(err)
	}
	var cs []net.Conn
	var rs []*bufio.Reader
	for i := range 5 {
		c := dial(t, p.Addr())
		r := bufio.NewReader(c)
		if _, err := roundTrip(c, r, fmt.Sprint("hi ", i)); err != nil {
			t.Fatal(err)
		}
		cs, rs = append(cs, c), append(rs, r)
	}
	// One connection half-closed, its other direction still open.
	cs[0].(*net.TCPConn).CloseWrite()

	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	for i, c := range cs {
		broken(t, c, rs[i])
		c.Close()
	}
	if c, err := net.DialTimeout("tcp", p.Addr(), waitTimeout); err == nil {
		c.Close()
		t.Fatal("the closed proxy still accepts connections")
	}
	s.close()
	goleak.VerifyNone(t)
}

// TestCutHealUnderLoad toggles the link while clients connect and talk
// through it (for the race detector): every round trip either completes
// with the right answer or fails; none hangs, none is garbled.
func TestCutHealUnderLoad(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	stop := make(chan struct{})
	var ok atomic.Int64
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				c, err := net.DialTimeout("tcp", p.Addr(), waitTimeout)
				if err != nil {
					t.Error(err)
					return
				}
				r := bufio.NewReader(c)
				for j := range 10 {
					msg := fmt.Sprintf("w%d c%d m%d", w, i, j)
					got, err := roundTrip(c, r, msg)
					if err != nil {
						if errors.Is(err, os.ErrDeadlineExceeded) {
							t.Errorf("round trip hung: %v", err)
						}
						break
					}
					if got != "echo "+msg {
						t.Errorf("got %q for %q", got, msg)
						break
					}
					ok.Add(1)
				}
				c.Close()
			}
		})
	}
	for range 20 {
		before := ok.Load()
		waitFor(t, "round trips through the healed link", func() bool { return ok.Load() >= before+10 })
		p.Cut()
		p.Heal()
	}
	close(stop)
	wg.Wait()
}

// TestFaultsDelayAndResetChunks makes the link lossy: every round trip
// (two chunks, one each way) either comes back whole and at least two
// delays late, or its connection is reset, and about half of the chunks
// are lost. Once the faults are lifted, every round trip comes back.
func TestFaultsDelayAndResetChunks(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	f := Faults{Delay: time.Millisecond, Jitter: 2 * time.Millisecond, ResetProb: 0.5, Seed: seed}
	if err := p.SetFaults(f); err != nil {
		t.Fatal(err)
	}
	const trips = 200
	var ok, failed int
	var c net.Conn
	var r *bufio.Reader
	for i := range trips {
		if c == nil {
			c = dial(t, p.Addr())
			r = bufio.NewReader(c)
		}
		msg := fmt.Sprint("lossy ", i)
		start := time.Now()
		got, err := roundTrip(c, r, msg)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("round trip %d hung: %v", i, err)
			}
			failed++
			c.Close()
			c = nil
			continue
		}
		if got != "echo "+msg {
			t.Fatalf("round trip %d: got %q, want %q", i, got, "echo "+msg)
		}
		if took := time.Since(start); took < 2*f.Delay {
			t.Fatalf("round trip %d took %v, less than two delays of %v", i, took, f.Delay)
		}
		ok++
	}
	// A round trip survives when both of its chunks do: a quarter of them
	// at 0.5 per chunk. The bounds are wide: 200 draws of a quarter land
	// outside them with a probability far below 1e-6.
	if ok < trips/10 || ok > trips/2 {
		t.Fatalf("%d of %d round trips survived a reset probability of 0.5 per chunk; want about a quarter", ok, trips)
	}
	if st := p.Stats(); st.Reset != uint64(failed) {
		t.Fatalf("stats %+v; %d round trips failed, each on a reset", st, failed)
	}

	if err := p.SetFaults(Faults{}); err != nil {
		t.Fatal(err)
	}
	if c == nil {
		c = dial(t, p.Addr())
		r = bufio.NewReader(c)
	}
	for i := range 100 {
		msg := fmt.Sprint("clean ", i)
		if got, err := roundTrip(c, r, msg); err != nil || got != "echo "+msg {
			t.Fatalf("round trip %d without faults: %q, %v", i, got, err)
		}
	}
	t.Logf("%d of %d round trips survived the faults", ok, trips)
}

// TestFaultsKeepLargeTransfersWholeAndInOrder delays every chunk of
// transfers of many chunks each way, without resets: every byte arrives,
// in order.
func TestFaultsKeepLargeTransfersWholeAndInOrder(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	if err := p.SetFaults(Faults{Jitter: time.Millisecond, Seed: 1}); err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	for i := range 5 {
		b := make([]byte, 200<<10)
		for j := range b {
			b[j] = 'a' + byte((i+j)%26)
		}
		msg := string(b)
		got, err := roundTrip(c, r, msg)
		if err != nil || got != "echo "+msg {
			t.Fatalf("transfer %d of %d bytes: %d bytes back, %v", i, len(b), len(got), err)
		}
	}
	if st := p.Stats(); st.Reset != 0 {
		t.Fatalf("stats %+v, want no reset", st)
	}
}

// TestCutClosesALossyLink: faults or not, nothing crosses a cut link.
func TestCutClosesALossyLink(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	if err := p.SetFaults(Faults{Delay: 50 * time.Millisecond, Seed: 2}); err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	r := bufio.NewReader(c)
	if got, err := roundTrip(c, r, "slow"); err != nil || got != "echo slow" {
		t.Fatalf("%q, %v", got, err)
	}
	// A chunk waiting out its delay when the cut comes is not forwarded.
	io.WriteString(c, "late\n")
	p.Cut()
	broken(t, c, r)
	before := s.accepted.Load()
	c = dial(t, p.Addr())
	broken(t, c, bufio.NewReader(c))
	if got := s.accepted.Load(); got != before {
		t.Fatalf("the target accepted %d connections during the cut", got-before)
	}
}

// TestADroppedChunkResetsTheConnection: a chunk the faults drop resets
// its connection (an RST, as a lossy network's dead connection ends), so
// that the sender sees ECONNRESET, not the clean end of stream (a FIN)
// that a peer closing on purpose sends.
func TestADroppedChunkResetsTheConnection(t *testing.T) {
	s := newEchoServer(t)
	p := newProxy(t, s.addr())
	if err := p.SetFaults(Faults{ResetProb: 1, Seed: 3}); err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	if _, err := io.WriteString(c, "lost\n"); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(waitTimeout))
	_, err := c.Read(make([]byte, 16))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("read after a dropped chunk: %v, want ECONNRESET", err)
	}
	if st := p.Stats(); st.Reset != 1 {
		t.Fatalf("stats %+v, want one connection reset", st)
	}
}

func TestSetFaultsRejectsBadFaults(t *testing.T) {
	p := newProxy(t, "127.0.0.1:1")
	for _, f := range []Faults{{ResetProb: -0.1}, {ResetProb: 1.5}, {Delay: -time.Second}, {Jitter: -1}} {
		if err := p.SetFaults(f); err == nil {
			t.Errorf("SetFaults(%+v) accepted", f)
		}
	}
}
