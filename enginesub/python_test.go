package enginesub

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"io"
	"math/rand/v2"
	"os/exec"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/kvevent/engine"
)

// debianPython is Debian's interpreter, which has python3-zmq and
// python3-msgpack; the pyenv python3 on PATH does not.
const debianPython = "/usr/bin/python3"

var pythonOK = sync.OnceValue(func() error {
	return exec.Command(debianPython, "-c", "import zmq, msgpack").Run()
})

func requirePython(t testing.TB) {
	t.Helper()
	if err := pythonOK(); err != nil {
		t.Skipf("%s with zmq and msgpack not available: %v", debianPython, err)
	}
}

// pubConfig is testdata/publisher.py's configuration.
type pubConfig struct {
	Pub         string `json:"pub"`
	Connect     bool   `json:"connect,omitempty"`
	Replay      string `json:"replay,omitempty"`
	ReplayShape int    `json:"replay_shape,omitempty"`
	Topic       string `json:"topic,omitempty"`
}

// pyPub is a running testdata/publisher.py: an engine's publisher over
// real libzmq, driven one command at a time.
type pyPub struct {
	t      testing.TB
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string
	stderr bytes.Buffer
	closed bool

	Pub, Replay string // the endpoints, ports resolved
}

func startPub(t testing.TB, cfg pubConfig) *pyPub {
	t.Helper()
	requirePython(t)
	arg, _ := json.Marshal(cfg)
	p := &pyPub{t: t, cmd: exec.Command(debianPython, "testdata/publisher.py", string(arg)), lines: make(chan string, 16)}
	p.cmd.Stderr = &p.stderr
	var err error
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
	}()
	t.Cleanup(p.close)
	var hello struct{ Pub, Replay string }
	p.read(&hello)
	p.Pub, p.Replay = hello.Pub, hello.Replay
	return p
}

func (p *pyPub) read(v any) {
	p.t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			p.close()
			p.t.Fatalf("publisher exited: %s", p.stderr.String())
		}
		if err := json.Unmarshal([]byte(line), v); err != nil {
			p.t.Fatalf("publisher said %q: %v", line, err)
		}
	case <-time.After(15 * time.Second):
		p.t.Fatalf("publisher silent for 15s")
	}
}

// do sends one command and waits for its answer.
func (p *pyPub) do(cmd any) {
	p.t.Helper()
	b, _ := json.Marshal(cmd)
	if _, err := p.stdin.Write(append(b, '\n')); err != nil {
		p.t.Fatalf("write to publisher: %v", err)
	}
	var r struct {
		OK  bool
		Err string
	}
	p.read(&r)
	if !r.OK {
		p.t.Fatalf("publisher: %s", r.Err)
	}
}

func (p *pyPub) waitSub() { p.t.Helper(); p.do(map[string]string{"cmd": "wait_sub"}) }

func (p *pyPub) raw(frames ...[]byte) {
	p.t.Helper()
	hexes := make([]string, len(frames))
	for i, f := range frames {
		hexes[i] = hex.EncodeToString(f)
	}
	p.do(map[string]any{"cmd": "raw", "frames": hexes})
}

func (p *pyPub) forgetBelow(seq uint64) {
	p.t.Helper()
	p.do(map[string]any{"cmd": "forget_below", "seq": seq})
}

// close ends the publisher: EOF on its stdin, then waits for it (killing
// it after a while).
func (p *pyPub) close() {
	if p.closed {
		return
	}
	p.closed = true
	p.stdin.Close()
	timer := time.AfterFunc(10*time.Second, func() { p.cmd.Process.Kill() })
	defer timer.Stop()
	for range p.lines { // the stdout pipe must be drained before Wait
	}
	if err := p.cmd.Wait(); err != nil {
		p.t.Errorf("publisher: %v\n%s", err, p.stderr.String())
	}
}

// Batches: generated in Go, encoded by Python.

type evSpec struct {
	Type      string   `json:"type"`
	Map       bool     `json:"map,omitempty"`
	Hashes    []uint64 `json:"hashes,omitempty"`
	Parent    *uint64  `json:"parent,omitempty"`
	Tokens    []uint32 `json:"tokens,omitempty"`
	BlockSize int      `json:"block_size,omitempty"`
	Medium    string   `json:"medium,omitempty"`
}

type batchCmd struct {
	Cmd    string   `json:"cmd"`
	Seq    uint64   `json:"seq"`
	Form   string   `json:"form"`
	DP     *uint32  `json:"dp"`
	Events []evSpec `json:"events"`
	Live   bool     `json:"live"`
}

