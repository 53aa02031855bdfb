package lograte

import (
	"crypto/rand"
	"encoding/binary"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestHTTPServerLogSummarizesHandshakeErrors: net/http's line per failed
// TLS handshake, from clients at many addresses (IPv6 ones too), for
// whatever reason, is counted each time, logged at Warn once per interval
// with how many were left out, and at Debug otherwise; every panic is
// logged at Error with its stack.
func TestHTTPServerLogSummarizesHandshakeErrors(t *testing.T) {
	var logs testlog.Buffer
	c := &clock{now: time.Unix(1_700_000_000, 0)}
	handshakes := prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "x"})
	l := newHTTPServerLog(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		New(time.Minute, c.read), time.Minute, handshakes)

	for _, addr := range []string{"10.0.0.1:50000", "[2001:db8::1]:443", "[2001:db8::abcd]:1", "10.0.0.2:7"} {
		l.Printf("http: TLS handshake error from %s: client sent an HTTP request to an HTTPS server", addr)
	}
	l.Printf("http: TLS handshake error from %s: EOF", "[::1]:9")
	l.Printf("http: panic serving %s: boom\ngoroutine 7 [running]:\nmain.f()", "[::1]:9")
	l.Printf("http: panic serving %s: boom\ngoroutine 8 [running]:\nmain.f()", "10.0.0.1:1")
	c.add(time.Minute)
	l.Printf("http: TLS handshake error from %s: client sent an HTTP request to an HTTPS server", "[fe80::2]:3")

	var m dto.Metric
	if err := handshakes.Write(&m); err != nil || m.GetCounter().GetValue() != 6 {
		t.Errorf("handshake errors counted: %v (%v), want 6", m.GetCounter().GetValue(), err)
	}
	lines := logs.Lines()
	want := [][]string{
		{"level=WARN", "a TLS handshake failed", "10.0.0.1:50000", "client sent an HTTP request"},
		{"level=ERROR", "http: panic serving [::1]:9: boom", "goroutine 7"},
		{"level=ERROR", "http: panic serving 10.0.0.1:1: boom", "goroutine 8"},
		{"level=WARN", "a TLS handshake failed", "[fe80::2]:3", "left_out=\"4 more like it"},
	}
	if len(lines) != len(want) {
		t.Fatalf("logged %d lines, want %d:\n%s", len(lines), len(want), logs.String())
	}
	for i, l := range lines {
		for _, w := range want[i] {
			if !strings.Contains(l, w) {
				t.Errorf("line %d: %s\nwant it to hold %q", i+1, l, w)
			}
		}
	}
}

// TestHTTPServerLogKeepsOverflowAtDebug: other lines a client varies past
// the limiter's kinds are still logged, at Debug, when held back in the
// overflow kind, not only counted.
func TestHTTPServerLogKeepsOverflowAtDebug(t *testing.T) {
	var logs testlog.Buffer
	c := &clock{now: time.Unix(1_700_000_000, 0)}
	l := newHTTPServerLog(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		New(time.Minute, c.read), time.Minute, nil)
	for i := range maxKinds + 2 {
		l.Printf("http: odd line %s", strings.Repeat("x", i+1))
	}
	l.Printf("http: Accept error: too many open files")
	if got := logs.Lines("level=WARN"); len(got) != maxKinds+1 {
		t.Errorf("%d Warn lines, want %d (each kept kind's first, then one of the overflow)", len(got), maxKinds+1)
	}
	if got := logs.Lines("level=DEBUG", "Accept error"); len(got) != 1 {
		t.Fatalf("an accept error held back in the overflow kind: %d Debug lines of it, want 1:\n%s", len(got), logs.String())
	}
}

// clientHello returns a TLS record holding a ClientHello whose only
// supported_versions entry is v.
func clientHello(v uint16) []byte {
	var body []byte
	body = append(body, 3, 3)
	r := make([]byte, 32)
	rand.Read(r)
	body = append(body, r...)
	body = append(body, 0)             // session id
	body = append(body, 0, 2, 0x13, 1) // cipher suites
	body = append(body, 1, 0)          // compression
	ext := []byte{0, 0x2b, 0, 3, 2, byte(v >> 8), byte(v)}
	body = binary.BigEndian.AppendUint16(body, uint16(len(ext)))
	body = append(body, ext...)
	hs := append([]byte{1, 0, byte(len(body) >> 8), byte(len(body))}, body...)
	rec := append([]byte{0x16, 3, 1}, byte(len(hs)>>8), byte(len(hs)))
	return append(rec, hs...)
}

// TestAClientCannotHideAHandlersPanic: a client that offers TLS versions
// spelled in hex letters ("client offered only unsupported versions:
// [abcd]") makes a kind of line per version, which lograte.Kind keeps
// (letters are not folded). 300 of them fill the limiter's 256 kinds; a
// handler's panic that comes next, its first, shares the overflow kind
// and is logged nowhere, not even at Debug. A handshake's failures are
// now one kind, whatever the reason, and a panic is never held back.
func TestAClientCannotHideAHandlersPanic(t *testing.T) {
	var logs testlog.Buffer
	handshakes := prometheus.NewCounter(prometheus.CounterOpts{Name: "x_total", Help: "x"})
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { panic("boom") }))
	srv.Config.ErrorLog = HTTPServerLog(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})), time.Minute, handshakes)
	srv.StartTLS()
	defer srv.Close()
	addr := srv.Listener.Addr().String()
	for i := range 300 {
		v := uint16(0)
		for j, k := 0, i; j < 4; j, k = j+1, k/6 {
			v = v<<4 | uint16(10+k%6)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		c.Write(clientHello(v))
		c.Read(make([]byte, 64))
		c.Close()
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(logs.Lines("unsupported versions")) < 300 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	resp, err := srv.Client().Get(srv.URL)
	if err == nil {
		resp.Body.Close()
	}
	deadline = time.Now().Add(5 * time.Second)
	for len(logs.Lines("level=ERROR", "panic serving")) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := logs.Lines("level=ERROR", "panic serving"); len(got) == 0 {
		t.Fatalf("after 300 failed TLS handshakes offering versions in hex letters, the handler's first panic was not logged at Error; Warn lines: %d", len(logs.Lines("level=WARN")))
	}
	if got := logs.Lines("level=WARN", "a TLS handshake failed"); len(got) != 1 {
		t.Errorf("300 failed TLS handshakes of as many reasons: %d Warn lines, want 1 (one kind, whatever the reason)", len(got))
	}
}
