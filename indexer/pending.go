// pending.go is the load of bookings decided and proposed but not yet
// applied: what lets a node "apply its own bookings optimistically and
// reconcile when the entry commits" (semantics.md §6). A leader deciding
// booked routes from the committed load alone would send every route that
// arrives before the first booking commits to the same rank, and admit them
// all past the busy thresholds.
//
// The pending bookings add to a rank what Sequences.Add would add if they
// applied now: one request each, max(isl-cached, 0) prefill tokens each,
// and one decode block for each distinct hash that some pending booking of
// the rank has and the rank's live bookings do not hold. "Now" matters:
// the live bookings change while a booking is pending (another applies,
// is freed, expires, its rank leaves), and a block counted by the pending
// list when it was added would be counted twice once a live booking came
// to hold it, or never once the live booking holding it went. So each
// (hash, rank) a pending booking has is a hold that knows whether the
// rank's live bookings hold the hash, and the Sequences the Pending watches
// tells it when that changes (seqState.incRef and decRef call setLive; a
// Restore calls relive). Decay is left out: a block that a decaying
// booking (SetDecay) alone holds counts in the committed load at its
// weight, and a pending booking sharing it adds nothing, though once
// applied it makes the block count whole; a rank whose requests decay
// looks up to those blocks' discount lighter to the decisions made while
// such a booking is pending.
//
// Invariants:
//   - byID holds each request id at most once; a rank has an entry in ranks
//     exactly while it has a pending booking, and its load is the sum of
//     its pending bookings' requests and prefill tokens, with
//     Load.ActiveDecodeBlocks the number of its holds whose hash its live
//     bookings do not hold.
//   - holders[h] lists, once each, the ranks with a pending booking whose
//     blocks have h, each with the number (> 0) of such bookings and
//     whether the rank's live bookings in the watched Sequences hold h.
//   - It reads no clock and is not safe for concurrent use: its owner
//     orders the calls (the decision and the apply of a booking). The
//     Sequences it watches calls into it from every mutation, so the owner
//     must also hold its lock around every mutation of that Sequences.
//   - Empty, it keeps little of a burst's memory (a leader's list is empty
//     most of the time): at most pendingSpare spare bookings, and its maps
//     made anew once they held more than pendingKeep entries.

package indexer

import (
	"slices"

	"github.com/kvrouter/kvrouter/kvevent"
)

// What an empty Pending keeps of a burst (Go maps never shrink).
const (
	pendingSpare       = 16      // spare bookings, for the next Adds
	pendingSpareBlocks = 1 << 12 // hashes a spare booking, or Add's scratch, has room for
	pendingKeep        = 1 << 12 // entries the maps held, past which they are made anew
)

// Pending holds bookings that are decided but not yet applied to the
// Sequences they will go to. The zero value is not ready; use NewPending.
type Pending struct {
	s       *Sequences
	byID    map[string]*pendingBooking
	ranks   map[kvevent.Rank]*pendingRank
	holders map[uint64]pendingHolders
	peak    int // the most entries byID or holders held since made
	set     hashSet
	ticket  uint64
	spare   []*pendingBooking // removed bookings, for the next Add
	news    []uint64          // Add's scratch: the booking's distinct hashes
	held    []bool            // Add's scratch: whether the rank's live bookings hold each
}

type pendingRank struct {
	rank kvevent.Rank
	load Load
	hits int64 // AddTo's scratch
}

type pendingBooking struct {
	id      string
	ticket  uint64
	rank    *pendingRank
	prefill int64
	blocks  []uint64 // its distinct hashes
}

// pendingHolders lists the ranks that hold one hash through a pending
// booking; most hashes have one, which lives inline.
type pendingHolders struct {
	first pendingHold
	rest  []pendingHold
}

// pendingHold is a rank holding a hash, how many of its pending bookings
// do, and whether its live bookings do too (the block is then counted in
// the committed load, not here).
type pendingHold struct {
	rank *pendingRank
	n    int
	live bool
}

// NewPending returns an empty Pending of the bookings that s has not
// applied yet, and makes it watch s: from now on every mutation of s must
// be made under the lock that orders the Pending's calls. s watches one
// Pending at most; a later NewPending of s replaces the earlier one.
func NewPending(s *Sequences) *Pending {
	p := &Pending{
		s:       s,
		byID:    make(map[string]*pendingBooking),
		ranks:   make(map[kvevent.Rank]*pendingRank),
		holders: make(map[uint64]pendingHolders),
	}
	s.mu.Lock()
	s.st.watch = p
	s.mu.Unlock()
	return p
}

// Len returns the number of pending bookings.
func (p *Pending) Len() int { return len(p.byID) }

// RankOf returns the rank request id is pending on; false when it is not.
func (p *Pending) RankOf(id string) (kvevent.Rank, bool) {
	if b, ok := p.byID[id]; ok {
		return b.rank.rank, true
	}
	return kvevent.Rank{}, false
}

