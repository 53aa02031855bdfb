package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// deviceThenHost registers worker 1 (block size 4, dp ranks dps) under the
// tiered view and has rank 0 hold the two full blocks of a 10-token prompt,
// the first on device and the second in host memory; it returns the
// leader, the prompt and the prompt's sequence hashes.
func deviceThenHost(t *testing.T, dps []uint32) (*Node, []uint32, []uint64) {
	t.Helper()
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.SetSettings(ctx(t), Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: dps}); err != nil {
		t.Fatal(err)
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	local := kvevent.LocalHashes(nil, tokens, 4, kvevent.SeedFor("", ""))
	if len(local) != 2 {
		t.Fatalf("local hashes %d, want 2 full blocks", len(local))
	}
	evs := []kvevent.Event{
		{EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Blocks: []kvevent.Block{{EngineHash: 100, LocalHash: local[0]}}},
		{EventID: 2, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, HasParent: true, Parent: 100,
			Blocks: []kvevent.Block{{EngineHash: 101, LocalHash: local[1]}}},
	}
	if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: kvevent.Rank{Worker: 1, DP: 0}, Events: evs}}); err != nil {
		t.Fatal(err)
	}
	return l, tokens, kvevent.SequenceHashes(nil, local)
}

// TestRouteCostsMatchTheFormulaWorkedByHand: the §5 costs of a whole route,
// worked by hand. Under the tiered view rank 0 holds the prompt's first
// block on device and its second in host memory and carries a reservation;
// rank 1 is idle, and its potential decode blocks are the request's own.
// An override of the host weight then ties the two on cost, and the tie
// goes to the longer overlap. From a review: no test pinned an idle rank's
// potential decode blocks (route.go gives every candidate the idle
// figure before the loaded ranks' own): setting it to 0 passed them all.
func TestRouteCostsMatchTheFormulaWorkedByHand(t *testing.T) {
	l, tokens, seq := deviceThenHost(t, []uint32{0, 1})
	r0 := kvevent.Rank{Worker: 1, DP: 0}
	// Rank 0: a reservation of 20 tokens, 4 cached (16 prefill tokens),
	// holding seq[0] and one other block.
	if err := l.Reserve(ctx(t), Booking{ID: "x", Rank: r0, SeqHashes: []uint64{seq[0], 999}, ISL: 20, CachedTokens: 4}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	d := res.Decision
	if d.RequestBlocks != 3 {
		t.Errorf("request blocks %d, want ceil(10/4) = 3", d.RequestBlocks)
	}
	// Rank 0: credit 1×1 (device) + 0.75×1 (host) = 1.75; raw prefill
	// (16 reserved + 10 asked) / 4 = 6.5; prefill 6.5 - 1.75 = 4.75;
	// potential decode blocks 2 active + 1 (seq[1], not held) = 3;
	// cost 7.75. Rank 1: no credit; raw 10/4 = 2.5; potential 2, the
	// request's full blocks; cost 4.5.
	want := map[uint32]float64{0: 7.75, 1: 4.5}
	for _, cs := range d.Candidates {
		if cs.Cost != want[cs.Rank.DP] {
			t.Errorf("rank %v cost %v (credit %v, raw %v, potential %d), want %v",
				cs.Rank, cs.Cost, cs.Credit, cs.RawPrefillBlocks, cs.PotentialDecodeBlocks, want[cs.Rank.DP])
		}
	}
	if d.Rank.DP != 1 {
		t.Errorf("chose %v, want dp 1", d.Rank)
	}
	// Host weight 4: rank 0's credit is 1 + 4 = 5, its prefill 1.5, its
	// cost 4.5, rank 1's: a tie, which the longer total overlap takes.
	hw := 4.0
	res, err = l.Route(ctx(t), RouteQuery{Tokens: tokens, Overrides: &indexer.Overrides{HostCacheHitWeight: &hw}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Decision.Rank.DP != 0 || res.Decision.DecidedBy != indexer.DecidedByOverlap {
		t.Errorf("tie: chose %v by %v, want dp 0 by overlap; candidates %+v", res.Decision.Rank, res.Decision.DecidedBy, res.Decision.Candidates)
	}
}

// TestABookedRouteCountsHostBlocksAsCachedTokens: a booked route books the
// request's cached tokens as min(total overlap × block size, isl), and
// under the tiered view a block in host memory is cached too: it spares
// its prefill compute. From a review: booking the device tier's blocks
// only (Overlap[0] × block size) passed every test.
func TestABookedRouteCountsHostBlocksAsCachedTokens(t *testing.T) {
	l, tokens, _ := deviceThenHost(t, []uint32{0})
	res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, Book: true, RequestID: "b1"})
	if err != nil || !res.Booked {
		t.Fatalf("booked %v, %v", res.Booked, err)
	}
	b, ok := l.Booking("b1")
	if !ok || b.CachedTokens != 8 || b.ISL != 10 {
		t.Fatalf("booking %+v (live %v), want isl 10 and 8 cached tokens (2 blocks, one on device, one in host memory)", b, ok)
	}
	if got := l.fsm.Sequences().Load(kvevent.Rank{Worker: 1, DP: 0}).ActivePrefillTokens; got != 2 {
		t.Fatalf("active prefill tokens %d, want 10 - 8 = 2", got)
	}
}

// TestRouteTiesSpreadPrefixesOverRanks: idle ranks tie on cost, and the tie
// goes to the highest rendezvous hash of (first block hash, rank), so that
// one prefix always lands on one rank and different prefixes spread over
// them. From a review: a constant first block hash passed every test,
// sending every tie to one rank.
func TestRouteTiesSpreadPrefixesOverRanks(t *testing.T) {
	l, _ := twoIdleRanks(t, nil)
	seen := map[uint32]int{}
	for p := 0; p < 16; p++ {
		tokens := make([]uint32, 8)
		for i := range tokens {
			tokens[i] = uint32(1000*p + i + 1)
		}
		res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens})
		if err != nil {
			t.Fatal(err)
		}
		if res.Decision.DecidedBy != indexer.DecidedByRendezvous {
			t.Fatalf("prefix %d decided by %v, want rendezvous", p, res.Decision.DecidedBy)
		}
		again, err := l.Route(ctx(t), RouteQuery{Tokens: tokens})
		if err != nil {
			t.Fatal(err)
		}
		if again.Decision.Rank != res.Decision.Rank {
			t.Fatalf("prefix %d went to %v, then to %v", p, res.Decision.Rank, again.Decision.Rank)
		}
		seen[res.Decision.Rank.DP]++
	}
	if len(seen) != 2 {
		t.Fatalf("16 prefixes tied on cost all went to one rank: %v", seen)
	}
}

