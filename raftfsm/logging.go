package raftfsm

import (
	"log/slog"
	"strings"

	"github.com/hashicorp/go-hclog"
)

// hclogAdapter gives hashicorp/raft a logger that writes through slog.
// Raft is chatty at info level (every heartbeat failure, every election
// step); warnings and errors are what an operator needs from it.
func hclogAdapter(l *slog.Logger) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		Name:            "raft",
		Level:           hclog.Warn,
		Output:          slogWriter{l.With("component", "raft")},
		DisableTime:     true,
		IncludeLocation: false,
	})
}

type slogWriter struct{ l *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	switch {
	case strings.Contains(msg, "transport shutdown"):
		// A connection's reader finding this node's own transport closed:
		// the routine end of a shutdown, not an error of the cluster.
		w.l.Info(msg)
	case strings.Contains(msg, "[ERROR]"):
		w.l.Error(msg)
	default:
		w.l.Warn(msg)
	}
	return len(p), nil
}
