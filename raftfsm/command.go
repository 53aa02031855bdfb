package raftfsm

import (
	"encoding/binary"
	"fmt"
	"iter"
	"maps"
	"slices"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
)

// Commands are the Raft log's entries. Each starts with a format version
// byte and a type byte; the rest is the type's compact binary encoding
// (codec.go). A decoder rejects anything it does not fully understand with
// ErrBadCommand. A garbled entry (truncated, or bytes no build writes) the
// FSM skips as a domain error: a committed entry cannot be refused, but it
// must never corrupt state. An entry a later build wrote (ErrLaterBuild: a
// version above commandVersion, a command type, a booking kind, an event
// kind or tier, a settings view or a worker extension this build does not
// know) the FSM does not skip: it halts there, applying nothing more,
// until the node runs a build that reads it (FSM.Halted), so that the
// upgraded node applies it from its log rather than lacking it for good.
//
// Version 2 adds the publisher incarnation to event batches (after each
// batch's rank) and to rank dumps (after the cursor), 8 bytes little
// endian each; the other types are encoded as in version 1. A command is
// written in version 1 unless it carries a non-zero incarnation, so that
// nodes of earlier builds read every entry a leader of this build writes
// until agents of this build send incarnations (upgrade the routers
// first: docs/operations.md). Version 1 entries are read as their batches
// and dumps having incarnation 0 (unfenced).
//
// Every command is safe to apply twice (a write that timed out may have
// committed, and its client retries): event batches through the per-rank
// cursor, registrations and settings by being absolute, bookings by
// request id, sweeps by their timestamp.

const (
	commandVersion   = 2 // the latest: with publisher incarnations; 1 and 2 are read
	commandVersionV1 = 1 // before publisher incarnations; what the rest is written in
)

type cmdType uint8

const (
	cmdEvents      cmdType = iota + 1 // per-rank event batches
	cmdReplace                        // a rank's full dump replaces its state
	cmdRegister                       // worker registration
	cmdDeregister                     // worker removal
	cmdBook                           // booking operations
	cmdExpire                         // expiry sweep
	cmdSettings                       // cluster scoring settings
	cmdMember                         // member table entry
	cmdMemberGone                     // member removed
	cmdCheck                          // replica digest check (see FSM.applyCheck)
	cmdRemoveRanks                    // unregistered ranks' removal (see FSM.removeUnregistered)
)

// command is the decoded form of any entry. Only the fields of its type are set.
type command struct {
	typ     cmdType
	now     int64 // leader time (unix nanos) for aging and bookings
	batches []RankBatch
	// cmdReplace
	rank        kvevent.Rank
	cursor      uint64
	incarnation uint64 // the dump's publisher incarnation (0: unfenced)
	stored      []kvevent.Event
	// cmdRemoveRanks
	ranks []kvevent.Rank
	// cmdRegister / cmdDeregister
	worker   WorkerInfo
	workerID uint64
	// cmdBook
	books bookOps
	// cmdExpire
	maxAgeNs int64
	// cmdSettings
	settings Settings
	// cmdMember / cmdMemberGone
	member Member
	// cmdCheck: the proposer's digest after it applied the check entry at
	// checkIndex (0: it has none to compare); and, from a leader whose
	// configuration is still the one it bootstrapped (Node.checkBootstrap),
	// that configuration and its log index (0: none carried).
	checkIndex, checkDigest uint64
	configIndex             uint64
	config                  []raft.Server
}

type bookKind uint8

const (
	bookAdd bookKind = iota + 1
	bookPrefillDone
	bookFree
	bookOutput // an output block: its sequence hash is SeqHashes[0]
	bookDecay  // a decay weight: Booking.Discount = DecayScale - weight
)

type bookOp struct {
	kind bookKind
	b    Booking
}