// TestRouteTiesSpreadPromptsShorterThanABlock: a prompt shorter than one
// block has no first block hash; its tie keys on the hash of its tokens
// (or, given by its length alone, on its request id), so that short
// prompts spread over idle ranks and one prompt keeps to one rank. From a
// review: every such prompt keyed 0, and every unbooked one went to the
// same rank whenever the ranks tied.
func TestRouteTiesSpreadPromptsShorterThanABlock(t *testing.T) {
	l, _ := twoIdleRanks(t, nil)
	for _, kind := range []string{"tokens", "request id"} {
		seen := map[uint32]int{}
		for p := range uint32(16) {
			q := RouteQuery{Tokens: []uint32{1000*p + 1, 1000*p + 2}}
			if kind == "request id" {
				q = RouteQuery{ISL: 2, RequestID: fmt.Sprintf("short-%d", p)}
			}
			var ranks []kvevent.Rank
			for range 2 {
				res, err := l.Route(ctx(t), q)
				if err != nil {
					t.Fatal(err)
				}
				if res.Decision.DecidedBy != indexer.DecidedByRendezvous {
					t.Fatalf("%s %d decided by %v, want rendezvous", kind, p, res.Decision.DecidedBy)
				}
				ranks = append(ranks, res.Decision.Rank)
			}
			if ranks[0] != ranks[1] {
				t.Fatalf("%s %d went to %v, then to %v", kind, p, ranks[0], ranks[1])
			}
			seen[ranks[0].DP]++
		}
		if len(seen) != 2 {
			t.Errorf("16 prompts shorter than a block, keyed by their %s, tied on cost all went to one rank: %v", kind, seen)
		}
	}
	// The key is the tokens' hash seeded as their blocks would be: a
	// LoRA or a salt changes it.
	if a, b := RendezvousKey(nil, []uint32{1, 2}, "", "", ""), RendezvousKey(nil, []uint32{1, 2}, "ad", "s", ""); a == b || a == 0 {
		t.Errorf("keys of two tokens, unseeded %x and seeded %x: want two keys, not 0", a, b)
	}
	if k := RendezvousKey([]uint64{42}, []uint32{1, 2}, "", "", "id"); k != 42 {
		t.Errorf("key of a prompt with a block: %d, want its first block hash 42", k)
	}
}

