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
