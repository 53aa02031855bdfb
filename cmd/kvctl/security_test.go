package main

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestTokenAndTLSFlags: against a node that serves TLS and asks for a
// token, kvctl needs --tls-ca (or an https:// endpoint it trusts) and the
// token (--token, --token-file or KVCTL_TOKEN); without the token it exits
// 1 saying how to give it; a flag it cannot use is a usage error.
func TestTokenAndTLSFlags(t *testing.T) {
	const token = "k3y"
	s := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler), Token: token})
	hs := httptest.NewTLSServer(s)
	t.Cleanup(func() { hs.Close(); s.Close() })
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	tokenFile := filepath.Join(dir, "token")
	junk := filepath.Join(dir, "junk.pem")
	for f, b := range map[string][]byte{
		ca:        pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw}),
		tokenFile: []byte(token + "\n"),
		junk:      []byte("junk\n"),
	} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ep := "--endpoints=" + strings.TrimPrefix(hs.URL, "https://")

	kvctl(t, ep, "--tls-ca", ca, "--token", token, "status").wantCode(t, 0)
	kvctl(t, ep, "--tls-ca", ca, "--token-file", tokenFile, "-o", "json", "workers").wantCode(t, 0)
	t.Setenv("KVCTL_TOKEN", token)
	kvctl(t, ep, "--tls-ca", ca, "workers").wantCode(t, 0)
	os.Unsetenv("KVCTL_TOKEN")

	for _, args := range [][]string{{}, {"--token", "other"}} {
		r := kvctl(t, append([]string{ep, "--tls-ca", ca}, append(args, "workers")...)...).wantCode(t, 1)
		if !strings.Contains(r.stderr, "unauthorized") || !strings.Contains(r.stderr, "--token") {
			t.Fatalf("kvctl %v without the cluster's token: stderr %q, want it to say unauthorized and name --token", args, r.stderr)
		}
	}
	// Over TLS, the node's certificate is not trusted without its CA;
	// without TLS, the node refuses the request (and the token went in
	// clear text, which kvctl warns of).
	r := kvctl(t, "--endpoints", hs.URL, "--token", token, "--timeout", "3s", "workers").wantCode(t, 1)
	if !strings.Contains(r.stderr, "not trusted") || !strings.Contains(r.stderr, "--tls-ca") {
		t.Fatalf("an https endpoint without the CA: stderr %q, want it to say the certificate is not trusted and name --tls-ca", r.stderr)
	}
	r = kvctl(t, ep, "--token", token, "--timeout", "3s", "workers").wantCode(t, 1)
	if !strings.Contains(r.stderr, "warning: the token goes to") || !strings.Contains(r.stderr, "serves TLS") {
		t.Fatalf("a host:port endpoint of a TLS node without --tls-ca: stderr %q, want the clear-text warning and a word on TLS", r.stderr)
	}
	// With TLS, no warning.
	if r := kvctl(t, ep, "--tls-ca", ca, "--token", token, "status").wantCode(t, 0); strings.Contains(r.stderr, "warning") {
		t.Fatalf("over TLS: stderr %q, want nothing", r.stderr)
	}
	// Flags it cannot use.
	kvctl(t, ep, "--tls-ca", junk, "--token", token, "status").wantCode(t, 2)
	kvctl(t, ep, "--tls-ca", filepath.Join(dir, "missing"), "status").wantCode(t, 2)
	kvctl(t, ep, "--tls-ca", ca, "--token", token, "--token-file", tokenFile, "status").wantCode(t, 2)
	kvctl(t, ep, "--tls-ca", ca, "--token", "two words", "status").wantCode(t, 2)
}

