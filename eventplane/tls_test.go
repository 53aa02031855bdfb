package eventplane

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// testPKI writes a CA, a server certificate for 127.0.0.1 and a client
// certificate into dir, as PEM files.
type testPKI struct{ ca, serverCert, serverKey, clientCert, clientKey string }

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	keyPEM := func(name string, k *ecdsa.PrivateKey) string {
		der, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return write(name, "EC PRIVATE KEY", der)
	}
	now := time.Now()
	caKey := key()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvrouter test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	leaf := func(serial int64, usage x509.ExtKeyUsage, k *ecdsa.PrivateKey) []byte {
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "leaf"},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{usage},
			KeyUsage: x509.KeyUsageDigitalSignature, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		return der
	}
	sk, ck := key(), key()
	return testPKI{
		ca:         write("ca.pem", "CERTIFICATE", caDER),
		serverCert: write("server.pem", "CERTIFICATE", leaf(2, x509.ExtKeyUsageServerAuth, sk)),
		serverKey:  keyPEM("server-key.pem", sk),
		clientCert: write("client.pem", "CERTIFICATE", leaf(3, x509.ExtKeyUsageClientAuth, ck)),
		clientKey:  keyPEM("client-key.pem", ck),
	}
}

// TestTLSPassesThrough: an embedded server that serves TLS and requires
// client certificates takes a client with the CA and its certificate, and
// refuses one without either; a request round trip works over TLS.
func TestTLSPassesThrough(t *testing.T) {
	pki := newTestPKI(t)
	s, err := StartServer(ServerConfig{Name: "tls", Addr: "127.0.0.1:0", TLSCert: pki.serverCert, TLSKey: pki.serverKey, TLSCA: pki.ca})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		s.Shutdown()
		s.WaitForShutdown()
	}()
	url := s.ClientURL()
	connect := func(o ClientOptions) (*nats.Conn, error) {
		return nats.Connect(url, append(o.NATSOptions(), nats.MaxReconnects(0), nats.Timeout(5*time.Second))...)
	}

	good, err := connect(ClientOptions{Name: "agent", TLSCA: pki.ca, TLSCert: pki.clientCert, TLSKey: pki.clientKey})
	if err != nil {
		t.Fatalf("a client with the CA and a certificate: %v", err)
	}
	defer good.Close()
	sub, err := good.Subscribe("echo", func(m *nats.Msg) { _ = m.Respond(m.Data) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if m, err := good.Request("echo", []byte("hi"), 5*time.Second); err != nil || string(m.Data) != "hi" {
		t.Fatalf("request over TLS: %v %v", m, err)
	}
	if !good.TLSRequired() {
		t.Fatal("the connection is not TLS")
	}

	for name, o := range map[string]ClientOptions{
		"without a client certificate": {TLSCA: pki.ca},
		"without the CA":               {TLSCert: pki.clientCert, TLSKey: pki.clientKey},
	} {
		if nc, err := connect(o); err == nil {
			nc.Close()
			t.Errorf("a client %s connected", name)
		}
	}
}

// TestServerOnAPortInUseFailsAtOnce: a server that cannot listen answers
// with the listener's error, as soon as it has it. From a review: the error only went
// to the log, StartServer waited its whole 10 s and said "did not start",
// and kvrouter, which started NATS after Raft, had led an election
// meanwhile.
func TestServerOnAPortInUseFailsAtOnce(t *testing.T) {
	for _, which := range []string{"client", "cluster"} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		cfg := ServerConfig{Addr: ln.Addr().String()}
		if which == "cluster" {
			cfg = ServerConfig{Addr: "127.0.0.1:0", ClusterAddr: ln.Addr().String()}
		}
		s, err := StartServer(cfg)
		if err == nil {
			s.Shutdown()
		}
		if err == nil || !strings.Contains(err.Error(), "address already in use") {
			t.Errorf("%s port in use: %v, want the listener's error", which, err)
		}
		// It names the address in use first: the cluster's, not the
		// client address, which is free.
		want := "nats server on " + ln.Addr().String() + ":"
		if which == "cluster" {
			want = "nats cluster address " + ln.Addr().String() + ":"
		}
		if err != nil && !strings.HasPrefix(err.Error(), want) {
			t.Errorf("%s port in use: %v, want it to begin %q", which, err, want)
		}
		ln.Close()
	}
}

