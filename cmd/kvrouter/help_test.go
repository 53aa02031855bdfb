package main

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
)

// TestNoFlagShowsTwoDefaults: a flag whose usage says its default in
// words shows that default alone in --help. From a review: such flags
// also showed cli's zero value, "(default: timed 64, ...) (default: 0)".
func TestNoFlagShowsTwoDefaults(t *testing.T) {
	for _, line := range clihelp.DoubleDefaults(newApp()) {
		t.Errorf("two defaults: %s", line)
	}
}
