package raftfsm

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
)

// The sequential specification of the load bookings (semantics.md §6,
// docs/api.md "Routing and load"): the state is every request id the
// tracker knows, live (its rank, its sequence hashes, its uncached prefill
// tokens until prefill_done) or freed (a tombstone: the id books nothing
// again). A rank's load is its live requests' count, their prefill tokens
// and the number of distinct sequence hashes they hold.
//
// A booked route reads the load of every candidate (the leader's view,
// "each with the load of those booked before it") and then books: its
// answer must show the load of the state it is linearized at, and name the
// rank the id is booked on. A route left unanswered may have booked on any
// rank, or not at all (a nondeterministic step).
type (
	bkKind int
	bkIn   struct {
		kind bkKind
		id   string
		isl  int
		seq  []uint64
		// final: a read of a node's committed load at the end (Loads).
		node string
	}
	bkOut struct {
		rank   int // a route's chosen rank (index in bkRanks)
		booked bool
		loads  [len(bkRanks)]bkLoad
	}
	bkLoad struct{ requests, prefill, blocks int64 }
	bkReq  struct {
		rank    int
		prefill int64
		seq     []uint64
		freed   bool
	}
	bkState map[string]bkReq
)

const (
	bkRoute bkKind = iota
	bkPrefillDone
	bkFree
	bkRead
)

var bkRanks = [...]kvevent.Rank{{Worker: 1, DP: 0}, {Worker: 1, DP: 1}, {Worker: 2}}

func bkRankIndex(r kvevent.Rank) int {
	for i, x := range bkRanks {
		if x == r {
			return i
		}
	}
	return -1
}

func (s bkState) loads() (out [len(bkRanks)]bkLoad) {
	held := make([]map[uint64]bool, len(bkRanks))
	for i := range held {
		held[i] = map[uint64]bool{}
	}
	for _, b := range s {
		if b.freed {
			continue
		}
		out[b.rank].requests++
		out[b.rank].prefill += b.prefill
		for _, h := range b.seq {
			held[b.rank][h] = true
		}
	}
	for i := range out {
		out[i].blocks = int64(len(held[i]))
	}
	return out
}

func (s bkState) with(id string, b bkReq) bkState {
	next := make(bkState, len(s)+1)
	for k, v := range s {
		next[k] = v
	}
	next[id] = b
	return next
}

