package engineapi_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/engineapi"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

func TestOffloadEvictOnboardOverTheSocketIsByteIdentical(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 32})
	if res := r.register(0); res.Replaced || res.Backend != "host" {
		t.Fatalf("first registration: %+v", res)
	}
	blocks := r.compute(0, 1, ids(0, 8)...)
	if res := r.offload(0, blocks); res.Queued != 8 {
		t.Fatalf("offload queued %d of 8: %+v", res.Queued, res)
	}
	r.idle(0)
	hs := hashesOf(blocks)
	look, err := r.c.Lookup(r.ctx(), engineapi.LookupRequest{DPRank: 0, Hashes: append(slices.Clone(hs), 12345)})
	check(t, err)
	for i := range hs {
		if !slices.Equal(look.Tiers[i], []string{"host"}) {
			t.Fatalf("lookup of block %d: tiers %v, want [host]", i, look.Tiers[i])
		}
	}
	if len(look.Tiers[8]) != 0 || look.Prefix != 8 {
		t.Fatalf("lookup of an unknown hash: tiers %v, prefix %d; want none, 8", look.Tiers[8], look.Prefix)
	}

	// The engine evicts the blocks from G1 and reuses them.
	r.scribble(0, ids(0, 8)...)
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{DPRank: 0, Hashes: hs, G1Blocks: ids(20, 8), TimeoutMs: 5000})
	check(t, err)
	if res.Loaded != 8 || res.Prefix != 8 || !res.Settled {
		t.Fatalf("onboard: %+v", res)
	}
	for i, h := range hs {
		if b := res.Blocks[i]; b.Status != "loaded" || b.From != "host" {
			t.Fatalf("block %d: %+v, want loaded from host", i, b)
		}
		r.checkBytes(0, 20+i, h)
	}
	if st := r.rankStats(0); st.Host.Referenced != 0 || st.Manager.Onboard.FromHost != 8 {
		t.Fatalf("after onboarding: host %+v, onboard %+v", *st.Host, st.Manager.Onboard)
	}
}

func TestDiskTierServesBlocksEvictedFromHost(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 4, diskCap: 64, mgr: manager.Config{Filter: manager.FilterConfig{Always: true}}})
	r.register(0)
	var rounds [][]engineapi.OffloadBlock
	for round := range 3 {
		blocks := r.compute(0, 1, ids(4*round, 4)...)
		rounds = append(rounds, blocks)
		r.offload(0, blocks)
		waitFor(t, "the round on disk", func() bool {
			st := r.rankStats(0)
			return st.Idle() && st.Disk.Used == 4*(round+1)
		})
	}
	look, err := r.c.Lookup(r.ctx(), engineapi.LookupRequest{DPRank: 0, Hashes: append(hashesOf(rounds[0]), hashesOf(rounds[2])...)})
	check(t, err)
	for i, tiers := range look.Tiers {
		want := []string{"disk"}
		if i >= 4 {
			want = []string{"host", "disk"}
		}
		if !slices.Equal(tiers, want) {
			t.Fatalf("lookup %d: %v, want %v", i, tiers, want)
		}
	}

	r.scribble(0, ids(0, 12)...)
	hs := hashesOf(rounds[0])
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{DPRank: 0, Hashes: hs, G1Blocks: ids(40, 4)})
	check(t, err)
	if res.Loaded != 4 || !res.Settled {
		t.Fatalf("onboard from disk: %+v", res)
	}
	for i, h := range hs {
		if res.Blocks[i].From != "disk" {
			t.Fatalf("block %d came from %q, want disk", i, res.Blocks[i].From)
		}
		r.checkBytes(0, 40+i, h)
	}
}

func TestReRegisteringReplacesTheRegionAndKeepsThePools(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 16})
	r.register(0)
	blocks := r.compute(0, 1, ids(0, 4)...)
	r.offload(0, blocks)
	r.idle(0)

	// The engine restarts with a new G1 region (another file).
	r.g1[0] = newG1Sim(t, r.dir, r.n)
	if res := r.register(0); !res.Replaced {
		t.Fatalf("second registration: %+v, want replaced", res)
	}
	st := r.rankStats(0)
	if st.Manager.Paths["d2h"].Blocks != 0 || st.Host.Used != 4 {
		t.Fatalf("after replacing: d2h %+v, host used %d; want a new manager on the same pool", st.Manager.Paths["d2h"], st.Host.Used)
	}
	hs := hashesOf(blocks)
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{DPRank: 0, Hashes: hs, G1Blocks: ids(10, 4)})
	check(t, err)
	if res.Loaded != 4 {
		t.Fatalf("onboard into the new region: %+v", res)
	}
	for i, h := range hs {
		r.checkBytes(0, 10+i, h)
	}

	if res, err := r.c.Unregister(r.ctx(), 0); err != nil || !res.Unregistered {
		t.Fatalf("unregister: %+v, %v", res, err)
	}
	if _, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{DPRank: 0, Blocks: r.compute(0, 1, 0)}); !errors.Is(err, engineapi.ErrNotRegistered) {
		t.Fatalf("offload after unregister: %v, want ErrNotRegistered", err)
	}
	look, err := r.c.Lookup(r.ctx(), engineapi.LookupRequest{DPRank: 0, Hashes: hs})
	check(t, err)
	if look.Prefix != 4 {
		t.Fatalf("lookup without a region: %+v, want the pool's 4 blocks", look)
	}
}

