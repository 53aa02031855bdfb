package enginesub

import (
	"context"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
)

// FuzzFrames feeds arbitrary messages, live and replayed, to the
// per-message handler, without sockets. The input is a program: each op
// byte says what comes next (a well-formed live batch, a replay reply, an
// end marker, a replay that fails, or raw frames from the input). Whatever
// it is:
//
//   - the handler never panics and never returns an error;
//   - between two sync points (the start, a Reset, a Resync), the batches
//     the sink receives have consecutive sequences: none twice, none out of
//     order, none missing (a payload the decoder rejects is a loss, and
//     resyncs);
//   - after a Reset, the first batch the sink receives before any Resync is
//     batch 0 of the new epoch: a new epoch's missed beginning is a gap;
//   - the counters agree with what the sink received.
//
// Each program runs twice: connecting, and bound (Config.Bind, whose rules
// for a reconnect's old connection must keep the same promises).
func FuzzFrames(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 0, 3})                                  // in order, then a gap
	f.Add([]byte{0, 0, 0, 1, 1, 2, 1, 3, 2, 0, 4, 0, 3})             // a gap filled by replay
	f.Add([]byte{0, 0, 0, 5, 0, 1, 0, 2})                            // restart
	f.Add([]byte{1, 5, 2, 0, 0, 0, 3})                               // overrun
	f.Add([]byte{3, 3, 0, 8, 0, 0, 0, 0, 0, 0, 0, 1, 3, 0xff, 0, 0}) // raw frames
	f.Add([]byte{0, 0, 3, 1, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 1, 2, 4, 0, 2})
	f.Add([]byte{0, 0, 3, 3, 0, 8, 0, 0, 0, 0, 0, 0, 0, 1, 3, 0xff, 0, 0, 0, 2}) // a rejected payload between two batches

	f.Fuzz(func(t *testing.T, prog []byte) {
		fuzzFrames(t, prog, false)
		fuzzFrames(t, prog, true)
	})
}

func fuzzFrames(t *testing.T, prog []byte, bind bool) {
	sink := &checkSink{t: t}
	var queued [][][]byte
	failNext := false
	replay := func(ctx context.Context, from uint64, each func([][]byte) bool) error {
		q := queued
		queued = nil
		fail := failNext
		failNext = false
		for _, r := range q {
			if !each(r) {
				return nil
			}
		}
		if fail || len(q) == 0 {
			return errReplayTimeout
		}
		return nil
	}
	c := newCore(t, sink, replay)
	c.bind = bind
	next := func() byte {
		if len(prog) == 0 {
			return 0
		}
		b := prog[0]
		prog = prog[1:]
		return b
	}
	for len(prog) > 0 {
		var live [][]byte
		switch op := next(); op % 5 {
		case 0: // a live batch
			seq := uint64(next() % 16)
			live = [][]byte{{}, seqFrame(seq), removedPayload(hashOf(seq), 0)}
		case 1: // a replay reply, in either shape
			seq := uint64(next() % 16)
			queued = append(queued, replyMsg(seq, op&8 != 0))
		case 2: // the end marker
			queued = append(queued, endMsg)
		case 3: // raw frames, live or replayed
			frames := make([][]byte, next()%6)
			for i := range frames {
				n := int(next() % 12)
				for range n {
					frames[i] = append(frames[i], next())
				}
			}
			if op&8 != 0 {
				queued = append(queued, frames)
			} else {
				live = frames
			}
		case 4: // the next replay fails after its replies
			failNext = true
		}
		if live != nil {
			if err := c.live(context.Background(), live); err != nil {
				t.Fatalf("live: %v", err)
			}
		}
	}
	st := c.Stats()
	if st.Batches != sink.batches || st.Resyncs != sink.resyncs || st.Epochs != sink.resets {
		t.Fatalf("stats %+v, sink saw %d batches, %d resyncs, %d resets", st, sink.batches, sink.resyncs, sink.resets)
	}
}

// checkSink checks the ordering invariants as the calls come.
type checkSink struct {
	t *testing.T
	// next is the sequence the next batch must have, when known: after a
	// batch, the next one; after a Reset, 0; after a Resync, unknown.
	known                    bool
	next                     uint64
	batches, resyncs, resets uint64
}

func (s *checkSink) expectNext(seq uint64) {
	s.known, s.next = true, seq
}

func (s *checkSink) Events(r kvevent.Rank, seq uint64, evs []kvevent.Event) error {
	s.batches++
	if s.known && seq != s.next {
		s.t.Fatalf("batch %d where batch %d was due", seq, s.next)
	}
	s.expectNext(seq + 1)
	for i := range evs {
		if err := evs[i].Validate(); err != nil {
			s.t.Fatalf("batch %d: %v", seq, err)
		}
	}
	return nil
}

func (s *checkSink) Reset(kvevent.Rank) {
	s.resets++
	s.expectNext(0)
}

func (s *checkSink) Resync(kvevent.Rank, Reason) {
	s.resyncs++
	s.known = false
}
