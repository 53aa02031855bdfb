package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/pypub"
)

// dashboardNames returns the metric families docs/grafana/kvrouter.json
// queries with the given prefix (a histogram's _bucket series name its
// family).
func dashboardNames(t *testing.T, prefix string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", "grafana", "kvrouter.json"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range regexp.MustCompile(prefix+`[a-z0-9_]+`).FindAllString(string(b), -1) {
		name := strings.TrimSuffix(m, "_bucket")
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	if len(names) == 0 {
		t.Fatalf("the dashboard queries no %s family", prefix)
	}
	return names
}

// checkDashboardRouterNames: every kvrouter_ family the dashboard queries
// is exported by one of the running nodes (which have seen a worker,
// events, routes and snapshots, so that labelled families have series;
// some, like the ingester's, only the leader has).
func checkDashboardRouterNames(t *testing.T, httpAddrs []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var all strings.Builder
	for _, addr := range httpAddrs {
		req, err := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/metrics", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		all.Write(body)
	}
	for _, name := range dashboardNames(t, "kvrouter_") {
		if !strings.Contains(all.String(), "# TYPE "+name+" ") {
			t.Errorf("the dashboard queries %s, which no node exports", name)
		}
	}
	// And only labels its series have: a label misspelt in a by (...)
	// makes one series of the lot, and in a matcher none.
	labels := map[string]map[string]bool{} // a series name → its labels
	for _, addr := range httpAddrs {
		for _, s := range scrape(t, "http://"+addr+"/metrics") {
			if labels[s.name] == nil {
				labels[s.name] = map[string]bool{}
			}
			for l := range s.labels {
				labels[s.name][l] = true
			}
		}
	}
	for _, msg := range dashboardLabelErrors(dashboardTargets(t), "kvrouter_", labels) {
		t.Error(msg)
	}
}

// TestDashboardAgentPanelsUseTheAgentsLabels: every kvagent_ family the
// dashboard queries has series on a fresh agent's /metrics (a running
// kvagent with its offload side, host copies and a G2 pool, that has seen
// no engine: nothing resynced, cleared or copied), and the labels its
// panels group by and match on are those series'. A family without series
// there reads "no data" in its panel and in an alert, not 0: the counters
// by reason (kvagent_events_resyncs_total, kvagent_rank_clears_total) had
// none before their first count, and a rank's kvagent_offload_* none
// before its engine registered a region; their labels went unchecked. No
// test read the labels before either: a panel's "sum by (tiers)
// (kvagent_pool_blocks)" passed every test.
func TestDashboardAgentPanelsUseTheAgentsLabels(t *testing.T) {
	pypub.Require(t)
	c := startClusterNATS(t, 1)
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*"})
	sockDir, err := os.MkdirTemp("", "kva") // a Unix socket's path is short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	_, url := startAgentMetrics(t, c, pub, "--offload-socket", filepath.Join(sockDir, "s"), "--backend", "host",
		"--block-bytes", "64", "--host-blocks", "4")
	pub.WaitSub()
	c.waitFor(readyTimeout, "the agent's offload pool to show on /metrics", func() (bool, string) {
		ss, err := scrapeOnce(t, url)
		if err != nil {
			return false, err.Error() // the agent slow to answer: tried again
		}
		for _, s := range ss {
			if s.name == "kvagent_pool_blocks" {
				return true, ""
			}
		}
		return false, "no kvagent_pool_blocks"
	})
	checkDashboardAgentLabels(t, url)
}

// checkDashboardAgentLabels: every kvagent_ family the dashboard queries
// has series on the agent's /metrics (url), and the labels its panels
// group by and match on are theirs (dashboardLabelErrors); a query over a
// family without series is left out of the labels' check.
func checkDashboardAgentLabels(t *testing.T, url string) {
	t.Helper()
	labels := map[string]map[string]bool{} // a series name → its labels
	for _, s := range scrape(t, url) {
		if labels[s.name] == nil {
			labels[s.name] = map[string]bool{}
		}
		for l := range s.labels {
			labels[s.name][l] = true
		}
	}
	for _, name := range dashboardNames(t, "kvagent_") {
		if labels[name] == nil && labels[name+"_bucket"] == nil {
			t.Errorf("the dashboard queries %s, of which a fresh agent shows no series: its panel reads no data, not 0", name)
		}
	}
	var targets []dashboardTarget
	for _, tg := range dashboardTargets(t) {
		// A query is checked if each of its kvagent_ series has series.
		if !slices.ContainsFunc(seriesName.FindAllStringSubmatch(tg.expr, -1), func(m []string) bool {
			return strings.HasPrefix(m[1], "kvagent_") && labels[m[1]] == nil
		}) {
			targets = append(targets, tg)
		}
	}
	for _, msg := range dashboardLabelErrors(targets, "kvagent_", labels) {
		t.Error(msg)
	}
}

