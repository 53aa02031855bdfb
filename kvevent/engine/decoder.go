package engine

import (
	"fmt"
	"slices"
	"strings"
	"unsafe"

	"github.com/kvrouter/kvrouter/kvevent"
)

// Config configures a Decoder for one rank of one worker.
type Config struct {
	// Rank is the rank followed, and the one the events are attributed to.
	// A batch whose data_parallel_rank names another dp rank is left out
	// whole (ReasonOtherDPRank): an engine that publishes several dp ranks
	// on one endpoint is indexed for Rank.DP only.
	Rank kvevent.Rank
	// BlockSize is the rank's registered block size, in tokens. Required.
	BlockSize int
	// Seed returns the content-hash seed of blocks stored under a LoRA
	// adapter, given the event's lora_name ("" when it has none). Nil means
	// kvevent.SeedFor(name, ""); SaltedSeed gives the seeds of an engine
	// that salts every block hash (its registered salt). A per-request
	// cache salt is never known here, see the package comment.
	Seed func(loraName string) uint64
	// MaxLearned bounds how many engine-hash → content-hash pairs (each with
	// its parent's engine hash) are kept to resolve stores that carry no
	// tokens (offload tiers). Zero means
	// DefaultMaxLearned; a negative value turns learning off, so that every
	// such store is dropped and counted as ReasonUnresolved.
	MaxLearned int
	// LearnGroupKinds, when set, remembers the kv_cache_spec_kind that
	// stores report for each group_idx, and classifies a later event that
	// has a group_idx but no kind (every BlockRemoved) by the kind learned for
	// its group. Off, events without a kind follow wire.md exactly: only
	// group 0 (or no group) is the main attention group. See the package
	// comment for when that rule misfiles removes of hybrid models.
	LearnGroupKinds bool
	// MaxCopies bounds how many (tier, engine hash) store counts are kept,
	// by which a remove of a block stored twice (two copies, see
	// copies.go) takes only one: the router's remove is left out until the
	// last copy goes. Zero means DefaultMaxCopies; a negative value turns
	// counting off, so that every remove is emitted.
	MaxCopies int
}

// DefaultMaxLearned is the default bound of Config.MaxLearned: a few MB per
// rank (two Go maps of an engine hash to its content and parent hashes),
// above the device blocks of one engine.
const DefaultMaxLearned = 1 << 17

// maxLearnedGroups bounds the group → kind table of LearnGroupKinds.
const maxLearnedGroups = 64

// maxSeenKept bounds the hashes of an event whose repeat check uses the
// decoder's reused set (a prompt of 64k tokens in blocks of 16): a longer
// event has its first maxSeenKept hashes checked in it and then all of them
// sorted in a copy, dropped after it (see repeats). A Go map never shrinks
// and clear costs its capacity, so a set kept after one large eviction
// would hold its memory and slow every later check.
const maxSeenKept = 1 << 12

// Reason is why a wire event, or some of its blocks, produced no router
// event. Reasons index Stats.Skipped and Stats.DroppedBlocks, and their
// String is the metric label.
type Reason uint8

// Reasons, in the order the rules are checked.
const (
	ReasonBadShape      Reason = iota // not an array or map with a string type tag
	ReasonUnknownType                 // a type other than BlockStored, BlockRemoved, AllBlocksCleared
	ReasonBadField                    // a field of the wrong msgpack type or out of range
	ReasonNotMainGroup                // not the main attention group (filtered, not malformed)
	ReasonUnknownMedium               // a medium that names no tier
	ReasonNoBlocks                    // a store or remove without block hashes
	ReasonRepeatedHash                // a hash repeated within a store, or a store's later hash equal to its parent
	ReasonParentIsFirst               // the first block hash equals the parent hash
	ReasonUnnamedLoRA                 // tokens under a LoRA given by lora_id only: no seed to hash them
	ReasonBlockSize                   // block_size ≠ the registered one, or tokens ≠ blocks × block_size
	ReasonUnresolved                  // no tokens, and the engine hash was never seen with tokens
	ReasonMMToken                     // a block whose tokens hold a multimodal digest (a str): not hashable from tokens
	ReasonOtherDPRank                 // the batch's data_parallel_rank is not Config.Rank.DP: another rank's events
	NumReasons
)

// absorbed is what convert returns for a remove that emits nothing because
// a copy of each block it names stays (Stats.Absorbed): not a Reason.
const absorbed = NumReasons

var reasonNames = [NumReasons]string{
	"bad_shape", "unknown_type", "bad_field", "not_main_group", "unknown_medium",
	"no_blocks", "repeated_hash", "parent_is_first", "unnamed_lora", "block_size", "unresolved",
	"mm_token", "other_dp_rank",
}

