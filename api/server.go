package api

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"reflect"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/internal/httpbody"
	"github.com/kvrouter/kvrouter/internal/httppath"
	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/kvrouter/kvrouter/internal/strictkeys"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Headers the API sets or reads.
const (
	// HeaderForwarded marks a request that a follower forwarded to the
	// leader; a node that is not the leader answers it 503 no_leader
	// instead of forwarding it again.
	HeaderForwarded = "X-Kvrouter-Forwarded"
	// HeaderForwardedTo, on a response, names the leader that answered a
	// forwarded request.
	HeaderForwardedTo = "X-Kvrouter-Forwarded-To"

	// HeaderMaybeApplied, on a 503 no_leader answer to a forwarded
	// write, says that the forward failed after it may have reached the
	// leader (not while dialing it; for a restore, after the whole upload
	// was relayed): the write may apply. So it does on a 503 no_leader
	// or shutting_down answer to a write not safe twice (HandleFuncOnce)
	// whose node lost its leadership or closed with it in its log. A
	// client sends a write that is not safe to send twice to no other
	// node then.
	HeaderMaybeApplied = "X-Kvrouter-Maybe-Applied"

	// Trailers of GET /v1/snapshot: known only once the stream is written.
	TrailerSnapshotIndex   = "X-Kvrouter-Snapshot-Index"
	TrailerSnapshotTerm    = "X-Kvrouter-Snapshot-Term"
	TrailerSnapshotSHA256  = "X-Kvrouter-Snapshot-Sha256"
	TrailerSnapshotBytes   = "X-Kvrouter-Snapshot-Bytes"
	TrailerSnapshotVersion = "X-Kvrouter-Snapshot-Format-Version"
	// TrailerError is set when a stream failed after its status was sent;
	// its content is incomplete and must be thrown away.
	TrailerError = "X-Kvrouter-Error"
	// TrailerErrorReason is the failure's reason, as in an error body.
	TrailerErrorReason = "X-Kvrouter-Error-Reason"
)

// Defaults of Options.
const (
	DefaultMaxBodyBytes   = 32 << 20
	DefaultForwardTimeout = 30 * time.Second
	DefaultBodyTimeout    = 30 * time.Second
)

// Options configure a Server. The zero value works.
type Options struct {
	// Logger gets one line per failed request (Debug for 4xx and 503, Error
	// for 500) and per forward failure. Default: slog.Default().
	Logger *slog.Logger
	// Registerer gets the API's metrics; Gatherer serves GET /metrics.
	// When both are nil a fresh registry serves both; when only one is set
	// the other defaults to it where it can (a *prometheus.Registry is
	// both).
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer
	// MaxBodyBytes bounds a JSON body (413 above it), and how much of a
	// snapshot upload a follower keeps to forward it. Default
	// DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// MaxSnapshotBytes bounds a snapshot upload. 0: no limit.
	MaxSnapshotBytes int64
	// ForwardTimeout bounds a request forwarded to the leader (snapshot
	// downloads and uploads are bounded by their client only). Default DefaultForwardTimeout.
	ForwardTimeout time.Duration
	// BodyTimeout bounds how long reading a request's body may take,
	// whether a handler reads it or net/http drains it unread (snapshot
	// uploads are bounded by their client only): a client that sends its
	// headers and stalls its body holds no handler, and no connection,
	// past it. Default DefaultBodyTimeout.
	BodyTimeout time.Duration
	// ForwardTransport carries forwarded requests. Default: a clone of
	// http.DefaultTransport, closed by Server.Close.
	ForwardTransport http.RoundTripper
	// ForwardScheme is the scheme of a leader whose HTTP address is
	// host:port: "http" (default) or "https", when the cluster's nodes
	// serve TLS (ForwardTransport then trusts their certificates).
	ForwardScheme string
	// Token, when set, is the bearer token every request must carry
	// ("Authorization: Bearer <token>"), except GET /healthz, /readyz and
	// /metrics, which probes and scrapers reach without one. A request
	// without it, or with another, is answered 401 unauthorized. A
	// forward to the leader carries the client's header on, so every node
	// of a cluster has the same token.
	Token string
	// NATSConnected, when set, says whether the node's NATS connection is
	// up, shown in /readyz's body (ReadyResponse.NATS); readiness does not
	// depend on it.
	NATSConnected func() bool
}

// Server is the HTTP API of one node. It is an http.Handler; Close it to
// drop the idle connections of its forwarding transport.
type Server struct {
	b         Backend
	opts      Options
	log       *slog.Logger
	mux       *http.ServeMux
	m         *metrics
	transport http.RoundTripper
	ownTransp *http.Transport    // closed by Close; nil when the caller gave one
	tokenSum  *[sha256.Size]byte // of Options.Token; nil: no token asked
	fwdLog    *lograte.Limiter   // failed forwards' Warn lines (logForwardFailed)

	checksMu   sync.Mutex
	checks     []func(raftfsm.WorkerInfo) error // CheckWorkers
	errWriters []errorWriter                    // HandleErrors, under checksMu
}

