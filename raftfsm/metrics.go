package raftfsm

import (
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports a node's Raft and index figures on each scrape
// (metrics.md): no per-request cost, bounded labels only.
type Collector struct {
	n *Node

	state, term, commit, applied, lastIndex, snapIndex *prometheus.Desc
	blocks, nodes, entries, orphans, needResync        *prometheus.Desc
	malformed, unknownRemoves, workers, ready          *prometheus.Desc
}

// NewCollector returns the collector of node n.
func NewCollector(n *Node) *Collector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvrouter_"+name, help, labels, nil)
	}
	return &Collector{n: n,
		state:          d("raft_state", "1 for this node's current Raft role.", "role"),
		term:           d("raft_term", "Current Raft term."),
		commit:         d("raft_commit_index", "Raft commit index."),
		applied:        d("raft_applied_index", "Index the FSM applied last (its own record)."),
		lastIndex:      d("raft_last_index", "Last index in the Raft log."),
		snapIndex:      d("raft_snapshot_index", "Index of the last Raft snapshot."),
		blocks:         d("index_blocks", "(rank, block) residencies per tier.", "tier"),
		nodes:          d("index_nodes", "Radix tree nodes."),
		entries:        d("index_entries", "(rank, block) residencies, any tier."),
		orphans:        d("events_orphaned_blocks", "Blocks held in orphan buffers waiting for their parent."),
		needResync:     d("index_ranks_needing_resync", "Ranks whose index state provably differs from their engine."),
		malformed:      d("events_rejected_total", "Events rejected as malformed.", "reason"),
		unknownRemoves: d("events_unknown_removes_total", "Removes of blocks the rank did not hold."),
		workers:        d("workers", "Registered workers."),
		ready:          d("ready", "1 once the node has caught up and serves."),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.state, c.term, c.commit, c.applied, c.lastIndex, c.snapIndex, c.blocks,
		c.nodes, c.entries, c.orphans, c.needResync, c.malformed, c.unknownRemoves, c.workers, c.ready} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.n.Status()
	g := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	for _, role := range []string{"Leader", "Follower", "Candidate"} {
		v := 0.0
		if s.State == role {
			v = 1
		}
		g(c.state, v, map[string]string{"Leader": "leader", "Follower": "follower", "Candidate": "candidate"}[role])
	}
	g(c.term, float64(s.Term))
	g(c.commit, float64(s.CommitIndex))
	g(c.applied, float64(s.AppliedIndex))
	g(c.lastIndex, float64(s.LastIndex))
	g(c.snapIndex, float64(s.SnapshotIndex))
	st := c.n.IndexStats()
	for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
		g(c.blocks, float64(st.Blocks[t]), t.String())
	}
	g(c.nodes, float64(st.Nodes))
	g(c.entries, float64(st.Entries))
	g(c.orphans, float64(st.OrphanBlocks))
	g(c.needResync, float64(st.NeedResync))
	ch <- prometheus.MustNewConstMetric(c.malformed, prometheus.CounterValue, float64(st.Counters.Malformed+c.n.fsm.malformed.Load()), "malformed")
	ch <- prometheus.MustNewConstMetric(c.unknownRemoves, prometheus.CounterValue, float64(st.Counters.UnknownRemoves))
	g(c.workers, float64(len(c.n.fsm.Workers())))
	r := 0.0
	if s.Ready {
		r = 1
	}
	g(c.ready, r)
}
