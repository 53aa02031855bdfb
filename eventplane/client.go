package eventplane

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/internal/readcap"
	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// ClientOptions are how agents and routers connect to NATS: an embedded
// server of the router cluster, or an external NATS. The zero value
// connects without credentials or TLS.
type ClientOptions struct {
	Name string // the connection's name, as the server shows it
	// User and Password: a Password is sent only with its User, and a URL
	// that carries user information is sent that instead (nats.go).
	User, Password string
	Creds          string // a credentials file (JWT and seed), for an external NATS
	// TLSCA is a PEM file of the CA that signed the server's certificate
	// (default: the system's roots once TLS is on); TLSCert and TLSKey are
	// this client's certificate, for servers that require one.
	TLSCA, TLSCert, TLSKey string
	// OnCredsError, when set, is called with what is wrong with Creds
	// each time a connection finds the file holding no credentials that
	// CheckFiles would take: nats.go retries such a connection for ever,
	// reporting nothing (a refusal by the server it reports, and gives up
	// after two).
	OnCredsError func(error)
}

// pingInterval and maxPingsOut are how NATSOptions finds a
// connection dead that no error ends: a server that hangs (SIGSTOP, a
// frozen VM) or a partition without a reset keeps the TCP connection open
// and silent, and only unanswered pings tell. The connection is taken for
// dead and the next server tried 4 to 6 s into the silence, well within
// an agent's default lease (10 s, heartbeats every 1 s); nats.go's
// defaults (2 minutes, 2 pings) took 4 to 6 minutes, every heartbeat
// lost and the lease long expired while the other servers answered. A
// ping and its pong every 2 s are a few bytes.
const (
	pingInterval = 2 * time.Second
	maxPingsOut  = 2
)

// NATSOptions returns the nats.Connect options of o: reconnect for ever
// (an agent must survive the loss of any router node), a silent server
// taken for dead within seconds (pingInterval), then credentials and TLS
// as set.
func (o ClientOptions) NATSOptions() []nats.Option {
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond),
		nats.PingInterval(pingInterval), nats.MaxPingsOutstanding(maxPingsOut)}
	if o.Name != "" {
		opts = append(opts, nats.Name(o.Name))
	}
	if o.User != "" {
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	}
	if o.Creds != "" && o.OnCredsError == nil {
		opts = append(opts, nats.UserCredentials(o.Creds))
	} else if o.Creds != "" {
		// nats.UserCredentials' two reads of the file, the JWT's checked
		// as CheckFiles checks it.
		opts = append(opts, nats.UserJWT(func() (string, error) {
			if err := checkCreds(o.Creds); err != nil {
				err = fmt.Errorf("--nats-creds %q: %w", o.Creds, err)
				o.OnCredsError(err)
				return "", err
			}
			b, err := readcap.Read(readcap.Open, o.Creds, maxCredsFileBytes)
			if err != nil {
				return "", err
			}
			return nkeys.ParseDecoratedJWT(b)
		}, func(nonce []byte) ([]byte, error) {
			b, err := readcap.Read(readcap.Open, o.Creds, maxCredsFileBytes)
			if err != nil {
				return nil, err
			}
			kp, err := nkeys.ParseDecoratedNKey(b)
			if err != nil {
				err = fmt.Errorf("--nats-creds %q: %w", o.Creds, err)
				o.OnCredsError(err)
				return nil, err
			}
			defer kp.Wipe()
			return kp.Sign(nonce)
		}))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	if o.TLSCert != "" || o.TLSKey != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	return opts
}

// Check says what is wrong with o as the client options of the NATS
// URLs urls (which CheckNATSURLs took), nil when nothing is: the
// combinations nats.go would not use as given, silently. Its messages
// name the flags of kvagent and kvrouter (--nats-user, ...), and show no
// password.
func (o ClientOptions) Check(urls string) error {
	switch {
	case (o.TLSCert == "") != (o.TLSKey == ""):
		return errors.New("--nats-tls-cert and --nats-tls-key go together: give both, or neither")
	case o.User != "" || o.Password != "":
		if u := URLWithUser(urls); u != "" {
			return fmt.Errorf("--nats-url %q carries user information, which NATS sends instead of --nats-user and --nats-password "+
				"(a user alone, with no password, as a token): give the user and password in the URLs or in the flags, not both", u)
		}
		if o.User == "" {
			return errors.New("--nats-password needs --nats-user: NATS sends a password only with its user")
		}
	}
	return nil
}