// From a review: a register request is a hundred bytes, and num_blocks was
// bounded only by the size of the file behind shm_path, which may be
// sparse; the agent then sized its per-block state by it (16 Mi blocks:
// 512 MiB for one register and unregister; 8 Ti blocks: the agent died out
// of memory). A region past Config.MaxRegionBlocks is refused before
// anything is sized by it, and the old registration stays.
func TestRegisterOfMoreBlocksThanTheAgentAllowsIsRefusedBeforeAnyAllocation(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8})
	r.register(0)
	const blocks = 16 << 20 // 16 GiB of 1 KiB blocks, sparse
	f, err := os.Create(filepath.Join(r.dir, "sparse"))
	check(t, err)
	check(t, f.Truncate(int64(blocks)*bs))
	check(t, f.Close())

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err = r.c.Register(r.ctx(), engineapi.RegisterRequest{DPRank: 0, ShmPath: f.Name(), BlockSizeBytes: bs, NumBlocks: blocks})
	runtime.ReadMemStats(&after)
	if !errors.Is(err, engineapi.ErrBadRequest) {
		t.Fatalf("register of %d blocks (the agent allows %d): %v, want bad_request", blocks, engineapi.DefaultMaxRegionBlocks, err)
	}
	// Generous: the request, the answer and the race detector's own.
	if d := after.TotalAlloc - before.TotalAlloc; d > 16<<20 {
		t.Fatalf("the refused register allocated %d MiB", d>>20)
	}
	if st := r.rankStats(0); !st.Registered || st.NumBlocks != r.n {
		t.Fatalf("after the refused register: registered %v, %d blocks; want the old region of %d", st.Registered, st.NumBlocks, r.n)
	}
}

// Config.MaxRegionBlocks is the largest region taken, itself included.
func TestRegisterOfExactlyMaxRegionBlocksIsTaken(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, blocks: 32, maxRegion: 32})
	r.register(0)
	over := newG1Sim(t, r.dir, 33)
	_, err := r.c.Register(r.ctx(), engineapi.RegisterRequest{DPRank: 0, ShmPath: over.path, BlockSizeBytes: bs, NumBlocks: 33})
	if !errors.Is(err, engineapi.ErrBadRequest) {
		t.Fatalf("register of 33 blocks with MaxRegionBlocks 32: %v, want bad_request", err)
	}
}

// Unregistering frees every G1 block of the region: a copy into G2 that
// is running then must not store the block, nor publish it (the engine
// may write other data into its G1 block once the answer came). From a
// review: removing the Free from the shutdown left every test green.
func TestCopyInFlightAtUnregisterStoresNothing(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, gate: gateIntoG2, mgr: manager.Config{Workers: 1, BatchSize: 4}})
	freed := make(chan struct{})
	engineapi.SetFreedHook(func() { close(freed) })
	t.Cleanup(func() { engineapi.SetFreedHook(nil) }) // before the rig's Close, whose shutdowns must not call it
	r.register(0)
	r.offload(0, r.compute(0, 1, ids(0, 2)...))
	r.gate.waitEntered(t)
	done := make(chan error)
	go func() { _, err := r.c.Unregister(r.ctx(), 0); done <- err }()
	// The copy, held at the gate, goes on only once the blocks are freed
	// (the manager's Close then waits for it).
	select {
	case <-freed:
	case <-time.After(10 * time.Second):
		t.Fatal("the unregister never freed the region's blocks")
	}
	r.gate.release()
	check(t, <-done)
	if n, used := r.sink.count(), r.host[0].Stats().Used; n != 0 || used != 0 {
		t.Fatalf("after unregister: %d events published, %d G2 blocks stored from the old region", n, used)
	}
}

// heldChecker holds every CheckOffload (which the offload handler runs
// after it took its reference on the rank's attachment) until open is
// closed; entered is closed on the first.
type heldChecker struct {
	entered chan struct{}
	open    chan struct{}
	once    sync.Once
}

func (c *heldChecker) CheckOffload(kvevent.Rank, uint64, kvevent.Block) error {
	c.once.Do(func() { close(c.entered) })
	<-c.open
	return nil
}