// TestRouteTiesKeepPromptsOfOneFirstBlockOnOneRank: semantics.md §5
// breaks a full tie by the rendezvous hash of (first block hash, rank), so
// that requests that share a prefix but tie on cost keep landing on one
// rank: prompts that share their first block and differ after it all go
// to one rank. From a review: keying the tie on the last block passed
// every test.
func TestRouteTiesKeepPromptsOfOneFirstBlockOnOneRank(t *testing.T) {
	l, _ := twoIdleRanks(t, nil)
	for p := range uint32(4) {
		var first kvevent.Rank
		for s := range uint32(8) {
			tokens := []uint32{1000*p + 1, 1000*p + 2, 1000*p + 3, 1000*p + 4,
				50000 + 100*s, 50001 + 100*s, 50002 + 100*s, 50003 + 100*s}
			res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens})
			if err != nil {
				t.Fatal(err)
			}
			if res.Decision.DecidedBy != indexer.DecidedByRendezvous {
				t.Fatalf("decided by %v, want rendezvous", res.Decision.DecidedBy)
			}
			if s == 0 {
				first = res.Decision.Rank
			} else if res.Decision.Rank != first {
				t.Fatalf("prefix %d: suffix %d went to %v, suffix 0 to %v: one first block, two ranks", p, s, res.Decision.Rank, first)
			}
		}
	}
}

// TestRouteMatchesTheAPIDocExample: docs/api.md's POST /v1/route example
// (block hashes 101, 102, 103 and isl 12 under the tiered view, rank 1/0
// holding two blocks on device and the third in host memory) is what
// Node.Route answers.
func TestRouteMatchesTheAPIDocExample(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.SetSettings(ctx(t), Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	evs := []kvevent.Event{
		{EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierDevice, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 101}, {EngineHash: 2, LocalHash: 102}}},
		{EventID: 2, Kind: kvevent.KindStored, Tier: kvevent.TierHostPinned, HasParent: true, Parent: 2, Blocks: []kvevent.Block{{EngineHash: 3, LocalHash: 103}}},
	}
	if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: kvevent.Rank{Worker: 1, DP: 0}, Events: evs}}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Route(ctx(t), RouteQuery{LocalHashes: []uint64{101, 102, 103}, ISL: 12})
	if err != nil {
		t.Fatal(err)
	}
	d := res.Decision
	if d.Rank != (kvevent.Rank{Worker: 1, DP: 0}) || d.Cost != 3.25 || d.RequestBlocks != 3 || d.DecidedBy != indexer.DecidedByCost {
		t.Fatalf("chose %v cost %v blocks %d by %v, want 1/0 3.25 3 cost", d.Rank, d.Cost, d.RequestBlocks, d.DecidedBy)
	}
	c0, c1 := d.Candidates[0], d.Candidates[1]
	if c0.Credit != 2.75 || c0.PrefillBlocks != 0.25 || c0.PotentialDecodeBlocks != 3 || c0.Overlap != [4]uint32{2, 1, 0, 0} {
		t.Errorf("rank 0: %+v", c0)
	}
	if c1.Cost != 6 || c1.PrefillBlocks != 3 || c1.PotentialDecodeBlocks != 3 {
		t.Errorf("rank 1: %+v", c1)
	}
}