// TestARouteThatDoesNotParseIsRefused: StartServer refuses a route that
// nats-server cannot parse, or could not dial (no host, no port, port 0),
// and takes host:port and nats-route:// URLs. From a review: nats-server's
// RoutesFromStr kept a nil URL for a route that did not parse (routes
// separated by spaces, an IPv6 address missing its ']'), and its route
// solicitation crashed the process on it.
func TestARouteThatDoesNotParseIsRefused(t *testing.T) {
	for _, r := range []string{"127.0.0.1:6222 127.0.0.1:6223", "[::1:6222", "127.0.0.1", ":6222", "127.0.0.1:0",
		"127.0.0.1:65536", "127.0.0.1:x", "http://127.0.0.1:6222", "nats-route://127.0.0.1:6222/x"} {
		if err := CheckRoute(r); err == nil {
			t.Errorf("CheckRoute(%q) = nil, want an error", r)
		}
		s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0", Routes: []string{r}})
		if err == nil {
			s.Shutdown()
			t.Errorf("StartServer with the route %q started", r)
		}
	}
	for _, r := range []string{"127.0.0.1:6222", "[::1]:6222", "nats-route://127.0.0.1:6222", "nats://h.example:6222", " 127.0.0.1:6222 "} {
		if err := CheckRoute(r); err != nil {
			t.Errorf("CheckRoute(%q): %v", r, err)
		}
	}
	// A route with a password shows none, whether it parses or not (a
	// password with an unescaped '#' or '/', which url.URL.Redacted
	// does not hide in the path).
	for _, r := range []string{"nats-route://alice:s3cret@127.0.0.1:0", "nats-route://alice:s3cret#1@127.0.0.1:6222",
		"nats-route://alice:1/s3cret@127.0.0.1:6222", "alice:s3cret@[::1:6222"} {
		if err := CheckRoute(r); err == nil || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("CheckRoute(%q) = %v, want an error that does not show the password", r, err)
		}
		s, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0", Routes: []string{r}})
		if err == nil {
			s.Shutdown()
		}
		if err == nil || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("StartServer with the route %q: %v, want an error that does not show the password", r, err)
		}
	}
}

