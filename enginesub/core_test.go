package enginesub

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"bytes"
	"encoding/binary"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"log/slog"
	"math"
	"runtime"
	"slices"
	"strings"

	"github.com/tinylib/msgp/msgp"
)

// step is one thing a core test does: a live message, or a change to what
// the fake engine replays next.
type step struct {
	live    [][]byte
	replies [][][]byte // what the next replay answers
	err     error      // and the error it ends with
}

func live(seqs ...uint64) []step {
	var out []step
	for _, s := range seqs {
		out = append(out, step{live: liveMsg(s)})
	}
	return out
}

func replies(err error, seqs ...uint64) step {
	st := step{err: err}
	for _, s := range seqs {
		st.replies = append(st.replies, replyMsg(s, s%2 == 0))
	}
	if err == nil {
		st.replies = append(st.replies, endMsg)
	}
	return st
}

func steps(parts ...any) []step {
	var out []step
	for _, p := range parts {
		switch p := p.(type) {
		case step:
			out = append(out, p)
		case []step:
			out = append(out, p...)
		default:
			panic(fmt.Sprintf("steps: %T", p))
		}
	}
	return out
}

// TestSequenceRules drives the per-message handler through the cases of
// the package comment, with a fake engine for replays, and checks what the
// sink hears, in order.
func TestSequenceRules(t *testing.T) {
	timeout := fmt.Errorf("%w (fake)", errReplayTimeout)
	cases := []struct {
		name      string
		replay    bool    // the subscriber has a replay endpoint
		resume    *uint64 // Config.Resume
		bind      bool    // Config.Bind
		steps     []step
		fail      uint64 // the sink refuses this batch (0: none)
		want      string
		malformed uint64
	}{
		{name: "in order", steps: live(0, 1, 2), want: "ev0 ev1 ev2"},
		{name: "first message accepted whatever its seq", steps: live(7, 8), want: "ev7 ev8"},
		{name: "seq back to zero starts an epoch", steps: live(0, 1, 2, 0, 1),
			want: "ev0 ev1 ev2 reset ev0 ev1"},
		{name: "seq back to the same with other bytes starts an epoch", steps: steps(live(0, 1), restarted(1), live(2)),
			want: "ev0 ev1 reset resync:gap ev1 ev2"},
		// From a review: a second live copy of the last batch, byte for
		// byte, was taken for a restarted engine's and reset the rank.
		{name: "a live copy of the last batch is a duplicate", steps: live(0, 1, 1, 2),
			want: "ev0 ev1 ev2"},
		{name: "a live copy of the last batch is a duplicate, with replay", replay: true,
			steps: steps(replies(nil, 0, 1), live(0, 1, 1, 2)),
			want:  "ev0 ev1 ev2"},
		{name: "a live copy of a batch after a gap is a duplicate", replay: true,
			steps: steps(replies(nil, 2, 3), live(0, 1, 4, 4, 5)),
			want:  "ev0 ev1 replay:2 ev2 ev3 ev4 ev5"},
		{name: "new epoch first seen above zero is a gap", steps: live(0, 1, 2, 3, 4, 2, 3),
			want: "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev2 ev3"},
		{name: "gap without replay resyncs and goes on", steps: live(0, 1, 3, 4),
			want: "ev0 ev1 resync:gap ev3 ev4"},
		{name: "gap filled by replay, live duplicates skipped", replay: true,
			steps: steps(replies(nil, 2, 3, 4, 5, 6, 7), live(0, 1, 4, 5, 6, 7, 8)),
			want:  "ev0 ev1 replay:2 ev2 ev3 ev4 ev5 ev6 ev7 ev8"},
		{name: "replay that repeats applied batches skips them", replay: true,
			steps: steps(replies(nil, 0, 1, 2, 3), live(0, 1, 3, 4)),
			want:  "ev0 ev1 replay:2 ev2 ev3 ev4"},
		{name: "overrun resyncs and goes on from the live batch", replay: true,
			steps: steps(replies(nil, 3, 4, 5), live(0, 1, 5, 6)),
			want:  "ev0 ev1 replay:2 resync:overrun ev5 ev6"},
		{name: "hole in the replay is never applied past", replay: true,
			steps: steps(replies(nil, 2, 4, 5), live(0, 1, 5, 6)),
			want:  "ev0 ev1 replay:2 resync:replay_failed ev5 ev6"},
		{name: "replay ending short of the gap resyncs", replay: true,
			steps: steps(replies(nil, 2), live(0, 1, 4)),
			want:  "ev0 ev1 replay:2 ev2 resync:replay_failed ev4"},
		{name: "replay timeout resyncs", replay: true,
			steps: steps(replies(timeout), live(0, 1, 4)),
			want:  "ev0 ev1 replay:2 resync:replay_failed ev4"},
		// Its copy of 4 unseen, the batches may be a restarted engine's.
		{name: "replay that timed out before the live batch's copy resyncs", replay: true,
			steps: steps(replies(timeout, 2, 3), live(0, 1, 4)),
			want:  "ev0 ev1 replay:2 resync:replay_failed ev4"},
		{name: "replay that timed out after the live batch's copy heals", replay: true,
			steps: steps(replies(timeout, 2, 3, 4), live(0, 1, 4)),
			want:  "ev0 ev1 replay:2 ev2 ev3 ev4"},
		{name: "restart during a gap: new epoch replayed from zero", replay: true,
			steps: steps(live(0, 1, 2), restartedReplies(0, 1, 2), restarted(2), live(3)),
			want:  "ev0 ev1 ev2 reset replay:0 ev0 ev1 ev2 ev3"},
		// The restarted engine's 3 and 4 would be applied under the old
		// engine's 5, with no Resync: the gap looked filled.
		{name: "restart during a gap, replay timing out before the gap's end: nothing of it applied", replay: true,
			steps: steps(live(0, 1, 2), step{replies: [][][]byte{restarted(3)[0].live, restarted(4)[0].live}, err: timeout}, live(5)),
			want:  "ev0 ev1 ev2 replay:3 resync:replay_failed ev5"},
		{name: "sink refusal resyncs", steps: live(0, 1, 2), fail: 1,
			want: "ev0 ev1! resync:sink_error ev2"},
		// From a review: a payload the decoder rejects consumed its
		// sequence and lost its events, and the sink never heard of it:
		// the rank kept blocks the lost batch removed.
		{name: "undecodable payload consumes its seq and resyncs",
			steps: steps(live(0), step{live: [][]byte{{}, seqFrame(1), []byte("\xc1 not msgpack")}}, live(2)),
			want:  "ev0 resync:bad_payload ev2", malformed: 1},
		{name: "a batch rejected for a data_parallel_rank sent as a string resyncs",
			steps: steps(live(0), rejected(1, "dp rank as a string"), live(2)),
			want:  "ev0 resync:bad_payload ev2", malformed: 1},
		{name: "a truncated batch resyncs", steps: steps(live(0), rejected(1, "truncated"), live(2)),
			want: "ev0 resync:bad_payload ev2", malformed: 1},
		{name: "a run of rejected batches resyncs once, and asks no replay", replay: true,
			steps: steps(live(0), rejected(1, "truncated"), rejected(2, "truncated"), rejected(3, "dp rank as a string"), live(4)),
			want:  "ev0 resync:bad_payload ev4", malformed: 3},
		{name: "a rejected batch that shows a gap resyncs once",
			steps: steps(live(0), rejected(2, "truncated"), live(3)),
			want:  "ev0 resync:gap ev3", malformed: 1},
		{name: "a rejected batch right after a new epoch resyncs",
			steps: steps(live(0, 1, 2), rejected(0, "truncated"), live(1)),
			want:  "ev0 ev1 ev2 reset resync:bad_payload ev1", malformed: 1},
		// The sink's last call being a Resync spares a rejected payload its
		// resync only until a batch is applied or an epoch starts (resynced
		// cleared in apply and in newEpoch): later, the lost batch's
		// events may matter again.
		{name: "a rejected batch after a resync and an applied batch resyncs",
			steps: steps(live(0, 2, 3), rejected(4, "truncated"), live(5)),
			want:  "ev0 resync:gap ev2 ev3 resync:bad_payload ev5", malformed: 1},
		{name: "a rejected batch after a resync and a reset resyncs",
			steps: steps(live(0, 1, 2), rejected(3, "truncated"), rejected(0, "truncated"), live(1)),
			want:  "ev0 ev1 ev2 resync:bad_payload reset resync:bad_payload ev1", malformed: 2},
		{name: "a rejected batch in a replay resyncs, and the replay goes on", replay: true,
			steps: steps(step{replies: [][][]byte{replyMsg(2, true), {{}, seqFrame(3), rejectedPayload(3, "truncated")},
				replyMsg(4, false), endMsg}}, live(0, 1, 5)),
			want: "ev0 ev1 replay:2 ev2 resync:bad_payload ev4 ev5", malformed: 1},
		{name: "malformed replies are skipped", replay: true,
			steps: steps(step{replies: [][][]byte{
				{seqFrame(2), removedPayload(hashOf(2), 0)}, // no delimiter
				{{}, seqFrame(2)}, // one frame
				{{}, {}, {}, seqFrame(2), removedPayload(hashOf(2), 0)}, // four frames
				{{}, seqFrame(2)[:7], removedPayload(hashOf(2), 0)},     // 7-byte seq
				{{}, seqFrame(endSeq), {1}},                             // end marker with a payload
				replyMsg(2, true), replyMsg(3, false), endMsg}}, live(0, 1, 3)),
			want: "ev0 ev1 replay:2 ev2 ev3", malformed: 5},
		{name: "malformed live messages are skipped",
			steps: steps(live(0),
				step{live: [][]byte{{}}},
				step{live: [][]byte{{}, seqFrame(1)}},
				step{live: [][]byte{{}, seqFrame(1), removedPayload(1, 0), {}}},
				step{live: [][]byte{{}, seqFrame(1)[1:], removedPayload(1, 0)}},
				step{live: [][]byte{{}, seqFrame(endSeq), {}}},
				live(1)),
			want: "ev0 ev1", malformed: 5},
		{name: "resume: the expected batch first", resume: u64p(5), steps: live(5, 6), want: "ev5 ev6"},
		{name: "resume: a later batch first is a gap, replayed", resume: u64p(5), replay: true,
			steps: steps(replies(nil, 5, 6, 7), live(8)), want: "replay:5 ev5 ev6 ev7 ev8"},
		{name: "resume: a later batch first without replay resyncs", resume: u64p(5), steps: live(7, 8),
			want: "resync:gap ev7 ev8"},
		{name: "resume: an earlier batch first is a new epoch", resume: u64p(5), steps: live(0, 1),
			want: "reset ev0 ev1"},
		{name: "resume at zero: batch zero first", resume: u64p(0), steps: live(0, 1), want: "ev0 ev1"},
		{name: "resume at zero: a later batch is a gap", resume: u64p(0), steps: live(2), want: "resync:gap ev2"},
		// From a review: in bind mode, a reconnect while behind interleaves
		// the old connection's unread batches with the new one's; they were
		// taken for a restarted engine's, and reset the rank over and over.
		{name: "bind: the old connection's batches, read in turn with the new, are skipped", bind: true,
			steps: live(0, 1, 2, 5, 3, 6, 4, 7), want: "ev0 ev1 ev2 resync:gap ev5 ev6 ev7"},
		{name: "bind: the old connection's batches are skipped past a replay", bind: true, replay: true,
			steps: steps(replies(nil, 3, 4, 5), live(0, 1, 2, 5, 3, 6, 4, 7)),
			want:  "ev0 ev1 ev2 replay:3 ev3 ev4 ev5 ev6 ev7"},
		{name: "bind: the old connection's batches may have holes", bind: true,
			steps: live(0, 1, 2, 6, 3, 7, 5, 8), want: "ev0 ev1 ev2 resync:gap ev6 ev7 ev8"},
		{name: "bind: an old connection's batch is skipped however late it comes", bind: true,
			steps: live(0, 1, 2, 5, 6, 7, 3), want: "ev0 ev1 ev2 resync:gap ev5 ev6 ev7"},
		{name: "bind: the batch before the jump ends the old connection", bind: true,
			steps: live(0, 1, 2, 5, 3, 4, 0), want: "ev0 ev1 ev2 resync:gap ev5 reset ev0"},
		{name: "bind: seq back to zero starts an epoch", bind: true, steps: live(0, 1, 2, 0, 1),
			want: "ev0 ev1 ev2 reset ev0 ev1"},
		{name: "bind: a restart while behind: the old epoch's batches above the last one read", bind: true,
			steps: steps(live(0, 1, 2), restarted(0), live(3), restarted(1), live(4), restarted(2, 3)),
			want:  "ev0 ev1 ev2 reset ev0 resync:gap ev3 reset resync:gap ev1 resync:gap ev4 reset resync:gap ev2 ev3"},
		{name: "bind: a restarted engine first seen above zero starts an epoch", bind: true,
			steps: steps(live(0, 1, 2, 3, 4), restarted(2, 3)), want: "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev2 ev3"},
		{name: "bind: the last sequence again with other bytes starts an epoch, whatever its time", bind: true,
			steps: steps(live(0, 1, 2, 3, 4), stamped(0.5, 4)), want: "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev4"},
		{name: "bind: a step back whose time cannot be read starts an epoch", bind: true,
			steps: steps(live(0, 1, 2, 3, 4), step{live: [][]byte{{}, seqFrame(3), untimedPayload(hashOf(3))}}),
			want:  "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev3"},
		// From a second review: the window of the old connection's batches
		// opened only at a gap above the next batch expected, and not before
		// the new epoch passed the last one: a reconnect after a replay that
		// ran ahead of the live stream, or soon after a restart, reset the
		// rank at each of the old connection's batches.
		{name: "bind: after a replay ahead, the new connection starts just past it", bind: true, replay: true,
			steps: steps(replies(nil, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), live(0, 1, 2, 5, 6, 7), live(13, 8, 14, 9, 15)),
			want:  "ev0 ev1 ev2 replay:3 ev3 ev4 ev5 ev6 ev7 ev8 ev9 ev10 ev11 ev12 ev13 ev14 ev15"},
		{name: "bind: after a replay ahead, the new connection starts inside it", bind: true, replay: true,
			steps: steps(replies(nil, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), live(0, 1, 2, 5, 6, 7), live(11, 8, 12, 9, 13, 10, 14)),
			want:  "ev0 ev1 ev2 replay:3 ev3 ev4 ev5 ev6 ev7 ev8 ev9 ev10 ev11 ev12 ev13 ev14"},
		{name: "bind: a reconnect soon after a restart skips the old connection's batches", bind: true,
			steps: steps(live(0, 1, 2, 3, 4, 5), restarted(0, 1, 2, 10, 3, 11, 4, 12, 13)),
			want:  "ev0 ev1 ev2 ev3 ev4 ev5 reset ev0 ev1 ev2 resync:gap ev10 ev11 ev12 ev13"},
		{name: "bind: past the old epoch's last batch, a reconnect's batches are skipped too", bind: true,
			steps: steps(live(0, 1, 2), restarted(0, 1, 2, 3, 6, 4, 7)), want: "ev0 ev1 ev2 reset ev0 ev1 ev2 ev3 resync:gap ev6 ev7"},
		// With a ts coarser than the batches' spacing, as wire.md and the
		// decoder allow (a float32 Unix time steps every 128 s, an integer
		// one every second), an old connection's batches carry the ts of
		// the last one read: not older, each starts an epoch (a review
		// proved that skipping them left a restarted engine's batches
		// skipped too: TestBindRestartWhileBehindWithCoarseTS).
		{name: "bind: the old connection's batches with a float32 ts start epochs", bind: true,
			steps: coarse(1.7e9, false, 0, 1, 2, 5, 3, 6, 4, 7),
			want:  "ev0 ev1 ev2 resync:gap ev5 reset resync:gap ev3 resync:gap ev6 reset resync:gap ev4 resync:gap ev7"},
		{name: "bind: the old connection's batches with an integer ts start epochs", bind: true,
			steps: coarse(1.7e9, true, 0, 1, 2, 5, 3, 6, 4, 7),
			want:  "ev0 ev1 ev2 resync:gap ev5 reset resync:gap ev3 resync:gap ev6 reset resync:gap ev4 resync:gap ev7"},
		{name: "bind: with a coarse ts, a step back to zero starts an epoch", bind: true,
			steps: coarse(1.7e9, true, 0, 1, 2, 3, 0, 1), want: "ev0 ev1 ev2 ev3 reset ev0 ev1"},
		{name: "bind: with a coarse ts, a step back at a later ts starts an epoch", bind: true,
			steps: steps(coarse(1.7e9, true, 0, 1, 2, 3, 4), coarse(1.7e9+1, true, 2, 3)),
			want:  "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev2 ev3"},
		// From a review: the newest ts was the highest ever read, so that
		// one batch stamped far in the future (a host clock stepped back
		// since) made every later step back an old connection's, a
		// restarted engine's too, until it reached the last sequence seen.
		{name: "bind: a ts far ahead is not the newest for good", bind: true,
			steps: steps(live(0, 1, 2), stamped(1e12, 3), live(4), restarted(1, 2)),
			want:  "ev0 ev1 ev2 ev3 ev4 reset resync:gap ev1 ev2"},
		{name: "connect: a step back after a jump is a new epoch", steps: live(0, 1, 2, 5, 3),
			want: "ev0 ev1 ev2 resync:gap ev5 reset resync:gap ev3"},
		// A new epoch forgets what the last replay applied: the restarted
		// engine's batches 2 and 3, other bytes than the replayed ones, are
		// its own, not a second restart each. From a review: deleting
		// newEpoch's reset of the replayed batches left every test green.
		{name: "a restart after a replay resets once", replay: true,
			steps: steps(replies(nil, 2, 3, 4, 5), live(0, 1, 4, 5), restarted(0, 1, 2, 3)),
			want:  "ev0 ev1 replay:2 ev2 ev3 ev4 ev5 reset ev0 ev1 ev2 ev3"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sink := &recSink{}
			if tc.fail != 0 {
				sink.fail = func(seq uint64) bool { return seq == tc.fail }
			}
			var next step
			var replay replayFunc
			if tc.replay {
				replay = func(ctx context.Context, from uint64, each func([][]byte) bool) error {
					sink.add(call{kind: "replay", seq: from})
					for _, r := range next.replies {
						if !each(r) {
							return nil
						}
					}
					return next.err
				}
			}
			c := newCore(t, sink, replay)
			c.resume, c.bind = tc.resume, tc.bind
			for _, st := range tc.steps {
				if st.live == nil {
					next = st
					continue
				}
				if err := c.live(bg, st.live); err != nil {
					t.Fatal(err)
				}
			}
			got := sink.of(nil)
			if trace(got) != tc.want {
				t.Fatalf("sink calls:\n got %s\nwant %s", trace(got), tc.want)
			}
			for _, cl := range got {
				if cl.kind == "ev" && !eventsEqual(cl.events, removedEvent(kvevent.Rank{}, cl.seq)) {
					t.Fatalf("batch %d delivered %s", cl.seq, fmtEvents(cl.events))
				}
			}
			st := c.Stats()
			if st.Malformed != tc.malformed {
				t.Fatalf("malformed = %d, want %d", st.Malformed, tc.malformed)
			}
			var evs, resyncs, resets uint64
			for _, cl := range got {
				switch cl.kind {
				case "ev":
					evs++
				case "resync":
					resyncs++
				case "reset":
					resets++
				}
			}
			if st.Batches != evs || st.Resyncs != resyncs || st.Epochs != resets {
				t.Fatalf("stats %+v disagree with the sink's %d batches, %d resyncs, %d resets", st, evs, resyncs, resets)
			}
		})
	}
}

