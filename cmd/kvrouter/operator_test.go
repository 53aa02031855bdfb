package main

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/clihelp"
	"github.com/urfave/cli/v2"
)

// TestAFlagGivenOutranksABadVariable: "a flag given outranks its
// variable" (docs/operations.md, Bootstrap a new cluster). A variable
// left with a value that does not parse (an env file's "200", no unit)
// is overridden by the flag on the command line: the node takes the
// flag's value and starts, rather than refusing the variable it does
// not use.
func TestAFlagGivenOutranksABadVariable(t *testing.T) {
	clearFlagEnv(t)
	for _, c := range []struct{ env, value, flag, given string }{
		{"KVROUTER_HEARTBEAT_TIMEOUT", "200", "--heartbeat-timeout", "100ms"},
		{"KVROUTER_SNAPSHOT_THRESHOLD", "-1", "--snapshot-threshold", "4096"},
	} {
		t.Setenv(c.env, c.value)
		app := newApp()
		app.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
		var cfgErr error
		app.Action = func(cctx *cli.Context) error {
			cfg := nodeConfig(cctx, nil, "127.0.0.1:7080", slog.Default())
			if c.flag == "--heartbeat-timeout" && cfg.HeartbeatTimeout != 100*time.Millisecond {
				cfgErr = errors.New("heartbeat timeout " + cfg.HeartbeatTimeout.String())
			}
			if c.flag == "--snapshot-threshold" && cfg.SnapshotThreshold != 4096 {
				cfgErr = errors.New("snapshot threshold not the flag's")
			}
			return nil
		}
		if err := app.Run([]string{"kvrouter", c.flag, c.given, "--election-timeout", "1s"}); err != nil {
			t.Errorf("%s=%s kvrouter %s %s: %v, want the flag's value taken (a flag given outranks its variable)", c.env, c.value, c.flag, c.given, err)
		} else if cfgErr != nil {
			t.Errorf("%s=%s kvrouter %s %s: %v, want the flag's value", c.env, c.value, c.flag, c.given, cfgErr)
		}
		os.Unsetenv(c.env)
	}
}

// TestAUsageErrorSaysWhatToDo: a command line kvrouter cannot run is
// refused with exit 2 and one line on stderr "saying what to do"
// (design cli.md: "Errors go to stderr, one line, saying what to do"),
// naming the flag as the operator types it (--flag): as kvctl's and
// kvsim's usage errors do ("...; see kvctl --help"). The real process
// is run (the test binary as kvrouter), its stderr read.
func TestAUsageErrorSaysWhatToDo(t *testing.T) {
	for _, c := range []struct {
		args []string
		flag string
	}{
		{[]string{"--heartbeat-timeout", "5"}, "--heartbeat-timeout"},    // a duration without its unit
		{[]string{"--snapshot-threshold", "-1"}, "--snapshot-threshold"}, // not a uint
		{[]string{"--log-level", "verbose"}, "--log-level"},              // not a level
		{[]string{"--version"}, "--version"},                             // not a flag of kvrouter
	} {
		data := filepath.Join(t.TempDir(), "data")
		cmd := exec.Command(os.Args[0], append(c.args, "--data-dir", data)...)
		cmd.Env = append(os.Environ(), asProcessEnv+"=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 {
			t.Errorf("kvrouter %v: %v, want exit 2", c.args, err)
			continue
		}
		msg := strings.TrimSpace(stderr.String())
		if !strings.Contains(msg, c.flag) || !(strings.Contains(msg, "want") || strings.Contains(msg, "--help")) {
			t.Errorf("kvrouter %v: stderr %q, want a line naming %s and saying what to give (want ..., or see kvrouter --help)", c.args, msg, c.flag)
		}
	}
}

// TestAUsageErrorOfAVariableNamesTheVariable: a value kvrouter refuses
// that came from its KVROUTER_* variable (docs/operations.md: every flag
// can come from one, a supervisor's EnvironmentFile= holding the
// settings) is named as the variable, as cli names a variable whose
// value does not parse ("from environment variable
// KVROUTER_HEARTBEAT_TIMEOUT"): the operator gave no such flag, and
// looks for it on the command line.
func TestAUsageErrorOfAVariableNamesTheVariable(t *testing.T) {
	clearFlagEnv(t)
	clihelp.WantVariableNamed(t, newApp, []string{"kvrouter", "--data-dir", filepath.Join(t.TempDir(), "data")}, [][2]string{
		{"KVROUTER_LOG_LEVEL", "verbose"},
		{"KVROUTER_MAX_BODY_BYTES", "0"},
		{"KVROUTER_HTTP_ADDR", "localhost"},
		{"KVROUTER_BOOKING_MAX_AGE", "48h"},
	})
}