// Add records the booking of request id on rank, which the watched
// Sequences has not applied yet, and returns a ticket for Drop. It records
// nothing and returns 0 when id is pending already or known to the
// Sequences (live, or freed and not swept): its apply will add nothing,
// so it must not count twice. isl and cachedTokens are as for
// Sequences.Add.
func (p *Pending) Add(id string, rank kvevent.Rank, seqHashes []uint64, isl, cachedTokens int) uint64 {
	if _, ok := p.byID[id]; ok {
		return 0
	}
	news, held, known := p.s.distinctHeld(p.news[:0], p.held[:0], id, rank, seqHashes, &p.set)
	p.news, p.held = news[:0], held[:0]
	if known {
		return 0
	}
	pr := p.ranks[rank]
	if pr == nil {
		pr = &pendingRank{rank: rank}
		p.ranks[rank] = pr
	}
	var b *pendingBooking
	if n := len(p.spare); n > 0 {
		b, p.spare = p.spare[n-1], p.spare[:n-1]
	} else {
		b = new(pendingBooking)
	}
	p.ticket++
	*b = pendingBooking{id: id, ticket: p.ticket, rank: pr, prefill: max(int64(isl)-int64(cachedTokens), 0), blocks: b.blocks[:0]}
	for i, h := range news {
		b.blocks = append(b.blocks, h)
		hd := pendingHold{rank: pr, n: 1, live: held[i]}
		hs, ok := p.holders[h]
		switch {
		case !ok:
			p.holders[h] = pendingHolders{first: hd}
		case hs.first.rank == pr:
			hs.first.n++ // another pending booking of this rank has it
			p.holders[h] = hs
			continue
		default:
			if j := slices.IndexFunc(hs.rest, func(hd pendingHold) bool { return hd.rank == pr }); j >= 0 {
				hs.rest[j].n++
				continue
			}
			hs.rest = append(hs.rest, hd)
			p.holders[h] = hs
		}
		if !hd.live {
			pr.load.ActiveDecodeBlocks++
		}
	}
	pr.load.ActivePrefillTokens += b.prefill
	pr.load.ActiveRequests++
	p.byID[id] = b
	p.peak = max(p.peak, len(p.byID), len(p.holders))
	return b.ticket
}

// Settle removes id's pending booking, whichever Add recorded it: its
// entry applied (Sequences now counts it, or refused it).
func (p *Pending) Settle(id string) {
	if b, ok := p.byID[id]; ok {
		p.remove(b)
	}
}

// Drop removes id's pending booking if it is the one Add returned ticket
// for: the caller that added it gave up on it, and must not remove a
// later Add's.
func (p *Pending) Drop(id string, ticket uint64) {
	if b, ok := p.byID[id]; ok && b.ticket == ticket {
		p.remove(b)
	}
}

// Clear removes every pending booking, and lets go of what they grew.
func (p *Pending) Clear() {
	for _, b := range p.byID {
		p.remove(b)
	}
	p.shrink()
}

func (p *Pending) remove(b *pendingBooking) {
	pr := b.rank
	for _, h := range b.blocks {
		hs := p.holders[h]
		var gone pendingHold // the rank's hold of h, when its last booking went
		switch {
		case hs.first.rank == pr && hs.first.n > 1:
			hs.first.n-- // another pending booking of the rank holds it
		case hs.first.rank == pr && len(hs.rest) == 0:
			delete(p.holders, h)
			if !hs.first.live {
				pr.load.ActiveDecodeBlocks--
			}
			continue
		case hs.first.rank == pr:
			gone = hs.first
			hs.first = hs.rest[len(hs.rest)-1]
			hs.rest = hs.rest[:len(hs.rest)-1]
		default:
			i := slices.IndexFunc(hs.rest, func(hd pendingHold) bool { return hd.rank == pr })
			if i < 0 {
				continue
			}
			if hs.rest[i].n--; hs.rest[i].n > 0 {
				continue
			}
			gone = hs.rest[i]
			hs.rest[i] = hs.rest[len(hs.rest)-1]
			hs.rest = hs.rest[:len(hs.rest)-1]
		}
		if gone.rank != nil && !gone.live {
			pr.load.ActiveDecodeBlocks--
		}
		p.holders[h] = hs
	}
	pr.load.ActivePrefillTokens -= b.prefill
	pr.load.ActiveRequests--
	if pr.load.ActiveRequests == 0 {
		delete(p.ranks, pr.rank)
	}
	delete(p.byID, b.id)
	if len(p.spare) < pendingSpare && cap(b.blocks) <= pendingSpareBlocks {
		*b = pendingBooking{blocks: b.blocks[:0]}
		p.spare = append(p.spare, b)
	}
	if len(p.byID) == 0 {
		p.shrink()
	}
}