// An offload request that took the region before an unregister and
// reaches the Manager only after the shutdown freed every G1 block (before
// it closed the Manager) is refused: queued in the blocks' new generation,
// its copy would publish a STORE of the old region's blocks, read from
// memory the engine no longer vouches for.
func TestOffloadInFlightAcrossUnregisterStoresNothing(t *testing.T) {
	c := &heldChecker{entered: make(chan struct{}), open: make(chan struct{})}
	r := newRig(t, rigConfig{hostCap: 8, checker: c, mgr: manager.Config{Workers: 1, BatchSize: 4}})
	r.register(0)
	blocks := r.compute(0, 1, ids(0, 2)...)
	offDone := make(chan error, 1)
	go func() {
		_, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{DPRank: 0, Blocks: blocks})
		offDone <- err
	}()
	select {
	case <-c.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the offload never reached the checker")
	}
	var offErr error
	engineapi.SetFreedHook(func() {
		// The shutdown has freed every block of the region; the offload
		// request still in its handler goes on now.
		close(c.open)
		offErr = <-offDone
		if offErr == nil {
			// Queued: give its copy the time to land before Close,
			// which would drop it still queued.
			deadline := time.Now().Add(2 * time.Second)
			for r.sink.count() == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
		}
	})
	t.Cleanup(func() { engineapi.SetFreedHook(nil) }) // before the rig's Close, whose shutdowns must not call it
	if _, err := r.c.Unregister(r.ctx(), 0); err != nil {
		t.Fatal(err)
	}
	if n, used := r.sink.count(), r.host[0].Stats().Used; n != 0 || used != 0 {
		t.Fatalf("after unregister: %d events published, %d G2 blocks stored from the old region's blocks, all freed before", n, used)
	}
	if !errors.Is(offErr, engineapi.ErrNotRegistered) {
		t.Fatalf("offload across the unregister: %v, want not_registered", offErr)
	}
}

// A rank with only a disk pool onboards through a staging buffer, whose
// copy into G1 is the H2D path's: /v1/stats lists it beside disk2h, with
// its blocks and bytes, as the metrics do.
func TestDiskOnlyRankStatsCountTheStagingHopUnderH2D(t *testing.T) {
	r := newRig(t, rigConfig{diskCap: 16, mgr: manager.Config{Filter: manager.FilterConfig{Always: true}}})
	r.register(0)
	blocks := r.compute(0, 1, 0, 1)
	r.offload(0, blocks)
	waitFor(t, "the blocks on disk", func() bool {
		st := r.rankStats(0)
		return st.Idle() && st.Disk.Used == 2
	})
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{DPRank: 0, Hashes: hashesOf(blocks), G1Blocks: []int{40, 41}})
	check(t, err)
	if res.Loaded != 2 {
		t.Fatalf("onboard from disk: %+v", res)
	}
	paths := r.rankStats(0).Manager.Paths
	for _, p := range []string{"disk2h", "h2d"} {
		if got, ok := paths[p]; !ok || got.Blocks != 2 || got.Bytes != 2*bs {
			t.Fatalf("disk-only rank's %s stats: %+v (listed %v), want 2 blocks, %d bytes", p, got, ok, 2*bs)
		}
	}
}

// A re-registration whose manager cannot start (the device has no streams
// left) is refused, and the old registration keeps serving: its manager
// still offloads from the old region.
func TestRefusedReRegistrationKeepsTheOldOne(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 16, streams: true})
	r.register(0)

	other := newG1Sim(t, r.dir, r.n)
	r.streams.fail.Store(true)
	_, err := r.c.Register(r.ctx(), engineapi.RegisterRequest{DPRank: 0, ShmPath: other.path, BlockSizeBytes: bs, NumBlocks: r.n})
	r.streams.fail.Store(false)
	if err == nil {
		t.Fatal("a registration whose manager could not make a stream succeeded")
	}
	if st := r.rankStats(0); !st.Registered {
		t.Fatalf("after the refused re-registration (%v) the rank has no registration", err)
	}
	blocks := r.compute(0, 1, ids(0, 4)...)
	if res := r.offload(0, blocks); res.Queued != 4 {
		t.Fatalf("offload after the refused re-registration: %+v, want 4 queued", res)
	}
	r.idle(0)
	if used := r.rankStats(0).Host.Used; used != 4 {
		t.Fatalf("host pool holds %d blocks, want the 4 offloaded from the old region", used)
	}
}

