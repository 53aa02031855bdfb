// sequences.go is the load tracker of semantics.md §6: the requests that were
// routed to a rank and have not finished ("active sequences"), and the load
// they put on it.
//
// A booking is one routed request: its id, its rank, the sequence hashes of
// its full blocks, its input length and how many of those tokens the rank
// already had cached. From the live bookings of a rank follow its load:
//
//   - ActiveDecodeBlocks: the number of DISTINCT sequence hashes among them
//     (two requests sharing a prefix share its KV blocks), each counting 1,
//     except that a block held by one booking alone counts 1 - d, d that
//     booking's discount (SetDecay); the sum is rounded half up;
//   - ActivePrefillTokens: the sum of max(isl-cached, 0) over the bookings
//     still in prefill;
//   - ActiveRequests: the number of live bookings.
//
// Invariants (the property tests check each against a naive model):
//   - A slot's refs[h] = n > 0 exactly when hash h occurs n times among the
//     live bookings of its rank; its ActiveDecodeBlocks is len(refs).
//   - blocks[h] lists, once each, exactly the slots whose refs hold h; a
//     hash nobody holds has no entry.
//   - A slot's live lists, once each, exactly the live bookings of its
//     rank, and live[b.pos] is b; its length is ActiveRequests.
//   - A slot's refs[h].ords is the wrapping sum of the ords of the
//     occurrences of h, so when refs[h].n == 1 it names the one holder; the
//     slot's discount is the sum, over its h with refs[h].n == 1, of that
//     holder's discount (parts per million), and discounted maps the ord
//     of every live booking with a non-zero discount to it.
//   - alone[h] lists, once each, the slots where one booking with a
//     non-zero discount alone holds h, each with that discount; a hash with
//     none has no entry.
//   - A rank has a slot exactly while it has a live booking; order lists the
//     slots in rank order, so every query walks the ranks in one order.
//   - byID holds each request id at most once, live or freed (a tombstone);
//     the expiry heap holds exactly the entries of byID, ordered by
//     (createdAt, id).
//   - Freed ids stay as tombstones until Expire sweeps them, i.e. until they
//     are older than the expiry age (by the sweeps' clock); while it stands,
//     a tombstone refuses an Add of its id, so a retried Add that arrives
//     after the Free of the same id does not resurrect the booking. Once it
//     is swept the id is unknown again, and an Add books it anew.
//   - Time never goes back: clock is the latest now an Expire was given,
//     and an Add whose now is below it is booked as created at clock. A
//     sweep from a clock that ran ahead therefore never refuses an Add
//     stamped by a clock behind it; such a booking lives the max age from
//     the sweep's time.
//   - digest is the wrapping sum of one hash per entry (live booking or
//     tombstone), so equal logical state gives an equal Digest whatever the
//     order of the operations that produced it.
//   - Nothing here reads a clock: time is the caller's int64 (unix nanos),
//     which is what lets a replicated FSM apply it deterministically.

package indexer

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/zeebo/xxh3"
)

// DefaultBookingMaxAge is how old a booking may grow before Expire frees it
// when the caller passes no age: a request that was never freed (a lost
// Free, a crashed client) stops counting as load after this long.
const DefaultBookingMaxAge = 300 * time.Second

// MaxBookingBlocks is the most blocks a live booking holds, its prompt's
// and its output's together: AddOutputBlock adds none to a booking that
// holds as many. Output blocks come one per call (the compatible API's
// output_block), bounded by nothing else than the booking's max age, and
// every replica applies each one and keeps, snapshots and journals the
// blocks; without a bound one client's reservation grows without end on
// every replica. 65536 blocks are a million tokens at 16 tokens per block,
// more than a model's context holds. An Add is not refused over it (its
// prompt is bounded by the entry's size): such a booking takes no output
// block. It is part of the replicated state machine's rules: every replica
// must refuse the same adds, so it changes only with an upgrade note.
const MaxBookingBlocks = 1 << 16

// Load is the load that live bookings put on one rank.
type Load struct {
	ActivePrefillTokens int64 // uncached input tokens of requests still in prefill
	ActiveDecodeBlocks  int64 // distinct KV blocks held by live requests
	ActiveRequests      int64 // live requests
}

// RankLoad is one rank's load and, from PotentialDecodeBlocks, the decode
// blocks it would hold if it also took the queried request.
type RankLoad struct {
	Rank                  kvevent.Rank
	Load                  Load
	PotentialDecodeBlocks int64
}

// Booking is one live request as snapshots carry it.
type Booking struct {
	ID           string
	Rank         kvevent.Rank
	SeqHashes    []uint64 // sequence hashes of the request's full blocks
	ISL          int      // input length in tokens
	CachedTokens int      // tokens the rank had cached when the request was routed
	PrefillDone  bool     // the first token was produced
	CreatedAt    int64    // the now of the Add (unix nanos)
	// Discount is taken off each block that this request alone holds on
	// its rank, in parts per million of a block (0: such blocks count
	// whole; DecayScale: they count nothing). SetDecay sets it.
	Discount uint32
}

// DecayScale is one whole block in the parts per million of SetDecay and
// Booking.Discount.
const DecayScale = 1_000_000

// FreedBooking is the tombstone of a freed request: it keeps a retried Add
// of the same id from booking it again until it is swept.
type FreedBooking struct {
	ID        string
	CreatedAt int64 // the CreatedAt of the booking it replaced
}

// SequencesSnapshot is the whole logical state of a Sequences: what a
// replicated snapshot must carry so that a restored node answers every later
// operation as the others do.
type SequencesSnapshot struct {
	Bookings []Booking      // live bookings, by id
	Freed    []FreedBooking // tombstones, by id
	// Swept is true once an Expire ran; Clock is then the latest now an
	// Expire was given, which an Add created before it is moved up to (see
	// Add).
	Swept bool
	Clock int64
}

