package raftfsm

import (
	"log/slog"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/kvrouter/kvrouter/internal/lograte"
)

// raftLogEvery is how often a line of one kind from hashicorp/raft is
// logged at most (lograte): a peer that stays down has the leader retry
// its heartbeats, and a node without a quorum its votes, several times a
// second for as long as it lasts, each retry a line.
const raftLogEvery = time.Minute

// hclogAdapter gives hashicorp/raft a logger that writes through slog.
// Raft is chatty at info level (every election step, every snapshot), so
// only its warnings and errors are passed; and a fault that lasts repeats
// one of those per retry, so each kind of line (its numbers folded:
// lograte.Kind) is logged at once, then at most once per raftLogEvery
// with the count of those left out.
func hclogAdapter(l *slog.Logger) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		Name:            "raft",
		Level:           hclog.Warn,
		Output:          &slogWriter{l: l.With("component", "raft"), rate: lograte.New(raftLogEvery, nil), every: raftLogEvery},
		DisableTime:     true,
		IncludeLocation: false,
	})
}

// slogWriter writes hclog's lines, one per Write, to slog, rate-limited
// per kind.
type slogWriter struct {
	l     *slog.Logger
	rate  *lograte.Limiter
	every time.Duration
}

func (w *slogWriter) Write(p []byte) (int, error) {
	msg := strings.TrimSpace(string(p))
	// A line's kind keeps its peer (the members are few): two peers down
	// are two kinds, each named once a minute, not one kind naming
	// whichever failed last.
	ok, skipped, overflowed := w.rate.Check(lograte.Kind(msg) + "\x00" + raftPeer(msg))
	if !ok {
		if overflowed {
			// Its kind crowded out: kept at Debug rather than only
			// counted in a kind that names none of it.
			w.l.Debug(msg)
		}
		return len(p), nil
	}
	args := lograte.LeftOut(skipped, w.every)
	switch {
	case strings.Contains(msg, "transport shutdown"), strings.Contains(msg, closedConn):
		// A connection's reader finding this node's own transport closed:
		// the routine end of a shutdown, not an error of the cluster. The
		// stream layer closes the connections it accepted itself, at its
		// Close (a clean stop: every SIGTERM logged "failed to decode
		// incoming command: ... use of closed network connection" at
		// Error) and for a peer that stalls, which it logs on its own.
		w.l.Info(msg, args...)
	case strings.Contains(msg, "[ERROR]"):
		w.l.Error(msg, args...)
	default:
		w.l.Warn(msg, args...)
	}
	return len(p), nil
}

// closedConn is the text of net.ErrClosed, which only an I/O call on a
// connection this process closed returns.
const closedConn = "use of closed network connection"

// raftPeerKeys are the keys of hashicorp/raft's (v1.8.0) Warn and Error
// lines whose value names a peer: peer= (replication), target= (votes,
// the transport), server-id= (the leader's "failed to contact", one per
// voter it has not heard from), candidate= and from= (vote requests
// refused), fallback= (the transport's address of a server it could not
// resolve). A from= that is all digits is a log index ("clearing log
// suffix"), not a peer.
var raftPeerKeys = [...]string{" peer=", " target=", " server-id=", " candidate=", " from=", " fallback="}

// raftPeer returns the peer a hashicorp/raft line names (the value of the
// first of raftPeerKeys it holds, quoted or not), or "" when it names none.
func raftPeer(msg string) string {
	for _, key := range raftPeerKeys {
		i := strings.Index(msg, key)
		if i < 0 {
			continue
		}
		v := msg[i+len(key):]
		if strings.HasPrefix(v, `"`) {
			if j := strings.IndexByte(v[1:], '"'); j >= 0 {
				v = v[1 : 1+j]
			} else {
				v = v[1:]
			}
		} else if j := strings.IndexByte(v, ' '); j >= 0 {
			v = v[:j]
		}
		if v == "" || strings.Trim(v, "0123456789") == "" {
			continue
		}
		return v
	}
	return ""
}
