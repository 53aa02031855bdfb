package compat

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeTarget is an AgentlessTarget that fails the commits it is told to fail and records the others.
type fakeTarget struct {
	fail      int    // how many commits fail next
	cursor    uint64 // what Cursor answers
	committed []kvevent.Event
}

func (f *fakeTarget) CheckLeader() error                         { return nil }
func (f *fakeTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *fakeTarget) Cursor(kvevent.Rank) uint64                 { return f.cursor }
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

	ft.cursor = Position(maxEpoch, 6, 1)
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

// TestAgentlessRankRegisteredAnewStartsOverAfterItsLastEpoch: a rank that
// used its last epoch applies nothing more, until the instance is
// unregistered and registered again (docs/compat.md), which starts its
// cursor over at 0: the next batch clears it into epoch 1 and applies.
// From a review: done within one poll, reconcile kept the subscriber,
// whose sink stayed at the last epoch with its clear failing.
func TestAgentlessRankRegisteredAnewStartsOverAfterItsLastEpoch(t *testing.T) {
	ft := &cursorTarget{cursor: Position(maxEpoch, 5, 1)}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	st := func() []kvevent.Event {
		return []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}
	}
	s := &positionSink{a: a, rank: r, epoch: maxEpoch}
	s.Reset(r) // the engine restarted: a clear is due, and cannot be
	if err := s.Events(r, 0, st()); err == nil {
		t.Fatal("a batch committed after the epochs ran out")
	}
	ft.cursor = 0 // unregistered and registered again
	if err := s.Events(r, 1, st()); err != nil {
		t.Fatalf("the rank registered anew: %v", err)
	}
	var got []string
	for _, ev := range ft.committed {
		e, seq, _ := SplitPosition(ev.EventID)
		got = append(got, fmt.Sprintf("%v@%d/%d", ev.Kind, e, seq))
	}
	if want := []string{"clear@1/0", "store@1/1"}; !slices.Equal(got, want) {
		t.Fatalf("committed %v, want %v", got, want)
	}
}

// cursorTarget applies positional ids as raftfsm does for a Positional
// rank: an id at or below the cursor is a duplicate, skipped; any higher
// id applies (holes are no gaps).
type cursorTarget struct {
	cursor    uint64
	committed []kvevent.Event // applied ones
}

func (f *cursorTarget) CheckLeader() error                         { return nil }
func (f *cursorTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *cursorTarget) Cursor(kvevent.Rank) uint64                 { return f.cursor }
func (f *cursorTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	ack := raftfsm.RankAck{Rank: bs[0].Rank}
	for _, ev := range bs[0].Events {
		if ev.EventID <= f.cursor {
			ack.Dups++
			continue
		}
		f.cursor = ev.EventID
		f.committed = append(f.committed, ev)
		ack.Applied++
	}
	ack.Cursor = f.cursor
	return []raftfsm.RankAck{ack}, nil
}

// TestAgentlessSubscriberOfAStaleEpochResyncs: a subscriber whose rank
// another leader cleared into a later epoch fails its next batch, and
// the resync clears the rank past that epoch, after which its batches
// apply. From a review: leadership went to another node and came back
// between two polls of Agentless.loop, so this node's subscriber kept
// running with its old epoch; the other leader's subscriber had cleared
// the rank meanwhile (a catch-up replay that failed: epoch+1), and every
// later batch of this one was below the cursor, dropped as a duplicate
// with no error: the rank never followed its engine again.
func TestAgentlessSubscriberOfAStaleEpochResyncs(t *testing.T) {
	ft := &cursorTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second}, log: quiet}
	r := kvevent.Rank{Worker: 1}
	st := func() []kvevent.Event {
		return []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 2}}}}
	}
	s := &positionSink{a: a, rank: r} // this node's subscriber, epoch 0
	if err := s.Events(r, 4, st()); err != nil {
		t.Fatal(err)
	}
	// The other leader resumed at batch 5, its replay failed, it cleared
	// the rank into epoch 1 and committed batch 5.
	ft.cursor = Position(1, 5, 1)
	failed := 0
	for seq := uint64(6); seq < 20; seq++ {
		if err := s.Events(r, seq, st()); err != nil {
			failed++
			s.Resync(r, enginesub.ReasonSinkError) // as enginesub does
		}
	}
	var got []string
	for _, ev := range ft.committed[1:] {
		e, seq, _ := SplitPosition(ev.EventID)
		got = append(got, fmt.Sprintf("%v@%d/%d", ev.Kind, e, seq))
	}
	if failed != 1 || len(got) < 2 || got[0] != "clear@2/0" || got[1] != "store@2/7" || len(got) != 14 {
		t.Fatalf("%d batches failed; committed after the other leader's clear: %v (want one failure, a clear into epoch 2, then batches 7 to 19)",
			failed, got)
	}
}

