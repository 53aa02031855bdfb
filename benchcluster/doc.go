// Package benchcluster holds the cluster benchmarks that need real
// processes or the HTTP API (make bench-cluster): failover of bin/kvrouter
// processes killed with SIGKILL, and route decisions served by a node's
// api.Server over loopback. The in-process ones (replicated ingest,
// restart, snapshot) are in package raftfsm.
//
// Every benchmark is a test gated by KVROUTER_BENCH=1 that prints
// "BENCH cluster.<figure> k=v ..." lines, each figure next to a baseline
// measured in the same run. The route benchmark's load generator runs in a
// child process (the test binary again, TestRouteLoadGenChild) and offers
// an open-loop rate: latency is measured from each request's due time.
// BenchmarkRoute* measure one decision's CPU and allocations without the
// network. The package has no non-test code.
package benchcluster
