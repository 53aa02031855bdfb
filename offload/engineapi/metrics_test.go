package engineapi_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/offload/engineapi"
)

// TestRequestsAreCountedAndTimedByPathAndStatus reads
// kvagent_engineapi_requests_total{path,status} and
// kvagent_engineapi_request_duration_seconds{path} (docs/offload.md) after
// requests answered 200 and one refused: no test read either family, and a
// server that counted nothing, or counted a refusal as a 200, passed.
func TestRequestsAreCountedAndTimedByPathAndStatus(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8})
	r.register(0)
	r.offload(0, r.compute(0, 1, 1, 2))
	r.idle(0)
	_, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{DPRank: 9, Blocks: r.compute(0, 1, 3)})
	if err == nil {
		t.Fatal("an offload for rank 9, which the server does not serve, was answered")
	}

	counts := map[[2]string]float64{}
	timed := map[string]uint64{}
	mfs, err := r.reg.Gather()
	check(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			ls := map[string]string{}
			for _, l := range m.GetLabel() {
				ls[l.GetName()] = l.GetValue()
			}
			switch mf.GetName() {
			case "kvagent_engineapi_requests_total":
				counts[[2]string{ls["path"], ls["status"]}] = m.GetCounter().GetValue()
			case "kvagent_engineapi_request_duration_seconds":
				timed[ls["path"]] = m.GetHistogram().GetSampleCount()
			}
		}
	}
	for _, c := range []struct {
		path, status string
		want         float64
	}{
		{engineapi.PathRegion, "200", 1},
		{engineapi.PathOffload, "200", 1},
		{engineapi.PathOffload, "404", 1}, // a rank not served
	} {
		if got := counts[[2]string{c.path, c.status}]; got != c.want {
			t.Errorf("kvagent_engineapi_requests_total{path=%q,status=%q} = %v, want %v (all: %v)", c.path, c.status, got, c.want, counts)
		}
	}
	if timed[engineapi.PathRegion] != 1 || timed[engineapi.PathOffload] != 2 {
		t.Errorf("kvagent_engineapi_request_duration_seconds counts %v, want %s 1 and %s 2", timed, engineapi.PathRegion, engineapi.PathOffload)
	}
}

// TestARanksOffloadFamiliesHaveSeriesBeforeItsEngineRegisters: each
// rank's kvagent_offload_* families have their series, at zero, from the
// server's start, and the same series, one each, once its engine
// registered a region and its Manager counts. Before, a Manager
// registered them with its start: an agent whose engine had not
// registered showed none, and a dashboard panel or an alert over them
// read "no data", not 0.
func TestARanksOffloadFamiliesHaveSeriesBeforeItsEngineRegisters(t *testing.T) {
	r := newRig(t, rigConfig{ranks: 2, hostCap: 8})
	// series returns, by family, each series' labels and value, for the
	// families of the ranks' Managers.
	series := func() map[string]map[string]float64 {
		mfs, err := r.reg.Gather() // fails on a series exported twice
		check(t, err)
		out := map[string]map[string]float64{}
		for _, mf := range mfs {
			name := mf.GetName()
			if !strings.HasPrefix(name, "kvagent_offload_") && name != "kvagent_onboard_blocks_total" {
				continue
			}
			out[name] = map[string]float64{}
			for _, m := range mf.GetMetric() {
				var ls []string
				for _, l := range m.GetLabel() {
					ls = append(ls, l.GetName()+"="+l.GetValue())
				}
				out[name][strings.Join(ls, ",")] = m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			}
		}
		return out
	}
	const copied = "kvagent_offload_blocks_total"
	d2h := func(dp string) string {
		return "dp_rank=" + dp + ",from=device,to=host,worker=" + strconv.FormatUint(worker, 10)
	}
	fresh := series()
	for _, dp := range []string{"0", "1"} {
		if v, ok := fresh[copied][d2h(dp)]; !ok || v != 0 {
			t.Fatalf("%s{%s} before the engine registered: %v, present %v; want 0 (all: %v)", copied, d2h(dp), v, ok, fresh[copied])
		}
	}

	r.register(0)
	r.offload(0, r.compute(0, 1, 1, 2))
	r.idle(0)
	after := series()
	if v := after[copied][d2h("0")]; v != 2 {
		t.Errorf("%s{%s} after 2 blocks offloaded: %v, want 2", copied, d2h("0"), v)
	}
	if v, ok := after[copied][d2h("1")]; !ok || v != 0 {
		t.Errorf("%s{%s}, of a rank whose engine did not register: %v, present %v; want 0", copied, d2h("1"), v, ok)
	}
	for name, ss := range fresh {
		for s := range ss {
			if _, ok := after[name][s]; !ok {
				t.Errorf("%s{%s}, exported before the registration, is gone after it", name, s)
			}
		}
	}
	for name, ss := range after {
		for s := range ss {
			if _, ok := fresh[name][s]; !ok {
				t.Errorf("%s{%s}, exported after the registration, was missing before it", name, s)
			}
		}
	}
}
