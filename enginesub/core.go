package enginesub

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/zeebo/xxh3"
)

// Stats are a Subscriber's counters since it was made.
type Stats struct {
	Batches     uint64 // batches given to the sink, live or replayed
	Events      uint64 // router events in them
	BlockEvents uint64 // stored blocks plus removed hashes in them
	Gaps        uint64 // jumps forward in the sequence
	Replays     uint64 // replays asked of the engine
	Replayed    uint64 // batches applied from replays
	Overruns    uint64 // replays that started above the sequence asked for
	Resyncs     uint64 // Sink.Resync calls, whatever the reason
	Epochs      uint64 // new epochs: engine restarts seen (Sink.Reset calls)
	Duplicates  uint64 // batches skipped: applied or given up already, or an engine's from before a restart seen
	Unverified  uint64 // stale live batches skipped because the replay that would tell whose they were failed
	Malformed   uint64 // messages skipped as malformed, live or replayed
	SinkErrors  uint64 // batches Sink.Events refused
	NextSeq     uint64 // the sequence expected next
	Decoder     engine.Stats
}

// replayFunc asks the engine for its buffered batches from sequence from
// on, and calls each with every reply (the frames a DEALER receives) until
// each returns false. It returns an error when the replay cannot be asked
// for, times out, or ctx ends. Each reply's frames are its own: each may
// keep them (replayGap holds payloads past the call).
type replayFunc func(ctx context.Context, from uint64, each func(frames [][]byte) bool) error

// core is a Subscriber without its sockets: sequence tracking, replay and
// decoding, one message at a time. Only the Run goroutine (or a test) calls
// its methods, except Stats.
type core struct {
	rank   kvevent.Rank
	sink   Sink
	dec    *engine.Decoder
	batch  engine.Batch
	log    *slog.Logger
	m      rankMetrics
	replay replayFunc // nil: no replay endpoint

	started  bool
	next     uint64 // the sequence to apply next
	liveLast uint64 // the last sequence seen on the live stream
	liveSeen bool   // liveLast holds a sequence (false only before the first, after a resume at 0)
	// liveSum is a fingerprint of the payload of live batch liveLast, when
	// liveSumOK (false when liveLast comes from Config.Resume, not the
	// wire): a second live copy of that batch, the same bytes, is a
	// duplicate, while other bytes under the same sequence come from a
	// restarted engine (a real batch carries its publish time).
	liveSum   uint64
	liveSumOK bool
	resume    *uint64

	// replayed holds a fingerprint of each batch the last replay applied,
	// from sequence replayedFrom on, until the live stream passes them:
	// their live copies, queued while the replay ran, are duplicates,
	// while a live batch of one of those sequences with other bytes comes
	// from a restarted engine (see live).
	replayedFrom uint64
	replayed     []uint64

	// stale: a gap's replay showed the engine restarted while live batches
	// of the engine before it were still queued (replayNewEpoch), and no
	// live batch has been shown to be the restarted engine's since. The
	// live stream may still be the old engine's: a connect-mode SUB socket
	// reads the old connection's unread batches before the new one's, and
	// each is neither a duplicate nor a restart (see staleLive).
	stale bool
	// mark is the last batch the stale epoch's replay applied (markSeq,
	// its fingerprint markSum), when markOK: the engine that answers the
	// replays may have restarted again since, and its copy of markSeq then
	// has other bytes (verifyStale asks for it first).
	markSeq, markSum uint64
	markOK           bool
	// staleFails counts the stale verifications in a row whose replay
	// failed before it showed the live batch (see maxStaleFails).
	staleFails int

	// resynced: the last call the sink had about the rank was Resync. A
	// rejected payload then resyncs it no more (see apply).
	resynced bool

	// bind is Config.Bind. A bound socket takes each connection the engine
	// makes on a pipe of its own, and reads the pipes in turn: when the
	// connection drops and is remade while the subscriber is behind, libzmq
	// still delivers the old pipe's unread batches, in turn with the new
	// pipe's. Each is a step back below liveLast, already applied or given
	// up (the new pipe's first batch was read, or replayed, after it): it is
	// skipped, not taken for a restarted engine's (which would reset the rank
	// at each one). It is told by its publish time: below liveTS, the ts of
	// batch liveLast, it was published before a batch already read, which a
	// restarted engine's batches never are. Equal is no evidence either way:
	// wire.md lets ts come as a float32 (a step every 128 s at today's Unix
	// times) and the decoder takes whole seconds, so an old pipe's batch and
	// a restarted engine's may both carry liveTS. Such a step back starts an
	// epoch: a reset the old pipe's batches did not need heals with the
	// rank's resync, while a restarted engine's batches skipped as an old
	// pipe's would leave the rank stale until the engine's sequence came
	// back to liveLast (an engine that restarted while the subscriber was
	// behind, its batch 0 read, then the old pipe's next batch above it).
	// Batch 0 always starts an epoch (no old pipe's batch can be 0 after a
	// later one of the same epoch), and so does the last sequence again
	// with other bytes, whatever its time: a restarted engine whose first
	// batches were lost, on a host whose clock stepped back, shows there at
	// the latest.
	//
	// liveTS is the ts of batch liveLast, not the highest ever read: one
	// batch stamped far ahead (a host clock stepped back since) would
	// otherwise make every later step back an old pipe's, a restarted
	// engine's too. The old pipe's batches were all published before the
	// new pipe's first one, so before the new pipe's batch that is liveLast
	// when they come (liveLast does not move at the batches skipped; those
	// a replay applied are told by their bytes, see replayed).
	bind     bool
	liveTS   float64
	liveTSOK bool // liveTS holds the ts of batch liveLast, read from the wire

	mu    sync.Mutex // guards stats
	stats Stats

	decSeen engine.Stats // the decoder's counters already exported
	skipLog *SkipLog     // the reasons logged, for the rank's worker
}