func (r Reason) String() string {
	if r < NumReasons {
		return reasonNames[r]
	}
	return fmt.Sprintf("reason(%d)", uint8(r))
}

// Stats are a Decoder's counters since it was made. A payload that fails
// with ErrPayload counts only in BadPayloads.
type Stats struct {
	Batches     uint64 // payloads decoded
	BadPayloads uint64 // payloads rejected whole with ErrPayload
	Events      uint64 // wire events read
	Emitted     uint64 // router events produced
	// Skipped counts wire events that produced no router event, by reason.
	// Every wire event read is either emitted or counted here once.
	Skipped [NumReasons]uint64
	// DroppedBlocks counts blocks left out of stores by the per-block rules
	// (ReasonBlockSize, ReasonUnresolved, ReasonMMToken): the first such block and every
	// later one of its event. When no block of an event is left, the event
	// is also counted in Skipped under the same reason. The blocks of the
	// stores of another dp rank's batch count under ReasonOtherDPRank.
	DroppedBlocks [NumReasons]uint64
	// ExtraKeyBlocks counts emitted stores' blocks whose engine hash covers
	// extra keys (vLLM's extra_keys: multimodal ids, cache salt;
	// TensorRT-LLM's mm_keys, Dynamo's block_mm_infos), from the first
	// block carrying one to the end of its store, since the engine's hashes
	// chain (a salt on block 0 covers every later block), or SGLang's
	// request metadata (a per-request cache_salt): their content hash
	// covers the tokens only, see the package comment. An entry that is
	// only the event's lora_name counts not (the content hashes are seeded
	// by it), nor does a later store of the same chain.
	ExtraKeyBlocks uint64
	// Learned is the number of engine-hash → content-hash pairs held now.
	Learned int
	// CopyRemoves counts hashes of removes left out because another copy
	// of the block, stored and not removed, stays (copies.go). Absorbed
	// counts removes that lost every hash so: they emit nothing, and are
	// neither emitted nor skipped.
	CopyRemoves, Absorbed uint64
	// Copies is the number of (tier, engine hash) store counts held now.
	Copies int
}

// SaltedSeed returns the Config.Seed of an engine whose every block hash
// carries salt (its registered additional salt): kvevent.SeedFor(lora,
// salt), so that a route with that cache_salt finds its blocks. Nil (the
// plain seeds) when salt is empty.
func SaltedSeed(salt string) func(loraName string) uint64 {
	if salt == "" {
		return nil
	}
	return func(lora string) uint64 { return kvevent.SeedFor(lora, salt) }
}

// A Decoder turns the payloads of one rank's engine into router events. It
// keeps state between payloads (the learned content hashes, the counters), so
// a rank has one Decoder, used by one goroutine at a time.
type Decoder struct {
	rank      kvevent.Rank
	blockSize int
	seed      func(string) uint64
	baseSeed  uint64
	learnKind bool

	learned   learnedHashes
	copies    copyCounts
	groupMain map[uint64]bool
	mediums   map[string]kvevent.Tier // medium spellings seen, so lookups do not allocate

	seeds map[string]uint64 // LoRA name → seed, so lookups do not allocate

	ev     wireEvent
	locals []uint64
	found  []learned // a store without tokens: what its resolved blocks' hashes taught
	spans  []span
	seen   map[uint64]struct{}
	left   int // bytes of the payload after the event being converted
	stats  Stats

	// mixedDP is set once a batch of another dp rank than Config.Rank.DP
	// was seen: from then on each payload's data_parallel_rank is read
	// before its events (peekDP), so that another rank's events are never
	// converted. Until then it is read where it comes, after the events in
	// the array encoding, and the first such batch is undone (Decode).
	mixedDP bool
	// otherDP is set while the payload being decoded is another rank's:
	// its events are read and counted, not converted.
	otherDP bool
}

// span locates an event's blocks or removed hashes in the Batch's storage
// while a payload is decoded; slices are cut once the storage stops growing.
type span struct{ start, end int }

// NewDecoder returns a Decoder for cfg.
func NewDecoder(cfg Config) (*Decoder, error) {
	if cfg.BlockSize <= 0 || cfg.BlockSize > maxBlockSize {
		return nil, fmt.Errorf("%w: block size %d", ErrConfig, cfg.BlockSize)
	}
	seed := cfg.Seed
	if seed == nil {
		seed = func(lora string) uint64 { return kvevent.SeedFor(lora, "") }
	}
	max := cfg.MaxLearned
	if max == 0 {
		max = DefaultMaxLearned
	}
	maxCopies := cfg.MaxCopies
	if maxCopies == 0 {
		maxCopies = DefaultMaxCopies
	}
	return &Decoder{
		rank:      cfg.Rank,
		blockSize: cfg.BlockSize,
		seed:      seed,
		baseSeed:  seed(""),
		learnKind: cfg.LearnGroupKinds,
		learned:   newLearned(max),
		copies:    newCopyCounts(maxCopies),
		groupMain: make(map[uint64]bool),
		mediums:   make(map[string]kvevent.Tier),
		seeds:     make(map[string]uint64),
		seen:      make(map[uint64]struct{}),
	}, nil
}

