package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/kvrouter/kvrouter/internal/readcap"
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

// MaxTokenFileBytes and MaxCAFileBytes bound what Token and TLSConfig
// read of a token file and of a CA file: a token is a few dozen bytes, a
// CA bundle (the system's whole, some hundred KiB) a few MiB at most.
// Unbounded, a path that never ends (/dev/zero, a producer that writes on)
// grew the command's memory until the kernel killed it.
const (
	MaxTokenFileBytes = 16 << 10
	MaxCAFileBytes    = readcap.MaxCAFileBytes
)

// OpenFunc opens a file for Token and TLSConfig to read: os.Open, or a
// caller's own, such as one whose reads an interrupt ends (a FIFO's
// producer may never open it, or stall).
type OpenFunc = readcap.OpenFunc

func openFile(path string) (io.ReadCloser, error) { return readcap.Open(path) }

// readCapped reads what open gives of path, failing on a file of more than
// limit bytes (readcap.Read: the NATS flags' files are read alike).
func readCapped(open OpenFunc, path string, limit int64) ([]byte, error) {
	return readcap.Read(open, path, limit)
}

// Token returns the token a command was given: token itself, or the
// content of file without the white space around it (a trailing newline).
// Both "" is no token; both set, an empty file, a file of more than
// MaxTokenFileBytes, or a token with anything but visible ASCII in it (no
// header carries it as written) is an error.
func Token(token, file string) (string, error) { return TokenFrom(token, file, openFile) }

// TokenFrom is Token reading file through open.
func TokenFrom(token, file string, open OpenFunc) (string, error) {
	switch {
	case token != "" && file != "":
		return "", errors.New("a token and a token file: give one of them")
	case file != "":
		b, err := readCapped(open, file, MaxTokenFileBytes)
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
// trusts the system's roots; a caFile of more than MaxCAFileBytes is an
// error.
func TLSConfig(caFile string) (*tls.Config, error) { return TLSConfigFrom(caFile, openFile) }

// TLSConfigFrom is TLSConfig reading caFile through open.
func TLSConfigFrom(caFile string, open OpenFunc) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile == "" {
		return cfg, nil
	}
	pem, err := readCapped(open, caFile, MaxCAFileBytes)
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
