// Package client is the Go client of a kvrouter cluster's HTTP API
// (package api; docs/api.md).
//
// A Client knows several endpoints (the nodes' HTTP addresses). A call goes
// to the endpoint that answered last, and moves on to the next ones when a
// node cannot be reached, or answers 503 no_leader, shutting_down or
// not_ready (it is cut off, stopping or starting while the others may
// serve); a node that answers anything else, even an error, is believed.
// Writes need no leader address: any node forwards them to its leader.
// Event batches (by event id), bookings (by request id) and registrations
// are safe to send twice, which is what makes moving on after a broken
// connection safe. Four are not: a leadership transfer sent again may
// move leadership a second time, a snapshot restore sent again installs
// the snapshot again, dropping what was applied between the two, a member
// removal sent again answers that the id is no member, and a worker's
// deregistration sent again answers that the worker is unknown. Once one
// of those may have reached a node (a timeout or a broken connection
// after it went out, the call's context ending after it went out whole,
// a forward to the leader that broke, a node that says it may have
// applied it or answers 503 timeout, or one that answers shutting_down, as
// it may close with the write in its log, or a success answer whose body could not be read), no
// other node is tried: the error is ErrOutcomeUnknown, and the caller
// checks the cluster (members, status, workers) before sending it again.
//
// Errors from the API come back as *Error, keeping the HTTP status and the
// reason; so does any answer outside 2xx, a redirect too (the client follows
// none: a node redirects only paths the client never sends, and a redirect
// followed may turn a write into a read). errors.Is matches them against the
// node's sentinel errors too (raftfsm.ErrNoLeader, indexer.ErrOverloaded,
// ...). When no endpoint can be reached the error wraps ErrUnreachable; when
// one may have taken the request without answering, ErrOutcomeUnknown; when
// one answered and was passed over, and none after it answered, the error is
// that answer. A node's TLS certificate that a try refused stays in the
// error too (*tls.CertificateVerificationError; CertificateHint says what to
// do). A JSON answer longer than MaxAnswerBytes fails with ErrAnswerTooLarge
// (error answers are read up to MaxAnswerBytes too, past which they keep
// only their status and first bytes; snapshot downloads are unbounded).
package client

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

var (
	// ErrUnreachable means no endpoint could be reached (connection
	// refused, DNS, ...): the request reached no node.
	ErrUnreachable = errors.New("no endpoint reachable")
	// ErrOutcomeUnknown means a request was sent and no answer came (a
	// timeout, a connection broken after the request went out, a node
	// whose forward to the leader broke): it may have applied. A write
	// that is not safe to send twice (a restore, a leadership transfer, a
	// member removal, a worker's deregistration) is then sent to no other
	// node; any other is, and when none answers the error is this one. A
	// write not safe twice whose context ended after the request went out
	// whole is this error too, wrapping the context's (a node installs a
	// restore it took whether or not anyone waits for the answer); any
	// other call whose context ended is the context's error alone. So is
	// a write not safe twice answered success whose answer could not be
	// read (a connection broken half-way through it, the context ending
	// before it came): it most likely applied; and one answered 503
	// shutting_down, wrapping that answer (a node that closes with the
	// write in its log, where the next leader may commit it, answered so
	// before it said X-Kvrouter-Maybe-Applied, and the client cannot tell
	// that answer from a refusal before the write was proposed), or 503
	// timeout (the node gave up waiting for the write, which may still
	// apply), wrapping that answer too; the text of those that wrap an
	// answer says that the answer leaves the outcome unknown, not that no
	// answer came. (A node refuses a restore it is closing before it
	// handed it to Raft with 503 no_leader, nothing installed, which is
	// sent on.)
	ErrOutcomeUnknown = errors.New("sent, and no answer came: the request may have applied")
	// errAnswerLeavesOutcomeUnknown is ErrOutcomeUnknown for an answer that
	// came and does not say whether the write applied (503 shutting_down
	// or timeout, HeaderMaybeApplied): the sentinel's "no answer came"
	// would send the reader after a node that did answer.
	errAnswerLeavesOutcomeUnknown error = answeredUnknown{}
	// ErrUnauthorized matches an answer 401 unauthorized: the cluster asks
	// for a token (kvrouter --token), and the client's is missing or is
	// not the cluster's.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrAnswerTooLarge means a node's JSON answer ran past MaxAnswerBytes:
	// a broken node, or something other than a kvrouter node at the
	// endpoint. The call fails rather than read (and hold) without end.
	ErrAnswerTooLarge = errors.New("answer too large")
	// ErrNotHTTP means an endpoint answered in another protocol than HTTP
	// (net/http's "malformed HTTP response" or "status code"): another
	// service listens at that address (a node's NATS port, given for its
	// HTTP port, greets each connection with a line of its own). No
	// node took the request: the try counts as no node reached, and its
	// text leaves out what the service sent (a greeting may carry keys and
	// the client's address). The call's error wraps it beside
	// ErrUnreachable when such a try was among those that failed.
	ErrNotHTTP = errors.New("answered in another protocol than HTTP (another service's port?)")
	// ErrNotAnAnswer means an endpoint answered success with JSON that
	// holds nothing of what every node's answer to the request does: an
	// object without the request's field (a status with no node id and no
	// Raft state, a route with no decision), from another service at that
	// address. Decoded as it came, {"foo":1} read as an empty members or
	// workers list, a status of no node, a route to worker 0. A write a
	// node answers 204 No Content (a member's addition or removal, a
	// worker's registration, settings, prefill_done, ...) answered with
	// another success status (another service's 200 {"foo":1}) is one
	// too: it was taken for done.
	ErrNotAnAnswer = errors.New("JSON of another shape than a node's answer (another service at that address?)")
)

// MaxAnswerBytes bounds a JSON answer the client reads. The largest a
// cluster sends are the workers list and a route's candidates, a few
// hundred bytes per rank: 64 MiB holds some 200,000 ranks. Snapshot
// downloads are a stream, not an answer, and are not bounded.
const MaxAnswerBytes = 64 << 20

// maxAnswerBytes is MaxAnswerBytes, lowered by tests: reading 64 MiB
// through the race detector takes most of a minute.
var maxAnswerBytes int64 = MaxAnswerBytes

// Options configure a Client. The zero value works.
type Options struct {
	// HTTPClient sends the requests. Default: a client with its own
	// transport (closed by Client.Close) and no overall timeout: bound
	// calls with their context. Its CheckRedirect is not used: the client
	// follows no redirect. Its transport must report the requests
	// it writes through net/http/httptrace (GetConn, WroteHeaders), as
	// *http.Transport does: a failed write that reports nothing counts as
	// never sent, and a write not safe twice would be sent on.
	HTTPClient *http.Client
	// UserAgent is sent with every request. Default "kvrouter-client".
	UserAgent string
	// Token, when set, goes with every request as "Authorization: Bearer
	// <token>": the cluster's token, when its nodes run with one
	// (kvrouter --token).
	Token string
	// Scheme is how endpoints given as host:port are reached: "http"
	// (default) or "https". An endpoint given as a URL keeps its own.
	Scheme string
	// TLS configures the client's own transport, when HTTPClient is nil
	// (see TLSConfig). Default: the system's roots.
	TLS *tls.Config
	// DialTimeout bounds each try's connection to a node, TLS handshake
	// included, with the client's own transport (when HTTPClient is nil).
	// Default: the transport's (30 s to connect, 10 s for TLS).
	DialTimeout time.Duration
	// HeaderTimeout bounds each try's wait for the answer's headers once
	// the request is sent, with the client's own transport. Default: no
	// bound but the call's context, so that a node that accepts
	// connections and never answers (wedged, stopped) takes the whole call
	// and no other node is tried: a caller with several endpoints sets it
	// to a try's share of its calls' timeout. A write not safe twice that
	// times out so is ErrOutcomeUnknown, as at the context's end.
	HeaderTimeout time.Duration
}

// Client calls the API of a kvrouter cluster. It is safe for concurrent use.
type Client struct {
	endpoints []string // base URLs, "http://host:port"
	hc        *http.Client
	own       *http.Transport // closed by Close; nil when the caller gave the client
	ua        string
	auth      string       // the Authorization header; "" when no token
	preferred atomic.Int32 // the endpoint that answered last
}

