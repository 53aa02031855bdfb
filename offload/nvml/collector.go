package nvml

import (
	"errors"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports a Monitor's inventory on every scrape:
//
//	kvagent_gpu_nvml_up                         1 when NVML answered, else 0
//	kvagent_gpu_count                           GPUs NVML reports, lost ones too
//	kvagent_gpu_info{gpu,name,uuid}             1 per GPU
//	kvagent_gpu_memory_total_bytes{gpu}
//	kvagent_gpu_memory_used_bytes{gpu}
//	kvagent_gpu_pcie_link_generation{gpu}       current (drops when idle)
//	kvagent_gpu_pcie_link_width{gpu}            current lanes
//	kvagent_gpu_pcie_link_max_generation{gpu}
//	kvagent_gpu_pcie_link_max_width{gpu}
//
// gpu is the NVML index; values NVML cannot read are left out, and so is
// every per-GPU series of a GPU whose handle cannot be opened (a lost GPU),
// which kvagent_gpu_count still counts.
type Collector struct {
	m *Monitor

	up, count, info, memTotal, memUsed, gen, width, genMax, widthMax *prometheus.Desc
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a Collector for m.
func NewCollector(m *Monitor) *Collector {
	gpu := []string{"gpu"}
	d := func(name, help string, labels []string) *prometheus.Desc {
		return prometheus.NewDesc("kvagent_gpu_"+name, help, labels, nil)
	}
	return &Collector{
		m:        m,
		up:       d("nvml_up", "1 when NVML initialised and answered the last scrape, else 0.", nil),
		count:    d("count", "Number of GPUs NVML reports on this node, those it cannot open (lost) included.", nil),
		info:     d("info", "GPU identity; value 1.", []string{"gpu", "name", "uuid"}),
		memTotal: d("memory_total_bytes", "GPU memory, total.", gpu),
		memUsed:  d("memory_used_bytes", "GPU memory in use, by every process.", gpu),
		gen:      d("pcie_link_generation", "Current PCIe link generation (lower while the GPU idles).", gpu),
		width:    d("pcie_link_width", "Current PCIe link width in lanes.", gpu),
		genMax:   d("pcie_link_max_generation", "Maximum PCIe link generation of the GPU and slot.", gpu),
		widthMax: d("pcie_link_max_width", "Maximum PCIe link width in lanes.", gpu),
	}
}

// Describe sends every descriptor.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.count, c.info, c.memTotal, c.memUsed, c.gen, c.width, c.genMax, c.widthMax} {
		ch <- d
	}
}

// Collect reads the inventory and sends its metrics.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	inv, err := c.m.Inventory()
	up := 1.0
	if err != nil {
		up = 0
		// Not an invalid metric: that would fail the agent's whole scrape.
		if !errors.Is(err, ErrNoNVML) && !errors.Is(err, ErrClosed) {
			c.m.logger().Warn("nvml: scrape failed", "err", err)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, up)
	ch <- prometheus.MustNewConstMetric(c.count, prometheus.GaugeValue, float64(inv.Count))
	gauge := func(d *prometheus.Desc, v float64, gpu string) {
		if v > 0 {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, gpu)
		}
	}
	for _, g := range inv.GPUs {
		gpu := strconv.Itoa(g.Index)
		ch <- prometheus.MustNewConstMetric(c.info, prometheus.GaugeValue, 1, gpu, g.Name, g.UUID)
		gauge(c.memTotal, float64(g.MemoryTotalBytes), gpu)
		if g.MemoryTotalBytes > 0 { // used may be 0 on an idle GPU, but only if total is known
			ch <- prometheus.MustNewConstMetric(c.memUsed, prometheus.GaugeValue, float64(g.MemoryUsedBytes), gpu)
		}
		gauge(c.gen, float64(g.PCIeLinkGen), gpu)
		gauge(c.width, float64(g.PCIeLinkWidth), gpu)
		gauge(c.genMax, float64(g.PCIeLinkGenMax), gpu)
		gauge(c.widthMax, float64(g.PCIeLinkWidthMax), gpu)
	}
}
