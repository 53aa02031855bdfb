package main

import (
	"strings"
	"testing"
	"time"
)

// TestATimeoutNamesTheEndpointsItWaitedOn: a command whose --timeout runs
// out on nodes that accept connections and never answer (stopped with
// SIGSTOP, wedged) says which endpoints it waited on, as the error of
// nodes refusing connections names each ("no endpoint reachable:
// ADDR: ...; ADDR: ..."). docs/kvctl.md: an error line says what to do;
// "raise --timeout" without the address leaves the operator to guess
// which of the --endpoints hung. From a review: the line was
// "no answer within --timeout 4s: GET /v1/cluster/status: context
// deadline exceeded; raise --timeout, or see kvctl status".
func TestATimeoutNamesTheEndpointsItWaitedOn(t *testing.T) {
	a, b := hungAddr(t), hungAddr(t)
	for _, cmd := range [][]string{{"members", "list"}, {"index", "stats"}, {"route", "--hashes", "1"}} {
		r := runBounded(t, time.Minute, append([]string{"--endpoints", a + "," + b, "--timeout", "4s"}, cmd...)...)
		r.wantCode(t, 1)
		for _, addr := range []string{a, b} {
			if !strings.Contains(r.stderr, addr) {
				t.Errorf("kvctl %s with two hung endpoints: stderr %q names no %s", strings.Join(cmd, " "), strings.TrimSpace(r.stderr), addr)
			}
		}
	}
}
