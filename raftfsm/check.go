package raftfsm

import (
	"fmt"
	"time"
)

// Replica digest checks.
//
// Replicas that applied the same entries hold the same state, so their
// digests (FSM.Digest) agree at every applied index. A replica whose state
// diverged (a bug, a bad disk, a state database edited by hand) would
// still answer routes, from its own wrong index, and nothing else would
// notice. So the leader proposes a check entry every Config.CheckInterval
// and every replica applies it in log order:
//
//   - Applying the check entry at index j, a replica notes its own digest
//     after it (the entry changes nothing else): lastCheck = (j, digest).
//   - The leader proposes the next check with its own lastCheck in it. A
//     replica applying that entry compares the digest carried with its own
//     lastCheck when both are of the same index: a difference is a
//     mismatch, counted in kvrouter_state_digest_mismatch_total and logged
//     as an error with both digests.
//
// A replica with no lastCheck at that index (it started or restored since,
// or the proposer had none) compares nothing. The comparison is exact: the
// digest is a function of the applied entries only (the leader stamps
// time into the commands), and the check entry is applied at the same
// place in the log on every replica, however Raft batched the entries.
//
// A node that does not know the check command (an older build) skips the
// entry as undecodable, which changes nothing; so checks need no upgrade
// order.

// CheckPoint is a replica's digest right after it applied a check entry.
type CheckPoint struct {
	Index  uint64 `json:"index"`  // the check entry's log index; 0: none
	Digest uint64 `json:"digest"` // FSM.Digest after applying it
}

// CheckResult is the response of an applied check entry.
type CheckResult struct {
	Compared bool // the carried digest was of this replica's last check
	Match    bool // compared and equal
}

// LastCheck returns the last check entry this FSM applied, and the digest
// after it; zero when none since it started or restored.
func (f *FSM) LastCheck() CheckPoint {
	f.checkMu.Lock()
	defer f.checkMu.Unlock()
	return f.lastCheck
}

// DigestChecks returns how many check entries compared a digest, and how
// many of those found a mismatch, since this FSM started.
func (f *FSM) DigestChecks() (compared, mismatched uint64) {
	return f.checksCompared.Load(), f.digestMismatches.Load()
}

// applyCheck applies the check entry at index (see the file comment).
func (f *FSM) applyCheck(c *command, index uint64) CheckResult {
	own := f.digestWith(f.wtab) // mid-batch: the table as applied so far
	f.checkMu.Lock()
	prev := f.lastCheck
	f.lastCheck = CheckPoint{Index: index, Digest: own}
	f.checkMu.Unlock()
	var res CheckResult
	if c.checkIndex == 0 || c.checkIndex != prev.Index {
		return res
	}
	res.Compared = true
	f.checksCompared.Add(1)
	if c.checkDigest == prev.Digest {
		res.Match = true
		return res
	}
	f.digestMismatches.Add(1)
	f.logger.Error("state digest differs from the leader's: this replica's state has diverged; "+
		"replace its data directory (docs/operations.md)",
		"index", c.checkIndex, "digest", fmt.Sprintf("%016x", prev.Digest),
		"leader_digest", fmt.Sprintf("%016x", c.checkDigest), "check_index", index)
	return res
}

// resetCheck forgets the last check: the state it describes is gone (a
// restore replaced it).
func (f *FSM) resetCheck() {
	f.checkMu.Lock()
	f.lastCheck = CheckPoint{}
	f.checkMu.Unlock()
}

// proposeCheck proposes a check entry carrying this node's last check.
// The leader loop calls it; a failed proposal is retried at the next tick.
func (n *Node) proposeCheck() {
	last := n.fsm.LastCheck()
	n.raft.Apply(encodeCheck(time.Now().UnixNano(), last.Index, last.Digest), n.cfg.ApplyTimeout)
}
