package sim

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// OffloadConfig gives a timed worker (Engine) the node agent's offload
// tiers, run with the real offload code on the host backend: its G1 (the
// KV cache) is a device region of an offload/backend.Host, one slot per
// block, holding BlockBytes of real bytes per block; a block G1 evicts is
// copied to a G2 offload/pool.HostPool; blocks go from there (or from G1
// when there is no G2) to a G3 offload/pool.DiskPool (Pebble, in a
// temporary directory) by the offload manager's frequency filter; and a
// request whose prefix continues in G2/G3 past G1 loads those blocks back
// into G1 (a real copy, checked) and is charged their transfer time
// instead of their prefill. The zero value (no G2, no G3) is off: the
// worker is exactly the worker without offload.
//
// Everything runs synchronously on the replay's goroutine (each copy is
// waited for), so a replay stays deterministic.
type OffloadConfig struct {
	HostBlocks int // G2 capacity in blocks per worker; 0: no G2
	DiskBlocks int // G3 capacity in blocks per worker; 0: no G3
	// BlockBytes is the size of a block in G1, G2 and G3 in this
	// simulation (synthetic content derived from the block's hash),
	// rounded up to a multiple of 8; default 1,024. It does not change the timing, which counts a block's real KV
	// size (Timing.KVBytesPerToken × the engine's block size).
	BlockBytes int
	// HostGBps is the G2 → G1 bandwidth (host → GPU), in GB/s (1e9 bytes);
	// default 20 (PCIe Gen4 x16-class pinned copies).
	HostGBps float64
	// DiskGBps is the G3 → G1 bandwidth (disk → host staging → GPU, bound
	// by the disk), in GB/s; default 5 (one fast NVMe SSD).
	DiskGBps float64
	// DiskThreshold is the offload manager's filter (offload/manager
	// FilterConfig.Threshold): a block is written to G3 once it has been
	// seen that many times (an offload from G1, or an onboard that found
	// it); default 2, 1 writes every block. Counts halve every
	// DiskHalfLife sightings (default 65,536).
	DiskThreshold int
	DiskHalfLife  int
	// Dir is where each worker's G3 database gets its own temporary
	// directory, removed when the worker closes; default os.TempDir().
	Dir string
}

// Enabled reports whether the worker has an offload tier.
func (c OffloadConfig) Enabled() bool { return c.HostBlocks > 0 || c.DiskBlocks > 0 }

func (c OffloadConfig) withDefaults() OffloadConfig {
	if !c.Enabled() {
		return c
	}
	if c.BlockBytes <= 0 {
		c.BlockBytes = 1024
	}
	c.BlockBytes = (c.BlockBytes + 7) &^ 7
	if c.HostGBps <= 0 {
		c.HostGBps = 20
	}
	if c.DiskGBps <= 0 {
		c.DiskGBps = 5
	}
	// DiskThreshold and DiskHalfLife: zero takes the manager's defaults
	// (manager.NewSightings); a negative one is refused there.
	return c
}

// OffloadStats counts what a worker's offload tiers did (summed over the
// fleet in Result.Offload).
type OffloadStats struct {
	Offloaded     uint64 // blocks G1 evicted and copied into G2
	Revived       uint64 // blocks G1 evicted that G2 already held (no copy)
	OffloadFull   uint64 // blocks G1 evicted that G2 had no room for (lost)
	Cold          uint64 // blocks G1 evicted, no G2, that the filter kept off G3 (lost)
	DiskWritten   uint64 // blocks written to G3 (from G2, or from G1 without G2)
	DiskRevived   uint64 // G3 writes of a block G3 already held (no write, counted as used)
	DiskSkipped   uint64 // G3 writes dropped: the block left G2 first, or G3 had no room
	DiskPuts      uint64 // Pebble batches written
	LoadedHost    uint64 // blocks onboarded from G2 into G1
	LoadedDisk    uint64 // blocks onboarded from G3 into G1
	Checked       uint64 // onboarded blocks whose G1 bytes were checked
	Mismatches    uint64 // checked blocks whose bytes differed (a replay with any fails)
	HostEvictions uint64 // G2 evictions
	DiskEvictions uint64 // G3 evictions
	LoadNs        int64  // simulated transfer time charged for onboarding, before Engine.Speed
}

