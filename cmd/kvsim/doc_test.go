package main

import (
	"testing"

	"github.com/kvrouter/kvrouter/internal/doccheck"
	"github.com/urfave/cli/v2"
)

// longName is a flag seen by its long name only (-o is written with one
// dash).
type longName struct{ cli.Flag }

func (f longName) Names() []string { return f.Flag.Names()[:1] }

// TestEveryReplayFlagIsDocumented: every kvsim replay flag is named on a
// page under docs/ (docs/sim.md), as kvrouter's and kvagent's are. (From a
// review: renaming --zmq-host to --zmq-bind-host passed every test of
// cmd/kvsim and internal/doccheck, docs/sim.md still naming --zmq-host.)
func TestEveryReplayFlagIsDocumented(t *testing.T) {
	var flags []cli.Flag
	for _, f := range replayCommand().Flags {
		flags = append(flags, longName{f})
	}
	doccheck.FlagsDocumented(t, "../../docs", "kvsim", flags)
}
