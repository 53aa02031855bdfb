// Package natswatch logs a daemon's NATS client connection as it comes
// and goes, and ends the daemon when nats.go closes it for good: kvagent's
// connection, and kvrouter's to an external NATS (--nats-url).
//
// Invariant: nats.go retries a lost connection for ever
// (eventplane.ClientOptions), except after the server refused the
// credentials twice in a row, when it closes the connection for good. A
// daemon that can then publish or hear nothing must not run on, looking
// healthy to its supervisor: a close the owner did not ask for
// (Watch.Closing) ends it with ErrClosed. nats.go never gives up on a
// credentials file that holds no credentials when it reads it again (it
// held them at the start): that ends the daemon too, with ErrCreds
// (Watch.CredsError, the connection's OnCredsError). ErrorHandler counts
// a subscription that falls behind, for any connection, and logs it at
// most once per slowLogEvery.
package natswatch

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
)

// ErrClosed ends a daemon whose NATS connection closed for good.
var ErrClosed = errors.New("the NATS connection closed for good (nats.go gives up after the server refuses the credentials twice in a row)")

// ErrCreds ends a daemon whose credentials file holds none when a
// connection is made again, which nats.go would retry for ever.
var ErrCreds = errors.New("the NATS credentials file cannot be used (it held credentials when the daemon started)")

// Ended is the cause of ctx when a Watch ended it (ErrClosed or
// ErrCreds: the daemon stops with it, an error), nil otherwise (a
// signal, or the owner's own end).
func Ended(ctx context.Context) error {
	if cause := context.Cause(ctx); errors.Is(cause, ErrClosed) || errors.Is(cause, ErrCreds) {
		return cause
	}
	return nil
}

// Watch logs a connection made with its Options and its ErrorHandler.
// Only the first failure of a run of them is logged (at Warn), and the
// first refusal of the credentials in the run; the connection made, or
// made again, ends the run (Info).
type Watch struct {
	log   *slog.Logger
	lost  context.CancelCauseFunc
	texts Texts

	now     func() time.Time
	every   time.Duration // Remind's interval: RemindEvery, but in tests
	failing atomic.Bool   // a failure was logged, and no connection made since
	refused atomic.Bool   // a refusal of the credentials was logged, and no connection made since
	closing atomic.Bool   // the owner closes the connection: its close is no failure
	badCred atomic.Bool   // CredsError's stop logged
	// downSince is when the connection was last lost (UnixNano), or the
	// Watch made (never connected yet); 0 while it is up.
	downSince atomic.Int64

	credsMu   sync.Mutex
	credsFrom time.Time // the first of CredsError's run of failures, zero when none
	credsRun  int       // its failures, 0 since a try that read the file whole
}

// credsGrace and credsTries are how long, and how many tries in a row,
// the credentials file must fail before CredsError stops the daemon: an
// operator's rewrite of the file that is not atomic (rm then cp, an
// editor's truncate and write) can race a reconnect, and the next try
// reads it whole. A run ends with a try that read the file whole: a
// connection made, or the server's refusal of the credentials (which it
// can only refuse once they were read and sent: credsWhole).
const (
	credsGrace = 5 * time.Second
	credsTries = 3
)

// Texts are what a Watch's log lines say of the daemon.
type Texts struct {
	// Who names the daemon in its log ("the agent", "the node").
	Who string
	// Unreachable says what to check when NATS cannot be reached.
	Unreachable string
	// Lost says what waits while the connection is down.
	Lost string
}

// New returns a Watch that logs to log and calls lost with ErrClosed
// (wrapping the connection's last error) when the connection closes for
// good without the owner's Closing.
func New(log *slog.Logger, lost context.CancelCauseFunc, texts Texts) *Watch {
	w := &Watch{log: log, lost: lost, texts: texts, now: time.Now, every: RemindEvery}
	w.downSince.Store(w.now().UnixNano())
	return w
}

// Closing marks the owner's own close of the connection, which is then
// neither a loss nor an end: call it before nats.Conn.Close.
func (w *Watch) Closing() { w.closing.Store(true) }