// NewServer returns the API of backend b.
func NewServer(b Backend, opts Options) *Server {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	switch {
	case opts.Registerer == nil && opts.Gatherer == nil:
		reg := prometheus.NewRegistry()
		opts.Registerer, opts.Gatherer = reg, reg
	case opts.Registerer == nil:
		if r, ok := opts.Gatherer.(prometheus.Registerer); ok {
			opts.Registerer = r
		} else {
			opts.Registerer = prometheus.NewRegistry()
		}
	case opts.Gatherer == nil:
		if g, ok := opts.Registerer.(prometheus.Gatherer); ok {
			opts.Gatherer = g
		} else {
			opts.Gatherer = prometheus.NewRegistry()
		}
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if opts.BodyTimeout <= 0 {
		opts.BodyTimeout = DefaultBodyTimeout
	}
	if opts.ForwardTimeout <= 0 {
		opts.ForwardTimeout = DefaultForwardTimeout
	}
	if opts.ForwardScheme == "" {
		opts.ForwardScheme = "http"
	}
	s := &Server{b: b, opts: opts, log: opts.Logger, mux: http.NewServeMux(), fwdLog: lograte.New(forwardLogEvery, nil)}
	if opts.Token != "" {
		sum := sha256.Sum256([]byte(opts.Token))
		s.tokenSum = &sum
	}
	s.m = newMetrics(opts.Registerer, s.log)
	if opts.ForwardTransport != nil {
		s.transport = opts.ForwardTransport
	} else {
		s.ownTransp = http.DefaultTransport.(*http.Transport).Clone()
		s.transport = s.ownTransp
	}
	s.routes()
	return s
}

// Close releases the forwarding transport's idle connections. The Server
// still answers requests afterwards.
func (s *Server) Close() error {
	if s.ownTransp != nil {
		s.ownTransp.CloseIdleConnections()
	}
	return nil
}

// routes registers every route; docs/api.md documents each (a section
// whose heading is the pattern: TestReferencePageCoversEveryRoute). The
// writes not safe to apply twice are registered with handleOnce: a restore (a
// second drops what was applied between the two), a leadership transfer
// (it may move leadership again), a member removal (the second answers
// that the id is no member) and a worker's deregistration (the second
// answers 404 unknown_worker).
func (s *Server) routes() {
	s.handle("POST /v1/route", jsonBody, s.route)
	s.handle("POST /v1/requests/{id}/prefill_done", noBody, s.prefillDone)
	s.handle("DELETE /v1/requests/{id}", noBody, s.free)

	s.handle("GET /v1/workers", noBody, s.workers)
	s.handle("POST /v1/workers", jsonBody, s.registerWorker)
	s.handleOnce(patternDeregister, noBody, s.deregisterWorker)

	s.handle("GET /v1/index/stats", noBody, s.indexStats)
	s.handle("GET /v1/settings", noBody, s.getSettings)
	s.handle("PUT /v1/settings", jsonBody, s.setSettings)

	s.handle("POST /v1/events", jsonBody, s.events)
	s.handle("POST /v1/ranks/{worker}/{dp}/dump", jsonBody, s.dump)

	s.handle("GET /v1/cluster/status", noBody, s.status)
	s.handle("GET /v1/cluster/members", noBody, s.members)
	s.handle("POST /v1/cluster/members", jsonBody, s.addMember)
	s.handleOnce(patternRemove, noBody, s.removeMember)
	s.handleOnce(patternTransfer, optionalJSONBody, s.transferLeader)

	s.handle(patternSnapshot, noBody, s.saveSnapshot)
	s.handleOnce(patternRestore, streamBody, s.restoreSnapshot)

	s.handle("GET /healthz", noBody, s.healthz)
	s.handle("GET /readyz", noBody, s.readyz)
	metrics := promhttp.HandlerFor(s.opts.Gatherer, promhttp.HandlerOpts{
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
		ErrorHandling: promhttp.ContinueOnError,
	})
	s.handle("GET /metrics", noBody, func(w http.ResponseWriter, r *http.Request) error {
		metrics.ServeHTTP(w, r)
		return nil
	})
}

// HandleFunc registers h under pattern (a net/http ServeMux pattern) with
// the middleware every route of the Server gets: metrics labelled with the
// pattern, panic recovery, the body limit, and forwarding to the leader
// when h returns an error wrapping raftfsm.ErrNotLeader before writing
// anything (the body h read is replayed there). Any other error is
// answered as the API's JSON error; a handler with an error shape of its
// own writes it and returns nil. Other APIs served from the same node
// (package compat) register their routes here.
func (s *Server) HandleFunc(pattern string, h func(w http.ResponseWriter, r *http.Request) error) {
	s.handle(pattern, optionalJSONBody, h)
}

// HandleFuncOnce registers h as HandleFunc does, for a write that is not
// safe to apply twice (a second answers otherwise than the first, or does
// more: a removal that answers 404 for what the first removed). When h
// returns a raftfsm.NotLeaderError with MaybeApplied (this node lost its
// leadership, or closed, with the write in its log, and the next leader
// may commit it), the request is not forwarded to the new leader, where it
// would apply a second time: it is answered 503 no_leader (shutting_down
// when the node closed) with HeaderMaybeApplied, as the API's own writes not safe twice are (a
// restore, a leadership transfer, a member removal, a worker's
// deregistration). Any other ErrNotLeader is forwarded as HandleFunc's
// routes are.
func (s *Server) HandleFuncOnce(pattern string, h func(w http.ResponseWriter, r *http.Request) error) {
	s.handleOnce(pattern, optionalJSONBody, h)
}

// CheckWorkers adds a check that every POST /v1/workers registration must
// pass before it is proposed: the APIs served beside /v1 (package compat)
// see /v1 workers too, and keep rules over the worker table that a /v1
// registration must not break. check runs under the backend's worker-table
// lock (raftfsm.LockWorkers), so it must not take that lock; it judges the
// leader's table, and returns the error a write on a follower returns
// (wrapping raftfsm.ErrNotLeader: forwarded to the leader) where it runs
// on one. An error wrapping ErrConflict is answered 409 conflict; any
// other as the backend's errors are.
func (s *Server) CheckWorkers(check func(w raftfsm.WorkerInfo) error) {
	s.checksMu.Lock()
	defer s.checksMu.Unlock()
	s.checks = append(s.checks, check)
}

// errorWriter is a HandleErrors registration.
type errorWriter struct {
	prefix string
	write  func(w http.ResponseWriter, r *http.Request, code int, msg string) bool
}

// HandleErrors lets an API served beside /v1 (package compat) write the
// errors the Server answers for requests whose path is prefix or under it
// and is none of the Server's own (/v1 and the probes, whose answers stay
// the API's JSON errors): a missing token's 401, no route's 404 or 405, a
// body past its limit, a 503 without a leader, every error its handlers
// return. write gets the status and the message the JSON error would
// carry (the headers, Allow and X-Kvrouter-Maybe-Applied
// among them, already set), and returns false to leave the answer to the
// Server. The registration of the longest prefix that holds the path is
// asked. The drop-in APIs answer in the request's encoding, MessagePack
// included, which the Server's JSON error was not.
func (s *Server) HandleErrors(prefix string, write func(w http.ResponseWriter, r *http.Request, code int, msg string) bool) {
	s.checksMu.Lock()
	defer s.checksMu.Unlock()
	s.errWriters = append(s.errWriters, errorWriter{prefix: prefix, write: write})
}

// sentPathKey keys the path WithSentPath records.
type sentPathKey struct{}

// WithSentPath returns ctx carrying p, the path a client sent, for a
// handler in front of the Server that rewrites the path before passing the
// request on (compat.SelectionHandler adds the /selection prefix): the
// Server's 404 and 405 then name p, which the client knows, rather than
// the path the Server routed, which the client never sent and its
// listener may not even serve. Nothing else reads it: routing, errors'
// prefixes (HandleErrors) and forwards go by the request's URL.
func WithSentPath(ctx context.Context, p string) context.Context {
	return context.WithValue(ctx, sentPathKey{}, p)
}

// SentPath is the path WithSentPath recorded in ctx; false when none was.
func SentPath(ctx context.Context) (string, bool) {
	p, ok := ctx.Value(sentPathKey{}).(string)
	return p, ok
}

// OwnPath reports whether p is one of the Server's own paths (/v1 and
// under it, the probes, the metrics), whose errors are the API's JSON
// ones; any other path is an API's served beside /v1 (HandleErrors).
func OwnPath(p string) bool {
	switch {
	case p == "/v1", strings.HasPrefix(p, "/v1/"), p == "/healthz", p == "/readyz", p == "/metrics":
		return true
	}
	return false
}

// writeOwnError answers an error through the HandleErrors writer of its
// path's prefix; false when none wrote it.
func (s *Server) writeOwnError(w http.ResponseWriter, r *http.Request, code int, msg string) bool {
	p := r.URL.Path
	if OwnPath(p) {
		return false
	}
	s.checksMu.Lock()
	ws := s.errWriters
	s.checksMu.Unlock()
	var at *errorWriter
	for i, u := range ws {
		if (p == u.prefix || strings.HasPrefix(p, u.prefix+"/")) && (at == nil || len(u.prefix) > len(at.prefix)) {
			at = &ws[i]
		}
	}
	return at != nil && at.write(w, r, code, msg)
}

// checkWorker runs the CheckWorkers checks on a /v1 registration.
func (s *Server) checkWorker(w raftfsm.WorkerInfo) error {
	s.checksMu.Lock()
	checks := s.checks
	s.checksMu.Unlock()
	for _, c := range checks {
		if err := c(w); err != nil {
			return err
		}
	}
	return nil
}

// ServeHTTP answers a request. Unknown paths and methods get JSON errors
// like every other failure.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Every body gets BodyTimeout to arrive, whether or not a handler reads
	// it, and before the token check, so that a 401 or a 404 is bounded too
	// (httpbody.Bound says why; TestBodyDeadlineCutsOnlyBodies). A
	// snapshot upload's route takes it off (register).
	httpbody.Bound(w, r, s.opts.BodyTimeout)
	if s.tokenSum != nil && !s.authorized(r) {
		start := time.Now()
		rec := &recorder{ResponseWriter: w}
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter"`)
		msg := "this cluster asks for a token (Authorization: Bearer ...), and the request carries none"
		if a := r.Header.Get("Authorization"); a != "" {
			msg = "the request's token is not this cluster's"
			if scheme, _, _ := strings.Cut(a, " "); !strings.EqualFold(scheme, "Bearer") {
				msg = "the request's Authorization is not a Bearer token (Authorization: Bearer ...)"
			}
		}
		s.writeError(rec, r, &httpError{code: http.StatusUnauthorized, reason: ReasonUnauthorized, err: errors.New(msg)})
		s.observe("unauthorized", rec, start)
		return
	}
	if r.RequestURI == "*" {
		// The mux answers a "*" request-target (OPTIONS aside, which
		// net/http answers before any handler) 400 with no body; every
		// error here is a JSON one. The connection closes, as the mux's
		// answer closes it.
		start := time.Now()
		rec := &recorder{ResponseWriter: w}
		if r.ProtoAtLeast(1, 1) {
			w.Header().Set("Connection", "close")
		}
		s.writeError(rec, r, &httpError{code: http.StatusBadRequest, reason: ReasonInvalid,
			err: fmt.Errorf("the request target * names no resource for %s; see docs/api.md", r.Method)})
		s.observe("unmatched", rec, start)
		return
	}
	if p, esc, ok := httppath.Cleaned(r.URL); ok && r.Method != http.MethodConnect {
		// The mux answers a path that is not clean (a doubled slash, "."
		// or "..") with a 307 to the clean one, always (CONNECT and "*"
		// aside), but writes the cleaned escaped path there as a decoded
		// one: an id's %2F comes back as %252F, another id. The same
		// redirect, the escaping kept (http.Redirect escapes what is not
		// ASCII, as the mux's did).
		// It matches no route: counted as unmatched, with its 307.
		start := time.Now()
		rec := &recorder{ResponseWriter: w}
		u := url.URL{Path: p, RawPath: esc, RawQuery: r.URL.RawQuery}
		http.Redirect(rec, r, u.String(), http.StatusTemporaryRedirect)
		s.observe("unmatched", rec, start)
		return
	}
	if h, pattern := s.mux.Handler(r); pattern == "" {
		// No route: run the mux's answer on the side to learn whether it is
		// a 404 or a 405 (and which methods the path allows), and answer it
		// in JSON. Anything else goes out as the mux writes it.
		var probe headerProbe
		h.ServeHTTP(&probe, r)
		switch probe.code {
		case http.StatusNotFound, http.StatusMethodNotAllowed:
			start := time.Now()
			rec := &recorder{ResponseWriter: w}
			target := r.URL.Path
			if p, ok := SentPath(r.Context()); ok {
				target = p
			}
			if target == "" {
				// A CONNECT's target is an authority (host:port), which
				// leaves the path empty: name what it asked for.
				target = r.Host
			}
			reason, err := ReasonNotFound, fmt.Errorf("no route %s %s; see docs/api.md", r.Method, target)
			if probe.code == http.StatusMethodNotAllowed {
				allow := probe.h.Get("Allow")
				w.Header().Set("Allow", allow)
				reason, err = ReasonMethodNotAllowed, fmt.Errorf("%s is not allowed on %s (allowed: %s)", r.Method, target, allow)
			}
			s.writeError(rec, r, &httpError{code: probe.code, reason: reason, err: err})
			s.observe("unmatched", rec, start)
			return
		}
	}
	s.mux.ServeHTTP(w, r)
}

