package eventplane

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/internal/lograte"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
)

// natsLogEvery is how often the embedded server's Error lines of one kind
// (natsLogKind) are logged at most: a fault that lasts (a peer down,
// clients with wrong credentials) repeats them at the rate of its retries
// or connections, and the next line logged says
// how many were left out ("left_out"). It is a little under the minute
// between a down route's reported attempts (routeErrorReports): at a
// minute, attempt 60's line, 59 retries of a second after attempt 1's,
// fell inside the interval and was left out, and a peer down was logged
// every two minutes.
const natsLogEvery = 50 * time.Second

// routeErrorReports is the route reconnect attempts per Error line of a
// route's (ServerConfig's routes, kvrouter's --nats-routes): nats-server
// logs its first failed attempt and every routeErrorReports-th after at
// Error, the others at Debug. It retries every second
// (DEFAULT_ROUTE_RECONNECT), so a peer down is a line a minute per route
// connection; its default, 1, logged every attempt of each of the pool's
// connections, some 4 lines a second for as long as the peer was down.
const routeErrorReports = 60

// ServerConfig configures the embedded NATS server a kvrouter node runs.
type ServerConfig struct {
	Name        string   // server name, unique in the NATS cluster (the node id)
	Addr        string   // client listen address host:port; port 0 (or -1) picks one
	ClusterName string   // default "kvrouter"
	ClusterAddr string   // route listen address host:port; empty: no NATS cluster
	Routes      []string // other servers' route addresses, host:port or nats-route://host:port (CheckRoute)
	// User and Password, when set, are required of clients, and of the
	// servers that route to ClusterAddr: this server's own route dials
	// send them, a route written with its own user information excepted
	// (nats-route://user:pass@host:port). A Password needs its User
	// (nats-server asks for nothing without one). A server that asks for
	// no route credentials takes a dial that sends them: a cluster half
	// upgraded keeps its routes, made by the servers that send them.
	User, Password string
	// TLSCert and TLSKey (PEM files), when set, make clients connect with
	// TLS; TLSCA, when set too, requires of them a certificate that CA
	// signed (it needs TLSCert and TLSKey). Routes between the servers stay
	// plain (the cluster network). In-process connections (the node's own)
	// skip TLS.
	TLSCert, TLSKey, TLSCA string
	// AuthFailures, when set, counts the clients and routes the server
	// refused for their credentials (kvrouter's
	// kvrouter_nats_authentication_failures_total): their Error lines are
	// logged at most once per natsLogEvery, so the count is here.
	AuthFailures prometheus.Counter
	Logger       *slog.Logger

	// logEvery and routeErrorReports, when set (by tests), replace
	// natsLogEvery and routeErrorReports: a test of a peer down sees its
	// lines in seconds instead of minutes.
	logEvery          time.Duration
	routeErrorReports int
}

// CheckServerAddr says what is wrong with addr as a listen address of the
// embedded server (ServerConfig.Addr and ClusterAddr, kvrouter's
// --nats-addr and --nats-cluster-addr), nil when nothing is: host:port,
// the port a number from 0 to 65535 (0, or nats-server's -1: one the
// kernel picks). nats-server takes a port number only: a service name
// ("127.0.0.1:http"), which net.Listen would look up, is refused here as
// StartServer refuses it.
func CheckServerAddr(addr string) error {
	_, _, err := splitHostPort(addr)
	return err
}

// CheckServerName says what is wrong with name as the embedded server's
// name (ServerConfig.Name, kvrouter's --node-id), nil when nothing is:
// nats-server refuses a name with a space, when it starts.
func CheckServerName(name string) error {
	if strings.Contains(name, " ") {
		return errors.New("holds a space, which the embedded NATS server refuses in its server name")
	}
	return nil
}

// splitHostPort parses a listen address of the embedded server for
// CheckServerAddr and StartServer alike, so that the check refuses what
// the server would: a port out of range fails only at its listen, after
// kvrouter has locked its data directory and taken its HTTP port.
func splitHostPort(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("port %q: %w", p, err)
	}
	// -1 is nats-server's RANDOM_PORT, which ServerConfig.Addr documents.
	if port < server.RANDOM_PORT || port > 65535 {
		return "", 0, fmt.Errorf("port %d: want a number from 0 to 65535", port)
	}
	if port == 0 {
		port = server.RANDOM_PORT
	}
	return host, port, nil
}