// Stats returns the decoder's counters.
func (d *Decoder) Stats() Stats {
	s := d.stats
	s.Learned = d.learned.len()
	s.Copies = d.copies.held()
	return s
}

// Reset forgets what the decoder learned from earlier payloads (content
// hashes, group kinds) and the copies it counted, keeping its counters.
// Call it when the rank starts a new epoch: the engine restarted, its cache
// is empty and its block hashes may be seeded anew.
func (d *Decoder) Reset() {
	d.learned.reset()
	clear(d.groupMain)
	d.copies.forget()
}

// ForgetCopies drops the copies counted (copies.go). Call it when the
// rank's state is cleared because batches were lost: a lost remove would
// leave a count above the engine's copies, and the block held on the router
// after the engine evicted its last one. The learned content hashes stay
// (the engine did not restart).
func (d *Decoder) ForgetCopies() { d.copies.forget() }

// Decode decodes one payload (the msgpack frame of one batch) and appends
// its router events to out.
//
// A malformed event is skipped and counted in Stats; the others still
// decode. A payload that cannot be read as a batch returns an error wrapping
// ErrPayload, and then out is as it was before the call; the error wraps
// ErrOtherDPRank too when the payload's data_parallel_rank, read before its
// events (after a first batch of another rank), names another dp rank.
// Nothing of payload is retained: the caller may reuse it as soon as Decode
// returns.
func (d *Decoder) Decode(payload []byte, out *Batch) error {
	if d.mixedDP {
		if dp, ok := peekDP(payload); ok && dp != d.rank.DP {
			return d.decodeOther(payload, out)
		}
		return d.decode(payload, out)
	}
	saved := d.stats
	nEvents, nBlocks, nRemoved := len(out.Events), len(out.blocks), len(out.removed)
	if err := d.decode(payload, out); err != nil || !out.HasDPRank || out.DPRank == d.rank.DP {
		return err
	}
	// The first batch of another dp rank: an engine (Dynamo's TensorRT-LLM
	// relay with attention DP, one endpoint for every rank) or a
	// misconfigured follower (--dp-start) sends several ranks' batches here.
	// Filed under Config.Rank, its blocks would be routed to a rank that
	// does not hold them, and its clear would clear this one. Its events
	// are taken back and the batch decoded again as another rank's. What
	// its stores taught (content hashes, group kinds) stays, true of the
	// engine's hashes whichever rank stored them; the copies it counted
	// cannot be told from this rank's, so all are forgotten, as after a
	// rejected payload (copies.go). Later payloads are peeked at first.
	clear(out.Events[nEvents:])
	out.Events = out.Events[:nEvents]
	out.blocks, out.removed = out.blocks[:nBlocks], out.removed[:nRemoved]
	d.stats = saved
	d.copies.forget()
	d.mixedDP = true
	return d.decodeOther(payload, out)
}

// decodeOther decodes a payload of another dp rank than Config.Rank.DP: its
// events are read, and counted under ReasonOtherDPRank, but none is
// converted or emitted, and no copy is counted for them. Its sequence is
// the subscriber's to take all the same (an empty batch, not a gap).
// One that does not decode returns an error wrapping ErrOtherDPRank
// as well as ErrPayload.
func (d *Decoder) decodeOther(payload []byte, out *Batch) error {
	d.otherDP = true
	defer func() { d.otherDP = false }()
	if err := d.decode(payload, out); err != nil {
		return fmt.Errorf("%w: %w", ErrOtherDPRank, err)
	}
	return nil
}