// CheckFiles reads the files o names, and says what is wrong with the
// first that nats.go could not use, nil when none: the TLS client
// certificate and its key (a PEM pair), the CA (PEM certificates), and
// the credentials file, which must hold a user JWT and the user's nkey
// seed, parsed as nats.UserCredentials parses them when it connects. Its
// messages name the flags of kvagent and kvrouter (--nats-creds, ...),
// and show nothing of the files' contents.
//
// Without it a file missing or wrong failed each connection, and nats.go
// retries a connection for ever: a creds file holding no credentials
// (nkeys.ParseDecoratedJWT takes any text for a JWT; only the seed's
// absence fails, when the nonce is signed) kept an agent running,
// publishing nothing, as if NATS were out of reach. nats.go reads the
// files again at each connection; one that goes bad after the check is
// OnCredsError's.
func (o ClientOptions) CheckFiles() error {
	if o.TLSCert != "" || o.TLSKey != "" {
		if _, err := tls.LoadX509KeyPair(o.TLSCert, o.TLSKey); err != nil {
			return fmt.Errorf("--nats-tls-cert %q, --nats-tls-key %q: %w", o.TLSCert, o.TLSKey, err)
		}
	}
	if o.TLSCA != "" {
		b, err := readcap.Read(readcap.Open, o.TLSCA, readcap.MaxCAFileBytes)
		if err != nil {
			return fmt.Errorf("--nats-tls-ca %q: %w", o.TLSCA, err)
		}
		if !x509.NewCertPool().AppendCertsFromPEM(b) {
			return fmt.Errorf("--nats-tls-ca %q holds no PEM certificate", o.TLSCA)
		}
	}
	if o.Creds != "" {
		if err := checkCreds(o.Creds); err != nil {
			return fmt.Errorf("--nats-creds %q: %w", o.Creds, err)
		}
	}
	return nil
}

// maxCredsFileBytes bounds what CheckFiles reads of a --nats-creds file:
// one holds a user's JWT (its claims: a few hundred bytes, a few KiB with
// many permissions) and an nkey seed (58 bytes), each in a decorated
// block. Unbounded, a wrong path (/dev/zero) was read until the process
// died.
const maxCredsFileBytes = 64 << 10

// checkCreds parses a NATS credentials file as nats.UserCredentials does
// (nkeys.ParseDecoratedJWT, nkeys.ParseDecoratedNKey), and more strictly:
// the JWT must decode as a user's claims, and the seed must be that
// user's, or the server refuses the connection.
func checkCreds(file string) error {
	b, err := readcap.Read(readcap.Open, file, maxCredsFileBytes)
	if err != nil {
		return err
	}
	const want = "want a NATS credentials file (a -----BEGIN NATS USER JWT----- block, then the user's -----BEGIN USER NKEY SEED----- block, as nsc writes them)"
	tok, err := nkeys.ParseDecoratedJWT(b)
	if err != nil {
		return fmt.Errorf("%w: %s", err, want)
	}
	claims, err := jwt.DecodeUserClaims(tok)
	if err != nil {
		return fmt.Errorf("holds no user JWT (%v): %s", err, want)
	}
	kp, err := nkeys.ParseDecoratedNKey(b)
	if err != nil {
		return fmt.Errorf("holds no nkey seed (%w): %s", err, want)
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return fmt.Errorf("%w: %s", err, want)
	}
	if pub != claims.Subject {
		return fmt.Errorf("its seed is not the key of its JWT's user (%s): %s", claims.Subject, want)
	}
	return nil
}