const testBlockSize = 4

// batchGen makes random batches in both event encodings and both batch
// forms, with the router events each must decode to.
type batchGen struct {
	rng    *rand.Rand
	rank   kvevent.Rank
	n      uint64
	stored []uint64 // hashes stored so far, for parents and removes
}

func newGen(t testing.TB, rank kvevent.Rank) *batchGen {
	seed := rand.Uint64()
	t.Logf("batch generator seed %#x", seed)
	return &batchGen{rng: rand.New(rand.NewPCG(seed, 7)), rank: rank}
}

func (g *batchGen) hash() uint64 {
	g.n++
	z := g.n * 0x9e3779b97f4a7c15 // splitmix64: distinct, spread over all 64 bits
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

var mediums = []struct {
	name string
	tier kvevent.Tier
}{{"", kvevent.TierDevice}, {"GPU", kvevent.TierDevice}, {"CPU", kvevent.TierHostPinned}}

// batch returns batch seq, published live or not, and its router events.
func (g *batchGen) batch(seq uint64, live bool) (batchCmd, []kvevent.Event) {
	b := batchCmd{Cmd: "batch", Seq: seq, Form: "array", Live: live}
	dp := g.rank.DP
	switch g.rng.IntN(3) {
	case 0:
		b.Form = "map"
		b.DP = &dp
	case 1:
		b.DP = &dp
	}
	want := []kvevent.Event{}
	for range 1 + g.rng.IntN(3) {
		m := mediums[g.rng.IntN(len(mediums))]
		spec := evSpec{Map: g.rng.IntN(2) == 0, Medium: m.name}
		e := kvevent.Event{Rank: g.rank, Tier: m.tier}
		switch k := g.rng.IntN(10); {
		case k < 6 || len(g.stored) == 0:
			spec.Type, e.Kind = "BlockStored", kvevent.KindStored
			spec.BlockSize = testBlockSize
			if len(g.stored) > 0 && g.rng.IntN(2) == 0 {
				p := g.stored[g.rng.IntN(len(g.stored))]
				spec.Parent, e.HasParent, e.Parent = &p, true, p
			}
			n := 1 + g.rng.IntN(3)
			for range n * testBlockSize {
				spec.Tokens = append(spec.Tokens, g.rng.Uint32N(50000))
			}
			locals := kvevent.LocalHashes(nil, spec.Tokens, testBlockSize, kvevent.SeedFor("", ""))
			for i := range n {
				h := g.hash()
				spec.Hashes = append(spec.Hashes, h)
				e.Blocks = append(e.Blocks, kvevent.Block{EngineHash: h, LocalHash: locals[i]})
				g.stored = append(g.stored, h)
			}
		case k < 9:
			spec.Type, e.Kind = "BlockRemoved", kvevent.KindRemoved
			first := g.rng.IntN(len(g.stored))
			for _, h := range g.stored[first:min(first+1+g.rng.IntN(2), len(g.stored))] {
				spec.Hashes = append(spec.Hashes, h)
				e.Removed = append(e.Removed, h)
			}
		default:
			spec.Type, e.Kind, e.Tier = "AllBlocksCleared", kvevent.KindCleared, kvevent.TierDevice
			spec.Medium = ""
		}
		b.Events = append(b.Events, spec)
		want = append(want, e)
	}
	return b, want
}

// publish has p publish batches from..to (inclusive) of g, live or not, and
// returns the sink calls they should give.
func publish(p *pyPub, g *batchGen, from, to uint64, live bool) []call {
	p.t.Helper()
	var calls []call
	for seq := from; seq <= to; seq++ {
		b, want := g.batch(seq, live)
		p.do(b)
		calls = append(calls, call{kind: "ev", rank: g.rank, seq: seq, events: want})
	}
	return calls
}

// runSub runs a subscriber until the test ends, and waits for its socket.
func runSub(t testing.TB, cfg Config) *Subscriber {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	if cfg.Decoder.BlockSize == 0 {
		cfg.Decoder.BlockSize = testBlockSize
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	select {
	case <-s.Ready():
	case err := <-done:
		done <- err
		t.Fatalf("Run: %v", err)
	}
	return s
}

func TestPythonPublisherBatchesArriveInOrder(t *testing.T) {
	rank := kvevent.Rank{Worker: 42, DP: 3}
	p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*", Topic: "kv@w42"})
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: p.Pub, Topic: "kv@", Rank: rank, Sink: sink})
	p.waitSub()
	p.raw([]byte("other"), seqFrame(1000), removedPayload(1, 0)) // filtered out by topic
	g := newGen(t, rank)
	want := publish(p, g, 0, 59, true)
	waitCalls(t, sink, &rank, want)
	st := s.Stats()
	if st.Batches != 60 || st.Gaps != 0 || st.Malformed != 0 || st.Resyncs != 0 || st.Epochs != 0 || st.NextSeq != 60 {
		t.Fatalf("stats %+v", st)
	}
	var blocks uint64
	for _, c := range want {
		for _, e := range c.events {
			blocks += uint64(len(e.Blocks) + len(e.Removed))
		}
	}
	if st.BlockEvents != blocks || st.Decoder.Emitted != st.Events {
		t.Fatalf("block events %d (want %d), events %d, decoder emitted %d", st.BlockEvents, blocks, st.Events, st.Decoder.Emitted)
	}
}

