package eventplane

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// ClientOptions are how agents and routers connect to NATS: an embedded
// server of the router cluster, or an external NATS. The zero value
// connects without credentials or TLS.
type ClientOptions struct {
	Name           string // the connection's name, as the server shows it
	User, Password string
	Creds          string // a credentials file (JWT and seed), for an external NATS
	// TLSCA is a PEM file of the CA that signed the server's certificate
	// (default: the system's roots once TLS is on); TLSCert and TLSKey are
	// this client's certificate, for servers that require one.
	TLSCA, TLSCert, TLSKey string
}

// NATSOptions returns the nats.Connect options of o: reconnect for ever
// (an agent must survive the loss of any router node), then credentials and
// TLS as set.
func (o ClientOptions) NATSOptions() []nats.Option {
	opts := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond)}
	if o.Name != "" {
		opts = append(opts, nats.Name(o.Name))
	}
	if o.User != "" {
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	}
	if o.Creds != "" {
		opts = append(opts, nats.UserCredentials(o.Creds))
	}
	if o.TLSCA != "" {
		opts = append(opts, nats.RootCAs(o.TLSCA))
	}
	if o.TLSCert != "" || o.TLSKey != "" {
		opts = append(opts, nats.ClientCert(o.TLSCert, o.TLSKey))
	}
	return opts
}

// CheckNATSURLs says what is wrong with a list of NATS URLs (kvagent's
// and kvrouter's --nats-url), nil when nothing is: it must list, comma-separated, at least one URL of a NATS server,
// as nats.Connect takes them: [scheme://][user[:password]@]host[:port],
// the scheme nats (the default), tls, ws or wss, websocket URLs not mixed
// with others. Without the check a URL nats.go cannot reach ("http//bad
// url" is a host named http) is retried for ever. Its messages show no
// password (RedactURLs).
func CheckNATSURLs(s string) error {
	n, ws := 0, 0
	for _, u := range strings.Split(s, ",") {
		if u = strings.TrimSpace(u); u == "" {
			continue // nats.Connect skips it too
		}
		n++
		shown := RedactURLs(u) // messages never show a password
		full := u
		if !strings.Contains(u, "://") {
			full = "nats://" + u
		}
		p, err := url.Parse(full)
		if err != nil {
			return fmt.Errorf("%q is not a URL: %w", shown, err)
		}
		isWS := false
		switch strings.ToLower(p.Scheme) {
		case "nats", "tls":
		case "ws", "wss":
			ws++
			isWS = true // a websocket URL's path and query go in its handshake
		default:
			return fmt.Errorf("%q: scheme %q, want nats://host:port (or tls://, ws://, wss://)", shown, p.Scheme)
		}
		if p.Hostname() == "" {
			return fmt.Errorf("%q has no host: want nats://host:port", shown)
		}
		if port := p.Port(); port != "" { // none: nats.Connect takes the scheme's default
			if v, err := strconv.ParseUint(port, 10, 16); err != nil || v == 0 {
				return fmt.Errorf("%q: port %q, want 1 to 65535", shown, port)
			}
		}
		if !isWS && (p.Path != "" && p.Path != "/" || p.RawQuery != "") || p.Fragment != "" || p.Opaque != "" {
			return fmt.Errorf("%q has more than a host and port (a path, query or fragment): want nats://host:port", shown)
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
// password hidden (user:xxxxx@host, as url.URL.Redacted writes it), for
// logs and messages. It reads the user and password by the text, before
// the host's last @: a URL written without a scheme, or one that does not
// parse, shows none either.
func RedactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, u := range parts {
		parts[i] = redactURL(u)
	}
	return strings.Join(parts, ",")
}

// redactURL returns u with the password of its user information hidden.
func redactURL(u string) string {
	start := 0
	if i := strings.Index(u, "://"); i >= 0 {
		start = i + len("://")
	}
	authority := u[start:]
	if end := strings.IndexAny(authority, "/?#"); end >= 0 {
		authority = authority[:end] // an @ after the host is no user's
	}
	at := strings.LastIndex(authority, "@")
	if at < 0 {
		return u
	}
	user, _, hasPassword := strings.Cut(authority[:at], ":")
	if !hasPassword {
		return u
	}
	return u[:start] + user + ":xxxxx" + u[start+at:]
}
