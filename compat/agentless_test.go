package compat

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
)

func TestPositionRoundTrip(t *testing.T) {
	for _, c := range []struct {
		epoch uint32
		seq   uint64
		idx   int
	}{{0, 0, 1}, {1, 0, 0}, {3, 1<<32 - 1, maxBatchEvents}, {1<<20 - 1, 12345, 7}} {
		id := Position(c.epoch, c.seq, c.idx)
		e, s, i := SplitPosition(id)
		if e != c.epoch || s != c.seq || i != c.idx {
			t.Fatalf("%+v → %#x → %d %d %d", c, id, e, s, i)
		}
	}
	// Positions order as the stream: by epoch, then sequence, then index.
	if !(Position(0, 5, 2) < Position(0, 6, 1) && Position(0, 1<<32-1, 9) < Position(1, 0, 0) && Position(1, 0, 0) < Position(1, 0, 1)) {
		t.Fatal("positions do not order as the stream")
	}
	if e, next := resumeAt(Position(2, 9, 3)); e != 2 || *next != 10 {
		t.Fatalf("resume after batch 9: epoch %d next %d", e, *next)
	}
	if e, next := resumeAt(Position(3, 0, 0)); e != 3 || *next != 0 {
		t.Fatalf("resume after a clear: epoch %d next %d", e, *next)
	}
	if _, next := resumeAt(0); next != nil {
		t.Fatal("a rank never heard of resumes somewhere")
	}
}

// chainGen makes an engine's stream for the Python publisher: independent
// chains stored on the GPU, and GPU tails removed. held is what the rank
// holds.
type chainGen struct {
	rng    *rand.Rand
	n      uint64
	chains [][]uint64
	held   map[uint64]bool
}

func (g *chainGen) next() pypub.EvSpec {
	if len(g.chains) > 0 && g.rng.IntN(4) == 0 {
		i := g.rng.IntN(len(g.chains))
		if ch := g.chains[i]; len(ch) > 0 {
			tail := ch[len(ch)-1]
			g.chains[i] = ch[:len(ch)-1]
			delete(g.held, tail)
			return pypub.EvSpec{Type: "BlockRemoved", Hashes: []uint64{tail}, Medium: "GPU"}
		}
	}
	spec := pypub.EvSpec{Type: "BlockStored", BlockSize: testBlockSize, Medium: "GPU"}
	var ch []uint64
	for range 1 + g.rng.IntN(3) {
		g.n++
		h := 1<<50 | g.n
		ch = append(ch, h)
		g.held[h] = true
		spec.Hashes = append(spec.Hashes, h)
		for range testBlockSize {
			spec.Tokens = append(spec.Tokens, g.rng.Uint32N(50000))
		}
	}
	g.chains = append(g.chains, ch)
	return spec
}

// TestAgentlessSurvivesLeaderLoss: an engine registered through
// POST /register is followed by the leader itself; every node answers the
// same; the leader is killed while the engine streams, the new leader
// resumes from the replicated cursor through the engine's replay socket,
// and every node's index still holds exactly what the engine does.
func TestAgentlessSurvivesLeaderLoss(t *testing.T) {
	pypub.Require(t)
	seed := testseed.Seed(t)
	c := startCluster(t)
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*", ReplayShape: 3})
	r := c.nodes[c.follower()].doRetry(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 9, Endpoint: pub.Pub,
		ReplayEndpoint: pub.Replay, ModelName: "llama", BlockSize: testBlockSize})
	if r.code != 201 {
		t.Fatalf("register: %d %s", r.code, r.body)
	}
	pub.WaitSub()

	g := &chainGen{rng: rand.New(rand.NewPCG(seed, 1)), held: map[uint64]bool{}}
	var seq uint64
	publish := func(n int) {
		for range n {
			var evs []pypub.EvSpec
			for range 1 + g.rng.IntN(3) {
				evs = append(evs, g.next())
			}
			pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: seq, Form: "array", Events: evs, Live: true})
			seq++
		}
	}
	// held counts the blocks a node's dump holds for instance 9.
	held := func(nd *testNode) (int, []byte) {
		r := nd.do(t, codecJSON, "GET", "/dump", nil)
		var d map[string]DumpNamespace
		if err := json.Unmarshal(r.body, &d); err != nil || r.code != 200 {
			t.Fatalf("dump: %d %s %v", r.code, r.body, err)
		}
		return len(d["llama:default"].Events), r.body
	}
	rank := kvevent.Rank{Worker: WorkerID(9, "llama", DefaultTenant)}
	// agree waits, too, for every node's cursor to reach the engine's last
	// batch: a last batch that removes a block and stores another leaves
	// the count as it was, and the nodes agree on the state before it.
	agree := func(what string) {
		t.Helper()
		waitFor(t, 30*time.Second, what, func() bool {
			var first []byte
			for i, nd := range c.nodes {
				if c.down[i] {
					continue
				}
				if _, s, _ := SplitPosition(nd.node.Cursor(rank)); s != seq-1 {
					return false
				}
				n, body := held(nd)
				if n != len(g.held) {
					return false
				}
				if first == nil {
					first = body
				} else if !bytes.Equal(first, body) {
					return false
				}
			}
			return true
		})
	}
	publish(40)
	agree("every node to hold what the engine holds")

	old := c.leader()
	c.stop(old)
	publish(60) // partly while no one leads: the PUB drops those
	c.leader()
	agree("the new leader to resume through the replay socket and every node to hold what the engine holds")

	// The replay, not a resync, healed it: the rank was never cleared.
	for i, nd := range c.nodes {
		if c.down[i] {
			continue
		}
		cur := nd.node.Cursor(rank)
		if e, s, _ := SplitPosition(cur); e != 0 || s != seq-1 {
			t.Fatalf("node %d: cursor at epoch %d batch %d, want epoch 0 batch %d", i, e, s, seq-1)
		}
	}
	_ = fmt.Sprint
}

