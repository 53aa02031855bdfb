package main

import (
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/kvrouter/kvrouter/sim"
	"github.com/urfave/cli/v2"
)

// TestNoFlagShowsTwoDefaults: a flag whose usage says its default in
// words shows that default alone in --help. From a review: such flags
// also showed cli's zero value, "(default: timed 64, ...) (default: 0)".
func TestNoFlagShowsTwoDefaults(t *testing.T) {
	for _, line := range clihelp.DoubleDefaults(newApp()) {
		t.Errorf("two defaults: %s", line)
	}
}

// TestPoliciesHelpNamesWhatTheDefaultsLeaveOut: --policies' help said
// "default: every policy of the mode", but the timed default leaves out
// greedy_balanced. Every policy a timed or cache-only default leaves out
// is named in the help.
func TestPoliciesHelpNamesWhatTheDefaultsLeaveOut(t *testing.T) {
	var usage string
	for _, f := range replayCommand().Flags {
		if sf, ok := f.(clihelp.EnvFlag).Unwrap().(*cli.StringFlag); ok && sf.Name == "policies" {
			usage = sf.Usage
		}
	}
	_, after, _ := strings.Cut(usage, "(default:")
	for _, mode := range []string{"timed", "cache"} {
		def := strings.Split(modeDefaults[mode].policies, ",")
		for _, name := range append(slices.Clone(sim.PolicyNames), "ceiling") {
			if !slices.Contains(def, name) && !strings.Contains(after, mode+" without "+name) {
				t.Errorf("--mode %s's default leaves out %s, and the help does not say so: %q", mode, name, usage)
			}
		}
	}
}