// authorized reports whether r may be served: it carries the token, or
// asks for a probe or for the metrics. The tokens are compared through
// their SHA-256 sums, in constant time, so that neither the comparison's
// time nor the token's length tells a client how close it came.
func (s *Server) authorized(r *http.Request) bool {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		switch r.URL.Path {
		case "/healthz", "/readyz", "/metrics":
			return true
		}
	}
	scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return false
	}
	sum := sha256.Sum256([]byte(strings.TrimSpace(token)))
	return subtle.ConstantTimeCompare(sum[:], s.tokenSum[:]) == 1
}

// headerProbe is a ResponseWriter that keeps the status and headers and
// drops the body.
type headerProbe struct {
	h    http.Header
	code int
}

func (p *headerProbe) Header() http.Header {
	if p.h == nil {
		p.h = http.Header{}
	}
	return p.h
}
func (p *headerProbe) Write(b []byte) (int, error) {
	if p.code == 0 {
		p.code = http.StatusOK
	}
	return len(b), nil
}
func (p *headerProbe) WriteHeader(code int) {
	if p.code == 0 {
		p.code = code
	}
}

type bodyKind uint8

const (
	noBody           bodyKind = iota // the body is ignored
	jsonBody                         // a JSON object, at most MaxBodyBytes
	optionalJSONBody                 // a JSON object or nothing
	streamBody                       // a stream, at most MaxSnapshotBytes; its head is kept for a forward
)

