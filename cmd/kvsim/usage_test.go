package main

import (
	"errors"
	"testing"

	"github.com/urfave/cli/v2"
)

// TestAUsageErrorNamesTheFlagAsTyped: a flag that does not parse, or one
// kvsim does not define, is named as the operator types it (--flag), with
// what it takes, as kvrouter's, kvagent's and kvctl's usage errors do,
// instead of the flag package's "invalid value "x" for flag -workers:
// parse error" and "flag provided but not defined: -bogus"; the line
// still ends "; see kvsim replay --help" (or kvsim's), exit 2.
func TestAUsageErrorNamesTheFlagAsTyped(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"replay", "--workers", "x"}, `--workers "x": want a whole number; see kvsim replay --help`},
		{[]string{"replay", "--agent-wait", "5"}, `--agent-wait "5": want a duration with its unit, such as 200ms or 2m; see kvsim replay --help`},
		{[]string{"replay", "--bogus"}, `--bogus is not a flag of kvsim replay; see kvsim replay --help`},
		{[]string{"--bogus", "replay"}, `--bogus is not a flag of kvsim; see kvsim --help`},
	} {
		_, err := kvsim(t, c.args...)
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != exitUsage || err.Error() != c.want {
			t.Errorf("kvsim %q: %v, want exit 2: %s", c.args, err, c.want)
		}
	}
}