// CheckRoute says what is wrong with r as a route of the embedded server
// (ServerConfig.Routes, kvrouter's --nats-routes), nil when nothing is:
// host:port, or a URL nats-route://host:port (or nats://, as nats-server's
// configuration takes it), with a host and a port from 1 to 65535 and
// nothing after them; an IPv6 host in brackets, its zone as net.Dial
// takes it in host:port ([fe80::1%eth0]:6222) and escaped in a URL
// (nats-route://[fe80::1%25eth0]:6222). nats-server's own parse (RoutesFromStr) keeps a nil
// URL for a route that does not parse (a list separated by spaces, an IPv6
// address missing its ']'), and its route solicitation then crashes the
// process on it. Its messages never show the route's user information
// (redactRoute).
func CheckRoute(r string) error {
	_, err := parseRoute(r, redactRoute(strings.TrimSpace(r)))
	return err
}

// CheckRoutes checks a comma-separated list of routes (kvrouter's
// --nats-routes) as nats-server splits it, each as CheckRoute does, and
// returns them; empty entries are skipped. Its messages never show a
// route's user information, also when a password written with an
// unescaped ',' was cut in two there (shownRoute).
func CheckRoutes(list string) ([]string, error) {
	parts := strings.Split(list, ",")
	var routes []string
	for i, r := range parts {
		if r = strings.TrimSpace(r); r == "" {
			continue
		}
		if _, err := parseRoute(r, shownRoute(parts, i)); err != nil {
			return nil, err
		}
		routes = append(routes, r)
	}
	return routes, nil
}

// shownRoute returns what CheckRoutes' messages name parts[i] by: the
// route redacted (redactRoute), or, when it holds no '@' and a later part
// does before any part that begins a URL of its own ("://"), the parts up
// to that one joined and redacted: a password with an unescaped ',' is
// cut there, and its first half (nats-route://user:pass) holds no '@' to
// find its user information by. A part that reads as host:port (port 0,
// which CheckRoute refuses) is named on its own.
func shownRoute(parts []string, i int) string {
	end := i + 1
	if p := strings.TrimSpace(parts[i]); !strings.Contains(p, "@") && !isHostPort(p[routeSchemeEnd(p):]) {
		for j := i + 1; j < len(parts); j++ {
			if strings.Contains(parts[j], "://") {
				break
			}
			if strings.Contains(parts[j], "@") {
				end = j + 1
				break
			}
		}
	}
	return redactRoute(strings.TrimSpace(strings.Join(parts[i:end], ",")))
}

// redactRoute returns route r with its user information hidden whole, as
// xxxxx: the text from its scheme's "://" (or from its start) to its LAST
// '@'. It reads the text, not the URL url.Parse makes of it, so that no
// password shows whatever the parse outcome: a route that does not parse
// (a list separated by spaces, an IPv6 host missing its ']', a password
// with an unescaped '#'), and one that parses with a password holding an
// unescaped '/', '?' or '@', which url.Parse reads as the end of the host
// (the rest of the password then lies in the path or query, which
// url.URL.Redacted shows).
func redactRoute(r string) string {
	start := routeSchemeEnd(r)
	at := strings.LastIndex(r[start:], "@")
	if at < 0 {
		return r
	}
	return r[:start] + "xxxxx" + r[start+at:]
}

// escapeZone returns host:port route r with the zone of its IPv6 host
// escaped as a URL writes it ([fe80::1%25eth0]:6222, which url.Parse
// requires): r is read as net.Dial and --nats-cluster-addr read it
// ([fe80::1%eth0]:6222), and every '%' between its brackets is the
// zone's. The brackets are looked for after the user information.
func escapeZone(r string) string {
	at := strings.LastIndex(r, "@") + 1
	open, end := strings.Index(r[at:], "["), strings.Index(r[at:], "]")
	if open < 0 || end < open {
		return r
	}
	return r[:at+open] + strings.ReplaceAll(r[at+open:at+end], "%", "%25") + r[at+end:]
}