// CredsError is the connection's eventplane.ClientOptions.OnCredsError:
// a credentials file gone bad since the daemon's start fails every try,
// and nats.go never gives up on it, so the daemon stops (lost, with
// ErrCreds wrapping err), as when the server refuses the credentials,
// once the file has failed credsTries tries in a row over credsGrace at
// least (a rewrite of the file racing a try fails that one alone; a try
// that read the file whole, connected or refused, ends the run). The
// first failure of a run is logged at Warn, the stop at Error, once.
func (w *Watch) CredsError(err error) {
	now := w.now()
	w.credsMu.Lock()
	if w.credsRun == 0 {
		w.credsFrom = now
	}
	w.credsRun++
	first, stop := w.credsRun == 1, w.credsRun >= credsTries && now.Sub(w.credsFrom) >= credsGrace
	w.credsMu.Unlock()
	if first {
		w.log.Warn(fmt.Sprintf("the --nats-creds file holds no credentials; retrying (%s stops if it stays so for %v)", w.texts.Who, credsGrace), "err", err)
	}
	if !stop {
		return
	}
	if w.badCred.CompareAndSwap(false, true) {
		w.log.Error(fmt.Sprintf("the --nats-creds file holds no credentials: %s stops", w.texts.Who), "err", err)
	}
	w.lost(fmt.Errorf("%w: %v", ErrCreds, err))
}

// credsWhole ends CredsError's run of failures: a try read the file
// whole (a connection was made, or the server refused the credentials).
func (w *Watch) credsWhole() {
	w.credsMu.Lock()
	w.credsRun = 0
	w.credsMu.Unlock()
}

// refusal logs the server's refusal of the credentials, once per run of
// failures (a refusal after a try that could not reach NATS, or after
// the connection was lost, is logged too: it says what to fix). A refusal
// by the server ends CredsError's run (the try read the file whole); a
// creds file nats.go could not use, which Refused takes too, does not.
func (w *Watch) refusal(err error) {
	if serverRefused(err) {
		w.credsWhole()
	}
	w.failing.Store(true)
	if w.refused.CompareAndSwap(false, true) {
		w.log.Warn(fmt.Sprintf("NATS refused %s's credentials; retrying (check --nats-user, --nats-password, --nats-creds)", w.texts.Who), "err", err)
	}
}

// ErrorHandler is ErrorHandler's for the Watch's connection, which it
// takes instead: the server's refusal of the credentials as the
// connection is made again is logged as such (refusal). nats.go reports
// that refusal only to the asynchronous error handler
// (nats.ErrAuthorization, ErrAuthExpired, ErrAuthRevoked), not to
// ReconnectErrHandler, which sees it only for the first connection.
func (w *Watch) ErrorHandler(slow prometheus.Counter) nats.Option {
	h := newErrorHandler(w.log, slow, time.Now)
	h.refused = w.refusal
	return nats.ErrorHandler(h.handle)
}

// RemindEvery is how often Remind logs a connection that is down.
const RemindEvery = 30 * time.Second

// Remind logs at Error, every RemindEvery until ctx ends, that the
// connection is down (never made yet, or lost) and for how long: the
// Warn of a run of failures is logged once, and a wrong --nats-url
// would otherwise leave a daemon running that hears nothing, one line
// at its start telling.
func (w *Watch) Remind(ctx context.Context) {
	t := time.NewTicker(w.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			w.remind()
		}
	}
}

// remind is Remind's line, logged while the connection is down.
func (w *Watch) remind() {
	since := w.downSince.Load()
	if since == 0 || w.closing.Load() {
		return
	}
	w.log.Error(fmt.Sprintf("no NATS connection: %s (%s)", strings.TrimSuffix(w.texts.Lost, ","), w.texts.Unreachable),
		"for", w.now().Sub(time.Unix(0, since)).Round(time.Second))
}

// Connected reports whether the connection is up (made, and not lost
// since).
func (w *Watch) Connected() bool { return w.downSince.Load() == 0 }

// Options are the connection's handlers, to pass to nats.Connect.
func (w *Watch) Options() []nats.Option {
	return []nats.Option{
		nats.ConnectHandler(func(nc *nats.Conn) {
			w.failing.Store(false)
			w.refused.Store(false)
			w.credsWhole()
			w.downSince.Store(0)
			// Not nc.ConnectedUrlRedacted: it hides a password only, and
			// shows a token given as the URL's user (nats://TOKEN@host).
			w.log.Info("connected to NATS", "url", eventplane.RedactURLs(nc.ConnectedUrl()))
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) {
			// Each try that fails: the first connection's (with
			// nats.RetryOnFailedConnect), and a lost one's (every 250 ms).
			if Refused(err) {
				w.refusal(err)
			} else if w.failing.CompareAndSwap(false, true) {
				w.log.Warn(fmt.Sprintf("cannot reach NATS; retrying until it answers (%s)", w.texts.Unreachable), "err", err)
			}
		}),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if w.closing.Load() {
				return
			}
			w.failing.Store(true)
			w.downSince.CompareAndSwap(0, w.now().UnixNano())
			w.log.Warn(fmt.Sprintf("lost the NATS connection; reconnecting (%s until it is back)", w.texts.Lost), "err", err)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			w.failing.Store(false)
			w.refused.Store(false)
			w.credsWhole()
			w.downSince.Store(0)
			w.log.Info("reconnected to NATS", "url", eventplane.RedactURLs(nc.ConnectedUrl()))
		}),
		nats.ClosedHandler(func(nc *nats.Conn) {
			if w.closing.Load() {
				return
			}
			w.log.Error(fmt.Sprintf("the NATS connection is closed for good: %s stops", w.texts.Who), "err", nc.LastError())
			w.lost(fmt.Errorf("%w: %v", ErrClosed, nc.LastError()))
		}),
	}
}