// Sequences tracks the active sequences of every rank (semantics.md §6).
//
// It is safe for concurrent use: mutations (Add, PrefillDone, Free, Expire,
// RemoveRank, RemoveWorker, Restore) take a write lock, queries a read lock,
// so route handlers may query while the FSM apply goroutine mutates. Queries
// that need scratch space take it from the caller (PotentialScratch), one per
// goroutine, so that concurrent readers share nothing writable. A Pending
// that watches it (NewPending) is called from its mutations, which must
// then be made under the lock that orders the Pending's calls.
//
// The zero value is not ready; use NewSequences.
type Sequences struct {
	mu sync.RWMutex
	// lazyMu orders the two calls that, under the read lock, bring up to
	// date what the tracker keeps for later: FlushJournal (the bookings to
	// report) and Digest (the bookings to rehash). Each holds the read
	// lock, not the write lock, so that route queries go on meanwhile;
	// what they change, only mutations (excluded by the read lock) and
	// these two calls (lazyMu) touch, and no query reads it.
	lazyMu sync.Mutex
	st     seqState
}

// NewSequences returns an empty load tracker.
func NewSequences() *Sequences {
	s := &Sequences{}
	s.st.init()
	return s
}

// booking is one entry of byID: live, or a tombstone when freed.
type booking struct {
	id          string
	rank        kvevent.Rank
	slot        int32    // the rank's slot while live
	seq         []uint64 // owned copy; nil once freed
	isl         int
	cached      int
	prefill     int64 // max(isl-cached, 0)
	prefillDone bool
	freed       bool
	createdAt   int64
	discount    uint32 // parts per million off each block it alone holds
	ord         uint64 // unique among live bookings; see refEntry
	hash        uint64 // digest hash of the fields that never change
	pos         int32  // its index in its slot's live list while live
	// dirtyAt is 1 + its index in seqState.dirty while an output block
	// changed its seq since its hash was computed (the digest then leaves
	// its entry out until settle); 0 otherwise.
	dirtyAt int32
	// unjournaled is set while b is on seqState.unjournaled.
	unjournaled bool
	// held is the set of its seq's hashes, built the first time an output
	// block's membership is a question its rank's refs cannot answer (see
	// holds); nil until then.
	held map[uint64]struct{}
}

// refEntry counts the occurrences of one hash among a rank's bookings and
// sums their bookings' ords, so that when n is 1, ords is the ord of the
// one booking holding it: what lets a discount follow a block as it goes
// from shared to held alone and back without a list of holders.
type refEntry struct {
	n    int32
	ords uint64
}

// slotList lists the slots of the ranks holding one sequence hash. Most
// blocks are held by one rank, so the first lives inline and a block held by
// one rank costs no allocation beyond its map slot.
type slotList struct {
	first int32
	rest  []int32
}

// rankSlot is one rank with live bookings. refs counts the occurrences of
// each sequence hash among its bookings: its own small map, so that booking
// a block the rank already holds (the common case: requests routed to a
// rank share its prefixes) touches only this map, and the global holders
// map changes only when a rank starts or stops holding a block.
//
// live lists the rank's live bookings (in no order; booking.pos is each
// one's index), so that removing a rank frees its bookings without a walk
// over every booking of the fleet: a lease sweep that removes many workers
// must not cost workers × bookings.
type rankSlot struct {
	rank     kvevent.Rank
	load     Load  // ActiveDecodeBlocks counts every block whole; see view
	discount int64 // parts per million off load.ActiveDecodeBlocks
	refs     map[uint64]refEntry
	live     []*booking
}

// view is the slot's load as callers see it: the discount of the blocks
// held by one decaying booking taken off the decode blocks, rounded half up.
func (rs *rankSlot) view() Load {
	l := rs.load
	if rs.discount != 0 {
		l.ActiveDecodeBlocks = (l.ActiveDecodeBlocks*DecayScale - rs.discount + DecayScale/2) / DecayScale
	}
	return l
}

type seqState struct {
	byID   map[string]*booking
	expiry []*booking // min-heap on (createdAt, id)
	live   int
	freed  int

	blocks    map[uint64]slotList // hash -> slots of the ranks holding it
	slotOf    map[kvevent.Rank]int32
	slots     []rankSlot
	freeSlots []int32
	order     []int32 // live slots, in rank order

	discounted map[uint64]*booking    // ord -> live booking with a discount
	alone      map[uint64][]aloneHold // hash -> slots where one decaying booking alone holds it
	nextOrd    uint64

	swept  bool
	clock  int64  // the latest now of an Expire, once swept
	digest uint64 // wrapping sum of entryHash over byID, but for the dirty ones
	buf    []byte // encoding scratch for hashes; used under the write lock or lazyMu
	hashed uint64 // blocks bookingHash has read, which tests count

	// dirty lists the live bookings whose hash an output block made stale
	// (booking.dirtyAt): rehashing a booking's whole seq at every output
	// block made each one cost O(blocks it holds), so Digest (and anything
	// else that needs the hash) settles them, once for many blocks.
	dirty []*booking

	journal SeqJournal // nil when no durable copy follows
	// unjournaled lists the bookings added or changed since the last
	// FlushJournal (booking.unjournaled), each once: a journal told of
	// every change rewrote a booking's whole seq at each of its output
	// blocks, O(blocks²) bytes over a request's life.
	unjournaled []*booking
	// unjournaledBytes estimates what FlushJournal will write for them
	// (UnjournaledBytes), so that a group of bookings alone still fills.
	unjournaledBytes int
	watch            *Pending // told when a rank starts or stops holding a hash; nil when none watches
}

func (st *seqState) init() {
	st.byID = make(map[string]*booking)
	st.blocks = make(map[uint64]slotList)
	st.slotOf = make(map[kvevent.Rank]int32)
	st.discounted = make(map[uint64]*booking)
	st.alone = make(map[uint64][]aloneHold)
}

// aloneHold is a slot where one decaying booking alone holds a block, and
// that booking's discount: what a request sharing the block takes back
// (PotentialDecodeBlocks), found with one lookup per block, not one per
// holder.
type aloneHold struct {
	slot     int32
	discount uint32
}

