package raftfsm

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testclock"
)

// TestSilenceAfterTheNodesClockSteppedBack: a node's wall clock is
// stepped back (an NTP correction, typically at boot: the clock had run
// ahead) after the node started. A rank whose events this node stamped a
// second ago by that clock sent events a second ago, and is not silent
// ("a registered rank that sent no events for --silent-after is
// reported silent", docs/events.md; "each node judges silence by its own
// clock"). The node's start, a floor for the silence, was read before the
// step: its wall reading is later than every stamp since, so it is the
// latest of the floors by wall time, while the silence is then measured
// from it by the monotonic reading, which the step did not move: the
// rank was reported silent (kvrouter_worker_silent 1, `silent: true`)
// until the clock caught up with the start's wall time again, however
// often it published.
func TestSilenceAfterTheNodesClockSteppedBack(t *testing.T) {
	const silentAfter = 5 * time.Second
	const step = time.Hour
	c := newTestCluster(t, 1, func(cfg *Config) { cfg.SilentAfter = silentAfter })
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	// The instant judged: 2·SilentAfter from now by the monotonic clock
	// (well past SilentAfter since the node's start), on a wall clock
	// stepped back by an hour since the node started.
	judged := testclock.WallStepped(t, time.Now().Add(2*silentAfter), -step)
	// The rank's events, stamped by the leader (this node) a second before
	// the judged instant, by its clock as it reads after the step.
	heard := judged.Add(-time.Second)
	f := l.raft.Apply(encodeEvents(heard.UnixNano(), []RankBatch{{Rank: r1, Events: chainEvents(r1, 1, 2, 10)}}), 5*time.Second)
	if err := f.Error(); err != nil {
		t.Fatal(err)
	}
	ws := l.workersAt(judged)
	if len(ws) != 1 || len(ws[0].Ranks) != 1 {
		t.Fatalf("workers %+v", ws)
	}
	if rs := ws[0].Ranks[0]; rs.LastHeard != heard.UnixNano() || rs.Silent {
		t.Fatalf("rank %v heard %v before the judged instant by this node's clock (stepped back %v after its start): silent %v (SilentAfter %v), last heard %d (want %d)",
			r1, judged.Round(0).Sub(heard.Round(0)), step, rs.Silent, silentAfter, rs.LastHeard, heard.UnixNano())
	}
}