// bookOps are a book command's operations as the entry encodes them: the
// decoder checks them all, and all decodes them again one at a time as
// they apply. An operation decodes into an 88-byte bookOp from as few as
// 2 bytes of the entry, so a decoded slice of them cost 44 bytes per
// entry byte (2.8 GB for a 64 MiB entry, on every replica); one at a
// time, an entry costs what its ids and sequence hashes take, about its
// own size at most.
type bookOps struct {
	b []byte // the operations' bytes, a slice of the entry's data
	n int    // how many
}

// all yields the operations in order. The decoder checked them, so none
// fails here.
func (o bookOps) all() iter.Seq[bookOp] {
	return func(yield func(bookOp) bool) {
		d := dec{b: o.b}
		var op bookOp
		for range o.n {
			decodeBookOp(&d, &op)
			if !yield(op) {
				return
			}
		}
	}
}

// decodeBookOp reads one booking operation into op, or with op nil only
// checks it, allocating nothing.
func decodeBookOp(d *dec, op *bookOp) {
	kind := bookKind(d.u8("booking kind"))
	id := d.idBytes("request id")
	var b Booking
	switch kind {
	case bookAdd:
		b.Rank = decodeRank(d)
		m := d.count("seq hashes", 8)
		if op != nil {
			b.SeqHashes = make([]uint64, m)
		}
		for j := range m {
			h := d.u64("seq hash")
			if op != nil {
				b.SeqHashes[j] = h
			}
		}
		b.ISL = int(min(d.uv("isl"), 1<<40))
		b.CachedTokens = int(min(d.uv("cached"), 1<<40))
	case bookPrefillDone, bookFree:
	case bookOutput:
		if h := d.u64("output block hash"); op != nil {
			b.SeqHashes = []uint64{h}
		}
	case bookDecay:
		if v := d.uv("discount"); v <= indexer.DecayScale {
			b.Discount = uint32(v)
		} else {
			d.fail("discount")
		}
	default:
		if kind > bookDecay && d.err == nil {
			// A later build's kind: halted at, not skipped (kinds are
			// added without a version bump), so that a node of this build
			// does not go out of step with the upgraded ones.
			d.err = fmt.Errorf("%w: booking kind %d (this build reads 1 to %d)", ErrLaterBuild, kind, bookDecay)
		}
		d.fail("booking kind")
	}
	if op != nil {
		b.ID = string(id)
		*op = bookOp{kind: kind, b: b}
	}
}

// bookOutcome is the response of a book command of one add: the rank the
// id is booked on after it (the first booking's, for a retried add), or
// live false when nothing is. Then freed says that the id was booked and
// freed (or expired) before and its tombstone stands; left that the add
// named a rank no registered worker has (its worker left between the
// route's decision and the commit); err that the tracker refused the
// booking as invalid. Only freed means "request ids are single-use".
type bookOutcome struct {
	rank  kvevent.Rank
	live  bool
	freed bool
	left  bool
	err   error
}

// encodeHeader writes a command's header in version 1.
func encodeHeader(e *enc, t cmdType, now int64) { encodeHeaderV(e, commandVersionV1, t, now) }

func encodeHeaderV(e *enc, version uint8, t cmdType, now int64) {
	e.u8(version)
	e.u8(uint8(t))
	e.sv(now)
}

// eventBound is the most bytes encodeEvent writes for ev, so that a
// command's buffer is sized once: a large entry grown by append left
// about its own size again in garbage, which the collector paid for by
// tracing the index.
func eventBound(ev *kvevent.Event) int {
	return 2*binary.MaxVarintLen64 + 3 + 8 + 16*len(ev.Blocks) + 8*len(ev.Removed)
}

func eventsBound(evs []kvevent.Event) int {
	n := binary.MaxVarintLen64
	for i := range evs {
		n += eventBound(&evs[i])
	}
	return n
}