// TestEngineRestartStartsNewEpochAndReconnects stops the publisher and binds
// a new one on the same endpoint, counting from 0 again: the subscriber
// reconnects by itself, resets the rank, and follows the new stream.
func TestEngineRestartStartsNewEpochAndReconnects(t *testing.T) {
	rank := kvevent.Rank{Worker: 1}
	first := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*"})
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: first.Pub, Rank: rank, Sink: sink})
	first.waitSub()
	g := newGen(t, rank)
	want := publish(first, g, 0, 4, true)
	waitCalls(t, sink, &rank, want)
	first.close()

	second := startPub(t, pubConfig{Pub: first.Pub})
	second.waitSub()
	want = append(want, call{kind: "reset"})
	want = append(want, publish(second, g, 0, 2, true)...)
	waitCalls(t, sink, &rank, want)
	if st := s.Stats(); st.Epochs != 1 || st.Resyncs != 0 || st.Gaps != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestGapHealedByReplay has the publisher skip batches on PUB that its
// replay socket still serves: the sink sees every batch once, in order,
// whichever reply shape the engine uses.
func TestGapHealedByReplay(t *testing.T) {
	for _, shape := range []int{2, 3} {
		t.Run(map[int]string{2: "seq_payload", 3: "topic_seq_payload"}[shape], func(t *testing.T) {
			rank := kvevent.Rank{Worker: 5, DP: 1}
			p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*", ReplayShape: shape})
			sink := &recSink{}
			s := runSub(t, Config{Endpoint: p.Pub, ReplayEndpoint: p.Replay, Rank: rank, Sink: sink})
			p.waitSub()
			g := newGen(t, rank)
			want := publish(p, g, 0, 2, true)
			want = append(want, publish(p, g, 3, 5, false)...) // dropped by PUB
			want = append(want, publish(p, g, 6, 9, true)...)
			waitCalls(t, sink, &rank, want)
			want = append(want, publish(p, g, 10, 12, true)...)
			waitCalls(t, sink, &rank, want)
			st := s.Stats()
			if st.Gaps != 1 || st.Replays != 1 || st.Replayed < 3 || st.Resyncs != 0 || st.Batches != 13 {
				t.Fatalf("stats %+v", st)
			}
			t.Logf("replayed %d batches, skipped %d live duplicates", st.Replayed, st.Duplicates)
		})
	}
}

// TestReplayOverrunResyncs has the engine's buffer lose the batches the
// subscriber missed: the replay starts above the one asked for.
func TestReplayOverrunResyncs(t *testing.T) {
	rank := kvevent.Rank{Worker: 9}
	p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*"})
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: p.Pub, ReplayEndpoint: p.Replay, Rank: rank, Sink: sink})
	p.waitSub()
	g := newGen(t, rank)
	want := publish(p, g, 0, 2, true)
	publish(p, g, 3, 7, false)
	p.forgetBelow(5)
	want = append(want, call{kind: "resync", reason: ReasonOverrun})
	want = append(want, publish(p, g, 8, 9, true)...)
	waitCalls(t, sink, &rank, want)
	if st := s.Stats(); st.Overruns != 1 || st.Replays != 1 || st.Replayed != 0 || st.Resyncs != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestGapWithoutReplayEndpointResyncs(t *testing.T) {
	rank := kvevent.Rank{Worker: 2}
	p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*"})
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: p.Pub, Rank: rank, Sink: sink})
	p.waitSub()
	g := newGen(t, rank)
	want := publish(p, g, 0, 1, true)
	publish(p, g, 2, 2, false)
	want = append(want, call{kind: "resync", reason: ReasonGap})
	want = append(want, publish(p, g, 3, 4, true)...)
	waitCalls(t, sink, &rank, want)
	if st := s.Stats(); st.Gaps != 1 || st.Replays != 0 || st.Resyncs != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestUnansweredReplayTimesOutAndResyncs points the replay at an endpoint