// URLWithUser returns the first URL of urls (a list CheckNATSURLs took)
// that carries user information, as RedactURLs shows it, or "" when none
// does.
func URLWithUser(urls string) string {
	for _, u := range strings.Split(urls, ",") {
		if u = strings.TrimSpace(u); u == "" {
			continue
		}
		full := u
		if !strings.Contains(u, "://") {
			full = "nats://" + u
		}
		if p, err := url.Parse(full); err == nil && p.User != nil {
			return RedactURLs(u)
		}
	}
	return ""
}

// CheckNATSURLs says what is wrong with a list of NATS URLs (kvagent's
// and kvrouter's --nats-url), nil when nothing is: it must list,
// comma-separated, at least one URL of a NATS server, as nats.Connect
// takes them: [scheme://][user[:password]@]host[:port], the scheme nats
// (the default), tls, ws or wss, websocket URLs not mixed with others.
// Without the check a URL nats.go cannot reach ("http//bad url" is a host
// named http) is retried for ever.
//
// Its messages show no password: each names its URL as RedactURLs shows
// it, and none quotes url.Parse's error or a part of the parsed URL
// (a port) that a password written with an unescaped / ? # or @ could
// hold: url.Error quotes the URL as given, and its inner errors quote the
// text they refuse ("invalid port \":pa\"" of nats://alice:pa#ss@host).
func CheckNATSURLs(s string) error {
	parts := strings.Split(s, ",")
	shown := redactParts(parts) // messages never show a password
	n, ws := 0, 0
	for k, u := range parts {
		if u = strings.TrimSpace(u); u == "" {
			continue // nats.Connect skips it too
		}
		n++
		full := u
		if !strings.Contains(u, "://") {
			full = "nats://" + u
		}
		p, err := url.Parse(full)
		if err != nil {
			return fmt.Errorf("%q does not parse as a URL: want [nats://][user[:password]@]host[:port], "+
				"with any / ? # @ : %% or space of the user or password percent-encoded", shown[k])
		}
		isWS := false
		switch strings.ToLower(p.Scheme) { // the text before the first ':', which no password precedes
		case "nats", "tls":
		case "ws", "wss":
			ws++
			isWS = true // a websocket URL's path and query go in its handshake
		default:
			return fmt.Errorf("%q: scheme %q, want nats://host:port (or tls://, ws://, wss://)", shown[k], p.Scheme)
		}
		if p.Hostname() == "" {
			return fmt.Errorf("%q has no host: want nats://host:port", shown[k])
		}
		if port := p.Port(); port != "" { // none: nats.Connect takes the scheme's default
			// url.Parse took the port's digits; the message does not
			// quote them (a password's, if an '@' follows).
			if v, err := strconv.ParseUint(port, 10, 16); err != nil || v == 0 {
				return fmt.Errorf("%q: port out of range, want 1 to 65535", shown[k])
			}
		}
		if !isWS && (p.Path != "" && p.Path != "/" || p.RawQuery != "") || p.Fragment != "" || p.Opaque != "" {
			return fmt.Errorf("%q has more than a host and port (a path, query or fragment): want nats://host:port", shown[k])
		}
	}
	switch {
	case n == 0:
		return errors.New("no URL: want nats://host:port[,nats://host:port...]")
	case ws > 0 && ws < n:
		return errors.New("websocket URLs (ws://, wss://) mixed with others: NATS takes one kind or the other")
	}
	return nil
}

// RedactURLs returns a list of NATS URLs (--nats-url) with each URL's
// password hidden (user:xxxxx@host, as url.URL.Redacted writes it), and
// the user of one with no password, which nats.go sends as a token
// (xxxxx@host; url.URL.Redacted and nats.go's ConnectedUrlRedacted show
// it), for logs and messages. It reads the user information by the
// text, not as url.Parse does, so that no password shows whatever the input: a URL
// written without a scheme, one that does not parse, and a password
// holding an unescaped / ? # @ or space (which url.Parse reads as the
// end of the host) are hidden too. The user information runs from the
// scheme to the URL's last '@' (redactURL), so a websocket URL with an
// '@' in its path or query (ws://h:8080/nats?x=a@b) shows as
// ws://h:xxxxx@b: the text cannot tell that from a password written
// unescaped (ws://alice:8080/nats?x=a@b), and it errs on the side of
// hiding. A password with an unescaped ',' (which nats.Connect and
// CheckNATSURLs read as two URLs) is hidden too (redactGroups), unless
// its text before the ',' reads as a port (alice:1234,pw@h shows as
// alice:1234,xxxxx@h): the text cannot tell that from h:1234 followed by
// a URL with a token, and that list must show as the URLs it holds.
func RedactURLs(list string) string {
	parts := strings.Split(list, ",")
	var out []string
	for _, g := range redactGroups(parts) {
		out = append(out, redactURL(strings.Join(parts[g[0]:g[1]], ",")))
	}
	return strings.Join(out, ",")
}