// SkipLog records which reasons for leaving engine events out were logged
// (Config.SkipLog). Its zero value logs none yet; it is safe for
// concurrent use.
type SkipLog struct {
	mu   sync.Mutex
	seen [engine.NumReasons]bool
}

// first reports whether reason r is not logged yet, and marks it logged.
func (l *SkipLog) first(r engine.Reason) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.seen[r] {
		return false
	}
	l.seen[r] = true
	return true
}

func (c *core) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}

func (c *core) count(f func(*Stats)) {
	c.mu.Lock()
	f(&c.stats)
	c.mu.Unlock()
}

// live handles one message of the live stream. It returns an error only
// when ctx ended during a replay.
func (c *core) live(ctx context.Context, frames [][]byte) error {
	seq, payload, bad := parseLive(frames)
	if bad != "" {
		c.malformed(bad, nil)
		return nil
	}
	sum := xxh3.Hash(payload)
	ts, tsOK := payloadTS(payload)
	if c.stale {
		if done, err := c.staleLive(ctx, seq, payload, sum, ts, tsOK); done {
			return err
		}
	}
	older := tsOK && c.liveTSOK && ts < c.liveTS
	// A sequence a replay applied: the live copy of that batch, or, with
	// other bytes, a restarted engine's batch (the sequence alone cannot
	// tell them apart when the replay started at 0, nor after a catch-up
	// that failed part-way).
	restarted := false
	if i := seq - c.replayedFrom; seq >= c.replayedFrom && i < uint64(len(c.replayed)) {
		if sum == c.replayed[i] {
			c.head(seq, sum, ts, tsOK)
			c.count(func(s *Stats) { s.Duplicates++ })
			c.m.duplicates.Inc()
			return nil
		}
		restarted = c.started
		c.replayed = c.replayed[:0]
	} else if seq >= c.replayedFrom {
		c.replayed = c.replayed[:0] // the live stream is past the replay
	}
	if !c.started && c.resume == nil {
		c.started, c.next = true, seq
		c.head(seq, sum, ts, tsOK)
		c.apply(seq, payload)
		return nil
	}
	if !c.started {
		// Taking over from a predecessor that applied everything below
		// *resume: it saw those sequences live or in a replay (which only
		// holds what was published), so a live sequence below *resume
		// means the engine restarted since.
		r := *c.resume
		c.started, c.next, c.liveLast, c.liveSeen = true, r, r-1, r > 0
		c.liveSumOK = false
	}
	// The live stream comes over one connection at a time, in order: within
	// an epoch it only goes up (but for a bound socket's old pipe: see
	// bind). Going back means a new publisher, counting from 0 again
	// (wire.md: a sequence below the last one seen). The last sequence
	// again is a new publisher only with other bytes: the same bytes are a
	// second copy of the batch, a duplicate, which must not reset the rank.
	// (Sequences the replay applied may be above liveLast: those are
	// duplicates, below.)
	if !restarted && c.liveSeen && seq == c.liveLast && c.liveSumOK && sum == c.liveSum {
		c.count(func(s *Stats) { s.Duplicates++ })
		c.m.duplicates.Inc()
		return nil
	}
	if c.bind && !restarted && older && seq > 0 && c.liveSeen && seq < c.liveLast && seq < c.next {
		c.count(func(s *Stats) { s.Duplicates++ })
		c.m.duplicates.Inc()
		return nil
	}
	if restarted || c.liveSeen && seq <= c.liveLast {
		c.newEpoch(seq)
	}
	c.head(seq, sum, ts, tsOK)
	switch {
	case seq < c.next:
		c.count(func(s *Stats) { s.Duplicates++ })
		c.m.duplicates.Inc()
	case seq == c.next:
		c.apply(seq, payload)
	default:
		return c.heal(ctx, seq, payload)
	}
	return nil
}