// decode is Decode's work for one payload, converting its events unless
// d.otherDP.
func (d *Decoder) decode(payload []byte, out *Batch) error {
	saved := d.stats
	nEvents, nBlocks, nRemoved := len(out.Events), len(out.blocks), len(out.removed)
	ts, dp, hasDP := out.TS, out.DPRank, out.HasDPRank

	rest, err := d.decodeBatch(payload, out)
	if err == nil && len(rest) != 0 {
		err = fmt.Errorf("%d bytes after the batch", len(rest))
	}
	// Between payloads, the scratch of the last event holds no more than
	// maxKeptBytes a slice, and nothing that points into payload.
	d.ev.reset()
	d.locals = reuse(d.locals)
	d.found = reuse(d.found)
	if err != nil {
		clear(out.Events[nEvents:])
		out.Events = out.Events[:nEvents]
		out.blocks, out.removed = out.blocks[:nBlocks], out.removed[:nRemoved]
		out.TS, out.DPRank, out.HasDPRank = ts, dp, hasDP
		d.stats = saved
		d.stats.BadPayloads++
		// The events read before the bad bytes changed the counts, and
		// those after them, removes perhaps, were never read: the counts
		// say nothing of the engine's copies now (copies.go). Another dp
		// rank's events count no copy: this rank's counts stay right.
		if !d.otherDP {
			d.copies.forget()
		}
		return fmt.Errorf("%w: at byte %d of %d: %w", ErrPayload, len(payload)-len(rest), len(payload), err)
	}

	// The storage has stopped growing: cut each event's slice out of it, and
	// stamp the rank (a batch of another dp rank emitted none).
	for i := range out.Events[nEvents:] {
		e := &out.Events[nEvents+i]
		e.Rank = d.rank
		s := d.spans[i]
		switch e.Kind {
		case kvevent.KindStored:
			e.Blocks = out.blocks[s.start:s.end:s.end]
		case kvevent.KindRemoved:
			e.Removed = out.removed[s.start:s.end:s.end]
		}
	}
	d.stats.Batches++
	return nil
}

// decodeBatch reads [ts, events, dp_rank?, ...] or {ts, events,
// data_parallel_rank}. It returns the bytes after the batch.
func (d *Decoder) decodeBatch(b []byte, out *Batch) ([]byte, error) {
	d.spans = reuse(d.spans)
	out.TS, out.DPRank, out.HasDPRank = 0, 0, false
	if len(b) == 0 {
		return b, fmt.Errorf("empty payload")
	}
	switch {
	case isArray(b[0]):
		n, rest, err := arrayHeader(b)
		if err != nil {
			return b, err
		}
		if n < 2 {
			return b, fmt.Errorf("batch array of %d elements, want [ts, events] or [ts, events, dp_rank]", n)
		}
		b = rest
		if b, err = d.readTS(b, out); err != nil {
			return b, err
		}
		if b, err = d.readEvents(b, out); err != nil {
			return b, err
		}
		if n >= 3 {
			if b, err = d.readDP(b, out); err != nil {
				return b, err
			}
		}
		return skipN(b, n-3) // later fields, if any, are ignored

	case isMap(b[0]):
		n, rest, err := mapHeader(b)
		if err != nil {
			return b, err
		}
		b = rest
		events := false
		for i := 0; i < n; i++ {
			key, rest, ok, err := readStr(b)
			if err != nil {
				return b, err
			}
			if !ok {
				if b, err = skipN(b, 2); err != nil {
					return b, err
				}
				continue
			}
			b = rest
			switch string(key) {
			case "ts":
				b, err = d.readTS(b, out)
			case "events":
				if events {
					return b, fmt.Errorf("batch map with two events keys")
				}
				events = true
				b, err = d.readEvents(b, out)
			case "data_parallel_rank":
				b, err = d.readDP(b, out)
			default:
				b, err = skipN(b, 1)
			}
			if err != nil {
				return b, err
			}
		}
		if !events {
			return b, fmt.Errorf("batch map without events")
		}
		return b, nil
	}
	return b, fmt.Errorf("batch is neither an array nor a map (lead byte %#x)", b[0])
}

func (d *Decoder) readTS(b []byte, out *Batch) ([]byte, error) {
	if len(b) > 0 && b[0] == mnil {
		return b[1:], nil
	}
	ts, rest, ok, err := readNumber(b)
	if err != nil {
		return b, err
	}
	if !ok {
		return b, fmt.Errorf("ts is not a number (lead byte %#x)", b[0])
	}
	out.TS = ts
	return rest, nil
}

// peekDP returns the data_parallel_rank of a payload, read over its events
// without decoding them; ok is false when it has none or cannot be read so
// (Decode then reports what is wrong with it).
func peekDP(b []byte) (dp uint32, ok bool) {
	if len(b) == 0 {
		return 0, false
	}
	switch {
	case isArray(b[0]):
		n, rest, err := arrayHeader(b)
		if err != nil || n < 3 {
			return 0, false
		}
		if rest, err = skipN(rest, 2); err != nil {
			return 0, false
		}
		v, _, ok, _ := readUint(rest, 1<<32-1)
		return uint32(v), ok
	case isMap(b[0]):
		n, rest, err := mapHeader(b)
		if err != nil {
			return 0, false
		}
		for i := 0; i < n; i++ {
			key, after, isStr, err := readStr(rest)
			if err != nil {
				return 0, false
			}
			if isStr && string(key) == "data_parallel_rank" { // the last one counts, as in decodeBatch
				v, _, isUint, _ := readUint(after, 1<<32-1)
				dp, ok = uint32(v), isUint
			}
			if rest, err = skipN(rest, 2); err != nil {
				return 0, false
			}
		}
		return dp, ok
	}
	return 0, false
}

