package main

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/urfave/cli/v2"

	"github.com/kvrouter/kvrouter/agent"
	"github.com/kvrouter/kvrouter/eventplane"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// countingTarget is a leader that commits everything and counts the
// dumps and events it is given.
type countingTarget struct {
	mu            sync.Mutex
	dumps, events int
}

func (t *countingTarget) IngestEvents(_ context.Context, bs []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	acks := make([]raftfsm.RankAck, len(bs))
	for i, b := range bs {
		t.events += len(b.Events)
		acks[i] = raftfsm.RankAck{Rank: b.Rank, Cursor: b.Events[len(b.Events)-1].EventID, Applied: len(b.Events)}
	}
	return acks, nil
}

func (t *countingTarget) ReplaceRankFenced(context.Context, kvevent.Rank, uint64, uint64, []kvevent.Event) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.dumps++
	return nil
}

func (t *countingTarget) IsLeader() bool                                 { return true }
func (t *countingTarget) WorkerTable() map[uint64]raftfsm.WorkerInfo     { return nil }
func (t *countingTarget) DeregisterWorker(context.Context, uint64) error { return nil }

func (t *countingTarget) counts() (dumps, events int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.dumps, t.events
}

// publisherFlags runs kvagent's flag parsing on args and returns the
// publisher configuration it makes.
func publisherFlags(t *testing.T, args ...string) eventplane.PublisherConfig {
	t.Helper()
	var pc eventplane.PublisherConfig
	a := app()
	a.Action = func(c *cli.Context) error { pc = publisherConfig(c); return nil }
	a.ExitErrHandler = func(*cli.Context, error) {} // keep the test process
	if err := a.Run(append([]string{"kvagent"}, args...)); err != nil {
		t.Fatalf("kvagent %v: %v", args, err)
	}
	return pc
}

// TestEventsSubjectReachesThePublisher: --events-subject (or
// KVAGENT_EVENTS_SUBJECT) is the subject the agent's publisher sends on,
// and its dumps go on <subject>.dump, where a router started with the same
// --events-subject listens. From a review: kvagent had no such flag, and a
// router with a subject of its own never got its events.
func TestEventsSubjectReachesThePublisher(t *testing.T) {
	if pc := publisherFlags(t); pc.Subject != eventplane.DefaultSubject {
		t.Fatalf("default subject %q, want %q", pc.Subject, eventplane.DefaultSubject)
	}
	t.Setenv("KVAGENT_EVENTS_SUBJECT", "site2.events")
	if pc := publisherFlags(t); pc.Subject != "site2.events" {
		t.Fatalf("subject %q from KVAGENT_EVENTS_SUBJECT, want site2.events", pc.Subject)
	}
	const subject = "site1.events"
	pc := publisherFlags(t, "--events-subject", subject)

	// The router's ingester, as kvrouter --events-subject site1.events
	// starts it.
	url, tg := startIngester(t, subject)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	a, err := agent.New(agent.Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: 4,
		Conn: nc, Publisher: pc, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("agent run: %v", err)
		}
	}()

	// The agent resyncs its rank with a dump as it starts.
	waitFor(t, "the agent's first dump on "+subject+".dump", func() bool { d, _ := tg.counts(); return d > 0 })
	r := kvevent.Rank{Worker: 7}
	ev := kvevent.Event{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 1001}}}
	if err := a.Events(r, 0, []kvevent.Event{ev}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the agent's event on "+subject, func() bool { _, n := tg.counts(); return n > 0 })
}

// closingPool stands in for the offload side: as it closes, it publishes
// one pool event through the agent, as a pool whose last copy finishes
// at shutdown does.
type closingPool struct {
	a   *agent.Agent
	ev  kvevent.Event
	err error // what the publish returned
}

func (p *closingPool) Close() error {
	_, p.err = p.a.Publish(p.ev.Rank, []kvevent.Event{p.ev})
	return p.err
}

// TestShutdownDeliversTheLastEvents: events the agent took just before
// it was stopped, the engine's and those the offload side publishes as
// it closes, are acknowledged by the router by the time shutdown returns:
// the offload side closes first, then the publisher is flushed, then
// closed. From a review: calling a.Close before the offload side's
// Close, or deleting the flush, left every test green.
func TestShutdownDeliversTheLastEvents(t *testing.T) {
	url, tg := startIngester(t, eventplane.DefaultSubject)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	a, err := agent.New(agent.Config{Worker: 7, Endpoint: "tcp://127.0.0.1:*", Bind: true, BlockSize: 4,
		Conn: nc, Publisher: eventplane.PublisherConfig{Subject: eventplane.DefaultSubject}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	waitFor(t, "the agent's first dump", func() bool { d, _ := tg.counts(); return d > 0 })

	r := kvevent.Rank{Worker: 7}
	blk := kvevent.Block{EngineHash: 1, LocalHash: 1001}
	if err := a.Events(r, 0, []kvevent.Event{{Rank: r, Kind: kvevent.KindStored, Blocks: []kvevent.Block{blk}}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("agent run: %v", err)
	}
	pool := &closingPool{a: a, ev: kvevent.Event{Rank: r, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, Blocks: []kvevent.Block{blk}}}
	shutdown(a, pool, quiet)
	if pool.err != nil {
		t.Errorf("the offload side's last event was refused: %v", pool.err)
	}
	if _, n := tg.counts(); n != 2 {
		t.Errorf("the router has %d of the 2 events published before the shutdown when it returned, want both", n)
	}
}

// startIngester starts an embedded NATS server and, on it, a router's
// ingester of subject (as kvrouter --events-subject subject starts it)
// feeding a countingTarget; both stop when t ends. It returns the
// server's client URL and the target.
func startIngester(t *testing.T, subject string) (string, *countingTarget) {
	t.Helper()
	s, err := eventplane.StartServer(eventplane.ServerConfig{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	inc, err := nats.Connect(s.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(inc.Close)
	tg := &countingTarget{}
	in, err := eventplane.NewIngester(eventplane.IngesterConfig{Conn: inc, Node: tg, Subject: subject,
		DumpSubject: subject + ".dump", Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	return s.ClientURL(), tg
}

// hungFlush is a flushCloser whose Flush waits until its context ends (a
// router that never acknowledges the last events), recording how long it
// waited, and whose Close is counted.
type hungFlush struct {
	waited chan time.Duration
	closed atomic.Bool
}

func (h *hungFlush) Flush(ctx context.Context) error {
	start := time.Now()
	<-ctx.Done()
	h.waited <- time.Since(start)
	return ctx.Err()
}

func (h *hungFlush) Close() error { h.closed.Store(true); return nil }

// TestTheStopsFlushIsBoundedByTwoSeconds pins shutdown's bound on the
// flush of the last events (2 s): a router that never acknowledges them
// does not hold the stop; the flush is given up, logged, and the
// publisher closed.
func TestTheStopsFlushIsBoundedByTwoSeconds(t *testing.T) {
	h := &hungFlush{waited: make(chan time.Duration, 1)}
	var logs logBuffer
	done := make(chan struct{})
	go func() {
		defer close(done)
		shutdown(h, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("the stop still waits 20 s on for a flush the router never acknowledges, want it given up after 2 s")
	}
	if d := <-h.waited; d < time.Second || d > 10*time.Second {
		t.Fatalf("the stop's flush was given up after %v, want about 2 s", d)
	}
	if !h.closed.Load() {
		t.Fatal("the publisher was not closed after the flush was given up")
	}
	if !logs.has("events not acknowledged at shutdown") {
		t.Fatalf("the stop did not log the flush it gave up:\n%s", logs.String())
	}
}