// staleLive handles live batch seq while the live stream may still be the
// old engine's (stale): it reports whether it dealt with the batch, else
// live goes on with it as the restarted engine's, under the usual rules.
//
// Nothing but the batch's bytes tells whose it is. Its sequence cannot: the
// old connection's batches climb from the one that showed the restart, the
// new connection's start anywhere (a PUB drops what it publishes before
// the subscription arrives), and an engine that restarted twice meanwhile
// may have a connection of its own queued in between, whose batches
// step back. So stale ends only with a batch shown to be the engine's
// that answers replays, and the others are skipped (counted duplicates),
// none of them starting an epoch:
//   - one of the sequences the last replay applied: the same bytes, the
//     engine's live copy (live skips it); other bytes, an earlier engine's;
//   - below the next sequence expected otherwise: skipped, whoever sent it
//     (the new engine's would be a batch the rank holds or gave up);
//   - else the engine is asked for it (verifyStale).
//
// The publish time would tell most of them without a replay, but not
// soundly: the engine may send it as a float32 (a step every 128 s), and a
// host clock that steps back across the restart would have the new
// engine's batches taken for the old one's, and dropped without a resync.
func (c *core) staleLive(ctx context.Context, seq uint64, payload []byte, sum uint64, ts float64, tsOK bool) (bool, error) {
	i := seq - c.replayedFrom
	replayed := seq >= c.replayedFrom && i < uint64(len(c.replayed))
	switch {
	case replayed && sum == c.replayed[i]:
		c.stale = false
		return false, nil
	case replayed || seq < c.next:
		c.head(seq, sum, ts, tsOK)
		c.skipStale(seq)
		return true, nil
	}
	c.head(seq, sum, ts, tsOK)
	return true, c.verifyStale(ctx, seq, payload)
}

// verifyStale asks the engine, which restarted since the old engine's live
// batches still queued were published, for its batches from c.next through
// seq, to tell whose live batch seq (liveLast, at or above c.next) is:
//   - the engine's copy has the same bytes: the live stream is the
//     restarted engine's now, stale ends, and the replay applied the batch
//     (or, when it overran, the rank is resynced and the batch applied);
//   - other bytes, or a replay that ends before seq (the engine has not
//     published it): an earlier engine's, skipped, and nothing replayed is
//     applied (see replayGap); an overrun lost some of the engine's
//     batches, and the rank is resynced;
//   - the engine's copy of the epoch's last batch (mark, read first) has
//     other bytes, or the replay ends with no batch at all (the engine has
//     not published the mark, which the epoch applied from it, and an
//     engine's sequence only rises): the engine restarted again since the
//     epoch began, and the epoch's batches are the engine's in between
//     (restartedAgain);
//     a replay whose first batch is above the mark (the engine's buffer
//     no longer holds it) leaves it unchecked, and is an overrun only
//     when that batch is above c.next too (replayGap);
//   - a replay that fails before it shows seq leaves the batch's engine
//     unknown: it is skipped (counted unverified) and the rank resynced,
//     since it may have been the restarted engine's. The next live batch
//     asks again from c.next, which replays it then if it was. Applying
//     it instead would, if it was the old engine's, leave the dead
//     engine's blocks on the rank after the resync, and its next batches
//     too. But the maxStaleFails-th failure in a row ends stale, and the
//     batch is applied on the resynced rank: the replays may never come
//     back, and the engine's batches would all be skipped meanwhile.
//
// A resync is spared when the sink's last call about the rank was one
// already (nothing applied since could be missing the batch). It returns
// an error only when ctx ended.
func (c *core) verifyStale(ctx context.Context, seq uint64, payload []byte) error {
	from := c.next
	if c.markOK && !c.resynced {
		from = c.markSeq // the engine's copy of the epoch's last batch first
	}
	reason, shown := c.replayGap(ctx, from, seq, false)
	if err := ctx.Err(); err != nil {
		return err
	}
	if shown == endAgain {
		return c.restartedAgain(ctx, seq)
	}
	if shown == endSame {
		c.stale, c.staleFails = false, 0
		c.log.Info("live stream is the restarted engine's", "rank", c.rank, "seq", seq)
		if reason == "" { // the replay applied it
			c.count(func(s *Stats) { s.Duplicates++ })
			c.m.duplicates.Inc()
			return nil
		}
		if !c.resynced {
			c.resync(reason, "missing", fmt.Sprintf("%d..%d", c.next, seq-1))
		}
		c.next = seq
		c.apply(seq, payload)
		return nil
	}
	if shown == endUnchecked || reason == ReasonOverrun {
		if reason == "" {
			reason = ReasonReplayFailed
		}
		if !c.resynced {
			c.resync(reason, "missing", fmt.Sprintf("%d..", c.next), "unknown", seq)
		}
	}
	if shown != endUnchecked {
		c.staleFails = 0
		c.skipStale(seq)
		return nil
	}
	if reason == ReasonOverrun {
		// The engine answered, but no longer holds seq: the batches
		// after it, its own ones too when they come, it holds.
		c.staleFails = 0
	} else {
		c.staleFails++
	}
	if c.staleFails >= maxStaleFails {
		// The replays keep failing (the socket down, the engine gone):
		// waiting for one to answer would skip every batch of the
		// engine meanwhile, in order as they come, which a stream
		// outside of stale follows with no replay at all. The rank was
		// resynced (above, or before, with nothing applied since), so
		// the live batches are taken for the current engine's from
		// here, as a subscriber without a replay endpoint takes them:
		// if the old engine's are still queued after all, a step back
		// to the engine's own batches starts an epoch.
		c.log.Warn("live stream taken for the restarted engine's unverified: replays keep failing",
			"rank", c.rank, "seq", seq, "failed_replays", c.staleFails)
		c.stale, c.staleFails = false, 0
		c.next = seq
		c.apply(seq, payload)
		return nil
	}
	c.log.Debug("live batch skipped unverified: its replay failed", "rank", c.rank, "seq", seq)
	c.count(func(s *Stats) { s.Unverified++ })
	c.m.unverified.Inc()
	return nil
}

