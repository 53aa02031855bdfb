package store

import (
	"fmt"
	"log/slog"
)

// pebbleLogger routes Pebble's printf-style logging to a *slog.Logger.
type pebbleLogger struct{ l *slog.Logger }

func (p pebbleLogger) Infof(format string, args ...any) {
	p.l.Info(fmt.Sprintf(format, args...))
}

func (p pebbleLogger) Errorf(format string, args ...any) {
	p.l.Error(fmt.Sprintf(format, args...))
}

// Fatalf is how Pebble reports a broken internal invariant or unrecoverable
// on-disk state; its contract is that Fatalf does not return (Pebble's own
// default logger calls log.Fatalf). We log the message first so that it
// reaches the node's log sink, then stop the goroutine with a panic rather
// than os.Exit so a test sees the stack.
func (p pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	p.l.Error(msg, "fatal", true)
	panic("pebble fatal: " + msg)
}
