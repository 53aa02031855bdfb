package engineapi_test

import (
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
