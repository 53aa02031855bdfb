package main

import (
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"strings"
	"testing"
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