// New returns a client of the nodes at endpoints: "host:port" or
// "http(s)://host:port" each, with a host and a port from 1 to 65535, and
// at most one trailing '/'. An IPv6 zone is written as it is
// ([fe80::1%eth0]:7080), in a URL also escaped (%25eth0).
func New(endpoints []string, opts Options) (*Client, error) {
	c := &Client{hc: opts.HTTPClient, ua: opts.UserAgent}
	if c.ua == "" {
		c.ua = "kvrouter-client"
	}
	if opts.Token != "" {
		if err := checkToken(opts.Token); err != nil {
			return nil, err
		}
		c.auth = "Bearer " + opts.Token
	}
	scheme := cmp.Or(opts.Scheme, "http")
	if scheme != "http" && scheme != "https" {
		return nil, fmt.Errorf("scheme %q (want http or https)", scheme)
	}
	var err error
	if c.endpoints, err = baseURLs(endpoints, scheme); err != nil {
		return nil, err
	}
	if c.hc == nil {
		c.own = http.DefaultTransport.(*http.Transport).Clone()
		if opts.TLS != nil {
			c.own.TLSClientConfig = opts.TLS
		}
		if opts.DialTimeout > 0 {
			c.own.DialContext = (&net.Dialer{Timeout: opts.DialTimeout, KeepAlive: 30 * time.Second}).DialContext
			c.own.TLSHandshakeTimeout = opts.DialTimeout
		}
		c.own.ResponseHeaderTimeout = opts.HeaderTimeout
		c.hc = &http.Client{Transport: c.own}
	}
	// No redirect is followed: a node answers one only for a path that
	// is not clean, which the client never sends, and a 301, 302 or 303
	// followed would turn a write into a GET, whose 200 would read as the
	// write's. A copy, so that the caller's client keeps its own policy.
	hc := *c.hc
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	c.hc = &hc
	return c, nil
}

// CheckEndpoints says what is wrong with endpoints as those of New (nil
// when nothing is), in New's words: a caller that checks its endpoints
// before it starts (kvrouter --join) refuses what New would. Like New's,
// its errors show an endpoint with user information as RedactEndpoints
// does, and quote nothing else of it.
func CheckEndpoints(endpoints []string) error {
	_, err := baseURLs(endpoints, "http")
	return err
}

// baseURLs returns the base URLs of endpoints, blank ones skipped. The
// entries cut from one endpoint at a ',' of its password (endpointGroups)
// are taken together, and refused as that one endpoint (it has user
// information), named with the password hidden: an error shows none of
// it.
func baseURLs(endpoints []string, scheme string) ([]string, error) {
	var bases []string
	for _, g := range endpointGroups(endpoints) {
		e := strings.TrimSpace(strings.Join(endpoints[g[0]:g[1]], ","))
		if e == "" {
			continue
		}
		base, err := baseURL(e, scheme)
		if err != nil {
			return nil, fmt.Errorf("endpoint %q: %w", RedactEndpoint(e), err)
		}
		bases = append(bases, base)
	}
	if len(bases) == 0 {
		return nil, errors.New("no endpoints (want host:port, ...)")
	}
	return bases, nil
}

// RedactEndpoints returns a comma-separated list of endpoints, as given,
// with the password of each one's user information hidden
// (RedactEndpoint), for messages. A password with a ',' (which splits
// the list there) is hidden whole: the entries cut from one endpoint are
// redacted together (endpointGroups), unless its text before the ','
// reads as host:port (admin:1234,pw@h:1 shows as given): the text cannot
// tell that from the endpoint admin:1234 followed by the user pw's, and
// that list must show as given.
func RedactEndpoints(list string) string {
	parts := strings.Split(list, ",")
	var out []string
	for _, g := range endpointGroups(parts) {
		out = append(out, RedactEndpoint(strings.Join(parts[g[0]:g[1]], ",")))
	}
	return strings.Join(out, ",")
}

// endpointGroups groups the entries of a list of endpoints split at its
// commas into the endpoints whose passwords RedactEndpoint hides, as
// [first, end) ranges. An entry is an endpoint of its own, except one
// whose text after its scheme holds a ':' and does not end in a
// host:port after its last '@' (admin:s3cret, a user and a password cut
// at a ','; admin:p@ss, one whose password also holds an '@') and that is
// followed, before an entry that begins with a scheme, by one with an
// '@': the entries up to that one are one endpoint. An entry that ends in
// host:port (a numeric port, an IPv6 host in brackets) is always one of
// its own: merged with a later user@host entry (h:1,bob@h2:2), the text
// would read as a user "h" with the password "1,bob" and show as
// h:xxxxx@h2:2, a list the operator did not write. No list that New takes
// holds an entry with an '@', so that the groups of one are its entries.
func endpointGroups(parts []string) [][2]int {
	var groups [][2]int
	for i := 0; i < len(parts); {
		end := i + 1
		rest := parts[i][schemeEnd(parts[i]):]
		host := strings.TrimSuffix(strings.TrimSpace(rest[strings.LastIndex(rest, "@")+1:]), "/")
		if strings.Contains(rest, ":") && !isHostPort(host) {
			for j := i + 1; j < len(parts); j++ {
				if schemeEnd(parts[j]) > 0 {
					break // an endpoint of its own
				}
				if strings.Contains(parts[j], "@") {
					end = j + 1
					break
				}
			}
		}
		groups = append(groups, [2]int{i, end})
		i = end
	}
	return groups
}

// isHostPort reports whether s reads as host:port with a numeric port.
func isHostPort(s string) bool {
	_, port, err := net.SplitHostPort(s)
	if err != nil || port == "" {
		return false
	}
	_, err = strconv.ParseUint(port, 10, 16)
	return err == nil
}

// RedactEndpoint returns an endpoint as given with the password of its
// user information hidden (user:xxxxx@host, as url.URL.Redacted writes
// it), for messages: New refuses user information, and its error must not
// show the password of an endpoint written with one (a proxy's URL). It
// reads the text, not a parse, so that nothing of a password shows
// whatever the input: one that holds an unescaped / ? # % @ or space,
// which url.Parse reads as the end of the host or refuses, is hidden too.
// The user information runs from the scheme's "://" (schemeEnd; or e's
// start, past leading white space, which New trims) to e's last '@', and
// its password from its first ':'. A list's endpoint whose password holds
// a ',' is cut there: RedactEndpoints hides it whole.
func RedactEndpoint(e string) string {
	start := schemeEnd(e)
	if start == 0 {
		start = len(e) - len(strings.TrimLeftFunc(e, unicode.IsSpace))
	}
	at := strings.LastIndex(e[start:], "@")
	if at < 0 {
		return e
	}
	user, _, hasPassword := strings.Cut(e[start:start+at], ":")
	if !hasPassword {
		return e
	}
	return e[:start] + user + ":xxxxx" + e[start+at:]
}

// schemeEnd returns the index in e (leading white space included) just
// after its "scheme://", 0 when e does not begin with a scheme New takes
// (http, https, in any case). Any other text before a "://" reads as a
// user: admin://pw@h is admin's password "//pw" as much as the scheme
// admin, and hiding from admin's ':' hides both readings' passwords.
func schemeEnd(e string) int {
	lead := len(e) - len(strings.TrimLeftFunc(e, unicode.IsSpace))
	scheme, _, ok := strings.Cut(e[lead:], "://")
	if !ok {
		return 0
	}
	switch strings.ToLower(scheme) {
	case "http", "https":
		return lead + len(scheme) + len("://")
	}
	return 0
}

func baseURL(e, scheme string) (string, error) {
	var u *url.URL
	if s, rest, ok := strings.Cut(e, "://"); ok {
		var err error
		if u, err = url.Parse(e); err != nil {
			// An IPv6 zone written as it is (http://[fe80::1%eth0]:7080),
			// as a plain endpoint takes it, is no URL (its % would be
			// %25): the rest is then a plain host:port, of that scheme.
			// url.Parse's error is not quoted: it quotes the endpoint,
			// which the caller names already, and the text it refuses, a
			// password's when the endpoint has user information
			// ("invalid port \":pa\"" of http://u:pa#ss@h:1).
			if u, err = hostPortURL(strings.ToLower(s), rest); err != nil {
				return "", errors.New("does not parse as a URL: want http(s)://host:port")
			}
		}
	} else {
		var err error
		if u, err = hostPortURL(scheme, e); err != nil {
			return "", err
		}
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("scheme %q (want http or https)", u.Scheme)
	}
	if u.Hostname() == "" {
		return "", errors.New("no host (want host:port)")
	}
	// A port is required, as kvrouter --join requires it: without one the
	// scheme's (80, 443) would be dialed, never a node's (7080 by default),
	// and a typo in a list of endpoints would cost that node its share of
	// the failover silently (only the others would answer).
	if u.Port() == "" {
		return "", errors.New("no port (want host:port)")
	}
	// The port is not quoted: url.Parse reads the digits of a password
	// written before an unescaped '#' as one (http://u:99999#@h:1).
	if p, err := strconv.ParseUint(u.Port(), 10, 16); err != nil || p == 0 {
		return "", errors.New("port out of range: want a number from 1 to 65535")
	}
	// Nothing a request would drop: a user (no credentials are sent
	// from it), a path, a query or a fragment (an empty one too: url.URL
	// keeps no trace of a bare '#', which no host:port holds).
	if u.User != nil || u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || strings.Contains(e, "#") {
		return "", errors.New("want host:port with no user, path or query")
	}
	// Through url.URL: a zone's % is escaped (%25), so that the base
	// parses as a URL again, with each request's path.
	return (&url.URL{Scheme: u.Scheme, Host: u.Host}).String(), nil
}

