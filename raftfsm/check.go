package raftfsm

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/raft"
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
//
// Configuration checks. Every node started with --peers on an empty
// directory writes its own first log entry, the configuration of its
// peers, at index 1 and term 1 (raft.BootstrapCluster). Raft takes two
// such entries for the same entry, so nodes started with different
// --peers lists run with different configurations, silently: one that
// listed a fourth, nonexistent voter counts quorums of three out of four,
// and dials a peer at the address its own list gave. So a leader whose
// configuration is still its bootstrap entry (Node.checkBootstrap)
// proposes a check that also carries that entry and its index; a replica
// applying it reads the entry at that index of its own log and, if it
// differs (other ids, suffrages or addresses, as dialled), counts
// kvrouter_configuration_mismatch_total and logs an error naming both
// lists and what to do. A replica whose log no longer holds the entry (a
// snapshot replaced it) compares nothing. An older build skips such a
// check (its decoder finds trailing bytes).

// CheckPoint is a replica's digest right after it applied a check entry.
type CheckPoint struct {
	Index  uint64 `json:"index"`  // the check entry's log index; 0: none
	Digest uint64 `json:"digest"` // FSM.Digest after applying it
}

// CheckResult is the response of an applied check entry.
type CheckResult struct {
	Compared bool // the carried digest was of this replica's last check
	Match    bool // compared and equal

	ConfigCompared bool // a configuration was carried and this log held its entry
	ConfigMatch    bool // compared and equal
}

// LastCheck returns the last check entry this FSM applied, and the digest
// after it; zero when none since it started or restored.
func (f *FSM) LastCheck() CheckPoint {
	f.checkMu.Lock()
	defer f.checkMu.Unlock()
	return f.lastCheck
}

// ConfigMismatches returns how many configuration checks found this
// node's Raft configuration entry differing from the leader's, since it
// started.
func (f *FSM) ConfigMismatches() uint64 { return f.configMismatches.Load() }

// checkConfig compares servers, the leader's configuration at index, with
// the entry at index of this node's log (see the file comment): whether
// it compared, and whether they are equal. A difference is logged and
// counted.
func (f *FSM) checkConfig(index uint64, servers []raft.Server) (compared, match bool) {
	if f.configAt == nil {
		return false, false
	}
	own, ok := f.configAt(index)
	if !ok {
		return false, false
	}
	onlyOwn, onlyLeader := configDiff(own, servers)
	if len(onlyOwn) == 0 && len(onlyLeader) == 0 {
		return true, true
	}
	f.configMismatches.Add(1)
	f.logger.Error("this node's Raft configuration differs from the leader's at the same log index: the nodes were started "+
		"with different --peers, and each runs with its own list. If the leader's list is right, stop this node, empty its "+
		"data directory and start it again with the leader's --peers; if this node's is, change the leader's configuration "+
		"(kvctl members remove|add), which every node takes",
		"index", index, "this_node", serverList(own), "leader", serverList(servers),
		"only_this_node", strings.Join(onlyOwn, ","), "only_leader", strings.Join(onlyLeader, ","))
	return true, false
}

// configDiff returns the servers of a that b does not list as they are
// in a (same id, suffrage and address, as dialled: SameRaftAddr), and the
// reverse, each as id@address.
func configDiff(a, b []raft.Server) (onlyA, onlyB []string) {
	missing := func(x, y []raft.Server) []string {
		var out []string
		for _, s := range x {
			if !slices.ContainsFunc(y, func(t raft.Server) bool {
				return t.ID == s.ID && t.Suffrage == s.Suffrage && SameRaftAddr(string(t.Address), string(s.Address))
			}) {
				out = append(out, serverString(s))
			}
		}
		return out
	}
	return missing(a, b), missing(b, a)
}

// serverList writes a configuration's servers as id@address, a
// non-voter's with its suffrage, comma-separated in id order.
func serverList(servers []raft.Server) string {
	out := make([]string, 0, len(servers))
	for _, s := range servers {
		out = append(out, serverString(s))
	}
	slices.Sort(out)
	return strings.Join(out, ",")
}

func serverString(s raft.Server) string {
	if s.Suffrage != raft.Voter {
		return fmt.Sprintf("%s@%s(%s)", s.ID, s.Address, s.Suffrage)
	}
	return fmt.Sprintf("%s@%s", s.ID, s.Address)
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
	if c.configIndex != 0 {
		res.ConfigCompared, res.ConfigMatch = f.checkConfig(c.configIndex, c.config)
	}
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
