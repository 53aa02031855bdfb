package engineapi_test

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/pool"
	"github.com/kvrouter/kvrouter/offload/pool/pooltest"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
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

// TestDiskDownHoldsWhileNoManagerRuns: kvagent_offload_disk_down says 1
// once the rank's G3 pool has shut itself down (docs/offload.md), whether
// or not its engine has a region registered: the pool is the server's,
// not the Manager's. With no Manager, rankMetrics exports
// manager.IdleMetrics, whose disk_down was 0 whatever the pool's state: a
// dead disk tier read healthy before the engine registered and again
// after it unregistered (an engine restart).
func TestDiskDownHoldsWhileNoManagerRuns(t *testing.T) {
	r := newRig(t, rigConfig{ranks: 1, hostCap: 8, diskCap: 256})
	diskDown := func(when string) float64 {
		t.Helper()
		mfs, err := r.reg.Gather()
		check(t, err)
		for _, mf := range mfs {
			if mf.GetName() == "kvagent_offload_disk_down" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatalf("%s: no kvagent_offload_disk_down series", when)
		return -1
	}
	if v := diskDown("fresh"); v != 0 {
		t.Fatalf("kvagent_offload_disk_down on a fresh server: %v, want 0", v)
	}
	// Bit rot under the open pool until a compaction meets it and the
	// pool shuts itself down (as offload/manager's shutDisk).
	d := r.disk[0]
	rotten := map[string]bool{}
	shut := false
	for h := uint64(1 << 40); h < 1<<40+300 && !shut; h++ {
		pooltest.Rot(t, d.Dir(), rotten)
		shut = errors.Is(d.Register(pool.Block{Hash: h, Local: h}, make([]byte, bs)), pool.ErrCorrupt)
	}
	if !shut || d.Err() == nil {
		t.Fatal("the disk pool did not shut down")
	}
	before := diskDown("the pool shut down, no engine registered")
	r.register(0)
	registered := diskDown("the pool shut down, the engine registered")
	_, err := r.c.Unregister(r.ctx(), 0)
	check(t, err)
	after := diskDown("the pool shut down, the engine unregistered")
	if before != 1 || registered != 1 || after != 1 {
		t.Fatalf("kvagent_offload_disk_down with the rank's disk pool shut down (Err: %v): %v before the engine registered, %v while registered, %v after it unregistered; want 1 throughout",
			d.Err(), before, registered, after)
	}
}

// seriesOf lists the offload families' series (name{labels}) of a gather.
func seriesOf(mfs []*dto.MetricFamily) []string {
	var out []string
	for _, mf := range mfs {
		name := mf.GetName()
		if !strings.HasPrefix(name, "kvagent_offload_") && name != "kvagent_onboard_blocks_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			out = append(out, name+"{"+strings.Join(ls, ",")+"}")
		}
	}
	sort.Strings(out)
	return out
}

// TestRankMetricsAreTheSameOnAPedanticRegistry: on a pedantic registry,
// each pool layout gathers without error before a registration, after one, during
// re-registrations raced by scrapes, and after the engine unregistered;
// the series are the same throughout, and lint finds nothing.
func TestRankMetricsAreTheSameOnAPedanticRegistry(t *testing.T) {
	for _, tc := range []struct {
		name          string
		host, diskCap int
	}{{"host", 8, 0}, {"host+disk", 8, 8}, {"disk", 0, 8}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, rigConfig{ranks: 2, hostCap: tc.host, diskCap: tc.diskCap, pedantic: true})
			gather := func(when string) []string {
				mfs, err := r.reg.Gather()
				if err != nil {
					t.Fatalf("%s: pedantic gather: %v", when, err)
				}
				return seriesOf(mfs)
			}
			fresh := gather("fresh")
			if len(fresh) == 0 {
				t.Fatal("no offload series on a fresh server")
			}
			mfs, err := r.reg.Gather()
			check(t, err)
			probs, err := promlint.NewWithMetricFamilies(mfs).Lint()
			check(t, err)
			for _, p := range probs {
				if strings.HasPrefix(p.Metric, "kvagent_offload_") || p.Metric == "kvagent_onboard_blocks_total" {
					t.Errorf("lint: %s: %s", p.Metric, p.Text)
				}
			}
			r.register(0)
			if got := gather("registered"); fmt.Sprint(got) != fmt.Sprint(fresh) {
				t.Errorf("series after a registration differ:\n got %v\nwant %v", got, fresh)
			}
			var wg sync.WaitGroup
			stop := make(chan struct{})
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					if _, err := r.reg.Gather(); err != nil {
						t.Errorf("gather racing a re-registration: %v", err)
						return
					}
				}
			}()
			for range 20 {
				r.register(0)
				r.register(1)
			}
			_, err = r.c.Unregister(r.ctx(), 0)
			check(t, err)
			close(stop)
			wg.Wait()
			if got := gather("unregistered"); fmt.Sprint(got) != fmt.Sprint(fresh) {
				t.Errorf("series after unregistration differ:\n got %v\nwant %v", got, fresh)
			}
		})
	}
}

// TestRankMetricsGoWithTheServer: a closed server's rank families
// are gone from its registry.
func TestRankMetricsGoWithTheServer(t *testing.T) {
	r := newRig(t, rigConfig{ranks: 1, hostCap: 8, pedantic: true})
	r.register(0)
	check(t, r.srv.Close())
	mfs, err := r.reg.Gather()
	check(t, err)
	if s := seriesOf(mfs); len(s) != 0 {
		t.Errorf("after Close: %v", s)
	}
}
