package sim

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
	"github.com/kvrouter/kvrouter/sim/enginepub"
)

// evSink records what the engine subscribers decode, per rank.
type evSink struct {
	mu      sync.Mutex
	events  map[kvevent.Rank][]kvevent.Event
	batches int
	seqs    map[kvevent.Rank][]uint64
	trouble []string // resets and resyncs: there should be none
}

func (s *evSink) Events(r kvevent.Rank, seq uint64, evs []kvevent.Event) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range evs {
		e.Blocks, e.Removed = slices.Clone(e.Blocks), slices.Clone(e.Removed)
		s.events[r] = append(s.events[r], e)
	}
	s.seqs[r] = append(s.seqs[r], seq)
	s.batches++
	return nil
}

func (s *evSink) Reset(r kvevent.Rank) { s.note("reset " + r.String()) }
func (s *evSink) Resync(r kvevent.Rank, why enginesub.Reason) {
	s.note("resync " + r.String() + " " + string(why))
}
func (s *evSink) note(m string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.trouble = append(s.trouble, m)
}

func (s *evSink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.batches
}

// recording is a policy that keeps a copy of every event its workers
// publish, per rank: the simulated cache changes.
type recording struct {
	Policy
	events map[kvevent.Rank][]kvevent.Event
}

func (p *recording) Observe(ev *kvevent.Event, now int64) {
	e := *ev
	e.Blocks, e.Removed = slices.Clone(ev.Blocks), slices.Clone(ev.Removed)
	p.events[ev.Rank] = append(p.events[ev.Rank], e)
	p.Policy.Observe(ev, now)
}

// Simulated workers publish their KV cache changes on real ZMQ engine
// wires (enginepub); the repository's engine subscribers (enginesub, the
// node agent's) decode exactly the changes the workers made: the opening
// clear, every store and remove, in order, with the blocks' parents, and content hashes —
// computed by the decoder from the tokens on the wire — equal to the
// trace's (kvevent.LocalHashes of the request's tokens, seed
// kvevent.SeedFor("", "")), so a router indexing them matches the
// requests' prompts.
func TestWorkersPublishTheirCacheChangesOverZMQ(t *testing.T) {
	seed := testseed.Seed(t)
	const workers, bs = 3, 16
	reqs := GenerateSharedPrefix(SharedPrefixConfig{Requests: 200, Sessions: 24, Seed: seed})
	pr := prepare(t, reqs, bs)
	// A small cache, so that workers evict (BlockRemoved) as well as store.
	cfg := Config{Workers: workers, BlockSize: bs, CapacityTokens: 2500 * bs}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	sink := &evSink{events: map[kvevent.Rank][]kvevent.Event{}, seqs: map[kvevent.Rank][]uint64{}}
	pubs := make([]BatchPublisher, workers)
	for i := range workers {
		pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", ReplayEndpoint: "tcp://127.0.0.1:*"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pub.Close() })
		sub, err := enginesub.New(enginesub.Config{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(),
			Rank: RankOf(i), Decoder: engine.Config{BlockSize: bs}, Sink: sink})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sub.Run(ctx); err != nil {
				t.Errorf("subscriber %d: %v", i, err)
			}
		}()
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		err = pub.WaitSubscribed(wctx, 1)
		wcancel()
		if err != nil {
			t.Fatal(err)
		}
		pubs[i] = pub
	}

	rec := &recording{Policy: NewRouter(workers, bs, indexer.DefaultParams(), seed), events: map[kvevent.Rank][]kvevent.Event{}}
	fleet := &WireFleet{BlockSize: bs, Pubs: pubs}
	// The workers start by announcing an empty cache, as kvsim does.
	if err := fleet.ClearAll(); err != nil {
		t.Fatal(err)
	}
	for i := range workers {
		rec.events[RankOf(i)] = []kvevent.Event{{Rank: RankOf(i), Kind: kvevent.KindCleared}}
	}
	res, err := Replay(pr, cfg, WithWire(rec, fleet))
	if err != nil {
		t.Fatal(err)
	}
	if err := fleet.Flush(); err != nil {
		t.Fatal(err)
	}
	if res.Errors != 0 || res.Evicted == 0 {
		t.Fatalf("replay: %d errors (%s), %d evicted: want none and some", res.Errors, res.FirstError, res.Evicted)
	}

	deadline := time.Now().Add(30 * time.Second)
	for sink.count() < int(fleet.Batches) {
		if time.Now().After(deadline) {
			t.Fatalf("the subscribers got %d batches of %d", sink.count(), fleet.Batches)
		}
		time.Sleep(5 * time.Millisecond) // polling, bounded by the deadline
	}

	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.trouble) > 0 {
		t.Fatalf("the subscribers lost track: %v", sink.trouble)
	}
	var stores, removes, clears int
	for i := range workers {
		r := RankOf(i)
		want, got := rec.events[r], sink.events[r]
		if w, g := fmtWire(want), fmtWire(got); w != g {
			t.Fatalf("worker %d: decoded events differ from the cache's changes (%d vs %d events); first difference at line %d",
				i, len(got), len(want), firstDiff(g, w))
		}
		for j, s := range sink.seqs[r] {
			if s != uint64(j) {
				t.Fatalf("worker %d: batch %d has sequence %d", i, j, s)
			}
		}
		for _, e := range want {
			switch e.Kind {
			case kvevent.KindStored:
				stores++
			case kvevent.KindRemoved:
				removes++
			case kvevent.KindCleared:
				clears++
			}
		}
	}
	if stores == 0 || removes == 0 || clears != workers || uint64(stores+removes+clears) != fleet.Events {
		t.Fatalf("%d stores, %d removes and %d clears, fleet counted %d events", stores, removes, clears, fleet.Events)
	}

	// The content hashes on the wire are the prompts' own: every stored
	// block's is kvevent.LocalHashes of the tokens of a prompt that
	// contains it, at its position.
	known := map[uint64]uint64{} // engine hash → content hash, from the trace
	exp := Expander{BlockSize: bs}
	for k := range pr.Reqs {
		local := kvevent.LocalHashes(nil, exp.Tokens(&pr.Reqs[k]), bs, kvevent.SeedFor("", ""))
		for j, h := range kvevent.SequenceHashes(nil, local) {
			known[h] = local[j]
		}
	}
	for _, evs := range sink.events {
		for _, e := range evs {
			for _, b := range e.Blocks {
				if l, ok := known[b.EngineHash]; !ok || l != b.LocalHash {
					t.Fatalf("stored block %#x: content hash %#x, the prompt's is %#x (known %v)", b.EngineHash, b.LocalHash, l, ok)
				}
			}
		}
	}
	t.Logf("%d requests, %d batches, %d stores, %d removes, %d blocks stored over ZMQ", res.Requests, fleet.Batches, stores, removes, fleet.Blocks)
}

