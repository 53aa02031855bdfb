package compat

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// fakeTarget is an AgentlessTarget that fails the commits it is told to fail and records the others.
type fakeTarget struct {
	fail      int // how many commits fail next
	committed []kvevent.Event
}

func (f *fakeTarget) CheckLeader() error                         { return nil }
func (f *fakeTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *fakeTarget) Cursor(kvevent.Rank) uint64                 { return 0 }
func (f *fakeTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	if f.fail > 0 {
		f.fail--
		return nil, errors.New("raft apply: context deadline exceeded: timed out enqueuing operation")
	}
	f.committed = append(f.committed, bs[0].Events...)
	return []raftfsm.RankAck{{Rank: bs[0].Rank, Applied: len(bs[0].Events)}}, nil
}

// TestAgentlessLostBatchIsFollowedByAClear: a batch whose commit fails
// makes the subscriber resync, and when the clear's commit fails too (the
// same overload), the next batch commits the clear first: no batch after a
// lost one applies without a clear in between. (The sink took the new
// epoch whether or not its clear committed, so the next batches applied
// above the cursor as if the rank had been cleared, the lost batch missing
// from the index for good.)
func TestAgentlessLostBatchIsFollowedByAClear(t *testing.T) {
	ft := &fakeTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	s := &positionSink{a: a, rank: r}
	st := func() []kvevent.Event {
		return []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}
	}
	if err := s.Events(r, 4, st()); err != nil {
		t.Fatal(err)
	}
	ft.fail = 2
	if err := s.Events(r, 5, st()); err == nil { // lost
		t.Fatal("want the commit to fail")
	}
	s.Resync(r, enginesub.ReasonSinkError) // as enginesub does; its clear fails too
	if err := s.Events(r, 6, st()); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ev := range ft.committed {
		e, seq, _ := SplitPosition(ev.EventID)
		got = append(got, fmt.Sprintf("%v@%d/%d", ev.Kind, e, seq))
	}
	if want := []string{"store@0/4", "clear@1/0", "store@1/6"}; !slices.Equal(got, want) {
		t.Fatalf("committed %v, want %v", got, want)
	}
}

// TestAgentlessPositionLimits: from a review. A clear past the last epoch
// used to wrap to position 0, a duplicate of everything, and the rank then
// dropped every batch silently; it is an error now, and nothing commits. A
// sequence past what a position holds cleared the rank and bumped the
// epoch on every batch; now the first such batch clears it once and the
// rest of the epoch is dropped until the engine restarts.
func TestAgentlessPositionLimits(t *testing.T) {
	ft := &fakeTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	st := []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}

	s := &positionSink{a: a, rank: r, epoch: maxEpoch}
	s.Resync(r, enginesub.ReasonGap)
	if err := s.Events(r, 7, st); err == nil {
		t.Fatal("a batch committed after the epochs ran out")
	}
	if len(ft.committed) != 0 {
		t.Fatalf("committed %d events past the last epoch", len(ft.committed))
	}

	s = &positionSink{a: a, rank: r, epoch: 3}
	past := uint64(1) << positionSeqBits
	if err := s.Events(r, past, st); err == nil {
		t.Fatal("a sequence past a position's was taken")
	}
	s.Resync(r, enginesub.ReasonSinkError) // as enginesub does
	for seq := past + 1; seq < past+4; seq++ {
		if err := s.Events(r, seq, st); err != nil {
			t.Fatalf("batch %d: %v", seq, err)
		}
	}
	if s.epoch != 4 || len(ft.committed) != 1 || ft.committed[0].Kind != kvevent.KindCleared {
		t.Fatalf("epoch %d, committed %v: want one clear, into epoch 4", s.epoch, ft.committed)
	}
	// From a review: a clear that fails there is tried again with the
	// next batch, not left due for the rest of the epoch.
	s.pastSeq, s.clearDue = true, ""
	ft.fail = 1
	s.Resync(r, enginesub.ReasonSinkError) // its clear fails
	if err := s.Events(r, past+10, st); err != nil {
		t.Fatalf("the due clear's retry: %v", err)
	}
	if s.clearDue != "" || s.epoch != 5 {
		t.Fatalf("clear due %q, epoch %d: the failed clear was not retried", s.clearDue, s.epoch)
	}
	ft.committed = ft.committed[:1]
	s.Reset(r) // the engine restarted: batches apply again
	if err := s.Events(r, 0, st); err != nil {
		t.Fatal(err)
	}
	if len(ft.committed) != 3 || ft.committed[2].Kind != kvevent.KindStored {
		t.Fatalf("after the restart, committed %v", ft.committed)
	}
}