// TestReplayStopsWhenContextEnds checks that a cancellation during a replay
// returns at once, applying nothing more and resyncing nothing.
func TestReplayStopsWhenContextEnds(t *testing.T) {
	sink := &recSink{}
	ctx, cancel := context.WithCancel(context.Background())
	c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		cancel()
		return ctx.Err()
	})
	if err := c.live(ctx, liveMsg(0)); err != nil {
		t.Fatal(err)
	}
	if err := c.live(ctx, liveMsg(2)); !errors.Is(err, context.Canceled) {
		t.Fatalf("live during a cancelled replay: %v, want context.Canceled", err)
	}
	if got := trace(sink.of(nil)); got != "ev0" {
		t.Fatalf("sink calls %s, want ev0", got)
	}
}

// TestLiveCopyOfLastBatchCountsAsDuplicate: the second live copy of a
// batch is counted (Stats and kvagent_subscriber_duplicates_total) as a
// duplicate, not as an epoch.
func TestLiveCopyOfLastBatchCountsAsDuplicate(t *testing.T) {
	c := newCore(t, &recSink{}, nil)
	for _, msg := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(1), liveMsg(1)} {
		if err := c.live(bg, msg); err != nil {
			t.Fatal(err)
		}
	}
	if st := c.Stats(); st.Duplicates != 2 || st.Epochs != 0 || st.Batches != 2 {
		t.Fatalf("stats %+v, want 2 batches, 2 duplicates, 0 epochs", st)
	}
}