func (s *OffloadStats) add(o *OffloadStats) {
	s.Offloaded += o.Offloaded
	s.Revived += o.Revived
	s.OffloadFull += o.OffloadFull
	s.Cold += o.Cold
	s.DiskWritten += o.DiskWritten
	s.DiskRevived += o.DiskRevived
	s.DiskSkipped += o.DiskSkipped
	s.DiskPuts += o.DiskPuts
	s.LoadedHost += o.LoadedHost
	s.LoadedDisk += o.LoadedDisk
	s.Checked += o.Checked
	s.Mismatches += o.Mismatches
	s.HostEvictions += o.HostEvictions
	s.DiskEvictions += o.DiskEvictions
	s.LoadNs += o.LoadNs
}

// stageBlocks is the size of the staging buffer in blocks: the copies of
// one batch beyond it go in several rounds.
const stageBlocks = 256

// offloader is one worker's G1 region and offload tiers. It sees every
// event of the worker's Cache before the worker records it: a Removed
// block is copied out of its G1 slot (to G2, or to G3) before the slot is
// given back, and a Stored block gets a slot and its bytes (synthetic, or
// loaded from G2/G3 when the admission planned so).
type offloader struct {
	cfg   OffloadConfig
	rank  kvevent.Rank
	bs    int // bytes per block
	emit  func(*kvevent.Event)
	be    *backend.Host
	g1    backend.DeviceBuffer
	stage backend.HostBuffer
	st    backend.Stream
	ev    backend.Event
	host  *pool.HostPool
	disk  *pool.DiskPool
	dir   string

	slots  map[uint64]g1block // blocks in G1
	free   []int32            // free G1 slots, popped from the end
	filter *manager.Sightings[struct{}]
	plan   map[uint64]planned // the onboarding of the admission in progress
	diskQ  []diskWrite        // G3 writes waiting for the end of the pass

	stats   OffloadStats
	copies  []backend.Copy
	pending []onboardCopy
	want    []byte
}

type g1block struct {
	slot int32
	blk  pool.Block
}

type planned struct {
	tier kvevent.Tier // TierHostPinned or TierDisk
	blk  pool.Block
	src  backend.Ptr // the G2 slot (host)
	used bool
}

type onboardCopy struct {
	h    uint64
	slot int32
	p    planned
}

type diskWrite struct {
	blk  pool.Block
	data []byte // nil: read from G2 when written
}

// sinkFunc hands the pools' events to the worker, in order.
type sinkFunc func(*kvevent.Event)

func (f sinkFunc) Publish(_ kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	for i := range evs {
		f(&evs[i])
	}
	return 0, nil
}

func newOffloader(rank kvevent.Rank, g1Blocks int, cfg OffloadConfig, emit func(*kvevent.Event)) (o *offloader, err error) {
	filter, err := manager.NewSightings[struct{}](manager.FilterConfig{Threshold: cfg.DiskThreshold, HalfLife: cfg.DiskHalfLife})
	if err != nil {
		return nil, err
	}
	o = &offloader{cfg: cfg, rank: rank, bs: cfg.BlockBytes, emit: emit, slots: make(map[uint64]g1block),
		filter: filter, plan: make(map[uint64]planned), want: make([]byte, cfg.BlockBytes)}
	defer func() {
		if err != nil {
			o.close()
			err = fmt.Errorf("sim: offload tiers of worker %v: %w", rank, err)
		}
	}()
	if o.be, err = backend.NewHost(); err != nil {
		return o, err
	}
	if o.g1, err = o.be.AllocDevice(g1Blocks * o.bs); err != nil {
		return o, err
	}
	if o.stage, err = o.be.AllocHost(stageBlocks * o.bs); err != nil {
		return o, err
	}
	if o.st, err = o.be.NewStream(); err != nil {
		return o, err
	}
	if o.ev, err = o.be.NewEvent(); err != nil {
		return o, err
	}
	sink := sinkFunc(emit)
	if cfg.HostBlocks > 0 {
		if o.host, err = pool.NewHost(o.be, pool.Config{Rank: rank, Capacity: cfg.HostBlocks, BlockSize: o.bs, Sink: sink}); err != nil {
			return o, err
		}
	}
	if cfg.DiskBlocks > 0 {
		if o.dir, err = os.MkdirTemp(cfg.Dir, "kvsim-g3-"); err != nil {
			return o, err
		}
		if o.disk, err = pool.OpenDisk(o.dir, pool.Config{Rank: rank, Capacity: cfg.DiskBlocks, BlockSize: o.bs, Sink: sink}, pool.DiskOptions{}); err != nil {
			return o, err
		}
	}
	o.free = make([]int32, g1Blocks)
	for i := range o.free { // slot 0 first
		o.free[i] = int32(g1Blocks - 1 - i)
	}
	return o, nil
}

