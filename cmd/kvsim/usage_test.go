package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/clihelp"
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

// TestALiveFlagGivenWithoutLiveIsRefusedWhateverItsVariable: --token,
// --token-file and --tls-ca given on the command line without --live are
// usage errors (docs/sim.md), also when the value given equals the
// flag's KVCTL_* variable: kvsim tells a flag from its variable by where
// it was read (clihelp.ApplyEnv), instead of by comparing the values,
// which took such a flag for the variable and ignored it. The variable
// alone is still ignored without --live.
func TestALiveFlagGivenWithoutLiveIsRefusedWhateverItsVariable(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing.jsonl")
	t.Setenv("KVCTL_TOKEN", "s3cret")
	_, err := kvsim(t, "replay", "--trace", missing, "--token", "s3cret")
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != exitUsage || !strings.Contains(err.Error(), "--token needs --live") {
		t.Errorf("KVCTL_TOKEN=s3cret kvsim replay --token s3cret: %v, want exit 2: --token needs --live", err)
	}
	_, err = kvsim(t, "replay", "--trace", missing)
	if err == nil || strings.Contains(err.Error(), "--token") {
		t.Errorf("KVCTL_TOKEN=s3cret kvsim replay: %v, want the missing trace refused, the variable ignored", err)
	}
}

// TestALiveValueOfAVariableNamesTheVariable: a --live replay's value
// kvsim refuses (exit 2) that came from kvctl's KVCTL_* variable, the
// flag not given, is named as the variable ("(--tls-ca from
// KVCTL_TLS_CA)"), as kvctl's, kvrouter's and kvagent's refusals are:
// the operator gave no such flag, and would look for it on the command
// line.
func TestALiveValueOfAVariableNamesTheVariable(t *testing.T) {
	clihelp.UnsetEnv(t, replayCommand().Flags)
	missing := filepath.Join(t.TempDir(), "missing")
	clihelp.WantVariableNamed(t, newApp, []string{"kvsim", "replay", "--live", "--trace", genTrace(t), "--workers", "2", "--policies", "round_robin"}, [][2]string{
		{"KVCTL_TLS_CA", missing},
		{"KVCTL_ENDPOINTS", "127.0.0.1"},
	})
}

// TestATraceThatCannotBeReadSaysWhereItsPathCameFrom: a trace that is
// missing or malformed is an error (exit 1), naming --trace, and, when
// KVSIM_TRACE gave its path, the variable, instead of "open trace: ..."
// alone, which sent the operator who had a KVSIM_TRACE left set in the
// environment looking at a command line that held no trace.
func TestATraceThatCannotBeReadSaysWhereItsPathCameFrom(t *testing.T) {
	clihelp.UnsetEnv(t, replayCommand().Flags)
	missing := filepath.Join(t.TempDir(), "missing.jsonl")
	bad := filepath.Join(t.TempDir(), "bad.jsonl")
	if err := os.WriteFile(bad, []byte("garbage\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		env  string
		args []string
		want string
	}{
		{"", []string{"--trace", missing}, "--trace: open trace: open " + missing},
		{missing, nil, "(--trace from KVSIM_TRACE)"},
		{bad, nil, "--trace: " + bad + ": bad trace: line 1"},
	} {
		t.Setenv("KVSIM_TRACE", tc.env)
		var out, errb bytes.Buffer
		code := run(append([]string{"kvsim", "replay"}, tc.args...), &out, &errb)
		if code != 1 || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("KVSIM_TRACE=%q %v: exit %d, %q; want exit 1 saying %q", tc.env, tc.args, code, errb.String(), tc.want)
		}
	}
}

// TestABadScoringFlagNamesTheFlag: a scoring flag out of the router's
// bounds is refused (exit 2) naming the flag, as typed, not the scoring
// parameter it sets: "--overlap-credit -1" answered "invalid scoring
// parameters: overlap_score_credit = -1 (want 0 to 1e+12)", a name the
// command line does not hold.
func TestABadScoringFlagNamesTheFlag(t *testing.T) {
	for _, f := range []string{"overlap-credit", "prefill-load-scale", "decode-request-weight"} {
		for _, v := range []string{"-1", "NaN", "1e300"} {
			args := []string{"replay", "--trace", filepath.Join(t.TempDir(), "none.jsonl"), "--" + f, v}
			_, err := kvsim(t, args...)
			var ec cli.ExitCoder
			if !errors.As(err, &ec) || ec.ExitCode() != exitUsage || !strings.HasPrefix(err.Error(), "--"+f+" ") {
				t.Errorf("kvsim %q: %v, want exit 2 naming --%s first", args, err, f)
			}
		}
	}
}