// TestRouteLeavesOutRanksOfAnotherBlockSize: semantics.md §1 makes the
// block size one per model, the same for every worker; a route hashes the
// prompt with the cluster's block size (the smallest id's, 4 here), so a
// worker of another block size (8) can never match a block, and its
// bookings would name blocks it does not have: it is no candidate. A route
// that hashes with a namespace's own block size (q.BlockSize, the
// compatible APIs) has that block size's workers alone. From a review:
// worker 2 was a candidate, and with worker 1 loaded it took the request.
func TestRouteLeavesOutRanksOfAnotherBlockSize(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4, DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	// Past RegisterWorker's check, as a log written without it holds it.
	if _, err := l.apply(ctx(t), encodeRegister(now(), &WorkerInfo{ID: 2, BlockSize: 8, DPRanks: []uint32{0}})); err != nil {
		t.Fatal(err)
	}
	if err := l.Reserve(ctx(t), Booking{ID: "x", Rank: kvevent.Rank{Worker: 1}, SeqHashes: []uint64{7}, ISL: 40}); err != nil {
		t.Fatal(err)
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	candidates := func(q RouteQuery) []kvevent.Rank {
		t.Helper()
		res, err := l.Route(ctx(t), q)
		if err != nil {
			t.Fatalf("route (block size %d): %v", q.BlockSize, err)
		}
		var ranks []kvevent.Rank
		for _, cs := range res.Decision.Candidates {
			ranks = append(ranks, cs.Rank)
		}
		if len(ranks) != 1 || res.Decision.Rank != ranks[0] {
			t.Errorf("route (block size %d) chose %v of candidates %v", q.BlockSize, res.Decision.Rank, ranks)
		}
		return ranks
	}
	if got := candidates(RouteQuery{Tokens: tokens}); !slices.Equal(got, []kvevent.Rank{{Worker: 1}}) {
		t.Errorf("a route hashed with the cluster's block size 4 has candidates %v, want worker 1's rank alone", got)
	}
	if got := candidates(RouteQuery{Tokens: tokens, BlockSize: 8}); !slices.Equal(got, []kvevent.Rank{{Worker: 2}}) {
		t.Errorf("a route hashed with a namespace's block size 8 has candidates %v, want worker 2's rank alone", got)
	}
}

// TestRouteRefusesAnISLBelowItsPrompt: an input length below the prompt's
// tokens, or below its full blocks' (block hashes × block size), is
// ErrInvalid: a booking would record an ISL below the blocks it holds. One
// at or above them routes. From a review: both routed, and booked.
func TestRouteRefusesAnISLBelowItsPrompt(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		q  RouteQuery
		ok bool
	}{
		{RouteQuery{LocalHashes: []uint64{1, 2}, ISL: 7, Book: true, RequestID: "a"}, false},
		{RouteQuery{Tokens: []uint32{1, 2, 3, 4, 5}, ISL: 4}, false},
		{RouteQuery{Tokens: []uint32{1, 2, 3, 4, 5}, ISL: 5}, true},
		{RouteQuery{LocalHashes: []uint64{1, 2}, ISL: 8, Book: true, RequestID: "b"}, true},
	} {
		_, err := l.Route(ctx(t), tc.q)
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("route of %d tokens, %d block hashes, isl %d: %v, want ok %v (else ErrInvalid)", len(tc.q.Tokens), len(tc.q.LocalHashes), tc.q.ISL, err, tc.ok)
		}
	}
	if _, ok := l.fsm.Sequences().Get("a"); ok {
		t.Error("the refused route of isl 7 was booked")
	}
	if b, ok := l.fsm.Sequences().Get("b"); !ok || b.ISL != 8 {
		t.Errorf("booking b: %+v, %v; want isl 8", b, ok)
	}
}