// maxStaleFails is how many stale verifications in a row may fail (the
// replay times out, breaks off or skips a batch; not an overrun, which the
// engine answered) before stale ends and the
// live stream is taken for the current engine's (verifyStale). Each
// failure costs a replay timeout and skips a batch the engine may have
// sent: a few ride out a replay socket's brief outage (a restart's), and
// more would only drop more of the engine's batches.
const maxStaleFails = 3

// restartedAgain follows a stale verification (verifyStale) whose replay
// showed the engine restarted again since the stale epoch began: its copy
// of the epoch's last batch (mark) has other bytes, or it has not
// published the mark at all (its sequence is below it). The epoch's batches
// are the engine's in between, which may have died before any live batch
// of its own was read: the next engine's live batches come with sequences
// the epoch holds (skipped as an earlier engine's, or as below the next
// expected), then above them, and taken for the epoch's they would be
// applied on the dead engine's state for good. The rank starts a new
// epoch and is replayed from 0 (resynced if that fails); the stream stays
// stale, unless the replay holds the live batch seq with its bytes: the
// live stream is the engine's, and the replay applied it.
func (c *core) restartedAgain(ctx context.Context, seq uint64) error {
	c.log.Info("engine restarted again while the live stream was stale", "rank", c.rank, "seq", seq)
	c.newEpoch(seq)
	c.stale = true
	reason, _ := c.replayGap(ctx, 0, 0, true)
	if err := ctx.Err(); err != nil {
		return err
	}
	if reason != "" {
		c.resync(reason, "missing", "0..")
	}
	c.markStale()
	if i := seq - c.replayedFrom; seq >= c.replayedFrom && i < uint64(len(c.replayed)) && c.replayed[i] == c.liveSum {
		c.stale = false
		c.log.Info("live stream is the restarted engine's", "rank", c.rank, "seq", seq)
		c.count(func(s *Stats) { s.Duplicates++ })
		c.m.duplicates.Inc()
		return nil
	}
	c.skipStale(seq)
	return nil
}

// markStale keeps the last batch the stale epoch's replay applied as its
// mark, when the replay applied the batches below c.next and the rank was
// not resynced since (a resync dropped what the rank held: nothing of an
// earlier engine is left to mix with).
func (c *core) markStale() {
	n := uint64(len(c.replayed))
	c.markOK = c.stale && !c.resynced && n > 0 && c.replayedFrom+n == c.next
	if c.markOK {
		c.markSeq, c.markSum = c.next-1, c.replayed[n-1]
	}
}

// skipStale skips live batch seq, an earlier engine's or not shown to be
// the current one's (staleLive), counted with the duplicates: like them, a
// batch not to apply.
func (c *core) skipStale(seq uint64) {
	c.log.Debug("live batch of the engine before its restart skipped", "rank", c.rank, "seq", seq)
	c.count(func(s *Stats) { s.Duplicates++ })
	c.m.duplicates.Inc()
}

