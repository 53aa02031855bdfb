package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// TestEveryGlobalFlagReadsItsVariable: every global flag is read from the
// environment variable docs/kvctl.md's table of global flags names for it
// ("Every global flag is also read from an environment variable"), and
// the table lists every global flag. Each variable is given a value kvctl
// acts on where the flag is left out: a bad one refused as the flag's
// would be (exit 2, naming the flag), or the token, which draws the
// clear-text warning.
func TestEveryGlobalFlagReadsItsVariable(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "kvctl.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(doc), "| flag | variable | default | what |")
	if !ok {
		t.Fatal("docs/kvctl.md has no table of global flags")
	}
	table, _, _ = strings.Cut(table, "\n\n")
	row := regexp.MustCompile("(?m)^\\| (?:`-[a-z]`, )?`--([a-z-]+)` \\| `(KVCTL_[A-Z_]+)` \\|")
	documented := map[string]string{} // flag -> variable
	for _, m := range row.FindAllStringSubmatch(table, -1) {
		documented[m[1]] = m[2]
	}
	var flags []string
	for _, f := range newApp(&env{}).Flags {
		flags = append(flags, f.Names()[0])
	}
	docFlags := make([]string, 0, len(documented))
	for f, v := range documented {
		docFlags = append(docFlags, f)
		if want := "KVCTL_" + strings.ToUpper(strings.ReplaceAll(f, "-", "_")); v != want {
			t.Errorf("docs/kvctl.md: --%s's variable is %s, want %s", f, v, want)
		}
	}
	slices.Sort(flags)
	slices.Sort(docFlags)
	if !slices.Equal(flags, docFlags) {
		t.Errorf("kvctl's global flags %q, docs/kvctl.md's table %q", flags, docFlags)
	}
	dead := deadAddr(t)
	missing := filepath.Join(t.TempDir(), "missing")
	// What each variable is set to, the exit code and what stderr must say.
	cases := map[string]struct {
		value string
		code  int
		want  string
	}{
		"KVCTL_ENDPOINTS":  {"127.0.0.1:x", 2, "127.0.0.1:x"},
		"KVCTL_TIMEOUT":    {"-1s", 2, "--timeout -1s"},
		"KVCTL_OUTPUT":     {"yaml", 2, `-o "yaml"`},
		"KVCTL_TOKEN":      {"s3cret", 1, "the token goes to " + dead + " in clear text"},
		"KVCTL_TOKEN_FILE": {missing, 2, "token file: open " + missing},
		"KVCTL_TLS_CA":     {missing, 2, "--tls-ca"},
	}
	for f, v := range documented {
		c, ok := cases[v]
		if !ok {
			t.Errorf("--%s: no case for %s", f, v)
			continue
		}
		t.Run(v, func(t *testing.T) {
			t.Setenv(v, c.value)
			args := []string{"status"}
			if v != "KVCTL_ENDPOINTS" {
				args = append([]string{"--endpoints", dead}, args...)
			}
			r := kvctl(t, args...).wantCode(t, c.code)
			if !strings.Contains(r.stderr, c.want) {
				t.Errorf("%s=%s: stderr %q; want it to say %q (the variable read as --%s)", v, c.value, r.stderr, c.want, f)
			}
		})
	}
}

// TestAFlagGivenOutranksABadVariable: the command line outranks a global
// flag's variable (docs/kvctl.md) even when the variable does not parse:
// KVCTL_TIMEOUT=200 (no unit) with --timeout given runs the command,
// instead of a usage error on the variable kvctl would not use. With the
// flag left out the bad variable is a usage error naming it and what the
// flag takes.
func TestAFlagGivenOutranksABadVariable(t *testing.T) {
	dead := deadAddr(t)
	t.Setenv("KVCTL_TIMEOUT", "200")
	for _, args := range [][]string{
		{"--timeout", "5s", "--endpoints", dead, "status"},
		{"--endpoints", dead, "status", "--timeout=5s"},
	} {
		r := kvctl(t, args...)
		if r.code != 1 || strings.Contains(r.stderr, "KVCTL_TIMEOUT") {
			t.Errorf("KVCTL_TIMEOUT=200 kvctl %q: exit %d, stderr %q; want the status run, exit 1 for the unreachable node", args, r.code, r.stderr)
		}
	}
	r := kvctl(t, "--endpoints", dead, "status").wantCode(t, 2)
	if want := `KVCTL_TIMEOUT="200" (--timeout): want a duration with its unit`; !strings.Contains(r.stderr, want) {
		t.Errorf("KVCTL_TIMEOUT=200 kvctl status: stderr %q, want it to say %q", r.stderr, want)
	}
}