// TestAModelWorkerOfAnotherBlockSizeLeavesV1RoutesAlone: a worker with a
// model (a compatible API's namespace, hashing with its own block size)
// does not set the block size /v1 routes hash with while workers without a
// model have one, even with the smallest id: /v1 routes keep the /v1
// workers as candidates and leave it out, and a /v1 worker of the /v1
// workers' block size registers. From a review: worker 1 (model "other",
// block size 32) was the only candidate of every /v1 route, and worker 12
// was refused with ErrBlockSizeConflict.
func TestAModelWorkerOfAnotherBlockSizeLeavesV1RoutesAlone(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	for _, id := range []uint64{10, 11} {
		if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: id, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 32, Model: "other", DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	res, err := l.Route(ctx(t), RouteQuery{Tokens: make([]uint32, 64)})
	if err != nil {
		t.Fatalf("/v1 route: %v", err)
	}
	var ranks []kvevent.Rank
	for _, cs := range res.Decision.Candidates {
		ranks = append(ranks, cs.Rank)
	}
	if want := []kvevent.Rank{{Worker: 10}, {Worker: 11}}; !slices.Equal(ranks, want) {
		t.Errorf("/v1 route beside a model worker of another block size: chose %v of candidates %v, want candidates %v", res.Decision.Rank, ranks, want)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 12, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Errorf("a /v1 worker of the /v1 workers' block size 16 beside model worker 1 of 32: %v", err)
	}
	// A model worker of the /v1 block size stays a /v1 route candidate.
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16, Model: "same", DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	res, err = l.Route(ctx(t), RouteQuery{Tokens: make([]uint32, 64)})
	if err != nil {
		t.Fatalf("/v1 route: %v", err)
	}
	ranks = ranks[:0]
	for _, cs := range res.Decision.Candidates {
		ranks = append(ranks, cs.Rank)
	}
	if want := []kvevent.Rank{{Worker: 2}, {Worker: 10}, {Worker: 11}, {Worker: 12}}; !slices.Equal(ranks, want) {
		t.Errorf("/v1 route with a model worker of the /v1 block size: candidates %v, want %v", ranks, want)
	}
}

// TestACompatNamespaceDoesNotBindV1Workers: a cluster serving a
// compatible API's namespace (model "a", block size 32, an id with bit 63
// set as compat.WorkerID gives it) takes the first /v1 worker without a
// model of another block size, which then sets the block size /v1 routes
// hash with. From a review: it was refused (ErrBlockSizeConflict, and
// kvagent stopped), the namespace's worker taken for the cluster's.
func TestACompatNamespaceDoesNotBindV1Workers(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1<<63 | 12345, Instance: 7, BlockSize: 32, Model: "a", DPRanks: []uint32{0}}); err != nil {
		t.Fatal(err)
	}
	if v := l.fsm.published(); v.blockSize != 32 {
		t.Errorf("/v1 block size of a cluster of model workers alone: %d, want 32, the smallest id's as before", v.blockSize)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 10, BlockSize: 16, DPRanks: []uint32{0}}); err != nil {
		t.Fatalf("the first /v1 worker (no model) beside a compat namespace of model a: %v", err)
	}
	if v := l.fsm.published(); v.blockSize != 16 || v.blockSizeFrom != 10 {
		t.Errorf("/v1 block size %d (worker %d's), want 16 (worker 10's)", v.blockSize, v.blockSizeFrom)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 11, BlockSize: 32, DPRanks: []uint32{0}}); !errors.Is(err, ErrBlockSizeConflict) {
		t.Errorf("a /v1 worker of the namespace's block size 32 beside /v1 worker 10 of 16: %v, want ErrBlockSizeConflict", err)
	}
}