// head makes live batch seq, whose payload has fingerprint sum and publish
// time ts (when tsOK), the last one seen on the live stream.
func (c *core) head(seq, sum uint64, ts float64, tsOK bool) {
	c.liveLast, c.liveSeen, c.liveSum, c.liveSumOK = seq, true, sum, true
	c.liveTS, c.liveTSOK = ts, tsOK
}

// catchUp, for a subscriber that resumes (Config.Resume) and has a replay
// endpoint, asks the engine at once for what it published since: an idle
// engine sends nothing live that would show the gap. A replay that starts
// above the resume point (an overrun) resyncs the rank, and the first live
// batch is then taken whatever its sequence. A replay that fails (cannot
// reach the engine, times out, skips a batch) resyncs too: nothing tells
// what the engine published meanwhile. It returns an error only when ctx
// ended.
func (c *core) catchUp(ctx context.Context) error {
	if c.started || c.resume == nil || c.replay == nil {
		return nil
	}
	r := *c.resume
	c.started, c.next, c.liveLast, c.liveSeen = true, r, r-1, r > 0
	c.liveSumOK = false
	c.count(func(s *Stats) { s.NextSeq = c.next })
	reason, _ := c.replayGap(ctx, r, r, true)
	if err := ctx.Err(); err != nil {
		return err
	}
	if reason != "" {
		c.resync(reason, "missing", fmt.Sprintf("%d..", r))
		c.started, c.resume = false, nil
	}
	return nil
}

// newEpoch starts the epoch of a restarted engine, first seen at seq.
func (c *core) newEpoch(seq uint64) {
	c.log.Info("engine restarted: new epoch", "rank", c.rank, "last_seq", c.liveLast, "seq", seq)
	c.count(func(s *Stats) { s.Epochs++ })
	c.m.epochs.Inc()
	c.sink.Reset(c.rank)
	c.resynced = false
	c.stale, c.markOK, c.staleFails = false, false, 0
	c.dec.Reset()
	c.replayed = c.replayed[:0]
	// The new epoch starts at 0: if seq is above, its first batches were
	// missed, which is a gap like any other.
	c.next = 0
	c.count(func(s *Stats) { s.NextSeq = c.next })
}

// heal handles the live batch seq, which follows a gap: batches c.next to
// seq-1 are missing. It fills the gap from a replay when it can, else
// resyncs, and then applies the batch unless the replay already did.
//
// The replay runs on this goroutine: live messages that arrive meanwhile
// wait in the SUB socket's queue, and those the replay covers are skipped
// as duplicates when live reads them (their sequence is above liveLast and
// below next).
func (c *core) heal(ctx context.Context, seq uint64, payload []byte) error {
	from := c.next
	c.count(func(s *Stats) { s.Gaps++ })
	c.m.gaps.Inc()
	reason := ReasonGap
	if c.replay != nil {
		var end gapEnd
		reason, end = c.replayGap(ctx, from, seq, false)
		if err := ctx.Err(); err != nil {
			return err
		}
		if end == endOther {
			return c.replayNewEpoch(ctx, seq)
		}
	}
	if reason != "" {
		c.resync(reason, "missing", fmt.Sprintf("%d..%d", c.next, seq-1))
		c.next = seq
	}
	if seq < c.next {
		c.count(func(s *Stats) { s.Duplicates++ })
		c.m.duplicates.Inc()
		return nil
	}
	c.apply(seq, payload)
	return nil
}

// replayNewEpoch follows a gap whose replay came from a restarted engine
// (see replayGap): its batch seq has other bytes than the live batch seq
// just read, which the engine published before it restarted (its last
// batches, the restarted engine's first ones, lost in between). The live
// batch is the old epoch's, applied nowhere: the rank starts the new epoch
// and is replayed from 0, through seq at least, which the engine's buffer
// was just seen to hold. A replay that fails resyncs the rank, and the
// stream goes on past seq (the new epoch's live copies of the batches
// replayed are told by their bytes, see replayed).
//
// The live batches read next may be the old engine's still: those its
// connection sent before it died, queued behind seq. Each has other bytes
// than the new engine's batch of its sequence, or is above every sequence
// the new engine published yet; taken for the live stream's, they would
// start an epoch each, or be applied on the new epoch's state. The stream
// is stale until a live batch is shown to be the new engine's (staleLive).
func (c *core) replayNewEpoch(ctx context.Context, seq uint64) error {
	c.log.Info("replay came from a restarted engine", "rank", c.rank, "seq", seq)
	c.newEpoch(seq)
	c.stale = true
	reason, _ := c.replayGap(ctx, 0, seq+1, true)
	if err := ctx.Err(); err != nil {
		return err
	}
	if reason != "" {
		c.resync(reason, "missing", fmt.Sprintf("0..%d", seq))
		c.next = max(c.next, seq+1)
		c.count(func(s *Stats) { s.NextSeq = c.next })
	}
	c.markStale()
	return nil
}

