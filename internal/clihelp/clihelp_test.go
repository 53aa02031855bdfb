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
