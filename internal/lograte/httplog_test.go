package lograte

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestHTTPServerLogSummarizesHandshakeErrors: net/http's line per failed
// TLS handshake, from clients at many addresses (IPv6 ones too), is
// counted each time, logged at Warn once per interval with how many were
// left out, and at Debug otherwise; a panic is logged at Error with its
// stack, and other lines at Warn, each kind held back alike.
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
		{"level=WARN", "a TLS handshake failed", "EOF"},
		{"level=ERROR", "http: panic serving [::1]:9: boom", "goroutine 7"},
		{"level=WARN", "a TLS handshake failed", "[fe80::2]:3", "left_out=\"3 more like it"},
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
