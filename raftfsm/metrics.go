package raftfsm

import (
	"io/fs"
	"math"
	"path/filepath"
	"strconv"
	"time"

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

	leaderChanges, readySeconds, restoreSeconds, diskBytes  *prometheus.Desc
	bookings, bookingsExpired                               *prometheus.Desc
	workerBlocks, workerSilent, workerPrefill, workerDecode *prometheus.Desc
	checks, mismatches, stalls, workerBusy, indexMemory     *prometheus.Desc
	eventsApplied, forcedCompactions, applyHalted           *prometheus.Desc
	configMismatches, inboundClosed, replicationHolds       *prometheus.Desc
}

// GapsCounterOpts is kvrouter_events_gaps_total: the rank batches whose
// RankAck.Gap reached their publisher. The event plane's ingester counts
// those it answers, the API those of POST /v1/events; each registers it
// through promreg on the node's registry, which gives the second the
// first's collector, so that it is one family whichever path acknowledged
// the gap, and one definition keeps the two registrations alike.
func GapsCounterOpts() prometheus.CounterOpts {
	return prometheus.CounterOpts{Name: "kvrouter_events_gaps_total",
		Help: "Rank batches acknowledged with a gap, over the event plane or POST /v1/events."}
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
		unknownRemoves: d("events_unknown_removes_total", "Removes of blocks the rank did not hold in the remove's tier."),
		workers:        d("workers", "Registered workers."),
		ready:          d("ready", "1 once the node has caught up and serves."),

		leaderChanges:   d("raft_leader_changes_total", "Leaders this node has seen take over (Raft's leader observations)."),
		readySeconds:    d("startup_ready_seconds", "Seconds from the node's start to ready (absent until ready)."),
		restoreSeconds:  d("restore_duration_seconds", "Seconds the last snapshot restore took (absent before one)."),
		diskBytes:       d("store_disk_bytes", "Bytes on disk under the data directory, by store: raft (log), fsm (state), snapshots.", "store"),
		bookings:        d("bookings_active", "Live load bookings (routed requests not yet freed)."),
		bookingsExpired: d("bookings_expired_total", "Bookings the expiry sweep removed (never freed), since this node started (its log replay included)."),
		workerBlocks:    d("index_worker_blocks", "(rank, block) residencies per worker and tier.", "worker", "tier"),
		workerSilent:    d("worker_silent", "1 when a rank of the worker has sent nothing for --silent-after.", "worker"),
		workerPrefill:   d("worker_active_prefill_tokens", "Uncached input tokens of the worker's requests still in prefill.", "worker"),
		workerDecode:    d("worker_active_decode_blocks", "Distinct KV blocks the worker's live requests hold.", "worker"),
		checks:          d("state_digest_checks_total", "Replica digest checks that compared this node's digest with the leader's, since it started."),
		mismatches:      d("state_digest_mismatch_total", "Replica digest checks that found this node's state differing from the leader's: its state has diverged."),
		configMismatches: d("configuration_mismatch_total", "Configuration checks that found this node's Raft configuration entry differing from the leader's at the same log index, "+
			"since it started: the nodes were bootstrapped with different --peers."),
		eventsApplied: d("events_applied_total", "Events of event batches this node's state machine took, by op, tier and outcome (applied, duplicate, gap: after a gap in its batch, malformed, fenced: in a batch of another publisher incarnation than the rank's last dump), since it started.", "op", "tier", "outcome"),
		indexMemory:   d("index_memory_bytes", "Estimated bytes the in-memory index holds (nodes, holders, engine-hash maps, orphan buffers)."),
		workerBusy:    d("worker_busy", "1 when every rank of the worker is over a busy threshold of the scoring settings (it takes no routes), 0 while one is not.", "worker"),
		stalls:        d("store_write_stall_seconds_total", "Seconds Pebble held writes back (memtables waiting for a flush, or too many level 0 sublevels), by store: raft (log), fsm (state).", "store"),

		applyHalted: d("apply_halted", "1 while this node's state machine is halted at a Raft entry a later build wrote, which it cannot read: it applies nothing until it is upgraded."),
		inboundClosed: d("raft_inbound_connections_closed_total", "Connections to this node's --raft-addr it closed unserved, since it started, by reason: "+
			"over_limit (closed at once: the remote host held 64, or all hosts 256), silent (nothing sent within 30 s of the accept), "+
			"other_cluster (its greeting named another cluster: a raft address another cluster lists reaches this node). "+
			"A peer sends its request as soon as it connects and holds ten at most: a rise of over_limit or silent is a port scan, a client that connects and waits, "+
			"or a flood; of other_cluster, a member's raft address that another cluster's node serves.", "reason"),
		replicationHolds: d("raft_replication_holds_total", "Times this node, leading, found a follower not answering its entries (its port refused, its connection lost, "+
			"a timeout) and held that follower's replication until it answered a heartbeat again, since it started, so that the follower gets its entries "+
			"as soon as it is back, where Raft alone backs off up to 10 s. A rise is a follower down or unreachable."),
		forcedCompactions: d("raft_forced_compactions_total", "Times this node, leading, compacted its whole Raft log because a follower's log could not take the leader's "+
			"from its start (it held a snapshot restore no other node took), so that the follower got the leader's snapshot."),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.state, c.term, c.commit, c.applied, c.lastIndex, c.snapIndex, c.blocks,
		c.nodes, c.entries, c.orphans, c.needResync, c.malformed, c.unknownRemoves, c.workers, c.ready,
		c.leaderChanges, c.readySeconds, c.restoreSeconds, c.diskBytes, c.bookings, c.bookingsExpired,
		c.workerBlocks, c.workerSilent, c.workerPrefill, c.workerDecode, c.checks, c.mismatches, c.stalls, c.workerBusy, c.indexMemory, c.eventsApplied,
		c.forcedCompactions, c.applyHalted, c.configMismatches, c.inboundClosed, c.replicationHolds} {
		ch <- d
	}
	c.n.fsm.applySeconds.Describe(ch)
	c.n.fsm.persistSeconds.Describe(ch)
	c.n.lookupSeconds.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	applied, _ := c.n.fsm.Applied()
	s := c.n.statusAt(applied) // not Status: see statusAt
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
	g(c.indexMemory, float64(st.MemoryBytes))
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
	halted := 0.0
	if s.ApplyHalted != "" {
		halted = 1
	}
	g(c.applyHalted, halted)

	n, f := c.n, c.n.fsm
	ch <- prometheus.MustNewConstMetric(c.leaderChanges, prometheus.CounterValue, float64(n.leaderChanges.Load()))
	ch <- prometheus.MustNewConstMetric(c.forcedCompactions, prometheus.CounterValue, float64(n.forcedCompactions.Load()))
	ch <- prometheus.MustNewConstMetric(c.replicationHolds, prometheus.CounterValue, float64(n.watch.holds.Load()))
	if v := n.readySeconds.Load(); v != 0 {
		g(c.readySeconds, math.Float64frombits(v))
	}
	if v := f.restoreSeconds.Load(); v != 0 {
		g(c.restoreSeconds, math.Float64frombits(v))
	}
	for _, sub := range []string{"raft", "fsm", "snapshots"} {
		g(c.diskBytes, float64(dirBytes(filepath.Join(n.cfg.DataDir, sub))), sub)
	}
	live, _ := f.Sequences().Count()
	g(c.bookings, float64(live))
	ch <- prometheus.MustNewConstMetric(c.bookingsExpired, prometheus.CounterValue, float64(f.expiredBookings.Load()))
	for k := kvevent.KindStored; k <= kvevent.KindCleared; k++ {
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			for o, name := range outcomeNames {
				ch <- prometheus.MustNewConstMetric(c.eventsApplied, prometheus.CounterValue, float64(f.events[k][t][o].Load()), k.String(), t.String(), name)
			}
		}
	}
	compared, mismatched := f.DigestChecks()
	ch <- prometheus.MustNewConstMetric(c.checks, prometheus.CounterValue, float64(compared))
	ch <- prometheus.MustNewConstMetric(c.mismatches, prometheus.CounterValue, float64(mismatched))
	ch <- prometheus.MustNewConstMetric(c.configMismatches, prometheus.CounterValue, float64(c.n.fsm.ConfigMismatches()))
	ch <- prometheus.MustNewConstMetric(c.stalls, prometheus.CounterValue, n.logStalls.Seconds(), "raft")
	var overCap, silent, foreign uint64
	if n.stream != nil {
		overCap, silent = n.stream.inboundClosed()
		foreign = n.stream.foreign.Load()
	}
	ch <- prometheus.MustNewConstMetric(c.inboundClosed, prometheus.CounterValue, float64(overCap), "over_limit")
	ch <- prometheus.MustNewConstMetric(c.inboundClosed, prometheus.CounterValue, float64(silent), "silent")
	ch <- prometheus.MustNewConstMetric(c.inboundClosed, prometheus.CounterValue, float64(foreign), "other_cluster")
	ch <- prometheus.MustNewConstMetric(c.stalls, prometheus.CounterValue, f.stalls.Seconds(), "fsm")
	f.applySeconds.Collect(ch)
	f.persistSeconds.Collect(ch)
	n.lookupSeconds.Collect(ch)

	// Per worker (bounded by the fleet): its ranks summed.
	for _, w := range n.Workers() {
		id := strconv.FormatUint(w.Info.ID, 10)
		var blocks [kvevent.NumTiers]int64
		var silent, prefill, decode int64
		// Busy only when all its ranks are (semantics.md §5): the scorer
		// routes to a rank that is not.
		busy := int64(0)
		if len(w.Ranks) > 0 {
			busy = 1
		}
		for _, rs := range w.Ranks {
			for t := range blocks {
				blocks[t] += rs.Blocks[t]
			}
			if rs.Silent {
				silent = 1
			}
			if !rs.Busy {
				busy = 0
			}
			prefill += rs.Load.ActivePrefillTokens
			decode += rs.Load.ActiveDecodeBlocks
		}
		for t := kvevent.Tier(0); t < kvevent.NumTiers; t++ {
			g(c.workerBlocks, float64(blocks[t]), id, t.String())
		}
		g(c.workerSilent, float64(silent), id)
		g(c.workerBusy, float64(busy), id)
		g(c.workerPrefill, float64(prefill), id)
		g(c.workerDecode, float64(decode), id)
	}
}

// dirBytes is the size of the regular files under dir (0 when it is
// missing); a file removed during the walk is skipped.
func dirBytes(dir string) int64 {
	var total int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				total += info.Size()
			}
		}
		return nil
	})
	return total
}

// observeSince observes the seconds since start on h.
func observeSince(h prometheus.Histogram, start time.Time) { h.Observe(time.Since(start).Seconds()) }
