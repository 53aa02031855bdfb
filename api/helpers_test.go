package api_test

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m))
}

var _ api.Backend = (*apitest.Fake)(nil)

// node is one API server over a fake backend, on a real listener.
type node struct {
	fake *apitest.Fake
	api  *api.Server
	http *httptest.Server
	reg  *prometheus.Registry
}

// addr is the node's host:port.
func (n *node) addr() string { return strings.TrimPrefix(n.http.URL, "http://") }

func newNode(t *testing.T, id string, opts api.Options) *node {
	t.Helper()
	n := &node{reg: prometheus.NewRegistry()}
	n.fake = apitest.New(id, "")
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	opts.Registerer, opts.Gatherer = n.reg, n.reg
	n.api = api.NewServer(n.fake, opts)
	n.http = httptest.NewServer(n.api)
	st := n.fake.Status()
	st.HTTPAddr, st.LeaderHTTP = n.addr(), n.addr()
	n.fake.SetStatus(st)
	n.fake.SetMembers([]raftfsm.Member{{ID: id, RaftAddr: id + ":7946", HTTPAddr: n.addr(), Voter: true, Leader: true}})
	t.Cleanup(func() {
		n.http.Close()
		n.api.Close()
	})
	return n
}

// withWorkers registers two workers of two ranks each on n's backend.
func withWorkers(t *testing.T, n *node) {
	t.Helper()
	for _, id := range []uint64{1, 2} {
		err := n.fake.RegisterWorker(context.Background(), raftfsm.WorkerInfo{
			ID: id, DPRanks: []uint32{0, 1}, BlockSize: 4, Capacity: [4]int64{1000, 2000, 0, 0}, Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
	}
}

type answer struct {
	code   int
	header http.Header
	body   []byte
}

func (a answer) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(a.body, &m); err != nil {
		t.Fatalf("body %q is not a JSON object: %v", a.body, err)
	}
	return m
}

func (a answer) reason(t *testing.T) string {
	t.Helper()
	r, _ := a.json(t)["reason"].(string)
	return r
}

func send(t *testing.T, base, method, path, body string, hdr ...string) answer {
	t.Helper()
	return sendWithin(t, 10*time.Second, base, method, path, body, hdr...)
}

// sendWithin is send with a timeout of its own, for a request whose
// answer may take long on a loaded machine under -race.
func sendWithin(t *testing.T, timeout time.Duration, base, method, path, body string, hdr ...string) answer {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, base+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{code: resp.StatusCode, header: resp.Header, body: b}
}

// keysOf returns the sorted keys of a JSON object.
func keysOf(v any) []string {
	m, _ := v.(map[string]any)
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

func sorted(ks ...string) []string {
	slices.Sort(ks)
	return ks
}

// counterValue returns the sum of the counters of family name whose labels
// include labels.
func counterValue(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	return sumOf(t, g, name, labels, func(m *dto.Metric) float64 { return m.GetCounter().GetValue() })
}

// histogramCount returns the sample count of the histograms of family name
// whose labels include labels.
func histogramCount(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) uint64 {
	t.Helper()
	return uint64(sumOf(t, g, name, labels, func(m *dto.Metric) float64 { return float64(m.GetHistogram().GetSampleCount()) }))
}

// sumOf sums value over the series of family name whose labels include
// labels.
func sumOf(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string, value func(*dto.Metric) float64) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metrics
				}
			}
			sum += value(m)
		}
	}
	return sum
}
