package clihelp

import (
	"strings"
	"testing"

	"github.com/urfave/cli/v2"
)

func TestAFlagWhoseUsageSaysItsDefaultIsReported(t *testing.T) {
	app := &cli.App{
		Name:  "tool",
		Flags: []cli.Flag{&cli.IntFlag{Name: "good", Usage: "a count", DefaultText: "from the input"}},
		Commands: []*cli.Command{{
			Name: "group",
			Subcommands: []*cli.Command{{
				Name:  "leaf",
				Flags: []cli.Flag{&cli.DurationFlag{Name: "wait", Usage: "how long (default: no limit)"}},
			}},
		}},
	}
	bad := DoubleDefaults(app)
	if len(bad) != 1 || !strings.HasPrefix(bad[0], "tool group leaf: --wait") {
		t.Fatalf("DoubleDefaults = %q, want only tool group leaf's --wait", bad)
	}
}

func TestAFlagNotReadFromItsEnvVarIsReported(t *testing.T) {
	flags := []cli.Flag{
		&cli.StringFlag{Name: "raft-addr", EnvVars: []string{"TOOL_RAFT_ADDR"}},
		&cli.IntFlag{Name: "port"},
		&cli.BoolFlag{Name: "quiet", EnvVars: []string{"TOOL_QUIET", "QUIET"}},
		&cli.DurationFlag{Name: "wait", EnvVars: []string{"OTHER_WAIT"}},
	}
	bad := EnvVarMismatches(flags, "TOOL")
	if len(bad) != 3 || !strings.HasPrefix(bad[0], "--port:") || !strings.HasPrefix(bad[1], "--quiet:") || !strings.HasPrefix(bad[2], "--wait:") {
		t.Fatalf("EnvVarMismatches = %q, want --port, --quiet and --wait", bad)
	}
}

// TestUsageErrorsNameTheFlagAndWhatItTakes: the flag package's messages,
// as a cli.App's OnUsageError gets them, become one line naming the flag
// as typed (--flag), what it takes, and where the help is.
func TestUsageErrorsNameTheFlagAndWhatItTakes(t *testing.T) {
	var got *cli.App
	app := &cli.App{
		Name:           "tool",
		Flags:          []cli.Flag{&cli.DurationFlag{Name: "wait"}, &cli.Uint64Flag{Name: "count"}},
		Action:         func(*cli.Context) error { return nil },
		ExitErrHandler: func(*cli.Context, error) {},
	}
	var msg string
	app.OnUsageError = func(c *cli.Context, err error, _ bool) error {
		got, msg = c.App, UsageError(err, c.App.Flags, "tool --help")
		return err
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--wait", "5"}, `--wait "5": want a duration with its unit, such as 200ms or 2m; see tool --help`},
		{[]string{"--count=-1"}, `--count "-1": want a whole number, 0 or more; see tool --help`},
		{[]string{"--count", "99999999999999999999"}, `--count "99999999999999999999": out of range, want a whole number, 0 or more; see tool --help`},
		{[]string{"-version"}, `--version is not a flag of tool; see tool --help`},
		{[]string{"--wait"}, `--wait needs a value; see tool --help`},
	} {
		msg = ""
		_ = app.Run(append([]string{"tool"}, c.args...))
		if got == nil || msg != c.want {
			t.Errorf("tool %q: %q, want %q", c.args, msg, c.want)
		}
	}
}