// TestAnIPv6RouteWithoutBracketsIsRefused: a route whose IPv6 host is
// written without brackets (::ffff:127.0.0.1:6222) is refused, and the
// same host in brackets routes, with an IPv6 zone too as
// --nats-cluster-addr takes it ([fe80::1%eth0]:6222; %25 in a URL). From
// a review: url.URL's Hostname and Port split the bare address at its
// last ':' and CheckRoute took it, but nats-server dials the URL's Host
// split by net.SplitHostPort ("too many colons"), and the node never
// routed to that peer, without a word; a zone in brackets was refused as
// "an IPv6 host is written in brackets".
func TestAnIPv6RouteWithoutBracketsIsRefused(t *testing.T) {
	b, err := StartServer(ServerConfig{Name: "b", Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Shutdown()
	port := strconv.Itoa(b.ClusterAddr().Port)
	routes := []string{"[::ffff:127.0.0.1]:" + port, "nats-route://[::ffff:127.0.0.1]:" + port}
	if lo := loopbackName(); lo != "" {
		routes = append(routes, "[::ffff:127.0.0.1%"+lo+"]:"+port, "nats-route://[::ffff:127.0.0.1%25"+lo+"]:"+port)
	}
	for _, r := range routes {
		a, err := StartServer(ServerConfig{Name: "a", Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0", Routes: []string{r}})
		if err != nil {
			t.Fatalf("route %s: %v", r, err)
		}
		waitFor(t, 10*time.Second, "a route to b through "+r, func() bool { return a.NumRoutes() > 0 })
		a.Shutdown()
	}
	for _, r := range []string{"::ffff:127.0.0.1:" + port, "nats-route://::ffff:127.0.0.1:" + port, "fd00::2:6222", "alice:pw@fd00::2:6222"} {
		if err := CheckRoute(r); err == nil || !strings.Contains(err.Error(), "brackets") {
			t.Errorf("CheckRoute(%q) = %v, want an error saying to bracket the IPv6 host", r, err)
		}
		if a, err := StartServer(ServerConfig{Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0", Routes: []string{r}}); err == nil {
			a.Shutdown()
			t.Errorf("StartServer with the route %q started", r)
		}
	}
	// A zone in a URL is written %25, as url.Parse requires.
	if err := CheckRoute("nats-route://[fe80::1%eth0]:6222"); err == nil || !strings.Contains(err.Error(), "%25") {
		t.Errorf("a URL route with its zone unescaped: %v, want an error saying to write it %%25", err)
	}
	if err := CheckRoute("[fe80::1%eth0]:6222"); err != nil {
		t.Errorf("a host:port route with a zone: %v", err)
	}
}

// loopbackName returns the name of a loopback interface, "" when there
// is none.
func loopbackName() string {
	ifs, err := net.Interfaces()
	if err != nil {
		return ""
	}
	for _, i := range ifs {
		if i.Flags&net.FlagLoopback != 0 && i.Flags&net.FlagUp != 0 {
			return i.Name
		}
	}
	return ""
}

// TestSettingsTheServerWouldNotEnforceAreRefused: StartServer refuses a
// password without its user (nats-server would let every client in), a
// CA for client certificates without the server's TLS certificate (it
// would serve no TLS), and routes without a cluster address (it would
// route nowhere), rather than start without them. From a review.
func TestSettingsTheServerWouldNotEnforceAreRefused(t *testing.T) {
	for name, cfg := range map[string]ServerConfig{
		"a password alone":   {Addr: "127.0.0.1:0", Password: "s3cret"},
		"a CA alone":         {Addr: "127.0.0.1:0", TLSCA: "ca.pem"},
		"routes, no cluster": {Addr: "127.0.0.1:0", Routes: []string{"127.0.0.1:6222"}},
	} {
		if s, err := StartServer(cfg); err == nil {
			s.Shutdown()
			t.Errorf("StartServer with %s started", name)
		}
	}
}

// TestTheServerChecksAgreeWithStartServer: CheckServerAddr and
// CheckServerName, which kvrouter runs on --nats-addr,
// --nats-cluster-addr and --node-id before it locks its data directory,
// refuse what StartServer refuses and take what it starts with. From a
// review: kvrouter checked the addresses with net.LookupPort, which takes
// a service name (127.0.0.1:http) that StartServer's parse refused, and a
// --node-id with a space reached nats-server unchecked; and from another,
// the checks took a negative port (127.0.0.1:-5) that StartServer's
// listen refused (-1 is nats-server's random port, which both take).
func TestTheServerChecksAgreeWithStartServer(t *testing.T) {
	for _, c := range []struct {
		name, addr, cluster string
	}{
		{"a", "127.0.0.1:0", ""},
		{"a", "127.0.0.1:0", "127.0.0.1:0"},
		{"a b", "127.0.0.1:0", ""},
		{"a", "127.0.0.1:http", ""},
		{"a", "127.0.0.1:0", "127.0.0.1:http"},
		{"a", "127.0.0.1", ""},
		{"a", "127.0.0.1:65536", ""},
		{"a", "127.0.0.1:-5", ""},
		{"a", "127.0.0.1:0", "127.0.0.1:-5"},
		{"a", "127.0.0.1:-1", "127.0.0.1:-1"},
	} {
		checked := CheckServerName(c.name) == nil && CheckServerAddr(c.addr) == nil && (c.cluster == "" || CheckServerAddr(c.cluster) == nil)
		s, err := StartServer(ServerConfig{Name: c.name, Addr: c.addr, ClusterAddr: c.cluster})
		if err == nil {
			s.Shutdown()
			s.WaitForShutdown()
		}
		if checked != (err == nil) {
			t.Errorf("name %q, addr %q, cluster %q: the checks take it: %v; StartServer: %v", c.name, c.addr, c.cluster, checked, err)
		}
	}
}

// TestARouteDoesNotBypassTheClientCredentials pins docs/events.md's
// `--nats-user`/`--nats-password` (operations.md, Security: "The event
// plane can authenticate"): a server given a User and Password lets no
// publisher's message in without them. A NATS server that dials the
// route port (--nats-cluster-addr) with no credentials at all must not
// become a route through which its own unauthenticated clients publish
// to the subscribers of the authenticated server (the leader's
// ingester): today the embedded server configures no cluster
// authorization, so any server that reaches the route port joins the
// NATS cluster and relays anything.
func TestARouteDoesNotBypassTheClientCredentials(t *testing.T) {
	s, err := StartServer(ServerConfig{Name: "n1", Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0",
		User: "alice", Password: "s3cret"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Shutdown()
	// An unauthenticated client is refused on the client port.
	if nc, err := nats.Connect(s.ClientURL()); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected to a server that asks for them")
	}
	sub, err := nats.Connect(s.ClientURL(), nats.UserInfo("alice", "s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	got := make(chan *nats.Msg, 1)
	if _, err := sub.Subscribe("kvrouter.events", func(m *nats.Msg) {
		select {
		case got <- m:
		default:
		}
	}); err != nil {
		t.Fatal(err)
	}
	if err := sub.Flush(); err != nil {
		t.Fatal(err)
	}

	// A rogue server, no credentials anywhere, routed to n1's route port.
	rogue, err := StartServer(ServerConfig{Name: "rogue", Addr: "127.0.0.1:0", ClusterAddr: "127.0.0.1:0",
		Routes: []string{s.ClusterAddr().String()}})
	if err != nil {
		t.Fatal(err)
	}
	defer rogue.Shutdown()
	pub, err := nats.Connect(rogue.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	// Polled with a deadline: the route, if it is taken, needs a moment
	// to carry the subscription's interest over.
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if err := pub.Publish("kvrouter.events", []byte("unauthenticated")); err != nil {
			t.Fatal(err)
		}
		pub.Flush()
		select {
		case m := <-got:
			t.Fatalf("a message published with no credentials, through a server routed to the route port, reached a subscriber of the server that asks for them: %q (routes %d)", m.Data, s.NumRoutes())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