// hostPortURL is the URL of scheme whose host is hp as it is, not text to
// parse as a URL: an IPv6 zone's % ([fe80::1%eth0]:7080) would have to be
// written %25 there. One trailing '/' is dropped, as a URL endpoint may
// end in one (h:7080/). What a URL would not read back as this host (a
// path, a user) is refused.
func hostPortURL(scheme, hp string) (*url.URL, error) {
	hp = strings.TrimSuffix(hp, "/")
	u := &url.URL{Scheme: scheme, Host: hp}
	if back, err := url.Parse(u.String()); err != nil || back.Host != hp {
		return nil, errors.New("want host:port, or http(s)://host:port")
	}
	return u, nil
}

// ClearText returns the endpoints (host:port) that the client reaches over
// plain http: with a token, it crosses the network as written there.
func (c *Client) ClearText() []string {
	var out []string
	for _, e := range c.endpoints {
		if h, ok := strings.CutPrefix(e, "http://"); ok {
			out = append(out, h)
		}
	}
	return out
}

// Endpoints returns the endpoints' base URLs, in the order given.
func (c *Client) Endpoints() []string { return append([]string(nil), c.endpoints...) }

// Close drops the idle connections of the client's own transport.
func (c *Client) Close() error {
	if c.own != nil {
		c.own.CloseIdleConnections()
	}
	return nil
}

// Error is an error answer of the API.
type Error struct {
	Endpoint   string // the base URL that answered
	StatusCode int
	Reason     string // api.Reason*; "" when the body was not an API error
	Message    string
	// Candidates of a route that failed with reason overloaded: every one
	// is busy, and says why. None for a brief route.
	Candidates []api.Candidate
	// CandidatesLeftOut counts the candidates past api.MaxCandidates that
	// Candidates leaves out: a node lists at most that many.
	CandidatesLeftOut int

	body []byte // the answer's body (up to MaxAnswerBytes), for calls that read more of it
}

func (e *Error) Error() string {
	host := strings.TrimPrefix(strings.TrimPrefix(e.Endpoint, "http://"), "https://")
	if e.Reason == "" {
		msg := e.Message
		if e.StatusCode/100 != 3 {
			// No node's error: another server's page (a 404's HTML).
			msg = AnswerExcerpt(msg, e.StatusCode)
		}
		return fmt.Sprintf("%s: HTTP %d: %s", host, e.StatusCode, msg)
	}
	return fmt.Sprintf("%s: %s (HTTP %d, %s)", host, e.Message, e.StatusCode, e.Reason)
}

// ExcerptRunes bounds AnswerExcerpt's excerpt.
const ExcerptRunes = 60

// AnswerExcerpt is a short excerpt, on one line, of the body of an error
// answer that is no node's (another server's page): a web page's title, or
// its text without the tags, of at most ExcerptRunes runes; the status
// code's text when that leaves nothing. An Error whose body is no API
// error (Reason "") says this of it, and kvctl status's ERROR cell too.
func AnswerExcerpt(body string, code int) string {
	s := strings.TrimSpace(body)
	if strings.HasPrefix(s, "<") {
		lower := strings.ToLower(s)
		if i := strings.Index(lower, "<title>"); i >= 0 {
			if j := strings.Index(lower[i:], "</title>"); j >= 0 {
				s = s[i+len("<title>") : i+j]
			}
		}
		var b strings.Builder
		tag := false
		for _, r := range s {
			switch {
			case r == '<':
				tag = true
				b.WriteByte(' ')
			case r == '>' && tag:
				tag = false
			case !tag:
				b.WriteRune(r)
			}
		}
		s = b.String()
	}
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > ExcerptRunes {
		s = strings.TrimSpace(string(r[:ExcerptRunes])) + "…"
	}
	if s == "" {
		s = http.StatusText(code)
	}
	return s
}

// Unwrap returns the node's sentinel error for the reason, so that
// errors.Is(err, raftfsm.ErrNoLeader) and the like work across the wire.
// The node's timeout and canceled (its context errors) match none: as
// context.DeadlineExceeded or context.Canceled they would read as the
// caller's own context ending.
func (e *Error) Unwrap() error {
	switch e.Reason {
	case api.ReasonNoLeader:
		return raftfsm.ErrNoLeader
	case api.ReasonOverloaded:
		return indexer.ErrOverloaded
	case api.ReasonNoWorkers:
		return indexer.ErrNoWorkers
	case api.ReasonUnknownWorker:
		return raftfsm.ErrUnknownWorker
	case api.ReasonUnknownRank:
		return indexer.ErrUnknownRank
	case api.ReasonStaleDump:
		return raftfsm.ErrStaleDump
	case api.ReasonUnregisteredRank:
		return raftfsm.ErrUnregisteredRank
	case api.ReasonBadSnapshot:
		return raftfsm.ErrBadSnapshot
	case api.ReasonInsufficientStorage:
		return raftfsm.ErrInsufficientStorage
	case api.ReasonInvalid, api.ReasonBadJSON:
		return raftfsm.ErrInvalid
	case api.ReasonShuttingDown:
		return raftfsm.ErrShutdown
	case api.ReasonStateReplaced:
		return raftfsm.ErrStateReplaced
	case api.ReasonUnreachable:
		return raftfsm.ErrUnreachable
	case api.ReasonUnauthorized:
		return ErrUnauthorized
	case api.ReasonConflict:
		return api.ErrConflict
	}
	return nil
}

// request is one API call.
type request struct {
	method, path string
	json         []byte    // a JSON body; replayable
	stream       io.Reader // a streamed body; replayable only while unread, or when it is an io.Seeker
	streamLen    int64     // its length, -1 when unknown
	endpoint     string    // when set, this endpoint only
	// passed: endpoints not to try, which answered success in JSON of
	// another shape (callReq passes a read on from them).
	passed []string
	// once: not safe to send twice (its second apply is not a no-op):
	// once it may have reached a node, no other node is tried.
	once bool
}

// isWrite reports whether method changes state: a read that got no
// answer applied nothing.
func isWrite(method string) bool { return method != http.MethodGet && method != http.MethodHead }

// partlySent reports whether a streamed body (counted) broke off before
// its end: a node takes a stream (a restore) only whole, so it did not
// take this one. It waits for the transport to be done with the body.
func partlySent(ctx context.Context, counted *countingReader, length int64) bool {
	if counted == nil {
		return false
	}
	select {
	case <-counted.closed:
	case <-ctx.Done():
		return false
	}
	return !counted.eof && (length < 0 || counted.n < length)
}

// bodyLetGo bounds how long a call whose context ended waits for the
// transport to be done with a streamed body (sentWhole). The cancel
// closes the connection, which ends the body's write at once.
const bodyLetGo = 5 * time.Second

// sentWhole reports, once the call's context ended, whether the request's
// body (counted, nil for a JSON body) went out whole, waiting for the
// transport to be done with it. A body the transport still holds after
// bodyLetGo counts as sent whole: the careful answer for a write not
// safe twice.
func sentWhole(counted *countingReader, length int64) bool {
	if counted == nil {
		return true
	}
	t := time.NewTimer(bodyLetGo)
	defer t.Stop()
	select {
	case <-counted.closed:
	case <-t.C:
		return true
	}
	return counted.eof || length >= 0 && counted.n >= length
}