// TestReplayedCountsAppliedBatchesOnly: Stats.Replayed counts the batches
// a replay applied, not a replayed payload the decoder rejects (counted
// Malformed, and resynced).
func TestReplayedCountsAppliedBatchesOnly(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		for _, r := range [][][]byte{replyMsg(2, true), {{}, seqFrame(3), rejectedPayload(3, "truncated")}, replyMsg(4, false), replyMsg(5, false), endMsg} {
			if !each(r) {
				return nil
			}
		}
		return nil
	})
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(5)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := trace(sink.of(nil)), "ev0 ev1 ev2 resync:bad_payload ev4 ev5"; got != want {
		t.Fatalf("sink calls %s, want %s", got, want)
	}
	if st := c.Stats(); st.Replayed != 3 || st.Malformed != 1 {
		t.Fatalf("Replayed = %d, Malformed = %d, want 3 (batches 2, 4 and 5 applied) and 1 (3 rejected)", st.Replayed, st.Malformed)
	}
}

// TestReplayFromARestartedEngineIsNotApplied: the subscriber is behind,
// the engine restarts, and the SUB queue drops the old engine's batch 4
// and the new engine's batches 0 to 6. The old engine's batch 5 shows the
// gap; the replay is the restarted engine's, whose batch 5 has other bytes
// than the one just read live. Applied on the old epoch's state, it would
// leave the old engine's blocks on the sink for good, under the new
// engine's: the rank starts a new epoch and is replayed from 0 instead.
func TestReplayFromARestartedEngineIsNotApplied(t *testing.T) {
	sink := &recSink{}
	top := uint64(6) // the restarted engine's buffer: its batches 0 to 6
	c := newCore(t, sink, restartedReplay(sink, &top))
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	// The engine publishes its batch 7, which the live stream brings: above
	// every batch replayed, it may be the old engine's still, queued behind
	// 5. A replay tells: the engine's copy of 7 has its bytes. It is asked
	// from 6, the epoch's last batch, whose copy shows the engine has not
	// restarted again since.
	top = 7
	if err := c.live(bg, restartedMsg(7)); err != nil {
		t.Fatal(err)
	}
	calls := sink.of(nil)
	synced := false
	for _, cl := range calls {
		switch cl.kind {
		case "reset", "resync":
			synced = true
		case "ev":
			if !synced && cl.events[0].Removed[0] >= restartedHash(0) {
				t.Fatalf("the restarted engine's batch %d reached the sink on the old epoch's state, with no Reset or Resync before it:\n%s",
					cl.seq, trace(calls)+"\n"+fmtEvents(cl.events))
			}
		}
	}
	if got, want := trace(calls), "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 ev6 replay:6 ev7"; got != want {
		t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
	}
	if st := c.Stats(); st.Epochs != 1 || st.Resyncs != 0 || st.Replays != 3 || st.Replayed != 8 {
		t.Fatalf("stats %+v, want 1 epoch, no resync, 3 replays, 8 batches replayed", st)
	}
	// The first replay, answered by the restarted engine, is counted as
	// such (no other test pinned the outcome).
	var m dto.Metric
	if err := c.m.replays.WithLabelValues("restarted").Write(&m); err != nil || m.GetCounter().GetValue() != 1 {
		t.Fatalf("kvagent_subscriber_replays_total{outcome=\"restarted\"} = %v (%v), want 1", m.GetCounter().GetValue(), err)
	}
}

// TestOldEngineBatchesQueuedAfterARestartStartNoEpoch: connect mode. The
// subscriber is behind; the SUB queue lost the old engine's batch 4 but
// holds its batches 5 to 8, published before it died. When 5 is read the
// engine has restarted and published its batches 0 to 9: the gap's replay
// tells the restart (its 5 has other bytes), and the rank is reset and
// replayed from 0. The old engine's 6, 7 and 8, queued still, then come
// live, each with other bytes than the new engine's batch of its sequence
// the replay applied: they are the dead engine's, skipped (counted
// duplicates), not one more restart each (a Reset and a replay from 0).
func TestOldEngineBatchesQueuedAfterARestartStartNoEpoch(t *testing.T) {
	sink := &recSink{}
	top := uint64(9)
	c := newCore(t, sink, restartedReplay(sink, &top))
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5), liveMsg(6), liveMsg(7), liveMsg(8),
		restartedMsg(9), restartedMsg(10)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := trace(sink.of(nil)), "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 ev6 ev7 ev8 ev9 ev10"; got != want {
		t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
	}
	if st := c.Stats(); st.Epochs != 1 || st.Replays != 2 || st.Resyncs != 0 || st.Duplicates != 4 {
		t.Fatalf("stats %+v, want 1 epoch, 2 replays, no resync, 4 duplicates (old 6, 7, 8 and the live copy of 9)", st)
	}
}

