package compat

import (
	"log/slog"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
)

// TestAgentlessRestartBackoffIsCappedAndReset: a rank whose subscriber
// keeps stopping by itself waits twice as long each time, from the poll,
// up to maxRestartBackoff (30 s) and no longer; one that ran 30 s or more
// before it stopped starts again after a poll, its backoff reset. failed
// is called directly with how long the subscriber ran: no sleep.
func TestAgentlessRestartBackoffIsCappedAndReset(t *testing.T) {
	a := &Agentless{cfg: AgentlessConfig{Poll: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	w := agentlessSub{endpoint: "tcp://10.0.0.1:5557", blockSize: 4}
	backoff := func(ran time.Duration) time.Duration {
		t.Helper()
		before := time.Now()
		a.failed(r, &w, ran)
		rt := a.retry[r]
		if rt.at.Before(before.Add(rt.backoff)) || rt.at.After(time.Now().Add(rt.backoff)) {
			t.Fatalf("retry at %v, %v after it failed; want its backoff %v", rt.at, rt.at.Sub(before), rt.backoff)
		}
		return rt.backoff
	}
	if got := backoff(0); got != time.Second {
		t.Fatalf("the first failure waits %v, want the poll", got)
	}
	for _, want := range []time.Duration{2, 4, 8, 16, 30, 30, 30} {
		if got := backoff(time.Millisecond); got != want*time.Second {
			t.Fatalf("a subscriber that stopped at once waits %v, want %v", got, want*time.Second)
		}
	}
	if got := backoff(maxRestartBackoff - time.Millisecond); got != maxRestartBackoff {
		t.Fatalf("a subscriber that ran just under %v waits %v, want %v still", maxRestartBackoff, got, maxRestartBackoff)
	}
	if got := backoff(maxRestartBackoff); got != time.Second {
		t.Fatalf("a subscriber that ran %v waits %v, want the poll: its backoff reset", maxRestartBackoff, got)
	}
	if got := backoff(time.Millisecond); got != 2*time.Second {
		t.Fatalf("after the reset, a subscriber that stopped at once waits %v, want 2s", got)
	}
}

// TestAgentlessUnregisteredRankLogsItsDroppedBatchesOnce: a rank
// unregistered under its running subscriber has its engine's batches
// dropped, without an error (no history the rank should hold is lost, and
// a resync would clear nothing), until the next poll stops the
// subscriber; the sink logs that once, not a line per batch.
func TestAgentlessUnregisteredRankLogsItsDroppedBatchesOnce(t *testing.T) {
	ft := &unregisteredTarget{}
	var logs testlog.Buffer
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second},
		log: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))}
	r := kvevent.Rank{Worker: 1}
	s := &positionSink{a: a, rank: r}
	for seq := range uint64(5) {
		st := []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1 + seq, LocalHash: 2}}}}
		if err := s.Events(r, seq, st); err != nil {
			t.Fatalf("batch %d of an unregistered rank: %v, want it dropped without an error", seq, err)
		}
	}
	if ft.proposed != 5 {
		t.Fatalf("%d proposals of 5 batches", ft.proposed)
	}
	if got := logs.Lines("not registered any more"); len(got) != 1 {
		t.Fatalf("%d log lines for 5 dropped batches of an unregistered rank, want 1:\n%s", len(got), logs.String())
	}
}
