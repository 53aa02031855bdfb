package raftfsm

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/kvrouter/kvrouter/internal/testseed"
	"github.com/kvrouter/kvrouter/kvevent"
)

// The sequential specification of event ingestion, per rank (porcupine
// checks each rank apart): the state is the rank's cursor. A batch of
// events first … first+n-1 counts the ids at or below the cursor as
// duplicates, applies the next ones while they follow the cursor by one,
// and stops at a gap; its answer is the ack that gives. A read answers the
// cursor.
type (
	linIn struct {
		rank     kvevent.Rank
		read     bool
		first    uint64
		n        int
		clientOp int
	}
	linOut struct {
		ack    RankAck // an ingest's
		cursor uint64  // a read's
	}
)

// linStep applies in to cursor cur.
func linStep(cur uint64, in linIn) (uint64, RankAck) {
	ack := RankAck{Rank: in.rank}
	for id := in.first; id < in.first+uint64(in.n); id++ {
		switch {
		case id <= cur:
			ack.Dups++
		case id == cur+1:
			cur = id
			ack.Applied++
		default:
			ack.Gap = true
		}
		if ack.Gap {
			break
		}
	}
	ack.Cursor = cur
	return cur, ack
}

var ingestModel = porcupine.Model{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[kvevent.Rank][]porcupine.Operation{}
		var order []kvevent.Rank
		for _, op := range h {
			r := op.Input.(linIn).rank
			if _, ok := by[r]; !ok {
				order = append(order, r)
			}
			by[r] = append(by[r], op)
		}
		out := make([][]porcupine.Operation, 0, len(order))
		for _, r := range order {
			out = append(out, by[r])
		}
		return out
	},
	Init: func() interface{} { return uint64(0) },
	Step: func(state, input, output interface{}) (bool, interface{}) {
		cur, in := state.(uint64), input.(linIn)
		if in.read {
			return output.(linOut).cursor == cur, cur
		}
		next, ack := linStep(cur, in)
		if output == nil {
			return true, next // unanswered: it applied here, if at all
		}
		got := output.(linOut).ack
		got.Resync = false // the index's business (this test's stores orphan), not the cursor's
		return got == ack, next
	},
	DescribeOperation: func(input, output interface{}) string {
		in := input.(linIn)
		if in.read {
			return fmt.Sprintf("read %v -> %d", in.rank, output.(linOut).cursor)
		}
		if output == nil {
			return fmt.Sprintf("ingest %v [%d, %d] -> ?", in.rank, in.first, in.first+uint64(in.n)-1)
		}
		a := output.(linOut).ack
		return fmt.Sprintf("ingest %v [%d, %d] -> cursor %d applied %d dups %d gap %v", in.rank, in.first, in.first+uint64(in.n)-1,
			a.Cursor, a.Applied, a.Dups, a.Gap)
	},
	DescribeState: func(state interface{}) string { return fmt.Sprintf("cursor %d", state.(uint64)) },
}