func (d *Decoder) readDP(b []byte, out *Batch) ([]byte, error) {
	if len(b) > 0 && b[0] == mnil {
		out.HasDPRank = false
		return b[1:], nil
	}
	dp, rest, ok, err := readUint(b, 1<<32-1)
	if err != nil {
		return b, err
	}
	if !ok {
		return b, fmt.Errorf("data_parallel_rank is not an integer in [0, 2^32) (lead byte %#x)", b[0])
	}
	out.DPRank, out.HasDPRank = uint32(dp), true
	return rest, nil
}

func (d *Decoder) readEvents(b []byte, out *Batch) ([]byte, error) {
	if len(b) == 0 {
		return b, fmt.Errorf("no events")
	}
	if !isArray(b[0]) {
		return b, fmt.Errorf("events is not an array (lead byte %#x)", b[0])
	}
	n, b, err := arrayHeader(b)
	if err != nil {
		return b, err
	}
	// The events and their spans are sized once, for as many events as the
	// bytes left can emit: grown by append (a quarter at a time once large),
	// a flood of small events cost five times their final storage, 34 to 40
	// bytes a payload byte. Skipped events emit nothing, so the count alone
	// (a byte each) is not trusted.
	if k := min(n, len(b)/minEmittedEventBytes); k > 0 {
		out.Events = grow(out.Events, k)
		d.spans = grow(d.spans, k)
	}
	for i := 0; i < n; i++ {
		if b, err = readEvent(b, &d.ev); err != nil {
			return b, fmt.Errorf("events[%d]: %w", i, err)
		}
		d.left = len(b)
		d.stats.Events++
		if d.otherDP {
			d.stats.Skipped[ReasonOtherDPRank]++
			if d.ev.typ == evStored {
				d.stats.DroppedBlocks[ReasonOtherDPRank] += uint64(len(d.ev.hashes))
			}
			continue
		}
		if r, ok := d.convert(&d.ev, out); !ok {
			if r == absorbed {
				d.stats.Absorbed++
			} else {
				d.stats.Skipped[r]++
			}
		} else {
			d.stats.Emitted++
		}
	}
	return b, nil
}

// minEmittedEventBytes is the size of the smallest event that emits a
// router event: ["BlockStored", [h]] in the array encoding, a one-byte hash
// learned earlier (1 + 12 + 1 + 1 bytes); ["BlockRemoved", [h]] takes 16,
// ["AllBlocksCleared"] 18, and the map encoding more.
const minEmittedEventBytes = 15

// room returns s with room for m more elements. When it has none, it is
// grown to four times its capacity, but never past m more than the bytes
// left after the event (left: a byte at least a hash or block) can add, so
// the storage a payload's blocks or removed hashes end in is at most what
// its bytes can hold, and the copies on the way cost a third of that.
// (Grown by append, a quarter at a time once large, they cost five times
// their final storage: 81 bytes a payload byte for many events of a
// hundred one-byte hashes.) Nor is it grown past maxKeptBytes while what
// it needs fits there, so that storage Reset would keep is not dropped.
func room[T any](s []T, m, left int) []T {
	if cap(s)-len(s) >= m {
		return s
	}
	need := len(s) + m
	c := min(max(need, 4*cap(s)), need+left)
	var zero T
	if kept := maxKeptBytes / int(unsafe.Sizeof(zero)); need <= kept {
		c = min(c, kept)
	}
	return grow(s, c-len(s))
}

// grow returns s with room for n more elements, as slices.Grow, but with
// one allocation of that capacity under the race detector too, where
// slices.Grow's append of n zero elements allocates them apart as well
// (the tests' allocation bounds hold under go test -race).
func grow[T any](s []T, n int) []T {
	if cap(s)-len(s) >= n {
		return s
	}
	g := make([]T, len(s), len(s)+n)
	copy(g, s)
	return g
}

// Fields each event type reads: a bad value in any other field is ignored.
const (
	storedUses  = 1<<fHashes | 1<<fParent | 1<<fTokens | 1<<fBlockSize | 1<<fMedium | 1<<fLoraName | 1<<fGroup | 1<<fKind
	removedUses = 1<<fHashes | 1<<fMedium | 1<<fGroup | 1<<fKind
	// AllBlocksCleared has no fields (wire.md): a clear wipes the rank in
	// every tier and group, so no group or kind sent with one (the map
	// encoding reads them) can cost it, as none can in the array one.
	clearedUses = 0
)