// A handlerFunc answers a request or returns an error without having
// written anything; the error is then answered (or the request forwarded
// to the leader) by the Server.
type handlerFunc func(w http.ResponseWriter, r *http.Request) error

// handle registers h under pattern with the middleware every route gets:
// metrics labelled with the pattern, panic recovery, the body limit and
// replay buffer, and error answers with leader forwarding.
func (s *Server) handle(pattern string, kind bodyKind, h handlerFunc) {
	s.register(pattern, kind, false, h)
}

// handleOnce registers h as handle does, for a write not safe to apply
// twice: one that may have applied is not forwarded (fail).
func (s *Server) handleOnce(pattern string, kind bodyKind, h handlerFunc) {
	s.register(pattern, kind, true, h)
}

// register is handle, and handleOnce when once.
func (s *Server) register(pattern string, kind bodyKind, once bool, h handlerFunc) {
	rm := &routeMetrics{route: pattern, dur: s.m.httpDuration.WithLabelValues(pattern)} // present from the start
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &recorder{ResponseWriter: w}
		var body *replayBody
		defer func() {
			if p := recover(); p != nil {
				if p == http.ErrAbortHandler { // the server aborts the response; let it
					s.observeRoute(rm, rec, start)
					panic(p)
				}
				s.log.Error("api handler panicked", "route", pattern, "panic", p, "stack", string(debug.Stack()))
				if rec.wrote {
					// The status is out (a snapshot stream half-way): an
					// answer that ended here would read whole, a chunked
					// stream with no error trailer. Abort it, as a
					// forward whose leader broke off does: the client
					// reads a broken stream.
					s.observeRoute(rm, rec, start)
					panic(http.ErrAbortHandler)
				}
				s.writeError(rec, r, &httpError{code: http.StatusInternalServerError, reason: ReasonInternal,
					err: fmt.Errorf("internal error: %v", p)})
			} else {
				// The handler is done with the body (a panicking one may not
				// be: its body is left to the garbage collector).
				body.release()
			}
			s.observeRoute(rm, rec, start)
		}()

		switch kind {
		case jsonBody, optionalJSONBody:
			// ServeHTTP gave the body BodyTimeout to arrive.
			body = newReplayBody(http.MaxBytesReader(w, r.Body, s.opts.MaxBodyBytes), s.opts.MaxBodyBytes)
		case streamBody:
			// A snapshot upload may take longer than BodyTimeout, and is
			// bounded by its client only: it takes off the deadline
			// ServeHTTP set (once the request passed the token check).
			if d, ok := w.(readDeadliner); ok && r.Body != http.NoBody && r.ContentLength != 0 {
				_ = d.SetReadDeadline(time.Time{})
			}
			rc := r.Body
			if s.opts.MaxSnapshotBytes > 0 {
				rc = http.MaxBytesReader(w, rc, s.opts.MaxSnapshotBytes)
			}
			body = newReplayBody(rc, s.opts.MaxBodyBytes)
		}
		if body != nil {
			r.Body = body
		}
		if err := h(rec, r); err != nil {
			s.fail(rec, r, pattern, once, body, err)
		}
	}))
}

