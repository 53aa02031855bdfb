package main

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/urfave/cli/v2"
)

// clearFlagEnv unsets, for the test, every KVAGENT_* variable of a flag,
// so that the environment the tests run in sets none.
func clearFlagEnv(t *testing.T) {
	t.Helper()
	clihelp.UnsetEnv(t, app().Flags)
}

// TestAFlagGivenOutranksABadVariable: a flag given outranks its KVAGENT_*
// variable (docs/operations.md), even one that does not parse: the agent
// starts with the flag, instead of exiting 2 on a variable it would not
// use. With the flag not given, the variable is read, and its bad value
// refused naming it and what the flag takes.
func TestAFlagGivenOutranksABadVariable(t *testing.T) {
	clearFlagEnv(t)
	t.Setenv("KVAGENT_HEARTBEAT_INTERVAL", "200")
	if got := agentFlags(t, "--heartbeat-interval", "100ms").HeartbeatInterval; got != 100*time.Millisecond {
		t.Errorf("KVAGENT_HEARTBEAT_INTERVAL=200 kvagent --heartbeat-interval 100ms: heartbeat interval %v, want 100ms", got)
	}
	err := checkOnly()
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 || !strings.Contains(err.Error(), `KVAGENT_HEARTBEAT_INTERVAL="200"`) || !strings.Contains(err.Error(), "want a duration") {
		t.Errorf("KVAGENT_HEARTBEAT_INTERVAL=200 kvagent: %v, want exit 2 naming the variable and what --heartbeat-interval takes", err)
	}
	t.Setenv("KVAGENT_HEARTBEAT_INTERVAL", "300ms")
	if got := agentFlags(t).HeartbeatInterval; got != 300*time.Millisecond {
		t.Errorf("KVAGENT_HEARTBEAT_INTERVAL=300ms kvagent: heartbeat interval %v, want 300ms", got)
	}
}

// TestAUsageErrorSaysWhatToDo: a command line whose flag does not parse
// is refused (exit 2) with one line naming the flag as typed (--flag),
// what it takes and "see kvagent --help", as kvrouter's, instead of the
// flag package's "invalid value ... for flag -heartbeat-interval: parse
// error".
func TestAUsageErrorSaysWhatToDo(t *testing.T) {
	clearFlagEnv(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--heartbeat-interval", "5"}, `--heartbeat-interval "5": want a duration with its unit, such as 200ms or 2m; see kvagent --help`},
		{[]string{"--dp-size", "x"}, `--dp-size "x": want a whole number; see kvagent --help`},
		{[]string{"--version"}, `--version is not a flag of kvagent; see kvagent --help`},
	} {
		a := app()
		a.Action = func(*cli.Context) error { return nil }
		a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		err := a.Run(append([]string{"kvagent"}, c.args...))
		var ec cli.ExitCoder
		if !errors.As(err, &ec) || ec.ExitCode() != 2 || err.Error() != c.want {
			t.Errorf("kvagent %q: %v, want exit 2: %s", c.args, err, c.want)
		}
	}
}

// TestAUsageErrorOfAVariableNamesTheVariable: a value kvagent refuses
// (exit 2) that came from its KVAGENT_* variable, the flag not given, is
// named as the variable: the operator gave no such flag, and would look
// for it on the command line. The agent's own run is used: each value is
// refused before it starts anything.
func TestAUsageErrorOfAVariableNamesTheVariable(t *testing.T) {
	clearFlagEnv(t)
	clihelp.WantVariableNamed(t, app, []string{"kvagent", "--metrics-addr", "", "--worker-id", "1", "--block-size", "4"}, [][2]string{
		{"KVAGENT_DP_SIZE", "0"},
		{"KVAGENT_LEASE", "500ms"},
		{"KVAGENT_LOG_LEVEL", "verbose"},
	})
}