// gapEnd is what a gap's replay showed of the live batch that ended it
// (see replayGap).
type gapEnd int

const (
	endUnchecked gapEnd = iota // not asked, or the replay failed or broke off before it
	endSame                    // its copy has the live batch's bytes
	endOther                   // its copy has other bytes: the replay came from a restarted engine
	endMissing                 // the replay ended cleanly before it: the engine has not published it
	endAgain                   // while stale, its copy of the epoch's mark has other bytes, or it has none yet: restarted again
)

// replayGap asks for the batches from `from` on and applies those it gets,
// in order. It returns "" when the gap up to upTo (excluded) was filled,
// and, with whole, the replay also ended cleanly (a catch-up, whose gap
// has no known end: only the replay's end says it is filled), else the
// reason to resync.
//
// A replay that starts above from means the engine's buffer no longer holds
// the batches asked for: an overrun, and nothing replayed can stand in for
// them. Its batches are not applied; the stream goes on from the live batch
// that showed the gap.
//
// A gap shown by live batch upTo (not whole) may be answered by an engine
// that restarted since that batch was published: one that reached upTo
// again in its new epoch, the old epoch's last batches and the new one's
// first lost in between. Its batches are not the old epoch's missing ones,
// and applied they would mix the two epochs on the sink. Its batch upTo
// tells: other bytes than the live batch's (a real batch carries its
// publish time). So the batches below upTo are held until the replay's
// copy of upTo is seen; with other bytes, none is applied and replayGap
// reports endOther. A replay that ends before upTo applies what it held,
// as a replay that ends short always did (but while the live stream is
// stale: see below). One that fails or skips a batch before upTo applies
// none of them: without the copy of upTo they may be a restarted engine's
// as well as the missing ones, and applied they would look like a filled
// gap when they reach it, the old engine's batch upTo applied on them with
// no Resync; the rank resyncs instead. The batches held point into the
// replies, each a message of its own, and are
// at most what the engine sends at once (its buffer), which the replay
// socket queues anyway. What the replay showed of upTo is reported in shown
// (endUnchecked when whole, or the live batch upTo is not liveLast).
//
// While the live stream is stale (verifyStale), the replay checks whose
// live batch upTo is: one that overran is read on to its copy of upTo,
// and one that ends before upTo applies nothing (the engine has not
// published upTo: the live batch is an earlier engine's, and the
// engine's batches wait for the live batch shown to be its own). But one
// from the epoch's mark that ends with no batch at all shows the engine
// restarted again (endAgain), as its copy of the mark with other bytes
// does.
func (c *core) replayGap(ctx context.Context, from, upTo uint64, whole bool) (reason Reason, shown gapEnd) {
	c.count(func(s *Stats) { s.Replays++ })
	c.replayed, c.replayedFrom = c.replayed[:0], from
	first, overrun, hole, restarted := true, false, false, false
	gapFrom := c.next // below upTo: a gap (else a stale batch checked, verifyStale)
	check := !whole && c.liveSeen && c.liveLast == upTo && c.liveSumOK
	checked := check
	// While the live stream is stale, what the replay shows of upTo says
	// whose live batch upTo is, even when it overran (verifyStale).
	scan := check && c.stale
	// A stale verification from the epoch's mark reads the engine's copy
	// of it first: other bytes, the engine restarted again (verifyStale);
	// a buffer that starts above it leaves it unchecked.
	mark := scan && c.markOK && from == c.markSeq && from < c.next
	again := false
	var held [][]byte // replayed batches c.next.. not applied until upTo is checked
	want := func() uint64 { return c.next + uint64(len(held)) }
	applyReplayed := func(seq uint64, payload []byte) {
		if len(c.replayed) == 0 {
			c.replayedFrom = seq
		}
		c.replayed = append(c.replayed, xxh3.Hash(payload))
		if c.apply(seq, payload) {
			c.count(func(s *Stats) { s.Replayed++ })
		}
	}
	flush := func() {
		for _, p := range held {
			applyReplayed(c.next, p)
		}
		held = held[:0]
	}
	err := c.replay(ctx, from, func(frames [][]byte) bool {
		seq, payload, end, bad := parseReply(frames)
		switch {
		case bad != "":
			c.malformed(bad, nil)
			return true
		case end:
			return false
		}
		if first {
			first = false
			least := from
			if mark && seq > from {
				// The engine's buffer no longer holds the mark: its copy
				// is not checked this time, and only a batch missing from
				// c.next on is an overrun (the mark is applied already).
				mark, least = false, c.next
			}
			if seq > least {
				overrun = true
				if !scan {
					return false
				}
			}
		}
		switch {
		case mark && seq == c.markSeq && !overrun:
			if xxh3.Hash(payload) != c.markSum {
				again = true
				return false
			}
		case overrun: // nothing applied: read on to the copy of upTo only
			switch {
			case seq < upTo:
				return true
			case seq > upTo:
				hole = true
			case xxh3.Hash(payload) == c.liveSum:
				shown = endSame
			default:
				restarted = true
			}
			return false
		case seq < want(): // applied (or held) already
			c.count(func(s *Stats) { s.Duplicates++ })
			c.m.duplicates.Inc()
		case seq > want(): // a hole in the replay: never apply past it
			hole = true
			return false
		case check && seq < upTo:
			held = append(held, payload)
		default:
			if check {
				if xxh3.Hash(payload) != c.liveSum {
					restarted = true
					return false
				}
				check = false
				shown = endSame
				flush()
			}
			applyReplayed(seq, payload)
		}
		return true
	})
	if mark && first && err == nil {
		// The replay from the mark ended cleanly with no batch at all: the
		// engine has not published the mark, which the epoch applied from
		// the engine answering its replays then. An engine's sequence only
		// rises (and its buffer keeps its last batches), so it restarted
		// again, and has not reached the mark yet; taken for "upTo is an
		// earlier engine's", its batches would be skipped as below c.next
		// while the rank kept the dead engine's.
		again = true
	}
	switch {
	case ctx.Err() != nil:
		return "", endUnchecked
	case again:
		c.m.replays.WithLabelValues("restarted").Inc()
		return "", endAgain
	case restarted && overrun: // only while stale (scan): the old engine's batch, and batches lost
		c.count(func(s *Stats) { s.Overruns++ })
		c.m.replays.WithLabelValues("overrun").Inc()
		return ReasonOverrun, endOther
	case restarted && scan:
		c.staleShown(upTo, "its copy has other bytes")
		return "", endOther
	case restarted:
		c.m.replays.WithLabelValues("restarted").Inc()
		return "", endOther
	}
	if checked && shown == endUnchecked && err == nil && (!overrun || scan) && !hole {
		shown = endMissing // the replay's end came first
	}
	if check && (err != nil || hole) {
		held = held[:0] // the copy of upTo unseen: none applied (see above)
	}
	if scan && shown == endMissing {
		// While stale, the engine's batches are not applied for a live
		// batch shown to be an earlier engine's: an engine that restarted
		// again since the epoch began would have them mix two epochs.
		// The live batch shown to be the engine's asks for them again.
		held = held[:0]
	}
	flush() // the replay ended before upTo, if any are held
	switch {
	case overrun:
		c.count(func(s *Stats) { s.Overruns++ })
		c.m.replays.WithLabelValues("overrun").Inc()
		return ReasonOverrun, shown
	case scan && shown == endMissing:
		c.staleShown(upTo, "the engine has not published it")
		return "", shown
	case c.next >= upTo && !(whole && (err != nil || hole)):
		if err != nil {
			c.log.Debug("replay ended badly after filling the gap", "rank", c.rank, "err", err)
		}
		c.m.replays.WithLabelValues("healed").Inc()
		if gapFrom < upTo {
			c.log.Info("gap filled by replay", "rank", c.rank, "from", from, "to", upTo-1)
		}
		return "", shown
	}
	c.m.replays.WithLabelValues("failed").Inc()
	switch {
	case err != nil:
		c.log.Warn("replay failed", "rank", c.rank, "from", from, "err", err)
	case hole:
		c.log.Warn("replay skipped a batch", "rank", c.rank, "from", from, "missing", c.next)
	default:
		c.log.Warn("replay ended short of the gap", "rank", c.rank, "from", from, "reached", c.next, "want", upTo)
	}
	return ReasonReplayFailed, shown
}

