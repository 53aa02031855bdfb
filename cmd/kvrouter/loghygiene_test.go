package main

import (
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// TestFailedTLSHandshakesDoNotFloodTheLog: a node serving its API over TLS
// (--tls-cert, --tls-key) must not log one line per connection whose
// handshake fails (a port scan, a plain-HTTP client, a load balancer's TCP
// check): the line count would grow with the attacker's rate.
func TestFailedTLSHandshakesDoNotFloodTheLog(t *testing.T) {
	var logs testlog.Buffer
	old := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})))
	t.Cleanup(func() { slog.SetDefault(old) })

	der, key := apitest.SelfSigned(t, &x509.Certificate{Subject: pkix.Name{CommonName: "n1"},
		DNSNames: []string{"localhost"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tln := tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}, MinVersion: tls.VersionTLS12})
	handshakes := prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_http_tls_handshake_errors_total", Help: "x"})
	srv := newHTTPServer(http.NotFoundHandler(), httpErrorLog(slog.Default(), ln.Addr().String(), handshakes))
	go srv.Serve(tln)
	t.Cleanup(func() { srv.Close() })

	const conns = 500
	for i := 0; i < conns; i++ {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		c.SetReadDeadline(time.Now().Add(2 * time.Second))
		c.Read(make([]byte, 512))
		c.Close()
	}
	// Each connection's handshake error is counted before it is logged
	// (or not): once all are counted, all lines are in.
	counted := func() float64 {
		var m dto.Metric
		handshakes.Write(&m)
		return m.GetCounter().GetValue()
	}
	poll(t, "every failed handshake counted in kvrouter_http_tls_handshake_errors_total", func() bool { return counted() >= conns })
	lines := strings.Count(logs.String(), "\n")
	if lines > 10 {
		first := strings.SplitN(logs.String(), "\n", 2)[0]
		t.Fatalf("%d plain-HTTP connections to the TLS API port logged %d lines (want a bounded summary, at most 10); first: %s", conns, lines, first)
	}
}
