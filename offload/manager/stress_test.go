package manager_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// TestConcurrentEngineNeverGetsForeignBytes runs an engine that computes,
// recomputes, offloads and frees G1 blocks (always Free before writing
// again, as the contract asks) while another goroutine onboards known
// blocks into G1 blocks of its own, over small pools that evict and
// promote all the time. Every block loaded, and every block the pools hold
// at the end, must have exactly the bytes of its hash: a copy that raced a
// Free must never have been stored.
func TestConcurrentEngineNeverGetsForeignBytes(t *testing.T) {
	const engineBlocks, onboardBlocks = 16, 16
	r := newRig(t, rigConfig{blocks: engineBlocks + onboardBlocks, hostCap: 24, diskCap: 48, gate: slowFromG1,
		cfg: manager.Config{Workers: 2, BatchSize: 4, QueueCapacity: 32}})
	var (
		mu     sync.Mutex
		known  []uint64 // hashes offloaded so far
		stop   = make(chan struct{})
		wg     sync.WaitGroup
		calls  atomic.Int64 // Onboard calls made
		loaded atomic.Int64 // blocks onboarded
	)
	rng := r.onboarderRand()
	wg.Add(1)
	go func() { // the onboarder: its own G1 blocks, its own random choices
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			mu.Lock()
			var hs []uint64
			for range 1 + rng.IntN(4) {
				if len(known) > 0 {
					// Half the time one of the last 32 offloaded, which
					// the pools are likely to hold still.
					lo := 0
					if rng.IntN(2) == 0 {
						lo = max(len(known)-32, 0)
					}
					hs = append(hs, known[lo+rng.IntN(len(known)-lo)])
				}
			}
			mu.Unlock()
			if len(hs) == 0 {
				continue
			}
			dst := ids(engineBlocks, len(hs))
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			res, err := r.m.Onboard(ctx, hs, dst)
			cancel()
			calls.Add(1)
			if err != nil {
				t.Error(err)
				return
			}
			<-res.Settled
			for i, b := range res.Blocks {
				switch b.Status {
				case manager.Loaded:
					loaded.Add(1)
					if !r.holds(dst[i], hs[i]) {
						t.Errorf("onboarded block %#x (from %v) into G1 block %d with foreign bytes", hs[i], b.From, dst[i])
					}
				case manager.NotFound:
				default:
					t.Errorf("onboard block %#x: %v %v", hs[i], b.Status, b.Err)
				}
			}
		}
	}()

	// At least 600 engine steps, and on until the onboarder made 50 calls
	// and the run copied something both ways: on a loaded machine the slow
	// copies can lose every race to the scribbles, so past step 600 the
	// engine stops scribbling until a copy and an onboard went through.
	var all []manager.OffloadRequest
	deadline := time.Now().Add(10 * time.Second)
	progressed := func() bool { return loaded.Load() > 0 && r.m.Stats().Paths[manager.D2H].Blocks > 0 }
	calm := false
	for op := 0; op < 600 || (calls.Load() < 50 || !progressed()) && time.Now().Before(deadline); op++ {
		calm = op >= 600 && !progressed()
		id := r.rng.IntN(engineBlocks)
		var req manager.OffloadRequest
		if len(all) > 0 && r.rng.IntN(3) == 0 {
			// A later request computes a known block again.
			check(t, r.m.Free(id))
			req = r.recompute(all[r.rng.IntN(len(all))], id)
		} else {
			check(t, r.m.Free(id))
			req = r.compute(0, r.rng.IntN(4), id)[0]
			all = append(all, req)
		}
		r.offload([]manager.OffloadRequest{req})
		mu.Lock()
		known = append(known, req.Hash)
		mu.Unlock()
		if calm {
			continue
		}
		switch r.rng.IntN(4) {
		case 0: // the block is evicted from G1 and reused at once, mid-copy
			r.scribble(id)
		case 1: // some other block is reused for data never offloaded
			r.scribble(r.rng.IntN(engineBlocks))
		}
	}
	close(stop)
	wg.Wait()
	r.idle()

	buf := make([]byte, bs)
	stored := 0
	for _, q := range all {
		for _, p := range []interface {
			Read(uint64, []byte) error
		}{r.host, r.disk} {
			err := p.Read(q.Hash, buf)
			if errors.Is(err, pool.ErrNotFound) {
				continue
			}
			check(t, err)
			stored++
			r.mu.Lock()
			ok := slices.Equal(buf, r.bytes[q.Hash])
			r.mu.Unlock()
			if !ok {
				t.Fatalf("a pool holds block %#x with foreign bytes", q.Hash)
			}
		}
	}
	s := r.m.Stats()
	t.Logf("%d copies held at the end; D2H %+v; H2Disk %+v; onboard %+v", stored,
		s.Paths[manager.D2H], s.Paths[manager.H2Disk], s.Onboard)
	if s.Paths[manager.D2H].Blocks == 0 || s.Onboard.FromHost+s.Onboard.FromDisk == 0 {
		t.Fatal("the stress run copied nothing")
	}
	if st := r.host.Stats(); st.Referenced != 0 || st.Pending != 0 {
		t.Fatalf("host pool after the run: %d referenced, %d pending", st.Referenced, st.Pending)
	}
	if st := r.disk.Stats(); st.Referenced != 0 || st.Pending != 0 {
		t.Fatalf("disk pool after the run: %d referenced, %d pending", st.Referenced, st.Pending)
	}
}

func TestCloseCancelsWaitingOnboardsAndWaitsForRunningCopies(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, gate: gateIntoG1,
		cfg: manager.Config{Workers: 1, BatchSize: 1, OnboardTimeout: time.Minute}})
	reqs := r.compute(0, 1, 0, 1)
	r.offload(reqs)
	r.idle()

	results := make(chan manager.Result, 2)
	start := func(h uint64, id int) {
		go func() {
			res, err := r.m.Onboard(context.Background(), []uint64{h}, []int{id})
			if err != nil {
				t.Error(err)
				res.Blocks = []manager.BlockResult{{}}
			}
			results <- res
		}()
	}
	start(reqs[0].Hash, 10)
	r.gate.waitEntered(t) // the only worker holds the first copy
	start(reqs[1].Hash, 11)
	waitFor(t, 10*time.Second, "the second Onboard to queue", func() bool {
		return r.m.Stats().Paths[manager.H2D].Depth == 1
	})

	closed := make(chan error)
	go func() { closed <- r.m.Close() }()
	for range 2 {
		select {
		case res := <-results:
			if res.Blocks[0].Status != manager.Canceled {
				t.Fatalf("Onboard during Close: %v, want canceled", res.Blocks[0].Status)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("Onboard still waiting after Close began")
		}
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a copy was still held", err)
	default:
	}
	r.gate.release()
	check(t, <-closed)
	if st := r.host.Stats(); st.Referenced != 0 {
		t.Fatalf("%d G2 blocks pinned after Close", st.Referenced)
	}
}
