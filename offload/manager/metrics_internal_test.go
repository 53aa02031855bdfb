package manager

import (
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvevent"
)

// TestMetricsReportEachStatUnderItsName gives every counter and gauge of a
// Manager's Stats a value of its own and reads the families: each series
// must carry its own stat under its own labels. Onboard blocks from host
// reported as from disk, dropped{reason="full"} reporting Exists, or
// kvagent_offload_bytes_total reporting blocks passed every other test.
func TestMetricsReportEachStatUnderItsName(t *testing.T) {
	f, err := NewSightings[promotion](FilterConfig{Threshold: 3, HalfLife: 1000})
	if err != nil {
		t.Fatal(err)
	}
	m := &Manager{cfg: Config{Rank: kvevent.Rank{Worker: 7, DP: 1}}, filter: f}
	m.lanes[D2H] = &lane{path: D2H, depth: 1, inflight: 2}
	m.lanes[H2D] = &lane{path: H2D, depth: 31, inflight: 32}
	m.stats = Stats{
		Invalid: 11, NoPriority: 12, Duplicates: 13, Cold: 14, NoDisk: 15,
		Onboard: OnboardStats{Calls: 16, FromHost: 17, FromDisk: 18, NotFound: 19, TimedOut: 20, Canceled: 21, Failed: 22, LateWrites: 23},
	}
	m.stats.Paths[D2H] = PathStats{Queued: 3, Shed: 4, Skipped: 5, Exists: 6, Full: 7, Failed: 8, Blocks: 9, Bytes: 10}
	m.stats.Paths[H2D] = PathStats{Queued: 33, Shed: 34, Skipped: 35, Exists: 36, Full: 37, Failed: 38, Blocks: 39, Bytes: 40}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newMetrics(m))

	want := map[string]float64{
		`kvagent_offload_requests_ignored_total{reason="invalid"}`:     11,
		`kvagent_offload_requests_ignored_total{reason="no_priority"}`: 12,
		`kvagent_offload_requests_ignored_total{reason="duplicate"}`:   13,
		`kvagent_offload_requests_ignored_total{reason="cold"}`:        14,
		`kvagent_offload_requests_ignored_total{reason="no_disk"}`:     15,
		`kvagent_offload_filter_hashes{}`:                              0,
		`kvagent_offload_onboard_calls_total{}`:                        16,
		`kvagent_onboard_blocks_total{from="host",to="device"}`:        17,
		`kvagent_onboard_blocks_total{from="disk",to="device"}`:        18,
		`kvagent_offload_onboard_failures_total{reason="not_found"}`:   19,
		`kvagent_offload_onboard_failures_total{reason="timeout"}`:     20,
		`kvagent_offload_onboard_failures_total{reason="canceled"}`:    21,
		`kvagent_offload_onboard_failures_total{reason="error"}`:       22,
		`kvagent_offload_onboard_late_writes_total{}`:                  23,
	}
	for _, p := range []struct {
		from, to string
		base     float64
	}{{"device", "host", 0}, {"host", "device", 30}} {
		path := `from="` + p.from + `",to="` + p.to + `"`
		for name, v := range map[string]float64{
			`kvagent_offload_queue_depth{` + path + `}`:                                               1,
			`kvagent_offload_inflight_blocks{` + path + `}`:                                           2,
			`kvagent_offload_queued_total{` + path + `}`:                                              3,
			`kvagent_offload_dropped_total{from="` + p.from + `",reason="shed",to="` + p.to + `"}`:    4,
			`kvagent_offload_dropped_total{from="` + p.from + `",reason="skipped",to="` + p.to + `"}`: 5,
			`kvagent_offload_dropped_total{from="` + p.from + `",reason="exists",to="` + p.to + `"}`:  6,
			`kvagent_offload_dropped_total{from="` + p.from + `",reason="full",to="` + p.to + `"}`:    7,
			`kvagent_offload_dropped_total{from="` + p.from + `",reason="error",to="` + p.to + `"}`:   8,
			`kvagent_offload_blocks_total{` + path + `}`:                                              9,
			`kvagent_offload_bytes_total{` + path + `}`:                                               10,
		} {
			want[name] = p.base + v
		}
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			if mt.GetCounter() == nil && mt.GetGauge() == nil {
				continue // the latency histograms
			}
			var ls []string // sorted by name, as Gather sorts them
			for _, l := range mt.GetLabel() {
				if l.GetName() == "worker" || l.GetName() == "dp_rank" {
					if v := map[string]string{"worker": "7", "dp_rank": "1"}[l.GetName()]; l.GetValue() != v {
						t.Errorf("%s has %s=%q, want %q", mf.GetName(), l.GetName(), l.GetValue(), v)
					}
					continue
				}
				ls = append(ls, l.GetName()+`="`+l.GetValue()+`"`)
			}
			got[mf.GetName()+"{"+strings.Join(ls, ",")+"}"] = mt.GetCounter().GetValue() + mt.GetGauge().GetValue()
		}
	}
	var names []string
	for name := range want {
		names = append(names, name)
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		w, wok := want[name]
		g, gok := got[name]
		if !gok || !wok || g != w {
			t.Errorf("%s = %v (reported %v), want %v (expected %v)", name, g, gok, w, wok)
		}
	}
}