func encodeEvent(e *enc, ev *kvevent.Event) {
	e.uv(ev.EventID)
	e.u8(uint8(ev.Kind))
	e.u8(uint8(ev.Tier))
	switch ev.Kind {
	case kvevent.KindStored:
		e.bool(ev.HasParent)
		if ev.HasParent {
			e.u64(ev.Parent)
		}
		e.uv(uint64(len(ev.Blocks)))
		for _, b := range ev.Blocks {
			e.u64(b.EngineHash)
			e.u64(b.LocalHash)
		}
	case kvevent.KindRemoved:
		e.uv(uint64(len(ev.Removed)))
		for _, h := range ev.Removed {
			e.u64(h)
		}
	}
}

// decodeScratch holds the arrays that event commands decode into, reused
// from command to command by the FSM (ApplyBatch): a command's batches,
// events, blocks and removed hashes are slices of them, valid until the
// next command is decoded. Nothing the FSM does with a command keeps them:
// the index copies what it holds on to (an orphan's blocks), and bookings,
// which the load tracker keeps, are not decoded here. Per-event slices
// were about a tenth of all allocation on the event-plane benchmark.
type decodeScratch struct {
	batches []RankBatch
	events  []kvevent.Event
	blocks  []kvevent.Block
	removed []uint64
}

// reset makes the arrays free for the next command.
func (s *decodeScratch) reset() {
	s.batches, s.events, s.blocks, s.removed = s.batches[:0], s.events[:0], s.blocks[:0], s.removed[:0]
}

// take returns n zeroed elements after the slab's length. A full slab is
// replaced by a larger array; the slices taken before keep the old one.
func take[T any](slab *[]T, n int) []T {
	if n == 0 {
		return nil // as the first command into a fresh slab gets
	}
	s := *slab
	if len(s)+n > cap(s) {
		s = make([]T, 0, max(2*cap(s), n, 64))
	}
	out := s[len(s) : len(s)+n : len(s)+n]
	clear(out)
	*slab = s[:len(s)+n]
	return out
}

func decodeEvent(d *dec, sc *decodeScratch, r kvevent.Rank, ev *kvevent.Event) {
	ev.Rank = r
	ev.EventID = d.uv("event id")
	ev.Kind = kvevent.Kind(d.u8("event kind"))
	ev.Tier = kvevent.Tier(d.u8("event tier"))
	if !ev.Tier.Valid() && d.err == nil {
		// A node validates every event before it proposes it, so only a
		// later build (with a tier this one does not know) writes one:
		// halted at, not skipped, as a later booking kind.
		d.err = fmt.Errorf("%w: event tier %d (this build reads 0 to %d)", ErrLaterBuild, ev.Tier, kvevent.NumTiers-1)
	}
	switch ev.Kind {
	case kvevent.KindStored:
		ev.HasParent = d.bool("has parent")
		if ev.HasParent {
			ev.Parent = d.u64("parent")
		}
		n := d.count("blocks", 16)
		ev.Blocks = take(&sc.blocks, n)
		for i := range ev.Blocks {
			ev.Blocks[i] = kvevent.Block{EngineHash: d.u64("engine hash"), LocalHash: d.u64("local hash")}
		}
	case kvevent.KindRemoved:
		n := d.count("removed", 8)
		ev.Removed = take(&sc.removed, n)
		for i := range ev.Removed {
			ev.Removed[i] = d.u64("removed hash")
		}
	case kvevent.KindCleared:
	default:
		if ev.Kind > kvevent.KindCleared && d.err == nil {
			d.err = fmt.Errorf("%w: event kind %d (this build reads %d to %d)", ErrLaterBuild, ev.Kind, kvevent.KindStored, kvevent.KindCleared)
		}
		d.fail("event kind") // kind 0: no build's, garbled
	}
}

func encodeRank(e *enc, r kvevent.Rank) { e.uv(r.Worker); e.uv(uint64(r.DP)) }

func decodeRank(d *dec) kvevent.Rank {
	w := d.uv("worker")
	dp := d.uv("dp rank")
	if dp > 1<<32-1 {
		d.fail("dp rank")
	}
	return kvevent.Rank{Worker: w, DP: uint32(dp)}
}