// TestOldEngineBatchesAboveTheRestartedEnginesAreSkipped: as
// TestOldEngineBatchesQueuedAfterARestartStartNoEpoch, but the restarted
// engine has published only its batches 0 to 5 when the old engine's 5 is
// read. The old engine's queued 6, 7 and 8 are above every batch the
// replay applied, and the next expected: taken for the new epoch's, the
// rank would keep the dead engine's 6 to 8 for good (the new engine's
// first live batch read, 9, comes with no gap). A replay asked for each
// tells: the engine has not published it, so it is the old engine's,
// skipped. The new engine's 9 is in its replay, with its bytes: the
// replay applies 6 to 9, and the stream is the new engine's again.
func TestOldEngineBatchesAboveTheRestartedEnginesAreSkipped(t *testing.T) {
	sink := &recSink{}
	top := uint64(5) // the restarted engine's last batch published
	c := newCore(t, sink, restartedReplay(sink, &top))
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5), liveMsg(6), liveMsg(7), liveMsg(8)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	top = 10
	for _, m := range [][][]byte{restartedMsg(9), restartedMsg(10), restartedMsg(11)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	// What the rank holds: the batches applied since the last Reset or
	// Resync, all the restarted engine's.
	var held []uint64
	reset := false
	for _, cl := range calls {
		switch cl.kind {
		case "reset", "resync":
			held, reset = held[:0], true
		case "ev":
			if h := cl.events[0].Removed[0]; reset && h != restartedHash(cl.seq) {
				t.Fatalf("batch %d applied with hash %#x, the old engine's, after its restart was seen:\n%s", cl.seq, h, trace(calls))
			}
			held = append(held, cl.seq)
		}
	}
	if len(held) != 12 || held[0] != 0 || held[11] != 11 {
		t.Fatalf("the rank holds batches %v since its last Reset or Resync, want 0 to 11:\n%s", held, trace(calls))
	}
	want := "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 replay:5 replay:5 replay:5 ev6 ev7 ev8 ev9 ev10 ev11"
	if got := trace(calls); got != want {
		t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
	}
	if st := c.Stats(); st.Epochs != 1 || st.Resyncs != 0 {
		t.Fatalf("stats %+v, want 1 epoch, no resync", st)
	}
}

// TestRestartedEnginesConnectionAfterOldBatchesStartsNoEpoch: after a
// gap's replay showed the engine restarted, and the old engine's 7, still
// queued, was skipped, the restarted engine's connection brings its
// batches, below the last one read: a step back, which outside of this
// is a restart, here is the epoch already started. Those the replay
// applied are skipped by their bytes; one above is asked of the engine
// (its copy has the same bytes) and applied with the batches below it.
func TestRestartedEnginesConnectionAfterOldBatchesStartsNoEpoch(t *testing.T) {
	for _, tc := range []struct {
		name  string
		top   uint64 // the restarted engine's last batch when 5 is read
		first uint64 // its first batch read live
		want  string
	}{
		{"into the batches replayed", 9, 4,
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 ev6 ev7 ev8 ev9 ev10"},
		{"at the next batch", 5, 6,
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 replay:5 ev6 ev7 ev8 ev9 ev10"},
		{"above the next batch", 5, 7,
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 replay:5 ev6 ev7 ev8 ev9 ev10"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := &recSink{}
			top := tc.top
			c := newCore(t, sink, restartedReplay(sink, &top))
			for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5), liveMsg(7)} {
				if err := c.live(bg, m); err != nil {
					t.Fatal(err)
				}
			}
			top = 10
			for s := tc.first; s <= 10; s++ {
				if err := c.live(bg, restartedMsg(s)); err != nil {
					t.Fatal(err)
				}
			}
			if got := trace(sink.of(nil)); got != tc.want {
				t.Fatalf("sink calls:\n got %s\nwant %s", got, tc.want)
			}
			if st := c.Stats(); st.Epochs != 1 || st.Resyncs != 0 {
				t.Fatalf("stats %+v, want 1 epoch, no resync", st)
			}
		})
	}
}

// TestStaleBatchWhoseReplayFailsOrOverruns: after a gap's replay showed
// the engine restarted, a live batch above what the rank holds may be the
// old engine's (queued still) or the new one's; the engine is asked for
// it. A replay that fails says nothing: the batch is skipped and the rank
// resynced (it may have been the new engine's), and the next live batch
// asks again, from the next sequence expected (the first asked from the
// epoch's last batch too, which the resync dropped). A replay that overran still shows
// the engine's copy of the batch: the same bytes, the batch is applied
// after a resync; other bytes, it is skipped, the rank resynced.
func TestStaleBatchWhoseReplayFailsOrOverruns(t *testing.T) {
	timeout := fmt.Errorf("%w (fake)", errReplayTimeout)
	for _, tc := range []struct {
		name  string
		low   uint64 // the restarted engine's first batch buffered, once 5 is read
		fail  bool   // the replays after the restart is seen time out
		first [][]byte
		want  string
	}{
		{"replay fails: skipped, resynced, asked again", 0, true, liveMsg(6),
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 resync:replay_failed replay:6 ev6 ev7 ev8"},
		{"overrun, the new engine's copy: applied", 7, false, restartedMsg(7),
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 resync:overrun ev7 ev8"},
		{"overrun, the old engine's: skipped", 7, false, liveMsg(7),
			"ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 resync:overrun replay:6 ev8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := &recSink{}
			low, top, failing := uint64(0), uint64(5), false
			c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
				sink.add(call{kind: "replay", seq: from})
				if failing {
					failing = false
					return timeout
				}
				for s := max(from, low); s <= top; s++ {
					if !each(restartedMsg(s)) {
						return nil
					}
				}
				each(endMsg)
				return nil
			})
			for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
				if err := c.live(bg, m); err != nil {
					t.Fatal(err)
				}
			}
			low, top, failing = tc.low, 8, tc.fail
			for _, m := range [][][]byte{tc.first, restartedMsg(8)} {
				if err := c.live(bg, m); err != nil {
					t.Fatal(err)
				}
			}
			if got := trace(sink.of(nil)); got != tc.want {
				t.Fatalf("sink calls:\n got %s\nwant %s", got, tc.want)
			}
			if st := c.Stats(); st.Epochs != 1 {
				t.Fatalf("stats %+v, want 1 epoch", st)
			}
		})
	}
}

// TestEngineRestartingAgainWhileStaleStartsAnEpoch: a gap's replay shows
// the engine restarted (engine B, which has published its batches 0 to
// 5): the rank is reset, B's 0 to 5 applied, and the stream is stale. B
// dies before any live batch of its own is read, and engine C starts and
// publishes its 0 to 7 live. C's 0 to 5 are below what the rank holds
// (skipped), and C's 6, asked of the engine, has C's bytes: taken for the
// epoch's, C's batches would be applied on B's for good. The replay that
// verifies 6 reads the engine's copy of B's 5 first, whose other bytes
// show C restarted since: the rank starts a new epoch and holds C's 0 to
// 7 only.
func TestEngineRestartingAgainWhileStaleStartsAnEpoch(t *testing.T) {
	for _, bind := range []bool{false, true} {
		t.Run(fmt.Sprintf("bind=%v", bind), func(t *testing.T) {
			c, sink, toC := staleAfterARestart(t, bind)
			toC(7)
			for s := uint64(0); s <= 7; s++ {
				if err := c.live(bg, thirdMsg(s)); err != nil {
					t.Fatal(err)
				}
			}
			calls := sink.of(nil)
			if got, want := fmt.Sprint(heldSince(calls)), "[C0 C1 C2 C3 C4 C5 C6 C7]"; got != want {
				t.Fatalf("the rank holds %s since its last Reset or Resync, want %s\ncalls: %s\nstats %+v", got, want, trace(calls), c.Stats())
			}
			want := "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 ev6 ev7"
			if got := trace(calls); got != want {
				t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
			}
			if st := c.Stats(); st.Epochs != 2 || st.Resyncs != 0 || c.stale {
				t.Fatalf("stats %+v, stale %v: want 2 epochs, no resync, the stream C's", st, c.stale)
			}
		})
	}
}

