package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
)

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