func TestBadRequestsAreRefusedAndChangeNothing(t *testing.T) {
	r := newRig(t, rigConfig{ranks: 2, hostCap: 16})
	r.register(0) // rank 1 has pools but no region
	good := r.compute(0, 1, 0, 1)
	r.offload(0, good)
	r.idle(0)
	short := filepath.Join(r.dir, "short")
	check(t, os.WriteFile(short, make([]byte, bs), 0o600))

	j := func(v any) string {
		b, err := json.Marshal(v)
		check(t, err)
		return string(b)
	}
	tooMany := make([]engineapi.Hash, engineapi.MaxRequestBlocks+1)
	for i := range tooMany {
		tooMany[i] = engineapi.Hash(i + 1)
	}
	off := func(bs ...engineapi.OffloadBlock) string { return j(engineapi.OffloadRequest{DPRank: 0, Blocks: bs}) }
	blk := func(id int, h uint64) engineapi.OffloadBlock {
		return engineapi.OffloadBlock{G1Block: id, Hash: engineapi.Hash(h), Priority: 1}
	}
	cases := []struct {
		name, method, path, body string
		status                   int
		want                     error
	}{
		{"malformed JSON", "POST", engineapi.PathOffload, `{"dp_rank":0,"blocks":[`, 400, engineapi.ErrBadRequest},
		{"unknown field", "POST", engineapi.PathOffload, `{"dp_rank":0,"block":[]}`, 400, engineapi.ErrBadRequest},
		{"trailing data", "POST", engineapi.PathFree, `{"dp_rank":0,"g1_blocks":[3]} {}`, 400, engineapi.ErrBadRequest},
		{"not an object", "POST", engineapi.PathFree, `[1,2]`, 400, engineapi.ErrBadRequest},
		// encoding/json takes null for an empty object: dp_rank 0.
		{"null unregisters nothing", "POST", engineapi.PathUnregister, `null`, 400, engineapi.ErrBadRequest},
		{"null offloads nothing", "POST", engineapi.PathOffload, ` null`, 400, engineapi.ErrBadRequest},
		{"no dp_rank", "POST", engineapi.PathUnregister, `{}`, 400, engineapi.ErrBadRequest},
		{"no dp_rank free", "POST", engineapi.PathFree, `{"g1_blocks":[3]}`, 400, engineapi.ErrBadRequest},
		// encoding/json matches names in any case; the last spelling wins.
		{"field in another case", "POST", engineapi.PathUnregister, `{"dp_rank":1,"DP_Rank":0}`, 400, engineapi.ErrBadRequest},
		{"field given twice", "POST", engineapi.PathUnregister, `{"dp_rank":1,"dp_rank":0}`, 400, engineapi.ErrBadRequest},
		{"block field in another case", "POST", engineapi.PathOffload, `{"dp_rank":0,"blocks":[{"G1_Block":3,"hash":7,"priority":1}]}`, 400, engineapi.ErrBadRequest},
		{"block field given twice", "POST", engineapi.PathOffload, `{"dp_rank":0,"blocks":[{"g1_block":3,"hash":7,"hash":8,"priority":1}]}`, 400, engineapi.ErrBadRequest},
		{"fractional hash", "POST", engineapi.PathOffload, `{"dp_rank":0,"blocks":[{"g1_block":3,"hash":1.5}]}`, 400, engineapi.ErrBadRequest},
		{"hash as a string", "POST", engineapi.PathLookup, `{"dp_rank":0,"hashes":["7"]}`, 400, engineapi.ErrBadRequest},
		{"hash over 64 bits", "POST", engineapi.PathLookup, `{"dp_rank":0,"hashes":[18446744073709551616]}`, 400, engineapi.ErrBadRequest},
		{"unknown dp rank", "POST", engineapi.PathOffload, j(engineapi.OffloadRequest{DPRank: 9, Blocks: []engineapi.OffloadBlock{blk(3, 77)}}), 404, engineapi.ErrUnknownRank},
		{"unknown dp rank lookup", "POST", engineapi.PathLookup, `{"dp_rank":9,"hashes":[1]}`, 404, engineapi.ErrUnknownRank},
		{"region not registered", "POST", engineapi.PathOffload, j(engineapi.OffloadRequest{DPRank: 1, Blocks: []engineapi.OffloadBlock{blk(3, 77)}}), 409, engineapi.ErrNotRegistered},
		{"free without a region", "POST", engineapi.PathFree, `{"dp_rank":1,"g1_blocks":[0]}`, 409, engineapi.ErrNotRegistered},
		{"block id out of range", "POST", engineapi.PathOffload, off(blk(3, 77), blk(64, 78)), 400, engineapi.ErrBadRequest},
		{"negative block id", "POST", engineapi.PathOffload, off(blk(-1, 77)), 400, engineapi.ErrBadRequest},
		{"zero hash", "POST", engineapi.PathOffload, off(blk(3, 77), blk(4, 0)), 400, engineapi.ErrBadRequest},
		{"own parent", "POST", engineapi.PathOffload, off(engineapi.OffloadBlock{G1Block: 3, Hash: 9, Parent: 9}), 400, engineapi.ErrBadRequest},
		{"block named twice", "POST", engineapi.PathOffload, off(blk(3, 77), blk(3, 78)), 400, engineapi.ErrBadRequest},
		{"free out of range", "POST", engineapi.PathFree, `{"dp_rank":0,"g1_blocks":[0,1,64]}`, 400, engineapi.ErrBadRequest},
		{"free more ids than the cap", "POST", engineapi.PathFree, j(engineapi.FreeRequest{G1Blocks: make([]int, engineapi.MaxRequestBlocks+1)}), 400, engineapi.ErrBadRequest},
		{"lookup more hashes than the cap", "POST", engineapi.PathLookup, j(engineapi.LookupRequest{Hashes: tooMany}), 400, engineapi.ErrBadRequest},
		{"onboard lengths differ", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: hashesOf(good), G1Blocks: []int{5}}), 400, engineapi.ErrBadRequest},
		{"onboard into a block twice", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: hashesOf(good), G1Blocks: []int{5, 5}}), 400, engineapi.ErrBadRequest},
		{"onboard zero hash", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: []engineapi.Hash{good[0].Hash, 0}, G1Blocks: []int{5, 6}}), 400, engineapi.ErrBadRequest},
		{"onboard out of range", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: hashesOf(good), G1Blocks: []int{5, 99}}), 400, engineapi.ErrBadRequest},
		{"onboard negative timeout", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: hashesOf(good), G1Blocks: []int{5, 6}, TimeoutMs: -1}), 400, engineapi.ErrBadRequest},
		// From a review: removing the upper bound left every test green.
		{"onboard timeout past the cap", "POST", engineapi.PathOnboard, j(engineapi.OnboardRequest{Hashes: hashesOf(good), G1Blocks: []int{5, 6}, TimeoutMs: engineapi.MaxTimeoutMs + 1}), 400, engineapi.ErrBadRequest},
		{"register wrong block size", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{ShmPath: r.g1[0].path, BlockSizeBytes: 512, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register no blocks", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{ShmPath: r.g1[0].path, BlockSizeBytes: bs}), 400, engineapi.ErrBadRequest},
		{"register no handle", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{BlockSizeBytes: bs, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register both handles", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{IPCHandle: []byte(r.g1[0].path), ShmPath: r.g1[0].path, BlockSizeBytes: bs, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register relative path", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{ShmPath: "g1", BlockSizeBytes: bs, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register missing file", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{ShmPath: filepath.Join(r.dir, "nope"), BlockSizeBytes: bs, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register file too short", "POST", engineapi.PathRegion, j(engineapi.RegisterRequest{ShmPath: short, BlockSizeBytes: bs, NumBlocks: 64}), 400, engineapi.ErrBadRequest},
		{"register bad base64", "POST", engineapi.PathRegion, `{"dp_rank":0,"ipc_handle":"!!","block_size_bytes":1024,"num_blocks":64}`, 400, engineapi.ErrBadRequest},
		{"wrong method", "GET", engineapi.PathOffload, ``, 405, nil},
		{"unknown path", "POST", "/v1/nothing", `{}`, 404, nil},
	}
	before, events := r.stats(), r.sink.count()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			status, body, err := r.c.Raw(r.ctx(), tc.method, tc.path, []byte(tc.body))
			check(t, err)
			var e engineapi.Error
			if err := json.Unmarshal(body, &e); err != nil || e.Code == "" || e.Message == "" {
				t.Fatalf("error answer %q is not {error, code} JSON", body)
			}
			e.Status = status
			if status != tc.status || (tc.want != nil && !errors.Is(&e, tc.want)) {
				t.Fatalf("answer %d %s, want %d %v", status, body, tc.status, tc.want)
			}
			r.idle(0)
			if after := r.stats(); !statsEqual(before, after) {
				t.Fatalf("a refused request changed the state:\nbefore %s\nafter  %s", jsonOf(before), jsonOf(after))
			}
			if n := r.sink.count(); n != events {
				t.Fatalf("a refused request published %d events", n-events)
			}
		})
	}
	// A request of exactly the cap is answered.
	look, err := r.c.Lookup(r.ctx(), engineapi.LookupRequest{Hashes: tooMany[:engineapi.MaxRequestBlocks]})
	check(t, err)
	if len(look.Tiers) != engineapi.MaxRequestBlocks {
		t.Fatalf("lookup of %d hashes answered %d", engineapi.MaxRequestBlocks, len(look.Tiers))
	}

	// The good blocks are still where they were, and onboard back.
	r.scribble(0, 0, 1)
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{DPRank: 0, Hashes: hashesOf(good), G1Blocks: []int{7, 8}})
	check(t, err)
	if res.Loaded != 2 {
		t.Fatalf("onboard after the refused requests: %+v", res)
	}
	r.checkBytes(0, 7, good[0].Hash)
	r.checkBytes(0, 8, good[1].Hash)
}

