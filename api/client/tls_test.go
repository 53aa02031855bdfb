package client_test

import (
	"context"
	"encoding/pem"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

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
	if _, err := client.New([]string{"h:1"}, client.Options{Token: "a b"}); err == nil {
		t.Error("a token with a space: accepted")
	}
	if _, err := client.New([]string{"h:1"}, client.Options{Scheme: "ftp"}); err == nil {
		t.Error("scheme ftp: accepted")
	}
}
