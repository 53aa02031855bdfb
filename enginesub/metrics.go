package enginesub

import (
	"fmt"
	"strconv"

	"github.com/kvrouter/kvrouter/internal/promreg"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the families of every subscriber registered on one
// Registerer, labelled by rank.
type metrics struct {
	batches, blockEvents, gaps, epochs, duplicates *prometheus.CounterVec // worker, dp_rank
	unverified, copyRemoves                        *prometheus.CounterVec // worker, dp_rank
	replays                                        *prometheus.CounterVec // worker, dp_rank, outcome
	resyncs, malformed                             *prometheus.CounterVec // worker, dp_rank, reason
	skipped, droppedBlocks                         *prometheus.CounterVec // worker, dp_rank, reason
}

// rankMetrics are one subscriber's series: its rank's labels are fixed.
type rankMetrics struct {
	batches, blockEvents, gaps, epochs, duplicates prometheus.Counter
	unverified, copyRemoves                        prometheus.Counter
	replays                                        *prometheus.CounterVec // outcome
	resyncs, malformed                             *prometheus.CounterVec // reason
	skipped, droppedBlocks                         *prometheus.CounterVec // reason (engine.Reason)
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	rank := []string{"worker", "dp_rank"}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, append(rank, labels...))
	}
	m := &metrics{
		batches: counter("kvagent_subscriber_batches_total",
			"Engine batches decoded and given to the sink, live or replayed."),
		blockEvents: counter("kvagent_subscriber_block_events_total",
			"Stored blocks plus removed hashes in the batches given to the sink."),
		gaps: counter("kvagent_engine_seq_gaps_total",
			"Jumps forward in an engine rank's event sequence (batches the PUB socket dropped)."),
		epochs: counter("kvagent_subscriber_epochs_total",
			"Engine restarts seen: the sequence fell back and the rank started a new epoch."),
		duplicates: counter("kvagent_subscriber_duplicates_total",
			"Batches skipped, live or replayed: applied or given up already (a second copy, a replay's live copy, an old connection's batch), or sent by the engine before a restart a replay showed (still queued on its connection)."),
		unverified: counter("kvagent_subscriber_unverified_total",
			"Live batches skipped after an engine restart a replay showed, while the old engine's may still be queued, because the replay asked to tell whose each was failed (the rank resynced); after 3 such failures in a row the stream is taken for the engine's."),
		copyRemoves: counter("kvagent_subscriber_copy_removes_total",
			"Hashes of engine removes not sent because another copy of the block, announced by its own store and not removed, stays (vLLM caches a copy per request that filled the block; its offloading connector announces the blocks chunks share once per chunk)."),
		replays: counter("kvagent_subscriber_replays_total",
			"Replays asked of the engine, by outcome (healed, overrun, failed, restarted: answered by an engine that restarted since the live batch that showed the gap, stale: showed a live batch read after such a restart to be an earlier engine's, skipped).", "outcome"),
		resyncs: counter("kvagent_subscriber_resyncs_total",
			"Ranks whose state was declared unknown, by reason (gap, overrun, replay_failed, sink_error, bad_payload).", "reason"),
		malformed: counter("kvagent_subscriber_malformed_total",
			"Engine messages skipped as malformed, by reason (frames, seq, payload, delimiter).", "reason"),
		skipped: counter("kvagent_subscriber_skipped_events_total",
			"Wire events of decoded batches that gave no router event, by the decoder's reason (block_size, unknown_medium, not_main_group, other_dp_rank: a batch of another dp rank than the one followed, ...).", "reason"),
		droppedBlocks: counter("kvagent_subscriber_dropped_blocks_total",
			"Blocks left out of stored events by the per-block rules, by reason (block_size, unresolved, mm_token), and those of stores in another dp rank's batches (other_dp_rank).", "reason"),
	}
	if reg == nil {
		return m, nil
	}
	// Several subscribers (a Group's) share a Registerer: the second one
	// finds the families registered and uses them.
	for _, p := range []**prometheus.CounterVec{&m.batches, &m.blockEvents, &m.gaps, &m.epochs, &m.duplicates, &m.unverified,
		&m.copyRemoves, &m.replays, &m.resyncs, &m.malformed, &m.skipped, &m.droppedBlocks} {
		c, err := promreg.Register(reg, *p)
		if err != nil {
			return nil, fmt.Errorf("enginesub: register metrics: %w", err)
		}
		*p = c
	}
	return m, nil
}

// forget deletes a rank's series from every family (a rank no longer
// followed: its series would stay exported with their last values).
func (m *metrics) forget(worker uint64, dp uint32) {
	labels := prometheus.Labels{"worker": strconv.FormatUint(worker, 10), "dp_rank": strconv.FormatUint(uint64(dp), 10)}
	for _, v := range []*prometheus.CounterVec{m.batches, m.blockEvents, m.gaps, m.epochs, m.duplicates, m.unverified,
		m.copyRemoves, m.replays, m.resyncs, m.malformed, m.skipped, m.droppedBlocks} {
		v.DeletePartialMatch(labels)
	}
}

func (m *metrics) forRank(worker uint64, dp uint32) rankMetrics {
	w, d := strconv.FormatUint(worker, 10), strconv.FormatUint(uint64(dp), 10)
	labels := prometheus.Labels{"worker": w, "dp_rank": d}
	r := rankMetrics{
		batches:       m.batches.WithLabelValues(w, d),
		blockEvents:   m.blockEvents.WithLabelValues(w, d),
		gaps:          m.gaps.WithLabelValues(w, d),
		epochs:        m.epochs.WithLabelValues(w, d),
		duplicates:    m.duplicates.WithLabelValues(w, d),
		unverified:    m.unverified.WithLabelValues(w, d),
		copyRemoves:   m.copyRemoves.WithLabelValues(w, d),
		replays:       m.replays.MustCurryWith(labels),
		resyncs:       m.resyncs.MustCurryWith(labels),
		malformed:     m.malformed.MustCurryWith(labels),
		skipped:       m.skipped.MustCurryWith(labels),
		droppedBlocks: m.droppedBlocks.MustCurryWith(labels),
	}
	// The labelled series show zero before their first occurrence.
	for _, o := range []string{"healed", "overrun", "failed", "restarted", "stale"} {
		r.replays.WithLabelValues(o)
	}
	for _, why := range []Reason{ReasonGap, ReasonOverrun, ReasonReplayFailed, ReasonSinkError, ReasonBadPayload} {
		r.resyncs.WithLabelValues(string(why))
	}
	for _, why := range badReasons {
		r.malformed.WithLabelValues(why)
	}
	return r
}