// TestABadLogLevelSaysTheLevels: a --log-level slog does not know is a
// usage error naming the levels kvagent takes, as kvrouter's, instead of
// slog's "slog: level string "verbose": unknown name".
func TestABadLogLevelSaysTheLevels(t *testing.T) {
	clearFlagEnv(t)
	a := app()
	a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
	err := a.Run([]string{"kvagent", "--metrics-addr", "", "--worker-id", "1", "--block-size", "4", "--log-level", "verbose"})
	var ec cli.ExitCoder
	if want := `--log-level "verbose": want debug, info, warn or error`; !errors.As(err, &ec) || ec.ExitCode() != 2 || err.Error() != want {
		t.Errorf("kvagent --log-level verbose: %v, want exit 2: %s", err, want)
	}
}

// TestEitherRouterTokenFlagOutranksBothTokenVariables pins
// docs/operations.md, "Security": --router-token or --router-token-file
// given outranks both KVAGENT_ROUTER_TOKEN and KVAGENT_ROUTER_TOKEN_FILE
// (clihelp.TokenFlagArgs), as kvctl's token flags do: a stale
// KVAGENT_ROUTER_TOKEN beside --router-token-file given is not "a token
// and a token file", and the agent registers with the file's token. Both
// variables set, no flag given, are refused naming the variables.
func TestEitherRouterTokenFlagOutranksBothTokenVariables(t *testing.T) {
	clearFlagEnv(t)
	security := func(args ...string) (string, error) {
		a := app()
		a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		var got string
		a.Action = func(c *cli.Context) error {
			sec, err := routerSecurity(c)
			got = sec.token
			return err
		}
		err := a.Run(append([]string{"kvagent", "--router", "127.0.0.1:1"}, args...))
		return got, err
	}
	err := clihelp.WantTokenFlagsOutrankVariables(t, security, "router-token", "router-token-file", "KVAGENT_ROUTER_TOKEN", "KVAGENT_ROUTER_TOKEN_FILE")
	var ec cli.ExitCoder
	if !errors.As(err, &ec) || ec.ExitCode() != 2 {
		t.Errorf("both router token variables set, no flag: %v, want exit 2", err)
	}
}

// TestARouterVariableWithoutRouterIsNotRefused: KVAGENT_ROUTER_TOKEN,
// KVAGENT_ROUTER_TOKEN_FILE or KVAGENT_ROUTER_TLS_CA set in an
// environment several agents share (a systemd EnvironmentFile), some of
// them without --router, does not stop an agent without --router: it
// registers nowhere, and reads none of them (a token file missing, or
// both token variables set, included). The flag given on the command line
// without --router is still refused (exit 2), naming the flag.
func TestARouterVariableWithoutRouterIsNotRefused(t *testing.T) {
	clearFlagEnv(t)
	security := func(args ...string) error {
		a := app()
		a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		a.Action = func(c *cli.Context) error {
			_, err := routerSecurity(c)
			return err
		}
		return a.Run(append([]string{"kvagent"}, args...))
	}
	missing := t.TempDir() + "/missing"
	for _, vars := range [][][2]string{
		{{"KVAGENT_ROUTER_TOKEN", "s3cret"}},
		{{"KVAGENT_ROUTER_TOKEN_FILE", missing}},
		{{"KVAGENT_ROUTER_TLS_CA", missing}},
		{{"KVAGENT_ROUTER_TOKEN", "s3cret"}, {"KVAGENT_ROUTER_TOKEN_FILE", missing}},
	} {
		for _, kv := range vars {
			t.Setenv(kv[0], kv[1])
		}
		if err := security(); err != nil {
			t.Errorf("%v, no --router: %v, want the agent started", vars, err)
		}
		clearFlagEnv(t)
	}
	for _, f := range []string{"router-token", "router-token-file", "router-tls-ca"} {
		err := security("--"+f, missing)
		var ec cli.ExitCoder
		if want := "--" + f + " is for the registrations through --router, and there is no --router"; !errors.As(err, &ec) || ec.ExitCode() != 2 || err.Error() != want {
			t.Errorf("kvagent --%s %s, no --router: %v, want exit 2: %s", f, missing, err, want)
		}
	}
}