// redactParts returns, for each part of a --nats-url split at its commas,
// the redacted text of the URL it belongs to (redactGroups): what
// CheckNATSURLs' messages name it by.
func redactParts(parts []string) []string {
	shown := make([]string, len(parts))
	for _, g := range redactGroups(parts) {
		r := strings.TrimSpace(redactURL(strings.Join(parts[g[0]:g[1]], ",")))
		for k := g[0]; k < g[1]; k++ {
			shown[k] = r
		}
	}
	return shown
}

// redactGroups groups the parts of a --nats-url split at its commas into
// the URLs whose passwords redactURL hides, as [first, end) ranges. A
// part is its own URL, except one with no '@' whose text after the
// scheme holds a ':' that does not begin a port (user:password, a
// password cut at a ',') and that is followed, before a part that begins
// with a scheme, by a part with an '@': the parts up to that one are one
// URL. A part that reads as host:port (a numeric port, an IPv6 host in
// brackets) is always a URL of its own: merged with a later user@host
// part (h:4222,bob@h2), the merged text would read as a user "h" with
// the password "4222,bob" and show as h:xxxxx@h2, a list the operator
// did not write.
func redactGroups(parts []string) [][2]int {
	var groups [][2]int
	for i := 0; i < len(parts); {
		end := i + 1
		p := strings.TrimSpace(parts[i])
		rest := p[schemeEnd(p):]
		if !strings.Contains(p, "@") && strings.Contains(rest, ":") && !isHostPort(rest) {
			for j := i + 1; j < len(parts); j++ {
				q := strings.TrimSpace(parts[j])
				if schemeEnd(q) > 0 {
					break // a URL of its own
				}
				if strings.Contains(q, "@") {
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

// schemeEnd returns the index in u (leading spaces included) just after
// its "scheme://", 0 when u does not begin with the scheme of a NATS URL
// (nats, tls, ws, wss, in any case). Any other text before a "://" reads
// as a user: alice://pw@host is alice's password "//pw" as much as the
// scheme alice, and hiding from alice's ':' hides both readings'
// passwords (http://alice:pw@h shows as http:xxxxx@h).
func schemeEnd(u string) int {
	lead := len(u) - len(strings.TrimLeft(u, " \t"))
	scheme, _, ok := strings.Cut(u[lead:], "://")
	if !ok {
		return 0
	}
	switch strings.ToLower(scheme) {
	case "nats", "tls", "ws", "wss":
		return lead + len(scheme) + len("://")
	}
	return 0
}

// redactURL returns u with the password of its user information hidden,
// or, when it has no password, the user: that is a token.
// The user information runs from the scheme (schemeEnd) to u's LAST '@',
// and its password from its first ':': a password may hold '@', '/', '?',
// '#', ':' or spaces written unescaped (alice:p@ss@host, alice:p/w@host),
// which url.Parse would read otherwise, and every byte of it is hidden.
func redactURL(u string) string {
	start := schemeEnd(u)
	at := strings.LastIndex(u[start:], "@")
	if at < 0 {
		return u
	}
	user, _, hasPassword := strings.Cut(u[start:start+at], ":")
	if !hasPassword {
		// A user with no password is a token (nats.go sends it as the
		// connection's auth_token): the whole user information is the
		// secret. The spaces before a URL without a scheme are kept.
		lead := start + len(user) - len(strings.TrimLeft(user, " \t"))
		return u[:lead] + "xxxxx" + u[start+at:]
	}
	return u[:start] + user + ":xxxxx" + u[start+at:]
}