// staleShown counts a stale verification's replay (verifyStale) that
// showed live batch seq to be an earlier engine's (why): the replay did
// what it was asked, and the batch is skipped; neither healed nor failed.
// Each of the old engine's batches still queued after a restart costs one,
// so the log has it at Debug.
func (c *core) staleShown(seq uint64, why string) {
	c.m.replays.WithLabelValues("stale").Inc()
	c.log.Debug("stale live batch shown to be an earlier engine's", "rank", c.rank, "seq", seq, "why", why)
}

// apply decodes batch seq and gives it to the sink. It consumes seq even
// when the decoder rejects the payload (see the package comment): the
// batch's events, the valid ones too, are then lost, and the rank is
// resynced, since the sink may hold blocks the batch removed. Not when the
// sink's last call was a Resync already: it holds nothing from the stream
// since, that the lost batch could have made stale, and an engine whose
// every payload is rejected costs one resync, not one per batch. Nor when
// the payload is another dp rank's (engine.ErrOtherDPRank): it reaches the
// sink empty. It reports whether the batch was applied: decoded (or known
// to be another rank's) and given to the sink.
func (c *core) apply(seq uint64, payload []byte) bool {
	c.next = seq + 1
	c.batch.Reset()
	if err := c.dec.Decode(payload, &c.batch); err != nil {
		c.malformed(badPayload, err)
		if !errors.Is(err, engine.ErrOtherDPRank) {
			c.count(func(s *Stats) { s.NextSeq = c.next; s.Decoder = c.dec.Stats() })
			c.exportSkips()
			if !c.resynced {
				c.resync(ReasonBadPayload, "seq", seq, "err", err)
			}
			return false
		}
		// Another dp rank's batch (its data_parallel_rank read first)
		// that does not decode: its events were never this rank's, so
		// this rank lost nothing with it. It reaches the sink empty, as
		// that rank's readable batches do; resyncing this rank for it
		// cost a rebuild of the rank (kvagent clears it on the router).
	}
	c.exportSkips()
	n := c.batch.BlockEvents()
	c.count(func(s *Stats) {
		s.Batches++
		s.Events += uint64(len(c.batch.Events))
		s.BlockEvents += uint64(n)
		s.NextSeq = c.next
		s.Decoder = c.dec.Stats()
	})
	c.m.batches.Inc()
	c.m.blockEvents.Add(float64(n))
	c.resynced = false
	if err := c.sink.Events(c.rank, seq, c.batch.Events); err != nil {
		c.count(func(s *Stats) { s.SinkErrors++ })
		c.resync(ReasonSinkError, "seq", seq, "err", err)
	}
	c.batch.Reset() // drop references the sink must not keep
	return true
}

