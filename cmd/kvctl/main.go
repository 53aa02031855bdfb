// Command kvctl is the operator CLI of a kvrouter cluster: cluster status
// and membership, leadership transfer, workers, route decisions, index
// statistics, and snapshots (save, inspect, restore online or seed a new
// cluster offline), over the HTTP API of docs/api.md.
//
// Exit codes: 0 success, 1 error, 2 bad usage. Errors are one line on
// stderr that says what to do (kvctl or a command group without a
// command: its help, then that line); -o json writes only JSON to stdout.
package main

import (
	"context"
	"io"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvrouter/kvrouter/raftfsm"
	"golang.org/x/term"
)

func main() {
	// The first SIGINT or SIGTERM ends run's context: kvctl stops what it
	// does (a transfer, a read of a file or of stdin) and says
	// "interrupted", exit 1. The next one kills it, as Go's default
	// handling would have: a step that does not look at the context
	// (an output pipe that nothing drains) cannot hold kvctl.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop)
	// kvctl logs nothing: what reaches the standard logger is net/http's,
	// whose "Unsolicited response received on idle HTTP channel" copies
	// another service's greeting (a NATS port's, its keys and kvctl's
	// address) to stderr beside kvctl's own one-line error.
	log.SetOutput(io.Discard)
	code := run(ctx, os.Args, &env{
		stdout:   os.Stdout,
		stderr:   os.Stderr,
		stdin:    os.Stdin,
		terminal: term.IsTerminal(int(os.Stderr.Fd())),
		inspect:  raftfsm.InspectSnapshot,
		seed:     raftfsm.SeedDataDir,
	})
	stop()
	os.Exit(code)
}