// TestStaleReplayEndingBelowTheMarkStartsAnEpoch: as
// TestEngineRestartingAgainWhileStaleStartsAnEpoch, but engine C has
// published its 0 to 2 only when engine B's queued live batch 6 is asked
// of it. The replay from the epoch's mark (B's 5) ends with no batch at
// all: the engine answering has not published 5, which the epoch applied
// from it, and an engine's sequence only rises, so it restarted again
// (not: 6 is an earlier engine's). Taken for that, 6 would be skipped,
// B's epoch kept, and C's live 0 to 2 skipped as below the next expected:
// the rank would keep the dead B's blocks, with no Reset or Resync, until
// C published past them. The rank starts a new epoch and holds C's 0 to
// 2 only.
func TestStaleReplayEndingBelowTheMarkStartsAnEpoch(t *testing.T) {
	c, sink, toC := staleAfterARestart(t, false)
	if !c.stale || !c.markOK || c.markSeq != 5 {
		t.Fatalf("setup: stale %v markOK %v mark %d, want a stale epoch marked at 5", c.stale, c.markOK, c.markSeq)
	}
	toC(2) // B restarts as C, which publishes its 0 to 2 and idles
	for _, m := range [][][]byte{restartedMsg(6), thirdMsg(0), thirdMsg(1), thirdMsg(2)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	if got, want := fmt.Sprint(heldSince(calls)), "[C0 C1 C2]"; got != want {
		t.Fatalf("the rank holds %s since its last Reset or Resync, want %s\ncalls: %s\nstats %+v", got, want, trace(calls), c.Stats())
	}
	if st := c.Stats(); st.Epochs != 2 || st.Resyncs != 0 || c.stale {
		t.Fatalf("stats %+v, stale %v: want 2 epochs, no resync, the stream C's", st, c.stale)
	}
}

// staleAfterARestart returns a core (bind or connect) that read the old
// engine's live 0 to 3 and then 5: the gap's replay showed the engine
// restarted as B (reset, B's 0 to 5 replayed), and the rank is stale,
// marked at B's 5. toC(top) restarts B as C, whose replays answer its 0
// to top from then on.
func staleAfterARestart(t *testing.T, bind bool) (c *core, sink *recSink, toC func(top uint64)) {
	t.Helper()
	sink = &recSink{}
	engineC := false
	top := uint64(5)
	c = newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		sink.add(call{kind: "replay", seq: from})
		for s := from; s <= top; s++ {
			m := restartedMsg(s)
			if engineC {
				m = thirdMsg(s)
			}
			if !each(m) {
				return nil
			}
		}
		each(endMsg)
		return nil
	})
	c.bind = bind
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	return c, sink, func(t uint64) { engineC, top = true, t }
}

// TestStaleReplayFromAMarkTheEngineNoLongerHoldsIsNoOverrun: the restarted
// engine's replay buffer holds batches 6.. (its oldest is exactly the next
// batch the subscriber expects). A stale verification replays from the
// epoch's mark (5), which the engine no longer holds: the mark is left
// unchecked, and the replay, missing nothing from c.next on, is no
// overrun: the rank is not resynced.
func TestStaleReplayFromAMarkTheEngineNoLongerHoldsIsNoOverrun(t *testing.T) {
	for _, live := range []struct {
		name  string
		msg   [][]byte
		stale bool // after the live batch
	}{{"old engine's queued batch 6", liveMsg(6), true}, {"restarted engine's batch 6", restartedMsg(6), false}} {
		t.Run(live.name, func(t *testing.T) {
			sink := &recSink{}
			top, oldest := uint64(5), uint64(0)
			c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
				sink.add(call{kind: "replay", seq: from})
				for s := max(from, oldest); s <= top; s++ {
					if !each(restartedMsg(s)) {
						return nil
					}
				}
				each(endMsg)
				return nil
			})
			for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
				if err := c.live(bg, m); err != nil {
					t.Fatal(err)
				}
			}
			if !c.stale || !c.markOK || c.next != 6 {
				t.Fatalf("setup: stale %v markOK %v next %d", c.stale, c.markOK, c.next)
			}
			// The engine published on; its buffer now starts at 6.
			top, oldest = 8, 6
			before := len(sink.of(nil))
			if err := c.live(bg, live.msg); err != nil {
				t.Fatal(err)
			}
			calls := sink.of(nil)[before:]
			if st := c.Stats(); st.Resyncs != 0 {
				t.Errorf("rank resynced (%d) though the engine holds every batch from c.next=6 on: calls %s, stats %+v", st.Resyncs, trace(calls), st)
			}
			if c.stale != live.stale {
				t.Errorf("stale %v after the live batch, want %v: calls %s", c.stale, live.stale, trace(calls))
			}
		})
	}
}

// TestStaleEndsAfterReplaysKeepFailing: after a gap's replay showed the
// engine restarted, the replay socket goes down for good (every replay
// times out), and the restarted engine's live batches 6 to 30 come in
// order. Outside of stale a replay socket down costs nothing while no gap
// shows; stale, each batch asks a replay, and waiting for one to answer
// would skip every batch of the engine for ever. The first failure
// resyncs the rank, and the maxStaleFails-th in a row ends stale: that
// batch and the next are applied on the resynced rank. The batches
// skipped meanwhile are counted unverified, not as duplicates.
func TestStaleEndsAfterReplaysKeepFailing(t *testing.T) {
	sink := &recSink{}
	top, down := uint64(5), false
	timeout := fmt.Errorf("%w (fake)", errReplayTimeout)
	c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		sink.add(call{kind: "replay", seq: from})
		if down {
			return timeout
		}
		for s := from; s <= top; s++ {
			if !each(restartedMsg(s)) {
				return nil
			}
		}
		each(endMsg)
		return nil
	})
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	down = true
	before, dups := len(sink.of(nil)), c.Stats().Duplicates
	for s := uint64(6); s <= 30; s++ {
		if err := c.live(bg, restartedMsg(s)); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	var want []string
	for s := maxStaleFails + 5; s <= 30; s++ {
		want = append(want, fmt.Sprintf("ev%d", s))
	}
	if got, want := trace(calls[before:]), "replay:5 resync:replay_failed replay:6 replay:6 "+strings.Join(want, " "); got != want {
		t.Fatalf("sink calls after the replay socket went down:\n got %s\nwant %s", got, want)
	}
	st := c.Stats()
	if st.Unverified != maxStaleFails-1 || st.Duplicates != dups || st.Epochs != 1 || st.Resyncs != 1 || c.stale {
		t.Fatalf("stats %+v, stale %v: want %d unverified, no more duplicates (%d), 1 epoch, 1 resync, the stream no longer stale",
			st, c.stale, maxStaleFails-1, dups)
	}
	var m dto.Metric
	if err := c.m.unverified.Write(&m); err != nil || m.GetCounter().GetValue() != maxStaleFails-1 {
		t.Fatalf("kvagent_subscriber_unverified_total = %v (%v), want %d", m.GetCounter().GetValue(), err, maxStaleFails-1)
	}
}

// TestStaleBatchShownToBeAnEarlierEnginesCountsStale: after a gap's replay
// showed the engine restarted (its batches 0 to 5), the old engine's
// queued 6, 7 and 8 are each asked of the engine: 6 and 7 it has not
// published (the replay ends before them), 8 it has, by then, with other
// bytes. Each replay did what it was asked and shows a dead engine's
// batch: kvagent_subscriber_replays_total counts them stale, not failed
// (a broken replay socket's count), healed (the replay from 0 alone) or
// restarted (the gap's replay alone).
func TestStaleBatchShownToBeAnEarlierEnginesCountsStale(t *testing.T) {
	sink := &recSink{}
	top := uint64(5)
	c := newCore(t, sink, restartedReplay(sink, &top))
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5), liveMsg(6), liveMsg(7)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	top = 8
	for _, m := range [][][]byte{liveMsg(8)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	if got, want := trace(calls), "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5 replay:5 replay:5"; got != want {
		t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
	}
	for outcome, want := range map[string]float64{"stale": 3, "failed": 0, "healed": 1, "restarted": 1} {
		var m dto.Metric
		if err := c.m.replays.WithLabelValues(outcome).Write(&m); err != nil || m.GetCounter().GetValue() != want {
			t.Errorf("kvagent_subscriber_replays_total{outcome=%q} = %v (%v), want %v", outcome, m.GetCounter().GetValue(), err, want)
		}
	}
	if st := c.Stats(); st.Duplicates != 3 || st.Resyncs != 0 || !c.stale {
		t.Fatalf("stats %+v, stale %v: want 3 duplicates, no resync, the stream stale still", st, c.stale)
	}
}