// routeSchemeEnd returns the index in r just after its "scheme://", 0
// when r does not begin with a scheme.
func routeSchemeEnd(r string) int {
	if scheme, _, ok := strings.Cut(r, "://"); ok && isScheme(scheme) {
		return len(scheme) + len("://")
	}
	return 0
}

// isScheme reports whether s reads as a URL scheme (RFC 3986: a letter,
// then letters, digits, '+', '-' or '.'): the text before a "://" that
// is not one (user:pa://ss@host) is user information.
func isScheme(s string) bool {
	for i, c := range s {
		letter := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
		if !letter && (i == 0 || !('0' <= c && c <= '9' || c == '+' || c == '-' || c == '.')) {
			return false
		}
	}
	return s != ""
}

// parseRoute parses a route as CheckRoute checks it; its messages name
// the route by shown, which shows no user information.
func parseRoute(r, shown string) (*url.URL, error) {
	r = strings.TrimSpace(r)
	full := r
	if !strings.Contains(r, "://") {
		full = "nats-route://" + escapeZone(r)
	}
	// The user information is hidden whole: say how to write one that
	// url.Parse reads otherwise.
	password := ""
	if shown != r {
		password = "; any / ? # @ , % or space of the user or password percent-encoded"
	}
	u, err := url.Parse(full)
	if err != nil || u == nil {
		zone := ""
		if full == r && strings.Contains(r, "%") {
			zone = "; a URL writes an IPv6 zone's % as %25, nats-route://[fe80::1%25eth0]:6222"
		}
		return nil, fmt.Errorf("%q does not parse as a route: want host:port or nats-route://host:port "+
			"(a list is comma-separated; an IPv6 host is written in brackets, [::1]:6222%s%s)", shown, zone, password)
	}
	switch u.Scheme {
	case "nats-route", "nats":
	default:
		// Not u.Scheme: the text before a ':' of a route with no scheme
		// (user:pa://ss@host) is its user.
		return nil, fmt.Errorf("%q: want host:port or nats-route://host:port (the scheme nats-route or nats)", shown)
	}
	// nats-server dials the URL's Host split by net.SplitHostPort, not by
	// url.URL's Hostname and Port, which split an IPv6 host written
	// without brackets (fd00::2:6222) at its last ':': a route that
	// SplitHostPort refuses is one it never dials, without a word.
	host, port, err := net.SplitHostPort(u.Host)
	switch {
	case err != nil && strings.Count(u.Host, ":") > 1 && !strings.HasPrefix(u.Host, "["):
		return nil, fmt.Errorf("%q: an IPv6 host is written in brackets, [fd00::2]:6222 (host:port)", shown)
	case err == nil && host == "":
		return nil, fmt.Errorf("%q has no host: want host:port", shown)
	}
	if p, perr := strconv.ParseUint(port, 10, 16); err != nil || perr != nil || p == 0 {
		return nil, fmt.Errorf("%q: want a port from 1 to 65535 (host:port)", shown)
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.Fragment != "" || u.Opaque != "" {
		return nil, fmt.Errorf("%q has more than a host and port: want host:port (or nats-route://host:port%s)", shown, password)
	}
	return u, nil
}

// StartServer starts an embedded NATS server and waits until it accepts
// connections. Call Shutdown on it to stop it. A setting that the server
// would ignore, or not enforce, is an error: a route that CheckRoute
// refuses, routes without a ClusterAddr, a Password without its User, a
// TLSCA without TLSCert and TLSKey.
func StartServer(cfg ServerConfig) (*server.Server, error) {
	host, port, err := splitHostPort(cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("nats address %q: %w", cfg.Addr, err)
	}
	switch {
	case cfg.Password != "" && cfg.User == "":
		return nil, errors.New("nats server: a password needs its user (without one, every client is let in)")
	case cfg.TLSCA != "" && (cfg.TLSCert == "" || cfg.TLSKey == ""):
		return nil, errors.New("nats server: a TLS CA for client certificates needs the server's TLS certificate and key")
	}
	var routes []*url.URL
	for _, r := range cfg.Routes {
		if strings.TrimSpace(r) == "" {
			continue
		}
		u, err := parseRoute(r, redactRoute(strings.TrimSpace(r)))
		if err != nil {
			return nil, fmt.Errorf("nats route %w", err)
		}
		routes = append(routes, u)
	}
	if len(routes) > 0 && cfg.ClusterAddr == "" {
		return nil, errors.New("nats server: routes need a cluster address to route from")
	}
	opts := &server.Options{
		ServerName: cfg.Name, Host: host, Port: port,
		Username: cfg.User, Password: cfg.Password,
		NoSigs: true, NoLog: true, MaxPayload: 8 << 20,
		ReconnectErrorReports: cmp.Or(cfg.routeErrorReports, routeErrorReports),
		// Publishers reconnect to any server of the cluster; the default
		// 2 s write deadline is fine, keep the rest at defaults.
	}
	if cfg.TLSCert != "" || cfg.TLSKey != "" {
		tc, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: cfg.TLSCert, KeyFile: cfg.TLSKey,
			CaFile: cfg.TLSCA, Verify: cfg.TLSCA != ""})
		if err != nil {
			return nil, fmt.Errorf("nats TLS: %w", err)
		}
		opts.TLS, opts.TLSConfig, opts.TLSVerify, opts.TLSTimeout = true, tc, cfg.TLSCA != "", 2
	}
	if cfg.ClusterAddr != "" {
		ch, cp, err := splitHostPort(cfg.ClusterAddr)
		if err != nil {
			return nil, fmt.Errorf("nats cluster address %q: %w", cfg.ClusterAddr, err)
		}
		opts.Cluster = server.ClusterOpts{Name: cfg.ClusterName, Host: ch, Port: cp}
		if opts.Cluster.Name == "" {
			opts.Cluster.Name = "kvrouter"
		}
		// The route port asks for the clients' credentials: without them
		// any server reaching it joins the NATS cluster, and relays what
		// its own clients publish, unauthenticated, to this server's
		// subscribers (kvrouter-ingest included).
		if cfg.User != "" {
			opts.Cluster.Username, opts.Cluster.Password = cfg.User, cfg.Password
			for _, u := range routes {
				if u.User == nil {
					u.User = url.UserPassword(cfg.User, cfg.Password)
				}
			}
		}
		opts.Routes = routes
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("nats server: %w", err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	// The server reports a port it cannot listen on through Fatalf, from
	// its accept loop, and never gets ready: that message is the error,
	// at once (it took the whole wait before, and said only "did not
	// start").
	fatal := make(chan string, 1)
	s.SetLoggerV2(natsLogger{l: logger.With("component", "nats"), fatal: fatal,
		limit: lograte.New(cmp.Or(cfg.logEvery, natsLogEvery), nil), authFailures: cfg.AuthFailures}, false, false, false)
	go s.Start()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if s.ReadyForConnections(20 * time.Millisecond) {
			return s, nil
		}
		select {
		case msg := <-fatal:
			// The server listens for routes only once its client listener
			// is up: a fatal error while that is up is the route
			// listener's, and names the cluster address.
			clientUp := s.Addr() != nil
			s.Shutdown()
			if cfg.ClusterAddr != "" && clientUp {
				return nil, fmt.Errorf("nats cluster address %s: %s", cfg.ClusterAddr, msg)
			}
			return nil, fmt.Errorf("nats server on %s: %s", cfg.Addr, msg)
		default:
		}
		if time.Now().After(deadline) {
			s.Shutdown()
			return nil, fmt.Errorf("nats server on %s did not start within 10s", cfg.Addr)
		}
	}
}

