package apitest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TLSNode serves h (an API server) over TLS, with a self-signed CA
// certificate that names dnsNames only and is valid from
// notBefore to notAfter, until the test ends. It returns the node's
// host:port and the certificate, for a client to trust (a pool, or its
// PEM in a --tls-ca file). The handshakes a client refuses are not logged.
func TLSNode(t testing.TB, h http.Handler, dnsNames []string, notBefore, notAfter time.Time) (string, *x509.Certificate) {
	t.Helper()
	der, key := SelfSigned(t, &x509.Certificate{Subject: pkix.Name{CommonName: "node1"},
		DNSNames: dnsNames, NotBefore: notBefore, NotAfter: notAfter})
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewUnstartedServer(h)
	hs.TLS = &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}
	hs.Config.ErrorLog = log.New(io.Discard, "", 0)
	hs.StartTLS()
	t.Cleanup(hs.Close)
	return strings.TrimPrefix(hs.URL, "https://"), cert
}

// SelfSigned signs tmpl with a new P-256 key, as its own CA: a server
// certificate a client trusts by naming it in its pool or --tls-ca. The
// serial number, key usages and CA flags are set here; tmpl gives the
// names (CommonName, DNSNames, IPAddresses) and the validity.
func SelfSigned(t testing.TB, tmpl *x509.Certificate) (der []byte, key *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	c := *tmpl
	c.SerialNumber = big.NewInt(1)
	c.IsCA, c.BasicConstraintsValid = true, true
	c.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature
	c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	der, err = x509.CreateCertificate(rand.Reader, &c, &c, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return der, key
}

// WriteSelfSigned writes a SelfSigned certificate for 127.0.0.1, valid
// from an hour ago for a day, and its key into dir as PEM files
// (node.pem, node-key.pem), for the --tls-* flags, and returns their
// paths.
func WriteSelfSigned(t testing.TB, dir string) (certFile, keyFile string) {
	t.Helper()
	now := time.Now()
	der, key := SelfSigned(t, &x509.Certificate{Subject: pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour)})
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "node.pem"), filepath.Join(dir, "node-key.pem")
	for f, b := range map[string]*pem.Block{certFile: {Type: "CERTIFICATE", Bytes: der}, keyFile: {Type: "EC PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(f, pem.EncodeToMemory(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return certFile, keyFile
}