// convert applies the rules of wire.md and semantics.md §1–2 to one wire
// event and appends the router event it gives to out. It returns false, and
// the reason, when the event gives none.
func (d *Decoder) convert(e *wireEvent, out *Batch) (Reason, bool) {
	if e.badShape {
		return ReasonBadShape, false
	}
	var uses uint16
	switch e.typ {
	case evStored:
		uses = storedUses
	case evRemoved:
		uses = removedUses
	case evCleared:
		uses = clearedUses
	default:
		return ReasonUnknownType, false
	}
	// vLLM's offloading connector stores a block in its CPU or STORAGE tier,
	// unless self_describing_kv_events is set, as a placeholder: one hash,
	// no parent, no tokens and block_size 0, its "unknown". Without tokens
	// a size says nothing the decoder reads, so 0 is an absent size there;
	// with tokens it is out of range, as any other size that is not one.
	if e.typ == evStored && e.has(fBlockSize) && e.blockSize == 0 {
		e.present &^= fBlockSize.bit()
		if len(e.tokens) > 0 {
			e.bad |= fBlockSize.bit()
		}
	}
	if e.bad&uses != 0 {
		if e.typ == evRemoved {
			d.copies.drop(e.hashes) // a copy went: which tier's, unknown
		}
		return ReasonBadField, false
	}
	if e.typ == evCleared {
		d.copies.forget() // the rank is cleared in every tier
		out.Events = append(out.Events, kvevent.Event{Kind: kvevent.KindCleared})
		d.spans = append(d.spans, span{})
		return 0, true
	}
	if !d.mainGroup(e) {
		return ReasonNotMainGroup, false
	}

	// A tier whose storage is REMOTE to the engine (vLLM's FS or OBJ
	// secondary tier configured so, medium STORAGE) is not the worker's
	// disk: its blocks go under External, the tier of remote or shared
	// storage, whatever the medium says. LOCAL, absent or any other value
	// keeps the medium's tier (semantics.md, Mediums).
	tier, ok := kvevent.TierExternal, true
	if !isRemote(e.locality) {
		tier, ok = d.tier(e.medium)
	}
	if !ok {
		if e.typ == evRemoved {
			d.copies.drop(e.hashes)
		}
		return ReasonUnknownMedium, false
	}
	if len(e.hashes) == 0 {
		return ReasonNoBlocks, false
	}
	if e.typ == evRemoved {
		// Each hash named takes one copy off its count, a hash named twice
		// two; those of which a copy stays are left out (copies.go).
		var kept int
		e.hashes, kept = d.copies.removed(tier, e.hashes)
		if kept > 0 {
			d.stats.CopyRemoves += uint64(kept)
			if len(e.hashes) == 0 {
				return absorbed, false
			}
		}
		// A remove that repeats a hash removes it once: vLLM's offloading
		// connector merges the hashes of every key it evicts into one
		// remove per group, and chunks that share a prefix repeat its
		// hashes ("consumers are expected to deduplicate"). Skipped, the
		// remove would leave every block it names in the index, routed to
		// until the rank resyncs.
		if d.repeats(e.hashes) {
			e.hashes = d.unique(e.hashes)
		}
		start := len(out.removed)
		out.removed = append(room(out.removed, len(e.hashes), d.left), e.hashes...)
		out.Events = append(out.Events, kvevent.Event{Kind: kvevent.KindRemoved, Tier: tier})
		d.spans = append(d.spans, span{start, len(out.removed)})
		return 0, true
	}

	// A store without tokens that names no parent (vLLM's placeholder,
	// above) goes under the parent the device store of its first block
	// named: an engine hash covers the block's prefix, so that block is
	// never a sequence's first, and placed at the root it would be another
	// block under the same hash (the index would drop the device's copy for
	// it). A first block never learned is dropped as unresolved below.
	if len(e.tokens) == 0 && !e.has(fParent) {
		if v, ok := d.learned.get(e.hashes[0]); ok && v.hasParent {
			e.parent = v.parent
			e.present |= fParent.bit()
		}
	}
	// A store that repeats a hash names a block as its own descendant.
	if d.repeats(e.hashes) {
		return ReasonRepeatedHash, false
	}
	hasParent := e.has(fParent)
	if hasParent && e.parent == e.hashes[0] {
		return ReasonParentIsFirst, false
	}
	// A later hash that is the parent names it as its own descendant
	// (kvevent.Event.Validate refuses it): the parent's hash is repeated
	// within the event.
	if hasParent && slices.Contains(e.hashes[1:], e.parent) {
		return ReasonRepeatedHash, false
	}
	// Blocks stored under a LoRA adapter are hashed with the adapter's seed,
	// which needs its name; old engines send only lora_id. (A store without
	// tokens is resolved by engine hash, which already covers the adapter.)
	if len(e.tokens) > 0 && e.has(fLoraID) && !e.has(fLoraName) {
		return ReasonUnnamedLoRA, false
	}
	start := len(out.blocks)
	keep, why := d.blocks(e, out)
	if dropped := len(e.hashes) - keep; dropped > 0 {
		d.stats.DroppedBlocks[why] += uint64(dropped)
	}
	if keep == 0 {
		return why, false
	}
	d.copies.stored(tier, e.hashes[:keep])
	switch {
	case e.salted: // a per-request salt covers every block, as extra keys would
		d.stats.ExtraKeyBlocks += uint64(keep)
	case e.extraKeys != nil:
		d.stats.ExtraKeyBlocks += uint64(e.extraKeyBlocks(keep))
	}
	out.Events = append(out.Events, kvevent.Event{
		Kind:      kvevent.KindStored,
		Tier:      tier,
		HasParent: hasParent,
		Parent:    e.parent,
	})
	d.spans = append(d.spans, span{start, len(out.blocks)})
	return 0, true
}

