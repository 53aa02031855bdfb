package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestMistypedNATSRoutesIsAUsageErrorNotACrash: a --nats-routes entry the
// embedded server cannot parse is a usage error (exit 2) naming the flag,
// before the data directory is touched. From a review: the list went to
// nats-server unchecked, whose RoutesFromStr keeps a nil URL for an entry
// that does not parse (a list separated by spaces, an IPv6 address
// missing its ']'), and its route solicitation crashed the whole process
// with a nil pointer dereference, after the data directory was locked.
// The start runs in a child process: a crash would take the test binary
// down.
func TestMistypedNATSRoutesIsAUsageErrorNotACrash(t *testing.T) {
	const childEnv = "KVROUTER_TEST_NATS_ROUTES"
	if routes, ok := os.LookupEnv(childEnv); ok {
		checkRefusedStart(t, []string{"--http-addr", "127.0.0.1:0", "--raft-addr", freeAddr(t), "--nats-addr", "127.0.0.1:0",
			"--nats-cluster-addr", freeAddr(t), "--nats-routes", routes}, "--nats-routes")
		return
	}
	for _, routes := range []string{
		"127.0.0.1:16229 127.0.0.1:16230", // a space instead of a comma
		"[::1:6222",                       // an IPv6 address missing its ]
		"127.0.0.1:6222,[::1:6223",
		"127.0.0.1",   // no port
		":6222",       // no host
		"127.0.0.1:0", // a port nobody listens on
		"http://127.0.0.1:6222",
	} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestMistypedNATSRoutesIsAUsageErrorNotACrash$", "-test.count=1")
		cmd.Env = append(os.Environ(), childEnv+"="+routes)
		out, err := cmd.CombinedOutput()
		if i := strings.Index(string(out), "panic:"); i >= 0 {
			t.Errorf("--nats-routes %q crashed kvrouter:\n%s", routes, out[i:min(len(out), i+400)])
		} else if err != nil {
			t.Errorf("--nats-routes %q: %v\n%s", routes, err, out)
		}
	}
}
