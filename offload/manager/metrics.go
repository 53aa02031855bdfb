package manager

import (
	"strconv"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics exports a Manager's Stats when scraped, so that its counters live
// in one place (Manager.stats, under its lock); only the two latency
// histograms are observed on the hot path.
//
// Families (all labelled worker and dp_rank; from and to are tiers:
// device, host, disk):
//
//	kvagent_offload_queue_depth{from,to}             blocks queued
//	kvagent_offload_inflight_blocks{from,to}         blocks being copied
//	kvagent_offload_queued_total{from,to}            blocks accepted into a queue
//	kvagent_offload_dropped_total{from,to,reason}    shed|skipped|exists|full|error
//	kvagent_offload_blocks_total{from,to}            blocks copied
//	kvagent_offload_bytes_total{from,to}             bytes copied
//	kvagent_offload_duration_seconds{from,to}        one batch's copy
//	kvagent_offload_requests_ignored_total{reason}   invalid|no_priority|duplicate|cold|no_disk
//	kvagent_offload_disk_down                        1 once the disk pool has shut down (damage), else 0
//	kvagent_offload_filter_hashes                    hashes the frequency filter tracks
//	kvagent_offload_onboard_calls_total
//	kvagent_onboard_blocks_total{from,to}            blocks loaded into G1 (to=device), by source tier
//	kvagent_offload_onboard_failures_total{reason}   not_found|timeout|canceled|error
//	kvagent_offload_onboard_late_writes_total        copies into G1 that outlived their Onboard
//	kvagent_offload_onboard_duration_seconds         one Onboard call
type metrics struct {
	stats func() Stats // the Manager's, or zero for a rank without one
	disk  bool         // the rank has a disk pool: disk_down is exported
	paths []Path       // the paths this manager uses

	depth, inflight, queued, dropped, blocks, bytes *prometheus.Desc
	ignored, tracked, diskDown                      *prometheus.Desc
	onCalls, onBlocks, onFailures, onLate           *prometheus.Desc

	copyVec        *prometheus.HistogramVec
	copySeconds    [NumPaths]prometheus.Observer // nil for a path not used
	onboardSeconds prometheus.Histogram
}

func newMetrics(m *Manager) *metrics {
	var paths []Path
	for p := range NumPaths {
		if m.lanes[p] != nil || p == H2D { // H2D also carries Disk2H's second hop
			paths = append(paths, p)
		}
	}
	return newMetricsOf(m.cfg.Rank, paths, m.Stats, m.disk != nil)
}

// IdleMetrics exports, at zero, the families a Manager of rank would
// export on paths, for a rank whose engine has not registered a region yet
// (or has unregistered it), so no Manager runs: a dashboard or an alert
// over them then reads 0 on such a rank, not "no data". A collector that
// delegates to it while the rank has no Manager, and to the Manager's
// Collector while it has, exports the same series throughout: they
// describe the same families.
//
// diskDown is nil for a rank without a disk pool, which has no
// kvagent_offload_disk_down; else it reports whether the pool has shut
// down (pool.DiskPool.Err() != nil). The pool outlives the Managers, so
// its state is not zero between them: a dead disk tier read healthy
// before the engine registered and again after it unregistered.
func IdleMetrics(rank kvevent.Rank, paths []Path, diskDown func() bool) prometheus.Collector {
	stats := func() Stats { return Stats{} }
	if diskDown != nil {
		stats = func() Stats { return Stats{DiskDown: diskDown()} }
	}
	return newMetricsOf(rank, paths, stats, diskDown != nil)
}

// Collector is the Manager's metrics (the families above), for a caller
// that exports them itself rather than through Config.Registerer.
func (m *Manager) Collector() prometheus.Collector { return m.metrics }

func newMetricsOf(rank kvevent.Rank, paths []Path, stats func() Stats, disk bool) *metrics {
	labels := prometheus.Labels{"worker": strconv.FormatUint(rank.Worker, 10), "dp_rank": strconv.FormatUint(uint64(rank.DP), 10)}
	d := func(name, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc("kvagent_offload_"+name, help, vars, labels)
	}
	x := &metrics{
		stats:      stats,
		disk:       disk,
		depth:      d("queue_depth", "Blocks waiting in an offload or onboard queue.", "from", "to"),
		inflight:   d("inflight_blocks", "Blocks taken by a copy worker and not finished.", "from", "to"),
		queued:     d("queued_total", "Blocks accepted into an offload queue.", "from", "to"),
		dropped:    d("dropped_total", "Blocks not copied, by reason: shed by a full queue, skipped (freed or evicted before or during the copy), exists in the destination or is being written there by another copy, full destination, error.", "from", "to", "reason"),
		blocks:     d("blocks_total", "Blocks copied.", "from", "to"),
		bytes:      d("bytes_total", "Bytes copied.", "from", "to"),
		ignored:    d("requests_ignored_total", "Offload requests not queued, by reason.", "reason"),
		tracked:    d("filter_hashes", "Block hashes the frequency filter counts."),
		diskDown:   d("disk_down", "1 once the disk pool has shut itself down (damaged or unreadable files): nothing more is offloaded to it until a restart."),
		onCalls:    d("onboard_calls_total", "Onboard calls."),
		onBlocks:   prometheus.NewDesc("kvagent_onboard_blocks_total", "Blocks loaded into G1 (to=device), by the tier they came from.", []string{"from", "to"}, labels),
		onFailures: d("onboard_failures_total", "Blocks an Onboard did not load, by reason.", "reason"),
		onLate:     d("onboard_late_writes_total", "Copies into G1 still running when their Onboard gave up."),
		copyVec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "kvagent_offload_duration_seconds",
			Help:        "Time one batch of block copies took.",
			ConstLabels: labels,
			Buckets:     prometheus.ExponentialBuckets(10e-6, 4, 10), // 10µs .. 2.6s
		}, []string{"from", "to"}),
		onboardSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "kvagent_offload_onboard_duration_seconds",
			Help:        "Time one Onboard call took, until it returned.",
			ConstLabels: labels,
			Buckets:     prometheus.ExponentialBuckets(100e-6, 2.5, 12), // 100µs .. 2.4s
		}),
	}
	for _, p := range paths {
		x.paths = append(x.paths, p)
		x.copySeconds[p] = x.copyVec.WithLabelValues(p.From().String(), p.To().String())
	}
	return x
}