// blocks appends the blocks of a store to out.blocks and returns how many
// it kept; when fewer than all, why names the rule that cut the rest.
//
// A block is kept only with its content hash. With tokens, the hash is
// computed (and learned); without (an offload-tier store), it is looked up
// among the learned ones. The first block that fails either way ends the
// event: the blocks after it chain onto it, so they could not be placed.
func (d *Decoder) blocks(e *wireEvent, out *Batch) (keep int, why Reason) {
	n, bs := len(e.hashes), d.blockSize
	if e.has(fBlockSize) && e.blockSize != uint64(bs) {
		return 0, ReasonBlockSize
	}
	if len(e.tokens) == 0 {
		out.blocks = room(out.blocks, n, d.left)
		d.found = d.found[:0]
		keep = n
		for i, h := range e.hashes {
			v, ok := d.learned.get(h)
			if !ok {
				keep, why = i, ReasonUnresolved
				break
			}
			out.blocks = append(out.blocks, kvevent.Block{EngineHash: h, LocalHash: v.local})
			d.found = append(d.found, v)
		}
		// Kept only once the chain is resolved: keeping a block may clear
		// the old generation, which may hold the rest of the chain.
		for i, v := range d.found {
			d.learned.keep(e.hashes[i], v)
		}
		return keep, why
	}
	keep = n
	switch {
	case len(e.tokens) > n*bs: // more tokens than blocks: which belong where is unknown
		return 0, ReasonBlockSize
	case len(e.tokens) < n*bs && !e.has(fBlockSize):
		// Without block_size, only n × bs tokens show that the engine's
		// blocks are bs tokens: fewer may be the whole of n smaller blocks,
		// and tokens[i*bs:(i+1)*bs] would then not be block i's.
		return 0, ReasonBlockSize
	case len(e.tokens) < n*bs: // the blocks with all their tokens stay
		keep, why = len(e.tokens)/bs, ReasonBlockSize
	}
	// A multimodal digest among the tokens (TensorRT-LLM's image start):
	// the blocks before it are text blocks, which a text request with the
	// same prefix (a shared system prompt) hits; its block and the later
	// ones, whose engine hashes cover the image, are dropped.
	if at := (e.mmToken - 1) / bs; e.mmToken > 0 && at < keep {
		keep, why = at, ReasonMMToken
	}
	d.locals = kvevent.LocalHashes(d.locals[:0], e.tokens[:keep*bs], bs, d.seedFor(e))
	out.blocks = room(out.blocks, keep, d.left)
	v := learned{parent: e.parent, hasParent: e.has(fParent)}
	for i, local := range d.locals {
		h := e.hashes[i]
		out.blocks = append(out.blocks, kvevent.Block{EngineHash: h, LocalHash: local})
		v.local = local
		d.learned.put(h, v)
		v.parent, v.hasParent = h, true // the next block's parent
	}
	return keep, why
}

// maxSeeds bounds the LoRA name → seed cache; names past it are hashed on
// every event instead.
const maxSeeds = 256

// seedFor returns the content-hash seed of e's blocks.
func (d *Decoder) seedFor(e *wireEvent) uint64 {
	if !e.has(fLoraName) || len(e.loraName) == 0 {
		return d.baseSeed
	}
	if s, ok := d.seeds[string(e.loraName)]; ok {
		return s
	}
	name := string(e.loraName)
	s := d.seed(name)
	if len(d.seeds) < maxSeeds {
		d.seeds[name] = s
	}
	return s
}

