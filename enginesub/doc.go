// Package enginesub subscribes to one inference engine's KV event stream
// (shared/design/wire.md): a ZMQ SUB socket receives the engine's 3-frame
// messages [topic, seq, payload], the engine decoder (kvevent/engine) turns
// each payload into router events, and a Sink receives them, one call per
// batch. A Subscriber follows one data-parallel rank of one worker; a Group
// runs one per rank.
//
// The sequence number is the only loss signal a PUB socket gives, so each
// Subscriber tracks it:
//
//   - The first message is accepted whatever its sequence.
//   - seq == next: the batch is applied.
//   - seq below the last sequence seen on the live stream, or equal to it
//     with other bytes (a real batch carries its publish time): the engine
//     restarted (a new publisher counts from 0 again). The rank starts a new
//     epoch: Sink.Reset, the decoder forgets what it learned, and the next
//     batch expected is 0, so a new epoch first seen above 0 is a gap. The
//     last sequence again with the same bytes is a second copy of that
//     batch: a duplicate, skipped (a fingerprint of the last live payload
//     is kept to tell).
//   - seq above next: a gap. With a replay endpoint the missing batches are
//     asked for (a DEALER to the engine's ROUTER) and applied in order; a
//     replay that starts above the one asked for means the engine's buffer
//     was overrun. When history cannot be had (no replay endpoint, overrun,
//     timeout, a short or holed replay), Sink.Resync says the rank's state is
//     unknown, and the stream is followed on from the batch that showed the
//     gap. A replay whose copy of the batch that showed the gap has other
//     bytes comes from an engine that restarted since that batch was
//     published (the old epoch's last batches and the new one's first lost
//     in between): none of it is applied; the rank starts a new epoch,
//     Sink.Reset, the live batch is dropped with its epoch, and the new one
//     is replayed from 0 (resynced if that fails). To tell, the batches
//     below the gap's end are held until its copy comes; a replay that
//     fails or skips a batch before that copy applies none of them, and
//     the rank resyncs.
//   - After such a restart, the batches the old engine sent before it died
//     may still be queued on its connection, read before the new one's.
//     The live stream is stale until a batch is shown to be the restarted
//     engine's, and none of its batches starts an epoch: one of the
//     sequences the replay applied is told by its bytes (other bytes: the
//     old engine's, skipped); one below the next expected is skipped; one
//     above is asked of the engine (a replay from the next expected): its
//     copy with the same bytes, the stream is the engine's again, and the
//     replay applied it; other bytes, or none yet (the replay ends before
//     it), the old engine's, skipped. That replay starts at the last
//     batch the epoch applied: its copy (when the engine's buffer still
//     holds it; else it is not checked) with other bytes, or a replay
//     with no batch at all (the engine has not published that sequence,
//     and an engine's sequence only rises), shows the engine restarted
//     again since (its live batches may have come with sequences the
//     epoch holds, and been skipped), and the rank starts another epoch,
//     replayed from 0. A replay that fails leaves it
//     unknown: skipped (counted unverified), the rank resynced, and the
//     next live batch asks again; the third such failure in a row ends
//     stale, its batch applied on the resynced rank, and the stream is
//     followed as the engine's (replays may not come back). The batches
//     shown to be an earlier engine's are counted as duplicates. Neither its
//     sequence (the new connection's first batch comes at any sequence)
//     nor its publish time (float32, or a clock stepped back) tells soundly.
//   - Live messages that arrive while a replay runs wait in the SUB socket's
//     queue; those the replay already applied (above the last live sequence,
//     at or below the last applied) are duplicates and are skipped.
//   - A bound socket (Config.Bind) takes each connection the engine makes
//     on a pipe of its own, and reads the pipes in turn: when the engine's
//     connection drops and is remade while the subscriber is behind, the
//     old connection's unread batches come interleaved with the new one's,
//     below the last sequence seen. Each was applied already, or given up
//     (the new connection's first batch showed the gap first), and is
//     skipped as a duplicate, not taken for a restarted engine's. It is told
//     by its publish time (the payload's ts): older than the batch of the
//     last sequence read live, it was published before a batch already
//     read, which a restarted engine's never are. A step back to 0, one
//     whose ts cannot be read, one not older (an equal ts too: a float32 or
//     whole-second ts is the same for batches published apart, an old
//     connection's and a restarted engine's alike), and the last sequence
//     again with other bytes start an epoch as above.
//   - A live message of a sequence the last replay applied is told apart by
//     its bytes (a fingerprint of each replayed payload is kept until the
//     live stream passes them): the same bytes are that batch's live copy, a
//     duplicate; other bytes come from a restarted engine, a new epoch. The
//     sequence alone cannot tell them apart after a catch-up from 0, or
//     after a catch-up that failed part-way.
//
// The SUB socket keeps TCP keepalive on (10 s idle, then 3 probes 5 s
// apart): an engine whose host died without closing the connection (a
// crash, a partition) is noticed, and in connect mode the connection
// remade, within about 25 s, where the kernel's defaults would wait for
// hours. ZMTP heartbeats (Config.Heartbeat) are off unless asked for:
// libzmq reads no PING while the subscriber's queue is full, so a
// back-pressured subscriber would drop a healthy connection, and the
// reconnect can abort the process (libzmq issues 3937, 4767). A replay's
// DEALER needs none: ReplayTimeout bounds the engine's silence there. Both sockets refuse a message frame
// over Config.MaxMessage (256 MiB by default) and drop the connection that
// sent it: a peer that connects to a bound endpoint cannot exhaust the
// agent's memory with one message.
//
// Invariants:
//   - Within an epoch, every batch reaches the sink at most once, and in
//     sequence order.
//   - A gap is never applied past: the batch after a gap reaches the sink
//     only after the missing batches did, or after Sink.Resync.
//   - When history is lost the sink hears of it (Resync); when the engine
//     restarts, Reset.
//   - A malformed message (wrong frame count, a sequence frame that is not 8
//     bytes, a payload the decoder rejects) never reaches the sink and never
//     stops the subscriber: it is skipped and counted. A rejected payload
//     with a readable sequence consumes that sequence (a replay would return
//     the same bytes, so asking again could only end in a resync), and its
//     events, valid ones too, are lost: the rank is resynced
//     (ReasonBadPayload), unless the sink's last call about it was a Resync
//     already, after which it took nothing from the stream that the lost
//     batch could have made stale. Each such resync costs the sink one
//     rebuild of the rank (kvagent clears it on the router); an engine
//     whose every payload is rejected costs one in all, not one per batch.
//     A rejected payload that names another dp rank, read before its
//     events (engine.ErrOtherDPRank: an endpoint carrying several ranks'
//     batches), is counted the same, but resyncs nothing: its events were
//     never the followed rank's, and it reaches the sink empty, as that
//     rank's readable batches do.
//   - Each socket lives on the Run goroutine, which is the only caller of
//     the sink; Run returns when its context is cancelled, sockets closed.
//
// What the wire cannot tell: an engine that restarts and whose first batches
// are lost, so that the first sequence seen from it is above the last one
// seen before, looks like a gap, not a new epoch; the gap's replay, the
// restarted engine's like the live batch that showed it, mixes the two
// epochs' batches on the sink. Shown by the old engine's last batch, the
// gap's replay tells when the restarted engine has published that sequence
// again (its copy has other bytes, above); when it has not, its replay ends
// short of the gap, and the batches it holds are applied on the old
// epoch's state: the rank resyncs unless they reach the gap's end, and is
// reset when the new engine's batch of that sequence comes live, but not
// when that batch is lost too. In bind mode, a publish time tells an old
// connection's batch from a restarted engine's only as finely as the engine
// sends it: a float32 ts changes every 128 s at today's Unix times, an
// integer one every second. An old connection's batch with the ts of the
// last batch read (the same step), or with none, starts an epoch, as a
// restarted engine's would: a bound subscriber that falls behind and is
// reconnected then resets and resyncs the rank at each turn of the two
// connections (taking such a batch for an old connection's would leave the
// rank stale when it was a restarted engine's). A restarted engine whose
// batch 0 was lost, on a host whose clock stepped back across the restart,
// has its batches skipped as an old connection's until it reaches the last
// sequence seen, which starts the epoch (and a replay from 0) when its
// bytes differ; past it, it is the gap above. An engine that restarts while
// a bound subscriber is behind interleaves the two epochs' batches: the
// rank is reset and resynced at each turn, and is right again from the
// first of the new engine's batches read after the old connection's last.
// An engine that restarts again while the stream is stale (the old
// engine's batches still being read after a restart a replay showed) is
// seen only at the first live batch above what the epoch holds, the old
// engine's or its own (its replay has the epoch's last batch with other
// bytes, or not at all): its batches below are skipped, and until such a
// batch comes the rank keeps the engine in between's (after a resync of
// the stale epoch, the replay's copy of the epoch's last batch is not
// checked, and the newest engine's batches are applied on the resynced
// rank; nor is it when, by the first such batch, the engine has published
// so far past it that its buffer no longer holds it, and they are applied
// on the epoch's). And a stale stream whose replays keep failing is taken
// for the engine's at the third failure in a row: the old engine's
// batches, if some are queued still, are then applied on the resynced
// rank, until the engine's own batches step back below them (a new epoch)
// or show a gap (a resync).
// The first message a Subscriber sees may be preceded by history it never
// saw: a caller that needs the engine's whole cache must start the
// subscriber before the engine.
package enginesub