// A node agent's subscriber (enginesub, with Resume) that comes back after
// missing 3,000 batches of a simulated worker, all within the 10,000 its
// replay ROUTER keeps, heals from the replay instead of resyncing (clearing)
// the rank: the ROUTER dropped what passed its send high-water mark, so the
// replay had holes.
func TestSubscriberHealsFromALongReplay(t *testing.T) {
	pub, err := enginepub.New(enginepub.Config{Endpoint: "tcp://127.0.0.1:*", ReplayEndpoint: "tcp://127.0.0.1:*"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	const n = 3000
	var buf []byte
	for i := range n {
		buf = AppendBatch(buf[:0], 1, []WireEvent{{Kind: kvevent.KindRemoved, Hashes: []uint64{uint64(i + 1)}}}, 0)
		if _, err := pub.Publish(buf); err != nil {
			t.Fatal(err)
		}
	}
	sink := &evSink{events: map[kvevent.Rank][]kvevent.Event{}, seqs: map[kvevent.Rank][]uint64{}}
	zero := uint64(0)
	sub, err := enginesub.New(enginesub.Config{Endpoint: pub.Endpoint(), ReplayEndpoint: pub.ReplayEndpoint(),
		Rank: RankOf(0), Decoder: engine.Config{BlockSize: 16}, Sink: sink, Resume: &zero})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = sub.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		sink.mu.Lock()
		got, trouble := len(sink.seqs[RankOf(0)]), slices.Clone(sink.trouble)
		sink.mu.Unlock()
		if got >= n || len(trouble) > 0 || time.Now().After(deadline) {
			if got != n || len(trouble) > 0 {
				t.Fatalf("caught up on %d of %d batches from the worker's replay; resets and resyncs: %v", got, n, trouble)
			}
			break
		}
		time.Sleep(5 * time.Millisecond) // polling, bounded by the deadline
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	for j, s := range sink.seqs[RankOf(0)] {
		if s != uint64(j) {
			t.Fatalf("batch %d has sequence %d", j, s)
		}
	}
}

func firstDiff(a, b string) int {
	la, lb := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}
