package e2e

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
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