// do sends req to the preferred endpoint, then to the others in order
// while none can be reached, and returns the first answer. An answer
// outside 2xx (a redirect, which is not followed, too) is returned as
// *Error with the body closed; a 2xx answer's body is the caller's to
// close.
func (c *Client) do(ctx context.Context, req request) (*http.Response, string, error) {
	order := c.order(req.endpoint)
	if len(req.passed) > 0 {
		order = slices.DeleteFunc(order, func(b string) bool { return slices.Contains(req.passed, b) })
	}
	var errs []string
	var answered error // the last node that answered, passed over
	maybeSent := false // a try may have reached a node that did not answer
	// The first try's refusal of a node's TLS certificate: the error keeps
	// it (errors.As, CertificateHint) beside its text.
	var certErr *tls.CertificateVerificationError
	notHTTP := false // a try answered in another protocol (ErrNotHTTP)
	var start int64 = -1
	seeker, _ := req.stream.(io.Seeker)
	if seeker != nil {
		if off, err := seeker.Seek(0, io.SeekCurrent); err == nil {
			start = off
		}
	}
	for i, base := range order {
		var body io.Reader
		var counted *countingReader
		switch {
		case req.json != nil:
			body = bytes.NewReader(req.json)
		case req.stream != nil && req.streamLen == 0:
			body = http.NoBody
		case req.stream != nil:
			counted = &countingReader{ctx: ctx, r: req.stream, closed: make(chan struct{})}
			body = counted
		}
		// wrote: the request's headers went out on a connection (the
		// transport's own word, whatever its later errors: a dial, a TLS
		// handshake or a proxy that failed sent nothing). WroteHeaders
		// fires once they are in the connection's buffer; a transport that
		// then retries on a new connection starts over with GetConn, so
		// wrote tells of the last attempt.
		var wrote atomic.Bool
		tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
			GetConn:      func(string) { wrote.Store(false) },
			WroteHeaders: func() { wrote.Store(true) },
		})
		hr, err := http.NewRequestWithContext(tctx, req.method, base+req.path, body)
		if err != nil {
			return nil, base, err
		}
		hr.Header.Set("User-Agent", c.ua)
		hr.Header.Set("Accept", "application/json")
		if c.auth != "" {
			hr.Header.Set("Authorization", c.auth)
		}
		switch {
		case req.json != nil:
			hr.Header.Set("Content-Type", "application/json")
		case req.stream != nil:
			hr.Header.Set("Content-Type", "application/octet-stream")
			hr.ContentLength = req.streamLen
		}
		// rewind readies the body to be sent again to the next endpoint:
		// fine while none of it was read, or when it can be rewound. The
		// transport may still be sending this try's body when the answer
		// (an early 503) comes: rewinding under it would hand both tries
		// the same reader, and the next one a corrupted stream. The
		// transport closes the body once done with it, error or not.
		rewind := func() bool {
			if counted == nil {
				return true
			}
			select {
			case <-counted.closed:
			case <-ctx.Done():
				errs = append(errs, fmt.Sprintf("waiting for the body's last send: %v", ctx.Err()))
				return false
			}
			if ctx.Err() != nil {
				// A Read of the stream may have been left behind
				// (countingReader), still running: no Seek under it.
				errs = append(errs, fmt.Sprintf("the body's last send: %v", ctx.Err()))
				return false
			}
			if counted.n == 0 {
				return true
			}
			if start < 0 {
				errs = append(errs, "the body was partly sent and cannot be sent again")
				return false
			}
			if _, serr := seeker.Seek(start, io.SeekStart); serr != nil {
				errs = append(errs, fmt.Sprintf("rewind the body: %v", serr))
				return false
			}
			return true
		}
		last := i == len(order)-1
		resp, err := c.hc.Do(hr)
		if err != nil {
			if ctxErr := ctx.Err(); ctxErr != nil {
				// The caller's deadline or cancel: no other node is
				// tried. A write not safe twice whose request went out
				// whole may still be applied by the node (a restore it
				// installs while no one waits for the answer): its
				// outcome is unknown, not a timeout to retry.
				if req.once && wrote.Load() && isWrite(req.method) && sentWhole(counted, req.streamLen) {
					return nil, base, fmt.Errorf("%s %s to %s: %w: %w", req.method, req.path, hostOf(base), ErrOutcomeUnknown, ctxErr)
				}
				return nil, base, fmt.Errorf("%s %s: %w", req.method, req.path, waitedOn(base, ctxErr, errs, order[i+1:]))
			}
			if isNotHTTP(err) {
				// Not a node: kvrouter's listeners all speak HTTP. Nothing
				// applied, whatever went out.
				notHTTP = true
				errs = append(errs, fmt.Sprintf("%s %v", hostOf(base), ErrNotHTTP))
				if last || !rewind() {
					break
				}
				continue
			}
			errs = append(errs, fmt.Sprintf("%s: %v", hostOf(base), unwrapURLError(err)))
			if certErr == nil {
				errors.As(err, &certErr)
			}
			if wrote.Load() && isWrite(req.method) && !partlySent(ctx, counted, req.streamLen) {
				maybeSent = true
				if req.once {
					return nil, base, fmt.Errorf("%s %s to %s: %w: %v", req.method, req.path, hostOf(base), ErrOutcomeUnknown, unwrapURLError(err))
				}
			}
			if last || !rewind() {
				break
			}
			continue
		}
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			apiErr := decodeError(base, resp)
			resp.Body.Close()
			// A node cut off from the others (a partition, an election
			// in progress) answers 503 no_leader, a stopping one 503
			// shutting_down and a starting one 503 not_ready, while the
			// rest of the cluster may serve: try the next endpoint rather
			// than stick to this one. But a node whose forward may have
			// reached the leader, or that lost its leadership or closed
			// with the write in its log, says so (HeaderMaybeApplied): a
			// write not safe to send twice stops there. So it does at a
			// plain shutting_down: a node before that header was sent for
			// a close (and any node for a leadership transfer it was
			// carrying out) answered so with the write possibly applied,
			// and the answer does not tell it from a refusal before the
			// write was proposed. So it does at a 503 timeout: the node
			// gave up waiting for a write it proposed (or forwarded),
			// which may still apply (docs/api.md).
			var e *Error
			if req.once && resp.Header.Get(api.HeaderMaybeApplied) != "" {
				return nil, base, fmt.Errorf("%w: %w", errAnswerLeavesOutcomeUnknown, apiErr)
			}
			if req.once && isWrite(req.method) && errors.As(apiErr, &e) &&
				(e.Reason == api.ReasonShuttingDown || e.StatusCode == http.StatusServiceUnavailable && e.Reason == api.ReasonTimeout) {
				return nil, base, fmt.Errorf("%w: %w", errAnswerLeavesOutcomeUnknown, apiErr)
			}
			if !last && errors.As(apiErr, &e) && e.StatusCode == http.StatusServiceUnavailable &&
				(e.Reason == api.ReasonNoLeader || e.Reason == api.ReasonShuttingDown || e.Reason == api.ReasonNotReady) && rewind() {
				errs = append(errs, fmt.Sprintf("%s: %v", hostOf(base), apiErr))
				answered = apiErr
				continue
			}
			c.prefer(base)
			return nil, base, apiErr
		}
		c.prefer(base)
		return resp, base, nil
	}
	if answered != nil {
		// A node answered (no leader, stopping, starting) and the rest
		// could not be reached: that answer is the error, not
		// ErrUnreachable, which says the request may have reached nobody.
		return nil, "", withCause(fmt.Errorf("%w (tried: %s)", answered, strings.Join(errs, "; ")), certErr)
	}
	if maybeSent {
		return nil, "", withCause(fmt.Errorf("%s %s: %w (tried: %s)", req.method, req.path, ErrOutcomeUnknown, strings.Join(errs, "; ")), certErr)
	}
	err := fmt.Errorf("%s %s: %w: %s", req.method, req.path, ErrUnreachable, strings.Join(errs, "; "))
	if notHTTP {
		err = &causedError{error: err, cause: ErrNotHTTP}
	}
	return nil, "", withCause(err, certErr)
}