// An instance registered with an additional_salt is followed with its salt
// in every content hash: /query and /selection/select with token_ids find
// its blocks with that cache_salt, and not without it. From a review: the
// salt reached no decoder, and then /select (which took no cache_salt)
// could not match a salted instance's blocks at all.
func TestSaltedInstanceIsMatchedWithItsCacheSaltOnly(t *testing.T) {
	pypub.Require(t)
	n := startNode(t)
	ag := NewAgentless(n.node, AgentlessConfig{Poll: 50 * time.Millisecond, ReplayTimeout: 2 * time.Second, Logger: quiet})
	t.Cleanup(func() { ag.Close() })
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*"})
	r := n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 9, Endpoint: pub.Pub,
		ReplayEndpoint: pub.Replay, ModelName: "llama", BlockSize: testBlockSize, AdditionalSalt: "tenant-a"})
	if r.code != 201 {
		t.Fatalf("register: %d %s", r.code, r.body)
	}
	pub.WaitSub()
	pub.Do(pypub.BatchCmd{Cmd: "batch", Seq: 0, Form: "array", Live: true, Events: []pypub.EvSpec{{Type: "BlockStored",
		BlockSize: testBlockSize, Medium: "GPU", Hashes: []uint64{101, 102, 103}, Tokens: prompt}}})
	query := func(salt string) int {
		r := n.do(t, codecJSON, "POST", "/query", QueryRequest{TokenIDs: prompt, ModelName: "llama", CacheSalt: salt})
		var q QueryResponse
		if err := json.Unmarshal(r.body, &q); err != nil || r.code != 200 {
			t.Fatalf("query: %d %s %v", r.code, r.body, err)
		}
		return q.Instances["9"].LongestMatched
	}
	waitFor(t, 20*time.Second, "the salted query to find the blocks", func() bool { return query("tenant-a") == len(prompt) })
	if got := query(""); got != 0 {
		t.Fatalf("a query without the salt matched %d tokens, want 0", got)
	}
	sel := func(salt string) SelectResponse {
		r := n.do(t, codecJSON, "POST", "/selection/select", SelectRequest{ModelName: "llama", TokenIDs: prompt, ISLTokens: len(prompt), CacheSalt: salt})
		var s SelectResponse
		if err := json.Unmarshal(r.body, &s); err != nil || r.code != 200 {
			t.Fatalf("select: %d %s %v", r.code, r.body, err)
		}
		return s
	}
	if s := sel("tenant-a"); s.Overlap.LongestMatched != len(prompt) || s.EffectivePrefillTokens != 0 {
		t.Fatalf("select with the salt: overlap %+v, effective_prefill_tokens %d; want the whole prompt cached", s.Overlap, s.EffectivePrefillTokens)
	}
	if s := sel(""); s.Overlap.LongestMatched != 0 {
		t.Fatalf("select without the salt: overlap %+v, want none", s.Overlap)
	}
}

// POST /events for an agentless instance is refused (409): its ids are
// positions in the engine's stream, which the leader's subscriber commits;
// a posted id in a late epoch would move the rank's cursor there, and the
// subscriber could never commit again. The cursor stays, and the
// subscriber's batches go on committing.
func TestEventsForAnAgentlessInstanceAreRefused(t *testing.T) {
	n := startNode(t)
	mustCode(t, n.do(t, codecJSON, "POST", "/register", RegisterRequest{InstanceID: 1, Endpoint: "tcp://127.0.0.1:9",
		ModelName: "llama", BlockSize: 4}), 201, "register")
	id := WorkerID(1, "llama", DefaultTenant)
	if !n.node.WorkerTable()[id].Positional {
		t.Fatal("the instance is not agentless")
	}
	rk := kvevent.Rank{Worker: id}
	before := n.node.Cursor(rk)
	r := n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: 1, ModelName: "llama", Events: []Event{
		{EventID: Position(maxEpoch, 0, 1), Type: "stored", Blocks: []Block{{BlockHash: 1, TokensHash: 2}}}}})
	if r.code != 409 || !bytes.Contains(r.body, []byte("agentless")) || !bytes.Contains(r.body, []byte("false")) {
		t.Fatalf("POST /events for the agentless instance: %d %s, want 409 saying to register it with agentless false", r.code, r.body)
	}
	if got := n.node.Cursor(rk); got != before {
		t.Fatalf("the refused post moved the rank's cursor from %d to %d", before, got)
	}

	// What the leader's subscriber of the rank commits from now on.
	a := &Agentless{b: n.node, cfg: AgentlessConfig{CommitTimeout: 5 * time.Second}, log: quiet}
	s := &positionSink{a: a, rank: rk}
	for seq := uint64(0); seq < 3; seq++ {
		ev := []kvevent.Event{{Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 10 + seq, LocalHash: 20 + seq}}}}
		if seq > 0 {
			ev[0].HasParent, ev[0].Parent = true, 10+seq-1
		}
		if err := s.Events(rk, seq, ev); err != nil {
			t.Fatalf("the engine's batch %d: %v", seq, err)
		}
	}
}