// TestStaleReplayEndingBeforeTheLiveBatchAppliesNothing: after a gap's
// replay showed the engine restarted (its batches 0 to 5), the engine
// publishes its 6 and 7, and the old engine's queued 9 comes live (its 6
// to 8 lost). The replay asked for 9 holds the engine's 6 and 7 and ends
// before 9: the live batch is the dead engine's, skipped, and the batches
// the replay held are not applied for it; the engine's own live batch,
// when one comes (6), asks for them again, and is shown to be its own.
func TestStaleReplayEndingBeforeTheLiveBatchAppliesNothing(t *testing.T) {
	sink := &recSink{}
	top := uint64(5)
	c := newCore(t, sink, restartedReplay(sink, &top))
	for _, m := range [][][]byte{liveMsg(0), liveMsg(1), liveMsg(2), liveMsg(3), liveMsg(5)} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	top = 7
	if err := c.live(bg, liveMsg(9)); err != nil {
		t.Fatal(err)
	}
	before := "ev0 ev1 ev2 ev3 replay:4 reset replay:0 ev0 ev1 ev2 ev3 ev4 ev5 replay:5"
	if got := trace(sink.of(nil)); got != before {
		t.Fatalf("sink calls after the old engine's 9:\n got %s\nwant %s", got, before)
	}
	top = 8
	for s := uint64(6); s <= 8; s++ {
		if err := c.live(bg, restartedMsg(s)); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := trace(sink.of(nil)), before+" replay:5 ev6 ev7 ev8"; got != want {
		t.Fatalf("sink calls:\n got %s\nwant %s", got, want)
	}
	if st := c.Stats(); st.Epochs != 1 || st.Resyncs != 0 || st.Replayed != 9 || c.stale {
		t.Fatalf("stats %+v, stale %v: want 1 epoch, no resync, 9 batches replayed, the stream the engine's", st, c.stale)
	}
}

func u64p(v uint64) *uint64 { return &v }

// TestCatchUpOnResume: a resuming subscriber with a replay endpoint asks
// for what it missed before any live batch; an overrun resyncs and the
// next live batch is taken whatever its sequence.
func TestCatchUpOnResume(t *testing.T) {
	for _, tc := range []struct {
		name    string
		resume  uint64
		replies step
		live    []step
		want    string
	}{
		{"missed batches replayed at once", 5, replies(nil, 5, 6, 7), live(8), "replay:5 ev5 ev6 ev7 ev8"},
		{"nothing missed", 5, replies(nil), live(5, 6), "replay:5 ev5 ev6"},
		{"overrun resyncs, then the live stream is taken", 5, replies(nil, 7, 8), live(9, 10), "replay:5 resync:overrun ev9 ev10"},
		// Before, a catch-up whose replay failed counted as healed: the
		// gap of a resume has no end but the replay's own.
		{"a replay that fails resyncs", 5, replies(errors.New("no answer")), live(7, 8), "replay:5 resync:replay_failed ev7 ev8"},
		{"a replay that fails after some batches resyncs", 5, replies(errors.New("cut"), 5, 6), live(9), "replay:5 ev5 ev6 resync:replay_failed ev9"},
		{"a replay with a hole resyncs", 5, replies(nil, 5, 7), live(9), "replay:5 ev5 resync:replay_failed ev9"},
		// The live copies of replayed batches, queued while the replay
		// ran, are duplicates, also when the replay started at 0.
		{"live copies of the replay are duplicates", 5, replies(nil, 5, 6, 7), live(6, 7, 8), "replay:5 ev5 ev6 ev7 ev8"},
		{"live copies of a replay from 0 are duplicates", 0, replies(nil, 0, 1, 2), live(0, 1, 2, 3), "replay:0 ev0 ev1 ev2 ev3"},
		// From a review: after a catch-up from 0, the restarted engine's
		// 0, 1, 2 were dropped as duplicates and its 3 applied on the old
		// epoch's state, for good.
		{"a restart after a replay from 0 starts an epoch", 0, replies(nil, 0, 1, 2), restarted(0, 1, 2, 3),
			"replay:0 ev0 ev1 ev2 reset ev0 ev1 ev2 ev3"},
		{"a restart after a replay starts an epoch", 5, replies(nil, 5, 6, 7), restarted(0, 1), "replay:5 ev5 ev6 ev7 reset ev0 ev1"},
		// From a review: the live copy of a batch that a failed catch-up
		// applied reached the sink a second time.
		{"a failed catch-up's batches are not applied again", 5, replies(errors.New("cut"), 5, 6), live(6, 7),
			"replay:5 ev5 ev6 resync:replay_failed ev7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sink := &recSink{}
			c := newCore(t, sink, func(ctx context.Context, from uint64, each func([][]byte) bool) error {
				sink.add(call{kind: "replay", seq: from})
				for _, r := range tc.replies.replies {
					if !each(r) {
						return nil
					}
				}
				return tc.replies.err
			})
			c.resume = u64p(tc.resume)
			if err := c.catchUp(bg); err != nil {
				t.Fatal(err)
			}
			for _, st := range tc.live {
				if err := c.live(bg, st.live); err != nil {
					t.Fatal(err)
				}
			}
			if got := trace(sink.of(nil)); got != tc.want {
				t.Fatalf("sink calls:\n got %s\nwant %s", got, tc.want)
			}
		})
	}
}

// TestBindRestartWhileBehindWithCoarseTS: in bind mode an engine restarts
// while the subscriber is behind, within one ts step (the same whole
// second, or float32 step), and its batch 0 is read: the old connection's
// next batch, above it, is then a gap, and the restarted engine's next
// batches step back below it with the same ts. From a review: when an
// equal ts counted as an old connection's, they were all skipped as
// duplicates until the engine's sequence came back to the old one's last,
// and the rank kept the old engine's batches applied after the reset.
func TestBindRestartWhileBehindWithCoarseTS(t *testing.T) {
	for _, asInt := range []bool{true, false} {
		t.Run(fmt.Sprintf("int=%v", asInt), func(t *testing.T) {
			const oldHash, newHash = 0xab000000, 0xcd000000
			const T = 1.7e9
			const lastOld = 1000 // the old engine published 0..1000
			const read = 997     // the subscriber read 0..997; the old pipe holds 998..1000
			msg := func(seq, hash uint64, ts float64) [][]byte {
				p := removedPayload(hash, 0)
				b := []byte{p[0]}
				if asInt {
					b = binary.BigEndian.AppendUint32(append(b, 0xce), uint32(ts))
				} else {
					b = binary.BigEndian.AppendUint32(append(b, 0xca), math.Float32bits(float32(ts)))
				}
				return [][]byte{{}, seqFrame(seq), append(b, p[10:]...)}
			}
			sink := &recSink{}
			c := newCore(t, sink, nil)
			c.bind = true
			feed := func(m [][]byte) {
				if err := c.live(bg, m); err != nil {
					t.Fatal(err)
				}
			}
			for s := uint64(0); s <= read; s++ {
				feed(msg(s, oldHash+s, T+float64(s)*0.01))
			}
			// The restarted engine (new pipe) and the old pipe, read in turn.
			ts := T + 10.5
			newSeq := uint64(0)
			for s := uint64(read + 1); s <= lastOld; s++ {
				feed(msg(newSeq, newHash+newSeq, ts))
				newSeq++
				feed(msg(s, oldHash+s, T+float64(s)*0.01))
			}
			for ; newSeq < 50; newSeq++ { // the old pipe is drained
				feed(msg(newSeq, newHash+newSeq, ts))
			}
			calls := sink.of(nil)
			last := -1
			for i, cl := range calls {
				if cl.kind == "reset" {
					last = i
				}
			}
			var newAfter, oldAfter int
			for _, cl := range calls[last+1:] {
				if cl.kind != "ev" {
					continue
				}
				if cl.events[0].Removed[0] >= newHash {
					newAfter++
				} else {
					oldAfter++
				}
			}
			// The new engine's batches 3..49, read after the old pipe's
			// last, reach the sink after the last reset, and none of the
			// old engine's after it.
			if st := c.Stats(); oldAfter != 0 || newAfter < 47 {
				t.Fatalf("after the last reset the sink got %d old-engine and %d new-engine batches, want 0 and >= 47 (the restarted engine's batches 3..49); stats %+v",
					oldAfter, newAfter, st)
			}
		})
	}
}

// restarted is live batches of a restarted engine: the same sequences and
// events as live's, other bytes (a real batch carries its publish time).
func restarted(seqs ...uint64) []step {
	var out []step
	for _, s := range seqs {
		out = append(out, stamped(2.5+float64(s)/4096, s)...)
	}
	return out
}

// restartedReplies is what the next replay answers when the engine
// restarted (restarted): its batches seqs, and the end.
func restartedReplies(seqs ...uint64) step {
	var st step
	for _, s := range seqs {
		st.replies = append(st.replies, restarted(s)[0].live)
	}
	st.replies = append(st.replies, endMsg)
	return st
}

// stamped is live batch seq published at time ts.
func stamped(ts float64, seq uint64) []step {
	p := removedPayload(hashOf(seq), 0)
	binary.BigEndian.PutUint64(p[2:10], math.Float64bits(ts))
	return []step{{live: [][]byte{{}, seqFrame(seq), p}}}
}

// coarse is live batches published 10 ms apart from Unix time from on,
// their ts sent as wire.md and the decoder allow besides a float64: a
// float32 (a step every 128 s) or whole seconds, so that they all carry the
// same one.
func coarse(from float64, asInt bool, seqs ...uint64) []step {
	var out []step
	for _, seq := range seqs {
		p := removedPayload(hashOf(seq), 0)
		ts := from + float64(seq)*0.01
		b := []byte{p[0]}
		if asInt {
			b = binary.BigEndian.AppendUint32(append(b, 0xce), uint32(ts))
		} else {
			b = binary.BigEndian.AppendUint32(append(b, 0xca), math.Float32bits(float32(ts)))
		}
		out = append(out, step{live: [][]byte{{}, seqFrame(seq), append(b, p[10:]...)}})
	}
	return out
}

