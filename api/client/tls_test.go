package client_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
)

// A cluster that serves TLS and asks for a token: a client given its CA,
// the https scheme and the token is served; one without the token gets
// ErrUnauthorized from the first node, and tries no other (the node
// answered).
func TestTokenAndTLS(t *testing.T) {
	const token = "t0ken"
	var hits [2]atomic.Int64
	var addrs []string
	var caFile string
	for i := range hits {
		f := apitest.New("n1", "")
		s := api.NewServer(f, api.Options{Logger: slog.New(slog.DiscardHandler), Token: token})
		hs := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits[i].Add(1)
			s.ServeHTTP(w, r)
		}))
		t.Cleanup(func() { hs.Close(); s.Close() })
		addrs = append(addrs, strings.TrimPrefix(hs.URL, "https://"))
		if i == 0 {
			caFile = filepath.Join(t.TempDir(), "ca.pem")
			if err := os.WriteFile(caFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw}), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	tlsCfg, err := client.TLSConfig(caFile)
	if err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	newTLSClient := func(tok string) *client.Client {
		c, err := client.New(addrs, client.Options{TLS: tlsCfg, Token: tok, Scheme: "https"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	ctx := context.Background()

	tok, err := client.Token("", tokenFile)
	if err != nil || tok != token {
		t.Fatalf("Token from the file = %q, %v; want %q", tok, err, token)
	}
	if _, err := newTLSClient(tok).Status(ctx); err != nil {
		t.Fatalf("with the CA and the token: %v", err)
	}
	before0, before1 := hits[0].Load(), hits[1].Load()
	_, err = newTLSClient("").Status(ctx)
	if !errors.Is(err, client.ErrUnauthorized) {
		t.Fatalf("without the token: %v, want ErrUnauthorized", err)
	}
	if h0, h1 := hits[0].Load(), hits[1].Load(); h0 != before0+1 || h1 != before1 {
		t.Fatalf("a 401 was not believed: hits went from %d,%d to %d,%d", before0, before1, h0, h1)
	}
	if _, err := newTLSClient("wrong").Status(ctx); !errors.Is(err, client.ErrUnauthorized) {
		t.Fatalf("with a wrong token: %v, want ErrUnauthorized", err)
	}
	// Without the CA the node's certificate is not trusted: no node is
	// served, and none is believed to have answered.
	c, err := client.New(addrs, client.Options{Token: token, Scheme: "https"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Status(ctx); !errors.Is(err, client.ErrUnreachable) {
		t.Fatalf("without the CA: %v, want ErrUnreachable", err)
	}
}

func TestTokenAndTLSConfigErrors(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	notPEM := filepath.Join(dir, "not.pem")
	for _, f := range []string{empty, notPEM} {
		content := ""
		if f == notPEM {
			content = "hello\n"
		}
		if err := os.WriteFile(f, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := client.Token("a", empty); err == nil {
		t.Error("a token and a token file: accepted")
	}
	if _, err := client.Token("", empty); err == nil {
		t.Error("an empty token file: accepted")
	}
	if _, err := client.Token("", filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing token file: accepted")
	}
	if tok, err := client.Token("", ""); tok != "" || err != nil {
		t.Errorf("no token = %q, %v", tok, err)
	}
	for _, bad := range []string{"a b", "a\x00b", "a\x7fb", "clé"} {
		if _, err := client.Token(bad, ""); err == nil {
			t.Errorf("token %q: accepted", bad)
		}
		if _, err := client.New([]string{"h:1"}, client.Options{Token: bad}); err == nil {
			t.Errorf("client.New with token %q: accepted", bad)
		}
	}
	nul := filepath.Join(dir, "nul")
	if err := os.WriteFile(nul, []byte("abc\x00def\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Token("", nul); err == nil {
		t.Error("a token file with a NUL: accepted")
	}
	if _, err := client.TLSConfig(notPEM); err == nil {
		t.Error("a CA file without PEM: accepted")
	}
	// A token file of the cap is read; a byte more is refused, as is a CA
	// file over its own (a path that never ends, /dev/zero, grew the
	// command's memory without them).
	atCap, overCap := filepath.Join(dir, "at-cap"), filepath.Join(dir, "over-cap")
	for f, n := range map[string]int{atCap: client.MaxTokenFileBytes, overCap: client.MaxCAFileBytes + 1} {
		if err := os.WriteFile(f, []byte(strings.Repeat("a", n)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if tok, err := client.Token("", atCap); err != nil || len(tok) != client.MaxTokenFileBytes {
		t.Errorf("a token file of MaxTokenFileBytes: %d byte(s), %v; want it read", len(tok), err)
	}
	if _, err := client.Token("", overCap); err == nil || !strings.Contains(err.Error(), "is larger than") {
		t.Errorf("a token file over MaxTokenFileBytes: %v, want it refused as larger", err)
	}
	if _, err := client.TLSConfig(overCap); err == nil || !strings.Contains(err.Error(), "is larger than") {
		t.Errorf("a CA file over MaxCAFileBytes: %v, want it refused as larger", err)
	}
	if _, err := client.New([]string{"h:1"}, client.Options{Token: "a b"}); err == nil {
		t.Error("a token with a space: accepted")
	}
	if _, err := client.New([]string{"h:1"}, client.Options{Scheme: "ftp"}); err == nil {
		t.Error("scheme ftp: accepted")
	}
}

// tlsNode serves the API over TLS (apitest.TLSNode) and returns the
// node's address and a client configuration that trusts its certificate.
func tlsNode(t *testing.T, dnsNames []string, notBefore, notAfter time.Time) (string, *tls.Config) {
	t.Helper()
	node := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(func() { node.Close() })
	addr, cert := apitest.TLSNode(t, node, dnsNames, notBefore, notAfter)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return addr, &tls.Config{RootCAs: pool}
}

// TestCertificateHint: a node's certificate that the client's handshake
// refuses stays in the call's error (its text as before), and
// CertificateHint tells apart a certificate not trusted, one that does not
// name the address dialed, and one expired. From a review: kvctl and
// kvrouter --join read the error's text, and took every wording of a name
// mismatch but one for a certificate not trusted.
func TestCertificateHint(t *testing.T) {
	now := time.Now()
	untrusted := httptest.NewTLSServer(http.NotFoundHandler())
	untrusted.Config.ErrorLog = log.New(io.Discard, "", 0)
	defer untrusted.Close()
	unnamed, unnamedTLS := tlsNode(t, []string{"node1.example"}, now.Add(-time.Hour), now.Add(time.Hour))
	expired, expiredTLS := tlsNode(t, nil, now.Add(-2*time.Hour), now.Add(-time.Hour))
	for _, c := range []struct {
		name string
		addr string
		tls  *tls.Config
		want []string
	}{
		{"not trusted", strings.TrimPrefix(untrusted.URL, "https://"), nil, []string{"not trusted", "--the-ca-flag"}},
		{"not naming the address", unnamed, unnamedTLS, []string{"does not name 127.0.0.1", "node1.example"}},
		{"expired", expired, expiredTLS, []string{"expired"}},
	} {
		cl, err := client.New([]string{c.addr}, client.Options{TLS: c.tls, Scheme: "https"})
		if err != nil {
			t.Fatal(err)
		}
		_, err = cl.Status(context.Background())
		cl.Close()
		var ve *tls.CertificateVerificationError
		if !errors.Is(err, client.ErrUnreachable) || !errors.As(err, &ve) || !strings.Contains(err.Error(), "x509:") {
			t.Errorf("%s: %v, want ErrUnreachable holding the certificate's verification error", c.name, err)
			continue
		}
		hint := client.CertificateHint(err, "--the-ca-flag")
		for _, w := range c.want {
			if !strings.Contains(hint, w) {
				t.Errorf("%s: CertificateHint = %q, want it to say %q", c.name, hint, w)
			}
		}
	}
	// Errors of no certificate: no hint.
	_, err := newClient(t, deadAddr(t)).Status(context.Background())
	if hint := client.CertificateHint(err, "--tls-ca"); hint != "" || err == nil {
		t.Errorf("an unreachable node (%v): CertificateHint = %q, want none", err, hint)
	}
}

// DialTimeout bounds a try's TLS handshake too (Options): a node that
// accepts the connection and never answers the handshake fails the try
// with net/http's TLS handshake timeout, the node unreachable, before the
// call's context (5 s, under the transport's default handshake bound of
// 10 s) ends. From a review: the client's transport without the bound
// passed every test of the package.
func TestDialTimeoutBoundsTheTLSHandshake(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var held []net.Conn
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // read from never: the handshake hangs
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-accepted
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	})
	c, err := client.New([]string{"https://" + ln.Addr().String()}, client.Options{DialTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err = c.Workers(ctx)
	if err == nil || errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, client.ErrUnreachable) ||
		!strings.Contains(err.Error(), "TLS handshake timeout") {
		t.Fatalf("a node that never answers the TLS handshake: %v; want it unreachable for the TLS handshake timeout, not the context's deadline", err)
	}
}