// tier maps a medium (nil: the device) to its tier.
func (d *Decoder) tier(medium []byte) (kvevent.Tier, bool) {
	if medium == nil {
		return kvevent.TierDevice, true
	}
	if t, ok := d.mediums[string(medium)]; ok {
		return t, true
	}
	t, err := kvevent.ParseMedium(string(medium))
	if err != nil {
		return 0, false
	}
	if len(d.mediums) < 64 { // spellings differ only in case: few, but bound them
		d.mediums[string(medium)] = t
	}
	return t, true
}

// isRemote reports whether locality is REMOTE, in any ASCII case.
func isRemote(locality []byte) bool {
	const remote = "remote"
	if len(locality) != len(remote) {
		return false
	}
	for i := range locality {
		// Setting bit 0x20 lowers an ASCII capital and keeps a lower-case
		// letter; no other byte becomes one of these letters by it.
		if locality[i]|0x20 != remote[i] {
			return false
		}
	}
	return true
}

// Full-attention kinds: only these feed the index.
var mainKinds = [...]string{"full_attention", "mla_attention", "sink_full_attention"}

func isMainKind(kind []byte) bool {
	for _, k := range mainKinds {
		if len(kind) == len(k) && strings.EqualFold(string(kind), k) {
			return true
		}
	}
	return false
}

// mainGroup reports whether e belongs to the main attention group (wire.md):
// an event with a kv_cache_spec_kind is main when the kind is a
// full-attention kind; without a kind, when it has no group_idx or group 0.
// With LearnGroupKinds, a kind learned from an earlier store of the same
// group stands in for a missing one.
func (d *Decoder) mainGroup(e *wireEvent) bool {
	if e.has(fKind) {
		main := isMainKind(e.kind)
		if d.learnKind && e.has(fGroup) {
			if _, ok := d.groupMain[e.group]; ok || len(d.groupMain) < maxLearnedGroups {
				d.groupMain[e.group] = main
			}
		}
		return main
	}
	if !e.has(fGroup) {
		return true
	}
	if d.learnKind {
		if main, ok := d.groupMain[e.group]; ok {
			return main
		}
	}
	return e.group == 0
}

// unique drops the later copies of each hash from hs, in place, keeping
// the first ones in their order, and returns what is left. Short lists are
// compared pairwise, longer ones go through the reused set, as in repeats.
// A list longer than maxSeenKept is looked up in a sorted copy, with a bit
// a hash for those kept: 8 bytes a hash and dropped after it, as repeats'
// copy (a set of its own cost several times that).
func (d *Decoder) unique(hs []uint64) []uint64 {
	n := 0
	switch {
	case len(hs) <= 32:
		for _, h := range hs {
			if !slices.Contains(hs[:n], h) {
				hs[n] = h
				n++
			}
		}
	case len(hs) <= maxSeenKept:
		clear(d.seen)
		for _, h := range hs {
			if _, ok := d.seen[h]; !ok {
				d.seen[h] = struct{}{}
				hs[n] = h
				n++
			}
		}
	default:
		sorted := slices.Clone(hs)
		slices.Sort(sorted)
		sorted = slices.Compact(sorted)
		kept := make([]uint64, (len(sorted)+63)/64)
		for _, h := range hs {
			i, _ := slices.BinarySearch(sorted, h)
			if kept[i/64]&(1<<(i%64)) == 0 {
				kept[i/64] |= 1 << (i % 64)
				hs[n] = h
				n++
			}
		}
	}
	return hs[:n]
}

// repeats reports whether a hash occurs twice in hs. Short lists (the
// common case) are compared pairwise; longer ones through the reused set,
// up to maxSeenKept hashes. A list longer than that has its first
// maxSeenKept hashes checked in the set (a repeat among them ends the check
// there) and then, if none repeats, is sorted in a copy: 8 bytes a hash,
// where a set of its own, sized for every hash, cost several times that and
// was paid in full even when the check ended at the first hashes.
func (d *Decoder) repeats(hs []uint64) bool {
	if len(hs) <= 32 {
		for i := 1; i < len(hs); i++ {
			for j := 0; j < i; j++ {
				if hs[i] == hs[j] {
					return true
				}
			}
		}
		return false
	}
	clear(d.seen)
	for _, h := range hs[:min(len(hs), maxSeenKept)] {
		if _, ok := d.seen[h]; ok {
			return true
		}
		d.seen[h] = struct{}{}
	}
	if len(hs) <= maxSeenKept {
		return false
	}
	sorted := slices.Clone(hs)
	slices.Sort(sorted)
	for i := 1; i < len(sorted); i++ {
		if sorted[i] == sorted[i-1] {
			return true
		}
	}
	return false
}
