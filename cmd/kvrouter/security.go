package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"

	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/urfave/cli/v2"
)

// security is how the node's HTTP API is guarded: the token a request must
// carry, and TLS. Every node of a cluster runs with the same: a follower
// forwards the client's token to the leader, over TLS when it serves TLS.
type security struct {
	token     string
	serverTLS *tls.Config // nil: plain HTTP
	clientTLS *tls.Config // trusts the other nodes' certificates
}

// loadSecurity reads --token or --token-file (either given outranks
// both variables: clihelp.TokenArgs) and the --tls-* files, so
// that a file that is missing or wrong stops the start before anything
// listens.
func loadSecurity(c *cli.Context) (security, error) {
	var sec security
	var err error
	// Either token flag given outranks both variables, as kvctl's: a
	// stale KVROUTER_TOKEN does not stand against --token-file given.
	token, file, given := clihelp.TokenArgs(c, "KVROUTER_TOKEN", "KVROUTER_TOKEN_FILE")
	if sec.token, err = client.Token(token, file); err != nil {
		names := "--token, --token-file"
		if !given {
			names = "KVROUTER_TOKEN, KVROUTER_TOKEN_FILE"
		}
		return sec, fmt.Errorf("%s: %w", names, err)
	}
	cert, key, ca := c.String("tls-cert"), c.String("tls-key"), c.String("tls-ca")
	switch {
	case (cert == "") != (key == ""):
		return sec, errors.New("--tls-cert and --tls-key go together: give both, or neither")
	case cert == "" && ca != "":
		return sec, errors.New("--tls-ca trusts the other nodes' certificates: it needs --tls-cert and --tls-key (the nodes of a cluster all serve TLS, or none does)")
	case cert == "":
		return sec, nil
	}
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		return sec, fmt.Errorf("--tls-cert, --tls-key: %w", err)
	}
	sec.serverTLS = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	if sec.clientTLS, err = client.TLSConfig(ca); err != nil {
		return sec, fmt.Errorf("--tls-ca: %w", err)
	}
	return sec, nil
}

// checkNATSFiles reads the --nats-tls-* files, and with --nats-url the
// --nats-creds file (checkNATSFlags refuses it otherwise), as
// loadSecurity reads the --tls-* files: a file that is missing or wrong
// is a usage error naming its flag, before the data directory is locked
// and anything listens, rather than a failed start once the embedded
// server starts or the client connects. The check is kvagent's too
// (eventplane.ClientOptions.CheckFiles): PEM for the TLS files, and for
// the creds file a user JWT and that user's nkey seed, which nats.go
// needs to connect.
func checkNATSFiles(c *cli.Context) error {
	return eventplane.ClientOptions{TLSCA: c.String("nats-tls-ca"), TLSCert: c.String("nats-tls-cert"),
		TLSKey: c.String("nats-tls-key"), Creds: c.String("nats-creds")}.CheckFiles()
}

// scheme is how the nodes' HTTP addresses are reached.
func (s security) scheme() string {
	if s.serverTLS != nil {
		return "https"
	}
	return "http"
}

// listen listens on addr, serving TLS when the node does.
func (s security) listen(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil || s.serverTLS == nil {
		return ln, err
	}
	return tls.NewListener(ln, s.serverTLS), nil
}

// transport returns a transport to the other nodes (forwards, joins); the
// caller closes its idle connections.
func (s security) transport() *http.Transport {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if s.clientTLS != nil {
		tr.TLSClientConfig = s.clientTLS
	}
	return tr
}
