package enginesub

import (
	"bytes"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

// TestBatchesOfAnotherDPRankAreLeftOutAndLogged: an engine that publishes
// every dp rank's batches on one endpoint with one sequence (Dynamo's
// TensorRT-LLM relay with attention DP: [ts, [event], attention_dp_rank])
// reaches a subscriber that follows rank 0 with rank 3's batches too. They
// reach the sink empty (their sequence taken: no gap, no resync), counted
// under other_dp_rank, and the reason is logged once with what to do.
// Filed under rank 0, rank 3's removes took rank 0's blocks, and its
// blocks were routed to rank 0.
func TestBatchesOfAnotherDPRankAreLeftOutAndLogged(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	sink := &recSink{}
	r := kvevent.Rank{Worker: 3}
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: sink, Registerer: reg,
		Logger:  slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Rank:    r,
		Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	for seq := range uint64(4) {
		dp := uint32(3)
		if seq == 2 {
			dp = 0 // rank 0's own batch, between rank 3's
		}
		if err := s.core.live(bg, [][]byte{{}, seqFrame(seq), removedPayload(hashOf(seq), dp)}); err != nil {
			t.Fatal(err)
		}
	}
	want := []call{{kind: "ev", rank: r, seq: 0}, {kind: "ev", rank: r, seq: 1},
		{kind: "ev", rank: r, seq: 2, events: removedEvent(r, 2)}, {kind: "ev", rank: r, seq: 3}}
	waitCalls(t, sink, &r, want)
	series := counterSeries(t, reg, "kvagent_subscriber_skipped_events_total")
	if want := []string{"dp_rank=0,reason=other_dp_rank,worker=3 3"}; !slices.Equal(series, want) {
		t.Fatalf("kvagent_subscriber_skipped_events_total series %q, want %q", series, want)
	}
	if n := strings.Count(logs.String(), "engine events left out"); n != 1 ||
		!strings.Contains(logs.String(), "reason=other_dp_rank") ||
		!strings.Contains(logs.String(), "the engine publishes dp rank 3's events on the endpoint of rank 0") {
		t.Fatalf("%d log lines for the skipped events, want 1 naming the reason and the ranks:\n%s", n, logs.String())
	}
}
