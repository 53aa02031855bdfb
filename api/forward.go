package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// forwardLogEvery bounds the Warn lines of failed forwards to one per
// leader address and kind of failure per interval, with how many were left
// out; the others go to Debug. Every write a follower takes while its
// leader's HTTP address cannot be reached fails alike: after a leader's
// kill -9 one follower logged 140 lines in 0.22 s, and a leader whose
// --http-advertise nothing listens on had a line per request for as long
// as it led. kvrouter_http_forwards_total counts every one.
const forwardLogEvery = time.Minute

// logForwardFailed logs a failed forward to the leader at leader, rate-
// limited per leader and kind (forwardLogEvery).
func (s *Server) logForwardFailed(pattern, leader, kind string, err any) {
	args := []any{"route", pattern, "leader", leader, "err", err}
	ok, skipped := s.fwdLog.Allow(leader + "\x00" + kind)
	if !ok {
		s.log.Debug("api forward to the leader failed", args...)
		return
	}
	s.log.Warn("api forward to the leader failed", append(args, lograte.LeftOut(skipped, forwardLogEvery)...)...)
}

// The snapshot routes, which stream for as long as the snapshot takes.
const (
	patternSnapshot   = "GET /v1/snapshot"
	patternRestore    = "POST /v1/snapshot/restore"
	patternRemove     = "DELETE /v1/cluster/members/{id}"
	patternTransfer   = "POST /v1/cluster/leader/transfer"
	patternDeregister = "DELETE /v1/workers/{id}"
)

// forward proxies a write that reached a follower to the leader at
// leaderHTTP (host:port, or a URL) and copies the leader's answer back,
// status, headers, body and trailers, streaming. body is the request body
// as the client sent it (nil: none).
//
// The forward carries HeaderForwarded, so that a leader that lost its
// leadership in the meantime answers 503 instead of forwarding once more:
// at most one hop, whatever the cluster does. It drops the client's
// Idempotency-Key and X-Idempotency-Key headers, which would let the
// transport send the write a second time. A leader that cannot be
// reached is answered 503 no_leader (timeout when the deadline passed
// after the request went out: the write may still apply, and retrying it
// is safe). Each forward is counted in kvrouter_http_forwards_total, sent
// or failed; one whose answer broke off after its status line went out is
// failed, and its http.ErrAbortHandler panic goes on to the server, which
// closes the connection. It returns the forward's outcome (forwardSent or
// forwardFailed).
func (s *Server) forward(w *recorder, r *http.Request, pattern, leaderHTTP string, body io.Reader) string {
	target, err := leaderURL(leaderHTTP, s.opts.ForwardScheme)
	if err != nil {
		s.m.httpForwards.WithLabelValues(pattern, forwardFailed).Inc()
		s.writeError(w, r, &httpError{code: http.StatusServiceUnavailable, reason: ReasonNoLeader,
			err: fmt.Errorf("not the leader, and the leader's address %q is unusable: %v", leaderHTTP, err)})
		return forwardFailed
	}
	ctx := r.Context()
	if pattern != patternSnapshot && pattern != patternRestore { // streams: bounded by the client's deadline only
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.opts.ForwardTimeout)
		defer cancel()
	}
	outcome := forwardSent
	// wrote: the forward's headers went out to the leader (a failed dial,
	// TLS handshake or deadline before them sent nothing).
	var wrote atomic.Bool
	// Of the transport's last attempt (it retries on a new connection
	// when a kept-alive one took nothing; GetConn starts each attempt).
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn:      func(string) { wrote.Store(false) },
		WroteHeaders: func() { wrote.Store(true) },
	})
	// relayed counts the body as the transport takes it: a leader
	// installs only a whole upload, so a restore whose forward broke
	// before the transport took all of it was not applied.
	var relayed *relayedBody
	if body != nil && r.ContentLength != 0 {
		relayed = &relayedBody{r: body, want: r.ContentLength}
		body = relayed
	}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.SetXForwarded()
			pr.Out.Header.Set(HeaderForwarded, "1")
			// With either of these, Go's transport takes a body-less
			// write for safe to replay and sends it again on a new
			// connection when a reused one broke: a second apply. The
			// forward decides about retries itself (HeaderMaybeApplied).
			pr.Out.Header.Del("Idempotency-Key")
			pr.Out.Header.Del("X-Idempotency-Key")
			pr.Out.GetBody = nil
			if body == nil || r.ContentLength == 0 {
				pr.Out.Body, pr.Out.ContentLength = nil, 0
				return
			}
			pr.Out.Body = io.NopCloser(body)
			pr.Out.ContentLength = r.ContentLength // -1 (chunked) when the client did not say
		},
		Transport: s.transport,
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Set(HeaderForwardedTo, target.Host)
			return nil
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			outcome = forwardFailed
			// The leader may have the write (a restore: the whole upload).
			maybeApplied := wrote.Load() && (pattern != patternRestore || relayed.whole())
			reason := ReasonNoLeader
			switch {
			case r.Context().Err() != nil && errors.Is(r.Context().Err(), context.Canceled):
				reason = ReasonCanceled // the client went away: the leader was not at fault
			case errors.Is(err, context.DeadlineExceeded) && maybeApplied:
				// timeout says the write may still apply. A deadline that
				// passed before the request went out (a dial to a leader
				// that drops SYNs: Go's dial timeout is a
				// DeadlineExceeded too) sent nothing: no_leader, which
				// sends the client on to another node.
				reason = ReasonTimeout
			}
			s.logForwardFailed(pattern, target.Host, reason, err)
			if rec, ok := w.(*recorder); ok && rec.wrote {
				return // the leader's answer broke off half-way; nothing more to say
			}
			if readErr := relayed.readErr(); readErr != nil && reason != ReasonCanceled {
				// The client's body stopped the forward (its framing, its
				// size): no fault of the leader's, and sent to another
				// node it fails again (not no_leader). Answered as this
				// node answers the body itself.
				if pattern == patternRestore {
					err = uploadError(readErr)
				} else {
					err = bodyError(readErr)
				}
				s.writeError(w, r, err)
				return
			}
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				// This node's own body limit stopped the forward: the
				// body can never be taken, by any node (not no_leader,
				// which sends the client on to the next one).
				s.writeError(w, r, err)
				return
			}
			if maybeApplied {
				w.Header().Set(HeaderMaybeApplied, "true")
			}
			s.writeError(w, r, &httpError{code: http.StatusServiceUnavailable, reason: reason,
				err: fmt.Errorf("forward to the leader at %s: %w", target.Host, err)})
		},
		ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	defer func() {
		// The proxy aborts an answer that broke off after its status line
		// went out (a snapshot stream whose leader died) with a panic of
		// http.ErrAbortHandler, which the server turns into a closed
		// connection: count it failed, and let the panic go on.
		if p := recover(); p != nil {
			s.m.httpForwards.WithLabelValues(pattern, forwardFailed).Inc()
			if p == http.ErrAbortHandler { // any other panic is logged by the handler's recover
				s.logForwardFailed(pattern, target.Host, "broke_off", "relaying the answer broke off half-way")
			}
			panic(p)
		}
		s.m.httpForwards.WithLabelValues(pattern, outcome).Inc()
	}()
	proxy.ServeHTTP(w, r.WithContext(ctx))
	return outcome
}

