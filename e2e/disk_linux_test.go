package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestFollowerDiskFullExitsAndCatchesUp is fault scenario 15 on a
// follower: under a stream of event batches, one follower's disk stops
// taking writes (a file size limit, RLIMIT_FSIZE, set on the running
// process a little above its largest file: Go ignores SIGXFSZ, so a write
// past it fails with EFBIG, as one on a full disk fails with ENOSPC). The
// follower's next Raft log write fails, and Pebble takes that as fatal:
// the node exits with the disk's error in its log rather than
// acknowledging entries it did not store. The other two acknowledge on;
// restarted without the limit (space freed), the follower replays what it
// had synced, catches up, and holds every acknowledged event at the
// others' applied index and digest.
func TestFollowerDiskFullExitsAndCatchesUp(t *testing.T) {
	diskFullUnderIngest(t, false)
}

// TestLeaderDiskFullExitsAndANewLeaderTakesOver is fault scenario 15 on
// the leader: its disk stops taking writes under the stream, it exits with
// the disk's error in its log, the other two elect a new leader in a
// later term and acknowledge on, and the old leader, restarted without the
// limit, follows and catches up.
func TestLeaderDiskFullExitsAndANewLeaderTakesOver(t *testing.T) {
	diskFullUnderIngest(t, true)
}

// diskFullUnderIngest fills the disk of the leader (leader) or of a
// follower while two publishers stream, and checks what the cluster and
// the node do: see the two tests.
func diskFullUnderIngest(t *testing.T, leader bool) {
	seed := testSeed(t)
	c := startCluster(t, 3)
	pubs, all := registeredPublishers(t, c.cl, seed)

	var stop, failed atomic.Bool
	var acked atomic.Int64
	errs := make([]error, len(pubs))
	ctx := ctxT(t, 90*time.Second)
	var wg sync.WaitGroup
	for i, p := range pubs {
		wg.Go(func() {
			for !stop.Load() {
				if _, errs[i] = p.publishNext(ctx, c.cl); errs[i] != nil {
					failed.Store(true)
					return
				}
				acked.Add(1)
			}
		})
	}
	// streamed waits until n more requests are acknowledged (or a
	// publisher fails: wg.Wait reports it).
	streamed := func(n int64, what string) {
		t.Helper()
		from := acked.Load()
		c.waitFor(30*time.Second, what, func() (bool, string) {
			return acked.Load() >= from+n || failed.Load(), ""
		})
	}
	streamed(50, "50 requests acknowledged before the fault")

	// The node is frozen while its disk fills (freezeLeader,
	// freezeFollower): found and then filled, the leader may have lost an
	// election in between (Raft's 200 ms lease on a loaded machine), or
	// the follower won one, and the test would fault the other role than
	// its own and pass without testing it.
	var lead, v int
	var oldTerm uint64
	if leader {
		lead, oldTerm = c.freezeLeader()
		v = lead
	} else {
		v, lead = c.freezeFollower()
	}
	n := c.nodes[v]
	limit := c.fillDisk(v)
	c.resume(v)
	t.Logf("%s's disk full: writes past %d bytes into a file fail (leader %s)", n.id, limit, c.nodes[lead].id)

	// The node stops, on its own, with the disk's error in its log.
	c.waitFor(readyTimeout, n.id+" to exit on its full disk", func() (bool, string) {
		return n.p.exited(), "it runs"
	})
	n.stopped = true // its exit is the expected one from here on
	var ee *exec.ExitError
	if !errors.As(n.p.err, &ee) || ee.ExitCode() == 0 {
		t.Fatalf("%s exited with %v on its full disk, want a failure", n.id, n.p.err)
	}
	why := diskErrorLine(c.runLog(v))
	if why == "" {
		t.Fatalf("%s exited (%v) with no line in its log naming the refused write (\"file too large\")", n.id, n.p.err)
	}
	t.Logf("%s exited (%v): %s", n.id, n.p.err, why)

	// The other two go on acknowledging: a new leader if it was the
	// leader that stopped.
	if leader {
		lead = c.leader()
		if term := c.term(lead); term <= oldTerm {
			t.Fatalf("the others' leader %s is in term %d, the stopped leader %s led in term %d",
				c.nodes[lead].id, term, n.id, oldTerm)
		}
	}
	streamed(50, "50 requests acknowledged by the two others after the fault")
	stop.Store(true)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("publisher %d: %v", i, err)
		}
	}
	c.converged()
	c.checkAll(all)
	c.appliedOnceAt(all, c.others(v)) // they ran throughout

	// Space freed, the node starts again (a new process: no limit),
	// replays what it had synced, and catches up.
	c.restart(v)
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	if why := diskErrorLine(c.runLog(v)); why != "" {
		t.Fatalf("%s restarted with room on its disk still says: %s", n.id, why)
	}
}

// freezeFollower freezes a follower (SIGSTOP) and returns its position
// and the leader's, once every other node, asked after the freeze, agrees
// on that leader in one term: their terms, read after the freeze, are at
// least those they voted in before it, so the frozen node, which needs
// one of their votes, was elected in no later term, and in that one
// another leads. Else it is let go on, and a follower of the moment is
// tried. It cannot be elected while frozen.
func (c *cluster) freezeFollower() (int, int) {
	c.t.Helper()
	var at, lead int
	c.waitFor(leaderTimeout, "a follower frozen while the others agree on another leader", func() (bool, string) {
		lead = c.leader()
		at = c.others(lead)[0]
		c.pause(at)
		sts := c.statusAll()
		for i, st := range sts {
			if i != at && c.nodes[i].serving() && (st == nil || sts[lead] == nil ||
				st.LeaderID != c.nodes[lead].id || st.Term != sts[lead].Term) {
				c.resume(at)
				return false, fmt.Sprintf("%s followed %s; after its freeze: %s", c.nodes[at].id, c.nodes[lead].id, describe(sts))
			}
		}
		return true, ""
	})
	return at, lead
}

// fillDisk makes node i's disk refuse writes from now on, as a full one
// does, and returns the limit: its running process's RLIMIT_FSIZE (the
// soft one: the hard limit stays) a little above the largest file it
// holds, its log file included (stderr, where it says why it stops),
// so that the Raft log's write-ahead file, which grows with every entry,
// crosses it within a few hundred entries.
func (c *cluster) fillDisk(i int) uint64 {
	c.t.Helper()
	n := c.nodes[i]
	largest := fileSize(c.t, n.logPath)
	err := filepath.WalkDir(n.dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			largest = max(largest, fileSize(c.t, path))
		}
		return nil
	})
	if err != nil {
		c.t.Fatalf("walk %s's data directory: %v", n.id, err)
	}
	limit := uint64(largest) + 64<<10
	pid := n.p.cmd.Process.Pid
	var lim unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_FSIZE, nil, &lim); err != nil {
		c.t.Fatalf("read %s's file size limit: %v", n.id, err)
	}
	lim.Cur = limit
	if err := unix.Prlimit(pid, unix.RLIMIT_FSIZE, &lim, nil); err != nil {
		c.t.Fatalf("limit %s's file size: %v", n.id, err)
	}
	return limit
}

// fileSize is the size of the file at path; 0 when it is gone (Pebble
// removes files as it goes).
func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// diskErrorLine is the first line of a node's log that names a write the
// disk refused ("file too large", EFBIG), or "".
func diskErrorLine(log string) string {
	for line := range strings.SplitSeq(log, "\n") {
		if strings.Contains(line, "level=ERROR") && strings.Contains(line, "file too large") {
			return line
		}
	}
	return ""
}
