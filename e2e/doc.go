// Package e2e runs the kvrouter cluster as an operator does: the real
// kvrouter and kvctl binaries, built once per test run, started as separate
// processes on loopback ports with their own data directories, killed
// (SIGKILL), paused (SIGSTOP) and restarted by the tests. The partition
// tests route each directed pair's Raft traffic through a loopback proxy
// (internal/netproxy, one per link, wired in by each node's own --peers)
// and cut a leader or a follower off from the others, then heal. The
// loss-of-quorum tests (fault scenario 17 of the replication design) take
// the quorum away under the stream, both followers killed or every link
// cut: the leader left alone steps down, is not ready and refuses every
// write, and nothing is acknowledged, until the quorum is back. The
// majority-lost test follows docs/operations.md's "Majority lost": two
// nodes killed and their directories deleted, the survivor, a follower,
// killed too, its directory saved offline (kvctl snapshot save --data-dir,
// its log's entries past its state applied) and a new cluster seeded from
// the file: every acknowledged write is there. The lossy
// test (scenario 10) makes every link lose about half its traffic, as
// connection resets (netproxy.Faults), and delay the rest by a jittered
// delay, for a few seconds, then takes the faults off. The membership
// tests do what an operator does with the built kvctl, under the stream:
// scenario 12 moves the leadership four times (kvctl leader transfer,
// --to a named follower and to any voter), each answered with the new
// leader; scenario 13 removes a follower (kvctl members remove), starts
// a fresh node with --join, removes the leader itself, and joins a second
// fresh node, so that three members remain. Each removed node is not
// ready and refuses writes, reports itself removed once it has seen its
// removal (a removed follower may never see it: a candidate the members
// refuse), and is stopped; kvctl members list and kvctl status then show
// the three members.
//
// Every test checks the cluster against a model the test keeps of what was
// acknowledged: after each fault every acknowledged event is in the index,
// the per-rank cursors equal the last acknowledged event ids, and all
// replicas report the same state digest at the same applied index.
//
// TestChaosSoakLosesNothingAcknowledged, the chaos soak, runs only under
// KVROUTER_LONG=1 (make test-long): two publishers and a router run
// through a three-node cluster, faults included, while a fault loop injects
// one fault a round (KVROUTER_CHAOS_ROUNDS, 30 by default): a random node
// killed with SIGKILL and restarted, a random node cut off through the
// partition proxies and healed, the leader stopped with SIGSTOP until the
// others elect a new one and resumed, or a one-way cut of one directed
// raft link of the leader's (leader to follower: the follower loses its
// leader and the other two write on; follower to leader: raft uses that
// direction only in an election, so the leader hands its leadership to
// the cut follower, which leads on without reaching the old leader) and
// healed. The last round is an online restore with a member down: a
// random node killed with SIGKILL, the publishers held still while kvctl
// snapshot save and kvctl snapshot restore run through the other two
// nodes (so the state restored is the state acknowledged), and the killed
// node restarted to catch up on the restored state; before any write, the
// two nodes and then the restarted one must hold it with every rank
// flagged for a resync, which only an installed restore sets (the writes
// after it clear the flags rank by rank). It is the last
// because a restore hands every node the leader's Raft configuration,
// the leader's view of the partition proxies, after which they route no
// cut. Never two faults at once: three nodes would lose their majority.
// After every round (the publishers hold still for the check), and at the
// end, every node holds what the model says was acknowledged (after the
// restore, every rank flagged for a resync), at one applied index with
// one digest, and applied each acknowledged event once
// (kvrouter_events_applied_total{outcome="applied"}): a node never killed
// and never restoring a snapshot counts every acknowledged event, a
// restarted one, or one that restored, what was acknowledged since the
// first check after its restart or restore. The faults' kinds and victims
// come from the test's seed, logged with the command that replays them:
// KVROUTER_LONG=1 go test ./e2e/ -run '^TestChaosSoakLosesNothingAcknowledged$' -seed N
// (which node leads when a fault strikes depends on timing, not the seed).
//
// The package holds only tests; `go test ./e2e/` runs them all in about a
// minute. `-seed N` replays a run's random event stream (each test logs its
// seed). The binaries are built without the race detector, also under
// `go test -race`: only the test process itself is instrumented then.
package e2e