// EncodeEvents encodes a batch of per-rank event batches.
func encodeEvents(now int64, batches []RankBatch) []byte {
	size := 64
	for i := range batches {
		size += 40 + eventsBound(batches[i].Events)
	}
	fenced := false // a batch carries an incarnation: version 2
	for i := range batches {
		fenced = fenced || batches[i].Incarnation != 0
	}
	e := enc{b: make([]byte, 0, size)}
	if fenced {
		encodeHeaderV(&e, commandVersion, cmdEvents, now)
	} else {
		encodeHeader(&e, cmdEvents, now)
	}
	e.uv(uint64(len(batches)))
	for i := range batches {
		encodeRank(&e, batches[i].Rank)
		if fenced {
			e.u64(batches[i].Incarnation)
		}
		e.uv(uint64(len(batches[i].Events)))
		for j := range batches[i].Events {
			encodeEvent(&e, &batches[i].Events[j])
		}
	}
	return e.b
}

// encodeReplace encodes a rank dump of publisher incarnation incarnation
// (0: unfenced, written in version 1).
func encodeReplace(now int64, r kvevent.Rank, cursor, incarnation uint64, stored []kvevent.Event) []byte {
	e := enc{b: make([]byte, 0, 104+eventsBound(stored))}
	if incarnation != 0 {
		encodeHeaderV(&e, commandVersion, cmdReplace, now)
	} else {
		encodeHeader(&e, cmdReplace, now)
	}
	encodeRank(&e, r)
	e.uv(cursor)
	if incarnation != 0 {
		e.u64(incarnation)
	}
	e.uv(uint64(len(stored)))
	for i := range stored {
		encodeEvent(&e, &stored[i])
	}
	return e.b
}

func encodeWorker(e *enc, w *WorkerInfo) {
	e.uv(w.ID)
	e.uv(uint64(len(w.DPRanks)))
	for _, r := range w.DPRanks {
		e.uv(uint64(r))
	}
	e.uv(uint64(w.BlockSize))
	for _, c := range w.Capacity {
		e.sv(c)
	}
	e.str(w.Endpoint)
	e.str(w.Model)
	// Extension 1: the compatible APIs' fields. A worker encoded before
	// it ends after the model.
	e.u8(1)
	e.str(w.Tenant)
	e.uv(w.Instance)
	encodeEndpoints(e, w.EventEndpoints)
	encodeEndpoints(e, w.ReplayEndpoints)
	e.str(w.Salt)
	e.sv(w.LeaseMs)
	e.bool(w.Positional)
}

// encodeEndpoints writes a dp rank → endpoint map in rank order, so that
// equal maps encode to equal bytes on every node.
func encodeEndpoints(e *enc, m map[uint32]string) {
	e.uv(uint64(len(m)))
	for _, r := range slices.Sorted(maps.Keys(m)) {
		e.uv(uint64(r))
		e.str(m[r])
	}
}

func decodeEndpoints(d *dec) map[uint32]string {
	n := d.count("endpoints", 2)
	if n == 0 {
		return nil
	}
	m := make(map[uint32]string, n)
	for i := 0; i < n; i++ {
		r := d.uv("endpoint dp rank")
		if r > 1<<32-1 {
			d.fail("endpoint dp rank")
		}
		m[uint32(r)] = d.str("endpoint")
	}
	return m
}

