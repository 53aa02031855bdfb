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
// one per every at Warn, which says what it is. A handler's panic is
// logged at Error with its stack; any other line (an accept error, a
// handler's superfluous WriteHeader) at Warn. Without it, net/http logs
// every line through the log package's standard logger, which slog's
// default handler writes at Info.
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
	kind := first
	// The client's address is taken out of the kind wherever it appears
	// (a read error names it again): an IPv6 address has more than
	// digits, which Kind alone would leave a kind of its own per client.
	if addr := remoteAddr(first); addr != "" {
		kind = strings.ReplaceAll(first, addr, "")
	}
	ok, skipped := w.rate.Allow(Kind(kind))
	args := LeftOut(skipped, w.every)
	switch {
	case strings.HasPrefix(first, tlsHandshakePrefix):
		if w.handshakes != nil {
			w.handshakes.Inc()
		}
		if !ok {
			w.l.Debug(first)
			return len(p), nil
		}
		w.l.Warn("a TLS handshake failed: a client that does not speak TLS to this port (plain HTTP, a port scan, a TCP health check) or distrusts its certificate; one line per "+w.every.String()+" at most, every one at debug",
			append([]any{"line", first}, args...)...)
	case !ok:
		// Counted by the limiter, logged with the next of its kind.
	case strings.HasPrefix(first, panicPrefix):
		w.l.Error(first, append(args, "stack", stack)...)
	default:
		w.l.Warn(first, args...)
	}
	return len(p), nil
}

// remoteAddr returns the client's address a line of net/http names, or
// "" for a line that names none.
func remoteAddr(line string) string {
	for _, prefix := range []string{tlsHandshakePrefix, panicPrefix} {
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			addr, _, _ := strings.Cut(rest, ": ")
			return addr
		}
	}
	return ""
}