// slowLogEvery is how often ErrorHandler logs a subscription that stays
// behind: at most a line per this, per subscription. nats.go reports a
// slow consumer again as soon as the subscription has taken one message
// since its last report, so one that stays behind (its handler slower
// than what comes) is reported about once per message it takes: hundreds
// of lines a second, unlimited.
const slowLogEvery = 10 * time.Second

// ErrorHandler is the connection's handler of asynchronous errors, to
// pass to nats.Connect (for any connection: the embedded server's too). A
// subscription that fell behind, whose messages the client dropped
// (nats.ErrSlowConsumer: events not ingested, heartbeats not answered),
// is counted in slow at each of nats.go's reports, and logged at Warn
// with its subject and the messages it dropped since its last line (all
// so far, at its first), at most once per slowLogEvery: nats.go reports
// it again each time the subscription has taken a message since, so one
// that stays behind is reported (and counted) about once per message it
// takes. Other errors (a permission the server denied) are logged at
// Warn. nats.go's default handler wrote them to stderr, outside the log,
// and counted nothing.
func ErrorHandler(log *slog.Logger, slow prometheus.Counter) nats.Option {
	return nats.ErrorHandler(newErrorHandler(log, slow, time.Now).handle)
}

// errorHandler is ErrorHandler's state: the last line of each
// subscription that fell behind.
type errorHandler struct {
	log  *slog.Logger
	slow prometheus.Counter
	now  func() time.Time
	// refused, when set, takes the server's refusals of the credentials
	// (Watch.ErrorHandler).
	refused func(error)

	mu     sync.Mutex
	logged map[*nats.Subscription]slowLine
}

// slowLine is the last line logged of a subscription that fell behind:
// when, and its count of dropped messages then.
type slowLine struct {
	at      time.Time
	dropped int
}

func newErrorHandler(log *slog.Logger, slow prometheus.Counter, now func() time.Time) *errorHandler {
	return &errorHandler{log: log, slow: slow, now: now, logged: make(map[*nats.Subscription]slowLine)}
}

func (h *errorHandler) handle(_ *nats.Conn, sub *nats.Subscription, err error) {
	subject := ""
	if sub != nil {
		subject = sub.Subject
	}
	if h.refused != nil && serverRefused(err) {
		h.refused(err)
		return
	}
	if errors.Is(err, nats.ErrSlowConsumer) {
		h.slow.Inc()
		if sub == nil {
			h.log.Warn("a NATS subscription fell behind: messages dropped until it catches up", "err", err)
			return
		}
		dropped, _ := sub.Dropped()
		now := h.now()
		h.mu.Lock()
		last, seen := h.logged[sub]
		if seen && now.Sub(last.at) < slowLogEvery {
			h.mu.Unlock()
			return
		}
		h.logged[sub] = slowLine{at: now, dropped: dropped}
		// Subscriptions gone since their last line are forgotten: a
		// daemon that subscribes anew keeps no line of each.
		for s := range h.logged {
			if !s.IsValid() {
				delete(h.logged, s)
			}
		}
		h.mu.Unlock()
		h.log.Warn("a NATS subscription fell behind: messages dropped until it catches up", "subject", subject,
			"dropped", dropped-last.dropped, "dropped_total", dropped, "err", err)
		return
	}
	h.log.Warn("NATS reported an error", "subject", subject, "err", err)
}

// serverRefused reports whether err is the server's refusal of the
// credentials: the asynchronous error's (nats.ErrAuthorization, ...), or
// the -ERR a try's own error carries (errors.Is takes "authorization
// violation" as nats.ErrAuthorization).
func serverRefused(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked)
}

// Refused reports whether a NATS connection error is the credentials'
// fault (the server refusing them, or a creds file nats.go cannot use),
// not a server out of reach.
func Refused(err error) bool {
	s := strings.ToLower(err.Error())
	return strings.Contains(s, "authorization") || strings.Contains(s, "authentication") || strings.Contains(s, "nkeys:")
}