// TestAgentlessRestartsSubscribersOfAnOlderTerm: reconcile stops a
// subscriber that started in an older Raft term and starts it again, from
// the rank's cursor now; in the same term it keeps it. From a review: a
// node that lost leadership and won it back between two polls kept its
// subscribers, whose epoch and sequence were those from before the other
// leader's term (see TestAgentlessSubscriberOfAStaleEpochResyncs).
func TestAgentlessRestartsSubscribersOfAnOlderTerm(t *testing.T) {
	ft := &cursorTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{CommitTimeout: time.Second, Registerer: prometheus.NewRegistry()},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}}
	defer a.reconcile(nil, 0)
	r := kvevent.Rank{Worker: 1}
	table := map[uint64]raftfsm.WorkerInfo{1: {ID: 1, Positional: true, BlockSize: 4,
		EventEndpoints: map[uint32]string{0: "tcp://127.0.0.1:9"}}}
	a.reconcile(table, 5)
	first := a.subs[r]
	if first == nil {
		t.Fatal("no subscriber for the rank")
	}
	a.reconcile(table, 5)
	if a.subs[r] != first {
		t.Fatal("a subscriber was restarted within its term")
	}
	a.reconcile(table, 7)
	if a.subs[r] == first || a.subs[r] == nil || a.subs[r].term != 7 {
		t.Fatalf("after a term change: subscriber %p (was %p)", a.subs[r], first)
	}
	select {
	case <-first.done:
	default:
		t.Fatal("the subscriber of the old term still runs")
	}
}

// hangingTarget is a cursorTarget whose next commit, once hangNext is set,
// hangs until its context ends (a Raft that takes the entry and never
// applies it: a leader cut off from its followers), then answers the
// context's error as Node.apply does.
type hangingTarget struct {
	mu       sync.Mutex
	ct       cursorTarget
	hangNext bool
	// The hung commit, once it returned: when it was called, its
	// context's deadline (zero if none), and how its context ended.
	hung                 bool
	hungAt, hungDeadline time.Time
	hungErr              error
}

func (f *hangingTarget) CheckLeader() error                         { return nil }
func (f *hangingTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo { return nil }
func (f *hangingTarget) Cursor(r kvevent.Rank) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ct.Cursor(r)
}

func (f *hangingTarget) IngestEvents(ctx context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	f.mu.Lock()
	hang := f.hangNext
	f.hangNext = false
	f.mu.Unlock()
	if hang {
		start := time.Now()
		deadline, _ := ctx.Deadline()
		<-ctx.Done()
		f.mu.Lock()
		f.hung, f.hungAt, f.hungDeadline, f.hungErr = true, start, deadline, ctx.Err()
		f.mu.Unlock()
		return nil, fmt.Errorf("raft apply: waiting for the entry to apply: %w", ctx.Err())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ct.IngestEvents(ctx, bs)
}

// committed returns what was committed, as kind@epoch/seq.
func (f *hangingTarget) committed() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var got []string
	for _, ev := range f.ct.committed {
		e, seq, _ := SplitPosition(ev.EventID)
		got = append(got, fmt.Sprintf("%v@%d/%d", ev.Kind, e, seq))
	}
	return got
}