// isNotHTTP reports whether err is net/http's for an answer that is not
// HTTP: a status line it could not read ("malformed HTTP response",
// "malformed HTTP status code", "malformed HTTP version"), or bytes that
// came before the request went out (the transport closes the connection
// with a peek that failed on no error: an HTTP server never speaks
// first, a NATS server greets at once), which it reports in no other
// words; or, asked over TLS, a first record that is not TLS (the
// greeting again; a plain-HTTP answer net/http reports in its own words,
// "server gave HTTP response to HTTPS client", for kvctl's hint). Over
// TLS the handshake failed, so no request went out.
func isNotHTTP(err error) bool {
	var rh tls.RecordHeaderError
	if errors.As(err, &rh) {
		return true
	}
	s := unwrapURLError(err).Error()
	return strings.Contains(s, "malformed HTTP ") || strings.Contains(s, "readLoopPeekFailLocked: %!w(<nil>)")
}

// answeredUnknown is errAnswerLeavesOutcomeUnknown: ErrOutcomeUnknown
// (errors.Is) in other words.
type answeredUnknown struct{}

func (answeredUnknown) Error() string {
	return "sent, and the answer leaves the outcome unknown: the request may have applied"
}

func (answeredUnknown) Is(target error) bool { return target == ErrOutcomeUnknown }

// causedError is an error that also wraps a cause its text already tells
// of (a try's error, in the list of the tries).
type causedError struct {
	error
	cause error
}

func (e *causedError) Unwrap() []error { return []error{e.error, e.cause} }

// withCause returns err, with errors.Is and errors.As also finding cause
// when it is not nil. Only a certificate's refusal is kept so: a try's
// other errors (a dial's timeout, which is a context.DeadlineExceeded)
// would read as the call's own.
func withCause(err error, cause *tls.CertificateVerificationError) error {
	if cause == nil {
		return err
	}
	return &causedError{error: err, cause: cause}
}

// order returns the endpoints to try: the preferred one first, then the
// others in their order; or only the one asked for.
func (c *Client) order(only string) []string {
	if only != "" {
		return []string{only}
	}
	n := len(c.endpoints)
	p := int(c.preferred.Load()) % n
	out := make([]string, 0, n)
	for i := range n {
		out = append(out, c.endpoints[(p+i)%n])
	}
	return out
}

func (c *Client) prefer(base string) {
	for i, e := range c.endpoints {
		if e == base {
			c.preferred.Store(int32(i))
			return
		}
	}
}

// resetAnswer sets the answer out, decoded from an answer of another
// shape, back to its zero value before another endpoint's is decoded
// into it: a field that answer set and the next leaves out would stay.
func resetAnswer(out any) {
	if r, ok := out.(interface{ reset() }); ok {
		r.reset()
		return
	}
	if v := reflect.ValueOf(out); v.Kind() == reflect.Pointer && !v.IsNil() {
		v.Elem().SetZero()
	}
}

// waitedOn is a call's end by its context (ctxErr) while it waited on
// base: it names base, what the endpoints tried before it did (errs)
// and the endpoints not tried (rest), so that an operator whose
// --timeout ran out knows which node hung and which were never asked.
// It wraps ctxErr: callers branch on it with errors.Is.
func waitedOn(base string, ctxErr error, errs, rest []string) error {
	var tail []string
	if len(errs) > 0 {
		tail = append(tail, "before it: "+strings.Join(errs, "; "))
	}
	if len(rest) > 0 {
		hosts := make([]string, len(rest))
		for i, b := range rest {
			hosts[i] = hostOf(b)
		}
		tail = append(tail, "not tried: "+strings.Join(hosts, ", "))
	}
	if len(tail) == 0 {
		return fmt.Errorf("waiting on %s: %w", hostOf(base), ctxErr)
	}
	return fmt.Errorf("waiting on %s: %w (%s)", hostOf(base), ctxErr, strings.Join(tail, "; "))
}

func hostOf(base string) string {
	return strings.TrimPrefix(strings.TrimPrefix(base, "http://"), "https://")
}

func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// countingReader is a streamed body: it counts what the transport read,
// and closed tells when the transport is done with it. A Read honours
// ctx: the transport waits for its body's Read before it returns, even
// once the call's context ended, and a caller's stream that blocks (a
// pipe whose writer stalls) held the call past its context. The Read of
// the stream still running then is left behind, its bytes dropped, and
// neither counted nor its end taken for the body's: the connection was
// closed under a truncated upload.
type countingReader struct {
	ctx    context.Context
	r      io.Reader
	n      int64
	eof    bool // the stream's end was read: the whole body went out
	closed chan struct{}
	once   sync.Once
	buf    []byte        // what the stream's Read fills; not p, which the transport reuses once Read returned
	done   chan readDone // the stream's Read's result
	left   bool          // a Read of the stream was left behind: no other may start
}

// readDone is the result of a Read of the stream.
type readDone struct {
	n   int
	err error
}

// Close is the transport's: it never closes the caller's stream.
func (c *countingReader) Close() error {
	c.once.Do(func() { close(c.closed) })
	return nil
}

func (c *countingReader) Read(p []byte) (int, error) {
	if c.left {
		return 0, c.ctx.Err()
	}
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	if cap(c.buf) < len(p) {
		c.buf = make([]byte, len(p))
	}
	if c.done == nil {
		c.done = make(chan readDone, 1)
	}
	buf := c.buf[:len(p)]
	go func() {
		n, err := c.r.Read(buf)
		c.done <- readDone{n, err}
	}()
	var d readDone
	select {
	case d = <-c.done:
	case <-c.ctx.Done():
		c.left = true
		return 0, c.ctx.Err()
	}
	n := copy(p, buf[:d.n])
	c.n += int64(n)
	if d.err == io.EOF {
		c.eof = true
	}
	return n, d.err
}

// decodeError reads an error answer, up to maxAnswerBytes: the same bound
// as an answer's, since a route refused overloaded lists every candidate
// rank, a few hundred bytes each (a worker may have 4,096 dp ranks), and
// one cut short no longer decodes and loses its reason.
func decodeError(base string, resp *http.Response) error {
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	e := &Error{Endpoint: base, StatusCode: resp.StatusCode, body: raw}
	var body api.ErrorResponse
	if json.Unmarshal(raw, &body) == nil && body.Error != "" {
		e.Reason, e.Message, e.Candidates, e.CandidatesLeftOut = body.Reason, body.Error, body.Candidates, body.CandidatesLeftOut
		return e
	}
	msg := strings.TrimSpace(string(raw))
	if len(msg) > 200 {
		msg = msg[:200] + "…"
	}
	if msg == "" {
		msg = http.StatusText(resp.StatusCode)
	}
	if resp.StatusCode/100 == 3 {
		// Not a node's answer (a node redirects only paths the client
		// does not send): a proxy, or another server at the endpoint.
		loc := "nowhere (no Location)"
		if l := resp.Header.Get("Location"); l != "" {
			loc = strconv.Quote(l)
		}
		msg = fmt.Sprintf("redirected to %s, which the client does not follow: is the endpoint a kvrouter node's API address? (%s)", loc, msg)
	}
	e.Message = msg
	return e
}

// call sends a JSON request (in may be nil) and decodes a JSON answer into
// out (nil: the answer is dropped).
func (c *Client) call(ctx context.Context, method, path string, in, out any) error {
	req, err := jsonRequest(method, path, in)
	if err != nil {
		return err
	}
	return c.callReq(ctx, req, out)
}

// callOnce is call for a write that is not safe to send twice
// (request.once).
func (c *Client) callOnce(ctx context.Context, method, path string, in, out any) error {
	req, err := jsonRequest(method, path, in)
	if err != nil {
		return err
	}
	req.once = true
	return c.callReq(ctx, req, out)
}

func jsonRequest(method, path string, in any) (request, error) {
	req := request{method: method, path: path}
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return req, fmt.Errorf("%s %s: encode: %w", method, path, err)
		}
		req.json = b
	}
	return req, nil
}

// callReq sends req (do) and decodes its answer into out. An endpoint that
// answered success in JSON of another shape (ErrNotAnAnswer: another
// service's API) is passed over, as one that answers in another protocol
// is, when req may go to any endpoint and be sent again (not once), or
// reads no answer (out nil: a write whose success no node answers but
// 204, which callOne's comment says is safe to send on): the next is
// asked. When none of the rest answers (an error answer is
// returned as it is), the error is the first such endpoint's, with what
// the others did.
func (c *Client) callReq(ctx context.Context, req request, out any) error {
	var first error // the first endpoint's answer of another shape
	for {
		err := c.callOne(ctx, &req, out)
		if errors.Is(err, ErrNotAnAnswer) && (!req.once || out == nil) && req.endpoint == "" && len(req.passed) < len(c.endpoints) {
			if first == nil {
				first = err
			}
			continue
		}
		var answer *Error
		switch {
		case first == nil || err == nil:
			return err
		case errors.As(err, &answer):
			return err // an endpoint's answer: the caller's to read
		case errors.Is(err, ErrNotAnAnswer):
			return first
		default:
			return fmt.Errorf("%w (then: %w)", first, err)
		}
	}
}

