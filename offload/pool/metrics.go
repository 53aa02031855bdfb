package pool

import (
	"fmt"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// collector exports a pool's Stats when scraped, so the counters live in one
// place (the core, under its lock) and the hot path updates no metric.
type collector struct {
	c *core

	capacity, used, pending, referenced, inactive                      *prometheus.Desc
	hits, misses, registered, revived, evictions, publishErrors, bytes *prometheus.Desc
	damaged                                                            *prometheus.Desc
}

func newCollector(c *core) *collector {
	labels := prometheus.Labels{"tier": c.tier.String(),
		"worker": strconv.FormatUint(c.cfg.Rank.Worker, 10), "dp_rank": strconv.FormatUint(uint64(c.cfg.Rank.DP), 10)}
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc("kvagent_pool_"+name, help, nil, labels)
	}
	return &collector{
		c:             c,
		capacity:      d("capacity_blocks", "Blocks the offload pool can hold."),
		bytes:         d("block_bytes", "Size of one block of the offload pool."),
		used:          d("blocks", "Blocks held by the offload pool, including those being written."),
		pending:       d("pending_blocks", "Blocks of the offload pool whose bytes are being written."),
		referenced:    d("referenced_blocks", "Blocks of the offload pool acquired by a reader."),
		inactive:      d("inactive_blocks", "Written, unreferenced blocks of the offload pool (reusable by hash)."),
		hits:          d("hits_total", "Acquires and successful reads of a block the offload pool holds."),
		misses:        d("misses_total", "Acquires and reads of a block the offload pool does not hold."),
		registered:    d("registered_total", "Blocks stored into the offload pool."),
		revived:       d("revived_total", "Registrations of a block the offload pool already held (a copy skipped, the block used now)."),
		evictions:     d("evictions_total", "Blocks evicted from the offload pool."),
		publishErrors: d("publish_errors_total", "Event batches of the offload pool the sink refused."),
		damaged:       d("damaged_total", "Blocks of the offload pool whose bytes failed to read (dropped, with a REMOVE)."),
	}
}

func (m *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.capacity, m.bytes, m.used, m.pending, m.referenced, m.inactive,
		m.hits, m.misses, m.registered, m.revived, m.evictions, m.publishErrors, m.damaged} {
		ch <- d
	}
}

func (m *collector) Collect(ch chan<- prometheus.Metric) {
	s := m.c.stats()
	g := func(d *prometheus.Desc, v int) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v))
	}
	n := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	g(m.capacity, s.Capacity)
	g(m.bytes, s.BlockSize)
	g(m.used, s.Used)
	g(m.pending, s.Pending)
	g(m.referenced, s.Referenced)
	g(m.inactive, s.Inactive)
	n(m.hits, s.Hits)
	n(m.misses, s.Misses)
	n(m.registered, s.Registered)
	n(m.revived, s.Revived)
	n(m.evictions, s.Evictions)
	n(m.publishErrors, s.PublishErrors)
	n(m.damaged, s.Damaged)
}

// registerMetrics registers c's collector on reg (when set) and returns the
// function that unregisters it.
func registerMetrics(reg prometheus.Registerer, c *core) (func(), error) {
	if reg == nil {
		return func() {}, nil
	}
	m := newCollector(c)
	if err := reg.Register(m); err != nil {
		return nil, fmt.Errorf("register %s pool metrics of rank %s: %w", c.tier, c.cfg.Rank, err)
	}
	return func() { reg.Unregister(m) }, nil
}