// rejected is live batch seq with a defect that makes the decoder reject
// it whole (rejectedPayload).
func rejected(seq uint64, defect string) []step {
	return []step{{live: [][]byte{{}, seqFrame(seq), rejectedPayload(seq, defect)}}}
}

// rejectedPayload is the payload of test batch seq with a defect that makes
// the decoder reject it whole, its valid remove with it: its dp rank sent
// as a string, or its end cut off.
func rejectedPayload(seq uint64, defect string) []byte {
	p := removedPayload(hashOf(seq), 0)
	switch defect {
	case "dp rank as a string":
		return append(p[:len(p)-5], 0xa1, '0')
	case "truncated":
		return p[:len(p)-3]
	}
	panic("rejectedPayload: " + defect)
}

// untimedPayload is removedPayload(hash, 0) with a nil ts.
func untimedPayload(hash uint64) []byte {
	p := removedPayload(hash, 0)
	return append([]byte{p[0], 0xc0}, p[10:]...)
}

// TestSkippedEventsAreCountedAndLogged: wire events the decoder leaves out
// show in kvagent_subscriber_skipped_events_total by reason, and each
// reason is logged once per rank. They were counted only in the
// subscriber's in-memory Stats, which nothing exported: a worker
// registered with the wrong block size lost every store silently.
func TestSkippedEventsAreCountedAndLogged(t *testing.T) {
	reg := prometheus.NewRegistry()
	var logs bytes.Buffer
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: &recSink{}, Registerer: reg,
		Logger:  slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Rank:    kvevent.Rank{Worker: 3, DP: 1},
		Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	for seq := range uint64(3) {
		if err := s.core.live(bg, [][]byte{{}, seqFrame(seq), floppyPayload(hashOf(seq))}); err != nil {
			t.Fatal(err)
		}
	}
	series := counterSeries(t, reg, "kvagent_subscriber_skipped_events_total")
	if want := []string{"dp_rank=1,reason=unknown_medium,worker=3 3"}; !slices.Equal(series, want) {
		t.Fatalf("kvagent_subscriber_skipped_events_total series %q, want %q", series, want)
	}
	if n := strings.Count(logs.String(), "engine events left out"); n != 1 || !strings.Contains(logs.String(), "reason=unknown_medium") {
		t.Fatalf("%d log lines for the skipped events, want 1 naming the reason:\n%s", n, logs.String())
	}
}

// TestDroppedBlocksAreCountedByReason: blocks the decoder's per-block rules
// leave out of a stored event show in
// kvagent_subscriber_dropped_blocks_total by reason: a store of 3 tokens
// on 4-token blocks (block_size) and an offload store of an engine hash
// never seen with its tokens (unresolved). No test read the family: a
// subscriber that counted none passed.
func TestDroppedBlocksAreCountedByReason(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: &recSink{}, Registerer: reg,
		Logger:  slog.New(slog.DiscardHandler),
		Rank:    kvevent.Rank{Worker: 3}, // the batches' data_parallel_rank
		Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	for seq, p := range [][]byte{
		storePayload(1.0, hashOf(0), []uint32{1, 2, 3}, "GPU"),
		storePayload(1.1, hashOf(1), nil, "CPU"),
		storePayload(1.2, hashOf(2), nil, "CPU"),
	} {
		if err := s.core.live(bg, [][]byte{{}, seqFrame(uint64(seq)), p}); err != nil {
			t.Fatal(err)
		}
	}
	series := counterSeries(t, reg, "kvagent_subscriber_dropped_blocks_total")
	if want := []string{"dp_rank=0,reason=block_size,worker=3 1", "dp_rank=0,reason=unresolved,worker=3 2"}; !slices.Equal(series, want) {
		t.Fatalf("kvagent_subscriber_dropped_blocks_total series %q, want %q", series, want)
	}
}

