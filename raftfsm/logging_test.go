package raftfsm

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/internal/testlog"
)

// TestRaftLogLevels: Raft's errors are logged as errors, its warnings as
// warnings, but a connection's reader that finds this node's own transport
// shut down is the routine end of a shutdown: info, not error. From a
// run-through of docs/operations.md: stopping a follower logged it as
// ERROR.
func TestRaftLogLevels(t *testing.T) {
	var out bytes.Buffer
	h := hclogAdapter(slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug})))
	h.Error("failed to decode incoming command", "error", "transport shutdown")
	h.Error("failed to appendEntries to", "peer", "n2")
	h.Warn("heartbeat timeout reached")
	// What a connection's reader logs when this node's stream layer closed
	// its connection (a clean stop: TestAStoppedNodesTransportLogsNoError).
	h.Error("failed to decode incoming command", "error", "read tcp 127.0.0.1:7411->127.0.0.1:39728: use of closed network connection")
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := []string{"level=INFO", "level=ERROR", "level=WARN", "level=INFO"}
	if len(lines) != len(want) {
		t.Fatalf("logged:\n%s", out.String())
	}
	for i, l := range lines {
		if !strings.Contains(l, want[i]) {
			t.Errorf("line %d: %s, want %s", i, l, want[i])
		}
	}
}

// TestRaftLinesAreLimitedPerKindAndPeer: a line Raft repeats per retry is
// logged once per interval, but two peers down are two kinds: each peer is
// named, not only the one that failed last (the numbers of an address fold
// in lograte.Kind, so the peer is kept apart).
func TestRaftLinesAreLimitedPerKindAndPeer(t *testing.T) {
	var out bytes.Buffer
	h := hclogAdapter(slog.New(slog.NewTextHandler(&out, nil)))
	for i := range 50 {
		h.Error("failed to heartbeat to", "peer", "127.0.0.1:40159", "backoff time", i)
		h.Error("failed to heartbeat to", "peer", "127.0.0.1:40160", "backoff time", i)
		h.Error("failed to make requestVote RPC", "target", "{Voter n2 127.0.0.1:40159}", "error", "dial tcp: connection refused", "term", i)
		h.Error("failed to make requestVote RPC", "target", "{Voter n3 127.0.0.1:40160}", "error", "dial tcp: connection refused", "term", i)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("50 retries to each of two peers, of two kinds of line: %d lines logged, want 4 (one per kind and peer):\n%s", len(lines), out.String())
	}
	for _, peer := range []string{"40159 backoff", "40160 backoff", "n2 127.0.0.1:40159", "n3 127.0.0.1:40160"} {
		if !strings.Contains(out.String(), peer) {
			t.Errorf("no line names %q:\n%s", peer, out.String())
		}
	}
}

func TestRaftPeer(t *testing.T) {
	for msg, want := range map[string]string{
		`[ERROR] raft: failed to heartbeat to: peer=127.0.0.1:4001 backoff time=100ms`:                  "127.0.0.1:4001",
		`[ERROR] raft: failed to make requestVote RPC: target="{Voter n2 127.0.0.1:4002}" error="x"`:    "{Voter n2 127.0.0.1:4002}",
		`[ERROR] raft: failed to appendEntries to: peer="{Voter n3 127.0.0.1:4003}" error=EOF`:          "{Voter n3 127.0.0.1:4003}",
		`[WARN]  raft: heartbeat timeout reached, starting election: last-leader-addr= last-leader-id=`: "",
		`[ERROR] raft: peer=`: "",
		`[WARN]  raft: failed to contact: server-id=n4 time=1.5s`:                                                       "n4",
		`[WARN]  raft: duplicate requestVote from: candidate=127.0.0.1:4002`:                                            "127.0.0.1:4002",
		`[WARN]  raft: rejecting vote request since node is not a voter: from=127.0.0.1:4005`:                           "127.0.0.1:4005",
		`[WARN]  raft: clearing log suffix: from=1042 to=1050`:                                                          "",
		`[WARN]  raft: unable to get address for server, using fallback address: id=n3 fallback=127.0.0.1:4003 error=x`: "127.0.0.1:4003",
	} {
		if got := raftPeer(msg); got != want {
			t.Errorf("raftPeer(%q) = %q, want %q", msg, got, want)
		}
	}
}

// TestRaftFailedToContactNamesEachServer: the leader's lease check warns
// "failed to contact" per unreachable voter with server-id=, which
// raftPeer did not read; ids n4 and n5 differ only in a digit, which
// lograte.Kind folds, so with two voters unreachable (5 voters, quorum
// kept) only the first was ever named within the minute.
func TestRaftFailedToContactNamesEachServer(t *testing.T) {
	var out bytes.Buffer
	h := hclogAdapter(slog.New(slog.NewTextHandler(&out, nil)))
	for range 10 {
		h.Warn("failed to contact", "server-id", "n4", "time", "1.5s")
		h.Warn("failed to contact", "server-id", "n5", "time", "1.5s")
	}
	if !strings.Contains(out.String(), "server-id=n5") {
		t.Fatalf("two voters unreachable (n4, n5): only one named in the log:\n%s", out.String())
	}
}

// TestAStoppedNodesTransportLogsNoError: a clean stop (SIGTERM) closes the
// node's Raft transport while a leader's connection to it is open (an
// AppendEntries served, the connection pooled); the stream layer closes
// that connection itself, and the reader's "failed to decode incoming
// command: ... use of closed network connection" is the routine end of a
// shutdown, logged at Info. From a rolling upgrade run with the binaries:
// every node stopped logged it at Error.
func TestAStoppedNodesTransportLogsNoError(t *testing.T) {
	var out testlog.Buffer
	logger := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}))
	f, err := NewTransport("127.0.0.1:0", nil, 2*time.Second, logger)
	if err != nil {
		t.Fatal(err)
	}
	greetAsNone(t, f)
	l, err := NewTransport("127.0.0.1:0", nil, 2*time.Second, quiet)
	if err != nil {
		t.Fatal(err)
	}
	greetAsNone(t, l)
	defer l.Close()
	done, served := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(served)
		for {
			select {
			case rpc := <-f.Consumer():
				rpc.Respond(&raft.AppendEntriesResponse{Term: 1, Success: true}, nil)
			case <-done:
				return
			}
		}
	}()
	defer func() {
		close(done)
		<-served
	}()
	header := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte("l"), Addr: []byte(l.LocalAddr())}
	var ar raft.AppendEntriesResponse
	if err := l.AppendEntries("f", f.LocalAddr(), &raft.AppendEntriesRequest{RPCHeader: header, Term: 1}, &ar); err != nil {
		t.Fatal(err)
	}
	f.Close()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "failed to decode incoming command") {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 30s waiting for the reader of the closed connection to log its end; logged:\n%s", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if lines := out.Lines("level=ERROR"); len(lines) > 0 {
		t.Fatalf("a node's transport closed at its stop logged at Error: %s", lines[0])
	}
}
