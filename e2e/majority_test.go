package e2e

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The lines of kvctl snapshot save FILE --data-dir DIR (docs/kvctl.md):
// the file, what the directory's state had applied and its log's end, and
// how many of the log's entries the save applied after the state.
var (
	offlineSavedLine = regexp.MustCompile(`(?m)^saved (.+) from (.+) \(index (\d+), term (\d+), [^,]+, sha256 [0-9a-f]{64}\)$`)
	offlineStateLine = regexp.MustCompile(`(?m)^state applied at index (\d+) \(term \d+\); Raft log last index (\d+) \(term (\d+)\)$`)
	offlineLogLine   = regexp.MustCompile(`(?m)^applied the log's (\d+) entries after index (\d+): some may never have been committed`)
)

// TestMajorityLostIsRecoveredFromASurvivorsDirectory follows
// docs/operations.md's "Majority lost" with the built binaries: a 3-node
// cluster loses two nodes for good (kill -9, their data directories
// deleted), and the survivor, a follower, crashes too (kill -9: no clean
// stop for the offline save to lean on). kvctl snapshot save FILE
// --data-dir saves the survivor's directory; each node of a new cluster
// (new directories, new addresses) is seeded from FILE with kvctl snapshot
// restore --data-dir --node-id --peers and started. Every acknowledged
// event and worker is in the new cluster (the model), on every node at
// one digest, the survivor's; and the streams go on.
//
// The survivor is restarted cleanly midway, so that its state database is
// durable up to there, and the writes after stay in its open group (the
// FSM commits a group at 16 MiB, at a snapshot or at a clean stop): after
// the crash they are only in its Raft log, which the save must apply, as
// the docs promise. --applied-only, or the directory of a node lost
// before those writes, leaves them out.
func TestMajorityLostIsRecoveredFromASurvivorsDirectory(t *testing.T) {
	seed := testSeed(t)
	old := startCluster(t, 3)
	p := newPublisher(seed, testRanks...)
	registerWorkers(t, old.cl, p.model)
	if err := p.publishN(ctxT(t, 60*time.Second), old.cl, 8); err != nil {
		t.Fatal(err)
	}
	lead, _ := old.leaderWithTerm()
	s := (lead + 1) % len(old.nodes) // the survivor, a follower
	old.converged()
	old.stop(s) // a clean stop commits its open group: its state is durable to here
	old.restart(s)
	if err := p.publishN(ctxT(t, 60*time.Second), old.cl, 8); err != nil {
		t.Fatal(err)
	}
	// Every node's log holds every acknowledged write: a write is
	// acknowledged once a majority's logs hold it, and that majority may
	// be the two nodes lost, which this test is not about.
	old.converged()

	// A majority lost for good, then the survivor crashes. Alone, it
	// appends nothing: its log's end and state are read before its crash.
	for i := range old.nodes {
		if i != s {
			old.kill9(i)
			if err := os.RemoveAll(old.nodes[i].dir); err != nil {
				t.Fatal(err)
			}
		}
	}
	st := old.status(s)
	if st == nil {
		t.Fatalf("the survivor %s does not answer", old.nodes[s].id)
	}
	t.Logf("survivor %s, %s: last index %d, applied %d, digest %s", old.nodes[s].id, st.State, st.LastIndex, st.AppliedIndex, st.Digest)
	old.kill9(s)

	// The offline save of the survivor's directory.
	dir := old.nodes[s].dir
	file := filepath.Join(t.TempDir(), "survivor.snap")
	res := runKvctl(t, "snapshot", "save", file, "--data-dir", dir)
	if res.code != 0 {
		t.Fatalf("%v", res)
	}
	saved, state, logged := offlineSavedLine.FindStringSubmatch(res.stdout), offlineStateLine.FindStringSubmatch(res.stdout),
		offlineLogLine.FindStringSubmatch(res.stdout)
	if saved == nil || saved[1] != file || saved[2] != dir || state == nil || logged == nil {
		t.Fatalf("%v\nwant 'saved %s from %s (index N, term T, SIZE, sha256 ...)', 'state applied at index A (term T); Raft log last index L (term LT)' "+
			"and 'applied the log's N entries after index A: ...'", res, file, dir)
	}
	index, applied, last, entries, after := atoi(t, saved[3]), atoi(t, state[1]), atoi(t, state[2]), atoi(t, logged[1]), atoi(t, logged[2])
	switch {
	case last != st.LastIndex:
		t.Fatalf("%v\nthe log's last index %d; the survivor's was %d", res, last, st.LastIndex)
	case applied >= last || after != applied || entries != last-applied:
		t.Fatalf("%v\nwant the state applied below the log's end (the writes after the survivor's restart in its log alone), "+
			"and every entry after it applied", res)
	case index != last:
		t.Fatalf("%v\nthe file is at index %d, want the log's last index %d", res, index, last)
	case atoi(t, state[3]) == 0:
		t.Fatalf("%v\nthe log's last term is 0, want its last entry's term", res)
	}
	t.Logf("kvctl snapshot save --data-dir:\n%s", res.stdout)
	if parts, _ := filepath.Glob(file + ".*"); len(parts) != 0 {
		t.Fatalf("the save left %v beside the file", parts)
	}

	// A new cluster seeded from the file, as the docs' step 4 does.
	c := startClusterWith(t, 3, func(c *cluster) {
		for _, n := range c.nodes {
			res := runKvctl(t, "snapshot", "restore", file, "--data-dir", n.dir, "--node-id", n.id, "--peers", c.peers())
			if res.code != 0 || !strings.HasPrefix(res.stdout, "seeded "+n.dir+" for node "+n.id) {
				t.Fatalf("%v", res)
			}
		}
	})
	p.model.restored() // the seed flags every rank for a resync
	c.converged()
	c.checkAll(p.model)
	if index == st.AppliedIndex {
		// The survivor had applied its whole log: the file holds its state.
		c.waitDigest(st.Digest)
	}
	for _, n := range c.nodes {
		if _, err := p.publishNext(ctxT(t, 30*time.Second), n.cl); err != nil {
			t.Fatalf("write through %s: %v", n.id, err)
		}
	}
	c.converged()
	c.checkAll(p.model)
}

// atoi parses a decimal number a test read from a command's output.
func atoi(t *testing.T, s string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
