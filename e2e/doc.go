// Package e2e runs the kvrouter cluster as an operator does: the real
// kvrouter and kvctl binaries, built once per test run, started as separate
// processes on loopback ports with their own data directories, killed
// (SIGKILL), paused (SIGSTOP) and restarted by the tests. The partition
// tests route each directed pair's Raft traffic through a loopback proxy
// (internal/netproxy, one per link, wired in by each node's own --peers)
// and cut a leader or a follower off from the others, then heal.
//
// Every test checks the cluster against a model the test keeps of what was
// acknowledged: after each fault every acknowledged event is in the index,
// the per-rank cursors equal the last acknowledged event ids, and all
// replicas report the same state digest at the same applied index.
//
// The package holds only tests; `go test ./e2e/` runs them all in about a
// minute. `-seed N` replays a run's random event stream (each test logs its
// seed). The binaries are built without the race detector, also under
// `go test -race`: only the test process itself is instrumented then.
package e2e