// readDeadliner is a ResponseWriter that can bound its request's reads.
type readDeadliner interface{ SetReadDeadline(time.Time) error }

// routeMetrics are one route pattern's metric handles, resolved once
// instead of per request: the duration histogram, and the counter of 200
// answers once the first one is counted (a series appears with its first
// request, as before).
type routeMetrics struct {
	route string
	dur   prometheus.Observer
	ok    atomic.Pointer[prometheus.Counter]
}

func (s *Server) observeRoute(rm *routeMetrics, rec *recorder, start time.Time) {
	if code := rec.status(); code == http.StatusOK {
		c := rm.ok.Load()
		if c == nil {
			ok := s.m.httpRequests.WithLabelValues(rm.route, "200")
			c = &ok
			rm.ok.Store(c)
		}
		(*c).Inc()
	} else {
		s.m.httpRequests.WithLabelValues(rm.route, strconv.Itoa(code)).Inc()
	}
	rm.dur.Observe(time.Since(start).Seconds())
}

func (s *Server) observe(route string, rec *recorder, start time.Time) {
	s.m.httpRequests.WithLabelValues(route, strconv.Itoa(rec.status())).Inc()
	s.m.httpDuration.WithLabelValues(route).Observe(time.Since(start).Seconds())
}

// fail answers a handler's error: a forward to the leader when the backend
// said it is not the leader and the request can be replayed there (but
// for a route registered once, not safe twice, whose write may have
// applied), a JSON error otherwise.
func (s *Server) fail(w *recorder, r *http.Request, pattern string, once bool, body *replayBody, err error) {
	if w.wrote {
		// The status line is out (a stream failed half-way); the handler
		// reported what it could in a trailer.
		s.log.Warn("api stream failed", "route", pattern, "err", err)
		return
	}
	// A route left to the leader counts on this node unless the forward
	// is sent (leaderRoute).
	var lr *leaderRoute
	errors.As(err, &lr)
	var nle *raftfsm.NotLeaderError
	if errors.As(err, &nle) && nle.MaybeApplied && once {
		// This node lost its leadership, or closed, with the write in
		// its log: the next leader may commit it. A write not safe twice
		// is not forwarded (it would apply a second time), and the answer
		// says so (HeaderMaybeApplied); any other is forwarded as ever
		// (or answered shutting_down).
		w.Header().Set(HeaderMaybeApplied, "true")
		reason, why := ReasonNoLeader, "leadership moved"
		if nle.Closed {
			reason, why = ReasonShuttingDown, "the node closed"
		}
		err = &httpError{code: http.StatusServiceUnavailable, reason: reason,
			err: fmt.Errorf("%w (%s with the write in the log: it may apply)", err, why)}
	} else if errors.Is(err, raftfsm.ErrNotLeader) {
		switch {
		case r.Header.Get(HeaderForwarded) != "":
			// Forwarded once already and still not at the leader:
			// leadership moved in between. Stop here; the client retries.
			s.m.httpForwards.WithLabelValues(pattern, forwardLoop).Inc()
			err = &httpError{code: http.StatusServiceUnavailable, reason: ReasonNoLeader,
				err: fmt.Errorf("%w (the request was already forwarded once; leadership is moving, retry)", err)}
		case errors.As(err, &nle) && nle.LeaderHTTP != "":
			replay, ok := body.replay()
			if ok {
				if s.forward(w, r, pattern, nle.LeaderHTTP, replay) != forwardSent && lr != nil {
					lr.answered.Inc()
				}
				return
			}
			s.m.httpForwards.WithLabelValues(pattern, forwardNoBody).Inc()
			err = &httpError{code: http.StatusServiceUnavailable, reason: ReasonNoLeader,
				err: fmt.Errorf("%w; the body was too large to forward, send it to the leader at %s", err, nle.LeaderHTTP)}
		}
	}
	if lr != nil {
		lr.answered.Inc()
	}
	s.writeError(w, r, err)
}