var (
	// seriesName is a family's series named in a query, and its matchers.
	seriesName = regexp.MustCompile(`\b([a-z][a-z0-9_]*)(\{[^}]*\})?`)
	// matcherLabel is a label a matcher names.
	matcherLabel = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)`)
	// groupingLabels are the labels of an aggregation's by (...) or
	// without (...).
	groupingLabels = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
)

// dashboardLabelErrors checks the labels each query of the dashboard
// names, of its series with the given prefix, against the labels the
// series have (labels: a series name → its label names): a matcher's
// label must be its series', a by (...) or without (...) label one of the
// query's series', or instance or job, the target labels Prometheus adds.
func dashboardLabelErrors(targets []dashboardTarget, prefix string, labels map[string]map[string]bool) []string {
	var errs []string
	for _, tg := range targets {
		var names []string
		for _, m := range seriesName.FindAllStringSubmatch(tg.expr, -1) {
			if !strings.HasPrefix(m[1], prefix) {
				continue
			}
			names = append(names, m[1])
			for _, l := range matcherLabel.FindAllStringSubmatch(m[2], -1) {
				if !labels[m[1]][l[1]] {
					errs = append(errs, fmt.Sprintf("the panel %q (%s) matches on %s's label %s, which it does not have", tg.panel, tg.expr, m[1], l[1]))
				}
			}
		}
		if len(names) == 0 {
			continue
		}
		for _, g := range groupingLabels.FindAllStringSubmatch(tg.expr, -1) {
			for _, l := range strings.Split(g[1], ",") {
				l = strings.TrimSpace(l)
				if l == "" || l == "instance" || l == "job" {
					continue
				}
				if !slices.ContainsFunc(names, func(n string) bool { return labels[n][l] }) {
					errs = append(errs, fmt.Sprintf("the panel %q (%s) groups by %s, a label none of %s has", tg.panel, tg.expr, l, strings.Join(names, ", ")))
				}
			}
		}
	}
	return errs
}

// TestDashboardLabelErrorsFindsAMisspeltLabel: the labels' check finds a
// by (...) label and a matcher's label the series do not have.
func TestDashboardLabelErrorsFindsAMisspeltLabel(t *testing.T) {
	labels := map[string]map[string]bool{
		"kvrouter_events_received_total":         {"worker": true, "op": true, "tier": true},
		"kvrouter_route_duration_seconds_bucket": {"stage": true, "le": true},
	}
	good := []dashboardTarget{
		{"received", "sum by (op, tier) (rate(kvrouter_events_received_total[1m]))"},
		{"route", `histogram_quantile(0.99, sum by (le, instance) (rate(kvrouter_route_duration_seconds_bucket{stage="backend"}[5m])))`},
	}
	if errs := dashboardLabelErrors(good, "kvrouter_", labels); len(errs) != 0 {
		t.Fatalf("the series' own labels refused: %v", errs)
	}
	bad := []dashboardTarget{
		{"received", "sum by (op, tiers) (rate(kvrouter_events_received_total[1m]))"},
		{"route", `histogram_quantile(0.99, sum by (le) (rate(kvrouter_route_duration_seconds_bucket{stages="backend"}[5m])))`},
	}
	if errs := dashboardLabelErrors(bad, "kvrouter_", labels); len(errs) != 2 {
		t.Fatalf("errors %v, want one for tiers and one for stages", errs)
	}
}

// TestDashboardAgentNamesExist: every kvagent_ family the dashboard
// queries is registered by the agent's code: named whole in a string, or
// composed from the offload manager's and the pools' prefixes.
func TestDashboardAgentNamesExist(t *testing.T) {
	var src strings.Builder
	composed := map[string]string{ // file → the prefix its d("...") names take
		filepath.Join("..", "offload", "manager", "metrics.go"): "kvagent_offload_",
		filepath.Join("..", "offload", "pool", "metrics.go"):    "kvagent_pool_",
	}
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		src.Write(b)
		if prefix, ok := composed[path]; ok {
			for _, m := range regexp.MustCompile(`d\("([a-z0-9_]+)"`).FindAllStringSubmatch(string(b), -1) {
				src.WriteString(`"` + prefix + m[1] + `"`)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range dashboardNames(t, "kvagent_") {
		if !strings.Contains(src.String(), `"`+name+`"`) {
			t.Errorf("the dashboard queries %s, which no agent code registers", name)
		}
	}
}

// dashboardTarget is one query of a panel of docs/grafana/kvrouter.json.
type dashboardTarget struct {
	panel, expr string
}

// dashboardTargets returns every query of docs/grafana/kvrouter.json.
func dashboardTargets(t *testing.T) []dashboardTarget {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", "grafana", "kvrouter.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("docs/grafana/kvrouter.json: %v", err)
	}
	var out []dashboardTarget
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			out = append(out, dashboardTarget{p.Title, tg.Expr})
		}
	}
	if len(out) == 0 {
		t.Fatal("the dashboard has no query")
	}
	return out
}

// replicaCounters are the counters every replica's state machine keeps,
// each committed event counted once per node (docs/operations.md, What to
// watch).
var replicaCounters = []string{
	"kvrouter_events_applied_total",
	"kvrouter_events_rejected_total",
	"kvrouter_events_unknown_removes_total",
	"kvrouter_bookings_expired_total",
}

// acrossInstances matches an aggregation over a family's rate or
// increase: the operator, and its by (...) labels.
var acrossInstances = regexp.MustCompile(`(sum|max|min|avg)\s*(?:by\s*\(([^)]*)\))?\s*\(\s*(?:rate|increase)\(\s*([a-z0-9_]+)`)

// TestDashboardDoesNotSumReplicaCounters: a panel over a counter every
// replica keeps takes the max across instances, or shows each instance;
// a sum reads the cluster's size times the events.
func TestDashboardDoesNotSumReplicaCounters(t *testing.T) {
	checked := 0
	for _, tg := range dashboardTargets(t) {
		for _, m := range acrossInstances.FindAllStringSubmatch(tg.expr, -1) {
			if !slices.Contains(replicaCounters, m[3]) {
				continue
			}
			checked++
			perInstance := slices.Contains(strings.Split(strings.ReplaceAll(m[2], " ", ""), ","), "instance")
			if m[1] == "sum" && !perInstance {
				t.Errorf("the panel %q (%s) sums %s across instances: every replica counts each event", tg.panel, tg.expr, m[3])
			}
		}
	}
	if checked == 0 {
		t.Fatal("no panel aggregates a replica's counter: the pattern no longer matches the dashboard")
	}
}

// TestDashboardEventsAppliedCountsEachEventOnce: the dashboard's "Events
// applied /s by outcome" panel, evaluated on a 3-node cluster's counters
// after N events (its aggregation across the nodes), gives N. Every
// replica's state machine counts each event: summed, the panel read three
// times the events the cluster applied (and three times "Events received
// /s", which only the leader counts).
func TestDashboardEventsAppliedCountsEachEventOnce(t *testing.T) {
	const title = "Events applied /s by outcome"
	var expr string
	for _, tg := range dashboardTargets(t) {
		if tg.panel == title {
			expr = tg.expr
		}
	}
	m := acrossInstances.FindStringSubmatch(expr)
	if m == nil || m[3] != "kvrouter_events_applied_total" {
		t.Fatalf("the panel %q queries %q: want an aggregation of kvrouter_events_applied_total", title, expr)
	}

	c := startCluster(t, 3)
	const events = 4
	body := `{"batches": [{"worker_id": 1, "dp_rank": 0, "events": [
	 {"event_id": 1, "type": "stored", "tier": "device", "blocks": [{"hash": 11, "local_hash": 101}, {"hash": 12, "local_hash": 102}]},
	 {"event_id": 2, "type": "stored", "tier": "host", "parent_hash": 12, "blocks": [{"hash": 13, "local_hash": 103}]},
	 {"event_id": 3, "type": "removed", "tier": "device", "hashes": [12]},
	 {"event_id": 4, "type": "cleared"}]}]}`
	// A write waits on a leader and its commit: an election (a loaded
	// machine misses heartbeats) answers 503, and a stalled leader nothing
	// within a call's time. The batch is sent again then, to the node that
	// leads at that try, as a client does; one that applied already counts
	// its events as duplicates, not applied, and leaves what this test
	// checks as it was. Any other answer fails.
	c.waitFor(leaderTimeout, "POST /v1/events answered by a leader", func() (bool, string) {
		code, out := postJSONWithin(t, c.nodes[c.leader()], "/v1/events", body, callTimeout)
		if code != http.StatusOK && code != http.StatusServiceUnavailable && code != 0 {
			t.Fatalf("POST /v1/events: %d %s", code, out)
		}
		return code == http.StatusOK, fmt.Sprintf("%d %s", code, out)
	})
	var got []float64
	for _, n := range c.nodes {
		ss := waitMetrics(c, "http://"+n.httpAddr+"/metrics", n.id+" to apply the events", func(ss samples) (bool, string) {
			got := ss.sum("kvrouter_events_applied_total", "outcome", "applied")
			return got == events, fmt.Sprint(got)
		})
		got = append(got, ss.sum("kvrouter_events_applied_total", "outcome", "applied"))
	}
	var panel float64
	switch m[1] {
	case "sum":
		for _, v := range got {
			panel += v
		}
	case "max":
		panel = slices.Max(got)
	default:
		t.Fatalf("the panel %q aggregates with %s, which this test does not evaluate", title, m[1])
	}
	if panel != events {
		t.Errorf("the panel %q (%s) reads %v events applied for the %d events the cluster applied (each node's: %v)", title, expr, panel, events, got)
	}
}
