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
