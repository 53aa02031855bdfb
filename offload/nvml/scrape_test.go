package nvml_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// scrape registers c in a fresh registry, gathers it, and returns each
// sample as `name{label="value",...} value`, sorted, keeping only the
// families named (all when none are).
func scrape(t *testing.T, c prometheus.Collector, names ...string) []string {
	t.Helper()
	r := prometheus.NewPedanticRegistry()
	if err := r.Register(c); err != nil {
		t.Fatal(err)
	}
	mfs, err := r.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var out []string
	for _, mf := range mfs {
		if len(names) > 0 && !slices.Contains(names, mf.GetName()) {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			s := mf.GetName()
			if len(ls) > 0 {
				s += "{" + strings.Join(ls, ",") + "}"
			}
			out = append(out, fmt.Sprintf("%s %g", s, m.GetGauge().GetValue()))
		}
	}
	slices.Sort(out)
	return out
}

func expectSamples(t *testing.T, got []string, want ...string) {
	t.Helper()
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("samples:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}
