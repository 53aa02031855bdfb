package main

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
)

// TestAFlagGivenInAnyFormOutranksItsVariable: the flag outranks its
// variable however it is written (--flag=value, -flag value,
// -flag=value), and one written after "--" is an argument, not the flag:
// the variable is then read, and its bad value refused naming it.
func TestAFlagGivenInAnyFormOutranksItsVariable(t *testing.T) {
	clearFlagEnv(t)
	t.Setenv("KVROUTER_HEARTBEAT_TIMEOUT", "200")
	for _, args := range [][]string{
		{"--heartbeat-timeout=100ms"},
		{"-heartbeat-timeout", "100ms"},
		{"-heartbeat-timeout=100ms"},
	} {
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {}
		var got time.Duration
		app.Action = func(c *cli.Context) error {
			got = nodeConfig(c, nil, "127.0.0.1:7080", slog.Default()).HeartbeatTimeout
			return nil
		}
		if err := app.Run(append([]string{"kvrouter"}, args...)); err != nil || got != 100*time.Millisecond {
			t.Errorf("KVROUTER_HEARTBEAT_TIMEOUT=200 kvrouter %q: %v, heartbeat timeout %v, want 100ms", args, err, got)
		}
	}
	app := newApp()
	app.ExitErrHandler = func(*cli.Context, error) {}
	app.Action = func(*cli.Context) error { return nil }
	err := app.Run([]string{"kvrouter", "--", "--heartbeat-timeout", "100ms"})
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), `KVROUTER_HEARTBEAT_TIMEOUT="200"`) {
		t.Errorf(`KVROUTER_HEARTBEAT_TIMEOUT=200 kvrouter -- --heartbeat-timeout 100ms: %v, want exit 2 naming the variable`, err)
	}
}

// TestEitherTokenFlagOutranksBothTokenVariables pins docs/operations.md,
// "Security": --token or --token-file given outranks both KVROUTER_TOKEN
// and KVROUTER_TOKEN_FILE (clihelp.TokenArgs), as kvctl's do: a stale
// KVROUTER_TOKEN beside --token-file given is not "a token and a token
// file", and the node asks for the file's token. Both variables set, no
// flag given, are refused naming the variables.
func TestEitherTokenFlagOutranksBothTokenVariables(t *testing.T) {
	clearFlagEnv(t)
	const token = "fr3sh"
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	security := func(args ...string) (string, error) {
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {}
		var got string
		app.Action = func(c *cli.Context) error {
			sec, err := loadSecurity(c)
			got = sec.token
			return err
		}
		err := app.Run(append([]string{"kvrouter"}, args...))
		return got, err
	}
	for _, tc := range []struct {
		env, val string
		flags    []string
	}{
		{"KVROUTER_TOKEN", "stale", []string{"--token-file", file}},
		{"KVROUTER_TOKEN_FILE", filepath.Join(t.TempDir(), "missing"), []string{"--token", token}},
	} {
		t.Setenv(tc.env, tc.val)
		if got, err := security(tc.flags...); err != nil || got != token {
			t.Errorf("%s=%s kvrouter %s: %v, token %q; want the command line's %q", tc.env, tc.val, strings.Join(tc.flags, " "), err, got, token)
		}
		os.Unsetenv(tc.env)
	}
	t.Setenv("KVROUTER_TOKEN", "stale")
	t.Setenv("KVROUTER_TOKEN_FILE", file)
	if _, err := security(); err == nil || !strings.Contains(err.Error(), "KVROUTER_TOKEN, KVROUTER_TOKEN_FILE") {
		t.Errorf("KVROUTER_TOKEN=stale KVROUTER_TOKEN_FILE=%s kvrouter: %v, want the variables named as a token and a token file", file, err)
	}
}