// TestTokenAndCAFilesAreReadUpToACap: a --token-file or --tls-ca larger
// than a token or a CA bundle is (/dev/zero, a wrong file) is a usage error
// naming its flag, once kvctl has read a byte more than the cap. From a
// review: both were read whole, and --token-file /dev/zero grew kvctl
// until the kernel killed it.
func TestTokenAndCAFilesAreReadUpToACap(t *testing.T) {
	dir := t.TempDir()
	bigToken, bigCA := filepath.Join(dir, "token"), filepath.Join(dir, "ca.pem")
	for f, n := range map[string]int{bigToken: client.MaxTokenFileBytes + 1, bigCA: client.MaxCAFileBytes + 1} {
		if err := os.WriteFile(f, []byte(strings.Repeat("a", n)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct{ flag, file string }{{"--token-file", bigToken}, {"--tls-ca", bigCA}} {
		r := kvctl(t, "--endpoints", deadAddr(t), tc.flag, tc.file, "status").wantCode(t, 2)
		if !strings.Contains(r.stderr, tc.flag) || !strings.Contains(r.stderr, "is larger than") {
			t.Errorf("%s of a file over the cap: stderr %q, want it to name the flag and say the file is larger than kvctl reads", tc.flag, r.stderr)
		}
	}
}

// TestTokenFlagsOutrankTheirVariables: --token or --token-file on the
// command line is the token, whatever KVCTL_TOKEN or KVCTL_TOKEN_FILE the
// environment holds, as every other flag outranks its variable; both given
// on the command line, or both in the environment, stay a usage error.
// From a review: KVCTL_TOKEN set and --token-file given (or
// KVCTL_TOKEN_FILE and --token) was "a token and a token file", exit 2.
func TestTokenFlagsOutrankTheirVariables(t *testing.T) {
	const token = "s3cret"
	s := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler), Token: token})
	hs := httptest.NewServer(s)
	t.Cleanup(func() { hs.Close(); s.Close() })
	ep := "--endpoints=" + hs.Listener.Addr().String()
	dir := t.TempDir()
	good, other := filepath.Join(dir, "good"), filepath.Join(dir, "other")
	for f, b := range map[string]string{good: token + "\n", other: "other\n"} {
		if err := os.WriteFile(f, []byte(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	t.Setenv("KVCTL_TOKEN", "other")
	kvctl(t, ep, "--token-file", good, "workers").wantCode(t, 0)
	kvctl(t, ep, "--token", token, "workers").wantCode(t, 0)
	os.Unsetenv("KVCTL_TOKEN")

	t.Setenv("KVCTL_TOKEN_FILE", other)
	kvctl(t, ep, "--token", token, "workers").wantCode(t, 0)
	kvctl(t, ep, "--token-file", good, "workers").wantCode(t, 0)

	t.Setenv("KVCTL_TOKEN", token)
	r := kvctl(t, ep, "workers").wantCode(t, 2)
	if !strings.Contains(r.stderr, "KVCTL_TOKEN") {
		t.Fatalf("KVCTL_TOKEN and KVCTL_TOKEN_FILE both set: stderr %q, want it to name them", r.stderr)
	}
	kvctl(t, ep, "--token", token, "--token-file", good, "workers").wantCode(t, 2)
}

// TestAWedgedTLSNodeIsPassedOver: a node that accepts connections and
// never answers costs a try's share of --timeout over TLS too, and the next
// node answers. From a review of docs/operations.md: the TLS handshake
// waited for the transport's own 10 s, past the whole --timeout.
func TestAWedgedTLSNodeIsPassedOver(t *testing.T) {
	s := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler)})
	hs := httptest.NewTLSServer(s)
	t.Cleanup(func() { hs.Close(); s.Close() })
	wedged, err := net.Listen("tcp", "127.0.0.1:0") // the kernel accepts; nothing answers
	if err != nil {
		t.Fatal(err)
	}
	defer wedged.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	ep := "--endpoints=" + wedged.Addr().String() + "," + strings.TrimPrefix(hs.URL, "https://")
	kvctl(t, ep, "--tls-ca", ca, "--timeout", "6s", "members", "list").wantCode(t, 0)
}

// A follower whose own forward to its leader fails that forward's TLS
// check answers 503 with the x509 text. kvctl's TLS settings are right
// (it reached the follower over TLS with the token): it must not tell the
// user to give --tls-ca, but that the node's forward failed. From a
// review: kvctl read the answer's text for its own TLS error.
func TestAFollowersFailedForwardIsNotBlamedOnKvctlsTLS(t *testing.T) {
	const token = "k3y"
	q := slog.New(slog.DiscardHandler)
	leaderAPI := api.NewServer(apitest.New("n1", ""), api.Options{Logger: q, Token: token})
	leader := httptest.NewTLSServer(leaderAPI)
	defer func() { leader.Close(); leaderAPI.Close() }()
	fake := apitest.New("n2", "")
	fake.SetFollower("n1", strings.TrimPrefix(leader.URL, "https://"))
	// The follower's forwards trust the system's roots, not the leader's cert.
	followerAPI := api.NewServer(fake, api.Options{Logger: q, Token: token, ForwardScheme: "https"})
	follower := httptest.NewTLSServer(followerAPI)
	defer func() { follower.Close(); followerAPI.Close() }()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: follower.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	r := kvctl(t, "--endpoints", strings.TrimPrefix(follower.URL, "https://"), "--tls-ca", ca, "--token", token,
		"--timeout", "5s", "members", "add", "n4", "127.0.0.1:1", "127.0.0.1:2").wantCode(t, 1)
	if strings.Contains(r.stderr, "give --tls-ca") || !strings.Contains(r.stderr, "forward to its leader failed TLS") {
		t.Fatalf("kvctl blamed its own --tls-ca for the follower's forward, or did not say the forward failed: %s", r.stderr)
	}
}

