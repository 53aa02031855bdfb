package enginesub

import "github.com/kvrouter/kvrouter/kvevent"

// A Sink receives what a Subscriber learns from one engine rank. A
// Subscriber calls its sink from its Run goroutine only, one call at a time;
// the subscribers of a Group share one sink and call it concurrently, each
// for its own rank.
type Sink interface {
	// Events receives the router events of one engine batch of rank r, with
	// its sequence number. Within an epoch, batches arrive in sequence order
	// and each at most once; a batch whose events were all filtered out by
	// the decoder arrives with none, as does one whose data_parallel_rank
	// names another dp rank than Config.Rank's (its events are another
	// rank's: engine.ReasonOtherDPRank). The events carry Config.Rank and
	// EventID 0.
	// evs and every slice in it are valid only during the call: a sink that
	// keeps them must copy them.
	//
	// A non-nil error says the sink did not take the batch. The batch is
	// then lost, and the subscriber calls Resync(r, ReasonSinkError) before
	// going on with the next one.
	Events(r kvevent.Rank, seq uint64, evs []kvevent.Event) error

	// Reset says rank r's engine restarted: a new epoch began, the engine's
	// cache is empty, and the rank's blocks must be cleared before the
	// batches that follow are applied.
	Reset(r kvevent.Rank)

	// Resync says rank r's state is unknown: batches were lost and cannot
	// be had again (reason says why). The rank must be rebuilt from scratch
	// (cleared, or replaced by a full dump); the batches that follow continue
	// from the one after the loss.
	Resync(r kvevent.Rank, reason Reason)
}

// Reason is why a rank was resynchronised. Its value is the metric label.
type Reason string

// Reasons for a resync.
const (
	// ReasonGap: batches were missed and there is no replay endpoint.
	ReasonGap Reason = "gap"
	// ReasonOverrun: the engine's replay buffer no longer holds the missed
	// batches (the replay started above the sequence asked for).
	ReasonOverrun Reason = "overrun"
	// ReasonReplayFailed: the replay timed out, failed, or ended before the
	// gap was filled.
	ReasonReplayFailed Reason = "replay_failed"
	// ReasonSinkError: Sink.Events refused a batch.
	ReasonSinkError Reason = "sink_error"
	// ReasonBadPayload: the decoder rejected a batch's payload whole (a
	// field of the wrong type, a truncated event): its events, valid ones
	// too, are lost.
	ReasonBadPayload Reason = "bad_payload"
)