// shrink lets go, once nothing is pending, of what a burst grew: maps
// that held more than pendingKeep entries, and large scratch.
func (p *Pending) shrink() {
	if p.peak > pendingKeep {
		p.byID = make(map[string]*pendingBooking)
		p.ranks = make(map[kvevent.Rank]*pendingRank)
		p.holders = make(map[uint64]pendingHolders)
		p.peak = 0
	}
	if cap(p.news) > pendingSpareBlocks {
		p.news, p.held = nil, nil
	}
	if len(p.set.keys) > 2*pendingSpareBlocks {
		p.set = hashSet{}
	}
}

// AddTo adds the pending load to the candidates, which are in rank order
// and hold the committed load (Sequences.PotentialDecodeBlocks) for a
// request with the given sequence hashes: each candidate's Load grows by
// its rank's pending bookings', and its PotentialDecodeBlocks by the
// blocks they add less those of the request among them (the committed
// figure counted those as the request's own). A rank that is not a
// candidate is left out. With nothing pending it does nothing.
func (p *Pending) AddTo(cands []Candidate, seqHashes []uint64) {
	if len(p.byID) == 0 {
		return
	}
	p.set.reset(len(seqHashes))
	for _, h := range seqHashes {
		if !p.set.insert(h) {
			continue
		}
		hs, ok := p.holders[h]
		if !ok {
			continue
		}
		if !hs.first.live {
			hs.first.rank.hits++
		}
		for _, hd := range hs.rest {
			if !hd.live {
				hd.rank.hits++
			}
		}
	}
	for r, pr := range p.ranks {
		hits := pr.hits
		pr.hits = 0
		i, ok := slices.BinarySearchFunc(cands, r, func(c Candidate, r kvevent.Rank) int { return c.Rank.Compare(r) })
		if !ok {
			continue
		}
		c := &cands[i]
		c.Load.ActivePrefillTokens += pr.load.ActivePrefillTokens
		c.Load.ActiveDecodeBlocks += pr.load.ActiveDecodeBlocks
		c.Load.ActiveRequests += pr.load.ActiveRequests
		c.PotentialDecodeBlocks += pr.load.ActiveDecodeBlocks - hits
	}
}

// setLive tells p that rank's live bookings now hold h (a Sequences
// mutation made the first of them hold it) or no longer do (the last one
// holding it went). The watched Sequences calls it under its write lock.
func (p *Pending) setLive(rank kvevent.Rank, h uint64, live bool) {
	if len(p.byID) == 0 {
		return
	}
	hs, ok := p.holders[h]
	if !ok {
		return
	}
	hd := &hs.first
	if hd.rank.rank != rank {
		i := slices.IndexFunc(hs.rest, func(hd pendingHold) bool { return hd.rank.rank == rank })
		if i < 0 {
			return
		}
		hd = &hs.rest[i]
	}
	if hd.live == live {
		return // unreachable while the invariants hold
	}
	hd.live = live
	if live {
		hd.rank.load.ActiveDecodeBlocks--
	} else {
		hd.rank.load.ActiveDecodeBlocks++
	}
	p.holders[h] = hs
}

// relive sets every hold's live flag, and the ranks' decode blocks, from
// st: the watched Sequences' whole state was replaced by it (Restore),
// under its write lock.
func (p *Pending) relive(st *seqState) {
	for h, hs := range p.holders {
		p.relive1(st, h, &hs.first)
		for i := range hs.rest {
			p.relive1(st, h, &hs.rest[i])
		}
		p.holders[h] = hs
	}
}

func (p *Pending) relive1(st *seqState, h uint64, hd *pendingHold) {
	live := false
	if sl, ok := st.slotOf[hd.rank.rank]; ok {
		live = st.slots[sl].refs[h].n > 0
	}
	switch {
	case live && !hd.live:
		hd.rank.load.ActiveDecodeBlocks--
	case !live && hd.live:
		hd.rank.load.ActiveDecodeBlocks++
	}
	hd.live = live
}

// distinctHeld appends to dst the distinct hashes of seqHashes, and to
// held whether rank's live bookings hold each, and returns them; known is
// true, and dst and held left as they were, when id is live or a
// tombstone (an Add of it would book nothing).
func (s *Sequences) distinctHeld(dst []uint64, held []bool, id string, rank kvevent.Rank, seqHashes []uint64, set *hashSet) (_ []uint64, _ []bool, known bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	st := &s.st
	if _, ok := st.byID[id]; ok {
		return dst, held, true
	}
	var refs map[uint64]refEntry
	if sl, ok := st.slotOf[rank]; ok {
		refs = st.slots[sl].refs
	}
	set.reset(len(seqHashes))
	for _, h := range seqHashes {
		if set.insert(h) {
			dst = append(dst, h)
			held = append(held, refs[h].n > 0)
		}
	}
	return dst, held, false
}