func decodeWorker(d *dec) WorkerInfo {
	var w WorkerInfo
	w.ID = d.uv("worker id")
	n := d.count("dp ranks", 1)
	for i := 0; i < n; i++ {
		r := d.uv("dp rank")
		if r > 1<<32-1 {
			d.fail("dp rank")
		}
		w.DPRanks = append(w.DPRanks, uint32(r))
	}
	w.DPRanks = uniqueRanks(w.DPRanks)
	bs := d.uv("block size")
	if bs > MaxBlockSize {
		d.fail("block size")
	}
	w.BlockSize = int(bs)
	for i := range w.Capacity {
		w.Capacity[i] = d.sv("capacity")
	}
	w.Endpoint = d.str("endpoint")
	w.Model = d.str("model")
	if d.err != nil || d.off == len(d.b) {
		return w // encoded before extension 1
	}
	switch ext := d.u8("worker extension"); {
	case d.err != nil || ext == 1:
	case ext > 1: // a later build's fields: refused, not misread
		d.err = fmt.Errorf("%w: worker extension %d (this build reads 1)", ErrLaterBuild, ext)
	default:
		d.fail("worker extension")
	}
	w.Tenant = d.str("tenant")
	w.Instance = d.uv("instance id")
	w.EventEndpoints = decodeEndpoints(d)
	w.ReplayEndpoints = decodeEndpoints(d)
	w.Salt = d.str("salt")
	w.LeaseMs = d.sv("lease")
	w.Positional = d.bool("positional") // 0 or 1 only: a later build bumps the extension
	return w
}

// decodeView reads a settings view. A view this build does not know is a
// later build's: refused, not read as dedup (View's String and the
// lookups take every view but tiered as dedup).
func decodeView(d *dec) indexer.View {
	v := indexer.View(d.u8("view"))
	if d.err == nil && v != indexer.ViewDedup && v != indexer.ViewTiered {
		d.err = fmt.Errorf("%w: settings view %d (this build reads %d, dedup, and %d, tiered)", ErrLaterBuild, v, indexer.ViewDedup, indexer.ViewTiered)
	}
	return v
}

// uniqueRanks returns ranks as they are when no rank is listed twice, and
// otherwise sorted with each rank once. RegisterWorker refuses a rank
// listed twice, but a log or a state written without that check (an
// embedding caller's, or an earlier build's) may hold one, and a committed
// registration cannot be refused: it is applied with each rank once
// rather than skipped, so that every replica, and every replay of the
// log, registers the worker as the others do. (Listed twice, a rank was
// two route candidates, and the second always looked idle.) Both decodes
// of a worker, an entry's and the state's, go through here.
func uniqueRanks(ranks []uint32) []uint32 {
	if len(ranks) < 2 {
		return ranks
	}
	seen := make(map[uint32]struct{}, len(ranks))
	for _, dp := range ranks {
		if _, dup := seen[dp]; dup {
			s := slices.Clone(ranks)
			slices.Sort(s)
			return slices.Compact(s)
		}
		seen[dp] = struct{}{}
	}
	return ranks
}

func encodeRegister(now int64, w *WorkerInfo) []byte {
	var e enc
	encodeHeader(&e, cmdRegister, now)
	encodeWorker(&e, w)
	return e.b
}

func encodeDeregister(now int64, id uint64) []byte {
	var e enc
	encodeHeader(&e, cmdDeregister, now)
	e.uv(id)
	return e.b
}

// encodeRemoveRanks writes the removal of ranks' state, each unless its
// worker's registration lists it when the entry applies.
func encodeRemoveRanks(now int64, ranks []kvevent.Rank) []byte {
	var e enc
	encodeHeader(&e, cmdRemoveRanks, now)
	e.uv(uint64(len(ranks)))
	for _, r := range ranks {
		encodeRank(&e, r)
	}
	return e.b
}

func encodeBook(now int64, ops []bookOp) []byte {
	var e enc
	encodeHeader(&e, cmdBook, now)
	e.uv(uint64(len(ops)))
	for _, op := range ops {
		e.u8(uint8(op.kind))
		e.str(op.b.ID)
		if op.kind == bookAdd {
			encodeRank(&e, op.b.Rank)
			e.uv(uint64(len(op.b.SeqHashes)))
			for _, h := range op.b.SeqHashes {
				e.u64(h)
			}
			e.uv(uint64(op.b.ISL))
			e.uv(uint64(op.b.CachedTokens))
		}
		if op.kind == bookOutput {
			e.u64(op.b.SeqHashes[0])
		}
		if op.kind == bookDecay {
			e.uv(uint64(op.b.Discount))
		}
	}
	return e.b
}