// withCandidates carries a failed route decision's scores to the error body.
type withCandidates struct {
	error
	cands   []Candidate
	leftOut int
}

func (e *withCandidates) Unwrap() error { return e.error }

// writeError answers err as a JSON error body.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	code, reason := classify(err)
	body := ErrorResponse{Error: err.Error(), Reason: reason}
	var wc *withCandidates
	if errors.As(err, &wc) {
		body.Candidates, body.CandidatesLeftOut = wc.cands, wc.leftOut
	}
	level := slog.LevelDebug
	if code >= 500 && code != http.StatusServiceUnavailable {
		level = slog.LevelError
	}
	s.log.Log(r.Context(), level, "api request failed", "method", r.Method, "path", r.URL.Path,
		"code", code, "reason", reason, "err", err)
	if s.writeOwnError(w, r, code, body.Error) {
		return
	}
	buf, merr := json.Marshal(body)
	if merr != nil { // cannot happen for these types; answer in plain JSON anyway
		buf = []byte(`{"error":"internal error","reason":"internal"}`)
		code = http.StatusInternalServerError
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Del("Content-Length")
	w.WriteHeader(code)
	_, _ = w.Write(append(buf, '\n'))
}

// reply writes v as a JSON body with status code. It marshals before it
// writes, so that a value that cannot be encoded is still answered 500.
func reply(w http.ResponseWriter, code int, v any) error {
	buf, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode the response: %w", err)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_, _ = w.Write(append(buf, '\n'))
	return nil
}

