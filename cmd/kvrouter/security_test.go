package main

import (
	"crypto/tls"
	"net"
	"testing"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/api/apitest"
)

// TestTheHTTPPortsRefuseTLSBelow12: --tls-cert serves TLS 1.2 and up
// (security.go's MinVersion): a TLS 1.1 client is refused in the
// handshake, a TLS 1.2 one served. A review's sabotage (MinVersion
// tls.VersionTLS10, run with GODEBUG=tls10server=1, without which Go's
// own default refuses TLS 1.0 and 1.1 still) passed every test before
// this one.
func TestTheHTTPPortsRefuseTLSBelow12(t *testing.T) {
	clearFlagEnv(t)
	cert, key := apitest.WriteSelfSigned(t, t.TempDir())
	app := newApp()
	app.ExitErrHandler = func(*cli.Context, error) {}
	var sec security
	app.Action = func(c *cli.Context) (err error) { sec, err = loadSecurity(c); return err }
	if err := app.Run([]string{"kvrouter", "--tls-cert", cert, "--tls-key", key}); err != nil {
		t.Fatal(err)
	}
	ln, err := sec.listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	for _, v := range []uint16{tls.VersionTLS10, tls.VersionTLS11, tls.VersionTLS12} {
		d := &net.Dialer{Timeout: 5 * time.Second}
		c, err := tls.DialWithDialer(d, "tcp", ln.Addr().String(), &tls.Config{InsecureSkipVerify: true, MinVersion: v, MaxVersion: v})
		if c != nil {
			c.Close()
		}
		if v < tls.VersionTLS12 && err == nil {
			t.Errorf("a TLS version %#x client was served, want it refused", v)
		}
		if v == tls.VersionTLS12 && err != nil {
			t.Errorf("a TLS 1.2 client: %v, want it served", err)
		}
	}
}
