package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
)

// CertificateHint says what to do when err holds a client's refusal of a
// node's TLS certificate in its own handshake (the errors of this
// package's calls keep it): the certificate does not name the address
// the node was reached at, is signed by no CA the client trusts (caFlag is
// the flag that gives one: --tls-ca), or is expired or otherwise not
// valid. It is "" for any other error, an API answer's text included (a
// follower's forward to its leader that failed its own TLS check).
func CertificateHint(err error, caFlag string) string {
	var name x509.HostnameError
	var authority x509.UnknownAuthorityError
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &name):
		return fmt.Sprintf("the node's certificate does not name %s, the address it was reached at (%s): "+
			"reach the node by a name or IP address its certificate holds, or reissue the certificate with that one", name.Host, certNames(name.Certificate))
	case errors.As(err, &authority):
		return fmt.Sprintf("the node's certificate is not trusted: give %s with the CA that signed it", caFlag)
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return "the node's certificate, or its CA's, has expired or is not valid yet: renew it (or check the clocks)"
	case errors.As(err, &invalid):
		return "the node's certificate is not valid for a TLS server here: reissue it"
	}
	return ""
}

// certNames says which names a certificate holds for a client to reach its
// server by.
func certNames(c *x509.Certificate) string {
	if c == nil {
		return "it names none that was read"
	}
	var names []string
	names = append(names, c.DNSNames...)
	for _, ip := range c.IPAddresses {
		names = append(names, ip.String())
	}
	if len(names) == 0 {
		return "it names none: a name goes in its subject alternative names, its common name is not read"
	}
	return "it names " + strings.Join(names, ", ")
}

// Token returns the token a command was given: token itself, or the
// content of file without the white space around it (a trailing newline).
// Both "" is no token; both set, an empty file, or a token with anything
// but visible ASCII in it (no header carries it as written) is an error.
func Token(token, file string) (string, error) {
	switch {
	case token != "" && file != "":
		return "", errors.New("a token and a token file: give one of them")
	case file != "":
		b, err := os.ReadFile(file)
		if err != nil {
			return "", fmt.Errorf("token file: %w", err)
		}
		if token = strings.TrimSpace(string(b)); token == "" {
			return "", fmt.Errorf("token file %s is empty", file)
		}
	}
	if err := checkToken(token); err != nil {
		return "", err
	}
	return token, nil
}

// checkToken refuses a token that an Authorization header cannot carry as
// written: anything but visible ASCII (white space, control characters,
// non-ASCII letters).
func checkToken(token string) error {
	for i := 0; i < len(token); i++ {
		if c := token[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("the token holds %q at byte %d: want visible ASCII only", c, i)
		}
	}
	return nil
}

// TLSConfig returns the TLS configuration of a client of nodes whose
// certificates the PEM certificates in caFile sign (or are). caFile ""
// trusts the system's roots.
func TLSConfig(caFile string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile == "" {
		return cfg, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("TLS CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("TLS CA %s holds no PEM certificate", caFile)
	}
	cfg.RootCAs = pool
	return cfg, nil
}