// TestRegistrationsOfTwoBlockSizesSentTogetherTakeOne: RegisterWorker
// judges a worker without a model with every earlier registration through
// the leader applied (blockSizeMu, held until its apply returns): of two
// of different block sizes sent at once to an empty cluster, one is
// refused. From a review: both passed (the check read the table, and
// proposed with nothing held), and the cluster had two block sizes.
func TestRegistrationsOfTwoBlockSizesSentTogetherTakeOne(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	for try := 0; try < 20; try++ {
		a, b := uint64(2*try+1), uint64(2*try+2)
		errs := make(chan error, 2)
		go func() { errs <- l.RegisterWorker(ctx(t), WorkerInfo{ID: a, BlockSize: 8, DPRanks: []uint32{0}}) }()
		go func() { errs <- l.RegisterWorker(ctx(t), WorkerInfo{ID: b, BlockSize: 4, DPRanks: []uint32{0}}) }()
		e1, e2 := <-errs, <-errs
		if e1 == nil && e2 == nil {
			ws := l.fsm.Workers()
			t.Fatalf("try %d: both registrations of block sizes 8 and 4 passed: workers %d (bs %d) and %d (bs %d) registered together",
				try, a, ws[a].BlockSize, b, ws[b].BlockSize)
		}
		for _, err := range []error{e1, e2} {
			if err != nil && !errors.Is(err, ErrBlockSizeConflict) {
				t.Fatalf("try %d: %v, want nil or ErrBlockSizeConflict", try, err)
			}
		}
		for _, id := range []uint64{a, b} {
			if err := l.DeregisterWorker(ctx(t), id); err != nil && !errors.Is(err, ErrUnknownWorker) {
				t.Fatal(err)
			}
		}
	}
}

// TestRouteHashesTokensWithItsLoRAAndSalt: blocks indexed under a LoRA
// name and a salt (SeedFor) are found by a route of the same tokens that
// names both, and by no route that leaves either out (semantics.md §1).
// Only e2e's agent test covered the salt, and nothing the LoRA name.
func TestRouteHashesTokensWithItsLoRAAndSalt(t *testing.T) {
	c := newTestCluster(t, 1, nil)
	l := c.leader()
	if err := l.SetSettings(ctx(t), Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered}); err != nil {
		t.Fatal(err)
	}
	if err := l.RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	local := kvevent.LocalHashes(nil, tokens, 4, kvevent.SeedFor("ad", "s"))
	evs := []kvevent.Event{{EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
		Blocks: []kvevent.Block{{EngineHash: 100, LocalHash: local[0]}, {EngineHash: 101, LocalHash: local[1]}}}}
	if _, err := l.IngestEvents(ctx(t), []RankBatch{{Rank: kvevent.Rank{Worker: 1}, Events: evs}}); err != nil {
		t.Fatal(err)
	}
	for _, q := range []struct {
		lora, salt string
		want       uint32
	}{{"ad", "s", 2}, {"", "s", 0}, {"ad", "", 0}, {"", "", 0}, {"s", "ad", 0}} {
		res, err := l.Route(ctx(t), RouteQuery{Tokens: tokens, LoRA: q.lora, Salt: q.salt})
		if err != nil {
			t.Fatal(err)
		}
		if got := res.Decision.Chosen().Overlap[kvevent.TierDevice]; got != q.want {
			t.Errorf("lora %q salt %q: device overlap %d, want %d", q.lora, q.salt, got, q.want)
		}
	}
}

// TestAnUnbookedRouteAllocatesOnlyItsResult pins the hot-path rule of the
// developers' guide ("no per-event allocation you can avoid") on the
// route decision: hashing the tokens, the match, the loads and the score
// run in the pooled scratch (routeScratch), so an unbooked decision
// allocates only its result's candidates, one slice (the chosen one alone
// when brief). No test measured the decision's allocations: one more per
// call passed every test.
func TestAnUnbookedRouteAllocatesOnlyItsResult(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector makes sync.Pool drop items at random")
	}
	l, tokens, _ := deviceThenHost(t, []uint32{0, 1, 2, 3})
	for _, q := range []RouteQuery{
		{Tokens: tokens, Brief: true},
		{Tokens: tokens},
		{LocalHashes: []uint64{7, 8, 9}, ISL: 12, Brief: true},
	} {
		c := context.Background()
		if _, err := l.Route(c, q); err != nil {
			t.Fatal(err)
		}
		n := testing.AllocsPerRun(100, func() {
			if _, err := l.Route(c, q); err != nil {
				t.Fatal(err)
			}
		})
		if n > 1 {
			t.Errorf("%+v: a route decision allocated %.1f times, want at most 1 (its candidates)", q, n)
		}
	}
}