// setAlone records that one booking with discount alone holds h on slot
// (0: no decaying booking holds it alone there any more).
func (st *seqState) setAlone(h uint64, slot int32, discount uint32) {
	hs := st.alone[h]
	i := slices.IndexFunc(hs, func(a aloneHold) bool { return a.slot == slot })
	switch {
	case discount != 0 && i >= 0:
		hs[i].discount = discount
		return
	case discount != 0:
		hs = append(hs, aloneHold{slot: slot, discount: discount})
	case i < 0:
		return
	default:
		hs[i] = hs[len(hs)-1]
		hs = hs[:len(hs)-1]
		if len(hs) == 0 {
			delete(st.alone, h)
			return
		}
	}
	st.alone[h] = hs
}

func validateBooking(id string, isl, cached int) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: empty request id", ErrInvalidBooking)
	case isl < 0:
		return fmt.Errorf("%w: request %q: negative input length %d", ErrInvalidBooking, id, isl)
	case cached < 0:
		return fmt.Errorf("%w: request %q: negative cached tokens %d", ErrInvalidBooking, id, cached)
	}
	return nil
}

// Add books request id on rank at routing time: its blocks start counting as
// decode load and isl-cachedTokens (at least 0) as prefill load. now is the
// request's creation time; a retry of the same booking must carry the same
// now (it travels in the log entry).
//
// A now below the latest sweep's (Expire) is taken as that sweep's time:
// the tracker's time never goes back. Leaders stamp bookings and sweeps
// with their own clocks, and one whose clock ran ahead may have swept at
// a time the next leader's clock has not reached; its bookings would
// otherwise be older than the sweep already, and lost to the next one.
//
// It reports whether it booked. It does nothing and returns false when id is
// live (a duplicate) or was freed and its tombstone is not yet swept (a
// retry that arrived after the Free; Freed tells the two apart). It returns
// an error, booking nothing, for an empty id or a negative isl or
// cachedTokens. seqHashes is copied.
func (s *Sequences) Add(id string, rank kvevent.Rank, seqHashes []uint64, isl, cachedTokens int, now int64) (bool, error) {
	if err := validateBooking(id, isl, cachedTokens); err != nil {
		return false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	if _, ok := st.byID[id]; ok {
		return false, nil
	}
	if st.swept && now < st.clock {
		now = st.clock
	}
	b := &booking{
		id:        id,
		rank:      rank,
		seq:       slices.Clone(seqHashes),
		isl:       isl,
		cached:    cachedTokens,
		prefill:   max(int64(isl)-int64(cachedTokens), 0),
		createdAt: now,
	}
	st.insert(b)
	st.journalBooked(b)
	return true, nil
}

// PrefillDone marks request id as past prefill (its first token came): its
// uncached tokens stop counting as prefill load; its blocks still count. It
// reports whether it changed anything: false for an unknown or freed id or a
// repeat.
func (s *Sequences) PrefillDone(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	b, ok := st.byID[id]
	if !ok || b.freed || b.prefillDone {
		return false
	}
	st.settle(b)
	st.digest -= b.entryHash()
	b.prefillDone = true
	st.digest += b.entryHash()
	st.slots[b.slot].load.ActivePrefillTokens -= b.prefill
	st.journalBooked(b)
	return true
}

// AddOutputBlock records that live request id produced an output block of
// sequence hash h: the block counts as decode load on the request's rank
// from now on, until the request is freed. It reports whether it changed
// anything: false for an unknown or freed id, an h the request already
// holds (so a retry with the same h changes nothing), or a request that
// holds MaxBookingBlocks blocks already.
func (s *Sequences) AddOutputBlock(id string, h uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	b, ok := st.byID[id]
	if !ok || b.freed || len(b.seq) >= MaxBookingBlocks || st.holds(b, h) {
		return false
	}
	// Amortized O(1) in the blocks b holds: the membership test above, an
	// append (b.seq is owned: nothing else keeps it past a call), and the
	// hash left for settle.
	if b.dirtyAt == 0 {
		st.digest -= b.entryHash()
		st.dirty = append(st.dirty, b)
		b.dirtyAt = int32(len(st.dirty))
	}
	b.seq = append(b.seq, h)
	if b.held != nil {
		b.held[h] = struct{}{}
	}
	if st.incRef(h, b) {
		st.slots[b.slot].load.ActiveDecodeBlocks++
	}
	st.journalBooked(b)
	return true
}

// SetDecay sets how much the blocks that live request id alone holds on its
// rank count in its rank's decode load: weight parts per million of a block
// (DecayScale: whole, 0: nothing), for as long as the request holds such a
// block alone; a block another live request also holds counts whole. It is
// the "decay fraction" of output-block tracking: a client that expects the
// request to end soon (weight = 1 - generated/expected output tokens) makes
// the blocks that will go with it weigh less in routing decisions. A weight
// above DecayScale counts as DecayScale. It reports whether it changed
// anything: false for an unknown or freed id or the weight it has.
func (s *Sequences) SetDecay(id string, weight uint32) bool {
	discount := DecayScale - min(weight, DecayScale)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	b, ok := st.byID[id]
	if !ok || b.freed || b.discount == discount {
		return false
	}
	rs := &st.slots[b.slot]
	var alone int64
	for _, h := range b.seq {
		if rs.refs[h].n == 1 {
			alone++
			st.setAlone(h, b.slot, discount)
		}
	}
	rs.discount += alone * (int64(discount) - int64(b.discount))
	st.settle(b)
	st.digest -= b.entryHash()
	b.discount = discount
	if discount == 0 {
		delete(st.discounted, b.ord)
	} else {
		st.discounted[b.ord] = b
	}
	b.hash = st.bookingHash(b)
	st.digest += b.entryHash()
	st.journalBooked(b)
	return true
}

// Free ends request id (finished, failed or cancelled): its load goes, and
// its id stays as a tombstone until Expire sweeps it. It reports whether it
// freed anything: false for an unknown or already freed id.
func (s *Sequences) Free(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	b, ok := st.byID[id]
	if !ok || b.freed {
		return false
	}
	st.tombstone(b)
	return true
}

// Expire frees every live booking older than maxAge at now (now - CreatedAt >
// maxAge) and sweeps the tombstones as old; it returns how many live
// bookings it freed. maxAge <= 0 means DefaultBookingMaxAge. A swept
// tombstone's id is unknown from then on: an Add books it again.
//
// It also raises the clock to now (never lowers it): an Add created before
// it is booked as created at it (see Add).
//
// Entries go in (CreatedAt, id) order, so that replicas applying the same
// sweep do the same thing in the same order.
func (s *Sequences) Expire(now int64, maxAge time.Duration) (expired int) {
	if maxAge <= 0 {
		maxAge = DefaultBookingMaxAge
	}
	cutoff := now - int64(maxAge)
	if now < math.MinInt64+int64(maxAge) { // now-maxAge would wrap
		cutoff = math.MinInt64
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	if !st.swept || now > st.clock {
		st.swept, st.clock = true, now
		if st.journal != nil {
			st.journal.Clock(now)
		}
	}
	for len(st.expiry) > 0 && st.expiry[0].createdAt < cutoff {
		b := st.popExpiry()
		st.settle(b)
		if !b.freed {
			st.unbook(b)
			st.live--
			expired++
		} else {
			st.freed--
		}
		st.digest -= b.entryHash()
		delete(st.byID, b.id)
		if st.journal != nil {
			st.journal.Gone(b.id)
		}
	}
	return expired
}

// RemoveRank frees every live booking of rank (it left the fleet) and returns
// how many. Like Free, each leaves a tombstone.
func (s *Sequences) RemoveRank(rank kvevent.Rank) int {
	return s.removeRanks(rank, rank)
}

// RemoveWorker frees every live booking of every rank of worker and returns
// how many. Like Free, each leaves a tombstone.
func (s *Sequences) RemoveWorker(worker uint64) int {
	return s.removeRanks(kvevent.Rank{Worker: worker}, kvevent.Rank{Worker: worker, DP: math.MaxUint32})
}

// removeRanks frees the live bookings of the ranks from lo to hi
// (inclusive, in rank order).
func (s *Sequences) removeRanks(lo, hi kvevent.Rank) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := &s.st
	n := 0
	// A binary search of the slots (the ranks holding bookings, in rank
	// order) makes the common case, none of the ranks holds one, cost
	// O(log ranks), not O(bookings) nor O(ranks): removing many workers
	// one by one must not be quadratic.
	i, _ := slices.BinarySearchFunc(st.order, lo, func(sl int32, r kvevent.Rank) int { return st.slots[sl].rank.Compare(r) })
	if i == len(st.order) || st.slots[st.order[i]].rank.Compare(hi) > 0 {
		return 0
	}
	// The order in which bookings are freed does not change the resulting
	// state: reference counts and sums commute. A slot's last booking
	// releases it, which takes it out of order: order[i] is then the next
	// rank.
	for i < len(st.order) {
		rs := &st.slots[st.order[i]]
		if rs.rank.Compare(hi) > 0 {
			break
		}
		if len(rs.live) == 0 {
			i++ // unreachable while the invariants hold: a slot in order has a live booking
			continue
		}
		for len(rs.live) > 0 {
			st.tombstone(rs.live[len(rs.live)-1])
			n++
		}
	}
	return n
}

// Load returns rank's load; zero when it has no live booking.
func (s *Sequences) Load(rank kvevent.Rank) Load {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if sl, ok := s.st.slotOf[rank]; ok {
		return s.st.slots[sl].view()
	}
	return Load{}
}

// Loads appends to dst the load of every rank with a live booking, in rank
// order, and returns it. PotentialDecodeBlocks is left zero.
func (s *Sequences) Loads(dst []RankLoad) []RankLoad {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for _, sl := range s.st.order {
		dst = append(dst, RankLoad{Rank: s.st.slots[sl].rank, Load: s.st.slots[sl].view()})
	}
	return dst
}

// Get returns live request id's booking (a copy); false when id is
// unknown or freed.
func (s *Sequences) Get(id string) (Booking, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.st.byID[id]
	if !ok || b.freed {
		return Booking{}, false
	}
	out := b.export()
	out.SeqHashes = slices.Clone(out.SeqHashes)
	return out, true
}

// Blocks returns how many blocks live request id holds (its prompt's and
// its output's; see MaxBookingBlocks) without copying them, as Get does;
// false when id is unknown or freed.
func (s *Sequences) Blocks(id string) (int, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.st.byID[id]
	if !ok || b.freed {
		return 0, false
	}
	return len(b.seq), true
}

// Holds reports whether live request id holds a block of sequence hash h
// (its prompt's or its output's), in O(1) amortized as AddOutputBlock's
// own test; false when id is unknown or freed. It takes the write lock:
// the test may build the booking's set of blocks.
func (s *Sequences) Holds(id string, h uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.st.byID[id]
	return ok && !b.freed && s.st.holds(b, h)
}

// RankOf returns the rank live request id is booked on; false when it is
// unknown or freed.
func (s *Sequences) RankOf(id string) (kvevent.Rank, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.st.byID[id]
	if !ok || b.freed {
		return kvevent.Rank{}, false
	}
	return b.rank, true
}

// Freed reports whether id was booked and freed (or expired) and its
// tombstone is not yet swept: what an Add of it refuses for a reason other
// than a live duplicate.
func (s *Sequences) Freed(id string) bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.st.byID[id]
	return ok && b.freed
}