func encodeExpire(now int64, maxAgeNs int64) []byte {
	var e enc
	encodeHeader(&e, cmdExpire, now)
	e.sv(maxAgeNs)
	return e.b
}

// encodeCheck encodes a digest check carrying the proposer's digest after
// its apply of the check entry at index (0 and 0 when it has none).
func encodeCheck(now int64, index, digest uint64) []byte {
	var e enc
	encodeHeader(&e, cmdCheck, now)
	e.uv(index)
	e.u64(digest)
	return e.b
}

// encodeConfigCheck encodes a digest check (encodeCheck) that also carries
// the proposer's Raft configuration, the entry at configIndex of its log:
// each replica compares it with the entry at that index of its own log
// (FSM.applyCheck). The fields follow the digest's, so a build that reads
// only those skips the entry as undecodable (trailing bytes), which
// changes nothing.
func encodeConfigCheck(now int64, index, digest, configIndex uint64, servers []raft.Server) []byte {
	var e enc
	encodeHeader(&e, cmdCheck, now)
	e.uv(index)
	e.u64(digest)
	e.uv(configIndex)
	e.uv(uint64(len(servers)))
	for _, s := range servers {
		e.str(string(s.ID))
		e.str(string(s.Address))
		e.u8(uint8(s.Suffrage))
	}
	return e.b
}

// refused is the error of a command that decodes but that no build
// writes, which the FSM skips as a garbled one (ErrBadCommand): settings
// of a NaN, infinite or negative weight (every build's SetSettings
// refuses them; applied, they would fail every route, as Select refuses
// them). Weights above indexer.MaxWeight pass: an older build wrote them.
func (c *command) refused() error {
	if c.typ == cmdSettings {
		if err := c.settings.Params.ValidateStored(); err != nil {
			return fmt.Errorf("%w: settings no build writes: %v", ErrBadCommand, err)
		}
	}
	return nil
}

func encodeSettings(now int64, s *Settings) []byte {
	var e enc
	encodeHeader(&e, cmdSettings, now)
	p := s.Params
	for _, f := range []float64{p.OverlapScoreCredit, p.HostCacheHitWeight, p.DiskCacheHitWeight, p.PrefillLoadScale,
		p.DecodeActiveRequestWeight, p.Temperature, p.BusyDecodeFraction} {
		e.f64(f)
	}
	e.sv(p.BusyPrefillTokens)
	e.u8(uint8(s.View))
	return e.b
}

func encodeMember(now int64, m *Member) []byte {
	var e enc
	encodeHeader(&e, cmdMember, now)
	e.str(m.ID)
	e.str(m.RaftAddr)
	e.str(m.HTTPAddr)
	return e.b
}

// encodeMemberValue is the value of a member's record in the state
// database (its key is the member's id): its Raft and HTTP addresses.
func encodeMemberValue(m *Member) []byte {
	var e enc
	e.str(m.RaftAddr)
	e.str(m.HTTPAddr)
	return e.b
}

func encodeMemberGone(now int64, id string) []byte {
	var e enc
	encodeHeader(&e, cmdMemberGone, now)
	e.str(id)
	return e.b
}

// decodeCommand decodes one entry's data.
func decodeCommand(b []byte) (command, error) {
	return decodeCommandInto(b, &decodeScratch{})
}