// TestAUsageErrorNamesTheFlagAsTyped: a flag that does not parse, or one
// kvctl does not define, is named as the operator types it (--flag),
// with what it takes, instead of the flag package's "invalid value "5"
// for flag -timeout: parse error" and "flag provided but not defined:
// -bogus"; the line still ends "; see kvctl --help" (or the command's).
func TestAUsageErrorNamesTheFlagAsTyped(t *testing.T) {
	dead := deadAddr(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--timeout", "5", "--endpoints", dead, "status"}, `kvctl: --timeout "5": want a duration with its unit, such as 200ms or 2m; see kvctl --help`},
		{[]string{"--bogus", "status"}, `kvctl: --bogus is not a flag of kvctl; see kvctl --help`},
		{[]string{"--endpoints", dead, "snapshot", "save", "f", "--max-time", "x"}, `kvctl: --max-time "x": want a duration with its unit, such as 200ms or 2m; see kvctl snapshot save --help`},
	} {
		r := kvctl(t, c.args...).wantCode(t, 2)
		if got := strings.TrimSpace(r.stderr); got != c.want {
			t.Errorf("kvctl %q: stderr %q, want %q", c.args, got, c.want)
		}
	}
}

// TestAUsageErrorOfAVariableNamesTheVariable: a value kvctl refuses (exit
// 2) that came from a global flag's KVCTL_* variable, the flag left out,
// is named as the variable: the operator gave no such flag, and would
// look for it on the command line. The value is not repeated beyond what
// the message shows of it (an endpoint can carry a password).
func TestAUsageErrorOfAVariableNamesTheVariable(t *testing.T) {
	dead := deadAddr(t)
	missing := filepath.Join(t.TempDir(), "missing")
	for _, c := range []struct {
		env, value string
		args       []string
		want       string
	}{
		{"KVCTL_TIMEOUT", "-1s", []string{"--endpoints", dead, "status"}, "(--timeout from KVCTL_TIMEOUT)"},
		{"KVCTL_ENDPOINTS", "127.0.0.1:x", []string{"status"}, "(--endpoints from KVCTL_ENDPOINTS)"},
		{"KVCTL_TLS_CA", missing, []string{"--endpoints", dead, "status"}, "(--tls-ca from KVCTL_TLS_CA)"},
		{"KVCTL_OUTPUT", "yaml", []string{"--endpoints", dead, "status"}, `-o "yaml": want table or json (-o from KVCTL_OUTPUT)`},
	} {
		t.Run(c.env, func(t *testing.T) {
			t.Setenv(c.env, c.value)
			r := kvctl(t, c.args...).wantCode(t, 2)
			if !strings.Contains(r.stderr, c.want) {
				t.Errorf("%s=%s kvctl %q: stderr %q, want it to say %s", c.env, c.value, c.args, r.stderr, c.want)
			}
		})
	}
	t.Setenv("KVCTL_TIMEOUT", "-1s")
	r := kvctl(t, "--timeout", "-1s", "--endpoints", dead, "status").wantCode(t, 2)
	if strings.Contains(r.stderr, "KVCTL_TIMEOUT") {
		t.Errorf("kvctl --timeout -1s: stderr %q names KVCTL_TIMEOUT, which the flag given outranks", r.stderr)
	}
	t.Setenv("KVCTL_OUTPUT", "yaml")
	r = kvctl(t, "-o", "yaml", "--endpoints", dead, "status").wantCode(t, 2)
	if strings.Contains(r.stderr, "KVCTL_OUTPUT") {
		t.Errorf("kvctl -o yaml: stderr %q names KVCTL_OUTPUT, which the flag given outranks", r.stderr)
	}
}