// exportSkips counts, in the metrics, the wire events and blocks the
// decoder left out since the last call (and the removed hashes it held back
// because another copy stays), and logs each reason the first
// time it shows on the rank's worker (Config.SkipLog): a worker registered
// with the wrong block size, for one, loses every store to it.
func (c *core) exportSkips() {
	st := c.dec.Stats()
	for r := range engine.NumReasons {
		ev := st.Skipped[r] - c.decSeen.Skipped[r]
		bl := st.DroppedBlocks[r] - c.decSeen.DroppedBlocks[r]
		if ev == 0 && bl == 0 {
			continue
		}
		name := r.String()
		if ev > 0 {
			c.m.skipped.WithLabelValues(name).Add(float64(ev))
		}
		if bl > 0 {
			c.m.droppedBlocks.WithLabelValues(name).Add(float64(bl))
		}
		if c.skipLog.first(r) {
			level := slog.LevelWarn
			if r == engine.ReasonNotMainGroup {
				level = slog.LevelInfo // a hybrid model's other groups: expected
			}
			args := []any{"rank", c.rank, "reason", name, "events", ev, "blocks", bl, "metric", "kvagent_subscriber_skipped_events_total"}
			if r == engine.ReasonOtherDPRank && c.batch.HasDPRank {
				// Only the batch just decoded can have shown it: the
				// decoder counts no other.
				n, m := c.batch.DPRank, c.rank.DP
				args = append(args, "batch_dp_rank", n, "fix", fmt.Sprintf("the engine publishes dp rank %d's events on the endpoint of rank %d: "+
					"give each dp rank its own endpoint (vLLM: port + rank) and follow rank %d with --dp-start/--dp-size", n, m, n))
			}
			c.log.Log(context.Background(), level, "engine events left out", args...)
		}
	}
	if k := st.CopyRemoves - c.decSeen.CopyRemoves; k > 0 {
		c.m.copyRemoves.Add(float64(k))
	}
	c.decSeen.Skipped, c.decSeen.DroppedBlocks, c.decSeen.CopyRemoves = st.Skipped, st.DroppedBlocks, st.CopyRemoves
}

func (c *core) resync(reason Reason, args ...any) {
	c.log.Warn("rank resync", append([]any{"rank", c.rank, "reason", string(reason)}, args...)...)
	c.count(func(s *Stats) { s.Resyncs++ })
	c.m.resyncs.WithLabelValues(string(reason)).Inc()
	// The sink clears the rank: what the engine still holds comes back as
	// it stores it again, and the copies counted before are not its own.
	c.dec.ForgetCopies()
	c.sink.Resync(c.rank, reason)
	c.resynced = true
}

func (c *core) malformed(why string, err error) {
	c.count(func(s *Stats) { s.Malformed++ })
	c.m.malformed.WithLabelValues(why).Inc()
	c.log.Debug("malformed engine message skipped", "rank", c.rank, "reason", why, "err", err)
}