func (x *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{x.depth, x.inflight, x.queued, x.dropped, x.blocks, x.bytes,
		x.ignored, x.tracked, x.diskDown, x.onCalls, x.onBlocks, x.onFailures, x.onLate} {
		ch <- d
	}
	x.copyVec.Describe(ch)
	x.onboardSeconds.Describe(ch)
}

func (x *metrics) Collect(ch chan<- prometheus.Metric) {
	s := x.stats()
	g := func(d *prometheus.Desc, v int, lv ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), lv...)
	}
	n := func(d *prometheus.Desc, v uint64, lv ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), lv...)
	}
	for _, p := range x.paths {
		ps := s.Paths[p]
		from, to := p.From().String(), p.To().String()
		g(x.depth, ps.Depth, from, to)
		g(x.inflight, ps.InFlight, from, to)
		n(x.queued, ps.Queued, from, to)
		n(x.dropped, ps.Shed, from, to, "shed")
		n(x.dropped, ps.Skipped, from, to, "skipped")
		n(x.dropped, ps.Exists, from, to, "exists")
		n(x.dropped, ps.Full, from, to, "full")
		n(x.dropped, ps.Failed, from, to, "error")
		n(x.blocks, ps.Blocks, from, to)
		n(x.bytes, ps.Bytes, from, to)
	}
	n(x.ignored, s.Invalid, "invalid")
	n(x.ignored, s.NoPriority, "no_priority")
	n(x.ignored, s.Duplicates, "duplicate")
	n(x.ignored, s.Cold, "cold")
	n(x.ignored, s.NoDisk, "no_disk")
	g(x.tracked, s.Tracked)
	if x.disk {
		down := 0
		if s.DiskDown {
			down = 1
		}
		g(x.diskDown, down)
	}
	o := s.Onboard
	n(x.onCalls, o.Calls)
	n(x.onBlocks, o.FromHost, "host", "device")
	n(x.onBlocks, o.FromDisk, "disk", "device")
	n(x.onFailures, o.NotFound, NotFound.String())
	n(x.onFailures, o.TimedOut, TimedOut.String())
	n(x.onFailures, o.Canceled, Canceled.String())
	n(x.onFailures, o.Failed, Failed.String())
	n(x.onLate, o.LateWrites)
	x.copyVec.Collect(ch)
	x.onboardSeconds.Collect(ch)
}