// TestIngestIsLinearizable: four clients ingest overlapping batches of
// two ranks' events through whichever node leads (so batches repeat,
// skip ahead and race one another), while the leader is killed (a crash:
// its unsynced state is lost) and started again, three times. Porcupine
// checks that every acknowledgement is that of one order of the batches
// in which each batch takes effect once, between its call and its answer
// (a batch left unanswered may have applied or not), and that the
// cursors read from every node at the end agree with that order. A
// failing history is written as a porcupine visualization.
func TestIngestIsLinearizable(t *testing.T) {
	seed := testseed.Seed(t)
	c := newTestCluster(t, 3, nil)
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 1, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	if err := c.leader().RegisterWorker(ctx(t), WorkerInfo{ID: 2, BlockSize: 16, DPRanks: []uint32{0, 1}}); err != nil {
		t.Fatal(err)
	}
	ranks := []kvevent.Rank{r1, r2}

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
		highest [2]atomic.Uint64 // the highest cursor acknowledged per rank: where batches aim
	)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for client := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(client)))
			pace := time.NewTicker(time.Millisecond)
			defer pace.Stop()
			for k := 0; ; k++ {
				select {
				case <-stop:
					return
				case <-pace.C:
				}
				n := leader()
				if n == nil {
					continue
				}
				ri := rng.IntN(len(ranks))
				in := linIn{rank: ranks[ri], n: 1 + rng.IntN(4), clientOp: k}
				// Around the cursor: some batches repeat, some follow,
				// some leave a gap.
				in.first = uint64(max(1, int64(highest[ri].Load())+int64(rng.IntN(6))-2))
				op := porcupine.Operation{ClientId: client, Input: in, Call: now()}
				cctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				acks, err := n.IngestEvents(cctx, []RankBatch{{Rank: in.rank, Events: chainEvents(in.rank, in.first, in.n, in.first*16)}})
				cancel()
				if err != nil {
					op.Return = math.MaxInt64 // unanswered: it may commit later, or never
				} else {
					op.Output, op.Return = linOut{ack: acks[0]}, now()
					acked.Add(1)
					for {
						h := highest[ri].Load()
						if acks[0].Cursor <= h || highest[ri].CompareAndSwap(h, acks[0].Cursor) {
							break
						}
					}
				}
				histMu.Lock()
				history = append(history, op)
				histMu.Unlock()
			}
		}()
	}
	waitAcked := func(more int64, what string) {
		want := acked.Load() + more
		waitFor(t, 30*time.Second, what, func() bool { return acked.Load() >= want })
	}
	waitAcked(100, "the first acknowledgements")
	for round := range 3 {
		nodesMu.Lock()
		down := -1
		for i, n := range c.nodes {
			if n != nil && n.IsLeader() {
				down = i
			}
		}
		if down >= 0 {
			c.crash(down)
		}
		nodesMu.Unlock()
		waitAcked(50, fmt.Sprintf("acknowledgements from a new leader (round %d)", round))
		if down >= 0 {
			nodesMu.Lock()
			c.start(down)
			nodesMu.Unlock()
		}
		waitAcked(50, fmt.Sprintf("acknowledgements after the restart (round %d)", round))
	}
	close(stop)
	wg.Wait()

	c.converged()
	for _, r := range ranks {
		want := c.nodes[0].Cursor(r)
		for _, n := range c.nodes {
			call := now()
			cur := n.Cursor(r)
			if cur != want {
				t.Errorf("%s holds rank %v at %d, %s at %d", n.cfg.ID, r, cur, c.nodes[0].cfg.ID, want)
			}
			history = append(history, porcupine.Operation{ClientId: 4, Input: linIn{rank: r, read: true},
				Call: call, Output: linOut{cursor: cur}, Return: now()})
		}
	}
	unanswered := 0
	for _, op := range history {
		if op.Output == nil {
			unanswered++
		}
	}
	t.Logf("%d operations, %d acknowledged, %d unanswered; cursors %d and %d",
		len(history), acked.Load(), unanswered, c.nodes[0].Cursor(r1), c.nodes[0].Cursor(r2))
	checkLinearizable(t, ingestModel, history, "ingest", "the acknowledgements", seed, unanswered)
}

// checkLinearizable checks history against model with porcupine and fails
// t unless it is linearizable: what names the answers checked, name the
// HTML visualisation of a failing history (name-linearizability-SEED.html
// in the temporary directory). A search that runs out of time says nothing
// either way, so it fails the test, in CI too: the histories stay small
// (operations left unanswered, which make the search grow, come from the
// leader crashes, about one a client a crash), and a check takes
// milliseconds against the minute allowed.
func checkLinearizable(t *testing.T, model porcupine.Model, history []porcupine.Operation, name, what string, seed uint64, unanswered int) {
	t.Helper()
	checkStart := time.Now()
	res, info := porcupine.CheckOperationsVerbose(model, history, time.Minute)
	t.Logf("porcupine: %v in %v", res, time.Since(checkStart))
	switch res {
	case porcupine.Ok:
	case porcupine.Unknown:
		t.Fatalf("porcupine gave up within its time limit: no verdict (seed %d, %d operations, %d unanswered)",
			seed, len(history), unanswered)
	default:
		path := filepath.Join(os.TempDir(), fmt.Sprintf("%s-linearizability-%d.html", name, seed))
		if err := porcupine.VisualizePath(model, info, path); err != nil {
			t.Logf("visualize: %v", err)
		}
		t.Fatalf("%s are not linearizable (seed %d); history in %s", what, seed, path)
	}
}