// close releases everything; the G3 directory is removed.
func (o *offloader) close() error {
	var errs []error
	if o.host != nil {
		errs = append(errs, o.host.Close())
	}
	if o.disk != nil {
		errs = append(errs, o.disk.Close())
	}
	if o.dir != "" {
		errs = append(errs, os.RemoveAll(o.dir))
	}
	if o.be != nil {
		errs = append(errs, o.be.Close()) // frees G1, the staging buffer, the stream and the event
	}
	o.host, o.disk, o.dir, o.be = nil, nil, "", nil
	return errors.Join(errs...)
}

// Stats returns the counters, with the pools' evictions.
func (o *offloader) snapshot() OffloadStats {
	s := o.stats
	if o.host != nil {
		s.HostEvictions = o.host.Stats().Evictions
	}
	if o.disk != nil {
		s.DiskEvictions = o.disk.Stats().Evictions
	}
	return s
}

// content fills b (a multiple of 8 bytes) with block h's synthetic
// bytes: each 8-byte word a mix of h and the word's position, so a block
// copied to the wrong place, or another block's bytes, never pass.
func content(b []byte, h uint64) {
	x := h
	for i := 0; i+8 <= len(b); i += 8 {
		x += 0x9e3779b97f4a7c15
		z := (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
		binary.LittleEndian.PutUint64(b[i:], z^(z>>31))
	}
}

func (o *offloader) slotPtr(s int32) backend.Ptr { return o.g1.At(int(s) * o.bs) }

func (o *offloader) stagePtr(i int) backend.Ptr { return o.stage.At(i * o.bs) }

func (o *offloader) stageBytes(i int) []byte { return o.stage.Bytes()[i*o.bs : (i+1)*o.bs] }

// run queues copies, waits for them and panics on a backend error: every
// pointer is the simulator's own, so an error is a bug.
func (o *offloader) run(copies []backend.Copy) {
	if len(copies) == 0 {
		return
	}
	err := o.be.CopyBatchAsync(o.st, copies)
	if err == nil {
		err = o.be.Record(o.ev, o.st)
	}
	if err == nil {
		err = o.be.Synchronize(o.ev)
	}
	if err != nil {
		panic(fmt.Sprintf("sim: offload copy: %v", err))
	}
}

// event handles one event of the worker's cache, then records it.
func (o *offloader) event(ev *kvevent.Event) {
	switch ev.Kind {
	case kvevent.KindRemoved:
		o.evicted(ev.Removed)
		o.emit(ev) // after the copies' STOREs: the index never loses the parent
		for _, h := range ev.Removed {
			b := o.slots[h]
			delete(o.slots, h)
			o.free = append(o.free, b.slot)
		}
	case kvevent.KindStored:
		o.stored(ev)
		o.emit(ev)
	default:
		o.emit(ev)
	}
}

// evicted copies the blocks G1 evicts, still in their slots, out: to G2,
// or to G3 (through the staging buffer) when there is no G2 and the filter
// passes them. Parents first: G1 evicts leaves first.
func (o *offloader) evicted(hs []uint64) {
	blocks := make([]pool.Block, 0, len(hs))
	src := make([]backend.Ptr, 0, len(hs))
	for i := len(hs) - 1; i >= 0; i-- {
		b, ok := o.slots[hs[i]]
		if !ok {
			panic(fmt.Sprintf("sim: G1 evicted block %#x without a slot", hs[i]))
		}
		blocks = append(blocks, b.blk)
		src = append(src, o.slotPtr(b.slot))
	}
	hot := make([]bool, len(blocks))
	for i := range blocks {
		hot[i] = o.filter.Hot(o.filter.See(blocks[i].Hash, nil))
	}
	if o.host == nil {
		o.toDiskFromG1(blocks, src, hot)
		return
	}
	before := o.host.Stats().Revived
	stored, err := o.host.RegisterFrom(o.st, o.ev, blocks, src)
	if err != nil && !errors.Is(err, pool.ErrFull) {
		panic(fmt.Sprintf("sim: offload to G2: %v", err))
	}
	// RegisterFrom stops at the first block with no room: the blocks from
	// there on that G2 did not hold already are lost.
	revived := int(o.host.Stats().Revived - before)
	o.stats.Offloaded += uint64(stored)
	o.stats.Revived += uint64(revived)
	if err != nil {
		o.stats.OffloadFull += uint64(len(blocks) - stored - revived)
	}
	if o.disk == nil {
		return
	}
	now := o.host.Lookup(hashesOf(blocks), nil)
	for i, b := range blocks {
		if hot[i] && now[i] {
			o.diskQ = append(o.diskQ, diskWrite{blk: b})
		}
	}
}

// toDiskFromG1 is the no-G2 path: a hot block's bytes are copied out of G1
// now (its slot is about to be reused) and written to G3 at the end of the
// pass; a cold one is lost.
func (o *offloader) toDiskFromG1(blocks []pool.Block, src []backend.Ptr, hot []bool) {
	if o.disk == nil {
		return
	}
	for start := 0; start < len(blocks); start += stageBlocks {
		end := min(start+stageBlocks, len(blocks))
		o.copies = o.copies[:0]
		var idx []int
		for i := start; i < end; i++ {
			if !hot[i] {
				o.stats.Cold++
				continue
			}
			o.copies = append(o.copies, backend.Copy{Dst: o.stagePtr(len(idx)), Src: src[i], N: o.bs})
			idx = append(idx, i)
		}
		o.run(o.copies)
		for j, i := range idx {
			o.diskQ = append(o.diskQ, diskWrite{blk: blocks[i], data: slices.Clone(o.stageBytes(j))})
		}
	}
}

func hashesOf(bs []pool.Block) []uint64 {
	hs := make([]uint64, len(bs))
	for i, b := range bs {
		hs[i] = b.Hash
	}
	return hs
}

// stored gives the new G1 blocks their slots and bytes: loaded from G2/G3
// for the blocks the admission planned to onboard, synthetic otherwise.
func (o *offloader) stored(ev *kvevent.Event) {
	parent := uint64(0)
	if ev.HasParent {
		parent = ev.Parent
	}
	o.copies = o.copies[:0]
	o.pending = o.pending[:0]
	n := 0
	for _, kb := range ev.Blocks {
		if len(o.free) == 0 {
			panic("sim: G1 has no free slot for a stored block")
		}
		s := o.free[len(o.free)-1]
		o.free = o.free[:len(o.free)-1]
		blk := pool.Block{Hash: kb.EngineHash, Parent: parent, Local: kb.LocalHash}
		o.slots[kb.EngineHash] = g1block{slot: s, blk: blk}
		parent = kb.EngineHash
		if p, ok := o.plan[kb.EngineHash]; ok {
			o.pending = append(o.pending, onboardCopy{h: kb.EngineHash, slot: s, p: p})
			continue
		}
		content(o.stageBytes(n), kb.EngineHash)
		o.copies = append(o.copies, backend.Copy{Dst: o.slotPtr(s), Src: o.stagePtr(n), N: o.bs})
		if n++; n == stageBlocks {
			o.run(o.copies)
			o.copies, n = o.copies[:0], 0
		}
	}
	o.run(o.copies)
	if len(o.pending) > 0 {
		o.onboard(o.pending)
	}
}

// plan pins the blocks of seq[from:to] that continue the request's prefix
// in G2 (preferred) or G3, and returns how many in each tier. The blocks
// load into G1 when the admission stores them (onboard); endPlan releases
// the pins.
func (o *offloader) planOnboard(local, seq []uint64, from, to int) (host, disk int) {
	for i := from; i < to; i++ {
		h := seq[i]
		blk := pool.Block{Hash: h, Local: local[i]}
		if i > 0 {
			blk.Parent = seq[i-1]
		}
		if o.host != nil {
			if s, err := o.host.Acquire(h); err == nil {
				o.plan[h] = planned{tier: kvevent.TierHostPinned, blk: blk, src: s.Ptr}
				host++
				continue
			}
		}
		if o.disk != nil {
			if err := o.disk.Acquire(h); err == nil {
				o.plan[h] = planned{tier: kvevent.TierDisk, blk: blk}
				disk++
				continue
			}
		}
		break
	}
	return host, disk
}

// loadMs is the transfer time of onboarding host blocks from G2 and disk
// blocks from G3, at their real KV size; it counts it in the stats.
func (o *offloader) loadMs(host, disk, blockSize int, t Timing) float64 {
	ms := t.TransferMs(host, blockSize, o.cfg.HostGBps) + t.TransferMs(disk, blockSize, o.cfg.DiskGBps)
	o.stats.LoadNs += int64(math.Round(ms * 1e6))
	return ms
}

// endPlan releases the admission's pins. loaded says whether the
// admission went ahead (every planned block must then have been loaded).
func (o *offloader) endPlan(loaded bool) {
	for h, p := range o.plan {
		if loaded && !p.used {
			panic(fmt.Sprintf("sim: planned block %#x was not onboarded", h))
		}
		var err error
		if p.tier == kvevent.TierHostPinned {
			err = o.host.Release(h)
		} else {
			err = o.disk.Release(h)
		}
		if err != nil {
			panic(fmt.Sprintf("sim: release onboarded block: %v", err))
		}
	}
	clear(o.plan)
}

// onboard copies planned blocks into their new G1 slots, G2 blocks with
// one device copy from their pinned slots, G3 blocks read from Pebble into
// the staging buffer and copied from there; then reads every slot back and
// checks its bytes. Each found block is a sighting for the G3 filter.
func (o *offloader) onboard(cs []onboardCopy) {
	o.copies = o.copies[:0]
	for _, c := range cs {
		if c.p.tier == kvevent.TierHostPinned {
			o.copies = append(o.copies, backend.Copy{Dst: o.slotPtr(c.slot), Src: c.p.src, N: o.bs})
			o.stats.LoadedHost++
		}
	}
	o.run(o.copies)
	o.copies = o.copies[:0]
	n := 0
	for _, c := range cs {
		if c.p.tier != kvevent.TierDisk {
			continue
		}
		if err := o.disk.Read(c.h, o.stageBytes(n)); err != nil {
			panic(fmt.Sprintf("sim: onboard from G3: %v", err))
		}
		o.copies = append(o.copies, backend.Copy{Dst: o.slotPtr(c.slot), Src: o.stagePtr(n), N: o.bs})
		o.stats.LoadedDisk++
		if n++; n == stageBlocks {
			o.run(o.copies)
			o.copies, n = o.copies[:0], 0
		}
	}
	o.run(o.copies)
	// Check: read the G1 slots back and compare with what the block was
	// given when it was first computed.
	for start := 0; start < len(cs); start += stageBlocks {
		part := cs[start:min(start+stageBlocks, len(cs))]
		o.copies = o.copies[:0]
		for i, c := range part {
			o.copies = append(o.copies, backend.Copy{Dst: o.stagePtr(i), Src: o.slotPtr(c.slot), N: o.bs})
		}
		o.run(o.copies)
		for i, c := range part {
			content(o.want, c.h)
			o.stats.Checked++
			if !bytes.Equal(o.stageBytes(i), o.want) {
				o.stats.Mismatches++
			}
		}
	}
	for _, c := range cs {
		p := o.plan[c.h]
		p.used = true
		o.plan[c.h] = p
		if o.filter.Hot(o.filter.See(c.p.blk.Hash, nil)) && o.disk != nil && c.p.tier == kvevent.TierHostPinned {
			o.diskQ = append(o.diskQ, diskWrite{blk: c.p.blk})
		}
	}
}

// flushDisk writes the pass's G3 writes in one Pebble batch: a promotion
// reads the block from G2 (pinned while written; skipped when it has left
// G2), a write from G1 has its bytes already.
func (o *offloader) flushDisk() {
	if len(o.diskQ) == 0 || o.disk == nil {
		o.diskQ = o.diskQ[:0]
		return
	}
	blocks := make([]pool.Block, 0, len(o.diskQ))
	data := make([][]byte, 0, len(o.diskQ))
	var pinned []uint64
	seen := make(map[uint64]bool, len(o.diskQ))
	for _, w := range o.diskQ {
		if seen[w.blk.Hash] {
			continue
		}
		seen[w.blk.Hash] = true
		if w.data != nil {
			blocks, data = append(blocks, w.blk), append(data, w.data)
			continue
		}
		s, err := o.host.Acquire(w.blk.Hash)
		if err != nil {
			o.stats.DiskSkipped++ // evicted from G2 since
			continue
		}
		pinned = append(pinned, w.blk.Hash)
		blocks, data = append(blocks, w.blk), append(data, s.Bytes)
	}
	o.diskQ = o.diskQ[:0]
	if len(blocks) > 0 {
		before := o.disk.Stats().Revived
		stored, err := o.disk.Put(blocks, data)
		if err != nil && !errors.Is(err, pool.ErrFull) {
			panic(fmt.Sprintf("sim: write to G3: %v", err))
		}
		revived := int(o.disk.Stats().Revived - before)
		o.stats.DiskPuts++
		o.stats.DiskWritten += uint64(stored)
		o.stats.DiskRevived += uint64(revived)
		o.stats.DiskSkipped += uint64(len(blocks) - stored - revived)
	}
	for _, h := range pinned {
		if err := o.host.Release(h); err != nil {
			panic(fmt.Sprintf("sim: release promoted block: %v", err))
		}
	}
}