// relayedBody is a forward's request body that tells whether the
// transport took all of it. The transport reads it in its own goroutine,
// which may still run when the forward's error is handled.
type relayedBody struct {
	r    io.Reader
	want int64 // the body's length; -1 when the client did not say
	n    atomic.Int64
	eof  atomic.Bool
	err  atomic.Pointer[error] // the first read error but io.EOF: the client's body's
}

func (b *relayedBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.n.Add(int64(n))
	if err == io.EOF {
		b.eof.Store(true)
	} else if err != nil {
		b.err.CompareAndSwap(nil, &err)
	}
	return n, err
}

// readErr is the first error reading the client's body gave the forward
// (io.EOF aside); nil: none, or a nil relayedBody (no body).
func (b *relayedBody) readErr() error {
	if b == nil {
		return nil
	}
	if e := b.err.Load(); e != nil {
		return *e
	}
	return nil
}

// whole reports whether the transport took the whole body: the leader
// cannot have had all of it before that. Every byte is counted before the
// transport writes it. A nil relayedBody (no body) is whole.
func (b *relayedBody) whole() bool {
	return b == nil || b.eof.Load() || (b.want >= 0 && b.n.Load() >= b.want)
}

// leaderURL turns a member's HTTP address into the base URL to forward to;
// a host:port is reached by scheme. A host:port is checked by the rule the
// members API and kvrouter --http-advertise check it by
// (raftfsm.CheckHTTPAddr), so that every address the member table takes
// is one a follower forwards to: a host name or an IP (an IPv6 one in
// brackets, its zone as written: [fe80::1%eth0]:7080), which a URL reads
// back as the same host.
func leaderURL(addr, scheme string) (*url.URL, error) {
	var u *url.URL
	if strings.Contains(addr, "://") {
		var err error
		if u, err = url.Parse(addr); err != nil {
			return nil, err
		}
	} else {
		u = &url.URL{Scheme: scheme, Host: addr}
	}
	if u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("want host:port or an http(s) URL")
	}
	// A wildcard reaches this node's own host (this node, when it listens
	// on that port), not the leader: a member table written before
	// kvrouter refused one as the advertised HTTP address.
	if ip, err := netip.ParseAddr(u.Hostname()); err == nil && ip.WithZone("").Unmap().IsUnspecified() {
		return nil, fmt.Errorf("a wildcard host, which reaches this node's own host: restart the leader with --http-advertise, the address the other nodes reach it at")
	}
	if u.Host == addr {
		if err := raftfsm.CheckHTTPAddr(addr); err != nil {
			return nil, err
		}
	}
	return &url.URL{Scheme: u.Scheme, Host: u.Host}, nil
}
