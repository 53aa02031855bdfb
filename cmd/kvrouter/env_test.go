package main

import (
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/clihelp"
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
	clihelp.WantTokenFlagsOutrankVariables(t, security, "token", "token-file", "KVROUTER_TOKEN", "KVROUTER_TOKEN_FILE")
}

// TestAPeersRefusalNamesTheFlagAndItsVariable: a --peers that does not
// parse is refused (exit 2) with a line naming --peers, and, when
// KVROUTER_PEERS gave it, the variable (docs/operations.md: "a value
// refused that came from a variable is named as it"), as every other
// refused flag is. From a review: the line was ParsePeers's alone
// ("peer \"x\": want id=raftaddr=httpaddr"), naming neither.
func TestAPeersRefusalNamesTheFlagAndItsVariable(t *testing.T) {
	for _, bad := range []string{"x", "node1=127.0.0.1:7001=127.0.0.1:7081,node1=127.0.0.1:7002=127.0.0.1:7082"} {
		if err := checkRefusedStart(t, []string{"--peers", bad}, "--peers"); err == nil {
			continue
		}
		t.Setenv("KVROUTER_PEERS", bad)
		err := runKvrouterFor(t, 5*time.Second, "--data-dir", filepath.Join(t.TempDir(), "data"))
		if err == nil || !strings.Contains(err.Error(), "(--peers from KVROUTER_PEERS)") {
			t.Errorf("KVROUTER_PEERS=%q: %v, want an error naming KVROUTER_PEERS", bad, err)
		}
	}
}