func jsonOf(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func statsEqual(a, b engineapi.StatsResponse) bool { return jsonOf(a) == jsonOf(b) }

// TestSignedHashesAreTheirUnsignedBits: an engine that numbers its blocks
// with signed 64-bit hashes sends them as they are.
func TestSignedHashesAreTheirUnsignedBits(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 4})
	r.register(0)
	b := r.compute(0, 1, 0)[0]
	neg := int64(-42)
	r.bytes[uint64(neg)] = r.bytes[uint64(b.Hash)]
	body := fmt.Sprintf(`{"dp_rank":0,"blocks":[{"g1_block":0,"hash":%d,"local":5,"priority":1}]}`, neg)
	if status, ans, err := r.c.Raw(r.ctx(), "POST", engineapi.PathOffload, []byte(body)); err != nil || status != 200 {
		t.Fatalf("offload with a signed hash: %d %s %v", status, ans, err)
	}
	r.idle(0)
	look, err := r.c.Lookup(r.ctx(), engineapi.LookupRequest{Hashes: []engineapi.Hash{engineapi.Hash(uint64(neg))}})
	check(t, err)
	if look.Prefix != 1 {
		t.Fatalf("lookup by the unsigned bits of -42: %+v", look)
	}
}

// TestOffloadFloodWithStalledBackendAnswersPromptlyAndSheds: every copy
// into G2 hangs; the engine floods offloads (and frees and lookups) from
// several goroutines. Each answer comes at once; the queue keeps its
// capacity and sheds the rest, and says so.
func TestOffloadFloodWithStalledBackendAnswersPromptlyAndSheds(t *testing.T) {
	const capacity, senders, each = 8, 4, 25
	r := newRig(t, rigConfig{blocks: 128, hostCap: 256, gate: gateIntoG2,
		mgr: manager.Config{Workers: 1, BatchSize: 1, QueueCapacity: capacity}})
	r.register(0)
	r.offload(0, r.compute(0, 100, 0))
	r.gate.waitEntered(t) // every copy from now on hangs

	reqs := make([][]engineapi.OffloadBlock, senders)
	for s := range reqs {
		reqs[s] = r.compute(0, 1, ids(1+s*each, each)...)
	}
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		shed    int
		slowest time.Duration
	)
	for s := range senders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for _, b := range reqs[s] {
				start := time.Now()
				res, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{Blocks: []engineapi.OffloadBlock{b}})
				_, ferr := r.c.Free(r.ctx(), engineapi.FreeRequest{G1Blocks: []int{127}})
				_, lerr := r.c.Lookup(r.ctx(), engineapi.LookupRequest{Hashes: []engineapi.Hash{b.Hash}})
				d := time.Since(start)
				if err := errors.Join(err, ferr, lerr); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				shed += res.Shed
				slowest = max(slowest, d)
				mu.Unlock()
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		r.gate.release()
		<-done
		t.Fatal("the engine's requests blocked behind stalled copies")
	}
	t.Logf("slowest offload+free+lookup round trip while stalled: %v", slowest)
	st := r.rankStats(0).Manager.Paths["d2h"]
	if flood := senders * each; shed != flood-capacity || st.Shed != uint64(flood-capacity) || st.Depth != capacity {
		t.Fatalf("shed %d (stats %d), depth %d; want %d shed, %d queued", shed, st.Shed, st.Depth, flood-capacity, capacity)
	}
	r.gate.release()
	r.idle(0)
	if used := r.rankStats(0).Host.Used; used != capacity+1 {
		t.Fatalf("host pool holds %d blocks, want %d", used, capacity+1)
	}
}

