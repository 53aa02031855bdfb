package clihelp

import (
	"errors"
	"os"
	"path/filepath"
	"strings"

	"github.com/urfave/cli/v2"
)

// envTest is what the test helpers ask of a test (a *testing.T).
type envTest interface {
	Helper()
	Setenv(key, value string)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	TempDir() string
}

// UnsetEnv unsets, for the test t, every variable flags read, so that a
// run sees only the test's arguments, not the environment the tests
// happen to run in (t.Setenv restores them after it).
func UnsetEnv(t envTest, flags []cli.Flag) {
	t.Helper()
	for _, f := range flags {
		ef, ok := f.(interface{ GetEnvVars() []string })
		if !ok {
			continue
		}
		for _, v := range ef.GetEnvVars() {
			t.Setenv(v, "") // restored after the test
			if err := os.Unsetenv(v); err != nil {
				t.Fatalf("unset %s: %v", v, err)
			}
		}
	}
}

// WantVariableNamed runs app (a fresh one from newApp) with args once for
// each variable of vars set to its value, the others unset, and fails t
// unless each run is a usage error (exit 2) whose message names the
// variable: a value refused that came from a variable, its flag not
// given (FromEnv).
func WantVariableNamed(t envTest, newApp func() *cli.App, args []string, vars [][2]string) {
	t.Helper()
	for _, kv := range vars {
		env, value := kv[0], kv[1]
		t.Setenv(env, value)
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		err := app.Run(args)
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 {
			t.Errorf("%s=%s: %v, want exit 2", env, value, err)
		} else if !strings.Contains(err.Error(), env) {
			t.Errorf("%s=%s (no flag given): %q, want the message to name %s", env, value, err, env)
		}
		if err := os.Unsetenv(env); err != nil {
			t.Fatalf("unset %s: %v", env, err)
		}
	}
}

// WantTokenFlagsOutrankVariables checks the rule of TokenFlagArgs on a
// binary: run parses args as the binary does and returns the token it
// would use. Either token flag given outranks both token variables (the
// other flag's variable set, to a stale token or a missing file), and both
// variables set with no flag given are refused naming both variables;
// that run's error is returned for the caller's own checks (an exit code).
func WantTokenFlagsOutrankVariables(t envTest, run func(args ...string) (string, error), tokenFlag, fileFlag, tokenVar, fileVar string) error {
	t.Helper()
	const token = "fr3sh"
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatalf("write the token file: %v", err)
	}
	for _, tc := range []struct {
		env, val string
		flags    []string
	}{
		{tokenVar, "stale", []string{"--" + fileFlag, file}},
		{fileVar, filepath.Join(t.TempDir(), "missing"), []string{"--" + tokenFlag, token}},
	} {
		t.Setenv(tc.env, tc.val)
		if got, err := run(tc.flags...); err != nil || got != token {
			t.Errorf("%s=%s with %s: %v, token %q; want the command line's %q", tc.env, tc.val, strings.Join(tc.flags, " "), err, got, token)
		}
		if err := os.Unsetenv(tc.env); err != nil {
			t.Fatalf("unset %s: %v", tc.env, err)
		}
	}
	t.Setenv(tokenVar, "stale")
	t.Setenv(fileVar, file)
	_, err := run()
	if err == nil || !strings.Contains(err.Error(), tokenVar+", "+fileVar) {
		t.Errorf("%s=stale %s=%s, no flag: %v, want the variables named as a token and a token file", tokenVar, fileVar, file, err)
	}
	return err
}
