package main

import (
	"encoding/json"
	"errors"
	"github.com/kvrouter/kvrouter/api"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/urfave/cli/v2"
)

// A test that hangs is named at the end of the output (testwatch).
func TestMain(m *testing.M) { testwatch.Main(m) }

// TestPeersAreChecked: --peers entries must be id=host:port=host:port,
// each id and address once, and must list this node as it runs.
func TestPeersAreChecked(t *testing.T) {
	const three = "n1=127.0.0.1:7001=127.0.0.1:7081,n2=127.0.0.1:7002=127.0.0.1:7082,n3=127.0.0.1:7003=127.0.0.1:7083"
	peers, err := parsePeers(three)
	if err != nil || len(peers) != 3 {
		t.Fatalf("parse: %v %v", peers, err)
	}
	if err := checkPeers(peers, "n2", "127.0.0.1:7002", "127.0.0.1:7082"); err != nil {
		t.Fatalf("n2 as listed: %v", err)
	}
	for _, c := range []struct{ id, raft, http, want string }{
		{"n4", "127.0.0.1:7004", "127.0.0.1:7084", "does not list this node"},
		{"n2", "127.0.0.1:9002", "127.0.0.1:7082", "lists n2 at 127.0.0.1:7002"},
		{"n2", "127.0.0.1:7002", "127.0.0.1:9082", "lists n2 at 127.0.0.1:7002"},
	} {
		if err := checkPeers(peers, c.id, c.raft, c.http); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s at %s %s: %v, want an error with %q", c.id, c.raft, c.http, err, c.want)
		}
	}
	for _, bad := range []string{
		"n1=a=127.0.0.1:7081",                                    // no port
		"n1=127.0.0.1:7001",                                      // no http address
		"n1=127.0.0.1:7001=127.0.0.1:7081,n1=h:1=h:2",            // id twice
		"n1=127.0.0.1:7001=127.0.0.1:7081,n2=127.0.0.1:7001=h:2", // raft address twice
	} {
		if _, err := parsePeers(bad); err == nil {
			t.Errorf("--peers %s parsed", bad)
		}
	}
}

// TestArgumentsAreRefused: kvrouter takes flags only; a stray argument (a
// flag's value split off, a mistyped flag) is a usage error, exit 2, before
// anything starts. It used to be ignored.
func TestArgumentsAreRefused(t *testing.T) {
	app := newApp()
	app.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
	err := app.Run([]string{"kvrouter", "--data-dir", t.TempDir(), "n1"})
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), `"n1"`) {
		t.Fatalf("kvrouter with an argument: %v, want exit 2 naming it", err)
	}
}

// TestStartingNodeAnswers: while the state loads, the listening port
// answers: alive (/healthz 200), not ready (503 not_ready, Retry-After) for
// everything else. From a review: the port was bound seconds before it was
// served, and probes hung on it.
func TestStartingNodeAnswers(t *testing.T) {
	for path, want := range map[string]int{"/healthz": 200, "/readyz": 503, "/v1/route": 503, "/v1/cluster/status": 503} {
		rec := httptest.NewRecorder()
		startingHandler.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		if rec.Code != want {
			t.Fatalf("%s while starting: %d, want %d", path, rec.Code, want)
		}
		var body map[string]string
		if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
			t.Fatalf("%s: %v in %q", path, err, rec.Body)
		}
		if want == 503 && (body["reason"] != api.ReasonNotReady || rec.Header().Get("Retry-After") == "") {
			t.Fatalf("%s while starting: %v %v", path, body, rec.Header())
		}
	}
}

// TestBodyLimitsAreChecked: the body limits must be positive (a snapshot
// limit of 0 means none); a bad one is a usage error before anything
// starts.
func TestBodyLimitsAreChecked(t *testing.T) {
	for _, args := range [][]string{{"--max-body-bytes", "0"}, {"--max-body-bytes", "-5"}, {"--max-snapshot-bytes", "-1"}} {
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		err := app.Run(append([]string{"kvrouter", "--data-dir", t.TempDir()}, args...))
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), args[0]) {
			t.Fatalf("kvrouter %v: %v, want exit 2 naming the flag", args, err)
		}
	}
}

// TestUnregisteredGraceIsChecked: a grace of 0 or less is a usage error
// (the ingester would take it for its default).
func TestUnregisteredGraceIsChecked(t *testing.T) {
	for _, v := range []string{"0s", "-1m"} {
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		err := app.Run([]string{"kvrouter", "--data-dir", t.TempDir(), "--unregistered-grace", v})
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), "--unregistered-grace") {
			t.Fatalf("kvrouter --unregistered-grace %s: %v, want exit 2 naming the flag", v, err)
		}
	}
}