// TestOnboardAnswerSaysWhetherCopiesIntoG1MayStillLand: a copy into G1
// that hangs past the deadline is reported timed out; the answer waits
// SettleTimeout for it and then says settled=false. Once the copy is let
// go, a later onboard settles normally.
func TestOnboardAnswerSaysWhetherCopiesIntoG1MayStillLand(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, gate: gateOutOfG2, settle: 50 * time.Millisecond,
		mgr: manager.Config{Workers: 1, BatchSize: 4}})
	r.register(0)
	blocks := r.compute(0, 1, ids(0, 2)...)
	r.offload(0, blocks)
	r.idle(0)
	res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{Hashes: hashesOf(blocks), G1Blocks: ids(10, 2), TimeoutMs: 50})
	check(t, err)
	if res.Settled || res.Loaded != 0 || res.Blocks[0].Status != "timeout" {
		t.Fatalf("onboard with a hung copy: %+v, want timed out and not settled", res)
	}
	r.gate.release()
	waitFor(t, "the late write to be counted", func() bool { return r.rankStats(0).Manager.Onboard.LateWrites == 2 })
	res, err = r.c.Onboard(r.ctx(), engineapi.OnboardRequest{Hashes: hashesOf(blocks), G1Blocks: ids(20, 2)})
	check(t, err)
	if !res.Settled || res.Loaded != 2 {
		t.Fatalf("onboard after the release: %+v", res)
	}
	r.checkBytes(0, 20, blocks[0].Hash)
	r.checkBytes(0, 21, blocks[1].Hash)
}

// TestOnboardTimeoutLongerThanTheAgentsIsTheDeadline: an onboard's
// timeout_ms is its deadline even when longer than the manager's
// OnboardTimeout (--onboard-timeout), as docs/offload.md says. With a 1 ns
// OnboardTimeout, an onboard of 30 s whose copy is held at the gate waits
// for it and loads the blocks; one given the 1 ns would time out at once.
func TestOnboardTimeoutLongerThanTheAgentsIsTheDeadline(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, gate: gateOutOfG2, mgr: manager.Config{Workers: 1, OnboardTimeout: time.Nanosecond}})
	r.register(0)
	blocks := r.compute(0, 1, ids(0, 2)...)
	r.offload(0, blocks)
	r.idle(0)
	type answer struct {
		res engineapi.OnboardResponse
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{Hashes: hashesOf(blocks), G1Blocks: ids(10, 2), TimeoutMs: 30_000})
		done <- answer{res, err}
	}()
	select {
	case a := <-done:
		t.Fatalf("onboard answered %+v, %v before its copy ran: the 1 ns OnboardTimeout was its deadline, not timeout_ms", a.res, a.err)
	case <-r.gate.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no copy reached the gate")
	}
	r.gate.release()
	a := <-done
	check(t, a.err)
	if a.res.Loaded != 2 || !a.res.Settled {
		t.Fatalf("onboard with timeout_ms 30000 and a copy held past the 1 ns OnboardTimeout: %+v, want both loaded", a.res)
	}
	r.checkBytes(0, 10, blocks[0].Hash)
	r.checkBytes(0, 11, blocks[1].Hash)
}