// natsLogger sends the server's log lines to slog, and its first fatal
// one to fatal too. Its Error lines are rate-limited per kind (limit,
// natsLogKind): a peer down is one per route reconnect, and with the
// pool's connections each reconnecting, routeErrorReports still logs
// their first attempts together; anyone who reaches the client port
// writes one per connection refused for its credentials (seen: 1,900
// lines a second from one client in a loop).
type natsLogger struct {
	l            *slog.Logger
	fatal        chan<- string
	limit        *lograte.Limiter
	authFailures prometheus.Counter // nil: not counted
}

func (n natsLogger) Noticef(format string, v ...any) { n.l.Info(fmt.Sprintf(format, v...)) }
func (n natsLogger) Warnf(format string, v ...any)   { n.l.Warn(fmt.Sprintf(format, v...)) }
func (n natsLogger) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	n.l.Error(msg)
	select {
	case n.fatal <- msg:
	default:
	}
}
func (n natsLogger) Errorf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	auth := isAuthFailure(msg)
	if auth && n.authFailures != nil {
		n.authFailures.Inc()
	}
	ok, skipped, overflowed := n.limit.Check(natsLogKind(msg, auth))
	if !ok {
		if overflowed {
			// Its kind crowded out (by lines a client varied): kept at
			// Debug rather than only counted in a kind that names none
			// of it.
			n.l.Debug(msg)
		}
		return
	}
	if skipped > 0 {
		n.l.Error(routeAuthHint(msg), "left_out", skipped)
		return
	}
	n.l.Error(routeAuthHint(msg))
}