// TestSkipReasonsAreLoggedOncePerWorker: semantics.md §1 logs a reason for
// leaving events out once per worker, not per event nor per dp rank. The
// subscribers of a group (one worker's ranks) each logged it: a worker of
// eight ranks with a wrong block size warned eight times. The metric still
// counts per rank.
func TestSkipReasonsAreLoggedOncePerWorker(t *testing.T) {
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	g, err := NewGroup(Config{Endpoint: "tcp://127.0.0.1:5557", Sink: &recSink{}, Registerer: reg,
		Logger:  slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Rank:    kvevent.Rank{Worker: 3},
		Decoder: engine.Config{BlockSize: 4}}, 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range g.Subscribers() {
		for seq := range uint64(2) {
			if err := s.core.live(bg, [][]byte{{}, seqFrame(seq), floppyPayload(hashOf(seq))}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := strings.Count(logs.String(), "engine events left out"); n != 1 {
		t.Fatalf("%d log lines for one reason on one worker's 3 ranks, want 1:\n%s", n, logs.String())
	}
	// A subscriber made alone (no group, no shared SkipLog) logs for itself.
	s, err := New(Config{Endpoint: "tcp://127.0.0.1:1", Sink: &recSink{}, Registerer: prometheus.NewRegistry(),
		Logger:  slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
		Rank:    kvevent.Rank{Worker: 4},
		Decoder: engine.Config{BlockSize: 4}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.core.live(bg, [][]byte{{}, seqFrame(0), floppyPayload(hashOf(0))}); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(logs.String(), "engine events left out"); n != 2 {
		t.Fatalf("%d log lines after another worker's subscriber skipped, want 2:\n%s", n, logs.String())
	}
}

// floppyPayload is the batch [ts, [["BlockRemoved", [0x77], "FLOPPY"],
// ["BlockRemoved", [hash]]]]: a remove from a medium that names no tier,
// then one of a device block.
func floppyPayload(hash uint64) []byte {
	b := []byte{0x92, 0xcb}
	b = binary.BigEndian.AppendUint64(b, math.Float64bits(1.5))
	b = append(b, 0x92, 0x93, 0xac)
	b = append(b, "BlockRemoved"...)
	b = append(b, 0x91, 0x77, 0xa6)
	b = append(b, "FLOPPY"...)
	b = append(b, 0x92, 0xac)
	b = append(b, "BlockRemoved"...)
	b = append(b, 0x91, 0xcf)
	return binary.BigEndian.AppendUint64(b, hash)
}

// TestPayloadTS: the publish time is read from each batch shape wire.md
// lists, and a payload without a usable one says so.
func TestPayloadTS(t *testing.T) {
	f32 := binary.BigEndian.AppendUint32([]byte{0x92, 0xca}, math.Float32bits(2.5))
	cases := []struct {
		name    string
		payload []byte
		want    float64
		ok      bool
	}{
		{"array, float64", removedPayload(hashOf(0), 0), 1.5, true},
		{"array, float32", append(f32, 0x90), 2.5, true},
		{"array, int", []byte{0x92, 0x07, 0x90}, 7, true},
		{"map, ts after events", []byte{0x82, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x90, 0xa2, 't', 's', 0x09}, 9, true},
		{"map without ts", []byte{0x81, 0xa6, 'e', 'v', 'e', 'n', 't', 's', 0x90}, 0, false},
		{"nil ts", untimedPayload(hashOf(0)), 0, false},
		{"NaN", binary.BigEndian.AppendUint64([]byte{0x91, 0xcb}, math.Float64bits(math.NaN())), 0, false},
		{"empty array", []byte{0x90}, 0, false},
		{"not msgpack", []byte{0xc1}, 0, false},
		{"empty", nil, 0, false},
	}
	for _, tc := range cases {
		if got, ok := payloadTS(tc.payload); got != tc.want || ok != tc.ok {
			t.Errorf("%s: payloadTS = %v, %v; want %v, %v", tc.name, got, ok, tc.want, tc.ok)
		}
	}
}

// discardSink takes every batch and keeps nothing, so that a test can
// measure what the subscriber itself holds.
type discardSink struct{}

func (discardSink) Events(kvevent.Rank, uint64, []kvevent.Event) error { return nil }
func (discardSink) Reset(kvevent.Rank)                                 {}
func (discardSink) Resync(kvevent.Rank, Reason)                        {}

// bigRemovePayload is [ts, [["BlockRemoved", [n hashes]]], 0].
func bigRemovePayload(ts float64, n int) []byte {
	b := msgp.AppendArrayHeader(nil, 3)
	b = msgp.AppendFloat64(b, ts)
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendArrayHeader(b, 2)
	b = msgp.AppendString(b, "BlockRemoved")
	b = msgp.AppendArrayHeader(b, uint32(n))
	for i := range n {
		b = msgp.AppendUint64(b, 0x8000000000000000|uint64(i))
	}
	return msgp.AppendInt(b, 0)
}

// TestOneLargeBatchIsNotHeldForGood: from a review: after one batch that
// removed 2M blocks (as an eviction step can), the subscriber held ~35 MB
// for the rest of the run, in storage the decoder reuses from batch to
// batch (its Batch, its wire event). Storage above a bound is dropped once
// the batch has been given to the sink.
func TestOneLargeBatchIsNotHeldForGood(t *testing.T) {
	heap := func() int64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	c := newCore(t, discardSink{}, nil)
	if err := c.live(bg, liveMsg(0)); err != nil {
		t.Fatal(err)
	}
	before := heap()
	if err := c.live(bg, [][]byte{{}, seqFrame(1), bigRemovePayload(1.5, 2<<20)}); err != nil {
		t.Fatal(err)
	}
	for s := uint64(2); s < 100; s++ {
		if err := c.live(bg, liveMsg(s)); err != nil {
			t.Fatal(err)
		}
	}
	held := heap() - before
	runtime.KeepAlive(c)
	if st := c.Stats(); st.Batches != 100 {
		t.Fatalf("sink got %d batches, want 100", st.Batches)
	}
	if held > 4<<20 {
		t.Fatalf("subscriber holds %d MB after one batch of 2M removes and 98 small ones, want under 4", held>>20)
	}
}

// storePayload is [ts, [["BlockStored", [h], nil, tokens, 4, nil, medium]], 0].
func storePayload(ts float64, h uint64, tokens []uint32, medium string) []byte {
	b := msgp.AppendArrayHeader(nil, 3)
	b = msgp.AppendFloat64(b, ts)
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendArrayHeader(b, 7)
	b = msgp.AppendString(b, "BlockStored")
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendUint64(b, h)
	b = msgp.AppendNil(b)
	b = msgp.AppendArrayHeader(b, uint32(len(tokens)))
	for _, tk := range tokens {
		b = msgp.AppendUint32(b, tk)
	}
	b = msgp.AppendInt(b, 4)
	b = msgp.AppendNil(b)
	b = msgp.AppendString(b, medium)
	return msgp.AppendInt(b, 0)
}

// TestNewEpochForgetsLearnedHashes: a restarted engine may seed its block
// hashes anew, so a tokenless (offload) store of an engine hash learned in
// the old epoch is unresolved, not placed with the old epoch's content hash.
// From a review: deleting newEpoch's decoder reset left every test green.
func TestNewEpochForgetsLearnedHashes(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, nil)
	const h = 0xfeedface12345678
	for _, m := range [][][]byte{
		{{}, seqFrame(0), storePayload(1.0, h, []uint32{1, 2, 3, 4}, "GPU")},
		{{}, seqFrame(1), storePayload(1.1, h, nil, "CPU")}, // resolved: same epoch
		{{}, seqFrame(0), storePayload(2.0, h, nil, "CPU")}, // the restarted engine's
	} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	if got := trace(calls); got != "ev0 ev1 reset ev0" {
		t.Fatalf("sink calls %s, want ev0 ev1 reset ev0", got)
	}
	if n := len(calls[1].events); n != 1 {
		t.Fatalf("a tokenless store of a hash learned in the same epoch gave %d events, want 1", n)
	}
	if n := len(calls[3].events); n != 0 {
		t.Fatalf("restarted engine's tokenless store resolved from the old epoch: %s", fmtEvents(calls[3].events))
	}
}

// counterSeries returns the series of counter family name in reg, each
// as "label=value,… count", in the registry's order.
func counterSeries(t *testing.T, reg *prometheus.Registry, name string) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var series []string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var l []string
			for _, p := range m.GetLabel() {
				l = append(l, p.GetName()+"="+p.GetValue())
			}
			series = append(series, fmt.Sprintf("%s %v", strings.Join(l, ","), m.GetCounter().GetValue()))
		}
	}
	return series
}

// TestALiveBatchInOrderAllocatesNothing pins the hot-path rule of the
// developers' guide ("no per-event allocation you can avoid") on the
// subscriber's live path: a batch in sequence, parsed, decoded and handed
// to the sink, allocates nothing once the core is warm. The decoder alone
// is pinned (kvevent/engine); the framing, the counting and the metrics
// around it were not: one more allocation per batch passed every test.
func TestALiveBatchInOrderAllocatesNothing(t *testing.T) {
	c := newCore(t, discardSink{}, nil)
	msgs := make([][][]byte, 110) // AllocsPerRun's warm-up run and 100 more, after one
	for i := range msgs {
		msgs[i] = liveMsg(uint64(i))
	}
	i := 0
	live := func() {
		if err := c.live(bg, msgs[i]); err != nil {
			t.Fatal(err)
		}
		i++
	}
	live()
	n := testing.AllocsPerRun(100, live)
	if c.stats.Batches != uint64(i) || c.stats.Resyncs != 0 || c.stats.Malformed != 0 {
		t.Fatalf("stats %+v after %d batches in order", c.stats, i)
	}
	if n != 0 {
		t.Fatalf("a live batch allocated %.1f times, want 0", n)
	}
}

// storedOnce is the payload of a batch that stores block hash h (tokens
// 1..4, blocks of 4) in the device tier, as vLLM announces each copy of a
// block its prefix cache holds.
func storedOnce(h uint64) []byte {
	b := msgp.AppendArrayHeader(nil, 3)
	b = msgp.AppendFloat64(b, 1.5)
	b = msgp.AppendArrayHeader(b, 1)
	b = appendStored(b, h)
	return msgp.AppendUint32(b, 0)
}

// appendStored appends the array_like BlockStored of block hash h (tokens
// 1..4, blocks of 4, no parent) to b.
func appendStored(b []byte, h uint64) []byte {
	b = msgp.AppendArrayHeader(b, 7)
	b = msgp.AppendString(b, "BlockStored")
	b = msgp.AppendArrayHeader(b, 1)
	b = msgp.AppendUint64(b, h)
	b = msgp.AppendNil(b)
	b = msgp.AppendArrayHeader(b, 4)
	for tok := range 4 {
		b = msgp.AppendInt(b, tok+1)
	}
	b = msgp.AppendInt(b, 4)
	b = msgp.AppendNil(b)
	return msgp.AppendNil(b)
}

// A resync clears the rank, so the copies the decoder counted before it go
// too (engine.Decoder.ForgetCopies): the batches lost in the gap may have
// removed some. Kept, the two copies counted before the gap would absorb
// the remove of the one the engine stored after it, and the router would
// route to a block the engine no longer holds.
func TestResyncForgetsTheCopiesCounted(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, nil) // no replay endpoint: a gap resyncs
	const h = 0xc0c0
	for _, m := range [][][]byte{
		{{}, seqFrame(0), storedOnce(h)},
		{{}, seqFrame(1), storedOnce(h)},
		{{}, seqFrame(3), storedOnce(h)}, // 2 is lost
		{{}, seqFrame(4), removedPayload(h, 0)},
	} {
		if err := c.live(bg, m); err != nil {
			t.Fatal(err)
		}
	}
	var m dto.Metric
	if err := c.m.copyRemoves.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetCounter().GetValue(); got != 0 {
		t.Fatalf("kvagent_subscriber_copy_removes_total %v, want 0: no remove was held back", got)
	}
	calls := sink.of(nil)
	if got, want := trace(calls), "ev0 ev1 resync:gap ev3 ev4"; got != want {
		t.Fatalf("sink calls %s, want %s", got, want)
	}
	last := calls[len(calls)-1].events
	if len(last) != 1 || last[0].Kind != kvevent.KindRemoved || !slices.Equal(last[0].Removed, []uint64{h}) {
		t.Fatalf("batch 4 gave the sink %v, want the remove of %#x: the one copy stored since the resync is gone", last, h)
	}
}

// A remove of a block stored twice is held back, and counted in
// kvagent_subscriber_copy_removes_total; the second is sent.
func TestACopysRemoveIsHeldBackAndCounted(t *testing.T) {
	sink := &recSink{}
	c := newCore(t, sink, nil)
	const h = 0xc1c1
	for i, p := range [][]byte{storedOnce(h), storedOnce(h), removedPayload(h, 0), removedPayload(h, 0)} {
		if err := c.live(bg, [][]byte{{}, seqFrame(uint64(i)), p}); err != nil {
			t.Fatal(err)
		}
	}
	calls := sink.of(nil)
	if len(calls) != 4 || len(calls[2].events) != 0 || len(calls[3].events) != 1 || calls[3].events[0].Kind != kvevent.KindRemoved {
		t.Fatalf("sink calls %s, events %v / %v; want the first remove held back (no event), the second sent",
			trace(calls), calls[min(2, len(calls)-1)].events, calls[len(calls)-1].events)
	}
	var m dto.Metric
	if err := c.m.copyRemoves.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetCounter().GetValue(); got != 1 {
		t.Fatalf("kvagent_subscriber_copy_removes_total %v, want 1", got)
	}
}
