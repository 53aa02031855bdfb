package enginesub

import (
	"bytes"
	"encoding/binary"
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

// badTSPayload is removedPayload with its ts a string: the decoder rejects
// it whole (engine.ErrPayload), yet its dp rank can be read first.
func badTSPayload(hash uint64, dp uint32) []byte {
	b := []byte{0x93, 0xa3, 'n', 'o', 'w', 0x91, 0x92, 0xac}
	b = append(b, "BlockRemoved"...)
	b = append(b, 0x91, 0xcf)
	b = binary.BigEndian.AppendUint64(b, hash)
	b = append(b, 0xce)
	return binary.BigEndian.AppendUint32(b, dp)
}

// TestARejectedBatchOfAnotherDPRankResyncsNothing: on an endpoint that
// carries several dp ranks' batches, once the subscriber has seen one of
// another rank's, a payload of that rank that the decoder rejects is
// counted as malformed and reaches the sink empty, as that rank's readable
// batches do: its events were never the followed rank's, and resyncing
// the followed rank for it cost a rebuild of the rank on the router. A
// rejected payload of the followed rank itself still resyncs it.
func TestARejectedBatchOfAnotherDPRankResyncsNothing(t *testing.T) {
	reg := prometheus.NewRegistry()
	sink := &recSink{}
	r := kvevent.Rank{Worker: 3}
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: sink, Registerer: reg,
		Logger: slog.New(slog.DiscardHandler), Rank: r, Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	for seq, payload := range [][]byte{
		removedPayload(hashOf(0), 3), // rank 3's first batch: its dp rank is read first from now on
		badTSPayload(hashOf(1), 3),   // rank 3's, rejected
		removedPayload(hashOf(2), 0), // the followed rank's own
		badTSPayload(hashOf(3), 0),   // the followed rank's, rejected: its remove is lost
	} {
		if err := s.core.live(bg, [][]byte{{}, seqFrame(uint64(seq)), payload}); err != nil {
			t.Fatal(err)
		}
	}
	want := []call{{kind: "ev", rank: r, seq: 0}, {kind: "ev", rank: r, seq: 1},
		{kind: "ev", rank: r, seq: 2, events: removedEvent(r, 2)}, {kind: "resync", rank: r, reason: ReasonBadPayload}}
	waitCalls(t, sink, &r, want)
	if st := s.Stats(); st.Malformed != 2 || st.Resyncs != 1 {
		t.Fatalf("stats: %d malformed, %d resyncs; want 2 malformed (one of each rank), 1 resync (the followed rank's)", st.Malformed, st.Resyncs)
	}
}
