package main

import (
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v2"
)

// clearFlagEnv unsets every KVAGENT_* variable of a flag for the test, so
// that the environment the tests run in sets none.
func clearFlagEnv(t *testing.T) {
	t.Helper()
	for _, f := range app().Flags {
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