func (s bkState) String() string {
	ids := make([]string, 0, len(s))
	for id := range s {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var sb strings.Builder
	for _, id := range ids {
		b := s[id]
		if b.freed {
			fmt.Fprintf(&sb, "%s freed; ", id)
		} else {
			fmt.Fprintf(&sb, "%s on %v prefill %d; ", id, bkRanks[b.rank], b.prefill)
		}
	}
	return sb.String()
}

// bkStep is the sequential specification: the states in reaches from s
// answering out (nil: unanswered, any answer).
func bkStep(s bkState, in bkIn, out *bkOut) []bkState {
	b, known := s[in.id]
	switch in.kind {
	case bkRead:
		if s.loads() != out.loads {
			return nil
		}
		return []bkState{s}
	case bkRoute:
		if out == nil {
			states := []bkState{s}
			if !known {
				for r := range bkRanks {
					states = append(states, s.with(in.id, bkReq{rank: r, prefill: int64(in.isl), seq: in.seq}))
				}
			}
			return states
		}
		if s.loads() != out.loads {
			return nil
		}
		switch {
		case known && b.freed:
			if out.booked {
				return nil
			}
			return []bkState{s}
		case known:
			if !out.booked || out.rank != b.rank {
				return nil
			}
			return []bkState{s}
		default:
			if !out.booked {
				return nil
			}
			return []bkState{s.with(in.id, bkReq{rank: out.rank, prefill: int64(in.isl), seq: in.seq})}
		}
	case bkPrefillDone:
		next := s
		if known && !b.freed {
			b.prefill = 0
			next = s.with(in.id, b)
		}
		if out == nil {
			return []bkState{s, next}
		}
		return []bkState{next}
	case bkFree:
		next := s
		if known && !b.freed {
			next = s.with(in.id, bkReq{freed: true})
		}
		if out == nil {
			return []bkState{s, next}
		}
		return []bkState{next}
	}
	return nil
}

var bookingModel = porcupine.NondeterministicModel{
	Init: func() []interface{} { return []interface{}{bkState{}} },
	Step: func(state, input, output interface{}) []interface{} {
		var out *bkOut
		if output != nil {
			o := output.(bkOut)
			out = &o
		}
		var next []interface{}
		for _, s := range bkStep(state.(bkState), input.(bkIn), out) {
			next = append(next, s)
		}
		return next
	},
	Equal: func(a, b interface{}) bool {
		// The same id has the same sequence hashes wherever it is booked.
		return maps.EqualFunc(a.(bkState), b.(bkState), func(x, y bkReq) bool {
			return x.rank == y.rank && x.prefill == y.prefill && x.freed == y.freed
		})
	},
	DescribeOperation: func(input, output interface{}) string {
		in := input.(bkIn)
		ans := "?"
		if output != nil {
			o := output.(bkOut)
			ans = fmt.Sprintf("loads %v", o.loads)
			if in.kind == bkRoute {
				ans = fmt.Sprintf("rank %v booked %v, %s", bkRanks[o.rank], o.booked, ans)
			} else if in.kind != bkRead {
				ans = "ok"
			}
		}
		switch in.kind {
		case bkRoute:
			return fmt.Sprintf("route+book %s isl %d blocks %d -> %s", in.id, in.isl, len(in.seq), ans)
		case bkPrefillDone:
			return fmt.Sprintf("prefill_done %s -> %s", in.id, ans)
		case bkFree:
			return fmt.Sprintf("free %s -> %s", in.id, ans)
		}
		return fmt.Sprintf("loads of %s -> %s", in.node, ans)
	},
	DescribeState: func(state interface{}) string { return state.(bkState).String() },
}

// TestBookingsAreLinearizable: four clients each route-and-book their own
// requests through whichever node leads, mark them prefill_done and free
// them (each sometimes sent twice, a prefill_done sometimes skipped, a
// route sometimes sent again after its free, which books nothing),
// retrying a call that failed with the same id, while the leadership moves
// five times: the leader crashes (and starts again) and is handed over, in
// turn. Every booked route's answer shows the load of each
// candidate rank that it decided with; porcupine checks that these loads
// and the ranks the routes name are those of one order of the calls in
// which each takes effect once, between its call and its answer (a call
// left unanswered may have applied or not), and that the load every node
// holds at the end is that order's. The requests share block prefixes, so
// a rank's decode blocks count distinct blocks. A failing history is
// written as a porcupine visualization.
func TestBookingsAreLinearizable(t *testing.T) {
	seed := testseed.Seed(t)
	c := newTestCluster(t, 3, nil)
	const bs = 4
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: bs, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: bs}); err != nil {
		t.Fatal(err)
	}

	var nodesMu sync.Mutex // c.nodes changes under the clients' feet
	leader := func() *Node {
		nodesMu.Lock()
		defer nodesMu.Unlock()
		for _, n := range c.nodes {
			if n != nil && n.IsLeader() {
				return n
			}
		}
		return nil
	}
	start := time.Now()
	now := func() int64 { return int64(time.Since(start)) }
	var (
		histMu  sync.Mutex
		history []porcupine.Operation
		acked   atomic.Int64
		errsMu  sync.Mutex
		errs    = map[string]int{}
	)
	record := func(op porcupine.Operation) {
		histMu.Lock()
		history = append(history, op)
		histMu.Unlock()
	}
	stop := make(chan struct{})
	stopped := func() bool {
		select {
		case <-stop:
			return true
		default:
			return false
		}
	}
	var wg sync.WaitGroup
	for client := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(client)))
			pace := time.NewTicker(time.Millisecond)
			defer pace.Stop()
			// call sends one call to the leader until it is answered
			// (each try recorded; one that failed is left open) or the
			// test stops; it reports whether it was answered.
			call := func(in bkIn, do func(n *Node, ctx context.Context) (*bkOut, error)) bool {
				for !stopped() {
					<-pace.C
					n := leader()
					if n == nil {
						continue
					}
					op := porcupine.Operation{ClientId: client, Input: in, Call: now()}
					cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
					out, err := do(n, cctx)
					cancel()
					if err != nil {
						errsMu.Lock()
						errs[firstWords(err.Error())]++
						errsMu.Unlock()
						if !leadershipErr(err) {
							// A refusal (ErrInvalid) is an answer, and a
							// wrong one: every call here is valid.
							t.Errorf("client %d: %s: %v", client, in.id, err)
							return false
						}
						if !notApplied(err) {
							op.Return = math.MaxInt64 // unanswered: it may apply later, or never
							record(op)
						}
						continue
					}
					op.Output, op.Return = *out, now()
					record(op)
					acked.Add(1)
					return true
				}
				return false
			}
			for k := 0; !stopped(); k++ {
				id := fmt.Sprintf("c%d-%d", client, k)
				// 1 to 3 blocks from a small pool of first blocks, so
				// that requests share prefixes (and decode blocks).
				local := []uint64{uint64(1 + rng.IntN(3))}
				for range rng.IntN(3) {
					local = append(local, rng.Uint64())
				}
				isl := len(local)*bs + rng.IntN(bs)
				in := bkIn{kind: bkRoute, id: id, isl: isl, seq: kvevent.SequenceHashes(nil, local)}
				route := func(n *Node, ctx context.Context) (*bkOut, error) {
					res, err := n.Route(ctx, RouteQuery{LocalHashes: local, ISL: isl, Book: true, RequestID: id})
					if err != nil {
						return nil, err
					}
					out := bkOut{rank: bkRankIndex(res.Decision.Rank), booked: res.Booked}
					if len(res.Decision.Candidates) != len(bkRanks) {
						return nil, fmt.Errorf("route %s: %d candidates, want %d", id, len(res.Decision.Candidates), len(bkRanks))
					}
					for _, cs := range res.Decision.Candidates {
						out.loads[bkRankIndex(cs.Rank)] = bkLoad{cs.ActiveRequests, cs.ActivePrefillTokens, cs.ActiveDecodeBlocks}
					}
					return &out, nil
				}
				call(in, route) // a route never answered is freed all the same
				if rng.IntN(6) == 0 {
					call(in, route) // sent again (a lost answer): the first try's rank, counted once
				}
				write := func(kind bkKind, f func(n *Node, ctx context.Context, id string) error) {
					call(bkIn{kind: kind, id: id}, func(n *Node, ctx context.Context) (*bkOut, error) {
						if err := f(n, ctx, id); err != nil {
							return nil, err
						}
						return &bkOut{}, nil
					})
				}
				if rng.IntN(4) > 0 {
					write(bkPrefillDone, (*Node).PrefillDone)
					if rng.IntN(5) == 0 {
						write(bkPrefillDone, (*Node).PrefillDone) // idempotent
					}
				}
				// Some requests stay booked a while, so that loads add up.
				if rng.IntN(3) == 0 {
					continue
				}
				write(bkFree, (*Node).Free)
				if rng.IntN(5) == 0 {
					write(bkFree, (*Node).Free) // idempotent
				}
				if rng.IntN(6) == 0 {
					call(in, route) // a late duplicate of a freed id books nothing
				}
			}
		}()
	}
	waitAcked := func(more int64, what string) {
		want := acked.Load() + more
		waitFor(t, 30*time.Second, what, func() bool { return acked.Load() >= want })
	}
	crashLeader := func() int {
		nodesMu.Lock()
		defer nodesMu.Unlock()
		for i, n := range c.nodes {
			if n != nil && n.IsLeader() {
				c.crash(i)
				return i
			}
		}
		return -1
	}
	waitAcked(100, "the first acknowledgements")
	for round := range 5 {
		switch round % 2 {
		case 1:
			l := c.elected()
			transferLeadership(t, l, "")
			waitAcked(50, "acknowledgements after the transfer")
		default:
			down := crashLeader()
			waitAcked(50, fmt.Sprintf("acknowledgements from a new leader (round %d)", round))
			if down >= 0 {
				nodesMu.Lock()
				c.start(down)
				nodesMu.Unlock()
			}
			waitAcked(50, fmt.Sprintf("acknowledgements after the restart (round %d)", round))
		}
	}
	close(stop)
	wg.Wait()

	c.converged()
	for _, n := range c.nodes {
		call := now()
		var out bkOut
		for _, l := range n.Loads() {
			if i := bkRankIndex(l.Rank); i >= 0 {
				out.loads[i] = bkLoad{l.Load.ActiveRequests, l.Load.ActivePrefillTokens, l.Load.ActiveDecodeBlocks}
			} else {
				t.Errorf("%s holds load on %v, a rank never booked", n.cfg.ID, l.Rank)
			}
		}
		history = append(history, porcupine.Operation{ClientId: 4, Input: bkIn{kind: bkRead, node: n.cfg.ID},
			Call: call, Output: out, Return: now()})
	}
	unanswered := 0
	for _, op := range history {
		if op.Output == nil {
			unanswered++
		}
	}
	t.Logf("%d operations, %d acknowledged, %d unanswered (%v)", len(history), acked.Load(), unanswered, errs)
	checkLinearizable(t, bookingModel.ToModel(), history, "booking", "the bookings' answers", seed, unanswered)
}

// firstWords is an error's first words, to count errors by kind.
func firstWords(s string) string {
	f := strings.Fields(s)
	return strings.Join(f[:min(len(f), 4)], " ")
}

// notApplied reports whether err says that the write was not applied and
// never will be (docs/api.md: "503 no_leader ... nothing was applied", but
// for a write the leader lost with it in its log, MaybeApplied): such a
// call is left out of the history, as it did not happen.
func notApplied(err error) bool {
	if errors.Is(err, ErrNotProposed) {
		return true
	}
	var nle *NotLeaderError
	if errors.As(err, &nle) {
		return !nle.MaybeApplied
	}
	return errors.Is(err, ErrNoLeader) // a leader before its Barrier passed (CheckLeader)
}

// leadershipErr reports whether err is one of a write that met a leader
// change or a node's end (applied, maybe, or not: notApplied tells), as
// opposed to a refusal of the write itself.
func leadershipErr(err error) bool {
	for _, e := range []error{ErrNoLeader, ErrNotLeader, ErrShutdown, ErrNotProposed, context.DeadlineExceeded} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}