// decodeJSON decodes the body into v strictly: one JSON object, no key
// that is not a field's name exactly (encoding/json alone takes one that
// matches without its case), no key given twice in an object (strictkeys.Check),
// nothing after it. An empty body is an error unless optional. The body
// must be an object: encoding/json decodes a null into a struct as
// nothing at all, which would make "null" a request of every default.
func decodeJSON(r *http.Request, v any, optional bool) error {
	return decodeJSONWithin(r, v, optional, nil)
}

// decodeJSONWithin is decodeJSON that first refuses a body whose arrays
// would take more than its budget to decode, with costs (checkDecodeBudget);
// nil costs checks nothing.
func decodeJSONWithin(r *http.Request, v any, optional bool, costs *decodeCosts) error {
	var b []byte
	var err error
	if rb, ok := r.Body.(*replayBody); ok {
		// The Server's own body: read into its kept bytes (no copy),
		// which a forward replays anyway.
		b, err = rb.readRest()
	} else {
		b, err = io.ReadAll(r.Body)
	}
	if err != nil {
		return bodyError(err)
	}
	if costs != nil {
		if err := checkDecodeBudget(b, costs); err != nil {
			return err
		}
	}
	return decodeJSONBytes(b, v, optional)
}

// decodeJSONBytes is decodeJSON of the body b.
func decodeJSONBytes(b []byte, v any, optional bool) error {
	start := len(b) - len(bytes.TrimLeft(b, " \t\n\r"))
	if start == len(b) {
		if optional {
			return nil
		}
		return &httpError{code: http.StatusBadRequest, reason: ReasonBadJSON,
			err: errors.New("the body is empty (want a JSON object)")}
	}
	if b[start] != '{' {
		return &httpError{code: http.StatusBadRequest, reason: ReasonBadJSON,
			err: fmt.Errorf("the body starts with %s (want a JSON object)", bodyStart(b[start:]))}
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	if err := dec.Decode(new(json.RawMessage)); !errors.Is(err, io.EOF) {
		if err == nil {
			err = errors.New("more than one JSON value in the body")
		}
		return jsonError(fmt.Errorf("after the JSON object: %w", err))
	}
	// Valid JSON, decoded: now every key as written.
	if err := strictkeys.Check(b, reflect.TypeOf(v)); err != nil {
		return jsonError(err)
	}
	return nil
}

// bodyStart names what b, a body that is not a JSON object, starts with,
// for its error: a UTF-8 byte-order mark by name (encoding/json takes
// none), a byte that is not printable ASCII in hex (%q of a byte would
// show 0xef as the Latin-1 letter 'ï'), a printable one quoted.
func bodyStart(b []byte) string {
	switch c := b[0]; {
	case bytes.HasPrefix(b, []byte("\xef\xbb\xbf")):
		return "a UTF-8 byte-order mark"
	case c < 0x20 || c >= 0x7f:
		return fmt.Sprintf("the byte %#02x", c)
	default:
		return fmt.Sprintf("%q", c)
	}
}

// bodyError answers a JSON request body that could not be read whole,
// which is no fault of its JSON (BodyReadError says how).
func bodyError(err error) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return jsonError(err)
	}
	code, msg := BodyReadError(err)
	reason := ReasonBadJSON
	switch code {
	case http.StatusRequestTimeout:
		reason = ReasonRequestTimeout
	case http.StatusServiceUnavailable:
		reason = ReasonCanceled
	}
	return &httpError{code: code, reason: reason, err: msg}
}