// callOne is one round of callReq: when the answer is of another shape, its
// endpoint is added to req.passed (and the node that answers next is
// preferred over it, by do).
func (c *Client) callOne(ctx context.Context, req *request, out any) error {
	resp, base, err := c.do(ctx, *req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		if resp.StatusCode != http.StatusNoContent {
			// The calls that read no answer are writes a node answers 204
			// No Content on success, and nothing else (a follower's
			// forward to its leader passes the leader's status on, as a
			// proxy does). Another success (another service's 200
			// {"foo":1}) was taken for done: kvctl said "removed member
			// n3" and n3 stayed. No node answered it, so none received
			// the write, and sending it to the next endpoint is safe,
			// even for a write not safe twice (req.once): callReq does,
			// as it does a read's.
			req.passed = append(req.passed, base)
			return notAnAnswer(*req, base, fmt.Errorf("%w: HTTP %d where a node answers 204 No Content", ErrNotAnAnswer, resp.StatusCode))
		}
		return nil
	}
	// A write not safe twice keeps its answer's first bytes, to quote one
	// that is not a node's: what answered (a proxy's page, another API)
	// tells the reader more than a decoder's complaint.
	head := &answerHead{}
	body := io.Reader(resp.Body)
	if req.once && isWrite(req.method) {
		body = io.TeeReader(resp.Body, head)
	}
	shape := func(err error) error {
		resetAnswer(out)
		req.passed = append(req.passed, base)
		if req.once && isWrite(req.method) {
			// A success of another shape to a write not safe twice (a
			// restore): no node's answer, so nothing says the write
			// applied, and a proxy in front of a node may have passed it
			// on. Not taken as done, nor sent again.
			return fmt.Errorf("%s %s to %s: %w: HTTP %d with a body that is not its answer, %s: %w",
				req.method, req.path, hostOf(base), errAnswerLeavesOutcomeUnknown, resp.StatusCode, head, err)
		}
		return notAnAnswer(*req, base, err)
	}
	if err := decodeAnswer(body, out); err != nil {
		if errors.Is(err, ErrNotAnAnswer) {
			return shape(err)
		}
		var syntax *json.SyntaxError
		var typ *json.UnmarshalTypeError
		if req.once && isWrite(req.method) && (errors.As(err, &syntax) || errors.As(err, &typ)) {
			// Read whole enough to tell: not JSON of the answer's kind
			// (an HTML page, a list), which is no answer of a node's.
			return shape(fmt.Errorf("%w: %w", ErrNotAnAnswer, err))
		}
		if req.once && isWrite(req.method) {
			// The node answered success, and its answer broke off (a
			// connection reset, the caller's context ending): the write
			// is most likely applied, and the caller, without its answer,
			// must not take it for one that failed and send it again.
			if ctxErr := ctx.Err(); ctxErr != nil && !errors.Is(err, ctxErr) {
				err = fmt.Errorf("%w (%w)", err, ctxErr)
			}
			return fmt.Errorf("%s %s to %s: %w: its answer (HTTP %d) could not be read: %w", req.method, req.path, hostOf(base), ErrOutcomeUnknown, resp.StatusCode, err)
		}
		return fmt.Errorf("%s %s: decode the answer: %w", req.method, req.path, err)
	}
	if sh, ok := out.(shaped); ok {
		if err := sh.shapeErr(); err != nil {
			return shape(err)
		}
	}
	drainAnswer(resp.Body)
	return nil
}

// answerQuoteBytes bounds the prefix of an answer that an error quotes
// (answerHead).
const answerQuoteBytes = 200

// answerHead keeps the first answerQuoteBytes bytes written to it, and
// takes (without keeping) the rest.
type answerHead struct {
	b []byte
	n int64 // all bytes written
}

func (h *answerHead) Write(p []byte) (int, error) {
	if room := answerQuoteBytes - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(room, len(p))]...)
	}
	h.n += int64(len(p))
	return len(p), nil
}

// String quotes the kept bytes, and says when the answer was longer.
func (h *answerHead) String() string {
	if h.n > int64(len(h.b)) {
		return fmt.Sprintf("body %q...", h.b)
	}
	return fmt.Sprintf("body %q", h.b)
}

// notAnAnswer is the error of an answer of another shape (ErrNotAnAnswer,
// err) from the endpoint base: it names the endpoint, as an error answer's
// and an answer in another protocol's do, since the call may have passed
// over others before it.
func notAnAnswer(req request, base string, err error) error {
	return fmt.Errorf("%s %s: %s answered %w", req.method, req.path, hostOf(base), err)
}

// decodeAnswer decodes a JSON answer of at most MaxAnswerBytes into out.
// A body that runs past the limit (the decoder read all of it and still
// wanted more) fails with ErrAnswerTooLarge; one whose value ends within
// the limit decodes whatever follows it.
func decodeAnswer(body io.Reader, out any) error {
	limit := maxAnswerBytes
	lr := &io.LimitedReader{R: body, N: limit + 1}
	err := json.NewDecoder(lr).Decode(out)
	if err != nil && lr.N <= 0 {
		return fmt.Errorf("%w: more than %d bytes (client.MaxAnswerBytes)", ErrAnswerTooLarge, limit)
	}
	return err
}

// keyed decodes a JSON object into v, and fails with ErrNotAnAnswer when
// the object lacks key, a field every node's answer to the request holds
// (null when it is empty). Decoded into v alone, an object without any of
// v's fields is v's zero value: an empty list.
//
// filled (nil: never) tells from the decoded v that the key was there (a
// list that came non-nil): then the object is not looked at again. Only
// an answer that left it unset (absent, null, or a value its zero value
// cannot be told from) is decoded a second time, as a map of its fields:
// a large answer decoded so twice took 1.3 to 3.6 times the CPU of one
// decode (a 62 MiB list of workers).
type keyed[T any] struct {
	v      *T
	key    string
	filled func(*T) bool
}

func (k *keyed[T]) reset() { *k.v = *new(T) }

func (k *keyed[T]) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, k.v); err != nil {
		return err
	}
	if k.filled != nil && k.filled(k.v) {
		return nil
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return err
	}
	if _, ok := fields[k.key]; !ok {
		return fmt.Errorf("%w: no %q field", ErrNotAnAnswer, k.key)
	}
	return nil
}

// shaped is an answer that tells, once decoded, whether it is of another
// shape than a node's (ErrNotAnAnswer): fields every node's answer fills
// came empty.
type shaped interface{ shapeErr() error }

// statusAnswer is a status as decoded: every node's has its id or its Raft
// state.
type statusAnswer raftfsm.NodeStatus

func (s *statusAnswer) shapeErr() error {
	if s.ID == "" && s.State == "" {
		return fmt.Errorf("%w: no node id and no Raft state", ErrNotAnAnswer)
	}
	return nil
}

// routeAnswer is a route decision as decoded: every decision names its
// deciding term and the block size.
type routeAnswer api.RouteResponse

func (r *routeAnswer) shapeErr() error {
	if r.DecidedBy == "" && r.BlockSize == 0 {
		return fmt.Errorf("%w: no decision and no block size", ErrNotAnAnswer)
	}
	return nil
}

// restoreAnswer is a restore's report as decoded: every report names
// the snapshot's format version (1 or more) and its checksum.
type restoreAnswer raftfsm.SnapshotInfo

func (r *restoreAnswer) shapeErr() error {
	if r.FormatVersion == 0 && r.SHA256 == "" {
		return fmt.Errorf("%w: no format version and no checksum of a restore's report", ErrNotAnAnswer)
	}
	return nil
}

// drainBytes bounds what drainAnswer reads of an answer past its JSON
// value: a node's answer ends with the value's newline.
const drainBytes = 4 << 10

// drainAnswer reads what is left of a JSON answer's body after its value
// decoded, up to drainBytes. The transport keeps a connection for the
// next request only when its last answer was read to the end, and a
// decoder stops at the end of the value: before the end of a chunked
// body (the node sends any answer over a few KiB so), whose closing chunk
// is still to be read. An answer that did not decode is not drained: it
// is no node's, and one kept open (a stream) would hold the call until
// its context ends; closing it drops the connection.
func drainAnswer(body io.Reader) {
	_, _ = io.CopyN(io.Discard, body, drainBytes)
}

