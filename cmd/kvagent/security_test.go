package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/urfave/cli/v2"
)

// routerArgs are the flags of an agent that registers through router (an
// address, or a URL), its NATS and engine on ports nothing listens on.
func routerArgs(t *testing.T, router string, extra ...string) []string {
	return append([]string{"--log-level", "info", "--worker-id", "1", "--block-size", "4",
		"--nats-url", "nats://127.0.0.1:" + strconv.Itoa(freePort(t)),
		"--engine-endpoint", "tcp://127.0.0.1:" + strconv.Itoa(freePort(t)), "--router", router}, extra...)
}

// TestAWrongRouterTokenNamesTheTokenFlag: a router that refuses the
// agent's token (401 unauthorized) ends the agent (exit 1, docs/events.md:
// an answer 4xx other than 408 and 429 is not retried) with an error that
// says what to fix: the token flag (--router-token, --router-token-file
// or KVAGENT_ROUTER_TOKEN), as kvctl and kvrouter --join say --token on a
// 401 (docs/operations.md, "Security"). From a review: it said "fix the
// registration", which is not what is wrong.
func TestAWrongRouterTokenNamesTheTokenFlag(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter"`)
		w.WriteHeader(http.StatusUnauthorized)
		w.Write([]byte(`{"error":"the request's token is not this cluster's","reason":"unauthorized"}`))
	}))
	defer srv.Close()
	r := startKvagent(t, routerArgs(t, strings.TrimPrefix(srv.URL, "http://"), "--router-token", "wrong")...)
	err := r.waitEnded(t)
	var ec cli.ExitCoder
	if err == nil || errors.As(err, &ec) && ec.ExitCode() != 1 {
		t.Fatalf("kvagent with a wrong token: %v, want exit 1", err)
	}
	if !strings.Contains(err.Error(), "--router-token") {
		t.Fatalf("kvagent with a wrong token: %q, want it to name --router-token", err)
	}
}

// TestATLSRouterReachedWithoutTheCANamesTheCAFlag: --router naming a node
// that serves TLS (kvrouter --tls-cert), without --router-tls-ca, ends the
// agent (the node answers the clear-text request 400) with an error that
// names --router-tls-ca, as kvrouter's --join says what to give
// (docs/operations.md, "Security"). From a review: it said "fix the
// registration", naming nothing the operator can act on.
func TestATLSRouterReachedWithoutTheCANamesTheCAFlag(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	r := startKvagent(t, routerArgs(t, strings.TrimPrefix(srv.URL, "https://"))...)
	err := r.waitEnded(t)
	if err == nil || !strings.Contains(err.Error(), "--router-tls-ca") {
		t.Fatalf("kvagent reaching a TLS router in clear text: %v, want an error naming --router-tls-ca", err)
	}
}

// TestAnUntrustedRouterCertificateNamesTheCAFlag: a --router-tls-ca that
// did not sign the node's certificate fails every registration; the
// agent's log says what to fix (client.CertificateHint: give
// --router-tls-ca with the CA that signed it), as kvctl and a node whose
// --join fails do (docs/operations.md, "Security"). From a review: it
// retried for ever with "registering the worker failed; retrying" and
// x509's text only.
func TestAnUntrustedRouterCertificateNamesTheCAFlag(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	r := startKvagent(t, routerArgs(t, strings.TrimPrefix(srv.URL, "https://"), "--router-tls-ca", anotherCA(t))...)
	waitFor(t, "a failed registration logged", func() bool { return r.logs.has("registering the worker failed") })
	if !r.logs.has("--router-tls-ca") {
		t.Fatalf("the agent's log says nothing of --router-tls-ca for a certificate it does not trust:\n%s", r.logs)
	}
}

// anotherCA writes a CA's certificate, one that signed no server's, to a
// file for --router-tls-ca and returns its path.
func anotherCA(t *testing.T) string {
	t.Helper()
	ca, _ := apitest.WriteSelfSigned(t, t.TempDir()) // signed by itself alone
	return ca
}

// TestAPlainHTTPRouterReachedWithTheCANamesTheMismatch: --router-tls-ca
// given for a node that serves plain HTTP fails each registration's
// handshake ("server gave HTTP response to HTTPS client"); the agent
// retries (a transport error, as a certificate refused: the node may be
// restarted with TLS while the agent runs, as when a cluster turns TLS on
// with its agents given the CA first) and each warning's hint says what
// is wrong, as kvrouter --join's refusedJoin does: the node answers plain
// HTTP. From a review: the warning carried Go's text only.
func TestAPlainHTTPRouterReachedWithTheCANamesTheMismatch(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	r := startKvagent(t, routerArgs(t, strings.TrimPrefix(srv.URL, "http://"), "--router-tls-ca", anotherCA(t))...)
	waitFor(t, "a failed registration logged", func() bool { return r.logs.has("registering the worker failed") })
	if !r.logs.has("answers plain HTTP") || !r.logs.has("drop --router-tls-ca") {
		t.Fatalf("the agent's log does not say that the router node answers plain HTTP while --router-tls-ca is given:\n%s", r.logs)
	}
	select {
	case err := <-r.done:
		r.done <- err
		t.Fatalf("the agent stopped (%v) on a router node that answers plain HTTP, want it retrying (the node may get TLS):\n%s", err, r.logs)
	default:
	}
}

// TestAStopDuringARegistrationLogsNoRetry: a clean stop (SIGTERM, Ctrl-C)
// while a registration is under way (the router's HTTP API slow or out of
// reach) ends the registration; the agent does not log that it failed and
// is retried (WARN "registering the worker failed; retrying", err "context
// canceled"): nothing is retried, and an operator reading the stop's log
// would look for a fault in the router. From a review.
func TestAStopDuringARegistrationLogsNoRetry(t *testing.T) {
	hung, err := net.Listen("tcp", "127.0.0.1:0") // takes the registration, never answers
	if err != nil {
		t.Fatal(err)
	}
	defer hung.Close()
	var accepted atomic.Int32
	go func() {
		for {
			c, err := hung.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			defer c.Close()
		}
	}()
	r := startKvagent(t, routerArgs(t, hung.Addr().String())...)
	waitFor(t, "a registration under way", func() bool { return accepted.Load() > 0 })
	if err := r.stop(t); err != nil {
		t.Fatalf("kvagent: %v", err)
	}
	if r.logs.has("registering the worker failed") {
		t.Fatalf("the stop logged a registration retry:\n%s", r.logs)
	}
}

// TestARegistrationAnsweredByAnotherServiceSaysToCheckRouter: a
// registration that another service answered with a success no node gives
// (client.ErrNotAnAnswer: 200 where a node answers 204) is retried, each
// warning saying that --router is no node's API; it was taken for done.
func TestARegistrationAnsweredByAnotherServiceSaysToCheckRouter(t *testing.T) {
	err := fmt.Errorf("POST /v1/workers: 10.0.0.9:8080 answered %w: HTTP 200 where a node answers 204 No Content", client.ErrNotAnAnswer)
	if h := registrationHint(err); !strings.Contains(h, "--router") {
		t.Fatalf("hint for %v: %q, want one naming --router", err, h)
	}
}
