package clihelp

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
)

// envApp is a tool whose --wait and --name are EnvFlags, read from
// TOOL_WAIT and TOOL_NAME after the command line; its action refuses a
// --wait over a minute as a usage error, through FromEnv.
func envApp(wait *time.Duration, name *string) *cli.App {
	return &cli.App{
		Name: "tool",
		Flags: EnvAfterArgs([]cli.Flag{
			&cli.DurationFlag{Name: "wait", Value: time.Second, EnvVars: []string{"TOOL_WAIT"}},
			&cli.StringFlag{Name: "name", Value: "x", EnvVars: []string{"TOOL_NAME"}},
		}),
		Before: ApplyEnv,
		Action: func(c *cli.Context) error {
			*wait, *name = c.Duration("wait"), c.String("name")
			if *wait > time.Minute {
				return FromEnv(c, cli.Exit("--wait "+wait.String()+": want at most 1m", 2))
			}
			return nil
		},
		ExitErrHandler: func(*cli.Context, error) {},
	}
}

// TestAFlagGivenOutranksItsVariable: a variable is read only for a flag
// the command line left unset, so that a bad one does not stop a command
// line that gives the flag; a bad one read is a usage error naming it,
// and a value a check refuses is said to come from it.
func TestAFlagGivenOutranksItsVariable(t *testing.T) {
	var wait time.Duration
	var name string
	t.Setenv("TOOL_WAIT", "200")
	t.Setenv("TOOL_NAME", "")
	if err := envApp(&wait, &name).Run([]string{"tool", "--wait", "2s"}); err != nil || wait != 2*time.Second || name != "" {
		t.Errorf(`TOOL_WAIT=200 TOOL_NAME="" tool --wait 2s: %v, wait %v, name %q; want 2s and "" (a string variable, even empty)`, err, wait, name)
	}
	err := envApp(&wait, &name).Run([]string{"tool"})
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || err.Error() != `TOOL_WAIT="200" (--wait): want a duration with its unit, such as 200ms or 2m; unset it, or give --wait` {
		t.Errorf("TOOL_WAIT=200 tool: %v, want exit 2 naming TOOL_WAIT and what --wait takes", err)
	}
	t.Setenv("TOOL_WAIT", "")
	if err := envApp(&wait, &name).Run([]string{"tool"}); err != nil || wait != time.Second {
		t.Errorf(`TOOL_WAIT="" tool: %v, wait %v, want the default 1s (an empty variable of a duration is skipped)`, err, wait)
	}
	t.Setenv("TOOL_WAIT", "2m")
	err = envApp(&wait, &name).Run([]string{"tool"})
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.HasSuffix(err.Error(), "(--wait from TOOL_WAIT)") {
		t.Errorf("TOOL_WAIT=2m tool: %v, want exit 2 saying --wait came from TOOL_WAIT", err)
	}
	if err := envApp(&wait, &name).Run([]string{"tool", "--wait", "2m"}); err == nil || strings.Contains(err.Error(), "TOOL_WAIT") {
		t.Errorf("TOOL_WAIT=2m tool --wait 2m: %v, want a usage error not naming TOOL_WAIT", err)
	}
}

// TestTheHelpersSeeAVariableNamed: UnsetEnv leaves the tool's variables
// unset, and WantVariableNamed passes a run refusing a value that came
// from one, naming it.
func TestTheHelpersSeeAVariableNamed(t *testing.T) {
	var wait time.Duration
	var name string
	t.Setenv("TOOL_WAIT", "200")
	UnsetEnv(t, envApp(&wait, &name).Flags)
	if err := envApp(&wait, &name).Run([]string{"tool"}); err != nil || wait != time.Second || name != "x" {
		t.Fatalf("tool, its variables unset: %v, wait %v, name %q; want the defaults", err, wait, name)
	}
	WantVariableNamed(t, func() *cli.App { return envApp(&wait, &name) }, []string{"tool"}, [][2]string{{"TOOL_WAIT", "2m"}, {"TOOL_WAIT", "x"}})
}

// TestEitherTokenFlagOutranksBothVariables: TokenArgs takes the command
// line's --token and --token-file when it gives either, the other left
// empty even where its variable is set, and the variables otherwise,
// for flags that read them (EnvFlags, kvsim's) or not (kvctl's).
func TestEitherTokenFlagOutranksBothVariables(t *testing.T) {
	for _, withVars := range []bool{false, true} {
		newApp := func(got *[3]string) *cli.App {
			vars := func(v string) []string {
				if withVars {
					return []string{v}
				}
				return nil
			}
			return &cli.App{
				Name: "tool",
				Flags: EnvAfterArgs([]cli.Flag{
					&cli.StringFlag{Name: "token", EnvVars: vars("TOOL_TOKEN")},
					&cli.StringFlag{Name: "token-file", EnvVars: vars("TOOL_TOKEN_FILE")},
				}),
				Before: ApplyEnv,
				Action: func(c *cli.Context) error {
					token, file, given := TokenArgs(c, "TOOL_TOKEN", "TOOL_TOKEN_FILE")
					got[0], got[1], got[2] = token, file, map[bool]string{true: "flags", false: "variables"}[given]
					return nil
				},
			}
		}
		t.Setenv("TOOL_TOKEN", "stale")
		t.Setenv("TOOL_TOKEN_FILE", "/stale")
		for _, tc := range []struct {
			args []string
			want [3]string
		}{
			{[]string{"--token-file", "/f"}, [3]string{"", "/f", "flags"}},
			{[]string{"--token", "t"}, [3]string{"t", "", "flags"}},
			{[]string{"--token", "t", "--token-file", "/f"}, [3]string{"t", "/f", "flags"}},
			{nil, [3]string{"stale", "/stale", "variables"}},
		} {
			var got [3]string
			if err := newApp(&got).Run(append([]string{"tool"}, tc.args...)); err != nil || got != tc.want {
				t.Errorf("flags read the variables %v: TOOL_TOKEN=stale TOOL_TOKEN_FILE=/stale tool %v: %v, %q; want %q", withVars, tc.args, err, got, tc.want)
			}
		}
	}
}