// Route asks for a routing decision (and books it with req.Book). On
// reason overloaded the *Error carries every candidate's score, unless
// req.Brief.
func (c *Client) Route(ctx context.Context, req api.RouteRequest) (*api.RouteResponse, error) {
	var out api.RouteResponse
	if err := c.call(ctx, http.MethodPost, "/v1/route", req, (*routeAnswer)(&out)); err != nil {
		return nil, err
	}
	return &out, nil
}

// pathSegment escapes s as one segment of a request's path. url.PathEscape
// leaves "." and ".." as they are, valid ids (a request's, a member's)
// that would make the path one the node answers with a redirect to its
// clean form, another path: they go as %2E and %2E%2E, which the node
// reads back as the id.
func pathSegment(s string) string {
	switch s {
	case ".":
		return "%2E"
	case "..":
		return "%2E%2E"
	}
	return url.PathEscape(s)
}

// PrefillDone marks a booked request's prefill as finished.
func (c *Client) PrefillDone(ctx context.Context, requestID string) error {
	return c.call(ctx, http.MethodPost, "/v1/requests/"+pathSegment(requestID)+"/prefill_done", nil, nil)
}

// Free ends a booked request.
func (c *Client) Free(ctx context.Context, requestID string) error {
	return c.call(ctx, http.MethodDelete, "/v1/requests/"+pathSegment(requestID), nil, nil)
}

// Workers lists the registered workers, sorted by id.
func (c *Client) Workers(ctx context.Context) ([]api.Worker, error) {
	var out api.WorkersResponse
	if err := c.call(ctx, http.MethodGet, "/v1/workers", nil, &keyed[api.WorkersResponse]{&out, "workers", func(w *api.WorkersResponse) bool { return w.Workers != nil }}); err != nil {
		return nil, err
	}
	return out.Workers, nil
}

// RegisterWorker registers a worker or updates its registration.
func (c *Client) RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error {
	return c.call(ctx, http.MethodPost, "/v1/workers", api.RegisterWorkerRequestFrom(w), nil)
}

// DeregisterWorker removes a worker; errors.Is(err, raftfsm.ErrUnknownWorker)
// when there is none of that id. It is not sent twice: the second try of
// a deregistration that went through answers ErrUnknownWorker. When a node
// may have taken it without answering, the error is ErrOutcomeUnknown:
// list the workers (Workers) to see whether it applied.
func (c *Client) DeregisterWorker(ctx context.Context, workerID uint64) error {
	return c.callOnce(ctx, http.MethodDelete, "/v1/workers/"+strconv.FormatUint(workerID, 10), nil, nil)
}

// IndexStats returns the index summary of the node that answers.
func (c *Client) IndexStats(ctx context.Context) (*api.IndexStats, error) {
	var out api.IndexStats
	if err := c.call(ctx, http.MethodGet, "/v1/index/stats", nil, &keyed[api.IndexStats]{&out, "entries", nil}); err != nil {
		return nil, err
	}
	return &out, nil
}

// Settings returns the cluster's scoring settings as the node that
// answers holds them (GET /v1/settings).
//
// A node of a build before GET /v1/settings answers it 405
// method_not_allowed: the next endpoint is asked then, as one that
// cannot be reached is, and when none of the rest answers, the error is
// the first 405 (with what the others did).
func (c *Client) Settings(ctx context.Context) (raftfsm.Settings, error) {
	return c.settings(ctx, "/v1/settings")
}

// ConsistentSettings returns the cluster's scoring settings as the leader
// holds them once it holds every change acknowledged before its term
// (GET /v1/settings?consistent=true): a follower forwards the read to the
// leader, and a leader just elected answers 503 no_leader until it has
// caught up, passed over as Settings' errors are. Read this way before
// putting the settings back changed (a read-modify-write): a follower's or
// a new leader's state may lack a change the cluster acknowledged, and
// putting it back would undo that change. A node of a build before the
// parameter ignores it and answers from its own state.
func (c *Client) ConsistentSettings(ctx context.Context) (raftfsm.Settings, error) {
	return c.settings(ctx, "/v1/settings?consistent=true")
}

// settings is Settings and ConsistentSettings, read at path.
func (c *Client) settings(ctx context.Context, path string) (raftfsm.Settings, error) {
	var out api.SettingsRequest
	req := request{method: http.MethodGet, path: path}
	var first error // the first node's 405: an older build
	for {
		err := c.callReq(ctx, req, &keyed[api.SettingsRequest]{&out, "params", nil})
		var e *Error
		if errors.As(err, &e) && e.StatusCode == http.StatusMethodNotAllowed && len(req.passed)+1 < len(c.endpoints) &&
			!slices.Contains(req.passed, e.Endpoint) {
			if first == nil {
				first = err
			}
			req.passed = append(req.passed, e.Endpoint)
			continue
		}
		switch {
		case err == nil:
		case first == nil:
			return raftfsm.Settings{}, err
		case errors.As(err, &e) && e.StatusCode != http.StatusMethodNotAllowed:
			return raftfsm.Settings{}, err // a node of a later build answered
		case errors.As(err, &e):
			return raftfsm.Settings{}, first
		default:
			return raftfsm.Settings{}, fmt.Errorf("%w (then: %w)", first, err)
		}
		break
	}
	s := raftfsm.Settings{}
	if out.Params != nil {
		s.Params = *out.Params
	}
	if out.View != "" { // omitted: the default, dedup
		v, ok := indexer.ParseView(out.View)
		if !ok {
			return raftfsm.Settings{}, fmt.Errorf("%w: settings of the view %q (this kvctl reads dedup and tiered)", ErrNotAnAnswer, out.View)
		}
		s.View = v
	}
	return s, nil
}

// SetSettings replaces the cluster's scoring settings. Params fields left at
// their zero value are sent as zero: start from indexer.DefaultParams.
func (c *Client) SetSettings(ctx context.Context, p indexer.Params, view indexer.View) error {
	return c.call(ctx, http.MethodPut, "/v1/settings", api.SettingsRequest{Params: &p, View: view.String()}, nil)
}

// Status returns the status of the node that answers (the preferred
// endpoint, or the next reachable one).
func (c *Client) Status(ctx context.Context) (*raftfsm.NodeStatus, error) {
	var out raftfsm.NodeStatus
	if err := c.call(ctx, http.MethodGet, "/v1/cluster/status", nil, (*statusAnswer)(&out)); err != nil {
		return nil, err
	}
	return &out, nil
}

// EndpointStatus is one endpoint's answer to StatusAll.
type EndpointStatus struct {
	Endpoint string              // the base URL asked
	Status   *raftfsm.NodeStatus // nil when Err is set
	Err      error
}

// StatusAll asks every endpoint for its status, concurrently, and returns
// the answers in the order of the endpoints.
func (c *Client) StatusAll(ctx context.Context) []EndpointStatus {
	out := make([]EndpointStatus, len(c.endpoints))
	var wg sync.WaitGroup
	for i, base := range c.endpoints {
		out[i].Endpoint = base
		wg.Go(func() {
			var st raftfsm.NodeStatus
			err := c.callReq(ctx, request{method: http.MethodGet, path: "/v1/cluster/status", endpoint: base}, (*statusAnswer)(&st))
			if err != nil {
				out[i].Err = err
				return
			}
			out[i].Status = &st
		})
	}
	wg.Wait()
	return out
}

// Ready reports whether the node that answers is ready, and its applied
// index. A node that is not ready answers 503 not_ready, which the client
// passes over like no_leader: with several endpoints, the answer is the
// first ready node's (or the last one's); give a client of one endpoint to
// ask a given node. A success without the "ready" field every node's
// holds is ErrNotAnAnswer, as for every other read: another service at
// that address, not a node that is not ready.
func (c *Client) Ready(ctx context.Context) (api.ReadyResponse, error) {
	var out api.ReadyResponse
	// A node's 200 says ready true: only another answer is looked at twice.
	err := c.call(ctx, http.MethodGet, "/readyz", nil, &keyed[api.ReadyResponse]{&out, "ready", func(r *api.ReadyResponse) bool { return r.Ready }})
	if err != nil {
		var ae *Error
		if errors.As(err, &ae) && ae.Reason == api.ReasonNotReady {
			// An error answer of a node's shape (decodeError: an error
			// text and a reason), as every other call's: not_ready. Its
			// body is a ReadyResponse too (state, applied index), but for
			// a node still loading its state, whose server is not up yet
			// (kvrouter's loading handler): error and reason alone.
			out = api.ReadyResponse{Error: ae.Message, Reason: ae.Reason}
			_ = json.Unmarshal(ae.body, &out)
			out.Ready = false
			return out, nil
		}
		return out, err
	}
	return out, nil
}

