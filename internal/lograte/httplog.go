package lograte

import (
	"log"
	"log/slog"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// What net/http's server logs (its ErrorLog) begins with, where a line
// names the client's address: "<prefix><addr>: <rest>".
const (
	tlsHandshakePrefix = "http: TLS handshake error from "
	panicPrefix        = "http: panic serving "
)

// HTTPServerLog returns an http.Server's ErrorLog that writes net/http's
// lines to l, rate-limited per kind (the line, the client's address taken
// out, its numbers folded: Kind) to one per every, with how many were
// left out (LeftOut).
//
// A failed TLS handshake (a plain-HTTP client, a port scan, a load
// balancer's TCP check) is a line per connection, at the client's rate:
// each is counted in handshakes (when not nil) and logged at Debug, and
// one per every at Warn, which says what it is; all are one kind, whatever
// their reason (crypto/tls's reasons quote what the client offered, in
// hex: a kind per reason would let a client fill the limiter). A
// handler's panic is logged at Error with its stack, every one: it is a
// bug of ours, rare, and the only trace of it. Any other line (an accept
// error, a handler's superfluous WriteHeader) is logged at Warn, rate-
// limited, and when it is held back in the limiter's overflow kind (a
// client varied its lines past maxKinds) at Debug. Without it, net/http
// logs every line through the log package's standard logger, which
// slog's default handler writes at Info.
func HTTPServerLog(l *slog.Logger, every time.Duration, handshakes prometheus.Counter) *log.Logger {
	return newHTTPServerLog(l, New(every, nil), every, handshakes)
}

func newHTTPServerLog(l *slog.Logger, rate *Limiter, every time.Duration, handshakes prometheus.Counter) *log.Logger {
	return log.New(&httpWriter{l: l, rate: rate, every: every, handshakes: handshakes}, "", 0)
}

// httpWriter takes net/http's lines, one per Write (log.Logger writes
// each whole).
type httpWriter struct {
	l          *slog.Logger
	rate       *Limiter
	every      time.Duration
	handshakes prometheus.Counter
}

func (w *httpWriter) Write(p []byte) (int, error) {
	line := strings.TrimSuffix(string(p), "\n")
	first, stack, _ := strings.Cut(line, "\n") // a panic's stack follows its first line
	switch {
	case strings.HasPrefix(first, panicPrefix):
		// Not rate-limited: a limiter's kinds filled by a client's lines
		// (or a panic of another kind within the minute) would otherwise
		// hide it.
		w.l.Error(first, "stack", stack)
		return len(p), nil
	case strings.HasPrefix(first, tlsHandshakePrefix):
		if w.handshakes != nil {
			w.handshakes.Inc()
		}
		ok, skipped := w.rate.Allow(tlsHandshakePrefix)
		if !ok {
			w.l.Debug(first)
			return len(p), nil
		}
		w.l.Warn("a TLS handshake failed: a client that does not speak TLS to this port (plain HTTP, a port scan, a TCP health check) or distrusts its certificate; one line per "+w.every.String()+" at most, every one at debug",
			append([]any{"line", first}, LeftOut(skipped, w.every)...)...)
		return len(p), nil
	}
	ok, skipped, overflowed := w.rate.Check(Kind(first))
	switch {
	case ok:
		w.l.Warn(first, LeftOut(skipped, w.every)...)
	case overflowed:
		w.l.Debug(first)
	}
	// Else counted by the limiter, logged with the next of its kind.
	return len(p), nil
}
