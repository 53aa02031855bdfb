package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestRegisterReusesTheFamilyRegisteredFirst: a second collector of the
// same family gets the first one back, and both callers count on one
// series; a family of the same name and another shape is an error.
func TestRegisterReusesTheFamilyRegisteredFirst(t *testing.T) {
	reg := prometheus.NewRegistry()
	opts := prometheus.CounterOpts{Name: "x_total", Help: "x"}
	a, err := Register(reg, prometheus.NewCounterVec(opts, []string{"k"}))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Register(reg, prometheus.NewCounterVec(opts, []string{"k"}))
	if err != nil || b != a {
		t.Fatalf("second registration: %p, %v; want the first collector %p", b, err, a)
	}
	a.WithLabelValues("1").Inc()
	b.WithLabelValues("1").Inc()
	fams, err := reg.Gather()
	if err != nil || len(fams) != 1 || len(fams[0].GetMetric()) != 1 || fams[0].GetMetric()[0].GetCounter().GetValue() != 2 {
		t.Fatalf("gathered %v (%v), want one family with one series at 2", fams, err)
	}
	if _, err := Register(reg, prometheus.NewCounterVec(opts, []string{"other"})); err == nil {
		t.Fatal("a family of the same name with other labels was taken")
	}
	if _, err := Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{Name: "x_total", Help: "x"})); err == nil {
		t.Fatal("a gauge under a counter vec's name was taken")
	}
}