// Members lists the cluster's members, sorted by id.
func (c *Client) Members(ctx context.Context) ([]raftfsm.Member, error) {
	var out api.MembersResponse
	if err := c.call(ctx, http.MethodGet, "/v1/cluster/members", nil, &keyed[api.MembersResponse]{&out, "members", func(m *api.MembersResponse) bool { return m.Members != nil }}); err != nil {
		return nil, err
	}
	return out.Members, nil
}

// AddMember adds a voter.
func (c *Client) AddMember(ctx context.Context, id, raftAddr, httpAddr string) error {
	return c.call(ctx, http.MethodPost, "/v1/cluster/members",
		api.AddMemberRequest{ID: id, RaftAddr: raftAddr, HTTPAddr: httpAddr}, nil)
}

// RemoveMember removes a member.
func (c *Client) RemoveMember(ctx context.Context, id string) error {
	// Not sent twice: the second try of a removal that went through
	// answers that id is no member.
	return c.callOnce(ctx, http.MethodDelete, "/v1/cluster/members/"+pathSegment(id), nil, nil)
}

// TransferLeader hands leadership to the member to, or to any up-to-date
// voter when to is "".
func (c *Client) TransferLeader(ctx context.Context, to string) error {
	return c.callOnce(ctx, http.MethodPost, "/v1/cluster/leader/transfer", api.TransferLeaderRequest{To: to}, nil)
}

// IngestEvents sends batches of events and returns one ack per batch, in
// order, each with its rank. Batches that together would cost more than
// a node's decode budget of any body (api.EventsDecodeCost, more than
// api.DecodeBudgetFloor), which a node may refuse 413 too_large, are sent
// in several requests, each answered before the next is sent; a batch
// that costs more alone is sent alone. When one fails, the batches of
// those before it were applied: sent again, their events count as
// duplicates.
func (c *Client) IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	acks := make([]raftfsm.RankAck, 0, len(batches))
	for {
		n := min(1, len(batches)) // none: one request, which the node answers
		cost := api.EventsDecodeCost(batches[:n])
		for ; n < len(batches); n++ {
			cost += api.EventsDecodeCost(batches[n : n+1])
			if cost > api.DecodeBudgetFloor {
				break
			}
		}
		var out api.EventsResponse
		if err := c.call(ctx, http.MethodPost, "/v1/events", api.EventsRequestFrom(batches[:n]), &out); err != nil {
			return nil, err
		}
		if len(out.Acks) != n {
			return nil, fmt.Errorf("POST /v1/events: %d acks for %d batches", len(out.Acks), n)
		}
		for _, a := range out.Acks {
			acks = append(acks, a.RankAck())
		}
		if batches = batches[n:]; len(batches) == 0 {
			return acks, nil
		}
	}
}

// DumpRank replaces a rank's whole state with stored events, at cursor.
func (c *Client) DumpRank(ctx context.Context, rank kvevent.Rank, cursor uint64, stored []kvevent.Event) error {
	req := api.DumpRequest{Cursor: cursor, Events: make([]api.Event, len(stored))}
	for i := range stored {
		req.Events[i] = api.EventFrom(&stored[i])
	}
	path := fmt.Sprintf("/v1/ranks/%d/%d/dump", rank.Worker, rank.DP)
	// A node answers 200 with the dump's report, not 204: read it, so that
	// another service's success is not taken for a dump taken.
	var out api.DumpResponse
	return c.call(ctx, http.MethodPost, path, req, &keyed[api.DumpResponse]{&out, "cursor", nil})
}

// SnapshotResult describes a downloaded snapshot.
type SnapshotResult struct {
	// Info is what the server reported in the stream's trailers; fields it
	// did not report are zero (Bytes, which every build reports, is the
	// stream's length: SaveSnapshot fails when it is not).
	Info     raftfsm.SnapshotInfo
	Bytes    int64  // bytes received and written
	SHA256   string // of the bytes received
	Endpoint string // the base URL that answered
}

// SaveSnapshot streams the cluster's latest snapshot into w. On an error
// w may hold part of a stream, which must be thrown away; the stream
// itself ends with a checksum that raftfsm.InspectSnapshot verifies. A
// stream whose size trailer is missing or not its length is an error.
func (c *Client) SaveSnapshot(ctx context.Context, w io.Writer) (SnapshotResult, error) {
	var res SnapshotResult
	resp, base, err := c.do(ctx, request{method: http.MethodGet, path: "/v1/snapshot"})
	if err != nil {
		return res, err
	}
	defer resp.Body.Close()
	res.Endpoint = base
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(w, h), resp.Body)
	res.Bytes = n
	if err != nil {
		return res, fmt.Errorf("GET /v1/snapshot from %s: after %d bytes: %w", hostOf(base), n, err)
	}
	res.SHA256 = hex.EncodeToString(h.Sum(nil))
	// Trailers are filled in once the body has been read to its end.
	t := resp.Trailer
	if msg := t.Get(api.TrailerError); msg != "" {
		return res, &Error{Endpoint: base, StatusCode: resp.StatusCode, Reason: t.Get(api.TrailerErrorReason),
			Message: "snapshot stream failed after " + strconv.FormatInt(n, 10) + " bytes: " + msg}
	}
	// Every build sends the size trailer with a whole stream: one that
	// ended without it, or read other than its size, broke off without
	// the error trailers (a node of an earlier build whose handler
	// panicked half-way ended the stream cleanly), or came through a
	// proxy that drops trailers, which cannot tell either.
	size := t.Get(api.TrailerSnapshotBytes)
	if res.Info.Bytes, err = strconv.ParseInt(size, 10, 64); err != nil || res.Info.Bytes != n {
		if size == "" {
			size = "none"
		}
		return res, fmt.Errorf("GET /v1/snapshot from %s: the stream ended after %d bytes with %s %s (a stream cut short, or a proxy that drops HTTP trailers): throw it away",
			hostOf(base), n, api.TrailerSnapshotBytes, size)
	}
	res.Info.Index, _ = strconv.ParseUint(t.Get(api.TrailerSnapshotIndex), 10, 64)
	res.Info.Term, _ = strconv.ParseUint(t.Get(api.TrailerSnapshotTerm), 10, 64)
	v, _ := strconv.ParseUint(t.Get(api.TrailerSnapshotVersion), 10, 32)
	res.Info.FormatVersion = uint32(v)
	res.Info.SHA256 = t.Get(api.TrailerSnapshotSHA256)
	return res, nil
}

// RestoreSnapshot uploads a snapshot stream and installs it on the whole
// cluster. r is read once, unless it is an io.Seeker: then a call that
// could not reach a node is retried on the next endpoint from where r
// started. The upload announces its length when r tells it (an *os.File,
// a *bytes.Reader), and is chunked otherwise. When ctx ends while a Read
// of r blocks, the call returns without waiting for it: that Read is left
// to return on its own (close r to end it), and what it read is dropped.
// A success whose body is not a restore's report (another service's, a
// proxy's page) is ErrOutcomeUnknown and ErrNotAnAnswer, quoting the
// body's first bytes: no node said it installed the snapshot, and one
// behind a proxy may have.
func (c *Client) RestoreSnapshot(ctx context.Context, r io.Reader) (raftfsm.SnapshotInfo, error) {
	var out raftfsm.SnapshotInfo
	err := c.callReq(ctx, request{method: http.MethodPost, path: "/v1/snapshot/restore", stream: r, streamLen: streamLen(r), once: true}, (*restoreAnswer)(&out))
	return out, err
}

// streamLen returns how many bytes are left in r, or -1 when r cannot say.
func streamLen(r io.Reader) int64 {
	switch v := r.(type) {
	case interface{ Len() int }:
		return int64(v.Len())
	case interface {
		Stat() (fs.FileInfo, error)
		io.Seeker
	}:
		fi, err := v.Stat()
		if err != nil || !fi.Mode().IsRegular() {
			return -1
		}
		off, err := v.Seek(0, io.SeekCurrent)
		if err != nil || off > fi.Size() {
			return -1
		}
		return fi.Size() - off
	}
	return -1
}