// BodyReadError says how a server answers a request body that could not
// be read whole (err is what reading it returned, not over the size
// limit), and with what message, which names no address (a net.OpError's
// text holds both ends of the connection):
//
//   - 408: it did not arrive within the server's body timeout (a stalled
//     client or network). Nothing was applied; it may be sent again.
//   - 503: its connection broke or closed before its end (the client went
//     away, or the network between). Nothing was applied; it may be sent
//     again.
//   - 400: anything else, which is the client's framing (a chunked body's
//     malformed chunk size): sent again, it fails again.
//
// The compatible APIs (compat) answer their bodies by it too.
func BodyReadError(err error) (code int, msg error) {
	var ne net.Error
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		return http.StatusRequestTimeout, errors.New("the request body did not arrive within the node's body timeout: send it again")
	}
	var oe *net.OpError
	switch {
	case errors.As(err, &oe):
		if oe.Err != nil {
			err = oe.Err
		}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
	default:
		return http.StatusBadRequest, fmt.Errorf("the request body's framing is malformed: %v", err)
	}
	return http.StatusServiceUnavailable, fmt.Errorf("the request body broke off before its end (%v): send it again", err)
}

func jsonError(err error) error {
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return &httpError{code: http.StatusRequestEntityTooLarge, reason: ReasonTooLarge,
			err: fmt.Errorf("the body is larger than %d bytes", mbe.Limit)}
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		err = errors.New("the JSON body ends early")
	}
	return &httpError{code: http.StatusBadRequest, reason: ReasonBadJSON, err: fmt.Errorf("bad JSON: %w", err)}
}

// recorder is the ResponseWriter handlers see: it remembers the status for
// the metrics and whether anything was written (after which an error can no
// longer be answered, nor the request forwarded).
type recorder struct {
	http.ResponseWriter
	code  int
	wrote bool
}

func (r *recorder) WriteHeader(code int) {
	if !r.wrote && code >= 200 {
		r.code, r.wrote = code, true
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(p []byte) (int, error) {
	if !r.wrote {
		r.code, r.wrote = http.StatusOK, true
	}
	return r.ResponseWriter.Write(p)
}

// Flush lets streams and the forwarding proxy flush through the recorder.
func (r *recorder) Flush() { _ = http.NewResponseController(r.ResponseWriter).Flush() }

// Unwrap gives http.ResponseController the connection underneath.
func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func (r *recorder) status() int {
	if !r.wrote {
		return http.StatusOK
	}
	return r.code
}

// replayBody keeps what a handler reads of a request body, up to keep
// bytes, so that the request can be forwarded to the leader after the
// backend refused it: the forward sends the kept bytes and then whatever
// the handler left unread. They are pooled: a request's kept bytes are
// reused by a later request once the handler is done (release), unless
// they were handed to a forward.
type replayBody struct {
	rc       io.ReadCloser
	kept     bytes.Buffer
	keep     int64
	over     bool // read more than keep: cannot replay
	replayed bool // handed to a forward: not reused
}

// maxPooledReplay bounds the kept bytes a pooled replayBody holds on to.
const maxPooledReplay = 64 << 10

var replayPool = sync.Pool{New: func() any { return new(replayBody) }}

func newReplayBody(rc io.ReadCloser, keep int64) *replayBody {
	b := replayPool.Get().(*replayBody)
	b.rc, b.keep = rc, keep
	return b
}

// release returns b to the pool; b must not be used afterwards. A nil
// replayBody releases as nothing.
func (b *replayBody) release() {
	if b == nil || b.replayed {
		return
	}
	b.rc, b.over = nil, false
	if b.kept.Cap() > maxPooledReplay {
		b.kept = bytes.Buffer{}
	}
	b.kept.Reset()
	replayPool.Put(b)
}

func (b *replayBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if n > 0 && !b.over {
		if int64(b.kept.Len()+n) > b.keep {
			b.over = true
			b.kept = bytes.Buffer{}
		} else {
			b.kept.Write(p[:n])
		}
	}
	return n, err
}

// readRest reads the rest of the body and returns it. When nothing was
// read before, it reads straight into the kept bytes (one copy, no
// allocation once the pooled buffer has grown); the result is then only
// valid until release.
func (b *replayBody) readRest() ([]byte, error) {
	if b.over || b.kept.Len() > 0 {
		return io.ReadAll(b)
	}
	_, err := b.kept.ReadFrom(b.rc)
	rest := b.kept.Bytes()
	if int64(len(rest)) > b.keep {
		b.over = true
		b.kept = bytes.Buffer{}
	}
	return rest, err
}

func (b *replayBody) Close() error { return b.rc.Close() }

// replay returns the body as the client sent it, when it can. A nil
// replayBody (a route without a body) replays as nothing.
func (b *replayBody) replay() (io.Reader, bool) {
	if b == nil {
		return nil, true
	}
	if b.over {
		return nil, false
	}
	// The forward's transport may still read the kept bytes after the
	// handler returns: they are not reused.
	b.replayed = true
	return io.MultiReader(bytes.NewReader(b.kept.Bytes()), b.rc), true
}