func TestListenRemovesAStaleSocketAndRefusesALiveOne(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 4})
	be, err := backend.NewHost()
	check(t, err)
	defer be.Close()
	cfg := engineapi.Config{Socket: r.srv.Socket(), Backend: be, Ranks: []engineapi.RankPools{{Rank: rankOf(0), Host: r.host[0]}}}
	if _, err := engineapi.Listen(cfg); err == nil {
		t.Fatal("a second server took over a live socket")
	}
	if fi, err := os.Stat(r.srv.Socket()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v, want 0600", fi.Mode(), err)
	}

	// A socket file nobody serves on (a crashed agent's) is taken over.
	stale := filepath.Join(r.dir, "stale.sock")
	ln, err := net.Listen("unix", stale)
	check(t, err)
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	cfg.Socket = stale
	srv, err := engineapi.Listen(cfg)
	check(t, err)
	c := engineapi.NewClient(stale)
	defer c.Close()
	check(t, c.Health(context.Background()))
	check(t, srv.Close())
	if _, err := os.Stat(stale); !os.IsNotExist(err) {
		t.Fatalf("Close left the socket file: %v", err)
	}

	// Any other file is not ours to remove.
	plain := filepath.Join(r.dir, "plain")
	check(t, os.WriteFile(plain, nil, 0o600))
	cfg.Socket = plain
	if _, err := engineapi.Listen(cfg); err == nil {
		t.Fatal("Listen replaced a regular file")
	}
}

// The socket's server gives a request's header 10 s and closes a
// keep-alive connection idle for 2 minutes, and sets no read or write
// timeout. From a review: deleting both timeouts passed every test of the
// package.
func TestTheSocketsServerHasItsTimeouts(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 4})
	hs := r.srv.HTTPServer()
	if hs.ReadHeaderTimeout != 10*time.Second || hs.IdleTimeout != 2*time.Minute || hs.ReadTimeout != 0 || hs.WriteTimeout != 0 || hs.MaxHeaderBytes != 0 {
		t.Errorf("the socket's server: header timeout %v, idle %v, read %v, write %v, max header bytes %d; want 10s, 2m0s, none, none, the default",
			hs.ReadHeaderTimeout, hs.IdleTimeout, hs.ReadTimeout, hs.WriteTimeout, hs.MaxHeaderBytes)
	}
}

// A filter threshold past the manager's counts is refused when the server
// starts (kvagent's flag then fails at start, naming the setting), not at
// the engine's first registration.
func TestListenRefusesAFilterThresholdPastTheCountRange(t *testing.T) {
	be, err := backend.NewHost()
	check(t, err)
	defer be.Close()
	host, err := pool.NewHost(be, pool.Config{Rank: rankOf(0), BlockSize: bs, Capacity: 4})
	check(t, err)
	defer host.Close()
	srv, err := engineapi.Listen(engineapi.Config{Socket: filepath.Join(t.TempDir(), "kvagent.sock"), Backend: be,
		Ranks:   []engineapi.RankPools{{Rank: rankOf(0), Host: host}},
		Manager: manager.Config{Filter: manager.FilterConfig{Threshold: 1 << 32}}})
	if err == nil {
		srv.Close()
		t.Fatal("Listen accepted filter threshold 1<<32")
	}
	if !errors.Is(err, manager.ErrInvalid) || !strings.Contains(err.Error(), "filter threshold") {
		t.Fatalf("Listen: %v, want ErrInvalid naming the filter threshold", err)
	}
}

// TestCloseWithRequestsInFlightLeavesNothingRunning: onboards waiting on a
// hung copy when the agent stops get their answer; Close returns once the
// copies are let go, and goleak finds nothing after.
func TestCloseWithRequestsInFlightLeavesNothingRunning(t *testing.T) {
	r := newRig(t, rigConfig{hostCap: 8, gate: gateOutOfG2, mgr: manager.Config{Workers: 1, BatchSize: 1}})
	r.register(0)
	blocks := r.compute(0, 1, ids(0, 3)...)
	r.offload(0, blocks)
	r.idle(0)
	var wg sync.WaitGroup
	for i, b := range blocks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := r.c.Onboard(r.ctx(), engineapi.OnboardRequest{Hashes: []engineapi.Hash{b.Hash}, G1Blocks: []int{10 + i}, TimeoutMs: 30_000})
			var e *engineapi.Error
			if err != nil && !errors.As(err, &e) && !errors.Is(err, net.ErrClosed) {
				t.Logf("onboard during Close: %v", err) // a cut connection is fine
			}
		}()
	}
	r.gate.waitEntered(t)
	closed := make(chan error)
	go func() { closed <- r.srv.Close() }()
	r.gate.release()
	select {
	case err := <-closed:
		check(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return")
	}
	wg.Wait()
	if _, err := r.c.Stats(r.ctx()); err == nil {
		t.Fatal("the server answers after Close")
	}
	if st := r.host[0].Stats(); st.Referenced != 0 {
		t.Fatalf("%d G2 blocks still pinned after Close", st.Referenced)
	}
}