// where nothing answers: the replay's deadline ends it.
func TestUnansweredReplayTimesOutAndResyncs(t *testing.T) {
	rank := kvevent.Rank{Worker: 3}
	p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*"})
	sink := &recSink{}
	nobody := "tcp://127.0.0.1:" + freePorts(t, 1)
	s := runSub(t, Config{Endpoint: p.Pub, ReplayEndpoint: nobody, ReplayTimeout: 200 * time.Millisecond,
		Rank: rank, Sink: sink})
	p.waitSub()
	g := newGen(t, rank)
	want := publish(p, g, 0, 1, true)
	publish(p, g, 2, 2, false)
	want = append(want, call{kind: "resync", reason: ReasonReplayFailed})
	want = append(want, publish(p, g, 3, 4, true)...)
	waitCalls(t, sink, &rank, want)
	if st := s.Stats(); st.Replays != 1 || st.Resyncs != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestMalformedFramesAreCountedAndSkipped(t *testing.T) {
	rank := kvevent.Rank{Worker: 4}
	p := startPub(t, pubConfig{Pub: "tcp://127.0.0.1:*"})
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: p.Pub, Rank: rank, Sink: sink})
	p.waitSub()
	g := newGen(t, rank)
	want := publish(p, g, 0, 1, true)
	payload := removedPayload(1, 0)
	p.raw([]byte{}, seqFrame(2))                        // 2 frames
	p.raw([]byte{}, seqFrame(2), payload, []byte("x"))  // 4 frames
	p.raw([]byte{}, seqFrame(2)[1:], payload)           // 7-byte seq
	p.raw([]byte{}, seqFrame(2), []byte("\xc1garbage")) // a payload the decoder rejects
	p.raw([]byte{})                                     // 1 frame
	p.raw([]byte{}, seqFrame(endSeq), []byte{})         // the replay end marker, live
	want = append(want, publish(p, g, 3, 4, true)...)   // the garbage consumed seq 2
	waitCalls(t, sink, &rank, want)
	st := s.Stats()
	if st.Malformed != 6 || st.Decoder.BadPayloads != 1 || st.Resyncs != 0 || st.Epochs != 0 || st.Gaps != 0 || st.Batches != 4 {
		t.Fatalf("stats %+v", st)
	}
}

// TestBindModeReceivesFromConnectingPublisher: the engine connects, the
// subscriber binds.
func TestBindModeReceivesFromConnectingPublisher(t *testing.T) {
	rank := kvevent.Rank{Worker: 6}
	sink := &recSink{}
	s := runSub(t, Config{Endpoint: "tcp://127.0.0.1:*", Bind: true, Rank: rank, Sink: sink})
	if s.LocalEndpoint() == "tcp://127.0.0.1:*" {
		t.Fatalf("local endpoint %q: port not resolved", s.LocalEndpoint())
	}
	p := startPub(t, pubConfig{Pub: s.LocalEndpoint(), Connect: true})
	p.waitSub()
	g := newGen(t, rank)
	waitCalls(t, sink, &rank, publish(p, g, 0, 19, true))
}

// TestGroupFollowsEachRankOnItsPort runs a group of two ranks in bind mode
// on ports base and base+1, with one publisher per rank.
func TestGroupFollowsEachRankOnItsPort(t *testing.T) {
	requirePython(t)
	base := freePorts(t, 2)
	sink := &recSink{}
	grp, err := NewGroup(Config{Endpoint: "tcp://127.0.0.1:" + base, Bind: true, Rank: kvevent.Rank{Worker: 8},
		Sink: sink, Logger: quiet, Decoder: engine.Config{BlockSize: testBlockSize}}, 2)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- grp.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("group: %v", err)
		}
	}()
	for _, s := range grp.Subscribers() {
		<-s.Ready()
	}
	for i, s := range grp.Subscribers() {
		rank := kvevent.Rank{Worker: 8, DP: uint32(i)}
		if s.Rank() != rank {
			t.Fatalf("subscriber %d follows %v", i, s.Rank())
		}
		p := startPub(t, pubConfig{Pub: s.LocalEndpoint(), Connect: true})
		p.waitSub()
		waitCalls(t, sink, &rank, publish(p, newGen(t, rank), 0, 4, true))
	}
}