// TestHostnameMismatchIsNotCalledUntrusted: a node whose certificate kvctl
// trusts (--tls-ca names it) but which does not name the address kvctl
// reached it at is told as such, not as a certificate to trust with
// --tls-ca. From a review: only Go's "certificate is valid for" wording
// was read as a name mismatch, and its other wordings (no IP SANs, here)
// were reported as "not trusted: give --tls-ca".
func TestHostnameMismatchIsNotCalledUntrusted(t *testing.T) {
	node := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(func() { node.Close() })
	ep, cert := apitest.TLSNode(t, node, []string{"node1.example"}, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range [][]string{{"members", "list"}, {"status"}} {
		r := kvctl(t, append([]string{"--endpoints", ep, "--tls-ca", ca, "--timeout", "3s"}, cmd...)...).wantCode(t, 1)
		if strings.Contains(r.stderr, "not trusted") || !strings.Contains(r.stderr, "does not name 127.0.0.1") ||
			!strings.Contains(r.stderr, "node1.example") {
			t.Errorf("kvctl %v, a trusted certificate that does not name the address: stderr %q, want it to say the certificate does not name 127.0.0.1 (it names node1.example)", cmd, r.stderr)
		}
	}
}

// TestRestoreGivesTheCertificateHintOfOtherCommands: an online restore
// against a node whose certificate kvctl refuses gets the same advice as
// every other command (a name it lacks, an expired one), not "not trusted:
// give --tls-ca", and still says nothing was sent. From a review: the
// readiness probe the restore runs first turned each endpoint's error into
// text, and the x509 error that says why went with it.
func TestRestoreGivesTheCertificateHintOfOtherCommands(t *testing.T) {
	node := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(func() { node.Close() })
	for _, tc := range []struct {
		name        string
		dns         []string
		from, until time.Time
		want        string
	}{
		{"name mismatch", []string{"node1.example"}, time.Now().Add(-time.Hour), time.Now().Add(time.Hour), "does not name 127.0.0.1"},
		{"expired", nil, time.Now().Add(-2 * time.Hour), time.Now().Add(-time.Hour), "renew it"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep, cert := apitest.TLSNode(t, node, tc.dns, tc.from, tc.until)
			dir := t.TempDir()
			ca := filepath.Join(dir, "ca.pem")
			if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), 0o600); err != nil {
				t.Fatal(err)
			}
			file := filepath.Join(dir, "a.snap")
			if err := os.WriteFile(file, []byte("snapshot"), 0o600); err != nil {
				t.Fatal(err)
			}
			h := &harness{inspect: func(io.Reader) (raftfsm.SnapshotInfo, error) { return raftfsm.SnapshotInfo{}, nil }}
			base := []string{"--endpoints", ep, "--tls-ca", ca, "--timeout", "3s"}
			other := h.run(t, append(base, "members", "list")...).wantCode(t, 1)
			if !strings.Contains(other.stderr, tc.want) {
				t.Fatalf("members list: stderr %q, want %q", other.stderr, tc.want)
			}
			r := h.run(t, append(base, "snapshot", "restore", file)...).wantCode(t, 1)
			if !strings.Contains(r.stderr, tc.want) || strings.Contains(r.stderr, "not trusted") ||
				!strings.Contains(r.stderr, "no endpoint answered") || !strings.Contains(r.stderr, "nothing was sent to the cluster") {
				t.Fatalf("snapshot restore: stderr %q\nwant it to say %q, as members list does, and that nothing was sent:\n%q",
					r.stderr, tc.want, other.stderr)
			}
		})
	}
}

// TestStatusOverTLSOfAnEndpointThatSpeaksAnotherProtocol: with --tls-ca
// (a cluster that serves TLS), an endpoint where a service of another
// protocol answers (a node's NATS port given for its HTTP port, which
// greets each connection in clear text) is no node that did not answer:
// docs/kvctl.md, "An endpoint where a service of another protocol
// answers (a node's NATS port given for its HTTP port) is no node ... the
// error says `answered in another protocol than HTTP`", and "kvctl
// status": such an endpoint "reads ERROR, and is not counted among the
// endpoints that did not answer". Over TLS the greeting fails kvctl's
// handshake instead of its HTTP read, and the row read UNREACHABLE with
// "did not answer; check that those nodes run".
func TestStatusOverTLSOfAnEndpointThatSpeaksAnotherProtocol(t *testing.T) {
	der, _ := apitest.SelfSigned(t, &x509.Certificate{Subject: pkix.Name{CommonName: "node1"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)})
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	ln := natsGreeter(t)
	r := kvctl(t, "--endpoints", ln.Addr().String(), "--tls-ca", ca, "--timeout", "3s", "status", "-o", "json").wantCode(t, 1)
	rows := statusJSON(t, r.stdout)
	if len(rows) != 1 || rows[0].Failure != failError || !strings.Contains(rows[0].Error, "not a kvrouter status") ||
		strings.Contains(r.stderr, "did not answer") {
		t.Errorf("over TLS, the endpoint that answered with a NATS greeting: rows %+v, stderr %q; want ERROR, not a kvrouter status, and not \"did not answer\"",
			rows, strings.TrimSpace(r.stderr))
	}
	r = kvctl(t, "--endpoints", ln.Addr().String(), "--tls-ca", ca, "--timeout", "3s", "members", "list").wantCode(t, 1)
	if e := strings.TrimSpace(r.stderr); !strings.Contains(e, "not a node's HTTP port") || strings.Contains(e, "that the nodes run") {
		t.Errorf("kvctl members list over TLS against the NATS greeting: stderr %q; want it to say the address is not a node's HTTP port", e)
	}
}