// decodeCommandInto decodes one entry's data, its events into sc's arrays.
func decodeCommandInto(b []byte, sc *decodeScratch) (command, error) {
	d := dec{b: b}
	var c command
	v := d.u8("version")
	switch {
	case d.err == nil && v > commandVersion:
		return c, fmt.Errorf("%w: command format version %d (this build reads %d and %d)", ErrLaterBuild, v, commandVersionV1, commandVersion)
	case d.err == nil && v != commandVersion && v != commandVersionV1:
		return c, fmt.Errorf("%w: command format version %d (this build reads %d and %d)", ErrBadCommand, v, commandVersionV1, commandVersion)
	}
	fenced := v >= 2 // event batches and dumps carry an incarnation
	c.typ = cmdType(d.u8("type"))
	c.now = d.sv("time")
	switch c.typ {
	case cmdEvents:
		// A batch is at least its rank (two varints), its incarnation when
		// fenced and its event count: its count is checked at that, so
		// that decoded batches (48 bytes each) cost at most 16 bytes per
		// entry byte, not 24.
		least := 3
		if fenced {
			least = 11
		}
		n := d.count("batches", least)
		c.batches = take(&sc.batches, n)
		for i := range c.batches {
			rb := &c.batches[i]
			rb.Rank = decodeRank(&d)
			if fenced {
				rb.Incarnation = d.u64("incarnation")
			}
			m := d.count("events", 3)
			rb.Events = take(&sc.events, m)
			for j := range rb.Events {
				decodeEvent(&d, sc, rb.Rank, &rb.Events[j])
			}
		}
	case cmdReplace:
		c.rank = decodeRank(&d)
		c.cursor = d.uv("cursor")
		if fenced {
			c.incarnation = d.u64("incarnation")
		}
		n := d.count("stored", 3)
		c.stored = take(&sc.events, n)
		for i := range c.stored {
			decodeEvent(&d, sc, c.rank, &c.stored[i])
		}
	case cmdRegister:
		c.worker = decodeWorker(&d)
	case cmdDeregister:
		c.workerID = d.uv("worker id")
	case cmdRemoveRanks:
		n := d.count("ranks", 2)
		c.ranks = make([]kvevent.Rank, n)
		for i := range c.ranks {
			c.ranks[i] = decodeRank(&d)
		}
	case cmdBook:
		n := d.count("bookings", 2)
		start := d.off
		for range n {
			decodeBookOp(&d, nil)
		}
		c.books = bookOps{b: d.b[start:d.off], n: n}
	case cmdExpire:
		c.maxAgeNs = d.sv("max age")
	case cmdSettings:
		p := &c.settings.Params
		for _, f := range []*float64{&p.OverlapScoreCredit, &p.HostCacheHitWeight, &p.DiskCacheHitWeight, &p.PrefillLoadScale,
			&p.DecodeActiveRequestWeight, &p.Temperature, &p.BusyDecodeFraction} {
			*f = d.f64("param")
		}
		p.BusyPrefillTokens = d.sv("busy prefill tokens")
		c.settings.View = decodeView(&d)
	case cmdMember:
		c.member = Member{ID: d.id("member id"), RaftAddr: d.str("raft addr"), HTTPAddr: d.str("http addr")}
	case cmdMemberGone:
		c.member.ID = d.id("member id")
	case cmdCheck:
		c.checkIndex = d.uv("check index")
		c.checkDigest = d.u64("check digest")
		if d.err == nil && d.off < len(d.b) {
			c.configIndex = d.uv("check configuration index")
			// Three bytes at least per server: two lengths and a suffrage.
			n := d.count("check configuration servers", 3)
			c.config = make([]raft.Server, 0, n)
			for range n {
				s := raft.Server{ID: raft.ServerID(d.str("server id")), Address: raft.ServerAddress(d.str("server address"))}
				switch v := d.u8("server suffrage"); raft.ServerSuffrage(v) {
				case raft.Voter, raft.Nonvoter, raft.Staging:
					s.Suffrage = raft.ServerSuffrage(v)
				default:
					d.fail("server suffrage")
				}
				c.config = append(c.config, s)
			}
			if d.err == nil && (c.configIndex == 0 || n == 0) {
				d.fail("check configuration (an index and at least one server)")
			}
		}
	default:
		// A full header of a type this build does not know: a later
		// build's command (a truncated header is garbled).
		if d.err == nil {
			d.err = fmt.Errorf("%w: command type %d", ErrLaterBuild, c.typ)
		}
	}
	if err := d.done(); err != nil {
		return command{}, err
	}
	return c, nil
}