// Count returns the number of live bookings and of tombstones.
func (s *Sequences) Count() (live, freed int) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.st.live, s.st.freed
}

// PotentialScratch is reusable scratch space for PotentialDecodeBlocks. One
// goroutine uses it at a time; keep one per route handler (or in a
// sync.Pool). The zero value is ready.
type PotentialScratch struct {
	set  hashSet
	hits []int32
	back []int64 // per slot: the discount the request's sharing takes back
}

// PotentialDecodeBlocks appends to dst, for every rank with a live booking,
// in rank order, its load and its potential decode blocks for a request with
// the given sequence hashes: its active decode blocks plus the request's
// distinct blocks that its live requests do not already hold, with the
// blocks it shares with one decaying request (SetDecay) that alone holds
// them counted whole, as they count once it is booked. It returns dst
// and the number of distinct blocks of the request, which is the potential
// decode blocks of every rank that is not listed (an idle rank).
//
// The cost is O(request blocks + ranks) map work, not O(blocks × ranks):
// one lookup per distinct request block in the global hash → holders map
// finds every rank that holds it, and the walk over the ranks is one pass.
// Beyond the lookups it does one increment per (request block, rank holding
// it) pair — the very overlaps the answer is made of — which approaches
// blocks × ranks only when every rank holds every block of the request, and
// even then is a slice walk, not a map lookup per rank; while some booking
// decays, one more lookup per request block finds the ranks where a
// decaying booking alone holds it. With a scratch that
// has grown to size and a dst with room, it allocates nothing. sc may be nil
// (it then allocates).
func (s *Sequences) PotentialDecodeBlocks(dst []RankLoad, seqHashes []uint64, sc *PotentialScratch) ([]RankLoad, int64) {
	if sc == nil {
		sc = new(PotentialScratch)
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := &s.st
	if cap(sc.hits) < len(st.slots) {
		sc.hits = make([]int32, len(st.slots), cap(st.slots))
	}
	if cap(sc.back) < len(st.slots) {
		sc.back = make([]int64, len(st.slots), cap(st.slots))
	}
	hits, back := sc.hits[:len(st.slots)], sc.back[:len(st.slots)]
	decaying := len(st.alone) > 0
	sc.set.reset(len(seqHashes))
	var distinct int64
	for _, h := range seqHashes {
		if !sc.set.insert(h) {
			continue // a repeated hash is one block
		}
		distinct++
		e, ok := st.blocks[h]
		if !ok {
			continue
		}
		hits[e.first]++
		for _, sl := range e.rest {
			hits[sl]++
		}
		if decaying { // no probe while nobody decays
			for _, a := range st.alone[h] {
				back[a.slot] += int64(a.discount)
			}
		}
	}
	// Only live slots appear in blocks and alone, and order lists every
	// live slot, so this walk also leaves hits and back all zero for the
	// next call.
	for _, sl := range st.order {
		rs := &st.slots[sl]
		l := rs.view()
		potential := l.ActiveDecodeBlocks + distinct - int64(hits[sl])
		if back[sl] != 0 {
			// Booked, the request would share blocks that one decaying
			// booking alone holds, and they would count whole again
			// (incRef): the view's discount less theirs, rounded as view.
			whole := rs.load.ActiveDecodeBlocks + distinct - int64(hits[sl])
			potential = (whole*DecayScale - rs.discount + back[sl] + DecayScale/2) / DecayScale
			back[sl] = 0
		}
		dst = append(dst, RankLoad{
			Rank:                  rs.rank,
			Load:                  l,
			PotentialDecodeBlocks: potential,
		})
		hits[sl] = 0
	}
	return dst, distinct
}

// Bookings returns a copy of every live booking, ordered by id.
func (s *Sequences) Bookings() []Booking {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.st.bookings()
}

// Snapshot returns a copy of the whole logical state: live bookings and
// tombstones ordered by id, and the sweeps' clock.
func (s *Sequences) Snapshot() SequencesSnapshot {
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := &s.st
	snap := SequencesSnapshot{Bookings: st.bookings(), Swept: st.swept, Clock: st.clock}
	snap.Freed = make([]FreedBooking, 0, st.freed)
	for _, b := range st.byID {
		if b.freed {
			snap.Freed = append(snap.Freed, FreedBooking{ID: b.id, CreatedAt: b.createdAt})
		}
	}
	slices.SortFunc(snap.Freed, func(a, b FreedBooking) int { return cmp.Compare(a.ID, b.ID) })
	return snap
}

func (st *seqState) bookings() []Booking {
	out := make([]Booking, 0, st.live)
	for _, b := range st.byID {
		if !b.freed {
			out = append(out, Booking{
				ID: b.id, Rank: b.rank, SeqHashes: slices.Clone(b.seq), ISL: b.isl,
				CachedTokens: b.cached, PrefillDone: b.prefillDone, CreatedAt: b.createdAt, Discount: b.discount,
			})
		}
	}
	slices.SortFunc(out, func(a, b Booking) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// Restore replaces the whole state with snap, atomically: on error (an
// invalid booking, an id given twice) nothing changes. Bookings are
// restored as given, even ones older than the max age at the clock (the
// next Expire frees them). A snapshot with only Bookings set restores those
// with no tombstones and no clock.
func (s *Sequences) Restore(snap SequencesSnapshot) error {
	var st seqState
	st.init()
	for i := range snap.Bookings {
		bk := &snap.Bookings[i]
		if err := validateBooking(bk.ID, bk.ISL, bk.CachedTokens); err != nil {
			return fmt.Errorf("restore booking %d: %w", i, err)
		}
		if _, dup := st.byID[bk.ID]; dup {
			return fmt.Errorf("restore: %w: request %q given twice", ErrInvalidBooking, bk.ID)
		}
		if bk.Discount > DecayScale {
			return fmt.Errorf("restore booking %d: %w: request %q: discount %d above %d", i, ErrInvalidBooking, bk.ID, bk.Discount, DecayScale)
		}
		b := &booking{
			id: bk.ID, rank: bk.Rank, seq: slices.Clone(bk.SeqHashes), isl: bk.ISL, cached: bk.CachedTokens,
			prefill: max(int64(bk.ISL)-int64(bk.CachedTokens), 0), createdAt: bk.CreatedAt, discount: bk.Discount,
		}
		st.insert(b)
		if bk.PrefillDone {
			st.digest -= b.entryHash()
			b.prefillDone = true
			st.digest += b.entryHash()
			st.slots[b.slot].load.ActivePrefillTokens -= b.prefill
		}
	}
	for i, f := range snap.Freed {
		if f.ID == "" {
			return fmt.Errorf("restore tombstone %d: %w: empty request id", i, ErrInvalidBooking)
		}
		if _, dup := st.byID[f.ID]; dup {
			return fmt.Errorf("restore: %w: request %q given twice", ErrInvalidBooking, f.ID)
		}
		b := &booking{id: f.ID, createdAt: f.CreatedAt, freed: true}
		b.hash = st.tombHash(b)
		st.byID[b.id] = b
		st.pushExpiry(b)
		st.freed++
		st.digest += b.hash
	}
	st.swept, st.clock = snap.Swept, snap.Clock
	if !st.swept {
		st.clock = 0
	}
	s.mu.Lock()
	st.journal = s.st.journal // a restore is not reported; the journal stays attached
	if st.watch = s.st.watch; st.watch != nil {
		st.watch.relive(&st)
	}
	s.st = st
	s.mu.Unlock()
	return nil
}

// Digest returns a hash of the logical state (live bookings with their
// prefill flag, tombstones, the sweeps' clock). Equal states give equal digests
// whatever the order of the operations that built them; replicas compare
// digests to detect divergence. It is O(1) but for the bookings that took
// output blocks since the last call, each rehashed once (see seqState.dirty).
//
// It settles them under the read lock and lazyMu (see Sequences), not the
// write lock: 50,000 bookings of 512 blocks, each with an output block since
// the last call, take 110-300 ms to rehash, and the replicas' digest check
// (every 30 s) and every status read held route queries that long.
func (s *Sequences) Digest() uint64 {
	s.lazyMu.Lock()
	defer s.lazyMu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	for len(s.st.dirty) > 0 {
		s.st.settle(s.st.dirty[len(s.st.dirty)-1])
	}
	st := &s.st
	h := st.digest
	if st.swept {
		h = mix64(h ^ mix64(uint64(st.clock)^0x5bd1e9955bd1e995))
	}
	return mix64(h)
}

// settle computes the hash of b again if an output block left it stale,
// and puts b's entry back into the digest.
func (st *seqState) settle(b *booking) {
	if b.dirtyAt == 0 {
		return
	}
	i, last := b.dirtyAt-1, int32(len(st.dirty)-1)
	if m := st.dirty[last]; m != b {
		st.dirty[i], m.dirtyAt = m, b.dirtyAt
	}
	st.dirty[last] = nil
	st.dirty = st.dirty[:last]
	b.dirtyAt = 0
	b.hash = st.bookingHash(b)
	st.digest += b.entryHash()
}

// holds reports whether live booking b holds h, in O(1) amortized: its
// rank's refs answer when no booking or one (by its ord) holds h there;
// only a block several of the rank's bookings hold needs b's own set,
// built once.
func (st *seqState) holds(b *booking, h uint64) bool {
	switch e := st.slots[b.slot].refs[h]; e.n {
	case 0:
		return false
	case 1:
		return e.ords == b.ord
	}
	if b.held == nil {
		b.held = make(map[uint64]struct{}, len(b.seq))
		for _, x := range b.seq {
			b.held[x] = struct{}{}
		}
	}
	_, ok := b.held[h]
	return ok
}

// insert books a new live booking: it indexes its blocks, adds its load and
// records it in byID, the expiry heap and the digest.
func (st *seqState) insert(b *booking) {
	b.slot = st.slotFor(b.rank)
	st.nextOrd++
	b.ord = st.nextOrd
	if b.discount != 0 {
		st.discounted[b.ord] = b
	}
	rs := &st.slots[b.slot]
	for _, h := range b.seq {
		if st.incRef(h, b) {
			rs.load.ActiveDecodeBlocks++
		}
	}
	rs.load.ActivePrefillTokens += b.prefill
	rs.load.ActiveRequests++
	b.pos = int32(len(rs.live))
	rs.live = append(rs.live, b)
	b.hash = st.bookingHash(b)
	st.byID[b.id] = b
	st.pushExpiry(b)
	st.live++
	st.digest += b.entryHash()
}

// tombstone frees a live booking and keeps its id as a tombstone with the
// same createdAt (so its expiry heap entry stays valid).
func (st *seqState) tombstone(b *booking) {
	if st.journal != nil {
		st.journal.Freed(FreedBooking{ID: b.id, CreatedAt: b.createdAt})
	}
	st.settle(b)
	st.unbook(b)
	st.digest -= b.entryHash()
	b.freed = true
	b.seq, b.held = nil, nil
	b.discount = 0
	b.prefillDone = false
	b.hash = st.tombHash(b)
	st.digest += b.hash
	st.live--
	st.freed++
}

// unbook removes a live booking's load from its rank and releases the
// rank's slot when it was the rank's last booking.
func (st *seqState) unbook(b *booking) {
	rs := &st.slots[b.slot]
	for _, h := range b.seq {
		if st.decRef(h, b) {
			rs.load.ActiveDecodeBlocks--
		}
	}
	delete(st.discounted, b.ord)
	if !b.prefillDone {
		rs.load.ActivePrefillTokens -= b.prefill
	}
	rs.load.ActiveRequests--
	last := len(rs.live) - 1
	if m := rs.live[last]; m != b {
		rs.live[b.pos], m.pos = m, b.pos
	}
	rs.live[last] = nil
	rs.live = rs.live[:last] // keeps its array for the slot's next bookings
	if rs.load.ActiveRequests == 0 {
		rs.discount = 0 // already 0 while the invariants hold
		st.releaseSlot(b.slot)
	}
}

// incRef counts one more occurrence of h, held by b, on b's slot; it
// reports whether the slot did not hold h before, in which case the slot
// joins h's holders. It keeps the slot's discount: h held alone by b now
// takes b's discount; h held alone by another booking until now stops
// taking that one's.
func (st *seqState) incRef(h uint64, b *booking) bool {
	slot := b.slot
	rs := &st.slots[slot]
	e := rs.refs[h]
	switch e.n {
	case 0:
		if b.discount != 0 {
			rs.discount += int64(b.discount)
			st.setAlone(h, slot, b.discount)
		}
	case 1:
		if len(st.discounted) > 0 { // no map probe while nobody decays
			if o := st.discounted[e.ords]; o != nil {
				rs.discount -= int64(o.discount)
				st.setAlone(h, slot, 0)
			}
		}
	}
	rs.refs[h] = refEntry{n: e.n + 1, ords: e.ords + b.ord}
	if e.n > 0 {
		return false
	}
	if st.watch != nil {
		st.watch.setLive(rs.rank, h, true)
	}
	sl, ok := st.blocks[h]
	if !ok {
		st.blocks[h] = slotList{first: slot}
		return true
	}
	sl.rest = append(sl.rest, slot)
	st.blocks[h] = sl
	return true
}

// decRef counts one occurrence of h, held by b, less on b's slot; it
// reports whether the slot no longer holds h, in which case it leaves h's
// holders, and h's entry goes when nobody holds it. It keeps the slot's
// discount as incRef does.
func (st *seqState) decRef(h uint64, b *booking) bool {
	slot := b.slot
	rs := &st.slots[slot]
	e := rs.refs[h]
	if e.n > 1 {
		e.n--
		e.ords -= b.ord
		if e.n == 1 && len(st.discounted) > 0 {
			if o := st.discounted[e.ords]; o != nil {
				rs.discount += int64(o.discount)
				st.setAlone(h, slot, o.discount)
			}
		}
		rs.refs[h] = e
		return false
	}
	if e.n == 0 {
		return false // unreachable while the invariants hold
	}
	if b.discount != 0 {
		rs.discount -= int64(b.discount)
		st.setAlone(h, slot, 0)
	}
	delete(rs.refs, h)
	if st.watch != nil {
		st.watch.setLive(rs.rank, h, false)
	}
	sl := st.blocks[h]
	last := len(sl.rest) - 1
	if sl.first == slot {
		if last < 0 {
			delete(st.blocks, h)
			return true
		}
		sl.first = sl.rest[last]
	} else {
		i := slices.Index(sl.rest, slot)
		if i < 0 {
			return true // unreachable while the invariants hold
		}
		sl.rest[i] = sl.rest[last]
	}
	sl.rest = sl.rest[:last] // keeps its array: a shared block's holders come and go
	st.blocks[h] = sl
	return true
}

// slotFor returns rank's slot, giving it one (and a place in order) when it
// has none.
func (st *seqState) slotFor(rank kvevent.Rank) int32 {
	if sl, ok := st.slotOf[rank]; ok {
		return sl
	}
	var sl int32
	if n := len(st.freeSlots); n > 0 {
		// A released slot keeps its (empty) refs map for the next rank.
		sl = st.freeSlots[n-1]
		st.freeSlots = st.freeSlots[:n-1]
		st.slots[sl].rank = rank
	} else {
		sl = int32(len(st.slots))
		st.slots = append(st.slots, rankSlot{rank: rank, refs: make(map[uint64]refEntry)})
	}
	st.slotOf[rank] = sl
	i, _ := slices.BinarySearchFunc(st.order, rank, func(s int32, r kvevent.Rank) int { return st.slots[s].rank.Compare(r) })
	st.order = slices.Insert(st.order, i, sl)
	return sl
}

func (st *seqState) releaseSlot(sl int32) {
	rank := st.slots[sl].rank
	i, found := slices.BinarySearchFunc(st.order, rank, func(s int32, r kvevent.Rank) int { return st.slots[s].rank.Compare(r) })
	if found {
		st.order = slices.Delete(st.order, i, i+1)
	}
	delete(st.slotOf, rank)
	st.slots[sl].rank, st.slots[sl].load, st.slots[sl].discount = kvevent.Rank{}, Load{}, 0
	st.freeSlots = append(st.freeSlots, sl)
}

// The expiry heap is a plain binary min-heap on (createdAt, id); ids are
// unique, so the order is total and every replica pops the same sequence.

func expiryLess(a, b *booking) bool {
	if a.createdAt != b.createdAt {
		return a.createdAt < b.createdAt
	}
	return a.id < b.id
}

func (st *seqState) pushExpiry(b *booking) {
	h := append(st.expiry, b)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !expiryLess(h[i], h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	st.expiry = h
}

func (st *seqState) popExpiry() *booking {
	h := st.expiry
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h[n] = nil
	h = h[:n]
	for i := 0; ; {
		l, small := 2*i+1, i
		if l < n && expiryLess(h[l], h[small]) {
			small = l
		}
		if r := l + 1; r < n && expiryLess(h[r], h[small]) {
			small = r
		}
		if small == i {
			break
		}
		h[i], h[small] = h[small], h[i]
		i = small
	}
	st.expiry = h
	return top
}

// Digest hashes. A live booking's entry hash is the XXH3 of its fixed fields,
// remixed when its prefill is done; a tombstone's covers its id and time.
// The tags keep a booking and a tombstone of the same id apart.

const prefillDoneSalt = 0x2545f4914f6cdd1d

func (b *booking) entryHash() uint64 {
	if b.prefillDone {
		return mix64(b.hash ^ prefillDoneSalt)
	}
	return b.hash
}

func (st *seqState) bookingHash(b *booking) uint64 {
	buf := append(st.buf[:0], 'B')
	buf = binary.LittleEndian.AppendUint64(buf, uint64(len(b.id)))
	buf = append(buf, b.id...)
	buf = binary.LittleEndian.AppendUint64(buf, b.rank.Worker)
	buf = binary.LittleEndian.AppendUint32(buf, b.rank.DP)
	buf = binary.LittleEndian.AppendUint64(buf, uint64(b.isl))
	buf = binary.LittleEndian.AppendUint64(buf, uint64(b.cached))
	buf = binary.LittleEndian.AppendUint64(buf, uint64(b.createdAt))
	buf = binary.LittleEndian.AppendUint64(buf, uint64(len(b.seq)))
	st.hashed += uint64(len(b.seq))
	for _, h := range b.seq {
		buf = binary.LittleEndian.AppendUint64(buf, h)
	}
	if b.discount != 0 { // absent when 0, so older digests stay as they were
		buf = append(buf, 'D')
		buf = binary.LittleEndian.AppendUint32(buf, b.discount)
	}
	st.buf = buf
	return xxh3.Hash(buf)
}

func (st *seqState) tombHash(b *booking) uint64 {
	buf := append(st.buf[:0], 'F')
	buf = binary.LittleEndian.AppendUint64(buf, uint64(len(b.id)))
	buf = append(buf, b.id...)
	buf = binary.LittleEndian.AppendUint64(buf, uint64(b.createdAt))
	st.buf = buf
	return xxh3.Hash(buf)
}

// hashSet is a small open-addressing set of uint64 for deduplicating one
// request's hashes without allocating: a slot is in use when its generation
// is the current one, so reset is O(1) instead of clearing the table.
type hashSet struct {
	keys []uint64
	gens []uint32
	gen  uint32
	mask uint64
}

// reset empties the set and makes room for n keys at load factor <= 1/2.
func (s *hashSet) reset(n int) {
	size := 16
	for size < 2*n {
		size *= 2
	}
	if len(s.keys) < size {
		s.keys = make([]uint64, size)
		s.gens = make([]uint32, size)
		s.gen = 0
	}
	s.mask = uint64(len(s.keys) - 1)
	s.gen++
	if s.gen == 0 { // wrapped: old generations could look current
		clear(s.gens)
		s.gen = 1
	}
}

// insert adds k and reports whether it was absent.
func (s *hashSet) insert(k uint64) bool {
	i := (k * 0x9e3779b97f4a7c15) >> 32 & s.mask
	for {
		if s.gens[i] != s.gen {
			s.gens[i], s.keys[i] = s.gen, k
			return true
		}
		if s.keys[i] == k {
			return false
		}
		i = (i + 1) & s.mask
	}
}

// A SeqJournal is told of every change to the tracker's logical state, so
// that a durable copy can follow it (the cluster writes each change into
// the Pebble batch of its state database's open group). Calls happen under the
// tracker's write lock, but for FlushJournal's Booked calls, made under its
// read lock (no mutation runs meanwhile, queries do); calls never overlap,
// and an implementation must not call back into the tracker.
type SeqJournal interface {
	// Booked: a live booking was added or changed (prefill done, an output
	// block, a discount). Reported at the next FlushJournal, once for all
	// its changes since the last one, and only if it is live then.
	Booked(b Booking)
	// Freed: a booking was freed and is now a tombstone.
	Freed(f FreedBooking)
	// Gone: a live booking expired or a tombstone was swept; id is forgotten.
	Gone(id string)
	// Clock: the sweeps' clock moved to c (and a sweep has run).
	Clock(c int64)
}

// SetJournal attaches j (nil detaches). Changes before the call are not
// reported, nor those made before it and not yet flushed (FlushJournal).
func (s *Sequences) SetJournal(j SeqJournal) {
	s.mu.Lock()
	s.st.journal = j
	s.st.dropUnjournaled()
	s.mu.Unlock()
}

// journalBooked notes that live booking b was added or changed, for the
// next FlushJournal to report; a booking changed many times between two
// flushes (one output block an entry) is reported once.
func (st *seqState) journalBooked(b *booking) {
	if st.journal == nil {
		return
	}
	if b.unjournaled {
		st.unjournaledBytes += 8 // an output block's hash, at most
		return
	}
	b.unjournaled = true
	st.unjournaled = append(st.unjournaled, b)
	st.unjournaledBytes += unjournaledRecordBytes + len(b.id) + 8*len(b.seq)
}

// unjournaledRecordBytes estimates a booking record's bytes besides its id
// and sequence hashes (rank, counts, times, the key's framing).
const unjournaledRecordBytes = 64

// UnjournaledBytes estimates the bytes the next FlushJournal writes: the
// records of the bookings added or changed since the last one. A durable
// copy that commits in groups of a size counts them (the cluster's group
// commit): bookings alone, written only at the flush, would otherwise never
// fill a group.
func (s *Sequences) UnjournaledBytes() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st.unjournaledBytes
}

// FlushJournal reports to the journal (Booked) each booking added or
// changed since the last call, once, as it stands now. A booking freed
// (its tombstone), expired or swept since is not reported: Freed or Gone
// told the journal already, and what it wrote stands. The other changes
// (Freed, Gone, Clock) are reported as they happen.
//
// A durable copy that records the state as of some point must flush
// first: until then it lacks those bookings' latest changes (the cluster
// flushes before each commit of its state database's group and before it
// lays the open group under a read view).
//
// It holds the read lock and lazyMu, not the write lock: queries go on
// while it reports, and mutations wait, so that each booking is reported
// as it stands and the journal is called by no one else meanwhile. A flush
// writes up to a group of bookings (16 MB of records, 3 ms for 4 MB on
// one core in raftfsm's BenchmarkFlushOfBookings, ten times that when it
// allocated a record per booking), and under the write lock every route
// waited that long. A Holds that must build a booking's set waits like a
// mutation, and the queries that come after it wait too (sync.RWMutex
// holds new readers behind a waiting writer).
func (s *Sequences) FlushJournal() {
	s.lazyMu.Lock()
	defer s.lazyMu.Unlock()
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := &s.st
	for _, b := range st.unjournaled {
		// A freed booking stays in byID as its tombstone; an expired one
		// may have been booked again since, as another booking.
		if st.journal != nil && !b.freed && st.byID[b.id] == b {
			st.journal.Booked(b.export())
		}
	}
	st.dropUnjournaled()
}

// dropUnjournaled empties the list of bookings to report, keeping its
// capacity.
func (st *seqState) dropUnjournaled() {
	for i, b := range st.unjournaled {
		b.unjournaled = false
		st.unjournaled[i] = nil
	}
	st.unjournaled = st.unjournaled[:0]
	st.unjournaledBytes = 0
}

func (b *booking) export() Booking {
	return Booking{ID: b.id, Rank: b.rank, SeqHashes: b.seq, ISL: b.isl, CachedTokens: b.cached,
		PrefillDone: b.prefillDone, CreatedAt: b.createdAt, Discount: b.discount}
}