// TestAgentlessCommitThatHangsEndsAtCommitTimeout: a commit the target
// never answers ends at CommitTimeout, although the subscriber runs on;
// the batch is then lost, counted as a sink error resync
// (kvagent_subscriber_resyncs_total{reason="sink_error"}), the rank is
// cleared into the next epoch and the engine's next batches commit. A
// commit waiting on the subscriber's context alone would hold the rank,
// every later batch behind it, until the subscriber stopped.
func TestAgentlessCommitThatHangsEndsAtCommitTimeout(t *testing.T) {
	const commitTimeout = 200 * time.Millisecond
	reg := prometheus.NewRegistry()
	ft := &hangingTarget{}
	a := &Agentless{b: ft, cfg: AgentlessConfig{Poll: time.Hour, CommitTimeout: commitTimeout, Registerer: reg},
		log: quiet, subs: map[kvevent.Rank]*agentlessSub{}, retry: map[kvevent.Rank]agentlessRetry{}}
	defer a.reconcile(nil, 0)
	pub := newEngine(t, false)
	a.reconcile(map[uint64]raftfsm.WorkerInfo{1: {ID: 1, Positional: true, BlockSize: testBlockSize,
		EventEndpoints: map[uint32]string{0: pub.Endpoint()}}}, 5)
	waitSubscribed(t, pub, 1)
	publish := func(i uint64) {
		t.Helper()
		if _, err := pub.Publish(storeBatch(1000+i, uint32(i))); err != nil {
			t.Fatal(err)
		}
	}
	publish(0)
	waitFor(t, 10*time.Second, "the first batch committed", func() bool { return len(ft.committed()) == 1 })

	ft.mu.Lock()
	ft.hangNext = true
	ft.mu.Unlock()
	published := time.Now()
	publish(1)
	waitFor(t, 10*time.Second, "the hung commit to end", func() bool {
		ft.mu.Lock()
		defer ft.mu.Unlock()
		return ft.hung
	})
	// The commit's context, not a clock read after it ended, tells when it
	// ends: how soon the hung call was scheduled after the context was
	// made, and how late it woke after the deadline, are the machine's.
	// Its deadline is CommitTimeout after the subscriber made it: at most
	// that after the call began, at least that after the batch was
	// published. And it ended by that deadline, not by the subscriber
	// stopping (which would cancel it).
	ft.mu.Lock()
	at, deadline, ended := ft.hungAt, ft.hungDeadline, ft.hungErr
	ft.mu.Unlock()
	if deadline.IsZero() {
		t.Fatal("the hung commit's context has no deadline: it waits until the subscriber stops")
	}
	if d, p := deadline.Sub(at), deadline.Sub(published); d > commitTimeout || p < commitTimeout {
		t.Fatalf("the hung commit's deadline is %v after its call, %v after the batch was published, want CommitTimeout (%v) after the commit began", d, p, commitTimeout)
	}
	if !errors.Is(ended, context.DeadlineExceeded) {
		t.Fatalf("the hung commit ended with %v, want its deadline exceeded", ended)
	}
	waitFor(t, 10*time.Second, "the rank cleared after the lost batch", func() bool { return len(ft.committed()) == 2 })
	publish(2)
	waitFor(t, 10*time.Second, "the next batch committed", func() bool { return len(ft.committed()) == 3 })
	if got, want := ft.committed(), []string{"store@0/0", "clear@1/0", "store@1/2"}; !slices.Equal(got, want) {
		t.Fatalf("committed %v, want %v: the lost batch followed by a clear, then the next batch", got, want)
	}
	if n := resyncs(t, reg, enginesub.ReasonSinkError); n != 1 {
		t.Fatalf("%v sink_error resyncs counted, want 1", n)
	}
}

// resyncs returns kvagent_subscriber_resyncs_total for reason, over every
// rank registered in reg.
func resyncs(t *testing.T, reg *prometheus.Registry, reason enginesub.Reason) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "kvagent_subscriber_resyncs_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == string(reason) {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// TestAgentlessBatchDoesNotLandInAPostedRegistration: from a review. An
// agentless instance unregistered and registered again with "agentless":
// false before the next poll keeps its leader's subscriber until that
// poll. Its sink committed whatever the registration had become: the
// engine's first batch (epoch 0, sequence 0: ids 1..k) applied at the new
// registration's cursor 0, and the poster's own events 1..k were then
// skipped as duplicates. The batch is marked as positions and applies only
// to a Positional worker's rank, checked as it applies, so it is dropped
// (errRankUnregistered) both while the instance is unregistered and once
// it is registered to post its own events.
func TestAgentlessBatchDoesNotLandInAPostedRegistration(t *testing.T) {
	n := startNode(t)
	reg := func(agentless bool) {
		mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: "tcp://10.0.0.1:5557",
			ModelName: "llama", BlockSize: testBlockSize, Agentless: &agentless}), 201, "register")
	}
	reg(true)
	a := &Agentless{b: n.node, cfg: AgentlessConfig{CommitTimeout: 5 * time.Second}, log: quiet}
	r := kvevent.Rank{Worker: WorkerID(1, "llama", DefaultTenant), DP: 0}
	s := &positionSink{a: a, rank: r} // the subscriber started at cursor 0
	st := []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 7, LocalHash: 7}}}}
	mustCode(t, n.do(t, codecJSON, "POST", "/unregister", UnregisterRequest{InstanceID: 1, ModelName: "llama"}), 200, "unregister")
	if err := s.Events(r, 0, st); err != nil || !s.unregistered {
		t.Errorf("a batch of the instance unregistered: %v, dropped as unregistered %v", err, s.unregistered)
	}
	reg(false)
	// The engine's next batch reaches the subscriber before the next poll.
	s.unregistered = false
	if err := s.Events(r, 1, st); err != nil || !s.unregistered {
		t.Errorf("a batch of the instance registered with agentless false: %v, dropped as unregistered %v", err, s.unregistered)
	}
	if c := n.node.Cursor(r); c != 0 {
		t.Fatalf("the subscriber's batches moved the rank's cursor to %d", c)
	}
	acks := postEvents(t, n, stored(1, 0, "", 0, 2))
	if len(acks.Acks) != 1 || acks.Acks[0].Applied != 1 {
		t.Errorf("the poster's first event after registering with agentless false: %+v, want it applied; cursor %d",
			acks.Acks, n.node.Cursor(r))
	}
}