// isAuthFailure reports whether msg, an Error line of the server's, tells
// of a client or route it refused for its credentials. nats-server says so
// only in its log (no hook counts them): its text is what there is to go by.
func isAuthFailure(msg string) bool {
	return strings.Contains(msg, server.ErrAuthentication.Error())
}

// natsLogKind is the kind natsLogger rate-limits Error line msg under: its
// numbers taken out (lograte.Kind: attempts, addresses, connection ids),
// and of an authentication failure everything but whether a client or a
// route failed, since the rest (the user name, the client's name, an IPv6
// address) is the connecting side's to vary. A parser error is one kind
// per kind of connection ("Client parser ERROR", "Router parser ERROR"):
// it quotes the bytes the other side sent (proto='...'), and a client
// sending garbage would otherwise make a kind per connection and fill the
// limiter, crowding out the first line of a real fault.
func natsLogKind(msg string, auth bool) string {
	switch {
	case auth && strings.Contains(msg, " - rid:"):
		return "route " + server.ErrAuthentication.Error()
	case auth:
		return "client " + server.ErrAuthentication.Error()
	}
	if peer := routePeer(msg); peer != "" {
		// The peer stays in the kind (the members are few): two peers
		// down are two kinds, each logged, not one kind naming whichever
		// failed last (an address is all digits, which Kind folds).
		return lograte.Kind(msg) + "\x00" + peer
	}
	if i := strings.Index(msg, parserError); i >= 0 {
		fields := strings.Fields(msg[:i])
		if len(fields) > 0 {
			return fields[len(fields)-1] + parserError
		}
		return parserError
	}
	return lograte.Kind(msg)
}

// routeConnectError begins nats-server's line of a route's failed dial:
// "Error trying to connect to route (attempt N): dial tcp ADDR: ...".
const routeConnectError = "Error trying to connect to route"

// routePeer returns the address a route's failed dial names (the
// "dial tcp" error's), or "" for a line of another kind or one that names
// none (a failed lookup names the host, which Kind keeps).
func routePeer(msg string) string {
	if !strings.Contains(msg, routeConnectError) {
		return ""
	}
	_, rest, ok := strings.Cut(msg, "dial tcp ")
	if !ok {
		return ""
	}
	addr, _, _ := strings.Cut(rest, ": ")
	return addr
}

// parserError is what nats-server's line of a connection that sent what
// it could not parse holds, after the kind of connection ("Client").
const parserError = " parser ERROR"

// routeAuthHint returns msg, a line of the server's log, with what to
// check added when it tells of a route refused for its credentials: the
// refused side's "Route Error 'Authorization Violation'", the refusing
// side's "authentication error", each of a route connection ("rid:").
// Neither line shows a password.
func routeAuthHint(msg string) string {
	const same = "every server of the NATS cluster needs the same user and password (kvrouter's --nats-user and --nats-password)"
	if !strings.Contains(msg, " - rid:") {
		return msg
	}
	switch {
	case strings.Contains(msg, "'Authorization Violation'"):
		return msg + ": the other server refused this one's route credentials; " + same
	case strings.Contains(msg, server.ErrAuthentication.Error()):
		return msg + ": a route dial was refused for its credentials; " + same +
			" (a server of a build that sends none is refused too, its route made by this server's dial)"
	}
	return msg
}
func (n natsLogger) Debugf(format string, v ...any) { n.l.Debug(fmt.Sprintf(format, v...)) }
func (n natsLogger) Tracef(format string, v ...any) {}