func TestErrorsKeepTheirSentinel(t *testing.T) {
	for _, tc := range []struct {
		code string
		want error
	}{{"bad_request", engineapi.ErrBadRequest}, {"unknown_rank", engineapi.ErrUnknownRank},
		{"not_registered", engineapi.ErrNotRegistered}, {"closed", engineapi.ErrClosed}} {
		err := fmt.Errorf("wrapped: %w", &engineapi.Error{Status: http.StatusBadRequest, Code: tc.code, Message: "x"})
		if !errors.Is(err, tc.want) {
			t.Fatalf("code %s does not unwrap to %v", tc.code, tc.want)
		}
	}
}

// refusing is a Checker that refuses one engine hash and records what it
// was asked.
type refusing struct {
	hash uint64
	mu   sync.Mutex
	seen []string
}

var errContradicts = errors.New("contradicts the engine's events")

func (c *refusing) CheckOffload(r kvevent.Rank, parent uint64, b kvevent.Block) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen = append(c.seen, fmt.Sprintf("%s %d %d %d", r, parent, b.EngineHash, b.LocalHash))
	if b.EngineHash == c.hash {
		return errContradicts
	}
	return nil
}

// TestOffloadBlockTheCheckerRefusesRefusesTheRequest: the Checker sees
// every block of an offload with the rank, parent, hash and local hash;
// one it refuses makes the request a bad_request naming the block, and
// nothing of it is queued.
func TestOffloadBlockTheCheckerRefusesRefusesTheRequest(t *testing.T) {
	c := &refusing{hash: 77}
	r := newRig(t, rigConfig{hostCap: 16, checker: c})
	r.register(0)
	bad := []engineapi.OffloadBlock{{G1Block: 1, Hash: 76, Local: 6, Priority: 1}, {G1Block: 2, Hash: 77, Parent: 76, Local: 7, Priority: 1}}
	_, err := r.c.Offload(r.ctx(), engineapi.OffloadRequest{DPRank: 0, Blocks: bad})
	var ae *engineapi.Error
	if !errors.As(err, &ae) || ae.Status != http.StatusBadRequest || !errors.Is(err, engineapi.ErrBadRequest) ||
		!strings.Contains(ae.Message, "blocks[1]") || !strings.Contains(ae.Message, errContradicts.Error()) {
		t.Fatalf("offload of a block the checker refuses: %v; want a 400 bad_request naming blocks[1]", err)
	}
	if st := r.rankStats(0); st.Manager.Paths["d2h"].Queued != 0 {
		t.Fatalf("a refused offload queued %d blocks", st.Manager.Paths["d2h"].Queued)
	}
	if res := r.offload(0, bad[:1]); res.Queued != 1 {
		t.Fatalf("offload of a block the checker passes: %+v", res)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	want := []string{rankOf(0).String() + " 0 76 6", rankOf(0).String() + " 76 77 7", rankOf(0).String() + " 0 76 6"}
	if !slices.Equal(c.seen, want) {
		t.Fatalf("the checker saw %q, want %q", c.seen, want)
	}
}

// TestAStalledBodyDoesNotHoldAConnectionForEver: a local client that
// sends a request's header with a Content-Length and never its body has
// its connection closed once the body timeout passes (30 s; a second
// here), as kvrouter's ports do. The socket's server read the body with
// no deadline: a stalled client held a handler, its goroutine and its
// connection until Close.
func TestAStalledBodyDoesNotHoldAConnectionForEver(t *testing.T) {
	defer engineapi.SetBodyTimeout(time.Second)()
	r := newRig(t, rigConfig{hostCap: 4})
	c, err := net.Dial("unix", r.srv.Socket())
	check(t, err)
	defer c.Close()
	_, err = c.Write([]byte("POST /v1/offload HTTP/1.1\r\nHost: kvagent\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"))
	check(t, err)
	const bound = 10 * time.Second // past the test's body timeout
	c.SetReadDeadline(time.Now().Add(bound))
	start := time.Now()
	_, err = io.Copy(io.Discard, c) // the answer, if any, then the close
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("a request whose body never came: its connection still open after %v (body timeout 1s)", bound)
	}
	t.Logf("closed after %v: %v", time.Since(start).Round(time.Millisecond), err)
}
